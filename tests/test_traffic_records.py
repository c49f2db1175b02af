"""Traffic records: durable, bounded, private shards that the trainer reads as data."""

import json
import os
import stat

import pytest

from spd.errors import SpdInputError
from spd.traffic.records import TrafficRecorder, read_records, shards


def _record(recorder, i: int, answer: int = 5) -> None:
    recorder.record(
        [1, 2, i],
        list(range(10, 10 + answer)),
        endpoint="chat",
        sampling={"temperature": 0.0, "top_k": 50, "top_p": 1.0, "seed": None},
        head="v1",
        stats={"mode": "spd", "equivalent_accept_length": 1.5, "steps": 9},
        finish="length",
    )


def test_requests_are_recorded_in_private_shards_and_read_back(tmp_path):
    recorder = TrafficRecorder(tmp_path / "rec", max_bytes=1 << 20, model="tiny")
    for i in range(3):
        _record(recorder, i)
    recorder.close()
    assert stat.S_IMODE((tmp_path / "rec").stat().st_mode) == 0o700
    (shard,) = shards(tmp_path / "rec")
    assert shard.name == "traffic-000001.jsonl" and stat.S_IMODE(shard.stat().st_mode) == 0o600
    rows = list(read_records(tmp_path / "rec"))
    assert [r["prompt_ids"] for r in rows] == [[1, 2, 0], [1, 2, 1], [1, 2, 2]]
    assert rows[0]["answer_ids"] == [10, 11, 12, 13, 14] and rows[0]["head"] == "v1" and rows[0]["model"] == "tiny"
    assert rows[0]["sampling"]["temperature"] == 0.0 and rows[0]["accept_length"] == 1.5
    assert recorder.counts.written == 3 and recorder.counts.failed == 0

    again = TrafficRecorder(tmp_path / "rec", max_bytes=1 << 20)  # a restarted server: a new shard, none lost
    _record(again, 3)
    again.close()
    assert [p.name for p in shards(tmp_path / "rec")] == ["traffic-000001.jsonl", "traffic-000002.jsonl"]
    assert len(list(read_records(tmp_path / "rec"))) == 4


def test_the_oldest_shards_go_first_when_over_the_budget(tmp_path):
    recorder = TrafficRecorder(tmp_path, max_bytes=1 << 20)  # shards of 128 KiB
    for i in range(1500):
        _record(recorder, i, answer=200)  # about 1 KiB a line: 1.5 MiB in all
        if i % 100 == 99:
            recorder.flush()  # (as a server's pace would: the queue never fills)
    recorder.close()
    assert recorder.counts.failed == 0
    present = shards(tmp_path)
    total = sum(p.stat().st_size for p in present)
    assert total <= 1 << 20 and recorder.counts.deleted_shards > 0 and present[0].name != "traffic-000001.jsonl"
    rows = list(read_records(tmp_path))
    assert rows[-1]["prompt_ids"] == [1, 2, 1499]  # the newest kept, in order
    assert [r["prompt_ids"][2] for r in rows] == list(range(1500 - len(rows), 1500))


def test_a_torn_last_line_is_dropped_with_a_warning(tmp_path, capsys):
    recorder = TrafficRecorder(tmp_path, max_bytes=1 << 20)
    for i in range(2):
        _record(recorder, i)
    recorder.close()
    (shard,) = shards(tmp_path)
    with open(shard, "ab") as f:  # a kill in the middle of a line
        f.write(b'{"v": 1, "prompt_ids": [1, 2')
    rows = list(read_records(tmp_path))
    assert len(rows) == 2
    assert "dropped a last line that a kill cut short" in capsys.readouterr().err


def test_lines_that_are_not_records_are_skipped_and_said(tmp_path, capsys):
    (tmp_path / "traffic-000001.jsonl").write_text(
        json.dumps({"prompt_ids": [1], "answer_ids": [2]}) + "\n[1, 2]\n" + json.dumps({"prompt_ids": "x"}) + "\n"
    )
    assert [r["answer_ids"] for r in read_records(tmp_path)] == [[2]]
    assert "skipped 2 line(s) that are not traffic records" in capsys.readouterr().err


def test_a_write_that_fails_is_counted_and_never_raises(tmp_path, capsys):
    recorder = TrafficRecorder(tmp_path / "rec", max_bytes=1 << 20)
    _record(recorder, 0)
    recorder.close()
    recorder = TrafficRecorder(tmp_path / "rec", max_bytes=1 << 20)
    for p in shards(tmp_path / "rec"):
        p.unlink()
    os.rmdir(tmp_path / "rec")  # the directory is gone under the server
    _record(recorder, 1)
    recorder.close()
    assert recorder.counts.failed == 1 and recorder.counts.written == 0
    assert "a traffic record could not be written" in capsys.readouterr().err


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda p: (p.write_text("x"), p)[1], "is a file; expected a directory"),
        (lambda p: (p.write_text("x"), p / "sub")[1], "cannot be created"),
    ],
)
def test_a_directory_that_cannot_hold_records_is_one_error(tmp_path, make, expected):
    with pytest.raises(SpdInputError, match=expected):
        TrafficRecorder(make(tmp_path / "f"), max_bytes=1 << 20)
    with pytest.raises(SpdInputError, match="--record-max-mb must be at least 1"):
        TrafficRecorder(tmp_path / "ok", max_bytes=1000)


def test_the_trainer_reads_a_record_directory_with_the_answers_supervised(tmp_path, tiny_testbed):
    from transformers import AutoTokenizer

    from spd.data.prepare import DataConfig, prepare_dataset

    tokenizer = AutoTokenizer.from_pretrained(tiny_testbed / "target")
    recorder = TrafficRecorder(tmp_path, max_bytes=1 << 20)
    _record(recorder, 3, answer=4)
    _record(recorder, 4, answer=0)  # nothing generated: nothing to learn
    recorder.close()
    with open(shards(tmp_path)[0], "ab") as f:
        f.write(b'{"prompt_ids": [1')  # torn
    reports = []
    ds = prepare_dataset(str(tmp_path), tokenizer, DataConfig(max_length=64), report=reports.append)
    assert ds["input_ids"] == [[1, 2, 3, 10, 11, 12, 13]] and ds["loss_mask"] == [[0, 0, 0, 1, 1, 1, 1]]
    assert any("1 no supervised tokens" in r for r in reports)
    short = prepare_dataset(str(tmp_path), tokenizer, DataConfig(max_length=5), report=reports.append)
    assert short["input_ids"] == [[1, 2, 3, 10, 11]]  # a long record keeps its prompt and its answer's start
