"""Counts of the fault catalogue (tests/fault_cases.yaml) for the closing note: tried, refused before the model
loads, refused after, faults survived, bytes lost.

    python benchmarks/fault_catalogue.py [--out benchmarks/results/fault_catalogue.md]

Runs tests/test_faults.py with LONGRL_FAULT_REPORT set (each case appends its outcome) and tabulates what the cases
recorded; a case that failed its assertions records nothing and is counted as failed.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fault_catalogue.md"))
    args = p.parse_args()
    import yaml

    cases = yaml.safe_load((ROOT / "tests" / "fault_cases.yaml").read_text())
    with tempfile.TemporaryDirectory() as d:
        report = Path(d) / "report.jsonl"
        env = {**os.environ, "LONGRL_FAULT_REPORT": str(report),
               "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, "-m", "pytest", "-q", str(ROOT / "tests" / "test_faults.py"), "-p", "no:cacheprovider"]
        run = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
        rows = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
    done = {r["id"]: r for r in rows}
    refused_before = sum(r["outcome"] == "refused" and r["load"] == "before" for r in rows)
    refused_after = sum(r["outcome"] == "refused" and r["load"] != "before" for r in rows)
    survived = sum(r["outcome"] == "survived" for r in rows)
    lost = sum(r["bytes_lost"] for r in rows)
    by_area = collections.Counter(c["area"] for c in cases)
    passed_by_area = collections.Counter(c["area"] for c in cases if c["id"] in done)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-500:]
    lines = [
        f"# Fault catalogue — {datetime.date.today().isoformat()}",
        "",
        f"Command: `python benchmarks/fault_catalogue.py` (pytest: {summary}); Python {platform.python_version()}, "
        f"{platform.platform()}, CPU only.",
        "",
        "| tried | handled as specified | refused before the model loads | refused after | faults survived | "
        "bytes lost |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| {len(cases)} | {len(done)} | {refused_before} | {refused_after} | {survived} | {lost} |",
        "",
        "Plus the process tests in the same file (signals sent to a running `longrl train`; kill -9 at random moments",
        "of checkpoint writes, then resume compared with an uninterrupted run), listed in the pytest summary above.",
        "",
        "| area | cases | handled |",
        "| --- | --- | --- |",
        *[f"| {a} | {n} | {passed_by_area[a]} |" for a, n in sorted(by_area.items())],
        "",
    ]
    missing = [c["id"] for c in cases if c["id"] not in done]
    if missing:
        lines += ["Not handled as specified: " + ", ".join(missing), ""]
    text = "\n".join(lines)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    return 0 if not missing and run.returncode == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
