"""spd-adapt: a head learns from a server's traffic records; a better candidate becomes the next version, a worse one
is dropped, the traffic is learned from once, and every version is complete and lossless."""

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import run_main
from spd.cli.adapt import main
from spd.decoding.engine import Engine
from spd.decoding.generation import generate_ar
from spd.decoding.sampling import SamplingParams
from spd.heads.loading import load_speculator
from spd.target.staging import StagedModel
from spd.target.tokenizer import load_tokenizer
from spd.traffic.adapt import Adapter
from spd.traffic.config import AdaptConfig
from spd.traffic.records import RecordPosition, TrafficRecorder, read_records_after, shards
from spd.traffic.versions import newest_version, next_number

TEXTS = ["def main(argv):\n    ", "import os\n", "class A:\n    def", "for i in range(", "x = [1, 2", "if x:\n"]
FAST = ("--steps", "3", "--threads", "1", "--poll", "0.1", "--set", "lr=3e-3", "--set", "batch_size=4")


def _answers(staged, tokenizer, texts, tokens=10) -> list[tuple[list[int], list[int]]]:
    """The target's own greedy answers: what a server at T = 0 would have answered and recorded."""
    prompts = [tokenizer(text)["input_ids"] for text in texts]
    return [(ids, generate_ar(staged, ids, tokens).token_ids) for ids in prompts]


def _record(directory, answers) -> None:
    recorder = TrafficRecorder(directory, max_bytes=1 << 20, model="tiny")
    for prompt, answer in answers:
        recorder.record(
            prompt,
            answer,
            endpoint="completions",
            sampling={"temperature": 0.0},
            head=None,
            stats={"mode": "spd"},
            finish="length",
        )
    recorder.close()


@pytest.fixture(scope="module")
def traffic(tiny_testbed, tmp_path_factory):
    """A records directory of the target's answers to six prompts, and replay data in the trainer's token-row format
    (the same answers' second halves, continuing their first: greedy answers too)."""
    staged = StagedModel.from_pretrained(tiny_testbed / "target", n_stages=2)
    tokenizer = load_tokenizer(tiny_testbed / "target")
    root = tmp_path_factory.mktemp("traffic")
    answers = _answers(staged, tokenizer, TEXTS)
    _record(root / "records", answers)
    replay = root / "replay.jsonl"
    rows = [{"prompt_ids": p + a[:5], "answer_ids": a[5:]} for p, a in answers]
    replay.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return {"records": root / "records", "replay": replay, "staged": staged}


def _records(traffic, tmp_path):
    """A copy of the records for one test (its versions go inside it)."""
    shutil.copytree(traffic["records"], tmp_path / "records")
    return tmp_path / "records"


def test_a_better_candidate_becomes_v1_a_lossless_head_and_the_traffic_is_learned_from_once(
    traffic, tiny_heads, tmp_path
):
    records = _records(traffic, tmp_path)
    args = ("--records", str(records), "--head", str(tiny_heads[2]), "--every", "50", "--once", *FAST)
    proc = run_main(main, *args, "--margin", "-0.5", "--replay", str(traffic["replay"]))
    assert proc.returncode == 0, proc.stderr
    kept = [line for line in proc.stdout.splitlines() if " v1 kept: held-out L'_acc est " in line]
    assert len(kept) == 1 and "published" in kept[0], proc.stdout
    assert "on 2 traffic rows and 2 replay rows, 4 held out" in proc.stdout, proc.stdout
    v1 = records / "heads" / "v1"
    assert newest_version(records / "heads") == (1, v1)
    assert sorted(p.name for p in v1.iterdir()) == ["README.md", "config.json", "model.safetensors", "version.json"]
    info = json.loads((v1 / "version.json").read_text())
    assert info["version"] == 1 and info["parent"] == 0 and info["steps"] == 3 and info["time"]
    assert info["after"]["L_acc_est"] > info["before"]["L_acc_est"] * 0.5
    card = (v1 / "README.md").read_text()
    for expected in ("| traffic, trained on | 2 |", "| replay: ", "| traffic, held out (the newest records) | 4 |"):
        assert expected in card, card
    assert "spd-adapt --records" in card and f"{info['after']['L_acc_est']:.3f}" in card
    assert not [p for p in (records / "heads").iterdir() if p.name.startswith(".") and p.name != ".lock"]

    # The version is a head in bf16, and decoding with it is the target's own greedy decoding.
    assert {t.dtype for t in load_file(v1 / "model.safetensors").values() if t.is_floating_point()} == {torch.bfloat16}
    staged = traffic["staged"]
    engine = Engine.chain(staged, load_speculator(str(v1)))
    prompt = [0, 280, 75, 363, 70]
    assert engine.run(prompt, 24, SamplingParams()).token_ids == generate_ar(staged, prompt, 24).token_ids

    # The position is remembered: the same traffic is not learned from again.
    again = run_main(main, *args, "--margin", "-0.5")
    assert again.returncode == 0, again.stderr
    assert "0 new answer tokens in 0 records since the last round" in again.stdout, again.stdout
    assert next_number(records / "heads") == 2


def test_a_candidate_short_of_the_margin_is_dropped_with_both_figures(traffic, tiny_heads, tmp_path):
    records = _records(traffic, tmp_path)
    proc = run_main(
        main,
        "--records",
        str(records),
        "--head",
        str(tiny_heads[2]),
        "--every",
        "50",
        "--once",
        "--margin",
        "1e6",
        *FAST,
    )
    assert proc.returncode == 0, proc.stderr
    (line,) = [line for line in proc.stdout.splitlines() if "candidate dropped" in line]
    figures = line.split("held-out L'_acc est ")[1]
    before, after = figures.split(" (v0) -> ")
    assert math.isfinite(float(before)) and math.isfinite(float(after.split()[0])), line
    assert "v0 stays" in line
    assert newest_version(records / "heads") is None and next_number(records / "heads") == 1
    assert json.loads((records / "heads" / "position.json").read_text())["shard"] == 1  # learned from, once


def test_a_stopped_round_leaves_no_version(traffic, tiny_heads, tmp_path):
    records = _records(traffic, tmp_path)
    said = []

    def say(message):
        said.append(message)
        if message.startswith("round for v1"):
            adapter.stop()  # as SIGTERM does, once the trainer is starting

    cfg = AdaptConfig(str(records), str(tiny_heads[2]), every=50, steps=3, threads=1, once=True)
    adapter = Adapter(cfg, say=say)
    assert adapter.run() == 0
    adapter.close()
    assert said[-1] == "stopped; the round in progress was abandoned"
    assert [p.name for p in (records / "heads").iterdir()] == [".lock"]


def test_newest_version_skips_incomplete_and_damaged_versions(tiny_heads, tmp_path, capsys):
    versions = tmp_path / "heads"
    assert newest_version(versions) is None
    for n in (1, 2, 3, 4):
        shutil.copytree(tiny_heads[2], versions / f"v{n}")
        (versions / f"v{n}" / "version.json").write_text(json.dumps({"version": n}))
    (versions / "v2" / "version.json").write_text('{"version": 2, "par')  # cut short
    (versions / "v3" / "version.json").unlink()  # never finished
    (versions / "v4" / "model.safetensors").unlink()
    (versions / ".v5.abcd1234.tmp").mkdir()  # a version being written
    assert newest_version(versions) == (1, versions / "v1")
    err = capsys.readouterr().err
    assert "v4': it has no model.safetensors" in err and "v3': it has no version.json" in err
    assert "v2': the version file" in err and "is cut short" in err
    assert newest_version(versions) == (1, versions / "v1") and capsys.readouterr().err == ""  # said once
    assert next_number(versions) == 5


def test_records_are_read_after_a_position(tmp_path, capsys):
    (tmp_path / "traffic-000001.jsonl").write_text('{"prompt_ids": [1], "answer_ids": [2]}\n{"prompt_ids": [3')
    (tmp_path / "traffic-000002.jsonl").write_text('{"prompt_ids": [4], "answer_ids": [5]}\n{"prompt_ids"')
    rows, position = read_records_after(tmp_path, RecordPosition())
    assert [r["prompt_ids"] for r in rows] == [[1], [4]] and position == RecordPosition(2, 39)
    assert "traffic-000001.jsonl: dropped a last line that a kill cut short" in capsys.readouterr().err
    with open(tmp_path / "traffic-000002.jsonl", "a") as f:  # the server finishes its line
        f.write(': [6], "answer_ids": [7]}\n')
    rows, position = read_records_after(tmp_path, position)
    assert [r["prompt_ids"] for r in rows] == [[6]] and position.offset == (
        tmp_path / "traffic-000002.jsonl"
    ).stat().st_size
    assert read_records_after(tmp_path, position) == ([], position)
    for shard in shards(tmp_path):
        shard.unlink()
    (tmp_path / "traffic-000001.jsonl").write_text('{"prompt_ids": [8], "answer_ids": [9]}\n')  # begun again
    rows, _ = read_records_after(tmp_path, position)
    assert [r["prompt_ids"] for r in rows] == [[8]] and "reading them from their start" in capsys.readouterr().err


def _bad_inputs(tiny_testbed, tiny_heads, tmp_path):
    records = tmp_path / "records"
    records.mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    (tmp_path / "file").write_text("x")
    shutil.copytree(tiny_heads[4], tmp_path / "n4" / "v1")
    (tmp_path / "n4" / "v1" / "version.json").write_text('{"version": 1}')
    ok = ("--records", str(records), "--head", str(tiny_heads[2]))
    return [
        (("--records", str(tmp_path / "nope"), "--head", str(tiny_heads[2])), "--records '.*nope' does not exist"),
        (("--records", str(tmp_path / "other"), "--head", str(tiny_heads[2])), "holds no traffic records"),
        (("--records", str(records), "--head", str(tiny_testbed / "target")), "--head: .* not an SPD speculation head"),
        (("--records", str(records), "--head", str(tmp_path / "none")), "--head: .*does not exist"),
        ((*ok, "--replay", str(tmp_path / "missing.jsonl")), "the data path '.*missing.jsonl' does not exist"),
        ((*ok, "--versions", str(tmp_path / "file" / "heads")), "--versions '.*' is not writable"),
        ((*ok, "--versions", str(tmp_path / "n4")), "holds heads for another target or cut than --head"),
        ((*ok, "--every", "0"), "--every must be a whole number of at least 1, got 0"),
        ((*ok, "--steps", "x"), "argument --steps: invalid int value"),
        ((*ok, "--replay-share", "1"), "--replay-share must be at least 0 and below 1"),
        ((*ok, "--heldout-share", "0"), "--heldout-share must be above 0 and below 1"),
        ((*ok, "--margin", "nan"), "--margin must be a finite number above -1"),
        ((*ok, "--set", "max_steps=5"), "'max_steps=5' is not a trainer setting spd-adapt passes on"),
        ((*ok, "--set", "lr=fast"), "bad value for lr"),
    ]


def test_bad_inputs_are_one_line_and_status_2(tiny_testbed, tiny_heads, tmp_path):
    import re

    for args, expected in _bad_inputs(tiny_testbed, tiny_heads, tmp_path):
        proc = run_main(main, *args)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (args, proc.stderr)
        assert re.search(expected, lines[0]), (expected, lines[0])
    assert not (tmp_path / "records" / "heads").exists()  # nothing written for a wrong input
