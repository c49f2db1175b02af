"""The OpenAI wire format the server speaks: request models (validated strictly), response and chunk bodies.

Requests are pydantic models with ``extra="forbid"``: an unknown field is a 400 naming it, as a typo should
be. Fields OpenAI defines that this server cannot honour (``n > 1``, ``logprobs``, penalties, ``logit_bias``,
``best_of``, ``echo``, ``suffix``, tools) are refused with a 400 saying so, instead of being silently
ignored. ``top_k`` and ``ignore_eos`` are extensions (vLLM and SGLang accept them too). Defaults are OpenAI's
(``temperature`` 1, ``top_p`` 1, completions ``max_tokens`` 16; chat without ``max_tokens`` runs to EOS or
the end of the context).

Every number has a bound, so that no value a client sends reaches the engine as an overflow (a 500) or as
an allocation: ``seed`` is what ``torch.Generator.manual_seed`` takes (-2**63 .. 2**64 - 1), token counts
and ``top_k`` are at most 2**31 - 1 (the context check then gives the real limit), and stop strings are at
most :data:`MAX_STOPS` of at most :data:`MAX_STOP_CHARS` characters each.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOPS = 4  # OpenAI's own limit
MAX_STOP_CHARS = 1000  # per stop string: far above any real one, and it bounds the per-token matching work
MAX_INT = 2**31 - 1  # token counts and top_k: beyond any context, below any overflow
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts


class _Strict(BaseModel):
    # strict: "1" is not an int and 1 is not a bool; forbid: unknown fields are errors.
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields shared by both endpoints."""

    model: str
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, le=MAX_INT)  # extension; 0 or -1 = off
    ignore_eos: bool = False  # extension (as vLLM's): run to max_tokens or a stop string, past the EOS token
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None  # accepted and ignored, as OpenAI's own field for abuse tracking
    # OpenAI fields this server refuses unless they are at their no-op values.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOPS or any(not s for s in stops):
            raise ValueError(f"stop must be a non-empty string or a list of at most {MAX_STOPS} non-empty strings")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string has {max(map(len, stops))} characters; expected at most {MAX_STOP_CHARS}")
        return stops

    def unsupported(self) -> str | None:
        """The first field set to something this server does not do, as an error message (None: all fine)."""
        if self.n != 1:
            return f"n = {self.n} is not supported: this server returns one choice per request (n = 1)"
        if self.presence_penalty or self.frequency_penalty:
            return "presence_penalty and frequency_penalty are not supported (their outputs are not the target's)"
        if self.logit_bias:
            return "logit_bias is not supported"
        return None

    def sampling(self) -> dict:
        """The engine's sampling arguments."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": max(self.top_k, 0),
            "seed": self.seed,
            "ignore_eos": self.ignore_eos,
        }


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: str | list[int]
    max_tokens: int = Field(16, ge=1, le=MAX_INT)
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> str | None:
        if self.logprobs is not None:
            return "logprobs is not supported by this server"
        if self.echo or self.suffix is not None or (self.best_of not in (None, 1)):
            return "echo, suffix and best_of are not supported by this server"
        return super().unsupported()


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    response_format: dict | None = None

    def unsupported(self) -> str | None:
        if self.logprobs or self.top_logprobs is not None:
            return "logprobs is not supported by this server"
        if self.tools or self.tool_choice is not None:
            return "tools are not supported by this server"
        if self.response_format not in (None, {"type": "text"}):
            return "response_format other than text is not supported by this server"
        return super().unsupported()

    def budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# ------------------------------------------------------------------------------------------- errors


class HttpError(Exception):
    """An error answered with OpenAI's error JSON: ``{"error": {"message", "type", "param", "code"}}``."""

    TYPES = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        405: "invalid_request_error",
        413: "invalid_request_error",
        415: "invalid_request_error",
        503: "service_unavailable",
        500: "internal_error",
    }

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.TYPES.get(self.status, "error"),
                "param": self.param,
                "code": self.status,
            }
        }


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """One sentence from pydantic's errors (the first one): what was wrong, where, what was expected."""
    if not errors:
        return "the request body is not valid", None
    error = errors[0]
    where = [str(part) for part in error.get("loc", ()) if part != "body"]
    param = ".".join(where) or None
    kind = error.get("type", "")
    if kind == "json_invalid":
        return f"the request body is not valid JSON ({error.get('ctx', {}).get('error', 'parse error')})", None
    if kind == "extra_forbidden":
        return f"unknown field '{param}'; see the OpenAI API reference for the fields this endpoint takes", param
    if kind == "missing":
        return f"the field '{param}' is required", param
    if param is None and kind in ("model_type", "model_attributes_type", "dict_type"):
        return "the request body must be a JSON object", None
    return f"invalid '{param}': {error.get('msg', 'wrong value')}", param


# ---------------------------------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(rid: str, model: str, chat: bool, text: str, finish: str, use: dict, spd: dict) -> dict:
    """A whole (non-streamed) response."""
    if chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish,
            "logprobs": None,
        }
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": use,
        "spd": spd,
    }


def chunk_body(
    rid: str,
    model: str,
    chat: bool,
    text: str | None,
    finish: str | None = None,
    spd: dict | None = None,
    role: bool = False,
) -> dict:
    """One server-sent event's JSON: a text delta and/or the finish reason."""
    if chat:
        delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
    body = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }
    if spd is not None:
        body["spd"] = spd
    return body
