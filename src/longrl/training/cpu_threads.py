"""How many threads torch's CPU operations use, set once when a run starts.

torch's default is one thread per core of the machine, whoever else uses them: on a CPU shared with other processes
(or a container granted fewer cores than the machine has) its threads wait on each other and a run slows down many
times over. The count, in order:

1. ``train.cpu_threads`` when > 0;
2. ``OMP_NUM_THREADS`` when set in the environment (torch read it at import; left as it is);
3. automatic: the CPUs this process may use (its affinity, capped by a cgroup CPU quota) less those busy with other
   processes (the 1-minute load average, less one for this process), at least 1.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

log = logging.getLogger(__name__)


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity, capped by a cgroup v2 or v1 CPU quota."""
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cgroup_quota()
    return max(1, min(count, quota) if quota else count)


def _cgroup_quota() -> int | None:
    """ceil(quota / period) of the cgroup's CPU limit, or None without one."""
    try:
        text = Path("/sys/fs/cgroup/cpu.max").read_text().split()  # v2: "max 100000" or "200000 100000"
        if text and text[0] != "max":
            return math.ceil(int(text[0]) / int(text[1]))
        return None
    except (OSError, ValueError, IndexError):
        pass
    try:  # v1
        quota = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return math.ceil(quota / period) if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def automatic_threads(cpus: int, load_average: float) -> int:
    """max(1, cpus − round(load_average − 1)), at most ``cpus``: the CPUs left by other processes (the load
    average counts this process too, once it runs)."""
    busy = max(0, round(load_average - 1.0))
    return max(1, min(cpus, cpus - busy))


def choose_threads(configured: int, environ=os.environ) -> tuple[int | None, str]:
    """(threads to set, or None to leave torch's count; why), by the rules of the module docstring."""
    if configured > 0:
        return configured, "train.cpu_threads"
    if environ.get("OMP_NUM_THREADS"):
        return None, f"OMP_NUM_THREADS={environ['OMP_NUM_THREADS']}"
    cpus = usable_cpus()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return automatic_threads(cpus, load), f"{cpus} usable CPUs, load average {load:.1f}"


_automatic_done = False


def set_cpu_threads(configured: int) -> int:
    """Set torch's CPU thread count: ``configured`` (> 0) at every call; the automatic count (or OMP_NUM_THREADS's)
    once per process, so a second run in the same process keeps the first choice. Return the count."""
    import torch

    global _automatic_done
    if configured > 0 or not _automatic_done:
        _automatic_done = _automatic_done or configured <= 0
        threads, why = choose_threads(configured)
        if threads is not None and threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        log.info("CPU threads: %d (%s; train.cpu_threads or OMP_NUM_THREADS to choose)", torch.get_num_threads(), why)
    return torch.get_num_threads()
