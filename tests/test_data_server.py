"""Training data made through an OpenAI-compatible server (``data/regenerate.py`` and ``data/self_instruct.py`` with
``--server``), against a real ``spd-serve --mode ar`` on the miniature testbed: the same greedy answers as the target
loaded in the script, seeded samples that a resumed run repeats, a run whose server dies mid-run finished by a rerun
with no row lost or repeated, and one ``error:`` line for a server that is not there or a wrong flag."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import REPO, run_script, two_at_a_time
from spd.testing.server import ServerProcess


def rows_by_id(path: Path) -> dict[str, dict]:
    """The rows of a jsonl file by id, each id once."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len({r["id"] for r in rows}) == len(rows), "an id written twice"
    return {r["id"]: r for r in rows}


def errors(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


@pytest.fixture(scope="module")
def ar_server(tiny_testbed):
    server = ServerProcess("--target", str(tiny_testbed / "target"), "--mode", "ar", cwd=REPO)
    yield server
    server.stop()


@pytest.mark.slow
def test_served_answers_are_the_targets_own(tiny_testbed, ar_server, tmp_path):
    """At T = 0 the server's answers (chat through /v1/chat/completions, texts through /v1/completions) are the rows
    the target loaded in the script writes, in float32: the same text, finish_reason and new_tokens."""
    target = str(tiny_testbed / "target")
    texts = f"{tiny_testbed / 'corpus' / 'train.jsonl'}:3"
    common = ("--max-new-tokens", "16", "--prefix-chars", "120")
    runs = [
        ("--target", target, "--prompts", "stdlib:4", "--batch-size", "1", "--out", str(tmp_path / "here.jsonl")),
        ("--target", target, "--texts", texts, "--batch-size", "1", "--out", str(tmp_path / "here-texts.jsonl")),
        ("--server", ar_server.url, "--prompts", "stdlib:4", "--concurrency", "3", "--out", str(tmp_path / "s.jsonl")),
        ("--server", ar_server.url, "--texts", texts, "--out", str(tmp_path / "s-texts.jsonl")),
    ]
    procs = two_at_a_time(lambda args: run_script("data/regenerate.py", *args, *common), runs)
    assert all("answered now, 0 already there" in proc.stdout for proc in procs)
    served = rows_by_id(tmp_path / "s.jsonl")
    assert served == rows_by_id(tmp_path / "here.jsonl") and len(served) == 4
    assert all(set(row) == {"id", "messages", "finish_reason", "new_tokens"} for row in served.values())
    assert rows_by_id(tmp_path / "s-texts.jsonl") == rows_by_id(tmp_path / "here-texts.jsonl")


@pytest.mark.slow
def test_served_instructions_are_seeded_and_resume(tiny_testbed, ar_server, tmp_path):
    """Samples through /v1/completions: the rows have the in-process keys and verdicts; each sample is what the
    server answers its seeded request (a finished one kept or rejected on its text, one that ran to max_tokens cut
    off); a run of 3 then 6 writes what one run of 6 at another concurrency writes, each id once."""
    from spd.data.client import request_seed
    from spd.data.self_instruct import TOPICS, user_turn_ids
    from spd.target.tokenizer import load_tokenizer

    target = str(tiny_testbed / "target")
    straight, resumed = tmp_path / "straight.jsonl", tmp_path / "resumed.jsonl"

    def sample(args):
        out, count, concurrency = args
        flags = ("--topics", f"code:{count}", "--concurrency", concurrency, "--max-new-tokens", "24")
        return run_script("data/self_instruct.py", "--target", target, "--server", ar_server.url, *flags, "--out", out)

    two_at_a_time(sample, [(str(straight), 6, "3"), (str(resumed), 3, "1")])
    proc = sample((str(resumed), 6, "1"))
    assert "code: 3 sampled now" in proc.stdout and "3 already there" in proc.stdout
    rows = rows_by_id(resumed)
    assert rows == rows_by_id(straight) and sorted(rows) == [f"code-0-{i}" for i in range(6)]
    prefix = user_turn_ids(load_tokenizer(target), TOPICS["code"])
    kept = []
    for row_id, row in rows.items():
        assert set(row) == {"id", "topic", "prompt", "keep", "why"} and (row["why"] is None) == row["keep"]
        body = {"model": ar_server.model, "prompt": prefix, "max_tokens": 24, "temperature": 1.0, "top_p": 0.95}
        seeded = {**body, "seed": request_seed(0, row_id)}
        answer = httpx.post(f"{ar_server.url}/v1/completions", json=seeded, timeout=60).json()
        choice = answer["choices"][0]
        assert choice["text"].strip() == row["prompt"]
        assert (row["why"] == "cut off") == (choice["finish_reason"] == "length")
        assert row["why"] in (None, "cut off", "too short", "duplicate", "benchmark overlap")
        kept += [" ".join(row["prompt"].lower().split())] if row["keep"] else []
    assert len(kept) == len(set(kept))


@pytest.mark.slow
def test_a_run_whose_server_dies_is_finished_by_a_rerun(tiny_testbed, ar_server, tmp_path):
    """The server is killed after the first rows: the job retries, then ends with one error line naming the server,
    the finished rows on disk; a rerun against a live server (after a torn last line) writes the rest, and the file
    has every id once with an uninterrupted run's answers."""
    args = ("--prompts", "stdlib:24", "--max-new-tokens", "32", "--concurrency", "1")  # rows left when it dies
    whole, out = tmp_path / "whole.jsonl", tmp_path / "out.jsonl"
    dying = ServerProcess("--target", str(tiny_testbed / "target"), "--mode", "ar", cwd=REPO)
    job = None
    try:
        job = subprocess.Popen(
            [sys.executable, str(REPO / "data" / "regenerate.py"), "--server", dying.url, *args, "--retries", "1"]
            + ["--out", str(out)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.time() + 120
        while time.time() < deadline and not (out.exists() and out.read_text().count("\n") >= 2):
            time.sleep(0.02)
        dying.proc.kill()
        _, stderr = job.communicate(timeout=120)
    finally:
        dying.stop()
        if job is not None and job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode == 2, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and dying.url in lines[0] and "after 2 tries" in lines[0], stderr
    written = rows_by_id(out)
    assert 2 <= len(written) < 24
    with open(out, "a") as f:
        f.write('{"id": "a torn li')  # a job killed in the middle of a line
    two_at_a_time(
        lambda o: run_script("data/regenerate.py", "--server", ar_server.url, *args, "--out", str(o)), [whole, out]
    )
    assert rows_by_id(out) == rows_by_id(whole) and len(rows_by_id(whole)) == 24
    assert all(written[i] == rows_by_id(out)[i] for i in written)


@pytest.mark.slow
def test_a_server_that_is_not_there_or_refuses_is_one_error(tiny_testbed, ar_server, tmp_path):
    """Nothing listening: both scripts retry, then exit 2 with one error line naming the URL, in bounded time; a
    wrong model is the caller's mistake: one error line with the server's message at once, no retry."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nowhere = f"http://127.0.0.1:{port}"
    target = str(tiny_testbed / "target")
    cases = [
        ("data/regenerate.py", "--server", nowhere, "--model", "m", "--prompts", "stdlib:2", "--retries", "2"),
        ("data/self_instruct.py", "--target", target, "--server", nowhere, "--topics", "code:2", "--retries", "1"),
        ("data/regenerate.py", "--server", ar_server.url, "--model", "nope", "--prompts", "stdlib:2"),
    ]
    start = time.time()
    procs = two_at_a_time(
        lambda c: run_script(*c, "--out", str(tmp_path / f"{cases.index(c)}.jsonl"), check=False), cases
    )
    assert time.time() - start < 120
    for case, proc, expected in zip(cases, procs, ("after 3 tries", "after 2 tries", "HTTP 404")):
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (case, proc.stderr)
        assert len(errors(proc)) == 1 and expected in errors(proc)[0], (case, proc.stderr)
    assert nowhere in errors(procs[0])[0] and "Connection refused" in errors(procs[0])[0]
    assert f"the server {ar_server.url} refused POST /v1/chat/completions" in errors(procs[2])[0]
    assert 'the model "nope" does not exist' in errors(procs[2])[0]


def test_server_flags_bad_input_is_a_usage_error(tmp_path):
    """--concurrency 0, --retries -1, a URL that is not http(s), --server with --target, or neither: exit 2."""
    out = str(tmp_path / "x.jsonl")
    url = "http://127.0.0.1:9"
    regenerate, self_instruct = "data/regenerate.py", "data/self_instruct.py"
    cases = [
        (regenerate, ["--server", url, "--concurrency", "0", "--prompts", "stdlib:2"], "--concurrency must be"),
        (regenerate, ["--server", url, "--retries", "-1", "--prompts", "stdlib:2"], "--retries 0 or more"),
        (regenerate, ["--server", "localhost:8000", "--prompts", "stdlib:2"], "expected an http:// or https:// URL"),
        (regenerate, ["--server", url, "--target", "t", "--prompts", "stdlib:2"], "--target is loaded only without"),
        (regenerate, ["--prompts", "stdlib:2"], "--target is required"),
        (
            self_instruct,
            ["--target", "t", "--server", url, "--concurrency", "0", "--topics", "code:2"],
            "--concurrency",
        ),
    ]
    procs = two_at_a_time(lambda case: run_script(case[0], *case[1], "--out", out, check=False), cases)
    for (_, args, expected), proc in zip(cases, procs):
        assert proc.returncode == 2 and expected in proc.stderr, (args, proc.stderr)
    assert not Path(out).exists()
