"""On the GPU: the per-key-head attention backward (ops/grouped_attention.py) on PyTorch's CUDA flash kernels, the
8B shape's heads: the same output bit for bit, gradients within the flash backward's own run-to-run noise (its dq
accumulates with atomics), and the backward's peak lower by the flash transients the planner no longer counts."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _qkv(T, Hq=32, Hkv=8, D=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda h: torch.randn(1, T, h, D, generator=g, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # noqa
    return [t.requires_grad_() for t in (mk(Hq), mk(Hkv), mk(Hkv))]


def _sdpa(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


@pytest.mark.parametrize("T", [4099, 16384])
def test_grouped_backward_equals_flash_within_its_noise(T):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from longrl.ops.grouped_attention import GroupedBackwardAttention

    q, k, v = _qkv(T, seed=T)
    do = torch.randn(1, T, 32, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        runs = []
        for _ in range(2):
            out = _sdpa(q, k, v)
            runs.append((out.detach(), torch.autograd.grad(out, (q, k, v), do)))
    out = GroupedBackwardAttention.apply(q, k, v, 128 ** -0.5)
    grads = torch.autograd.grad(out, (q, k, v), do)
    (ref, ref_grads), (_, again) = runs
    assert torch.equal(out, ref)
    for got, want, want2 in zip(grads, ref_grads, again):
        assert got.shape == want.shape and got.dtype == want.dtype
        floor = float((want2.float() - want.float()).abs().max())
        scale = float(want.float().abs().max())
        diff = float((got.float() - want.float()).abs().max())
        assert diff <= max(2 * floor, 2 ** -8 * scale), (diff, floor, scale)


def test_grouped_backward_peak_is_lower_by_the_flash_transients():
    """At 32,768 tokens (8B heads) the whole flash backward holds a float32 dq accumulator and dk, dv expanded to
    the query heads, 32 KB a token; the grouped one holds one group's share. The backward's peak above what was
    allocated before it falls by at least 3/4 of the difference the planner counts (attention_backward_bytes).
    Flash is pinned for the whole call (SDPA's default may be cuDNN, whose transients differ), and each path runs
    once before it is measured."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from longrl.memory.planner import attention_backward_bytes
    from longrl.ops.grouped_attention import GroupedBackwardAttention

    T = 32768
    q, k, v = _qkv(T)
    do = torch.randn(1, T, 32, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)

    def whole(q, k, v):
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return _sdpa(q, k, v)

    peaks = {}
    for name, attend in (("whole", whole), ("grouped", lambda q, k, v: GroupedBackwardAttention.apply(q, k, v,
                                                                                                      128 ** -0.5))):
        for _ in range(2):  # the second run is measured
            out = attend(q, k, v)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            grads = torch.autograd.grad(out, (q, k, v), do)
            torch.cuda.synchronize()
            peaks[name] = torch.cuda.max_memory_allocated() - before
            del out, grads
    saved = attention_backward_bytes(T, 4096, 4096, 1024, 2) - attention_backward_bytes(T, 4096, 4096, 1024, 2,
                                                                                          groups=8)
    assert peaks["whole"] - peaks["grouped"] >= 0.75 * saved, (peaks, saved)
