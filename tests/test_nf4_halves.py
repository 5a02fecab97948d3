"""The NF4 codes' halves layout (ops/nf4_halves.py): an exact in-place byte permutation and its inverse, its lookup
PTX replayed on the CPU, and the product on halves groups against the plain twin (Triton's interpreter, float16;
bf16 on the GPU)."""

import random
import textwrap

import pytest
import torch
from interpreter import run_interpreted
from ptx_emulator import run_ptx

from longrl.ops import nf4_halves as nh


def _codes_in_k_order(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed >> 4, packed & 15), dim=-1).reshape(-1)


@pytest.mark.parametrize("N, K", [(1, 128), (3, 384), (17, 1280)])
def test_halves_layout_pairs_each_chunks_two_blocks_and_round_trips(N, K):
    torch.manual_seed(N * K)
    packed = torch.randint(0, 256, (N * K // 2,), dtype=torch.uint8)
    original = packed.clone()
    codes = _codes_in_k_order(packed).view(-1, 128)  # [chunks, 128] in k order
    nh.to_halves_(packed, K)
    assert torch.equal(packed.view(-1, 64) >> 4, codes[:, :64])  # high nibbles: the chunk's first block
    assert torch.equal(packed.view(-1, 64) & 15, codes[:, 64:])  # low: its second
    assert torch.equal(nh.halves_codes(packed, K), original)  # a copy back, the halves untouched
    assert not torch.equal(packed, original) or N * K < 256
    nh.from_halves_(packed, K)
    assert torch.equal(packed, original)


def test_halves_layout_converts_in_slices(monkeypatch):
    monkeypatch.setattr(nh, "SLICE_CHUNKS", 3)  # 10 chunks: slices of 3, 3, 3, 1
    packed = torch.randint(0, 256, (10 * 64,), dtype=torch.uint8)
    original = packed.clone()
    want = nh.to_halves_(packed.clone(), 128 * 10)
    monkeypatch.setattr(nh, "SLICE_CHUNKS", 1 << 18)
    assert torch.equal(nh.to_halves_(packed, 128 * 10), want)
    assert torch.equal(nh.from_halves_(packed, 128 * 10), original)


REPAIR_CHECK = textwrap.dedent('''
    import torch
    from longrl.ops import nf4_halves as nh

    for chunks in (1, 31, 32, 33, 70):  # one program's block of 32 chunks, and across blocks
        torch.manual_seed(chunks)
        packed = torch.randint(0, 256, (chunks * 64,), dtype=torch.uint8)
        want = nh.to_halves_(packed.clone(), 128, kernel=False)
        got = packed.clone()
        nh._repair_kernel[(-(-chunks // nh.REPAIR_BLOCK),)](got, chunks, TO_HALVES=True, BLOCK=nh.REPAIR_BLOCK)
        assert torch.equal(got, want), chunks
        nh._repair_kernel[(-(-chunks // nh.REPAIR_BLOCK),)](got, chunks, TO_HALVES=False, BLOCK=nh.REPAIR_BLOCK)
        assert torch.equal(got, packed), chunks
    print("repair ok")
''')


def test_in_place_kernel_equals_the_pytorch_path_both_ways():
    """The CUDA path's one-launch in-place kernel (Triton's interpreter) against the PyTorch twin, both ways, at
    chunk counts inside one program's block and across blocks."""
    assert "repair ok" in run_interpreted(REPAIR_CHECK)


def test_halves_layout_refuses_partial_chunks():
    with pytest.raises(ValueError, match="multiple of 128"):
        nh.to_halves_(torch.zeros(96, dtype=torch.uint8), 192)
    with pytest.raises(ValueError, match="uint8"):
        nh.to_halves_(torch.zeros(64, dtype=torch.int8), 128)


@pytest.mark.parametrize("pack", [2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lookup_ptx_gives_each_bytes_two_table_values(pack, dtype):
    """The lookup PTX, replayed: for random tables and code bytes, its first output holds each byte's high-nibble
    entry, its second the low-nibble entry, in element order (two 16-bit values a register), the table's bits
    exactly those of dtype(code)."""
    rng = random.Random(pack)
    for _ in range(200):
        code = [rng.uniform(-1, 1) for _ in range(16)]
        bits = [b & 0xFFFF for b in torch.tensor(code).to(dtype).view(torch.int16).tolist()]
        ptx = nh.lookup_ptx(nh.table_planes(code, dtype), pack)
        w = rng.getrandbits(8 * pack)
        regs = run_ptx(ptx, {f"${pack}": w})
        values = [regs[f"${r}"] >> 16 * h & 0xFFFF for r in range(pack) for h in (0, 1)]
        code_bytes = [(w >> 8 * i) & 0xFF for i in range(pack)]
        assert values[:pack] == [bits[b >> 4] for b in code_bytes]
        assert values[pack:] == [bits[b & 15] for b in code_bytes]
    assert nh.lookup_constraints(pack).count("=r") == pack
    with pytest.raises(ValueError):
        nh.lookup_ptx(nh.table_planes(code, dtype), 8)


HALVES_CHECK = textwrap.dedent('''
    import sys
    sys.path.insert(0, "tests")
    import torch
    from test_nf4_matmul import _quantized
    from longrl.ops import nf4_matmul as nm

    # (rows of each weight, K, rows of x, 16-bit rows, bias, launch): K splits, tiles shrunk to the weights' bounds,
    # a partial last tile, luts 4, 5, 6 (3 runs as 4), fixup
    cases = [([64, 48, 40], 384, 5, 3, True, dict(lut=4, programs=1000)),
             ([80], 1280, 17, 0, False, dict(lut=5, programs=1000, fixup=True)),
             ([32, 16], 256, 1, 7, True, dict(lut=6, bn=32)),
             ([48], 128, 33, 0, False, dict(lut=3))]
    for rows, K, M, R, bias, launch in cases:
        torch.manual_seed(K + M)
        params = [_quantized(n, K, seed=n + i)[0] for i, n in enumerate(rows)]
        dense = torch.randn(R, K, dtype=torch.float16) if R else None
        biases = [torch.randn(n, dtype=torch.float16) for n in rows] if bias else None
        g = nm.nf4_group(params, dense, biases)
        x = torch.randn(M, K, dtype=torch.float16)
        lut = max(4, launch["lut"])
        before = [p.clone() for p in g.packed]
        want = nm.nf4_group_reference(x, g, **nm.twin_options(lut)).float()
        nm.set_halves(g, True)
        assert g.halves and not all(torch.equal(a, b) for a, b in zip(g.packed, before))
        assert torch.equal(nm.nf4_group_reference(x, g, **nm.twin_options(lut)).float(), want)  # twin reads either
        got = nm.nf4_group_linear(x, g, launch=launch).float()
        scale = x.float().abs() @ nm.nf4_group_weight(g, torch.float32).abs().t()
        assert ((got - want).abs() <= 2 ** -9 * scale + 1e-3).all(), (rows, K, M, float((got - want).abs().max()))
        nm.set_halves(g, False)
        assert all(torch.equal(a, b) for a, b in zip(g.packed, before))  # the weights' bytes back as they were
    print("halves ok")
''')


def test_halves_kernel_equals_the_twin_under_the_interpreter():
    """The product on halves-layout groups (Triton's interpreter: the table in memory stands in for the PTX lookup
    tested above) against the plain twin of the same launch choice's roundings, over odd shapes; the group's
    codes back bit for bit after set_halves(False)."""
    pytest.importorskip("bitsandbytes")
    assert "halves ok" in run_interpreted(HALVES_CHECK)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("M", [1, 16, 33, 128])
@pytest.mark.parametrize("launch", [dict(lut=4, pack=2), dict(lut=5, pack=4), dict(lut=5, pack=2, fixup=True)])
def test_halves_kernel_on_the_gpu_equals_the_twin(M, launch):
    """bf16 on the GPU: the PTX lookup in the halves layout against the twin of its roundings (q/k/v-like group with
    LoRA A rows and biases, K = 4,096), and the codes restored bit for bit."""
    pytest.importorskip("bitsandbytes")
    from test_nf4_matmul import _quantized

    from longrl.ops import nf4_matmul as nm

    torch.manual_seed(M)
    K, rows = 4096, [256, 64, 64]
    params = [_quantized(n, K, seed=i, device="cuda")[0] for i, n in enumerate(rows)]
    g = nm.nf4_group(params, torch.randn(32, K, dtype=torch.bfloat16, device="cuda") * 0.02,
                     [torch.randn(n, dtype=torch.bfloat16, device="cuda") for n in rows])
    x = torch.randn(M, K, dtype=torch.bfloat16, device="cuda")
    want = nm.nf4_group_reference(x, g, **nm.twin_options(launch["lut"])).float()
    before = [p.clone() for p in g.packed]
    nm.set_halves(g, True)
    via_twin = [nh.to_halves_(p.clone(), K, kernel=False) for p in before]
    try:
        assert all(torch.equal(a, b) for a, b in zip(g.packed, via_twin))  # the in-place kernel as its twin
        got = nm.nf4_group_linear(x, g, launch={**nm.LAUNCH[16], "kord": False, **launch}).float()
    finally:
        nm.set_halves(g, False)
    assert all(torch.equal(a, b) for a, b in zip(g.packed, before))
    scale = x.float().abs() @ nm.nf4_group_weight(g, torch.float32).abs().t()
    assert ((got - want).abs() <= 2 ** -8 * scale + 1e-2).all(), float((got - want).abs().max())


def test_a_sampler_call_keeps_the_halves_layout_inside_and_undoes_it_whatever_happens():
    """Sampler.prepared with the NF4 kernel: the groups' codes are in the halves layout for the call, in
    bitsandbytes' order inside module_order (a forward through the modules: prefill, extend steps), and back in
    that order after a call that raised."""
    pytest.importorskip("bitsandbytes")
    from test_nf4_matmul import tiny_qlora

    from longrl.rollout import Sampler

    model = tiny_qlora()
    codes = {n: p.detach().clone() for n, p in model.named_parameters() if p.dtype == torch.uint8}

    def same() -> bool:
        return all(torch.equal(p, codes[n]) for n, p in model.named_parameters() if n in codes)

    sampler = Sampler(model, None, nf4_halves=True)
    sampler.use_triton = True  # (the routing as on a GPU; no kernel runs here)
    with pytest.raises(RuntimeError, match="a failure mid-call"):
        with sampler.prepared():
            assert len(sampler.fast.halves) == 4 * 2 and not same()
            with sampler.module_order():
                assert same()
            assert not same()
            raise RuntimeError("a failure mid-call")
    assert same() and sampler.fast.halves == []
    off = Sampler(model, None)
    off.use_triton = True
    with off.prepared() as (_, quant, _):  # off (the default): routed, the codes in bitsandbytes' order
        assert quant["nf4"] == 7 * 2 and off.fast.halves == [] and same()


def test_config_key_needs_the_nf4_kernel_and_reaches_the_sampler():
    """generation.nf4_halves: refused without generation.nf4_kernel (a ConfigError naming the key), and handed to
    the sampler the trainer builds."""
    from test_sampler import tiny_model

    from longrl.config import Config, ConfigError
    from longrl.config.validation import validate
    from longrl.rollout.completions import build_sampler

    cfg = Config()
    cfg.generation.nf4_halves, cfg.generation.nf4_kernel = True, False
    with pytest.raises(ConfigError, match="generation.nf4_halves"):
        validate(cfg, require_rewards=False)
    cfg.generation.nf4_kernel = True
    validate(cfg, require_rewards=False)
    model, tok = tiny_model(seed=0)
    assert build_sampler(model, tok, cfg.generation, max_length=64).nf4_halves is True
    assert build_sampler(model, tok, Config().generation, max_length=64).nf4_halves is False
