"""Rank 0's view of the stages: :class:`RemoteStages`, the step loop's stage back-end across processes (the methods of
:class:`spd.decoding.backend.LocalStages`). A chain's level (``paths``: every level one token) travels as a plain token
(TOKEN: no positions, no mask) and a chain's hit needs no notice; a tree level travels with its positions and
ancestor-mask rows (LEVEL) and a hit is a PRUNE notice."""

from __future__ import annotations

import torch

from ..target.staging import StagedModel, StageOutput
from .link import Link
from .protocol import (
    BATCH_END,
    BATCH_START,
    BATCH_TAG,
    CLOCK_COUNTS,
    CLOCK_TIMES,
    CLOCKS,
    CLOSE,
    CONTROL_TAG,
    DATA_TAG,
    FLUSH,
    KEPT_INLINE,
    KEPT_TAG,
    LEVEL,
    NOTICE,
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
from .stage import EpochLog, follow_prunes, pack_level


class RemoteStages:
    """The engine's stage backend on rank 0: stages live on ranks 1..n (see the module docstring)."""

    def __init__(self, staged: StagedModel, config: RuntimeConfig, control_group):
        self.staged = staged
        self.n = staged.n_stages
        self.config = config
        self.control_group = control_group
        self.link = Link(
            0,
            config,
            staged.dtype,
            staged.device,
            staged.config.hidden_size,
            staged.max_positions,
            staged.num_layers + 2,
        )
        self.epoch = 0
        self.stage_anchors: list[list[int]] = [[] for _ in range(self.n)]
        self.paths = False
        self.notices = 0  # control notices sent (each stage receives all of them before it stops)
        self.log = EpochLog()
        # Notices decided but not sent yet, per stage rank: stage 1's go right before its next input, the
        # others' right after it; all before rank 0 waits for anything.
        self._unsent: dict[int, list[tuple]] = {rank: [] for rank in range(1, self.n + 1)}  # (notice, spill)
        self.batch = None  # the spd.runtime.batch.RemoteBatch whose batch mode the stages are in, if any

    def configure(self, stage_anchors: list[list[int]], paths: bool = False) -> None:
        self.stage_anchors = stage_anchors
        self.paths = paths

    def prefill(self, prompt_ids_1T: torch.Tensor, anchors: list[int], capacity: int) -> StageOutput:
        """Start a request on the stages: ``anchors`` for every prompt position, H^L for the last one (1, 1, D)."""
        self.leave_batch()
        self.epoch += 1
        self.log.forget_before(self.epoch)
        b, big_l = self.staged.boundaries, self.staged.num_layers
        flags = torch.zeros(big_l + 1, dtype=torch.long)
        for ids in self.stage_anchors:
            for a in ids:
                flags[a] |= 1
        for a in anchors:
            flags[a] |= 2
        hidden_1TD = self.staged.embed(prompt_ids_1T)
        self._post_notices()
        self.link.send(1, DATA_TAG, PREFILL, self.epoch, 0, hidden_1TD[0][:, None], extra=flags)
        collected: dict[int, torch.Tensor] = {0: hidden_1TD} if 0 in anchors else {}
        last_hidden = None
        for s in range(self.n):
            mine = [a for a in anchors if b[s] < a <= b[s + 1]]
            is_last = s == self.n - 1
            if mine:
                payload = self._recv_report(s, 0)
                for i, a in enumerate(mine):
                    collected[a] = payload[:, i][None]
            if is_last:  # H^L of the last prompt position only (all rank 0 needs of it: the first token's logits)
                last_hidden = self._recv_report(s, 0)[:, 0][None]
        return StageOutput(last_hidden, collected)

    def flush(self, length: int) -> None:
        """Every stage drops its in-flight work and truncates its KV cache to ``length`` rows."""
        self._notify(FLUSH, length, None)

    def prune(self, committed: int, kept: torch.Tensor) -> None:
        """Tree hit: every stage keeps the subtree ``kept`` after the committed root (row ``committed``). A chain keeps
        every node in place: the stages need not hear of it."""
        if self.paths:
            return
        self._notify(PRUNE, committed, torch.as_tensor(kept, dtype=torch.long).cpu().contiguous())

    def _notify(self, kind: int, length: int, kept: torch.Tensor | None) -> None:
        """Start a new epoch now (what is sent from here on carries it); the notice waits in ``_unsent``."""
        if kind != CLOSE:  # CLOSE ends the control path; it starts no epoch
            self.epoch += 1
            self.log.record(self.epoch, kept)
        count = 0 if kept is None else kept.numel()
        notice = torch.zeros(NOTICE + KEPT_INLINE, dtype=torch.long)
        notice[:NOTICE] = torch.tensor([self.epoch, length, kind, count])
        if kept is not None:
            notice[NOTICE : NOTICE + min(count, KEPT_INLINE)] = kept[:KEPT_INLINE]
        spill = kept[KEPT_INLINE:].contiguous() if count > KEPT_INLINE else None
        for pending in self._unsent.values():
            pending.append((notice, spill))
        self.notices += 1

    def _post_notices(self, ranks: list[int] | None = None) -> None:
        """Send the notices not yet sent to ``ranks`` (default: every stage).

        Stage 1 needs a step's notice before its next input (it waits for the notice of a newer epoch before
        it computes), the other stages only when that input reaches them: their n - 1 sends go after it,
        so that they do not delay it. Rank 0 sends every notice before it waits for anything.
        """
        for rank in ranks or self._unsent:
            for notice, spill in self._unsent[rank]:
                self.link.isend(notice, rank, CONTROL_TAG, self.control_group)
                if spill is not None:
                    self.link.isend(spill, rank, KEPT_TAG, self.control_group)
            self._unsent[rank] = []

    # ------------------------------------------------------------------------------- tree levels
    def launch_level(self, level, tree, committed: int, early: bool = False) -> None:
        """Send a new level (depth 0) to stage 1, once: a chain's token at its position, or a tree level with its
        positions and ancestor-mask rows. ``early`` (made before this step's verification): sent now only with
        ``--early-launch``, else at the start of the next step."""
        if early and not self.config.early_launch:
            return
        if not level.sent:
            level.sent = True
            self._post_notices([1])
            if self.paths:
                self.link.send(1, DATA_TAG, TOKEN, self.epoch, committed + level.start, level.hidden_1TD[0][:, None])
            else:
                start, end = level.start, level.start + level.size
                positions_T = tree.positions(committed)[start:end]
                extra = pack_level(start, positions_T, tree.mask()[start:end, :end])
                self.link.send(1, DATA_TAG, LEVEL, self.epoch, committed, level.hidden_1TD[0][:, None], extra=extra)
        self._post_notices()

    def advance(self, levels, tree, committed: int) -> None:
        """Every level in flight ran its next stage: take the stage's report (anchors; H^L from stage n)."""
        for level in levels:
            stage = level.depth
            mine = self.stage_anchors[stage]
            is_last = stage == self.n - 1
            if mine or is_last:
                payload = (
                    self._recv_report(stage, committed + level.start)
                    if self.paths
                    else self._recv_level_report(stage, level)
                )
                for i, a in enumerate(mine):
                    level.anchors[a] = payload[:, i]
                if is_last:
                    level.hidden_1TD = payload[:, -1][None]
            level.depth += 1

    def _recv_level_report(self, stage: int, level) -> torch.Tensor:
        """The report of ``stage`` on ``level``, mapped through the prunes since it was sent: (T, W, D)."""
        header, start, payload = self._recv_current(stage)
        if int(header[1]) > self.epoch or start != level.start or payload.shape[0] != level.size:
            raise RuntimeError(
                f"rank 0: stage {stage} reported a tree level (start {start}, {payload.shape[0]} "
                f"nodes, epoch {int(header[1])}), expected start {level.start}, {level.size} nodes, "
                f"epoch {self.epoch}"
            )
        return payload

    def _recv_report(self, stage: int, position: int) -> torch.Tensor:
        """The current epoch's report of ``stage`` (0-based) for ``position``: (T, W, D)."""
        header, _, payload = self._recv_current(stage)
        if int(header[1]) != self.epoch or int(header[2]) != position:
            raise RuntimeError(
                f"rank 0: stage {stage} reported position {int(header[2])} of epoch "
                f"{int(header[1])}, expected position {position} of epoch {self.epoch}"
            )
        return payload

    def _recv_current(self, stage: int) -> tuple[torch.Tensor, int, torch.Tensor]:
        """The next report of ``stage`` (0-based) that still counts: (header, tree start or -1, payload).

        Work of a flushed or finished request, still in the pipe, is skipped; a tree level's report from
        before prunes is mapped through them (its surviving rows, its start now), or skipped if no node
        survives.
        """
        src = stage + 1
        tag = DATA_TAG if stage == self.n - 1 else REPORT_TAG
        self._post_notices()
        while True:
            header, extra, payload = self.link.recv(src, tag)
            epoch = int(header[1])
            start = int(extra[0]) if extra is not None else -1
            if epoch >= self.epoch:
                return header, start, payload
            kepts = self.log.since(epoch, self.epoch)
            if kepts is None or int(header[0]) != REPORT or extra is None:
                continue
            if extra.numel() != 3:
                raise PipelineLost(
                    f"rank 0: stage {stage} reported a tree level with {extra.numel()} extras, "
                    "expected 3 (start, size, end)"
                )
            mapped = follow_prunes(*extra.tolist(), kepts)
            if mapped is not None:
                rows, start, _ = mapped
                return header, start, payload[rows]

    # ------------------------------------------------------------------------------- batch mode
    def batch_backend(self, rows: int):
        """The back-end of a batched pipeline over these stages, with a KV pool of ``rows`` rows on each
        (:class:`spd.runtime.batch.RemoteBatch`)."""
        from .batch import RemoteBatch

        return RemoteBatch(self, rows)

    def enter_batch(self, batch) -> None:
        """The stages enter ``batch``'s batch mode (``BATCH_START`` down the data chain: its phase so far and its
        pool's rows), unless they are in it."""
        if self.batch is batch:
            return
        self.leave_batch()
        self._post_notices()
        self.link.allow_batch(batch.pool.rows)
        self.link.send(1, DATA_TAG, BATCH_START, batch.phase, batch.pool.rows)
        self.batch = batch

    def leave_batch(self) -> None:
        """The stages leave the batch mode (each is told the last phase, to take every output of it first)."""
        if self.batch is None:
            return
        for rank in range(1, self.n + 1):
            self.link.send(rank, BATCH_TAG, BATCH_END, 0, self.batch.phase)
        self.batch = None

    def ping(self) -> None:
        """Tell every stage that rank 0 is alive while no request runs (a stage waits ``timeout_s`` at most)."""
        self.leave_batch()
        self._post_notices()
        self.link.send(1, DATA_TAG, PING, self.epoch, 0)

    def clocks(self) -> dict:
        """Where each rank's time went since the last call (or the start), for a benchmark's step breakdown; call
        between requests. ``{"rank0": Link.clock(), "stages": [one dict per stage: CLOCK_TIMES in seconds,
        CLOCK_COUNTS]}``; rank 0's clock starts anew."""
        self.leave_batch()
        self._post_notices()
        self.link.send(1, DATA_TAG, CLOCKS, self.epoch, 0)
        rank0 = self.link.clock()
        stages = []
        for s in range(self.n):
            tag = DATA_TAG if s == self.n - 1 else REPORT_TAG
            while True:  # (reports of a finished request's tokens still in the pipe are passed over)
                header, extra, _ = self.link.recv(s + 1, tag)
                if int(header[0]) == CLOCKS:
                    break
            values = extra.tolist() if extra is not None else []
            if len(values) != len(CLOCK_TIMES) + len(CLOCK_COUNTS):
                raise PipelineLost(
                    f"rank 0: stage {s} answered the clock request with {len(values)} values, "
                    f"expected {len(CLOCK_TIMES) + len(CLOCK_COUNTS)}"
                )
            times = {name: v / 1e6 for name, v in zip(CLOCK_TIMES, values)}
            stages.append({**times, **dict(zip(CLOCK_COUNTS, values[len(CLOCK_TIMES) :]))})
        self.link.reset_clock()
        return {"rank0": rank0, "stages": stages}

    def shutdown(self) -> None:
        """CLOSE the control path; STOP down the chain; drain every stage's reports until its STOP arrives."""
        self.leave_batch()
        self._notify(CLOSE, 0, None)
        self._post_notices()
        self.link.send(1, DATA_TAG, STOP, self.epoch, self.notices)
        for s in range(self.n):
            tag = DATA_TAG if s == self.n - 1 else REPORT_TAG
            while int(self.link.recv(s + 1, tag)[0][0]) != STOP:
                pass
        self.link.drain_sends()
