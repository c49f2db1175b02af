"""Durable writes: the one place for "write beside, sync, then rename".

A file is written under a temporary name beside its final one (same directory, so the rename is atomic),
fsynced, renamed over the final name, and the directory fsynced: a reader, or a machine that loses power, sees
the old file or the new one, never half of one. A failed write removes its temporary file and leaves the old
file as it was. Directories are put in place the same way, whole (:func:`rename_dir`, :func:`replace_dir`).

- :func:`atomic_file`: ``open`` for writing, committed on a normal exit; :func:`atomic_path` for writers that
  take a file name (safetensors, ``save_pretrained``); :func:`write_text_atomic`, :func:`write_json_atomic`;
  :func:`write_json_compact` for large results (a list of numbers or booleans on one line).
- :func:`replace_file`: rename a complete file over another, durably.
- :func:`temp_dir_beside`, :func:`rename_dir`, :func:`replace_dir`: a new directory written aside, then put in
  place as a new one or swapped for an existing one.
- :func:`temp_pattern`: the names those temporaries have, for removing what a killed writer left.
- :func:`check_free_space`: refuse, before a long job writes, what will not fit on the disk.
- :func:`complete_lines`: an append-only jsonl file read back for a resume, a last line a kill cut short dropped.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO


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


# ------------------------------------------------------------------------------------------------ files


def temp_pattern(names: str) -> re.Pattern[str]:
    """The names :func:`atomic_path` and :func:`temp_dir_beside` give the temporaries of files or directories
    whose names match the regular expression ``names`` (``.<name>.XXXXXXXX.tmp``): what a killed writer leaves."""
    return re.compile(rf"\.(?:{names})\.[a-z0-9_]{{8}}\.tmp")


def _new_temp_file(path: Path) -> Path:
    """A new empty file beside ``path`` with a name no one else has (created exclusively, so a file that happens
    to have the name is never touched), with the permissions ``open`` gives a new file (the umask's)."""
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
        os.close(fd)
        return tmp
    raise FileExistsError(f"no free temporary name beside '{path}'")


def replace_file(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """Rename the complete file ``tmp`` over ``path``, durably: ``tmp`` fsynced first, ``path``'s directory after."""
    fsync_path(tmp)
    os.replace(tmp, path)
    fsync_path(Path(path).parent)


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A new empty temporary file beside ``path``, for a writer that takes a file name: on a normal exit it is
    fsynced and renamed over ``path`` (:func:`replace_file`), on an exception removed (``path`` left as it was)."""
    path = Path(path)
    tmp = _new_temp_file(path)
    try:
        yield tmp
        replace_file(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "w", **open_kwargs) -> Iterator[IO]:
    """``open(path, mode)`` for writing (``"w"``, ``"wb"``), committed atomically: the file object writes to a
    temporary file beside ``path``, which a normal exit closes, fsyncs and renames over ``path``, and an exception
    removes."""
    if not mode.startswith("w"):
        raise ValueError(f"atomic_file writes a new file; expected a mode 'w' or 'wb', got '{mode}'")
    with atomic_path(path) as tmp, open(tmp, mode, **open_kwargs) as f:
        yield f


def write_text_atomic(path: str | os.PathLike, text: str, encoding: str | None = None) -> None:
    """Write ``text`` to ``path`` atomically (:func:`atomic_file`)."""
    with atomic_file(path, "w", encoding=encoding) as f:
        f.write(text)


def write_json_atomic(path: str | os.PathLike, obj, indent: int = 2) -> None:
    """Write ``obj`` as indented JSON (and a final newline) to ``path`` atomically: a reader never sees half a file."""
    write_text_atomic(path, json.dumps(obj, indent=indent) + "\n")


def write_json_compact(path: str | os.PathLike, obj, indent: int = 1) -> None:
    """Write ``obj`` as JSON to ``path`` atomically, as :func:`write_json_atomic` does, except that a list holding
    no list or dict stays on one line, and so does each row of a list of flat objects (an object holding no object
    and no list of them): objects are indented, a per-token list of a thousand booleans is one line, not a
    thousand, and a per-prompt record is one line. ``json.load`` reads back the same object."""

    def scalars(value) -> bool:
        return not isinstance(value, (dict, list)) or isinstance(value, list) and all(map(scalars, value))

    def encode(value, level: int) -> str:
        if isinstance(value, dict) and value:
            parts = [f"{json.dumps(key)}: {encode(item, level + 1)}" for key, item in value.items()]
        elif isinstance(value, list) and any(isinstance(item, (dict, list)) for item in value):
            parts = [
                json.dumps(item)
                if isinstance(item, dict) and all(map(scalars, item.values()))
                else encode(item, level + 1)
                for item in value
            ]
        else:
            return json.dumps(value)
        inner, outer = "\n" + " " * (indent * (level + 1)), "\n" + " " * (indent * level)
        brackets = "{}" if isinstance(value, dict) else "[]"
        return brackets[0] + inner + ("," + inner).join(parts) + outer + brackets[1]

    # Through json first: keys become strings and tuples lists exactly as json.dumps makes them.
    write_text_atomic(path, encode(json.loads(json.dumps(obj)), 0) + "\n")


# ------------------------------------------------------------------------------------------ directories


def temp_dir_beside(path: str | os.PathLike) -> Path:
    """A new, uniquely named directory beside ``path`` (``.<name>.XXXXXXXX.tmp`` in its parent: on the same file
    system, so putting it in place is a rename)."""
    path = Path(path)
    return Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))


def rename_dir(tmp: str | os.PathLike, final: str | os.PathLike) -> None:
    """Put the complete directory ``tmp`` in place as a new ``final``: fsynced, renamed, the parent fsynced.

    The rename fails (OSError) if ``final`` is a file or a directory that is not empty, so nothing is replaced;
    an empty directory there is replaced, as ``rename`` does.
    """
    fsync_tree(tmp)
    os.rename(tmp, final)
    fsync_path(Path(final).parent)


def replace_dir(
    tmp: str | os.PathLike,
    final: str | os.PathLike,
    aside: str | os.PathLike | None = None,
    discard: Callable[[Path], object] = shutil.rmtree,
) -> None:
    """Put the complete directory ``tmp`` in place as ``final``, replacing the one there: fsynced, renamed, the old
    ``final`` removed last.

    A directory cannot be renamed over a non-empty one, so an existing ``final`` is first renamed to ``aside``
    (default ``<tmp>.old``, beside it) and handed to ``discard`` only once the new one is in place and its parent
    directory synced. Killed at any point, a complete directory is at ``final`` (the old or the new one) or, between
    the two renames, the old one is at ``aside``; a rename that fails puts the old one back.
    """
    tmp, final = Path(tmp), Path(final)
    aside = Path(aside) if aside is not None else tmp.with_name(tmp.name + ".old")
    fsync_tree(tmp)
    moved = final.exists()
    if moved:
        os.rename(final, aside)
    try:
        os.rename(tmp, final)
    except BaseException:
        if moved:
            os.rename(aside, final)
        raise
    fsync_path(final.parent)
    if moved:
        discard(aside)


def check_free_space(path: str | os.PathLike, need: int, what: str, remedy: str) -> None:
    """Refuse, in one :class:`~spd.errors.SpdInputError`, to start writing ``what`` (``need`` bytes) under ``path``
    when the disk there has less free; ``remedy`` says what to do instead."""
    from .errors import SpdInputError

    free = shutil.disk_usage(path).free
    if need > free:
        # MiB below 1 GiB: "0.00 GiB" would not say how far off it is.
        size = (lambda b: f"{b / 2**30:.2f} GiB") if need >= 2**30 else (lambda b: f"{b / 2**20:.1f} MiB")
        raise SpdInputError(
            f"{what} needs {size(need)} but only {size(free)} are free under '{path}'; free some space, or {remedy}"
        )


def complete_lines(path: str | os.PathLike) -> str:
    """The complete lines of the append-only file ``path``, whose writer appends whole lines and syncs them: a last
    line without its newline (a kill mid-write) is cut off the file, with a warning on stderr, so the line is
    written again whole by the job that resumes."""
    import sys

    path = Path(path)
    data = path.read_bytes()
    good = data[: data.rfind(b"\n") + 1]
    if len(good) != len(data):
        with open(path, "r+b") as f:
            f.truncate(len(good))
        print(
            f"warning: {path}: dropped a last line that a kill cut short ({len(data) - len(good)} bytes); "
            "its work is done again",
            file=sys.stderr,
        )
    return good.decode("utf-8", errors="replace")
