"""A CPU emulator of the few PTX instructions the NF4 lookups use (mov, and, or, shr, prmt on .b32 registers), to
replay their inline assembly, which Triton's interpreter does not run."""


def prmt(a: int, b: int, c: int) -> int:
    """PTX prmt.b32 (default mode): byte k of the result is byte (nibble k of c) & 7 of the pair {b, a}, its sign
    replicated when the nibble's bit 3 is set."""
    src = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
    out = 0
    for k in range(4):
        nib = (c >> 4 * k) & 0xF
        byte = src[nib & 7]
        out |= ((0xFF if byte & 0x80 else 0) if nib & 8 else byte) << 8 * k
    return out


OPS = {"mov.b32": lambda v: v[0], "and.b32": lambda v: v[0] & v[1], "or.b32": lambda v: v[0] | v[1],
       "shr.b32": lambda v: v[0] >> v[1], "prmt.b32": lambda v: prmt(*v)}


def run_ptx(ptx: str, regs: dict) -> dict:
    """Execute ``ptx`` line by line on ``regs`` (name → 32-bit value; updated and returned). Braces and directives
    (lines starting with '.') are skipped."""
    for line in ptx.splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}.":
            continue
        op, rest = line.split(None, 1)
        d, *args = [a.strip() for a in rest.split(",")]
        v = [int(a, 16) if a.startswith("0x") else int(a) if a.isdigit() else regs[a] for a in args]
        regs[d] = OPS[op](v) & 0xFFFFFFFF
    return regs
