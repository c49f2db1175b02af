"""The testbed: a small real target model, a smaller draft model and their tokenizer, built on this machine.

Everything is derived from the Python standard library's own source files (found with ``sysconfig``):
a train/validation corpus split by file, a byte-level BPE tokenizer trained on the train split, and two
Llama-architecture causal LMs trained from scratch on it. The result is a set of ordinary Hugging Face
directories (``target/``, ``draft/``, ``tokenizer/``) plus ``testbed.json`` with the settings and the
measured validation loss / perplexity of both models.

Builds are deterministic and cached per component: calling :func:`build_testbed` again with the same
settings does nothing. By default the models train for fixed step counts (about 15 + 4 minutes on the
2-core reference machine), so the result does not depend on how busy the machine is. A time budget
(``minutes``) instead derives the step count from the measured speed of the first steps; ``testbed.json``
records it, and passing it back as ``steps`` rebuilds the identical model.

The builder replaces only what it wrote itself: ``corpus/`` (recognised by its ``corpus.json``),
``tokenizer/``, ``target/`` and ``draft/`` (by their ``testbed_build.json``, which lists the files the build
wrote), ``prompts.jsonl`` and ``testbed.json`` (by their contents). Anything else at those paths is refused
(:class:`spd.errors.SpdInputError`) unless ``force``; even then the builder only writes its own files beside
what is there, and removes nothing it did not write.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import re
import shutil
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import numpy as np
import torch
from tqdm.auto import tqdm

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

# Directories under the standard library that are not part of its own source code.
_EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
CHAT_ROLES = ("system", "user", "assistant")
# Special tokens: BOS/EOS/PAD plus one marker per chat role, so chat-data code paths can be exercised.
SPECIAL_TOKENS = [BOS, EOS, PAD] + [f"<|{role}|>" for role in CHAT_ROLES]
# Each turn is "<|role|>\n{content}<|eos|>\n"; the assistant's turn ends with EOS like in most chat models.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass
class ModelSpec:
    """Architecture and training budget of one testbed model."""

    layers: int  # decoder layers
    hidden: int  # hidden size D
    heads: int  # attention heads
    kv_heads: int  # key/value heads (GQA when smaller than heads)
    ffn: int  # SwiGLU intermediate size
    steps: int | None  # optimizer steps (deterministic); None: derive them from `minutes`
    minutes: float | None = None  # wall-clock training budget, used only when `steps` is None
    lr: float = 3e-3  # peak AdamW learning rate (warmup, then cosine decay to 10%)
    warmup_steps: int = 100
    batch_size: int = 16
    seq_len: int = 256  # training window; the models' max_position_embeddings is 4x this
    compile: bool = True  # torch.compile the forward/backward (~1.4x tokens/s on a 2-core CPU); eager fallback


@dataclass
class TestbedConfig:
    """All settings of a testbed build; the cache key of every component."""

    vocab_size: int = 4096
    val_fraction: float = 0.05  # share of files (by hash of the path) held out for validation
    max_files: int | None = None  # use only the first N files (sorted by path): for miniature builds
    seed: int = 0
    eval_tokens: int = 131072  # validation tokens used for the reported loss/perplexity (cap)
    # The target: 8 layers so that 1, 2, 4 and 8 stages divide it. Calibrated on a 2-core CPU (MEASURED.md):
    # smaller-and-longer beats wider-and-shorter within a 20-minute budget.
    # Step counts: what a 15- and a 4-minute budget gave on the idle reference machine (docs/testbed.md).
    target: ModelSpec = field(
        default_factory=lambda: ModelSpec(layers=8, hidden=128, heads=4, kv_heads=4, ffn=384, steps=1023)
    )
    draft: ModelSpec = field(
        default_factory=lambda: ModelSpec(layers=2, hidden=96, heads=4, kv_heads=4, ffn=256, steps=810)
    )


# ---------------------------------------------------------------------------------------------- corpus


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


# ------------------------------------------------------------------------------------------- tokenizer


def train_tokenizer(corpus_dir: Path, out_dir: Path, vocab_size: int, model_max_length: int, key: str):
    """Train a byte-level BPE on the train split and save it as a Hugging Face tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = _read_texts(corpus_dir / "train.jsonl")
    tok.train_from_iterator(tqdm(texts, desc="tokenizer", unit="file"), trainer=trainer, length=len(texts))
    bos_id = tok.token_to_id(BOS)
    # Every encoded text starts with BOS, as every training document does.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[f"<|{r}|>" for r in CHAT_ROLES],
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
    )
    _install_dir(out_dir, hf_tok.save_pretrained, {"key": key})
    return hf_tok


def tokenize_split(corpus_dir: Path, split: str, tokenizer) -> np.ndarray:
    """All files of a split as one uint16 token stream: ``BOS text EOS`` per file, in file order."""
    texts = _read_texts(corpus_dir / f"{split}.jsonl")
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    for start in tqdm(range(0, len(texts), 64), desc=f"tokenize {split}", unit="batch"):
        for row in tokenizer(texts[start : start + 64], verbose=False)["input_ids"]:
            ids.extend(row)
            ids.append(eos)
    return np.asarray(ids, dtype=np.uint16)


# -------------------------------------------------------------------------------------------- training


def make_llama(spec: ModelSpec, tokenizer, seed: int):
    """A freshly initialised LlamaForCausalLM for ``spec`` (fp32, sdpa attention)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden,
        intermediate_size=spec.ffn,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=4 * spec.seq_len,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    return model


def _lr_at(step: int, total: int, spec: ModelSpec) -> float:
    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    progress = min(1.0, (step - spec.warmup_steps) / max(1, total - spec.warmup_steps))
    return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate_loss(model, tokens: np.ndarray, seq_len: int, max_tokens: int, batch_size: int = 16) -> float:
    """Mean next-token cross-entropy over consecutive windows of the validation stream."""
    model.eval()
    n_windows = max(1, min(len(tokens) - 1, max_tokens) // seq_len)
    data = torch.from_numpy(tokens[: n_windows * seq_len + 1].astype(np.int64))
    total, count = 0.0, 0
    for start in range(0, n_windows, batch_size):
        idx = torch.arange(start, min(n_windows, start + batch_size))[:, None] * seq_len
        x = data[idx + torch.arange(seq_len)]
        y = data[idx + torch.arange(1, seq_len + 1)]
        logits = model(input_ids=x).logits
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
        count += y.numel()
    return total / count


def train_model(
    name: str, spec: ModelSpec, tokenizer, train_tokens: np.ndarray, seed: int, progress: bool = True
) -> tuple[object, dict]:
    """Train a model from scratch on random windows of the train stream; returns (model, training record)."""
    if spec.steps is None and not (spec.minutes and spec.minutes > 0):
        raise ValueError(f"the {name} needs a step count or a positive time budget")
    model = make_llama(spec, tokenizer, seed)
    model.train()
    params = [p for p in model.parameters()]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=spec.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    data = torch.from_numpy(train_tokens.astype(np.int64))
    if len(data) <= spec.seq_len + 1:
        raise RuntimeError(f"the train split has {len(data)} tokens, fewer than one window of {spec.seq_len}")
    gen = torch.Generator().manual_seed(seed + 1)
    offsets = torch.arange(spec.seq_len + 1)

    def forward_backward(window):
        logits = model(input_ids=window[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
        loss.backward()
        return loss.detach()

    step_fn = torch.compile(forward_backward) if spec.compile else forward_backward
    total = spec.steps
    calibrate_after = 20  # steps timed to turn the time budget into a step count (inside the warmup)
    bar = tqdm(total=total, desc=f"train {name}", unit="step", disable=not progress)
    t0 = time.perf_counter()
    t_cal = None
    step, losses = 0, []
    while total is None or step < total:
        if total is None and step == 3:
            t_cal = time.perf_counter()  # the first steps include one-off warm-up costs
        if total is None and step == 3 + calibrate_after:
            per_step = (time.perf_counter() - t_cal) / calibrate_after
            total = max(step + 1, int(spec.minutes * 60 / per_step))
            bar.total = total
            bar.refresh()
        lr = _lr_at(step, total or 10**9, spec)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(data) - spec.seq_len - 1, (spec.batch_size,), generator=gen)
        window = data[starts[:, None] + offsets]
        try:
            loss = step_fn(window)
        except Exception as exc:  # a compiler toolchain problem must not stop the build: train eagerly
            if step_fn is forward_backward or step > 0:
                raise
            tqdm.write(f"warning: torch.compile failed ({type(exc).__name__}); training without it")
            opt.zero_grad(set_to_none=True)
            step_fn = forward_backward
            loss = step_fn(window)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        step += 1
        bar.update(1)
        if step % 10 == 0:
            bar.set_postfix(loss=f"{sum(losses[-10:]) / 10:.3f}", lr=f"{lr:.2e}")
    bar.close()
    elapsed = time.perf_counter() - t0
    model.eval()
    record = {
        "steps": step,
        "train_tokens": step * spec.batch_size * spec.seq_len,
        "train_minutes": round(elapsed / 60, 2),
        "tokens_per_s": round(step * spec.batch_size * spec.seq_len / elapsed, 1),
        "final_train_loss": round(sum(losses[-50:]) / len(losses[-50:]), 4),
    }
    return model, record


# ----------------------------------------------------------------------------------------------- build


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


# ------------------------------------------------------------------------------------- what is ours

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
        train_tokenizer(corpus_dir, tok_dir, cfg.vocab_size, 4 * cfg.target.seq_len, tok_key)
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
