"""bench/bench_adapt.py on the miniature testbed: the same stream through a static, an adapting and an ar server,
every answer equal to ar's, the adaptation's CPU counted, and a killed run resumed from its answers files."""

import json

import pytest

from conftest import run_main

ADAPT = "--margin -0.9 --steps 2 --poll 0.2 --heldout-share 0.5 --set lr=3e-3 --set batch_size=4"


def _stream(path, count: int):
    rows = [{"id": f"r{i}", "prompt": f"Write a function number {i} that adds two numbers.", "keep": True}
            for i in range(count)]  # fmt: skip
    rows.insert(2, {"id": "dropped", "prompt": "cut off", "keep": False})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow
def test_the_stream_runs_through_each_arm_equal_to_ar_and_a_rerun_resumes(tiny_testbed, tiny_heads, tmp_path):
    from spd.bench import adapt as bench_adapt

    stream = _stream(tmp_path / "stream.jsonl", 8)
    work, out = tmp_path / "work", tmp_path / "adapt.json"
    common = ["--target", str(tiny_testbed / "target"), "--head", str(tiny_heads[2]), "--stream", str(stream)]
    common += [
        "--max-tokens",
        "10",
        "--window",
        "3",
        "--adapt-every",
        "30",
        "--adapt-args",
        ADAPT,
        "--workdir",
        str(work),
    ]
    first = run_main(bench_adapt.main, *common, "--arms", "adapt", "--requests", "4", "--out", str(out))
    assert first.returncode == 0, first.stderr
    with open(work / "adapt" / "answers.jsonl", "a") as f:
        f.write('{"request": 4, "token_')  # a run killed mid-write
    second = run_main(
        bench_adapt.main,
        *common,
        "--requests",
        "7",
        "--concurrency",
        "2",
        "--out",
        str(out),
        "--plot",
        str(tmp_path / "a.png"),
    )
    assert second.returncode == 0, second.stderr
    assert "dropped a last line that a kill cut short" in second.stderr
    assert "adapt: 3 of 7 requests to ask" in second.stderr and "ar: 7 of 7 requests to ask" in second.stderr

    result = json.loads(out.read_text())
    assert set(result["arms"]) == {"static", "adapt", "ar"}
    for arm, figures in result["arms"].items():
        assert figures["requests"] == 7 and figures["failed"] == 0 and figures["identical_to_ar"] is True, arm
        assert len(figures["rolling_L_acc"]) == 7 and len(figures["head_version"]) == 7
    rows = [json.loads(line) for line in (work / "adapt" / "answers.jsonl").read_text().splitlines()]
    assert sorted(r["request"] for r in rows) == list(range(7))  # none asked twice, none lost
    assert result["arms"]["static"]["L_acc_last_window"] > 0
    assert result["arms"]["adapt"]["adapt_cpu_s"] > 0  # its spd-adapt ran at least a round's worth of CPU
    assert (tmp_path / "a.png").stat().st_size > 0


def test_wrong_input_is_one_line_before_any_server_starts(tmp_path):
    from spd.bench import adapt as bench_adapt

    stream = _stream(tmp_path / "stream.jsonl", 3)
    base = ["--target", "t", "--head", "h", "--workdir", str(tmp_path / "w")]
    cases = [
        (["--stream", str(tmp_path / "none.jsonl")], "does not exist"),
        (["--stream", str(stream), "--requests", "5"], "holds 3 requests; expected at least --requests 5"),
        (["--stream", str(stream), "--arms", "static,fast"], "--arms 'static,fast' is not a list of"),
    ]
    for flags, expected in cases:
        proc = run_main(bench_adapt.main, *base, *flags)
        assert proc.returncode == 2 and expected in proc.stderr, (flags, proc.stderr)
