"""The testbed's corpus: the Python standard library's own sources, split by file into train and validation, and
code prompts cut from the validation split."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sysconfig
from pathlib import Path
from typing import IO

from tqdm.auto import tqdm

from ..files import atomic_file
from .config import TestbedConfig

# Directories under the standard library that are not part of its own source code.
_EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def stdlib_dir() -> Path:
    """The directory of the running Python's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_source_files(root: Path) -> list[Path]:
    """All ``.py`` files under ``root``, sorted, without test folders and installed packages."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS)
        files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(files)


def _is_validation(relpath: str, val_fraction: float) -> bool:
    # Split by a hash of the path, so the split is stable when files are added or removed.
    h = int.from_bytes(hashlib.sha256(relpath.encode()).digest()[:8], "big")
    return h / 2**64 < val_fraction


def build_corpus(out_dir: Path, cfg: TestbedConfig) -> dict:
    """Write ``train.jsonl`` and ``validation.jsonl`` (one ``{"path", "text"}`` row per file) under out_dir."""
    root = stdlib_dir()
    files = stdlib_source_files(root)
    if cfg.max_files is not None:
        files = files[: cfg.max_files]
    if not files:
        raise RuntimeError(f"no .py files found under the standard library directory {root}")
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = {"train": 0, "validation": 0}
    chars = {"train": 0, "validation": 0}
    digest = hashlib.sha256()
    # Both splits are written beside their files and put in place only once both are whole and non-empty.
    with atomic_file(out_dir / "train.jsonl") as f_train, atomic_file(out_dir / "validation.jsonl") as f_val:
        _write_corpus(files, root, cfg, {"train": f_train, "validation": f_val}, counts, chars, digest)
        if counts["train"] == 0 or counts["validation"] == 0:
            raise RuntimeError(
                f"the corpus split is empty ({counts}); use more files (max_files) or another val_fraction"
            )
    return {
        "source": str(root),
        "python": platform.python_version(),
        "files": counts,
        "chars": chars,
        "sha256": digest.hexdigest(),
    }


def _write_corpus(
    files: list[Path], root: Path, cfg: TestbedConfig, out: dict[str, IO], counts: dict, chars: dict, digest
) -> None:
    """One JSON row per readable, non-empty file, into the (temporary) file of its split."""
    for path in tqdm(files, desc="corpus", unit="file"):
        rel = path.relative_to(root).as_posix()
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        split = "validation" if _is_validation(rel, cfg.val_fraction) else "train"
        out[split].write(json.dumps({"path": rel, "text": text}) + "\n")
        counts[split] += 1
        chars[split] += len(text)
        digest.update(rel.encode() + b"\0" + text.encode() + b"\0")


def make_prompts(corpus_dir: Path, count: int, seed: int, max_chars: int = 400) -> list[dict]:
    """Code prompts from the validation split: a run of whole lines starting at a seeded line of a file."""
    from ..data.regenerate import text_prefixes

    rows = [json.loads(line) for line in open(corpus_dir / "validation.jsonl")]
    return [
        {"prompt": p["text"], "path": rows[p["doc"]]["path"], "line": p["line"]}
        for p in text_prefixes([row["text"] for row in rows], count, seed, max_chars)
    ]


def _read_texts(path: Path) -> list[str]:
    with open(path) as f:
        return [json.loads(line)["text"] for line in f]
