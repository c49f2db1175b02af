"""Requests in, one at a time, onto the pipeline: a bounded FIFO queue and the thread that owns the engine.

Batch size 1 is SPD's regime (it cuts the latency of one request), so requests run one after another on
the pipeline, in arrival order. The queue holds at most ``max_queue`` waiting requests; one more is refused
(:class:`QueueFull`, a 503 with ``Retry-After``). The HTTP side (asyncio) and the engine thread talk through
each job: the engine thread pushes events (``token``, ``done``, ``error``) into the job's asyncio queue with
``call_soon_threadsafe``; the HTTP side sets ``cancelled`` when its client goes away, and the engine stops
that request at its next committed token (the engines' ``on_token`` returning True).

Stop strings are applied here, on the text: generation ends at the token that completes a stop string, the
text is cut before it, and while a suffix of the text could still be the start of a stop string it is held
back from the stream, so a streamed response never shows text the whole response would not have.
"""

from __future__ import annotations

import asyncio
import math
import queue
import threading
import time
from dataclasses import dataclass, field

from ..errors import SpdInputError, first_line
from .metrics import ServerMetrics
from .pipeline import Pipeline


class QueueFull(Exception):
    """The request queue is full; ``retry_after`` is a hint in whole seconds."""

    def __init__(self, waiting: int, retry_after: int):
        super().__init__(f"the server is busy: {waiting} requests are waiting for the pipeline; retry later")
        self.retry_after = retry_after


@dataclass
class Job:
    """One request: what to generate, and the channel back to the HTTP side."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: dict
    stops: list[str]
    loop: asyncio.AbstractEventLoop
    endpoint: str = "completions"
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.perf_counter)

    def cancel(self) -> None:
        self.cancelled.set()

    def emit(self, *event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class TextTracker:
    """Decoded text of the tokens so far, with stop strings applied; ``add`` returns the text safe to stream."""

    def __init__(self, tokenizer, stops: list[str], lock: threading.Lock):
        self.tokenizer, self.stops, self.lock = tokenizer, stops, lock
        self.ids: list[int] = []
        self.sent = 0  # characters streamed so far
        self.text = ""  # the response text as it stands (cut at a stop string once one matched)
        self.stopped = False

    def add(self, token: int) -> str:
        """Take one token; return the new text that can be streamed (possibly empty)."""
        self.ids.append(token)
        with self.lock:
            text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        hits = [i for i in (text.find(stop) for stop in self.stops) if i >= 0]
        if hits:
            self.text, self.stopped = text[:min(hits)], True
            return self._take(len(self.text))
        self.text = text  # what a whole response would say, even if it ends in half a character
        if text.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 character: wait for its other bytes
        held = max((k for stop in self.stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)
        return self._take(len(text) - held)

    def finish(self) -> str:
        """The rest of the text (what was held back for a stop string that never came)."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        piece = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return piece


class Scheduler:
    """The engine thread: takes jobs in order and runs them on the pipeline, pings it while idle."""

    def __init__(self, pipeline: Pipeline, metrics: ServerMetrics, max_queue: int = 64, idle_s: float = 5.0):
        self.pipeline, self.metrics = pipeline, metrics
        self.queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self.idle_s = idle_s
        self.tokenizer_lock = threading.Lock()  # HF fast tokenizers are not safe to call from two threads at once
        self.service_s = 1.0  # moving average of a request's time on the pipeline (Retry-After hint)
        metrics.queue_length.set_function(self.queue.qsize)
        self._thread = threading.Thread(target=self._loop, name="spd-pipeline", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Finish the running request, refuse the waiting ones, close the pipeline."""
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.emit("error", 503, "the server is shutting down")
        self.queue.put(None)
        self._thread.join(timeout=120)

    def submit(self, job: Job) -> None:
        """Queue a job, or raise QueueFull."""
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            waiting = self.queue.qsize()
            raise QueueFull(waiting, max(1, math.ceil(self.service_s * waiting))) from None

    # ----------------------------------------------------------------------------- engine thread
    def _loop(self) -> None:
        while True:
            try:
                job = self.queue.get(timeout=self.idle_s)
            except queue.Empty:
                self._idle()
                continue
            if job is None:
                break
            self._run(job)
        self.pipeline.close()

    def _idle(self) -> None:
        try:
            self.pipeline.idle()
        except Exception:  # noqa: BLE001 - a lost stage shows in lost(); the next request gets a 503
            pass

    def _run(self, job: Job) -> None:
        metrics = self.metrics
        if job.cancelled.is_set():
            metrics.requests.labels(job.endpoint, "cancelled").inc()
            return
        lost = self.pipeline.lost()
        if lost is not None:
            metrics.requests.labels(job.endpoint, "rejected").inc()
            job.emit("error", 503, f"the pipeline is down ({lost}); restart the server")
            return
        started = time.perf_counter()
        metrics.queue_time.observe(started - job.arrived)
        tracker = TextTracker(self.pipeline.tokenizer, job.stops, self.tokenizer_lock)
        first = True

        def on_token(token: int, accepted: bool) -> bool:
            nonlocal first
            if first:
                metrics.first_token.observe(time.perf_counter() - job.arrived)
                first = False
            job.emit("token", tracker.add(token), token, accepted)
            return tracker.stopped or job.cancelled.is_set()

        metrics.running.set(1)
        try:
            out = self.pipeline.generate(job.prompt_ids, job.max_new_tokens, on_token, **job.sampling)
        except SpdInputError as exc:
            metrics.requests.labels(job.endpoint, "invalid").inc()
            job.emit("error", 400, str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - the request fails alone; the server keeps serving
            lost = self.pipeline.lost()
            status = 503 if lost else 500
            metrics.requests.labels(job.endpoint, "rejected" if lost else "failed").inc()
            job.emit("error", status, f"the pipeline is down ({lost}); restart the server" if lost
                     else f"generation failed: {first_line(exc)}")
            return
        finally:
            metrics.running.set(0)
        elapsed = time.perf_counter() - started
        self.service_s = 0.8 * self.service_s + 0.2 * elapsed
        stats = out.stats.as_dict()
        metrics.record_generation(stats)
        if job.cancelled.is_set() and not tracker.stopped and out.stats.stop_reason == "stopped":
            metrics.requests.labels(job.endpoint, "cancelled").inc()
            job.emit("cancelled")
            return
        metrics.requests.labels(job.endpoint, "ok").inc()
        metrics.latency.observe(time.perf_counter() - job.arrived)
        finish = "stop" if tracker.stopped or stats["stop_reason"] == "eos" else "length"
        stats["queue_time_s"] = round(started - job.arrived, 4)
        job.emit("done", tracker.finish(), finish, stats)
