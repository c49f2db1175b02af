"""The pure ASGI middleware around every route: what one request may cost is bounded before it costs it, and every
request is logged once it has ended.

:class:`Guard` checks the API key and caps the body's size (by its Content-Length, then counted as it arrives)
before the body is read. :class:`AccessLog` writes one line on the ``spd.serve`` logger per request, with its
tokens and L'_acc (a 5xx as a warning, with its reason).
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from http import HTTPStatus

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers

from ..errors import first_line
from .protocol import HttpError

log = logging.getLogger("spd.serve")


class Guard:
    """Pure ASGI middleware in front of every route: the API key on /v1/*, then the body's size, both before the
    body is read. A Content-Length over the cap is refused at once; a body without one (chunked) is counted
    as it arrives and refused as soon as it passes the cap, so no request holds more than the cap in memory."""

    def __init__(self, app, max_body_bytes: int, api_key: str | None):
        self.app, self.max_body_bytes = app, max_body_bytes
        self.api_key = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        if self.api_key is not None and (scope["path"] == "/v1" or scope["path"].startswith("/v1/")):
            refusal = self._refuse_key(headers.get("authorization"))
            if refusal is not None:
                return await error_response(refusal)(scope, receive, send)
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            error = (
                HttpError(
                    413,
                    f"the request body has {length} bytes; expected at most {self.max_body_bytes} (--max-body-bytes)",
                )
                if length.isdigit()
                else HttpError(400, f"the Content-Length header '{length[:40]}' is not a number of bytes")
            )
            return await error_response(error, close=True)(scope, receive, send)
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise HttpError(
                        413,
                        f"the request body is over {self.max_body_bytes} bytes; expected at most "
                        f"{self.max_body_bytes} (--max-body-bytes)",
                        headers={"Connection": "close"},
                    )
            return message

        await self.app(scope, counted, send)

    def _refuse_key(self, authorization: str | None) -> HttpError | None:
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return HttpError(
                401,
                "the API key is missing; expected the header 'Authorization: Bearer <key>'",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if not hmac.compare_digest(key.strip().encode(), self.api_key):  # constant time: no key guessing by timing
            return HttpError(
                401,
                "the API key is wrong; expected the key this server was started with",
                headers={"WWW-Authenticate": "Bearer"},
                code="invalid_api_key",
            )
        return None


class AccessLog:
    """Pure ASGI middleware around everything: one line per request once its response has ended (a stream at its
    last event), as uvicorn's access log, plus what the request generated: client, method, path, status, completion
    tokens, L'_acc (where the mode reports it) and the time taken. A 5xx (a 503: queue full, the pipeline down) is a
    warning that says why; a stream the client left is said to be cancelled."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        note: dict = {}  # filled by the handlers, through request.state (access_notes)
        scope.setdefault("state", {})[_NOTE] = note
        status, ended = None, False

        async def watched(message):
            nonlocal status, ended
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
            ended = ended or (message["type"] == "http.response.body" and not message.get("more_body", False))

        try:
            await self.app(scope, receive, watched)
        except Exception as exc:  # (re-raised) starlette answers it with a 500 from outside this middleware
            status = 500 if status is None else status
            note.setdefault("error", f"{type(exc).__name__}: {first_line(exc)}")
            note["failed"] = True
            raise
        finally:
            if status is not None and status < 400 and not ended:
                note.setdefault("error", "the client went away; its generation was cancelled")
            _log_request(scope, status or 499, time.perf_counter() - start, note)


_NOTE = "spd_access"  # the key of a request's access-log notes in its scope's state


def access_notes(request: Request) -> dict:
    """The notes the access log writes this request's line from (tokens, L'_acc, why it failed)."""
    return request.scope.setdefault("state", {}).setdefault(_NOTE, {})


def _printable(text: str, limit: int = 200) -> str:
    """A client's text made safe for a log line: control characters escaped, at most ``limit`` characters."""
    text = text if text.isprintable() else json.dumps(text)[1:-1]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _log_request(scope, status: int, seconds: float, note: dict) -> None:
    client = scope.get("client")
    who = f"{client[0]}:{client[1]}" if client else "-"
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Client Closed Request" if status == 499 else ""
    parts = [f"{note['tokens']} tokens"] if "tokens" in note else []
    if note.get("accept_length") is not None:
        parts.append(f"L'_acc {note['accept_length']:.2f}")
    parts.append(f"{seconds:.3f} s")
    line = f'{who} "{scope["method"]} {_printable(scope["path"])}" {status} {phrase}, {", ".join(parts)}'
    # Why a 5xx failed, or a stream that ended early; a 4xx told the client its own mistake and is not repeated here.
    error = note.get("error") if status >= 500 or status < 400 else None
    level = logging.WARNING if status >= 500 or note.get("failed") else logging.INFO
    log.log(level, f"{line}; {_printable(error, 300)}" if error else line)


def error_response(exc: HttpError, close: bool = False) -> JSONResponse:
    """``exc`` as OpenAI's error JSON with its headers (``close``: and ``Connection: close``)."""
    headers = {**exc.headers, **({"Connection": "close"} if close else {})}
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)
