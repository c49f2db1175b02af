"""Offline target states (a capture): what a capture directory holds, read back for training with every file checked:
its rows (:class:`CapturedDataset`) and the target's stand-in (:class:`CapturedTarget`). :mod:`.capture_writer` runs
the frozen target once over a prepared dataset and writes one.

Training a head online runs the target's forward for every batch of every head; a capture runs it once,
and every head trained from it (variants, n, L_s, seeds) reads the stored states instead. A capture
directory holds:

- ``capture.json``: the manifest (target and revision, the target's config, anchors, dtype, teacher kind,
  rows and tokens, the shards done so far); rewritten atomically after every shard, ``complete`` at the end;
- ``teacher.safetensors``: the target's final-norm scale and LM head, so that training needs no target;
- ``tokens.json``: the tokenizer's token strings by id (when the target has a tokenizer);
- ``shard-NNNNN.safetensors``: concatenated rows: ``input_ids`` and ``loss_mask`` (T,), ``offsets`` (R+1,),
  ``hidden.{a}`` (T, D) for every captured anchor ``a``, and with a top-k teacher ``topk_ids`` /
  ``topk_logprobs`` (T, k). Shards are read lazily through safetensors' memory map.

Teacher: ``full`` stores ``H^L`` and reproduces the target's whole distribution at training time through
the stored norm and LM head (exact; the LM head's cost is paid while training); ``topk`` stores the top-k
log-probabilities at temperature 1 and trains on k + 1 buckets (the top k and the rest of the mass), so the
trainer skips the target's LM head (cheaper over a 150k-250k vocabulary; approximate).

Shape suffixes: T tokens of a shard, R rows, D hidden, V vocabulary, K top-k.
"""

from __future__ import annotations

import bisect
import os
import re
from itertools import accumulate
from pathlib import Path

import torch
from torch import nn

from ..errors import SpdInputError, first_line
from ..reading import FLOATING, INTEGER, load_safetensors, read_json, safetensors_header
from ..target.staging import TargetShape

MANIFEST = "capture.json"
TEACHER_FILE = "teacher.safetensors"
TOKENS_FILE = "tokens.json"  # the target tokenizer's token strings by id (draft vocabularies check against them)
AGAIN = "data/capture.py writes (capture it again)"  # what a damaged file of a capture was expected to be
FORMAT = 1


def is_capture(path: str | os.PathLike | None) -> bool:
    """Whether ``path`` is a capture directory (has a manifest)."""
    return path is not None and (Path(path).expanduser() / MANIFEST).is_file()


_SHARD_NAME = re.compile(r"shard-\d{5}\.safetensors")
# Manifest keys and their JSON types (what the trainer reads); a manifest lacking one, or of another type, is corrupt.
_MANIFEST_KEYS = {
    "format": int,
    "settings": dict,
    "target_config": dict,
    "num_layers": int,
    "hidden_size": int,
    "vocab_size": int,
    "norm_eps": (int, float),
    "pad_id": int,
    "states": list,
    "rows": int,
    "tokens": int,
    "shards": list,
    "complete": bool,
}


def checked_manifest(root: Path, path: str | os.PathLike) -> dict:
    """The manifest of the capture at ``root`` with every field the trainer reads checked, or one clear error."""
    manifest = read_json(root / MANIFEST, "capture manifest", f"the {MANIFEST} that {AGAIN}")
    bad = [
        k
        for k, kind in _MANIFEST_KEYS.items()
        if not isinstance(manifest.get(k), kind) or (kind is int and isinstance(manifest[k], bool))
    ]
    if not bad:
        bad = [
            f"shards[{i}]"
            for i, s in enumerate(manifest["shards"])
            if not (
                isinstance(s, dict)
                and isinstance(s.get("file"), str)
                and _SHARD_NAME.fullmatch(s["file"])
                and all(isinstance(s.get(k), int) and s[k] >= 0 for k in ("rows", "tokens"))
            )
        ]
        bad += ["states"] if not all(isinstance(a, int) and not isinstance(a, bool) for a in manifest["states"]) else []
        bad += [f"settings.{k}" for k in ("teacher", "dtype") if not isinstance(manifest["settings"].get(k), str)]
    if bad:
        raise SpdInputError(
            f"the capture '{path}' has a corrupt {MANIFEST} (missing or malformed: "
            f"{', '.join(bad[:4])}); capture it again with data/capture.py"
        )
    return manifest


def read_manifest(path: str | os.PathLike) -> dict:
    """A complete capture's manifest, or one clear error."""
    root = Path(path).expanduser()
    if not (root / MANIFEST).exists():
        raise SpdInputError(f"'{path}' is not a capture directory (no {MANIFEST}); make one with data/capture.py")
    manifest = checked_manifest(root, path)
    if manifest.get("format") != FORMAT:
        raise SpdInputError(f"the capture '{path}' has format {manifest.get('format')}; this version reads {FORMAT}")
    if not manifest["complete"]:
        raise SpdInputError(
            f"the capture '{path}' is incomplete ({len(manifest['shards'])} shards); run "
            "data/capture.py again with the same arguments to finish it"
        )
    if sum(s["rows"] for s in manifest["shards"]) != manifest["rows"]:
        raise SpdInputError(
            f"the capture '{path}' has a corrupt {MANIFEST} (its shards hold "
            f"{sum(s['rows'] for s in manifest['shards'])} rows, it says {manifest['rows']})"
        )
    return manifest


def check_shards(root: Path, manifest: dict, path) -> None:
    """Check every shard's header against its file and the manifest (tensors, dtypes, shapes, offsets): a missing,
    truncated or mismatched shard is one error now, not a failure in the middle of training."""
    from safetensors import SafetensorError, safe_open

    names = {"input_ids", "loss_mask", "offsets", *(f"hidden.{a}" for a in manifest["states"])}
    if manifest["settings"]["teacher"] == "topk":
        names |= {"topk_ids", "topk_logprobs"}
    hidden = manifest["hidden_size"]
    for shard in manifest["shards"]:
        file = root / shard["file"]
        tokens = shard["tokens"]
        header = safetensors_header(file, "capture shard", None, f"a complete shard that {AGAIN}")
        shapes = {k: tuple(entry["shape"]) for k, entry in header.items()}
        want = {
            "input_ids": (tokens,),
            "loss_mask": (tokens,),
            "offsets": (shard["rows"] + 1,),
            **{f"hidden.{a}": (tokens, hidden) for a in manifest["states"]},
        }
        wrong = sorted(k for k in names if k not in shapes or (k in want and shapes[k] != want[k]))
        # Token ids, masks and offsets are integers; states and log-probabilities floating point.
        wrong += sorted(
            k
            for k in names & set(header)
            if (header[k]["dtype"] in INTEGER) != (k in ("input_ids", "loss_mask", "offsets", "topk_ids"))
        )
        if not wrong:
            try:
                with safe_open(str(file), framework="pt") as handle:
                    offsets = handle.get_tensor("offsets")
            except SafetensorError as exc:
                raise SpdInputError(
                    f"the capture shard '{file}' cannot be read ({first_line(exc)}); expected a complete shard "
                    f"that {AGAIN}"
                ) from None
            if int(offsets[0]) != 0 or int(offsets[-1]) != tokens or bool((offsets[1:] < offsets[:-1]).any()):
                wrong = ["offsets"]
        if wrong:
            raise SpdInputError(
                f"the capture shard '{file}' does not fit its {MANIFEST} (bad or missing: {', '.join(wrong[:4])}); "
                f"expected a complete shard that {AGAIN}"
            )


class CapturedDataset(torch.utils.data.Dataset):
    """Rows of a capture: ``input_ids``, ``loss_mask`` and the stored states, read lazily from the shards."""

    def __init__(self, path: str | os.PathLike):
        self.root = Path(path).expanduser()
        self.manifest = read_manifest(self.root)
        check_shards(self.root, self.manifest, path)
        self.states: list[int] = self.manifest["states"]
        self.teacher: str = self.manifest["settings"]["teacher"]
        self._ends = list(accumulate(s["rows"] for s in self.manifest["shards"]))
        self._open: dict[int, tuple] = {}  # shard -> (safe_open handle, offsets); per process (DataLoader workers)

    def __len__(self) -> int:
        return self.manifest["rows"]

    def _shard(self, index: int):
        if index not in self._open:
            from safetensors import safe_open

            handle = safe_open(str(self.root / self.manifest["shards"][index]["file"]), framework="pt")
            self._open[index] = (handle, handle.get_tensor("offsets").tolist())
        return self._open[index]

    def row_tokens(self):
        """Every row's ``(input_ids, loss_mask)``, without states, a shard at a time: for vocabulary counts."""
        for index in range(len(self._ends)):
            handle, offsets = self._shard(index)
            all_ids, all_masks = handle.get_tensor("input_ids").long(), handle.get_tensor("loss_mask").bool()
            for lo, hi in zip(offsets, offsets[1:]):
                yield all_ids[lo:hi], all_masks[lo:hi]

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < len(self):
            raise IndexError(i)
        index = bisect.bisect_right(self._ends, i)
        local = i - (self._ends[index - 1] if index else 0)
        handle, offsets = self._shard(index)
        lo, hi = offsets[local], offsets[local + 1]
        row = {
            "input_ids": handle.get_slice("input_ids")[lo:hi].long(),
            "loss_mask": handle.get_slice("loss_mask")[lo:hi].bool(),
            "hidden": {a: handle.get_slice(f"hidden.{a}")[lo:hi] for a in self.states},
        }
        if self.teacher == "topk":
            row["topk_ids"] = handle.get_slice("topk_ids")[lo:hi].long()
            row["topk_logprobs"] = handle.get_slice("topk_logprobs")[lo:hi]
        return row


def collate_captured(rows: list[dict], pad_id: int = 0, multiple: int = 1, limit: int | None = None) -> dict:
    """Right-pad captured rows: the batch of :func:`spd.training.distill.collate` plus ``hidden`` (and the top-k teacher)."""
    from .distill import collate

    batch = collate(rows, pad_id, multiple, limit)
    b, n = batch["input_ids"].shape
    padded = {f"hidden.{a}": h for a, h in rows[0]["hidden"].items()}
    if "topk_ids" in rows[0]:
        padded.update(topk_ids=rows[0]["topk_ids"], topk_logprobs=rows[0]["topk_logprobs"])
    out = {name: x.new_zeros(b, n, *x.shape[1:]) for name, x in padded.items()}
    for i, r in enumerate(rows):
        length = len(r["input_ids"])
        for a, h in r["hidden"].items():
            out[f"hidden.{a}"][i, :length] = h
        if "topk_ids" in r:
            out["topk_ids"][i, :length] = r["topk_ids"]
            out["topk_logprobs"][i, :length] = r["topk_logprobs"]
    batch["hidden"] = {a: out.pop(f"hidden.{a}") for a in rows[0]["hidden"]}
    return {**batch, **out}


class CapturedTarget(TargetShape, nn.Module):
    """What training needs of a target, from a capture: its shape (config, stages), final norm and LM head.

    Stands in for :class:`spd.target.staging.StagedModel` in the trainer (``new_head``, ``check_compatible``,
    teacher logits), without the target's layers.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        n_stages: int | None = None,
        boundaries: list[int] | None = None,
        device: str | torch.device = "cpu",
    ):
        super().__init__()
        from transformers import AutoConfig

        from ..target.cut import split_layers

        self.root = Path(path).expanduser()
        self.manifest = read_manifest(self.root)
        cfg = dict(self.manifest["target_config"])
        self.config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        self.num_layers = self.manifest["num_layers"]
        self.boundaries = split_layers(self.num_layers, n_stages, boundaries)
        teacher = self.root / TEACHER_FILE
        expected = f"the {TEACHER_FILE} that {AGAIN}"
        weights = load_safetensors(teacher, "capture's teacher file", FLOATING, str(device), expected)
        if set(weights) != {"lm_head", "norm_scale"} or weights["lm_head"].dim() != 2:
            raise SpdInputError(
                f"the capture's teacher file '{teacher}' holds {sorted(weights)}; expected the tensors lm_head "
                f"(V, D) and norm_scale, as {AGAIN}"
            )
        vocab, hidden = weights["lm_head"].shape
        # skip_init: no random initialisation, which would draw from the RNG the head's initialisation uses next
        self.lm_head = torch.nn.utils.skip_init(
            nn.Linear, hidden, vocab, bias=False, device=device, dtype=weights["lm_head"].dtype
        )
        self.lm_head.weight.data.copy_(weights["lm_head"])
        self.register_buffer("scale", weights["norm_scale"])
        self.eps = self.manifest["norm_eps"]
        self.requires_grad_(False)

    @property
    def settings(self) -> dict:
        return self.manifest["settings"]

    def token_strings(self, ids: list[int]) -> list[str | None] | None:
        """The target tokenizer's strings of ``ids`` (None for ids it lacks), or None if the capture has none."""
        path = self.root / TOKENS_FILE
        if not path.exists():
            return None
        tokens = read_json(path, "capture's token strings", f"the {TOKENS_FILE} that {AGAIN}", of=list)
        return [tokens[i] if i < len(tokens) else None for i in ids]

    def norm_scale(self) -> torch.Tensor:
        return self.scale

    def norm(self, hidden_BTD: torch.Tensor) -> torch.Tensor:
        x = hidden_BTD.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.scale * x.to(hidden_BTD.dtype)

    def logits(self, hidden_BTD: torch.Tensor) -> torch.Tensor:
        """The target's logits from H^L: ``lm_head(norm(H^L))``."""
        return self.lm_head(self.norm(hidden_BTD))
