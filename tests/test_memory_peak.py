"""benchmarks/memory_peak.py: the live set at an allocator history's peak, replayed from synthetic events."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from memory_peak import peak_live_blocks, summarize  # noqa: E402


def _frames(path, line):
    return [{"filename": "/usr/lib/python3/site-packages/torch/functional.py", "line": 1, "name": "inner"},
            {"filename": f"/x/site-packages/{path}", "line": line, "name": "f"}]


def test_the_peak_is_the_first_largest_live_set_and_frees_count_when_completed():
    """a 100 + b 50 = 150; a's free requested (still allocated), c 30: 180; a's free completed: 80; d 120: 200, the
    peak, with b, c, d live (a freed); a later equal total does not move it; sites group by the innermost own frame
    (longrl/…, transformers/…), sizes summed."""
    events = [dict(action="alloc", addr=1, size=100, frames=_frames("longrl/memory/offload.py", 10)),
              dict(action="alloc", addr=2, size=50, frames=_frames("transformers/models/llama.py", 20)),
              dict(action="free_requested", addr=1, size=100),
              dict(action="alloc", addr=3, size=30, frames=_frames("transformers/models/llama.py", 20)),
              dict(action="free_completed", addr=1, size=100),
              dict(action="alloc", addr=4, size=120, frames=_frames("longrl/ops/losses.py", 5)),
              dict(action="free_completed", addr=3, size=30),
              dict(action="alloc", addr=5, size=30, frames=[]),
              dict(action="free_completed", addr=99, size=7)]  # allocated before the recording: ignored
    peak, live = peak_live_blocks(events)
    assert peak == 200 and sorted(live) == [2, 3, 4]
    figures, lines = summarize({"device_traces": [events]}, 0, baseline=2 ** 30)
    sites = {s["site"]: (s["gib"] * 2 ** 30, s["blocks"]) for s in figures["sites"]}
    assert sites == {"transformers/models/llama.py:20 f": (80, 2), "longrl/ops/losses.py:5 f": (120, 1)}
    assert figures["peak_gib"] == (2 ** 30 + 200) / 2 ** 30
    assert [s["site"] for s in figures["sites"]][0] == "longrl/ops/losses.py:5 f"  # largest first
    assert any("losses.py:5" in line for line in lines)
