"""Every Triton kernel of the sampler compiles for an H100/H200 (sm_90) with the launch options it is used with,
within the GPU's shared memory: ahead of time, through Triton's own ptxas, so no GPU is needed. (Their arithmetic
is checked against the PyTorch twins through the interpreter in test_decode_kernel.py / test_fast_decode.py.)"""

from __future__ import annotations

import re
from collections import Counter

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from longrl.rollout import decode_kernel as dk  # noqa: E402
from longrl.rollout import fused_ops as fo  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)
SHARED_LIMIT = 227 * 1024  # bytes a block may use on sm_90
# the chunk kernel's arguments for its merge's written-columns rule (the grouped prefix's member lists and lengths)
CHUNK_MEMBER_ARGS = dict(MEMBERS="*i64", PLEN_P="*i64", stride_mem="i64", G="i32", PCHUNK="i32")


def compile_for_sm90(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int = 2, aligned=(),
                     **options):
    """``aligned``: arguments known divisible by 16, as Triton specialises them at a launch (pointers of fresh
    tensors, sizes such as 4,096). Constexprs not given take the kernel's defaults, as a launch does."""
    constexprs = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **constexprs}
    signature = {**signature, **{k: "constexpr" for k in constexprs}}
    signature = {p.name: signature[p.name] for p in fn.params}  # the kernel's order: attrs below go by position
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(signature) if name in aligned}
    try:
        kernel = triton.compile(ASTSource(fn, signature=signature, constexprs=constexprs, attrs=attrs), target=SM90,
                                options={"num_warps": num_warps, "num_stages": num_stages, **options})
    except Exception as e:  # no ptxas for this platform: nothing to check here
        if "ptxas" in str(e).lower() and "not found" in str(e).lower():
            pytest.skip(f"Triton cannot build sm_90 code here: {e}")
        raise
    assert kernel.metadata.shared <= SHARED_LIMIT, (fn.__name__, kernel.metadata.shared)
    return kernel


@pytest.mark.parametrize("dtype, prec", [("*bf16", "tf32"), ("*fp32", "ieee")])
@pytest.mark.parametrize("head_dim, rep, members", [(128, 4, 8), (128, 6, 8), (64, 8, 16)])
def test_decode_attention_kernels_build(dtype, prec, head_dim, rep, members):
    strides = {n: "i64" for n in ("stride_qb", "stride_qh", "stride_pp", "stride_ph", "stride_pt", "stride_vpp",
                                  "stride_vph", "stride_vp", "stride_epp", "stride_eph")}
    # the 16-bit cache (FP8=False): the FP8 cache's exponent pointers are typed but unread
    common = dict(Q=dtype, KP=dtype, VP=dtype, KPE="*i8", VPE="*i8", M_OUT="*fp32", L_OUT="*fp32", ACC_OUT="*fp32",
                  scale="fp32", NPART="i32")
    # the merge in the chunk launch (reading every column, or the written ones: the counters option), or not
    for fused, npart, written in ((True, 2, False), (True, 33, False), (True, 33, True), (False, 2, False)):
        rb = triton.next_power_of_2(rep)
        np_, cb = dk._merge_blocks(npart, rb)
        kernel = compile_for_sm90(
            dk._chunk_kernel,
            {**common, "KS": dtype, "VS": dtype, "PIDX": "*i64", "PLEN": "*i64", "SLEN": "*i64", "COUNT": "*i32",
             "OUT": dtype, **strides, "stride_sb": "i64", "stride_sh": "i64", "stride_st": "i64", "FIRST": "i32",
             "NPRE": "i32", "KSE": "*i8", "VSE": "*i8", "SLOTS": "*i64", "stride_esb": "i64", "stride_esh": "i64",
             **{n: "i64" for n in ("stride_vsb", "stride_vsh", "stride_vs")}, **CHUNK_MEMBER_ARGS},
            dict(REP=rep, R=max(16, triton.next_power_of_2(rep)), D=head_dim, DP=head_dim, BLOCK=dk.BLOCK, CHUNK=1024,
                 PREC=prec, DYNAMIC_STOP=True, FUSED=fused, RB=rb, NP=np_, CB=cb, COUNT0=dk.COUNT0, FP8=False,
                 PREFETCH=False, V_WHOLE=False, HAS_SLOTS=members == 8,  # (8: a verify step's virtual rows)
                 WRITTEN=written, GP=triton.next_power_of_2(members)),
            num_warps=4)
        if fused:  # the counter taken with release-acquire at GPU scope after a CTA barrier; partials read from L2
            lines = kernel.asm["ptx"].splitlines()
            atom = next(i for i, line in enumerate(lines) if "atom." in line)
            last_store = max(i for i in range(atom) if "st.global" in lines[i])
            assert "acq_rel" in lines[atom] and ".gpu" in lines[atom], lines[atom]
            assert any("bar.sync" in line for line in lines[last_store:atom]), lines[last_store:atom + 1]
            assert any("ld.global.cg" in line for line in lines[atom:])
    gs = max(1, min(members, 64 // rep))
    compile_for_sm90(dk._prefix_kernel,
                     {**common, "MEMBERS": "*i64", "PLEN_P": "*i64", **strides, "stride_mem": "i64", "NSUB": "i32"},
                     dict(REP=rep, G=members, GS=gs, R=max(16, triton.next_power_of_2(gs * rep)), D=head_dim,
                          DP=head_dim, BLOCK=dk.BLOCK, PCHUNK=1024, PREC=prec, DYNAMIC_STOP=True, FP8=False,
                          PREFETCH=False, V_WHOLE=False),
                     num_warps=4)
    for npart in (2, 33, 1025):
        np_ = max(16, triton.next_power_of_2(npart))
        compile_for_sm90(dk._merge_kernel, {"M": "*fp32", "L": "*fp32", "ACC": "*fp32", "OUT": dtype, "NPART": "i32"},
                         dict(D=head_dim, DP=head_dim, NP=np_, CB=16), num_warps=4)


@pytest.mark.parametrize("dtype", ["*bf16", "*fp32"])
def test_fused_decode_kernels_build(dtype):
    for delta in (True, False):
        compile_for_sm90(fo._add_rmsnorm_kernel, {"H": dtype, "DELTA": dtype, "W": dtype, "X": dtype, "d": "i32",
                                                  "eps": "fp32", "stride_delta": "i64"},
                         dict(HAS_DELTA=delta, BLOCK=8192), num_warps=8)
    for norm in (False, True):
        kernel = compile_for_sm90(fo._rotary_kv_kernel,
                                  {"Q": dtype, "K": dtype, "V": dtype, "COS": dtype, "SIN": dtype, "KC": dtype,
                                   "VC": dtype, "WIDX": "*i64", "QW": dtype, "KW": dtype, "QO": dtype, "eps": "fp32",
                                   "stride_cs": "i64", "stride_ch": "i64", "stride_ct": "i64", "stride_q": "i64",
                                   "stride_k": "i64", "stride_v": "i64", "XA": dtype, "stride_xa": "i64", "LO_Q": "i32",
                                   "LO_K": "i32", "LO_V": "i32", "BQ": dtype, "BK": dtype, "BV": dtype, "SLOTS": "*i64"},
                                  dict(HQ=32, HKV=8, D=128, HALF=64, HAS_NORM=norm, R=32 if norm else 0,
                                       RP=32 if norm else 1, HAS_SLOTS=norm), num_warps=1,
                                  enable_fp_fusion=fo.ROTARY_FP_FUSION)
        # transformers rounds each rotary product before the sum: no fused multiply-add may stand in for them
        # (with contraction on, the compiler emitted fma.rn.bf16 and the H200 run missed by several bf16 units)
        assert "fma" not in kernel.asm["ptx"], "rotary products contracted into an fma"
    compile_for_sm90(fo._silu_mul_kernel, {"G": dtype, "U": dtype, "Y": dtype, "width": "i32", "stride_g": "i64",
                                           "stride_u": "i64"},
                     dict(BLOCK=1024, ACCURATE_EXP=True), num_warps=4)
    default = (fo.LAUNCH["silu_lora_bm"], fo.LAUNCH["silu_lora_bn"], fo.LAUNCH["silu_lora_warps"])
    small = (16, *default[1:])  # ≤ 16 rows: the tile rows shrink to 16
    for bm, bn, warps in ((16, 128, 4), default, small):  # gate/up's LoRA deltas folded in (packed decode), rank 32
        for dot16 in (False, True) if dtype != "*fp32" else (False,):  # 16-bit operands: on the tensor cores
            kernel = compile_for_sm90(fo._silu_mul_lora_kernel,
                                      {"G": dtype, "U": dtype, "Y": dtype, "XA": dtype, "BG": dtype, "BU": dtype,
                                       "rows": "i32", "width": "i32", "stride_g": "i64", "stride_u": "i64",
                                       "stride_xa": "i64", "LO_G": "i32", "LO_U": "i32"},
                                      dict(R=32, RP=32, BM=bm, BN=bn, ACCURATE_EXP=True, DOT16=dot16),
                                      num_warps=warps)
            assert ("mma" in kernel.asm["ptx"]) == dot16


def _fp8_chunk_signature() -> dict:
    """The chunk kernel's argument types on an FP8 cache (codes as uint8, int8 exponents), bf16 queries."""
    strides = ("stride_qb", "stride_qh", "stride_pp", "stride_ph", "stride_pt", "stride_sb", "stride_sh",
               "stride_st", "stride_vpp", "stride_vph", "stride_vp", "stride_vsb", "stride_vsh", "stride_vs",
               "stride_epp", "stride_eph", "stride_esb", "stride_esh")
    return dict(Q="*bf16", KP="*u8", VP="*u8", KS="*u8", VS="*u8", PIDX="*i64", PLEN="*i64", SLEN="*i64",
                M_OUT="*fp32", L_OUT="*fp32", ACC_OUT="*fp32", COUNT="*i32", OUT="*bf16", KPE="*i8", VPE="*i8",
                KSE="*i8", VSE="*i8", SLOTS="*i64", scale="fp32", **{n: "i64" for n in strides}, NPART="i32", FIRST="i32",
                NPRE="i32", **CHUNK_MEMBER_ARGS)


def test_fp8_cache_widening_to_float16_has_no_per_value_float32_step():
    """Why the FP8 cache's decode attention is no faster than bf16's (kv_fp8_speed_h200.md): Triton widens e4m3 to
    bf16 through float16 and a scalar cvt.bf16.f16 per value (an F2F, 16 a clock per SM on sm_90); the float16
    variant (LAUNCH fp8_f16, FP8 == 2) keeps the packed e4m3x2 → f16x2 conversion alone."""
    sig = _fp8_chunk_signature()
    rb = 4
    np_, cb = dk._merge_blocks(2, rb)
    counts = {}
    for fp8 in (1, 2):
        kernel = compile_for_sm90(dk._chunk_kernel, sig,
                                  dict(REP=4, R=16, D=128, DP=128, BLOCK=dk.BLOCK, CHUNK=1024, PREC="tf32",
                                       DYNAMIC_STOP=True, FUSED=True, RB=rb, NP=np_, CB=cb, COUNT0=dk.COUNT0, FP8=fp8,
                                       PREFETCH=False, V_WHOLE=True, HAS_SLOTS=False),
                                  num_warps=4)
        counts[fp8] = kernel.asm["ptx"].count("cvt.bf16.f16")
    assert counts[1] > 0 and counts[2] == 0, counts


def _cubin_tool(kernel, tool: str, *args: str) -> str:
    """stdout of one of the CUDA binary tools shipped with Triton's CUDA backend (nvdisasm, cuobjdump) run on a
    compiled kernel's cubin; skips where the tool is not there."""
    import os
    import subprocess
    import tempfile

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)
    if not os.access(path, os.X_OK):
        pytest.skip(f"no {tool} in this Triton build")
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        return subprocess.run([path, *args, cubin], capture_output=True, text=True, check=True).stdout


def _sass_loops(kernel) -> list[list[str]]:
    """The instructions of each loop body of a compiled kernel's SASS (a block from a label to the backward branch
    that returns to it), through nvdisasm."""
    text = _cubin_tool(kernel, "nvdisasm", "-c")
    labels, instrs = {}, []
    for line in text.splitlines():
        if m := re.match(r"\s*(\.L_x_\d+):", line):
            labels[m.group(1)] = len(instrs)
        elif m := re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", line):
            instrs.append(m.group(1).strip())
    bodies = []
    for i, ins in enumerate(instrs):
        m = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", ins)
        if m and labels.get(m.group(1), i + 1) < i:
            bodies.append(instrs[labels[m.group(1)]:i + 1])
    return bodies


def _opcodes(body: list[str]) -> list[str]:
    """Each instruction's opcode without its predicate and modifiers ("@!P0 FFMA.FTZ R1, ..." → "FFMA")."""
    return [re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0].split(".")[0] for ins in body]


def _loads_waited_on_mid_block(body: list[str]) -> int:
    """Plain global loads (not cp.async) of a loop body whose register is read before the last tenth of the body's
    instructions (where a load for the next iteration is only packed into the loop's carried registers): a stall
    of a global load's latency inside each block's work."""
    tail = int(0.9 * len(body))
    waited = 0
    for i, ins in enumerate(body):
        m = re.search(r"\bLDG\.E\S*\s+(R\d+)", ins)
        if m and "LDGSTS" not in ins:
            reg = re.compile(rf"\b{m.group(1)}\b")
            first_use = next((j for j in range(i + 1, len(body)) if reg.search(body[j])), len(body))
            waited += first_use < tail
    return waited


_ALIGNED = {n for n, t in _fp8_chunk_signature().items() if n.startswith("stride") or t.startswith("*")}  # as a
# launch specialises them (fresh tensors, strides that are multiples of 16)


def _fp8_chunk_build(fp8: int, prefetch: bool, block: int = dk.BLOCK):
    """(kernel, its two attention loops' SASS: the prefix's chunks and the suffix's) of the chunk kernel on an FP8
    cache read in whole value blocks, 8B heads, 4 warps."""
    np_, cb = dk._merge_blocks(33, 4)
    kernel = compile_for_sm90(dk._chunk_kernel, _fp8_chunk_signature(),
                              dict(REP=4, R=16, D=128, DP=128, BLOCK=block, CHUNK=1024, PREC="tf32",
                                   DYNAMIC_STOP=True, FUSED=True, RB=4, NP=np_, CB=cb, COUNT0=dk.COUNT0, FP8=fp8,
                                   PREFETCH=prefetch, V_WHOLE=True, HAS_SLOTS=False),
                              num_warps=4, aligned=_ALIGNED)
    attention_loops = [b for b in _sass_loops(kernel) if any(re.match(r"[HQ]GMMA|HMMA", ins) for ins in b)]
    assert len(attention_loops) == 2, len(attention_loops)
    return kernel, attention_loops


@pytest.mark.parametrize("fp8", [1, 2])
def test_fp8_prefetch_takes_the_exponent_loads_off_each_block(fp8):
    """The FP8 cache's scale exponents are 1 byte a position, loaded by plain global loads that Triton's pipeliner
    does not stage: without LAUNCH fp8_prefetch each block waits for them before its scaling; with it the loads
    are for the next block, first read at the block's end (sm_90 SASS of both attention loops, with the 16-aligned
    strides a launch specialises)."""
    waited = {}
    for prefetch in (False, True):
        _, attention_loops = _fp8_chunk_build(fp8, prefetch)
        waited[prefetch] = [_loads_waited_on_mid_block(b) for b in attention_loops]
    assert all(n > 0 for n in waited[False]) and waited[True] == [0, 0], waited
    sig, aligned = _fp8_chunk_signature(), _ALIGNED
    prefix_sig = {k: sig[k] for k in ("Q", "KP", "VP", "KPE", "VPE")}  # the grouped prompts' kernel builds with it
    prefix_sig.update(MEMBERS="*i64", PLEN_P="*i64", M_OUT="*fp32", L_OUT="*fp32", ACC_OUT="*fp32", scale="fp32",
                      **{n: "i64" for n in ("stride_qb", "stride_qh", "stride_pp", "stride_ph", "stride_pt",
                                            "stride_vpp", "stride_vph", "stride_vp", "stride_epp", "stride_eph",
                                            "stride_mem")}, NPART="i32", NSUB="i32")
    compile_for_sm90(dk._prefix_kernel, prefix_sig,
                     dict(REP=4, G=8, GS=8, R=32, D=128, DP=128, BLOCK=dk.BLOCK, PCHUNK=1024, PREC="tf32",
                          DYNAMIC_STOP=True, FP8=fp8, PREFETCH=True, V_WHOLE=True), num_warps=4, aligned=aligned)


def _registers(kernel) -> int:
    """Registers a thread of a compiled kernel (cuobjdump)."""
    return int(re.search(r"REG:(\d+)", _cubin_tool(kernel, "cuobjdump", "--dump-resource-usage")).group(1))


@pytest.mark.parametrize("fp8", [1, 2])
def test_fp8_values_read_in_whole_blocks_need_no_byte_gathers(fp8):
    """The FP8 value store is position-minor (kv_quant.py), so the second product's operand has its positions
    contiguous. Read in whole blocks (V_WHOLE: a capacity of whole blocks, no position mask), the values go through
    16-byte asynchronous copies and wider shared loads, with no byte loads from shared memory in either attention
    loop, and in fewer than 128 registers a thread. Stored [T, D], as before, they took 32 byte gathers a loop at
    128 registers (Triton 3.6 and 3.9; benchmarks/results/kv_fp8_decode_sass.md)."""
    kernel, attention_loops = _fp8_chunk_build(fp8, prefetch=False)
    for body in attention_loops:
        assert not [ins for ins in body if re.match(r"LDS\.U8\b", ins)], "byte gathers from shared memory"
        # a block of 32 positions: 4 KB of key codes and 4 KB of value codes, 16 bytes a thread and copy
        assert sum("LDGSTS.E.BYPASS.128" in ins for ins in body) >= 4
    assert _registers(kernel) < 128


def test_fp8_mma_products_run_on_e4m3_tensor_cores():
    """decode_kernel fp8_mma (FP8 == 3): in both attention loops every product is an e4m3 warpgroup product
    (QGMMA: the codes as stored, no widening to 16 bits and no 16-bit products), the value codes come by 16-byte
    copies with no byte gathers, within the shared memory at 2 and 3 stages."""
    for block in (64, 128):  # (128: the FP8 cache's default, FP8_LAUNCH)
        kernel, attention_loops = _fp8_chunk_build(3, prefetch=True, block=block)
        for body in attention_loops:  # a product per 64 keys and 32 dimensions, twice (hi and lo), both products
            products = sum(bool(re.match(r"QGMMA\.64x16x32\.F32\.E4M3\.E4M3", ins)) for ins in body)
            assert products == 16 * block // 64, (block, products)
            assert not [ins for ins in body if re.match(r"HMMA|HGMMA|LDS\.U8\b", ins)]
            assert sum("LDGSTS.E.BYPASS.128" in ins for ins in body) >= 4
    signature = {**_fp8_chunk_signature(), "MEMBERS": "*i64", "PLEN_P": "*i64", "stride_mem": "i64", "NSUB": "i32"}
    signature = {k: signature[k] for k in dk._prefix_kernel.arg_names if k in signature}
    for stages in (2, 3):
        compile_for_sm90(dk._prefix_kernel, signature,
                         dict(REP=4, G=8, GS=8, R=32, D=128, DP=128, BLOCK=64, PCHUNK=1024, PREC="tf32",
                              DYNAMIC_STOP=True, FP8=3, PREFETCH=True, V_WHOLE=True),
                         num_warps=4, num_stages=stages, aligned=_ALIGNED)


@pytest.mark.parametrize("rows, spread", [(16, False), (128, False), (16, True)])
def test_nf4_group_kernel_builds_with_packed_permutes(rows, spread):
    """lut 3's build of each row count's launch choice fits the shared memory, and hands its byte permutes four
    consecutive code bytes of one row a thread (what lut 3's per-row tables assume; nf4_matmul.permutes_packed,
    the check the product itself makes on the GPU before trusting a lut 3 build; lut 4's one table serves any
    layout). 32 and 64 rows share 128's choice. spread: 128-row tiles with 4 warps, whose build gave wrong results
    on the H200 (nf4_matmul_h200.md): the check refuses it."""
    from longrl.ops import nf4_matmul as nm

    cfg = {**nm.LAUNCH[rows], "lut": 3, **(dict(bn=128, warps=4) if spread else {})}
    kernel = _nf4_build(rows, cfg["lut"], cfg["bn"], cfg["warps"], cfg["stages"], cfg["swap"], cfg["join"])
    assert nm.permutes_packed(kernel) != spread  # (8B shapes: every pointer, width, row boundary a multiple of 16)


def _nf4_build(rows: int, lut: int, bn: int, warps: int, stages: int = 3, swap: bool = True, join: bool = True,
               fixup: bool = False, kord: bool = False, dtype: str = "bf16", unroll: int = 1, pack: int = 0):
    """The NF4 group product compiled for sm_90 at ``rows`` rows of x (activations ``dtype``), with the 8B shapes'
    alignments; ``pack`` 2 or 4: on codes in the halves layout (ops/nf4_halves.py), that many bytes a lookup."""
    import torch

    from longrl.ops import nf4_halves as nh
    from longrl.ops import nf4_matmul as nm

    halves = dict(HALVES=False, PACK=4, LOOKUP="", LOOKUP_CONS="")
    if pack:
        table = [-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0, 0.0796, 0.1609, 0.2461, 0.3379,
                 0.4407, 0.5626, 0.7230, 1.0]  # (NF4's, rounded: any 16 values build the same instructions)
        halves = dict(HALVES=True, PACK=pack, LOOKUP=nh.lookup_ptx(nh.table_planes(table, torch.bfloat16), pack),
                      LOOKUP_CONS=nh.lookup_constraints(pack))

    ptrs = dict(X=f"*{dtype}", P0="*u8", P1="*u8", P2="*u8", S="*fp32", CODE="*fp32", D=f"*{dtype}", BIAS=f"*{dtype}",
                Y="*fp32", OUT=f"*{dtype}", LOCK="*i32")
    ints = {n: "i32" for n in ("M", "K", "KB", "N0", "N01", "NQ", "R", "stride_xm", "stride_ym", "stride_ys",
                               "n_chunks", "chunks_per_split", "dense_tiles")}
    signature = {name: {**ptrs, **ints}[name] for name in nm._nf4_group_kernel.arg_names if name in {**ptrs, **ints}}
    return compile_for_sm90(nm._nf4_group_kernel, signature,
                            dict(HAS_BIAS=False, BM=rows, BN=bn, SWAP=swap, JOIN=join, LUT=lut, EVEN_K=True, ASM=True,
                                 FIXUP=fixup, SUM_BIAS=fixup, KORD=kord, UNROLL=unroll, **halves),
                            num_warps=warps, num_stages=stages,
                            aligned=[*ptrs, "K", "KB", "N0", "N01", "NQ", "stride_xm", "stride_ym", "stride_ys"])


@pytest.mark.parametrize("rows, bn, warps", [(16, 64, 4), (16, 128, 4), (32, 128, 8), (128, 128, 8)])
def test_nf4_lut4_builds_its_table_once_outside_the_loop(rows, bn, warps):
    """lut 4 (one table of the 16 unscaled codes; each block's product scaled after): its loop over K builds no
    table (no float multiply or bf16 conversion there, where lut 3 builds a table a row and block), spills nothing,
    and runs fewer instructions per code than lut 3's build of the same launch (the SASS, counted statically;
    benchmarks/results/decode_product_sass.md)."""
    per_code = {}
    for lut in (3, 4):
        kernel = _nf4_build(rows, lut, bn, warps)
        body = max(_sass_loops(kernel), key=len)
        ops = _opcodes(body)
        table_work = sum(op in ("FMUL", "F2FP") for op in ops)
        assert (table_work == 0) == (lut == 4), (lut, table_work)
        assert not {"STL", "LDL"} & set(ops), lut  # no register spills in the loop
        per_code[lut] = len(body) * 32 * warps / (bn * 128)  # a loop iteration: one chunk of 128 codes a row
    assert per_code[4] < per_code[3], per_code


@pytest.mark.parametrize("rows, lut, bn, warps", [(16, 4, 64, 4), (16, 5, 64, 4), (32, 5, 128, 8), (128, 5, 128, 8),
                                                 (128, 5, 64, 4)])
def test_nf4_values_paired_in_k_order_need_no_interleaving(rows, lut, bn, warps):
    """kord (PRMT_ASM_K: the permutes pair each byte's two values in k order, selectors made once for four bytes):
    the build gives each thread four consecutive bytes of a row (permutes_packed, which the pairing needs), its loop
    runs 2 permutes a code where the nibble-paired lookup runs 2.5 (the interleaving after it gone), fewer
    instructions in all, and no spills (benchmarks/results/decode_product_sass.md)."""
    from longrl.ops.nf4_matmul import permutes_packed

    per_code, permutes = {}, {}
    for kord in (False, True):
        kernel = _nf4_build(rows, lut, bn, warps, kord=kord)
        body = max(_sass_loops(kernel), key=len)
        ops = _opcodes(body)
        assert not {"STL", "LDL"} & set(ops), kord
        codes = bn * 128 / (32 * warps)  # a thread's codes in one loop iteration (a chunk of 128 a row)
        per_code[kord], permutes[kord] = len(body) / codes, ops.count("PRMT") / codes
    assert permutes_packed(kernel)
    assert permutes == {False: 2.5, True: 2.0}, permutes
    assert per_code[True] < per_code[False] - 0.3, per_code


@pytest.mark.parametrize("lut, kord", [(3, False), (4, False), (5, False), (6, False), (4, True)])
def test_nf4_permute_tables_take_the_activations_16_bit_type(lut, kord):
    """The byte permutes' tables are built in x's 16-bit type, so float16 activations (a model in float16) build
    and multiply on float16 tensor cores; before, their tables were bf16 whatever x was and luts 3 and 4 did not
    build for float16 ("Both operands must be same dtype")."""
    for dtype, mma in (("fp16", ".f16.f16"), ("bf16", ".bf16.bf16")):
        ptx = _nf4_build(16, lut, 64, 4, kord=kord, dtype=dtype).asm["ptx"]
        assert {m[-len(mma):] for m in re.findall(r"wgmma\.mma_async\S*", ptx)} == {mma}, dtype


@pytest.mark.parametrize("rows, lut", [(16, 4), (128, 5)])
def test_nf4_unroll_runs_two_chunks_an_iteration_with_fewer_instructions_a_chunk(rows, lut):
    """Launch choice unroll 2: the loop over K holds two chunks' tensor-core products and permutes an iteration,
    with fewer instructions a chunk than one chunk an iteration (the loop's bookkeeping shared: 311 against 335 at
    16 rows, 379 against 412 at 128 rows in Triton 3.9's build), and nothing spills."""
    one, two = (_opcodes(max(_sass_loops(_nf4_build(rows, lut, 64, 4, kord=True, unroll=u)), key=len)) for u in (1, 2))
    for op in ("HGMMA", "PRMT"):
        assert two.count(op) == 2 * one.count(op) > 0, op
    assert len(two) < 2 * len(one)
    assert "STL" not in two and "LDL" not in two


@pytest.mark.parametrize("product", ["nf4", "fp8"])
def test_fixup_adds_one_release_acquire_count_and_leaves_the_loop_over_k_alone(product):
    """The fixup launch choice (each tile's last K split sums the splits) builds for sm_90 with one atomic add a
    program, released after a barrier (every thread's partials stored first) and acquired before the partials
    are read back through L2 (.cg loads: no stale L1 line); the loop over K keeps its work (the same tensor-core
    and conversion instructions; ptxas schedules its address arithmetic a little differently: at 16 rows 405
    against 391 instructions for NF4, 386 against 384 for FP8), and nothing spills."""
    build = (lambda fixup: _nf4_build(16, 4, 64, 4, fixup=fixup)) if product == "nf4" else \
        (lambda fixup: _fp8_build(16, False, 64, 4, fixup=fixup))
    plain, fixed = build(False), build(True)
    ptx = fixed.asm["ptx"]
    assert len(re.findall(r"atom\.global\.gpu\.acq_rel\.add", ptx)) == 1, re.findall(r"atom\.[\w.]+", ptx)
    assert "atom." not in plain.asm["ptx"] and "ld.global.cg" in ptx and "bar.sync" in ptx
    main_loop = (lambda kernel: _opcodes(max(_sass_loops(kernel), key=len)))
    work = ("HMMA", "PRMT", "F2FP", "FMUL", "FFMA", "LDG", "LDGSTS", "LDS", "LDSM")
    assert Counter(op for op in main_loop(fixed) if op in work) == Counter(op for op in main_loop(plain) if op in work)
    assert len(main_loop(fixed)) <= 1.05 * len(main_loop(plain))
    assert not {"STL", "LDL"} & set(_opcodes([i for body in _sass_loops(fixed) for i in body]))


def _fp8_build(rows: int, f16: bool, bn: int, warps: int, stages: int = 3, fixup: bool = False):
    """The FP8 group product compiled for sm_90 at ``rows`` rows of x, with the 8B shapes' alignments."""
    from longrl.ops import fp8_matmul as fm

    ptrs = dict(X="*bf16", P0="*fp8e4nv", P1="*fp8e4nv", P2="*fp8e4nv", S0="*fp32", S1="*fp32", S2="*fp32",
                D="*bf16", BIAS="*bf16", Y="*fp32", OUT="*bf16", LOCK="*i32")
    ints = {n: "i32" for n in ("M", "K", "KB", "N0", "N01", "NQ", "R", "stride_xm", "stride_ym", "stride_ys",
                               "n_chunks", "chunks_per_split", "dense_tiles")}
    signature = {name: {**ptrs, **ints}[name] for name in fm._fp8_group_kernel.arg_names if name in {**ptrs, **ints}}
    return compile_for_sm90(fm._fp8_group_kernel, signature,
                            dict(HAS_BIAS=False, BM=rows, BN=bn, EVEN_K=True, F16=f16, FIXUP=fixup, SUM_BIAS=fixup),
                            num_warps=warps,
                            num_stages=stages,
                            aligned=[*ptrs, "K", "KB", "N0", "N01", "NQ", "stride_xm", "stride_ym", "stride_ys"])


@pytest.mark.parametrize("bn, warps", [(64, 4), (128, 4)])
def test_fp8_f16_product_converts_each_pair_of_codes_once(bn, warps):
    """The FP8 product at 16 rows of x (LAUNCH's tile, and 128-row tiles), as built (the default) and with f16. f16's
    loop over K converts two codes an instruction (F2FP), with no float32 work a weight (no HADD2 widening, no
    multiply: the scale comes after each block's product); its float32 multiplies and the other conversions are
    x's (x · p, then to float16 in pairs). So it runs fewer instructions a weight, spilling nothing
    (benchmarks/results/decode_product_sass.md; above 32 rows x's share grows and the default is leaner)."""
    rows, threads = 16, 32 * warps
    per_weight = {}
    for f16 in (False, True):
        body = max(_sass_loops(_fp8_build(rows, f16, bn, warps)), key=len)
        ops = _opcodes(body)
        weights, xs = bn * 128 / threads, 128 * rows / threads  # a thread's share of one chunk's weights and x
        if f16:
            assert ops.count("HADD2") == 0 and ops.count("FMUL") == xs
            assert ops.count("F2FP") == weights / 2 + xs / 2
        else:
            assert ops.count("HADD2") == ops.count("FMUL") == weights
        assert not {"STL", "LDL"} & set(ops), f16
        per_weight[f16] = len(body) / weights
    assert per_weight[True] < per_weight[False], per_weight


@pytest.mark.parametrize("vocab", [128_256, 151_936, 3001])
def test_sampling_kernel_builds(vocab):
    from longrl.rollout import sampling_kernel as sk

    nb = -(-vocab // sk.SAMPLE_BLOCK)
    kernel = compile_for_sm90(sk._sample_kernel,
                              {"Z": "*fp32", "U": "*fp64", "TOKENS": "*i64", "LOGPROBS": "*fp32", "V": "i32",
                               "stride_z": "i64", "temperature": "fp32"},
                              dict(NB=nb, NBP=triton.next_power_of_2(nb), BLOCK=sk.SAMPLE_BLOCK),
                              num_warps=sk.SAMPLE_WARPS)
    assert "div.rn.f32" in kernel.asm["ptx"]  # x / T rounded as PyTorch's division (not div.full's approximation)


@pytest.mark.parametrize("seed_type", ["i32", "u32", "i64", "u64"])  # Triton types a Python int by its range
def test_uniform_kernel_builds_with_logical_shifts_and_an_unsigned_conversion(seed_type):
    """The uniforms' kernel in sm_90 code: splitmix64's shifts logical (shr.u64: an arithmetic one would smear the
    sign bit and differ from the twin's), the 53 bits converted as unsigned, no float step in the hash."""
    from longrl.rollout import sampling_kernel as sk

    kernel = compile_for_sm90(sk._uniform_kernel, {"SEQ": "*i64", "POS": "*i64", "U": "*fp64", "seed_mix": seed_type,
                                                   "B": "i32"}, dict(BLOCK=sk.UNIFORM_BLOCK), num_warps=4)
    ops = Counter(line.split()[0] for line in kernel.asm["ptx"].splitlines() if line.startswith("\t") and
                  line.split() and line.split()[0][0].isalpha())
    per_thread = ops["cvt.rn.f64.u64"]  # the uniforms a thread makes: one conversion each
    assert per_thread >= 1 and ops["shr.s64"] == 0
    # each: two splitmix64 rounds of three logical shifts and two wrapping 64-bit products, then >> 11
    assert ops["shr.u64"] == 7 * per_thread and ops["mul.lo.s64"] + ops["mul.lo.u64"] == 4 * per_thread, ops


@pytest.mark.parametrize("rows, lut, pack", [(16, 4, 2), (32, 5, 4), (128, 5, 2)])
def test_nf4_halves_layout_loop_keeps_the_looked_up_tile_in_registers(rows, lut, pack):
    """On codes in the halves layout (ops/nf4_halves.py) the lookup's only operand is the byte tile, so Triton loads
    the bytes in the tensor-core operand's layout: the NF4 loop (the one with the lookup's permutes) stores nothing
    to shared memory and reads no tile back (no STS, no LDSM), where the k-ordered build of the same launch writes
    its looked-up 16-bit tile and reads it back every block; no spills."""
    def nf4_loop(kernel):
        return Counter(_opcodes(max(_sass_loops(kernel), key=lambda body: sum("PRMT" in i for i in body))))

    halves = nf4_loop(_nf4_build(rows, lut, 64, 4, fixup=True, pack=pack))
    kord = nf4_loop(_nf4_build(rows, lut, 64, 4, fixup=True, kord=True))
    assert halves["PRMT"] >= 128 and halves["HGMMA"] > 0
    assert halves["STS"] == 0 and halves["LDSM"] == 0 and halves["STL"] + halves["LDL"] == 0, halves
    if rows <= 32:  # (at 128 rows the k-ordered build's tile goes another way)
        assert kord["STS"] > 0 and kord["LDSM"] > 0, kord
