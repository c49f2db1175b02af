"""An append-only JSONL journal that lets a long run resume where a kill stopped it.

The first line holds the run's settings; every later line one finished unit of work, appended, flushed and
fsynced as it completes. Reopened with the same settings, the journal gives back what was done (a last line
a kill cut short is dropped); with other settings it is refused, naming the first setting that differs, so
results of two different runs are never mixed. The benchmark (``spd-bench decode``) journals each
(temperature, prompt, run) result and removes the journal once its report is written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .errors import SpdInputError
from .files import complete_lines


class Journal:
    """``Journal(path, settings)``: ``entries`` done so far, ``append(entry)``, ``remove()`` when finished."""

    def __init__(self, path: str | os.PathLike, settings: dict[str, Any]):
        self.path = Path(path)
        self.settings = json.loads(json.dumps(settings))  # as it reads back from disk
        self.entries: list[dict] = []
        if self.path.exists():
            self._load()
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._write_line({"settings": self.settings})

    @property
    def resumed(self) -> bool:
        return bool(self.entries)

    def append(self, entry: dict) -> None:
        self._write_line(entry)
        self.entries.append(entry)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)

    def _write_line(self, obj: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(obj) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def _load(self) -> None:
        lines = complete_lines(self.path).splitlines()  # a kill mid-write: the partial line goes
        try:
            header = json.loads(lines[0])["settings"] if lines else None
            entries = [json.loads(line) for line in lines[1:]]
        except (ValueError, KeyError, TypeError):
            raise SpdInputError(
                f"'{self.path}' is not a progress journal of this run; move it away to start again"
            ) from None
        if header is None:
            self._write_line({"settings": self.settings})
            return
        if header != self.settings:
            key = next(
                (k for k in sorted(set(header) | set(self.settings)) if header.get(k) != self.settings.get(k)), "?"
            )
            raise SpdInputError(
                f"'{self.path}' holds the progress of a run with other settings ({key}: "
                f"{_short(header.get(key))} there, {_short(self.settings.get(key))} now); run "
                "again with the same arguments to resume it, or remove the file to start afresh"
            )
        self.entries = entries


def _short(value: Any, limit: int = 60) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
