"""The prompts a regeneration answers (``data/regenerate.py``), as ``{"id", "prompt"}`` rows: from a jsonl file of
prompts or conversations, from ``stdlib[:N]`` (coding instructions made from the standard library), or prefixes of
a text corpus's rows for a base model to continue."""

from __future__ import annotations

from pathlib import Path

from ..errors import SpdInputError
from ..reading import iter_jsonl
from .instructions import stdlib_instructions
from .regenerate import text_prefixes


def json_lines(path: str, key: str):
    """``(row number, row)`` of each non-blank line of the jsonl file ``path``, whose rows carry ``key``; a line
    that is not a JSON object, or a file that is not one of them, is one error (:func:`spd.reading.iter_jsonl`)."""
    yield from enumerate(iter_jsonl(path, "jsonl file", f'one {{"{key}": ...}} object per line'), 1)


def _prompt_of(row) -> str | None:
    """A row's request: its ``"prompt"``, or the first user turn of its ``"messages"`` (an evaluation set's shape)."""
    if not isinstance(row, dict):
        return None
    if "prompt" in row or not isinstance(row.get("messages"), list):
        return row.get("prompt")
    user = [m for m in row["messages"] if isinstance(m, dict) and m.get("role") == "user"]
    return user[0].get("content") if user else None


def read_prompts(spec: str) -> list[dict]:
    """``{"id", "prompt"}`` rows from a jsonl file or ``stdlib[:N]``."""
    if spec == "stdlib" or spec.startswith("stdlib:"):
        count = spec.partition(":")[2]
        if count and not (count.isdigit() and int(count) > 0):
            raise SpdInputError(f"--prompts {spec}: expected stdlib or stdlib:N with N a positive integer")
        return stdlib_instructions(int(count) if count else None)
    path = Path(spec)
    if not path.is_file():
        raise SpdInputError(f"the prompts file '{spec}' does not exist; expected a jsonl file or stdlib[:N]")
    rows = []
    for number, row in json_lines(spec, "prompt"):
        if isinstance(row, dict) and row.get("keep") is False:  # a sample data/self_instruct.py rejected
            continue
        prompt = _prompt_of(row)
        if not isinstance(prompt, str) or not prompt.strip():
            raise SpdInputError(
                f'{spec}:{number} has no non-empty "prompt" string (or "messages" list with a user turn)'
            )
        rows.append({"id": str(row.get("id", number)), "prompt": prompt})
    if not rows:
        raise SpdInputError(f"the prompts file '{spec}' has no prompts")
    if len({r["id"] for r in rows}) != len(rows):
        raise SpdInputError(
            f"the prompts file '{spec}' repeats an \"id\"; ids must be unique (resuming relies on them)"
        )
    return rows


def read_texts(spec: str, seed: int, max_chars: int) -> list[dict]:
    """``{"id", "prompt"}`` rows: prefixes of the ``"text"`` rows of ``FILE[:N]``
    (:func:`spd.data.regenerate.text_prefixes`)."""
    path, count = spec, None
    head, _, tail = spec.rpartition(":")
    if head and tail.isdigit():
        path, count = head, int(tail)
        if count < 1:
            raise SpdInputError(f"--texts {spec}: the number of prefixes must be a positive integer")
    if not Path(path).is_file():
        raise SpdInputError(f"the texts file '{path}' does not exist; expected a jsonl file of {{\"text\": ...}} rows")
    texts = []
    for number, row in json_lines(path, "text"):
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise SpdInputError(f'{path}:{number} has no "text" string')
        if row["text"].strip():
            texts.append(row["text"])
    if not texts:
        raise SpdInputError(f"the texts file '{path}' has no non-empty \"text\"")
    prefixes = text_prefixes(texts, count or len(texts), seed, max_chars)
    return [{"id": f"text-{i}", "prompt": p["text"]} for i, p in enumerate(prefixes)]
