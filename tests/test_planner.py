"""The memory planner's choices for known configurations, and `longrl plan` refusing what cannot fit."""

import re
import subprocess
import sys

import pytest

from longrl.memory.planner import (GIB, MAX_PACKED_TOKENS, MLP_TILE_ALIGN, ModelShape, PlanError, choose_mlp_tile,
                                   kv_bytes_per_token, make_plan, plan_rollout, predict, safety_fraction)

LLAMA_8B = ModelShape(layers=32, hidden=4096, intermediate=14336, kv_dim=1024, q_dim=4096, vocab=128256, tied=False)
QWEN_15B = ModelShape(layers=28, hidden=1536, intermediate=8960, kv_dim=256, q_dim=1536, vocab=151936, tied=True)


def test_parameter_counts_match_the_published_sizes():
    assert LLAMA_8B.base_params() == pytest.approx(8.03e9, rel=0.01)
    assert QWEN_15B.base_params() == pytest.approx(1.54e9, rel=0.01)
    # LoRA r=32 on all 7 projections of Llama-3.1-8B: 83.9M parameters (PEFT's count)
    assert LLAMA_8B.lora_params(32) == 83_886_080


def test_long_sequences_alone_short_ones_packed():
    long = make_plan(LLAMA_8B, sequence_lengths=[20480] * 8, lora_r=32, weight_bytes=2, gpu_free_bytes=139 * GIB,
                     host_free_bytes=100 * GIB)
    assert long.micro_batch_tokens == 20480 and long.gpu_resident_layers == 32  # plenty of memory: nothing offloaded
    short = make_plan(QWEN_15B, sequence_lengths=[1024] * 64, lora_r=32, weight_bytes=2, gpu_free_bytes=80 * GIB,
                      host_free_bytes=100 * GIB)
    assert short.micro_batch_tokens == MAX_PACKED_TOKENS


def test_tight_gpu_offloads_and_keeps_what_fits():
    plan = make_plan(LLAMA_8B, sequence_lengths=[20480] * 8, lora_r=32, weight_bytes=2, gpu_free_bytes=27 * GIB,
                     host_free_bytes=100 * GIB)
    assert plan.micro_batch_tokens == 20480 and 0 < plan.gpu_resident_layers < 32
    assert plan.predicted_gpu_bytes <= 27 * GIB
    assert plan.predicted_host_bytes == (32 - plan.gpu_resident_layers) * 20480 * 4096 * 2


def test_short_host_memory_keeps_layer_inputs_on_the_gpu():
    """400K tokens of the 8B shape need ~100 GiB of layer inputs: with 60 GiB of host memory the planner keeps the
    rest on a 139 GiB GPU instead of refusing; with too little of both it refuses, naming both."""
    host = 60 * GIB
    plan = make_plan(LLAMA_8B, sequence_lengths=[409600], lora_r=32, weight_bytes=2, gpu_free_bytes=139 * GIB,
                     host_free_bytes=host)
    per_layer = 409600 * 4096 * 2
    assert plan.predicted_host_bytes == (32 - plan.gpu_resident_layers) * per_layer <= host
    assert 32 - host // per_layer <= plan.gpu_resident_layers < 32
    assert plan.predicted_gpu_bytes <= 139 * GIB and plan.mlp_tile_tokens is not None
    with pytest.raises(PlanError, match="GPU memory.*host memory"):
        make_plan(LLAMA_8B, sequence_lengths=[409600], lora_r=32, weight_bytes=2, gpu_free_bytes=80 * GIB,
                  host_free_bytes=host)


def test_attention_reuse_keeps_its_outputs_with_the_inputs():
    """With attention reuse each offloaded layer also keeps its attention output (tokens × q_dim) and float32
    log-sum-exp (tokens × heads): 20,480 tokens of the 8B shape need 5 GiB more host memory."""
    shape = ModelShape.from_config(__import__("transformers").LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        vocab_size=128256))
    kw = dict(tokens=20480, lora_r=32, weight_bytes=2, offload=True, gpu_resident=0, chunk=1024)
    _, plain_host, _ = predict(shape, **kw)
    _, reuse_host, _ = predict(shape, **kw, reuse_attention=True)
    assert plain_host == 32 * 20480 * 4096 * 2
    assert reuse_host - plain_host == 32 * 20480 * (4096 * 2 + 32 * 4)
    plan = make_plan(shape, sequence_lengths=[20480] * 8, lora_r=32, weight_bytes=2, gpu_free_bytes=139 * GIB,
                     host_free_bytes=100 * GIB, reuse_attention=True)
    assert "layer inputs + attention outputs on GPU" in plan.parts_gpu_bytes


def test_prediction_grows_with_tokens_and_shrinks_with_offload():
    kw = dict(lora_r=32, weight_bytes=2, chunk=1024)
    a, _, _ = predict(LLAMA_8B, tokens=4096, offload=False, gpu_resident=0, **kw)
    b, _, _ = predict(LLAMA_8B, tokens=20480, offload=False, gpu_resident=0, **kw)
    c, host, _ = predict(LLAMA_8B, tokens=20480, offload=True, gpu_resident=0, **kw)
    assert a < b and c < b and host == 32 * 20480 * 4096 * 2


def test_cannot_fit_names_the_way_out():
    with pytest.raises(PlanError, match="single sequence of 409,600 tokens.*max_completion_length"):
        make_plan(LLAMA_8B, sequence_lengths=[409600], lora_r=32, weight_bytes=2, gpu_free_bytes=24 * GIB,
                  host_free_bytes=500 * GIB)


def _llama_dir(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256).save_pretrained(tmp_path / "llama8b")
    (tmp_path / "llama8b" / "tokenizer_config.json").write_text("{}")  # a model directory has tokenizer files
    return tmp_path / "llama8b"


def test_cli_plan_prints_and_refuses(tmp_path):
    path = _llama_dir(tmp_path)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {{name_or_path: {path}, dtype: bfloat16, offload_activations: true}}\n"
                   "lora: {r: 32}\ndata: {max_prompt_length: 512}\ngeneration: {max_completion_length: 19968}\n"
                   "train: {prompts_per_step: 1}\n"
                   "rewards: [{function: 'longrl.tasks.arithmetic:format_reward'}]\n")
    ok = subprocess.run([sys.executable, "-m", "longrl.cli.main", "plan", str(cfg), "--gpu-memory-gib", "139"],
                        capture_output=True, text=True)
    assert ok.returncode == 0 and "predicted peak GPU" in ok.stdout and "20,480" in ok.stdout
    assert "predicted peak GPU (rollout)" in ok.stdout and re.search(r"rollout: concurrent sequences\s+8 of 8", ok.stdout)
    bad = subprocess.run([sys.executable, "-m", "longrl.cli.main", "plan", str(cfg), "--gpu-memory-gib", "16"],
                         capture_output=True, text=True)
    assert bad.returncode == 1 and "cannot fit" in bad.stderr and "Traceback" not in bad.stderr


def test_mlp_tile_only_when_the_longest_sequence_needs_it():
    kw = dict(lora_r=32, weight_bytes=2, host_free_bytes=500 * GIB)
    assert make_plan(LLAMA_8B, sequence_lengths=[20480] * 8, gpu_free_bytes=139 * GIB, **kw).mlp_tile_tokens is None
    assert make_plan(LLAMA_8B, sequence_lengths=[20480] * 8, gpu_free_bytes=27 * GIB, **kw).mlp_tile_tokens is None
    # 409,600 tokens on an H200 (139 GiB) fit untiled: the MLP backward's 6 T I b = 66 GiB beside what the layer keeps,
    # with as many inputs on the GPU as fit; with 120 GiB they need two tiles
    h200 = make_plan(LLAMA_8B, sequence_lengths=[409600], gpu_free_bytes=139 * GIB, **kw)
    assert h200.mlp_tile_tokens is None and h200.gpu_resident_layers >= 2
    assert h200.predicted_gpu_bytes <= safety_fraction() * 139 * GIB
    one_more, _, _ = predict(LLAMA_8B, tokens=409600, lora_r=32, weight_bytes=2, offload=True, chunk=1024,
                             gpu_resident=h200.gpu_resident_layers + 1)
    assert one_more > safety_fraction() * 139 * GIB
    plan = make_plan(LLAMA_8B, sequence_lengths=[409600], gpu_free_bytes=120 * GIB, **kw)
    usable = safety_fraction() * 120 * GIB
    untiled, _, _ = predict(LLAMA_8B, tokens=409600, lora_r=32, weight_bytes=2, offload=True, gpu_resident=0, chunk=1024)
    assert untiled > usable >= plan.predicted_gpu_bytes
    assert plan.mlp_tile_tokens == 204800 and plan.micro_batch_tokens == 409600
    tiled, _, parts = predict(LLAMA_8B, tokens=409600, lora_r=32, weight_bytes=2, offload=True,
                              gpu_resident=plan.gpu_resident_layers, chunk=1024, mlp_tile=plan.mlp_tile_tokens)
    assert tiled == plan.predicted_gpu_bytes and parts == plan.parts_gpu_bytes
    assert "MLP tile (tokens)" in plan.table() and f"{plan.mlp_tile_tokens:,}" in plan.table()
    assert "MLP tile (tokens)             off" in make_plan(QWEN_15B, sequence_lengths=[1024] * 8,
                                                              gpu_free_bytes=80 * GIB, **kw).table()


def test_mlp_tile_fixed_or_off():
    kw = dict(sequence_lengths=[409600], lora_r=32, weight_bytes=2, gpu_free_bytes=120 * GIB, host_free_bytes=500 * GIB)
    assert make_plan(LLAMA_8B, mlp_tile_tokens=8192, **kw).mlp_tile_tokens == 8192
    with pytest.raises(PlanError, match="409,600 tokens needs"):
        make_plan(LLAMA_8B, mlp_tile_tokens=0, **kw)
    small, large = make_plan(LLAMA_8B, mlp_tile_tokens=8192, **kw), make_plan(LLAMA_8B, **kw)
    assert small.gpu_resident_layers > large.gpu_resident_layers  # smaller tiles: more layer inputs kept on the GPU
    same = dict(tokens=409600, lora_r=32, weight_bytes=2, offload=True, gpu_resident=4, chunk=1024)
    assert predict(LLAMA_8B, mlp_tile=8192, **same)[0] < predict(LLAMA_8B, mlp_tile=204800, **same)[0]


def test_tiled_prediction_counts_one_tile_of_mlp_intermediates():
    """The MLP backward holds one tile's gate, act, up and the product's three gradients (6 t I), the post-norm
    output and the finished tiles' input gradients ((2 T − t) H); below that an RMSNorm backward's float32
    temporaries (5 T H × 4 bytes) are the largest transient of a layer."""
    kw = dict(lora_r=32, weight_bytes=2, offload=True, gpu_resident=0, chunk=1024)
    T, h, i, r, b = 100_000, LLAMA_8B.hidden, LLAMA_8B.intermediate, 32, 2
    untiled, _, p0 = predict(LLAMA_8B, tokens=T, **kw)
    half, _, _ = predict(LLAMA_8B, tokens=T, mlp_tile=T // 2, **kw)
    tenth, _, p10 = predict(LLAMA_8B, tokens=T, mlp_tile=T // 10, **kw)
    same, _, _ = predict(LLAMA_8B, tokens=T, mlp_tile=T, **kw)
    assert same == untiled
    lora_a = lambda t: 3 * (T - t) * r * b  # noqa: E731  LoRA A outputs of gate, up, down: one tile's
    assert untiled - half == 6 * (T - T // 2) * i * b - (T - T // 2) * h * b + lora_a(T // 2)
    assert untiled - tenth == (T * h + 6 * T * i) * b - 5 * T * h * 4 + lora_a(T // 10)  # the norm's backward now
    assert p0["layer inputs on GPU"] == p10["layer inputs on GPU"] == 2 * T * h * b  # own input + prefetched one


def test_layer_backward_counts_what_is_live_at_the_measured_400k_peak():
    """benchmarks/results/grpo_memory_llama-3.1-8b_probe_400k: one 409,600-token sequence, MLP tiles of 204,800, 4
    layer inputs resident, no optimizer state: 95.43 GiB measured. The peak is the last layer's MLP backward: the 4
    resident inputs (no prefetch: the layer below is resident too), what the recompute keeps (its incoming gradient,
    two float32 RMSNorm inputs, the input norm's output, q, the attention output, k, v, lse, cos/sin, LoRA A outputs)
    and one tile's MLP backward. The final hidden states, their gradient and the log-prob chunk were freed before
    (the planner used to add them and an offload copy on top: 125.74 GiB, +32%). That run also held the recomputed
    layer output [T, H], which the offloaded backward now frees (release_unread_output)."""
    T, t, h, i, k, q, r, b = 409600, 204800, 4096, 14336, 1024, 4096, 32, 2
    gpu, host, parts = predict(LLAMA_8B, tokens=T, lora_r=r, weight_bytes=2, offload=True, gpu_resident=4,
                               chunk=1024, optimizer=False, mlp_tile=t)
    kept = (T * (h * b + 2 * h * 4 + h * b + 2 * q * b + 2 * k * b + 32 * 4 + 2 * 128 * b + 4 * r * b)
            + 3 * t * r * b)
    mlp = (T * h + 6 * t * i + (T - t) * h) * b
    assert parts["layer inputs on GPU"] == 4 * T * h * b and host == 28 * T * h * b
    assert parts["layer recompute"] == kept + mlp
    assert parts["log-prob backward"] == T * h * 4 + 2 * T * h * b + 4 * 1024 * 128256 * 4
    assert gpu == sum(parts.values()) - parts["log-prob backward"]  # not live with the layer's backward
    assert abs((gpu + T * h * b) / GIB / 95.43 - 1) < 0.01  # with the output that run held


def test_offloaded_layers_hold_two_inputs_during_backward():
    """An offloaded layer's backward holds its fetched input and the prefetched one below: keeping up to two inputs
    resident costs no GPU memory, each one more costs T H b."""
    def gpu(resident, offload=True):
        return predict(LLAMA_8B, tokens=20480, lora_r=32, weight_bytes=2, offload=offload, gpu_resident=resident,
                       chunk=1024, mlp_tile=4096)[0]

    assert gpu(0) == gpu(1) == gpu(2) < gpu(3) and gpu(3) - gpu(2) == 20480 * 4096 * 2
    assert gpu(32) == gpu(0, offload=False)  # as plain checkpointing: all inputs, the recomputed output freed


def test_choose_mlp_tile_splits_evenly_and_aligns():
    assert choose_mlp_tile(409600, lambda t: True) == 204800  # two tiles
    assert choose_mlp_tile(409600, lambda t: t <= 100_000) == 81920  # 4 tiles: 102,400 > 100,000; 5 tiles
    assert choose_mlp_tile(10_000, lambda t: t <= 3000) == 2048  # ⌈10,000 / 4⌉ = 2,500 → 3,072 > 3,000; /5 → 2,048
    assert choose_mlp_tile(MLP_TILE_ALIGN, lambda t: True) is None  # nothing smaller to tile into
    assert choose_mlp_tile(50_000, lambda t: False) is None


def test_rollout_plan_counts_kv_and_queues_when_tight():
    kw = dict(prompts=16, G=8, prompt_len=512, completion_len=1024, lora_r=32, weight_bytes=2, compute_bytes=2)
    roomy = plan_rollout(LLAMA_8B, gpu_free_bytes=139 * GIB, **kw)
    kv_token = kv_bytes_per_token(LLAMA_8B, 2)
    assert kv_token == 2 * 32 * 1024 * 2  # K and V, 32 layers, 8 kv heads x 128
    assert roomy.slots == 128
    assert roomy.parts_gpu_bytes["KV cache"] == (16 * 512 + 128 * 1024) * kv_token  # prompts once, completions each
    tight = plan_rollout(LLAMA_8B, gpu_free_bytes=30 * GIB, **kw)
    assert 0 < tight.slots < 128 and tight.predicted_gpu_bytes <= 30 * GIB
    with pytest.raises(PlanError, match="cannot hold one sequence"):
        plan_rollout(LLAMA_8B, gpu_free_bytes=18 * GIB, **{**kw, "completion_len": 400_000})


def test_repeated_kv_attention_is_counted():
    """cuDNN / memory-efficient first on a GQA model: SDPA keeps the keys/values repeated to the query heads through
    the layer's backward, 2 · T · (q_dim − kv_dim) more elements (measured: sdpa_cudnn_20k's longrl+tile4096 peaks
    0.233 GiB above the flash run, 2 · 20,480 · 3,072 · 2 bytes = 0.234 GiB); a model without GQA adds none."""
    def gpu(shape, repeat):
        return predict(shape, tokens=20480, lora_r=32, weight_bytes=2, offload=True, gpu_resident=0, chunk=1024,
                       mlp_tile=4096, repeat_kv=repeat)[0]

    assert gpu(LLAMA_8B, True) - gpu(LLAMA_8B, False) == 2 * 20480 * (4096 - 1024) * 2
    mha = ModelShape(layers=4, hidden=512, intermediate=1024, kv_dim=512, q_dim=512, vocab=1000, tied=True)
    assert gpu(mha, True) == gpu(mha, False)


def test_grouped_attention_backward_is_counted_per_key_head_group():
    """model.grouped_attention_backward: from MIN_TOKENS tokens the flash transients of one key head group (its
    float32 dq accumulator, expanded dk and dv, the contiguous copies of its output gradient and output, and its
    gradients before their copy) instead of all heads': for the 8B heads at 131,072 tokens, (32 − 4) KB − 3.5 KB a
    token less; below MIN_TOKENS, in float32, and without GQA, nothing changes; the flag reaches the planner only on
    a GPU run on SDPA with flash first or nothing listed."""
    from longrl.config import load_config
    from longrl.memory.planner import attention_groups, grouped_attention_applies
    from longrl.ops.grouped_attention import MIN_TOKENS

    def gpu(shape, tokens, grouped, weight_bytes=2):
        return predict(shape, tokens=tokens, lora_r=32, weight_bytes=weight_bytes, offload=True, gpu_resident=0,
                       chunk=1024, mlp_tile=4096, fused_norms=True, grouped_attention=grouped)[0]

    T = 131072
    assert attention_groups(LLAMA_8B, T, True) == 8 and attention_groups(LLAMA_8B, MIN_TOKENS - 1, True) == 1
    per_group = T * (512 * 4 + 2 * 512 * 2)  # dq accumulator and expanded dk, dv of 4 query heads
    copies = T * (2 * 512 + 512 + 2 * 128) * 2  # the group's do and o made contiguous, its dq, dk, dv
    assert gpu(LLAMA_8B, T, False) - gpu(LLAMA_8B, T, True) == 8 * per_group - per_group - copies
    assert gpu(LLAMA_8B, MIN_TOKENS - 1, False) == gpu(LLAMA_8B, MIN_TOKENS - 1, True)
    assert gpu(LLAMA_8B, T, False, weight_bytes=4) == gpu(LLAMA_8B, T, True, weight_bytes=4)  # float32: flash can't
    mha = ModelShape(layers=4, hidden=512, intermediate=1024, kv_dim=512, q_dim=512, vocab=1000, tied=True)
    assert gpu(mha, T, True) == gpu(mha, T, False)
    base = ["rewards=[{function: 'longrl.tasks.arithmetic:format_reward'}]", "model.device=cuda"]
    cases = [([], False), (["model.grouped_attention_backward=true"], True),
             (["model.grouped_attention_backward=true", "model.sdpa_backends=[flash]"], True),
             (["model.grouped_attention_backward=true", "model.device=cpu"], False)]
    for overrides, applies in cases:
        assert grouped_attention_applies(load_config(overrides=base + overrides)) == applies, overrides


def test_nf4_kernel_block_scales_are_counted_in_the_rollout():
    kw = dict(prompts=4, G=8, prompt_len=512, completion_len=4096, lora_r=32, weight_bytes=0.6, compute_bytes=2,
              gpu_free_bytes=139 * GIB)
    plain, with_scales = plan_rollout(LLAMA_8B, **kw), plan_rollout(LLAMA_8B, **kw, nf4_scales=True)
    assert with_scales.parts_gpu_bytes["NF4 block scales"] == LLAMA_8B.base_params() * 4 // 64
    assert with_scales.predicted_gpu_bytes - plain.predicted_gpu_bytes == LLAMA_8B.base_params() * 4 // 64


def test_4bit_base_computing_in_float32_counts_float32_activations():
    """A 4-bit base's weights are ~1 byte a parameter whatever it computes in; its activations are the compute
    dtype's: a float32 QLoRA step's layer terms are the float32 step's (they were counted as 16-bit)."""
    from transformers import LlamaConfig

    from longrl.config import load_config
    from longrl.memory.planner import plan_for_config

    model = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=128256)

    def parts(dtype, four_bit):
        cfg = load_config(overrides=[f"model.dtype={dtype}", f"model.load_in_4bit={four_bit}",
                                     "model.offload_activations=true", "train.micro_batch_tokens=20480",
                                     "model.reuse_attention=false", "model.no_recompute_layers=0",
                                     "rewards=[{function: 'longrl.tasks.arithmetic:format_reward'}]"])
        return plan_for_config(cfg, model, 139 * GIB, 500 * GIB).parts_gpu_bytes

    qlora32, full32, qlora16 = parts("float32", True), parts("float32", False), parts("bfloat16", True)
    for key in ("layer inputs on GPU", "layer recompute"):
        assert qlora32[key] == full32[key] > qlora16[key]


def test_attention_reuse_left_null_is_on_with_offloading_where_it_costs_no_tokens():
    """model.reuse_attention null: with offloading the planner takes the plan with attention reuse unless it has
    fewer micro-batch tokens or a finer MLP tile than the plan without (then it is off); never without offloading;
    a pinned value is kept. On the CPU (nothing planned) null means on with offloading."""
    import torch
    from transformers import LlamaConfig

    from longrl.config import load_config
    from longrl.memory.layout import resolve_layout
    from longrl.memory.planner import plan_for_config

    model = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=128256)

    def cfg(*over):
        return load_config(overrides=["model.dtype=bfloat16", "data.max_prompt_length=512", "train.prompts_per_step=1",
                                      "generation.max_completion_length=19968", *over, "generation.backend=hf",
                                      "rewards=[{function: 'longrl.tasks.arithmetic:format_reward'}]"])

    offload = "model.offload_activations=true"  # generation.backend=hf: the training phase alone sets the minimum

    def plan(gpu_gib, *pin):
        return plan_for_config(cfg(offload, *pin), model, int(gpu_gib * GIB), 500 * GIB)

    def smallest_fitting(*pin) -> float:  # GiB, to 0.01
        lo, hi = 8.0, 139.0
        while hi - lo > 0.01:
            mid = (lo + hi) / 2
            try:
                plan(mid, *pin)
                hi = mid
            except PlanError:
                lo = mid
        return hi

    on_min, off_min = smallest_fitting("model.reuse_attention=true"), smallest_fitting("model.reuse_attention=false")
    assert off_min < on_min  # reuse keeps more on the GPU
    coarse = lambda p: p.mlp_tile_tokens or p.micro_batch_tokens  # noqa: E731
    chosen = set()
    for gpu_gib in [139, 40, 30, (off_min + on_min) / 2] + [on_min + 0.1 * k for k in range(12)]:
        auto, off = plan(gpu_gib), plan(gpu_gib, "model.reuse_attention=false")
        try:
            on = plan(gpu_gib, "model.reuse_attention=true")
        except PlanError:  # only the layout without reuse fits
            assert auto == off, gpu_gib
            chosen.add("fits only without")
            continue
        assert on.reuse_attention and not off.reuse_attention and on.predicted_host_bytes >= off.predicted_host_bytes
        free = on.micro_batch_tokens >= off.micro_batch_tokens and coarse(on) >= coarse(off)
        assert auto == (on if free else off), gpu_gib
        chosen.add(auto.reuse_attention)
    assert chosen == {True, False, "fits only without"}  # each outcome occurs
    assert "attention reuse" in auto.table()
    plain = plan_for_config(cfg("model.offload_activations=false", "model.gradient_checkpointing=true"), model,
                            139 * GIB, 500 * GIB)
    assert not plain.reuse_attention
    for over, want in (((offload,), True), ((), False), ((offload, "model.reuse_attention=false"), False)):
        assert resolve_layout(cfg(*over), None, torch.device("cpu")).reuse_attention is want, over


def test_full_fine_tuning_counts_the_base_weights_training_state():
    """lora.enabled=false trains every base weight: its gradient and Adam's two moments (in the weights' dtype)
    in the training phase, the moments through the rollout; they were not counted at all (lora_r = 0)."""
    from transformers import LlamaConfig

    from longrl.config import load_config
    from longrl.memory.planner import plan_for_config

    model = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=128256)

    def plan(lora):
        cfg = load_config(overrides=[f"lora.enabled={lora}", "grpo.beta=0", "model.dtype=bfloat16",
                                     "model.offload_activations=true", "train.micro_batch_tokens=8192",
                                     "model.no_recompute_layers=0",
                                     "rewards=[{function: 'longrl.tasks.arithmetic:format_reward'}]"])
        return plan_for_config(cfg, model, 139 * GIB, 500 * GIB)

    full, lora = plan(False), plan(True)
    weights = LLAMA_8B.base_params() * 2
    assert full.parts_gpu_bytes["base grads (+Adam)"] == 3 * weights
    assert full.rollout.parts_gpu_bytes["base Adam moments"] == 2 * weights
    assert "base grads (+Adam)" not in lora.parts_gpu_bytes

    def rest(p):  # the peak without the adapters' state and the larger backward phase (LoRA's activations differ)
        parts = p.parts_gpu_bytes
        return (p.predicted_gpu_bytes - parts["LoRA (+grads, Adam)"]
                - max(parts["layer recompute"], parts["log-prob backward"]))

    assert rest(full) == rest(lora) + 3 * weights


def test_without_checkpointing_every_layers_activations_are_counted():
    """Neither gradient checkpointing nor offloading: autograd keeps each layer's activations until its backward,
    L − 1 layers more than a checkpointed step holds; `longrl plan` on such a config no longer predicts the
    checkpointed peak."""
    from transformers import LlamaConfig

    from longrl.config import LoraConfig, load_config
    from longrl.memory.planner import layer_kept_bytes, plan_for_config

    model = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=128256)

    def plan(checkpointing):
        cfg = load_config(overrides=[f"model.gradient_checkpointing={checkpointing}", "model.dtype=bfloat16",
                                     "train.micro_batch_tokens=4096", "data.max_prompt_length=512",
                                     "model.reuse_attention=false", "model.no_recompute_layers=0",
                                     "generation.max_completion_length=3584",
                                     "rewards=[{function: 'longrl.tasks.arithmetic:format_reward'}]"])
        return plan_for_config(cfg, model, 139 * GIB, 500 * GIB)

    plain, checkpointed = plan(False), plan(True)
    T, r = plain.micro_batch_tokens, LoraConfig().r  # the default rank
    # a GPU run of a Llama model: the fused RMSNorm kernels keep 16-bit inputs (planner.fused_norms_apply)
    per_layer = layer_kept_bytes(LLAMA_8B, T, 2, tile=T, lora_r=r, offload=False, norm_bytes=2) + 3 * T * 14336 * 2
    assert plain.parts_gpu_bytes["activations of the other layers"] == 31 * per_layer
    assert "activations of the other layers" not in checkpointed.parts_gpu_bytes
    assert plain.predicted_gpu_bytes > checkpointed.predicted_gpu_bytes + 31 * per_layer * 0.99


def test_the_log_prob_row_kernels_are_planned_where_they_run():
    """On a GPU without a final logit softcap the log-prob backward holds one chunk of logits in the compute
    dtype (ops/logprob_kernel.py) instead of four float32 ones; CPU runs and softcapped models keep the latter."""
    from transformers import Gemma2Config, LlamaConfig

    from longrl.config import load_config
    from longrl.memory.planner import logprob_backward_bytes, logprob_kernel_applies

    def cfg(device):
        return load_config(overrides=[f"model.device={device}",
                                      "rewards=[{function: 'longrl.tasks.arithmetic:format_reward'}]"])

    llama = LlamaConfig(vocab_size=1000)
    assert logprob_kernel_applies(cfg("auto"), llama) and logprob_kernel_applies(cfg("cuda"), llama)
    assert not logprob_kernel_applies(cfg("cpu"), llama)
    assert not logprob_kernel_applies(cfg("cuda"), Gemma2Config(final_logit_softcapping=30.0))
    torch_path = logprob_backward_bytes(8192, 4096, 128256, 1024, 2)
    kernels = logprob_backward_bytes(8192, 4096, 128256, 1024, 2, kernel=True)
    assert torch_path - kernels == 1024 * 128256 * (16 - 2)
    _, _, parts = predict(LLAMA_8B, tokens=8192, lora_r=32, weight_bytes=2, offload=True, gpu_resident=0, chunk=1024,
                          logprob_kernel=True)
    assert parts["log-prob backward"] == kernels


# ----------------------------------------------------------------------------- the auto layout and the GPU budget

def _run_cfg(*overrides):
    from longrl.config import load_config

    return load_config(overrides=["model.dtype=bfloat16", "lora.r=32", "data.max_prompt_length=512",
                                  "rewards=[{function: 'longrl.tasks.arithmetic:format_reward'}]", *overrides])


def _llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256)


def test_auto_layout_recomputes_only_when_it_must():
    """Null layout keys: a short job with room to spare keeps every activation (no recompute); the 8B 20K job
    offloads; pinned keys are taken as they are."""
    from longrl.memory.planner import NO_RECOMPUTE_SHARE, layout_candidates, plan_for_config

    assert layout_candidates(None, None) == [(False, False), (True, True)]
    assert layout_candidates(None, True) == [(True, True)] and layout_candidates(None, False) == [(False, False)]
    assert layout_candidates(False, None) == [(False, False)] and layout_candidates(False, True) == [(False, True)]
    assert layout_candidates(True, None) == [(True, True)]
    short = plan_for_config(_run_cfg("generation.max_completion_length=512", "train.prompts_per_step=2"),
                            _llama_config(), 139 * GIB, 500 * GIB)
    assert not short.checkpointing and not short.offload
    assert short.predicted_gpu_bytes <= NO_RECOMPUTE_SHARE * 139 * GIB * safety_fraction()
    long = plan_for_config(_run_cfg("generation.max_completion_length=19968", "train.prompts_per_step=1"),
                           _llama_config(), 139 * GIB, 500 * GIB)
    assert long.checkpointing and long.offload and long.micro_batch_tokens == 20480
    pinned = plan_for_config(_run_cfg("generation.max_completion_length=512", "train.prompts_per_step=2",
                                      "model.gradient_checkpointing=true", "model.offload_activations=false"),
                             _llama_config(), 139 * GIB, 500 * GIB)
    assert pinned.checkpointing and not pinned.offload


@pytest.mark.parametrize("fourbit,gib", [(True, 22), (False, 40)])
def test_budget_caps_every_phase_of_the_8b_20k_job(fourbit, gib):
    """train.gpu_memory_gib: the plan is made for the budget, not for the (larger) free memory, and both phases'
    predictions stay inside it; in 22 GiB the 20K rollout runs fewer sequences at once with a bf16 cache and all 8
    with FP8."""
    from longrl.memory.planner import plan_for_config

    overrides = ["generation.max_completion_length=19968", "train.prompts_per_step=1", f"train.gpu_memory_gib={gib}",
                 f"model.load_in_4bit={str(fourbit).lower()}"]
    bf16 = plan_for_config(_run_cfg(*overrides), _llama_config(), 139 * GIB, 500 * GIB)
    fp8 = plan_for_config(_run_cfg(*overrides, "generation.kv_cache_dtype=fp8"), _llama_config(), 139 * GIB, 500 * GIB)
    for plan in (bf16, fp8):
        assert plan.budget_bytes == gib * GIB and plan.offload
        assert max(plan.predicted_gpu_bytes, plan.rollout.predicted_gpu_bytes) <= gib * GIB
    assert fp8.rollout.slots == 8
    assert 1 <= bf16.rollout.slots < 8 if gib == 22 else bf16.rollout.slots == 8  # 40 GiB: 15 + 19.6 GiB KV fit
    uncapped = plan_for_config(_run_cfg(*overrides[:2], f"model.load_in_4bit={str(fourbit).lower()}"),
                               _llama_config(), 139 * GIB, 500 * GIB)
    assert uncapped.rollout.slots == 8  # and more layer inputs stay on the GPU (resident, or in layers kept whole)
    assert uncapped.gpu_resident_layers + uncapped.no_recompute_layers >= bf16.gpu_resident_layers


def test_budget_that_cannot_fit_names_the_way_out():
    from longrl.memory.planner import plan_for_config

    with pytest.raises(PlanError, match="load_in_4bit=true.*raise train.gpu_memory_gib"):
        plan_for_config(_run_cfg("generation.max_completion_length=19968", "train.prompts_per_step=1",
                                 "train.gpu_memory_gib=18"), _llama_config(), 139 * GIB, 500 * GIB)
    with pytest.raises(PlanError, match="kv_cache_dtype=fp8"):  # the rollout of one 20K sequence in 16-bit
        plan_rollout(LLAMA_8B, prompts=1, G=8, prompt_len=512, completion_len=19968, lora_r=32, weight_bytes=0.75,
                     compute_bytes=2, gpu_free_bytes=9 * GIB)
    with pytest.raises(PlanError, match="kv_cache_gib=30 is more than"):
        plan_for_config(_run_cfg("generation.max_completion_length=19968", "train.prompts_per_step=1",
                                 "train.gpu_memory_gib=40", "generation.kv_cache_gib=30"), _llama_config(),
                        139 * GIB, 500 * GIB)


def test_trainer_fails_before_the_model_loads_and_loads_with_the_plan_s_layout(monkeypatch, tmp_path):
    """On CUDA (faked: the plan needs only the model's config) the trainer plans from the config before loading
    weights: a job that cannot fit raises PlanError without loading; one that fits loads with the plan's layout, a
    value: the config is left as the user wrote it."""
    import torch

    from longrl.memory import layout
    from longrl.memory.layout import resolve_layout
    from longrl.memory.planner import StepShape
    from longrl.recipes import grpo as tr
    from longrl.training import model_setup

    path = _llama_dir(tmp_path)
    loads = []
    monkeypatch.setattr(model_setup, "resolve_device", lambda device: torch.device("cuda"))
    monkeypatch.setattr(model_setup, "cap_allocator", lambda cfg, device: None)

    class Loaded(Exception):
        pass

    def load_model(*args, **kwargs):
        loads.append(1)
        raise Loaded

    monkeypatch.setattr(model_setup, "load_model", load_model)
    monkeypatch.setattr(layout, "usable_gpu_bytes", lambda cfg, device: min(139 * GIB, layout.budget_bytes(cfg) or 1e15))
    base = [f"model.name_or_path={path}", "generation.max_completion_length=19968", "train.prompts_per_step=1",
            f"output.output_dir={tmp_path / 'out'}"]
    with pytest.raises(PlanError):
        tr.GRPOTrainer(_run_cfg(*base, "train.gpu_memory_gib=12"))
    assert not loads
    cfg = _run_cfg(*base, "train.gpu_memory_gib=40")
    layouts = []  # what model set-up receives: the layout, checked as the weights load
    monkeypatch.setattr(model_setup, "load_model", lambda *a, **k: (layouts.append(k), load_model())[1])
    asked = cfg.to_dict()
    with pytest.raises(Loaded):
        tr.GRPOTrainer(cfg)
    assert loads and cfg.to_dict() == asked  # the plan is a value: nothing is written into the config
    frugal = resolve_layout(cfg, _llama_config(), torch.device("cuda"), StepShape.grpo(cfg, 19968))
    assert frugal.offload_activations is True and frugal.gradient_checkpointing is True
    assert frugal.micro_batch_tokens == 20480 and 0 < frugal.gpu_resident_layers <= 32
    assert frugal.no_recompute_layers == 0  # a 40 GiB budget: the frugal layout
    assert layouts[-1]["gradient_checkpointing"] is frugal.transformers_checkpointing
    roomy = _run_cfg(*base)
    roomy_layout = resolve_layout(roomy, _llama_config(), torch.device("cuda"), StepShape.grpo(roomy, 19968))
    assert roomy_layout.no_recompute_layers > 0 and roomy_layout.gradient_checkpointing is True


def test_cpu_demo_trajectory_is_bit_identical_with_the_auto_layout_keys(tmp_path):
    """On the CPU nothing is planned: the demo with its layout keys null (the defaults) trains exactly as with
    them pinned off, and the keys resolve to off."""
    from longrl.config import load_config
    from longrl.config.demo import demo_config
    from longrl.training.reporting import read_metrics
    from longrl.compat.trl import GRPOTrainer

    quick = ["train.max_steps=2", "train.prompts_per_step=2", "grpo.num_generations=4", "data.num_examples=64",
             "output.progress_bar=false",
             "output.tensorboard=false", "output.logging_steps=1"]
    runs = {}
    for name, keys in (("auto", []), ("pinned", ["model.gradient_checkpointing=false",
                                                 "model.offload_activations=false", "train.mlp_tile_tokens=0"])):
        cfg = load_config(None, quick + keys + [f"output.output_dir={tmp_path / name}"], base=demo_config())
        trainer = GRPOTrainer(cfg)
        assert trainer.layout.plan is None and trainer.layout.offload_activations is False
        assert trainer.layout.gradient_checkpointing is False
        trainer.train()
        runs[name] = [{k: v for k, v in m.items() if not k.endswith("time_s")} for m in read_metrics(tmp_path / name)]
    assert len(runs["auto"]) == 2 and runs["auto"] == runs["pinned"]


def test_plan_for_one_gpu_of_a_data_parallel_job():
    """FSDP2 (full weights) on 8 GPUs holds 1/8 of the weights, gradients and Adam moments per GPU (plus the root
    and two layers unsharded), and the rollout the full weights beside the shards: a job that cannot fit one
    40 GiB GPU fits each of 8. Replicated LoRA keeps the whole base per GPU and plans a rank's share of prompts."""
    from transformers import LlamaConfig

    from longrl.config import load_config
    from longrl.memory.planner import plan_for_config

    llama = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=128256)

    def cfg(lora):
        return load_config(None, ["model.dtype=bfloat16", "model.offload_activations=true", f"lora.enabled={lora}",
                                  "lora.r=32", "data.max_prompt_length=512", "generation.max_completion_length=3584",
                                  "train.prompts_per_step=8", "rewards=[{function: 'tasks:reward'}]"])
    with pytest.raises(PlanError):
        plan_for_config(cfg("false"), llama, 40 * GIB)
    one, eight = plan_for_config(cfg("false"), llama, 139 * GIB), plan_for_config(cfg("false"), llama, 40 * GIB,
                                                                                  world_size=8)
    for part in ("base weights", "base grads (+Adam)"):
        assert eight.parts_gpu_bytes[part] == pytest.approx(one.parts_gpu_bytes[part] / 8, abs=8)
    assert eight.parts_gpu_bytes["FSDP2 unsharded root + 2 layers"] > 2 * 128256 * 4096 * 2
    assert eight.rollout.parts_gpu_bytes["base weights"] == one.rollout.parts_gpu_bytes["base weights"]
    assert eight.rollout.sequences == 8 and one.rollout.sequences == 64
    lora_one, lora_three = (plan_for_config(cfg("true"), llama, 139 * GIB, world_size=n) for n in (1, 3))
    assert lora_three.parts_gpu_bytes["base weights"] == lora_one.parts_gpu_bytes["base weights"]
    assert lora_three.rollout.sequences == 3 * 8  # ⌈8 / 3⌉ prompts of 8 completions on the busiest rank


def test_fused_rmsnorm_kernels_keep_16_bit_inputs_in_the_prediction():
    """With the fused RMSNorm kernels (ops/rmsnorm.py) the layer keeps the norms' 16-bit inputs instead of float32
    copies, and their backward writes one [T, H] gradient instead of five float32 temporaries: per token the kept
    bytes fall by 2·H·(4 − 2), and the backward's largest transient is the attention's, not the norm's. The
    planner applies it to GPU runs of Llama-family models with model.fused_layers on."""
    from types import SimpleNamespace

    from longrl.memory.planner import (attention_backward_bytes, fused_norms_apply, layer_kept_bytes, predict)

    T, h = 8192, LLAMA_8B.hidden
    plain = layer_kept_bytes(LLAMA_8B, T, 2, tile=1024, lora_r=32, offload=True)
    fused = layer_kept_bytes(LLAMA_8B, T, 2, tile=1024, lora_r=32, offload=True, norm_bytes=2)
    assert plain - fused == T * 2 * h * (4 - 2)
    common = dict(tokens=T, lora_r=32, weight_bytes=2, offload=True, gpu_resident=0, chunk=1024, mlp_tile=1024,
                  logprob_kernel=True)
    _, _, parts_plain = predict(LLAMA_8B, **common)
    _, _, parts_fused = predict(LLAMA_8B, **common, fused_norms=True)
    transient = parts_fused["layer recompute"] - fused
    assert transient == attention_backward_bytes(T, h, LLAMA_8B.q_dim, LLAMA_8B.kv_dim, 2, norm_bytes=2)
    assert parts_plain["layer recompute"] - plain == 5 * T * h * 4  # transformers' norm backward was the largest
    run = SimpleNamespace(model=SimpleNamespace(fused_layers=True, device="auto"))
    llama, gemma = SimpleNamespace(model_type="llama"), SimpleNamespace(model_type="gemma2")
    assert fused_norms_apply(run, llama) and not fused_norms_apply(run, gemma)
    run.model.device = "cpu"
    assert not fused_norms_apply(run, llama)
    run.model.device, run.model.fused_layers = "cuda", False
    assert not fused_norms_apply(run, llama)


def test_layers_not_recomputed_fill_the_planners_share_of_plentiful_memory():
    """model.no_recompute_layers left null: with memory to spare (the 8B 20K job on an 80 GB card) the planner takes
    the last layers out of checkpointing while the step fits in KEPT_LAYERS_SHARE of the memory, as many as fit and
    no more; each counts kept + 3 T I b. With more memory (139 GiB) every layer; in a 40 GiB budget, with MLP tiles,
    or pinned, it takes what it is given."""
    from longrl.memory.planner import KEPT_LAYERS_SHARE, layer_kept_bytes, plan_for_config

    job = ("generation.max_completion_length=19968", "train.prompts_per_step=1")
    card = int(78.55 * GIB)  # an H100's free memory
    plan = plan_for_config(_run_cfg(*job), _llama_config(), card, 500 * GIB)
    W, T = plan.no_recompute_layers, plan.micro_batch_tokens
    assert 0 < W < 32 and plan.offload and plan.mlp_tile_tokens is None
    share = int(card * KEPT_LAYERS_SHARE * safety_fraction())
    assert plan.predicted_gpu_bytes <= share
    per_layer = layer_kept_bytes(LLAMA_8B, T, 2, tile=T, lora_r=32, offload=False, norm_bytes=2) + 3 * T * 14336 * 2
    assert plan.parts_gpu_bytes["layers not recomputed"] == W * per_layer
    more = plan_for_config(_run_cfg(*job, f"model.no_recompute_layers={W + 1}"), _llama_config(), card, 500 * GIB)
    assert more.no_recompute_layers == W + 1 and more.predicted_gpu_bytes > share  # one more would not fit
    assert more.gpu_resident_layers <= 32 - (W + 1)  # the checkpointed layers' inputs only
    budget = plan_for_config(_run_cfg(*job, "train.gpu_memory_gib=40"), _llama_config(), card, 500 * GIB)
    tiled = plan_for_config(_run_cfg(*job, "train.mlp_tile_tokens=4096"), _llama_config(), card, 500 * GIB)
    pinned = plan_for_config(_run_cfg(*job, "model.no_recompute_layers=0"), _llama_config(), card, 500 * GIB)
    assert budget.no_recompute_layers == tiled.no_recompute_layers == pinned.no_recompute_layers == 0
    assert "layers not recomputed" not in pinned.parts_gpu_bytes
    roomy = plan_for_config(_run_cfg(*job), _llama_config(), 139 * GIB, 500 * GIB)
    assert roomy.no_recompute_layers == 32
    assert roomy.predicted_gpu_bytes <= 139 * GIB * KEPT_LAYERS_SHARE * safety_fraction()
    assert pinned.predicted_gpu_bytes < plan.predicted_gpu_bytes
    assert "layers not recomputed" in plan.table()


def test_no_recompute_layers_config_errors_name_the_key():
    from longrl.config import ConfigError

    with pytest.raises(ConfigError, match="model.no_recompute_layers"):
        _run_cfg("model.no_recompute_layers=-1")
    with pytest.raises(ConfigError, match="model.no_recompute_layers"):
        _run_cfg("model.no_recompute_layers=true")
    # without checkpointing every layer keeps its activations anyway: accepted (a saved, resolved layout may say so)
    assert _run_cfg("model.no_recompute_layers=2", "model.gradient_checkpointing=false").model.no_recompute_layers == 2


def test_pinned_layers_not_recomputed_that_do_not_fit_name_the_key():
    from longrl.memory.planner import plan_for_config

    with pytest.raises(PlanError, match=r"lower model.no_recompute_layers \(now 32\)"):
        plan_for_config(_run_cfg("generation.max_completion_length=19968", "train.prompts_per_step=1",
                                 "model.no_recompute_layers=32", "train.gpu_memory_gib=60"), _llama_config(),
                        139 * GIB, 500 * GIB)


def test_a_pinned_count_of_layers_not_recomputed_sizes_the_micro_batch():
    """model.no_recompute_layers pinned: the token budget and the resident inputs are chosen with those layers'
    activations counted, so the plan shrinks the micro-batch to fit rather than failing."""
    from longrl.memory.planner import plan_for_config

    job = ("generation.max_completion_length=1536", "train.prompts_per_step=8", "train.gpu_memory_gib=36",
           "model.offload_activations=true")
    free = plan_for_config(_run_cfg(*job, "model.no_recompute_layers=0"), _llama_config(), 139 * GIB, 500 * GIB)
    pinned = plan_for_config(_run_cfg(*job, "model.no_recompute_layers=8"), _llama_config(), 139 * GIB, 500 * GIB)
    assert pinned.no_recompute_layers == 8 and pinned.predicted_gpu_bytes <= 36 * GIB
    assert pinned.micro_batch_tokens < free.micro_batch_tokens


def test_cudnn_attention_backward_counts_float32_dk_dv_and_a_statistic_per_head():
    """cuDNN's backward (where SDPA runs it: training_attention_kernel) holds float32 dq [T, Q], dk and dv [T, K] and a
    float32 statistic per query head, 24,704 bytes a token for the 8B heads (measured to the byte on an H200),
    instead of flash's float32 dq and dk, dv expanded to the query heads (32,768); with as many key as query heads
    (keys/values repeated for it) only the statistic differs from flash's count."""
    from longrl.memory.planner import attention_backward_bytes

    T, h, q, k, b = 5003, 4096, 4096, 1024, 2
    flash = attention_backward_bytes(T, h, q, k, b)
    cudnn = attention_backward_bytes(T, h, q, k, b, kernel="cudnn", heads=32)
    assert flash - cudnn == T * (32768 - 24704)
    assert (attention_backward_bytes(T, h, q, q, b, kernel="cudnn", heads=32)
            - attention_backward_bytes(T, h, q, q, b)) == T * 32 * 4
    # the grouped path runs flash kernels per key head whatever SDPA's own call would run
    assert (attention_backward_bytes(T, h, q, k, b, groups=8, kernel="cudnn", heads=32)
            == attention_backward_bytes(T, h, q, k, b, groups=8))
    T = 65537  # long enough that the attention backward is the layer's largest transient
    gpu = lambda kernel: predict(LLAMA_8B, tokens=T, lora_r=32, weight_bytes=2, offload=True, gpu_resident=0,  # noqa
                                 chunk=1024, mlp_tile=4096, fused_norms=True, logprob_kernel=True,
                                 attention_kernel=kernel)[0]
    assert gpu("flash") - gpu("cudnn") == T * 8064


def test_training_attention_kernel_without_a_gpu_and_with_a_listed_backend():
    from longrl.ops.attention_backend import training_attention_kernel

    assert training_attention_kernel(["cudnn", "flash"], 32, 8, 128, "cpu") == "cudnn"
    assert training_attention_kernel(["flash"], 32, 8, 128, "cuda") == "flash"
    assert training_attention_kernel(["efficient"], 32, 8, 128, "cuda") == "flash"
    assert training_attention_kernel([], 32, 8, 128, "cpu") == "flash"  # cannot ask: the larger GQA count


def test_safety_fraction_follows_the_allocator_settings():
    assert safety_fraction({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}) == 0.95
    assert safety_fraction({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128, expandable_segments:true"}) == 0.95
    assert safety_fraction({"PYTORCH_ALLOC_CONF": "max_split_size_mb:128"}) == 0.92
    assert safety_fraction({}) == 0.92


def test_saved_config_is_the_users_and_the_layout_is_saved_beside_it(tmp_path):
    """config.yaml holds the config as asked (defaults filled in, layout keys left null as written: nothing the
    planner or the layout resolution chose); layout.yaml beside it holds the layout the run used. An SFT run's
    epochs stay epochs: the step count they give is not written into train.max_steps."""
    import yaml

    from longrl import GRPOTrainer, SFTTrainer
    from longrl.config import load_config
    from longrl.config.demo import demo_config, sft_warm_start_config

    quick = ["train.max_steps=1", "train.prompts_per_step=2", "grpo.num_generations=2", "data.num_examples=16",
             "output.progress_bar=false", "output.tensorboard=false", "model.offload_activations=null",
             "model.reuse_attention=null", "train.mlp_tile_tokens=null", f"output.output_dir={tmp_path / 'grpo'}"]
    asked = load_config(None, quick, base=demo_config())
    trainer = GRPOTrainer(load_config(None, quick, base=demo_config()))
    trainer.train()
    saved = load_config(tmp_path / "grpo" / "config.yaml")
    assert saved.to_dict() == asked.to_dict()
    assert saved.model.offload_activations is None and saved.train.mlp_tile_tokens is None
    layout = yaml.safe_load((tmp_path / "grpo" / "layout.yaml").read_text())
    assert layout == trainer.layout.to_dict() and layout["model.offload_activations"] is False
    assert layout["planned"] is False  # the CPU: nothing planned, null keys off

    sft = [f"output.output_dir={tmp_path / 'sft'}", "sft.num_train_epochs=0.1", "output.progress_bar=false",
           "output.tensorboard=false"]
    asked = load_config(None, sft, base=sft_warm_start_config(demo_config()))
    trainer = SFTTrainer(load_config(None, sft, base=sft_warm_start_config(demo_config())))
    assert trainer.max_steps != asked.train.max_steps
    trainer.train()
    saved = load_config(tmp_path / "sft" / "config.yaml")
    assert saved.to_dict() == asked.to_dict() and saved.train.max_steps == asked.train.max_steps


def test_speculative_rollouts_count_their_verify_logits_and_drafts():
    """Speculative rollouts add the verify step's float32 logits of k + 1 positions a sequence (capped by the extend
    workspace), the device drafts' sources and the matcher's temporaries to the rollout's fixed memory, as the
    sampler sizes its KV cache; the KV cache gets what is left; a config with generation.speculative plans them."""
    from transformers import LlamaConfig

    from longrl.config import load_config
    from longrl.memory.planner import EXTEND_WORKSPACE_BYTES, plan_for_config, speculative_workspace_bytes

    key = "speculative (verify logits, drafts)"
    kw = dict(prompts=4, G=8, prompt_len=512, completion_len=4096, lora_r=32, weight_bytes=2, compute_bytes=2,
              gpu_free_bytes=139 * GIB)
    plain, spec = plan_rollout(LLAMA_8B, **kw), plan_rollout(LLAMA_8B, **kw, speculative_drafts=4)
    assert key not in plain.parts_gpu_bytes and spec.parts_gpu_bytes[key] > 32 * 5 * LLAMA_8B.vocab * 4
    assert (spec.predicted_gpu_bytes - spec.parts_gpu_bytes["KV cache"]
            == plain.predicted_gpu_bytes - plain.parts_gpu_bytes["KV cache"] + spec.parts_gpu_bytes[key])
    slots = [(plan_rollout(LLAMA_8B, **dict(kw, gpu_free_bytes=b * GIB // 8), speculative_drafts=4).slots,
              plan_rollout(LLAMA_8B, **dict(kw, gpu_free_bytes=b * GIB // 8)).slots) for b in range(8 * 21, 8 * 25)]
    assert all(a <= b for a, b in slots) and any(a < b for a, b in slots)  # tight budgets: fewer slots
    few, many = (speculative_workspace_bytes(LLAMA_8B.vocab, n, 4, 1, 512, 1024, 8192) for n in (8, 4096))
    assert few - speculative_workspace_bytes(LLAMA_8B.vocab, 8, 4, 1, 512, 1024, 0) == 8192 * 8  # the history
    assert many - speculative_workspace_bytes(LLAMA_8B.vocab, 4096, 1, 1, 512, 1024, 8192) == 0  # logits capped
    assert many >= EXTEND_WORKSPACE_BYTES
    model = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=128256)
    for speculative, counted in (([], False), (["generation.speculative=ngram"], True)):  # (off: the default)
        cfg = load_config(overrides=speculative + ["rewards=[{function: 'longrl.tasks.arithmetic:format_reward'}]"])
        assert (key in plan_for_config(cfg, model, 139 * GIB, 500 * GIB).rollout.parts_gpu_bytes) == counted


def test_the_sampler_sizes_its_kv_cache_after_the_speculative_workspace():
    from test_sampler import PROMPTS, tiny_model

    from longrl.memory.planner import DRAFT_HISTORY_TOKENS, speculative_workspace_bytes
    from longrl.rollout import Sampler, SamplingParams
    from longrl.rollout.sampler import _Run

    model, tok = tiny_model(seed=0)
    params = SamplingParams(max_new_tokens=12)
    plain, spec = (_Run(Sampler(model, tok, speculative=s, max_draft_tokens=3), PROMPTS, 4, params)
                   for s in ("off", "ngram"))
    want = speculative_workspace_bytes(model.config.vocab_size, len(PROMPTS) * 4, 3, len(PROMPTS),
                                       max(map(len, PROMPTS)), 12, DRAFT_HISTORY_TOKENS)
    assert spec._workspace_bytes() - plain._workspace_bytes() == want > 0
