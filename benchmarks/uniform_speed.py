"""The sampling uniforms on the GPU: the PyTorch twin (sampling.uniform_reference, ~40 element-wise launches) against
the one-launch kernel (sampling_kernel.uniform_triton), bit for bit checked, at the decode batch sizes.

Two figures a size: the host's microseconds a call (launches queued, no wait: what a decode step outside a CUDA
graph pays on the host) and the GPU's (CUDA-graph timed: the kernels alone).

    python benchmarks/uniform_speed.py [--tag _x]     # → results/uniform_speed_<card><tag>.{md,json}
    python benchmarks/uniform_speed.py --smoke        # CPU: the twin's host time only; writes nothing
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from bench_setup import sync  # noqa: E402
from results_io import card_tag, graph_seconds, run_meta, write_result  # noqa: E402

from longrl.rollout.sampling import uniform_reference  # noqa: E402

SIZES = (8, 32, 128, 512)
SEED = 1234


def host_seconds(fn, calls: int = 200) -> float:
    """Seconds of host time a call: ``calls`` calls queued back to back, timed before the GPU catches up."""
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    seconds = (time.perf_counter() - start) / calls
    sync()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tag", default="")
    ap.add_argument("--smoke", action="store_true", help="CPU, the twin only: the program runs; writes nothing")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    kernel = None
    if dev.type == "cuda":
        from longrl.rollout.sampling_kernel import uniform_triton as kernel
    rows = []
    for n in SIZES:
        seq = torch.arange(n, device=dev) * 7919 + 11
        pos = torch.randint(0, 20_000, (n,), device=dev)
        row = dict(rows=n, twin_host_us=host_seconds(lambda: uniform_reference(SEED, seq, pos)) * 1e6)
        if kernel is not None:
            same = torch.equal(kernel(SEED, seq, pos).view(torch.int64),
                               uniform_reference(SEED, seq, pos).view(torch.int64))
            row.update(kernel_host_us=host_seconds(lambda: kernel(SEED, seq, pos)) * 1e6,
                       twin_gpu_us=graph_seconds(lambda: uniform_reference(SEED, seq, pos)) * 1e6,
                       kernel_gpu_us=graph_seconds(lambda: kernel(SEED, seq, pos)) * 1e6, bit_for_bit=same)
        rows.append(row)
        print(row, flush=True)
    if args.smoke:
        print("(smoke run: nothing written)")
        return
    meta = run_meta()
    lines = ["# The sampling uniforms: PyTorch twin against the one-launch kernel", "",
             f"Command: `{meta['command']}`  ",
             f"Date: {meta['date']}; {meta['gpu']}; torch {meta['torch']}.", "",
             "Host µs: a call's host time with the launches queued back to back (no wait for the GPU); GPU µs: "
             "CUDA-graph timed. Bit for bit: the kernel's float64 uniforms equal the twin's.", "",
             "| rows | twin host µs | kernel host µs | twin GPU µs | kernel GPU µs | bit for bit |",
             "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['rows']} | {r['twin_host_us']:.1f} | {r.get('kernel_host_us', float('nan')):.1f} | "
              f"{r.get('twin_gpu_us', float('nan')):.1f} | {r.get('kernel_gpu_us', float('nan')):.1f} | "
              f"{r.get('bit_for_bit', '–')} |" for r in rows]
    write_result(f"uniform_speed_{card_tag()}{args.tag}", dict(meta=meta, rows=rows), lines + [""])


if __name__ == "__main__":
    main()
