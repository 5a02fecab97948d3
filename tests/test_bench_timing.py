"""The benchmarks' cold-L2 timing (benchmarks/results_io.py): the copies a product cycles through, and the order
its captured calls read them in."""

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import results_io  # noqa: E402


def test_l2_copies_put_twice_the_l2_between_two_reads_of_one_copy(monkeypatch):
    l2 = 50 * 2 ** 20
    monkeypatch.setattr(results_io.torch.cuda, "get_device_properties", lambda d: SimpleNamespace(L2_cache_size=l2))
    for nbytes in (1, 9 * 2 ** 20, 13 * 2 ** 20, l2, 62 * 2 ** 20, 10 * l2):
        n = results_io.l2_copies(nbytes, device=0)
        assert n >= 2 and (n - 1) * nbytes >= 2 * l2  # the other copies read between two reads of one
        assert n == 2 or (n - 2) * nbytes < 2 * l2  # and no more copies than that takes


def test_cold_seconds_calls_each_copy_once_then_in_turn(monkeypatch):
    seen = []

    def graph_seconds(fn, calls, reps):  # (the capture's calls, without a GPU)
        for _ in range(calls):
            fn()
        return 0.5

    monkeypatch.setattr(results_io, "graph_seconds", graph_seconds)
    fns = [lambda i=i: seen.append(i) for i in range(3)]
    assert results_io.cold_seconds(fns, calls=7) == 0.5
    assert seen == [0, 1, 2] + [0, 1, 2, 0, 1, 2, 0]
