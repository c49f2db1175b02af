"""The OpenAI wire format the server speaks: errors (one sentence for every mistake) and response and chunk bodies;
the request bodies are :mod:`.requests`.

Every error is OpenAI's JSON, ``{"error": {"message", "type", "param", "code"}}``, with OpenAI's ``type``
(``invalid_request_error``; ``server_error`` for 500 and 503) and ``code`` (``invalid_type``, ``invalid_value``,
``missing_required_parameter``, ``unknown_parameter``, ``unsupported_value``, ``integer_above_max_value``,
``context_length_exceeded``, ``model_not_found``, ... or null), ``param`` the field as OpenAI writes it
(``messages[0].content``), and a message of one sentence in this server's words, never the validator's.
"""

from __future__ import annotations

import json
import re
import time
import uuid

from pydantic_core import PydanticCustomError

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
        """The error as OpenAI's JSON body."""
        return {
            "error": {
                "message": self.message,
                "type": "server_error" if self.status >= 500 else "invalid_request_error",  # OpenAI's two types
                "param": self.param,
                "code": self.code,
            }
        }


def refusal(code: str, message: str, at: str = "") -> PydanticCustomError:
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


def param_name(loc: tuple) -> str | None:
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


def show(value: object, limit: int = 40) -> str:
    """A value as the client wrote it (JSON), cut to ``limit`` characters."""
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def json_kind(value: object) -> str:
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
        return f"the request body must be a JSON object, got {json_kind(value)}", None, "invalid_type"
    if kind in _EXPECTED:
        return f"'{param}' must be {_EXPECTED[kind]}, got {json_kind(value)}", param, "invalid_type"
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


# ---------------------------------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    """A response's id: ``prefix`` and 24 random hex digits."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI's ``usage`` object: the prompt's, the completion's and the total token counts."""
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
