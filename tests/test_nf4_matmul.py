"""The NF4 product (a QLoRA base's decode-step matmul read in 4 bits) against bitsandbytes: the twin exactly, the
Triton kernel through Triton's interpreter (a subprocess: TRITON_INTERPRET must be set before triton is imported)
on odd shapes, K splits and partial tiles, against the exact product of the dequantized weight. The interpreter's
bfloat16 products are wrong (it runs them on raw bits), so it checks float16 activations; bfloat16 runs on the GPU
(test below, and benchmarks/nf4_matmul.py)."""

import dataclasses
import sys
import textwrap

import pytest
import torch
from interpreter import run_interpreted
from ptx_emulator import run_ptx

bnb = pytest.importorskip("bitsandbytes")


def _quantized(N: int, K: int, seed: int, device: str = "cpu"):
    import bitsandbytes.functional as bnbf

    from longrl.ops.nf4_matmul import nf4_operands

    torch.manual_seed(seed)
    W = torch.randn(N, K, dtype=torch.bfloat16, device=device)  # quantized where it is used: Params4bit.cuda() of
    # codes quantizes again
    packed, state = bnbf.quantize_4bit(W, blocksize=64, quant_type="nf4", compress_statistics=True)
    param = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, quant_type="nf4", blocksize=64,
                              bnb_quantized=True)
    return param, state, nf4_operands(param)


@pytest.mark.parametrize("N, K, M", [(96, 128, 5), (64, 320, 1), (130, 192, 17)])
def test_twin_equals_bitsandbytes(N, K, M):
    import bitsandbytes.functional as bnbf

    from longrl.ops.nf4_matmul import dequantize_nf4, nf4_linear_reference

    param, state, ops = _quantized(N, K, seed=N + K)
    assert torch.equal(dequantize_nf4(*ops, torch.bfloat16), bnbf.dequantize_4bit(param.data, state))
    x = torch.randn(M, K, dtype=torch.bfloat16)
    want = bnb.matmul_4bit(x, param.t(), quant_state=state)
    assert torch.equal(nf4_linear_reference(x, *ops), want)


KERNEL_CHECK = textwrap.dedent('''
    import sys
    sys.path.insert(0, "tests")
    import torch
    from test_nf4_matmul import _quantized
    from longrl.ops import nf4_matmul as nm

    worst = 0.0
    def check(got, exact, what):
        global worst
        err = ((got.double() - exact).abs() / (exact.abs() + 1e-2)).max().item()
        worst = max(worst, err)
        assert err <= 2 ** -9, (what, err)  # float32 sums, one float16 rounding at the end

    # one weight (the per-call form): odd N, K crossing chunks (K = 192: one and a half), a bias, leading dims
    for N, K, M, bias in [(100, 192, 3, True), (70, 640, 65, False)]:
        param, state, ops = _quantized(N, K, seed=M)
        x = torch.randn(2, M, K, dtype=torch.float16)
        b = torch.randn(N, dtype=torch.float16) if bias else None
        got = nm.nf4_linear(x, *ops, bias=b, use_triton=True)
        twin = nm.twin_options(nm.launch_for(2 * M)[1]["lut"])  # the default launch's weights (lut 4: scaled after)
        W = nm.nf4_group_weight(nm.nf4_group([param]), torch.float16, **twin).double()
        assert got.shape == (2, M, N) and got.dtype == torch.float16
        check(got, x.double() @ W.t() + (b.double() if bias else 0), (N, K, M))
    # groups: q/k/v-like (three weights), gate/up-like (two), with 16-bit rows after them and biases; row tiles that
    # shrink to the weights' boundaries (48 rows), K splits (programs), both operand orders, each code lookup (the
    # default's permutes replaced by the table in memory here: tests below replay them), the tile interleaved in
    # registers (join) or read as even and odd k, M from 1 to 65; lut 4 (the scale after each block's product), 5
    # and 6 (the looked-up values scaled in 16 bits or float32) against their own exact products (twin_options),
    # with the values in k order (kord: here the pairing PRMT_ASM_K makes, _kord_pairs, put in order by _kord_tile),
    # K whole chunks or not, two chunks a loop iteration (unroll: splits of an even and an odd count of chunks)
    for rows, K, M, R, bias, launch in [([128, 64, 70], 320, 17, 5, True, dict(swap=False)),
                                        ([48, 80], 1280, 1, 3, False, dict(programs=64, join=False, lut=1)),
                                        ([96], 576, 33, 0, True, dict(bn=32, programs=8, swap=False, join=False, lut=0)),
                                        ([64, 64], 128, 65, 7, False, None),
                                        ([128, 64, 70], 320, 17, 5, True, dict(lut=4)),
                                        ([48, 80], 1280, 3, 3, False, dict(lut=4, programs=64, swap=False)),
                                        ([96], 576, 33, 0, True, dict(lut=4, bn=32, programs=8)),
                                        ([128, 64, 70], 320, 17, 5, True, dict(lut=5)),
                                        ([48, 80], 1280, 3, 3, False, dict(lut=6, programs=64, swap=False)),
                                        ([96], 576, 33, 0, True, dict(lut=5, bn=32, programs=8)),
                                        ([64, 64], 128, 65, 7, False, dict(lut=6)),
                                        ([128, 64, 70], 320, 17, 5, True, dict(lut=4, kord=True)),
                                        ([48, 80], 1280, 3, 3, False, dict(lut=5, kord=True, programs=64, swap=False)),
                                        ([96], 576, 33, 0, True, dict(lut=6, kord=True, bn=32, programs=8)),
                                        ([128, 64, 70], 1280, 17, 5, True, dict(lut=4, kord=True, unroll=2)),
                                        ([48, 80], 576, 3, 3, False, dict(lut=5, unroll=2, programs=4))]:
        ws = [_quantized(n, K, seed=n + i)[0] for i, n in enumerate(rows)]
        dense = torch.randn(R, K, dtype=torch.float16) if R else None
        biases = [torch.randn(n, dtype=torch.float16) if i != 1 else None for i, n in enumerate(rows)] if bias else None
        g = nm.nf4_group(ws, dense, biases)
        x = torch.randn(M, K, dtype=torch.float16)
        got = nm.nf4_group_linear(x, g, launch=launch)
        W = nm.nf4_group_weight(g, torch.float16, **nm.twin_options(nm.launch_for(M, launch)[1]["lut"])).double()
        assert got.shape == (M, sum(rows) + R)
        check(got, x.double() @ W.t() + (g.bias.double() if bias else 0), (rows, K, M, R))
        assert torch.equal(W[sum(rows):], dense.double()) if R else True  # the 16-bit rows are read as they are
    print("kernel ok", worst)
''')


def test_triton_kernel_equals_the_exact_product():
    assert "kernel ok" in run_interpreted(KERNEL_CHECK)


FIXUP_CHECK = textwrap.dedent('''
    import sys
    sys.path.insert(0, "tests")
    import torch
    from test_nf4_matmul import _quantized
    from longrl.ops import fp8_blocks as fb, fp8_matmul as fm, nf4_matmul as nm

    # (rows of each weight, K, rows of x, 16-bit rows, biases, launch): several K splits each (programs), K that ends
    # inside a chunk, tiles shrunk to the weights' bounds, one row of x and 65; lut 3 and 4, both operand orders
    cases = [([128, 64, 70], 2048 + 64, 17, 5, True, dict(programs=1000)),
             ([48, 80], 1280, 1, 3, False, dict(programs=1000, lut=4)),
             ([96], 1600, 65, 0, True, dict(bn=32, programs=1000, swap=False, lut=1))]
    for rows, K, M, R, bias, launch in cases:
        torch.manual_seed(K + M)
        dense = torch.randn(R, K, dtype=torch.float16) if R else None
        biases = [torch.randn(n, dtype=torch.float16) if i != 1 else None for i, n in enumerate(rows)] if bias else None
        x = torch.randn(M, K, dtype=torch.float16)
        ws = [fb.quantize_fp8_blocks(torch.randn(n, K) * 0.1) for n in rows]
        groups = [(nm, nm.nf4_group([_quantized(n, K, seed=n + i)[0] for i, n in enumerate(rows)], dense, biases),
                   nm.nf4_group_linear, nm.LAUNCH, nm.CHUNK),
                  (fm, fm.fp8_group([q for q, _ in ws], [sc for _, sc in ws], dense, biases), fm.fp8_group_linear,
                   fm.LAUNCH, fm.CHUNK)]
        for mod, g, linear, table, chunk in groups:
            cfg = {k: v for k, v in launch.items() if mod is nm or k in ("bn", "programs")}
            BM, entry = nm.launch_for(M, {**cfg, "fixup": True}, table)
            grid = nm.group_grid(M, g.rows, R, K, chunk, BM, entry)
            assert grid.split > 1 and nm.fixes_up(entry, grid, g.locks), (rows, K, M)  # the fixup runs
            plain = linear(x, g, launch=cfg)
            fixed = linear(x, g, launch={**cfg, "fixup": True})
            assert torch.equal(fixed.view(torch.int16), plain.view(torch.int16)), (mod.__name__, rows, K, M)
            assert not g.locks.any()  # every count back to zero for the next launch
    print("fixup ok")
''')


def test_splits_summed_by_their_last_program_equal_the_split_sum_launch_bit_for_bit():
    """The fixup launch choice (each tile's last K split adds the splits' partials in order, no second launch)
    against _split_sum_kernel's launch, NF4 and FP8 groups, under the interpreter (programs run one at a time: the
    counts, not the GPU's order, are what is checked here; tests/test_nf4_matmul.py's GPU test runs it there)."""
    assert "fixup ok" in run_interpreted(FIXUP_CHECK)


def test_fixup_only_where_one_m_tile_has_several_splits():
    from longrl.ops.nf4_matmul import GroupGrid, fixes_up

    locks = torch.zeros(10, dtype=torch.int32)
    grid = GroupGrid(BM=16, BN=64, dense_tiles=1, row_tiles=8, m_tiles=1, n_chunks=32, split=4, per_split=8, N0=64,
                     N01=128)
    assert fixes_up({"fixup": True}, grid, locks) and not fixes_up({}, grid, locks)
    assert not fixes_up({"fixup": True}, dataclasses.replace(grid, split=1), locks)  # nothing to sum
    assert not fixes_up({"fixup": True}, dataclasses.replace(grid, m_tiles=2), locks)  # a count a row tile only
    assert not fixes_up({"fixup": True}, dataclasses.replace(grid, row_tiles=11), locks)  # more tiles than counts


def test_scale_after_twin_differs_from_bitsandbytes_by_one_rounding_a_weight():
    """lut 4's twin: x · (cast(code[q]) · absmax)ᵀ in float32. Each of its weights differs from bitsandbytes'
    cast(code[q] · absmax) by at most the two bfloat16 roundings (half a unit, 2⁻⁸ relative, each), the 16-bit rows
    not at all."""
    from longrl.ops.nf4_matmul import nf4_group, nf4_group_reference, nf4_group_weight

    params = [_quantized(n, 320, seed=n)[0] for n in (48, 32)]
    dense = torch.randn(3, 320, dtype=torch.bfloat16)
    g = nf4_group(params, dense, None)
    exact, after = nf4_group_weight(g, torch.bfloat16), nf4_group_weight(g, torch.bfloat16, scale_after=True)
    assert after.dtype == torch.float32 and torch.equal(after[80:], dense.float())
    rel = ((after - exact.float()).abs() / exact.float().abs().clamp_min(1e-30))[exact != 0]
    assert 0 < rel.max() <= 2 ** -7  # (they do differ: a rounding before the scale, or after it)
    x = torch.randn(5, 320, dtype=torch.bfloat16)
    want = torch.nn.functional.linear(x.float(), after).to(torch.bfloat16)
    assert torch.equal(nf4_group_reference(x, g, scale_after=True), want)


def test_rounded_twins_are_the_looked_up_values_scaled_then_cast():
    """lut 6's weights are cast(cast(code[q]) · absmax), lut 5's cast(cast(code[q]) · cast(absmax)): each within
    two bf16 roundings of bitsandbytes' cast(code[q] · absmax) (lut 5 three), equal to it for most weights, the
    16-bit rows as they are; an unknown rounding or lut is refused."""
    from longrl.ops import nf4_matmul as nm
    from longrl.ops.nf4_matmul import nf4_group, nf4_group_linear, nf4_group_reference, nf4_group_weight, twin_options

    params = [_quantized(n, 320, seed=n)[0] for n in (48, 32)]
    dense = torch.randn(3, 320, dtype=torch.bfloat16)
    g = nf4_group(params, dense, None)
    exact = nf4_group_weight(g, torch.bfloat16).float()
    absmax = torch.cat([g.scales[:, :48].t(), g.scales[:, 48:].t()]).repeat_interleave(64, dim=1)  # [80, 320]
    code = nf4_group_weight(g, torch.bfloat16, scale_after=True)[:80] / absmax  # cast(code[q]) (exact quotient)
    for lut, rounded_scale, bound in [(6, absmax, 2 ** -7), (5, absmax.bfloat16().float(), 3 * 2 ** -8)]:
        W = nf4_group_weight(g, torch.bfloat16, **twin_options(lut))
        assert W.dtype == torch.bfloat16 and torch.equal(W[80:], dense)
        assert torch.equal(W[:80], (code * rounded_scale).bfloat16())
        rel = ((W.float() - exact).abs() / exact.abs().clamp_min(1e-30))[exact != 0]
        assert 0 < rel.max() <= bound and (rel == 0).float().mean() > 0.5
        x = torch.randn(5, 320, dtype=torch.bfloat16)
        assert torch.equal(nf4_group_reference(x, g, **twin_options(lut)), torch.nn.functional.linear(x, W))
    assert not torch.equal(nf4_group_weight(g, torch.bfloat16, rounded="code"),
                           nf4_group_weight(g, torch.bfloat16, rounded="code+scale"))
    with pytest.raises(ValueError, match="rounded"):
        nf4_group_weight(g, torch.bfloat16, rounded="scale")
    if nm.triton is not None:  # (without Triton the product is its twin, whatever the launch)
        with pytest.raises(ValueError, match="lut is 0 to 6"):
            nf4_group_linear(torch.randn(2, 320, dtype=torch.float16), g, launch=dict(lut=7))


def test_group_twin_stacks_bitsandbytes_weights():
    """The group's twin is bitsandbytes' dequantized weights stacked (scales read back from the group's
    transposed form), then the 16-bit rows, then the bias; shapes the kernel cannot tile are refused by name."""
    import bitsandbytes.functional as bnbf

    from longrl.ops.nf4_matmul import groupable, nf4_group, nf4_group_reference

    params = [_quantized(n, 192, seed=n)[0] for n in (32, 16, 40)]
    dense = torch.randn(3, 192, dtype=torch.bfloat16)
    bias = [None, torch.randn(16, dtype=torch.bfloat16), None]
    g = nf4_group(params, dense, bias)
    x = torch.randn(5, 192, dtype=torch.bfloat16)
    W = torch.cat([bnbf.dequantize_4bit(p.data, p.quant_state) for p in params] + [dense])
    b = torch.cat([torch.zeros(32), bias[1].float(), torch.zeros(43)]).to(torch.bfloat16)
    assert torch.equal(nf4_group_reference(x, g), torch.nn.functional.linear(x, W, b))
    assert "multiple of 16" in groupable([_quantized(24, 192, seed=1)[0], params[0]])
    assert "input widths" in groupable([params[0], _quantized(32, 128, seed=2)[0]])
    with pytest.raises(ValueError, match="input width 192"):
        nf4_group(params, torch.randn(3, 128))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("M, launch", [(1, dict(lut=4)), (16, dict(lut=4)), (16, dict(lut=4, bn=128)),
                                       (128, dict(lut=4, bn=128, warps=4)), (128, dict(lut=4)),
                                       (1, dict(lut=5)), (16, dict(lut=5)), (16, dict(lut=6, bn=32)),
                                       (128, dict(lut=5, bn=128, warps=8)), (128, dict(lut=6)),
                                       (1, dict(lut=4, kord=True)), (16, dict(lut=4, kord=True)),
                                       (16, dict(lut=5, kord=True, bn=128)), (128, dict(lut=5, kord=True)),
                                       (128, dict(lut=6, kord=True, bn=64, warps=4)),
                                       (16, dict(lut=4, kord=True, unroll=2)), (128, dict(lut=5, kord=True, unroll=2))])
def test_lut4_kernel_on_the_gpu_equals_its_twin(M, launch):
    """The one-table byte permutes on the GPU (any layout of the bytes, the 4-warp 128-row tile included): lut 4
    against its twin x · (cast(code) · absmax)ᵀ summed in float32, luts 5 and 6 (the values scaled before the
    product) against theirs (twin_options); with the values paired in k order (kord) the build kept it (its layout
    gives each thread four bytes of a row) and the result is the same."""
    from longrl.ops.nf4_matmul import PERMUTE_FALLBACKS
    from longrl.ops.nf4_matmul import nf4_group, nf4_group_linear, nf4_group_reference, nf4_group_weight, twin_options

    params = [_quantized(n, 4096, seed=M + n, device="cuda")[0] for n in (1024, 512)]
    g = nf4_group(params, torch.randn(32, 4096, dtype=torch.bfloat16, device="cuda"))
    x = torch.randn(M, 4096, dtype=torch.bfloat16, device="cuda")
    PERMUTE_FALLBACKS.clear()
    got = nf4_group_linear(x, g, launch=launch).float()
    assert not PERMUTE_FALLBACKS
    twin = twin_options(launch["lut"])
    want = nf4_group_reference(x, g, **twin).float()
    scale = x.float().abs() @ nf4_group_weight(g, torch.bfloat16, **twin).float().abs().t()
    assert ((got - want).abs() <= 2 ** -10 * scale + 2 ** -8 * want.abs()).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("lut, kord", [(3, False), (4, False), (5, False), (6, True)])
@pytest.mark.parametrize("M", [1, 16, 128])
def test_float16_activations_on_the_gpu_equal_the_twin(M, lut, kord):
    """A float16 model's decode products (tables built in float16) against the twin of the same lookup with
    float16 weights."""
    from longrl.ops.nf4_matmul import nf4_group, nf4_group_linear, nf4_group_reference, nf4_group_weight, twin_options

    params = [_quantized(n, 4096, seed=M + n, device="cuda")[0] for n in (1024, 512)]
    g = nf4_group(params, torch.randn(32, 4096, dtype=torch.float16, device="cuda"))
    x = torch.randn(M, 4096, dtype=torch.float16, device="cuda")
    got = nf4_group_linear(x, g, launch=dict(lut=lut, kord=kord)).float()
    assert got.isfinite().all()
    twin = twin_options(lut)
    want = nf4_group_reference(x, g, **twin).float()
    scale = x.float().abs() @ nf4_group_weight(g, torch.float16, **twin).float().abs().t()
    assert ((got - want).abs() <= 2 ** -10 * scale + 2 ** -8 * want.abs()).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("M", [1, 8, 16, 128])
def test_fixup_on_the_gpu_equals_the_split_sum_launch(M):
    """Splits summed by each tile's last program (the fixup launch choice: arrival counts, acquire/release) on the
    GPU, NF4 and FP8 groups of the 8B q/k/v shape with LoRA A rows and a bias: bit for bit the split-sum launch's,
    eagerly and on 20 replays of a CUDA graph of 3 calls (every count back at zero after each)."""
    from longrl.ops import fp8_blocks as fb
    from longrl.ops import fp8_matmul as fm
    from longrl.ops import nf4_matmul as nm

    dense = torch.randn(32, 4096, dtype=torch.bfloat16, device="cuda") * 0.02
    biases = [torch.randn(n, dtype=torch.bfloat16, device="cuda") for n in (4096, 1024, 1024)]
    ws = [fb.quantize_fp8_blocks(torch.randn(n, 4096, device="cuda") * 0.02) for n in (4096, 1024, 1024)]
    nf4 = [_quantized(n, 4096, seed=n + i, device="cuda")[0] for i, n in enumerate((4096, 1024, 1024))]
    cases = [(nm.nf4_group(nf4, dense, biases), nm.nf4_group_linear),
             (fm.fp8_group([q for q, _ in ws], [s for _, s in ws], dense, biases), fm.fp8_group_linear)]
    x = torch.randn(M, 4096, dtype=torch.bfloat16, device="cuda")
    for g, linear in cases:
        want = linear(x, g, launch=dict(programs=528))
        fixup = dict(programs=528, fixup=True)
        assert torch.equal(linear(x, g, launch=fixup).view(torch.int16), want.view(torch.int16))
        linear(x, g, launch=fixup)  # (warm before the capture)
        graph, outs = torch.cuda.CUDAGraph(), []
        with torch.cuda.graph(graph):
            outs = [linear(x, g, launch=fixup) for _ in range(3)]
        for _ in range(20):
            graph.replay()
            torch.cuda.synchronize()
            assert all(torch.equal(o.view(torch.int16), want.view(torch.int16)) for o in outs)
            assert not g.locks.any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("M", [1, 16, 128])
def test_bf16_kernel_on_the_gpu_equals_bitsandbytes(M):
    from longrl.ops.nf4_matmul import nf4_linear, nf4_operands

    param = _quantized(1024, 4096, seed=M, device="cuda")[0]
    ops = nf4_operands(param)
    x = torch.randn(M, 4096, dtype=torch.bfloat16, device="cuda")
    want = bnb.matmul_4bit(x, param.t(), quant_state=param.quant_state).float()
    got = nf4_linear(x, *ops).float()
    # both sum 4,096 products in their own order and round to bfloat16 (bitsandbytes' one-row product keeps
    # partial sums in 16 bits): the error scales with Σ|x·w|, not with the (cancelling) result
    from longrl.ops.nf4_matmul import dequantize_nf4

    scale = x.float().abs() @ dequantize_nf4(*ops, torch.float32).abs().t()
    assert ((got - want).abs() <= 2 ** -10 * scale).all()


def _run_asm(asm: str, w: int, planes: list[int]) -> dict:
    """The registers after running a lookup's PTX with its code bytes w in $4 and the table's planes L0..L3, H0..H3
    in $5.. (each four times: pack=4)."""
    return run_ptx(asm, {"$4": w, **{f"${5 + 4 * i + r}": p for i, p in enumerate(planes) for r in range(4)}})


def test_prmt_lookup_asm_replayed_on_the_cpu():
    """The GPU's code lookup (PRMT_ASM, inline PTX the interpreter cannot run), executed line by line by an emulator
    of its four opcodes: for random 16-entry tables of bf16 bits (as two byte planes of four registers) and random
    code bytes, its outputs are the table entries of each byte's high nibble and low nibble, in element order."""
    import random

    nm = pytest.importorskip("longrl.ops.nf4_matmul")
    if nm.triton is None:
        pytest.skip("needs Triton")
    asm = nm.PRMT_ASM.value
    rng = random.Random(0)
    for _ in range(300):
        vals = [rng.getrandbits(16) for _ in range(16)]
        planes = [sum((vals[4 * q + t] >> shift & 0xFF) << 8 * t for t in range(4))
                  for shift in (0, 8) for q in range(4)]  # L0..L3, H0..H3
        w = rng.getrandbits(32)
        regs = _run_asm(asm, w, planes)
        got_hi = [regs["$0"] & 0xFFFF, regs["$0"] >> 16, regs["$1"] & 0xFFFF, regs["$1"] >> 16]
        got_lo = [regs["$2"] & 0xFFFF, regs["$2"] >> 16, regs["$3"] & 0xFFFF, regs["$3"] >> 16]
        code_bytes = [(w >> 8 * i) & 0xFF for i in range(4)]
        assert got_hi == [vals[b >> 4] for b in code_bytes]
        assert got_lo == [vals[b & 15] for b in code_bytes]


def test_k_ordered_prmt_lookup_asm_replayed_on_the_cpu():
    """PRMT_ASM_K (the kord launch choice's lookup) run by the same emulator: for random tables and code bytes its
    four outputs are the values of bytes 0, 1, 2, 3 in k order, each byte's high-nibble entry first; the values
    are PRMT_ASM's, paired differently, in fewer instructions (22 against 25 a four bytes)."""
    import random

    nm = pytest.importorskip("longrl.ops.nf4_matmul")
    if nm.triton is None:
        pytest.skip("needs Triton")
    rng = random.Random(1)
    for _ in range(300):
        vals = [rng.getrandbits(16) for _ in range(16)]
        planes = [sum((vals[4 * q + t] >> shift & 0xFF) << 8 * t for t in range(4))
                  for shift in (0, 8) for q in range(4)]
        w = rng.getrandbits(32)
        regs = _run_asm(nm.PRMT_ASM_K.value, w, planes)
        got = [r >> 16 * half & 0xFFFF for r in (regs["$0"], regs["$1"], regs["$2"], regs["$3"]) for half in (0, 1)]
        code_bytes = [(w >> 8 * i) & 0xFF for i in range(4)]
        assert got == [vals[b >> 4 if h == 0 else b & 15] for b in code_bytes for h in (0, 1)]
    count = [len([ln for ln in asm.splitlines() if ln.strip() and ln.strip()[0] not in "{}."])
             for asm in (nm.PRMT_ASM.value, nm.PRMT_ASM_K.value)]
    assert count == [25, 22]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("M", [1, 61, 200])
def test_group_kernel_on_the_gpu_equals_the_twin(M):
    """bf16 on the GPU: a q/k/v-like group with LoRA A rows and a bias, and a down-like weight (K = 14,336 in
    112 chunks, split) under every launch choice of the table, the other operand order and the register gather,
    each against the float32 product of its own lookup's bf16 weights (twin_options: luts 4-6 round or scale them
    otherwise than bitsandbytes)."""
    from longrl.ops.nf4_matmul import (LAUNCH, PERMUTE_FALLBACKS, launch_for, nf4_group, nf4_group_linear,
                                       nf4_group_weight, twin_options)

    torch.manual_seed(M)
    cases = [(nf4_group([_quantized(n, 4096, seed=n, device="cuda")[0] for n in (512, 128, 128)],
                        torch.randn(96, 4096, device="cuda", dtype=torch.bfloat16) * 0.02,
                        [torch.randn(n, device="cuda", dtype=torch.bfloat16) for n in (512, 128, 128)])),
             nf4_group([_quantized(256, 14336, seed=3, device="cuda")[0]], None, None)]
    for g in cases:
        x = torch.randn(M, g.K, dtype=torch.bfloat16, device="cuda")
        choices = [dict(c) for c in {tuple(sorted(c.items())) for c in LAUNCH.values()}]  # the table's, once each
        PERMUTE_FALLBACKS.clear()
        for i, cfg in enumerate(choices + [dict(swap=False, bn=64, warps=4, stages=2, programs=132), dict(lut=1)]):
            # the weights this choice multiplies, exactly (luts 4-6 round or scale them otherwise: twin_options)
            lut = launch_for(M, cfg)[1]["lut"]  # (a choice's missing keys are the table entry's)
            W = nf4_group_weight(g, torch.bfloat16, **twin_options(lut)).float()
            exact = x.float() @ W.t() + (g.bias.float() if g.bias is not None else 0)
            scale = x.float().abs() @ W.abs().t()
            got = nf4_group_linear(x, g, launch=cfg).float()
            assert got.shape == exact.shape
            # one bfloat16 rounding of the result (2^-8 relative) plus float32 sums in another order
            assert ((got - exact).abs() <= 2 ** -8 * exact.abs() + 2 ** -12 * scale + 1e-3).all(), cfg
            if i == len(choices) - 1:  # the table's builds ran the byte permutes themselves (the measured path)
                assert not PERMUTE_FALLBACKS, PERMUTE_FALLBACKS


def tiny_qlora():
    """A 2-layer float16 Llama (hidden 128, MLP 256, vocab 97) with every projection in NF4 and LoRA r = 4."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from longrl.config.schema import LoraConfig
    from longrl.models import apply_lora
    from longrl.models.quantize import quantize_model

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg).to(torch.float16).eval()
    quantize_model(model, torch.randint(0, 97, (2, 16)), exception_budget=0.0)
    return apply_lora(model, LoraConfig(r=4, alpha=8.0))


SAMPLER_CHECK = textwrap.dedent('''
    import sys
    sys.path.insert(0, "tests")
    import torch
    from test_nf4_matmul import tiny_qlora
    from longrl.rollout import Sampler, SamplingParams

    model = tiny_qlora()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    codes = {n: p.detach().clone() for n, p in model.named_parameters() if p.dtype == torch.uint8}
    runs = []
    for nf4, halves in ((False, False), (True, False), (True, True)):
        sampler = Sampler(model, None, nf4_kernel=nf4, nf4_halves=halves)
        sampler.use_triton = True  # the fused decode kernels through the interpreter
        r = sampler.generate(prompts, 2, SamplingParams(max_new_tokens=6, temperature=0))
        runs.append((r, sampler.last_stats))
        # the codes as they were after the call (the halves layout undone)
        assert all(torch.equal(p, codes[n]) for n, p in model.named_parameters() if n in codes)
    (plain, s0), (fast, s1), (halved, s2) = runs
    assert s0["nf4_projections"] == 0 and s1["nf4_projections"] == s2["nf4_projections"] == 7 * 2, (s0, s1)
    assert s1["packed_groups"] == 4 * 2, s1  # q/k/v + A, o + A, gate/up + A, down + A: one NF4 product each
    assert s1["lora_fused"] and s1["fast_decode"]
    assert s1["nf4_halves_groups"] == 0 and s2["nf4_halves_groups"] == 4 * 2, s2  # (K 128 and 256: whole chunks)
    for fast_run in (fast, halved):  # (the halved call's prefill reads bitsandbytes' order: module_order)
        assert fast_run.completion_ids == plain.completion_ids, (fast_run.completion_ids, plain.completion_ids)
        a = torch.tensor(sum(fast_run.logprobs, [])); b = torch.tensor(sum(plain.logprobs, []))
        assert (a - b).abs().max() < 2e-2, (a - b).abs().max()
    print("sampler ok")
''')


def test_sampler_with_the_nf4_product_equals_bitsandbytes_path():
    """generation.nf4_kernel: a QLoRA model's decode steps through the grouped 4-bit products (each layer's
    q/k/v, o, gate/up and down with their LoRA A rows, the B products folded into the glue kernels) give
    bitsandbytes' path's tokens (greedy) and log-probs (float16, through the interpreter), on every projection of
    every layer; with the codes in bitsandbytes' order and in the halves layout (Sampler(nf4_halves)), which
    the call undoes (the model's codes after it equal those before, byte for byte)."""
    assert "sampler ok" in run_interpreted(SAMPLER_CHECK)


@pytest.mark.parametrize("N, K", [(3, 40), (5, 96)])
def test_twin_handles_blocks_that_run_across_rows(N, K):
    """bitsandbytes' 64-element blocks run across rows (quantize_4bit makes ⌈N·K/64⌉ of them): with N·K not a
    multiple of 64 the last is partial. The twin reads them flat, as they were made; it reconstructs the weight
    as well as NF4 does. (bitsandbytes' own CPU dequantization indexes rows by ⌊K/64⌋ blocks there, so it is no
    reference for these shapes; the sampler only routes K a multiple of 64 to the kernel.)"""
    import bitsandbytes.functional as bnbf

    from longrl.ops.nf4_matmul import dequantize_nf4, nf4_operands

    torch.manual_seed(N)
    W = torch.randn(N, K, dtype=torch.bfloat16)
    packed, state = bnbf.quantize_4bit(W, blocksize=64, quant_type="nf4", compress_statistics=True)
    assert state.absmax.numel() == -(-N * K // 64)
    param = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, quant_type="nf4", blocksize=64,
                              bnb_quantized=True)
    got = dequantize_nf4(*nf4_operands(param), torch.float32)
    assert got.shape == (N, K)
    assert (got - W.float()).abs().mean() < 0.1  # NF4's error on unit normals is ≈ 0.07


def test_codes_not_stored_as_bytes_are_refused():
    import bitsandbytes.functional as bnbf

    from longrl.ops.nf4_matmul import nf4_operands

    W = torch.randn(8, 128, dtype=torch.bfloat16)
    packed, state = bnbf.quantize_4bit(W, blocksize=64, quant_type="nf4", quant_storage=torch.bfloat16)
    param = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, quant_type="nf4", blocksize=64,
                              bnb_quantized=True)
    with pytest.raises(ValueError, match="uint8"):
        nf4_operands(param)


def test_prepare_without_bitsandbytes_routes_nothing(monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    from longrl.rollout.fast_decode import FastDecoder

    cfg = LlamaConfig(vocab_size=50, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    decoder = FastDecoder(LlamaForCausalLM(cfg))
    monkeypatch.setitem(sys.modules, "bitsandbytes.nn", None)  # import fails as if it were not installed
    assert decoder.prepare_quantized() == {"nf4": 0, "fp8": 0} and decoder.quant == {}
