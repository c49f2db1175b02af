"""Regenerate training data: a target's own answers to a list of prompts (chat), or its own continuations of
text prefixes (a base model).

A speculation head learns to predict its target, so the best training data are the target's own responses
(EAGLE and SpecForge regenerate their data the same way). The rows written here are, for a chat target,
``{"id", "messages": [user, assistant], "finish_reason", "new_tokens"}`` (``train/distill.py`` renders them
with the target's chat template and supervises the assistant turn only), and for a base model (``chat=False``)
``{"id", "text": prefix + continuation, "finish_reason", "new_tokens"}``: plain text, every position supervised.
The prefixes of a text corpus come from :func:`text_prefixes`.

Batched (prompts of similar length together, left padding) and resumable: each finished batch is appended
and fsynced, a restart skips the ids already written and drops a last line a kill cut short.
:func:`regenerate_served` writes the same rows with the answers of an OpenAI-compatible server (a large target
served by vLLM, SGLang or spd-serve), one request per prompt, each row appended as its answer arrives.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import SpdInputError
from ..files import complete_lines
from .client import Client, as_completed, request_seed

if TYPE_CHECKING:
    import torch  # imported where it is used: the served path (regenerate_served) never needs it


def read_done(path: Path) -> set[str]:
    """Ids already in ``path``; a partial last line (a kill mid-write) is cut off the file, with a warning."""
    if not path.exists():
        return set()
    done = set()
    for number, line in enumerate(complete_lines(path).splitlines(), 1):
        try:
            done.add(json.loads(line)["id"])
        except (ValueError, KeyError, TypeError) as exc:
            raise SpdInputError(
                f"{path}:{number} is not a regenerated row ({exc}); move the file away to start again"
            ) from exc
    return done


def text_prefixes(texts: Sequence[str], count: int, seed: int, max_chars: int = 400) -> list[dict]:
    """``count`` prefixes of documents, ``{"doc", "line", "text"}`` (the ``i``-th from document ``i % len(texts)``):
    a run of whole lines from a seeded line (``line``, from 1), at most ``max_chars`` characters (a longer first line
    is cut); blank runs are left out."""
    import numpy as np

    rng = np.random.default_rng(seed)
    prefixes = []
    for i in range(count):
        lines = texts[i % len(texts)].splitlines(keepends=True)
        start = int(rng.integers(0, max(1, len(lines) - 4)))
        text = ""
        for line in lines[start:]:
            if text and len(text) + len(line) > max_chars:
                break
            text += line[:max_chars]
        if text.strip():
            prefixes.append({"doc": i % len(texts), "line": start + 1, "text": text})
    return prefixes


def chat_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt as one user turn, rendered with the chat template and the assistant's header."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def _left_padded(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows padded on the left to the longest, and their attention mask."""
    import torch

    width = max(len(ids) for ids in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for row, ids in enumerate(rows):
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention[row, width - len(ids) :] = 1
    return input_ids, attention


def _answer_row(prompt: dict, reply: str, chat: bool) -> dict:
    """The row written for one answer: a conversation (``chat``) or the prompt's text continued."""
    if not chat:
        return {"id": prompt["id"], "text": prompt["prompt"] + reply}
    messages = [{"role": "user", "content": prompt["prompt"]}, {"role": "assistant", "content": reply}]
    return {"id": prompt["id"], "messages": messages}


def regenerate(
    model,
    tokenizer,
    prompts: Sequence[dict],
    out: str | os.PathLike,
    batch_size: int = 16,
    max_new_tokens: int = 384,
    temperature: float = 0.0,
    seed: int = 0,
    progress: bool = True,
    chat: bool = True,
) -> dict:
    """Append the target's answer to every prompt ``{"id", "prompt"}`` not yet in ``out`` (``chat``: the prompt as
    a user turn; otherwise its continuation of the prompt as plain text); return statistics."""
    import torch
    from tqdm import tqdm

    if chat and tokenizer.chat_template is None:
        raise SpdInputError(
            "regeneration of chat data needs a target whose tokenizer has a chat template; for a "
            "base model, continue text prefixes instead (data/regenerate.py --texts)"
        )
    if batch_size < 1 or max_new_tokens < 1:
        raise SpdInputError(f"batch size and max new tokens must be positive, got {batch_size} and {max_new_tokens}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = read_done(out)
    encode = (lambda text: chat_ids(tokenizer, text)) if chat else (lambda text: tokenizer(text)["input_ids"])
    todo = [(p, encode(p["prompt"])) for p in prompts if p["id"] not in done]
    todo.sort(key=lambda item: len(item[1]))  # similar lengths per batch: little padding
    eos_ids, pad = eos_and_pad(model, tokenizer)
    device = next(model.parameters()).device
    new_tokens, start = 0, time.perf_counter()
    bar = tqdm(total=len(todo), desc="regenerating", unit="prompt", disable=not progress)
    with open(out, "a", encoding="utf-8") as f:
        for first in range(0, len(todo), batch_size):
            batch = todo[first : first + batch_size]
            input_ids, attention = _left_padded([ids for _, ids in batch], pad)
            torch.manual_seed(seed + first)
            generated = _continue(model, input_ids.to(device), attention.to(device), max_new_tokens, temperature, pad)
            for (prompt, _), ids in zip(batch, generated):
                stop = next((i for i, t in enumerate(ids) if t in eos_ids), None)
                answer = ids if stop is None else ids[:stop]
                new_tokens += len(answer)
                row = _answer_row(prompt, tokenizer.decode(answer, skip_special_tokens=True), chat)
                row.update(finish_reason="length" if stop is None else "stop", new_tokens=len(answer))
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - start):.0f}")
    bar.close()
    return _stats(prompts, done, todo, new_tokens, time.perf_counter() - start)


def eos_and_pad(model, tokenizer) -> tuple[set[int], int]:
    """The ids that end a sample (the model's generation config's EOS) and the id rows are padded with (the
    tokenizer's, else one of the EOS ids)."""
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos_ids))
    return eos_ids, pad


def _continue(
    model, input_ids: torch.Tensor, attention: torch.Tensor, max_new_tokens: int, temperature: float, pad: int
) -> list[list[int]]:
    """``model.generate``'s new tokens for every row of a left-padded batch (greedy at temperature 0)."""
    width = input_ids.shape[1]  # every row's answer starts here
    return model.generate(
        input_ids=input_ids,
        attention_mask=attention,
        max_new_tokens=max_new_tokens,
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else None,
        top_p=None,
        top_k=None,
        pad_token_id=pad,
    )[:, width:].tolist()


def _stats(prompts: Sequence[dict], done: set[str], todo: list, new_tokens: int, seconds: float) -> dict:
    """What a regeneration did: prompts, those done before, those generated now, new tokens, time and rate."""
    return {
        "prompts": len(prompts),
        "skipped_done": len(done),
        "generated": len(todo),
        "new_tokens": new_tokens,
        "seconds": round(seconds, 1),
        "tokens_per_s": round(new_tokens / seconds, 1) if seconds > 0 else None,
    }


def regenerate_served(
    client: Client,
    model: str,
    prompts: Sequence[dict],
    out: str | os.PathLike,
    concurrency: int = 8,
    max_new_tokens: int = 384,
    temperature: float = 0.0,
    seed: int = 0,
    progress: bool = True,
    chat: bool = True,
) -> dict:
    """:func:`regenerate`'s rows from the server behind ``client`` serving ``model``: each prompt not yet in ``out``
    one request (``chat``: a user turn to /v1/chat/completions, which renders the chat template with its default
    system prompt as :func:`chat_ids` does; otherwise the text to /v1/completions), at most ``concurrency`` in
    flight, each row appended and fsynced as its answer arrives; return statistics."""
    from tqdm import tqdm

    if concurrency < 1 or max_new_tokens < 1:
        raise SpdInputError(f"concurrency and max new tokens must be positive, got {concurrency} and {max_new_tokens}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = read_done(out)
    todo = [p for p in prompts if p["id"] not in done]

    def ask(prompt: dict):
        body = {"model": model, "max_tokens": max_new_tokens, "temperature": temperature}
        if chat:
            body["messages"] = [{"role": "user", "content": prompt["prompt"]}]
        else:
            body["prompt"] = prompt["prompt"]
        if temperature > 0:
            body["seed"] = request_seed(seed, prompt["id"])
        return client.complete(body, chat)

    new_tokens, start = 0, time.perf_counter()
    bar = tqdm(total=len(todo), desc="regenerating", unit="prompt", disable=not progress)
    with bar, open(out, "a", encoding="utf-8") as f:  # the bar ends its line before an error is printed
        for prompt, answer in as_completed(ask, todo, concurrency):
            row = _answer_row(prompt, answer.text, chat)
            row.update(finish_reason=answer.finish_reason, new_tokens=answer.new_tokens)
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
            new_tokens += answer.new_tokens
            bar.update(1)
            bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - start):.0f}")
    return _stats(prompts, done, todo, new_tokens, time.perf_counter() - start)
