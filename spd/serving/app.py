"""The HTTP layer: a FastAPI app with OpenAI's completions and chat endpoints, health, models and metrics.

Every request is checked here before it is queued (a wrong body, an unknown model, a prompt that does not
fit the context: a 400/404 with OpenAI's error JSON, and nothing reaches the pipeline). Generation happens
on the scheduler's thread; this side waits for the job's events, streams them as server-sent events
(``data: {json}`` per chunk, ``data: [DONE]`` at the end, as OpenAI does) or assembles one response, and
cancels the job when the client disconnects.
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from .metrics import ServerMetrics
from .protocol import (ChatCompletionRequest, CompletionRequest, HttpError, chunk_body, completion_body, new_id,
                       usage, validation_message)
from .scheduler import Job, QueueFull, Scheduler


def create_app(scheduler: Scheduler, metrics: ServerMetrics, model_name: str) -> FastAPI:
    """The server's routes around a started scheduler."""
    pipeline = scheduler.pipeline
    tokenizer = pipeline.tokenizer
    app = FastAPI(title="spd-serve", summary="Speculative Pipeline Decoding, OpenAI-compatible")

    @app.exception_handler(HttpError)
    async def _http_error(request: Request, exc: HttpError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.get("/health")
    async def health():
        lost = pipeline.lost()
        if lost is not None:
            raise HttpError(503, f"the pipeline is down ({lost})")
        return {"status": "ok", "model": model_name, "mode": pipeline.spec.mode, "stages": pipeline.n_stages,
                "runtime": pipeline.spec.runtime, "queue_length": scheduler.queue.qsize()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "spd", "max_model_len": pipeline.max_positions}]}

    @app.get("/metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await _parse(request, CompletionRequest, "completions")
        try:
            if isinstance(req.prompt, str):
                if not req.prompt:
                    raise HttpError(400, "the prompt is empty; expected some text", "prompt")
                with scheduler.tokenizer_lock:
                    prompt_ids = tokenizer(req.prompt)["input_ids"]
            else:
                prompt_ids = req.prompt
            return await _generate(request, req, prompt_ids, req.max_tokens, chat=False)
        except HttpError as exc:
            metrics.requests.labels("completions", "rejected" if exc.status == 503 else "invalid").inc()
            raise

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await _parse(request, ChatCompletionRequest, "chat")
        try:
            if not tokenizer.chat_template:
                raise HttpError(400, f"the model '{model_name}' has no chat template; use /v1/completions")
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
            try:
                with scheduler.tokenizer_lock:
                    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                    prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            except Exception as exc:  # noqa: BLE001 - the template's own complaint (e.g. role order) is the message
                raise HttpError(400, f"the chat template refused these messages: {exc}", "messages") from None
            return await _generate(request, req, prompt_ids, req.budget(), chat=True)
        except HttpError as exc:
            metrics.requests.labels("chat", "rejected" if exc.status == 503 else "invalid").inc()
            raise

    async def _parse(request: Request, model: type[BaseModel], endpoint: str):
        body = await request.body()
        try:
            req = model.model_validate_json(body)
        except ValidationError as exc:
            metrics.requests.labels(endpoint, "invalid").inc()
            message, param = validation_message(exc.errors())
            raise HttpError(400, message, param) from None
        if req.model != model_name:
            metrics.requests.labels(endpoint, "invalid").inc()
            raise HttpError(404, f"the model '{req.model}' does not exist; this server serves '{model_name}'",
                            "model")
        unsupported = req.unsupported()
        if unsupported is not None:
            metrics.requests.labels(endpoint, "invalid").inc()
            raise HttpError(400, unsupported)
        return req

    def _budget(prompt_ids: list[int], max_tokens: int | None) -> int:
        """max_tokens (default: the rest of the context), refused when prompt + max_tokens overflow it."""
        if not prompt_ids:
            raise HttpError(400, "the prompt is empty; expected at least one token", "prompt")
        bad = [t for t in prompt_ids if not 0 <= t < pipeline.vocab_size]
        if bad:
            raise HttpError(400, f"prompt token id {bad[0]} is outside the vocabulary (0..{pipeline.vocab_size - 1})",
                            "prompt")
        limit = pipeline.max_positions
        if limit is None:
            return max_tokens or 4096
        if len(prompt_ids) >= limit:
            raise HttpError(400, f"the prompt has {len(prompt_ids)} tokens but the model's context is {limit} "
                            "tokens; expected a shorter prompt", "prompt")
        if max_tokens is not None and len(prompt_ids) + max_tokens > limit:
            raise HttpError(400, f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) exceed the "
                            f"model's context of {limit} tokens; expected max_tokens <= {limit - len(prompt_ids)}",
                            "max_tokens")
        return max_tokens or limit - len(prompt_ids)

    async def _generate(request: Request, req, prompt_ids: list[int], max_tokens: int | None, chat: bool):
        endpoint = "chat" if chat else "completions"
        job = Job(list(prompt_ids), _budget(prompt_ids, max_tokens), req.sampling(), req.stop or [],
                  asyncio.get_running_loop(), endpoint)
        try:
            scheduler.submit(job)
        except QueueFull as exc:
            raise HttpError(503, str(exc), headers={"Retry-After": str(exc.retry_after)}) from None
        rid = new_id("chatcmpl" if chat else "cmpl")
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            return StreamingResponse(_stream(job, rid, chat, include_usage), media_type="text/event-stream")
        return await _respond(request, job, rid, chat)

    async def _respond(request: Request, job: Job, rid: str, chat: bool):
        pieces: list[str] = []
        tokens = 0
        checked = time.monotonic()
        while True:
            try:
                event = await asyncio.wait_for(job.events.get(), timeout=0.25)
            except asyncio.TimeoutError:
                event = None
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
                return completion_body(rid, model_name, chat, text, finish, usage(len(job.prompt_ids), tokens), stats)
            elif event[0] == "error":
                raise HttpError(event[1], event[2])
            else:  # cancelled
                return Response(status_code=499)

    async def _stream(job: Job, rid: str, chat: bool, include_usage: bool):
        def sse(body: dict) -> str:
            return f"data: {json.dumps(body)}\n\n"

        tokens = 0
        try:
            if chat:
                yield sse(chunk_body(rid, model_name, chat, None, role=True))
            ids: list[int] = []
            flags: list[bool] = []
            while True:
                event = await job.events.get()
                if event[0] == "token":
                    _, piece, token, accepted = event
                    tokens += 1
                    ids.append(token)
                    flags.append(accepted)
                    if piece:  # tokens whose text is held back go out with the next piece
                        yield sse(chunk_body(rid, model_name, chat, piece, spd={"token_ids": ids, "accepted": flags}))
                        ids, flags = [], []
                elif event[0] == "done":
                    _, rest, finish, stats = event
                    if rest or ids:
                        yield sse(chunk_body(rid, model_name, chat, rest, spd={"token_ids": ids, "accepted": flags}))
                    yield sse(chunk_body(rid, model_name, chat, None, finish, spd=stats))
                    if include_usage:
                        body = chunk_body(rid, model_name, chat, None)
                        body["choices"], body["usage"] = [], usage(len(job.prompt_ids), tokens)
                        yield sse(body)
                    break
                elif event[0] == "error":
                    yield sse(HttpError(event[1], event[2]).body())
                    break
                else:
                    break
            yield "data: [DONE]\n\n"
        finally:
            job.cancel()  # a no-op when it finished; stops the generation when the client went away

    return app
