"""``spd-bench regenerate``: the answering speed of ``data/regenerate.py`` setting by setting, on a tiny chat
target made from the miniature testbed's (its tokenizer given a chat template)."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import run_bench, run_main


@pytest.fixture(scope="module")
def chat_target(tiny_testbed, tmp_path_factory):
    from transformers import AutoTokenizer

    target = tmp_path_factory.mktemp("chat") / "target"
    shutil.copytree(tiny_testbed / "target", target)
    tokenizer = AutoTokenizer.from_pretrained(target)
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    tokenizer.save_pretrained(target)
    return target


def test_each_setting_answers_the_same_prompts_and_is_compared_with_the_first(chat_target, tmp_path):
    out = tmp_path / "regen.json"
    done = run_bench(
        "regenerate",
        "--target",
        str(chat_target),
        "--prompts",
        "3",
        "--skip",
        "2",
        "--max-new-tokens",
        "4",
        "--settings",
        "float32:3",
        "float32:3",
        "float32:1",
        "--threads",
        "1",
        "--out",
        str(out),
    )
    assert done.returncode == 0, done.stderr
    assert "| dtype | batch | tokens |" in done.stdout
    report = json.loads(out.read_text())
    assert report["command"].startswith("spd-bench regenerate --target ")
    assert report["prompts"] == 3 and report["skip"] == 2 and report["max_new_tokens"] == 4
    first, again, single = report["runs"]
    assert [r["batch_size"] for r in report["runs"]] == [3, 3, 1]
    assert first["answers"] == again["answers"] == single["answers"] == 3
    assert first["speedup"] == 1.0 and again["equal_to_first"] == 3  # the same setting gives the same answers
    assert again["new_tokens"] == first["new_tokens"] <= 12
    assert all(r["tokens_per_s"] > 0 and 0 <= r["equal_to_first"] <= 3 for r in report["runs"])


def test_a_wrong_setting_is_one_error():
    from spd.bench.regenerate import main

    for setting in ("float16:8", "bfloat16", "float32:0"):
        done = run_main(main, "--target", "x", "--settings", setting)
        assert done.returncode == 2
        assert f"'{setting}' is not DTYPE:BATCH with DTYPE one of float32, bfloat16" in done.stderr
