"""Whole GRPO steps on 1, 2, 4, 8 GPUs: data-parallel LoRA, a 4-bit base (QLoRA, replicated), full weights with FSDP2.

Each world size runs the trainer under torchrun (`torchrun --standalone --nproc-per-node N`), the distributed code
path; ``--with-single`` also runs the one-process path (no process group) at N = 1 in the same call, so the two can
be compared side by side. Random-weight models of real shapes in bf16, LoRA r=32 on every linear projection, G=8,
512-token prompts, completions of exactly --completion tokens (EOS ignored), --prompts-per-gpu prompts per GPU
(weak scaling: the global batch grows with N), offloaded checkpointing with the planner. Reported from the last of
--steps steps (the first captures CUDA graphs): step time, generated tokens/s per GPU (P·G·completion / step time
/ N; also the rollout alone), the phases, peak GPU memory (the largest rank's, and each rank's), and with
--collectives the time in collectives of one more, profiled step (NCCL or gloo kernels and ops).

    python benchmarks/grpo_scale.py --layouts lora,qlora,full --gpus 1,2,4,8               # on an 8-GPU machine
    python benchmarks/grpo_scale.py --layouts lora --gpus 1 --with-single --prompts-per-gpu 1 --completion 19968
    python benchmarks/grpo_scale.py --shape tiny --device cpu --gpus 1,2 --layouts lora,full --steps 2 --completion 16
    python benchmarks/grpo_scale.py --shape llama-3.1-70b --layouts qlora --gpus 1,8   # the 70B shape, 4-bit base

``--phases train,rollout`` measures the two halves of a step apart, through the trainer (the policy module it
trains through: DDP under torchrun, the model itself in one process), one model load per path:

  train    the training step alone on fixed completions (random tokens, seeded: the same on both paths) of
           --completion tokens: the reference pass (base with adapters off) + the policy update (forward/backward
           over the planner's micro-batches + optimizer step) — benchmarks/grpo_memory.py's figure, with the step
  rollout  the trainer's rollout (its sampler on the training weights) of --rollout-prompts prompts per GPU ×
           G × --rollout-completion tokens, beta 0 (no reference pass in it) — benchmarks/rollout_speed.py's figure

each warmed up once (Triton compiles, CUDA-graph captures) and then measured --reps times (the median reported):

    python benchmarks/grpo_scale.py --layouts lora --gpus 1 --with-single --phases train,rollout --prompts-per-gpu 1 \
        --completion 19968 --rollout-prompts 16 --rollout-completion 1024 --tag _ws1_phases
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from bench_setup import bench_lora, random_model, whitespace_tokenizer, write_grpo_inputs  # noqa: E402
from results_io import run_meta, write_result  # noqa: E402

GIB = 2 ** 30
LAYOUTS = ("lora", "qlora", "full")
COLLECTIVE_NAMES = ("nccl", "gloo", "all_reduce", "allreduce", "reduce_scatter", "all_gather", "broadcast")


# ----------------------------------------------------------------------------------------------- one rank
def _config(args, root: Path, data: Path | None, reward: Path | None, device: str):
    from longrl.config import Config, LoraConfig, RewardSpec, validate

    cfg = Config()
    cfg.model.device = device
    cfg.model.offload_activations = device != "cpu"
    cfg.model.load_in_4bit = args.layout == "qlora"
    cfg.model.no_recompute_layers = None if args.no_recompute < 0 else args.no_recompute
    cfg.lora = LoraConfig(enabled=args.layout != "full", r=32, alpha=64.0, dropout=0.0)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg.train.prompts_per_step, cfg.train.max_steps = args.prompts_per_gpu * world, args.steps
    cfg.train.learning_rate = 1e-5
    cfg.generation.max_completion_length, cfg.generation.ignore_eos = args.completion, True
    cfg.grpo.num_generations, cfg.grpo.loss_type = args.G, "dapo"
    cfg.grpo.beta = 0.04 if args.layout != "full" else 0.0  # the reference is the base with adapters off
    cfg.output.output_dir, cfg.output.progress_bar, cfg.output.tensorboard = str(root / "run"), False, False
    cfg.output.log_completions = 0
    if args.shape == "tiny":  # the builtin model and its task (CPU check)
        cfg.model.name_or_path, cfg.model.dtype = "builtin:tiny-arith", "float32"
        cfg.data.source = "task:arithmetic"
        cfg.rewards = [RewardSpec(function="longrl.tasks.arithmetic:answer_reward")]
    else:
        cfg.data.source, cfg.data.max_prompt_length, cfg.data.shuffle = str(data), args.prompt_len, False
        cfg.rewards = [RewardSpec(function=f"{reward}:random_reward")]
    validate(cfg)
    return cfg


def _random_model(args, device: str, root: Path):
    """The shape's random-weight model (the same on every rank: seeded), 4-bit and/or with LoRA per layout."""
    from longrl.models import apply_lora, calibration_ids, quantize_model

    torch.manual_seed(0)
    model = random_model(args.shape, device)
    tok = whitespace_tokenizer(model)
    if args.layout == "qlora":
        quantize_model(model, calibration_ids(vocab_size=model.config.vocab_size).to(device))
        torch.cuda.empty_cache()
    if args.layout != "full":
        model = apply_lora(model, bench_lora())
    return model, tok


def _collective_seconds(prof) -> float:
    """Seconds of collective kernels (CUDA) or collective ops (CPU) in a profile."""
    total_us = 0.0
    for event in prof.key_averages():
        if any(n in event.key.lower() for n in COLLECTIVE_NAMES):
            device_us = getattr(event, "self_device_time_total", 0) or getattr(event, "self_cuda_time_total", 0)
            total_us += device_us if device_us else event.self_cpu_time_total
    return total_us / 1e6


def _fixed_batch(trainer, prompts: int, G: int, prompt_len: int, completion: int):
    """This rank's share of a fabricated global batch of ``prompts`` prompts × G completions (random tokens and
    advantages, seeded: every path and world size cuts the same batch), as the trainer's RolloutBatch without its
    reference log-probs (the measured reference pass computes them)."""
    from longrl.training.distributed import rank_prompts
    from longrl.ops.losses import loss_token_weights
    from longrl.recipes.grpo import RolloutBatch

    vocab = trainer.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(3, vocab - 1, (prompts, prompt_len), generator=g)  # [P, prompt]
    completion_ids = torch.randint(3, vocab - 1, (prompts * G, completion), generator=g)  # [P·G, T]
    advantages = torch.randn(prompts * G, generator=g)  # [P·G]
    w = trainer.world
    rows = [p * G + k for p in rank_prompts(prompts, 1, w.rank, w.world_size) for k in range(G)]
    n = len(rows)
    mask = torch.ones(n, completion)  # [n, T]
    weights = loss_token_weights(mask, trainer.cfg.grpo.loss_type, completion, all_sum=w.all_sum)
    return RolloutBatch(prompts=[""] * n, completions=[""] * n,
                        prompt_ids=[prompt_ids[i // G].tolist() for i in rows],
                        completion_ids=[completion_ids[i].tolist() for i in rows], rewards=torch.zeros(n),
                        rewards_per_function=torch.zeros(n, 1), advantages=advantages[rows], mask=mask,
                        weights=weights, old_logps=None, ref_logps=None, sampler_logps=None,
                        truncated=torch.zeros(n, dtype=torch.bool), num_reward_failures=0)


def measure_phases(trainer, args) -> dict:
    """[warm-up + --reps] measurements of each of --phases: the training step alone on fixed completions, the
    rollout alone (see the module docstring). Seconds and peak GPU GiB come from the trainer's own phase timers."""
    out = {}
    world = trainer.world.world_size
    if "train" in args.phases:
        runs = []
        for _ in range(1 + args.reps):
            batch = _fixed_batch(trainer, args.prompts_per_gpu * world, args.G, args.prompt_len, args.completion)
            stats = trainer.train_on_batch(batch)  # the reference pass (beta ≠ 0), then the update
            st = trainer.phase_stats
            ref_s = st.get("reference_time_s", 0.0)
            runs.append(dict(reference_s=ref_s, update_s=st["update_time_s"], train_s=ref_s + st["update_time_s"],
                             peak_gib=max(st.get("reference_peak_gib", 0.0), st.get("update_peak_gib", 0.0)),
                             loss=stats["loss"], grad_norm=stats["grad_norm"]))
            print("train:", {k: round(v, 3) for k, v in runs[-1].items()}, flush=True)
        out["train"] = runs
    if "rollout" in args.phases:  # the trainer's rollout batch at the rollout shape (beta 0: no reference pass)
        cfg = trainer.cfg
        cfg.train.prompts_per_step = args.rollout_prompts * world
        cfg.generation.max_completion_length, cfg.grpo.beta = args.rollout_completion, 0.0
        runs = []
        for _ in range(1 + args.reps):
            b = trainer.generate_batch()
            st = trainer.phase_stats
            tokens = sum(len(c) for c in b.completion_ids)  # this rank's
            runs.append(dict(generation_s=st["generation_time_s"], peak_gib=st.get("generation_peak_gib", 0.0),
                             tokens=tokens, tokens_per_s=tokens / st["generation_time_s"]))
            print("rollout:", {k: round(v, 3) for k, v in runs[-1].items()}, flush=True)
        out["rollout"] = runs
    return out


def worker(args) -> None:
    """One rank (or the single process): train --steps steps (or measure --phases), rank 0 writes the result
    JSON."""
    from longrl.compat.trl import GRPOTrainer

    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = "cpu" if args.device == "cpu" else f"cuda:{local}"
    if device != "cpu":
        torch.cuda.set_device(device)
    root = Path(args.workdir) / f"{args.layout}-{'single' if args.single else 'dist'}-{os.environ.get('WORLD_SIZE', 1)}"
    root.mkdir(parents=True, exist_ok=True)
    model = tok = data = reward = None
    if args.shape != "tiny":
        model, tok = _random_model(args, device, root)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        per_gpu = max(args.prompts_per_gpu, args.rollout_prompts if args.phases else 0)
        data, reward = write_grpo_inputs(root, per_gpu * world * max(args.steps + 1, args.reps + 1, 2),
                                         args.prompt_len, model.config.vocab_size)
    cfg = _config(args, root, data, reward, device)
    trainer = GRPOTrainer(cfg, model=model, tokenizer=tok)
    trainer.save = lambda: None  # timing only: no checkpoint at the end
    if args.phases:
        phases = measure_phases(trainer, args)
        if rank == 0:
            m, plan = trainer.layout, trainer.layout.plan
            layout = dict(no_recompute_layers=m.no_recompute_layers, gpu_resident_layers=m.gpu_resident_layers,
                          predicted_train_gib=plan.predicted_gpu_bytes / GIB if plan else None)
            Path(args.result).write_text(json.dumps(dict(phases=phases, world_size=trainer.world.world_size,
                                                         distributed=trainer.world.distributed, layout=layout)))
        return
    start = time.perf_counter()
    history = trainer.train()
    wall = time.perf_counter() - start
    collectives = None
    if args.collectives and trainer.world.distributed:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device != "cpu" else [])
        trainer.cfg.train.max_steps += 1
        with profile(activities=activities) as prof:
            profiled = trainer.train()[-1]
        collectives = dict(seconds=_collective_seconds(prof), step_seconds=profiled["step_time_s"])
    if rank == 0:
        Path(args.result).write_text(json.dumps(dict(history=history, wall_seconds=wall, collectives=collectives,
                                                     world_size=trainer.world.world_size,
                                                     distributed=trainer.world.distributed), default=str))


# ----------------------------------------------------------------------------------------------- the table
def _run(args, layout: str, n: int, single: bool, workdir: Path) -> dict:
    result = workdir / f"{layout}-{'single' if single else n}.json"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in (("shape", args.shape), ("device", args.device),
                                                         ("prompts_per_gpu", args.prompts_per_gpu), ("G", args.G),
                                                         ("prompt_len", args.prompt_len),
                                                         ("completion", args.completion), ("steps", args.steps),
                                                         ("no_recompute", args.no_recompute))]
    flags += ["--worker", f"--layout={layout}", f"--result={result}", f"--workdir={workdir}"]
    if args.phases:
        flags += [f"--phases={args.phases}", f"--reps={args.reps}", f"--rollout-prompts={args.rollout_prompts}",
                  f"--rollout-completion={args.rollout_completion}"]
    flags += ["--single"] if single else []
    flags += ["--collectives"] if args.collectives and n > 1 else []
    here = str(Path(__file__).resolve())
    cmd = ([sys.executable, here, *flags] if single else
           [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", here, *flags])
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1" if args.device == "cpu" else "4")}
    env.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off
    print("$", " ".join(cmd), flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, timeout=args.timeout)
    if proc.returncode != 0 or not result.is_file():
        return dict(layout=layout, gpus=n, single=single, error=f"exit code {proc.returncode}",
                    seconds=time.perf_counter() - start)
    r = json.loads(result.read_text())
    if args.phases:
        return dict(layout=layout, gpus=n, single=single, distributed=r["distributed"], plan=r.get("layout"),
                    wall_s=time.perf_counter() - start, **_phase_summary(r["phases"], n))
    last = r["history"][-1]
    n_gen = args.prompts_per_gpu * n * args.G * args.completion  # generated tokens of the step, all ranks
    peaks = {k: v for k, v in last.items() if k.endswith("_peak_gib") and v is not None}
    per_rank = {k: v for k, v in last.items() if "_peak_gib/rank" in k}
    gen_s = last.get("generation_time_s") or float("nan")
    return dict(layout=layout, gpus=n, single=single, step_s=last["step_time_s"],
                tokens_per_s_per_gpu=n_gen / last["step_time_s"] / n,
                rollout_tokens_per_s_per_gpu=n_gen / gen_s / n,
                phases={k: last.get(f"{k}_time_s") for k in ("generation", "rewards", "reference", "update")},
                peak_gib=max(peaks.values()) if peaks else None, peaks_per_rank=per_rank,
                collectives=r["collectives"], distributed=r["distributed"], history=r["history"])


def _phase_summary(phases: dict, n: int) -> dict:
    """Medians of the measured reps (the warm-up left out) of each phase; the rollout's tokens/s per GPU."""
    out = {}
    for name, runs in phases.items():
        measured = runs[1:] or runs
        out[name] = {k: statistics.median(r[k] for r in measured) for k in measured[0]}
        out[name]["warmup"] = runs[0]
        out[name]["reps"] = len(measured)
    return out


def _fmt(x, spec=".1f"):
    return "–" if x is None else format(x, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-3.1-8b", help="a benchmarks/trl_baseline.py shape, or tiny (the "
                    "builtin model and its arithmetic task, for a CPU check)")
    ap.add_argument("--layouts", default="lora,qlora,full")
    ap.add_argument("--gpus", default="1,2,4,8", help="world sizes (those above the GPUs present are skipped)")
    ap.add_argument("--with-single", action="store_true", help="also the one-process path (no process group) at 1")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--prompts-per-gpu", type=int, default=4)
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--completion", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--collectives", action="store_true", help="one more, profiled step per world size > 1")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds for one world size's run")
    ap.add_argument("--phases", default="", help="train,rollout: the training step alone on fixed completions and "
                    "the rollout alone (see above) instead of whole steps")
    ap.add_argument("--reps", type=int, default=1, help="--phases: measured repetitions after one warm-up")
    ap.add_argument("--rollout-prompts", type=int, default=16, help="--phases rollout: prompts per GPU")
    ap.add_argument("--rollout-completion", type=int, default=1024, help="--phases rollout: tokens per completion")
    ap.add_argument("--no-recompute", type=int, default=-1,
                    help="model.no_recompute_layers (the last N layers not recomputed); -1: the planner's choice")
    ap.add_argument("--tag", default="")
    # one rank's run (set by the orchestrator)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--single", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--layout", default="lora", choices=LAYOUTS, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    import logging

    logging.basicConfig(level=logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING,
                        stream=sys.stdout, format="%(asctime)s %(name)s: %(message)s")
    if args.worker:
        return worker(args)
    bad_phases = [x for x in args.phases.split(",") if x and x not in ("train", "rollout")]
    if bad_phases:
        ap.error(f"unknown phases {bad_phases}; choose from train, rollout")
    layouts = [x for x in args.layouts.split(",") if x]
    bad = [x for x in layouts if x not in LAYOUTS]
    if bad:
        ap.error(f"unknown layouts {bad}; choose from {', '.join(LAYOUTS)}")
    available = torch.cuda.device_count() if args.device == "cuda" else os.cpu_count()
    sizes = [int(x) for x in args.gpus.split(",") if x]
    skipped = [n for n in sizes if n > available]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for layout in layouts:
            if args.with_single:
                rows.append(_run(args, layout, 1, True, Path(tmp)))
            for n in sizes:
                if n <= available:
                    rows.append(_run(args, layout, n, False, Path(tmp)))
    (write_phases if args.phases else write)(args, rows, skipped)


def _row_start(r: dict, columns: int) -> tuple[str, bool]:
    """A table row's first cells (layout, GPUs, path), and whether the row is done (a failed run: its error)."""
    path = "one process" if r.get("single") else "torchrun"
    start = f"| {r['layout']} | {r['gpus']} | {path} |"
    if "error" in r:
        return start + f" failed: {r['error']} |" + " |" * (columns - 4), True
    return start, False


def _heading(args, title: str, **params) -> tuple[dict, list[str]]:
    """(the run's metadata, the table's title and provenance lines)."""
    device = "CPU" if args.device == "cpu" else (torch.cuda.get_device_name() if torch.cuda.is_available() else "?")
    meta = run_meta(shape=args.shape, prompts_per_gpu=args.prompts_per_gpu, G=args.G, prompt_len=args.prompt_len,
                    completion=args.completion, **params)
    return meta, [f"# {title}, {args.shape} shape, {device}", "",
                  f"{meta['date']}, torch {meta['torch']}, transformers {meta['transformers']}; `{meta['command']}`", ""]


def write_phases(args, rows: list[dict], skipped: list[int]) -> None:
    """The --phases table: per layout and path, the training step alone and the rollout alone."""
    meta, lines = _heading(args, "GRPO step phases through the trainer", phases=args.phases,
                           rollout_prompts=args.rollout_prompts, rollout_completion=args.rollout_completion,
                           reps=args.reps, skipped_world_sizes=skipped)
    lines += [f"Training step alone: {args.prompts_per_gpu} prompt(s) × G={args.G} per GPU, {args.prompt_len}-token "
              f"prompts, fixed {args.completion}-token completions (random tokens), LoRA r=32, beta 0.04: the reference "
              "pass + the policy update (forward/backward, optimizer step). Rollout alone: "
              f"{args.rollout_prompts} prompts × G={args.G} per GPU × {args.rollout_completion} tokens (EOS ignored) "
              f"through the trainer's sampler. Medians of {args.reps} measured rep(s) after one warm-up; peak: the "
              "largest GPU allocation of the phase (rank 0's). Loss and gradient norm: the paths update on the same "
              "batch, so they agree up to reduction order.", "",
              "| layout | GPUs | path | train s (ref + update) | ref s | update s | train peak GiB | rollout s "
              "| rollout tok/s/GPU | rollout peak GiB | warm-up train s / rollout s | update loss / grad norm "
              "| layers not recomputed / inputs resident / planned train GiB |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        start, failed = _row_start(r, 13)
        if failed:
            lines.append(start)
            continue
        t, ro, plan = r.get("train") or {}, r.get("rollout") or {}, r.get("plan") or {}
        lines.append(f"{start} {_fmt(t.get('train_s'), '.2f')} "
                     f"| {_fmt(t.get('reference_s'), '.2f')} | {_fmt(t.get('update_s'), '.2f')} "
                     f"| {_fmt(t.get('peak_gib'), '.2f')} | {_fmt(ro.get('generation_s'), '.2f')} "
                     f"| {_fmt(ro.get('tokens_per_s'), ',.0f')} | {_fmt(ro.get('peak_gib'), '.2f')} "
                     f"| {_fmt((t.get('warmup') or {}).get('train_s'), '.1f')} / "
                     f"{_fmt((ro.get('warmup') or {}).get('generation_s'), '.1f')} "
                     f"| {_fmt(t.get('loss'), '.6g')} / {_fmt(t.get('grad_norm'), '.6g')} "
                     f"| {_fmt(plan.get('no_recompute_layers'), 'd')} / {_fmt(plan.get('gpu_resident_layers'), 'd')} / "
                     f"{_fmt(plan.get('predicted_train_gib'), '.2f')} |")
    stem = f"grpo_scale_phases_{args.shape}_{'cpu' if args.device == 'cpu' else 'gpu'}{args.tag}"
    write_result(stem, dict(meta=meta, rows=rows), lines)


def write(args, rows: list[dict], skipped: list[int]) -> None:
    meta, lines = _heading(args, "GRPO scale-out", steps=args.steps, skipped_world_sizes=skipped)
    base = {r["layout"]: r for r in rows if r.get("gpus") == 1 and not r.get("single") and "error" not in r}
    lines += [f"{args.prompts_per_gpu} prompts × G={args.G} per GPU, {args.prompt_len}-token prompts, "
              f"{args.completion}-token completions; the last of {args.steps} steps. Tokens/s per GPU: generated "
              "tokens of the step ÷ step time ÷ GPUs. Efficiency: tokens/s/GPU ÷ that of the 1-GPU torchrun run.", "",
              "| layout | GPUs | path | step s | tok/s/GPU | rollout tok/s/GPU | efficiency | peak GiB (max rank) "
              "| collectives s | gen / ref / update s |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        start, failed = _row_start(r, 10)
        if failed:
            lines.append(start)
            continue
        one = base.get(r["layout"])
        eff = r["tokens_per_s_per_gpu"] / one["tokens_per_s_per_gpu"] if one else None
        ph = r["phases"]
        lines.append(f"{start} {r['step_s']:.2f} | {r['tokens_per_s_per_gpu']:,.0f} "
                     f"| {r['rollout_tokens_per_s_per_gpu']:,.0f} | {_fmt(eff, '.1%')} | {_fmt(r['peak_gib'], '.2f')} "
                     f"| {_fmt((r['collectives'] or {}).get('seconds'), '.2f')} "
                     f"| {_fmt(ph['generation'], '.1f')} / {_fmt(ph['reference'], '.1f')} / "
                     f"{_fmt(ph['update'], '.1f')} |")
    if skipped:
        lines += ["", f"Not run (more GPUs than this machine has): {', '.join(map(str, skipped))}."]
    stem = f"grpo_scale_{args.shape}_{'cpu' if args.device == 'cpu' else 'gpu'}{args.tag}"
    write_result(stem, dict(meta=meta, rows=rows), lines)


if __name__ == "__main__":
    main()
