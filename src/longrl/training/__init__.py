"""What the recipes share: model set-up and the optimizer, the run directory and its lock, checkpoints, stop
signals, numeric guards, reporting, callbacks, data parallelism and held-out evaluation."""
