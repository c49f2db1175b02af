"""Building the testbed: each component (corpus, tokenizer, target, draft) cached under the settings it depends on,
and written only where the builder wrote before (the package docstring says how it recognises that)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

from ..errors import SpdInputError
from ..files import (
    atomic_file,
    rename_dir,
    replace_file,
    temp_dir_beside,
    temp_pattern,
    write_json_atomic,
    write_text_atomic,
)
from ..paths import default_testbed_dir
from .config import ModelSpec, TestbedConfig
from .corpus import build_corpus, make_prompts, stdlib_dir
from .tokenizer import SPECIAL_TOKENS, tokenize_split, train_tokenizer
from .training import evaluate_loss, train_model


def _key(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _save_model_dir(model, tokenizer, out_dir: Path, meta: dict) -> None:
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id

    def save(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    _install_dir(out_dir, save, meta)


MARKER = "testbed_build.json"  # in tokenizer/, target/, draft/: the component's key and the files the build wrote
CORPUS_MARKER = "corpus.json"
COMPONENT_DIRS = {"corpus": CORPUS_MARKER, "tokenizer": MARKER, "target": MARKER, "draft": MARKER}
_STREAM = re.compile(r"(train|validation)\.[0-9a-f]{16}\.npy")  # token streams the builder caches in corpus/
_TEMP_DIR = temp_pattern("tokenizer|target|draft")  # _install_dir's temporary directories, left by a killed build


def _install_dir(out_dir: Path, save, meta: dict) -> None:
    """``save(tmp)`` into a new temporary directory beside ``out_dir``, then put its files in place.

    A new ``out_dir`` is the temporary directory renamed. An existing one (ours, empty, or forced) gets the new
    files over their namesakes; of the rest, only files the previous build's marker lists are removed.
    """
    tmp = temp_dir_beside(out_dir)
    try:
        save(tmp)
        files = sorted(p.name for p in tmp.iterdir() if p.name != MARKER)
        if not out_dir.exists():
            write_json_atomic(tmp / MARKER, {**meta, "files": files})
            rename_dir(tmp, out_dir)
            return
        old = _read_json(out_dir / MARKER)
        old_files = old.get("files", []) if isinstance(old, dict) and isinstance(old.get("files"), list) else []
        old_files = [f for f in old_files if isinstance(f, str) and "/" not in f and f not in ("", ".", "..")]
        # Killed from here on, the directory is still recognised as ours, and its key forces a rebuild.
        write_json_atomic(out_dir / MARKER, {"key": None, "files": sorted(set(old_files) | set(files))})
        for name in files:
            replace_file(tmp / name, out_dir / name)
        for name in set(old_files) - set(files):
            (out_dir / name).unlink(missing_ok=True)
        write_json_atomic(out_dir / MARKER, {**meta, "files": files})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _is_prompts_file(path: Path) -> bool:
    """Whether ``path`` is a prompts file the builder wrote (its first row has exactly our keys)."""
    try:
        with open(path, encoding="utf-8") as f:
            first = f.readline()
        return set(json.loads(first)) == {"prompt", "path", "line"} if first.strip() else path.stat().st_size == 0
    except (OSError, ValueError, TypeError):
        return False


def _is_testbed_json(path: Path) -> bool:
    info = _read_json(path)
    return isinstance(info, dict) and {"settings", "corpus", "tokens", "target", "draft"} <= set(info)


def _owned(path: Path, kind: str) -> bool | None:
    """True: absent, empty or written by the builder; False: someone else's; None: a file where a directory
    goes or the other way round (not even ``force`` writes there)."""
    if not path.exists() and not path.is_symlink():
        return True
    if kind == "dir":
        if not path.is_dir():
            return None
        if not any(path.iterdir()):
            return True
        marker = _read_json(path / COMPONENT_DIRS[path.name])
        return isinstance(marker, dict) and "key" in marker
    if not path.is_file():
        return None
    return _is_prompts_file(path) if path.name == "prompts.jsonl" else _is_testbed_json(path)


def check_outputs(out: Path, force: bool = False) -> None:
    """Refuse (one sentence) to build where the builder would write over paths it did not write."""
    if out.exists() and not out.is_dir():
        raise SpdInputError(f"the testbed output '{out}' is a file; expected a directory")
    paths = [(out / name, "dir") for name in COMPONENT_DIRS] + [
        (out / "prompts.jsonl", "file"),
        (out / "testbed.json", "file"),
    ]
    owned = {path: _owned(path, kind) for path, kind in paths}
    clash = [
        f"{p.name} ({'not a directory' if kind == 'dir' else 'not a file'})" for p, kind in paths if owned[p] is None
    ]
    if clash:
        raise SpdInputError(f"'{out}' has {', '.join(clash)} where the testbed writes its own; pass another --out")
    foreign = [f"{p.name}/" if kind == "dir" else p.name for p, kind in paths if owned[p] is False]
    if foreign and not force:
        raise SpdInputError(
            f"'{out}' already holds {', '.join(foreign)}, which the testbed builder did not write; "
            "pass another --out, or --force to write the testbed's files beside their contents"
        )


def build_testbed(
    out: str | os.PathLike | None = None, cfg: TestbedConfig | None = None, progress: bool = True, force: bool = False
) -> dict:
    """Build (or reuse) the testbed under ``out`` and return the contents of ``testbed.json``. It trains on every
    core (``OMP_NUM_THREADS`` when it is a positive count) and gives the caller its own thread count back."""
    threads, asked = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS", "").strip()
    torch.set_num_threads(int(asked) if asked.isdigit() and int(asked) > 0 else max(1, os.cpu_count() or 1))
    try:
        return _build(out, cfg, progress, force)
    finally:
        torch.set_num_threads(threads)


def _build(out, cfg: TestbedConfig | None, progress: bool, force: bool) -> dict:
    out = Path(out) if out is not None else default_testbed_dir()
    cfg = cfg or TestbedConfig()
    check_outputs(out, force)
    out.mkdir(parents=True, exist_ok=True)
    for leftover in out.iterdir():
        if _TEMP_DIR.fullmatch(leftover.name) and leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)
    settings = dataclasses.asdict(cfg)
    existing = _read_json(out / "testbed.json")
    # Each component complete: a build killed while it put a directory in place left that marker's key null.
    done = (
        all(
            isinstance(m := _read_json(out / name / marker), dict) and m.get("key")
            for name, marker in COMPONENT_DIRS.items()
        )
        and (out / "prompts.jsonl").is_file()
    )
    if existing and existing.get("settings") == settings and done:
        return existing

    from transformers import AutoTokenizer

    # Each component is keyed by the settings it depends on, so a changed model spec reuses the corpus.
    corpus_dir = out / "corpus"
    corpus_meta = _corpus(corpus_dir, cfg)
    tok_key = _key([corpus_meta["sha256"], cfg.vocab_size])
    tok_dir = out / "tokenizer"
    tok_meta = _read_json(tok_dir / MARKER)
    if not isinstance(tok_meta, dict) or tok_meta.get("key") != tok_key:
        hf_tok = train_tokenizer(corpus_dir, cfg.vocab_size, 4 * cfg.target.seq_len)
        _install_dir(tok_dir, hf_tok.save_pretrained, {"key": tok_key})
        _remove_streams(corpus_dir)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    streams = _token_streams(corpus_dir, tok_key, tokenizer)
    models = {
        name: _model(out / name, name, cfg, tok_key, tokenizer, streams, progress) for name in ("target", "draft")
    }

    prompts = make_prompts(corpus_dir, 100, cfg.seed)
    write_text_atomic(out / "prompts.jsonl", "".join(json.dumps(p) + "\n" for p in prompts))

    result = {
        "settings": settings,
        "corpus": {k: v for k, v in corpus_meta.items() if k != "key"},
        "tokens": {split: int(len(s)) for split, s in streams.items()},
        "tokenizer": {"vocab_size": len(tokenizer), "special_tokens": SPECIAL_TOKENS},
        "target": models["target"],
        "draft": models["draft"],
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }
    write_json_atomic(out / "testbed.json", result)
    return result


def _corpus(corpus_dir: Path, cfg: TestbedConfig) -> dict:
    """The corpus marker's contents, the corpus built first unless it is there for these settings."""
    corpus_key = _key([cfg.val_fraction, cfg.max_files, str(stdlib_dir())])
    corpus_meta = _read_json(corpus_dir / CORPUS_MARKER)
    if not isinstance(corpus_meta, dict) or corpus_meta.get("key") != corpus_key:
        corpus_dir.mkdir(exist_ok=True)
        # Marked as ours before anything is written into it, so a killed build is resumed, not refused.
        write_json_atomic(corpus_dir / CORPUS_MARKER, {"key": None})
        corpus_meta = {"key": corpus_key, **build_corpus(corpus_dir, cfg)}
        write_json_atomic(corpus_dir / CORPUS_MARKER, corpus_meta)
        _remove_streams(corpus_dir)
    return corpus_meta


def _token_streams(corpus_dir: Path, tok_key: str, tokenizer) -> dict[str, np.ndarray]:
    """Both splits as token streams, tokenized once per tokenizer and cached in the corpus directory."""
    streams = {}
    for split in ("train", "validation"):
        path = corpus_dir / f"{split}.{tok_key}.npy"
        if not path.exists():
            arr = tokenize_split(corpus_dir, split, tokenizer)
            with atomic_file(path, "wb") as f:
                np.save(f, arr)
        streams[split] = np.load(path)
    return streams


def _model(
    model_dir: Path, name: str, cfg: TestbedConfig, tok_key: str, tokenizer, streams: dict, progress: bool
) -> dict:
    """The record of the target or the draft (``name``) in ``testbed.json``, the model trained, evaluated and saved
    first unless ``model_dir`` holds it for these settings."""
    spec: ModelSpec = getattr(cfg, name)
    model_key = _key([tok_key, dataclasses.asdict(spec), cfg.seed, cfg.eval_tokens])
    meta = _read_json(model_dir / MARKER)
    if not isinstance(meta, dict) or meta.get("key") != model_key:
        model, record = train_model(name, spec, tokenizer, streams["train"], cfg.seed, progress=progress)
        val_loss = evaluate_loss(model, streams["validation"], spec.seq_len, cfg.eval_tokens)
        meta = {
            "key": model_key,
            "architecture": "LlamaForCausalLM",
            "spec": dataclasses.asdict(spec),
            "parameters": sum(p.numel() for p in model.parameters()),
            **record,
            "validation_loss": round(val_loss, 4),
            "validation_perplexity": round(math.exp(val_loss), 2),
            "validation_tokens": min(len(streams["validation"]) - 1, cfg.eval_tokens) // spec.seq_len * spec.seq_len,
        }
        _save_model_dir(model, tokenizer, model_dir, meta)
    return {k: v for k, v in meta.items() if k not in ("key", "files")}


def _remove_streams(corpus_dir: Path) -> None:
    """Drop the cached token streams (only files named as the builder names them)."""
    for stale in corpus_dir.iterdir():
        if _STREAM.fullmatch(stale.name) and stale.is_file():
            stale.unlink()
