"""Chunked log-probs / entropy and their gradients against a full-logits float64 computation."""

import pytest
import torch

from longrl.ops.logprobs import chunked_logprobs, reference_logprobs

CASES = [  # (N, H, V, chunk, temperature, softcap, multiplier, bias)
    (1, 3, 5, 1, 1.0, None, 1.0, False),
    (7, 16, 33, 3, 1.0, None, 1.0, False),  # chunk does not divide N
    (64, 8, 101, 64, 0.7, None, 1.0, True),  # one chunk exactly
    (65, 8, 101, 64, 1.3, 30.0, 1.0, False),  # crosses a chunk boundary by one row, softcapping
    (50, 12, 257, 16, 0.9, 5.0, 0.0625, True),  # Cohere/Granite-style multiplier with a strong softcap
    (33, 5, 17, 100, 2.0, None, 3.0, False),  # chunk larger than N
]


def _inputs(n, h, v, bias, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64) * 2
    weight = torch.randn(v, h, generator=g, dtype=torch.float64)
    b = torch.randn(v, generator=g, dtype=torch.float64) if bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, b, targets


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("train_head", [False, True])
def test_matches_full_logits_float64(case, train_head):
    n, h, v, chunk, temp, cap, mult, bias = case
    seed = torch.seed() % 2**31  # fresh inputs each run; printed on failure
    hidden, weight, b, targets = _inputs(n, h, v, bias, seed)
    g1 = torch.Generator().manual_seed(seed + 1)
    w_lp, w_ent = torch.randn(n, generator=g1, dtype=torch.float64), torch.randn(n, generator=g1, dtype=torch.float64)

    def run(fn, **kw):
        hid = hidden.clone().requires_grad_(True)
        W = weight.clone().requires_grad_(train_head)
        B = b.clone().requires_grad_(train_head) if b is not None else None
        lp, ent = fn(hid, W, targets, bias=B, temperature=temp, softcap=cap, multiplier=mult, with_entropy=True, **kw)
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        return lp.detach(), ent.detach(), hid.grad, W.grad, (B.grad if B is not None else None)

    fast = run(chunked_logprobs, chunk_size=chunk)
    ref = run(reference_logprobs)
    for name, a, r in zip(["logps", "entropy", "grad_hidden", "grad_weight", "grad_bias"], fast, ref):
        if r is None:
            assert a is None, name
            continue
        assert torch.allclose(a, r, rtol=1e-9, atol=1e-10), f"{name} differs (seed {seed})"
    if not train_head:
        assert fast[3] is None  # no LM-head gradient is computed when it is frozen


def test_float32_and_no_entropy_path():
    hidden, weight, _, targets = _inputs(37, 16, 50, False, 3)
    h32 = hidden.float().requires_grad_(True)
    lp, ent = chunked_logprobs(h32, weight.float(), targets, chunk_size=8)
    assert ent is None and lp.dtype == torch.float32
    lp.sum().backward()
    ref_h = hidden.clone().requires_grad_(True)
    ref_lp, _ = reference_logprobs(ref_h, weight, targets)
    ref_lp.sum().backward()
    assert torch.allclose(lp.double(), ref_lp, rtol=1e-4, atol=1e-4)
    assert torch.allclose(h32.grad.double(), ref_h.grad, rtol=1e-4, atol=1e-4)


def test_bfloat16_close_to_float64():
    hidden, weight, _, targets = _inputs(40, 32, 64, False, 5)
    lp, _ = chunked_logprobs(hidden.bfloat16(), weight.bfloat16(), targets, chunk_size=16)
    ref, _ = reference_logprobs(hidden, weight, targets)
    assert lp.dtype == torch.float32
    rel = (lp.double() - ref).norm() / ref.norm()
    assert rel < 2e-2


def test_peak_logits_memory_is_one_chunk(monkeypatch):
    """No [rows, V] block larger than one chunk is ever formed, in forward or backward."""
    import longrl.ops.logprobs as mod

    seen = []
    real_linear = torch.nn.functional.linear

    def spy(x, w, b=None):
        out = real_linear(x, w, b)
        seen.append(out.shape[0])
        return out

    monkeypatch.setattr(mod.torch.nn.functional, "linear", spy)
    hidden, weight, _, targets = _inputs(100, 8, 30, False, 7)
    hid = hidden.requires_grad_(True)
    lp, ent = chunked_logprobs(hid, weight, targets, chunk_size=16, with_entropy=True)
    (lp.sum() + ent.sum()).backward()
    assert seen and max(seen) <= 16


def test_bad_arguments():
    hidden, weight, _, targets = _inputs(4, 3, 5, False, 0)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_logprobs(hidden, weight, targets, chunk_size=0)
    with pytest.raises(ValueError, match="temperature"):
        chunked_logprobs(hidden, weight, targets, temperature=0.0)
    with pytest.raises(ValueError, match="targets"):
        chunked_logprobs(hidden, weight, targets[:2])


KERNEL_CHECK = '''
import sys
import torch
from longrl.ops.logprob_kernel import BLOCK, row_grad_, row_grad_reference, row_stats, row_stats_reference
from longrl.ops.logprobs import chunked_logprobs

seed = int(sys.argv[1])
torch.manual_seed(seed)
# the row kernels against their twins: vocabularies below, at and across the block, several blocks; 16-bit and
# float32 logits; the multiplier and temperature; the target at either end; large logits (the running maximum)
cases = 0
for V in (7, BLOCK, BLOCK + 5, 2 * BLOCK + 333):
    for dtype in (torch.float32, torch.bfloat16):
        for mult, temp, ent in ((1.0, 1.0, False), (0.0625, 0.7, True), (1.0, 1.3, True)):
            n = 5
            raw = (torch.randn(n, V) * 4).to(dtype)
            raw[1] += 80  # every entry large: exp would overflow without the maximum
            raw[2, V // 2] = 60  # one peak
            targets = torch.randint(0, V, (n,))
            targets[0], targets[3] = 0, V - 1
            got = row_stats(raw, targets, mult, temp, ent)
            want = row_stats_reference(raw, targets, mult, temp, ent)
            # float32 sums in another order: errors scale with the row's largest logit (lse − Σ p z cancels)
            scale = 1 + raw.float().abs().amax(-1) * mult / temp  # [n]
            for a, b in zip(got, want):
                if b is None:
                    assert a is None
                    continue
                assert ((a - b).abs() <= 4e-6 * scale + 1e-5 * b.abs()).all(), (a - b).abs().max()
            lse = want[0]
            g = torch.randn(n)
            g_ent, h = (torch.randn(n), want[2]) if ent else (None, None)
            dz = row_grad_(raw.clone(), targets, lse, g, g_ent, h, mult, temp)
            dz_ref = row_grad_reference(raw, targets, lse, g, g_ent, h, mult, temp)
            assert dz.dtype == raw.dtype
            tol = 1e-6 if dtype == torch.float32 else 1e-2  # (the interpreter truncates to 16 bits; torch rounds)
            err = (dz.float() - dz_ref.float()).abs()
            assert (err <= (tol + 4e-6 * scale[:, None]) * (1 + g.abs()[:, None]) + tol * dz_ref.float().abs()).all()
            cases += 1

# the whole chunked Function with the kernels against the PyTorch path: chunk-crossing rows, entropy, an
# expanded incoming gradient (a plain sum), gradients of hidden and of a trained head
for with_entropy in (False, True):
    hidden = torch.randn(37, 16) * 2
    weight = torch.randn(BLOCK + 9, 16)
    targets = torch.randint(0, BLOCK + 9, (37,))
    out = {}
    for kernel in (True, False):
        h, W = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        lp, ent = chunked_logprobs(h, W, targets, chunk_size=16, temperature=0.9, with_entropy=with_entropy,
                                   kernel=kernel)
        (lp.sum() + (ent * torch.linspace(-1, 1, 37)).sum() if with_entropy else lp.sum()).backward()
        out[kernel] = (lp.detach(), h.grad, W.grad) + ((ent.detach(),) if with_entropy else ())
    for a, b in zip(out[True], out[False]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
print("logprob kernels ok", cases)
'''


@pytest.mark.parametrize("seed", [0, 1])
def test_logprob_kernels_match_their_twins_under_the_interpreter(seed):
    pytest.importorskip("triton")
    from interpreter import run_interpreted

    assert "logprob kernels ok 24" in run_interpreted(KERNEL_CHECK, str(seed))


def test_logprob_kernel_refuses_what_it_cannot_compute():
    hidden, weight, _, targets = _inputs(4, 3, 5, False, 0)
    with pytest.raises(ValueError, match="softcap"):
        chunked_logprobs(hidden, weight, targets, softcap=30.0, kernel=True)
    lp, _ = chunked_logprobs(hidden, weight, targets)  # auto on the CPU: the PyTorch path
    assert lp.dtype == torch.float64


@pytest.mark.parametrize("dtype", ["*bf16", "*fp32"])
def test_logprob_kernels_build_for_sm90(dtype):
    """Both row kernels compile for an H100/H200 at Llama 3's and Qwen 2.5's vocabularies (ahead of time, no GPU)."""
    pytest.importorskip("triton")
    from test_kernels_compile import compile_for_sm90

    from longrl.ops import logprob_kernel as lk

    common = {"R": dtype, "Y": "*i64", "LSE": "*fp32", "stride_r": "i32", "mult": "fp32", "temp": "fp32"}
    for V in (128256, 151936):
        for flags in (dict(SCALE_M=False, SCALE_T=False, WITH_ENTROPY=False),
                      dict(SCALE_M=True, SCALE_T=True, WITH_ENTROPY=True)):
            consts = dict(V=V, BLOCK=lk.BLOCK, **flags)
            compile_for_sm90(lk._row_stats_kernel, {**common, "LP": "*fp32", "ENT": "*fp32"}, consts, num_warps=8)
            compile_for_sm90(lk._row_grad_kernel, {**common, "G": "*fp32", "GENT": "*fp32", "ENT": "*fp32"}, consts,
                             num_warps=8)
