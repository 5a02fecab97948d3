"""GPU checks of the rollout kernels beyond the test files (stage `gpucheck` of benchmarks/device_run.sh; prints
PASS/FAIL lines and the failures last): the fused sampling kernel against the float64 whole-CDF draw at vocabularies
from 1 to 151,936 entries (only boundary draws may differ; repeat runs identical), decode attention with its key
loops stopped early (DYNAMIC_STOP) bit-for-bit equal to running them to CHUNK and close to the reference, its merge
inside the chunk launch (the default) repeatable bit for bit, the merge kernel with stale NaN/inf in dead partial
columns, > 1,024 columns and NaN inputs, and the fused merge replayed from a CUDA graph with other lengths, close to
the separate merge launch."""
import sys

import torch
sys.path.insert(0, "src")
from longrl.rollout import decode_kernel as dk
from longrl.rollout.attention import decode_attention_reference
from longrl.rollout.sampling import inverse_cdf_reference, off_boundary_rows, token_logprobs, uniform_for
from longrl.rollout.sampling_kernel import sample_with_temperature

dev = "cuda"
fails = []

def check(name, ok, info=""):
    print(("PASS " if ok else "FAIL ") + name, info, flush=True)
    if not ok:
        fails.append(name)

# ---- 1. sampling kernel stress
for V in (1, 2, 17, 3001, 8192, 8193, 16384, 128256, 151936):
    for scale in (1.0, 8.0, 30.0):
        for T in (1.0, 0.6):
            B = 1024
            g = torch.Generator(device=dev).manual_seed(V + int(scale))
            z = torch.randn(B, V, device=dev, generator=g) * scale
            if V > 4:
                z[::5, V // 2:] = float("-inf")
                z[1::5, : V // 3] = float("-inf")
                z[2, :] = float("-inf"); z[2, V - 1] = 0.0
            u = uniform_for(3, torch.arange(B, device=dev), torch.full((B,), 5, device=dev))
            u[4:8] = torch.tensor([0.0, 1.0 - 2.0 ** -53, 0.5, 1.0], dtype=torch.float64, device=dev)
            tok, lp = sample_with_temperature(z, u, T)
            runs_equal = all(torch.equal(sample_with_temperature(z, u, T)[0], tok) for _ in range(5))
            probs = torch.softmax(z.double() / T, -1)
            want = inverse_cdf_reference(probs, u)
            bad = [(row, int(tok[row]), int(want[row]), float(u[row])) for row in off_boundary_rows(probs, u, tok, want)]
            finite = bool(torch.isfinite(z.gather(1, tok[:, None])).all())
            lp_ref = token_logprobs(z / T, tok)
            lp_err = float((lp - lp_ref).abs().max())
            check(f"sample V={V} scale={scale} T={T}", not bad and finite and runs_equal and lp_err < 1e-4,
                  f"mismatch={int((tok != want).sum())} off-boundary={bad[:3]} finite={finite} det={runs_equal} lp_err={lp_err:.2e}")

# ---- 2. decode attention: DYNAMIC_STOP True vs False, bitwise; and vs reference
torch.manual_seed(0)
for dtype in (torch.bfloat16, torch.float32):
    for (P, S, Hq, Hkv, Lp, T, D) in [(3, 7, 8, 2, 77, 131, 32), (2, 5, 6, 2, 64, 65, 16), (1, 3, 4, 4, 1, 1, 16),
                                      (2, 2, 4, 1, 130, 700, 24), (1, 2, 4, 2, 40, 1500, 16), (2, 3, 4, 2, 1100, 9, 16),
                                      (1, 9, 16, 2, 1100, 5, 16), (4, 64, 32, 8, 600, 3000, 128), (2, 16, 32, 8, 5000, 17, 128)]:
        k_pre, v_pre = (torch.randn(P, Hkv, Lp, D, device=dev).to(dtype) for _ in range(2))
        k_suf, v_suf = (torch.randn(S, Hkv, T, D, device=dev).to(dtype) for _ in range(2))
        q = torch.randn(S, Hq, D, device=dev).to(dtype)
        pidx = torch.randint(0, P, (S,), device=dev)
        entry_len = torch.randint(0, Lp + 1, (P,), device=dev); entry_len[0] = Lp
        slen = torch.randint(1, T + 1, (S,), device=dev)
        members = torch.full((P, S), -1, dtype=torch.long, device=dev)
        members[pidx, torch.arange(S, device=dev)] = torch.arange(S, device=dev)
        args = (q, k_pre, v_pre, pidx, entry_len[pidx], k_suf, v_suf, slen, D ** -0.5)
        ref = decode_attention_reference(*[a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args])
        for kw in ({}, dict(members=members, prompt_len=entry_len),
                   dict(members=members, prompt_len=entry_len, launch=dict(block=32, programs=4096))):
            dk.DYNAMIC_STOP = True
            a = dk.decode_attention_triton(*args, **kw)
            dk.DYNAMIC_STOP = False
            b = dk.decode_attention_triton(*args, **kw)
            dk.DYNAMIC_STOP = True
            err = float((a.float() - ref).abs().max())
            tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
            check(f"decode {dtype} {(P, S, Hq, Hkv, Lp, T, D)} grouped={bool(kw)}", torch.equal(a, b) and err < tol,
                  f"bitwise={torch.equal(a, b)} maxdiff_ab={float((a.float() - b.float()).abs().max()):.2e} err={err:.2e}")
            # the merge inside the chunk launch: whichever program merges, the same columns in the same order
            again = all(torch.equal(dk.decode_attention_triton(*args, **kw), a) for _ in range(3))
            check(f"fused merge repeats {dtype} {(P, S, Hq, Hkv, Lp, T, D)} grouped={bool(kw)}", again, "")

# ---- 3. merge kernel edges: dead columns with NaN/inf stale l/acc, maxima in later blocks, NaN in a live column
def merge(m, l, acc, npart, D):
    out = torch.empty(m.numel() // npart, D, device=dev, dtype=torch.float32)
    dk.merge_partials(m, l, acc, out, npart)
    return out

for npart in (1, 2, 16, 17, 33, 1025):
    rows, D = 64, 128
    m = torch.randn(rows, npart, device=dev) * 20
    dead = torch.rand(rows, npart, device=dev) < 0.5
    dead[0] = True  # a row with nothing live: 0/0
    dead[1, :-1] = True  # only the last column live
    dead[1:, -1] = False  # every other row with a live column (rows 5 and 6 take a NaN in one below)
    m[dead] = float("-inf")
    l = torch.rand(rows, npart, device=dev) + 0.1
    acc = torch.randn(rows, npart, D, device=dev)
    l[dead] = float("nan"); acc[dead] = float("nan")
    l[2, dead[2]] = float("inf")
    w = torch.where(dead, 0.0, torch.exp(m.double() - m.double().amax(1, keepdim=True).clamp(min=-1e300)))
    want = (torch.where(dead[..., None], 0.0, w[..., None] * acc.double()).sum(1)
            / torch.where(dead, 0.0, w * l.double()).sum(1, keepdim=True))
    got = merge(m.flatten().contiguous(), l.flatten().contiguous(), acc.reshape(-1, D).contiguous(), npart, D)
    okrows = slice(1, None)
    err = float((got[okrows].double() - want[okrows]).abs().max())
    check(f"merge npart={npart}", bool(torch.isnan(got[0]).all()) and err < 1e-4 and bool(torch.isfinite(got[1:]).all()),
          f"err={err:.2e} row0={got[0, :2].tolist()}")
    # a NaN in a live column's acc propagates; a NaN m column (a corrupt chunk)
    acc2 = acc.clone(); live_col = int((~dead[5]).nonzero()[0, 0]); acc2[5, live_col, 0] = float("nan")
    got2 = merge(m.flatten().contiguous(), l.flatten().contiguous(), acc2.reshape(-1, D).contiguous(), npart, D)
    check(f"merge nan-acc npart={npart}", bool(torch.isnan(got2[5, 0])), "")
    m3 = m.clone(); m3[6, live_col if not dead[6, live_col] else int((~dead[6]).nonzero()[0, 0])] = float("nan")
    got3 = merge(m3.flatten().contiguous(), l.flatten().contiguous(), acc.reshape(-1, D).contiguous(), npart, D)
    print(f"INFO merge nan-m npart={npart}: output row finite={bool(torch.isfinite(got3[6]).all())} (NaN m column dropped silently if True)")

# ---- 4. the fused merge replayed from a CUDA graph with other lengths (its counters back at rest after each launch;
# its own random generator: the draws above stay as they were)
P, S, Hq, Hkv, Lp, T, D = 4, 64, 32, 8, 600, 3000, 128
gen = torch.Generator(device=dev).manual_seed(4)
k_pre, v_pre = (torch.randn(P, Hkv, Lp, D, device=dev, generator=gen).to(torch.bfloat16) for _ in range(2))
k_suf, v_suf = (torch.randn(S, Hkv, T, D, device=dev, generator=gen).to(torch.bfloat16) for _ in range(2))
q = torch.randn(S, Hq, D, device=dev, generator=gen).to(torch.bfloat16)
pidx = torch.arange(S, device=dev) % P
entry_len = torch.full((P,), Lp, device=dev)
slen = torch.randint(1, T + 1, (S,), device=dev, generator=gen)
members = torch.arange(S, device=dev).view(S // P, P).T.contiguous()
args = (q, k_pre, v_pre, pidx, entry_len[pidx], k_suf, v_suf, slen, D ** -0.5)
kw = dict(members=members, prompt_len=entry_len)
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    dk.decode_attention_triton(*args, **kw)  # compiled before the capture
torch.cuda.current_stream().wait_stream(side)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    out = dk.decode_attention_triton(*args, **kw)
for trial in range(20):
    slen.copy_(torch.randint(0 if trial % 2 else 1, T + 1 if trial % 3 else 40, (S,), device=dev, generator=gen))
    graph.replay()
    want = dk.decode_attention_triton(*args, **kw)
    ref = decode_attention_reference(*[a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args])
    err = float((out.float() - ref).abs().max())
    # the separate merge launch: the same sums, compiled apart (float32 summation order), then rounded to bf16
    du = float((out.float() - dk.decode_attention_triton(*args, **kw, fused_merge=False).float()).abs().max())
    check(f"fused merge graph replay {trial}", torch.equal(out, want) and err < 2e-2 and du < 2e-2,
          f"bitwise-vs-eager={torch.equal(out, want)} err={err:.2e} vs-merge-launch={du:.2e}")

print("FAILS:", fails)
