"""``longrl export OUTPUT_DIR --from CHECKPOINT --format adapter|merged|gguf``."""

from __future__ import annotations

import sys

from .exit_codes import EXIT_BAD_INPUT


def export_command(args) -> int:
    from ..export import ExportError, export_checkpoint

    try:
        out = export_checkpoint(args.checkpoint, args.output_dir, fmt=args.format, quant=args.quant, dtype=args.dtype,
                                overwrite=args.overwrite, trust_remote_code=args.trust_remote_code)
    except ExportError as e:
        print(f"longrl: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"exported {args.format} to {out}")
    return 0
