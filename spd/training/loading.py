"""What a run trains on: the frozen target and the rows, online (the target loaded, datasets prepared) or offline
(a capture's rows and the target's stand-in; data/capture.py)."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch

from ..errors import SpdInputError

if TYPE_CHECKING:
    from accelerate import Accelerator

    from .distill import DistillConfig


def eval_sets(eval_data: str | dict[str, str] | None) -> dict[str, str]:
    """``eval_data`` as named held-out sets (one unnamed set, ``""``, for a single path; none for None)."""
    if not eval_data:
        return {}
    return dict(eval_data) if isinstance(eval_data, dict) else {"": eval_data}


def load_target_and_data(cfg: DistillConfig, accelerator: Accelerator) -> tuple:
    """The frozen target and the rows: (target, train rows, eval rows by set name, collate_fn, token_strings).

    ``token_strings(ids)`` gives the target tokenizer's strings of ``ids`` (None if unknown), read only when
    a draft vocabulary needs them.

    Online: the target (bf16 on GPU, fp32 on CPU; only its forward runs, under no_grad) and prepared datasets.
    Offline (``data`` is a capture, data/capture.py): the capture's rows and a stand-in for the target
    holding its config, final norm and LM head; no target layers are loaded.
    """
    from .capture import is_capture

    stages = {"n_stages": None if cfg.boundaries else cfg.n_stages, "boundaries": cfg.boundaries}
    sources = cfg.data if isinstance(cfg.data, list) else [cfg.data]
    if len(sources) > 1 and any(is_capture(s) for s in sources):
        raise SpdInputError(f"a mixture of datasets is prepared online; a capture cannot be one of them, got {sources}")
    if len(sources) == 1 and is_capture(sources[0]):
        return _load_offline(cfg, accelerator, sources[0], stages)
    return _load_online(cfg, accelerator, sources, stages)


def _load_offline(cfg: DistillConfig, accelerator: Accelerator, source: str, stages: dict) -> tuple:
    """:func:`load_target_and_data` from the capture ``source``: its stand-in for the target and its rows, the
    held-out rows captures of the same target."""
    from .capture import CapturedDataset, CapturedTarget, collate_captured, is_capture

    target = CapturedTarget(source, device=accelerator.device, **stages)
    train_ds = CapturedDataset(source)
    eval_ds = {}
    for name, path in eval_sets(cfg.eval_data).items():
        if not is_capture(path):
            raise SpdInputError(
                f"data is a capture, so eval_data must be one too (data/capture.py over the "
                f"held-out rows), got '{path}'; or pass eval_data=none"
            )
        eval_ds[name] = CapturedDataset(path)
        if eval_ds[name].manifest["target_config"] != train_ds.manifest["target_config"]:
            raise SpdInputError(f"the captures '{cfg.data}' and '{path}' come from different targets")
    if train_ds.teacher == "topk" and cfg.tau != 1:
        raise SpdInputError(f"a top-k capture holds the teacher at temperature 1; train it with tau=1, got {cfg.tau}")
    if train_ds.teacher == "topk" and cfg.draft_vocab_size:
        raise SpdInputError(
            "draft_vocab_size needs the full teacher (the target's distribution restricted to the "
            "draft tokens); capture with --teacher full"
        )
    pad_id = train_ds.manifest["pad_id"]
    collate_fn = partial(collate_captured, pad_id=pad_id, multiple=cfg.pad_to_multiple_of, limit=cfg.max_length)
    return target, train_ds, eval_ds, collate_fn, target.token_strings


def _load_online(cfg: DistillConfig, accelerator: Accelerator, sources: list[str], stages: dict) -> tuple:
    """:func:`load_target_and_data` with the target loaded: ``sources`` prepared (their rows mixed) and the held-out
    sets."""
    from datasets import concatenate_datasets

    from ..data.prepare import DataConfig, prepare_dataset
    from ..target.staging import StagedModel
    from ..target.tokenizer import load_tokenizer
    from .distill import collate

    on_gpu = torch.cuda.is_available()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
        cfg.target_dtype, torch.bfloat16 if on_gpu else torch.float32
    )
    staged = StagedModel.from_pretrained(
        cfg.target, revision=cfg.target_revision, device=accelerator.device, dtype=dtype, **stages
    )
    staged.requires_grad_(False)
    tokenizer = load_tokenizer(cfg.target, revision=cfg.target_revision)
    data_cfg = DataConfig(max_length=cfg.max_length, overflow=cfg.overflow, revision=cfg.data_revision)
    with accelerator.main_process_first():
        parts = [
            prepare_dataset(source, tokenizer, data_cfg, cfg.cache_dir, report=accelerator.print) for source in sources
        ]
        train_ds = parts[0] if len(parts) == 1 else concatenate_datasets(parts)  # shuffled by the loader
        eval_ds = {
            name: prepare_dataset(path, tokenizer, data_cfg, cfg.cache_dir, report=accelerator.print)
            for name, path in eval_sets(cfg.eval_data).items()
        }
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    collate_fn = partial(collate, pad_id=pad_id, multiple=cfg.pad_to_multiple_of, limit=cfg.max_length)
    return staged, train_ds, eval_ds, collate_fn, tokenizer.convert_ids_to_tokens
