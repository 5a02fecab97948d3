"""Training-time fused LoRA (models/lora_training.py) against PEFT's own forward and backward."""

from __future__ import annotations

import pytest
import torch
from test_lora_fusion import llama, randomise_adapters
from test_memory import _base, _batch, _grads, bf16_gradient_errors

from longrl.config.schema import LoraConfig
from longrl.models import apply_lora
from longrl.models.lora_training import FusedLoraLinear, fused_lora_training


class _NormInItsDtype(torch.nn.Module):
    """RMSNorm computed in its input's dtype: y = x · rsqrt(mean(x²) + ε) · w. transformers' Llama/Qwen2 norms
    compute in float32 even for a float64 model, so a 1e-16 change in the gradient reaching them can move their
    float32 rounding (1e-8 relative); the exactness tests below compare float64 paths through these instead."""

    def __init__(self, norm):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.variance_epsilon

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def float64_exact(model):
    """``model`` in float64 with its RMSNorms computed in float64 (see :class:`_NormInItsDtype`)."""
    model = model.double()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__.endswith("RMSNorm"):
                setattr(parent, name, _NormInItsDtype(child))
    return model


def assert_close_normwise(got: torch.Tensor, want: torch.Tensor, rel: float, msg: str) -> None:
    """‖got − want‖ ≤ rel · ‖want‖: a summation-order difference in float64 stays near 1e-16 of the tensor's scale
    (1e-11 here at most, where the tiny random model amplifies it), a real difference is orders of magnitude above."""
    err, scale = float((got - want).norm()), float(want.norm())
    assert err <= rel * scale, f"{msg}: ‖Δ‖ = {err:.3g}, ‖g‖ = {scale:.3g}"


@pytest.mark.parametrize("mode", ["none", "offload", "reuse"])
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_fused_training_gradients_equal_peft(mode, dropout):
    """Log-probs and every LoRA gradient as PEFT's, through offloaded checkpointing's recompute too; with dropout
    the masks are PEFT's (same modules, same RNG order). In float64: the tiny model's backward amplifies float32
    rounding (the sum inside the product) to ~1e-3 relative, which would hide a real difference."""
    base, batch = float64_exact(_base()), _batch(torch.seed() % 1000)
    lp, grads = _grads(base, mode, True, dropout, True, batch)
    lp_f, grads_f = _grads(base, mode, True, dropout, True, batch, fused_lora=True)
    torch.testing.assert_close(lp_f, lp, atol=1e-10, rtol=1e-10)
    assert grads_f.keys() == grads.keys() and any("lora_A" in k for k in grads)
    for k in grads:
        assert_close_normwise(grads_f[k], grads[k], 1e-9, k)


@pytest.mark.parametrize("mode", ["none", "offload"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_lora_add_equals_its_out_of_place_twin_exactly(monkeypatch, mode, dtype):
    """The B product added into the base product's own output (addmm_) is the same computation as the
    out-of-place addmm: log-probs and every LoRA gradient bit for bit, through the checkpoint's recompute too, in
    float32 and under bf16 autocast; and no [N, out] copy is made for it."""
    base, batch = _base(layers=2), _batch(torch.seed() % 1000)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is torch.bfloat16)
    monkeypatch.setattr(FusedLoraLinear, "grouped", False)  # each projection's own product
    with autocast:
        lp, grads = _grads(base, mode, True, 0.0, True, batch, fused_lora=True)
        monkeypatch.setattr(FusedLoraLinear, "in_place", False)
        lp_ref, grads_ref = _grads(base, mode, True, 0.0, True, batch, fused_lora=True)
    assert torch.equal(lp, lp_ref)
    assert grads.keys() == grads_ref.keys() and any("lora_B" in k for k in grads)
    for k in grads:
        assert torch.equal(grads[k], grads_ref[k]), k


def test_in_place_lora_add_makes_no_copy():
    """The fused projection's forward runs no copy of its [N, out] product (an out-of-place addmm would copy it
    first), alone or in its sibling group; its twin does, once a projection."""
    from torch.profiler import ProfilerActivity, profile

    model = apply_lora(llama(0, layers=1), LoraConfig(r=3, alpha=5.0))
    randomise_adapters(model, 1)
    ids = torch.randint(0, 97, (2, 7))

    def copies_in_addmm(in_place: bool, grouped: bool) -> int:
        FusedLoraLinear.in_place, FusedLoraLinear.grouped = in_place, grouped
        try:
            with fused_lora_training(model), profile(activities=[ProfilerActivity.CPU]) as prof:
                model(input_ids=ids)
        finally:
            FusedLoraLinear.in_place = FusedLoraLinear.grouped = True
        return sum(1 for e in prof.events() if e.name == "aten::copy_" and e.cpu_parent is not None
                   and e.cpu_parent.name.startswith("aten::addmm"))

    assert copies_in_addmm(False, False) == 7  # q, k, v, o, gate, up, down
    assert copies_in_addmm(True, False) == 0
    assert copies_in_addmm(True, True) == 0


@pytest.mark.parametrize("mode", ["none", "plain", "offload"])
def test_sibling_group_product_equals_each_projections_own(monkeypatch, mode):
    """q/k/v, gate/up, o and down as one _LoraGroupProduct per group (the input gradient summed inside the
    products) against each projection's own product with autograd's sums: float64 log-probs and LoRA gradients
    equal up to summation order, on a model with biased q/k/v projections (Qwen2) and one without (Llama)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    qwen_cfg = Qwen2Config(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    for base in (float64_exact(_base(layers=2)), float64_exact(Qwen2ForCausalLM(qwen_cfg))):
        batch = _batch(torch.seed() % 1000)
        lp, grads = _grads(base, mode, True, 0.0, True, batch, fused_lora=True)
        monkeypatch.setattr(FusedLoraLinear, "grouped", False)
        lp_ref, grads_ref = _grads(base, mode, True, 0.0, True, batch, fused_lora=True)
        monkeypatch.setattr(FusedLoraLinear, "grouped", True)
        torch.testing.assert_close(lp, lp_ref, atol=1e-12, rtol=1e-12)
        assert grads.keys() == grads_ref.keys() and any("lora_A" in k for k in grads)
        for k in grads:
            assert_close_normwise(grads[k], grads_ref[k], 1e-9, k)


def test_sibling_group_backward_adds_no_input_gradients():
    """In backward, the grouped products leave autograd none of the [N, in] input-gradient sums of a layer's
    projections (q/k/v, gate/up, o and down, each with its A product's share): with the twin, autograd adds
    them (11 for this 2-layer model); the sums that remain are the residual stream's and the norms'."""
    from torch.profiler import ProfilerActivity, profile

    model = apply_lora(llama(0, layers=2), LoraConfig(r=3, alpha=5.0))
    randomise_adapters(model, 1)
    ids = torch.randint(0, 97, (2, 7))

    def backward_adds(grouped: bool) -> int:
        FusedLoraLinear.grouped = grouped
        try:
            with fused_lora_training(model):
                loss = model(input_ids=ids).logits.float().square().mean()
                with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                    loss.backward()
        finally:
            FusedLoraLinear.grouped = True
        model.zero_grad(set_to_none=True)
        return sum(1 for e in prof.events() if e.name in ("aten::add", "aten::add_")
                   and e.input_shapes and e.input_shapes[0] in ([2, 7, 48], [2, 7, 80], [14, 48], [14, 80]))

    assert backward_adds(False) - backward_adds(True) >= 5 * 2


def test_fused_training_in_bf16_is_as_accurate_as_peft():
    """Under bf16 autocast (the trainer's mixed precision) the fused LoRA's gradients are no further from the float32
    model's than PEFT's own (the sum inside the product rounds once where PEFT rounds the product, the scale and
    the sum)."""
    errors = bf16_gradient_errors(_base(layers=3), _batch(5, n=4), fused_layers=False)
    assert errors["peft"] < 0.2 and errors["fused_layers+lora"] <= 1.5 * errors["peft"] + 1e-3, errors


def test_fused_training_swaps_in_and_out_and_steps_aside():
    model = apply_lora(llama(0, layers=2), LoraConfig(r=3, alpha=5.0))
    randomise_adapters(model, 1)
    keys = list(model.state_dict())
    modules = dict(model.named_modules())
    ids = torch.randint(0, 97, (2, 7))
    with fused_lora_training(model) as fused:
        assert fused
        wrapped = [m for m in model.modules() if isinstance(m, FusedLoraLinear)]
        assert len(wrapped) == 2 * 7 and list(model.state_dict()) == keys
        got = model(input_ids=ids).logits
        shared = {id(m.shared) for m in wrapped if m.shared is not None}
        assert len(shared) == 2 * 2  # q/k/v and gate/up of each layer share one A product
        assert all(m.shared.x is None for m in wrapped if m.shared is not None)  # no activation kept after
        assert all(m.group is not None and m.group.x is None and m.group.outs is None for m in wrapped)
        with fused_lora_training(model) as nested:  # the wrappers already add the adapters: nothing to swap
            assert not nested
            torch.testing.assert_close(model(input_ids=ids).logits, got, atol=0, rtol=0)
    assert dict(model.named_modules()).keys() == modules.keys()
    assert all(modules[n] is m for n, m in model.named_modules())  # the very modules are back
    torch.testing.assert_close(got, model(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    with model.disable_adapter(), fused_lora_training(model) as fused:  # the reference pass: PEFT's forward
        assert not fused
    plain = llama(0, layers=2)
    with fused_lora_training(plain) as fused:
        assert not fused


def test_fused_training_on_a_4bit_base_equals_peft():
    """QLoRA: the wrappers call bitsandbytes' 4-bit base layer as PEFT does; log-probs and LoRA gradients equal
    PEFT's up to float32 summation order (the sum inside the product)."""
    bnb = pytest.importorskip("bitsandbytes")
    from longrl.models import base_model, load_model
    from longrl.models.policy import sequence_logprobs

    model, tok = load_model("builtin:tiny-arith", lora=LoraConfig(r=8, alpha=16), device="cpu", load_in_4bit=True)
    assert isinstance(base_model(model).model.layers[0].mlp.up_proj.base_layer, bnb.nn.Linear4bit)
    randomise_adapters(model, 4)
    prompts = [[tok.bos_token_id, 5, 6, 7], [tok.bos_token_id, 8, 9]]
    completions = [[10, 11, 12], [13, 14]]
    results = []
    for fused in (False, True):
        model.zero_grad(set_to_none=True)
        with fused_lora_training(model) if fused else torch.enable_grad() as active:
            assert not fused or active
            lp, _ = sequence_logprobs(model, prompts, completions, 3, pad_id=tok.pad_token_id)
            lp.sum().backward()
        results.append((lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (lp_p, g_p), (lp_f, g_f) = results
    torch.testing.assert_close(lp_f, lp_p, atol=1e-4, rtol=1e-4)
    assert g_f.keys() == g_p.keys() and len(g_p) > 0
    for k in g_p:
        torch.testing.assert_close(g_f[k], g_p[k], atol=1e-4, rtol=1e-3, msg=k)
