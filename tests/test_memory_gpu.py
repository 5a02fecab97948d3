"""Attention reuse on the GPU's fused SDPA kernels: packed micro-batches (a mask: the memory-efficient kernel) and
cuDNN first. Runs on a GPU machine (`bash benchmarks/device_run.sh kernel`); without CUDA there is nothing to run."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


class _OpNames(TorchDispatchMode):
    """The names of the aten ops that run inside it (without their overload)."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype, packed, backends", [
    (torch.float32, True, []), (torch.bfloat16, False, []), (torch.bfloat16, True, []),
    (torch.bfloat16, False, ["flash"]), (torch.bfloat16, False, ["cudnn"]), (torch.bfloat16, True, ["cudnn"]),
    (torch.bfloat16, False, ["efficient"]), (torch.bfloat16, True, ["efficient"])])
def test_reused_attention_equals_offloaded_checkpointing_on_cuda(dtype, packed, backends, monkeypatch):
    """Every attention output through the host pool (in the memory layout the kernel wrote, which its backward reads
    by): the log-probs and gradients of offloaded checkpointing bit for bit wherever two offloaded runs agree bit for
    bit (else within twice their difference: the kernels' own run-to-run noise), and no attention kernel in the
    recompute."""
    from test_memory import _base, _batch, _CountAttention, _grads

    from longrl.memory import ActivationOffloader
    from longrl.ops.attention_backend import sdpa_priority

    monkeypatch.setattr(ActivationOffloader, "EXTRA_MIN_BYTES", 0)
    base = _base(layers=3).to("cuda", dtype)
    prompts, completions = _batch(5, n=4)
    if not packed:  # equal lengths: stacked rows, no mask
        prompts, completions = [p[:1] for p in prompts], [(c * 9)[:9] for c in completions]
    autocast = torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32)  # as the trainer computes
    with sdpa_priority(backends, "cuda", base), autocast:
        lp_a, g_a = _grads(base, "offload", True, 0.1, packed, (prompts, completions))
        _, g_b = _grads(base, "offload", True, 0.1, packed, (prompts, completions))
        count = _CountAttention()
        lp, g = _grads(base, "reuse", True, 0.1, packed, (prompts, completions), backward_mode=count)
    assert count.calls == 0
    assert torch.equal(lp, lp_a)
    floor = max(float((g_b[k].float() - g_a[k].float()).abs().max()) for k in g_a)
    assert g.keys() == g_a.keys() and len(g_a) > 0
    for k in g_a:
        diff = float((g[k].float() - g_a[k].float()).abs().max())
        assert diff <= 2 * floor, (k, diff, floor)


@pytest.mark.parametrize("first, op", [("cudnn", "_scaled_dot_product_cudnn_attention"),
                                       ("flash", "_scaled_dot_product_flash_attention")])
def test_the_listed_backend_really_runs_for_a_gqa_model(first, op):
    """model.sdpa_backends=[cudnn] on a grouped-query model: the cuDNN kernel runs (transformers' enable_gqa call
    alone would fall back to flash), through longrl_sdpa_mha; the log-probs agree with flash's."""
    from test_memory import _base, _batch, _grads

    from longrl.ops.attention_backend import sdpa_priority

    base = _base(layers=2).to("cuda", torch.bfloat16)
    prompts, completions = _batch(5, n=2)
    prompts, completions = [p[:1] for p in prompts], [(c * 9)[:9] for c in completions]  # equal lengths: no mask
    seen = _OpNames()
    with sdpa_priority([first], "cuda", base), seen:
        lp, _ = _grads(base, "offload", True, 0.0, False, (prompts, completions))
    assert op in seen.names, sorted(n for n in seen.names if "attention" in n)
    with sdpa_priority(["flash"], "cuda", base):
        lp_flash, _ = _grads(base, "offload", True, 0.0, False, (prompts, completions))
    torch.testing.assert_close(lp, lp_flash, atol=2e-2, rtol=2e-2)


def test_the_planners_attention_kernel_is_the_one_transformers_call_runs():
    """Nothing listed (PyTorch's own choice): the kernel training_attention_kernel reads off a probe call is the one
    whose backward a grouped-query model's training step runs (the planner counts that kernel's transients)."""
    from test_memory import _base, _batch, _grads

    from longrl.ops.attention_backend import training_attention_kernel

    base = _base(layers=2).to("cuda", torch.bfloat16)
    prompts, completions = _batch(5, n=2)
    prompts, completions = [p[:1] for p in prompts], [(c * 9)[:9] for c in completions]  # equal lengths: no mask
    seen = _OpNames()
    with seen:
        _grads(base, "offload", True, 0.0, False, (prompts, completions))
    cfg = base.config
    kernel = training_attention_kernel([], cfg.num_attention_heads, cfg.num_key_value_heads,
                                       cfg.hidden_size // cfg.num_attention_heads, "cuda")
    assert f"_scaled_dot_product_{kernel}_attention_backward" in seen.names, sorted(
        n for n in seen.names if "attention" in n)


def test_fused_layers_match_transformers_modules_on_cuda():
    """The fused RMSNorm and SiLU·up kernels on the GPU: bf16 forwards rounded where transformers rounds (nearly
    every element equal), input gradients within bf16 rounding of transformers' own, and a tiny model's LoRA
    gradients through them (and through the fused LoRA, models/lora_training.py) close to the unfused model's."""
    from test_memory import _base, _batch, bf16_gradient_errors

    from longrl.ops.rmsnorm import RMSNormFunction, rmsnorm_reference
    from longrl.ops.swiglu import SiluMulFunction, silu_mul_reference

    torch.manual_seed(0)
    for D in (4096, 1000, 128):
        x = (torch.randn(333, D, device="cuda") * 2).bfloat16().requires_grad_(True)
        w = (1 + 0.2 * torch.randn(D, device="cuda")).bfloat16()
        dy = torch.randn(333, D, device="cuda").bfloat16()
        y = RMSNormFunction.apply(x, w, 1e-5)
        (dx,) = torch.autograd.grad(y, x, dy)
        y_ref = rmsnorm_reference(x, w, 1e-5)
        (dx_ref,) = torch.autograd.grad(y_ref, x, dy)
        assert float((y != y_ref).float().mean()) < 0.01, D
        torch.testing.assert_close(dx.float(), dx_ref.float(), atol=3e-2, rtol=3e-2)
    g = (torch.randn(77, 14336, device="cuda") * 3).bfloat16().requires_grad_(True)
    u = torch.randn(77, 14336, device="cuda").bfloat16().requires_grad_(True)
    dh = torch.randn(77, 14336, device="cuda").bfloat16()
    h = SiluMulFunction.apply(g, u)
    dg, du = torch.autograd.grad(h, (g, u), dh)
    h_ref = silu_mul_reference(g, u)
    dg_ref, du_ref = torch.autograd.grad(h_ref, (g, u), dh)
    assert float((h != h_ref).float().mean()) < 0.01
    assert torch.equal(du, du_ref)  # dh · round(silu(g)): the same products
    torch.testing.assert_close(dg.float(), dg_ref.float(), atol=3e-2, rtol=3e-2)

    # a tiny model in bf16: each variant's gradients against the float32 model's (adapters of moderate size: with
    # B ~ N(0, 1) this model amplifies bf16 rounding to O(1) relative errors, transformers' own path included)
    errors = bf16_gradient_errors(_base(layers=3).to("cuda"), _batch(5, n=4), fused_layers=True)
    assert errors["peft"] < 0.2, errors
    for name in ("fused_layers", "fused_layers+lora"):
        assert errors[name] <= 2 * errors["peft"] + 1e-3, errors


@pytest.mark.parametrize("dtype, cos_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                              (torch.float32, torch.float32)])
def test_rotary_kernel_equals_transformers_bit_for_bit_on_cuda(dtype, cos_dtype):
    """The fused rotary embedding on the GPU: forward and gradients equal to transformers' formula bit for bit (the
    GPU rounds to nearest as torch does; the kernel runs without floating-point contraction)."""
    from longrl.ops.rotary import RotaryFunction, rotary_reference

    torch.manual_seed(0)
    for B, T, HQ, HK, D, cb in ((1, 4099, 32, 8, 128, 1), (3, 77, 12, 2, 128, 3), (2, 5, 7, 7, 64, 1)):
        qkv = torch.randn(B, T, (HQ + 2 * HK) * D, device="cuda").to(dtype)
        q, k = qkv[..., :HQ * D].view(B, T, HQ, D), qkv[..., HQ * D:(HQ + HK) * D].view(B, T, HK, D)
        pos = torch.randint(0, 30000, (cb, T), device="cuda").float()
        freqs = pos[..., None] / 500000 ** (torch.arange(0, D, 2, device="cuda").float() / D)
        emb = torch.cat((freqs, freqs), -1)
        cos, sin = emb.cos().to(cos_dtype), emb.sin().to(cos_dtype)
        out_dtype = torch.promote_types(dtype, cos_dtype)
        gq = torch.randn(B, HQ, T, D, device="cuda").to(out_dtype)
        gk = torch.randn(B, HK, T, D, device="cuda").to(out_dtype)
        results = []
        for fn in (RotaryFunction.apply, rotary_reference):
            ql, kl = q.detach().requires_grad_(True), k.detach().requires_grad_(True)
            oq, ok = fn(ql, kl, cos, sin)
            dq, dk = torch.autograd.grad((oq, ok), (ql, kl), (gq, gk))
            results.append((oq, ok, dq, dk))
        for got, want in zip(*results):
            assert got.dtype == want.dtype and torch.equal(got, want), (B, T, (got.float() - want.float()).abs().max())


@pytest.mark.parametrize("vocab, dtype", [(128256, torch.bfloat16), (151936, torch.bfloat16), (50000, torch.float32)])
def test_logprob_kernels_match_the_pytorch_path_on_cuda(vocab, dtype):
    """Chunked log-probs with the Triton row kernels against the PyTorch path on the GPU at real vocabularies:
    log-probs, entropies and the gradients of the hidden states (chunks crossing the rows, a temperature)."""
    from longrl.ops.logprobs import chunked_logprobs

    torch.manual_seed(0)
    hidden = (torch.randn(1500, 512, device="cuda") * 2).to(dtype)
    weight = (torch.randn(vocab, 512, device="cuda") / 8).to(dtype)
    targets = torch.randint(0, vocab, (1500,), device="cuda")
    out = {}
    for kernel in (True, False):
        h = hidden.clone().requires_grad_(True)
        lp, ent = chunked_logprobs(h, weight, targets, chunk_size=512, temperature=0.9, with_entropy=True,
                                   kernel=kernel)
        (lp.sum() + (ent * torch.linspace(-1, 1, 1500, device="cuda")).sum()).backward()
        out[kernel] = (lp.detach(), ent.detach(), h.grad.float())
    torch.testing.assert_close(out[True][0], out[False][0], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(out[True][1], out[False][1], atol=1e-3, rtol=1e-4)
    g, g_ref = out[True][2], out[False][2]
    assert (g - g_ref).norm() <= 1e-2 * g_ref.norm(), float((g - g_ref).norm() / g_ref.norm())


@pytest.mark.parametrize("mode", ["offload", "plain"])
def test_grouped_lora_products_on_cuda(mode, monkeypatch):
    """The sibling groups' products (models/lora_training._LoraGroupProduct, cuBLAS addmm_ accumulating the input
    gradient) under bf16 autocast on CUDA: the forward of each projection's own product bit for bit, and LoRA
    gradients no further from the float32 model's than that path's (they differ only in where the sums round)."""
    from test_memory import _base, _batch, _grads

    from longrl.models.lora_training import FusedLoraLinear

    base32 = _base(layers=3).to("cuda")
    batch = _batch(7, n=4)
    _, ref = _grads(base32, mode, True, 0.0, True, batch, b_scale=0.05)
    base = _base(layers=3).to("cuda", torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        lp_g, g_g = _grads(base, mode, True, 0.0, True, batch, fused_lora=True, b_scale=0.05)
        monkeypatch.setattr(FusedLoraLinear, "grouped", False)
        lp_m, g_m = _grads(base, mode, True, 0.0, True, batch, fused_lora=True, b_scale=0.05)
    assert torch.equal(lp_g, lp_m)

    def error(g):
        num = sum(float((g[k].float() - ref[k].float()).norm()) ** 2 for k in ref)
        return (num / sum(float(ref[k].float().norm()) ** 2 for k in ref)) ** 0.5

    assert g_g.keys() == g_m.keys() == ref.keys()
    assert error(g_g) <= 1.5 * error(g_m) + 1e-3, (error(g_g), error(g_m))


@pytest.mark.parametrize("nbytes", [1, 4095, 4097, 3 * 2 ** 20 + 5])
def test_exact_pinned_buffers_are_page_locked_and_round_trip(nbytes):
    """memory/pinned.exact_pinned: the bytes asked for, page-locked (CUDA's pointer attributes), asynchronous
    copies both ways equal to their source."""
    from longrl.memory.pinned import exact_pinned

    buf = exact_pinned(nbytes)
    assert buf.numel() == nbytes and buf.dtype == torch.uint8 and buf.is_pinned()
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    buf.copy_(src, non_blocking=True)
    back = torch.empty_like(src)
    back.copy_(buf, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, src)


def test_offloaded_checkpointing_on_exact_pinned_buffers_equals_the_default_pool(monkeypatch):
    """The offloader's pool on exactly pinned buffers (PinnedPool.EXACT_PINNED): log-probs bit for bit and
    gradients within the run-to-run noise of the default pool's offloaded runs."""
    from test_memory import _base, _batch, _grads

    from longrl.memory.offload import PinnedPool

    base = _base(layers=3).to("cuda", torch.bfloat16)
    batch = _batch(5, n=4)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        lp_a, g_a = _grads(base, "offload", True, 0.1, True, batch)
        _, g_b = _grads(base, "offload", True, 0.1, True, batch)
        monkeypatch.setattr(PinnedPool, "EXACT_PINNED", True)
        lp, g = _grads(base, "offload", True, 0.1, True, batch)
    assert torch.equal(lp, lp_a)
    floor = max(float((g_b[k].float() - g_a[k].float()).abs().max()) for k in g_a)
    assert g.keys() == g_a.keys() and len(g_a) > 0
    for k in g_a:
        assert float((g[k].float() - g_a[k].float()).abs().max()) <= 2 * floor, k
