"""Instruction mix of the decode attention's chunk kernel for sm_90, compiled ahead of time (no GPU): the SASS of
its key-block loop (per thread, one block of BLOCK keys), and the PTX conversions, for the bf16 cache (FP8=0), the
FP8 cache widened to bf16 (1) and to float16 (2, decode_kernel.LAUNCH fp8_f16); PREFETCH 1: the FP8 cache's
exponents loaded one block ahead (LAUNCH fp8_prefetch). The FP8 values are position-minor and read in whole blocks
(V_WHOLE: what a cache of kv_quant.value_capacity positions gets).

    python benchmarks/sass_decode_attention.py FP8 BLOCK WARPS STAGES [PREFETCH [SS]]     # e.g. 1 32 4 2 1
    (FP8 3: e4m3 products, fp8_mma; SS 1: the codes through e4m3 pointers, fp8_ss)
"""
import sys, re, subprocess, collections
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from longrl.rollout import decode_kernel as dk
fp8 = int(sys.argv[1]); block = int(sys.argv[2]); warps = int(sys.argv[3]); stages = int(sys.argv[4])
prefetch = len(sys.argv) > 5 and sys.argv[5] == "1"
ss = len(sys.argv) > 6 and sys.argv[6] == "1"  # e4m3 pointers (launch fp8_ss): the products' tiles from shared memory
cache = ("*fp8e4nv" if ss else "*u8") if fp8 else "*bf16"
strides = {n: "i64" for n in ("stride_qb", "stride_qh", "stride_pp", "stride_ph", "stride_pt", "stride_epp", "stride_eph")}
v_strides = ("stride_vpp", "stride_vph", "stride_vp", "stride_vsb", "stride_vsh", "stride_vs")
sig = dict(Q="*bf16", KP=cache, VP=cache, KS=cache, VS=cache, PIDX="*i64", PLEN="*i64", SLEN="*i64", M_OUT="*fp32", L_OUT="*fp32", ACC_OUT="*fp32", COUNT="*i32", OUT="*bf16", KPE="*i8", VPE="*i8", KSE="*i8", VSE="*i8", SLOTS="*i64", scale="fp32",
           **strides, stride_sb="i64", stride_sh="i64", stride_st="i64", **{n: "i64" for n in v_strides}, stride_esb="i64", stride_esh="i64", NPART="i32", FIRST="i32", NPRE="i32",
           MEMBERS="*i64", PLEN_P="*i64", stride_mem="i64", G="i32", PCHUNK="i32")
order = ["Q","KP","VP","KS","VS","PIDX","PLEN","SLEN","M_OUT","L_OUT","ACC_OUT","COUNT","OUT","KPE","VPE","KSE","VSE","SLOTS","MEMBERS","PLEN_P","stride_mem","G","PCHUNK","scale","stride_qb","stride_qh","stride_pp","stride_ph","stride_pt","stride_sb","stride_sh","stride_st",*v_strides,"stride_epp","stride_eph","stride_esb","stride_esh","NPART","FIRST","NPRE"]
sig = {k: sig[k] for k in order}
rb = 4; np_, cb = dk._merge_blocks(2, rb)
consts = dict(REP=4, R=16, D=128, DP=128, BLOCK=block, CHUNK=1024, PREC="tf32", DYNAMIC_STOP=True, FUSED=True, RB=rb, NP=np_, CB=cb, COUNT0=dk.COUNT0, FP8=fp8, PREFETCH=prefetch, V_WHOLE=bool(fp8), HAS_SLOTS=False, WRITTEN=False, GP=1)
sig.update({k: "constexpr" for k in consts})
aligned = [k for k in order if sig[k].startswith("*") or k.startswith("stride")]  # as a launch specialises them
attrs = {(i,): [["tt.divisibility", 16]] for i, k in enumerate(sig) if k in aligned}
k = triton.compile(ASTSource(dk._chunk_kernel, signature=sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages, **({"maxnreg": int(__import__("os").environ["MAXNREG"])} if __import__("os").environ.get("MAXNREG") else {})})
open("/tmp/a.cubin","wb").write(k.asm["cubin"])
sass = subprocess.run(["/work/venv/lib/python3.11/site-packages/triton/backends/nvidia/bin/nvdisasm", "-c", "/tmp/a.cubin"], capture_output=True, text=True).stdout
blocks, cur, name = {}, [], "start"
for l in sass.splitlines():
    m = re.match(r"^\.(L_x_\d+):", l.strip())
    if m: blocks[name] = cur; cur = []; name = m.group(1); continue
    if "/*" in l and ";" in l: cur.append(l)
blocks[name] = cur
order_b = list(blocks)
for i, b in enumerate(order_b):
    for l in blocks[b]:
        m = re.search(r"BRA\s+`?\(?\.?(L_x_\d+)", l)
        if m and m.group(1) in order_b and order_b.index(m.group(1)) <= i:
            body = []
            for bb in order_b[order_b.index(m.group(1)):i+1]: body += blocks[bb]
            if len(body) < 30: continue
            ops = collections.Counter(re.search(r"\s([A-Z][A-Z0-9_.]+)", x.split("*/",1)[1]).group(1).split(".")[0] for x in body if re.search(r"\s([A-Z][A-Z0-9_.]+)", x.split("*/",1)[1]))
            print("fp8" if fp8 else "bf16", "block", block, "warps", warps, "loop instrs", len(body), dict(ops.most_common(40)))
print("shared", k.metadata.shared)
ptx = k.asm["ptx"]
for pat in ["cvt.rn.f16x2.e4m3x2", "cvt.bf16.f16", "cvt.rn.bf16x2.f32", "cvt.f32.bf16"]:
    print(pat, ptx.count(pat))
