"""``longrl demo``: the offline demos (a tiny model learns small-number addition, to use a lookup tool, or the colour
of a shape in a picture: ``--task``), optionally after a supervised warm start (``--sft``)."""

from __future__ import annotations

import time

from .train import run_grpo


def start_demo_over(cfg, kind: str = "grpo"):
    """``longrl demo`` again into the same directory starts over: an earlier demo's checkpoints there are removed
    (only in a directory a demo made, and only those whose saved config names this builtin model); anything else
    is left to the trainer's check. ``kind``: the recipe that will train there (``grpo``, or ``sft`` for the warm
    start's directory), as which the directory is claimed. Returns the directory's run lock, held while this runs
    (and for the demo)."""
    import shutil

    from ..training.checkpoint import checkpoint_config, list_checkpoints
    from ..training.run_lock import acquire_run_lock, check_output_dir_contents, run_marker

    lock = acquire_run_lock(cfg.output.output_dir)
    try:
        check_output_dir_contents(cfg.output.output_dir, kind=kind, command="demo", overwrite=cfg.output.overwrite_output_dir)
    except BaseException:
        lock.release()
        raise
    if cfg.output.resume or not cfg.model.name_or_path.startswith("builtin:") or \
            (run_marker(cfg.output.output_dir) or {}).get("command") != "demo":
        return lock
    for path in list_checkpoints(cfg.output.output_dir):
        saved = checkpoint_config(path) or {}
        if saved.get("model", {}).get("name_or_path") == cfg.model.name_or_path:
            shutil.rmtree(path)
    return lock


def demo_command(cfg, warm_start: bool = False) -> int:
    from ..training.reporting import plot_reward_curve, read_metrics

    start = time.perf_counter()
    with start_demo_over(cfg):
        if warm_start:
            from ..config.demo import sft_warm_start_config
            from ..recipes.sft import SFTTrainer
            from ..recipes.grpo import GRPOTrainer

            sft_cfg = sft_warm_start_config(cfg)
            with start_demo_over(sft_cfg, kind="sft"):
                sft = SFTTrainer(sft_cfg)
                history = sft.train()
            print(f"warm start: {len(history)} supervised steps, held-out loss "
                  f"{history[-1].get('eval/loss', float('nan')):.3f}", flush=True)
            # a vision-language model goes on with its processor (GRPO finds the image encoder through it)
            tokenizer = sft.images.processor if sft.images is not None else sft.tokenizer
            GRPOTrainer(cfg, model=sft.model, tokenizer=tokenizer).train()
        else:
            run_grpo(cfg)
    metrics = read_metrics(cfg.output.output_dir)
    window = max(1, min(10, len(metrics) // 5))
    first = sum(m["reward"] for m in metrics[:window]) / window
    last = sum(m["reward"] for m in metrics[-window:]) / window
    png = plot_reward_curve(cfg.output.output_dir, metrics)
    rewards = [m["reward"] for m in metrics]
    reached = next((i + window for i in range(len(rewards) - window + 1)
                    if sum(rewards[i:i + window]) / window >= 0.9), None)
    print(f"mean reward: first {window} steps {first:.3f} -> last {window} steps {last:.3f} "
          f"({len(metrics)} steps, {time.perf_counter() - start:.0f} s); reward curve: {png}", flush=True)
    print(f"{window}-step mean reward first >= 0.9 at step {reached}" if reached else
          f"the {window}-step mean reward never reached 0.9", flush=True)
    return 0
