"""The OpenAI wire format the server speaks: request models (validated strictly), errors, response and chunk bodies.

Requests are pydantic models with ``extra="forbid"``: an unknown field is a 400 naming it, as a typo should be. A
field sent as JSON ``null`` takes its default, as in OpenAI's API (whose clients send ``null`` for "not set").
Fields OpenAI defines that this server cannot honour (``n > 1``, ``logprobs``, penalties, ``logit_bias``,
``best_of``, ``echo``, ``suffix``, tools, image parts, a list of prompts, audio, ...) are refused with a 400 that
names the field and says it is not supported, instead of being silently ignored; at their no-op values (``n: 1``,
``logprobs: false``, ``tools: []``, ...) they are accepted. ``user``, ``metadata``, ``store: false``,
``service_tier``, ``parallel_tool_calls``, ``prompt_cache_key`` and ``safety_identifier`` change nothing a server
without accounts or tools does, and are accepted and ignored. ``top_k`` and ``ignore_eos`` are extensions (vLLM and
SGLang accept them too). Defaults are OpenAI's (``temperature`` 1, ``top_p`` 1, completions ``max_tokens`` 16; chat
without ``max_tokens`` runs to EOS or the end of the context).

Every error is OpenAI's JSON, ``{"error": {"message", "type", "param", "code"}}``, with OpenAI's ``type``
(``invalid_request_error``; ``server_error`` for 500 and 503) and ``code`` (``invalid_type``, ``invalid_value``,
``missing_required_parameter``, ``unknown_parameter``, ``unsupported_value``, ``integer_above_max_value``,
``context_length_exceeded``, ``model_not_found``, ... or null), ``param`` the field as OpenAI writes it
(``messages[0].content``), and a message of one sentence in this server's words, never the validator's.

Every number has a bound, so that no value a client sends reaches the engine as an overflow (a 500) or as
an allocation: ``seed`` is what ``torch.Generator.manual_seed`` takes (-2**63 .. 2**64 - 1), token counts
and ``top_k`` are at most 2**31 - 1 (the context check then gives the real limit), and stop strings are at
most :data:`MAX_STOPS` of at most :data:`MAX_STOP_CHARS` characters each.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..decoding.sampling import SEED_MAX, SEED_MIN, SamplingParams

MAX_STOPS = 4  # OpenAI's own limit
MAX_STOP_CHARS = 1000  # per stop string: far above any real one, and it bounds the per-token matching work
MAX_INT = 2**31 - 1  # token counts and top_k: beyond any context, below any overflow

# ------------------------------------------------------------------------------------------- errors


class HttpError(Exception):
    """An error answered with OpenAI's error JSON: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: dict | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}
        self.code = code  # OpenAI's: a string naming the kind of mistake ("invalid_value", ...), or null

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": "server_error" if self.status >= 500 else "invalid_request_error",  # OpenAI's two types
                "param": self.param,
                "code": self.code,
            }
        }


def _refuse(code: str, message: str, at: str = "") -> PydanticCustomError:
    """A validation error that reaches the client as it is: OpenAI's ``code``, this message (``{param}`` in it: the
    field's name as OpenAI writes it), and ``at`` appended to that name (``[1]``: the second part of an array)."""
    return PydanticCustomError(code, "{message}", {"message": message, "at": at})


OUR_CODES = ("invalid_type", "invalid_value", "unsupported_value", "unsupported_parameter", "array_above_max_length")

_EXPECTED = {  # pydantic's type errors: what the field must be
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "list_type": "an array",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
}


def param_name(loc) -> str | None:
    """A pydantic location as OpenAI names a field: ``messages[0].content``."""
    name = ""
    for part in loc:
        if part == "body":
            continue
        if not isinstance(part, int):
            part = (
                part if part.isprintable() and len(part) <= 64 else json.dumps(part)[1:-1][:64]
            )  # a client's field name
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else part)
    return name or None


def show(value, limit: int = 40) -> str:
    """A value as the client wrote it (JSON), cut to ``limit`` characters."""
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _kind(value) -> str:
    """What a JSON value is, in words."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return show(value)
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


def validation_message(errors: list[dict], body: bytes = b"") -> tuple[str, str | None, str | None]:
    """(message, param, code) from pydantic's errors (the first one): one sentence saying what was wrong, where and
    what was expected, the field as OpenAI names it, and OpenAI's error code."""
    if not errors:
        return "the request body is not valid", None, None
    error = errors[0]
    kind, ctx, value = error.get("type", ""), error.get("ctx") or {}, error.get("input")
    param = param_name(error.get("loc", ()))
    if kind == "json_invalid":
        return _json_message(str(ctx.get("error", "parse error")), body), None, None
    if kind in OUR_CODES:
        param = (param or "") + ctx.get("at", "") or None
        return str(ctx.get("message", error.get("msg"))).replace("{param}", str(param)), param, kind
    if kind == "extra_forbidden":
        return (
            f"unknown field '{param}'; expected only the fields of the OpenAI API reference for this endpoint",
            param,
            "unknown_parameter",
        )
    if kind == "missing":
        return f"the field '{param}' is required", param, "missing_required_parameter"
    if param is None and kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"the request body must be a JSON object, got {_kind(value)}", None, "invalid_type"
    if kind in _EXPECTED:
        return f"'{param}' must be {_EXPECTED[kind]}, got {_kind(value)}", param, "invalid_type"
    if kind == "literal_error":
        return f"'{param}' must be {ctx.get('expected')}, got {show(value)}", param, "invalid_value"
    if kind == "finite_number":
        return f"'{param}' must be a finite number, got {show(value)}", param, "invalid_value"
    bounds = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt")}
    bounds.update({"less_than_equal": ("<=", "le"), "less_than": ("<", "lt")})
    if kind in bounds:
        sign, key = bounds[kind]
        bound = ctx.get(key)
        number = "decimal" if isinstance(bound, float) else "integer"  # the field's type, as OpenAI's codes name it
        bound = int(bound) if isinstance(bound, float) and bound.is_integer() else bound
        side = "below_min" if sign[0] == ">" else "above_max"
        return f"'{param}' must be {sign} {bound}, got {show(value)}", param, f"{number}_{side}_value"
    if kind == "too_short":
        if not value:
            return f"'{param}' must not be empty; expected at least {ctx.get('min_length')}", param, "empty_array"
        return f"'{param}' has too few items; expected at least {ctx.get('min_length')}", param, "invalid_value"
    if kind == "too_long":
        return f"'{param}' has too many items; expected at most {ctx.get('max_length')}", param, "invalid_value"
    message = str(error.get("msg", "wrong value")).removeprefix("Value error, ")
    return f"invalid '{param}': {message}", param, "invalid_value"


_ESCAPE = re.compile(r"(\\+)u([0-9a-fA-F]{4})")  # a run of backslashes, then u and four hex digits


def lone_surrogate(text: str) -> str | None:
    """The first ``\\uXXXX`` escape in JSON ``text`` that is half of a UTF-16 surrogate pair without its other half."""
    pending = None  # a high surrogate's escape, waiting for its low half right after it
    end = -1
    for match in _ESCAPE.finditer(text):
        if len(match.group(1)) % 2 == 0:  # an escaped backslash followed by "u": not an escape
            continue
        unit = int(match.group(2), 16)
        escape = "\\u" + match.group(2)
        if pending is not None and not (0xDC00 <= unit <= 0xDFFF and match.start() + len(match.group(1)) - 1 == end):
            return pending
        if 0xDC00 <= unit <= 0xDFFF and pending is None:
            return escape
        pending = escape if 0xD800 <= unit <= 0xDBFF else None
        end = match.end()
    return pending


def _json_message(error: str, body: bytes) -> str:
    """The parser's complaint as one sentence; a lone UTF-16 surrogate escape (which no UTF-8 text can hold) and
    bytes that are not UTF-8 get their own."""
    if "surrogate" in error or "end of hex escape" in error:
        lone = lone_surrogate(body.decode("utf-8", "replace"))
        escape = f" ({lone})" if lone else ""
        return (
            f"the request body has a lone UTF-16 surrogate escape{escape}; expected valid Unicode text, where "
            r"a high surrogate (\ud800-\udbff) is always followed by a low one (\udc00-\udfff)"
        )
    if "invalid unicode code point" in error:
        return f"the request body is not UTF-8 text ({error}); expected JSON encoded as UTF-8"
    return f"the request body is not valid JSON ({error})"


# ------------------------------------------------------------------------------------------ requests


class _Strict(BaseModel):
    # strict: "1" is not an int and 1 is not a bool; forbid: unknown fields are errors; no NaN or Infinity.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data):
        # OpenAI's API takes null for every optional field, meaning its default (clients send it for "not set").
        if isinstance(data, dict):
            fields = cls.model_fields
            return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}
        return data


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool = True  # accepted and ignored: no padding is added to the chunks


# The OpenAI fields this server refuses at any value but their no-op ones: (field, no-op values, why).
_REFUSED_SAMPLING = (
    ("n", (1,), "this server returns one choice per request; expected 1 or null"),
    ("presence_penalty", (0,), "the output would not be the target model's; expected 0 or null"),
    ("frequency_penalty", (0,), "the output would not be the target model's; expected 0 or null"),
    ("logit_bias", ({},), "the output would not be the target model's; expected {} or null"),
)


class _Sampling(_Strict):
    """Fields shared by both endpoints."""

    model: str
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, le=MAX_INT)  # extension; 0 or -1 = off
    ignore_eos: bool = False  # extension (as vLLM's): run to max_tokens or a stop string, past the EOS token
    stop: str | list[str] = []  # one string or up to MAX_STOPS; validated by _stop
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=128)
    user: str | None = None  # accepted and ignored, as OpenAI's own field for abuse tracking
    # OpenAI fields this server refuses unless they are at their no-op values.
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict = {}

    @field_validator("stop", mode="plain")
    @classmethod
    def _stop(cls, value) -> list[str]:
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise _refuse("invalid_type", f"'stop' must be a string or an array of strings, got {_kind(value)}")
        if len(stops) > MAX_STOPS:
            raise _refuse("array_above_max_length", f"'stop' has {len(stops)} strings; expected at most {MAX_STOPS}")
        if any(not s for s in stops):
            raise _refuse("invalid_value", "'stop' has an empty string; expected non-empty stop strings")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise _refuse(
                "invalid_value",
                f"a stop string has {max(map(len, stops))} characters; expected at most {MAX_STOP_CHARS}",
            )
        return stops

    def unsupported(self) -> HttpError | None:
        """The first field set to something this server does not do, as its 400 (None: all fine)."""
        return _first_refused(self, _REFUSED_SAMPLING)

    def sampling(self, vocab_size: int) -> SamplingParams:
        """The request's sampling settings for the engine: ``top_k`` 0 or -1 is off, and none beyond the vocabulary
        (the same draw)."""
        return SamplingParams(self.temperature, min(max(self.top_k, 0), vocab_size), self.top_p, self.seed)


def _first_refused(req: BaseModel, refused) -> HttpError | None:
    """The 400 for the first of ``refused`` (field, no-op values, why) that ``req`` sets to another value."""
    for name, fine, why in refused:
        value = getattr(req, name)
        if value is not None and value not in fine:
            code = "unsupported_value" if fine else "unsupported_parameter"  # (no value of it is honoured)
            what = f"'{name}'" if isinstance(value, (list, dict)) else f"{name} = {show(value)}"
            return HttpError(400, f"{what} is not supported: {why}", name, code=code)
    return None


_REFUSED_COMPLETION = (
    ("logprobs", (), "this server returns no log probabilities; expected null"),
    ("echo", (False,), "this server does not return the prompt; expected false or null"),
    ("suffix", (), "this server does not insert text; expected null"),
    ("best_of", (1,), "this server generates one sequence per request; expected 1 or null"),
)


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: str | list[int]  # validated by _prompt
    max_tokens: int = Field(16, ge=1, le=MAX_INT)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = Field(None, ge=0, le=20)
    suffix: str | None = None

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompt(cls, value) -> str | list[int]:
        if isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return value
        if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
            raise _refuse(
                "unsupported_value",
                "'prompt' is a list of prompts (batched prompts), which is not supported: this server answers one "
                "prompt per request; expected a string or an array of token ids",
            )
        raise _refuse("invalid_type", f"'prompt' must be a string or an array of token ids, got {_kind(value)}")

    def unsupported(self) -> HttpError | None:
        return _first_refused(self, _REFUSED_COMPLETION) or super().unsupported()


class TextPart(_Strict):
    type: Literal["text"]
    text: str


ROLES = ("system", "developer", "user", "assistant")


class Message(_Strict):
    role: str  # one of ROLES; validated by _role
    content: list[TextPart]  # a string is one text part; validated by _content
    name: str | None = None
    # Tool calls of an assistant turn, and its refusal text: refused (no tools here) and ignored.
    tool_calls: list = []
    function_call: dict | None = None
    refusal: str | None = None

    @field_validator("role", mode="plain")
    @classmethod
    def _role(cls, value) -> str:
        if value in ROLES:
            return value
        if value in ("tool", "function"):
            raise _refuse(
                "unsupported_value",
                f"{{param}} '{value}' is not supported: this server has no tool calling; expected one of "
                + ", ".join(ROLES),
            )
        raise _refuse("invalid_value", f"'{{param}}' must be one of {', '.join(ROLES)}, got {show(value)}")

    @field_validator("content", mode="plain")
    @classmethod
    def _content(cls, value) -> list[TextPart]:
        if isinstance(value, str):
            return [TextPart(type="text", text=value)]
        if not isinstance(value, list):
            raise _refuse("invalid_type", f"'{{param}}' must be a string or an array of text parts, got {_kind(value)}")
        parts = []
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise _refuse(
                    "unsupported_value",
                    f"{{param}} is a content part of type '{kind[:40]}', which is not supported: this server "
                    "reads text; expected parts of type 'text'",
                    f"[{i}]",
                )
            text = part.get("text") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(text, str) or set(part) != {"type", "text"}:
                raise _refuse(
                    "invalid_value",
                    f'{{param}} must be {{"type": "text", "text": "..."}}, got {show(part)}',
                    f"[{i}]",
                )
            parts.append(TextPart(type="text", text=text))
        return parts

    def text(self) -> str:
        return "".join(part.text for part in self.content)


_REFUSED_CHAT = (
    ("logprobs", (False,), "this server returns no log probabilities; expected false or null"),
    ("top_logprobs", (0,), "this server returns no log probabilities; expected 0 or null"),
    ("tools", ([],), "this server has no tool calling; expected [] or null"),
    ("tool_choice", ("none", "auto"), "this server has no tool calling; expected 'none', 'auto' or null"),
    ("functions", ([],), "this server has no function calling; expected [] or null"),
    ("function_call", ("none", "auto"), "this server has no function calling; expected 'none', 'auto' or null"),
    ("response_format", ({"type": "text"},), 'this server returns plain text; expected {"type": "text"} or null'),
    ("modalities", (["text"],), 'this server returns text only; expected ["text"] or null'),
    ("audio", (), "this server generates text only; expected null"),
    ("prediction", (), "this server takes no predicted output; expected null"),
    ("reasoning_effort", (), "the served model is not a reasoning model; expected null"),
    ("verbosity", (), "this server does not steer the length of its answers; expected null"),
    ("web_search_options", (), "this server does not search the web; expected null"),
    ("store", (False,), "this server keeps no completions; expected false or null"),
)


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list = []
    tool_choice: str | dict | None = None  # validated by _string_or_object
    parallel_tool_calls: bool | None = None  # ignored: no tools
    functions: list = []
    function_call: str | dict | None = None
    response_format: dict | None = None
    modalities: list = ["text"]
    audio: dict | None = None
    prediction: dict | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict | None = None
    store: bool = False
    # Accepted and ignored: stored-completion tags, the processing tier, cache and abuse-tracking keys.
    metadata: dict | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @field_validator("tool_choice", "function_call", mode="plain")
    @classmethod
    def _string_or_object(cls, value) -> str | dict:
        if isinstance(value, (str, dict)):
            return value
        raise _refuse("invalid_type", f"'{{param}}' must be a string or an object, got {_kind(value)}")

    def unsupported(self) -> HttpError | None:
        for i, message in enumerate(self.messages):
            if message.tool_calls or message.function_call is not None:
                field = "tool_calls" if message.tool_calls else "function_call"
                return HttpError(
                    400,
                    f"messages[{i}].{field} is not supported: this server has no tool calling; expected none",
                    f"messages[{i}].{field}",
                    code="unsupported_value",
                )
        return _first_refused(self, _REFUSED_CHAT) or super().unsupported()

    def budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


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
