"""A stage rank in the batch mode (:mod:`spd.runtime.batch`): :func:`batch_loop` applies each manifest's cache
operations, runs its segments as one ragged call over this stage's share of the KV pool, sends the outputs to the
next stage and reports to rank 0, until rank 0 ends the batch mode."""

from __future__ import annotations

import torch

from ..target.kv_pool import KVPool, Region
from ..target.segments import Segment
from ..target.staging import StagedModel
from .batch import CLOSE, FROM_MANIFEST, OPEN, PRUNE, TRUNCATE, decode_manifest
from .link import Link
from .protocol import BATCH_DATA, BATCH_END, BATCH_REPORT, BATCH_TAG, DATA_TAG, MANIFEST, PING, REPORT_TAG, PipelineLost

MAX_POOL_ROWS = 1 << 22  # the largest KV pool a batch mode may ask a stage for (rows)


def batch_loop(staged: StagedModel, stage: int, link: Link, rows: int, first_phase: int, run, pools: dict) -> None:
    """The batch mode of rank ``stage + 1``, entered after phase ``first_phase`` with a pool of ``rows`` rows (kept in
    ``pools`` for the next batch mode); ``run(pool, segments)`` is the stage's timed ragged call."""
    rank, n = stage + 1, staged.n_stages
    if not 1 <= rows <= MAX_POOL_ROWS:
        raise PipelineLost(f"rank {rank}: rank 0 asked for a KV pool of {rows} rows, expected 1..{MAX_POOL_ROWS}")
    link.allow_batch(rows)
    if rows not in pools:
        pools.clear()  # (one pool at a time: a new size replaces the old one)
        layer = staged.layers[staged.boundaries[stage]]
        weight = next(layer.parameters())
        pools[rows] = KVPool(staged, rows, stages=[stage], dtype=weight.dtype, device=weight.device)
    pool = pools[rows]
    caches = {}  # region start -> this stage's cache of that request
    inbox = _Inbox(link, stage, first_phase)
    while True:
        header, extra, payload = link.recv(0, BATCH_TAG)
        kind = int(header[0])
        if kind == PING:
            continue
        if kind == BATCH_END:
            inbox.take_until(int(header[2]))  # every output of the last phase is taken: the data path is clean again
            return
        if kind != MANIFEST:
            raise PipelineLost(f"rank {rank}: expected a batch manifest from rank 0, got a message of kind {kind}")
        phase, keep_from, ops, segments = decode_manifest(extra, rank, rows, rows, staged.num_layers)
        _apply_ops(ops, caches, pool, stage)
        inbox.take_until(phase - 1)
        inbox.items = {key: item for key, item in inbox.items.items() if item[0] >= keep_from}
        ragged = _ragged_inputs(segments, caches, inbox.items, payload, stage)
        outs = run(pool, ragged) if ragged else []
        _send_outputs(link, stage, n, phase, segments, outs)


class _Inbox:
    """The previous stage's outputs, taken phase by phase: ``items`` maps a key to (phase, hidden (T, D))."""

    def __init__(self, link: Link, stage: int, received: int):
        self.link, self.stage, self.rank = link, stage, stage + 1
        self.received = received  # the previous stage's messages are taken up to this phase
        self.items: dict[int, tuple[int, torch.Tensor]] = {}

    def take_until(self, phase: int) -> None:
        rank = self.rank
        while self.stage > 0 and self.received < phase:
            header, extra, payload = self.link.recv(rank - 1, DATA_TAG)
            words = extra.tolist() if extra is not None else []
            if (
                int(header[0]) != BATCH_DATA
                or int(header[1]) != self.received + 1
                or not words
                or len(words) != 1 + 2 * words[0]
            ):
                raise PipelineLost(
                    f"rank {rank}: expected the outputs of phase {self.received + 1} from rank "
                    f"{rank - 1}, got a message of kind {int(header[0])} for phase {int(header[1])}"
                )
            self.received += 1
            offset = 0
            for key, size in zip(words[1::2], words[2::2]):
                if payload is None or offset + size > payload.shape[0]:
                    raise PipelineLost(
                        f"rank {rank}: the outputs of phase {self.received} from rank {rank - 1} are "
                        "shorter than their item list says"
                    )
                self.items[key] = (self.received, payload[offset : offset + size, 0])
                offset += size


def _apply_ops(ops, caches: dict, pool: KVPool, stage: int) -> None:
    """A manifest's cache operations: open, close, truncate or prune a request's cache of this stage."""
    rank = stage + 1
    for op, base, value, kept in ops:
        if op == OPEN:
            caches[base] = pool.cache(stage, Region(base, value))
            continue
        cache = caches.get(base)
        if cache is None:
            raise PipelineLost(f"rank {rank}: a batch manifest names a request at row {base} that is not open")
        if op == CLOSE:
            del caches[base]
        elif op == TRUNCATE:
            cache.truncate(value)
        elif op == PRUNE:
            try:
                StagedModel.prune_tree([cache], value, kept)
            except ValueError as exc:
                raise PipelineLost(
                    f"rank {rank}: a prune from rank 0 does not fit this stage's cache ({exc})"
                ) from None


def _ragged_inputs(segments, caches: dict, items: dict, payload, stage: int) -> list[Segment]:
    """The stage's ragged call over a manifest's segments: each one's input rows (from the manifest at stage 1,
    else the previous stage's outputs) and its request's cache."""
    rank = stage + 1
    ragged, offset = [], 0
    for seg in segments:
        cache = caches.get(seg.base)
        if cache is None:
            raise PipelineLost(
                f"rank {rank}: a batch manifest gives work to a request at row {seg.base} that is not open"
            )
        if seg.key_in == FROM_MANIFEST:
            if stage != 0 or payload is None or offset + seg.size > payload.shape[0]:
                raise PipelineLost(f"rank {rank}: a batch manifest carries fewer hidden states than its segments")
            hidden_TD = payload[offset : offset + seg.size, 0]
            offset += seg.size
        else:
            if seg.key_in not in items:
                raise PipelineLost(
                    f"rank {rank}: a batch manifest names item {seg.key_in}, which rank "
                    f"{rank - 1} did not send in the last step"
                )
            hidden_TD = items[seg.key_in][1]
            if seg.rows:
                if max(seg.rows) >= hidden_TD.shape[0]:
                    raise PipelineLost(f"rank {rank}: a batch manifest names rows past item {seg.key_in}'s end")
                hidden_TD = hidden_TD[seg.rows]
        if hidden_TD.shape[0] != seg.size:
            raise PipelineLost(f"rank {rank}: a segment of {seg.size} tokens has {hidden_TD.shape[0]} input rows")
        ragged.append(Segment(cache, hidden_TD[None], seg.positions_T, seg.tree_mask_TN, seg.anchors))
    return ragged


def _send_outputs(link: Link, stage: int, n: int, phase: int, segments, outs) -> None:
    """The outputs onward to the next stage (all but the last), and the anchors (and H^L from the last) to rank 0."""
    rank = stage + 1
    if rank < n:
        listing = [len(segments)] + [
            word for seg, out in zip(segments, outs) for word in (seg.key_out, out.hidden_BTD.shape[1])
        ]
        hidden = torch.cat([out.hidden_BTD[0] for out in outs])[:, None] if outs else None
        link.send(
            rank + 1, DATA_TAG, BATCH_DATA, phase, 0, hidden, stage=rank, extra=torch.tensor(listing, dtype=torch.long)
        )
    report = []  # per segment: its anchors' rows, then H^L from the last stage
    for seg, out in zip(segments, outs):
        report += [out.anchors[a][0] for a in seg.anchors]
        if rank == n:
            report.append(out.hidden_BTD[0])
    link.send(
        0,
        DATA_TAG if rank == n else REPORT_TAG,
        BATCH_REPORT,
        phase,
        0,
        torch.cat(report)[:, None] if report else None,
        stage=rank,
    )
