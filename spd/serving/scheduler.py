"""Requests in, onto the pipeline: a bounded FIFO queue and the thread that owns the engine.

By default (``--max-batch 1``, SPD's regime: it cuts the latency of one request) requests run one after another
on the pipeline, in arrival order. With ``--max-batch B`` the engine thread hands every arriving request to the
batched pipeline (:mod:`spd.decoding.batch`), which runs up to ``B`` at once, admitting them at step boundaries
within its KV bound; each is answered when it ends. The queue holds at most ``max_queue`` waiting requests; one more is refused
(:class:`QueueFull`, a 503 with ``Retry-After``). The HTTP side (asyncio) and the engine thread talk through
each job: the engine thread pushes events (``token``, ``done``, ``error``) into the job's asyncio queue with
``call_soon_threadsafe``; the HTTP side sets ``cancelled`` when its client goes away, and the engine stops
that request at its next committed token (the engines' ``on_token`` returning True).

Stop strings are applied here, on the text: generation ends at the token that completes a stop string, the
text is cut before it, and while a suffix of the text could still be the start of a stop string it is held
back from the stream, so a streamed response never shows text the whole response would not have.

A server that watches for new head versions (:mod:`.heads`) swaps one in on the engine thread between steps: before
a request starts on the single-request path; before a job joins the batch, whose requests in flight keep the head
they started with while new ones get the new one.

If the engine thread ever dies (an error outside a request, or a lost distributed pipeline), the server
cannot serve any more: :meth:`Scheduler.failure` says why, in words that say to restart it, the waiting
requests get a 503 with that sentence, new ones are refused with it, and it is logged once (the ``spd.serve``
logger, as an error).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

from ..decoding.sampling import SamplingParams
from ..errors import SpdInputError, first_line
from .metrics import ServerMetrics
from .pipeline import Pipeline

log = logging.getLogger("spd.serve")


class EngineDown(Exception):
    """The engine thread is gone or the pipeline is lost: nothing can be served until a restart."""


class QueueFull(Exception):
    """The request queue is full; ``retry_after`` is a hint in whole seconds."""

    def __init__(self, waiting: int, retry_after: int):
        super().__init__(f"the server is busy: its queue is full ({waiting} waiting, --max-queue); retry later")
        self.retry_after = retry_after


@dataclass
class Job:
    """One request: what to generate, and the channel back to the HTTP side."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stops: list[str]
    loop: asyncio.AbstractEventLoop
    endpoint: str = "completions"
    ignore_eos: bool = False  # run to max_new_tokens or a stop string, past the EOS token
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None  # when its first and its latest token came, and how many came
    last_token_at: float | None = None
    tokens_out: int = 0

    def cancel(self) -> None:
        self.cancelled.set()

    def emit(self, *event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class StopMatcher:
    """One stop string found in a growing text, in time linear in the characters added (Knuth-Morris-Pratt).

    ``state`` is the length of the longest prefix of the stop string that ends the text fed so far: the
    characters to hold back from the stream. Feeding is amortized O(1) per character, whatever the length of
    the stop string (a scan of every prefix at every token would be quadratic in it).
    """

    def __init__(self, stop: str):
        self.stop = stop
        self.fail = [0] * len(stop)  # fail[i]: longest proper prefix of stop[:i + 1] that is also its suffix
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self.fail[k - 1]
            if stop[i] == stop[k]:
                k += 1
            self.fail[i] = k
        self.state = 0

    def feed(self, text: str, start: int) -> int:
        """Feed ``text[start:]``; return where the first match in it starts, or -1."""
        stop, fail, k = self.stop, self.fail, self.state
        for i in range(start, len(text)):
            c = text[i]
            while k and c != stop[k]:
                k = fail[k - 1]
            if c == stop[k]:
                k += 1
                if k == len(stop):
                    self.state = k
                    return i + 1 - k
        self.state = k
        return -1


class TextTracker:
    """Decoded text of the tokens so far, with stop strings applied; ``add`` returns the text safe to stream."""

    def __init__(self, tokenizer, stops: list[str], lock: threading.Lock):
        self.tokenizer, self.stops, self.lock = tokenizer, stops, lock
        self.matchers = [StopMatcher(stop) for stop in stops]
        self.longest = max(map(len, stops), default=0)
        self.ids: list[int] = []
        self.sent = 0  # characters streamed so far
        self.text = ""  # the response text as it stands (cut at a stop string once one matched)
        self.scanned = ""  # the text the matchers have seen
        self.stopped = False

    def add(self, token: int) -> str:
        """Take one token; return the new text that can be streamed (possibly empty)."""
        self.ids.append(token)
        with self.lock:
            text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        start = self._rescan_from(text)
        hits = [i for i in (m.feed(text, start) for m in self.matchers) if i >= 0]
        self.scanned = text
        if hits:
            self.text, self.stopped = text[: min(hits)], True
            return self._take(len(self.text))
        self.text = text  # what a whole response would say, even if it ends in half a character
        if text.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 character: wait for its other bytes
        held = max((m.state for m in self.matchers), default=0)
        return self._take(len(text) - held)

    def _rescan_from(self, text: str) -> int:
        """Where the matchers go on from: the end of the text they saw, or, when decoding the new token changed
        earlier characters (half a UTF-8 character completed, spaces cleaned up), the longest stop string before
        the first changed one, with the matchers reset (their state depends only on that many characters)."""
        old = self.scanned
        if text.startswith(old):
            return len(old)
        same = 0
        for back in (16, 256, 4096):  # the change is near the end: find an unchanged prefix without a full scan
            if back < len(old) and text.startswith(old[: len(old) - back]):
                same = len(old) - back
                break
        while same < min(len(old), len(text)) and old[same] == text[same]:
            same += 1
        for m in self.matchers:
            m.state = 0
        return max(0, same - self.longest + 1)

    def finish(self) -> str:
        """The rest of the text (what was held back for a stop string that never came)."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        piece = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return piece


class Scheduler:
    """The engine thread: takes jobs in order and runs them on the pipeline, pings it while idle."""

    def __init__(
        self,
        pipeline: Pipeline,
        metrics: ServerMetrics,
        max_queue: int = 64,
        idle_s: float = 5.0,
        max_batch: int = 1,
        kv_rows: int | None = None,
        batch_options: dict | None = None,
        recorder=None,
        head: str | None = None,
        heads=None,
    ):
        self.pipeline, self.metrics = pipeline, metrics
        self.recorder = recorder  # spd.traffic.records.TrafficRecorder: every answered request, or None
        self.head = head  # the head (or draft model) the requests are served with, as the records name it
        self.heads = heads  # spd.serving.heads.HeadVersions: new head versions swapped in, or None
        # --max-batch B > 1: many requests in flight at once (spd.decoding.batch); the pipeline checks it can.
        self.batch = pipeline.batched(max_batch, kv_rows, **(batch_options or {})) if max_batch > 1 else None
        self.queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self.idle_s = idle_s
        self.tokenizer_lock = threading.Lock()  # HF fast tokenizers are not safe to call from two threads at once
        self.service_s = 1.0  # moving average of a request's time on the pipeline (Retry-After hint)
        metrics.queue_length.set_function(self.queue.qsize)
        self._thread = threading.Thread(target=self._loop, name="spd-pipeline", daemon=True)
        self._stopping = False
        self._died: str | None = None  # why the engine thread ended, when it was not asked to
        self._logged = False
        self._log_lock = threading.Lock()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Finish the running request, refuse the waiting ones, close the pipeline."""
        self._stopping = True
        self._refuse_waiting("the server is shutting down")
        if self._thread.is_alive():
            self.queue.put(None)
            self._thread.join(timeout=120)

    def failure(self) -> str | None:
        """Why the server cannot serve (one sentence ending in what to do), or None while it can."""
        if self._died is None and self._thread.ident is not None and not self._thread.is_alive() and not self._stopping:
            self._died = "the engine thread exited"
        if self._died is not None:
            reason = f"the engine thread died ({self._died}); the server must be restarted"
        else:
            lost = self.pipeline.lost()
            if lost is None:
                return None
            reason = f"the pipeline is down ({lost}); the server must be restarted"
        self._log_once(reason)
        return reason

    def submit(self, job: Job) -> None:
        """Queue a job, or raise QueueFull (the queue is full) or EngineDown (nothing will ever run it)."""
        failure = self.failure()
        if failure is not None:
            raise EngineDown(failure)
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            waiting = self.queue.qsize()
            raise QueueFull(waiting, max(1, math.ceil(self.service_s * waiting))) from None
        if self._died is not None:  # it died between the check and the put: the loop's drain may have missed it
            self._refuse_waiting(self.failure())

    def _refuse_waiting(self, message: str) -> None:
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.emit("error", 503, message)

    def _log_once(self, reason: str) -> None:
        with self._log_lock:
            if self._logged:
                return
            self._logged = True
        log.error(reason)

    # ----------------------------------------------------------------------------- engine thread
    def _loop(self) -> None:
        job = None
        in_flight: dict = {}  # batched: request -> job
        try:
            if self.batch is not None:
                self._batch_loop(in_flight)
                return
            while True:
                try:
                    job = self.queue.get(timeout=self.idle_s)
                except queue.Empty:
                    self._idle()
                    continue
                if job is None:
                    break
                self._swap_head()
                self._run(job)
                job = None
        except BaseException as exc:  # noqa: BLE001 - whatever ends this thread must be seen, not hang requests
            self._died = f"{type(exc).__name__}: {first_line(exc)}"
            traceback.print_exc(file=sys.stderr)
            reason = self.failure()
            for lost in ([job] if job is not None else []) + list(in_flight.values()):
                lost.emit("error", 503, reason)
            self._refuse_waiting(reason)
        finally:
            self.pipeline.close()

    def _batch_loop(self, in_flight: dict) -> None:
        """Many requests at once: jobs join the batched pipeline as they arrive (it admits them at step boundaries,
        within its batch and KV bounds); each step runs every request in flight; each job is answered when its
        request ends. A job whose client went away is cancelled in the pipeline at the next step."""
        batch, metrics = self.batch, self.metrics
        while True:
            stopping = False
            self._swap_head()
            # Take waiting jobs while the batch has room (the others stay in the bounded queue); wait for one only
            # when nothing is in flight.
            while not batch.busy or len(batch.active) + len(batch.queue) < batch.max_batch:
                try:
                    job = self.queue.get(timeout=self.idle_s) if not batch.busy else self.queue.get_nowait()
                except queue.Empty:
                    if not batch.busy:
                        self._idle()
                        continue
                    break
                if job is None:
                    stopping = True
                    break
                self._swap_head()
                self._join(job, in_flight)
            for request, job in in_flight.items():
                if job.cancelled.is_set():
                    request.cancel()
            self._step(batch)
            metrics.batch_size.set(len(batch.active))
            metrics.running.set(len(batch.active))
            metrics.kv_tokens.set(batch.pool.rows - batch.pool.free_rows)
            if stopping:  # the requests in flight finish first
                while batch.busy:
                    self._step(batch)
                return

    def _step(self, batch) -> None:
        """One step of the batch. A step that raised has failed the requests in flight (each answered with the
        error); the server goes on with the next ones unless the pipeline is lost."""
        try:
            self.pipeline.step(batch)
        except Exception as exc:
            if self.pipeline.lost() is not None:
                raise
            log.error(f"a step failed, and with it its requests: {type(exc).__name__}: {first_line(exc)}")

    def _join(self, job: Job, in_flight: dict) -> None:
        """Hand ``job`` to the batched pipeline (bad input is answered at once)."""
        begun = self._begin(job)
        if begun is None:
            return
        tracker, on_token, started = begun
        head = self._serving()  # the batch copies the engine's proposer now: its head to the end

        def done(request) -> None:
            in_flight.pop(request, None)
            if request.state == "done":
                self._answer(job, tracker, request.output, started, head)
            elif request.state == "failed":
                self._fail(job, request.error)
            else:  # cancelled before its first token
                self.metrics.requests.labels(job.endpoint, "cancelled").inc()
                job.emit("cancelled")

        try:
            request = self.pipeline.submit(
                self.batch, job.prompt_ids, job.max_new_tokens, on_token, done, job.sampling, job.ignore_eos
            )
        except Exception as exc:  # noqa: BLE001 - the request fails alone; the server keeps serving
            self._fail(job, exc)
            return
        in_flight[request] = job

    def _swap_head(self) -> None:
        """Between steps: a new head version loaded since the last look serves new requests from now on."""
        if self.heads is not None:
            self.heads.swap(self.batch)

    def _serving(self):
        """The head new requests get: a :class:`spd.serving.heads.Head`, or None when the server does not watch."""
        return self.heads.current if self.heads is not None else None

    def _idle(self) -> None:
        self._swap_head()
        try:
            self.pipeline.idle()
        except Exception:  # noqa: BLE001 - a lost stage shows in lost(); the next request gets a 503
            pass
        self.failure()  # a stage lost while idle is logged now, not at the next request

    def _run(self, job: Job) -> None:
        begun = self._begin(job)
        if begun is None:
            return
        tracker, on_token, started = begun
        head = self._serving()
        self.metrics.running.set(1)
        self.metrics.kv_tokens.set(len(job.prompt_ids) + job.max_new_tokens)
        try:
            out = self.pipeline.generate(job.prompt_ids, job.max_new_tokens, on_token, job.sampling, job.ignore_eos)
        except Exception as exc:  # noqa: BLE001 - the request fails alone; the server keeps serving
            self._fail(job, exc)
            return
        finally:
            self.metrics.running.set(0)
            self.metrics.kv_tokens.set(0)
        self._answer(job, tracker, out, started, head)

    # ------------------------------------------------------------------------ one job's life (shared)
    def _begin(self, job: Job):
        """A job leaves the queue: None if it was cancelled or the server cannot serve (answered here), else its
        text tracker, the engine's ``on_token`` for it and its start time."""
        metrics = self.metrics
        if job.cancelled.is_set():
            metrics.requests.labels(job.endpoint, "cancelled").inc()
            return None
        failure = self.failure()
        if failure is not None:
            metrics.requests.labels(job.endpoint, "rejected").inc()
            job.emit("error", 503, failure)
            return None
        started = time.perf_counter()
        metrics.queue_time.observe(started - job.arrived)
        tracker = TextTracker(self.pipeline.tokenizer, job.stops, self.tokenizer_lock)

        def on_token(token: int, accepted: bool) -> bool:
            now = time.perf_counter()
            if job.last_token_at is None:
                metrics.first_token.observe(now - job.arrived)
                job.first_token_at = now
            else:
                metrics.between_tokens.observe(now - job.last_token_at)
            job.last_token_at = now
            job.tokens_out += 1
            job.emit("token", tracker.add(token), token, accepted)
            return tracker.stopped or job.cancelled.is_set()

        return tracker, on_token, started

    def _fail(self, job: Job, exc: BaseException) -> None:
        """The job's generation raised: 400 for bad input, else 500 (503 when the server cannot serve any more)."""
        if isinstance(exc, SpdInputError):
            self.metrics.requests.labels(job.endpoint, "invalid").inc()
            job.emit("error", 400, str(exc))
            return
        failure = self.failure()
        self.metrics.requests.labels(job.endpoint, "rejected" if failure else "failed").inc()
        job.emit("error", 503 if failure else 500, failure or f"generation failed: {first_line(exc)}")

    def _answer(self, job: Job, tracker: TextTracker, out, started: float, head=None) -> None:
        """The job's generation ended: its last events and metrics (``head``: the version that served it, if the
        server watches for versions)."""
        metrics = self.metrics
        elapsed = time.perf_counter() - started
        self.service_s = 0.8 * self.service_s + 0.2 * elapsed
        stats = out.stats.as_dict()
        metrics.record_generation(stats, head.number if head is not None else None)
        if job.tokens_out > 1:  # its own mean time between tokens, from its first token to its last
            metrics.request_between_tokens.observe((job.last_token_at - job.first_token_at) / (job.tokens_out - 1))
        if job.cancelled.is_set() and not tracker.stopped and out.stats.stop_reason == "stopped":
            metrics.requests.labels(job.endpoint, "cancelled").inc()
            job.emit("cancelled")
            return
        metrics.requests.labels(job.endpoint, "ok").inc()
        metrics.latency.observe(time.perf_counter() - job.arrived)
        finish = "stop" if tracker.stopped or stats["stop_reason"] == "eos" else "length"
        stats["queue_time_s"] = round(started - job.arrived, 4)
        if head is not None:
            stats["head_version"] = head.number
        job.emit("done", tracker.finish(), finish, stats)
        if self.recorder is not None:  # after the answer is on its way; never raises
            self.recorder.record(
                job.prompt_ids,
                out.token_ids,
                endpoint=job.endpoint,
                sampling=dataclasses.asdict(job.sampling),
                head=head.label if head is not None else self.head,
                stats=stats,
                finish=finish,
            )
