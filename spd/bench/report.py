"""What the benchmarks share: how a run is started and recorded (its parser, the command line and the JSON result it
writes, markdown tables) and the steps several of them take (a streamed request to spd-serve, a benchmark run in a
fresh process, a clock read after the device's work, a least-squares line)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from spd.files import write_json_compact

# The repository the benchmarks run scripts from (train/distill.py, data/capture.py) and read fixtures of.
REPO = Path(__file__).resolve().parents[2]


def argument_parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's argument parser: ``spd-bench NAME`` as its program, ``doc`` (its module's docstring) as its
    description, kept as written."""
    return argparse.ArgumentParser(
        prog=f"spd-bench {name}", description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def command_line(name: str, argv: Sequence[str] | None) -> str:
    """How a benchmark was run, for its JSON: ``spd-bench NAME`` and its arguments (``argv``, or the process's own
    when None, as argparse reads them)."""
    return " ".join(["spd-bench", name, *(sys.argv[1:] if argv is None else argv)])


def bench_command(name: str) -> list[str]:
    """The command that runs the benchmark ``name`` in a fresh interpreter (its arguments go after it)."""
    return [sys.executable, "-m", "spd.bench", name]


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


def streamed(url: str, path: str, body: dict) -> Iterator[dict]:
    """The events of a streamed request (``body`` POSTed to ``url + path`` of spd-serve or another OpenAI-compatible
    server), each ``data:`` line's JSON object as it arrives; an HTTP error or an ``error`` event is a RuntimeError
    with the server's message."""
    import httpx

    with httpx.stream("POST", f"{url}{path}", json=body, timeout=3600) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read().decode()}")
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                yield chunk


def sync(device) -> None:
    """Wait for the work queued on ``device`` (a torch device; a CPU has none queued), so that a clock read next
    counts it."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def line_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """The least-squares line through the points ``(xs[i], ys[i])``: its intercept and its slope (0 when every x is
    the same)."""
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / max(1e-9, sum((x - mean_x) ** 2 for x in xs))
    return mean_y - slope * mean_x, slope
