"""The bounds checks that tests/interpreter.py puts on every interpreted kernel (tests/triton_bounds.py): reads,
writes and atomics inside their arguments' storage pass (a view reaching past its own elements but inside its
storage included); one element past, unmasked or masked in, is caught and named, as is a stride-0 view read row by
row; masked-off lanes are not checked."""

import textwrap

import pytest
from interpreter import run_interpreted

CHECK = textwrap.dedent('''
    import torch, triton, triton.language as tl
    import triton_bounds
    if not triton_bounds.install():
        print("not installed")
        raise SystemExit(0)

    @triton.jit
    def copy(X, Y, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(Y + i, tl.load(X + i, mask=i < n, other=0.0))

    @triton.jit
    def store_at(Y, at):
        tl.store(Y + at, 1.0)

    @triton.jit
    def add_at(C, at):
        tl.atomic_add(C + at, 1)

    def caught(fn, op):
        try:
            fn()
        except Exception as e:  # the interpreter re-raises a kernel's error as its own type, the message kept
            assert f"{op} out of bounds" in str(e), e
            return True
        return False

    x, y = torch.arange(8, dtype=torch.float32), torch.zeros(16)
    copy[(1,)](x, y, 8, BLOCK=16)  # 8 lanes masked off
    assert y[:8].tolist() == list(range(8))
    copy[(1,)](torch.zeros(16)[4:12], y, 12, BLOCK=16)  # past the view's 8 elements, inside its storage
    store_at[(1,)](torch.zeros(4), 3)
    add_at[(1,)](torch.zeros(4, dtype=torch.int32), 3)
    assert caught(lambda: copy[(1,)](x, y, 9, BLOCK=16), "load")
    assert caught(lambda: store_at[(1,)](torch.zeros(4), 4), "store")
    assert caught(lambda: add_at[(1,)](torch.zeros(4, dtype=torch.int32), 4), "atomic")
    # a stride-0 view of one element read as 3 rows at base + row (the fast verify's fault of 2026-12-05)
    assert caught(lambda: copy[(1,)](torch.zeros(1).expand(3), y, 3, BLOCK=4), "load")
    print("bounds ok")
''')


def test_interpreted_kernels_are_bounds_checked():
    pytest.importorskip("triton")
    out = run_interpreted(CHECK)
    if "not installed" in out:
        pytest.skip("this Triton's interpreter has other internals: tests/triton_bounds.py checks nothing")
    assert "bounds ok" in out
