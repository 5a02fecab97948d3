"""The few-row NF4 product's CUDA kernels (ops/nf4_mma.py, built at first use by NVRTC: nf4_mma.cu and the staged
nf4_mma_staged.cu) against their twin, lut 4's x · (cast(code) · absmax)ᵀ in float32
(nf4_group_reference(scale_after=True)): odd and block-crossing shapes (rows that end inside a 32- or 128-row unit,
weights that meet inside one, three weights in one unit, K not a multiple of a four-block pass or stage, dense rows
of odd count), 1 to 32 rows of x, one and several K splits, 2 to 4 stages, bfloat16 and float16, eagerly and in a
CUDA graph.
On the CPU: where it does not apply it says so and the caller's path runs."""

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")

def _group(rows, K, R, bias, dtype, device, seed=0):
    import bitsandbytes.functional as bnbf

    from longrl.ops.nf4_matmul import nf4_group

    torch.manual_seed(seed)
    params = []
    for n in rows:
        W = torch.randn(n, K, dtype=torch.bfloat16, device=device)
        packed, state = bnbf.quantize_4bit(W, blocksize=64, quant_type="nf4", compress_statistics=True)
        params.append(bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, quant_type="nf4",
                                        blocksize=64, bnb_quantized=True))
    dense = torch.randn(R, K, dtype=dtype, device=device) * 0.05 if R else None
    biases = [torch.randn(n, dtype=dtype, device=device) for n in rows] if bias else None
    return nf4_group(params, dense, biases)


def _check(x, g, got):
    from longrl.ops.nf4_matmul import nf4_group_reference, nf4_group_weight

    want = nf4_group_reference(x, g, scale_after=True).float()
    scale = x.float().abs() @ nf4_group_weight(g, x.dtype, scale_after=True).float().abs().t()
    assert got.shape == want.shape
    # one 16-bit rounding of the result, float32 sums in another order
    assert ((got.float() - want).abs() <= 2 ** -8 * want.abs() + 2 ** -12 * scale + 1e-3).all()


SHAPES = [((512, 128, 128), 4096, 96, True),   # q/k/v-like with LoRA A rows and a bias
          ((48, 16, 40), 320, 33, False),      # weights meeting inside a 32-row unit, 104 rows, 5 blocks, odd R
          ((256,), 14336, 0, False),           # down-like: 224 blocks, split
          ((80,), 192, 0, True),               # 3 blocks (less than a pass), rows ending inside a unit
          ((144, 48, 100), 640, 40, True)]     # three weights in one 128-row unit, 10 blocks (2.5 stages)

# each kernel with its K split chosen, one split, many splits (the staged one with 3, 2 and 4 stages)
LAUNCHES = [dict(waves=1), dict(min_blocks=10 ** 6), dict(waves=8, min_blocks=1),
            dict(staged=True, waves=1), dict(staged=True, mma_stages=2, min_blocks=10 ** 6),
            dict(staged=True, mma_stages=4, waves=8, min_blocks=1)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("M", [1, 5, 8, 9, 16, 17, 32])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_equals_the_twin(M, shape, dtype):
    from longrl.ops import cuda_build
    from longrl.ops.nf4_mma import nf4_mma_linear

    rows, K, R, bias = shape
    g = _group(rows, K, R, bias, dtype, "cuda", seed=M)
    x = torch.randn(M, K, dtype=dtype, device="cuda")
    for launch in LAUNCHES:
        got = nf4_mma_linear(x, g, launch)
        assert got is not None, (launch, cuda_build.FAILURES)
        _check(x, g, got)
        assert not g.locks.any()  # every arrival count back at zero
        assert torch.equal(nf4_mma_linear(x, g, launch), got)  # the same result every call


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("staged", [False, True])
def test_group_product_takes_the_kernel_and_a_cuda_graph_replays_it(staged):
    """nf4_group_linear with the ``mma`` launch choice gives the kernel's result; captured in a CUDA graph (3 calls,
    splits summed by their last item) its replays give it again, the arrival counts back at zero."""
    from longrl.ops.nf4_matmul import nf4_group_linear
    from longrl.ops.nf4_mma import nf4_mma_linear

    g = _group((512, 128, 128), 4096, 96, True, torch.bfloat16, "cuda")
    x = torch.randn(8, 4096, dtype=torch.bfloat16, device="cuda")
    launch = dict(mma=True, staged=staged)
    want = nf4_mma_linear(x, g, launch)
    assert torch.equal(nf4_group_linear(x.view(2, 4, 4096), g, launch=launch).view(8, -1), want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [nf4_group_linear(x, g, launch=launch) for _ in range(3)]
    for _ in range(10):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(o, want) for o in outs)
        assert not g.locks.any()


def test_where_it_does_not_apply_it_returns_none_and_says_why():
    from longrl.ops.nf4_mma import nf4_mma_linear, why_not

    g = _group((64,), 128, 0, False, torch.bfloat16, "cpu")
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    assert "CUDA" in why_not(x, g)
    assert nf4_mma_linear(x, g) is None


def test_a_build_without_the_compiler_library_is_refused_with_its_reason(monkeypatch):
    from longrl.ops import cuda_build

    monkeypatch.setitem(cuda_build._LIBS, "nvrtc", None)
    monkeypatch.setattr(cuda_build, "_BUILT", {})
    monkeypatch.setattr(cuda_build, "FAILURES", {})
    assert cuda_build.build('extern "C" __global__ void k() {}', "k", [], torch.device("cuda", 0)) is None
    assert any("NVRTC" in why for why in cuda_build.FAILURES.values())


@pytest.mark.parametrize("granule", [1, 4])
@pytest.mark.parametrize("units, n_blocks, resident", [(898, 64, 660), (129, 224, 660), (3, 5, 132), (1, 1, 1),
                                                       (49, 64, 264), (33, 10, 264)])
def test_split_covers_k_and_counts_whole_waves(units, n_blocks, resident, granule):
    from longrl.ops.nf4_mma import split_for

    split, per_split = split_for(units, n_blocks, resident, min_blocks=4, fixup_blocks=2, granule=granule)
    assert (split - 1) * per_split < n_blocks <= split * per_split  # every block once, no empty split
    assert split == 1 or per_split >= 4
    assert per_split % granule == 0  # whole stages
    if (units, n_blocks, resident) == (898, 64, 660):  # one split: 2 waves × 64 blocks; two: 3 × 32 (+ 2)
        assert (split, per_split) != (1, 64)


def test_with_mma_adds_an_eight_row_entry_and_leaves_the_table():
    from longrl.ops import nf4_matmul as nm

    before = {b: dict(c) for b, c in nm.LAUNCH.items()}
    table = nm.with_mma(nm.LAUNCH)
    assert nm.LAUNCH == before and not any(c.get("mma") for c in before.values())  # off by default
    assert table[8] == {**before[16], **nm.MMA_LAUNCH}
    assert nm.launch_for(8, table=table)[1]["mma"] and not nm.launch_for(9, table=table)[1].get("mma")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_min_bytes_runs_a_small_group_on_the_entrys_triton_choice_and_a_large_one_on_the_kernel():
    from longrl.ops import nf4_matmul as nm
    from longrl.ops.nf4_mma import nf4_mma_linear

    small, large = _group((80,), 192, 0, True, torch.bfloat16, "cuda"), _group((256,), 14336, 0, False,
                                                                                 torch.bfloat16, "cuda", seed=1)
    entry = dict(nm.launch_for(8)[1])
    launch = {**entry, "mma": True, "waves": 1, "min_bytes": 10 ** 5}  # codes: small 7,680 bytes, large 1.8 MB
    for g, kernel in ((small, False), (large, True)):
        x = torch.randn(8, g.K, dtype=torch.bfloat16, device="cuda")
        got = nm.nf4_group_linear(x, g, launch=launch)
        direct = nf4_mma_linear(x, g, launch)
        assert (direct is not None) == kernel
        assert torch.equal(got, direct if kernel else nm.nf4_group_linear(x, g, launch=entry))


def test_min_bytes_leaves_small_groups_to_the_triton_path():
    from types import SimpleNamespace

    from longrl.ops import nf4_mma

    group = SimpleNamespace(packed=[torch.zeros(3000, dtype=torch.uint8), torch.zeros(1000, dtype=torch.uint8)])
    assert nf4_mma.takes(group, {}) and nf4_mma.takes(group, {"min_bytes": 4000})
    assert not nf4_mma.takes(group, {"min_bytes": 4001})
