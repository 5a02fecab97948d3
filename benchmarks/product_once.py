"""Run one packed decode product of an 8B layer a few times, for a kernel profiler (Nsight Compute) to read.

    ncu --kernel-name regex:_group_kernel --launch-skip 3 --launch-count 1 --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \\
        python3 benchmarks/product_once.py --group "gate/up + A" --rows 16 [--fp8] [--launch '{"lut": 5}']

The group's NF4 (or FP8) weights and LoRA A rows as benchmarks/nf4_matmul.py builds them (packed_group); x random
bf16 rows.
Prints the launch used; times nothing (the profiler does).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from nf4_matmul import GROUPS, packed_group  # noqa: E402

from longrl.ops import fp8_matmul as fm  # noqa: E402
from longrl.ops import nf4_matmul as nm  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--group", default="gate/up + A", choices=sorted(GROUPS))
    ap.add_argument("--rows", type=int, default=16, help="rows of x (the decode step's sequences)")
    ap.add_argument("--fp8", action="store_true", help="the FP8 base's product instead of NF4's")
    ap.add_argument("--launch", type=json.loads, default=None, help="a launch-table entry's overrides (JSON)")
    ap.add_argument("--calls", type=int, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("product_once.py needs a CUDA device")
    group = packed_group(args.group, "cuda", fp8=args.fp8)
    linear, table = (fm.fp8_group_linear, fm.LAUNCH) if args.fp8 else (nm.nf4_group_linear, nm.LAUNCH)
    x = torch.randn(args.rows, group.K, dtype=torch.bfloat16, device="cuda")
    print("launch", nm.launch_for(args.rows, args.launch, table), flush=True)
    for _ in range(args.calls):
        linear(x, group, launch=args.launch)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
