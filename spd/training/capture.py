"""Offline target states: run the frozen target once over a prepared dataset and keep what training needs.

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

Shards are planned from the row lengths before anything runs, and the target's batches never cross a
shard, so an interrupted capture resumes at the first missing shard and ends bit-identical.

Shape suffixes: T tokens of a shard, R rows, D hidden, V vocabulary, K top-k.
"""

from __future__ import annotations

import bisect
import os
import re
import shutil
from dataclasses import asdict, dataclass
from itertools import accumulate
from pathlib import Path

import torch
from torch import nn

from ..errors import SpdInputError, first_line
from ..files import atomic_path, check_free_space, temp_pattern, write_json_atomic
from ..reading import FLOATING, INTEGER, load_safetensors, read_json, safetensors_header
from ..target.staging import TargetShape

MANIFEST = "capture.json"
TEACHER_FILE = "teacher.safetensors"
TOKENS_FILE = "tokens.json"  # the target tokenizer's token strings by id (draft vocabularies check against them)
AGAIN = "data/capture.py writes (capture it again)"  # what a damaged file of a capture was expected to be
FORMAT = 1
TEACHERS = ("full", "topk")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def is_capture(path: str | os.PathLike | None) -> bool:
    """Whether ``path`` is a capture directory (has a manifest)."""
    return path is not None and (Path(path).expanduser() / MANIFEST).is_file()


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
        manifest = _load_manifest(out, out)
        if manifest.get("settings") != asdict(settings):
            raise SpdInputError(
                f"'{out}' holds a capture made with other settings ({_diff(manifest['settings'], asdict(settings))}); "
                "pass another output directory or delete it"
            )
        if manifest["complete"]:
            report(f"[capture] {out} is complete: {manifest['rows']} rows, {manifest['tokens']} tokens")
            return manifest
        report(f"[capture] resuming {out}: {len(manifest['shards'])} of {len(shards)} shards done")
        _remove_leftovers(out)
        # What the remaining shards take must fit too (the disk may have filled since the capture began).
        done = sum(s.get("tokens", 0) for s in manifest["shards"] if isinstance(s, dict))
        _check_free(
            out,
            max(0, total_tokens - done) * bytes_per_token(settings, hidden_size, num_layers),
            "the rest of the capture",
        )
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


def _load_manifest(root: Path, path) -> dict:
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
    manifest = _load_manifest(root, path)
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
