"""train/draft_vocab_coverage.py: the share of supervised tokens a head's draft vocabulary holds."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from conftest import run_script


def test_the_share_is_counted_on_supervised_tokens_only(tiny_testbed, tmp_path):
    from transformers import AutoTokenizer

    target = tiny_testbed / "target"
    tok = AutoTokenizer.from_pretrained(target)
    rows = [
        {"messages": [{"role": "user", "content": f"q {i}"}, {"role": "assistant", "content": f"a {i} b"}]}
        for i in range(6)
    ]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    from spd.data.prepare import render_conversation

    supervised = [i for r in rows for i, m in zip(*render_conversation(r["messages"], tok)) if m]
    held_ids = sorted(set(supervised))[: len(set(supervised)) // 2]
    head = tmp_path / "head"
    head.mkdir()
    save_file({"draft_ids": torch.tensor(held_ids), "norm.weight": torch.ones(2)}, str(head / "model.safetensors"))
    full = tmp_path / "full"
    full.mkdir()
    save_file({"norm.weight": torch.ones(2)}, str(full / "model.safetensors"))
    out = tmp_path / "cov.json"
    proc = run_script(
        "train/draft_vocab_coverage.py",
        "--target",
        str(target),
        "--head",
        f"half={head}",
        "--head",
        f"whole={full}",
        "--data",
        f"chat={data}",
        "--out",
        str(out),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())["heads"]
    expected = sum(i in set(held_ids) for i in supervised)
    assert report["half"]["chat"] == {
        "held": expected,
        "tokens": len(supervised),
        "share": round(expected / len(supervised), 4),
    }
    assert 0 < expected < len(supervised)
    assert report["whole"]["chat"]["share"] == 1.0 and report["whole"]["draft_vocab_size"] is None


def test_a_missing_head_is_one_error_line(tiny_testbed, tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"text": "hello"}) + "\n")
    proc = run_script(
        "train/draft_vocab_coverage.py",
        "--target",
        str(tiny_testbed / "target"),
        "--head",
        str(tmp_path / "nothere"),
        "--data",
        str(data),
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ") and "nothere" in proc.stderr
