"""Durable writes: what an atomic rename needs first (its contents and their directory entries on disk)."""

from __future__ import annotations

import os
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
