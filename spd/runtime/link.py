"""Messages between ranks: :class:`Link` (header, optional int64 extra and hidden states in one send, bounded
headers, emulated link latency) and :class:`Notices` (a stage's control notices, received on a thread)."""

from __future__ import annotations

import collections
import datetime
import queue
import threading
import time

import torch
import torch.distributed as dist

from ..errors import first_line
from .protocol import (
    CLOSE,
    CONTROL_TAG,
    DEFAULT_MAX_TOKENS,
    DEFAULT_MAX_WIDTH,
    HEADER,
    KEPT_INLINE,
    KEPT_TAG,
    KINDS,
    MAX_EXTRA,
    MAX_KEPT,
    NOTICE,
    NOTICE_KINDS,
    NOTICE_WAIT,
    PRUNE,
    STOP,
    PipelineLost,
    RuntimeConfig,
)

SENDS_IN_FLIGHT = 64  # sends whose completion is not awaited yet (their buffers stay alive until it is)
SEND_BYTES_HELD = 256 << 20  # and at most this much of their buffers (prompts' activations), the newest apart
GLOO_INLINE = (
    1 << 20
)  # bytes of extra + payload a message carries in its one send over gloo (the slot, less the header)


class Link:
    """Point-to-point messages with epoch bookkeeping, emulated latency and sends that never block.

    A message is one flat byte tensor: the int64 header, then the int64 ``extra`` and the payload (T, W, D). The
    receiver keeps the next receive from each peer and tag posted before the message is sent, in a buffer of a
    fixed slot size both sides know (a gloo send completes only against a posted receive; posting after the
    header arrived costs a second round trip per message). Header and payload in one send also halves the number
    of operations. Extra + payload larger than the slot (a long prompt) follow in a second send whose size the
    header gives.

    Over gloo a message lands in a larger posted buffer, so the slot is large (:data:`GLOO_INLINE`: a batch's
    ragged call, its outputs and its reports fit) and a send carries only its own bytes. NCCL needs a receive
    as long as the send, so there every message is padded to a small slot (a token's report, a small tree level)
    and the rest spills.
    """

    def __init__(
        self,
        rank: int,
        config: RuntimeConfig,
        dtype: torch.dtype,
        device: torch.device,
        hidden: int,
        max_tokens: int | None = None,
        max_width: int | None = None,
    ):
        self.rank, self.config, self.dtype, self.device, self.hidden = rank, config, dtype, device, hidden
        # What a peer may announce in a header (check_header): the model's context and rows per token.
        self.max_tokens = max_tokens or DEFAULT_MAX_TOKENS
        self.max_width = max_width or DEFAULT_MAX_WIDTH
        self.max_cells = self.max_tokens * self.max_width  # tokens x rows of one payload
        self.itemsize = torch.empty(0, dtype=dtype).element_size()
        # Room inline: over NCCL for a token's report (a few anchor rows plus H^L) and a small tree level's extra,
        # over gloo for far more (the class docstring); gloo's sends carry only their own bytes, NCCL's the slot.
        self.padded = config.backend != "gloo"
        token = 6 * hidden * self.itemsize + 4096
        self.inline = token if self.padded else max(token, GLOO_INLINE)
        self.slot = HEADER * 8 + self.inline
        self._posted: dict[tuple[int, int], tuple[dist.Work, torch.Tensor]] = {}
        # Sends in flight, oldest first, with their buffers (alive until the send is waited on). The transfer needs no
        # wait; the oldest is waited on only once SENDS_IN_FLIGHT newer ones exist, when it has long been received,
        # so the loop does not block on sends. (A thread that waited on every send, as before, cost rank 0 about a
        # third of its receive and send work in GIL hand-overs: docs/benchmarks.md.)
        self._sends: collections.deque = collections.deque()
        self._held = 0  # bytes of their buffers
        self.reset_clock()

    def allow_batch(self, rows: int) -> None:
        """In the batch mode a payload packs the rows of many requests (at most the KV pool's ``rows`` tokens, each
        with its anchors): raise the bounds a header may give to that."""
        self.max_tokens = max(self.max_tokens, rows * self.max_width)
        self.max_cells = max(self.max_cells, rows * self.max_width)

    def reset_clock(self) -> None:
        """Start counting anew where this rank's time in messages goes (seconds; :meth:`clock`)."""
        self._clock = {
            "send": 0.0,
            "receive": 0.0,
            "receive_wait": 0.0,
            "link_delay": 0.0,
            "messages_sent": 0,
            "messages_received": 0,
        }

    def clock(self) -> dict:
        """Since the last reset: seconds in ``send`` (packing and posting, control notices too; sends never block),
        in ``receive`` (all of it), of which ``receive_wait`` blocked for the message and ``link_delay`` slept as
        emulated latency; and the gloo sends posted and messages received."""
        return dict(self._clock)

    def send(
        self,
        dst: int,
        tag: int,
        kind: int,
        epoch: int,
        position: int,
        payload_TWD: torch.Tensor | None = None,
        stage: int = 0,
        extra: torch.Tensor | None = None,
    ) -> None:
        """Send a header, an optional int64 ``extra`` and an optional (T, W, D) payload; never blocks."""
        tick = time.perf_counter()
        length, width = (0, 0) if payload_TWD is None else payload_TWD.shape[:2]
        header = torch.tensor(
            [
                kind,
                epoch,
                position,
                length,
                stage,
                int(time.time() * 1e6),
                width,
                0 if extra is None else extra.numel(),
            ],
            dtype=torch.long,
        )
        body = []
        if extra is not None:
            body.append(extra.to(torch.long).contiguous().view(torch.uint8).flatten().to(self.device))
        if payload_TWD is not None:
            body.append(payload_TWD.to(self.dtype).contiguous().view(torch.uint8).flatten())
        size = sum(part.numel() for part in body)
        inline = size <= self.inline
        length = self.slot if self.padded else HEADER * 8 + (size if inline else 0)
        message = torch.empty(length, dtype=torch.uint8, device=self.device)
        message[: HEADER * 8] = header.view(torch.uint8).to(self.device)
        spill = None
        if inline:
            at = HEADER * 8
            for part in body:  # each part straight into its place (no concatenation first)
                message[at : at + part.numel()] = part
                at += part.numel()
        else:
            spill = torch.cat(body)
        self._clock["send"] += time.perf_counter() - tick  # (the posting: isend)
        self.isend(message, dst, tag)
        if spill is not None:
            self.isend(spill, dst, tag)

    def isend(self, buffer: torch.Tensor, dst: int, tag: int, group=None) -> None:
        """Start a send and keep it until it is waited on; a peer already known to be gone becomes PipelineLost (gloo
        can refuse a send at once instead of failing its wait)."""
        tick = time.perf_counter()
        try:
            work = dist.isend(buffer, dst, group=group, tag=tag)
        except RuntimeError as exc:
            raise PipelineLost(f"rank {self.rank}: lost contact with rank {dst} ({_short_reason(exc)})") from None
        self._sends.append((work, buffer, dst))
        self._held += buffer.numel() * buffer.element_size()
        while len(self._sends) > SENDS_IN_FLIGHT or (self._held > SEND_BYTES_HELD and len(self._sends) > 1):
            self._finish_send()
        self._clock["send"] += time.perf_counter() - tick
        self._clock["messages_sent"] += 1

    def _irecv(self, buffer: torch.Tensor, src: int, tag: int) -> dist.Work:
        try:
            return dist.irecv(buffer, src, tag=tag)
        except RuntimeError as exc:
            raise PipelineLost(f"rank {self.rank}: lost contact with rank {src} ({_short_reason(exc)})") from None

    def _post_recv(self, src: int, tag: int, buffer: torch.Tensor | None = None) -> None:
        """Post the next receive from ``src`` on ``tag``, into ``buffer`` (the last one, reused) or a new slot."""
        if buffer is None:
            buffer = torch.empty(self.slot, dtype=torch.uint8, device=self.device)
        self._posted[(src, tag)] = (self._irecv(buffer, src, tag), buffer)

    def recv(self, src: int, tag: int) -> tuple[list[int], torch.Tensor | None, torch.Tensor | None]:
        """Receive one message: (header fields as ints, extra or None, payload (T, W, D) or None), after the emulated
        latency."""
        tick = time.perf_counter()
        if (src, tag) not in self._posted:
            self._post_recv(src, tag)
        work, message = self._posted.pop((src, tag))
        self._wait(work, src)
        header = message[: HEADER * 8].cpu().view(torch.long).tolist()  # (plain ints: one op, not one per field)
        size = self.check_header(header, src)
        n_extra, length, width = header[7], header[3], header[6]
        if size <= self.inline:
            # Copied out, so that the same slot takes the next message (a new slot per message would cost more: a
            # megabyte allocated each time over gloo).
            body = message[HEADER * 8 : HEADER * 8 + size].clone()
        else:  # the second part comes next on this (src, tag): receive it before posting the next slot
            body = torch.empty(size, dtype=torch.uint8, device=self.device)
            self._wait(self._irecv(body, src, tag), src)
        if header[0] != STOP:
            self._post_recv(src, tag, message)  # the next message from this peer can land as soon as it is sent
        extra = payload_TWD = None
        if n_extra:
            extra = body[: n_extra * 8].cpu().view(torch.long).clone()
        if length:
            payload_TWD = body[n_extra * 8 :].view(self.dtype).view(length, width, self.hidden)
        if self.config.emulate_link_ms > 0:
            delay = header[5] / 1e6 + self.config.emulate_link_ms / 1000 - time.time()
            if delay > 0:
                slept = time.perf_counter()
                time.sleep(min(delay, self.config.emulate_link_ms / 1000))  # a skewed send time never waits longer
                self._clock["link_delay"] += time.perf_counter() - slept
        self._clock["receive"] += time.perf_counter() - tick
        self._clock["messages_received"] += 1
        return header, extra, payload_TWD

    def check_header(self, header: list[int], src: int) -> int:
        """The body size a received header announces, after checking every field against what a peer can send."""
        kind, epoch, position, length, stage, _, width, n_extra = header
        bounds = (
            ("kind", kind, min(KINDS), max(KINDS)),
            ("epoch", epoch, 0, 2**62),
            ("position", position, 0, 2**62),
            ("length", length, 0, self.max_tokens),
            ("stage", stage, 0, 2**20),
            ("payload width", width, 0, self.max_width),
            ("extra length", n_extra, 0, MAX_EXTRA),
        )
        for name, value, low, high in bounds:
            if not low <= value <= high:
                raise PipelineLost(
                    f"rank {self.rank}: a message from rank {src} has a bad header ({name} {value}, "
                    f"expected {low}..{high}); the peer is corrupt or not one of ours"
                )
        if length * width > self.max_cells:
            raise PipelineLost(
                f"rank {self.rank}: a message from rank {src} has a bad header (a payload of "
                f"{length} tokens x {width} rows, more than {self.max_cells} in all)"
            )
        if (length == 0) != (width == 0):
            raise PipelineLost(
                f"rank {self.rank}: a message from rank {src} has a bad header (a payload of "
                f"{length} tokens x {width} rows)"
            )
        return n_extra * 8 + length * width * self.hidden * self.itemsize

    def _wait(self, work: dist.Work, peer: int) -> None:
        """Wait for a receive; a dead or silent peer becomes PipelineLost naming both ranks."""
        tick = time.perf_counter()
        try:
            work.wait(datetime.timedelta(seconds=self.config.timeout_s))
            self._clock["receive_wait"] += time.perf_counter() - tick
        except RuntimeError as exc:
            why = _short_reason(exc)
            if "imed out" in why or "imeout" in why:
                raise PipelineLost(
                    f"rank {self.rank}: no message from rank {peer} within {self.config.timeout_s:g} s"
                ) from None
            raise PipelineLost(f"rank {self.rank}: lost contact with rank {peer} ({why})") from None

    def _finish_send(self) -> None:
        """Wait for the oldest send (long received by now, unless its peer is gone) and release its buffer."""
        work, buffer, dst = self._sends.popleft()
        self._held -= buffer.numel() * buffer.element_size()
        try:
            work.wait(datetime.timedelta(seconds=self.config.timeout_s))
        except RuntimeError as exc:
            raise PipelineLost(f"rank {self.rank}: lost contact with rank {dst} ({_short_reason(exc)})") from None

    def drain_sends(self) -> None:
        """Wait until every send has been received (at shutdown)."""
        while self._sends:
            self._finish_send()


class Notices:
    """A stage's end of the control path: a thread receives rank 0's notices as they arrive, the stage loop takes them.

    A gloo receive reports completion only once it has been waited on (``is_completed`` stays False before), so
    the stage loop could not tell whether a notice has arrived without blocking; the thread waits instead.
    """

    def __init__(self, rank: int, group, timeout_s: float):
        self.rank, self.timeout_s = rank, timeout_s
        self._arrived: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._receive_loop, args=(group,), daemon=True)
        self._thread.start()

    def _receive_loop(self, group) -> None:
        while True:
            buffer = torch.empty(NOTICE + KEPT_INLINE, dtype=torch.long)
            try:
                dist.irecv(buffer, 0, group=group, tag=CONTROL_TAG).wait(NOTICE_WAIT)
                epoch, length, kind, count = buffer[:NOTICE].tolist()
                if kind not in NOTICE_KINDS or not 0 <= count <= MAX_KEPT or epoch < 0 or length < 0:
                    self._arrived.put(
                        PipelineLost(
                            f"rank {self.rank}: a notice from rank 0 is malformed (kind {kind}, kept count {count}, "
                            f"epoch {epoch}, length {length}); the peer is corrupt or not one of ours"
                        )
                    )
                    return
                kept = buffer[NOTICE : NOTICE + min(count, KEPT_INLINE)] if kind == PRUNE else None
                if kind == PRUNE and count > KEPT_INLINE:
                    spill = torch.empty(count - KEPT_INLINE, dtype=torch.long)
                    dist.irecv(spill, 0, group=group, tag=KEPT_TAG).wait(NOTICE_WAIT)
                    kept = torch.cat([kept, spill])
            except RuntimeError as exc:  # rank 0 is gone; the stage loop reports it if it needs a notice
                self._arrived.put(exc)
                return
            self._arrived.put((epoch, length, kind, kept))
            if kind == CLOSE:
                return

    def take(self, block: bool) -> tuple[int, int, int, torch.Tensor | None] | None:
        """The next notice ``(epoch, committed length, kind, kept)``; None when none has arrived and not ``block``."""
        try:
            item = self._arrived.get(block, self.timeout_s if block else None)
        except queue.Empty:
            if not block:
                return None
            raise PipelineLost(f"rank {self.rank}: no notice from rank 0 within {self.timeout_s:g} s") from None
        if isinstance(item, PipelineLost):
            raise item
        if isinstance(item, BaseException):
            raise PipelineLost(f"rank {self.rank}: lost contact with rank 0 ({_short_reason(item)})")
        return item

    def close(self) -> None:
        """After the CLOSE notice was taken: the thread has ended or is about to."""
        self._thread.join(timeout=self.timeout_s)


def _short_reason(exc: BaseException) -> str:
    """Gloo's message without its source location and advice, e.g. "Connection closed by peer [127.0.0.1]:7371"."""
    import re

    why = re.sub(r"\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", first_line(exc))
    return why.split(". This is typically")[0].rstrip(".")
