"""``spd-adapt``: the loop in which a head learns from what its server served (the program is :mod:`spd.cli.adapt`).

It watches a records directory (``spd-serve --record DIR``, :mod:`.records`) and, whenever the records hold
``every`` answer tokens newer than the last round's, runs a round:

1. the new records are written to the work directory (:mod:`.snapshot`): the newest ``heldout_share`` of them as
   held-out rows, the rest as training rows with replay rows (the head's original data) sampled in;
2. the current head (the newest version, else the starting head) is fine-tuned for ``steps`` steps by the trainer
   (``spd-distill``) in a child process of its own, niced and with its own thread count, which measures the current
   head (step 0) and the candidate (the last step) on the held-out rows: its estimate of L'_acc;
3. the candidate is kept only if its estimate beats the current head's by ``margin`` (relative), and then published
   in bf16 as the next version ``vN`` of the versions directory (:mod:`.versions`) with its model card; a worse one
   is dropped with one line giving both figures.

The position in the records is remembered in the versions directory after every round, kept or dropped, so a
restarted process does not learn from the same traffic twice (``from_start`` reads it all again). :meth:`Adapter.stop`
(the program's SIGTERM and SIGINT) ends the loop between rounds; a round in progress is abandoned, its trainer
stopped, and no half-written version is left.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import SpdInputError
from ..reading import read_json
from .config import AdaptConfig
from .records import RecordPosition, read_records_after, shards
from .snapshot import Snapshot, heldout_rows, usable, write_snapshot
from .versions import (
    WORK,
    newest_version,
    next_number,
    open_versions,
    position_json,
    publish_version,
    remembered_position,
    write_position,
)

if TYPE_CHECKING:
    from ..training.distill import DistillConfig


@dataclass
class Round:
    """What a round is made of: the version it may become, the head it starts from, its data and trainer settings,
    and the records it reads (from ``start`` to ``through``)."""

    number: int
    parent: int
    parent_path: str
    snap: Snapshot
    trainer: DistillConfig  # the trainer's settings for this round
    start: RecordPosition
    through: RecordPosition


class Adapter:
    """One adapt process: its inputs checked and the versions directory held (made by ``__init__``, each wrong input
    one :class:`SpdInputError`), then :meth:`run`."""

    def __init__(self, cfg: AdaptConfig, say: Callable[[str], None] | None = None):
        self.cfg = cfg
        self.say = say or _say  # the log lines
        self.stopping = False
        records = Path(cfg.records).expanduser().resolve()
        self.versions = Path(cfg.versions).expanduser().resolve() if cfg.versions else records / "heads"
        self.records = _records_dir(cfg.records, self.versions)
        self.head, self.head_cfg = _starting_head(cfg.head)
        self.trainer = self._trainer_config()
        self.tokenizer = self._tokenizer()
        self.replay = [_replay_rows(source, self.trainer.data_revision) for source in cfg.replay]
        self.lock = open_versions(self.versions)
        try:
            self._check_versions_fit()
        except SpdInputError:
            self.close()
            raise
        self.position = RecordPosition() if cfg.from_start else remembered_position(self.versions)
        self.scanned, self.pending = self.position, []

    def stop(self) -> None:
        """End the loop at the next chance: between rounds, or by abandoning the round in progress."""
        self.stopping = True

    def close(self) -> None:
        """Let another adapt process have the versions directory."""
        self.lock.close()

    # ------------------------------------------------------------------ the inputs, checked before any round
    def _check_versions_fit(self) -> None:
        """The newest version must be a head for the starting head's target and cut: one versions directory per
        server."""
        from ..heads.loading import load_speculator_config

        newest = newest_version(self.versions)
        if newest is None:
            return
        theirs = load_speculator_config(str(newest[1]))
        if _shape(theirs) != _shape(self.head_cfg):
            raise SpdInputError(
                f"--versions '{self.versions}' holds heads for another target or cut than --head '{self.cfg.head}' "
                f"(v{newest[0]}: n = {theirs.n_stages}, boundaries {theirs.boundaries}; the head: n = "
                f"{self.head_cfg.n_stages}, boundaries {self.head_cfg.boundaries}); give each server its own --versions"
            )

    def _trainer_config(self):
        """The trainer's settings for every round, checked once here (the round fills in the head and the data)."""
        from ..paths import check_model_source
        from ..training.presets import load_config

        head, k = self.head_cfg, self.cfg.steps
        if not head.target_name_or_path and not any(item.startswith("target=") for item in self.cfg.settings):
            raise SpdInputError(f"--head '{self.cfg.head}' does not name its target in its config; pass target=DIR")
        base = {
            "target": head.target_name_or_path,
            "target_revision": head.target_revision,
            "lr": 1e-4,  # the paper's rate: small steps from a trained head
            "warmup_steps": max(1, k // 10),
            "log_every": max(1, k // 10),
            "max_steps": k,
            "eval_steps": [0, k],  # 0: the current head, the baseline the candidate must beat
            "eval_every": 0,
            "save_every": 0,
            "keep_checkpoints": 1,
            "threads": self.cfg.threads,
            "init_from": self.head,
            "data": "placeholder.jsonl",
            "eval_data": "placeholder.jsonl",
        }
        if head.schedule == "serial":
            base.update(variant="eagle", draft_steps=head.draft_steps)
        else:
            variant = "spd" if head.schedule == "input" else "ppsd" if head.max_depth == 1 else "output_state"
            base.update(variant=variant, n_stages=head.n_stages, boundaries=list(head.boundaries))
        cfg = load_config(None, [f"{key}={_text(value)}" for key, value in base.items()] + self.cfg.settings)
        try:
            check_model_source(cfg.target, "target", cfg.target_revision)
        except SpdInputError as exc:
            raise SpdInputError(f"{exc} (the target --head's config names; target=DIR names another)") from None
        return cfg

    def _tokenizer(self):
        from ..target.tokenizer import load_tokenizer

        return load_tokenizer(self.trainer.target, revision=self.trainer.target_revision)

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        """Watch the records and run rounds until stopped (``once``: one look); returns the exit status."""
        cfg = self.cfg
        number, path = self.current()
        self.say(
            f"v{number} ({path}) is the current head; a round starts when '{self.records}' holds {cfg.every} new "
            f"answer tokens; versions go to '{self.versions}'"
        )
        while not self.stopping:
            new, self.scanned = read_records_after(self.records, self.scanned)
            self.pending.extend(new)
            rows = usable(self.pending)
            tokens = sum(len(row["answer_ids"]) for row in rows)
            if tokens >= cfg.every and len(rows) > heldout_rows(len(rows), cfg.heldout_share):
                status = self.run_round(rows, self.scanned)
                if status is not None or cfg.once:
                    return status or 0
                self.pending = []
            elif cfg.once:
                needs = f"{cfg.every} (--every) in more than {heldout_rows(len(rows), cfg.heldout_share)} records"
                self.say(
                    f"{tokens} new answer tokens in {len(rows)} records since the last round; a round needs {needs}"
                )
                return 0
            self._sleep(cfg.poll)
        self.say("stopped")
        return 0

    def current(self) -> tuple[int, str]:
        """``(N, path)`` of the head a round starts from: the newest version, else the starting head (N = 0)."""
        newest = newest_version(self.versions)
        return (newest[0], str(newest[1])) if newest else (0, self.head)

    def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while not self.stopping and time.monotonic() < end:
            time.sleep(min(0.5, end - time.monotonic()))

    # ------------------------------------------------------------------ one round
    def run_round(self, rows: list[dict], through: RecordPosition) -> int | None:
        """Learn from ``rows`` (the records up to ``through``): a candidate trained, compared, kept or dropped, the
        position remembered. Returns None when done, or the exit status when the process should end."""
        r = self._new_round(rows, through)
        work = self.versions / WORK
        c = r.snap.counts
        self.say(
            f"round for v{r.number}: {c['traffic']['tokens'] + c['heldout']['tokens']} new answer tokens in "
            f"{c['traffic']['rows'] + c['heldout']['rows']} records; training v{r.parent} for {self.cfg.steps} steps "
            f"on {c['traffic']['rows']} traffic rows and {c['replay']['rows']} replay rows, "
            f"{c['heldout']['rows']} held out"
        )
        status = self._train(r.trainer, work)
        if status is not None:
            return status
        if self.stopping:
            shutil.rmtree(work, ignore_errors=True)
            self.say("stopped; the round in progress was abandoned")
            return 0
        self._keep_or_drop(r, work)
        write_position(self.versions, through)
        self.position = through
        shutil.rmtree(work, ignore_errors=True)
        return None

    def _new_round(self, rows: list[dict], through: RecordPosition) -> Round:
        """The next round: its data written to a fresh work directory, and the trainer's settings for a candidate
        that starts from the current head."""
        from ..data.prepare import DataConfig

        cfg = self.cfg
        parent, parent_path = self.current()
        number = next_number(self.versions)
        work = self.versions / WORK
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        trainer = self.trainer
        data_cfg = DataConfig(max_length=trainer.max_length, overflow=trainer.overflow, revision=trainer.data_revision)
        snap = write_snapshot(
            rows, work, cfg.heldout_share, self.replay, cfg.replay_share, number, self.tokenizer, data_cfg
        )
        trainer = dataclasses.replace(
            trainer,
            init_from=parent_path,
            data=snap.data,
            eval_data=str(snap.heldout),
            eval_rows=snap.counts["heldout"]["rows"],
            output_dir=str(work / "train"),
            cache_dir=str(work / "cache"),
            seed=number,
        )
        return Round(number, parent, parent_path, snap, trainer, self.position, through)

    def _keep_or_drop(self, r: Round, work: Path) -> None:
        """The candidate against the current head on the held-out rows: published as the next version if it beats it
        by the margin, else dropped; one line either way."""
        cfg = self.cfg
        summary = read_json(work / "train" / "summary.json", "trainer's summary")
        before = next(e for e in summary["evals"] if e["step"] == 0)
        after = summary["eval"]
        gain = after["L_acc_est"] / before["L_acc_est"] - 1
        figures = (
            f"held-out L'_acc est {before['L_acc_est']:.3f} (v{r.parent}) -> {after['L_acc_est']:.3f} ({gain:+.1%})"
        )
        if after["L_acc_est"] > before["L_acc_est"] * (1 + cfg.margin):
            info = {
                "parent": r.parent,
                "parent_path": r.parent_path,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "before": _figures(before),
                "after": _figures(after),
                "margin": cfg.margin,
                "steps": cfg.steps,
                "records_through": position_json(r.through),
            }
            card = self._card(r, summary, before, after)
            path = publish_version(self.versions, r.number, work / "train" / "final", info, card)
            self.say(f"v{r.number} kept: {figures}, margin {cfg.margin:+.1%}; published '{path}' (bf16)")
        else:
            self.say(f"candidate dropped: {figures}, short of the margin {cfg.margin:+.1%}; v{r.parent} stays")

    def _train(self, trainer, work: Path) -> int | None:
        """Run the trainer on ``trainer`` (a DistillConfig) in a niced child process with its own threads, its output
        in ``work/train.log``; None when it finished (or was stopped), else the exit status for this process."""
        import yaml

        config = work / "distill.yaml"
        config.write_text(yaml.safe_dump(dataclasses.asdict(trainer), sort_keys=False))
        threads = str(self.cfg.threads)
        env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, TOKENIZERS_PARALLELISM="false")
        log = work / "train.log"
        with open(log, "wb") as out:
            child = subprocess.Popen(
                [sys.executable, "-m", "spd.cli.distill", "--config", str(config)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # a Ctrl-C in the terminal reaches this process, which stops the child
                preexec_fn=lambda: os.nice(self.cfg.nice),
            )
            try:
                while child.poll() is None and not self.stopping:
                    time.sleep(0.2)
            finally:  # stopped, or this process is ending (a second Ctrl-C): the trainer ends with it
                if child.poll() is None:
                    child.terminate()
                    try:
                        child.wait(30)
                    except subprocess.TimeoutExpired:
                        child.kill()
                        child.wait()
            if self.stopping:
                return None
        if child.returncode == 0:
            return None
        kept = self.versions / "failed-round.log"
        shutil.copyfile(log, kept)
        lines = log.read_text(errors="replace").splitlines()
        error = next((line for line in reversed(lines) if line.startswith("error: ")), None)
        if error is not None:  # the trainer refused an input (a full disk, data it cannot read)
            raise SpdInputError(f"the trainer stopped: {error[len('error: ') :]} (its output: '{kept}')")
        print(f"error: the trainer failed (exit status {child.returncode}); its output: '{kept}'", file=sys.stderr)
        return 1

    def _card(self, r: Round, summary: dict, before: dict, after: dict) -> str:
        """A kept version's model card: the data, the training, the command, the figures measured."""
        cfg, head, c, trainer = self.cfg, self.head_cfg, r.snap.counts, r.trainer
        replay = ", ".join(f"`{source}`" for source in cfg.replay) or "none"
        seconds = summary["train_minutes"] * 60
        took = f"{seconds / 60:.1f} minutes" if seconds >= 60 else f"{seconds:.0f} s"
        return f"""---
base_model: {trainer.target}
tags: [speculative-decoding, pipeline-parallelism, spd, spd-adapt]
---

# SPD head v{r.number}, adapted to served traffic

Version {r.number} of a speculation head, fine-tuned by `spd-adapt` on the requests its server answered. The target
verifies every token, so the output is the target's own whichever version proposes it.

| | |
| --- | --- |
| target | `{trainer.target}` |
| pipeline | n = {head.n_stages}, boundaries {", ".join(map(str, head.boundaries))} |
| started from | v{r.parent}, `{r.parent_path}` (v0 is the server's starting head, `{self.head}`) |
| storage | `model.safetensors` in bf16 |
| licence | that of the starting head and its target |

## Data

The records of `{self.records}` after {_where(r.start)}, up to {_where(r.through)}.

| | rows | answer tokens |
| --- | ---: | ---: |
| traffic, trained on | {c["traffic"]["rows"]:,} | {c["traffic"]["tokens"]:,} |
| replay: {replay} (`--replay-share {cfg.replay_share:g}`) | {c["replay"]["rows"]:,} | {c["replay"]["tokens"]:,} |
| traffic, held out (the newest records) | {c["heldout"]["rows"]:,} | {c["heldout"]["tokens"]:,} |

## Training

- {cfg.steps} steps of {trainer.batch_size} rows from v{r.parent}'s weights (fp32): AdamW, lr {trainer.lr:g},
  {trainer.warmup_steps} warm-up step(s) and linear decay to zero, seed {trainer.seed}.
- {summary["tokens_seen"]:,} supervised tokens in {took}, {cfg.threads} thread(s) at niceness +{cfg.nice}.

```bash
{cfg.command or "spd-adapt"}
```

## Measured

On the held-out traffic ({after.get("positions", 0):,} positions), by the trainer, in fp32:

| | v{r.parent} (before) | v{r.number} (after) |
| --- | ---: | ---: |
| L'_acc estimate | {before["L_acc_est"]:.3f} | {after["L_acc_est"]:.3f} |
| top-1 agreement, full pipeline | {before["top1_full"]:.3f} | {after["top1_full"]:.3f} |
| KD loss | {before["kd_loss"]:.4f} | {after["kd_loss"]:.4f} |

Kept: it beats v{r.parent} by more than the margin, {cfg.margin:+.1%} (`--margin {cfg.margin:g}`).
"""


# ---------------------------------------------------------------------------------------------- helpers


def _say(message: str) -> None:
    print(f"[adapt {time.strftime('%H:%M:%S')}] {message}", flush=True)


def _records_dir(records: str, versions: Path) -> Path:
    """``records`` as a records directory: one that holds traffic shards, or none yet (a server that has answered
    nothing so far: the directory is empty but for hidden files and the versions directory)."""
    path = Path(records).expanduser().resolve()
    expected = "the directory a server records its traffic in (spd-serve --record DIR)"
    if not path.exists():
        raise SpdInputError(f"--records '{records}' does not exist; expected {expected}")
    if not path.is_dir():
        raise SpdInputError(f"--records '{records}' is a file; expected {expected}")
    if not shards(path) and any(p != versions and not p.name.startswith(".") for p in path.iterdir()):
        raise SpdInputError(
            f"--records '{records}' holds no traffic records (traffic-NNNNNN.jsonl); expected {expected}"
        )
    return path


def _starting_head(head: str):
    """``(path or hub id, config)`` of the head the server starts with, checked to be a trained head."""
    from ..heads.loading import load_speculator_config
    from ..reading import check_model_files

    try:
        config = load_speculator_config(head)
        check_model_files(head, "speculator", weights=True)
    except SpdInputError as exc:
        raise SpdInputError(f"--head: {exc}") from None
    path = Path(head).expanduser()
    if not path.is_dir():
        return head, config  # a hub id
    if not (path / "model.safetensors").is_file():
        raise SpdInputError(f"--head '{head}' has no model.safetensors; expected a trained head directory")
    return str(path.resolve()), config


def _replay_rows(source: str, revision: str | None):
    """The raw rows of a replay source, checked to hold some."""
    from ..data.prepare import DataConfig, _load_raw

    rows = _load_raw(source, DataConfig(revision=revision))
    if not len(rows):
        raise SpdInputError(f"--replay '{source}' holds no rows; expected the head's training data")
    return rows


def _shape(cfg) -> tuple:
    """What two heads for one server share: the target's shape and the pipeline's cut and schedule."""
    return (cfg.hidden_size, cfg.vocab_size, cfg.target_num_layers, list(cfg.boundaries), cfg.schedule, cfg.max_depth)


def _text(value) -> str:
    """A setting as ``key=value`` text that :func:`spd.training.presets.load_config` reads back."""
    import json

    return json.dumps(value) if isinstance(value, list) else "none" if value is None else str(value)


def _where(position: RecordPosition) -> str:
    return f"shard {position.shard}, byte {position.offset:,}" if position.shard else "their start"


def _figures(metrics: dict) -> dict:
    return {key: metrics[key] for key in ("L_acc_est", "top1_full", "kd_loss", "positions") if key in metrics}
