"""The fused temperature-sampling kernel (rollout/sampling_kernel.py) against its PyTorch twin (softmax, the whole
float64 CDF, log-softmax), through Triton's interpreter, and next_tokens' choice between them."""

from __future__ import annotations

import textwrap

import pytest
import torch
from interpreter import run_interpreted

from longrl.rollout.sampling import SamplingParams, fused_sampling_applies

KERNEL_CHECK = textwrap.dedent('''
    import sys
    import torch
    from longrl.rollout.sampling import inverse_cdf_reference, off_boundary_rows, token_logprobs
    from longrl.rollout.sampling_kernel import sample_with_temperature

    seed = int(sys.argv[1])
    g = torch.Generator().manual_seed(seed)
    # (vocabulary, block, temperature): one block, blocks with a partial tail, a block exactly, many blocks
    for V, block, T in [(50, 64, 1.0), (1000, 64, 0.7), (1024, 128, 1.0), (333, 32, 1.3), (4097, 256, 0.9)]:
        B = 32  # rows 0-7 the special ones, the rest random; one program a row
        z = torch.randn(B, V, generator=g) * 3
        z[0::4, V // 2:] = float("-inf")  # empty tail blocks: never drawn
        z[1::4, : V // 3] = float("-inf")  # empty head blocks
        z[2, :] = float("-inf")
        z[2, V - 1] = 0.0  # all mass on the last entry (the partial tail block)
        z[3, 7 % V] = 60.0  # one dominant entry
        u = torch.rand(B, generator=g, dtype=torch.float64)
        u[4:8] = torch.tensor([0.0, 1.0 - 2.0 ** -53, 0.5, 1.0], dtype=torch.float64)  # the ends (1.0: a u · total
        # that rounds up to the total; the search must come back to the last entry with mass)
        x = z / T
        probs = torch.softmax(x, dim=-1)
        want = inverse_cdf_reference(probs, u)
        got, logp = sample_with_temperature(z.contiguous(), u, T, block=block)
        assert bool(torch.isfinite(z.gather(1, got[:, None])).all()), "drew an entry without mass"
        assert int(got[2]) == V - 1
        bad = off_boundary_rows(probs, u, got, want)  # mismatches only where u sits on a boundary of the CDF
        assert not bad, (V, block, bad, got[bad].tolist(), want[bad].tolist())
        assert int((got != want).sum()) <= 1, (V, block)
        torch.testing.assert_close(logp, token_logprobs(x, got), atol=2e-5, rtol=1e-5)

    # the searches on a GPU-like scan: prefixes not monotonic across entries without mass (the interpreter's scan
    # is sequential, so these are fed in): the pick has mass, past the end it is the last entry with mass
    import triton
    import triton.language as tl
    from longrl.rollout.sampling_kernel import _first_with_mass

    @triton.jit
    def pick(CDF, MASS, TARGET, OUT, N: tl.constexpr):
        idx = tl.arange(0, N)
        tl.store(OUT, _first_with_mass(tl.load(CDF + idx), tl.load(MASS + idx) != 0, tl.load(TARGET), idx, N))

    cases = [  # (cdf, mass, target, pick)
        ([0.1, 0.3, 0.3 + 1e-12, 0.3 - 1e-12], [1, 1, 0, 0], 0.3 - 1e-13, 1),  # counting ≤ target gave 3
        ([0.1, 0.3, 0.3 + 1e-12, 0.3 - 1e-12], [1, 1, 0, 0], 0.3 + 1e-12, 1),  # past every entry: the last with mass
        ([0.0, 0.0 + 1e-15, 0.2, 0.5], [0, 0, 1, 1], 0.0, 2),  # leading entries without mass skipped
        ([0.0, 0.0, 0.0, 0.0], [0, 0, 0, 0], 0.0, 0),  # nothing has mass
        ([0.2, 0.2 - 1e-12, 0.7, 1.0], [1, 0, 1, 1], 0.2 - 2e-12, 0)]
    for cdf, mass, target, want in cases:
        out = torch.zeros(1, dtype=torch.int32)
        pick[(1,)](torch.tensor(cdf, dtype=torch.float64), torch.tensor(mass, dtype=torch.int32),
                   torch.tensor([target], dtype=torch.float64), out, N=4)
        assert int(out) == want, (cdf, mass, target, int(out), want)
    print("kernel ok")
''')

DISPATCH_CHECK = textwrap.dedent('''
    import torch
    from longrl.rollout.sampling import SamplingParams, next_tokens

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(37, 3001, generator=g) * 2  # 3001 entries: a block of 8,192 with a partial tail
    seq, pos = torch.arange(37), torch.randint(0, 50, (37,), generator=g)
    for params in (SamplingParams(temperature=0.8, seed=2), SamplingParams(temperature=1.0, seed=7, top_k=5000)):
        fused = next_tokens(logits, params, seq, pos, fused=True)
        plain = next_tokens(logits, params, seq, pos, fused=False)
        assert int((fused[0] != plain[0]).sum()) <= 1
        torch.testing.assert_close(fused[1], plain[1], atol=2e-5, rtol=1e-5)
    print("dispatch ok")
''')


@pytest.mark.parametrize("seed", [0, 1])
def test_fused_sampling_draws_the_references_tokens(seed):
    pytest.importorskip("triton")
    assert "kernel ok" in run_interpreted(KERNEL_CHECK, str(seed))


def test_next_tokens_fused_equals_plain():
    pytest.importorskip("triton")
    assert "dispatch ok" in run_interpreted(DISPATCH_CHECK)


@pytest.mark.parametrize("params,applies", [
    (SamplingParams(temperature=0.7), True), (SamplingParams(temperature=1.0, top_k=100), True),  # k ≥ V: no filter
    (SamplingParams(temperature=0), False), (SamplingParams(top_k=5), False), (SamplingParams(top_p=0.9), False),
    (SamplingParams(min_p=0.1), False), (SamplingParams(repetition_penalty=1.2), False)])
def test_fused_sampling_only_for_plain_temperature(params, applies):
    logits = torch.zeros(3, 100)
    seen = torch.zeros(3, 100, dtype=torch.bool) if params.repetition_penalty != 1.0 else None
    assert fused_sampling_applies(logits, params, seen, fused=True) is applies
    assert not fused_sampling_applies(logits, params, seen, fused=None)  # CPU logits: the PyTorch path
    assert not fused_sampling_applies(logits.half(), params, seen, fused=True)
    assert not fused_sampling_applies(logits.t(), params, seen, fused=True)  # rows not contiguous


def test_a_kernel_that_cannot_build_falls_back_to_pytorch_once(monkeypatch, caplog):
    """Where the kernel fails (no compiler for this GPU, ...), sampling goes on with the PyTorch path and the
    kernel is not tried again; asked for explicitly (fused=True), the failure is raised."""
    from longrl.rollout import sampling, sampling_kernel

    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("no compiler for this GPU")

    monkeypatch.setattr(sampling_kernel, "sample_with_temperature", broken)
    monkeypatch.setattr(sampling, "fused_sampling_applies", lambda *a: True)
    monkeypatch.setattr(sampling, "_FUSED_FAILED", [])
    logits, params = torch.randn(5, 40), SamplingParams(temperature=0.9, seed=1)
    seq, pos = torch.arange(5), torch.zeros(5, dtype=torch.long)
    with pytest.raises(RuntimeError, match="no compiler"):
        sampling.next_tokens(logits, params, seq, pos, fused=True)
    want = sampling.next_tokens(logits, params, seq, pos, fused=False)
    for _ in range(2):
        got = sampling.next_tokens(logits, params, seq, pos)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert len(calls) == 2 and "fused sampling kernel failed" in caplog.text  # the explicit call + one try


def test_a_triton_that_does_not_import_is_not_available(tmp_path):
    """An installed Triton that fails to import (built for another torch or CUDA) leaves the sampler on its PyTorch
    paths (found on the path is not enough: the decode attention's import would raise mid-rollout)."""
    import os
    import subprocess
    import sys

    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "__init__.py").write_text("raise ImportError('built for another CUDA')\n")
    code = "from longrl.rollout.sampling import triton_available; print(triton_available())"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


UNIFORM_CHECK = textwrap.dedent('''
    import torch
    from longrl.rollout.sampling import uniform_reference
    from longrl.rollout.sampling_kernel import UNIFORM_BLOCK, splitmix64_int, uniform_triton

    g = torch.Generator().manual_seed(3)
    big = 2 ** 63 - 1
    # seeds: small (Triton's 32-bit argument), past 2^31 and 2^63's edge (64-bit), negative, a salted one
    seeds = [0, 1, 7, 2 ** 31 + 5, big, -3, -(2 ** 63), 123456789 ^ 0x5EED5A17]
    for n in [1, 7, UNIFORM_BLOCK, UNIFORM_BLOCK + 1, 3 * UNIFORM_BLOCK - 5]:  # odd and block-crossing
        seq = torch.randint(-big, big, (n,), generator=g)
        pos = torch.randint(-big, big, (n,), generator=g)
        seq[:2] = torch.tensor([0, -1])[:n]
        pos[:1] = big
        for seed in seeds:
            want = uniform_reference(seed, seq, pos)
            got = uniform_triton(seed, seq, pos)
            assert got.dtype == torch.float64 and got.shape == seq.shape
            assert torch.equal(got.view(torch.int64), want.view(torch.int64)), (n, seed)
            assert bool(((got >= 0) & (got < 1)).all())
    # the host's hash of the seed is the tensor one's (two's complement for negative seeds)
    for seed in seeds:
        t = uniform_reference.__globals__["_splitmix64"](torch.tensor([seed]))
        assert int(t) % 2 ** 64 == splitmix64_int(seed), seed
    assert uniform_triton(5, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)).shape == (0,)
    # the kernel at seed hashes of each width Triton types an argument by (i32, u32, i64, u64), against the formula
    # in Python integers (a seed's hash below 2^32 is rare, so the seeds above seldom reach the narrow ones)
    from longrl.rollout.sampling_kernel import _uniform_kernel
    seq, pos = torch.tensor([0, 1, -1, 12345, -(2 ** 63)]), torch.tensor([0, 7, 2 ** 62, -1, 3])
    for mix in [0, 5, 2 ** 31 + 1, 2 ** 40 + 3, 2 ** 63 + 7, 2 ** 64 - 1]:
        u = torch.empty(5, dtype=torch.float64)
        _uniform_kernel[(1,)](seq, pos, u, mix, 5, BLOCK=8)
        m = 2 ** 64
        want = [(splitmix64_int(splitmix64_int(mix ^ (a % m)) ^ (b % m)) >> 11) / 2 ** 53
                for a, b in zip(seq.tolist(), pos.tolist())]
        assert u.tolist() == want, (mix, u.tolist(), want)
    print("uniform ok")
''')


def test_uniform_kernel_equals_its_twin_bit_for_bit():
    """The uniforms' one-launch kernel gives the PyTorch twin's float64 bits for any int64 sequence ids, positions
    and seed (extremes, negatives; odd and block-crossing sizes)."""
    pytest.importorskip("triton")
    assert "uniform ok" in run_interpreted(UNIFORM_CHECK)


def test_uniform_for_takes_the_twin_on_the_cpu_and_after_a_kernel_failure(monkeypatch, caplog):
    """uniform_for keeps the PyTorch ops off CUDA; where the kernel fails it warns once and stays on them."""
    from longrl.rollout import sampling, sampling_kernel

    seq, pos = torch.arange(6), torch.arange(6) * 3
    assert torch.equal(sampling.uniform_for(4, seq, pos), sampling.uniform_reference(4, seq, pos))
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("no compiler for this GPU")

    class FakeCuda(torch.Tensor):  # a CPU tensor that says it is on CUDA: uniform_for tries the kernel
        @property
        def is_cuda(self):
            return True

    monkeypatch.setattr(sampling_kernel, "uniform_triton", broken)
    monkeypatch.setattr(sampling, "triton_available", lambda: True)
    monkeypatch.setattr(sampling, "_UNIFORM_FAILED", [])
    fake = seq.as_subclass(FakeCuda)
    for _ in range(2):
        got = sampling.uniform_for(4, fake, pos)
        assert torch.equal(got.as_subclass(torch.Tensor), sampling.uniform_reference(4, seq, pos))
    assert len(calls) == 1 and "uniform kernel failed" in caplog.text
