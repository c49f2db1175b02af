"""A base model's own continuations of corpus prefixes (``data/regenerate.py --texts``): what a head for a target
without a chat template trains on. Run as a user would, on the miniature testbed."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_script, two_at_a_time


@pytest.mark.slow
def test_texts_are_the_targets_own_greedy_continuations(tiny_testbed, tmp_path):
    """Every prefix is continued once, greedily, exactly as the target continues it alone; a second run adds nothing."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from spd.data.regenerate import text_prefixes

    out = tmp_path / "texts.jsonl"
    args = (
        "--target",
        str(tiny_testbed / "target"),
        "--texts",
        f"{tiny_testbed / 'corpus' / 'train.jsonl'}:5",
        "--out",
        str(out),
        "--max-new-tokens",
        "12",
        "--batch-size",
        "1",
        "--prefix-chars",
        "200",
        "--seed",
        "3",
    )
    first = run_script("data/regenerate.py", *args)
    assert "5 answered now, 0 already there" in first.stdout
    rows = {row["id"]: row for row in map(json.loads, out.read_text().splitlines())}
    texts = [json.loads(line)["text"] for line in open(tiny_testbed / "corpus" / "train.jsonl")]
    prefixes = text_prefixes([t for t in texts if t.strip()], 5, seed=3, max_chars=200)
    assert sorted(rows) == [f"text-{i}" for i in range(5)]
    model = AutoModelForCausalLM.from_pretrained(tiny_testbed / "target").eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_testbed / "target")
    for i, prefix in enumerate(prefixes):
        row = rows[f"text-{i}"]
        assert set(row) == {"id", "text", "finish_reason", "new_tokens"}
        assert len(prefix["text"]) <= 200 and row["text"].startswith(prefix["text"])
        ids = tokenizer(prefix["text"], return_tensors="pt")["input_ids"]
        with torch.no_grad():
            solo = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        new = solo[0, ids.shape[1] :].tolist()
        stop = next((k for k, t in enumerate(new) if t == tokenizer.eos_token_id), None)
        new = new if stop is None else new[:stop]
        assert row["new_tokens"] == len(new)
        assert row["text"] == prefix["text"] + tokenizer.decode(new, skip_special_tokens=True)
    again = run_script("data/regenerate.py", *args)
    assert "0 answered now, 5 already there" in again.stdout


@pytest.mark.slow
def test_texts_bad_input_is_one_clear_error(tiny_testbed, tmp_path):
    """A missing file, N = 0 or rows without text: exit 2 and one error line, nothing written; ``--texts`` with
    ``--prompts``, or neither: a usage error (exit 2)."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"path": "a.py"}\n')
    train = str(tiny_testbed / "corpus" / "train.jsonl")
    cases = [
        (["--texts", str(tmp_path / "nope.jsonl")], "does not exist"),
        (["--texts", f"{train}:0"], "must be a positive integer"),
        (["--texts", str(bad)], 'has no "text" string'),
        (["--prompts", "stdlib:2", "--skip", "2"], "leaves no prompts to answer"),
        (["--prompts", "stdlib:2", "--skip", "-1"], None),
        (["--prompts", "stdlib:2", "--texts", train], None),
        ([], None),
    ]

    def run(case):
        extra, _ = case
        out = tmp_path / f"out-{cases.index(case)}.jsonl"
        return run_script(
            "data/regenerate.py", "--target", str(tiny_testbed / "target"), *extra, "--out", str(out), check=False
        ), out

    for (extra, expected), (proc, out) in zip(cases, two_at_a_time(run, cases)):
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (extra, proc.stderr)
        assert not out.exists() or not out.read_text(), extra
        if expected is not None:  # ours: one error line (the others are argparse's usage errors)
            errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
            assert len(errors) == 1 and expected in errors[0], (extra, proc.stderr)
