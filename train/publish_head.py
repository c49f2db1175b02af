"""Publish a trained head: its weights in bf16 (half the bytes; outputs stay lossless, since the target verifies
every token) as ``config.json`` plus ``model.safetensors`` in a directory that every mode loads with
``--speculator DIR``.

    python train/publish_head.py runs/smollm2-n8-text/final heads/smollm2-135m-instruct-spd-n8

Each file is written under a temporary name and renamed into place; other files in the directory (the model
card, README.md) are left as they are (:func:`spd.heads.publish.publish_head`). A wrong input prints one ``error:``
line and exits with 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DTYPES = ("bfloat16", "float16", "float32")  # spd.heads.publish.DTYPES, repeated so that --help imports no torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="a trained head: a directory written by train/distill.py (<output_dir>/final)")
    p.add_argument("out", type=Path, help="the directory to publish it in (e.g. heads/NAME)")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="storage dtype (default: bfloat16)")
    args = p.parse_args(argv)
    from spd.errors import run_cli

    return run_cli(_publish_and_report, args)


def _publish_and_report(args) -> int:
    from spd.heads.publish import publish_head

    files = publish_head(args.source, args.out, args.dtype)
    total = sum(f.stat().st_size for f in files)
    print(f"wrote {args.out} ({', '.join(f.name for f in files)}: {total / 2**20:.1f} MiB in {args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
