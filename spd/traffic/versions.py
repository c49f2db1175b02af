"""The versions directory: the heads ``spd-adapt`` learned from a server's traffic, for the server to load.

Layout (``<records>/heads`` unless told otherwise)::

    v1/, v2/, ...   config.json and model.safetensors (bf16), README.md (the model card), version.json (N, the
                    parent version, 0 for the starting head, the time, the held-out figures before and after, how
                    far into the records it learned)
    position.json   how far into the records the last round read (:class:`~spd.traffic.records.RecordPosition`)
    .lock           held by the one adapt process that writes here
    .work/          the round in progress (its data and the trainer's output), removed after it

A version is complete or absent: it is written under a temporary name beside its final one
(``.vN.XXXXXXXX.tmp``), fsynced and renamed into place (:func:`spd.files.rename_dir`), and never replaced; N only
grows. :func:`newest_version` is what the server asks; a ``vN`` without a readable ``version.json`` (a copy made by
hand, a damaged disk) is skipped with a warning.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import sys
from pathlib import Path
from typing import IO

from ..errors import SpdInputError
from ..files import rename_dir, temp_dir_beside, temp_pattern, write_json_atomic, write_text_atomic
from ..reading import read_json
from .records import RecordPosition

VERSION = re.compile(r"v(\d+)")
VERSION_FILE = "version.json"
POSITION_FILE = "position.json"
HEAD_FILES = ("config.json", "model.safetensors")
WORK = ".work"
_warned: set[tuple[str, str]] = set()  # (version, problem) already said: the server asks again and again


def version_dirs(versions_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Every ``vN`` directory of ``versions_dir``, complete or not, by N."""
    root = Path(versions_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := VERSION.fullmatch(p.name)) and p.is_dir()]
    return sorted(found)


def version_problem(number: int, path: Path) -> str | None:
    """Why the directory ``path`` (``vN``, N = ``number``) is not a complete version, or None when it is."""
    if not (path / VERSION_FILE).is_file():
        return f"it has no {VERSION_FILE}"
    try:
        info = read_json(path / VERSION_FILE, "version file", "the JSON object spd-adapt writes ({'version': N})")
    except SpdInputError as exc:
        return str(exc)
    if info.get("version") != number:
        return f"its {VERSION_FILE} names version {info.get('version')!r}, not {number}"
    missing = [name for name in HEAD_FILES if not (path / name).is_file()]
    return f"it has no {' or '.join(missing)}" if missing else None


def newest_version(versions_dir: str | os.PathLike) -> tuple[int, Path] | None:
    """``(N, path)`` of the newest complete version in ``versions_dir``, or None when there is none; an incomplete or
    damaged ``vN`` is skipped with a warning (once per process)."""
    for number, path in reversed(version_dirs(versions_dir)):
        problem = version_problem(number, path)
        if problem is None:
            return number, path
        if (str(path), problem) not in _warned:
            _warned.add((str(path), problem))
            print(f"warning: skipped the head version '{path}': {problem}", file=sys.stderr)
    return None


def read_version(path: str | os.PathLike) -> dict:
    """The ``version.json`` of a complete version."""
    return read_json(Path(path) / VERSION_FILE, "version file")


def publish_version(versions_dir: str | os.PathLike, number: int, head: str | os.PathLike, info: dict, card: str):
    """Publish the head ``head`` as version ``number``: its weights in bf16, ``card`` as README.md and ``info`` with
    the number as version.json, written aside and renamed into place whole; return its path. An existing ``vN`` is
    never replaced (OSError)."""
    from ..heads.publish import publish_head

    final = Path(versions_dir) / f"v{number}"
    if final.exists():
        raise FileExistsError(f"the version '{final}' exists already; versions are never replaced")
    tmp = temp_dir_beside(final)
    try:
        publish_head(head, tmp, "bfloat16")
        write_text_atomic(tmp / "README.md", card)
        write_json_atomic(tmp / VERSION_FILE, {"version": number, **info})
        rename_dir(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def next_number(versions_dir: str | os.PathLike) -> int:
    """The N of the next version: one more than every ``vN`` there, damaged ones included (N is never reused)."""
    return max((number for number, _ in version_dirs(versions_dir)), default=0) + 1


# ----------------------------------------------------------------------------------- the position in the records


def remembered_position(versions_dir: str | os.PathLike) -> RecordPosition:
    """How far into the records the last round read: ``position.json``, or the newest version's own record of it
    when that is further (a process killed between publishing a version and writing the position)."""
    root = Path(versions_dir)
    found = [RecordPosition()]
    if (root / POSITION_FILE).exists():
        try:
            found.append(_position(read_json(root / POSITION_FILE, "records position")))
        except (SpdInputError, KeyError, TypeError, ValueError) as exc:
            print(f"warning: {root / POSITION_FILE} is unreadable ({exc}); using the newest version's", file=sys.stderr)
    newest = newest_version(root)
    if newest is not None:
        try:
            found.append(_position(read_version(newest[1])["records_through"]))
        except (SpdInputError, KeyError, TypeError, ValueError):
            pass  # a version published by hand says nothing of the records
    return max(found)


def write_position(versions_dir: str | os.PathLike, position: RecordPosition) -> None:
    """Remember, durably, that the records up to ``position`` have been learned from."""
    write_json_atomic(Path(versions_dir) / POSITION_FILE, position_json(position))


def position_json(position: RecordPosition) -> dict:
    """``position`` as stored in ``position.json`` and ``version.json``."""
    return {"shard": position.shard, "offset": position.offset}


def _position(value: dict) -> RecordPosition:
    shard, offset = value["shard"], value["offset"]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (shard, offset)):
        raise ValueError(f"expected a shard and an offset of at least 0, got {value}")
    return RecordPosition(shard, offset)


# ------------------------------------------------------------------------------------------- the one writer


def open_versions(versions_dir: str | os.PathLike, flag: str = "--versions") -> IO:
    """Make ``versions_dir`` ready for one adapt process: created if needed, checked writable, locked (the open lock
    file is returned: keep it open while writing), and cleared of what a killed process left (temporary versions,
    the work directory). Each failure is one :class:`SpdInputError` naming ``flag``."""
    root = Path(versions_dir)
    if root.exists() and not root.is_dir():
        raise SpdInputError(f"{flag} '{root}' is a file; expected a directory for the head versions")
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)  # heads learned from private records
        lock = open(root / ".lock", "a")
    except OSError as exc:
        raise SpdInputError(
            f"{flag} '{root}' is not writable ({exc.strerror}); expected a directory this user can write"
        ) from None
    if not os.access(root, os.W_OK | os.X_OK):
        lock.close()
        raise SpdInputError(f"{flag} '{root}' is not writable; expected a directory this user can write")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        raise SpdInputError(
            f"{flag} '{root}' is in use by another spd-adapt; one adapt process writes a versions dir"
        ) from None
    leftovers = temp_pattern(r"v\d+")
    for path in root.iterdir():
        if leftovers.fullmatch(path.name) or path.name == WORK:
            shutil.rmtree(path, ignore_errors=True)
    return lock
