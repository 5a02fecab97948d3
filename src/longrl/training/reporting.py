"""Run outputs, for people and for machines.

- ``metrics.jsonl``: one JSON object per optimizer step (``eval/...`` keys on the steps that evaluated);
  ``completions.jsonl``: a sample of completions per logging step.
- ``output.report_to``: TensorBoard scalars (``train/...``, ``eval/...``) and/or Weights & Biases (imported only
  when asked; ``WANDB_MODE=offline`` works as wandb documents it).
- The console: in a terminal, a progress bar with log records printed above it (a logging handler that writes
  through the bar's console, so warnings never land on the bar's line); elsewhere (nohup, Slurm, CI: stdout is
  not a TTY) one plain line per logging step, and a line when each phase of the run's first step starts (the first
  step can take minutes: the log shows it is under way). A summary when the run ends.
- ``training_curves.png`` at each save: reward (total and per function), loss, KL, completion length and eval
  rewards, axes fitted to the data, legends outside the plots.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path

from .checkpoint import atomic_write_text

log = logging.getLogger(__name__)

LINE_KEYS = ("reward", "loss", "kl", "completion_length")  # the figures of a GRPO log line and of the bar
# per recipe: (the figures of a log line and of the bar, the first of them summed up at the end; the eval figure)
RECIPE_FIGURES = {"grpo": (LINE_KEYS, "eval/reward"), "sft": (("loss", "grad_norm", "lr", "tokens_per_s"), "eval/loss")}
REPORT_TARGETS = ("tensorboard", "wandb", "none")
CURVES_FILE = "training_curves.png"


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def report_targets(output_cfg) -> list[str]:
    """The integrations of ``output.report_to`` (with the deprecated ``output.tensorboard`` applied: true adds
    tensorboard, false removes it); "none" alone means none."""
    targets = [t for t in output_cfg.report_to if t != "none"]
    legacy = getattr(output_cfg, "tensorboard", None)
    if legacy is True and "tensorboard" not in targets:
        targets.append("tensorboard")
    elif legacy is False:
        targets = [t for t in targets if t != "tensorboard"]
    return list(dict.fromkeys(targets))


def check_report_to(output_cfg) -> None:
    """Fail before training when a requested integration is not installed (the message names the key)."""
    from ..config.errors import ConfigError

    for target in report_targets(output_cfg):
        module = {"tensorboard": "torch.utils.tensorboard", "wandb": "wandb"}[target]
        try:
            __import__(module)
        except ImportError as e:
            package = "tensorboard" if target == "tensorboard" else "wandb"
            raise ConfigError(f"config key 'output.report_to': {target} is not installed ({e}); pip install "
                              f"{package}, or remove {target} from output.report_to") from None


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _figure(value) -> str:
    return "-" if value is None else f"{value:.4g}"


def step_line(metrics: dict, total_steps: int, eta_s: float | None, recipe: str = "grpo") -> str:
    """``step 10/600 reward=0.412 loss=0.0123 kl=- completion_length=3.2 step_time_s=0.09 eta=0:52`` (and the eval
    reward on steps that evaluated); an SFT run's line: loss, grad_norm, lr, tokens_per_s (and eval/loss)."""
    keys, eval_key = RECIPE_FIGURES[recipe]
    parts = [f"step {metrics['step']}/{total_steps}"]
    parts += [f"{k}={_figure(metrics.get(k))}" for k in keys]
    parts.append(f"step_time_s={_figure(metrics.get('step_time_s'))}")
    if eval_key in metrics:
        parts.append(f"{eval_key}={_figure(metrics[eval_key])}")
    parts.append(f"eta={format_duration(eta_s) if eta_s is not None else '-'}")
    return " ".join(parts)


def reward_failure_lines(step: int, failures, num_samples: int) -> list[str]:
    """One line per reward function that failed in a step: how many samples, and the first error."""
    by_function: dict[str, list] = {}
    for f in failures:
        by_function.setdefault(f.function, []).append(f)
    lines = []
    for name, fails in by_function.items():
        samples = [f for f in fails if f.sample is not None]
        first = fails[0]
        where = f"sample {first.sample}" if first.sample is not None else "the batch call"
        count = f"{len(samples)} of {num_samples} samples" if samples else "the batch call (each sample alone worked)"
        lines.append(f"step {step}: reward function {name!r} failed on {count}; first error ({where}): {first.reason}")
    return lines


def phase_line(cfg, step: int, phase: str) -> str | None:
    """What the first step's ``phase`` does, for a log without a progress bar (None: a phase with nothing to do)."""
    g, gen, t = cfg.grpo, cfg.generation, cfg.train
    if phase == "generation":
        prompts = t.prompts_per_step * g.steps_per_generation
        return (f"step {step}: generation started: {prompts} prompts × {g.num_generations} completions, up to "
                f"{gen.max_completion_length} tokens each")
    if phase == "rewards":
        names = [r.url or r.function.rsplit(":", 1)[-1] for r in cfg.rewards] or ["the environment's rewards"]
        limits = sorted({r.timeout_s for r in cfg.rewards if r.timeout_s > 0})
        limit = ("; a call that hangs fails after " + " or ".join(f"{x:g} s" for x in limits) +
                 " (rewards[i].timeout_s)") if limits else ""
        return f"step {step}: rewards started: {', '.join(names)}{limit}"
    if phase == "reference":
        if g.beta == 0 and g.num_iterations == 1 and g.steps_per_generation == 1:
            return None
        return f"step {step}: reference log-probs started" + (" (old policy and KL reference)" if g.beta else "")
    if phase == "update":
        return f"step {step}: policy update started"
    if phase == "sft":
        return (f"step {step}: started: {cfg.sft.examples_per_step} examples of up to {cfg.sft.max_length} tokens, "
                "forward and backward")
    return f"step {step}: {phase} started"


class _ConsoleHandler(logging.Handler):
    """Log records printed through a rich console (above a live progress bar), formatted as the handler it
    stands in for formatted them."""

    def __init__(self, console, level: int, formatter: logging.Formatter | None):
        super().__init__(level)
        self.console = console
        self.setFormatter(formatter or logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.console.print(self.format(record), markup=False, highlight=False, soft_wrap=True)
        except Exception:  # noqa: BLE001 - logging must never stop the run
            self.handleError(record)


class RunReporter:
    """Writes a run's metrics and samples, reports them to the console and integrations, and sums the run up.

    ``stream``: where the console output goes (default sys.stdout); a progress bar only when it is a terminal.
    ``recipe``: "grpo" or "sft", whose figures the lines, the bar and the summary show (RECIPE_FIGURES).
    """

    def __init__(self, output_dir: Path, total_steps: int, report_to=("tensorboard",), progress_bar: bool = True,
                 resume_step: int = 0, logging_steps: int = 1, config: dict | None = None, stream=None,
                 recipe: str = "grpo"):
        self.recipe = recipe
        self.line_keys, self.eval_key = RECIPE_FIGURES[recipe]
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.total_steps, self.logging_steps, self.resume_step = total_steps, logging_steps, resume_step
        self.stream = stream or sys.stdout
        self._failed_writes: set[Path] = set()
        self.metrics_path = self.output_dir / "metrics.jsonl"
        self.completions_path = self.output_dir / "completions.jsonl"
        self._truncate(self.metrics_path, resume_step)
        self._truncate(self.completions_path, resume_step)
        self.start_time = time.perf_counter()
        self.last_step = resume_step
        self.writer = self.wandb_run = None
        if "tensorboard" in report_to:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.output_dir / "tensorboard"), purge_step=resume_step + 1)
        if "wandb" in report_to:
            import wandb

            self.wandb_run = wandb.init(project="longrl", name=self.output_dir.resolve().name,
                                        dir=str(self.output_dir), config=config, resume="allow")
        self.progress = None
        self._swapped: list[tuple[logging.Logger, logging.Handler]] = []
        if progress_bar and getattr(self.stream, "isatty", lambda: False)():
            self._start_bar(total_steps, resume_step)

    @classmethod
    def for_config(cls, cfg, resume_step: int = 0, stream=None, recipe: str = "grpo",
                   total_steps: int | None = None) -> "RunReporter":
        """The reporter of a run of ``cfg`` to ``total_steps`` (default train.max_steps)."""
        o = cfg.output
        total = cfg.train.max_steps if total_steps is None else total_steps
        return cls(Path(o.output_dir), total, report_targets(o), o.progress_bar, resume_step,
                   o.logging_steps, cfg.to_dict(), stream, recipe)

    # ------------------------------------------------------------------------------------------ console
    def _start_bar(self, total_steps: int, resume_step: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        console = Console(file=self.stream)
        self.progress = Progress(TextColumn(f"[bold]{self.recipe.upper()}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                 TextColumn("{task.fields[figures]}"), console=console, transient=False)
        self.task = self.progress.add_task("train", total=total_steps, completed=resume_step, figures="")
        # the handlers that write to the terminal print through the bar's console while it runs
        root = logging.getLogger()
        for handler in list(root.handlers):
            if isinstance(handler, logging.StreamHandler) and getattr(handler.stream, "isatty", lambda: False)():
                root.removeHandler(handler)
                root.addHandler(_ConsoleHandler(console, handler.level, handler.formatter))
                self._swapped.append((root, handler))
        self.progress.start()

    def _stop_bar(self) -> None:
        if self.progress is None:
            return
        self.progress.stop()
        root = logging.getLogger()
        for handler in [h for h in root.handlers if isinstance(h, _ConsoleHandler)]:
            root.removeHandler(handler)
        for logger, handler in self._swapped:
            logger.addHandler(handler)
        self._swapped.clear()
        self.progress = None

    def print(self, text: str) -> None:
        """A line for the person watching: above the bar in a terminal, else a plain line on the stream."""
        if self.progress is not None:
            self.progress.console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            print(text, file=self.stream, flush=True)

    def phase_started(self, step: int, phase: str, cfg) -> None:
        """Say that ``phase`` of the run's first step (``step``) started, when no progress bar shows the run is alive
        (:func:`phase_line`); later steps say nothing until their log line."""
        if self.progress is None and step == self.resume_step + 1:
            line = phase_line(cfg, step, phase)
            if line:
                self.print(line)

    def eta_s(self, step: int) -> float | None:
        done = step - self.resume_step
        if done <= 0:
            return None
        return (time.perf_counter() - self.start_time) / done * (self.total_steps - step)

    # ------------------------------------------------------------------------------------------ per step
    def _append(self, path: Path, text: str) -> None:
        """Append to a log file; a failed write (disk full) is reported once per file and the run goes on (its
        checkpoints are written, and their failures handled, separately)."""
        try:
            with open(path, "a") as f:
                f.write(text)
        except OSError as e:
            if path not in self._failed_writes:
                self._failed_writes.add(path)
                log.error("could not write %s: %s; the run goes on without these lines", path, e)

    def _tensorboard(self, call, *args) -> None:
        """A TensorBoard write; its writer thread's errors (re-raised here by the writer) turn TensorBoard off,
        reported once."""
        if self.writer is None:
            return
        try:
            call(*args)
        except Exception as e:  # noqa: BLE001 - whatever the writer raises, the run goes on without it
            log.error("TensorBoard write to %s failed: %s: %s; TensorBoard logging is off for the rest of the run",
                      self.output_dir / "tensorboard", type(e).__name__, e)
            writer, self.writer = self.writer, None
            try:
                writer.close()
            except Exception:  # noqa: BLE001 - the same failure again: the writer is given up either way
                pass

    def log_step(self, metrics: dict) -> None:
        metrics = {k: _clean(v) for k, v in metrics.items()}
        self._append(self.metrics_path, json.dumps(metrics) + "\n")
        step = metrics["step"]
        self.last_step = step
        scalars = {(k if k.startswith("eval/") else f"train/{k}"): v for k, v in metrics.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        for k, v in scalars.items():
            self._tensorboard(lambda *a: self.writer.add_scalar(*a), k, v, step)
        if self.wandb_run is not None:
            self.wandb_run.log(scalars, step=step)
        if self.progress is not None:
            figures = "  ".join(f"{k} {metrics[k]:.3g}" for k in self.line_keys if metrics.get(k) is not None)
            self.progress.update(self.task, completed=step, figures=figures)
            if self.eval_key in metrics:
                self.print(step_line(metrics, self.total_steps, self.eta_s(step), self.recipe))
        elif step % self.logging_steps == 0 or step in (1, self.total_steps) or self.eval_key in metrics:
            self.print(step_line(metrics, self.total_steps, self.eta_s(step), self.recipe))

    def log_completions(self, step: int, samples: list[dict]) -> None:
        self._append(self.completions_path,
                     "".join(json.dumps({"step": step, **s}, default=str) + "\n" for s in samples))
        if self.writer is not None and samples:
            text = "\n\n".join(f"**prompt** {s['prompt']}\n\n**completion** {s['completion']}\n\n"
                               f"**reward** {s['reward']}" for s in samples)
            self._tensorboard(lambda *a: self.writer.add_text(*a), "completions", text, step)

    def plot(self) -> Path | None:
        """Write ``training_curves.png`` from metrics.jsonl (the whole run, resumed steps too)."""
        try:
            return plot_training_curves(self.output_dir, read_metrics(self.output_dir))
        except Exception as e:  # noqa: BLE001 - a plot must never stop a run
            log.warning("could not write %s: %s: %s", CURVES_FILE, type(e).__name__, e)
            return None

    # ------------------------------------------------------------------------------------------ the end
    def summary(self) -> str:
        """Steps, time, reward first → last, and where the outputs are."""
        metrics = read_metrics(self.output_dir)
        elapsed = time.perf_counter() - self.start_time
        done = self.last_step - self.resume_step
        lines = [f"trained {done} steps in {format_duration(elapsed)}"
                 + (f" ({elapsed / done:.3g} s/step)" if done else "")
                 + (f", resumed at step {self.resume_step}" if self.resume_step else "")
                 + f"; step {self.last_step}/{self.total_steps}"]
        head, ev = self.line_keys[0], self.eval_key  # reward (GRPO) or loss (SFT)
        values = [m[head] for m in metrics if m.get(head) is not None]
        if values:
            window = max(1, min(10, len(values) // 5))
            first, last = sum(values[:window]) / window, sum(values[-window:]) / window
            lines.append(f"{head}: {first:.3f} (mean of the first {window} steps) → {last:.3f} (last {window})")
        evals = [m for m in metrics if m.get(ev) is not None]
        if evals:
            lines.append(f"eval {ev[5:]}: {evals[0][ev]:.3f} (step {evals[0]['step']}) → "
                         f"{evals[-1][ev]:.3f} (step {evals[-1]['step']})")
        from .checkpoint import latest_checkpoint

        outputs = [p for p in (latest_checkpoint(self.output_dir), self.metrics_path, self.completions_path,
                               self.output_dir / CURVES_FILE) if p is not None and p.exists()]
        if self.writer is not None:
            outputs.append(self.output_dir / "tensorboard")
        lines.append(f"outputs in {self.output_dir}: {', '.join(p.name for p in outputs)}")
        return "\n".join(lines)

    def close(self, finished: bool = True) -> None:
        self._stop_bar()
        self._tensorboard(lambda: self.writer.close())
        if self.wandb_run is not None:
            self.wandb_run.finish()
        if finished:
            self.print(self.summary())

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


def read_metrics(output_dir: Path) -> list[dict]:
    path = Path(output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


# ---------------------------------------------------------------------------------------------- plots

def _moving_average(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        part = [v for v in values[max(0, i - window + 1):i + 1] if not math.isnan(v)]
        out.append(sum(part) / len(part) if part else float("nan"))
    return out


def _series(metrics: list[dict], key: str) -> tuple[list[int], list[float]]:
    pairs = [(m["step"], m[key]) for m in metrics if m.get(key) is not None]
    return [s for s, _ in pairs], [float(v) for _, v in pairs]


def _fit_axis(ax, values: list[float]) -> None:
    """y limits around the data (5% margin; a flat series gets a unit-wide window)."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return
    lo, hi = min(finite), max(finite)
    pad = (hi - lo) * 0.05 if hi > lo else max(abs(hi) * 0.05, 0.5)
    ax.set_ylim(lo - pad, hi + pad)


def _save(fig, path: Path) -> Path:
    """Save a figure atomically (a temporary file in the same directory, then a rename)."""
    import matplotlib.pyplot as plt

    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, bbox_inches="tight")
    plt.close(fig)
    tmp.replace(path)
    return path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot_reward(ax, metrics: list[dict]) -> list[float]:
    steps, reward = _series(metrics, "reward")
    window = max(1, len(reward) // 20)
    ax.plot(steps, reward, alpha=0.35, label="mean reward")
    smooth = _moving_average(reward, window)
    ax.plot(steps, smooth, label=f"moving average ({window} steps)")
    return reward


def plot_training_curves(output_dir: Path, metrics: list[dict], filename: str = CURVES_FILE) -> Path | None:
    """One PNG with a panel each for the reward (total, each reward function, eval), the loss, the KL and the
    completion length (panels without data left out); None when there are no metrics yet."""
    if not metrics:
        return None
    plt = _pyplot()
    functions = sorted({k for m in metrics for k in m if k.startswith("rewards/")})
    eval_keys = sorted({k for m in metrics for k in m if k == "eval/reward" or k.startswith("eval/rewards/")})
    panels = [("reward", "reward")] + [(k, k.removeprefix("rewards/")) for k in functions]
    panels += [(k, k) for k in ("loss", "kl", "completion_length") if _series(metrics, k)[0]]
    panels += [(k, k) for k in eval_keys]
    fig, axes = plt.subplots(len(panels), 1, figsize=(7.5, 2.2 * len(panels)), dpi=110, sharex=True, squeeze=False)
    for ax, (key, title) in zip(axes[:, 0], panels):
        if key == "reward":
            values = _plot_reward(ax, metrics)
        else:
            steps, values = _series(metrics, key)
            ax.plot(steps, values, marker="o" if key.startswith("eval/") else None, markersize=3, label=title)
        _fit_axis(ax, values)
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize="small")
    axes[-1, 0].set_xlabel("optimizer step")
    return _save(fig, Path(output_dir) / filename)


def plot_reward_curve(output_dir: Path, metrics: list[dict], filename: str = "reward_curve.png") -> Path:
    """Mean reward per step and its moving average as a PNG (y axis fitted to the data, legend outside)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=120)
    values = _plot_reward(ax, metrics)
    _fit_axis(ax, values)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    return _save(fig, Path(output_dir) / filename)
