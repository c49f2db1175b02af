"""spd-serve: the real server process on a free local port, talked to with the real openai client and raw HTTP."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from conftest import REPO, run_main
from helpers.serve import PROMPT, Server, cli_json

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def spd_server(tiny_testbed, tiny_heads):
    server = Server("--target", str(tiny_testbed / "target"), "--mode", "spd", "--speculator", str(tiny_heads[4]))
    yield server
    server.stop()


# ------------------------------------------------------------------------------ output == spd-generate


@pytest.mark.slow
def test_completion_equals_spd_generate(spd_server, tiny_testbed, tiny_heads):
    expected = cli_json(
        tiny_testbed, "--mode", "spd", "--speculator", str(tiny_heads[4]), "--prompt", PROMPT, "--max-new-tokens", "24"
    )
    out = spd_server.client().completions.create(model=spd_server.model, prompt=PROMPT, max_tokens=24, temperature=0)
    assert out.choices[0].text == expected["text"]
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 24 and out.usage.prompt_tokens == expected["stats"]["prompt_tokens"]
    spd = out.model_extra["spd"]
    assert spd["mode"] == "spd" and spd["stages"] == 4
    assert spd["equivalent_accept_length"] == pytest.approx(4 * spd["decode_tokens"] / spd["steps"], abs=1e-3)
    assert len(spd["accepted_by_position"]) == 4 and sum(spd["token_acceptance"]) == spd["accepted"]


def test_token_id_prompt_and_seeded_sampling_equal_spd_generate(spd_server, tiny_testbed, tiny_heads):
    sampled = ["--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--seed", "3"]
    expected = cli_json(
        tiny_testbed,
        "--mode",
        "spd",
        "--speculator",
        str(tiny_heads[4]),
        "--prompt-ids",
        "5,17,40",
        "--max-new-tokens",
        "16",
        *sampled,
    )
    out = spd_server.post(
        "/v1/completions",
        {
            "model": spd_server.model,
            "prompt": [5, 17, 40],
            "max_tokens": 16,
            "temperature": 0.8,
            "top_k": 20,
            "top_p": 0.9,
            "seed": 3,
        },
    ).json()
    assert out["choices"][0]["text"] == expected["text"]
    assert out["spd"]["token_acceptance"] == expected["stats"]["token_acceptance"]


@pytest.mark.slow
def test_ignore_eos_runs_past_the_eos_token(spd_server):
    # A seeded T = 1 request that ends at EOS; the same request with ignore_eos runs on to max_tokens, drawing
    # the same tokens up to there.
    body = {"model": spd_server.model, "prompt": "x", "max_tokens": 200, "temperature": 1.0}
    for seed in range(40):
        ended = spd_server.post("/v1/completions", {**body, "seed": seed}).json()
        if ended["spd"]["stop_reason"] == "eos":
            break
    else:
        pytest.fail("no seed in 0..39 reached EOS within 200 tokens")
    assert ended["choices"][0]["finish_reason"] == "stop" and ended["usage"]["completion_tokens"] < 200
    full = spd_server.post("/v1/completions", {**body, "seed": seed, "ignore_eos": True}).json()
    assert full["choices"][0]["finish_reason"] == "length" and full["usage"]["completion_tokens"] == 200
    assert full["spd"]["token_acceptance"][: ended["usage"]["completion_tokens"]] == ended["spd"]["token_acceptance"]
    assert full["choices"][0]["text"].startswith(ended["choices"][0]["text"])


def test_chat_equals_spd_generate_chat(spd_server, tiny_testbed, tiny_heads):
    expected = cli_json(
        tiny_testbed,
        "--mode",
        "spd",
        "--speculator",
        str(tiny_heads[4]),
        "--chat",
        "--prompt",
        "Write a parser.",
        "--max-new-tokens",
        "20",
    )
    out = spd_server.client().chat.completions.create(
        model=spd_server.model, messages=[{"role": "user", "content": "Write a parser."}], max_tokens=20, temperature=0
    )
    assert out.choices[0].message.content == expected["text"] and out.choices[0].message.role == "assistant"
    assert out.usage.prompt_tokens == expected["stats"]["prompt_tokens"]


def test_streaming_equals_non_streaming(spd_server):
    client = spd_server.client()
    whole = client.completions.create(model=spd_server.model, prompt=PROMPT, max_tokens=30, temperature=0)
    chunks = list(
        client.completions.create(
            model=spd_server.model,
            prompt=PROMPT,
            max_tokens=30,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 30
    # Every token went out exactly once, in order (the spd extension of each chunk names its tokens).
    streamed = [
        t
        for c in chunks
        if c.choices and "token_ids" in c.model_extra.get("spd", {})
        for t in c.model_extra["spd"]["token_ids"]
    ]
    assert len(streamed) == 30

    messages = [{"role": "user", "content": "hello"}]
    whole = client.chat.completions.create(model=spd_server.model, messages=messages, max_tokens=25, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=spd_server.model, messages=messages, max_tokens=25, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_stop_strings_cut_the_text_streamed_or_not(spd_server):
    client = spd_server.client()
    full = (
        client.completions.create(model=spd_server.model, prompt="import os\n", max_tokens=40, temperature=0)
        .choices[0]
        .text
    )
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert len(stop) == 3
    expected = full[: full.index(stop)]
    out = client.completions.create(
        model=spd_server.model, prompt="import os\n", max_tokens=40, temperature=0, stop=[stop, "\x00never"]
    )
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < 40 and out.model_extra["spd"]["stop_reason"] == "stopped"
    chunks = list(
        client.completions.create(
            model=spd_server.model, prompt="import os\n", max_tokens=40, temperature=0, stop=stop, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == expected  # nothing past the stop was ever streamed
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_sixteen_concurrent_clients_all_answered_correctly(spd_server):
    client = spd_server.client(timeout=300)
    prompts = [f"def f{i}(x):\n    return" for i in range(16)]
    expected = [
        client.completions.create(model=spd_server.model, prompt=p, max_tokens=12, temperature=0).choices[0].text
        for p in prompts
    ]
    with ThreadPoolExecutor(16) as pool:
        answers = list(
            pool.map(
                lambda p: (
                    client.completions.create(model=spd_server.model, prompt=p, max_tokens=12, temperature=0)
                    .choices[0]
                    .text
                ),
                prompts,
            )
        )
    assert answers == expected


@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["local", "distributed"])
def test_batched_server_answers_each_client_as_the_one_at_a_time_server(spd_server, tiny_testbed, tiny_heads, runtime):
    """--max-batch 4 with a KV pool that holds fewer: 16 concurrent clients (greedy and seeded sampling, a stop string,
    a long prompt, one that disconnects, one bad request) each get the answer the one-at-a-time server gives, then a
    streamed one; /metrics shows the batch and the time between tokens (per gap and per request). In this process,
    and over the distributed runtime (the ragged batches carried stage to stage by 4 stage processes)."""
    server = Server(
        "--target",
        str(tiny_testbed / "target"),
        "--mode",
        "spd",
        "--speculator",
        str(tiny_heads[4]),
        "--max-batch",
        "4",
        "--kv-rows",
        "400",
        "--prefill-chunk",
        "16",
        "--step-tokens",
        "24",
        "--spread-prefill",
        "--runtime",
        runtime,
    )
    try:
        bodies = [
            {
                "model": server.model,
                "prompt": f"def f{i}(x):\n    return",
                "max_tokens": 8 + 3 * i,
                "temperature": 0.0 if i % 3 else 0.8,
                "seed": i,
            }
            for i in range(14)
        ]
        bodies[4]["stop"] = ["\n"]
        bodies[7]["prompt"] = "word " * 40

        def ask(url, model, body):
            return httpx.post(f"{url}/v1/completions", json={**body, "model": model}, timeout=300).json()

        expected = [ask(spd_server.url, spd_server.model, b) for b in bodies]

        def disconnect():
            with httpx.stream(
                "POST",
                f"{server.url}/v1/completions",
                timeout=300,
                json={"model": server.model, "prompt": "x", "max_tokens": 200, "stream": True},
            ) as r:
                for _ in zip(range(3), r.iter_lines()):
                    pass  # three events, then the client goes away

        with ThreadPoolExecutor(16) as pool:
            gone = pool.submit(disconnect)
            bad = pool.submit(ask, server.url, server.model, {"prompt": [1, 10**6], "max_tokens": 4})
            answers = list(pool.map(lambda b: ask(server.url, server.model, b), bodies))
            gone.result()
            error = bad.result()["error"]
            assert error["code"] == "invalid_value" and "outside the vocabulary" in error["message"]
        for got, want in zip(answers, expected):
            assert got["choices"][0]["text"] == want["choices"][0]["text"]
            assert got["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"]
        streamed = list(
            server.client().completions.create(
                model=server.model,
                prompt=bodies[1]["prompt"],
                max_tokens=bodies[1]["max_tokens"],
                temperature=0,
                stream=True,
            )
        )
        assert "".join(c.choices[0].text for c in streamed) == expected[1]["choices"][0]["text"]
        deadline = time.time() + 30
        while time.time() < deadline:  # the disconnected client's request is cancelled at its next token
            m = server.metrics()
            if m.get('spd_requests_total{endpoint="completions",outcome="cancelled"}', 0) == 1:
                break
            time.sleep(0.2)
        assert m['spd_requests_total{endpoint="completions",outcome="ok"}'] == 15
        assert m["spd_time_between_tokens_seconds_count"] > 50 and "spd_batch_size" in m
        # Each request of two tokens or more gives its own mean time between tokens (the disconnected one too, if
        # it ended after its tokens rather than before).
        multi = sum(a["usage"]["completion_tokens"] > 1 for a in [*answers, expected[1]])
        assert multi <= m["spd_request_time_between_tokens_seconds_count"] <= multi + 1
        assert m["spd_request_time_between_tokens_seconds_sum"] > 0
        assert m["spd_batch_size"] == 0 and m["spd_kv_reserved_tokens"] == 0  # idle again, every region given back
    finally:
        server.stop()


# ------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "body, status, needle",
    [
        ("{not json", 400, "not valid JSON"),
        ('["a list"]', 400, "JSON object"),
        ({"prompt": "x"}, 400, "'model' is required"),
        ({"MODEL": "target", "prompt": "x"}, 400, "'model' is required"),
        ({"model": "M", "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
        ({"model": "M", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ({"model": "M", "prompt": "x", "temperature": 3}, 400, "temperature"),
        ({"model": "M", "prompt": "x", "stream": "yes"}, 400, "stream"),
        ({"model": "M", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "M", "prompt": "x", "frobnicate": 1}, 400, "unknown field 'frobnicate'"),
        ({"model": "M", "prompt": "x", "n": 2}, 400, "n = 2"),
        ({"model": "M", "prompt": "x", "logprobs": 1}, 400, "logprobs"),
        ({"model": "M", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({"model": "M", "prompt": ""}, 400, "empty"),
        ({"model": "M", "prompt": [1, 2, 10**6]}, 400, "outside the vocabulary"),
        ({"model": "M", "prompt": "x", "max_tokens": 100000}, 400, "context"),
        ({"model": "M", "prompt": "word " * 400}, 400, "context"),
        ({"model": "other-model", "prompt": "x"}, 404, "does not exist"),
    ],
)
def test_bad_requests_get_one_clear_openai_error(spd_server, body, status, needle):
    if isinstance(body, dict) and body.get("model") == "M":
        body = {**body, "model": spd_server.model}
    response = spd_server.post("/v1/completions", body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert needle in error["message"] and "\n" not in error["message"] and error["type"]
    # The server keeps serving.
    ok = spd_server.post("/v1/completions", {"model": spd_server.model, "prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "role"),
        ({"messages": [{"role": "user", "content": 5}]}, "content"),
        ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, "logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools"),
    ],
)
def test_bad_chat_requests(spd_server, body, needle):
    response = spd_server.post("/v1/chat/completions", {"model": spd_server.model, **body})
    assert response.status_code == 400 and needle in response.json()["error"]["message"]


def test_openai_client_raises_on_bad_request(spd_server):
    with pytest.raises(openai.BadRequestError, match="n = 3"):
        spd_server.client().completions.create(model=spd_server.model, prompt="x", n=3)
    with pytest.raises(openai.NotFoundError):
        spd_server.client().completions.create(model="nope", prompt="x")


# ----------------------------------------------------------------------------- health, models, metrics


def test_health_models_and_metrics(spd_server):
    health = httpx.get(f"{spd_server.url}/health").json()
    assert health["status"] == "ok" and health["mode"] == "spd" and health["stages"] == 4
    models = httpx.get(f"{spd_server.url}/v1/models").json()
    assert models["data"][0]["id"] == spd_server.model == "target"
    before = spd_server.metrics()
    outs = [
        spd_server.post(
            "/v1/completions", {"model": spd_server.model, "prompt": p, "max_tokens": 10, "temperature": 0}
        ).json()
        for p in ("a = 1\n", "class A:\n")
    ]
    after = spd_server.metrics()
    ok = 'spd_requests_total{endpoint="completions",outcome="ok"}'
    assert after[ok] - before.get(ok, 0) == 2
    assert after["spd_generation_tokens_total"] - before["spd_generation_tokens_total"] == 20
    steps = after["spd_pipeline_steps_total"] - before["spd_pipeline_steps_total"]
    assert steps == sum(o["spd"]["steps"] for o in outs)
    decode = after["spd_decode_tokens_total"]
    assert after["spd_mean_accept_length"] == pytest.approx(4 * decode / after["spd_pipeline_steps_total"])
    for position in range(1, 5):
        assert f'spd_accepted_by_position_total{{position="{position}"}}' in after
    assert after["spd_queue_length"] == 0 and "spd_request_latency_seconds_count" in after


# ------------------------------------------------------------------------------------------ disconnect


def test_client_disconnect_cancels_the_generation(spd_server):
    before = spd_server.metrics()
    body = {
        "model": spd_server.model,
        "prompt": "x",
        "max_tokens": 240,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{spd_server.url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk arrived: generation is running; leave
    # A non-streamed request whose client goes away is cancelled too.
    url = httpx.URL(spd_server.url)
    sock = socket.create_connection((url.host, url.port))
    payload = json.dumps({**body, "stream": False}).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload)
    )
    time.sleep(0.4)  # whether it is still queued or already running, closing the connection cancels it
    sock.close()
    key = 'spd_requests_total{endpoint="completions",outcome="cancelled"}'
    deadline = time.time() + 60
    while time.time() < deadline and spd_server.metrics().get(key, 0) - before.get(key, 0) < 2:
        time.sleep(0.2)
    after = spd_server.metrics()
    assert after[key] - before.get(key, 0) == 2
    # Neither ran to its 240 tokens.
    assert after["spd_generation_tokens_total"] - before["spd_generation_tokens_total"] < 2 * 240
    ok = spd_server.post("/v1/completions", {"model": spd_server.model, "prompt": "x", "max_tokens": 3})
    assert ok.status_code == 200


# ------------------------------------------------------------------------------- queue, pp, tree mode


@pytest.mark.slow
def test_a_batched_step_that_raises_fails_its_requests_and_the_server_goes_on(tiny_testbed, tiny_heads, monkeypatch):
    """The engine thread of a batched server, in this process: the requests of a step whose stage call raised get a
    500 with the error, and the server answers the next ones as usual (it is not down)."""
    import asyncio

    import spd.decoding.backend as batch_module
    from spd.decoding.sampling import SamplingParams
    from spd.serving.metrics import ServerMetrics
    from spd.serving.pipeline import PipelineSpec, open_pipeline
    from spd.serving.scheduler import Job, Scheduler

    pipeline = open_pipeline(
        PipelineSpec(target=str(tiny_testbed / "target"), speculator=str(tiny_heads[4]), mode="spd")
    )
    scheduler = Scheduler(pipeline, ServerMetrics("t", "spd", 4, "local"), max_batch=4, idle_s=0.5)
    original, calls = batch_module.run_ragged, [0]

    def fails_first(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("the stage call failed")
        return original(*args, **kwargs)

    monkeypatch.setattr(batch_module, "run_ragged", fails_first)

    async def ask(prompts):
        loop = asyncio.get_running_loop()
        jobs = [Job(prompt_ids=p, max_new_tokens=8, sampling=SamplingParams(), stops=[], loop=loop) for p in prompts]
        for job in jobs:
            scheduler.submit(job)
        ends = []
        for job in jobs:
            event = await asyncio.wait_for(job.events.get(), 120)
            while event[0] not in ("done", "error"):
                event = await asyncio.wait_for(job.events.get(), 120)
            ends.append(event)
        return ends

    scheduler.start()
    try:
        first = asyncio.run(ask([[5, 6, 7], [8, 9]]))
        assert first[0][:2] == ("error", 500) and "the stage call failed" in first[0][2]
        assert all(end[0] in ("done", "error") for end in first)
        again = asyncio.run(ask([[5, 6, 7], [8, 9], [10]]))
        assert [end[0] for end in again] == ["done"] * 3 and scheduler.failure() is None
    finally:
        scheduler.stop()


def test_full_queue_gets_503_with_retry_after(tiny_testbed):
    server = Server("--target", str(tiny_testbed / "target"), "--mode", "pp", "--stages", "4", "--max-queue", "1")
    try:
        body = {"model": server.model, "prompt": "x", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
        with ThreadPoolExecutor(4) as pool:
            # One request running first (else all four may arrive before the scheduler takes one from the queue of
            # one, and only one is answered), then three at once: one waits in the queue, the others are refused.
            first = pool.submit(server.post, "/v1/completions", body)
            deadline = time.monotonic() + 60
            while server.metrics().get("spd_running_requests", 0) < 1 and not first.done():
                assert time.monotonic() < deadline, "the first request never started"
                time.sleep(0.02)
            rest = list(pool.map(lambda _: server.post("/v1/completions", body), range(3)))
            responses = [first.result(), *rest]
        codes = sorted(r.status_code for r in responses)
        assert codes.count(503) >= 1 and codes.count(200) >= 2, codes
        busy = next(r for r in responses if r.status_code == 503)
        assert int(busy.headers["retry-after"]) >= 1 and "busy" in busy.json()["error"]["message"]
        texts = {r.json()["choices"][0]["text"] for r in responses if r.status_code == 200}
        assert len(texts) == 1  # the same greedy request, the same answer
        assert server.metrics()['spd_requests_total{endpoint="completions",outcome="rejected"}'] >= 1
    finally:
        server.stop()
    # The log: a warning for every 503, saying why; an access line for each answer; one line at shutdown.
    deadline = time.time() + 10
    while time.time() < deadline and not any("shutting down after" in line for line in server.lines):
        time.sleep(0.05)
    refused = [line for line in server.lines if '"POST /v1/completions" 503 Service Unavailable' in line]
    assert len(refused) == codes.count(503), server.lines
    assert all(line.startswith("[spd-serve] warning: ") and "the server is busy" in line for line in refused)
    served = [line for line in server.lines if '"POST /v1/completions" 200 OK, 200 tokens' in line]
    assert len(served) == codes.count(200), server.lines
    stopped = [line for line in server.lines if "shutting down after" in line]
    assert len(stopped) == 1 and f"{len(responses)} requests answered" in stopped[0], server.lines


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode,flags", [("tree", ["--stages", "2", "--tree-width", "3"]), ("sd", ["--draft-steps", "3"])]
)
def test_draft_model_server_equals_spd_generate(tiny_testbed, mode, flags):
    """spd-serve with a draft model: a token tree in the pipeline, or serial speculative decoding."""
    server = Server(
        "--target", str(tiny_testbed / "target"), "--mode", mode, "--draft-model", str(tiny_testbed / "draft"), *flags
    )
    try:
        expected = cli_json(tiny_testbed, "--mode", "ar", "--prompt", PROMPT, "--max-new-tokens", "30")
        chunks = list(
            server.client().completions.create(
                model=server.model, prompt=PROMPT, max_tokens=30, temperature=0, stream=True
            )
        )
        assert "".join(c.choices[0].text for c in chunks) == expected["text"]
        assert chunks[-1].model_extra["spd"]["mode"] == mode
    finally:
        server.stop()


# ------------------------------------------------------------------------------- distributed runtime


@pytest.mark.slow
def test_distributed_server_serves_many_requests_on_one_set_of_processes(tiny_testbed, tiny_heads):
    prompts = [PROMPT, "import os\n", "class A:\n"]
    cases = [
        (
            "--mode",
            "spd",
            "--speculator",
            str(tiny_heads[4]),
            "--prompt",
            prompt,
            "--max-new-tokens",
            "16",
            "--temperature",
            "1",
            "--seed",
            str(i),
        )
        for i, prompt in enumerate(prompts)
    ]
    cases.append(("--mode", "ar", "--prompt", PROMPT, "--max-new-tokens", "16"))
    *sampled, greedy = [cli_json(tiny_testbed, *args) for args in cases]
    # A short timeout: idle stages must be kept alive by pings between requests.
    server = Server(
        "--target",
        str(tiny_testbed / "target"),
        "--mode",
        "spd",
        "--speculator",
        str(tiny_heads[4]),
        "--runtime",
        "distributed",
        "--timeout-s",
        "6",
    )
    try:
        stages = _stage_pids(server.proc.pid)
        assert len(stages) == 4
        client = server.client()
        for i, (prompt, expected) in enumerate(zip(prompts, sampled)):
            out = client.completions.create(model=server.model, prompt=prompt, max_tokens=16, temperature=1, seed=i)
            assert out.choices[0].text == expected["text"]
        time.sleep(8)  # longer than the stages' timeout: they stay up
        chunks = list(
            client.completions.create(model=server.model, prompt=PROMPT, max_tokens=16, temperature=0, stream=True)
        )
        assert "".join(c.choices[0].text for c in chunks) == greedy["text"]
        assert _stage_pids(server.proc.pid) == stages  # the same processes served every request
        assert httpx.get(f"{server.url}/health").json()["runtime"] == "distributed"
        server.proc.send_signal(signal.SIGTERM)  # a clean stop: STOP down the chain, every process exits
        assert server.proc.wait(timeout=60) == 0
    finally:
        server.stop()
    _wait_gone(stages)
    assert not [line for line in server.lines if line.startswith("error:")], server.lines


@pytest.mark.slow
def test_distributed_server_with_a_dead_stage_answers_503(tiny_testbed):
    server = Server(
        "--target",
        str(tiny_testbed / "target"),
        "--mode",
        "pp",
        "--stages",
        "2",
        "--runtime",
        "distributed",
        "--emulate-stage-ms",
        "20",
    )
    try:
        stages = _stage_pids(server.proc.pid)
        ok = server.post("/v1/completions", {"model": server.model, "prompt": "x", "max_tokens": 4})
        assert ok.status_code == 200
        # A stage dies in the middle of a request (200 tokens x 2 stages x 20 ms: 8 s): that request gets a
        # clear 503 naming it, not a hang; then /health fails and every new request gets a 503 too.
        threading.Timer(1.5, os.kill, (stages[1], signal.SIGKILL)).start()
        response = server.post(
            "/v1/completions",
            {"model": server.model, "prompt": "x", "max_tokens": 200, "temperature": 0, "ignore_eos": True},
        )
        assert response.status_code == 503, response.text
        assert "rank 2" in response.json()["error"]["message"]
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503 and "rank 2" in health.json()["error"]["message"]
        assert "must be restarted" in health.json()["error"]["message"]
        response = server.post("/v1/completions", {"model": server.model, "prompt": "x", "max_tokens": 4})
        assert response.status_code == 503 and "pipeline is down" in response.json()["error"]["message"]
        assert httpx.get(f"{server.url}/health").status_code == 503  # and stays so: no hang, no crash
        # The operator learns it from the log too, once.
        logged = [line for line in server.lines if "error: the pipeline is down" in line]
        assert len(logged) == 1 and "rank 2" in logged[0] and "must be restarted" in logged[0], server.lines
    finally:
        server.stop()
    assert server.proc.returncode is not None
    _wait_gone(stages)


def _wait_gone(pids: list[int]) -> None:
    deadline = time.time() + 30
    while time.time() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.5)
    assert not any(_alive(pid) for pid in pids)


def _stage_pids(parent: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(parent), "-f", "spd.cli.run_pipeline"], capture_output=True, text=True)
    return sorted(int(p) for p in out.stdout.split())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


# ------------------------------------------------------------------------------------------ the CLI


BAD_FLAGS = [
    (["--mode", "spd"], "--speculator"),
    (["--target", "/nonexistent/model"], "does not exist"),
    (["--mode", "fast"], "unknown --mode"),
    (["--max-queue", "0"], "positive integer"),
    (["--port", "70000"], "--port"),
    (["--idle-ping-s", "-1"], "positive number of seconds"),  # it used to kill the engine thread at its first wait
    (["--idle-ping-s", "0"], "positive number of seconds"),
    (["--idle-ping-s", "nan"], "finite"),
    (["--runtime", "distributed", "--mode", "pp", "--timeout-s", "4", "--idle-ping-s", "5"], "less than --timeout-s"),
    (["--max-body-bytes", "0"], "positive integer"),
    (["--max-model-len", "100000"], "more than the model's context of 256"),
    (["--api-key", " "], "API key (--api-key or SPD_API_KEY) is empty"),
    (["--mode", "pp", "--stages", "2", "--local-stages", "1"], "need --runtime distributed"),
    (["--mode", "pp", "--stages", "2", "--runtime", "distributed", "--local-stages", "1"], "pass --stage-addr"),
    (
        ["--mode", "pp", "--stages", "2", "--runtime", "distributed", "--local-stages", "3"],
        "--local-stages must be in 0..2",
    ),
    (
        [
            "--mode",
            "pp",
            "--stages",
            "2",
            "--runtime",
            "distributed",
            "--local-stages",
            "1",
            "--stage-addr",
            "127.0.0.1:29500",
        ],
        "loopback address",
    ),
    (
        [
            "--mode",
            "pp",
            "--stages",
            "2",
            "--runtime",
            "distributed",
            "--local-stages",
            "1",
            "--stage-addr",
            "10.0.0.1:0",
        ],
        "not an address",
    ),
    (["--local-stages", "-1"], "integer >= 0"),
    (["--max-batch", "0"], "positive integer"),
    (["--mode", "ar", "--max-batch", "2"], "batches --mode spd, pp or tree, not 'ar'"),
    (["--mode", "pp", "--kv-rows", "100"], "needs --max-batch above 1"),
    (["--mode", "pp", "--prefill-chunk", "16"], "needs --max-batch above 1"),
    (["--mode", "pp", "--max-batch", "2", "--prefill-chunk", "0"], "positive integer"),
    (["--mode", "pp", "--step-tokens", "64"], "needs --max-batch above 1"),
    (["--mode", "pp", "--spread-prefill"], "needs --max-batch above 1"),
    (["--mode", "pp", "--max-batch", "4", "--step-tokens", "4"], "above the 4 tokens of levels a stage call carries"),
    (["--mode", "pp", "--tree-nodes", "4"], "needs --max-batch above 1"),
    (["--mode", "pp", "--max-batch", "2", "--tree-nodes", "4"], "narrows token trees; it needs --mode tree"),
    (["--mode", "pp", "--max-batch", "4", "--tree-nodes", "2"], "--tree-nodes must be at least --max-batch (4"),
]


def test_cli_bad_flags_one_line_exit_2(tiny_testbed):
    """Each bad flag or combination: exit 2 with one line on stderr (spd-serve's main(argv), in this process)."""
    from spd.cli.serve import main as serve_main

    def run(case):
        args, needle = case
        # (--port 0 first: the port is bound before the model loads, and 8000 may be taken here)
        return args, needle, run_main(serve_main, "--target", str(tiny_testbed / "target"), "--port", "0", *args)

    for args, needle, proc in map(run, BAD_FLAGS):
        assert proc.returncode == 2, (args, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], (args, proc.stderr)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--server", "10.0.0.1:x"], "is not an address"),
        (["--server", "127.0.0.1:1", "--hold", "a,b"], "--hold 'a,b' is not a list of stage numbers"),
        (["--server", "127.0.0.1:1", "--wait-s", "0"], "--wait-s must be a positive"),
        (
            ["--server", "127.0.0.1:1", "--wait-s", "1"],
            "no spd-serve with remote stages answered at 127.0.0.1:1 within 1 s",
        ),
    ],
)
def test_spd_stage_bad_input_one_line_exit_2(tiny_testbed, args, needle):
    """spd-stage (a machine joining a server's pipeline, tested across namespaces in test_multinode.py)."""
    proc = subprocess.run(
        [sys.executable, "-m", "spd.cli.stage", "--target", str(tiny_testbed / "target"), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.strip().splitlines() if "[c10d]" not in line]  # (torch's own warnings)
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], proc.stderr


# ------------------------------------------------------------------------------- pieces, in process


def test_engines_stop_when_on_token_says_so(tiny_testbed, tiny_heads):
    from spd.decoding.engine import Engine

    spd = Engine.from_pretrained(str(tiny_testbed / "target"), speculator=str(tiny_heads[4]))
    tree = Engine.from_pretrained(str(tiny_testbed / "target"), draft_model=str(tiny_testbed / "draft"), stages=2)
    full = spd.generate(PROMPT, 20, mode="ar").token_ids
    for engine, mode in ((spd, "ar"), (spd, "pp"), (spd, "spd"), (tree, "tree")):
        seen = []
        out = engine.generate(PROMPT, 20, mode=mode, on_token=lambda t, a: seen.append(t) or len(seen) == 7)  # noqa: B023 - on_token runs inside this generate call
        assert out.token_ids == seen == full[:7] and out.stats.stop_reason == "stopped", mode


def test_text_tracker_holds_back_possible_stop_strings(tiny_testbed):
    from spd.serving.scheduler import TextTracker
    from spd.target.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_testbed / "target"))
    ids = tokenizer("alpha beta gamma delta")["input_ids"]
    tracker = TextTracker(tokenizer, ["gamma"], threading.Lock())
    streamed = ""
    for token in ids:
        streamed += tracker.add(token)
        assert "gam" not in streamed
        if tracker.stopped:
            break
    streamed += tracker.finish()
    assert (
        tracker.stopped
        and streamed == tracker.text == tokenizer.decode(ids, skip_special_tokens=True).split("gamma")[0]
    )
    free = TextTracker(tokenizer, ["zzz"], threading.Lock())
    text = "".join(free.add(t) for t in ids) + free.finish()
    assert text == tokenizer.decode(ids, skip_special_tokens=True) and not free.stopped


def _naive_tracker_text(tokenizer, ids: list[int], stops: list[str]) -> tuple[str, str, bool]:
    """The stop-string semantics by brute force (every prefix of every stop at every token): (streamed text, whole
    text, stopped)."""
    streamed, sent = "", 0
    for i in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:i], skip_special_tokens=True)
        hits = [j for j in (text.find(stop) for stop in stops) if j >= 0]
        if hits:
            text = text[: min(hits)]
            return streamed + text[sent:], text, True
        if text.endswith("\ufffd"):
            continue
        held = max((k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)
        if len(text) - held > sent:
            streamed, sent = streamed + text[sent : len(text) - held], len(text) - held
    return streamed + text[sent:], text, False


def test_text_tracker_matches_brute_force_stop_semantics(tiny_testbed):
    import random

    from spd.serving.scheduler import TextTracker
    from spd.target.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_testbed / "target"))
    rng = random.Random(0)
    text = "def parse(path):\n    with open(path) as f:\n        return [line.split(',') for line in f]\n" * 3
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    for _ in range(60):
        stops = []
        for _ in range(rng.randint(1, 4)):
            start = rng.randrange(len(text) - 1)
            stops.append(text[start : start + rng.randint(1, 12)] + ("" if rng.random() < 0.7 else "\x00"))
        tracker = TextTracker(tokenizer, stops, threading.Lock())
        streamed = ""
        for token in ids:
            streamed += tracker.add(token)
            if tracker.stopped:
                break
        streamed += tracker.finish()
        assert (streamed, tracker.text, tracker.stopped) == _naive_tracker_text(tokenizer, ids, stops), stops


def test_text_tracker_is_linear_in_stop_string_length(tiny_testbed):
    # Issue 25: four 100,000-character stop strings made a 16-token request take 7 s (every prefix of every stop
    # string was copied at every token). The protocol now refuses stop strings over 1,000 characters, and the
    # tracker's work per token does not grow with their length anyway.
    from spd.serving.scheduler import TextTracker
    from spd.target.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_testbed / "target"))
    ids = tokenizer("alpha beta gamma delta " * 4, add_special_tokens=False)["input_ids"][:16]
    stops = ["a" * 100_000, "alpha beta " * 10_000, "x" * 100_000, " " * 100_000]
    start = time.perf_counter()
    tracker = TextTracker(tokenizer, stops, threading.Lock())
    streamed = "".join(tracker.add(token) for token in ids) + tracker.finish()
    assert time.perf_counter() - start < 1.0
    assert not tracker.stopped and streamed == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
def test_load_benchmark_runs_side_by_side(tiny_testbed, tiny_heads, tmp_path):
    out = tmp_path / "load.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "spd.bench",
            "serve",
            "--target",
            str(tiny_testbed / "target"),
            "--prompts",
            str(tiny_testbed / "prompts.jsonl"),
            "--run",
            f"spd:{tiny_heads[4]}",
            "--run",
            "pp:4",
            "--requests",
            "6",
            "--concurrency",
            "3",
            "--max-tokens",
            "8",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["identical_outputs"] and [r["name"] for r in report["runs"]] == [f"spd:{tiny_heads[4]}", "pp:4"]
    for run in report["runs"]:
        assert run["requests"] == 6 and run["completion_tokens"] == 48
        assert 0 < run["latency_s"]["p50"] <= run["latency_s"]["p95"]
    assert "| pp:4 |" in proc.stdout


def test_load_benchmark_takes_the_runs_bench_takes_and_refuses_bad_ones(tmp_path):
    """spd-bench serve's --run is spd-bench decode's: the same check, one line and exit 2 before any server starts."""
    from conftest import run_main
    from spd.bench import serve as bench_serve

    bad = run_main(bench_serve.main, "--run", "--mode spd", "--prompts", str(tmp_path / "none.jsonl"))
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].endswith(
        "error: --run '--mode spd': --mode spd needs --speculator DIR_OR_ID (a head trained by train/distill.py)"
    )
    missing = run_main(bench_serve.main, "--run", "pp:4", "--prompts", str(tmp_path / "none.jsonl"))
    assert missing.returncode == 2 and "the prompts file" in missing.stderr and "does not exist" in missing.stderr
