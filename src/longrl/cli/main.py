"""Command line: ``longrl init [--model M] [--task T]``, ``longrl train CONFIG.yaml [KEY=VALUE ...]``, ``longrl sft``,
``longrl demo [KEY=VALUE ...]``, ``longrl plan``, ``longrl generate``, ``longrl eval`` and ``longrl export OUTPUT_DIR
--from CHECKPOINT --format adapter|merged|gguf``: the parser and the dispatch to one module per command (train.py,
plan.py, demo.py, inference.py, export.py), and the exit code of each error longrl explains itself.

Heavy modules (torch, transformers) load inside the commands, so ``longrl --help`` and ``--version`` stay fast."""

from __future__ import annotations

import argparse
import logging
import math
import re
import sys

from ..config import ConfigError, load_config
from .exit_codes import EXIT_BAD_INPUT


OVERRIDE = re.compile(r"[A-Za-z_][\w.\[\]-]*=")  # a dotted key, then =


def _parser() -> argparse.ArgumentParser:
    from .. import __version__

    p = argparse.ArgumentParser(prog="longrl", description="GRPO-family RL fine-tuning for long reasoning traces")
    p.add_argument("--version", action="version", version=f"longrl {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    init = sub.add_parser("init", help="print a commented starting config for a real model: longrl init > run.yaml")
    init.add_argument("--model", default=None, metavar="ID_OR_DIR",
                      help="hub id or local model directory (default: Qwen/Qwen2.5-1.5B-Instruct)")
    init.add_argument("--task", choices=("math", "code", "custom", "vision"), default=None,
                      help="math (default): a built-in answer reward on an `answer` column; code, custom: your "
                           "rewards.py; vision: prompts with images, a vision-language model (default "
                           "Qwen/Qwen2.5-VL-3B-Instruct)")
    init.add_argument("--sft", action="store_true", help="a config for `longrl sft` (supervised fine-tuning)")
    train = sub.add_parser("train", help="train from a YAML config")
    train.add_argument("config", help="YAML config file (see `longrl demo --print-config`)")
    train.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. train.max_steps=10")
    train.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                       help="data-parallel on N processes of this machine (one per GPU): starts torchrun for you; "
                            "for several machines run torchrun yourself (docs/distributed.md)")
    plan = sub.add_parser("plan", help="print the memory plan of a config and its predicted peaks; exit 1 if it cannot fit")
    plan.add_argument("config")
    plan.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    plan.add_argument("--gpu-memory-gib", type=float, default=None,
                      help="GPU memory to plan for (default: free memory of the current CUDA device)")
    plan.add_argument("--sft", action="store_true", help="plan a supervised step (`longrl sft` configs)")
    plan.add_argument("--nproc-per-node", type=int, default=1, metavar="N",
                      help="plan one GPU of a data-parallel job on N GPUs (full weights sharded by FSDP2, LoRA and "
                           "4-bit bases replicated)")
    export = sub.add_parser("export", help="export a checkpoint: PEFT adapter, merged 16-bit model, or GGUF + Modelfile")
    export.add_argument("output_dir", help="directory to create (refused if non-empty, unless a previous export "
                        "and --overwrite; never a training run's directory or one inside it)")
    export.add_argument("--from", dest="checkpoint", required=True, metavar="CHECKPOINT",
                        help="a checkpoint-STEP directory, or a run's output directory (its latest checkpoint)")
    export.add_argument("--format", choices=("adapter", "merged", "gguf"), required=True)
    export.add_argument("--quant", choices=("f16", "q8_0"), default="f16", help="GGUF tensor type (gguf only)")
    export.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "float32"), default="auto",
                        help="merged weights (merged only; auto: float16 if the base was, else bfloat16)")
    export.add_argument("--overwrite", action="store_true",
                        help="replace a previous export in OUTPUT_DIR (never a run, a checkpoint or other files)")
    export.add_argument("--trust-remote-code", action="store_true",
                        help="allow a base model that needs its own Python code (never taken from the checkpoint)")
    _add_generate_and_eval(sub)
    demo = sub.add_parser("demo", help="offline demo: a tiny model learns arithmetic by GRPO on the CPU")
    demo.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    demo.add_argument("--print-config", action="store_true", help="print the demo's full YAML config and exit")
    demo.add_argument("--task", choices=("arithmetic", "tools", "vision"), default="arithmetic",
                      help="arithmetic: one-turn sums; tools: two turns, a lookup tool the answer needs; vision: a "
                           "tiny vision-language model names the colour of a shape in a picture")
    demo.add_argument("--sft", action="store_true",
                      help="warm start: supervised fine-tuning on correct answers first, then GRPO from it")
    sft = sub.add_parser("sft", help="supervised fine-tuning from a YAML config (conversations, prompt/completion "
                                     "pairs or plain text)")
    sft.add_argument("config", help="YAML config file (the sft: section and data.source)")
    sft.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    sft.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                     help="data-parallel on N processes of this machine (one per GPU): starts torchrun for you")
    return p


def _number(kind, allowed: str, ok):
    """An argparse type: ``kind(text)`` that ``ok`` accepts, else an error naming what is allowed (argparse
    prefixes the argument's name and exits 2)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {allowed}; got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {allowed}; got {text!r}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its own messages
    return parse


POSITIVE = _number(int, "an integer >= 1", lambda v: v >= 1)
TEMPERATURE = _number(float, "a finite number >= 0 (0: greedy)", lambda v: math.isfinite(v) and v >= 0)
FINITE = _number(float, "a finite number", math.isfinite)


def _non_empty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a non-empty prompt")
    return text


def _json_file(text: str) -> str:
    """A file to write: not a directory, in a directory that exists (checked before anything is evaluated)."""
    from pathlib import Path

    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give the JSON file to write, e.g. {path / 'eval.json'}")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"the folder of {text} does not exist")
    return text


MODEL_HELP = ("a run's output directory (its latest checkpoint), a checkpoint-STEP directory, a model directory, a "
              "hub id or a .gguf file")


def _add_generate_and_eval(sub) -> None:
    gen = sub.add_parser("generate", help="sample completions from a run or any model (printed as each prompt's finish)")
    gen.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                     help="generation.* overrides (and model.* for a model that is not a run)")
    gen.add_argument("--from", dest="checkpoint", required=True, metavar="RUN_OR_MODEL", help=MODEL_HELP)
    gen.add_argument("--prompt", type=_non_empty, help="one prompt (a user message when the run trained on chat "
                     "prompts, or a model with a chat template)")
    gen.add_argument("--image", action="append", default=[], metavar="PATH",
                     help="an image for --prompt (repeat for several, in order); needs a vision-language model")
    gen.add_argument("--data", metavar="FILE", help="prompts from a dataset file (.jsonl/.json/.parquet/.csv; its "
                     "image or images column for a vision-language model)")
    gen.add_argument("--prompt-column", default=None, help="column of --data holding the prompt (default: the run's)")
    gen.add_argument("--limit", type=_number(int, "an integer >= 0 (0: all)", lambda v: v >= 0), default=0,
                     help="first N prompts of --data (default: all)")
    gen.add_argument("--n", type=POSITIVE, default=1, help="completions per prompt")
    gen.add_argument("--max-new-tokens", type=POSITIVE, default=None,
                     help="default: the run's max_completion_length")
    gen.add_argument("--temperature", type=TEMPERATURE, default=None, help="default: the run's; 0: greedy")
    gen.add_argument("--chat", choices=("auto", "yes", "no"), default="auto",
                     help="a --prompt string through the chat template (auto: if the run trained on chat prompts)")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--device", default=None, help="default: auto (model.device)")
    gen.add_argument("--jsonl", action="store_true", help="one JSON object per completion instead of text")
    ev = sub.add_parser("eval", help="mean reward and pass@k per reward function of a run or any model on held-out "
                                     "prompts")
    ev.add_argument("config", help="a YAML config (reward functions, generation settings, data.eval_source)")
    ev.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    ev.add_argument("--from", dest="checkpoint", required=True, metavar="RUN_OR_MODEL",
                    help=MODEL_HELP + " (a model loads with the config's model.* settings)")
    ev.add_argument("--data", metavar="FILE", help="held-out prompts (default: data.eval_source)")
    ev.add_argument("--n", type=POSITIVE, default=None, help="samples per prompt, the n of pass@k "
                    "(default: output.eval_num_generations)")
    ev.add_argument("--pass-threshold", type=FINITE, default=None,
                    help="a sample passes a reward function when it scores >= this (default: output.eval_pass_threshold)")
    ev.add_argument("--samples", type=_number(int, "an integer >= 0", lambda v: v >= 0), default=0,
                    help="also print this many scored completions")
    ev.add_argument("--output", type=_json_file, metavar="FILE.json", help="also write the metrics to this JSON file")
    ev.add_argument("--seed", type=int, default=7_919)
    ev.add_argument("--device", default=None, help="default: model.device of the config")


def _log_setup() -> None:
    """INFO on rank 0 (and in one process); WARNING and above, prefixed with the rank, on the others."""
    import os

    rank = int(os.environ.get("RANK", "0"))
    prefix = f"[rank {rank}] " if "RANK" in os.environ and os.environ.get("WORLD_SIZE", "1") != "1" else ""
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"{prefix}%(levelname)s %(name)s: %(message)s")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    # KEY=VALUE overrides anywhere: those after an option reach here (longrl eval run.yaml --from RUN --n 1 K=V)
    overrides = [x for x in extra if OVERRIDE.match(x)]
    unknown = [x for x in extra if not OVERRIDE.match(x)]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if overrides:
        if not hasattr(args, "overrides"):
            parser.error(f"`longrl {args.command}` takes no KEY=VALUE overrides: {' '.join(overrides)}")
        args.overrides += overrides
    if args.command in ("train", "sft") and args.nproc_per_node is not None:
        from .train import torchrun

        return torchrun(args)
    _log_setup()
    for noisy in ("httpx", "urllib3", "huggingface_hub", "datasets"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.command == "export":
        from .export import export_command

        return export_command(args)
    if args.command == "init":
        from ..config.starter import render, render_sft

        if args.sft and args.task:
            parser.error("--task chooses GRPO's rewards; `longrl init --sft` takes only --model")
        sys.stdout.write(render_sft(args.model) if args.sft else render(args.model, args.task or "math"))
        return 0
    try:
        if args.command in ("generate", "eval"):
            return _inference(args)
        if args.command == "demo":
            from ..config.demo import demo_config

            cfg = load_config(None, args.overrides, base=demo_config(args.task))
            if args.print_config:
                sys.stdout.write(cfg.to_yaml())
                return 0
            from .demo import demo_command

            return demo_command(cfg, warm_start=args.sft)
        if args.command == "sft":
            from .train import run_sft

            history = run_sft(load_config(args.config, args.overrides, recipe="sft"))
            last = history[-1] if history else {}
            print(f"sft: {len(history)} steps, last loss {last.get('loss', float('nan')):.4f}"
                  + (f", held-out loss {last['eval/loss']:.4f}" if "eval/loss" in last else ""))
            return 0
        sft_plan = args.command == "plan" and args.sft
        cfg = load_config(args.config, args.overrides, recipe="sft" if sft_plan else "grpo")
        if args.command == "plan":
            from .plan import plan_command

            return plan_command(cfg, args.gpu_memory_gib, args.nproc_per_node, sft=sft_plan)
        from .train import run_grpo

        run_grpo(cfg)
        return 0
    except ConfigError as e:
        print(f"longrl: configuration error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:  # before training started (the loop turns signals into TrainingStopped)
        print("longrl: interrupted before training started; no checkpoint was written", file=sys.stderr)
        return 130
    except Exception as e:
        from ..memory.planner import PlanError

        if isinstance(e, PlanError):
            print(f"longrl: this job cannot fit: {e}", file=sys.stderr)
            return 1
        code = _exit_code(e)
        if code is None:
            raise
        print(f"longrl: {e}" if _is_stop(e) else f"longrl: error: {e}", file=sys.stderr)
        return code
    except BaseException as e:
        from ..training.signals import ImmediateStop

        if not isinstance(e, ImmediateStop):
            raise
        print(f"longrl: {e}: no checkpoint written for the step in flight; the checkpoints written before are "
              "intact (resume with output.resume=true)", file=sys.stderr)
        return e.exit_code



def _is_stop(e: Exception) -> bool:
    from ..training.signals import TrainingStopped

    return isinstance(e, TrainingStopped)


def _exit_code(e: Exception) -> int | None:
    """The exit code for an error longrl explains itself (None: a bug, shown with its traceback)."""
    from ..agents.rollout import EnvironmentResetError
    from ..data.prompts import DataError
    from ..models import ModelLoadError
    from ..models.gguf import GgufError
    from ..rewards import RewardLoadError
    from ..training.checkpoint import CheckpointError, CheckpointWriteError
    from ..training.guards import EXIT_SAVE_FAILED
    from ..training.run_lock import OutputDirError, RunLockError
    from ..training.signals import TrainingStopped

    if isinstance(e, TrainingStopped):
        return e.exit_code
    if isinstance(e, CheckpointWriteError):
        return EXIT_SAVE_FAILED
    if isinstance(e, (DataError, ModelLoadError, GgufError, RewardLoadError, CheckpointError, RunLockError,
                      OutputDirError, EnvironmentResetError)):
        return EXIT_BAD_INPUT
    return None


def _inference(args) -> int:
    from ..export import ExportError
    from .inference import InferenceError, eval_main, generate_main
    from .inference_images import ImageRequestError

    try:
        return generate_main(args) if args.command == "generate" else eval_main(args)
    except (InferenceError, ImageRequestError, ExportError) as e:
        print(f"longrl: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
