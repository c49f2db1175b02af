"""A small client for an OpenAI-compatible server (vLLM, SGLang, spd-serve), for making training data with a
target that is served rather than loaded here (as SpecForge does).

At most ``concurrency`` requests are in flight (:func:`as_completed`). A request that fails where a retry can help
(no connection, a timeout, HTTP 429 or 5xx) is tried again after an exponential backoff with jitter; any other 4xx
is the caller's mistake and stops at once with the server's own message. Either way the failure is one
:class:`~spd.errors.SpdInputError` naming the server, which a program reports as one ``error:`` line.
"""

from __future__ import annotations

import hashlib
import random
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TypeVar

import httpx

from ..errors import SpdInputError

Item = TypeVar("Item")
Result = TypeVar("Result")

MAX_WAIT_S = 60.0  # the longest backoff between two tries


@dataclass
class Completion:
    """One answer: its text, why it ended and how many tokens it has."""

    text: str
    finish_reason: str  # "stop": end of turn (the EOS); "length": max_tokens reached
    new_tokens: int  # generated tokens, the EOS not counted (as the in-process path counts them)


def add_client_flags(parser) -> None:
    """The flags of a data script that sends its requests to ``--server``: the model, requests in flight, retries
    and the key (one set for data/regenerate.py and data/self_instruct.py)."""
    import os

    parser.add_argument(
        "--model", default=None, help="with --server: the served model's name (default: the first at /v1/models)"
    )
    parser.add_argument("--concurrency", type=int, default=8, help="with --server: requests in flight at once")
    parser.add_argument(
        "--retries",
        type=int,
        default=5,
        help="with --server: tries after the first of a request that failed for want of the server (no connection, "
        "a timeout, HTTP 429 or 5xx), each after twice the wait of the one before (1 s first)",
    )
    parser.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY"), help="with --server: its key (default: $OPENAI_API_KEY)"
    )


def request_seed(seed: int, key: str) -> int:
    """A request's sampling seed from the run's ``seed`` and the row's id: the same on every rerun and in any
    order of requests, so a resumed run asks for what an uninterrupted one would."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:4], "big") >> 1  # 31 bits: any server


class Client:
    """One server's OpenAI API at ``url`` (``http://host:8000``; a trailing ``/v1``, as OpenAI clients take, is
    accepted), with ``retries`` more tries per request after the first, the first backoff ``backoff_s``."""

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        retries: int = 5,
        backoff_s: float = 1.0,
        timeout_s: float = 1800.0,
        connections: int = 8,
    ):
        self.url = url.rstrip("/").removesuffix("/v1")
        self.retries, self.backoff_s = retries, backoff_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # A long read timeout: a request may wait behind the others in the server's queue before its first token.
        self.http = httpx.Client(
            base_url=self.url,
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=connections),
        )
        self.stopping = threading.Event()  # set by close(): requests waiting to retry give up at once

    def close(self) -> None:
        self.stopping.set()
        self.http.close()

    def request(self, method: str, path: str, body: dict | None = None) -> dict:
        """The JSON the server answers ``method path`` with (``body`` sent as JSON), retried as the module says."""
        for attempt in range(self.retries + 1):
            wait_s = min(MAX_WAIT_S, self.backoff_s * 2**attempt) * random.uniform(0.5, 1.0)  # jitter: no herd
            try:
                response = self.http.request(method, path, json=body)
            except httpx.TransportError as exc:  # refused, reset, timed out: the server may come back
                problem = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            else:
                if response.status_code < 400:
                    try:
                        return response.json()
                    except ValueError:
                        raise SpdInputError(f"the server {self.url} answered {path} with something not JSON") from None
                problem = f"HTTP {response.status_code}: {_message(response)}"
                if response.status_code != 429 and response.status_code < 500:
                    raise SpdInputError(f"the server {self.url} refused {method} {path}: {problem}")
                after = response.headers.get("retry-after", "")
                if after.isdigit():  # the server's own estimate of when it has room (a full queue)
                    wait_s = min(MAX_WAIT_S, max(wait_s, float(after)))
            if attempt == self.retries or self.stopping.wait(wait_s):
                break
        tries = f"{attempt + 1} tries" if attempt else "1 try"
        raise SpdInputError(
            f"the server {self.url} did not answer {method} {path} after {tries} ({problem}); check that it runs and "
            "run the same command again: the rows written so far are kept"
        )

    def first_model(self) -> str:
        """The id of the first model the server lists (/v1/models): the one a single-model server serves."""
        try:
            return self.request("GET", "/v1/models")["data"][0]["id"]
        except (KeyError, IndexError, TypeError):
            raise SpdInputError(f"the server {self.url} lists no model at /v1/models; name one with --model") from None

    def complete(self, body: dict, chat: bool) -> Completion:
        """One non-streamed request to /v1/chat/completions (``chat``) or /v1/completions, and its answer."""
        path = "/v1/chat/completions" if chat else "/v1/completions"
        answer = self.request("POST", path, body)
        try:
            choice = answer["choices"][0]
            text = choice["message"]["content"] if chat else choice["text"]
            finish, tokens = choice["finish_reason"], int(answer["usage"]["completion_tokens"])
        except (KeyError, IndexError, TypeError, ValueError):
            raise SpdInputError(
                f"the server {self.url} answered {path} without the choices and usage of an OpenAI response"
            ) from None
        if finish not in ("stop", "length"):
            raise SpdInputError(f"the server {self.url} ended a request with finish_reason '{finish}'")
        # Servers count the EOS a request stopped at among its tokens (usage.completion_tokens); the rows do not.
        return Completion(text or "", finish, max(0, tokens - (finish == "stop")))


def _message(response: httpx.Response) -> str:
    """The error message in a server's answer: OpenAI's ``{"error": {"message"}}``, vLLM's older ``{"message"}``,
    else the start of the body."""
    try:
        body = response.json()
        error = body.get("error")
        message = error.get("message") if isinstance(error, dict) else error or body.get("message")
    except (ValueError, AttributeError):
        message = None
    return str(message) if message else (response.text.strip()[:200] or response.reason_phrase)


def as_completed(
    fn: Callable[[Item], Result], items: Iterable[Item], concurrency: int
) -> Iterator[tuple[Item, Result]]:
    """``(item, fn(item))`` for every item, at most ``concurrency`` calls at once, each as soon as it finishes (in
    any order). After a call fails no new one starts; the calls in flight finish and are yielded, then the first
    failure is raised."""
    pool = ThreadPoolExecutor(concurrency)
    todo, running, failure = iter(items), {}, None
    try:
        while True:
            while failure is None and len(running) < concurrency:
                item = next(todo, _END)
                if item is _END:
                    break
                running[pool.submit(fn, item)] = item
            if not running:
                break
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                item = running.pop(future)
                if future.exception() is not None:
                    failure = failure or future.exception()
                else:
                    yield item, future.result()
        if failure is not None:
            raise failure
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


_END = object()
