"""The runtime's wire protocol and settings: message kinds and tags, the header layout, control notices, the
bounds a header may give, :class:`RuntimeConfig` and :class:`PipelineLost`."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

# Message kinds (header[0]) and tags.
PREFILL, TOKEN, STOP, REPORT, LEVEL, PING, CLOCKS = 1, 2, 3, 4, 5, 6, 7
# The batch mode (spd.runtime.batch): entered down the data chain, one manifest per stage and phase from rank 0,
# the stages' outputs to the next stage and their reports to rank 0, left with an end from rank 0 to each stage.
BATCH_START, MANIFEST, BATCH_DATA, BATCH_END, BATCH_REPORT = 8, 9, 10, 11, 12
DATA_TAG, REPORT_TAG, CONTROL_TAG, KEPT_TAG, BATCH_TAG = 1, 2, 3, 4, 5
HEADER = 8  # kind, epoch, position, length, stage, send time (us), payload width, extra length
# Control notices (epoch, committed length, kind, kept count), then a prune's kept indices in the same message
# (up to KEPT_INLINE; more follow on KEPT_TAG). CLOSE, the last notice, ends the stage's notice thread.
FLUSH, PRUNE, CLOSE = 0, 1, 2
NOTICE, KEPT_INLINE = 4, 252
NOTICE_WAIT = datetime.timedelta(days=365)  # the notice thread waits through idle time; the data path has the timeouts
KINDS = (PREFILL, TOKEN, STOP, REPORT, LEVEL, PING, CLOCKS, BATCH_START, MANIFEST, BATCH_DATA, BATCH_END, BATCH_REPORT)
# What a stage's CLOCKS reply carries (int64 extra: times in microseconds since its last reply, then counts): where
# its time went, for the benchmarks' step breakdown (rank 0 asks between runs, never during a request).
CLOCK_TIMES = ("elapsed", "compute", "emulated_compute", "notices", "send", "receive", "receive_wait", "link_delay")
CLOCK_COUNTS = ("items", "messages_sent", "messages_received")
NOTICE_KINDS = (FLUSH, PRUNE, CLOSE)
# Bounds on header fields when the model gives none: tokens per message (a prompt, a tree level), rows per token
# (anchors of a stage plus H^L), int64 extras (a prefill's per-layer flags, a tree level's positions and mask)
# and kept indices of a prune.
DEFAULT_MAX_TOKENS, DEFAULT_MAX_WIDTH, MAX_EXTRA, MAX_KEPT = 1 << 20, 1024, 1 << 22, 1 << 20


@dataclass
class RuntimeConfig:
    """How the processes talk and what is emulated."""

    backend: str = "gloo"  # gloo (CPU) or nccl (GPU) for the data path; control is always gloo
    timeout_s: float = 60.0  # a peer silent for this long is declared lost
    emulate_stage_ms: float = 0.0  # added compute time per stage call (a token, a tree level, a ragged batch)
    emulate_token_ms: float = 0.0  # and per token of that call (a batch's time grows with its tokens)
    emulate_link_ms: float = 0.0  # added latency per message
    # When stage 1 may start a proposal: False (default) once the step that made it has been verified
    # (a flush then costs nothing extra); True as soon as it exists (saves the verification round trip
    # on every step, but stage 1 may be busy with a doomed proposal when a flush comes: a step lost).
    early_launch: bool = False
    join_timeout_s: float = 600.0  # how long a rank waits for the others to join (they load their layers first)


class PipelineLost(RuntimeError):
    """A peer died or went silent: the runtime cannot continue."""
