"""Writing a capture (:mod:`.capture` says what it holds): the frozen target run once over a prepared dataset, its
states stored shard by shard.

Shards are planned from the row lengths before anything runs, and the target's batches never cross a
shard, so an interrupted capture resumes at the first missing shard and ends bit-identical.

Shape suffixes: T tokens of a shard, R rows, D hidden, V vocabulary, K top-k.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import asdict, dataclass
from itertools import accumulate
from pathlib import Path

import torch

from ..errors import SpdInputError
from ..files import atomic_path, check_free_space, temp_pattern, write_json_atomic
from .capture import FORMAT, MANIFEST, TEACHER_FILE, TOKENS_FILE, checked_manifest

TEACHERS = ("full", "topk")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class CaptureSettings:
    """What a capture stores; a resumed capture must ask for the same."""

    target: str
    target_revision: str | None
    anchors: list[int]  # hidden-state indices stored (H^L is added for the full teacher)
    dtype: str  # of the stored states and LM head
    teacher: str  # full | topk
    topk: int  # k for the top-k teacher (0 otherwise)
    shard_tokens: int  # a shard closes after the row that reaches this many tokens
    batch_tokens: int  # padded tokens per target forward
    data_fingerprint: str  # of the prepared rows: their source, tokenizer and preparation settings, and count


def anchors_for_stages(num_layers: int, stages: list[int]) -> list[int]:
    """The union of the default anchors (docs/method.md §2) of the cuts into each n of ``stages``: the equal cut, or
    where n does not divide the layers the balanced one (:func:`spd.target.cut.balanced_boundaries`, as the presets
    for such targets use); other cuts name their anchors with ``--anchors``."""
    from ..heads.config import default_anchors
    from ..target.cut import balanced_boundaries

    out: set[int] = set()
    for n in stages:
        if not 1 <= n <= num_layers:
            raise SpdInputError(f"{n} stages cannot cut the target's {num_layers} layers; expected 1 to {num_layers}")
        out.update(a for depth in default_anchors(balanced_boundaries(num_layers, n)) for a in depth)
    return sorted(out)


def plan_shards(lengths: list[int], shard_tokens: int) -> list[tuple[int, int]]:
    """Row ranges ``[start, end)`` of the shards: a shard closes after the row that reaches ``shard_tokens``."""
    shards, start, tokens = [], 0, 0
    for i, length in enumerate(lengths):
        tokens += length
        if tokens >= shard_tokens:
            shards.append((start, i + 1))
            start, tokens = i + 1, 0
    if start < len(lengths):
        shards.append((start, len(lengths)))
    return shards


def row_lengths(dataset) -> list[int]:
    """Every row's length, read a column batch at a time (a million-row dataset never sits in Python lists)."""
    lengths: list[int] = []
    for batch in dataset.iter(batch_size=4096):
        lengths.extend(len(ids) for ids in batch["input_ids"])
    return lengths


def bytes_per_token(settings: CaptureSettings, hidden_size: int, num_layers: int) -> int:
    """Disk bytes one captured token takes."""
    states = len(stored_states(settings, num_layers))
    item = _DTYPES[settings.dtype].itemsize
    topk = settings.topk * 8 if settings.teacher == "topk" else 0  # int32 id + fp32 log-prob
    return states * hidden_size * item + 4 + 1 + topk


def stored_states(settings: CaptureSettings, num_layers: int) -> list[int]:
    """Hidden-state indices a shard holds: the anchors, plus H^L for the full teacher."""
    return sorted(set(settings.anchors) | ({num_layers} if settings.teacher == "full" else set()))


def _batches(lengths: list[int], start: int, end: int, batch_tokens: int):
    """Consecutive row ranges of one shard whose padded size stays within ``batch_tokens`` (at least one row)."""
    lo = start
    while lo < end:
        hi, longest = lo, 0
        while hi < end and (hi == lo or max(longest, lengths[hi]) * (hi - lo + 1) <= batch_tokens):
            longest = max(longest, lengths[hi])
            hi += 1
        yield lo, hi
        lo = hi


@torch.no_grad()
def capture(
    staged,
    dataset,
    out_dir: str | os.PathLike,
    settings: CaptureSettings,
    pad_id: int = 0,
    source: dict | None = None,
    tokens: list[str] | None = None,
    report=print,
) -> dict:
    """Run ``staged`` over ``dataset`` (prepared rows) and write the capture to ``out_dir``; resumes."""
    from safetensors.torch import save_file

    out = Path(out_dir).expanduser()
    num_layers, hidden_size = staged.num_layers, staged.config.hidden_size
    _check_settings(settings, num_layers, staged.vocab_size)
    dtype = _DTYPES[settings.dtype]
    lengths = row_lengths(dataset)
    shards = plan_shards(lengths, settings.shard_tokens)
    states = stored_states(settings, num_layers)
    total_tokens = sum(lengths)
    need = (
        total_tokens * bytes_per_token(settings, hidden_size, num_layers)
        + staged.vocab_size * hidden_size * dtype.itemsize
    )

    manifest_path = out / MANIFEST
    if manifest_path.is_file():
        manifest = _resume(out, settings, lengths, len(shards), hidden_size, num_layers, report)
        if manifest["complete"]:
            return manifest
    else:
        manifest = _begin(out, staged, settings, lengths, len(shards), need, pad_id, source, tokens, report)

    for index in range(len(manifest["shards"]), len(shards)):
        start, end = shards[index]
        shard = _shard_tensors(
            staged, dataset.select(range(start, end)), lengths, start, end, settings, states, pad_id, dtype
        )
        name = f"shard-{index:05d}.safetensors"
        with atomic_path(out / name) as tmp:  # a shard exists only once it is whole
            save_file(shard, str(tmp))
        manifest["shards"].append({"file": name, "rows": end - start, "tokens": sum(lengths[start:end])})
        write_json_atomic(manifest_path, manifest)
        report(f"[capture] shard {index + 1}/{len(shards)}: rows {start}..{end - 1}")
    manifest["complete"] = True
    write_json_atomic(manifest_path, manifest)
    report(f"[capture] done: {out} ({sum(p.stat().st_size for p in out.iterdir()) / 2**30:.2f} GiB)")
    return manifest


def _resume(
    out: Path,
    settings: CaptureSettings,
    lengths: list[int],
    shard_count: int,
    hidden_size: int,
    num_layers: int,
    report,
) -> dict:
    """The manifest of the capture begun in ``out``, checked to ask for the same ``settings``; unless it is complete,
    what a killed run left is removed and the rest of the capture checked to fit on the disk."""
    manifest = checked_manifest(out, out)
    if manifest.get("settings") != asdict(settings):
        raise SpdInputError(
            f"'{out}' holds a capture made with other settings ({_diff(manifest['settings'], asdict(settings))}); "
            "pass another output directory or delete it"
        )
    if manifest["complete"]:
        report(f"[capture] {out} is complete: {manifest['rows']} rows, {manifest['tokens']} tokens")
        return manifest
    report(f"[capture] resuming {out}: {len(manifest['shards'])} of {shard_count} shards done")
    _remove_leftovers(out)
    # What the remaining shards take must fit too (the disk may have filled since the capture began).
    done = sum(s.get("tokens", 0) for s in manifest["shards"] if isinstance(s, dict))
    _check_free(
        out,
        max(0, sum(lengths) - done) * bytes_per_token(settings, hidden_size, num_layers),
        "the rest of the capture",
    )
    return manifest


def _begin(out: Path, staged, settings, lengths, shard_count, need, pad_id, source, tokens, report) -> dict:
    """A new capture in ``out``: the disk checked, the teacher (and the token strings) written, and a manifest with
    no shard yet; returns the manifest."""
    from safetensors.torch import save_file

    dtype = _DTYPES[settings.dtype]
    states = stored_states(settings, staged.num_layers)
    total_tokens = sum(lengths)
    out.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(out)
    free = shutil.disk_usage(out).free
    report(
        f"[capture] {len(lengths)} rows, {total_tokens} tokens, {shard_count} shards, states {states} in "
        f"{settings.dtype}, teacher {settings.teacher}: needs {need / 2**30:.2f} GiB on disk "
        f"({free / 2**30:.1f} GiB free)"
    )
    _check_free(out, need, "the capture")
    teacher = {
        "norm_scale": staged.norm_scale().to(dtype).contiguous(),
        "lm_head": staged.lm_head.weight.detach().to(dtype).contiguous(),
    }
    with atomic_path(out / TEACHER_FILE) as tmp:
        save_file(teacher, str(tmp))
    if tokens is not None:
        write_json_atomic(out / TOKENS_FILE, tokens)
    config = staged.config.to_dict()
    manifest = {
        "format": FORMAT,
        "settings": asdict(settings),
        "target_config": config,
        "num_layers": staged.num_layers,
        "hidden_size": staged.config.hidden_size,
        "vocab_size": staged.vocab_size,
        "norm_eps": staged.norm_eps,
        "pad_id": pad_id,
        "states": states,
        "source": source or {},
        "rows": len(lengths),
        "tokens": total_tokens,
        "bytes": need,
        "shards": [],
        "complete": False,
    }
    write_json_atomic(out / MANIFEST, manifest)
    return manifest


def _check_settings(settings: CaptureSettings, num_layers: int, vocab_size: int) -> None:
    """Refuse (one sentence) anchors, a teacher or a k the target cannot give."""
    bad = [a for a in settings.anchors if not 0 <= a <= num_layers]
    if bad:
        raise SpdInputError(
            f"anchors {bad} are not hidden-state indices of a {num_layers}-layer target (0..{num_layers})"
        )
    if settings.teacher not in TEACHERS:
        raise SpdInputError(f"teacher must be one of {', '.join(TEACHERS)}, got '{settings.teacher}'")
    if settings.teacher == "topk" and not 1 <= settings.topk < vocab_size:
        raise SpdInputError(f"topk must be in 1..{vocab_size - 1} for the top-k teacher, got {settings.topk}")


def _shard_tensors(
    staged,
    part,
    lengths: list[int],
    start: int,
    end: int,
    settings: CaptureSettings,
    states: list[int],
    pad_id: int,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """The tensors of the shard of rows ``[start, end)`` (``part``, those rows of the dataset): the target run over
    them in batches that never cross the shard, its states (and top-k teacher) concatenated row after row."""
    ids_all, mask_all = part["input_ids"], part["loss_mask"]  # one shard's rows in Python at a time
    tensors: dict[str, list[torch.Tensor]] = {}
    for lo, hi in _batches(lengths, start, end, settings.batch_tokens):
        rows = ids_all[lo - start : hi - start]
        width = max(lengths[lo:hi])
        ids_BN = torch.full((hi - lo, width), pad_id, dtype=torch.long)
        for b, row in enumerate(rows):
            ids_BN[b, : len(row)] = torch.tensor(row)
        hidden = staged.hidden_states(ids_BN.to(staged.device), states)
        if settings.teacher == "topk":
            logp_BNV = torch.log_softmax(staged.logits(hidden[staged.num_layers]).float(), dim=-1)
            top = logp_BNV.topk(settings.topk, dim=-1)
        for b, row in enumerate(rows):
            n = len(row)
            for a in states:
                tensors.setdefault(f"hidden.{a}", []).append(hidden[a][b, :n].to("cpu", dtype))
            if settings.teacher == "topk":
                tensors.setdefault("topk_ids", []).append(top.indices[b, :n].to("cpu", torch.int32))
                tensors.setdefault("topk_logprobs", []).append(top.values[b, :n].cpu())
    shard = {name: torch.cat(parts).contiguous() for name, parts in tensors.items()}
    shard["input_ids"] = torch.tensor([t for row in ids_all for t in row], dtype=torch.int32)
    shard["loss_mask"] = torch.tensor([m for row in mask_all for m in row], dtype=torch.uint8)
    shard["offsets"] = torch.tensor([0, *accumulate(lengths[start:end])], dtype=torch.int64)
    return shard


# The capture's own files; what a killed capture left of them is removed when it resumes: atomic_path's
# temporaries, and the fixed <name>.tmp names earlier versions wrote to.
_OWN_FILES = r"shard-\d{5}\.safetensors|teacher\.safetensors|tokens\.json|capture\.json"
_LEFTOVERS = (temp_pattern(_OWN_FILES), re.compile(rf"(?:{_OWN_FILES})\.tmp"))


def _remove_leftovers(out: Path) -> None:
    for path in out.iterdir():
        if any(p.fullmatch(path.name) for p in _LEFTOVERS) and path.is_file() and not path.is_symlink():
            path.unlink(missing_ok=True)


def _check_free(out: Path, need: int, what: str) -> None:
    check_free_space(out, need, what, "capture fewer rows (--max-tokens) or fewer anchors")


def _diff(old: dict, new: dict) -> str:
    return ", ".join(f"{k}: {old.get(k)!r} there vs {new.get(k)!r} now" for k in new if old.get(k) != new.get(k))
