"""Publish a trained head: its weights in bf16 (half the bytes; outputs stay lossless, since the target verifies
every token) as ``config.json`` plus ``model.safetensors`` in a directory that every mode loads with
``--speculator DIR``.

    python train/publish_head.py runs/smollm2-n8-text/final heads/smollm2-135m-instruct-spd-n8

Each file is written under a temporary name and renamed into place; other files in the directory (the model
card, README.md) are left as they are. A wrong input prints one ``error:`` line and exits with 2.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

DTYPES = ("bfloat16", "float16", "float32")
FILES = ("config.json", "model.safetensors")


def publish(source: str, out: Path, dtype: str) -> list[Path]:
    """Write ``source``'s head into ``out`` in ``dtype``; return the files written."""
    import torch

    from spd.files import replace_file
    from spd.heads.loading import load_speculator

    head = load_speculator(source, dtype=getattr(torch, dtype))
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".publish.", dir=out))
    try:
        head.save_pretrained(tmp, safe_serialization=True)
        written = sorted(p.name for p in tmp.iterdir())
        if written != sorted(FILES):
            raise RuntimeError(f"save_pretrained wrote {written}, expected {list(FILES)}")
        for name in FILES:
            replace_file(tmp / name, out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [out / name for name in FILES]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="a trained head: a directory written by train/distill.py (<output_dir>/final)")
    p.add_argument("out", type=Path, help="the directory to publish it in (e.g. heads/NAME)")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="storage dtype (default: bfloat16)")
    args = p.parse_args(argv)
    from spd.errors import run_cli

    return run_cli(_publish_and_report, args)


def _publish_and_report(args) -> int:
    files = publish(args.source, args.out, args.dtype)
    total = sum(f.stat().st_size for f in files)
    print(f"wrote {args.out} ({', '.join(f.name for f in files)}: {total / 2**20:.1f} MiB in {args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
