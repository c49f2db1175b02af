"""The HTTP layer: a FastAPI app with OpenAI's completions and chat endpoints, health, models and metrics.

Every request is checked here before it is queued (a wrong body, an unknown model, a prompt that does not
fit the context: a 400/404 with OpenAI's error JSON, and nothing reaches the pipeline). What one request
may cost is bounded before it costs it (:class:`Limits`): the API key is checked and the body's size capped
(by its Content-Length, then counted as it arrives) before the body is read; only a JSON content type is
parsed; a prompt longer in characters than the context could hold is refused before it is tokenized, and
tokenizing runs on a worker thread, never on the event loop. Every error, 404 and 405 included, is
OpenAI's error JSON. Generation happens on the scheduler's thread; this side waits for the job's events,
streams them as server-sent events (``data: {json}`` per chunk, ``data: [DONE]`` at the end, as OpenAI
does) or assembles one response, and cancels the job when the client disconnects; if the engine dies
meanwhile, the waiting request gets a 503 instead of waiting forever. Every request is logged once it has ended
(:class:`AccessLog`: one line on the ``spd.serve`` logger, with its tokens and L'_acc; a 5xx as a warning, with
its reason).

The routes are module-level handlers on :data:`router`; what they share of one server (the scheduler, the
metrics, the model's name and context, the prompt tokenizer) is one :class:`ServerState` on ``app.state.spd``,
which each handler takes through the :func:`server_state` dependency. :func:`create_app` only assembles the app.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import json
import logging
import threading
import time
from dataclasses import dataclass
from http import HTTPStatus
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import first_line
from .metrics import ServerMetrics
from .protocol import HttpError, chunk_body, completion_body, new_id, show, usage, validation_message
from .requests import ChatCompletionRequest, CompletionRequest
from .scheduler import EngineDown, Job, QueueFull, Scheduler

ROUTES = "/v1/completions, /v1/chat/completions, /v1/models, /health and /metrics"
log = logging.getLogger("spd.serve")


@dataclass
class Limits:
    """What one request may cost the server, and who may send one (spd-serve's flags)."""

    max_body_bytes: int = 8 * 2**20  # --max-body-bytes
    max_model_len: int | None = None  # --max-model-len: prompt + max_tokens (default: the model's context)
    api_key: str | None = None  # --api-key / SPD_API_KEY: required on /v1/* when set
    enable_docs: bool = False  # --enable-docs: /docs, /redoc, /openapi.json


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
                return await _error_response(refusal)(scope, receive, send)
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
            return await _error_response(error, close=True)(scope, receive, send)
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
        note: dict = {}  # filled by the handlers, through request.state (_note)
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


def _note(request: Request) -> dict:
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


def _error_response(exc: HttpError, close: bool = False) -> JSONResponse:
    headers = {**exc.headers, **({"Connection": "close"} if close else {})}
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def prompt_char_limit(tokenizer, max_model_len: int) -> int:
    """The most characters a prompt that fits ``max_model_len`` tokens can have, with room to spare: no token
    covers more characters than the longest vocabulary entry (byte-level entries: one character per byte),
    doubled for normalizers that fold characters together."""
    longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
    return max_model_len * max(longest, 4) * 2


@dataclass
class ServerState:
    """What the routes share, one per app (``app.state.spd``, reached through :func:`server_state`): the started
    scheduler and its pipeline, the metrics, the served model's name and context, and the tokenizer's copy that
    prompts are tokenized with."""

    scheduler: Scheduler
    metrics: ServerMetrics
    model_name: str
    max_model_len: int | None  # --max-model-len, else the model's context
    max_chars: int | None  # the longest prompt text that could fit max_model_len (prompt_char_limit)
    encoder: object  # the tokenizer prompts are tokenized with (a copy of the pipeline's, if it can be copied)
    encode_lock: threading.Lock  # held while the encoder runs (the engine's own lock when it is not a copy)

    @classmethod
    def build(cls, scheduler: Scheduler, metrics: ServerMetrics, model_name: str, limits: Limits) -> ServerState:
        pipeline = scheduler.pipeline
        tokenizer = pipeline.tokenizer
        max_model_len = limits.max_model_len or pipeline.max_positions
        max_chars = prompt_char_limit(tokenizer, max_model_len) if max_model_len else None
        # Prompts are tokenized on worker threads with their own copy of the tokenizer, so that a long prompt never
        # holds the lock the engine thread decodes the running request with.
        try:
            encoder = copy.deepcopy(tokenizer)
        except Exception:  # noqa: BLE001 - a tokenizer that cannot be copied is shared, under the engine's lock
            encoder = tokenizer
        encode_lock = scheduler.tokenizer_lock if encoder is tokenizer else threading.Lock()
        return cls(scheduler, metrics, model_name, max_model_len, max_chars, encoder, encode_lock)

    @property
    def pipeline(self):
        return self.scheduler.pipeline

    def check_chars(self, chars: int, param: str) -> None:
        """Refuse text that cannot fit the context before tokenizing it (tokenizing costs memory and time)."""
        if self.max_chars is not None and chars > self.max_chars:
            raise HttpError(
                400,
                f"the {param} has {chars} characters, more than a context of {self.max_model_len} "
                f"tokens can hold (at most {self.max_chars}); expected a shorter {param}",
                param,
                code="context_length_exceeded",
            )

    def encode(self, text: str, special: bool) -> list[int]:
        with self.encode_lock:
            return self.encoder(text, add_special_tokens=special)["input_ids"]

    def encode_chat(self, messages: list[dict]) -> list[int]:
        with self.encode_lock:
            text = self.encoder.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.encode(text, False)

    def budget(self, prompt_ids: list[int], max_tokens: int | None, prompt: str = "prompt") -> int:
        """max_tokens (default: the rest of the context), refused when prompt + max_tokens overflow it; ``prompt``
        names the field the prompt came from (``messages`` for chat)."""
        limit, vocab_size = self.max_model_len, self.pipeline.vocab_size
        if not prompt_ids:
            raise HttpError(400, "the prompt is empty; expected at least one token", prompt, code="invalid_value")
        if limit is not None and len(prompt_ids) >= limit:
            raise HttpError(
                400,
                f"the prompt has {len(prompt_ids)} tokens but the server's context (max model len) "
                f"is {limit} tokens; expected a shorter prompt",
                prompt,
                code="context_length_exceeded",
            )
        bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
        if bad:
            raise HttpError(
                400,
                f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})",
                prompt,
                code="invalid_value",
            )
        if limit is None:
            return max_tokens or 4096
        if max_tokens is not None and len(prompt_ids) + max_tokens > limit:
            raise HttpError(
                400,
                f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) exceed the "
                f"server's context (max model len) of {limit} tokens; expected max_tokens <= "
                f"{limit - len(prompt_ids)}",
                "max_tokens",
                code="context_length_exceeded",
            )
        return max_tokens or limit - len(prompt_ids)


async def server_state(request: Request) -> ServerState:
    """The dependency every route takes its server by (async: it runs on the event loop, not a worker thread)."""
    return request.app.state.spd


Server = Annotated[ServerState, Depends(server_state)]


def create_app(scheduler: Scheduler, metrics: ServerMetrics, model_name: str, limits: Limits | None = None) -> FastAPI:
    """The server's routes around a started scheduler."""
    limits = limits or Limits()
    docs = {} if limits.enable_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="spd-serve", summary="Speculative Pipeline Decoding, OpenAI-compatible", **docs)
    app.state.spd = ServerState.build(scheduler, metrics, model_name, limits)
    app.add_middleware(Guard, max_body_bytes=limits.max_body_bytes, api_key=limits.api_key)
    app.add_middleware(AccessLog)  # (added last: around the Guard, so that its refusals are logged too)
    app.add_exception_handler(HttpError, _http_error)
    app.add_exception_handler(StarletteHTTPException, _starlette_error)
    app.include_router(router)
    return app


async def _http_error(request: Request, exc: HttpError):
    _note(request)["error"] = exc.message
    return _error_response(exc)


async def _starlette_error(request: Request, exc: StarletteHTTPException):
    # Unknown paths and wrong methods: OpenAI's error JSON too, not FastAPI's {"detail": ...}.
    if exc.status_code == 404:
        message = f"there is no route {request.url.path}; this server has {ROUTES}"
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "another method")
        message = f"{request.method} is not allowed on {request.url.path}; expected {allowed}"
    else:
        message = str(exc.detail)
    return _error_response(HttpError(exc.status_code, message, headers=exc.headers))


# ---------------------------------------------------------------------------------------------------- routes
# (The handlers' names are the OpenAPI operation ids and summaries of /openapi.json: renaming one changes it.)
router = APIRouter()


@router.get("/health")
async def health(server: Server):
    failure = server.scheduler.failure()
    if failure is not None:
        raise HttpError(503, failure)
    pipeline = server.pipeline
    return {
        "status": "ok",
        "model": server.model_name,
        "mode": pipeline.spec.mode,
        "stages": pipeline.n_stages,
        "runtime": pipeline.spec.runtime,
        "queue_length": server.scheduler.queue.qsize(),
    }


@router.get("/v1/models")
async def models(server: Server):
    return {
        "object": "list",
        "data": [
            {
                "id": server.model_name,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "spd",
                "max_model_len": server.max_model_len,
            }
        ],
    }


@router.get("/metrics")
async def prometheus(server: Server):
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(server.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


@router.post("/v1/completions")
async def completions(request: Request, server: Server):
    req = await _parse(request, server, CompletionRequest, "completions")
    try:
        if isinstance(req.prompt, str):
            if not req.prompt:
                raise HttpError(400, "the prompt is empty; expected some text", "prompt", code="invalid_value")
            server.check_chars(len(req.prompt), "prompt")
            prompt_ids = await run_in_threadpool(server.encode, req.prompt, True)
        else:
            prompt_ids = req.prompt
        return await _generate(request, server, req, prompt_ids, req.max_tokens, chat=False)
    except HttpError as exc:
        server.metrics.requests.labels("completions", "rejected" if exc.status == 503 else "invalid").inc()
        raise


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, server: Server):
    req = await _parse(request, server, ChatCompletionRequest, "chat")
    try:
        if not server.pipeline.tokenizer.chat_template:
            raise HttpError(
                400,
                f"the model '{server.model_name}' has no chat template; expected a request to /v1/completions",
            )
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        server.check_chars(sum(len(m["content"]) for m in messages), "messages")
        try:
            prompt_ids = await run_in_threadpool(server.encode_chat, messages)
        except Exception as exc:  # noqa: BLE001 - the template's own complaint (e.g. role order) is the message
            raise HttpError(
                400, f"the chat template refused these messages: {first_line(exc)}", "messages", code="invalid_value"
            ) from None
        return await _generate(request, server, req, prompt_ids, req.budget(), chat=True, prompt="messages")
    except HttpError as exc:
        server.metrics.requests.labels("chat", "rejected" if exc.status == 503 else "invalid").inc()
        raise


# ------------------------------------------------------------------------------------ what the routes share
async def _parse(request: Request, server: ServerState, model: type[BaseModel], endpoint: str):
    """The request's body as ``model``, checked: a JSON content type, a valid body, this server's model and no
    setting it does not support."""
    media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        # A browser sends a cross-site text/plain or form POST without asking first: only JSON is parsed.
        server.metrics.requests.labels(endpoint, "invalid").inc()
        raise HttpError(
            415,
            f"the request body must be JSON sent with 'Content-Type: application/json', not "
            f"'{media or 'no content type'}'",
        )
    body = await request.body()
    try:
        req = model.model_validate_json(body)
    except ValidationError as exc:
        server.metrics.requests.labels(endpoint, "invalid").inc()
        message, param, code = validation_message(exc.errors(include_url=False), body)
        raise HttpError(400, message, param, code=code) from None
    if req.model != server.model_name:
        server.metrics.requests.labels(endpoint, "invalid").inc()
        raise HttpError(
            404,
            f"the model {show(req.model, 80)} does not exist; expected '{server.model_name}', the model this server "
            "serves",
            "model",
            code="model_not_found",
        )
    unsupported = req.unsupported()
    if unsupported is not None:
        server.metrics.requests.labels(endpoint, "invalid").inc()
        raise unsupported
    return req


async def _generate(
    request: Request,
    server: ServerState,
    req,
    prompt_ids: list[int],
    max_tokens: int | None,
    chat: bool,
    prompt: str = "prompt",
):
    """Queue the job; its response, streamed or whole (``prompt``: the field the prompt came from)."""
    endpoint = "chat" if chat else "completions"
    sampling = req.sampling(server.pipeline.vocab_size)
    job = Job(
        list(prompt_ids),
        server.budget(prompt_ids, max_tokens, prompt),
        sampling,
        req.stop or [],
        asyncio.get_running_loop(),
        endpoint,
        req.ignore_eos,
    )
    try:
        server.scheduler.submit(job)
    except QueueFull as exc:
        raise HttpError(503, str(exc), headers={"Retry-After": str(exc.retry_after)}) from None
    except EngineDown as exc:
        raise HttpError(503, str(exc)) from None
    rid = new_id("chatcmpl" if chat else "cmpl")
    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        stream = _stream(server, job, rid, chat, include_usage, _note(request))
        return StreamingResponse(stream, media_type="text/event-stream")
    return await _respond(request, server, job, rid, chat)


async def _respond(request: Request, server: ServerState, job: Job, rid: str, chat: bool):
    """The whole response, once the job is done (a 499 when the client went away meanwhile)."""
    pieces: list[str] = []
    tokens = 0
    checked = time.monotonic()
    while True:
        event = await _next_event(server.scheduler, job, 0.25)
        if time.monotonic() - checked >= 0.25:  # tokens may arrive faster than the timeout: check by the clock
            checked = time.monotonic()
            if await request.is_disconnected():
                job.cancel()
                return Response(status_code=499)  # nobody reads it; the job stops at its next token
        if event is None:
            continue
        if event[0] == "token":
            pieces.append(event[1])
            tokens += 1
        elif event[0] == "done":
            _, rest, finish, stats = event
            text = "".join(pieces) + rest
            _note(request).update(tokens=tokens, accept_length=stats.get("equivalent_accept_length"))
            return completion_body(
                rid, server.model_name, chat, text, finish, usage(len(job.prompt_ids), tokens), stats
            )
        elif event[0] == "error":
            raise _engine_error(event[1], event[2])
        else:  # cancelled
            return Response(status_code=499)


async def _next_event(scheduler: Scheduler, job: Job, timeout: float | None):
    """The job's next event (None after ``timeout``), or an error event once the engine is dead: its events
    would never come."""
    while True:
        try:
            return await asyncio.wait_for(job.events.get(), timeout=timeout or 0.5)
        except asyncio.TimeoutError:
            failure = scheduler.failure()
            if failure is not None and job.events.empty():
                return ("error", 503, failure)
            if timeout is not None:
                return None


def _engine_error(status: int, message: str) -> HttpError:
    """An error the engine thread answered a job with: 400 (the engine refused the input), 500 or 503."""
    return HttpError(status, message, code="invalid_value" if status == 400 else None)


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


async def _stream(server: ServerState, job: Job, rid: str, chat: bool, include_usage: bool, note: dict):
    """The job's events as server-sent events, then ``data: [DONE]``; the job is cancelled if the client goes.
    ``note``: the request's access-log notes (its tokens and L'_acc, or the error that ended it)."""
    model_name = server.model_name
    tokens = 0
    try:
        if chat:
            yield _sse(chunk_body(rid, model_name, chat, None, role=True))
        ids: list[int] = []
        flags: list[bool] = []
        while True:
            event = await _next_event(server.scheduler, job, None)
            if event[0] == "token":
                _, piece, token, accepted = event
                tokens += 1
                note["tokens"] = tokens
                ids.append(token)
                flags.append(accepted)
                if piece:  # tokens whose text is held back go out with the next piece
                    yield _sse(chunk_body(rid, model_name, chat, piece, spd={"token_ids": ids, "accepted": flags}))
                    ids, flags = [], []
            elif event[0] == "done":
                _, rest, finish, stats = event
                note["accept_length"] = stats.get("equivalent_accept_length")
                if rest or ids:
                    yield _sse(chunk_body(rid, model_name, chat, rest, spd={"token_ids": ids, "accepted": flags}))
                yield _sse(chunk_body(rid, model_name, chat, None, finish, spd=stats))
                if include_usage:
                    body = chunk_body(rid, model_name, chat, None)
                    body["choices"], body["usage"] = [], usage(len(job.prompt_ids), tokens)
                    yield _sse(body)
                break
            elif event[0] == "error":
                note.update(error=f"the stream ended with error {event[1]}: {event[2]}", failed=event[1] >= 500)
                yield _sse(_engine_error(event[1], event[2]).body())
                break
            else:
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancel()  # a no-op when it finished; stops the generation when the client went away
