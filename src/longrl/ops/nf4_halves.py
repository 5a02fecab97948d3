"""The NF4 codes' *halves* layout, and the code lookup that reads it (ops/nf4_matmul.py's ``halves`` groups).

bitsandbytes stores a row's codes two a byte in k order: byte i of a 128-code chunk starting at k0 holds k0 + 2i
(high nibble) and k0 + 2i + 1 (low). The halves layout keeps every byte in its chunk and re-pairs the codes:

    byte j of the chunk = code(k0 + j) << 4 | code(k0 + 64 + j)          j = 0 … 63

so a chunk's high nibbles are its first 64-wide block in k order and its low nibbles its second. The decode product
then looks up both values of a byte with one elementwise operation whose only operand is the byte tile, and each
block's values meet a contiguous 64-element slice of x. That is what lets Triton load the bytes straight into the
tensor-core operand's register layout (its layout conversion moves ahead of an elementwise op with one operand)
instead of writing the looked-up 16-bit tile to shared memory and reading it back each chunk, as the k-order
layout needs (the values of a byte there are neighbours in k, so they must be interleaved after the lookup).

The change is made in place on a weight's own bytes (no second copy), and undone the same way: on CUDA by one Triton
launch a weight (each program reads its chunks whole before it writes them), elsewhere by PyTorch ops a slice of
chunks at a time through a scratch buffer allocated first (the launch's twin). Both ways are exact byte permutations
(tests/test_nf4_halves.py). It needs K a multiple of 128.

:func:`lookup_ptx` is the lookup: the 16 table entries of the activations' dtype, as two byte planes of four
registers set from immediates, selected by byte permutes (PRMT) by each byte's nibbles.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without Triton: the PyTorch path
    triton = None

CHUNK = 128  # codes of a row a chunk (64 bytes): the product's step along K
SLICE_CHUNKS = 1 << 18  # chunks converted at once (16 MiB of codes, ~48 MiB of temporaries)


def halves_ok(K: int) -> bool:
    """Whether rows K wide can take the halves layout (whole chunks)."""
    return K % CHUNK == 0


def _chunks(packed: torch.Tensor, K: int) -> torch.Tensor:
    if not halves_ok(K):
        raise ValueError(f"the NF4 halves layout needs K a multiple of {CHUNK}; got {K}")
    if packed.dtype != torch.uint8 or packed.numel() % (CHUNK // 2):
        raise ValueError(f"NF4 codes as uint8 in whole chunks of {CHUNK // 2} bytes; got {packed.dtype} "
                         f"× {packed.numel()}")
    return packed.view(-1, CHUNK // 2)  # [N·K/128, 64]


def scratch_for(packed: torch.Tensor) -> torch.Tensor | None:
    """The temporaries of a conversion on the PyTorch path, allocated before any byte changes (so that running out
    of memory leaves the codes as they were): uint8 [min(chunks, SLICE_CHUNKS), 192]; None where the in-place kernel
    runs (it needs none)."""
    if triton is not None and packed.is_cuda:
        return None
    return _slice_scratch(packed)


def _slice_scratch(packed: torch.Tensor) -> torch.Tensor:
    chunks = min(packed.numel() // (CHUNK // 2), SLICE_CHUNKS)
    return torch.empty(chunks, CHUNK + CHUNK // 2, dtype=torch.uint8, device=packed.device)


if triton is not None:
    @triton.jit
    def _repair_kernel(P, n_chunks, TO_HALVES: tl.constexpr, BLOCK: tl.constexpr):
        """Chunks [BLOCK·pid, BLOCK·(pid + 1)) of P (uint8 [n_chunks, 64]) re-paired in place: into the halves
        layout (TO_HALVES), or back. Each program reads its chunks whole before it writes them (a barrier between)."""
        c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] chunks
        j = tl.arange(0, 64)  # [64] bytes written
        ok = (c < n_chunks)[:, None]
        row = P + c.to(tl.int64)[:, None] * 64  # [BLOCK, 1]
        if TO_HALVES:  # byte j ← code(k0 + j) << 4 | code(k0 + 64 + j); code(k0 + 2i + h) is byte i's nibble h
            first = tl.load(row + j[None, :] // 2, mask=ok, other=0)
            second = tl.load(row + 32 + j[None, :] // 2, mask=ok, other=0)
            odd = (j % 2 == 1)[None, :]
            hi = tl.where(odd, first & 15, first >> 4)
            lo = tl.where(odd, second & 15, second >> 4)
        else:  # byte i ← code(k0 + 2i) << 4 | code(k0 + 2i + 1); code(k0 + j) is byte j's high nibble, code(k0 + 64
            # + j) its low one
            low = (j >= 32)[None, :]
            src = tl.where(low, 2 * j[None, :] - 64, 2 * j[None, :])  # [1, 64] the byte holding code(k0 + 2i)
            a = tl.load(row + src, mask=ok, other=0)
            b = tl.load(row + src + 1, mask=ok, other=0)
            hi = tl.where(low, a & 15, a >> 4)
            lo = tl.where(low, b & 15, b >> 4)
        new = ((hi << 4) | lo).to(tl.uint8)
        tl.debug_barrier()  # every byte of these chunks read before any is written
        tl.store(row + j[None, :], new, mask=ok)


REPAIR_BLOCK = 32  # chunks a program of the in-place kernel


def _repair_on_device(packed: torch.Tensor, to_halves: bool) -> bool:
    """Run the in-place Triton kernel where it can (CUDA, Triton installed); False: the caller's PyTorch path."""
    if triton is None or not packed.is_cuda:
        return False
    n = packed.numel() // (CHUNK // 2)
    _repair_kernel[(triton.cdiv(n, REPAIR_BLOCK),)](packed, n, TO_HALVES=to_halves, BLOCK=REPAIR_BLOCK)
    return True


def _repair_(packed: torch.Tensor, K: int, scratch, kernel: bool, to_halves: bool) -> torch.Tensor:
    """The in-place change of a weight's codes either way: on CUDA one Triton launch (no temporaries); otherwise
    (or ``kernel`` False: the twin) a slice of chunks at a time through ``scratch`` (:func:`scratch_for`; made here
    when None): each chunk's codes into k order, then paired again."""
    chunks = _chunks(packed, K)
    if kernel and _repair_on_device(packed, to_halves):
        return packed
    scratch = _slice_scratch(packed) if scratch is None else scratch  # (the twin on CUDA too)
    half = CHUNK // 2
    for start in range(0, chunks.shape[0], SLICE_CHUNKS):
        v = chunks[start:start + SLICE_CHUNKS]
        codes, high = scratch[:len(v), :CHUNK], scratch[:len(v), CHUNK:]  # [c, 128] in k order; [c, 64]
        # from bitsandbytes' bytes, code(k0 + 2i + h) is byte i's nibble h; from the halves, code(k0 + j) is byte
        # j's high nibble and code(k0 + 64 + j) its low one
        first, second = (codes[:, 0::2], codes[:, 1::2]) if to_halves else (codes[:, :half], codes[:, half:])
        torch.bitwise_right_shift(v, 4, out=first)
        torch.bitwise_and(v, 15, out=second)
        # the halves pair codes j and 64 + j; bitsandbytes' order 2i and 2i + 1
        first, second = (codes[:, :half], codes[:, half:]) if to_halves else (codes[:, 0::2], codes[:, 1::2])
        torch.bitwise_left_shift(first, 4, out=high)
        torch.bitwise_or(high, second, out=v)
    return packed


@torch.no_grad()
def to_halves_(packed: torch.Tensor, K: int, scratch: torch.Tensor | None = None,
               kernel: bool = True) -> torch.Tensor:
    """Re-pair a weight's codes (uint8, bitsandbytes' order, rows K wide) into the halves layout, in place
    (:func:`_repair_`'s two paths)."""
    return _repair_(packed, K, scratch, kernel, True)


@torch.no_grad()
def from_halves_(packed: torch.Tensor, K: int, scratch: torch.Tensor | None = None,
                 kernel: bool = True) -> torch.Tensor:
    """Undo :func:`to_halves_` in place: the codes back in bitsandbytes' order."""
    return _repair_(packed, K, scratch, kernel, False)


def halves_codes(packed: torch.Tensor, K: int) -> torch.Tensor:
    """A copy of halves-layout codes in bitsandbytes' order (for the plain twin)."""
    return from_halves_(packed.clone(), K)


def table_planes(code: list[float], dtype: torch.dtype) -> list[int]:
    """The 16 entries dtype(code[i]) as byte planes: L0..L3 (low bytes of entries 4q … 4q + 3, entry 4q + t in
    byte t), then H0..H3 (their high bytes)."""
    bits = [b & 0xFFFF for b in torch.tensor(code, dtype=torch.float32).to(dtype).view(torch.int16).tolist()]
    return [sum(((bits[4 * q + t] >> shift) & 0xFF) << 8 * t for t in range(4)) for shift in (0, 8) for q in range(4)]


PLANES = ("L0", "L1", "L2", "L3", "H0", "H1", "H2", "H3")


def lookup_ptx(planes: list[int], pack: int) -> str:
    """Inline PTX of ``pack`` (2 or 4) code bytes → their high-nibble values (the first output: pack // 2
    registers of two 16-bit values) and low-nibble values (the second), element order kept. Per two bytes (16
    bits w): selectors s = w & 0x7777 (each nibble's low 3 bits) and t = 0x3210 | (w >> 1 & 0x4444) (bit 3 picks
    entries 8-15); a plane's 4 entries of 0-7 and of 8-15 by two permutes, the right one by a third; the two
    planes' bytes then paired into 16-bit values by two more. The planes are immediates, so the operation's only
    operand is the bytes (what lets Triton hoist its layout conversion)."""
    if pack not in (2, 4):
        raise ValueError(f"lookup_ptx: pack is 2 or 4, not {pack}")
    out_regs = pack // 2  # registers of each output
    src = f"${2 * out_regs}"
    lines = ["{", ".reg .b32 " + ", ".join(PLANES) + ", s, t, a, b, rl, rh, w;"]
    lines += [f"mov.b32 {name}, 0x{p:08x};" for name, p in zip(PLANES, planes)]
    for half in range(pack // 2):
        w = src
        if half:
            lines.append(f"shr.b32 w, {src}, 16;")
            w = "w"
        lines += [f"and.b32 s, {w}, 0x7777;", f"shr.b32 t, {w}, 1;", "and.b32 t, t, 0x4444;", "or.b32 t, t, 0x3210;",
                  "prmt.b32 a, L0, L1, s;", "prmt.b32 b, L2, L3, s;", "prmt.b32 rl, a, b, t;",
                  "prmt.b32 a, H0, H1, s;", "prmt.b32 b, H2, H3, s;", "prmt.b32 rh, a, b, t;",
                  f"prmt.b32 ${half}, rl, rh, 0x7351;",  # (high nibble of byte 0, of byte 1)
                  f"prmt.b32 ${out_regs + half}, rl, rh, 0x6240;"]  # (low nibble of byte 0, of byte 1)
    lines.append("}")
    return "\n".join(lines)


def lookup_constraints(pack: int) -> str:
    """The operand constraints of :func:`lookup_ptx`: two outputs of pack // 2 registers, one input register."""
    return ",".join(["=r"] * pack + ["r"])
