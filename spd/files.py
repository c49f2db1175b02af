"""Durable writes: what an atomic rename needs first (its contents and their directory entries on disk)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path


def fsync_path(path: str | os.PathLike) -> None:
    """fsync one file or directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file and directory under ``root`` (and ``root``): its contents are on disk before a rename."""
    for dirpath, _, filenames in os.walk(Path(root), topdown=False):
        for name in filenames:
            fsync_path(Path(dirpath) / name)
        fsync_path(dirpath)


def write_json_atomic(path: Path, obj) -> None:
    """Write JSON to a temporary file and rename it over ``path``: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def replace_dir(tmp: Path, final: Path, tag: str) -> None:
    """Put the complete directory ``tmp`` in place as ``final``: fsynced, renamed, the old ``final`` removed last.

    A directory cannot be renamed over a non-empty one, so an existing ``final`` is first renamed aside to
    ``<final>.<tag>.old`` (still whole: :func:`spd.training.distill.list_checkpoints` falls back to it if the
    process dies before the new one is in), and removed only once the new one is in place and its parent directory
    synced.
    """
    fsync_tree(tmp)
    aside = final.with_name(f"{final.name}.{tag}.old")
    if final.exists():
        os.rename(final, aside)
    os.rename(tmp, final)
    fsync_path(final.parent)
    if aside.exists():
        shutil.rmtree(aside)
