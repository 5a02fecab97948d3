"""Exit codes of the command line, beyond 0 (done) and the run's own (training/guards.py: EXIT_GUARD, EXIT_SAVE_FAILED)."""

EXIT_BAD_INPUT = 2  # the input was refused (config, data, rewards, model, checkpoint, output directory in use)
