"""A stage rank: :func:`stage_worker` runs its stage on every token or tree level that reaches it, applies flush
and prune notices, and reports anchors to rank 0; epochs and prunes decide which work is still valid."""

from __future__ import annotations

import time

import torch

from ..target.ragged import run_ragged
from ..target.staging import StagedModel, StageOutput
from .batch_stage import batch_loop
from .link import Link, Notices
from .protocol import (
    BATCH_START,
    CLOCK_COUNTS,
    CLOCK_TIMES,
    CLOCKS,
    CLOSE,
    DATA_TAG,
    LEVEL,
    PING,
    PREFILL,
    PRUNE,
    REPORT,
    REPORT_TAG,
    STOP,
    TOKEN,
    PipelineLost,
    RuntimeConfig,
)


def follow_prunes(start: int, size: int, end: int, kepts: list[torch.Tensor]):
    """Map a tree level through the prunes that happened since it was sent.

    The level is tree nodes ``[start, start + size)`` of a tree with ``end`` nodes up to it; ``kepts`` are the
    kept index sets of the prunes in order (:meth:`spd.decoding.tree.TokenTree.prune_to_child`). Returns None when no
    node survives, else ``(rows, new_start, cols)``: the surviving rows of the level (indices into it), the
    level's first tree index now, and the surviving tree nodes ``< end`` (old indices: the columns of the
    level's ancestor mask to keep).
    """
    # Python lists: a level has a few nodes and a tree a few dozen, where each torch op would cost more.
    rows, current = list(range(size)), list(range(start, start + size))
    cols, col_current = list(range(end)), list(range(end))
    for kept in kepts:
        new_index = {old: new for new, old in enumerate(kept.tolist())}
        rows, current = _survivors(rows, current, new_index)
        if not rows:
            return None
        cols, col_current = _survivors(cols, col_current, new_index)
    return torch.tensor(rows), current[0], torch.tensor(cols)


def _survivors(ids: list[int], nodes: list[int], new_index: dict[int, int]) -> tuple[list[int], list[int]]:
    """The ``ids`` whose tree node survives a prune, and those nodes' new indices."""
    kept = [(i, new_index[node]) for i, node in zip(ids, nodes) if node in new_index]
    return [i for i, _ in kept], [node for _, node in kept]


class EpochLog:
    """What each epoch of the current request was: a prune (its kept set) or anything else (flush, new request).

    Work of epoch ``m`` seen in epoch ``e > m`` is still valid only if every epoch in ``(m, e]`` was a prune;
    it is then mapped through those prunes (tree levels). Chain tokens are never pruned, so for them any
    newer epoch means stale.
    """

    def __init__(self):
        self.prunes: dict[int, torch.Tensor] = {}

    def record(self, epoch: int, kept: torch.Tensor | None) -> None:
        if kept is not None:
            self.prunes[epoch] = kept

    def since(self, old: int, now: int) -> list[torch.Tensor] | None:
        """The kept sets of epochs ``old + 1 .. now`` in order, or None when one of them was not a prune."""
        kepts = []
        for epoch in range(old + 1, now + 1):
            if epoch not in self.prunes:
                return None
            kepts.append(self.prunes[epoch])
        return kepts

    def forget_before(self, epoch: int) -> None:
        self.prunes = {e: k for e, k in self.prunes.items() if e >= epoch}


def stage_worker(staged: StagedModel, stage: int, config: RuntimeConfig, control_group, device: torch.device) -> None:
    """The loop of rank ``stage + 1``: run this stage on every token or tree level that reaches it, until STOP."""
    StageRank(staged, stage, config, control_group, device).serve()


class StageRank:
    """One stage's rank (see :func:`stage_worker`): its link, KV cache, epoch and the notices it has applied."""

    def __init__(self, staged: StagedModel, stage: int, config: RuntimeConfig, control_group, device: torch.device):
        self.staged, self.stage, self.config, self.device = staged, stage, config, device
        n = staged.n_stages
        self.rank = stage + 1
        self.prev, self.nxt = self.rank - 1, (self.rank + 1) % (n + 1)
        layers = list(staged.stage_layers(stage))
        self.first, self.last = staged.boundaries[stage], staged.boundaries[stage + 1]
        dtype = next(staged.layers[layers[0]].parameters()).dtype
        self.link = Link(
            self.rank, config, dtype, device, staged.config.hidden_size, staged.max_positions, staged.num_layers + 2
        )
        # A stage may have run up to n tokens past the committed prefix when a flush notice reaches it (n in flight,
        # plus a proposal launched before its step was verified): linear-attention layers keep n + 2 states.
        self.cache = staged.new_stage_cache(stage, 1, 256, ring_depth=n + 2, dtype=dtype, device=device)
        self.epoch = 0
        self.log = EpochLog()
        self.notices = 0  # control notices received
        self.token_anchors: list[int] = []
        self.control = Notices(self.rank, control_group, config.timeout_s)
        self.clock = StageClock(self.link)
        self.pools: dict = {}  # the batch mode's KV pool, kept between its busy periods

    # ------------------------------------------------------------------------------------ notices
    def take_notice(self, block: bool = True) -> bool:
        """Apply the next notice (waiting for it if ``block``); False when none has arrived."""
        notice = self.control.take(block)
        if notice is None:
            return False
        self.notices += 1
        new_epoch, length, kind, kept = notice
        if kind != CLOSE and new_epoch > self.epoch:  # notices of a finished request are ignored
            self.epoch = new_epoch
            self.log.record(new_epoch, kept)
            if kind == PRUNE:
                held = self.cache.length - length  # tree nodes this stage has run, the root first
                self.cache.keep(length + 1, kept[kept < held] - 1)
            else:
                self.cache.truncate(length)
        return True

    def catch_up(self, until_epoch: int | None) -> None:
        """Apply arrived notices; with ``until_epoch``, block until that epoch's notice is applied."""
        tick = time.perf_counter()
        while until_epoch is None or self.epoch < until_epoch:
            if not self.take_notice(block=until_epoch is not None):
                break
        self.clock.seconds["notices"] += time.perf_counter() - tick

    # -------------------------------------------------------------------------------- stage calls
    def timed(self, compute, tokens: int):
        """One stage call (``compute()``) over ``tokens`` tokens, then its emulated compute time, on the clock."""
        tick = time.perf_counter()
        out = compute()
        self.clock.seconds["compute"] += time.perf_counter() - tick
        self.clock.seconds["emulated_compute"] += _emulate(self.config, tokens)
        self.clock.items += 1
        return out

    def run(self, hidden_1TD, *args, **kwargs) -> StageOutput:
        """The stage's layers on a token, level or prompt."""
        return self.timed(lambda: self.staged.run_stage(self.stage, hidden_1TD, *args, **kwargs), hidden_1TD.shape[1])

    def run_batch(self, pool, segments) -> list[StageOutput]:
        """The batch mode's ragged call over ``segments`` (one emulated call for all of them)."""
        return self.timed(lambda: run_ragged(pool, self.stage, segments), sum(seg.size for seg in segments))

    # ------------------------------------------------------------------------------------ the loop
    def serve(self) -> None:
        """Take messages from the previous rank until STOP."""
        with torch.inference_mode():
            while True:
                header, extra, payload = self.link.recv(self.prev, DATA_TAG)
                kind, msg_epoch, position = int(header[0]), int(header[1]), int(header[2])
                if kind in (CLOCKS, PING, BATCH_START, STOP):
                    if self.between_requests(kind, msg_epoch, position):
                        break
                    continue
                self.catch_up(None)
                if kind == PREFILL:
                    self.prefill(msg_epoch, position, extra, payload)
                    continue
                if msg_epoch > self.epoch:
                    self.catch_up(msg_epoch)
                if kind == LEVEL:
                    self.level(msg_epoch, position, extra, payload)
                elif msg_epoch >= self.epoch:  # a token of a flushed epoch is dropped without computing
                    self.token(position, payload)
        self.link.drain_sends()

    def between_requests(self, kind: int, msg_epoch: int, position: int) -> bool:
        """CLOCKS, PING, BATCH_START or STOP (True: stop serving)."""
        link, nxt, rank = self.link, self.nxt, self.rank
        if kind == CLOCKS:
            # Rank 0 asks (between runs) where this stage's time went: the reply, then the request onward.
            link.send(
                0, DATA_TAG if nxt == 0 else REPORT_TAG, CLOCKS, msg_epoch, 0, stage=rank, extra=self.clock.take()
            )
            if nxt != 0:
                link.send(nxt, DATA_TAG, CLOCKS, msg_epoch, 0)
            return False
        if kind == PING:
            # A serving driver keeps idle stages alive: every wait has a timeout, requests may be far apart.
            if nxt != 0:
                link.send(nxt, DATA_TAG, PING, msg_epoch, 0)
            return False
        if kind == BATCH_START:
            # Many requests at once (spd.runtime.batch) until rank 0 ends it: position = the pool's rows.
            if nxt != 0:
                link.send(nxt, DATA_TAG, BATCH_START, msg_epoch, position)
            batch_loop(self.staged, self.stage, link, position, msg_epoch, self.run_batch, self.pools)
            return False
        while self.notices < position:  # STOP carries the number of notices sent (CLOSE last): take them all
            self.take_notice()
        self.control.close()
        link.send(nxt, DATA_TAG, STOP, msg_epoch, 0)
        if nxt != 0:
            link.send(0, REPORT_TAG, STOP, msg_epoch, 0, stage=rank)
        return True

    def prefill(self, msg_epoch: int, position: int, extra, payload) -> None:
        """A request's prompt: a new epoch, an empty cache, and the layers whose states this request reports."""
        # extra = per-layer flags for this request: bit 0 = report per token, bit 1 = report at prefill.
        self.epoch = msg_epoch
        self.log.forget_before(msg_epoch)
        self.cache.truncate(0)
        flags = extra.tolist() if extra is not None else []
        if len(flags) != self.staged.num_layers + 1:
            raise PipelineLost(
                f"rank {self.rank}: a prefill from rank {self.prev} carries {len(flags)} layer flags, "
                f"expected {self.staged.num_layers + 1}"
            )
        layers = range(self.first + 1, self.last + 1)
        self.token_anchors = [layer for layer in layers if flags[layer] & 1]
        prefill_anchors = [layer for layer in layers if flags[layer] & 2]
        out = self.run(payload[:, 0][None], self.cache, anchors=prefill_anchors)
        _forward(self.link, self.nxt, self.rank, PREFILL, msg_epoch, position, out, prefill_anchors, extra)
        self.catch_up(None)

    def level(self, msg_epoch: int, position: int, extra, payload) -> None:
        """A tree level (remapped by the prunes since it was sent; dropped when flushed or pruned away)."""
        level = _level_now(extra, payload, msg_epoch, self.epoch, position, self.log)
        if level is None:
            return  # flushed, or every node pruned: drop it without computing
        committed, start, positions_T, mask_TN, hidden_T1D = level
        if self.cache.length != committed + start:
            raise RuntimeError(
                f"stage {self.stage}: a tree level starting at node {start} after {committed} "
                f"committed rows, but the cache holds {self.cache.length}"
            )
        out = self.run(
            hidden_T1D[:, 0][None],
            self.cache,
            positions_T[None].to(self.device),
            anchors=self.token_anchors,
            tree_mask_TN=mask_TN,
        )
        # Unless prunes remapped it, the level goes on as it came.
        level_extra = extra if msg_epoch == self.epoch else pack_level(start, positions_T, mask_TN)
        _forward(
            self.link,
            self.nxt,
            self.rank,
            LEVEL,
            self.epoch,
            committed,
            out,
            self.token_anchors,
            level_extra,
            level_extra[:3],
        )
        self.catch_up(None)  # this step's prune has usually arrived: apply it while the next input is on its way

    def token(self, position: int, payload) -> None:
        """A chain's token at ``position``."""
        if self.cache.length != position:
            raise RuntimeError(
                f"stage {self.stage}: token at position {position} but the cache holds {self.cache.length}"
            )
        out = self.run(payload[:, 0][None], self.cache, anchors=self.token_anchors)
        _forward(self.link, self.nxt, self.rank, TOKEN, self.epoch, position, out, self.token_anchors, None)
        self.catch_up(None)


def pack_level(start: int, positions_T: torch.Tensor, mask_TN: torch.Tensor) -> torch.Tensor:
    """A tree level's int64 ``extra``: start, size, end (= N), the T positions, the (T, N) ancestor mask."""
    return torch.cat(
        [
            torch.tensor([start, positions_T.numel(), mask_TN.shape[1]]),
            positions_T.long().cpu(),
            mask_TN.flatten().long().cpu(),
        ]
    )


def check_level_extra(extra: torch.Tensor | None, payload_T1D: torch.Tensor | None) -> None:
    """A tree level's ``extra`` (:func:`pack_level`) must describe its payload: start, size, end and size * end
    mask entries."""
    ok = extra is not None and extra.numel() >= 3 and payload_T1D is not None
    if ok:
        start, size, end = extra[:3].tolist()
        ok = (
            size == payload_T1D.shape[0]
            and 0 <= start
            and start + size <= end
            and extra.numel() == 3 + size + size * end
        )
    if not ok:
        raise PipelineLost(
            f"a tree level message is malformed (extra {None if extra is None else extra[:3].tolist()}, "
            f"payload {None if payload_T1D is None else tuple(payload_T1D.shape)})"
        )


def _level_now(
    extra: torch.Tensor, payload_T1D: torch.Tensor, msg_epoch: int, epoch: int, committed: int, log: EpochLog
):
    """A received tree level as of the current epoch: (committed, start, positions, mask, hidden) or None."""
    check_level_extra(extra, payload_T1D)
    start, size, end = extra[:3].tolist()
    positions_T = extra[3 : 3 + size]
    mask_TN = extra[3 + size :].view(size, end).bool()
    if msg_epoch == epoch:
        return committed, start, positions_T, mask_TN, payload_T1D
    kepts = log.since(msg_epoch, epoch)
    if kepts is None:
        return None
    mapped = follow_prunes(start, size, end, kepts)
    if mapped is None:
        return None
    rows, start, cols = mapped
    # Each prune commits one more row; absolute positions do not change.
    return committed + len(kepts), start, positions_T[rows], mask_TN[rows][:, cols], payload_T1D[rows]


def _emulate(config: RuntimeConfig, tokens: int) -> float:
    """Sleep the emulated compute time of a stage call over ``tokens`` tokens; the seconds slept."""
    ms = config.emulate_stage_ms + config.emulate_token_ms * tokens
    if ms <= 0:
        return 0.0
    tick = time.perf_counter()
    time.sleep(ms / 1000)
    return time.perf_counter() - tick


class StageClock:
    """Where a stage's time goes between two CLOCKS requests: its layers, the emulated compute, notices, and its
    link's sends and receives (:meth:`spd.runtime.link.Link.clock`)."""

    def __init__(self, link: Link):
        self.link = link
        self._reset()

    def _reset(self) -> None:
        self.start = time.perf_counter()
        self.seconds = {"compute": 0.0, "emulated_compute": 0.0, "notices": 0.0}
        self.items = 0  # tokens, tree levels and prompts run
        self.link.reset_clock()

    def take(self) -> torch.Tensor:
        """The CLOCKS reply (protocol.CLOCK_TIMES in microseconds, then CLOCK_COUNTS), and a fresh start."""
        link = self.link.clock()
        times = {"elapsed": time.perf_counter() - self.start, **self.seconds, **link}
        values = [int(times[name] * 1e6) for name in CLOCK_TIMES]
        values += [self.items if name == "items" else int(link[name]) for name in CLOCK_COUNTS]
        self._reset()
        return torch.tensor(values, dtype=torch.long)


def _forward(
    link: Link,
    nxt: int,
    rank: int,
    kind: int,
    epoch: int,
    position: int,
    out: StageOutput,
    anchors: list[int],
    extra: torch.Tensor | None,
    report_extra: torch.Tensor | None = None,
) -> None:
    """Send the stage output downstream and the anchors (plus H^L from the last stage) to rank 0.

    At prefill rank 0 needs H^L of the prompt's last position only (its logits give the first token): the last
    stage sends its anchors, if it has any, and then that one row, instead of H^L of every prompt position."""
    hidden_TD = out.hidden_BTD[0]
    if nxt != 0:
        link.send(nxt, DATA_TAG, kind, epoch, position, hidden_TD[:, None], extra=extra)
    if kind == PREFILL and nxt == 0:
        if anchors:
            link.send(
                0,
                DATA_TAG,
                REPORT,
                epoch,
                position,
                torch.stack([out.anchors[a][0] for a in anchors], dim=1),
                stage=rank,
            )
        link.send(0, DATA_TAG, REPORT, epoch, position, hidden_TD[-1:, None], stage=rank)
        return
    rows = [out.anchors[a][0] for a in anchors] + ([hidden_TD] if nxt == 0 else [])
    if rows:
        link.send(
            0,
            DATA_TAG if nxt == 0 else REPORT_TAG,
            REPORT,
            epoch,
            position,
            torch.stack(rows, dim=1),
            stage=rank,
            extra=report_extra,
        )
