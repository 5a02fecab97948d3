"""The decode-step products of an NF4 (QLoRA) base: bitsandbytes' path (dequantize the whole weight, then a bf16
product) against longrl's kernel that reads the 4-bit weight directly (src/longrl/ops/nf4_matmul.py), and the
bf16 weight's own product, on the Llama-3.1-8B projection shapes; then the packed decode's groups (q/k/v + A,
o + A, gate/up + A, down + A, as rollout/fast_decode.py runs them) under each launch choice of a sweep, against the
bf16 packed product of the same group.

Bytes a call must read: bf16 weight 2 B/param; NF4 0.5 B/param + a float32 scale per 64 (0.0625 B/param);
bitsandbytes' batched path moves ~4.5 B/param (reads 4 bits, writes and reads back 16). GB/s below count the
kernel's own floor bytes (0.5625 B/param for NF4, 2 for bf16) over the time. Every time is GPU time per call
replayed from a CUDA graph of 20 calls (as a captured decode step runs them: no host launch cost), the calls in
turn on copies of the weights that read more than twice the L2 cache between two reads of one copy: from DRAM, as
in a decode step (results_io.l2_copies; until 2026-12-07 every call read one copy, and the weights that fit in the
L2, an 8B layer's q/k/v, o and down on an H100, were timed at L2's bandwidth).

    python benchmarks/nf4_matmul.py            # the table
    python benchmarks/nf4_matmul.py --sweep    # and the groups' sweep; its fastest choice per row count goes to
                                               # results/nf4_matmul_<card>_sweep.json "best" (rollout_speed.py --nf4-launch)
    python benchmarks/nf4_matmul.py --fp8 [--sweep]   # and, in the same run, an FP8 base's products (below)
    python benchmarks/nf4_matmul.py --sweep --mma --table-only --skip-table --sweep-rows 8,16,32
                                               # the table's entry against the few-row CUDA kernel (ops/nf4_mma.py)

--fp8: the same shapes and groups with FP8 e4m3 weights in 128 × 128 blocks (src/longrl/ops/fp8_matmul.py): longrl's
FP8 kernel (reads 1 byte a weight + 4 bytes a block: floor 1.0002 B/param) against the FP8 layer's own forward
(dequantize the whole weight to bf16, then the bf16 product: the rollout's fallback and the training product) and
bf16, at 1, 8, 16, 32 and 128 rows; with --sweep its launch choices on the packed groups (results
fp8_matmul_<card>_sweep: "best", for rollout_speed.py --fp8-launch; <card>: h100, h200, ...).
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from results_io import card_tag, cold_copies, cold_seconds, copy_bandwidth, run_meta, write_result  # noqa: E402

from longrl.ops import nf4_matmul as nm  # noqa: E402
from longrl.ops import nf4_mma  # noqa: E402

SHAPES = {"q/o 4096x4096": (4096, 4096), "k/v 1024x4096": (1024, 4096), "gate/up 14336x4096": (14336, 4096),
          "down 4096x14336": (4096, 14336)}
# the packed decode's groups of one Llama-3.1-8B layer at LoRA r = 32: (NF4 weights' rows, A rows, K)
GROUPS = {"q/k/v + A": ((4096, 1024, 1024), 96, 4096), "o + A": ((4096,), 32, 4096),
          "gate/up + A": ((14336, 14336), 64, 4096), "down + A": ((4096,), 32, 14336)}
DECODE_ROWS = (16, 128)
FP8_ROWS = (1, 8, 16, 32, 128)
SWEEP_ROWS = (128, 32, 16)  # the rollout's first
TRAIN_ROWS = (2048,)  # training-side products (a micro-batch's tokens): bitsandbytes keeps these


def quantized(N: int, K: int, dev, seed: int = 0):
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbf

    torch.manual_seed(seed)
    W = torch.randn(N, K, dtype=torch.bfloat16, device=dev) * 0.02
    packed, state = bnbf.quantize_4bit(W, blocksize=64, quant_type="nf4", compress_statistics=True)
    return bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, quant_type="nf4", blocksize=64,
                             bnb_quantized=True)


def sweep_choices(M: int) -> list[dict]:
    """Launch choices tried at M rows (128, where the rollout benchmark runs; 32 and 16)."""
    def c(bn, w, st, lut=3, swap=True, **more):
        return dict(bn=bn, swap=swap, join=True, lut=lut, warps=w, stages=st, programs=264, **more)

    # lut 4 (one unscaled table, the scale after each block's product; 25-42% fewer instructions a code in the
    # sm_90 SASS at 16-64 rows, decode_product_sass.md) beside the default lut 3
    # and luts 5 and 6 (lut 4's table, the values scaled before the product: the block products chain in the
    # tensor cores' sum), and a 32-row tile (too small for the warpgroup products: the smaller tensor-core op).
    # Nsight Compute (2026-12-06, logs/gpu_2026-12-06e/ncu_*.txt): at 128 rows the 128-row tile of 8 warps holds
    # one program an SM (168 registers a thread, 133 KB of staged tiles) in 1.7 waves; at 16 rows 6 programs (80
    # registers, 29 KB), half the issue slots used: hence fewer stages, smaller tiles and a register cap (maxnreg:
    # 64 and 72 let 7 programs share an SM at 16 rows, spilling 15 and 3 registers a loop in the CPU's sm_90 build;
    # at 128 rows 128 registers spill 16 and a 64-row tile of 4 warps at 2 stages fits 2 programs without a cap);
    # kord: the values paired in k order by the permutes, 0.8-0.9 fewer instructions a code (decode_product_sass.md)
    # The first sweep of 2026-12-06 (nf4_matmul_h100_call1.md) tried the alternatives above at 16 and 128 rows:
    # kord was the fastest at 16 rows (lut 4, 98.6 µs a layer at 528 programs), 64-row tiles of 4 warps at 3 stages
    # at 128 (lut 5, 209.8 µs at 396 programs, kord not tried there). What follows is the second: kord and stage
    # counts around those winners, and 32 rows (issue 43's middle target) with a list of its own; unroll 2 (two
    # chunks an iteration of the loop over K: 7-8% fewer instructions a chunk in the sm_90 SASS, twice the staged
    # tiles a stage, so at 2 stages beside 3)
    if M >= 128:
        return [c(64, 4, 3, lut=5), c(64, 4, 3, lut=5, kord=True), c(64, 4, 4, lut=5, kord=True),
                c(64, 4, 3, lut=4, kord=True), c(64, 4, 3, lut=6, kord=True), c(128, 8, 3, lut=5, kord=True),
                c(32, 4, 3, lut=5, kord=True), c(64, 8, 3, lut=5, kord=True), c(64, 4, 2, lut=5, kord=True, unroll=2)]
    if M >= 32:
        return [c(64, 4, 3, lut=5), c(64, 4, 3, lut=5, kord=True), c(64, 4, 3, lut=4, kord=True),
                c(64, 4, 4, lut=5, kord=True), c(128, 4, 3, lut=5, kord=True), c(128, 8, 3, lut=5, kord=True),
                c(32, 4, 3, lut=5, kord=True), c(32, 4, 3, lut=4, kord=True), c(64, 4, 2, lut=5, kord=True, unroll=2),
                c(64, 4, 2, lut=4, kord=True, unroll=2)]
    return [c(64, 4, 3, lut=4), c(64, 4, 3, lut=4, kord=True), c(64, 4, 4, lut=4, kord=True),
            c(64, 4, 2, lut=4, kord=True), c(64, 4, 3, lut=5, kord=True), c(64, 4, 3, lut=6, kord=True),
            c(32, 4, 3, lut=4, kord=True), c(64, 4, 3, lut=4, kord=True, maxnreg=72),
            c(64, 4, 3, lut=4, kord=True, unroll=2), c(64, 4, 2, lut=4, kord=True, unroll=2)]


def table(dev, bw: float) -> list[dict]:
    import bitsandbytes as bnb

    rows = []
    for name, (N, K) in SHAPES.items():
        param = quantized(N, K, dev)
        state = param.quant_state
        ops = nm.nf4_operands(param)
        group = nm.nf4_group([param])
        Wd = nm.dequantize_nf4(*ops, torch.bfloat16)
        params = cold_copies(param, group_bytes(group), lambda: quantized(N, K, dev), dev)  # (cold L2)
        nf4s = [group] + [nm.nf4_group([q]) for q in params[1:]]
        Wds = cold_copies(Wd, Wd.nbytes, Wd.clone, dev)
        for M in DECODE_ROWS + TRAIN_ROWS:
            x = torch.randn(M, K, dtype=torch.bfloat16, device=dev)
            want = bnb.matmul_4bit(x, param.t(), quant_state=state)
            got = nm.nf4_group_linear(x, group)
            err = float(((got.float() - want.float()).abs() / (want.float().abs() + 1e-2)).max())
            t_bnb = cold_seconds([partial(bnb.matmul_4bit, x, q.t(), quant_state=q.quant_state) for q in params])
            t_nf4 = cold_seconds([partial(nm.nf4_group_linear, x, g) for g in nf4s])
            t_bf16 = cold_seconds([partial(torch.nn.functional.linear, x, W) for W in Wds])
            nf4_bytes, bf16_bytes = N * K * (0.5 + 4 / 64), N * K * 2
            rows.append(dict(shape=name, M=M, bnb_us=t_bnb * 1e6, nf4_us=t_nf4 * 1e6, bf16_us=t_bf16 * 1e6,
                             nf4_gbs=nf4_bytes / t_nf4 / 1e9, bf16_gbs=bf16_bytes / t_bf16 / 1e9,
                             max_rel_err_vs_bnb=err))
            print(rows[-1], flush=True)
    return rows


def same_with_fixup(linear, xs: dict, groups: dict, cfg: dict, rows: list, M: int) -> bool:
    """Whether launch ``cfg`` (fixup on) gives every group's product bit for bit as without it; a difference is a
    row of ``rows`` (an error), not hidden."""
    for name, (g, _) in groups.items():
        got, want = linear(xs[name], g, launch=cfg), linear(xs[name], g, launch={**cfg, "fixup": False})
        if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
            rows.append(dict(M=M, **cfg, error=f"{name}: fixup differs from the split-sum launch by "
                                               f"{float((got.float() - want.float()).abs().max()):.3g}"))
            print(rows[-1], flush=True)
            return False
    return True


def packed_group(name: str, dev, fp8: bool = False):
    """GROUPS[name] as the packed decode holds it: random NF4 (or FP8) weights, then LoRA A rows (bf16, std 0.02)."""
    ns, r, K = GROUPS[name]
    if fp8:
        from longrl.ops import fp8_matmul as fm

        ws = [fp8_weight(n, K, dev, seed=i) for i, n in enumerate(ns)]
        a = torch.randn(r, K, dtype=torch.bfloat16, device=dev) * 0.02
        return fm.fp8_group([q for q, _ in ws], [s for _, s in ws], a)
    params = [quantized(n, K, dev, seed=i) for i, n in enumerate(ns)]
    return nm.nf4_group(params, torch.randn(r, K, dtype=torch.bfloat16, device=dev) * 0.02)


def group_copies(name: str, dev, fp8: bool = False) -> tuple[list, list]:
    """(copies of GROUPS[name] as packed_group makes it, copies of its bf16 weight) for the sweeps' cold timing;
    the first of each is the one the sweeps check results on."""
    g = packed_group(name, dev, fp8=fp8)
    if fp8:
        from longrl.ops import fp8_matmul as fm

        W = fm.fp8_group_weight(g, torch.bfloat16)
    else:
        W = nm.nf4_group_weight(g, torch.bfloat16)
    return (cold_copies(g, group_bytes(g), lambda: packed_group(name, dev, fp8=fp8), dev),
            cold_copies(W, W.nbytes, W.clone, dev))


def group_bytes(g) -> int:
    """The bytes a product of group g reads from its weights: NF4 codes (or FP8 codes), scales, dense rows."""
    parts = [*g.packed, g.scales] if hasattr(g, "packed") else [*g.codes, *g.scales]
    return sum(t.nbytes for t in parts) + (g.dense.nbytes if g.dense is not None else 0)


def sweep(dev, halves: bool = False, table_only: bool = False, mma: bool = False) -> tuple[list[dict], dict]:
    """Every group at each decode row count under each launch choice; the choice with the least summed time of a
    layer's four groups per row count ('best'). table_only: LAUNCH's entry alone (then the halves choices). mma:
    also the few-row CUDA kernel (ops/nf4_mma.py) under mma_choices, at up to 32 rows."""
    groups, copies = {}, {}  # copies: each group's and its bf16 weight's copies, timed in turn (cold L2)
    for name in GROUPS:
        copies[name] = group_copies(name, dev)
        groups[name] = (copies[name][0][0], copies[name][1][0])
    rows, best = [], {}
    for M in SWEEP_ROWS:
        xs = {name: torch.randn(M, g.K, dtype=torch.bfloat16, device=dev) for name, (g, _) in groups.items()}
        bf16 = {name: cold_seconds([partial(torch.nn.functional.linear, xs[name], W) for W in copies[name][1]])
                for name in groups}
        totals = []

        def record(cfg: dict, per: dict, candidate: bool = True) -> None:  # a timed launch choice: a row, and
            if candidate:  # (unless it runs on the halves layout) a candidate for 'best'
                totals.append((sum(per.values()), cfg))
            rows.append(dict(M=M, **cfg, us={k: v * 1e6 for k, v in per.items()}, layer_us=sum(per.values()) * 1e6,
                             bf16_us={k: v * 1e6 for k, v in bf16.items()}, bf16_layer_us=sum(bf16.values()) * 1e6))
            print(rows[-1], flush=True)

        def timed(cfg: dict) -> dict:
            return {name: cold_seconds([partial(nm.nf4_group_linear, xs[name], c, launch=cfg) for c in copies[name][0]])
                    for name in groups}

        def checked(cfg: dict) -> dict | None:  # timed, its results checked first; a launch choice that fails to
            try:  # build or is wrong is reported (a row), not hidden
                for name, (g, W) in groups.items():
                    if (cfg.get("mma") and nf4_mma.takes(g, cfg)  # (not a silent fallback)
                            and nm.nf4_mma_linear(xs[name], g, cfg) is None):
                        from longrl.ops import cuda_build
                        raise RuntimeError(f"the CUDA kernel did not run: {cuda_build.FAILURES}")
                    got = nm.nf4_group_linear(xs[name], g, launch=cfg).float()
                    want = torch.nn.functional.linear(xs[name].float(), W.float())
                    if not torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max())):
                        raise RuntimeError(f"{name}: result off by {float((got - want).abs().max()):.3g}")
                return timed(cfg)
            except Exception as e:
                rows.append(dict(M=M, **cfg, error=f"{type(e).__name__}: {e}"[:200]))
                print(rows[-1], flush=True)
                return None

        for cfg in ([dict(nm.launch_for(M)[1])] if table_only else sweep_choices(M)):
            if (per := checked(cfg)) is not None:
                record(cfg, per)
        for cfg in mma_choices(M) if mma and M <= 32 else ():
            if (per := checked(cfg)) is not None:
                record(cfg, per)
        if halves:  # the same groups with their codes in the halves layout (ops/nf4_halves.py), beside the above
            for gs, _ in copies.values():
                for g in gs:
                    nm.set_halves(g, True)
            try:
                for cfg in halves_choices(M):
                    if (per := checked(cfg)) is not None:
                        record(cfg, per, candidate=False)
            finally:
                for gs, _ in copies.values():
                    for g in gs:
                        nm.set_halves(g, False)
        if not totals:
            continue
        top = min(totals, key=lambda t: t[0])[1]
        for programs in () if table_only else (132, 396, 528, 792, 1056):  # the K split's target, for the fastest
            # build (528 was the most tried until 2026-12-06, and the fastest at 16 rows: more splits may still help
            # the few-row products)
            record({**top, "programs": programs}, timed({**top, "programs": programs}))
        fixup = {**min(totals, key=lambda t: t[0])[1], "fixup": True}  # the fastest, its splits summed by their last
        if not table_only and same_with_fixup(nm.nf4_group_linear, xs, groups, fixup, rows, M):  # programs
            record(fixup, timed(fixup))  # rather than a second launch
        best[M] = min(totals, key=lambda t: t[0])[1]
    return rows, best


def mma_choices(M: int) -> list[dict]:
    """The few-row CUDA kernels' choices (ops/nf4_mma.py; "mma" marks them, "staged" the staged kernel with its
    stages): the 64-wide blocks of K an item reads at least and a split's cost in blocks (nf4_mma.split_for), or
    the items in waves of the resident blocks."""
    entry = dict(nm.launch_for(M)[1])
    # min_bytes: the kernel on the groups of at least 16 MiB of codes (gate/up and down at the 8B shape), Triton's
    # on the others (nf4_mma.takes)
    return ([dict(entry, mma=True, min_blocks=32, fixup_blocks=2, min_bytes=16 << 20),
             dict(entry, mma=True, waves=0.5, min_blocks=32, min_bytes=16 << 20)]
            + [dict(entry, mma=True, min_blocks=b, fixup_blocks=f) for b, f in ((16, 2), (8, 2), (32, 2), (16, 8))]
            + [dict(entry, mma=True, waves=w, min_blocks=b) for w, b in ((0.5, 32), (0.5, 16), (0.25, 32))]
            + [dict(entry, mma=True, staged=True, mma_stages=s, min_blocks=b) for s in (3, 4, 2) for b in (16, 8)]
            + [dict(entry, mma=True, staged=True, mma_stages=s, waves=w, min_blocks=8)
               for s in (3, 4) for w in (1, 2)])


def halves_choices(M: int) -> list[dict]:
    """Launch choices on codes in the halves layout ("halves" marks them; the group's layout is what selects the
    kernel's path): bytes a lookup (pack), luts 4 and 5, stages, tiles, the K split's target, fixup."""
    def c(bn=64, w=4, st=3, lut=4, pack=2, programs=528, **more):
        return dict(bn=bn, swap=True, join=True, lut=lut, warps=w, stages=st, programs=programs, fixup=True,
                    halves=True, pack=pack, **more)

    if M >= 64:
        return [c(lut=5, programs=396), c(lut=5, pack=4, programs=396), c(lut=4, programs=396),
                c(lut=5, st=4, programs=396), c(128, 8, lut=5, programs=396), c(lut=5, programs=264)]
    return [c(lut=4), c(lut=4, pack=4), c(lut=5), c(lut=4, st=4), c(lut=4, st=2), c(128, 4, lut=4),
            c(lut=4, programs=792), c(lut=4, programs=396), c(lut=4, maxnreg=72), c(32, 4, lut=4)]


def fp8_weight(N: int, K: int, dev, seed: int = 0):
    """(codes, scales) of a random N × K weight (bf16, std 0.02) in FP8 blocks."""
    from longrl.ops.fp8_blocks import quantize_fp8_blocks

    torch.manual_seed(seed)
    return quantize_fp8_blocks(torch.randn(N, K, dtype=torch.bfloat16, device=dev) * 0.02)


def fp8_table(dev) -> list[dict]:
    """Each shape at FP8_ROWS rows: longrl's FP8 product, the dequantize-then-bf16 product, the bf16 product."""
    from longrl.ops import fp8_matmul as fm
    from longrl.ops.fp8_blocks import dequantize_fp8, fp8_bytes

    rows = []
    for name, (N, K) in SHAPES.items():
        q, s = fp8_weight(N, K, dev)
        group = fm.fp8_group([q], [s])
        Wd = dequantize_fp8(q, s, torch.bfloat16)
        weights = cold_copies((q, s), fp8_bytes(N, K), lambda: fp8_weight(N, K, dev), dev)  # (cold L2)
        fp8s = [group] + [fm.fp8_group([a], [b]) for a, b in weights[1:]]
        Wds = cold_copies(Wd, Wd.nbytes, Wd.clone, dev)
        for M in FP8_ROWS:
            x = torch.randn(M, K, dtype=torch.bfloat16, device=dev)
            want = torch.nn.functional.linear(x.float(), Wd.float())
            got = fm.fp8_group_linear(x, group).float()
            err = float(((got - want).abs() / (want.abs() + 1e-2)).max())
            t_fp8 = cold_seconds([partial(fm.fp8_group_linear, x, g) for g in fp8s])
            t_deq = cold_seconds([lambda a=a, b=b: torch.nn.functional.linear(x, dequantize_fp8(a, b, torch.bfloat16))
                                  for a, b in weights])
            t_bf16 = cold_seconds([partial(torch.nn.functional.linear, x, W) for W in Wds])
            rows.append(dict(shape=name, M=M, fp8_us=t_fp8 * 1e6, dequant_us=t_deq * 1e6, bf16_us=t_bf16 * 1e6,
                             fp8_gbs=fp8_bytes(N, K) / t_fp8 / 1e9, bf16_gbs=N * K * 2 / t_bf16 / 1e9,
                             max_rel_err=err))
            print(rows[-1], flush=True)
    return rows


def fp8_sweep(dev) -> tuple[list[dict], dict]:
    """The packed decode's groups in FP8 under launch choices at 8, 32 and 128 rows; the least summed layer time
    per row count ('best')."""
    from longrl.ops import fp8_matmul as fm

    groups, copies = {}, {}  # copies as in sweep (cold L2)
    for name in GROUPS:
        copies[name] = group_copies(name, dev, fp8=True)
        groups[name] = (copies[name][0][0], copies[name][1][0])

    def timed(name: str, cfg: dict) -> float:
        return cold_seconds([partial(fm.fp8_group_linear, xs[name], c, launch=cfg) for c in copies[name][0]])

    rows, best = [], {}
    for M in (128, 32, 8):
        xs = {name: torch.randn(M, g.K, dtype=torch.bfloat16, device=dev) for name, (g, _) in groups.items()}
        bf16 = sum(cold_seconds([partial(torch.nn.functional.linear, xs[n], W) for W in copies[n][1]])
                   for n in groups)
        totals = []
        # f16 (float16 codes, the scale after each block's product: 0.53-0.85x the instructions a weight at 16-64
        # rows in the SASS, more at 128, decode_product_sass.md) on each choice beside the default
        for bn, warps, stages, programs, f16 in [(b, w, 3, p, f) for b in (64, 128) for w in (4, 8)
                                                 for p in (264, 528, 792, 1056)
                                                 for f in ((False, True) if p == 528 else (False,))]:
            cfg = dict(bn=bn, warps=warps, stages=stages, programs=programs, f16=f16)
            try:
                total = 0.0
                for name, (g, W) in groups.items():
                    got = fm.fp8_group_linear(xs[name], g, launch=cfg).float()
                    want = torch.nn.functional.linear(xs[name].float(), W.float())
                    if not torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max())):
                        raise RuntimeError(f"{name}: off by {float((got - want).abs().max()):.3g}")
                    total += timed(name, cfg)
            except Exception as e:  # reported, not hidden
                rows.append(dict(M=M, **cfg, error=f"{type(e).__name__}: {e}"[:200]))
                continue
            totals.append((total, cfg))
            rows.append(dict(M=M, **cfg, layer_us=total * 1e6, bf16_layer_us=bf16 * 1e6))
            print(rows[-1], flush=True)
        cfg = {**min(totals, key=lambda t: t[0])[1], "fixup": True} if totals else None
        if cfg and same_with_fixup(fm.fp8_group_linear, xs, groups, cfg, rows, M):  # the fastest, splits summed by
            # their last programs
            total = sum(timed(n, cfg) for n in groups)
            totals.append((total, cfg))
            rows.append(dict(M=M, **cfg, layer_us=total * 1e6, bf16_layer_us=bf16 * 1e6))
            print(rows[-1], flush=True)
        if totals:
            best[M] = min(totals, key=lambda t: t[0])[1]
    return rows, best


def fp8_lines(rows: list[dict], sweep_rows: list[dict], best: dict) -> list[str]:
    from longrl.ops import fp8_matmul as fm

    lines = ["", "## FP8 base (e4m3, 128 × 128 block scales): longrl's FP8 kernel vs dequantize + bf16 vs bf16", "",
             "GB/s: floor bytes (1 B/param + 4 B a block) / time; dequant + bf16: the FP8 layer's own forward (the "
             f"rollout's fallback, and training's product). FP8 launch table: {dict(fm.LAUNCH)}.", "",
             "| weight | rows | longrl FP8 µs | dequant + bf16 µs | bf16 µs | FP8 GB/s | bf16 GB/s | × dequant "
             "| × bf16 | max rel err |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['M']} | {r['fp8_us']:.1f} | {r['dequant_us']:.1f} | {r['bf16_us']:.1f} | "
                     f"{r['fp8_gbs']:,.0f} | {r['bf16_gbs']:,.0f} | {r['dequant_us'] / r['fp8_us']:.2f} | "
                     f"{r['bf16_us'] / r['fp8_us']:.2f} | {r['max_rel_err']:.4f} |")
    if sweep_rows:
        lines += ["", f"FP8 launch sweep over a layer's four packed groups (µs summed); fastest: {best}", "",
                  "| rows | bn | warps | stages | programs | f16 | layer µs | bf16 layer µs | × bf16 |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in sweep_rows:
            head = (f"| {r['M']} | {r['bn']} | {r['warps']} | {r['stages']} | {r['programs']}"
                    f"{' + fixup' if r.get('fixup') else ''} | {r.get('f16', False)} | ")
            lines.append(head + (f"failed: {r['error']} | | |" if "error" in r else
                                 f"{r['layer_us']:.1f} | {r['bf16_layer_us']:.1f} | "
                                 f"{r['bf16_layer_us'] / r['layer_us']:.2f} |"))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweep", action="store_true", help="also time the packed decode's groups under launch choices")
    ap.add_argument("--halves", action="store_true", help="with --sweep: also the groups with their codes in the "
                    "halves layout (ops/nf4_halves.py) under halves_choices, beside the bitsandbytes order")
    ap.add_argument("--mma", action="store_true", help="with --sweep: also the few-row CUDA kernel "
                    "(ops/nf4_mma.py) under mma_choices at up to 32 rows")
    ap.add_argument("--table-only", action="store_true", help="with --sweep: LAUNCH's own entry at each row count "
                    "instead of sweep_choices (with --halves: the halves layout's choices against today's table)")
    ap.add_argument("--skip-table", action="store_true", help="leave out the per-shape table (the sweep alone)")
    ap.add_argument("--sweep-rows", default="", help="comma-separated row counts for --sweep (default 128,32,16)")
    ap.add_argument("--fp8", action="store_true", help="also time an FP8 base's products (and sweep them with "
                    "--sweep) in the same run")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("nf4_matmul.py times CUDA kernels; no GPU here")
    import bitsandbytes

    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    if args.sweep_rows:
        global SWEEP_ROWS
        SWEEP_ROWS = tuple(int(m) for m in args.sweep_rows.split(","))
    sweep_rows, best = sweep(dev, args.halves, args.table_only, args.mma) if args.sweep else ([], {})
    if best and not args.table_only:  # each bucket takes the fastest choice of the nearest swept row count at or
        # above it
        nm.LAUNCH.update({b: best[min((m for m in best if m >= b), default=max(best))] for b in nm.LAUNCH})
        write_result(f"nf4_matmul_{card_tag()}_sweep", {"best": {str(b): c for b, c in nm.LAUNCH.items()}, "sweep": sweep_rows},
                     [f"NF4 launch sweep (fastest per row count): {best}"])  # (rollout_speed --nf4-launch, at once)
    fp8_sweep_rows, fp8_best = fp8_sweep(dev) if args.fp8 and args.sweep else ([], {})
    if fp8_best:
        from longrl.ops import fp8_matmul as fm

        fm.LAUNCH.update({b: fp8_best[min((m for m in fp8_best if m >= b), default=max(fp8_best))] for b in fm.LAUNCH})
        write_result(f"fp8_matmul_{card_tag()}_sweep", {"best": {str(b): c for b, c in fm.LAUNCH.items()},
                                               "sweep": fp8_sweep_rows}, [f"FP8 launch sweep: {fp8_best}"])
    rows = [] if args.skip_table else table(dev, bw)
    fp8_rows = fp8_table(dev) if args.fp8 else []
    meta = run_meta(copy_bandwidth_gbs=bw / 1e9, bitsandbytes=bitsandbytes.__version__, launch=dict(nm.LAUNCH),
                    l2_cold=True)
    lines = [f"# NF4 decode product: bitsandbytes vs longrl's 4-bit kernel vs bf16, {meta['gpu']}", "",
             f"{meta['date']}; torch {meta['torch']}, bitsandbytes {meta['bitsandbytes']}.  ", f"`{meta['command']}`",
             "", f"Copy bandwidth {bw / 1e9:,.0f} GB/s. GPU time a call from CUDA graphs of 20 calls on copies of the "
             "weights (cold L2). GB/s: floor bytes "
             "(NF4 0.5625 B/param, bf16 2 B/param) / time. longrl's launch table (LAUNCH, after the sweep): "
             f"{meta['launch']}.", "",
             "| weight | rows | bitsandbytes µs | longrl NF4 µs | bf16 µs | NF4 GB/s | bf16 GB/s | × bitsandbytes "
             "| × bf16 | max rel err vs bnb |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['M']} | {r['bnb_us']:.1f} | {r['nf4_us']:.1f} | {r['bf16_us']:.1f} | "
                     f"{r['nf4_gbs']:,.0f} | {r['bf16_gbs']:,.0f} | {r['bnb_us'] / r['nf4_us']:.2f} | "
                     f"{r['bf16_us'] / r['nf4_us']:.2f} | {r['max_rel_err_vs_bnb']:.4f} |")
    if sweep_rows:
        names = list(GROUPS)
        lines += ["", "## The packed decode's groups (one 8B layer, LoRA r = 32), launch sweep", "",
                  "µs a call; 'layer' is the four groups' sum (bf16: the same groups as bf16 packed products, "
                  "rollout/fast_decode.py's 16-bit path). Fastest per row count: " +
                  ", ".join(f"{m} rows {c}" for m, c in best.items()) + ".", "",
                  "| rows | bn | lut | warps | stages | programs | " + " | ".join(names) +
                  " | layer µs | bf16 layer µs | × bf16 |", "|---" * (9 + len(names)) + "|"]
        for r in sweep_rows:
            head = (f"| {r['M']} | {r['bn']} | {r['lut']}{', kord' if r.get('kord') else ''}"
                    f"{', halves, pack ' + str(r['pack']) if r.get('halves') else ''}"
                    f"{', CUDA mma, blocks ' + str(r['min_blocks']) if r.get('mma') else ''}"
                    f"{', from ' + str(r['min_bytes'] >> 20) + ' MiB' if r.get('min_bytes') else ''}"
                    f"{', staged ' + str(r['mma_stages']) if r.get('staged') else ''}"
                    f"{', waves ' + str(r['waves']) if r.get('waves') else ''}"
                    f"{', fixup ' + str(r['fixup_blocks']) if r.get('fixup_blocks') is not None else ''}"
                    f" | {r['warps']}"
                    f"{' (maxnreg ' + str(r['maxnreg']) + ')' if r.get('maxnreg') else ''} | {r['stages']}"
                    f"{' (unroll ' + str(r['unroll']) + ')' if r.get('unroll', 1) > 1 else ''} | "
                    f"{r['programs']}{' + fixup' if r.get('fixup') else ''} | ")
            if "error" in r:
                lines.append(head + f"failed: {r['error']} |" + " |" * (len(names) + 2))
                continue
            lines.append(head + " | ".join(f"{r['us'][n]:.1f}" for n in names) +
                         f" | {r['layer_us']:.1f} | {r['bf16_layer_us']:.1f} | "
                         f"{r['bf16_layer_us'] / r['layer_us']:.2f} |")
    if args.fp8:
        lines += fp8_lines(fp8_rows, fp8_sweep_rows, fp8_best)
    write_result(f"nf4_matmul_{card_tag()}" + ("_fp8" if args.fp8 else "") + ("_halves" if args.halves else "")
                 + ("_mma" if args.mma else ""),
                 {**meta, "rows": rows, "sweep": sweep_rows, "best": {str(m): c for m, c in best.items()},
                  "fp8_rows": fp8_rows, "fp8_sweep": fp8_sweep_rows}, lines)


if __name__ == "__main__":
    main()
