"""spd-serve --record: every finished request in the traffic records, whatever the runtime, and a server killed
mid-stream keeps what it finished."""

import signal
import time

import pytest

from conftest import run_main
from helpers.serve import Server
from spd.traffic.records import read_records, shards

PROMPTS = ("def main(argv):\n", "class A:\n", "import os\n")


def _greedy(tiny_testbed, prompt_ids: list[int], n: int) -> list[int]:
    from spd.decoding.generation import generate_ar
    from spd.target.staging import StagedModel

    staged = StagedModel.from_pretrained(str(tiny_testbed / "target"), n_stages=1)
    return generate_ar(staged, prompt_ids, n).token_ids


@pytest.mark.parametrize(
    "flags",
    [
        pytest.param((), id="single"),
        pytest.param(("--max-batch", "2"), id="batched"),
        pytest.param(("--runtime", "distributed"), id="distributed", marks=pytest.mark.slow),
    ],
)
def test_every_finished_request_is_recorded_as_the_target_answered_it(tiny_testbed, tiny_heads, tmp_path, flags):
    server = Server(
        "--target", str(tiny_testbed / "target"), "--speculator", str(tiny_heads[4]), "--record", str(tmp_path),
        *flags,
    )  # fmt: skip
    try:
        client = server.client()
        for prompt in PROMPTS[:2]:
            client.completions.create(model=server.model, prompt=prompt, max_tokens=8, temperature=0)
        chat = client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
        metrics = server.metrics()
    finally:
        server.stop()
    rows = list(read_records(tmp_path))
    assert [r["endpoint"] for r in rows] == ["completions", "completions", "chat"]
    for row in rows:  # the answer is the target's own greedy continuation of the prompt it was given
        assert row["answer_ids"] == _greedy(tiny_testbed, row["prompt_ids"], len(row["answer_ids"]))
        assert row["head"] == str(tiny_heads[4]) and row["mode"] == "spd" and row["sampling"]["temperature"] == 0
        assert row["accept_length"] > 0 and row["finish"] in ("length", "stop")
    assert len(rows[0]["answer_ids"]) == 8 and rows[2]["prompt_ids"] != rows[0]["prompt_ids"]
    assert metrics["spd_records_written"] >= 2 and metrics["spd_record_failures"] == 0


def test_a_killed_server_keeps_the_requests_it_finished(tiny_testbed, tiny_heads, tmp_path):
    server = Server(
        "--target", str(tiny_testbed / "target"), "--speculator", str(tiny_heads[4]), "--record", str(tmp_path)
    )
    try:
        client = server.client()
        for prompt in PROMPTS:
            client.completions.create(model=server.model, prompt=prompt, max_tokens=4, temperature=0)
        deadline = time.monotonic() + 30  # the writer thread writes a line as its request ends
        while server.metrics()["spd_records_written"] < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait()
    rows = list(read_records(tmp_path))
    assert len(rows) == 3 and all(len(r["answer_ids"]) == 4 for r in rows)
    (shard,) = shards(tmp_path)
    assert oct(shard.stat().st_mode & 0o777) == "0o600"


def test_a_record_directory_that_cannot_be_used_stops_the_server_before_it_loads(tiny_testbed, tmp_path):
    from spd.cli.serve import main

    (tmp_path / "file").write_text("x")
    proc = run_main(main, "--target", str(tiny_testbed / "target"), "--port", "0", "--record", str(tmp_path / "file"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: --record '{tmp_path / 'file'}' is a file; expected a directory for the traffic records"
    )
    proc = run_main(
        main, "--target", str(tiny_testbed / "target"), "--port", "0", "--record", str(tmp_path), "--record-max-mb", "0"
    )
    assert proc.returncode == 2 and "--record-max-mb" in proc.stderr


@pytest.mark.slow
def test_the_load_benchmark_measures_what_recording_costs(tiny_testbed, tiny_heads, tmp_path):
    import json

    from spd.bench import serve as bench_serve

    out = tmp_path / "overhead.json"
    spec = f"spd:{tiny_heads[4]}"
    flags = ["--target", str(tiny_testbed / "target"), "--prompts", str(tiny_testbed / "prompts.jsonl")]
    flags += ["--run", spec, "--requests", "4", "--concurrency", "2", "--max-tokens", "6"]
    proc = run_main(bench_serve.main, *flags, "--record-overhead", "--repeats", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert [r["name"] for r in report["runs"]] == [spec, f"{spec} +record"] and report["identical_outputs"]
    assert set(report["record_overhead"]) == {spec} and report["record_overhead"][spec] < 1
    assert f"{spec}: recording costs" in proc.stdout
