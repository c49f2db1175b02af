"""The target's tokenizer: loaded from a directory or a hub id with errors for people, or None for a target that
ships no tokenizer (token-id prompts still work)."""

from __future__ import annotations

import os

from ..errors import SpdInputError, first_line
from ..paths import check_model_source
from ..reading import check_model_files


def load_tokenizer(name_or_path: str | os.PathLike, revision: str | None = None):
    """``AutoTokenizer.from_pretrained`` with a clear error for a wrong path, hub id, missing tokenizer or damaged
    file."""
    from transformers import AutoTokenizer

    source = str(name_or_path)
    check_model_source(source, "tokenizer", revision)
    check_model_files(source, "tokenizer", tokenizer=True)
    try:
        return AutoTokenizer.from_pretrained(source, revision=revision)
    except (OSError, ValueError, KeyError) as exc:
        raise SpdInputError(f"could not load a tokenizer from '{source}' ({first_line(exc)})") from None


TOKENIZER_FILES = (
    "tokenizer_config.json",
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)


def has_tokenizer_files(source: str, revision: str | None = None) -> bool:
    """Whether a model directory or hub repo ships a tokenizer.

    Asked before loading because ``AutoTokenizer`` builds an empty tokenizer from ``config.json`` alone for some
    families (Qwen3: one token), so a load without error does not mean there is a tokenizer.
    """
    from pathlib import Path

    from transformers.utils import cached_file

    path = Path(str(source)).expanduser()
    if path.is_dir():  # a damaged file counts: load_tokenizer names what is wrong with it
        return any((path / name).exists() for name in TOKENIZER_FILES)
    for name in ("config.json", *TOKENIZER_FILES):
        try:
            found = (
                cached_file(
                    str(source),
                    name,
                    revision=revision,
                    _raise_exceptions_for_missing_entries=False,
                    _raise_exceptions_for_connection_errors=False,
                )
                is not None
            )
        except OSError:
            return True  # cannot tell (no such repo, a gated one): let the loaders report why
        if name == "config.json" and not found:
            return True  # the repo cannot be resolved (offline, not cached): likewise
        if found and name != "config.json":
            return True
    return False


def load_target_tokenizer(target: str, revision: str | None = None, tokenizer: str | None = None):
    """``tokenizer`` if given, else the target's own tokenizer, or None when the target ships no tokenizer files
    (token-id prompts still work). A tokenizer that is there but does not load is an error."""
    if tokenizer is not None:
        return load_tokenizer(tokenizer)
    if not has_tokenizer_files(target, revision):
        return None
    return load_tokenizer(target, revision)
