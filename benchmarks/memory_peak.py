"""What is allocated at a CUDA step's peak, from PyTorch's allocator history (torch.cuda.memory._record_memory_history).

Replays the history's events in order — an ``alloc`` adds its block (address → size and the Python frames that
asked for it), a ``free_completed`` removes it (``free_requested`` is when the caller let go; the block stays
allocated until the stream is done with it, as max_memory_allocated counts it) — and keeps the live set at the first
moment the running total is largest:

    live(t) = Σ sizes allocated and not yet freed at event t,   peak = max_t live(t)

Blocks allocated before the recording started are not in the history; ``baseline`` (memory_allocated at the start)
stands for them. The live blocks are grouped by the innermost frame of the caller's code (``OWN_CODE``: longrl,
transformers, peft, the benchmarks), so a group names the line that holds the memory.
"""

from __future__ import annotations

from collections import defaultdict

OWN_CODE = ("longrl/", "transformers/", "peft/", "benchmarks/")
GIB = 2 ** 30


def _site(frames: list[dict]) -> str:
    """The innermost frame in OWN_CODE ('file:line function', the path from its package on), else the innermost."""
    for f in frames or []:
        name = f.get("filename", "")
        for part in OWN_CODE:
            if part in name:
                return f"{part}{name.split(part, 1)[1]}:{f.get('line')} {f.get('name')}"
    if frames:
        f = frames[0]
        return f"{f.get('filename', '?')}:{f.get('line')} {f.get('name')}"
    return "(no frames)"


def peak_live_blocks(events: list[dict]) -> tuple[int, dict[int, tuple[int, str]]]:
    """(peak bytes above the start, {address: (size, site)} live at the peak) of one device's trace events."""
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for e in events:
        action = e.get("action")
        if action == "alloc":
            live[e["addr"]] = (e["size"], _site(e.get("frames")))
            total += e["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif action == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])[0]
    return peak, at_peak


def summarize(snapshot: dict, device: int = 0, baseline: int = 0, top: int = 25) -> tuple[dict, list[str]]:
    """(figures, markdown lines) of the live blocks at the peak of ``snapshot`` (torch.cuda.memory._snapshot()),
    grouped by site, largest first."""
    peak, blocks = peak_live_blocks(snapshot["device_traces"][device])
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, site in blocks.values():
        groups[site][0] += size
        groups[site][1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    figures = dict(baseline_gib=baseline / GIB, peak_above_gib=peak / GIB, peak_gib=(baseline + peak) / GIB,
                   sites=[dict(site=s, gib=b / GIB, blocks=n) for s, (b, n) in ranked])
    lines = [f"Allocated before the step: {baseline / GIB:.2f} GiB; the step's peak above it: {peak / GIB:.2f} GiB "
             f"(total {(baseline + peak) / GIB:.2f} GiB). Live at the peak, by the code that allocated it:", "",
             "| GiB | blocks | allocated at |", "|---|---|---|"]
    lines += [f"| {b / GIB:.3f} | {n} | `{s}` |" for s, (b, n) in ranked[:top]]
    rest = sum(b for _, (b, _) in ranked[top:])
    if rest:
        lines.append(f"| {rest / GIB:.3f} | {sum(n for _, (_, n) in ranked[top:])} | (the other sites) |")
    return figures, lines
