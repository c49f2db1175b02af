"""spd-adapt's settings (:class:`AdaptConfig`, one field per flag), each wrong value one sentence naming its flag, and
the trainer settings a user may pass on to the rounds."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from ..errors import SpdInputError

# The trainer's settings a user may change (``key=value``); spd-adapt sets the others (the head, the data, the
# steps, the evaluation, the output) itself.
TRAINER_SETTINGS = (
    "lr",
    "warmup_steps",
    "batch_size",
    "grad_accum",
    "max_length",
    "pad_to_multiple_of",
    "overflow",
    "weight_decay",
    "max_grad_norm",
    "tau",
    "p_full",
    "kd_chunk",
    "mixed_precision",
    "target",
    "target_revision",
    "target_dtype",
    "data_revision",
    "max_minutes",
)


def default_threads() -> int:
    """A quarter of the cores this process may use, at least 1: the server keeps the rest."""
    return max(1, len(os.sched_getaffinity(0)) // 4)


@dataclass
class AdaptConfig:
    """Every setting of ``spd-adapt`` (its flags); checked when made, each wrong value one sentence naming its flag."""

    records: str  # the server's records directory (spd-serve --record DIR)
    head: str  # the head the server starts with: a trained head directory
    versions: str | None = None  # the versions directory (default: <records>/heads)
    every: int = 20000  # new answer tokens that start a round
    steps: int = 50  # optimizer steps per round
    replay: list[str] = field(default_factory=list)  # the head's original data, mixed in so that it does not forget
    replay_share: float = 0.5  # share of a round's training rows drawn from the replay data
    heldout_share: float = 0.1  # share of a round's records held out to compare the heads on (the newest)
    margin: float = 0.01  # a candidate is kept when its L'_acc estimate beats the current head's by this (relative)
    threads: int = field(default_factory=default_threads)  # the trainer's intra-op threads
    nice: int = 10  # the trainer's niceness, added to this process's
    poll: float = 30.0  # seconds between looks at the records
    once: bool = False  # one look (and a round if there is enough traffic), then exit
    from_start: bool = False  # read the records from their start, not from the position remembered
    settings: list[str] = field(default_factory=list)  # key=value trainer settings (TRAINER_SETTINGS)
    command: str = ""  # the command line, for the model cards

    def __post_init__(self):
        for flag, value in (("--every", self.every), ("--steps", self.steps), ("--threads", self.threads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpdInputError(f"{flag} must be a whole number of at least 1, got {value}")
        if not (math.isfinite(self.replay_share) and 0 <= self.replay_share < 1):
            raise SpdInputError(f"--replay-share must be at least 0 and below 1, got {self.replay_share}")
        if not (math.isfinite(self.heldout_share) and 0 < self.heldout_share < 1):
            raise SpdInputError(f"--heldout-share must be above 0 and below 1, got {self.heldout_share}")
        if not (math.isfinite(self.margin) and self.margin > -1):
            raise SpdInputError(f"--margin must be a finite number above -1 (a relative gain), got {self.margin}")
        if not 0 <= self.nice <= 19:
            raise SpdInputError(f"--nice must be in 0..19, got {self.nice}")
        if not (math.isfinite(self.poll) and self.poll > 0):
            raise SpdInputError(f"--poll must be a positive number of seconds, got {self.poll}")
        for item in self.settings:
            key, sep, _ = item.partition("=")
            if not sep or key not in TRAINER_SETTINGS:
                raise SpdInputError(
                    f"'{item}' is not a trainer setting spd-adapt passes on; expected key=value with a key among "
                    f"{', '.join(TRAINER_SETTINGS)} (spd-adapt sets the others)"
                )
