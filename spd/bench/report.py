"""What the benchmarks share for their output: the command line, the JSON result, written atomically, and markdown
tables."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from spd.files import write_json_compact

# The repository the benchmarks run scripts from (train/distill.py, data/capture.py) and read fixtures of.
REPO = Path(__file__).resolve().parents[2]


def command_line(name: str, argv: Sequence[str]) -> str:
    """How a benchmark was run, for its JSON: ``spd-bench NAME`` and its arguments."""
    return " ".join(["spd-bench", name, *argv])


def write_result(path: str | os.PathLike, result, indent: int = 1) -> Path:
    """Write a benchmark's ``result`` as JSON (and a final newline) to ``path``, its folder made first if missing, a
    list of numbers on one line; atomically (:func:`spd.files.write_json_compact`): a run killed while writing
    leaves the previous file whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_compact(path, result, indent=indent)
    return path


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]], rule: str = "---") -> str:
    """A markdown table: ``| a | b |``, the rule line (``|---|---|``, or ``| --- | --- |`` with ``rule=" --- "``),
    then one line per row, each cell written with ``str`` (format numbers before)."""
    lines = [_line(header), "|" + f"{rule}|" * len(header)]
    lines += [_line(row) for row in rows]
    return "\n".join(lines)


def _line(cells: Sequence[object]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"
