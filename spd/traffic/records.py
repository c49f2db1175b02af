"""Traffic records: what a server answered, kept as training data for its head.

``spd-serve --record DIR`` hands every finished request to a :class:`TrafficRecorder`, which appends it as one JSON
line to the newest shard ``DIR/traffic-NNNNNN.jsonl``. A line holds the request's prompt as the target's token ids
(a chat request's turns rendered by its chat template), the answer the target produced as token ids (every token
committed by the pipeline is the target's own, verified), the sampling settings, the head version and the
acceptance. The trainer reads ``DIR`` as data (``data=DIR``): the answer tokens are the supervised part;
``spd-adapt`` (:mod:`.adapt`) reads the records that came after a position (:func:`read_records_after`).

Durability: one ``write`` per line on a file opened for appending, so a killed server loses at most the requests
still in flight; the files and ``DIR`` are readable by their owner only. The shards are bounded: a new shard starts
at ``max_bytes / 8`` (at most 64 MiB) and the oldest shards are deleted while the whole is over ``max_bytes``.
Recording never fails a request: lines are written by a thread of their own, and a line that cannot be written
(a full disk, a removed directory) is counted and dropped.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SpdInputError

FORMAT = 1  # the "v" of every line
SHARD = re.compile(r"traffic-(\d{6})\.jsonl")
MAX_SHARD_BYTES = 64 << 20
QUEUE_LINES = 1024  # lines waiting for the writer thread; more are dropped (and counted), never waited for


def shards(directory: str | os.PathLike) -> list[Path]:
    """The record shards of ``directory``, oldest first."""
    directory = Path(directory)
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := SHARD.fullmatch(p.name))]
    return [p for _, p in sorted(found)]


def is_record_dir(path: str | os.PathLike) -> bool:
    """``path`` is a directory of traffic records (it holds at least one shard)."""
    path = Path(path)
    return path.is_dir() and bool(shards(path))


@dataclass
class RecorderCounts:
    """What the recorder did: lines written and bytes, lines dropped (could not be written, or the queue was
    full) and shards deleted for the budget."""

    written: int = 0
    written_bytes: int = 0
    failed: int = 0
    deleted_shards: int = 0
    last_error: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


class TrafficRecorder:
    """Appends finished requests to the shards of ``directory``, at most ``max_bytes`` in all (module docstring)."""

    def __init__(self, directory: str | os.PathLike, max_bytes: int, model: str = ""):
        if max_bytes < 1 << 20:
            raise SpdInputError(f"--record-max-mb must be at least 1 (got {max_bytes / 2**20:g} MiB)")
        self.directory = Path(directory).expanduser()
        self.max_bytes = max_bytes
        self.shard_bytes = min(MAX_SHARD_BYTES, max(max_bytes // 8, 64 << 10))
        self.model = model
        self.counts = RecorderCounts()
        self._open_directory()
        self._queue: queue.Queue = queue.Queue(QUEUE_LINES)
        self._thread = threading.Thread(target=self._write_lines, name="spd-record", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the directory, checked at start
    def _open_directory(self) -> None:
        d = self.directory
        if d.exists() and not d.is_dir():
            raise SpdInputError(f"--record '{d}' is a file; expected a directory for the traffic records")
        try:
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(d, 0o700)
        except OSError as exc:
            raise SpdInputError(
                f"--record '{d}' cannot be created ({exc.strerror}); expected a writable directory"
            ) from None
        if not os.access(d, os.W_OK | os.X_OK):
            raise SpdInputError(f"--record '{d}' is not writable; expected a directory this user can write to")
        free = shutil.disk_usage(d).free
        if free < min(self.shard_bytes, 16 << 20):
            raise SpdInputError(
                f"--record '{d}' has only {free / 2**20:.1f} MiB free; free some space or record elsewhere"
            )
        existing = shards(d)
        self._index = int(SHARD.fullmatch(existing[-1].name).group(1)) + 1 if existing else 1
        self._fd: int | None = None
        self._size = 0
        self._trim()  # a smaller budget than the last run's takes effect at once

    # ------------------------------------------------------------------ the request side (never raises)
    def record(
        self,
        prompt_ids: list[int],
        answer_ids: list[int],
        *,
        endpoint: str,
        sampling: dict,
        head: str | None,
        stats: dict,
        finish: str,
    ) -> None:
        """Queue one finished request; returns at once (a full queue drops the line and counts it)."""
        row = {
            "v": FORMAT,
            "time": round(time.time(), 3),
            "model": self.model,
            "endpoint": endpoint,
            "prompt_ids": list(prompt_ids),
            "answer_ids": list(answer_ids),
            "finish": finish,
            "sampling": sampling,
            "head": head,
            "mode": stats.get("mode"),
            "accept_length": stats.get("equivalent_accept_length"),
            "steps": stats.get("steps"),
        }
        try:
            self._queue.put_nowait(row)
        except queue.Full:
            self._failed("the record queue is full (the disk is slower than the server)")

    def flush(self) -> None:
        """Wait until every queued line is written (or counted as failed)."""
        self._queue.join()

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, then stop the writer thread and close the shard."""
        self._queue.put(None)
        self._thread.join(timeout)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    # ------------------------------------------------------------------ the writer thread
    def _write_lines(self) -> None:
        while (row := self._queue.get()) is not None:
            try:
                self._write(row)
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _write(self, row: dict) -> None:
        line = (json.dumps(row, separators=(",", ":")) + "\n").encode()
        try:
            if self._fd is None or self._size + len(line) > self.shard_bytes and self._size > 0:
                self._rotate()
            view = memoryview(line)
            while view:  # one write for a line in practice; a short write finishes the line
                view = view[os.write(self._fd, view) :]
            self._size += len(line)
        except OSError as exc:
            self._failed(f"{exc.strerror or exc}")
            if self._fd is not None:  # a torn line stays torn: start a fresh shard for the next one
                os.close(self._fd)
                self._fd = None
            self._trim()
            return
        with self.counts.lock:
            self.counts.written += 1
            self.counts.written_bytes += len(line)

    def _rotate(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        path = self.directory / f"traffic-{self._index:06d}.jsonl"
        self._index += 1
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._size = 0
        self._trim(extra=self.shard_bytes)  # room for the new shard to fill

    def _trim(self, extra: int = 0) -> None:
        """Delete the oldest shards while the whole (with ``extra`` bytes to come) is over the budget; the shard
        being written is kept."""
        try:
            present = shards(self.directory)
            sizes = [p.stat().st_size for p in present]
        except OSError:
            return
        total = sum(sizes) + extra
        current = self.directory / f"traffic-{self._index - 1:06d}.jsonl" if self._fd is not None else None
        for path, size in zip(present, sizes):
            if total <= self.max_bytes or path == current:
                break
            try:
                path.unlink()
            except OSError:
                continue
            total -= size
            with self.counts.lock:
                self.counts.deleted_shards += 1

    def _failed(self, why: str) -> None:
        with self.counts.lock:
            self.counts.failed += 1
            first = self.counts.last_error is None
            self.counts.last_error = why
        if first:
            print(f"warning: a traffic record could not be written ({why}); the request was served", file=sys.stderr)


# ---------------------------------------------------------------------------------------- reading records


def read_records(directory: str | os.PathLike) -> Iterator[dict]:
    """The records of ``directory``, oldest first. A shard's last line cut short by a kill is dropped with a
    warning, as is any other line that is not a record (counted in one warning per shard)."""
    directory = Path(directory)
    for path in shards(directory):
        data = path.read_bytes()
        lines = data.split(b"\n")  # the last piece: "" after a newline, else the torn line
        yield from _parse(path, lines[:-1])
        if lines[-1]:
            print(
                f"warning: {path}: dropped a last line that a kill cut short ({len(lines[-1])} bytes)", file=sys.stderr
            )


@dataclass(frozen=True, order=True)
class RecordPosition:
    """A place in a records directory: byte ``offset`` of shard number ``shard``, just after a complete line
    (``RecordPosition()``: before the first record)."""

    shard: int = 0
    offset: int = 0


def read_records_after(directory: str | os.PathLike, position: RecordPosition) -> tuple[list[dict], RecordPosition]:
    """The records of ``directory`` after ``position``, oldest first, and the position after the last line read.

    Only the newest shard grows (a restarted server starts a new one), so a last line without its newline is the
    server's next line while in the newest shard, left for the next read, and a line a kill cut short in an older
    one, dropped with a warning. A position past every record there (the records were deleted and begun again)
    reads them from their start, with a warning; shards deleted for the budget before they were read are gone."""
    directory = Path(directory)
    present = [(int(SHARD.fullmatch(p.name).group(1)), p) for p in shards(directory)]
    if not present:
        return [], position
    index, newest = present[-1]
    if position.shard > index or position.shard == index and newest.stat().st_size < position.offset:
        print(
            f"warning: {directory}: the records begin again before the position read up to ({position}); "
            "reading them from their start",
            file=sys.stderr,
        )
        position = RecordPosition()
    rows: list[dict] = []
    end = position
    for number, path in present:
        if number < position.shard:
            continue
        start = position.offset if number == position.shard else 0
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read()
        lines = data.split(b"\n")
        rows.extend(_parse(path, lines[:-1]))
        end = RecordPosition(number, start + len(data) - len(lines[-1]))
        if lines[-1] and number != index:
            print(
                f"warning: {path}: dropped a last line that a kill cut short ({len(lines[-1])} bytes)", file=sys.stderr
            )
    return rows, end


def _parse(path: Path, lines: list[bytes]) -> Iterator[dict]:
    """The records among complete ``lines`` of the shard ``path``; the others counted in one warning."""
    bad = 0
    for raw in lines:
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
            if not _is_record(row):
                raise ValueError
        except ValueError:
            bad += 1
            continue
        yield row
    if bad:
        print(f"warning: {path}: skipped {bad} line(s) that are not traffic records", file=sys.stderr)


def _is_record(row) -> bool:
    return (
        isinstance(row, dict)
        and isinstance(row.get("prompt_ids"), list)
        and isinstance(row.get("answer_ids"), list)
        and all(isinstance(t, int) for t in row["prompt_ids"])
        and all(isinstance(t, int) for t in row["answer_ids"])
    )
