"""What the benchmarks share for their output: the JSON result, written atomically, and markdown tables.

A script run as ``python bench/<name>.py`` has ``bench/`` first on ``sys.path``, where ``bench`` is the module
``bench/bench.py``; to import this one as ``bench.report`` it puts the repository's root before it::

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.report import write_result  # noqa: E402
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from spd.files import write_json_compact


def command_line(script: str, argv: Sequence[str] | None) -> str:
    """How a benchmark was run, for its JSON: ``python bench/<name>.py`` (``script`` is its ``__file__``) and its
    arguments (``argv``, or the process's own when it was started as a program)."""
    return "python " + " ".join([os.path.relpath(script, Path(__file__).resolve().parents[1]), *(argv or sys.argv[1:])])


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
