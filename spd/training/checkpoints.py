"""A run's checkpoints on disk, each complete or absent: ``checkpoints/step-N`` written under a temporary name and
renamed into place, an older copy moved aside while it is replaced, the newest complete one found on a resume, what
killed runs left removed; and a head saved the same way (``final``, a checkpoint's ``head``)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from ..files import replace_dir, temp_dir_beside

if TYPE_CHECKING:
    from ..heads.speculator import Speculator


def _aside(final: Path, tag: str) -> Path:
    """Where :func:`spd.files.replace_dir` moves an older ``final`` while the new one is renamed in: still whole
    there, :func:`list_checkpoints` falls back to it if the process dies before the new one is in."""
    return final.with_name(f"{final.name}.{tag}.old")


def save_head_atomic(head: Speculator, out_dir: str | Path) -> None:
    """``save_pretrained`` into a unique temporary directory, then :func:`spd.files.replace_dir`: never half a
    head."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir_beside(out_dir)
    try:
        head.save_pretrained(tmp, safe_serialization=True)
        replace_dir(tmp, out_dir, _aside(out_dir, tmp.name.split(".")[-2]))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# checkpoints/step-N: complete; step-N.T.tmp: being written; step-N.T.old: a complete step-N moved aside while its
# replacement is renamed in; step-N.T.del.tmp: being deleted. T is unique per run, shared by its processes.
_CHECKPOINT = re.compile(r"step-(\d+)(?:\.\w+\.(tmp|old|del\.tmp))?")


def _checkpoint_dirs(output_dir: str | Path) -> list[tuple[int, str | None, Path]]:
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _CHECKPOINT.fullmatch(p.name)
        if m and p.is_dir() and not p.is_symlink():
            found.append((int(m.group(1)), m.group(2), p))
    return found


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints (``checkpoints/step-N`` with a ``trainer_state.json``), oldest first.

    A step whose ``step-N`` is missing but whose previous copy was moved aside (``step-N.T.old``, a run killed
    while replacing it) is listed by that copy.
    """
    done: dict[int, Path] = {}
    for step, kind, p in sorted(_checkpoint_dirs(output_dir), key=lambda t: (t[1] is not None, t[2].name)):
        if kind in (None, "old") and step not in done and (p / "trainer_state.json").is_file():
            done[step] = p
    return [done[step] for step in sorted(done)]


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint, if any."""
    done = list_checkpoints(output_dir)
    return done[-1] if done else None


def commit_checkpoint(tmp: Path, final: Path, keep: int, tag: str) -> None:
    """Put a complete checkpoint ``tmp`` in place as ``final`` (:func:`spd.files.replace_dir`, an older ``final``
    moved aside to ``<final>.<tag>.old`` meanwhile), then drop all but the newest ``keep`` (each renamed first, so a
    half-deleted one is never taken for a checkpoint)."""
    replace_dir(tmp, final, _aside(final, tag))
    for old in list_checkpoints(final.parent.parent)[:-keep]:
        gone = old.with_name(f"{old.name.split('.')[0]}.{tag}.del.tmp")
        os.rename(old, gone)
        shutil.rmtree(gone, ignore_errors=True)


def clean_checkpoints(output_dir: str | Path) -> None:
    """Remove what killed runs left: unfinished ``.tmp``, half-deleted ``.del.tmp`` and superseded ``.old`` copies."""
    complete = {
        step for step, kind, p in _checkpoint_dirs(output_dir) if kind is None and (p / "trainer_state.json").is_file()
    }
    for step, kind, p in _checkpoint_dirs(output_dir):
        if kind in ("tmp", "del.tmp") or (kind == "old" and step in complete):
            shutil.rmtree(p, ignore_errors=True)
