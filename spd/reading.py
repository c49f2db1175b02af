"""Reading the files a user gives: a damaged one is one sentence, never a traceback from inside a library.

Every loader reads its files through here, or checks them here before the library that reads them (transformers,
safetensors, gguf) sees them. A file that is missing, a directory, empty (0 bytes), cut short, of another kind (text
named ``model.safetensors``, a Git LFS pointer, random bytes) or holding tensors of the wrong dtype raises
:class:`~spd.errors.SpdInputError` with one sentence: the path, what is wrong with it, and what was expected.

- :func:`check_file`: a file that is there, is a file, and is not empty.
- :func:`read_json`, :func:`read_yaml`, :func:`iter_jsonl` (:func:`read_jsonl`): parsed, and of the expected shape.
- :func:`safetensors_header`, :func:`load_safetensors`: the header of a safetensors file checked against the file's
  size and the dtypes expected, before safetensors maps it.
- :func:`torch_load`: ``torch.load(..., weights_only=True)``: plain tensors and containers, never code.
- :func:`check_gguf`: a GGUF file's header and tensor table, before transformers dequantises it.
- :func:`check_model_files`: the files of a Hugging Face model directory (config, weights, tokenizer) before
  ``from_pretrained`` reads them.

Importing this module is cheap (no torch).
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import NoReturn

from .errors import SpdInputError, first_line

# The dtypes of trained weights (safetensors' names); a head or target tensor of another dtype is damage, not a choice.
FLOATING = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0"})
INTEGER = frozenset({"BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64"})
# Integer tensors that a model of floating-point weights holds by design: a head's draft vocabulary (the target ids
# its LM head predicts, spd/heads/draft_vocab.py).
INDEX_TENSORS = frozenset({"draft_ids"})
_MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header
_LFS = b"version https://git-lfs"


class DamagedFile(SpdInputError):
    """A file that is missing, a directory, empty, cut short, of another kind or of the wrong dtype."""


def _fail(what: str, path, problem: str, expected: str) -> NoReturn:
    raise DamagedFile(f"the {what} '{path}' {problem}; expected {expected}")


def check_file(path: str | os.PathLike, what: str, expected: str) -> Path:
    """``path`` as a Path when it is a file that is not empty; else one sentence: missing, a directory, empty."""
    path = Path(path)
    if path.is_dir():
        _fail(what, path, "is a directory", expected)
    if not path.exists():
        _fail(what, path, "does not exist", expected)
    if path.stat().st_size == 0:
        _fail(what, path, "is empty (0 bytes)", expected)
    return path


def _read_bytes(path: Path, what: str, expected: str, size: int = -1) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(size)
    except OSError as exc:
        _fail(what, path, f"cannot be read ({exc.strerror or first_line(exc)})", expected)


def _other_kind(head: bytes, kind: str) -> str:
    """What a file that is not of ``kind`` is, from its first bytes, as the problem half of a message."""
    if head.startswith(_LFS):
        return "is a Git LFS pointer, not the file itself (run 'git lfs pull' where it was cloned)"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 3:  # not only a character cut at the end of the bytes read
            return f"is not a {kind} file"
        text = head[: exc.start].decode("utf-8")
    if all(c.isprintable() or c.isspace() for c in text):
        return f"is not a {kind} file but text (it starts {text[:24]!r})"
    return f"is not a {kind} file"


def _short(exc: BaseException) -> str:
    """A library's error as a clause: its first line, up to its first full stop (torch's run on for lines)."""
    return first_line(exc).split(". ")[0].rstrip(".")


def _json_error(exc: json.JSONDecodeError, line: bool = True) -> str:
    where = f"line {exc.lineno} column {exc.colno}" if line else f"column {exc.colno}"
    return f"{exc.msg} {where}" if exc.msg.endswith(" at") else f"{exc.msg} at {where}"


def _text(path: Path, what: str, expected: str) -> str:
    raw = _read_bytes(check_file(path, what, expected), what, expected)
    if raw.startswith(_LFS):
        _fail(what, path, _other_kind(raw, "text"), expected)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        _fail(what, path, f"is not UTF-8 text (byte {exc.start} cannot be decoded; a binary file?)", expected)


# ------------------------------------------------------------------------------------------------- text


def read_json(path: str | os.PathLike, what: str, expected: str = "a JSON object", of: type = dict):
    """The JSON object (``of=list``: array) in ``path``; one sentence for a file that is missing, empty, cut short,
    not JSON or holding another kind of value."""
    path = Path(path)
    text = _text(path, what, expected)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno} column {exc.colno}"
        # The parser ran out of text (a string still open counts): the end of the file is missing.
        if exc.pos >= len(text.rstrip()) or exc.msg.startswith("Unterminated string"):
            _fail(what, path, f"is cut short (its JSON stops at {where})", expected)
        _fail(what, path, f"is not valid JSON ({_json_error(exc)})", expected)
    if not isinstance(value, of):
        kinds = {dict: "an object", list: "an array"}
        _fail(what, path, f"holds a JSON {type(value).__name__}, not {kinds.get(of, of.__name__)}", expected)
    return value


def read_yaml(path: str | os.PathLike, what: str, expected: str = "a YAML mapping of keys to values") -> dict:
    """The YAML mapping in ``path`` (a file of comments only is an empty one); one sentence otherwise."""
    import yaml

    path = Path(path)
    text = _text(path, what, expected)
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        _fail(what, path, f"is not valid YAML ({getattr(exc, 'problem', None) or first_line(exc)}{where})", expected)
    if value is None:
        return {}
    if not isinstance(value, dict):
        _fail(what, path, f"holds a YAML {type(value).__name__}, not a mapping", expected)
    return value


def iter_jsonl(path: str | os.PathLike, what: str, expected: str = "one JSON object per line") -> Iterator[dict]:
    """The JSON objects of ``path``, one a line, read as they come (blank lines skipped; ``.gz`` read compressed)."""
    import gzip

    path = check_file(path, what, expected)
    if _read_bytes(path, what, expected, len(_LFS)) == _LFS:
        _fail(what, path, _other_kind(_LFS, "text"), expected)
    opener = gzip.open if path.suffix == ".gz" else open
    number = 0
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as exc:
                    detail = _json_error(exc, line=False) if isinstance(exc, json.JSONDecodeError) else _short(exc)
                    cut = ", the file cut short there" if not line.endswith("\n") else ""
                    problem = f"is not JSON ({detail}{cut})"
                else:
                    problem = None if isinstance(row, dict) else f"is not a JSON object (it is a {type(row).__name__})"
                if problem is not None:
                    raise DamagedFile(f"line {number} of the {what} '{path}' {problem}; expected {expected}")
                yield row
    except UnicodeDecodeError:
        _fail(what, path, f"is not UTF-8 text (line {number + 1} cannot be decoded; a binary file?)", expected)
    except (OSError, EOFError) as exc:  # gzip: not a gzip file, or one cut short
        _fail(what, path, f"cannot be read ({first_line(exc)})", expected)


def read_jsonl(path: str | os.PathLike, what: str, expected: str = "one JSON object per line") -> list[dict]:
    """All the JSON objects of ``path``, one a line (:func:`iter_jsonl`)."""
    return list(iter_jsonl(path, what, expected))


# ------------------------------------------------------------------------------------------- safetensors


def safetensors_header(
    path: str | os.PathLike,
    what: str,
    dtypes: Collection[str] | None = FLOATING,
    expected: str = "a complete safetensors file",
) -> dict[str, dict]:
    """The tensor table of a safetensors file (name -> ``{"dtype", "shape", "data_offsets"}``), its header checked
    against the file's size and every tensor's dtype against ``dtypes`` (None: any), without reading the tensors."""
    path = check_file(path, what, expected)
    size = path.stat().st_size
    if size < 10:
        _fail(what, path, f"is too short to be a safetensors file ({size} bytes)", expected)
    head = _read_bytes(path, what, expected, 9)
    length = int.from_bytes(head[:8], "little")
    if length > _MAX_HEADER or head[8:9] != b"{":
        _fail(what, path, _other_kind(_read_bytes(path, what, expected, 64), "safetensors"), expected)
    if 8 + length > size:
        _fail(what, path, f"is cut short ({size:,} bytes; its header alone is {8 + length:,})", expected)
    raw = _read_bytes(path, what, expected, 8 + length)[8:]
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
    except (UnicodeDecodeError, ValueError) as exc:
        _fail(what, path, f"has a damaged header ({first_line(exc)})", expected)
    header.pop("__metadata__", None)
    end = 0
    for name, entry in header.items():
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("dtype"), str)
            and isinstance(entry.get("shape"), list)
            and isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]
        ):
            _fail(what, path, f"has a damaged header (its entry for '{name}' is malformed)", expected)
        end = max(end, offsets[1])
    whole = 8 + length + end
    if size < whole:
        _fail(what, path, f"is cut short ({size:,} of the {whole:,} bytes its header describes)", expected)
    if size > whole:
        _fail(what, path, f"has {size - whole:,} bytes more than its header describes", expected)
    if dtypes is not None:
        wrong = {
            name: entry["dtype"]
            for name, entry in header.items()
            if entry["dtype"] not in dtypes and not (name in INDEX_TENSORS and entry["dtype"] in INTEGER)
        }
        if wrong:
            name, dtype = next(iter(wrong.items()))
            more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
            kind = "floating-point tensors" if set(dtypes) <= FLOATING else "tensors"
            _fail(what, path, f"holds '{name}' as {dtype}{more}", f"{kind} ({', '.join(sorted(dtypes))})")
    return header


def load_safetensors(
    path: str | os.PathLike,
    what: str,
    dtypes: Collection[str] | None = FLOATING,
    device: str = "cpu",
    expected: str = "a complete safetensors file",
) -> dict:
    """``safetensors.torch.load_file`` after :func:`safetensors_header`; whatever safetensors still refuses is one
    sentence too."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    safetensors_header(path, what, dtypes, expected)
    try:
        return load_file(str(path), device=device)
    except (SafetensorError, OSError) as exc:
        _fail(what, path, f"cannot be read as safetensors ({_short(exc)})", expected)


# ---------------------------------------------------------------------------------------- torch and GGUF


def torch_load(path: str | os.PathLike, what: str, expected: str = "a torch.save file of plain tensors"):
    """``torch.load(path, weights_only=True)``: tensors and plain containers only, never code from the file; a file
    that needs more, is cut short or is of another kind is one sentence. A zip-format file is memory-mapped, so
    looking at its config does not read its tensors."""
    import pickle
    import zipfile

    import torch

    path = check_file(path, what, expected)
    head = _read_bytes(path, what, expected, 64)
    if head.startswith(_LFS):
        _fail(what, path, _other_kind(head, "torch.save"), expected)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as exc:
        if "global" in str(exc).lower():  # torch names the blocked global (a function or class to import)
            _fail(
                what,
                path,
                "needs arbitrary unpickling (it holds more than tensors and plain containers), which could run "
                "code, so it was refused",
                expected,
            )
        _fail(what, path, "is not a torch.save file (unreadable pickle)", expected)
    except Exception as exc:  # a malformed file can fail anywhere inside the unpickler (IndexError, struct.error..)
        problem = f"is truncated or not a torch.save file ({type(exc).__name__}: {_short(exc)})"
        _fail(what, path, problem, expected)


def check_gguf(path: str | os.PathLike, what: str = "GGUF file", expected: str = "a complete .gguf model file"):
    """A GGUF file whose header and tensor table read, and whose tensors all lie inside the file."""
    path = check_file(path, what, expected)
    head = _read_bytes(path, what, expected, 64)
    if not head.startswith(b"GGUF"):
        _fail(what, path, _other_kind(head, "GGUF"), expected)
    try:
        from gguf import GGUFReader
    except ImportError:
        raise SpdInputError("reading a GGUF file needs the 'gguf' package: pip install gguf") from None
    size = path.stat().st_size
    try:
        reader = GGUFReader(path)
        end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    except (ValueError, IndexError, KeyError, OverflowError, EOFError) as exc:
        _fail(what, path, f"is cut short or damaged ({_short(exc)})", expected)
    if end > size:
        _fail(what, path, f"is cut short ({size:,} of the {end:,} bytes its tensor table describes)", expected)


# ------------------------------------------------------------------------------------- model directories

# What a tokenizer directory may hold: JSON files, and files of other formats that must at least not be empty.
TOKENIZER_JSON = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
)
TOKENIZER_OTHER = ("tokenizer.model", "spiece.model", "vocab.txt", "merges.txt")
SAVED = "the file that save_pretrained writes"


def check_model_files(source: str | os.PathLike, what: str, weights: bool = False, tokenizer: bool = False) -> None:
    """Check the files ``from_pretrained`` will read from the local model directory ``source`` (a hub id: nothing;
    the hub's files arrive whole): ``config.json`` and ``generation_config.json`` if there, with ``weights`` the
    safetensors files there (floating-point tensors unless the config names a quantisation; a shard a machine does
    not hold is its loader's to report), with ``tokenizer`` the tokenizer's files there. ``what`` names the model:
    "target", "speculator", ..."""
    directory = Path(str(source)).expanduser()
    if not directory.is_dir():
        return
    config = {}
    if (directory / "config.json").exists():
        config = read_json(directory / "config.json", f"{what}'s config", SAVED)
    if (directory / "generation_config.json").exists():
        read_json(directory / "generation_config.json", f"{what}'s generation config", SAVED)
    if weights:
        check_weights(directory, what, None if "quantization_config" in config else FLOATING)
    if tokenizer:
        label = "tokenizer file" if what == "tokenizer" else f"{what}'s tokenizer file"
        for name in TOKENIZER_JSON:
            if (directory / name).exists():
                read_json(directory / name, label, SAVED)
        for name in TOKENIZER_OTHER:
            if (directory / name).exists():
                check_file(directory / name, label, SAVED)


def check_weights(directory: Path, what: str, dtypes: Collection[str] | None = FLOATING) -> None:
    """The safetensors weights of a model directory: one file, or the shards its index lists."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index, f"{what}'s weights index", SAVED).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            _fail(f"{what}'s weights index", index, "has no weight_map of tensor names to shard files", SAVED)
        for shard in sorted(set(weight_map.values())):
            if (directory / shard).exists():
                safetensors_header(directory / shard, f"{what}'s weights shard", dtypes)
    elif (directory / "model.safetensors").exists():
        safetensors_header(directory / "model.safetensors", f"{what}'s weights file", dtypes)
    elif (directory / "pytorch_model.bin").exists():
        check_file(directory / "pytorch_model.bin", f"{what}'s weights file", "a torch.save file of weights")
