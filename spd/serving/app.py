"""The HTTP layer: a FastAPI app with OpenAI's completions and chat endpoints, health, models and metrics.

Every request is checked here before it is queued (a wrong body, an unknown model, a prompt that does not
fit the context: a 400/404 with OpenAI's error JSON, and nothing reaches the pipeline). What one request
may cost is bounded before it costs it (:class:`~spd.serving.state.Limits`; the API key and the body's size are
checked by :mod:`.middleware` before the body is read); only a JSON content type is parsed; a prompt longer in
characters than the context could hold is refused before it is tokenized, and tokenizing runs on a worker thread,
never on the event loop. Every error, 404 and 405 included, is OpenAI's error JSON. Generation happens on the
scheduler's thread; this side waits for the job's events, streams them as server-sent events (``data: {json}`` per
chunk, ``data: [DONE]`` at the end, as OpenAI does) or assembles one response, and cancels the job when the client
disconnects; if the engine dies meanwhile, the waiting request gets a 503 instead of waiting forever. Every request
is logged once it has ended (:class:`~spd.serving.middleware.AccessLog`).

The routes are module-level handlers on :data:`router`; what they share of one server (the scheduler, the
metrics, the model's name and context, the prompt tokenizer) is one :class:`~spd.serving.state.ServerState` on
``app.state.spd``, which each handler takes through the :func:`server_state` dependency. :func:`create_app` only
assembles the app.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import first_line
from .metrics import ServerMetrics
from .middleware import AccessLog, Guard, access_notes, error_response
from .protocol import HttpError, chunk_body, completion_body, new_id, show, usage, validation_message
from .requests import ChatCompletionRequest, CompletionRequest
from .scheduler import EngineDown, Job, QueueFull, Scheduler
from .state import Limits, ServerState

ROUTES = "/v1/completions, /v1/chat/completions, /v1/models, /health and /metrics"


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
    access_notes(request)["error"] = exc.message
    return error_response(exc)


async def _starlette_error(request: Request, exc: StarletteHTTPException):
    # Unknown paths and wrong methods: OpenAI's error JSON too, not FastAPI's {"detail": ...}.
    if exc.status_code == 404:
        message = f"there is no route {request.url.path}; this server has {ROUTES}"
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "another method")
        message = f"{request.method} is not allowed on {request.url.path}; expected {allowed}"
    else:
        message = str(exc.detail)
    return error_response(HttpError(exc.status_code, message, headers=exc.headers))


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
        stream = _stream(server, job, rid, chat, include_usage, access_notes(request))
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
            access_notes(request).update(tokens=tokens, accept_length=stats.get("equivalent_accept_length"))
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
