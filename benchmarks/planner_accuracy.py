"""The planner's current prediction against every measured longrl peak in benchmarks/results (no GPU needed).

Each grpo_memory row records the peak, the micro-batch budget, the GPU-resident layer inputs and the MLP tile of
the run; this recomputes ``planner.predict`` for exactly that configuration (no optimizer state, as the
benchmark step; keys/values repeated where the run put cuDNN or memory-efficient SDPA first). Each grpo_e2e run
records its rollout phase's peak; this recomputes ``planner.plan_rollout`` for its prompts × G × lengths. Each
sft_memory row (longrl's SFT step on one sequence: forward and backward, no optimizer state, the fused norms and
log-prob kernels) records its layout; this recomputes ``planner.predict`` for it. Each row gets two predictions:
with flash's attention backward counted and with cuDNN's (PyTorch 2.11 runs cuDNN's kernels for transformers' call
on an H200: ops/attention_backend.training_attention_kernel). Runs measured before the offloaded backward freed the
recomputed layer output (memory/offload.py release_unread_output; every source not in OUTPUT_FREED) held it,
[T, H] × b: it is counted back in for them. Writes results/planner_accuracy.{md,json}.

    python benchmarks/planner_accuracy.py
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from results_io import RESULTS, run_meta, write_result  # noqa: E402

from longrl.memory.planner import (GIB, ModelShape, PlanError, make_plan, nf4_weight_bytes, plan_rollout,  # noqa: E402
                                   predict)
from longrl.ops.attention_backend import repeats_kv  # noqa: E402

LLAMA_8B = ModelShape(layers=32, hidden=4096, intermediate=14336, kv_dim=1024, q_dim=4096, vocab=128256, tied=False)
QWEN_15B = ModelShape(layers=28, hidden=1536, intermediate=8960, kv_dim=256, q_dim=1536, vocab=151936, tied=True)
NF4_8B = nf4_weight_bytes(LLAMA_8B, 2, 0.10) / LLAMA_8B.base_params()
SOURCES = {"grpo_memory_llama-3.1-8b_h200_offload_v2": 2, "grpo_memory_llama-3.1-8b_tiling": 2,
           "grpo_memory_llama-3.1-8b_4bit": NF4_8B, "grpo_memory_llama-3.1-8b_reuse_20k": 2,
           "grpo_memory_llama-3.1-8b_sdpa_cudnn_20k": 2, "grpo_memory_llama-3.1-8b_probe_400k": 2}
ROLLOUTS = {"grpo_e2e_llama-3.1-8b_4x8x4096_h200": (LLAMA_8B, 2), "grpo_e2e_llama-3.1-8b_2x8x16384_h200": (LLAMA_8B, 2),
            "grpo_e2e_llama-3.1-8b_4x8x4096_h200_4bit": (LLAMA_8B, NF4_8B),
            "grpo_e2e_llama-3.1-8b_2x8x16384_h200_4bit": (LLAMA_8B, NF4_8B),
            "grpo_e2e_qwen2.5-1.5b_4x8x4096_h200": (QWEN_15B, 2)}
SFT_SOURCES = {"sft_memory_llama-3.1-8b_slope": 2, "sft_memory_llama-3.1-8b_default": 2,
               "sft_memory_llama-3.1-8b_nr": 2, "sft_memory_llama-3.1-8b_nr128k": 2,
               "sft_memory_llama-3.1-8b_cap40": 2, "sft_memory_llama-3.1-8b_cap40_edge": 2,
               "sft_memory_llama-3.1-8b_4bit_slope": NF4_8B, "sft_memory_llama-3.1-8b_4bit_cap24_expandable": NF4_8B,
               "sft_memory_llama-3.1-8b_4bit": NF4_8B, "sft_memory_llama-3.1-8b_cap40_grouped": 2,
               "sft_memory_llama-3.1-8b_snap": 2, "sft_memory_llama-3.1-8b_cap40_s17": 2,
               "sft_memory_llama-3.1-8b_cap40_s17b": 2, "sft_memory_llama-3.1-8b_4bit_cap24_s17": NF4_8B,
               "sft_memory_llama-3.1-8b_cap40_s17_98k": 2}
# SFT runs whose attention backward ran per key head group (ops/grouped_attention.py, then on by default)
GROUPED_SFT_SOURCES = {"sft_memory_llama-3.1-8b_cap40_grouped"}
# sources measured with the recomputed layer output freed (release_unread_output)
OUTPUT_FREED = {"sft_memory_llama-3.1-8b_cap40_s17b", "sft_memory_llama-3.1-8b_4bit_cap24_s17",
                "sft_memory_llama-3.1-8b_cap40_s17_98k"}
SFT_LAYOUT = re.compile(r"resident (\d+), tile (\d+)(?:, not recomputed (\d+))?")
H200_FREE = 139 * GIB


def sft_rows() -> list[dict]:
    """The SFT rows of SFT_SOURCES beside ``predict`` for each one's layout (resident inputs, MLP tile, layers not
    recomputed, as its ``layout`` column reads)."""
    rows = []
    for stem, weight_bytes in SFT_SOURCES.items():
        for r in json.loads((RESULTS / f"{stem}.json").read_text())["rows"]:
            if r.get("impl") != "longrl" or not r.get("peak_gib"):
                continue
            resident, tile, whole = (int(g or 0) for g in SFT_LAYOUT.match(r["layout"]).groups())
            held = held_output_bytes(stem, r["length"], offload=whole < LLAMA_8B.layers)
            rows.append(dict(source=stem, tokens=r["length"], layout=r["layout"], measured_gib=r["peak_gib"],
                             **predictions(r["peak_gib"], held, tokens=r["length"], lora_r=32,
                                           weight_bytes=weight_bytes, offload=True, gpu_resident=resident,
                                           chunk=1024, optimizer=False, mlp_tile=tile or None, logprob_kernel=True,
                                           fused_norms=True, no_recompute=whole,
                                           grouped_attention=stem in GROUPED_SFT_SOURCES)))
    return rows


def held_output_bytes(stem: str, tokens: int, offload: bool) -> int:
    """The recomputed layer output [T, H] × 2 an offloaded backward of a run measured before release_unread_output
    held."""
    return tokens * LLAMA_8B.hidden * 2 if offload and stem not in OUTPUT_FREED else 0


def predictions(measured_gib: float, held: int, **config) -> dict:
    """``predict`` for ``config`` (plus ``held`` bytes) with flash's and with cuDNN's attention backward counted,
    and each one's error against the measured peak."""
    out = {}
    for kernel in ("flash", "cudnn"):
        gpu = (predict(LLAMA_8B, attention_kernel=kernel, **config)[0] + held) / GIB
        out[f"predicted_{kernel}_gib"], out[f"error_{kernel}"] = gpu, gpu / measured_gib - 1
    return out


ADMIT_HOST_GIB = 88  # host memory the H200 machine's SFT runs saw free (their planner refusals name it)


def longest_admitted(cap_gib: float, weight_bytes: float) -> int:
    """The longest single SFT sequence ``make_plan`` admits in ``cap_gib`` of GPU memory (the 8B shape, LoRA r=32, the
    fused norms and log-prob kernels, cuDNN's attention backward, the planner's own layout and safety fraction under
    longrl's default allocator settings), by bisection."""
    lo, hi = 1024, 1 << 20
    while lo < hi:
        mid = (lo + hi + 1) // 2
        try:
            make_plan(LLAMA_8B, sequence_lengths=[mid], lora_r=32, weight_bytes=weight_bytes,
                      gpu_free_bytes=int(cap_gib * GIB), host_free_bytes=ADMIT_HOST_GIB * GIB, logprob_kernel=True,
                      fused_norms=True, no_recompute=None, attention_kernel="cudnn")
            lo = mid
        except PlanError:
            hi = mid - 1
    return lo


def prediction_cells(r: dict) -> str:
    return " | ".join(f"{r[f'predicted_{k}_gib']:.2f} | {100 * r[f'error_{k}']:+.1f}%" for k in ("flash", "cudnn"))


def main() -> None:
    rows = []
    for stem, weight_bytes in SOURCES.items():
        data = json.loads((RESULTS / f"{stem}.json").read_text())
        repeat_kv = repeats_kv([n for n in (data["args"].get("sdpa") or "").split(",") if n])
        for r in data["rows"]:
            if not r["impl"].startswith("longrl") or r.get("oom"):
                continue
            plain = r["impl"].startswith("longrl-plain")
            held = held_output_bytes(stem, r["planner_budget"], offload=not plain)
            rows.append(dict(source=stem, impl=r["impl"], tokens=r["length"], G=r.get("G", 8),
                             resident=r["planner_gpu_resident"], mlp_tile=r.get("mlp_tile"),
                             measured_gib=r["peak_gpu_gib"],
                             **predictions(r["peak_gpu_gib"], held, tokens=r["planner_budget"], lora_r=32,
                                           weight_bytes=weight_bytes, offload=not plain,
                                           gpu_resident=r["planner_gpu_resident"], chunk=1024, optimizer=False,
                                           mlp_tile=r.get("mlp_tile"),
                                           reuse_attention=r["impl"].startswith("longrl-reuse"),
                                           repeat_kv=repeat_kv)))
    lines = ["# Planner prediction vs measured peak (Llama-3.1-8B shape, one H200, no optimizer state)", "",
             "`python benchmarks/planner_accuracy.py` — the current `planner.predict` for each measured row's "
             "configuration, with flash's and with cuDNN's attention backward counted (runs from before the "
             "recomputed layer output was freed: with it counted back in).", "",
             "| source | impl | tokens × G | inputs on GPU | MLP tile | measured GiB | predicted, flash | error | "
             "predicted, cuDNN | error |", "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['source']} | {r['impl']} | {r['tokens']:,} × {r['G']} | {r['resident']} | "
              f"{r['mlp_tile'] or '–'} | {r['measured_gib']:.2f} | {prediction_cells(r)} |" for r in rows]
    rollouts = []
    for stem, (shape, weight_bytes) in ROLLOUTS.items():
        data = json.loads((RESULTS / f"{stem}.json").read_text())
        plan = plan_rollout(shape, prompts=data["prompts"], G=data["G"], prompt_len=data["prompt_len"],
                            completion_len=data["completion"], lora_r=32, weight_bytes=weight_bytes, compute_bytes=2,
                            gpu_free_bytes=H200_FREE)
        measured = data["phases"]["generation"]["peak_gib"]
        rollouts.append(dict(source=stem, measured_gib=measured, predicted_gib=plan.predicted_gpu_bytes / GIB,
                             error=plan.predicted_gpu_bytes / GIB / measured - 1))
    lines += ["", "Rollout phase of whole steps (`planner.plan_rollout`: weights, LoRA with Adam's moments and the "
              "fused copy, prefill and sampling workspace, KV cache):", "",
              "| source | measured GiB | predicted GiB | error |", "|---|---|---|---|"]
    lines += [f"| {r['source']} | {r['measured_gib']:.2f} | {r['predicted_gib']:.2f} | {100 * r['error']:+.1f}% |"
              for r in rollouts]
    sft = sft_rows()
    lines += ["", "SFT step, one sequence (`benchmarks/sft_memory.py`'s longrl rows, each in its own layout; \"planner "
              "refused\": the leanest layout measured anyway):", "",
              "| source | tokens | layout | measured GiB | predicted, flash | error | predicted, cuDNN | error |",
              "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['source']} | {r['tokens']:,} | {r['layout']} | {r['measured_gib']:.2f} | {prediction_cells(r)} |"
              for r in sft]
    admitted = {"bf16, 40 GiB": longest_admitted(40, 2),
                "NF4 (estimated weight bytes), 24 GiB": longest_admitted(24, NF4_8B)}
    lines += ["", f"The longest single SFT sequence the planner admits (`make_plan`, {ADMIT_HOST_GIB} GiB of host "
              "memory, the planner's layout; the capped runs above show what fits):", "",
              "| base, GPU budget | tokens |", "|---|---|"]
    lines += [f"| {k} | {v:,} |" for k, v in admitted.items()]
    write_result("planner_accuracy", {**run_meta(), "rows": rows, "rollouts": rollouts, "sft": sft,
                                      "admitted": admitted}, lines)


if __name__ == "__main__":
    main()
