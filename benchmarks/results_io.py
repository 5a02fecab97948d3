"""What the benchmarks share: the GPU's timing and copy bandwidth, and what every one writes beside its figures
(the run's metadata, a JSON + markdown pair in results/)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

import torch

# LONGRL_RESULTS_DIR redirects a run's files (a background run on the GPU machine writes outside the synced tree)
RESULTS = Path(os.environ.get("LONGRL_RESULTS_DIR") or Path(__file__).resolve().parent / "results")


def run_meta(**extra) -> dict:
    """Date, GPU (or CPU), library versions and the command line of this run, plus ``extra``."""
    import transformers

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    return dict(date=datetime.date.today().isoformat(), gpu=gpu, torch=torch.__version__,
                transformers=transformers.__version__, python=platform.python_version(),
                command="python " + " ".join(sys.argv), **extra)


def card_tag(device_name: str | None = None) -> str:
    """A GPU's model for a file name ("h100", "h200", "a100"; "cpu"): the first word of its device name shaped like
    letters and digits ("NVIDIA H100 80GB HBM3" → "h100"), else the last word. device_name: this machine's when None
    ("cpu" without CUDA; a name of "CPU" is "cpu")."""
    if device_name is None:
        if not torch.cuda.is_available():
            return "cpu"
        device_name = torch.cuda.get_device_name()
    words = device_name.lower().split()
    return next((w for w in words if re.fullmatch(r"[a-z]+\d{2,4}[a-z]*", w) and not w.endswith("gb")), words[-1])


def write_result(stem: str, payload: dict, lines: list[str], echo: bool = True) -> None:
    """results/STEM.json (``payload``) and results/STEM.md (``lines``), and with ``echo`` the markdown on stdout."""
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(payload, indent=2, default=str))
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")
    if echo:
        print("\n".join(lines))


def gpu_seconds(fn, reps: int = 50) -> float:
    """Median seconds of fn() over reps calls, each timed by CUDA events, after 5 warm-ups."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def captured(fn, calls: int) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of ``calls`` calls of fn, captured after 3 warm-ups (they compile and allocate), replayed once."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def graph_seconds(fn, calls: int = 20, reps: int = 20) -> float:
    """Median GPU seconds of one fn() replayed from a CUDA graph of ``calls`` calls: the time the device spends,
    without the host's launch overhead, as a captured decode step runs it."""
    graph = captured(fn, calls)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return sorted(times)[len(times) // 2]


def l2_copies(nbytes: int, device=None) -> int:
    """How many copies of an operand of ``nbytes`` a timing cycles through so that between two reads of one copy
    the others read at least twice the GPU's L2 cache: each read comes from DRAM, as in a decode step, whose other
    layers read gigabytes between two reads of one weight (an 8B layer's q/k/v, o and down fit in an H100's 50 MB
    L2, so timing one copy over and over measures L2's bandwidth, not the product's)."""
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device() if device is None else device).L2_cache_size
    return 1 + max(1, -(-2 * l2 // max(1, nbytes)))


def cold_copies(first, nbytes: int, make, device=None) -> list:
    """[first] and make()'s further copies of an operand of ``nbytes``, l2_copies of them in all."""
    return [first] + [make() for _ in range(l2_copies(nbytes, device) - 1)]


def cold_seconds(fns: list, calls: int = 20, reps: int = 20) -> float:
    """graph_seconds of fns[0](), fns[1](), ... in turn, one a captured call: the calls of one operation on its
    copies (l2_copies), each called once first (compiles, per-operand caches and allocations stay out of the
    capture)."""
    for fn in fns:
        fn()
    turn = iter(range(1 << 62))
    return graph_seconds(lambda: fns[next(turn) % len(fns)](), calls, reps)


def kernel_times(prof) -> dict:
    """{kernel or op name: (self GPU µs, calls)} of a finished torch.profiler profile."""
    out = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        us = e.self_cuda_time_total if us is None else us
        if us > 0:
            out[e.key] = (us, e.count)
    return out


def graph_kernel_times(fn, calls: int = 20, reps: int = 5) -> dict:
    """{kernel name: GPU µs per fn() call} of fn replayed from a CUDA graph (``calls`` captured, ``reps`` replays
    profiled): where a call's GPU time goes, kernel by kernel."""
    from torch.profiler import ProfilerActivity, profile

    graph = captured(fn, calls)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    return {name: us / (calls * reps) for name, (us, _) in kernel_times(prof).items()}


def copy_bandwidth(device) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write of a 4 GiB buffer, best of 5)."""
    gib = 2 ** 30
    src = torch.empty(gib, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    del src, dst
    return 2 * 4 * gib / best
