"""Training data: conversations or plain text -> token ids plus a loss mask, cached with ``datasets``.

Rows may be conversations (``messages`` or ``conversations``: lists of ``{"role", "content"}``, or ShareGPT
``{"from", "value"}``) rendered with the target tokenizer's chat template, where only assistant tokens
are supervised; plain text (``text``), where every token is; or token ids (``prompt_ids`` and ``answer_ids``, as a
server's traffic records hold them, :mod:`spd.traffic.records`), where the answer is. ``loss_mask[i] = 1`` means
token ``i`` is a supervised target, so position ``i - 1`` (which predicts it) carries a loss.

Sources: local ``.jsonl`` / ``.json`` / ``.parquet`` files (or a directory of them), a directory of traffic records
(``spd-serve --record DIR``), a directory written by ``Dataset.save_to_disk``, or a hub dataset id (``name`` or ``org/name``, with ``revision``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import SpdInputError, first_line
from ..files import rename_dir
from ..reading import check_file, iter_jsonl
from ..traffic.records import is_record_dir, read_records

_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
}
_FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@dataclass
class DataConfig:
    """How a source is turned into training rows."""

    max_length: int = 2048  # tokens per row
    overflow: str = "auto"  # longer rows: "drop", "truncate", "split" (text only); auto = drop chats, split text
    min_supervised: int = 1  # rows with fewer supervised tokens are dropped
    split: str = "train"  # split name for hub datasets / save_to_disk dataset dicts
    revision: str | None = None  # hub revision


def normalize_messages(row: dict, require_assistant: bool = True) -> list[dict] | None:
    """A row's conversation as ``[{"role", "content"}]`` (None when the row has none).

    Training rows need an assistant turn (the loss is on it); prompts for generation do not.
    """
    turns = row.get("messages")
    if turns is None:
        turns = row.get("conversations")
    if turns is None:
        return None
    if not isinstance(turns, list):
        raise ValueError("the conversation is not a list of turns")
    out = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise ValueError("a turn is not an object")
        if "role" in turn:
            role, content = turn["role"], turn.get("content")
        elif "from" in turn:
            role, content = _SHAREGPT_ROLES.get(str(turn["from"]).lower()), turn.get("value")
        else:
            raise ValueError("a turn has neither role/content nor from/value")
        if role not in ("system", "user", "assistant") or not isinstance(content, str):
            raise ValueError(f"unsupported turn (role {role!r})")
        out.append({"role": role, "content": content})
    if require_assistant and not any(t["role"] == "assistant" for t in out):
        raise ValueError("the conversation has no assistant turn")
    return out


def render_conversation(messages: list[dict], tokenizer) -> tuple[list[int], list[int]]:
    """Token ids of the rendered chat and a mask that is 1 exactly on assistant-turn tokens.

    Assistant spans are found by rendering growing prefixes of the conversation: the text added by an
    assistant turn after the generation prompt is that turn's reply (plus the template's end-of-turn).
    """
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, turn in enumerate(messages):
        if turn["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not full.startswith(upto) or not upto.startswith(before):
            raise ValueError("the chat template does not render conversations prefix by prefix")
        spans.append((len(before), len(upto)))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    mask = [int(any(lo <= start < hi for lo, hi in spans)) for start, _ in enc["offset_mapping"]]
    return enc["input_ids"], mask


def _encode_row(row: dict, tokenizer, cfg: DataConfig) -> list[tuple[list[int], list[int]]]:
    messages = normalize_messages(row)
    if messages is not None:
        ids, mask = render_conversation(messages, tokenizer)
        kind = "chat"
    elif isinstance(row.get("prompt_ids"), list) and isinstance(row.get("answer_ids"), list):
        ids = [int(t) for t in row["prompt_ids"]] + [int(t) for t in row["answer_ids"]]
        mask = [0] * len(row["prompt_ids"]) + [1] * len(row["answer_ids"])
        if ids and max(ids) >= len(tokenizer):
            raise ValueError("token ids beyond the tokenizer's vocabulary (records of another model?)")
        kind = "tokens"
    elif isinstance(row.get("text"), str):
        ids = tokenizer(row["text"], verbose=False)["input_ids"]
        if tokenizer.eos_token_id is not None:
            ids = ids + [tokenizer.eos_token_id]
        mask = [1] * len(ids)
        mask[0] = 0 if ids and ids[0] == tokenizer.bos_token_id else mask[0]
        kind = "text"
    else:
        raise ValueError("the row has no messages, conversations, text or prompt_ids and answer_ids field")
    auto = {"chat": "drop", "text": "split", "tokens": "truncate"}  # a long record keeps its prompt and answer's start
    overflow = cfg.overflow if cfg.overflow != "auto" else auto[kind]
    if len(ids) <= cfg.max_length:
        pieces = [(ids, mask)]
    elif overflow == "drop":
        raise OverflowError
    elif overflow == "truncate":
        pieces = [(ids[: cfg.max_length], mask[: cfg.max_length])]
    elif overflow == "split" and kind == "text":
        pieces = [
            (ids[i : i + cfg.max_length], mask[i : i + cfg.max_length]) for i in range(0, len(ids), cfg.max_length)
        ]
    else:
        raise SpdInputError(f"overflow='{overflow}' is not valid for {kind} rows; expected drop or truncate")
    return [(i, m) for i, m in pieces if sum(m) >= cfg.min_supervised and len(i) >= 2]


def _load_raw(source: str, cfg: DataConfig):
    """The raw rows of a local file/dir or hub dataset as a ``datasets.Dataset``."""
    import datasets

    path = Path(source).expanduser()
    if is_record_dir(path):
        return datasets.Dataset.from_list(
            [{"prompt_ids": r["prompt_ids"], "answer_ids": r["answer_ids"]} for r in read_records(path)]
        )
    if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
        ds = datasets.load_from_disk(str(path))
        return ds[cfg.split] if isinstance(ds, datasets.DatasetDict) else ds
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in _FILE_FORMATS)
        if not files:
            raise SpdInputError(
                f"the data directory '{source}' has no .jsonl, .json or .parquet files; expected a data file or a "
                "directory of them"
            )
    elif path.is_file():
        if path.suffix not in _FILE_FORMATS:
            raise SpdInputError(f"the data file '{source}' is not .jsonl, .json or .parquet")
        files = [path]
    elif source.startswith((".", "/", "~")) or source.count("/") > 1 or Path(source).suffix in _FILE_FORMATS:
        raise SpdInputError(f"the data path '{source}' does not exist")
    else:
        try:
            return datasets.load_dataset(source, split=cfg.split, revision=cfg.revision)
        except Exception as exc:  # the hub client raises many types; the user needs one line
            raise SpdInputError(f"could not load the dataset '{source}' from the hub: {first_line(exc)}") from None
    kinds = {_FILE_FORMATS[p.suffix] for p in files}
    if len(kinds) > 1:
        raise SpdInputError(f"the data directory '{source}' mixes json and parquet files")
    expected = "one JSON object per line (a row with messages, conversations or text)"
    for file in files:
        check_file(file, "data file", expected if file.suffix == ".jsonl" else f"a {file.suffix[1:]} file of rows")
    try:
        return datasets.load_dataset(kinds.pop(), data_files=[str(p) for p in files], split="train")
    except Exception as exc:  # malformed files surface as several pyarrow/datasets error types
        for file in files:  # the file and line at fault, when a line of a jsonl file is
            if file.suffix == ".jsonl":
                for _ in iter_jsonl(file, "data file", expected):
                    pass
        raise SpdInputError(f"could not read '{source}': {first_line(exc)}") from None


def fingerprint(source: str, tokenizer, cfg: DataConfig) -> str:
    """Cache key of a prepared dataset: the source (with file sizes/mtimes), tokenizer and settings."""
    path = Path(source).expanduser()
    stat = []
    if path.exists():
        for p in sorted([path] if path.is_file() else path.rglob("*")):
            if p.is_file():
                st = p.stat()
                stat.append((str(p), st.st_size, int(st.st_mtime)))
    tok = hashlib.sha256(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode()).hexdigest()
    key = json.dumps([source, stat, tok, getattr(tokenizer, "chat_template", None), asdict(cfg)], sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def prepare_dataset(
    source: str, tokenizer, cfg: DataConfig | None = None, cache_dir: str | Path | None = None, report=print
):
    """Tokenise ``source`` into rows ``{"input_ids", "loss_mask"}``; cached under ``cache_dir`` when given."""
    import datasets

    cfg = cfg or DataConfig()
    if cfg.overflow not in ("auto", "drop", "truncate", "split"):
        raise SpdInputError(f"overflow must be auto, drop, truncate or split, got '{cfg.overflow}'")
    cached = None
    if cache_dir is not None:
        cached = Path(cache_dir) / f"prepared-{fingerprint(source, tokenizer, cfg)}"
        if (cached / "dataset_info.json").exists():
            return datasets.load_from_disk(str(cached))
    raw = _load_raw(source, cfg)
    problems: Counter[str] = Counter()
    ids_rows, mask_rows = [], []
    for row in raw:
        try:
            pieces = _encode_row(row, tokenizer, cfg)
        except OverflowError:
            problems[f"longer than max_length={cfg.max_length} (dropped)"] += 1
            continue
        except (ValueError, TypeError) as exc:
            if isinstance(exc, SpdInputError):
                raise
            problems[str(exc)] += 1
            continue
        if not pieces:
            problems["no supervised tokens"] += 1
        for ids, mask in pieces:
            ids_rows.append(ids)
            mask_rows.append(mask)
    total = len(raw)
    if problems:
        detail = "; ".join(f"{count} {why}" for why, count in problems.most_common())
        report(f"[data] {source}: skipped rows out of {total}: {detail}")
    if not ids_rows:
        raise SpdInputError(
            f"no usable training rows in '{source}' ({total} rows read); expected conversations "
            "with an assistant turn or text rows"
        )
    ds = datasets.Dataset.from_dict({"input_ids": ids_rows, "loss_mask": mask_rows})
    report(f"[data] {source}: {len(ds)} rows, {sum(map(len, ids_rows))} tokens, {sum(map(sum, mask_rows))} supervised")
    if cached is not None:
        # A private temporary directory per process: two runs preparing the same data at once (e.g. the
        # SPD and PPSD presets side by side) must not write into one directory; the first rename wins.
        tmp = cached.with_name(f"{cached.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        ds.save_to_disk(str(tmp))
        try:
            rename_dir(tmp, cached)  # synced first: a cache on disk is whole, also after a power cut
        except OSError:
            if not (cached / "dataset_info.json").exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished first: use its copy
        ds = datasets.load_from_disk(str(cached))
    return ds
