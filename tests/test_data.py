"""Data preparation: chat rendering with assistant-only masks, formats, bad rows, overflow, caching."""

import json

import pytest
from transformers import AutoTokenizer

from spd.data.prepare import DataConfig, normalize_messages, prepare_dataset, render_conversation
from spd.errors import SpdInputError


@pytest.fixture(scope="module")
def tok(tiny_testbed):
    return AutoTokenizer.from_pretrained(tiny_testbed / "tokenizer")


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_assistant_only_mask(tok):
    msgs = [
        {"role": "system", "content": "be terse"},
        {"role": "user", "content": "def f():"},
        {"role": "assistant", "content": "return 1"},
        {"role": "user", "content": "more"},
        {"role": "assistant", "content": "x = 2"},
    ]
    ids, mask = render_conversation(msgs, tok)
    supervised = tok.decode([i for i, m in zip(ids, mask) if m])
    assert supervised == "return 1<|eos|>\nx = 2<|eos|>\n"
    assert len(ids) == len(mask)


def test_sharegpt_and_conversations_formats():
    share = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    assert normalize_messages(share) == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    conv = {"conversations": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    assert normalize_messages(conv)[1]["role"] == "assistant"
    assert normalize_messages({"text": "x"}) is None


def test_bad_rows_are_counted_not_fatal(tok, tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
        {"messages": [{"role": "user", "content": "no answer"}]},
        {"messages": "not a list"},
        {"conversations": [{"from": "alien", "value": "?"}, {"from": "gpt", "value": "x"}]},
        {"other": 1},
        {"text": "print('hello')"},
    ]
    lines = []
    ds = prepare_dataset(_write_jsonl(tmp_path / "d.jsonl", rows), tok, DataConfig(max_length=64), report=lines.append)
    assert len(ds) == 2
    assert "skipped rows out of 6" in lines[0] and "no assistant turn" in lines[0]


def test_empty_result_is_a_clear_error(tok, tmp_path):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])
    with pytest.raises(SpdInputError, match="no usable training rows"):
        prepare_dataset(path, tok, report=lambda _: None)


def test_missing_data_is_a_clear_error(tok, tmp_path):
    with pytest.raises(SpdInputError, match="does not exist"):
        prepare_dataset(str(tmp_path / "nope.jsonl"), tok)
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(SpdInputError, match="no .jsonl"):
        prepare_dataset(str(tmp_path / "empty_dir"), tok)


def test_overflow_policies(tok, tmp_path):
    long_text = "x = 1\n" * 200
    long_chat = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": long_text}]}
    path = _write_jsonl(tmp_path / "long.jsonl", [{"text": long_text}, long_chat])
    quiet = {"report": lambda _: None}
    auto = prepare_dataset(path, tok, DataConfig(max_length=64), **quiet)  # text split, chat dropped
    assert all(len(r) <= 64 for r in auto["input_ids"]) and len(auto) > 2
    trunc = prepare_dataset(path, tok, DataConfig(max_length=64, overflow="truncate"), **quiet)
    assert len(trunc) == 2 and all(len(r) == 64 for r in trunc["input_ids"])
    with pytest.raises(SpdInputError, match="no usable"):
        prepare_dataset(_write_jsonl(tmp_path / "c.jsonl", [long_chat]), tok, DataConfig(max_length=64), **quiet)


def test_prepared_dataset_is_cached(tok, tmp_path):
    path = _write_jsonl(tmp_path / "t.jsonl", [{"text": "a = 1"}, {"text": "b = 2"}])
    lines = []
    first = prepare_dataset(path, tok, cache_dir=tmp_path / "cache", report=lines.append)
    second = prepare_dataset(path, tok, cache_dir=tmp_path / "cache", report=lines.append)
    assert first["input_ids"] == second["input_ids"]
    assert len(lines) == 1  # the second call read the cache and reported nothing


@pytest.mark.slow
def test_prepare_script(tiny_testbed, tmp_path):
    from conftest import run_script

    ok = run_script(
        "data/prepare.py",
        "--target",
        str(tiny_testbed / "target"),
        "--data",
        str(tiny_testbed / "corpus" / "validation.jsonl"),
        "--max-length",
        "64",
        "--cache-dir",
        str(tmp_path / "cache"),
    )
    assert "rows ready" in ok.stdout and any((tmp_path / "cache").iterdir())
    bad = run_script(
        "data/prepare.py", "--target", str(tiny_testbed / "target"), "--data", str(tmp_path / "none.jsonl"), check=False
    )
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error:") and "does not exist" in bad.stderr


@pytest.mark.slow
def test_concurrent_preparation_of_one_cache_entry(tmp_path, tiny_testbed):
    """Two processes preparing the same data at once (two presets launched side by side) both succeed."""
    import subprocess
    import sys

    code = (
        "import sys; from transformers import AutoTokenizer; from spd.data.prepare import DataConfig, prepare_dataset;"
        "tok = AutoTokenizer.from_pretrained(sys.argv[1]);"
        "ds = prepare_dataset(sys.argv[2], tok, DataConfig(max_length=64), sys.argv[3], report=lambda m: None);"
        "print(len(ds))"
    )
    args = [str(tiny_testbed / "target"), str(tiny_testbed / "corpus" / "train.jsonl"), str(tmp_path / "cache")]
    procs = [
        subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-500:] for o in outs]
    assert outs[0][0] == outs[1][0] and int(outs[0][0]) > 0
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [next((tmp_path / "cache").glob("prepared-*")).name]
