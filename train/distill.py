"""Distil an SPD speculation head from a frozen target.

    accelerate launch train/distill.py --config configs/testbed-n8.yaml
    accelerate launch --cpu --num_processes 2 train/distill.py --config configs/testbed-n4.yaml max_steps=50
    accelerate launch train/distill.py --config configs/qwen3-8b-n8.yaml output_dir=runs/q8 --resume

Every config key can be overridden as ``key=value``. The head is written to ``<output_dir>/final``
(a ``from_pretrained`` directory); checkpoints go to ``<output_dir>/checkpoints/step-N`` and ``--resume``
continues the newest one exactly (weights, optimizer, scheduler, data position, RNG). A checkpoint is written
under a new temporary name, synced to disk and renamed into place; the one it replaces is removed only after.
``tensorboard=true`` logs to ``<output_dir>/logs`` (``tensorboard --logdir <output_dir>/logs``); ``wandb=true``
logs offline by default (``wandb_mode=offline``) to ``<output_dir>/wandb`` (upload later with ``wandb sync``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import pickle
import sys
import time
import uuid
from functools import partial
from pathlib import Path

import torch

from spd.errors import SpdInputError, first_line, run_cli


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"error: {message} (see --help)\n")


def parse_args(argv=None):
    p = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML preset (configs/*.yaml)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in output_dir")
    p.add_argument("overrides", nargs="*", help="key=value settings")
    return p.parse_args(argv)


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


def load_target_and_data(cfg, accelerator):
    """The frozen target and the rows: (target, train rows, eval rows or None, collate_fn, token_strings).

    ``token_strings(ids)`` gives the target tokenizer's strings of ``ids`` (None if unknown), read only when
    a draft vocabulary needs them.

    Online: the target (bf16 on GPU, fp32 on CPU; only its forward runs, under no_grad) and prepared datasets.
    Offline (``data`` is a capture, data/capture.py): the capture's rows and a stand-in for the target
    holding its config, final norm and LM head; no target layers are loaded.
    """
    from spd.training.capture import CapturedDataset, CapturedTarget, collate_captured, is_capture
    from datasets import concatenate_datasets
    from spd.data.prepare import DataConfig, prepare_dataset
    from spd.training.distill import collate
    from spd.target.staging import StagedModel, load_tokenizer

    stages = {"n_stages": None if cfg.boundaries else cfg.n_stages, "boundaries": cfg.boundaries}
    sources = cfg.data if isinstance(cfg.data, list) else [cfg.data]
    if len(sources) > 1 and any(is_capture(s) for s in sources):
        raise SpdInputError(f"a mixture of datasets is prepared online; a capture cannot be one of them, got {sources}")
    if len(sources) == 1 and is_capture(sources[0]):
        target = CapturedTarget(sources[0], device=accelerator.device, **stages)
        train_ds = CapturedDataset(sources[0])
        eval_ds = None
        if cfg.eval_data:
            if not is_capture(cfg.eval_data):
                raise SpdInputError(f"data is a capture, so eval_data must be one too (data/capture.py over the "
                                    f"held-out rows), got '{cfg.eval_data}'; or pass eval_data=none")
            eval_ds = CapturedDataset(cfg.eval_data)
            if eval_ds.manifest["target_config"] != train_ds.manifest["target_config"]:
                raise SpdInputError(f"the captures '{cfg.data}' and '{cfg.eval_data}' come from different targets")
        if train_ds.teacher == "topk" and cfg.tau != 1:
            raise SpdInputError(f"a top-k capture holds the teacher at temperature 1; train it with tau=1, got {cfg.tau}")
        if train_ds.teacher == "topk" and cfg.draft_vocab_size:
            raise SpdInputError("draft_vocab_size needs the full teacher (the target's distribution restricted to the "
                                "draft tokens); capture with --teacher full")
        pad_id = train_ds.manifest["pad_id"]
        return target, train_ds, eval_ds, partial(collate_captured, pad_id=pad_id), target.token_strings
    on_gpu = torch.cuda.is_available()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(cfg.target_dtype,
                                                                     torch.bfloat16 if on_gpu else torch.float32)
    staged = StagedModel.from_pretrained(cfg.target, revision=cfg.target_revision, device=accelerator.device,
                                         dtype=dtype, **stages)
    staged.requires_grad_(False)
    tokenizer = load_tokenizer(cfg.target, revision=cfg.target_revision)
    data_cfg = DataConfig(max_length=cfg.max_length, overflow=cfg.overflow, revision=cfg.data_revision)
    with accelerator.main_process_first():
        parts = [prepare_dataset(source, tokenizer, data_cfg, cfg.cache_dir, report=accelerator.print)
                 for source in sources]
        train_ds = parts[0] if len(parts) == 1 else concatenate_datasets(parts)  # shuffled by the loader
        eval_ds = (prepare_dataset(cfg.eval_data, tokenizer, data_cfg, cfg.cache_dir, report=accelerator.print)
                   if cfg.eval_data else None)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return staged, train_ds, eval_ds, partial(collate, pad_id=pad_id), tokenizer.convert_ids_to_tokens


def train(cfg, resume: bool) -> dict:
    log_with = check_trackers(cfg)  # before anything slow is loaded
    from accelerate import DataLoaderConfiguration
    from accelerate.utils import ProjectConfiguration, broadcast_object_list, set_seed
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm
    from spd.training.capture import CapturedDataset
    from spd.training.distill import (clean_checkpoints, commit_checkpoint, distill_step, evaluate, latest_checkpoint,
                             new_head, save_head_atomic, scale_fc_init, teacher_anchors, teacher_pass, to_device,
                             training_fills)
    from spd.heads.draft_vocab import check_draft_vocab, select_draft_vocab, token_counts, tokens_sha256
    from spd.training.backends import make_accelerator, plain_head
    from spd.training.kd import sample_fills
    from spd.heads.config import check_compatible
    from spd.heads.speculator import Speculator
    from spd.files import write_json_atomic

    on_gpu = torch.cuda.is_available()
    mixed = cfg.mixed_precision if cfg.mixed_precision != "auto" else ("bf16" if on_gpu else "no")
    # DDP, DeepSpeed ZeRO-2 or FSDP2 as `accelerate launch` asked, on GPUs or CPU (spd/training/backends.py)
    accelerator = make_accelerator(cfg.max_grad_norm, gradient_accumulation_steps=cfg.grad_accum,
                                   mixed_precision=mixed, log_with=log_with or None,
                                   project_config=ProjectConfiguration(project_dir=cfg.output_dir,
                                                                       logging_dir=str(Path(cfg.output_dir) / "logs")),
                                   dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    main = accelerator.is_main_process
    say = accelerator.print
    set_seed(cfg.seed)
    out = Path(cfg.output_dir)
    if main:
        out.mkdir(parents=True, exist_ok=True)
    # This run's temporary checkpoint names (one per run, the same on every process): never a name that a killed
    # run, or another run in the same directory, may still hold.
    tag = broadcast_object_list([uuid.uuid4().hex[:12] if main else None])[0]

    staged, train_ds, eval_ds, collate_fn, token_strings = load_target_and_data(cfg, accelerator)
    offline = isinstance(train_ds, CapturedDataset)
    if offline:
        cfg = dataclasses.replace(cfg, target=staged.settings["target"], target_revision=staged.settings["target_revision"])
    if cfg.init_from:
        head = Speculator.from_pretrained(cfg.init_from, dtype=torch.float32).to(accelerator.device)
        check_compatible(head.config, staged)
        check_draft_vocab(head, staged.vocab_size)
    elif cfg.draft_vocab_size:
        rows = (train_ds.row_tokens() if offline else
                (pair for batch in train_ds.iter(batch_size=4096) for pair in zip(batch["input_ids"], batch["loss_mask"])))
        draft_ids = select_draft_vocab(token_counts(rows, staged.vocab_size), cfg.draft_vocab_size)
        strings = token_strings(draft_ids.tolist())
        sha = tokens_sha256(strings) if strings is not None and None not in strings else None
        head = new_head(staged, cfg, draft_ids, sha).float()
    else:
        head = new_head(staged, cfg).float()
    anchors = teacher_anchors(head, staged)
    if offline:
        missing = sorted(set(head.needed_anchors()) - set(train_ds.states))
        if missing:
            raise SpdInputError(f"the capture '{cfg.data}' stores hidden states {train_ds.states} but this head needs "
                                f"{missing} as well; capture with --stages {staged.n_stages} (or --anchors)")

    eval_batches = []
    if eval_ds is not None:
        rows = [eval_ds[i] for i in range(min(cfg.eval_rows, len(eval_ds)))]
        eval_batches = [to_device(collate_fn(rows[i:i + cfg.batch_size]), accelerator.device)
                        for i in range(0, len(rows), cfg.batch_size)]
    loader = DataLoader(train_ds, batch_size=cfg.batch_size, shuffle=True, collate_fn=collate_fn,
                        generator=torch.Generator().manual_seed(cfg.seed))

    if cfg.fc_init == "scaled" and not cfg.init_from:
        # Statistics from the first rows of the training set (the same on every process).
        rows = [train_ds[i] for i in range(min(cfg.batch_size, len(train_ds)))]
        first = to_device(collate_fn(rows), accelerator.device)
        hidden = teacher_pass(staged, head.needed_anchors(), first)
        scale_fc_init(head, {a: float(h[first["valid"]].float().pow(2).mean().sqrt()) for a, h in hidden.items()})

    optimizer = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    head, optimizer, loader = accelerator.prepare(head, optimizer, loader)
    batches_per_epoch = len(loader)
    steps_per_epoch = max(1, batches_per_epoch // cfg.grad_accum)
    total_steps = cfg.max_steps or math.ceil(cfg.epochs * steps_per_epoch)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_lambda, warmup=cfg.warmup_steps,
                                                                     total=total_steps))
    accelerator.register_for_checkpointing(scheduler)
    # Fills are drawn from a generator of their own (per process), saved with every checkpoint.
    fill_gen = torch.Generator().manual_seed(cfg.seed * 1000 + accelerator.process_index)

    step, batches_done, elapsed_before = 0, 0, 0.0
    ckpt = latest_checkpoint(out) if resume else None
    if main:
        clean_checkpoints(out)  # what a killed run left (a step-N.T.old copy that is the newest checkpoint stays)
    accelerator.wait_for_everyone()
    if resume and ckpt is None:
        say(f"[resume] no checkpoint in {out / 'checkpoints'}; starting from scratch")
    if ckpt is not None:
        try:
            accelerator.load_state(str(ckpt))
            state = json.loads((ckpt / "trainer_state.json").read_text())
            step, batches_done, elapsed_before = state["step"], state["batches_done"], state["elapsed_s"]
            # weights_only: the RNG state is a tensor; a file holding anything else must not run code.
            fill_gen.set_state(torch.load(ckpt / f"fill_rng_{accelerator.process_index}.pt", weights_only=True))
        except (OSError, ValueError, KeyError, TypeError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
            raise SpdInputError(f"the checkpoint '{ckpt}' cannot be resumed ({type(exc).__name__}: "
                                f"{first_line(exc)}); remove it to resume from the one before") from None
        say(f"[resume] {ckpt.name}: step {step}, {batches_done} batches done")

    if log_with:
        # TensorBoard writes to <output_dir>/logs/<wandb_project>, wandb to <output_dir>/wandb/<run>. TensorBoard's
        # hparams take only scalars and strings, so lists (boundaries, anchors) go in as JSON.
        hparams = {k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in dataclasses.asdict(cfg).items()}
        init_kwargs = {"wandb": {"mode": cfg.wandb_mode, "dir": str(out)}} if cfg.wandb else {}
        accelerator.init_trackers(cfg.wandb_project, config=hparams, init_kwargs=init_kwargs)

    def save_checkpoint() -> None:
        final = out / "checkpoints" / f"step-{step}"
        tmp = final.with_name(f"{final.name}.{tag}.tmp")
        accelerator.save_state(str(tmp))
        torch.save(fill_gen.get_state(), tmp / f"fill_rng_{accelerator.process_index}.pt")
        accelerator.wait_for_everyone()
        whole = plain_head(accelerator, head)  # every process: under FSDP this gathers the shards
        if main:
            save_head_atomic(whole, tmp / "head")
            write_json_atomic(tmp / "trainer_state.json",
                              {"step": step, "batches_done": batches_done, "elapsed_s": elapsed_before + time.time() - t0})
            # Synced, then renamed over an older step-N (moved aside first, removed last): a checkpoint exists only
            # once it is complete, and a kill at any point leaves the newest complete one loadable.
            commit_checkpoint(tmp, final, cfg.keep_checkpoints, tag)
        accelerator.wait_for_everyone()

    def run_eval() -> dict:
        metrics = evaluate(accelerator.unwrap_model(head), staged, eval_batches, cfg.tau, cfg.kd_chunk)
        full, length = ("first draft", "L_acc (sd)") if cfg.variant == "eagle" else ("full pipeline", "L'_acc")
        say(f"[eval] step {step}: kd_loss {metrics['kd_loss']:.4f}, top-1 ({full}) {metrics['top1_full']:.4f}, "
            f"by fill {metrics['top1_by_fill']}, {length} est {metrics['L_acc_est']:.3f}")
        logs = {f"eval/{k}": v for k, v in metrics.items() if isinstance(v, float)}
        logs.update({f"eval/top1_fill{fill}": v for fill, v in metrics["top1_by_fill"].items()})
        accelerator.log(logs, step=step)
        return metrics

    max_fill, p_full = training_fills(cfg)
    t0 = time.time()
    head.train()
    bar = tqdm(total=total_steps, initial=step, desc="distill", unit="step", disable=not main)
    window_loss, window_agree, window_count = 0.0, 0, 0
    stop = step >= total_steps
    metrics: dict = {}
    while not stop:
        epoch, skip = divmod(batches_done, batches_per_epoch)
        loader.set_epoch(epoch)
        active = accelerator.skip_first_batches(loader, skip) if skip else loader
        for batch in active:
            with accelerator.accumulate(head):
                hidden = teacher_pass(staged, anchors, batch)
                fill_B = sample_fills(batch["input_ids"].shape[0], max_fill, fill_gen, p_full)
                loss, result = distill_step(head, staged, hidden, batch, fill_B.to(accelerator.device),
                                            cfg.tau, cfg.kd_chunk)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(head.parameters(), cfg.max_grad_norm)
                optimizer.step()  # a no-op on accumulation micro-steps (accelerate's optimizer wrapper)
                if accelerator.sync_gradients:
                    scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            batches_done += 1
            window_loss += float(result.loss_sum.detach())
            window_agree += result.agree
            window_count += result.count
            if not accelerator.sync_gradients:
                continue
            step += 1
            bar.update(1)
            if step % cfg.log_every == 0 and window_count:
                logs = {"train/kd_loss": window_loss / window_count, "train/top1": window_agree / window_count,
                        "train/lr": scheduler.get_last_lr()[0]}
                bar.set_postfix(loss=f"{logs['train/kd_loss']:.3f}", top1=f"{logs['train/top1']:.3f}")
                accelerator.log(logs, step=step)
                window_loss, window_agree, window_count = 0.0, 0, 0
            if eval_batches and cfg.eval_every and step % cfg.eval_every == 0 and step < total_steps:
                run_eval()
            timed_out = cfg.max_minutes is not None and elapsed_before + time.time() - t0 > cfg.max_minutes * 60
            if step >= total_steps or timed_out:
                stop = True
                break
            if cfg.save_every and step % cfg.save_every == 0:
                save_checkpoint()
    bar.close()
    loop_minutes = (elapsed_before + time.time() - t0) / 60  # training steps only (no final save, no final eval)
    save_checkpoint()
    if eval_batches:
        metrics = run_eval()
    whole = plain_head(accelerator, head)
    if main:
        save_head_atomic(whole, out / "final")
        summary = {"step": step, "total_steps": total_steps, "train_minutes": (elapsed_before + time.time() - t0) / 60,
                   "loop_minutes": loop_minutes,
                   "processes": accelerator.num_processes, "config": dataclasses.asdict(cfg), "eval": metrics}
        write_json_atomic(out / "summary.json", summary)
        say(f"[done] head written to {out / 'final'}")
    # No process tears down the process group (end_training) while another still works in it: under gloo a peer
    # that closes its connections early can abort one still in (or entering) a collective.
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return metrics


def main(argv=None) -> int:
    args = parse_args(argv)
    return run_cli(_configure_and_train, args)


def _configure_and_train(args) -> int:
    from spd.training.distill import load_config

    train(load_config(args.config, args.overrides), args.resume)
    return 0


if __name__ == "__main__":
    sys.exit(main())
