"""``python -m longrl.cli``: the command line."""

from .main import main

if __name__ == "__main__":
    raise SystemExit(main())
