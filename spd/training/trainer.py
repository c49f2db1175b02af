"""The distillation trainer: a head learns from a frozen target under ``accelerate`` (DDP, DeepSpeed ZeRO-2 or FSDP2,
on GPUs or CPU), online (the target runs inside each step) or from an offline capture (docs/training.md).

:func:`train` runs one :class:`DistillConfig` to its end: checkpoints in ``<output_dir>/checkpoints/step-N`` (written
under a temporary name, synced and renamed into place; ``resume`` continues the newest one exactly: weights,
optimizer, scheduler, data position, RNG), the head in ``<output_dir>/final`` and ``summary.json``. The program is
:mod:`spd.cli.distill` (``accelerate launch train/distill.py`` or ``accelerate launch -m spd.cli.distill``).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import pickle
import time
import uuid
from functools import partial
from pathlib import Path

import torch

from ..errors import SpdInputError, first_line
from ..target.precision import warn_if_slow
from .backends import cpu_threads
from .checkpoints import clean_checkpoints, commit_checkpoint, latest_checkpoint, list_checkpoints, save_head_atomic
from .distill import (
    DistillConfig,
    distill_step,
    new_head,
    scale_fc_init,
    teacher_anchors,
    teacher_pass,
    to_device,
    training_fills,
    with_draft_vocab,
)
from .evaluation import evaluate, evaluate_sets
from .loading import load_target_and_data


def lr_lambda(step: int, warmup: int, total: int) -> float:
    """Linear warmup, then linear decay to zero at ``total`` (the paper's schedule)."""
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (total - step) / max(1, total - warmup))


def _import_any(*modules: str) -> bool:
    for name in modules:
        try:
            importlib.import_module(name)
            return True
        except ImportError:
            pass
    return False


def check_trackers(cfg) -> list[str]:
    """The accelerate trackers ``cfg`` asks for, after checking that their packages import (one clear error if not)."""
    if cfg.wandb and cfg.wandb_mode not in ("offline", "online", "disabled"):
        raise SpdInputError(f"wandb_mode must be offline, online or disabled, got '{cfg.wandb_mode}'")
    if cfg.wandb and not _import_any("wandb"):
        raise SpdInputError("wandb=true needs the wandb package (pip install wandb, or pip install 'spd[train]')")
    # accelerate's TensorBoard tracker writes with torch.utils.tensorboard (needs tensorboard) or tensorboardX
    if cfg.tensorboard and not _import_any("torch.utils.tensorboard", "tensorboardX"):
        raise SpdInputError("tensorboard=true needs the tensorboard package (pip install tensorboard)")
    return [name for name, on in (("wandb", cfg.wandb), ("tensorboard", cfg.tensorboard)) if on]


def train(cfg: DistillConfig, resume: bool) -> dict:
    """Distil a head as ``cfg`` says (``resume``: from the newest checkpoint); returns the last evaluation."""
    log_with = check_trackers(cfg)  # before anything slow is loaded
    return Trainer(cfg, resume, log_with).run()


class Trainer:
    """One training run (see :func:`train`): the accelerator, the target and data, the head and its optimizer, and
    the position the run has reached (step, batches done, minutes before a resume), and every evaluation so far with
    the supervised tokens seen by then (``evals``: a data curve from one run, kept across resumes)."""

    def __init__(self, cfg: DistillConfig, resume: bool, log_with: list[str]):
        from accelerate.utils import broadcast_object_list, set_seed

        self.accelerator = self._accelerator(cfg, log_with)
        self.main = self.accelerator.is_main_process
        self.say = self.accelerator.print
        threads = cpu_threads(cfg.threads, self.accelerator.device)
        if threads is not None and threads != torch.get_num_threads():
            torch.set_num_threads(threads)
            self.say(f"[threads] {threads} intra-op thread(s) per process (threads=N sets it)")
        set_seed(cfg.seed)
        self.out = Path(cfg.output_dir)
        if self.main:
            self.out.mkdir(parents=True, exist_ok=True)
        # This run's temporary checkpoint names (one per run, the same on every process): never a name that a killed
        # run, or another run in the same directory, may still hold.
        self.tag = broadcast_object_list([uuid.uuid4().hex[:12] if self.main else None])[0]
        self.cfg = self._load(cfg)
        self._prepare()
        self.step, self.batches_done, self.elapsed_before, self.t0 = 0, 0, 0.0, time.time()
        # Supervised tokens trained on by this process (a resume puts the run's total on the main process), and the
        # evaluations so far.
        self.tokens_here, self.evals = 0, []
        self._resume(resume)
        self._check_disk()
        if log_with:
            self._init_trackers()

    @staticmethod
    def _accelerator(cfg: DistillConfig, log_with: list[str]):
        from accelerate import DataLoaderConfiguration
        from accelerate.utils import ProjectConfiguration

        from .backends import make_accelerator

        on_gpu = torch.cuda.is_available()
        mixed = cfg.mixed_precision if cfg.mixed_precision != "auto" else ("bf16" if on_gpu else "no")
        if mixed == "bf16" and not on_gpu:
            warn_if_slow(torch.bfloat16, "cpu", "the head's step under mixed_precision=bf16")
        # DDP, DeepSpeed ZeRO-2 or FSDP2 as `accelerate launch` asked, on GPUs or CPU (spd/training/backends.py)
        project = ProjectConfiguration(project_dir=cfg.output_dir, logging_dir=str(Path(cfg.output_dir) / "logs"))
        return make_accelerator(
            cfg.max_grad_norm,
            gradient_accumulation_steps=cfg.grad_accum,
            mixed_precision=mixed,
            log_with=log_with or None,
            project_config=project,
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        )

    def _load(self, cfg: DistillConfig) -> DistillConfig:
        """The target, the data and a head (new, or ``init_from``); returns the config with an offline capture's
        target filled in."""
        from .capture import CapturedDataset

        self.staged, self.train_ds, eval_ds, self.collate_fn, token_strings = load_target_and_data(
            cfg, self.accelerator
        )
        self.offline = isinstance(self.train_ds, CapturedDataset)
        if self.offline:
            cfg = dataclasses.replace(
                cfg, target=self.staged.settings["target"], target_revision=self.staged.settings["target_revision"]
            )
        self.head = self._new_head(cfg, token_strings)
        self.anchors = teacher_anchors(self.head, self.staged)
        if self.offline:
            missing = sorted(set(self.head.needed_anchors()) - set(self.train_ds.states))
            if missing:
                raise SpdInputError(
                    f"the capture '{cfg.data}' stores hidden states {self.train_ds.states} but this "
                    f"head needs {missing} as well; capture with --stages {self.staged.n_stages} "
                    "(or --anchors)"
                )
        self.eval_batches = {}  # held-out batches by set name
        for name, ds in eval_ds.items():
            rows = [ds[i] for i in range(min(cfg.eval_rows, len(ds)))]
            self.eval_batches[name] = [
                to_device(self.collate_fn(rows[i : i + cfg.batch_size]), self.accelerator.device)
                for i in range(0, len(rows), cfg.batch_size)
            ]
        return cfg

    def _new_head(self, cfg: DistillConfig, token_strings):
        """``init_from``'s head, or a new one (over a draft vocabulary of the data's most frequent tokens if asked).

        ``init_from`` with ``draft_vocab_size`` moves the head to the draft vocabulary of the new data
        (:func:`~spd.training.distill.with_draft_vocab`): a head trained on one kind of text starts on another
        without a ceiling set by the tokens it cannot propose."""
        from ..heads.config import check_compatible
        from ..heads.draft_vocab import check_draft_vocab
        from ..heads.loading import load_speculator

        staged = self.staged
        if cfg.init_from:
            head = load_speculator(cfg.init_from, dtype=torch.float32, device=self.accelerator.device)
            check_compatible(head.config, staged)
            check_draft_vocab(head, staged.vocab_size)
            if cfg.draft_vocab_size:
                draft_ids, sha = self._draft_vocab(cfg, token_strings)
                old_ids = head.draft_ids.cpu() if head.draft_ids is not None else draft_ids
                kept = int(torch.isin(draft_ids, old_ids).sum())
                head = with_draft_vocab(head, staged, draft_ids, sha)
                self.say(
                    f"[init] {cfg.init_from} moved to the data's draft vocabulary of {len(draft_ids)} tokens: "
                    f"{kept} keep their trained rows, {len(draft_ids) - kept} start from the target's LM head"
                )
            return head
        if not cfg.draft_vocab_size:
            return new_head(staged, cfg).float()
        return new_head(staged, cfg, *self._draft_vocab(cfg, token_strings)).float()

    def _draft_vocab(self, cfg: DistillConfig, token_strings) -> tuple[torch.Tensor, str | None]:
        """The ``draft_vocab_size`` most frequent supervised tokens of the training data, and their strings' hash."""
        from ..heads.draft_vocab import select_draft_vocab, token_counts, tokens_sha256

        train_ds = self.train_ds
        rows = (
            train_ds.row_tokens()
            if self.offline
            else (
                pair for batch in train_ds.iter(batch_size=4096) for pair in zip(batch["input_ids"], batch["loss_mask"])
            )
        )
        draft_ids = select_draft_vocab(token_counts(rows, self.staged.vocab_size), cfg.draft_vocab_size)
        strings = token_strings(draft_ids.tolist())
        return draft_ids, tokens_sha256(strings) if strings is not None and None not in strings else None

    def _prepare(self) -> None:
        """The FC scaling (``fc_init=scaled``), the loader, the optimizer and the schedule, under the accelerator."""
        from torch.utils.data import DataLoader

        cfg, accelerator = self.cfg, self.accelerator
        loader = DataLoader(
            self.train_ds,
            batch_size=cfg.batch_size,
            shuffle=True,
            collate_fn=self.collate_fn,
            generator=torch.Generator().manual_seed(cfg.seed),
        )
        if cfg.fc_init == "scaled" and not cfg.init_from:
            # Statistics from the first rows of the training set (the same on every process).
            rows = [self.train_ds[i] for i in range(min(cfg.batch_size, len(self.train_ds)))]
            first = to_device(self.collate_fn(rows), accelerator.device)
            hidden = teacher_pass(self.staged, self.head.needed_anchors(), first)
            scale_fc_init(
                self.head, {a: float(h[first["valid"]].float().pow(2).mean().sqrt()) for a, h in hidden.items()}
            )
        optimizer = torch.optim.AdamW(self.head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.head, self.optimizer, self.loader = accelerator.prepare(self.head, optimizer, loader)
        self.batches_per_epoch = len(self.loader)
        steps_per_epoch = max(1, self.batches_per_epoch // cfg.grad_accum)
        self.total_steps = cfg.max_steps or math.ceil(cfg.epochs * steps_per_epoch)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, partial(lr_lambda, warmup=cfg.warmup_steps, total=self.total_steps)
        )
        accelerator.register_for_checkpointing(self.scheduler)
        # Fills are drawn from a generator of their own (per process), saved with every checkpoint.
        self.fill_gen = torch.Generator().manual_seed(cfg.seed * 1000 + accelerator.process_index)

    def _resume(self, resume: bool) -> None:
        """Continue the newest checkpoint exactly (``resume``), after removing what a killed run left."""

        accelerator, out = self.accelerator, self.out
        ckpt = latest_checkpoint(out) if resume else None
        if self.main:
            clean_checkpoints(out)  # what a killed run left (a step-N.T.old copy that is the newest checkpoint stays)
        accelerator.wait_for_everyone()
        if resume and ckpt is None:
            self.say(f"[resume] no checkpoint in {out / 'checkpoints'}; starting from scratch")
        if ckpt is None:
            return
        try:
            accelerator.load_state(str(ckpt))
            state = json.loads((ckpt / "trainer_state.json").read_text())
            self.step, self.batches_done, self.elapsed_before = state["step"], state["batches_done"], state["elapsed_s"]
            # Checkpoints written before these were recorded resume with the count from here on and no history.
            self.tokens_here = state.get("tokens_seen", 0) if self.main else 0
            self.evals = list(state.get("evals", []))
            # weights_only: the RNG state is a tensor; a file holding anything else must not run code.
            self.fill_gen.set_state(torch.load(ckpt / f"fill_rng_{accelerator.process_index}.pt", weights_only=True))
        except (OSError, ValueError, KeyError, TypeError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
            raise SpdInputError(
                f"the checkpoint '{ckpt}' cannot be resumed ({type(exc).__name__}: "
                f"{first_line(exc)}); remove it to resume from the one before"
            ) from None
        self.say(f"[resume] {ckpt.name}: step {self.step}, {self.batches_done} batches done")

    def checkpoint_bytes(self) -> tuple[int, int]:
        """About what one checkpoint and the final head take on disk: the head's weights twice (the accelerator's
        state and the head beside it) and AdamW's two fp32 moments of every trained parameter; the head once."""
        head = self.accelerator.unwrap_model(self.head)
        weights = sum(t.numel() * t.element_size() for t in head.state_dict().values())
        moments = 2 * 4 * sum(p.numel() for p in head.parameters() if p.requires_grad)
        return 2 * weights + moments, weights

    def _check_disk(self) -> None:
        """Refuse, in one line and before the first step, a run whose checkpoints (``keep_checkpoints`` and the one
        being written) and final head will not fit on the disk of ``output_dir``."""
        from ..files import check_free_space

        checkpoint, head = self.checkpoint_bytes()
        new = max(1, self.cfg.keep_checkpoints + 1 - len(list_checkpoints(self.out)))  # those a resume keeps count
        check_free_space(
            self.out,
            new * checkpoint + head,
            f"this run ({new} checkpoint(s) of {checkpoint / 2**20:.1f} MiB and the final head)",
            "set output_dir on a larger disk or keep fewer checkpoints (keep_checkpoints=1)",
        )

    def _init_trackers(self) -> None:
        # TensorBoard writes to <output_dir>/logs/<wandb_project>, wandb to <output_dir>/wandb/<run>. TensorBoard's
        # hparams take only scalars and strings, so lists (boundaries, anchors) go in as JSON.
        cfg = self.cfg
        hparams = {k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in dataclasses.asdict(cfg).items()}
        init_kwargs = {"wandb": {"mode": cfg.wandb_mode, "dir": str(self.out)}} if cfg.wandb else {}
        self.accelerator.init_trackers(cfg.wandb_project, config=hparams, init_kwargs=init_kwargs)

    def elapsed_s(self) -> float:
        """Training seconds so far, over every resume."""
        return self.elapsed_before + time.time() - self.t0

    # ---------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> None:
        from ..files import write_json_atomic
        from .backends import plain_head

        accelerator = self.accelerator
        tokens = self.tokens_seen()  # a collective: every process
        final = self.out / "checkpoints" / f"step-{self.step}"
        tmp = final.with_name(f"{final.name}.{self.tag}.tmp")
        accelerator.save_state(str(tmp))
        torch.save(self.fill_gen.get_state(), tmp / f"fill_rng_{accelerator.process_index}.pt")
        accelerator.wait_for_everyone()
        whole = plain_head(accelerator, self.head)  # every process: under FSDP this gathers the shards
        if self.main:
            save_head_atomic(whole, tmp / "head")
            write_json_atomic(
                tmp / "trainer_state.json",
                {
                    "step": self.step,
                    "batches_done": self.batches_done,
                    "elapsed_s": self.elapsed_s(),
                    "tokens_seen": tokens,
                    "evals": self.evals,
                },
            )
            # Synced, then renamed over an older step-N (moved aside first, removed last): a checkpoint exists only
            # once it is complete, and a kill at any point leaves the newest complete one loadable.
            commit_checkpoint(tmp, final, self.cfg.keep_checkpoints, self.tag)
        accelerator.wait_for_everyone()

    def tokens_seen(self) -> int:
        """Supervised tokens trained on so far, over every process and resume (a collective: call on every process)."""
        count = torch.tensor([self.tokens_here], dtype=torch.int64, device=self.accelerator.device)
        return int(self.accelerator.reduce(count, reduction="sum").item())

    def run_eval(self) -> dict:
        cfg = self.cfg
        tokens = self.tokens_seen()
        head = self.accelerator.unwrap_model(self.head)
        if isinstance(cfg.eval_data, dict):
            metrics = evaluate_sets(head, self.staged, self.eval_batches, cfg.tau, cfg.kd_chunk)
        else:
            metrics = evaluate(head, self.staged, *self.eval_batches.values(), cfg.tau, cfg.kd_chunk)
        if not self.evals or self.evals[-1]["step"] != self.step:  # a resume may evaluate its last step again
            self.evals.append(
                {"step": self.step, "tokens_seen": tokens, "train_minutes": self.elapsed_s() / 60, **metrics}
            )
        full, length = ("first draft", "L_acc (sd)") if cfg.variant == "eagle" else ("full pipeline", "L'_acc")
        self.say(
            f"[eval] step {self.step}: kd_loss {metrics['kd_loss']:.4f}, top-1 ({full}) "
            f"{metrics['top1_full']:.4f}, by fill {metrics['top1_by_fill']}, {length} est "
            f"{metrics['L_acc_est']:.3f}"
        )
        for name, m in metrics.get("sets", {}).items():
            self.say(f"[eval] step {self.step}: {name}: top-1 {m['top1_full']:.4f}, {length} est {m['L_acc_est']:.3f}")
        logs = {f"eval/{k}": v for k, v in metrics.items() if isinstance(v, float)}
        logs.update({f"eval/top1_fill{fill}": v for fill, v in metrics["top1_by_fill"].items()})
        logs.update({f"eval/{name}/L_acc_est": m["L_acc_est"] for name, m in metrics.get("sets", {}).items()})
        self.accelerator.log(logs, step=self.step)
        return metrics

    # ------------------------------------------------------------------------------------ the loop
    def run(self) -> dict:
        """Train to ``total_steps`` (or ``max_minutes``), then save, evaluate and write the head and summary."""
        from tqdm.auto import tqdm

        self.t0 = time.time()
        self.head.train()
        self.bar = tqdm(total=self.total_steps, initial=self.step, desc="distill", unit="step", disable=not self.main)
        self.window = [0.0, 0, 0]  # KD loss, agreeing positions, positions since the last log line
        stop = self.step >= self.total_steps
        if self.eval_batches and self.step == 0 and 0 in (self.cfg.eval_steps or ()):
            self.run_eval()  # the starting head (init_from's), the baseline its training is measured against
        while not stop:
            stop = self.epoch()
        self.bar.close()
        return self.finish((self.elapsed_s()) / 60)  # training steps only (no final save, no final eval)

    def epoch(self) -> bool:
        """The rest of the current epoch (from the batch a resume stopped at); True when the run is done."""
        from .kd import sample_fills

        cfg, accelerator, head = self.cfg, self.accelerator, self.head
        max_fill, p_full = training_fills(cfg)
        epoch, skip = divmod(self.batches_done, self.batches_per_epoch)
        self.loader.set_epoch(epoch)
        active = accelerator.skip_first_batches(self.loader, skip) if skip else self.loader
        for batch in active:
            with accelerator.accumulate(head):
                hidden = teacher_pass(self.staged, self.anchors, batch)
                fill_B = sample_fills(batch["input_ids"].shape[0], max_fill, self.fill_gen, p_full)
                loss, result = distill_step(
                    head,
                    self.staged,
                    hidden,
                    batch,
                    fill_B.to(accelerator.device),
                    cfg.tau,
                    cfg.kd_chunk,
                    cfg.pad_to_multiple_of,
                )
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(head.parameters(), cfg.max_grad_norm)
                self.optimizer.step()  # a no-op on accumulation micro-steps (accelerate's optimizer wrapper)
                if accelerator.sync_gradients:
                    self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
            self.batches_done += 1
            self.tokens_here += int(batch["supervised"].sum())
            self.window[0] += float(result.loss_sum.detach())
            self.window[1] += result.agree
            self.window[2] += result.count
            if accelerator.sync_gradients and self.after_step():
                return True
        return False

    def after_step(self) -> bool:
        """An optimizer step is done: log, evaluate and checkpoint as configured; True when the run is done."""
        cfg = self.cfg
        self.step += 1
        self.bar.update(1)
        loss, agree, count = self.window
        if self.step % cfg.log_every == 0 and count:
            logs = {
                "train/kd_loss": loss / count,
                "train/top1": agree / count,
                "train/lr": self.scheduler.get_last_lr()[0],
            }
            self.bar.set_postfix(loss=f"{logs['train/kd_loss']:.3f}", top1=f"{logs['train/top1']:.3f}")
            self.accelerator.log(logs, step=self.step)
            self.window = [0.0, 0, 0]
        at = (cfg.eval_every and self.step % cfg.eval_every == 0) or self.step in (cfg.eval_steps or ())
        if self.eval_batches and at and self.step < self.total_steps:
            self.run_eval()
        timed_out = cfg.max_minutes is not None and self.elapsed_s() > cfg.max_minutes * 60
        if self.step >= self.total_steps or timed_out:
            return True
        if cfg.save_every and self.step % cfg.save_every == 0:
            self.save_checkpoint()
        return False

    def finish(self, loop_minutes: float) -> dict:
        """The last checkpoint, the final evaluation, the head in ``final`` and ``summary.json``."""
        from ..files import write_json_atomic
        from .backends import plain_head

        accelerator, out = self.accelerator, self.out
        self.save_checkpoint()
        metrics = self.run_eval() if self.eval_batches else {}
        tokens = self.tokens_seen()  # a collective: every process
        whole = plain_head(accelerator, self.head)
        if self.main:
            save_head_atomic(whole, out / "final")
            summary = {
                "step": self.step,
                "total_steps": self.total_steps,
                "train_minutes": self.elapsed_s() / 60,
                "loop_minutes": loop_minutes,
                "processes": accelerator.num_processes,
                "tokens_seen": tokens,
                "config": dataclasses.asdict(self.cfg),
                "eval": metrics,
                "evals": self.evals,  # every evaluation of the run, with the supervised tokens seen by then
            }
            write_json_atomic(out / "summary.json", summary)
            self.say(f"[done] head written to {out / 'final'}")
        # No process tears down the process group (end_training) while another still works in it: under gloo a peer
        # that closes its connections early can abort one still in (or entering) a collective.
        accelerator.wait_for_everyone()
        accelerator.end_training()
        return metrics
