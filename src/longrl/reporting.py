"""Run outputs: ``metrics.jsonl`` (one object per optimizer step), ``completions.jsonl`` (a sample of
completions per logging step), TensorBoard scalars, a progress bar, and the reward-curve PNG."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from .checkpoint import atomic_write_text

log = logging.getLogger(__name__)

BAR_KEYS = ("reward", "loss", "kl", "completion_length")


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class RunReporter:
    def __init__(self, output_dir: Path, total_steps: int, tensorboard: bool = True, progress_bar: bool = True,
                 resume_step: int = 0):
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.output_dir / "metrics.jsonl"
        self.completions_path = self.output_dir / "completions.jsonl"
        self._truncate(self.metrics_path, resume_step)
        self._truncate(self.completions_path, resume_step)
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(self.output_dir / "tensorboard"), purge_step=resume_step + 1)
            except ImportError:
                log.warning("tensorboard is not installed: no TensorBoard logs (pip install tensorboard)")
        self.progress = None
        if progress_bar:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("[bold]GRPO"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                     TextColumn("{task.fields[figures]}"), transient=False)
            self.task = self.progress.add_task("train", total=total_steps, completed=resume_step, figures="")
            self.progress.start()

    @staticmethod
    def _truncate(path: Path, resume_step: int) -> None:
        """Drop lines of steps after ``resume_step`` (a resumed run rewrites them); all lines when starting over.
        A line that does not parse (the half-written last line of a killed run) is dropped, and said."""
        if not path.exists():
            return
        kept = []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                step = json.loads(line).get("step", 0)
            except json.JSONDecodeError:
                log.warning("%s: line %d is not JSON (cut short when a run stopped?): dropped", path, number)
                continue
            if step <= resume_step:
                kept.append(line)
        atomic_write_text(path, "".join(line + "\n" for line in kept))

    def log_step(self, metrics: dict) -> None:
        metrics = {k: _clean(v) for k, v in metrics.items()}
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        step = metrics["step"]
        if self.writer is not None:
            for k, v in metrics.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.writer.add_scalar(f"train/{k}", v, step)
        if self.progress is not None:
            figures = "  ".join(f"{k} {metrics[k]:.3g}" for k in BAR_KEYS if metrics.get(k) is not None)
            self.progress.update(self.task, completed=step, figures=figures)

    def log_completions(self, step: int, samples: list[dict]) -> None:
        with open(self.completions_path, "a") as f:
            for s in samples:
                f.write(json.dumps({"step": step, **s}, default=str) + "\n")
        if self.writer is not None and samples:
            text = "\n\n".join(f"**prompt** {s['prompt']}\n\n**completion** {s['completion']}\n\n**reward** {s['reward']}"
                               for s in samples)
            self.writer.add_text("completions", text, step)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.writer is not None:
            self.writer.close()


def read_metrics(output_dir: Path) -> list[dict]:
    path = Path(output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def plot_reward_curve(output_dir: Path, metrics: list[dict], filename: str = "reward_curve.png") -> Path:
    """Mean reward per step (and a moving average) as a PNG, written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in metrics]
    reward = [m["reward"] if m["reward"] is not None else float("nan") for m in metrics]
    window = max(1, len(reward) // 20)
    smooth = [sum(reward[max(0, i - window + 1):i + 1]) / len(reward[max(0, i - window + 1):i + 1])
              for i in range(len(reward))]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot(steps, reward, alpha=0.35, label="mean reward")
    ax.plot(steps, smooth, label=f"moving average ({window} steps)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path = Path(output_dir) / filename
    tmp = path.with_name(f".{filename}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)
    return path
