"""Publishing a head: its weights stored in bf16 (half the bytes; outputs stay lossless, since the target verifies
every token) as ``config.json`` plus ``model.safetensors``, the directory every mode loads with ``--speculator DIR``.

``train/publish_head.py`` publishes a trained head by hand; ``spd-adapt`` publishes each head it keeps
(:mod:`spd.traffic.versions`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from ..files import replace_file
from .loading import load_speculator

DTYPES = ("bfloat16", "float16", "float32")
FILES = ("config.json", "model.safetensors")


def publish_head(source: str | os.PathLike, out: str | os.PathLike, dtype: str = "bfloat16") -> list[Path]:
    """Write ``source``'s head into ``out`` in ``dtype``, each file under a temporary name renamed into place (other
    files in ``out``, such as its model card, are left as they are); return the files written."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got '{dtype}'")
    head = load_speculator(str(source), dtype=getattr(torch, dtype))
    out = Path(out)
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
