"""The head a server serves, and how it changes while it serves: new versions watched, loaded and swapped in.

A server with a head (``--mode spd`` or ``tree`` with ``--speculator``) and a versions directory (``--record DIR``:
``DIR/heads``; ``--head-versions DIR``) watches it (:class:`HeadVersions`). A thread of its own asks
:func:`spd.traffic.versions.newest_version` every ``poll_s`` seconds and loads a newer complete version there, off the
engine thread (:func:`spd.decoding.loader.load_head`, then :meth:`spd.decoding.engine.Engine.proposer_for`); a version
made for another target or cut, or one that does not load, is refused with one log line and not tried again. The
engine thread swaps a loaded version in between steps (:meth:`HeadVersions.swap`): a request takes the head serving
when it starts and keeps it to its end, so requests in flight finish on the old head while new ones get the new one,
and nothing waits (a batch runs both heads for a while, each request on its own). A server started with versions
present starts on the newest that loads (:meth:`HeadVersions.start_on_newest`). The target verifies every token, so
the output is the target's own whichever head proposed it.

With ``--adapt`` the versions come from ``spd-adapt`` (:mod:`spd.traffic.adapt`), run as the server's child
(:class:`AdaptProcess`): niced, ending with the server (:mod:`spd.runtime.children`), its lines on the server's
stderr marked ``[spd-adapt]``.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from ..errors import first_line
from ..reading import read_json
from ..runtime.children import end_child, start_child
from ..traffic.versions import VERSION_FILE, newest_version, version_dirs, version_problem
from .metrics import ServerMetrics

log = logging.getLogger("spd.serve")

ADAPT_NICE = 10  # spd-adapt's niceness above the server's (its trainer adds its own --nice)


@dataclass(frozen=True)
class Head:
    """A head that serves or may: its version number (0: the one the server started with), how the traffic records
    name it (its path), its proposer for the engine, and the held-out figures its version.json gives, if any."""

    number: int
    label: str
    proposer: object
    figures: str | None = None


class HeadVersions:
    """The versions directory ``directory`` watched for the engine of ``pipeline`` (see the module docstring);
    ``label``: how the records name the head it started with."""

    def __init__(self, directory, pipeline, metrics: ServerMetrics, label: str, poll_s: float = 2.0):
        self.directory = Path(directory).expanduser()
        self.pipeline, self.metrics, self.poll_s = pipeline, metrics, poll_s
        self.current = Head(0, label, pipeline.engine.proposer)  # the head new requests get
        self.refused: set[int] = set()  # versions that did not load here: never tried again
        self._pending: Head | None = None  # loaded, waiting for the engine thread
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="spd-heads", daemon=True)
        metrics.watch_heads(lambda: self.current.number)

    def start_on_newest(self) -> None:
        """Before the server serves: the newest version that loads serves from the start (none: the starting head)."""
        for number, path in reversed(version_dirs(self.directory)):
            if version_problem(number, path) is None:
                head = self._load(number, path)
                if head is not None:
                    self.pipeline.engine.use_proposer(head.proposer)
                    self.current = head
                    return

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def swap(self, batch=None) -> Head | None:
        """On the engine thread, between steps: the version loaded since the last call, if any, serves the requests
        started from now on, and is returned; ``batch`` (a :class:`~spd.decoding.batch.BatchedPipeline`): its
        requests keep the head they started with."""
        with self._lock:
            head, self._pending = self._pending, None
        if head is None:
            return None
        old, self.current = self.current, head
        queued = [*batch.active, *batch.queue] if batch is not None else []
        in_flight = sum(request.source is old.proposer for request in queued)
        self.pipeline.engine.use_proposer(head.proposer)
        self.metrics.head_swaps.inc()
        figures = f" ({head.figures})" if head.figures else ""
        finish = "request in flight finishes" if in_flight == 1 else "requests in flight finish"
        rest = f"; {in_flight} {finish} on v{old.number}" if in_flight else ""
        log.info(f"head v{head.number} now serves new requests{figures}{rest}")
        return head

    # ------------------------------------------------------------------ the watching thread
    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                if self._pending is not None:  # one at a time: the engine thread has not taken the last one
                    continue
            try:
                newest = newest_version(self.directory)
            except OSError as exc:  # a directory removed or unreadable for a while: looked at again next time
                log.debug(f"cannot read the head versions in '{self.directory}': {exc}")
                continue
            if newest is None or newest[0] <= self.current.number or newest[0] in self.refused:
                continue
            head = self._load(*newest)
            if head is not None:
                with self._lock:
                    self._pending = head

    def _load(self, number: int, path: Path) -> Head | None:
        """Version ``number`` at ``path`` loaded onto the pipeline's target, or None (refused: one log line)."""
        from ..decoding.loader import load_head

        try:
            head = load_head(str(path), self.pipeline.spec, self.pipeline.staged)
            proposer = self.pipeline.engine.proposer_for(head)
        except Exception as exc:  # noqa: BLE001 - whatever a version's files do, the server keeps its head
            self.refused.add(number)
            self.metrics.head_refused.inc()
            log.warning(f"refused head v{number} ('{path}'): {first_line(exc)}; v{self.current.number} keeps serving")
            return None
        return Head(number, str(path), proposer, _figures(path))


def _figures(path: Path) -> str | None:
    """``held-out L'_acc est 1.21 -> 1.30`` from a version's version.json (spd-adapt's), or None."""
    try:
        info = read_json(path / VERSION_FILE, "version file")
        before, after = info["before"]["L_acc_est"], info["after"]["L_acc_est"]
        return f"held-out L'_acc est {before:.2f} -> {after:.2f}"
    except Exception:  # noqa: BLE001 - a version published by hand need not say
        return None


class AdaptProcess:
    """``spd-adapt`` (``cmd``) as the server's child: niced, in its own session with SIGTERM on the server's death,
    its output copied line by line to the server's stderr behind ``[spd-adapt]``."""

    def __init__(self, cmd: list[str], env: dict[str, str]):
        self.stopping = False
        self.proc = start_child(
            cmd,
            nice=ADAPT_NICE,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
        self._thread = threading.Thread(target=self._copy_lines, name="spd-adapt-log", daemon=True)
        self._thread.start()

    def _copy_lines(self) -> None:
        for line in self.proc.stdout:
            sys.stderr.write(f"[spd-adapt] {line}")
            sys.stderr.flush()
        status = self.proc.wait()
        if not self.stopping:
            log.warning(
                f"spd-adapt exited with status {status} (its lines above); the server goes on serving, "
                "but its head learns no more"
            )

    def close(self) -> None:
        """Stop it (SIGTERM: spd-adapt abandons a round in progress and stops its trainer), then wait for it."""
        self.stopping = True
        if self.proc.poll() is None:
            end_child(self.proc, grace_s=30)
        self._thread.join(timeout=5)
