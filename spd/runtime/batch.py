"""Many requests at once over the distributed runtime: the ragged batches of :mod:`spd.decoding.batch` carried stage
to stage (docs/method.md §9). Rank 0's side: :class:`RemoteBatch`; the stages' side: :mod:`spd.runtime.batch_stage`;
the wire format of a manifest: :func:`encode_manifest` / :func:`decode_manifest`.

**Phases.** The batched pipeline runs each step as one ragged call per stage (a request's levels that move after
its verification run in the same call, before it: :mod:`spd.decoding.batch`). Each such call is a *phase*. For
every phase rank 0 sends each stage a *manifest* (``BATCH_TAG``):

- the cache operations decided since the last phase, each naming a request by its region's first row: open the
  region, close it, truncate it (a miss), keep a pruned tree's rows (a hit); the stage applies them in order,
  before it runs anything;
- the stage's segments, one per request with work there: where the input is (stage 1: hidden states carried in the
  manifest; a later stage: an *item* the previous stage sent, and the rows of it that survived prunes), the
  position ids and ancestor mask of tree nodes, the anchors to report and the key its output goes on under.

Each stage runs its segments as one ragged call (:func:`spd.target.ragged.run_ragged`) over its own share of the
KV pool, sends their outputs to the next stage in one message (``DATA_TAG``, every phase, an empty one too) and
reports to rank 0: the anchors, and from the last stage ``H^L``. Rank 0 runs the requests' proposers while the
stages compute (the step loop hands over its stage work before its proposer's step and collects it after), then
reads every report of the phase before it verifies or starts the next one, so the stages of a phase run
concurrently (the pipeline), and a stage's input for phase ``p`` is always in the previous stage's messages of
phases before ``p``.

**No stale work.** The single-request runtime lets the stages run ahead of rank 0, so a flush reaches them late
and each request needs epochs to tell stale work apart. Here rank 0 names every piece of work a stage runs, after
the verification that might have flushed or pruned it: a request's rejection becomes an operation on its own
region and its dead items are simply never named again. Items live one step (each manifest says from which phase
on the stage keeps them).

**Rank 0's view.** The requests' caches on rank 0 are a *ledger* (:class:`spd.target.kv_pool.KVPool` with
``ledger=True``: the same regions and lengths, no keys or values), so the step loop's bookkeeping (length checks,
flush, prune) runs there unchanged; :class:`LedgerStages` also queues each flush and prune for the stages. A level
between two remote stages carries, in place of its hidden states, a *handle*: an int64 ``(1, T, 2)`` tensor of
``(item key, row)`` per node, which the loop's prune narrows exactly as it would narrow hidden rows.

The batch mode is entered with ``BATCH_START`` down the data chain (the pool's size in rows) when the first phase of
a busy period runs, and left with ``BATCH_END`` once the pipeline is idle, so pings, clock requests and shutdown
find the stages in their ordinary loop.
"""

from __future__ import annotations

import itertools

import torch

from ..decoding.backend import LocalStages
from ..target.kv_cache import StageKVCache
from ..target.kv_pool import KVPool, Region
from ..target.segments import Segment
from ..target.staging import StageOutput
from .protocol import BATCH_REPORT, BATCH_TAG, DATA_TAG, MANIFEST, REPORT_TAG, PipelineLost

OPEN, CLOSE, TRUNCATE, PRUNE = 1, 2, 3, 4  # cache operations of a manifest
FROM_MANIFEST = -1  # a segment's input travels in the manifest (stage 1)


def handles_of(keys: list[int], sizes: list[int], device: torch.device) -> torch.Tensor:
    """The stand-ins on rank 0 of items' hidden states, side by side: ``(key, row)`` for each of the ``sizes[i]``
    rows of item ``keys[i]``, ``(1, sum(sizes), 2)`` int64 (split it to get each item's handle)."""
    pairs = [[key, row] for key, size in zip(keys, sizes) for row in range(size)]
    return torch.tensor([pairs], dtype=torch.long, device=device)


def encode_manifest(
    phase: int, keep_from: int, ops: list[list[int]], segments: list[Segment], keys_out: list[int]
) -> torch.Tensor:
    """A manifest as int64: ``phase, keep_from, #ops, #segments``, the operations (kind, region start, arguments),
    then per segment: region start, input key (``FROM_MANIFEST``: the manifest's payload), size T, the number of
    input rows named (0: all) and those rows, a positions flag and T positions, the mask's width N and its T * N
    entries, the anchors (count, then indices), the output key."""
    words = [phase, keep_from, len(ops), len(segments)]
    for op in ops:
        words += op
    for seg, key_out in zip(segments, keys_out):
        hidden = seg.hidden_1TD
        if hidden.dtype == torch.long:  # a handle: an item of the previous stage, the rows that survive
            pairs = hidden[0].tolist()
            key_in, rows = pairs[0][0], [row for _, row in pairs]
        else:
            key_in, rows = FROM_MANIFEST, []
        words += [seg.cache.base, key_in, seg.size, len(rows), *rows]
        if seg.positions_T is None:
            words.append(0)
        else:
            words += [1, *seg.positions_T.tolist()]
        if seg.tree_mask_TN is None:
            words.append(0)
        else:
            words += [seg.tree_mask_TN.shape[1], *seg.tree_mask_TN.flatten().long().tolist()]
        words += [len(seg.anchors), *seg.anchors, key_out]
    return torch.tensor(words, dtype=torch.long)


class ManifestSegment:
    """A decoded segment (see :func:`encode_manifest`)."""

    __slots__ = ("base", "key_in", "size", "rows", "positions_T", "tree_mask_TN", "anchors", "key_out")


class _Reader:
    """Reads a manifest's words in order; anything out of bounds is a corrupt peer."""

    def __init__(self, words: list[int], rank: int):
        self.words, self.at, self.rank = words, 0, rank

    def take(self, count: int = 1, low: int = 0, high: int = 2**62) -> list[int]:
        if count < 0 or self.at + count > len(self.words):
            raise PipelineLost(
                f"rank {self.rank}: a batch manifest from rank 0 is truncated (word {self.at} of "
                f"{len(self.words)}, {count} more wanted); the peer is corrupt or not one of ours"
            )
        values = self.words[self.at : self.at + count]
        self.at += count
        if any(not low <= v <= high for v in values):
            raise PipelineLost(
                f"rank {self.rank}: a batch manifest from rank 0 has a value outside {low}..{high}; "
                "the peer is corrupt or not one of ours"
            )
        return values

    def one(self, low: int = 0, high: int = 2**62) -> int:
        return self.take(1, low, high)[0]


def decode_manifest(extra: torch.Tensor | None, rank: int, rows: int, max_tokens: int, layers: int):
    """``(phase, keep_from, ops, segments)`` of a manifest, every value checked against what rank 0 can send: region
    rows within the pool's ``rows``, segment sizes within ``max_tokens``, anchors within ``layers``."""
    reader = _Reader(extra.tolist() if extra is not None else [], rank)
    phase, keep_from, n_ops, n_segments = reader.take(4)
    ops = []
    for _ in range(n_ops):
        kind, base = reader.one(OPEN, PRUNE), reader.one(0, rows - 1)
        if kind == OPEN:
            ops.append((kind, base, reader.one(1, rows - base), None))
        elif kind == CLOSE:
            ops.append((kind, base, 0, None))
        elif kind == TRUNCATE:
            ops.append((kind, base, reader.one(0, rows), None))
        else:
            committed, count = reader.one(0, rows), reader.one(0, rows)
            ops.append((kind, base, committed, torch.tensor(reader.take(count, 0, rows), dtype=torch.long)))
    segments = []
    for _ in range(n_segments):
        seg = ManifestSegment()
        seg.base, seg.key_in, seg.size = reader.one(0, rows - 1), reader.one(FROM_MANIFEST), reader.one(1, max_tokens)
        seg.rows = reader.take(reader.one(0, max_tokens), 0, max_tokens - 1)
        seg.positions_T = torch.tensor(reader.take(seg.size), dtype=torch.long) if reader.one(0, 1) else None
        width = reader.one(0, rows)
        seg.tree_mask_TN = (
            torch.tensor(reader.take(seg.size * width, 0, 1), dtype=torch.bool).view(seg.size, width) if width else None
        )
        seg.anchors = reader.take(reader.one(0, layers), 0, layers)
        seg.key_out = reader.one(1)
        segments.append(seg)
    if reader.at != len(reader.words):
        raise PipelineLost(
            f"rank {rank}: a batch manifest from rank 0 has {len(reader.words) - reader.at} words "
            "past its end; the peer is corrupt or not one of ours"
        )
    return phase, keep_from, ops, segments


class LedgerStages(LocalStages):
    """A request's stage back-end on rank 0 of a batched runtime: its caches are ledger views of the pool (lengths
    only); each flush and prune is applied there and queued for the stages as an operation on the region."""

    def __init__(self, staged, batch: RemoteBatch):
        super().__init__(staged)
        self.batch = batch

    def prune(self, committed: int, kept: torch.Tensor) -> None:
        super().prune(committed, kept)
        if not self.paths:
            kept = torch.as_tensor(kept, dtype=torch.long)
            self.batch.ops.append([PRUNE, self.caches[0].base, committed, kept.numel(), *kept.tolist()])

    def flush(self, length: int) -> None:
        super().flush(length)
        self.batch.ops.append([TRUNCATE, self.caches[0].base, length])


class RemoteBatch:
    """Rank 0's back-end of a :class:`spd.decoding.batch.BatchedPipeline` whose stages are remote (see the module
    docstring): the pool's ledger, the operations queued for the stages, and one phase at a time."""

    def __init__(self, remote, rows: int):
        self.remote, self.staged, self.link = remote, remote.staged, remote.link
        self.n = self.staged.n_stages
        self.pool = KVPool(self.staged, rows, ledger=True)
        self.ops: list[list[int]] = []
        self.phase = 0
        self.step_first = [1, 1]  # the first phase of the previous step and of the current one
        self._keys = itertools.count(1)

    def request_stages(self) -> LedgerStages:
        return LedgerStages(self.staged, self)

    def open(self, region: Region) -> list[StageKVCache]:
        self.ops.append([OPEN, region.start, region.rows])
        return self.pool.caches(region)

    def release(self, region: Region) -> None:
        self.pool.release(region)
        self.ops.append([CLOSE, region.start])

    def new_step(self) -> None:
        """A pipeline step begins: items of the step before the previous one are dead."""
        self.step_first = [self.step_first[1], self.phase + 1]

    def idle(self) -> None:
        """No request is queued or in flight: the stages leave the batch mode (and forget its caches, so the
        operations still queued, closing regions, need not be sent)."""
        self.ops = []
        self.remote.leave_batch()

    def start(self, calls: list[list[Segment]]):
        """Start a phase: every stage's segments (``calls[s]``) go to its rank in a manifest, with the operations
        queued since the last phase."""
        self.remote.enter_batch(self)
        self.phase += 1
        keys = [[next(self._keys) for _ in segments] for segments in calls]
        for s, segments in enumerate(calls):
            extra = encode_manifest(self.phase, self.step_first[0], self.ops, segments, keys[s])
            payload = None
            if s == 0 and segments:
                payload = torch.cat([seg.hidden_1TD[0] for seg in segments])[:, None]
            self.link.send(s + 1, BATCH_TAG, MANIFEST, self.phase, 0, payload, extra=extra)
            for seg in segments:
                seg.cache.advance(seg.size)  # the ledger, as the stage's cache will
        self.ops = []
        return calls, keys

    def finish(self, started) -> list[list[StageOutput]]:
        """The phase's outputs, per stage and segment, as :func:`spd.target.ragged.run_ragged` gives them (hidden
        states as handles, but ``H^L`` from the last stage)."""
        calls, keys = started
        outputs = []
        for s, segments in enumerate(calls):
            last = s == self.n - 1
            while True:  # (reports of a single request's work still in the pipe when it ended are passed over)
                header, _, payload = self.link.recv(s + 1, DATA_TAG if last else REPORT_TAG)
                if int(header[0]) == BATCH_REPORT:
                    break
            expected = sum(seg.size * (len(seg.anchors) + last) for seg in segments)
            got = 0 if payload is None else payload.shape[0]
            if int(header[1]) != self.phase or got != expected:
                raise PipelineLost(
                    f"rank 0: stage {s} reported {got} rows for phase {int(header[1])}, expected "
                    f"{expected} rows for phase {self.phase}"
                )
            outputs.append(self._outputs(segments, keys[s], payload, last))
        return outputs

    def _outputs(
        self, segments: list[Segment], keys: list[int], payload: torch.Tensor | None, last: bool
    ) -> list[StageOutput]:
        """A stage's report cut into its segments' outputs: each segment's anchors (``T`` rows each, in its order),
        then from the last stage ``H^L``; before it, each segment's output stays there under its key (a handle)."""
        if not segments:
            return []
        blocks = [seg.size for seg in segments for _ in range(len(seg.anchors) + last)]
        rows = payload[:, 0].split(blocks) if blocks else ()
        if not last:
            sizes = [seg.size for seg in segments]
            handles = handles_of(keys, sizes, self.staged.device).split(sizes, dim=1)
        outs, i = [], 0
        for j, seg in enumerate(segments):
            anchors = {a: rows[i + k][None] for k, a in enumerate(seg.anchors)}
            i += len(seg.anchors)
            if last:
                hidden = rows[i][None]
                i += 1
            else:
                hidden = handles[j]
            outs.append(StageOutput(hidden, anchors))
        return outs
