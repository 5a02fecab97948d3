"""FP8 bases on the CPU: the e4m3 block round trip within half an ulp, FP8Linear against its twin (forward and input
gradient), PEFT's LoRA on it (merging into FP8 refused, exports merge into 16-bit), dtype casts that keep the codes,
the exceptions a 4-bit base keeps, config errors naming the keys, the planner's FP8 bytes, and a tiny Llama loaded
with load_in_fp8 that trains GRPO steps, saves adapters only, resumes and exports."""

import pytest
import torch

from longrl.config import ConfigError, LoraConfig, load_config
from longrl.config.demo import demo_config
from longrl.models import ModelLoadError, base_model, load_model
from longrl.models.fp8_linear import FP8Linear, dequantize_fp8_linears, fp8_layers, fp8_linear_reference
from longrl.ops.fp8_blocks import (E4M3_MAX, FP8_BYTES_PER_PARAM, dequantize_fp8, dequantize_fp8_reference,
                                   expanded_scales, fp8_bytes, quantize_fp8_blocks)

SHAPES = [(1, 1), (3, 200), (130, 129), (257, 384), (128, 128)]  # odd, block-crossing, whole blocks


@pytest.mark.parametrize("N, K", SHAPES)
def test_round_trip_error_within_half_an_ulp(N, K):
    """|W − Ŵ| ≤ 2⁻⁴ |W| where W/s is a normal e4m3 number (3 mantissa bits: half an ulp), ≤ 2⁻¹⁰ s below it; per
    block, the largest error ≤ 2⁻⁴ of the block's largest weight; each block's largest weight maps to ±448."""
    torch.manual_seed(N * K)
    w = torch.randn(N, K) * torch.logspace(-3, 1, K)  # columns of very different sizes: several blocks' scales
    q, s = quantize_fp8_blocks(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (-(-N // 128), -(-K // 128))
    w_hat = dequantize_fp8_reference(q, s, torch.float32)
    scale = expanded_scales(s, N, K)
    err = (w - w_hat).abs()
    assert (err <= torch.maximum(2 ** -4 * w.abs(), 2 ** -10 * scale) * (1 + 1e-6)).all()
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            block = (slice(128 * i, 128 * i + 128), slice(128 * j, 128 * j + 128))
            assert err[block].max() <= 2 ** -4 * w[block].abs().max() * (1 + 1e-6)
            assert q[block].float().abs().max() == E4M3_MAX
    assert fp8_bytes(N, K) == q.numel() + 4 * s.numel()


def test_zero_blocks_and_bytes():
    q, s = quantize_fp8_blocks(torch.zeros(130, 5))
    assert torch.equal(s, torch.ones(2, 1)) and (dequantize_fp8_reference(q, s, torch.float32) == 0).all()
    assert abs(fp8_bytes(4096, 4096) / 4096 ** 2 - FP8_BYTES_PER_PARAM) < 1e-9


def _layer(N: int, K: int, bias: bool, seed: int) -> tuple[torch.nn.Linear, FP8Linear]:
    torch.manual_seed(seed)
    lin = torch.nn.Linear(K, N, bias=bias)
    return lin, FP8Linear.from_linear(lin, torch.float32)


@pytest.mark.parametrize("N, K, bias", [(3, 200, True), (130, 129, False), (257, 384, True)])
def test_fp8_linear_equals_its_twin(N, K, bias):
    """float32 on the CPU: the module (dequantize per call, re-dequantize in backward) and the twin (autograd
    through the whole dequantized matrix) give the same outputs and input gradients, for fresh inputs with leading
    dimensions; the frozen base gets no gradient."""
    lin, layer = _layer(N, K, bias, seed=N + K)
    assert not any(p.requires_grad for p in layer.parameters())
    for rows in (1, 3, 17):
        x = torch.randn(2, rows, K, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_(True)
        y, y_ref = layer(x), fp8_linear_reference(x_ref, layer)
        assert y.shape == (2, rows, N) and torch.equal(y, y_ref)
        dy = torch.randn_like(y)
        y.backward(dy)
        y_ref.backward(dy)
        assert torch.allclose(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    assert layer.weight.grad is None
    # and close to the 16-bit layer it came from (e4m3: about 2⁻⁵ relative per weight)
    x = torch.randn(5, K)
    assert (layer(x) - lin(x)).norm() / lin(x).norm() < 0.05


def test_autocast_runs_the_product_in_its_dtype():
    _, layer = _layer(40, 72, True, seed=1)
    x = torch.randn(3, 72)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    want = torch.nn.functional.linear(x.bfloat16(), dequantize_fp8_reference(layer.weight, layer.weight_scale,
                                                                              torch.bfloat16), layer.bias.bfloat16())
    assert torch.equal(y, want)


def test_dtype_casts_keep_codes_and_scales():
    """model.to(bfloat16) / .half() / .float() reach the bias alone: cast codes would lose their scales."""
    _, layer = _layer(140, 130, True, seed=2)
    codes, scales = layer.weight.clone(), layer.weight_scale.clone()
    model = torch.nn.Sequential(layer)
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.float()):
        cast(model)
        assert torch.equal(layer.weight.view(torch.uint8), codes.view(torch.uint8))
        assert torch.equal(layer.weight_scale, scales) and layer.weight_scale.dtype == torch.float32
        assert layer.compute_dtype == layer.bias.dtype
    assert layer.bias.dtype == torch.float32 and layer.compute_dtype == torch.float32


def test_dequantize_dispatch_uses_the_twin_on_the_cpu():
    q, s = quantize_fp8_blocks(torch.randn(33, 140))
    assert torch.equal(dequantize_fp8(q, s, torch.float16), dequantize_fp8_reference(q, s, torch.float16))


def _fp8_tiny(**kw):
    return load_model("builtin:tiny-arith", device="cpu", load_in_fp8=True, **kw)


def test_load_keeps_the_4bit_exceptions_and_peft_wraps_fp8_layers():
    """The LM head (always), the keep-list and the most sensitive modules within the budget stay 16-bit, as with a
    4-bit base; PEFT puts its LoRA Linear on the FP8 layers (float32 adapters); PEFT's in-place merge is refused by
    torch (no float8 sum) and leaves the codes as they were."""
    model, _ = _fp8_tiny(lora=LoraConfig(r=4), quant_keep_modules=["layers.0.mlp.down_proj"],
                         quant_exception_budget=0.0)
    base = base_model(model)
    report = base.longrl_quant_report
    assert report.fmt.label == "FP8 e4m3" and "lm_head" in report.kept
    assert "model.layers.0.mlp.down_proj" in report.kept and report.exception_bytes > 0
    layers = fp8_layers(base)
    assert {n.removesuffix(".base_layer") for n in layers} == set(report.quantized)
    wrapped = [m for m in model.modules() if hasattr(m, "lora_A") and isinstance(m.base_layer, FP8Linear)]
    assert len(wrapped) == len(report.quantized)
    assert all(m.lora_A["default"].weight.dtype == torch.float32 for m in wrapped)
    before = {n: m.weight.view(torch.uint8).clone() for n, m in layers.items()}
    with torch.no_grad():
        for m in wrapped:
            m.lora_B["default"].weight.normal_()
    for safe in (False, True):
        with pytest.raises(RuntimeError, match="[Ff]loat8"):
            wrapped[0].merge(safe_merge=safe)
    assert all(torch.equal(before[n], m.weight.view(torch.uint8)) for n, m in layers.items())


def test_export_merges_into_16_bit_dequantized_weights():
    """dequantize_fp8_linears, then PEFT's merge: the merged model's outputs are the dequantized model's with the
    adapters (the sum happens in 16/32 bits, never in e4m3)."""
    model, _ = _fp8_tiny(lora=LoraConfig(r=4))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    ids = torch.tensor([[1, 5, 14, 6, 17, 3]])
    want = model(input_ids=ids).logits
    assert dequantize_fp8_linears(base_model(model), torch.float32) > 0
    assert not fp8_layers(model)
    assert torch.allclose(model(input_ids=ids).logits, want, atol=1e-5)
    merged = model.merge_and_unload()
    assert torch.allclose(merged(input_ids=ids).logits, want, atol=1e-4)


@pytest.mark.parametrize("overrides, keys", [
    (["model.load_in_fp8=true", "model.load_in_4bit=true"], ("model.load_in_fp8", "model.load_in_4bit")),
    (["model.load_in_fp8=true", "lora.enabled=false"], ("model.load_in_fp8", "lora.enabled")),
    (["model.load_in_fp8=maybe"], ("model.load_in_fp8",)),
])
def test_config_errors_name_the_keys(overrides, keys):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides, base=demo_config())
    assert all(k in str(err.value) for k in keys), str(err.value)


def test_load_model_refuses_both_quantizations_before_loading():
    with pytest.raises(ModelLoadError, match=r"model\.load_in_4bit.*model\.load_in_fp8"):
        load_model("builtin:tiny-arith", device="cpu", load_in_4bit=True, load_in_fp8=True)


def test_unsloth_names():
    from longrl.compat.unsloth import FastLanguageModel

    model, _ = FastLanguageModel.from_pretrained("builtin:tiny-arith", load_in_fp8=True, device="cpu")
    assert fp8_layers(model) and not getattr(model, "is_loaded_in_4bit", False)
    with pytest.raises(ValueError, match="load_in_4bit=True, load_in_fp8=True"):
        FastLanguageModel.from_pretrained("builtin:tiny-arith", load_in_4bit=True, load_in_fp8=True, device="cpu")


def test_planner_counts_fp8_weights():
    from transformers import LlamaConfig

    from longrl.memory.planner import GIB, ModelShape, plan_for_config

    llama8b = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)
    over = ["data.max_prompt_length=512", "generation.max_completion_length=4096", "train.prompts_per_step=1",
            "grpo.num_generations=8", "model.offload_activations=true", "model.dtype=bfloat16", "lora.enabled=true",
            "model.no_recompute_layers=0"]
    bf16 = plan_for_config(load_config(None, over, base=demo_config()), llama8b, 139 * GIB, 500 * GIB)
    q = plan_for_config(load_config(None, over + ["model.load_in_fp8=true"], base=demo_config()), llama8b,
                        139 * GIB, 500 * GIB)
    shape = ModelShape.from_config(llama8b)
    plain = shape.linear_params() * FP8_BYTES_PER_PARAM + (shape.base_params() - shape.linear_params()) * 2
    weights = q.parts_gpu_bytes["base weights (FP8 e4m3)"]
    assert weights == int(plain * 1.10) and 8.5 < weights / GIB < 9.5  # 6.5 GiB of projections + 1.96 GiB rest
    assert "FP8 dequantized weights" in q.parts_gpu_bytes
    assert q.rollout.parts_gpu_bytes["base weights"] == weights
    # the weights' ~6 GiB less, minus what only the FP8 step holds (a dequantized weight in forward and backward)
    assert bf16.predicted_gpu_bytes - q.predicted_gpu_bytes > 5.0 * GIB


QUICK = ["train.prompts_per_step=4", "grpo.num_generations=4", "train.micro_batch_size=8", "output.progress_bar=false",
         "output.tensorboard=false", "model.load_in_fp8=true", "lora.enabled=true", "model.quant_exception_budget=0.3",
         "grpo.beta=0.05"]


def test_fp8_grpo_trains_saves_adapters_resumes_and_exports(tmp_path):
    """GRPO on an FP8 tiny Llama (reference pass: the FP8 base, adapters off): a run resumed from its step-2
    checkpoint logs the same metrics as an uninterrupted one; checkpoints hold the adapters and no base weights;
    the merged export (16-bit, from the dequantized base) gives the trained model's outputs."""
    from safetensors import safe_open

    from longrl.compat.trl import GRPOTrainer
    from longrl.export import export_checkpoint
    from longrl.export.source import load_trained, read_checkpoint
    from longrl.training.reporting import read_metrics

    def cfg(out, *extra):
        return load_config(None, QUICK + [f"output.output_dir={out}", "output.save_steps=2", *extra],
                           base=demo_config())

    full = GRPOTrainer(cfg(tmp_path / "full", "train.max_steps=4")).train()
    assert all(m["kl"] is not None and m["grad_norm"] > 0 for m in full)
    GRPOTrainer(cfg(tmp_path / "cut", "train.max_steps=2")).train()
    GRPOTrainer(cfg(tmp_path / "cut", "train.max_steps=4", "output.resume=true")).train()
    strip = lambda ms: [{k: v for k, v in m.items() if not k.endswith("time_s")} for m in ms]  # noqa: E731
    assert strip(read_metrics(tmp_path / "cut")) == strip(full)
    ckpt = tmp_path / "cut" / "checkpoint-4"
    assert not (ckpt / "base_model.safetensors").exists()
    with safe_open(str(ckpt / "adapter_model.safetensors"), framework="pt") as f:
        assert f.keys() and all("lora_" in k for k in f.keys())

    trained = load_trained(read_checkpoint(ckpt))  # the FP8 base re-quantized from the seed's weights + adapters
    assert fp8_layers(trained)
    ids = torch.tensor([[1, 5, 14, 6, 17, 3, 9]])
    with torch.no_grad():
        want = trained(input_ids=ids).logits
        dequantize_fp8_linears(base_model(trained), torch.float32)
        assert torch.allclose(trained(input_ids=ids).logits, want, atol=1e-5)
    from transformers import AutoModelForCausalLM

    out = export_checkpoint(ckpt, tmp_path / "merged", fmt="merged", dtype="float32")
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert not any("float8" in str(p.dtype) for p in merged.parameters())
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, want, atol=1e-4)


def test_a_checkpoint_from_before_the_key_resumes():
    """A run saved before model.load_in_fp8 existed resumes (the missing key counts as its default); one trained
    on another base does not."""
    from longrl.config import resume_conflicts

    cfg = load_config(None, ["lora.enabled=true"], base=demo_config())
    saved = cfg.to_dict()
    del saved["model"]["load_in_fp8"]
    assert resume_conflicts(saved, cfg) == []
    fp8 = load_config(None, ["lora.enabled=true", "model.load_in_fp8=true"], base=demo_config())
    assert resume_conflicts(saved, fp8) == ["model.load_in_fp8: False → True"]
