"""Bounds checks for the kernels that tests run under Triton's interpreter (TRITON_INTERPRET=1; tests only).

On a GPU a load or store past a tensor's storage reads or corrupts whatever lies there, or stops the process with
an illegal address, often far from its cause. Under the interpreter it reads host memory silently. With
:func:`install`, every load, store and atomic whose mask lets it through must address bytes inside the storage of
one of its launch's tensor arguments (a view may reach anywhere in its storage); otherwise :class:`OutOfBounds`
names the kernel, the program, the first stray address, the nearest argument and every argument's layout.
tests/interpreter.py installs it in each snippet it runs.

It wraps the interpreter's argument staging and memory operations (triton/runtime/interpreter.py), which are not a
public interface: where this Triton's interpreter has other names or signatures, :func:`install` returns False and
nothing is checked.
"""

from __future__ import annotations

import inspect

import numpy as np

_LAUNCH: dict = {"kernel": None, "lo": None, "hi": None, "args": []}
# the signatures wrapped (their leading parameters: pointers, then mask where there is one)
_EXPECTED = {"create_masked_load": ["self", "ptrs", "mask"], "create_masked_store": ["self", "ptrs", "value", "mask"],
             "create_atomic_rmw": ["self", "rmwOp", "ptr", "val", "mask"], "create_atomic_cas": ["self", "ptr"]}


class OutOfBounds(RuntimeError):
    pass


def _tensors(arg, out: list) -> None:
    """The torch tensors in a kernel argument (tuples and tensor descriptors opened)."""
    if isinstance(arg, (tuple, list)):
        for a in arg:
            _tensors(a, out)
    elif hasattr(arg, "untyped_storage"):
        out.append(arg)
    elif hasattr(getattr(arg, "base", None), "untyped_storage"):
        out.append(arg.base)


def _record(executor, args_hst, kwargs_hst) -> None:
    """The storage ranges [start, end) of the launch's tensor arguments, sorted, and their layouts for messages."""
    ranges, layouts = set(), []
    for name, arg in list(zip(executor.arg_names, args_hst)) + list(kwargs_hst.items()):
        found: list = []
        _tensors(arg, found)
        for t in found:
            storage = t.untyped_storage()
            start = storage.data_ptr()
            ranges.add((start, start + storage.nbytes()))
            layouts.append(f"{name}: shape {tuple(t.shape)}, stride {t.stride()}, {t.dtype}, storage "
                           f"[{start:#x}, {start + storage.nbytes():#x}), offset {t.storage_offset()}")
    ranges = sorted(ranges)
    _LAUNCH.update(kernel=executor.fn.__name__, lo=np.array([r[0] for r in ranges], dtype=np.uint64),
                   hi=np.array([r[1] for r in ranges], dtype=np.uint64), args=layouts)


def _check(op: str, builder, ptrs, mask) -> None:
    """Raise OutOfBounds if a masked-in lane of ``ptrs`` addresses a byte outside every recorded range."""
    p = np.asarray(ptrs.data)
    size = max(1, ptrs.get_element_ty().primitive_bitwidth // 8)
    live = p if mask is None else p[np.broadcast_to(np.asarray(mask.data).astype(bool), p.shape)]
    live = live.astype(np.uint64).ravel()
    if not live.size:
        return
    lo, hi = _LAUNCH["lo"], _LAUNCH["hi"]
    at = np.searchsorted(lo, live, side="right").astype(np.int64) - 1  # the range starting at or below each address
    ok = at >= 0
    ok[ok] = live[ok] + np.uint64(size) <= hi[at[ok]]
    if ok.all():
        return
    first = int(live[~ok][0])
    gap, start, end = min((min(abs(first - int(a)), abs(first - int(b))), int(a), int(b)) for a, b in zip(lo, hi))
    where = f"{first - end:+d} B from the end of" if first >= end else f"{start - first} B before"
    raise OutOfBounds(f"{op} out of bounds in kernel {_LAUNCH['kernel']} (program {getattr(builder, 'grid_idx', '?')})"
                      f": {int((~ok).sum())} of {live.size} lanes outside every tensor argument; the first at "
                      f"{first:#x} ({size}-byte elements), {where} [{start:#x}, {end:#x})\n  "
                      + "\n  ".join(_LAUNCH["args"]))


def install() -> bool:
    """Wrap the interpreter's staging and memory operations with the checks (once); False where they differ."""
    try:
        import triton.runtime.interpreter as interp
    except ImportError:
        return False
    builder, executor = getattr(interp, "InterpreterBuilder", None), getattr(interp, "GridExecutor", None)
    if builder is None or executor is None or not hasattr(executor, "_init_args_hst"):
        return False
    if getattr(builder, "_bounds_checked", False):
        return True
    for name, params in _EXPECTED.items():
        fn = getattr(builder, name, None)
        if fn is None or list(inspect.signature(fn).parameters)[:len(params)] != params:
            return False
    stage = executor._init_args_hst

    def _init_args_hst(self, args_dev, kwargs):
        args_hst, kwargs_hst = stage(self, args_dev, kwargs)
        _record(self, args_hst, kwargs_hst)
        return args_hst, kwargs_hst

    load, store = builder.create_masked_load, builder.create_masked_store
    rmw, cas = builder.create_atomic_rmw, builder.create_atomic_cas

    def create_masked_load(self, ptrs, mask, *rest, **kw):
        _check("load", self, ptrs, mask)
        return load(self, ptrs, mask, *rest, **kw)

    def create_masked_store(self, ptrs, value, mask, *rest, **kw):
        _check("store", self, ptrs, mask)
        return store(self, ptrs, value, mask, *rest, **kw)

    def create_atomic_rmw(self, op, ptr, val, mask, *rest, **kw):
        _check("atomic", self, ptr, mask)
        return rmw(self, op, ptr, val, mask, *rest, **kw)

    def create_atomic_cas(self, ptr, *rest, **kw):
        _check("atomic", self, ptr, None)
        return cas(self, ptr, *rest, **kw)

    executor._init_args_hst = _init_args_hst
    builder.create_masked_load, builder.create_masked_store = create_masked_load, create_masked_store
    builder.create_atomic_rmw, builder.create_atomic_cas = create_atomic_rmw, create_atomic_cas
    builder._bounds_checked = True
    return True
