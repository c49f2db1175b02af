"""The OpenAI request bodies the server takes (``/v1/completions``, ``/v1/chat/completions``), validated strictly.

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

Every number has a bound, so that no value a client sends reaches the engine as an overflow (a 500) or as
an allocation: ``seed`` is what ``torch.Generator.manual_seed`` takes (-2**63 .. 2**64 - 1), token counts
and ``top_k`` are at most 2**31 - 1 (the context check then gives the real limit), and stop strings are at
most :data:`MAX_STOPS` of at most :data:`MAX_STOP_CHARS` characters each.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..decoding.sampling import SEED_MAX, SEED_MIN, SamplingParams
from .protocol import HttpError, json_kind, refusal, show

MAX_STOPS = 4  # OpenAI's own limit
MAX_STOP_CHARS = 1000  # per stop string: far above any real one, and it bounds the per-token matching work
MAX_INT = 2**31 - 1  # token counts and top_k: beyond any context, below any overflow


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
            raise refusal("invalid_type", f"'stop' must be a string or an array of strings, got {json_kind(value)}")
        if len(stops) > MAX_STOPS:
            raise refusal("array_above_max_length", f"'stop' has {len(stops)} strings; expected at most {MAX_STOPS}")
        if any(not s for s in stops):
            raise refusal("invalid_value", "'stop' has an empty string; expected non-empty stop strings")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise refusal(
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
            raise refusal(
                "unsupported_value",
                "'prompt' is a list of prompts (batched prompts), which is not supported: this server answers one "
                "prompt per request; expected a string or an array of token ids",
            )
        raise refusal("invalid_type", f"'prompt' must be a string or an array of token ids, got {json_kind(value)}")

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
            raise refusal(
                "unsupported_value",
                f"{{param}} '{value}' is not supported: this server has no tool calling; expected one of "
                + ", ".join(ROLES),
            )
        raise refusal("invalid_value", f"'{{param}}' must be one of {', '.join(ROLES)}, got {show(value)}")

    @field_validator("content", mode="plain")
    @classmethod
    def _content(cls, value) -> list[TextPart]:
        if isinstance(value, str):
            return [TextPart(type="text", text=value)]
        if not isinstance(value, list):
            raise refusal(
                "invalid_type", f"'{{param}}' must be a string or an array of text parts, got {json_kind(value)}"
            )
        parts = []
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise refusal(
                    "unsupported_value",
                    f"{{param}} is a content part of type '{kind[:40]}', which is not supported: this server "
                    "reads text; expected parts of type 'text'",
                    f"[{i}]",
                )
            text = part.get("text") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(text, str) or set(part) != {"type", "text"}:
                raise refusal(
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
        raise refusal("invalid_type", f"'{{param}}' must be a string or an object, got {json_kind(value)}")

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
