"""The demo's step time on the CPU with each micro-batch layout (``train.padding_free``): packed (one row of every
sequence back to back, the CUDA default) against padded rows (the CPU default). The loss is the same either way
(tests/test_inference.py); this measures what each costs. Runs alternate (packed, padded, packed, ...) so that a
change in the machine's load hits both; each is the demo config for --steps steps, timed after its first step.

    python benchmarks/demo_layout.py --steps 100 --repeats 2
    python benchmarks/demo_layout.py --update-only --repeats 20   # one demo batch's policy update, each layout

Prints a markdown table (mean and median step time, the update and reference phases, the final mean reward);
append it to benchmarks/results/demo_cpu.md with the date and the machine's load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch


def run(padding_free: bool, steps: int) -> dict:
    from longrl.config import load_config
    from longrl.config.demo import demo_config
    from longrl.compat.trl import GRPOTrainer

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(None, [f"train.max_steps={steps}", f"train.padding_free={str(padding_free).lower()}",
                                 f"output.output_dir={out}", "output.progress_bar=false", "output.report_to=[none]",
                                 "output.save_steps=0", "output.logging_steps=1000000"], base=demo_config())
        start = time.perf_counter()
        history = GRPOTrainer(cfg).train()
        wall = time.perf_counter() - start
    timed = history[1:]
    return {"layout": "packed" if padding_free else "padded", "wall_s": wall,
            "step_mean_s": statistics.mean(m["step_time_s"] for m in timed),
            "step_median_s": statistics.median(m["step_time_s"] for m in timed),
            "update_mean_s": statistics.mean(m["update_time_s"] for m in timed),
            "generation_mean_s": statistics.mean(m["generation_time_s"] for m in timed),
            "reward_last10": statistics.mean(m["reward"] for m in history[-10:])}


def update_only(repeats: int) -> None:
    """The policy update (forward + backward of every micro-batch, no optimizer step) of one demo rollout batch,
    timed alternately with each layout: the part of the step the layout changes."""
    from longrl.config import load_config
    from longrl.config.demo import demo_config
    from longrl.compat.trl import GRPOTrainer

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(None, [f"output.output_dir={out}", "output.report_to=[none]"], base=demo_config())
        trainer = GRPOTrainer(cfg)
        batch = trainer.generate_batch()
        trainer.optimizer.step = trainer.scheduler.step = lambda *a, **k: None
        times = {True: [], False: []}
        for _ in range(repeats):
            for packed in (True, False):
                trainer.padding_free = packed
                start = time.perf_counter()
                trainer.train_on_batch(batch)  # (demo: beta 0, no reference pass)
                times[packed].append(time.perf_counter() - start)
    lengths = sorted({len(p) + len(c) for p, c in zip(batch.prompt_ids, batch.completion_ids)})
    load = os.getloadavg()
    print(f"one demo batch: {len(batch.prompt_ids)} sequences of {lengths[0]}-{lengths[-1]} tokens, "
          f"{repeats} alternating repeats, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}\n")
    print("| layout | policy update, median | min |")
    print("|---|---|---|")
    for packed in (True, False):
        print(f"| {'packed' if packed else 'padded'} | {statistics.median(times[packed]) * 1e3:.1f} ms | "
              f"{min(times[packed]) * 1e3:.1f} ms |")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--update-only", action="store_true", help="time one batch's policy update per layout")
    args = p.parse_args()
    if args.update_only:
        update_only(args.repeats)
        return
    rows = []
    for _ in range(args.repeats):
        for padding_free in (True, False):
            rows.append(run(padding_free, args.steps))
            print(rows[-1], flush=True)
    load = os.getloadavg()
    print(f"\n{args.steps} demo steps a run, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}\n")
    print("| layout | step mean | step median | update phase | generation phase | run wall | reward, last 10 |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layout']} | {r['step_mean_s'] * 1e3:.1f} ms | {r['step_median_s'] * 1e3:.1f} ms | "
              f"{r['update_mean_s'] * 1e3:.1f} ms | {r['generation_mean_s'] * 1e3:.1f} ms | {r['wall_s']:.1f} s | "
              f"{r['reward_last10']:.3f} |")


if __name__ == "__main__":
    main()
