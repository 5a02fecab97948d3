"""``python -m longrl`` (and ``torchrun --nproc-per-node N -m longrl train run.yaml``): the command line."""

from .cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
