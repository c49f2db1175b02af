"""A round's data: the new traffic records split into training and held-out rows, replay rows sampled in, written
as the files the trainer reads (``spd-adapt``, :mod:`.adapt`), and counted as the trainer will see them.

The held-out rows are the newest records (the traffic the next version will meet is more like them), never trained
on. The trainer mixes a list of data sources by concatenating their rows, unweighted, so the replay data (the head's
original data, so that it does not forget) is mixed in by sampling: ``share`` of the training rows are replay
rows, drawn without replacement while the replay data has enough, else whole passes over it and a draw for the rest.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

MIN_HELDOUT = 4  # held-out rows at the least: fewer make the before/after comparison noise
MAX_HELDOUT = 256  # and at the most: the trainer measures both heads on all of them at every fill


def heldout_rows(usable: int, share: float) -> int:
    """How many of ``usable`` records a round holds out: ``share`` of them, within MIN_HELDOUT..MAX_HELDOUT."""
    return min(MAX_HELDOUT, max(MIN_HELDOUT, math.ceil(share * usable)))


def usable(rows: list[dict]) -> list[dict]:
    """The records with an answer: a request that produced no token teaches nothing."""
    return [row for row in rows if row["answer_ids"]]


@dataclass
class Snapshot:
    """The files of one round, and what they hold as the trainer prepares them (rows, supervised tokens)."""

    train: Path  # the traffic rows trained on: prompt_ids and answer_ids
    heldout: Path  # the newest traffic rows, for the before / after comparison
    replay: list[Path] = field(default_factory=list)  # one file of sampled rows per replay source
    counts: dict[str, dict[str, int]] = field(default_factory=dict)  # traffic / heldout / replay: rows, tokens

    @property
    def data(self) -> list[str]:
        """The trainer's ``data``: the traffic rows and the replay rows."""
        return [str(self.train), *map(str, self.replay)]


def write_snapshot(
    rows: list[dict],
    work: Path,
    heldout_share: float,
    replay: list,
    replay_share: float,
    seed: int,
    tokenizer,
    data_cfg,
) -> Snapshot:
    """Write ``rows`` (records, oldest first, each with an answer) into ``work`` as training and held-out rows, with
    replay rows sampled from ``replay`` (``datasets.Dataset``s of raw rows) to be ``replay_share`` of the training
    rows, each file prepared as the trainer will (``data_cfg``, into ``work/cache``, which the trainer then reads)
    and counted.

    A raw replay row may become several training rows (long text is split at ``max_length``): when the rows sampled
    come out well over their share, fewer are drawn (a prefix of the same draw), as many as the training rows per
    raw row measured on the first draw say."""
    from ..data.prepare import prepare_dataset

    def prepare(path: Path) -> dict[str, int]:
        ds = prepare_dataset(str(path), tokenizer, data_cfg, work / "cache", report=lambda line: None)
        return {"rows": len(ds), "tokens": sum(map(sum, ds["loss_mask"]))}

    held = heldout_rows(len(rows), heldout_share)
    if len(rows) <= held:
        raise ValueError(f"{len(rows)} records cannot be split into training and {held} held-out rows")
    snap = Snapshot(work / "traffic.jsonl", work / "heldout.jsonl")
    _write_tokens(snap.train, rows[:-held])
    _write_tokens(snap.heldout, rows[-held:])
    snap.counts = {"traffic": prepare(snap.train), "heldout": prepare(snap.heldout), "replay": {"rows": 0, "tokens": 0}}
    wanted = round(snap.counts["traffic"]["rows"] * replay_share / (1 - replay_share)) if replay else 0
    rng = random.Random(seed)
    for i, (count, dataset) in enumerate(zip(split_count(wanted, [len(d) for d in replay]), replay)):
        if not count:
            continue
        path = work / f"replay-{i}.jsonl"
        indices = sample_indices(len(dataset), count, rng)
        dataset.select(indices).to_json(str(path))
        got = prepare(path)
        fewer = max(1, round(count * count / max(1, got["rows"])))
        if got["rows"] > 1.5 * count and fewer < count:
            path = work / f"replay-{i}-fewer.jsonl"
            dataset.select(indices[:fewer]).to_json(str(path))
            got = prepare(path)
        snap.replay.append(path)
        for key in got:
            snap.counts["replay"][key] += got[key]
    return snap


def split_count(total: int, sizes: list[int]) -> list[int]:
    """``total`` shared out in proportion to ``sizes`` (largest remainders first), summing to ``total``."""
    whole = sum(sizes)
    if not whole:
        return [0] * len(sizes)
    exact = [total * size / whole for size in sizes]
    counts = [math.floor(x) for x in exact]
    for i in sorted(range(len(sizes)), key=lambda i: counts[i] - exact[i])[: total - sum(counts)]:
        counts[i] += 1
    return counts


def sample_indices(size: int, count: int, rng: random.Random) -> list[int]:
    """``count`` row indices of ``size`` rows: distinct while ``count <= size``, else whole passes and a draw."""
    passes, rest = divmod(count, size)
    indices = [i for _ in range(passes) for i in rng.sample(range(size), size)]
    return indices + rng.sample(range(size), rest)


def _write_tokens(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps({"prompt_ids": row["prompt_ids"], "answer_ids": row["answer_ids"]}) + "\n")
