"""The whole GRPO loop on one GPU: full optimizer steps (rollout + rewards + reference pass + policy update).

Random-weight models of real shapes in bf16, LoRA r=32 on every linear projection (float32 adapters and
optimizer state), G=8, 512-token prompts, completions of exactly --completion tokens (EOS ignored), beta 0.04,
offloaded checkpointing with the planner, longrl's sampler. Per phase: wall time, tokens/s, peak GPU memory
(the trainer's own phase metrics), from the last of --steps steps (the first one captures CUDA graphs).
Also a smoke run of the real CLI (`longrl train` on a tiny model directory + JSONL, checkpoint and resume).
`--impl trl` runs TRL 1.15's `GRPOTrainer.train()` on the same shape and data instead (its transformers
`generate` path: vLLM cannot be installed on the GPU machine), as the anchor: whole-step time and peak.

    python benchmarks/grpo_e2e.py --shape llama-3.1-8b --prompts 4 --completion 4096 --steps 2
    python benchmarks/grpo_e2e.py --shape llama-3.1-8b --prompts 2 --completion 16384 --steps 1
    python benchmarks/grpo_e2e.py --shape llama-3.1-8b --prompts 4 --completion 4096 --steps 2 --impl trl
    python benchmarks/grpo_e2e.py --cli-smoke-only
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import trl_baseline as tb  # noqa: E402
from bench_setup import REWARD_FILE, bench_lora, random_model, whitespace_tokenizer, write_grpo_inputs  # noqa: E402
from results_io import card_tag, run_meta, write_result  # noqa: E402

from longrl.config import Config, RewardSpec, validate  # noqa: E402
from longrl.models import apply_lora, calibration_ids, quantize_model  # noqa: E402
from longrl.models.fp8 import quantize_model_fp8  # noqa: E402
from longrl.models.fused_layers import FusedRMSNorm, FusedRotaryAttention, FusedSwiGLU  # noqa: E402
from longrl.compat.trl import GRPOTrainer  # noqa: E402

GIB = 2 ** 30
def run_loop(args, root: Path) -> dict:
    dev = torch.device("cuda")
    model = random_model(args.shape, dev)
    tok = whitespace_tokenizer(model)
    data, reward = write_grpo_inputs(root, args.prompts, args.prompt_len, model.config.vocab_size)
    first_prompt = json.loads(open(data).readline())["prompt"]
    assert len(tok(first_prompt, add_special_tokens=False)["input_ids"]) == args.prompt_len
    quant = None
    if args.load_in_4bit:  # NF4 with dynamic 16-bit exceptions, quantized where it lies; the bf16 weights are freed
        quant = quantize_model(model, calibration_ids(vocab_size=model.config.vocab_size).to(dev)).lines()
        print("\n".join(quant), flush=True)
        torch.cuda.empty_cache()
    if args.load_in_fp8:  # FP8 e4m3 (128 x 128 block scales) with the same dynamic 16-bit exceptions
        quant = quantize_model_fp8(model, calibration_ids(vocab_size=model.config.vocab_size).to(dev)).lines()
        print("\n".join(quant), flush=True)
        torch.cuda.empty_cache()
    lora = bench_lora()
    model = apply_lora(model, lora)
    cfg = Config()
    cfg.model.offload_activations = None if args.auto_layout else True  # None: the planner decides
    cfg.model.device = "cuda"
    cfg.train.gpu_memory_gib, cfg.generation.kv_cache_dtype = args.gpu_memory_gib, args.kv_cache_dtype
    cfg.model.load_in_4bit = args.load_in_4bit  # the planner counts NF4 bytes
    cfg.model.load_in_fp8 = args.load_in_fp8  # and FP8 bytes
    cfg.generation.nf4_kernel, cfg.generation.nf4_halves = args.nf4_kernel, args.nf4_halves
    cfg.lora = lora
    cfg.data.source, cfg.data.max_prompt_length, cfg.data.shuffle = str(data), args.prompt_len, False
    cfg.generation.max_completion_length, cfg.generation.ignore_eos = args.completion, True
    cfg.grpo.num_generations, cfg.grpo.beta, cfg.grpo.loss_type = args.G, 0.04, "dapo"
    cfg.train.prompts_per_step, cfg.train.max_steps, cfg.train.learning_rate = args.prompts, args.steps, 1e-5
    cfg.rewards = [RewardSpec(function=f"{reward}:random_reward")]
    cfg.output.output_dir, cfg.output.progress_bar, cfg.output.tensorboard = str(root / "run"), False, False
    cfg.output.log_completions = 0
    validate(cfg)
    if args.gpu_memory_gib:  # the weights were built (and quantized) before the trainer caps the allocator
        torch.cuda.empty_cache()
        assert torch.cuda.memory_reserved() <= args.gpu_memory_gib * GIB, "weights alone exceed the budget"
    torch.cuda.reset_peak_memory_stats()
    trainer = GRPOTrainer(cfg, model=model, tokenizer=tok)
    history = trainer.train()  # metrics.jsonl in the run dir has every step's phases as they finish
    step_peak = torch.cuda.max_memory_allocated() / GIB
    last = history[-1]
    n_seq = args.prompts * args.G
    gen_tokens = n_seq * args.completion
    train_tokens = n_seq * (args.prompt_len + args.completion)
    phases = {}
    for name, tokens in (("generation", gen_tokens), ("rewards", None), ("reference", train_tokens),
                         ("update", train_tokens)):
        t = last.get(f"{name}_time_s")
        phases[name] = dict(seconds=t, tokens_per_s=tokens / t if tokens and t else None,
                            peak_gib=last.get(f"{name}_peak_gib"))
    step_s = last["step_time_s"]
    # the trainer resets the peak counter at each phase's start, so the step's peak is the largest phase peak
    step_peak = max(p["peak_gib"] for p in phases.values() if p["peak_gib"] is not None)
    kv_gib = trainer.sampler.last_stats.get("kv_cache_bytes", 0) / GIB
    resident_gib = sum(t.numel() * t.element_size() for t in model.parameters()) / GIB  # base + LoRA weights
    train_peak = max(phases["reference"]["peak_gib"], phases["update"]["peak_gib"])
    cap = None
    if args.gpu_memory_gib:  # the cap the trainer set (an allocation past it raises): read back from the allocator
        probe = int((args.gpu_memory_gib + 1) * GIB)
        try:
            torch.empty(probe, dtype=torch.uint8, device=dev)
            cap = "NOT enforced: an allocation past the budget succeeded"
        except torch.OutOfMemoryError:
            cap = "enforced: an allocation past the budget raised out-of-memory"
    sampler_metrics = {k: v for k, v in last.items() if k.startswith("sampler/")}
    return dict(phases=phases, step_seconds=step_s, step_peak_gib=step_peak, weights_gib=resident_gib, cap=cap,
                sampler_metrics=sampler_metrics, layout=dict(offload=trainer.layout.offload_activations,
                                                             checkpointing=trainer.layout.gradient_checkpointing),
                kv_cache_gib=kv_gib, training_peak_gib=train_peak,
                rollout_over_weights_kv=phases["generation"]["peak_gib"] / (resident_gib + kv_gib),
                step_over_max_phase=step_peak / max(phases["generation"]["peak_gib"], train_peak),
                rollout_share=phases["generation"]["seconds"] / step_s,
                predicted_training_gib=trainer.layout.plan.predicted_gpu_bytes / GIB if trainer.layout.plan is not None else None,
                plan=trainer.layout.plan.table() if trainer.layout.plan is not None else None, quantization=quant,
                sampler_stats=dict(trainer.sampler.last_stats),
                fused_layers=sum(isinstance(m, (FusedRMSNorm, FusedSwiGLU, FusedRotaryAttention))
                                 for m in model.modules()),
                fused_lora_training=cfg.lora.fused_training,
                history=[{k: v for k, v in h.items() if not isinstance(v, str)} for h in history])


def run_trl(args, root: Path) -> dict:
    """TRL's own loop on the same model shape, LoRA, data and reward: GRPOTrainer.train() for --steps steps,
    4 prompts × 8 completions an optimizer step (batch 8 × 4 accumulation steps), generation forced to exactly
    --completion tokens (min_new_tokens), gradient checkpointing, bf16, beta 0.04."""
    import random

    from peft import LoraConfig as PeftLoraConfig
    from transformers import TrainerCallback

    tb._import_trl()
    from trl import GRPOConfig, GRPOTrainer

    import huggingface_hub.constants as hf_constants

    hf_constants.HF_HUB_DISABLE_TELEMETRY = True
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    model = random_model(args.shape, dev, dtype=torch.bfloat16 if cuda else torch.float32)
    # as a downloaded checkpoint's config says (the builder turns the cache off for the memory benchmark's TRL loss
    # step): without it transformers' generate re-runs the whole sequence for every new token
    model.config.use_cache = model.generation_config.use_cache = True
    tok = whitespace_tokenizer(model)
    data, _ = write_grpo_inputs(root, args.prompts, args.prompt_len, model.config.vocab_size)
    prompts = [json.loads(line)["prompt"] for line in open(data)]
    n_seq = args.prompts * args.G
    per_device = min(n_seq, 8)
    config = GRPOConfig(output_dir=str(root / "trl"), per_device_train_batch_size=per_device,
                        gradient_accumulation_steps=n_seq // per_device, num_generations=args.G,
                        max_completion_length=args.completion, generation_kwargs={"min_new_tokens": args.completion},
                        temperature=1.0, beta=0.04, learning_rate=1e-5, max_steps=args.steps,
                        gradient_checkpointing=True, bf16=cuda, use_cpu=not cuda, report_to=[], logging_steps=1,
                        save_strategy="no", seed=0, dataloader_num_workers=0)
    dataset = sys.modules["datasets"].Dataset.from_dict({"prompt": prompts * args.steps})
    times, peaks = [], []

    class StepClock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
                peaks.append(torch.cuda.max_memory_allocated() / GIB)
            times.append(time.perf_counter() - self.start)
            print(f"TRL step {len(times)}: {times[-1]:.2f} s", flush=True)

    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [random.random() for _ in completions],
                          args=config, train_dataset=dataset, processing_class=tok,
                          peft_config=PeftLoraConfig(r=32, lora_alpha=64, lora_dropout=0.0, target_modules="all-linear",
                                                     task_type="CAUSAL_LM"),
                          callbacks=[StepClock()])
    reuses_cache = generate_reuses_kv_cache(trainer.model)
    print(f"generate, called TRL's way, reuses its KV cache: {reuses_cache}", flush=True)  # before the long run
    fed = []  # tokens a no-grad forward fed per sequence inside train(): 1 for each decode step with a cache
    started = time.perf_counter()

    def count_fed(mod, inp):
        if torch.is_grad_enabled():
            return
        fed.append(inp[0].shape[1])
        if len(fed) % 512 == 0:  # progress of TRL's generate, so a run stopped by a time limit still says its rate
            print(f"TRL: {len(fed)} no-grad forwards after {time.perf_counter() - started:.1f} s", flush=True)

    hook = model.get_input_embeddings().register_forward_pre_hook(count_fed)
    try:
        trainer.train()
    finally:
        hook.remove()
    lengths = [h.get("completions/mean_length") for h in trainer.state.log_history if "completions/mean_length" in h]
    return dict(generate_reuses_kv_cache=reuses_cache, one_token_forwards=fed.count(1), step_seconds=times[-1], step_times=times, step_peak_gib=peaks[-1] if peaks else None,
                mean_completion_length=lengths[-1] if lengths else None,
                generated_tokens_per_s=n_seq * args.completion / times[-1])


def generate_reuses_kv_cache(model) -> bool:
    """Whether ``model.generate``, called as TRL 1.15 calls it (no grad, training mode; TRL turns gradient
    checkpointing off around generate), decodes with a working KV cache: one new token fed a step (else every step
    re-runs the whole sequence) and the same greedy tokens as in eval mode. 4 new tokens after a 6-token prompt;
    the model's mode restored."""
    ids = torch.arange(3, 9, device=next(model.parameters()).device)[None]  # [1, 6]
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4, do_sample=False,
              pad_token_id=0)
    was_training = model.training
    lengths = []
    hook = model.get_input_embeddings().register_forward_pre_hook(lambda mod, inp: lengths.append(inp[0].shape[1]))
    try:
        with torch.no_grad():
            model.eval()
            want = model.generate(**kw)
            lengths.clear()
            model.train()
            got = model.generate(**kw)
    finally:
        hook.remove()
        model.train(was_training)
    return lengths[1:] == [1, 1, 1] and torch.equal(got, want)


def cli_smoke(root: Path) -> dict:
    """`longrl train` on a tiny model directory and a JSONL file for 2 steps, then resumed to 3 (on this GPU)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from longrl.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    model_dir = root / "tiny-model"
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=tok.pad_token_id,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    data = root / "tiny.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}="}) + "\n" for a in range(5) for b in range(5)))
    (root / "tiny_reward.py").write_text(REWARD_FILE)
    config = root / "tiny.yaml"
    config.write_text(f"""model:
  name_or_path: {model_dir}
  offload_activations: true
data:
  source: {data}
generation:
  max_completion_length: 8
grpo:
  num_generations: 4
  beta: 0.04
train:
  prompts_per_step: 2
  max_steps: 2
  learning_rate: 1.0e-3
rewards:
  - function: {root / 'tiny_reward.py'}:random_reward
output:
  output_dir: {root / 'tiny-run'}
  save_steps: 1
  progress_bar: false
""")
    cmd = [sys.executable, "-m", "longrl.cli.main", "train", str(config)]
    first = subprocess.run(cmd, capture_output=True, text=True)
    second = subprocess.run(cmd + ["train.max_steps=3", "output.resume=true"], capture_output=True, text=True)
    metrics = [json.loads(line) for line in open(root / "tiny-run" / "metrics.jsonl")]
    ok = (first.returncode == 0 and second.returncode == 0 and [m["step"] for m in metrics] == [1, 2, 3]
          and "resumed from" in second.stderr and (root / "tiny-run" / "checkpoint-3").is_dir())
    return dict(ok=ok, returncodes=[first.returncode, second.returncode], steps=[m["step"] for m in metrics],
                stderr_tail=(first.stderr[-800:] + second.stderr[-800:]) if not ok else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(tb.SHAPES))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--completion", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--cli-smoke-only", action="store_true")
    ap.add_argument("--no-cli-smoke", action="store_true")
    ap.add_argument("--impl", default="longrl", choices=["longrl", "trl"])
    ap.add_argument("--tag", default="")
    ap.add_argument("--load-in-4bit", action="store_true",
                    help="NF4 base with dynamic 16-bit exceptions (longrl only); files get _4bit")
    ap.add_argument("--nf4-kernel", action="store_true", help="with --load-in-4bit: generation.nf4_kernel (decode "
                    "products read the NF4 weight directly; the default since 2026-12-01, the flag kept for older "
                    "commands); files get _nf4k")
    ap.add_argument("--bnb-decode", action="store_true", help="with --load-in-4bit: generation.nf4_kernel off "
                    "(decode products through bitsandbytes' own call, as before 2026-12-01); files keep _4bit alone")
    ap.add_argument("--nf4-halves", action="store_true", help="with --load-in-4bit: generation.nf4_halves (the NF4 "
                    "codes in the halves layout during each rollout); files get _halves")
    ap.add_argument("--nf4-mma", action="store_true", help="with --load-in-4bit: the decode products of up to 8 rows "
                    "on the few-row CUDA kernel (ops/nf4_mma.py, nf4_matmul.MMA_LAUNCH); files get _mma")
    ap.add_argument("--load-in-fp8", action="store_true", help="FP8 e4m3 base (128 x 128 block scales) with dynamic "
                    "16-bit exceptions, decode products on longrl's FP8 kernel (longrl only); files get _fp8")
    ap.add_argument("--gpu-memory-gib", type=float, default=0.0, help="train.gpu_memory_gib: the run's budget (the "
                    "planner, the KV cache and the allocator's cap); files get _capN")
    ap.add_argument("--kv-cache-dtype", default="bf16", choices=["bf16", "fp8"], help="generation.kv_cache_dtype; "
                    "fp8: files get _kvfp8")
    ap.add_argument("--auto-layout", action="store_true", help="leave model.offload_activations null (the planner "
                    "decides) instead of pinning offloaded checkpointing")
    args = ap.parse_args()
    args.tag = (f"_cap{args.gpu_memory_gib:g}" if args.gpu_memory_gib else "") + (
        "_kvfp8" if args.kv_cache_dtype == "fp8" else "") + args.tag
    if (args.nf4_kernel or args.bnb_decode) and not args.load_in_4bit:
        ap.error("--nf4-kernel / --bnb-decode need --load-in-4bit")
    if args.nf4_kernel and args.bnb_decode:
        ap.error("--nf4-kernel and --bnb-decode exclude each other")
    if args.nf4_halves and (not args.load_in_4bit or args.bnb_decode):
        ap.error("--nf4-halves needs --load-in-4bit and the NF4 kernel (not --bnb-decode)")
    if args.nf4_mma and (not args.load_in_4bit or args.bnb_decode):
        ap.error("--nf4-mma needs --load-in-4bit and the NF4 kernel (not --bnb-decode)")
    if args.nf4_mma:
        from longrl.ops import nf4_matmul

        nf4_matmul.LAUNCH.update(nf4_matmul.with_mma(nf4_matmul.LAUNCH))
    args.nf4_kernel = args.load_in_4bit and not args.bnb_decode
    if args.load_in_4bit and args.load_in_fp8:
        ap.error("--load-in-4bit and --load-in-fp8 exclude each other")
    if args.load_in_4bit:
        args.tag = ("_4bit" + ("_nf4k" if args.nf4_kernel else "") + ("_halves" if args.nf4_halves else "")
                    + ("_mma" if args.nf4_mma else "") + args.tag)
    if args.load_in_fp8:
        args.tag = "_fp8" + args.tag
    import logging

    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("httpx", "urllib3", "huggingface_hub", "datasets"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    for phases in ("longrl.recipes.grpo", "longrl.rollout.sampler"):  # each phase as it ends: a timeout still shows them
        logging.getLogger(phases).setLevel(logging.DEBUG)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        smoke = {"ok": None} if args.no_cli_smoke else cli_smoke(root)
        print("cli smoke:", smoke, flush=True)
        if args.cli_smoke_only:
            return
        start = time.perf_counter()
        if args.impl == "trl":
            result = run_trl(args, root)
            print("trl:", result, flush=True)
            write_trl(args, result)
            return
        result = run_loop(args, root)
    result["wall_seconds"] = time.perf_counter() - start
    write(args, result, smoke)


def write_trl(args, r: dict) -> None:
    import trl

    meta = run_meta(trl=trl.__version__)
    gpu = meta["gpu"]
    stem = f"grpo_e2e_{args.shape}_{args.prompts}x{args.G}x{args.completion}_{card_tag(gpu)}_trl{args.tag}"
    cache = ("reuses its KV cache" if r["generate_reuses_kv_cache"] else
             "runs WITHOUT a KV cache (each new token re-runs the whole sequence)")
    cache += (f"; inside train() {r['one_token_forwards']:,} forwards fed one token a sequence (a cached "
              f"decode step each; {args.steps} × {args.completion - 1:,} expected)")
    peak = f"{r['step_peak_gib']:.2f} GiB" if r["step_peak_gib"] is not None else "–"
    lines = [f"# TRL {meta['trl']} GRPOTrainer.train(), {args.shape} shape, {gpu}", "",
             f"{meta['date']}; torch {meta['torch']}, transformers {meta['transformers']}.  ", f"`{meta['command']}`", "",
             f"{args.prompts} prompts × {args.G} completions forced to {args.completion} tokens (`min_new_tokens`), "
             "transformers `generate` (vLLM is not installable on the GPU machine), LoRA r=32 all-linear, gradient "
             f"checkpointing, bf16, beta 0.04. TRL generates from the model in training mode (checkpointing turned off "
             f"around generate); checked before train(), generate {cache}.", "",
             f"Step {args.steps} of {args.steps}: **{r['step_seconds']:.2f} s** ({r['generated_tokens_per_s']:,.0f} "
             f"generated tokens/s over the whole step), peak {peak}; mean completion length "
             f"{r['mean_completion_length']}. All steps: {', '.join(f'{t:.1f}' for t in r['step_times'])} s."]
    write_result(stem, {**meta, **vars(args), **r}, lines)


def write(args, r: dict, smoke: dict) -> None:
    meta = run_meta()
    stem = f"grpo_e2e_{args.shape}_{args.prompts}x{args.G}x{args.completion}_{card_tag()}{args.tag}"
    base = ("NF4 4-bit base with 16-bit exceptions" + (", decode products on the NF4 kernel" if args.nf4_kernel else "")
            if args.load_in_4bit else "FP8 e4m3 base with 16-bit exceptions, decode products on the FP8 kernel"
            if args.load_in_fp8 else "bf16")
    lines = [f"# Whole GRPO step, {args.shape} shape (random weights, {base}, LoRA r=32), {meta['gpu']}", "",
             f"{meta['date']}; torch {meta['torch']}, transformers {meta['transformers']}.  ", f"`{meta['command']}`", "",
             f"{args.prompts} prompts × {args.G} completions of exactly {args.completion} tokens after a {args.prompt_len}-"
             f"token prompt; beta 0.04 (reference pass), offloaded checkpointing + planner, longrl's sampler "
             f"(KV cache {r['kv_cache_gib']:.2f} GiB). Figures of step {args.steps} of {args.steps}.", "",
             "| phase | seconds | tokens/s | peak GPU GiB |", "|---|---|---|---|"]
    for name, p in r["phases"].items():
        tps = f"{p['tokens_per_s']:,.0f}" if p["tokens_per_s"] else "–"
        peak = f"{p['peak_gib']:.2f}" if p["peak_gib"] is not None else "–"
        lines.append(f"| {name} | {p['seconds']:.2f} | {tps} | {peak} |")
    pred = r.get("predicted_training_gib")
    lines += [f"| **whole step** | **{r['step_seconds']:.2f}** | | **{r['step_peak_gib']:.2f}** |", "",
              f"Peaks: the trainer resets the counter at each phase's start, so the step's peak is the largest phase "
              f"peak. Rollout phase: {r['phases']['generation']['peak_gib']:.2f} GiB = "
              f"{r['rollout_over_weights_kv']:.3f} × (weights {r['weights_gib']:.2f} + KV cache "
              f"{r['kv_cache_gib']:.2f} GiB). Training phases (reference, update): {r['training_peak_gib']:.2f} GiB"
              + (f" (planner: {pred:.2f} GiB without the KV cache, which was released)" if pred else "")
              + f". Step peak / max(rollout, training) = {r['step_over_max_phase']:.3f}. Rollout share of the step: "
              f"{100 * r['rollout_share']:.0f}%. CLI smoke (tiny model dir + JSONL, 2 steps, resumed to 3, on this GPU): "
              f"{'not run' if smoke['ok'] is None else 'passed' if smoke['ok'] else 'FAILED ' + str(smoke)}.", "",
              "Sampler (last rollout): fast decode step {fast_decode}, fused LoRA {lora_fused}, packed projection "
              "groups {packed_groups}, projections on the NF4 kernel {nf4_projections}.".format(
                  **{"fast_decode": "–", "lora_fused": "–", "packed_groups": 0, "nf4_projections": 0,
                     **r.get("sampler_stats", {})})
              + f" Training: fused RMSNorm/SiLU·up/rotary attention modules {r.get('fused_layers', 0)}, fused LoRA in the update "
              f"{r.get('fused_lora_training', False)}."
              + (" Of the generation phase, the sampler's fixed host costs: {graph_captures} CUDA-graph captures in "
                 "{graph_capture_s:.2f} s, the model set up for the rollout and undone in {setup:.2f} s.".format(
                     graph_captures=r["sampler_stats"].get("graph_captures", 0),
                     graph_capture_s=r["sampler_stats"].get("graph_capture_s", 0.0),
                     setup=r["sampler_stats"]["prepare_s"] + r["sampler_stats"]["release_s"])
                 if "prepare_s" in r.get("sampler_stats", {}) else ""),
              "", f"Budget: train.gpu_memory_gib = {args.gpu_memory_gib or 'none'}; allocator cap "
              f"{r.get('cap') or 'none'}. KV cache dtype {args.kv_cache_dtype}; layout "
              f"{'auto (planner)' if args.auto_layout else 'offloading pinned'}: {r.get('layout')}. "
              f"Sampler/trainer mismatch: {r.get('sampler_metrics')}.",
              "", "Plan:", "", "```", r["plan"] or "", "```"]
    if r.get("quantization"):
        lines += ["", "```", *r["quantization"], "```"]
    write_result(stem, {**meta, **vars(args), **r, "cli_smoke": smoke}, lines)


if __name__ == "__main__":
    main()
