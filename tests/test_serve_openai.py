"""spd-serve speaks OpenAI's request shapes: the official openai client against a real server process (one, for the
whole module), explicit JSON nulls meaning the defaults, every 400 in OpenAI's error shape with ``param`` naming the
field and a string ``code``, and the server's log (one access line per request, a warning per 503, a shutdown line).
The protocol's checks themselves are also tested in this process, without a server."""

from __future__ import annotations

import json
import re
import socket
import sys
import time

import httpx
import pytest

from conftest import run_main
from helpers.serve import PROMPT, Server

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "user", "content": "Write a parser."}]

# Every optional field of OpenAI's two endpoints, sent as null (the openai client sends null for a field set to None).
COMPLETION_NULLS = dict.fromkeys(
    "temperature top_p n stream stream_options presence_penalty frequency_penalty logprobs user logit_bias stop seed "
    "max_tokens best_of echo suffix top_k ignore_eos".split()
)
CHAT_NULLS = dict.fromkeys(
    "temperature top_p n stream stream_options presence_penalty frequency_penalty logprobs top_logprobs user "
    "logit_bias tools tool_choice parallel_tool_calls functions function_call response_format stop seed max_tokens "
    "max_completion_tokens modalities audio prediction reasoning_effort verbosity web_search_options store metadata "
    "service_tier prompt_cache_key safety_identifier top_k ignore_eos".split()
)


@pytest.fixture(scope="module")
def server(tiny_testbed):
    server = Server("--target", str(tiny_testbed / "target"), "--mode", "pp", "--stages", "2")
    yield server
    server.stop()


def wait_for_line(server: Server, pattern: str, timeout: float = 10) -> str:
    """The first line of the server's stderr matching ``pattern`` (its log is read by a thread: poll)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = [line for line in list(server.lines) if re.search(pattern, line)]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no log line matches {pattern!r}:\n" + "".join(server.lines[-20:]))


# ------------------------------------------------------------------------------------ the openai client


def test_chat_and_completions_through_the_openai_client(server):
    client = server.client()
    out = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=12, temperature=0)
    assert out.object == "text_completion" and out.choices[0].finish_reason == "length" and out.choices[0].text
    assert out.usage.completion_tokens == 12 and out.usage.total_tokens == out.usage.prompt_tokens + 12
    chat = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=10, temperature=0)
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content and chat.usage.completion_tokens <= 10
    # Text parts are the same message as a string.
    parts = [{"role": "user", "content": [{"type": "text", "text": "Write a "}, {"type": "text", "text": "parser."}]}]
    same = client.chat.completions.create(model=server.model, messages=parts, max_tokens=10, temperature=0)
    assert same.choices[0].message.content == chat.choices[0].message.content


def test_streams_with_include_usage_end_with_a_usage_chunk(server):
    client = server.client()
    whole = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=10, temperature=0)
    chunks = list(
        client.completions.create(
            model=server.model,
            prompt=PROMPT,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])
    chat = list(
        client.chat.completions.create(
            model=server.model,
            messages=MESSAGES,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chat[0].choices[0].delta.role == "assistant" and chat[-1].choices == []
    tokens = sum(len(c.model_extra["spd"].get("token_ids", [])) for c in chat if "spd" in c.model_extra)
    assert chat[-1].usage.completion_tokens == tokens and 0 < tokens <= 8


def test_explicit_nulls_mean_the_defaults(server):
    """Every optional field null, through the client (extra_body) and raw: the answer of the same request without
    them. (temperature null is 1, OpenAI's default: seeded, so that the two draws are the same.)"""
    client = server.client()
    base = {"model": server.model, "prompt": PROMPT}
    plain = client.completions.create(**base, max_tokens=8, seed=3)
    nulls = {k: v for k, v in COMPLETION_NULLS.items() if k not in ("max_tokens", "seed")}
    got = client.completions.create(**base, max_tokens=8, seed=3, extra_body=nulls)
    assert got.choices[0].text == plain.choices[0].text
    # max_tokens null is the completions default, 16.
    raw = server.post("/v1/completions", {**base, **COMPLETION_NULLS})
    assert raw.status_code == 200, raw.text
    assert raw.json()["usage"]["completion_tokens"] <= 16 and raw.json()["choices"][0]["finish_reason"]
    streamed = server.post("/v1/completions", {**base, **COMPLETION_NULLS, "stream": True, "max_tokens": 3})
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    options = server.post("/v1/completions", {**base, "max_tokens": 2, "stream_options": {"include_usage": None}})
    assert options.status_code == 200, options.text

    chat_plain = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=8, seed=5)
    chat_nulls = {k: v for k, v in CHAT_NULLS.items() if k not in ("max_tokens", "seed")}
    chat = client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=8, seed=5, extra_body=chat_nulls
    )
    assert chat.choices[0].message.content == chat_plain.choices[0].message.content
    messages = [{"role": "user", "content": "Write a parser.", "name": None}]
    raw = server.post("/v1/chat/completions", {"model": server.model, "messages": messages, **CHAT_NULLS})
    assert raw.status_code == 200, raw.text
    # The no-op values of the fields the server refuses otherwise are accepted too.
    no_ops = {"n": 1, "logprobs": False, "tools": [], "tool_choice": "none", "response_format": {"type": "text"}}
    no_ops |= {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "store": False, "user": "u1"}
    no_ops |= {"metadata": {"run": "a"}, "service_tier": "auto", "parallel_tool_calls": True, "modalities": ["text"]}
    raw = server.post("/v1/chat/completions", {"model": server.model, "messages": MESSAGES, "max_tokens": 2, **no_ops})
    assert raw.status_code == 200, raw.text


CHAT_400 = [
    # (body fields, param, code, words in the message)
    ({"n": 2}, "n", "unsupported_value", "n = 2 is not supported"),
    ({"n": 0}, "n", "integer_below_min_value", "'n' must be >= 1, got 0"),
    ({"logprobs": True}, "logprobs", "unsupported_value", "logprobs = true is not supported"),
    ({"top_logprobs": 3}, "top_logprobs", "unsupported_value", "top_logprobs = 3 is not supported"),
    ({"presence_penalty": 0.5}, "presence_penalty", "unsupported_value", "presence_penalty = 0.5 is not supported"),
    ({"frequency_penalty": -1}, "frequency_penalty", "unsupported_value", "frequency_penalty = -1.0 is not supported"),
    ({"logit_bias": {"5": 10}}, "logit_bias", "unsupported_value", "'logit_bias' is not supported"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "unsupported_value", "'tools' is not"),
    ({"tool_choice": "required"}, "tool_choice", "unsupported_value", 'tool_choice = "required" is not supported'),
    ({"response_format": {"type": "json_object"}}, "response_format", "unsupported_value", "is not supported"),
    ({"audio": {"voice": "alloy"}}, "audio", "unsupported_parameter", "'audio' is not supported"),
    ({"reasoning_effort": "low"}, "reasoning_effort", "unsupported_parameter", "is not supported"),
    ({"temperature": 3}, "temperature", "decimal_above_max_value", "'temperature' must be <= 2, got 3"),
    ({"temperature": "hot"}, "temperature", "invalid_type", "'temperature' must be a number, got a string"),
    ({"max_tokens": 0}, "max_tokens", "integer_below_min_value", "'max_tokens' must be >= 1"),
    ({"stream": "yes"}, "stream", "invalid_type", "'stream' must be true or false"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "array_above_max_length", "expected at most 4"),
    ({"frobnicate": 1}, "frobnicate", "unknown_parameter", "unknown field 'frobnicate'"),
    ({"messages": []}, "messages", "empty_array", "'messages' must not be empty"),
    ({"messages": None}, "messages", "invalid_type", "'messages' must be an array, got null"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_type", "got 5"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "invalid_value", "must be one of"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", "unsupported_value", "is not supported"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "missing_required_parameter", "is required"),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]}]},
        "messages[0].content[1]",
        "unsupported_value",
        "messages[0].content[1] is a content part of type 'image_url', which is not supported",
    ),
    (
        {"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": "c"}]}]},
        "messages[0].tool_calls",
        "unsupported_value",
        "is not supported",
    ),
    ({"model": "other"}, "model", "model_not_found", 'the model "other" does not exist'),
]


@pytest.mark.parametrize("fields, param, code, words", CHAT_400)
def test_chat_400s_name_the_field_with_openai_codes(server, fields, param, code, words):
    body = {"model": server.model, "messages": MESSAGES, "max_tokens": 2, **fields}
    response = server.post("/v1/chat/completions", body)
    assert response.status_code == (404 if code == "model_not_found" else 400), response.text
    error = response.json()["error"]
    assert error == {"message": error["message"], "type": "invalid_request_error", "param": param, "code": code}
    assert words in error["message"] and "\n" not in error["message"]
    for leak in (".str", "list[", "function-", "Input should", "Value error", "union"):  # no validator internals
        assert leak not in error["message"] and leak not in str(error["param"]), error


COMPLETION_400 = [
    ({"prompt": ["one", "two"]}, "prompt", "unsupported_value", "a list of prompts (batched prompts)"),
    ({"prompt": [[1, 2], [3]]}, "prompt", "unsupported_value", "a list of prompts (batched prompts)"),
    ({"prompt": 5}, "prompt", "invalid_type", "'prompt' must be a string or an array of token ids, got 5"),
    ({"prompt": None}, "prompt", "invalid_type", "got null"),
    ({"prompt": ""}, "prompt", "invalid_value", "the prompt is empty"),
    ({"prompt": [1, 10**6]}, "prompt", "invalid_value", "outside the vocabulary"),
    ({"max_tokens": 100000}, "max_tokens", "context_length_exceeded", "expected max_tokens <="),
    ({"logprobs": 1}, "logprobs", "unsupported_parameter", "logprobs = 1 is not supported"),
    ({"echo": True}, "echo", "unsupported_value", "echo = true is not supported"),
    ({"suffix": "x"}, "suffix", "unsupported_parameter", 'suffix = "x" is not supported'),
    ({"best_of": 2}, "best_of", "unsupported_value", "best_of = 2 is not supported"),
    ({"seed": 2**64}, "seed", "integer_above_max_value", "'seed' must be <= 18446744073709551615"),
    ({"stop": 5}, "stop", "invalid_type", "'stop' must be a string or an array of strings, got 5"),
]


@pytest.mark.parametrize("fields, param, code, words", COMPLETION_400)
def test_completion_400s_name_the_field_with_openai_codes(server, fields, param, code, words):
    response = server.post("/v1/completions", {"model": server.model, "prompt": "x", "max_tokens": 2, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error == {"message": error["message"], "type": "invalid_request_error", "param": param, "code": code}
    assert words in error["message"] and "\n" not in error["message"]


@pytest.mark.parametrize(
    "body, words",
    [
        (b'{"model": "target", "prompt": "\\ud800 x"}', "lone UTF-16 surrogate escape (\\ud800)"),
        (b'{"model": "target", "prompt": "\\ud83d\\ude00 \\udc00"}', "lone UTF-16 surrogate escape (\\udc00)"),
        (b'{"model": "target", "prompt": "\xff"}', "is not UTF-8 text"),
        (b'{"model": "target", "prompt": "x",}', "is not valid JSON"),
        (b'["x"]', "must be a JSON object, got an array"),
    ],
)
def test_bodies_that_are_not_json_objects_say_why(server, body, words):
    response = server.post("/v1/completions", body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert words in error["message"] and error["type"] == "invalid_request_error"
    assert "hex escape" not in error["message"] or "surrogate" in error["message"]
    # A surrogate pair is fine.
    ok = server.post("/v1/completions", b'{"model": "target", "prompt": "\\ud83d\\ude00", "max_tokens": 1}')
    assert ok.status_code == 200, ok.text


def test_the_openai_client_raises_with_openai_fields(server):
    client = server.client()
    cases = [
        (lambda: client.completions.create(model=server.model, prompt=["a", "b"]), "prompt", "unsupported_value"),
        (lambda: client.chat.completions.create(model=server.model, messages=MESSAGES, n=3), "n", "unsupported_value"),
        (
            lambda: client.chat.completions.create(model=server.model, messages=MESSAGES, logprobs=True),
            "logprobs",
            "unsupported_value",
        ),
        (
            lambda: client.chat.completions.create(
                model=server.model,
                messages=[
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}
                ],
            ),
            "messages[0].content[0]",
            "unsupported_value",
        ),
        (
            lambda: client.chat.completions.create(
                model=server.model,
                messages=MESSAGES,
                tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            ),
            "tools",
            "unsupported_value",
        ),
    ]
    for call, param, code in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            call()
        assert (caught.value.param, caught.value.code, caught.value.type) == (param, code, "invalid_request_error")
        assert "is not supported" in caught.value.message
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="nope", prompt="x")
    assert (caught.value.param, caught.value.code) == ("model", "model_not_found")


# ------------------------------------------------------------------------------------------------- the log


def test_one_access_line_per_request(server):
    client = server.client()
    out = client.completions.create(model=server.model, prompt="class A:\n", max_tokens=7, temperature=0)
    assert out.usage.completion_tokens == 7
    line = wait_for_line(server, r'"POST /v1/completions" 200 OK, 7 tokens, L\'_acc \d+\.\d\d, \d+\.\d{3} s$')
    assert line.startswith("[spd-serve] 127.0.0.1:")
    list(client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=5, stream=True, seed=1))
    wait_for_line(server, r'"POST /v1/chat/completions" 200 OK, \d tokens, L\'_acc \d+\.\d\d, \d+\.\d{3} s$')
    httpx.get(f"{server.url}/health")
    wait_for_line(server, r'"GET /health" 200 OK, \d+\.\d{3} s$')
    server.post("/v1/completions", {"model": server.model, "prompt": "x", "n": 4})
    wait_for_line(server, r'"POST /v1/completions" 400 Bad Request, \d+\.\d{3} s$')
    # A stream its client leaves: the line says so, with the tokens it had.
    body = {"model": server.model, "prompt": "x", "max_tokens": 240, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break
    wait_for_line(server, r"200 OK, \d+ tokens, \d+\.\d{3} s; the client went away; its generation was cancelled$")


def test_a_port_in_use_is_one_error_before_the_model_loads(tiny_testbed):
    """The port is bound before the model loads: the port is what is reported (one line, exit 2)."""
    from spd.cli.serve import main as serve_main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_main(serve_main, "--target", str(tiny_testbed / "target"), "--mode", "pp", "--port", str(port))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: cannot listen on 127.0.0.1:{port}: the address is already in use"), lines


def test_the_missing_extra_names_the_documented_install_command(monkeypatch, tmp_path):
    from spd.cli.serve import main as serve_main

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import uvicorn raises ImportError
    proc = run_main(serve_main, "--target", str(tmp_path), "--mode", "pp", "--port", "0")
    assert proc.returncode == 2 and "(uvicorn is missing)" in proc.stderr
    assert "pip install -e '.[serve]'" in proc.stderr, proc.stderr


# ------------------------------------------------------------------------------------ the protocol, in process


def test_every_optional_field_takes_null():
    from spd.serving.requests import ChatCompletionRequest, CompletionRequest

    completion = CompletionRequest.model_validate_json(json.dumps({"model": "m", "prompt": "x", **COMPLETION_NULLS}))
    assert (completion.temperature, completion.top_p, completion.n, completion.max_tokens) == (1.0, 1.0, 1, 16)
    assert completion.stop == [] and completion.stream is False and completion.unsupported() is None
    chat = ChatCompletionRequest.model_validate_json(json.dumps({"model": "m", "messages": MESSAGES, **CHAT_NULLS}))
    assert chat.budget() is None and chat.tools == [] and chat.unsupported() is None
    for name, field in {**CompletionRequest.model_fields, **ChatCompletionRequest.model_fields}.items():
        if not field.is_required():
            assert name in COMPLETION_NULLS or name in CHAT_NULLS, f"{name} is not tested with null"


def test_lone_surrogates_are_found():
    from spd.serving.protocol import lone_surrogate

    assert lone_surrogate(r'"\ud800"') == r"\ud800"
    assert lone_surrogate(r'"\ud83d\ude00 \udc01"') == r"\udc01"
    assert lone_surrogate(r'"\ud800\u0041"') == r"\ud800"
    assert lone_surrogate(r'"\ud800 \udc00"') == r"\ud800"  # not adjacent: no pair
    assert lone_surrogate(r'"\\ud800 \ud83d\ude00"') is None  # an escaped backslash, then text
    assert lone_surrogate(r'"\u0041"') is None
