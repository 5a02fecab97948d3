# Written against benchmarks/rollout_speed.py at commit fd99e7f (derive() then counted the prefix once per sequence).
"""Tables of the 2026-11-30 H200 run (call 1), rebuilt from its logs: the run was cut by a timeout while
transformers' continuous batching was still running, before the script wrote its tables."""
import sys, argparse, json
sys.argv = ["benchmarks/rollout_speed.py"]
sys.path.insert(0, "benchmarks")
import rollout_speed as rs
rs.CUDA = False
import torch
class A: pass
def build(shape, prompts, layers, kvh, res, bw, err, weight_bytes, cmd, note):
    a = A(); a.shape, a.prompts, a.G, a.prompt_len, a.new_tokens, a.tag = shape, prompts, 8, 512, 1024, ""
    results = {"kernel_max_abs_err": err, "copy_bandwidth_gbs": bw, **res}
    kv_token = 2 * layers * kvh * 128 * 2
    rs.derive(results, prompts * 8, 1024, 512, kv_token)
    rs.torch.cuda.get_device_name = lambda: "NVIDIA H200"
    rs.CUDA = True
    orig = sys.argv
    sys.argv = cmd.split()[1:]
    import datetime, transformers, platform
    rs.torch.__version__ = "2.11.0+cu130"; transformers.__version__ = "5.17.0"
    rs.write_tables(a, results, weight_bytes)
    p = rs.Path("benchmarks/results") / f"rollout_speed_{shape}_h200.md"
    p.write_text(p.read_text() + "\n" + note + "\n")
step8 = 15345393664
w8 = 15.270027160644531 * 2**30
# the base model's step bytes: LoRA r=32 params (float32) on all 7 projections of 32 layers
lora8 = 32 * 32 * 4 * ((4096 + 4096) + (4096 + 1024) * 2 + (4096 + 4096) + (4096 + 14336) * 2 + (14336 + 4096))
res8 = {"longrl": dict(seconds=17.270556532, prefill_s=0.40353588099999627, peak_gib=18.23049545288086, kv_gib=17.0,
                       weights_gib=w8 / 2**30, step_weight_bytes=step8),
        "longrl-nolora": dict(seconds=12.882244646000004, prefill_s=0.3606004980000108, peak_gib=18.01174545288086,
                              kv_gib=17.0, weights_gib=(w8 - lora8) / 2**30, step_weight_bytes=step8 - lora8),
        "hf-generate": dict(seconds=103.91284592200002, peak_gib=24.55804681777954, weights_gib=w8 / 2**30),
        "hf-continuous": {"error": "did not finish: still running ~170 s after it started when the 330 s timeout of the "
                                   "script ended it (< 131,072 / 170 ≈ 770 tokens/s)"}}
note = ("Rebuilt from the run's log (`benchmarks/results/rollout_speed_h200_call1.log`): the call's `timeout 330` ended the "
        "script while `generate_batch` ran, before it wrote these tables. The base model's bytes for longrl-nolora are the "
        f"LoRA model's minus the adapters ({lora8 / 2**30:.3f} GiB float32).")
build("llama-3.1-8b", 16, 32, 8, res8, 4267, 0.0078125, w8,
      "python benchmarks/rollout_speed.py --shape llama-3.1-8b --prompts 16 --G 8 --prompt-len 512 --new-tokens 1024", note)
step15 = 2768399360
w15 = 3.012965202331543 * 2**30
lora15 = 28 * 32 * 4 * ((1536 + 1536) + (1536 + 256) * 2 + (1536 + 1536) + (1536 + 8960) * 2 + (8960 + 1536))
res15 = {"longrl": dict(seconds=14.965255619000004, prefill_s=0.43017549099999997, peak_gib=16.688118934631348,
                        kv_gib=14.875, weights_gib=w15 / 2**30, step_weight_bytes=step15),
         "longrl-nolora": dict(seconds=11.166593693999971, prefill_s=0.3561566430000198, peak_gib=16.688118934631348,
                               kv_gib=14.875, weights_gib=(w15 - lora15) / 2**30, step_weight_bytes=step15 - lora15),
         "hf-continuous": {"error": "did not finish: still running ~175 s after it started when the 200 s timeout ended "
                                    "the script (< 524,288 / 175 ≈ 3,000 tokens/s)"},
         "hf-generate": {"error": "not reached (after hf-continuous in that run)"}}
note15 = ("Rebuilt from the run's log (`benchmarks/results/rollout_speed_h200_call1.log`): the call's `timeout 200` ended the "
          "script while `generate_batch` ran, before it wrote these tables; transformers' `generate` was not reached.")
build("qwen2.5-1.5b", 64, 28, 2, res15, 4272, 0.0078125, w15,
      "python benchmarks/rollout_speed.py --shape qwen2.5-1.5b --prompts 64 --G 8 --prompt-len 512 --new-tokens 1024 "
      "--impls longrl,longrl-nolora,hf-continuous,hf-generate", note15)
