"""The testbed builder, run as a user would (a miniature build), and the loading of what it writes."""

import dataclasses
import json

import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import run_script
from spd.testbed import ModelSpec, build_testbed, stdlib_dir, stdlib_source_files
from spd.testbed import TestbedConfig as Config


def test_miniature_build_writes_loadable_models(tiny_testbed):
    info = json.loads((tiny_testbed / "testbed.json").read_text())
    for name in ("target", "draft"):
        model = AutoModelForCausalLM.from_pretrained(tiny_testbed / name)
        tok = AutoTokenizer.from_pretrained(tiny_testbed / name)
        assert model.config.model_type == "llama"
        assert model.config.vocab_size == len(tok) == info["tokenizer"]["vocab_size"]
        assert info[name]["parameters"] == sum(p.numel() for p in model.parameters())
        assert info[name]["validation_perplexity"] > 1
        assert info[name]["train_tokens"] == info[name]["steps"] * 4 * 64
    assert info["target"]["spec"]["layers"] == 8
    assert info["draft"]["spec"]["layers"] == 2
    assert info["target"]["parameters"] > info["draft"]["parameters"]


def test_corpus_is_split_by_file_and_loads_with_datasets(tiny_testbed):
    ds = load_dataset(
        "json",
        data_files={
            "train": str(tiny_testbed / "corpus" / "train.jsonl"),
            "validation": str(tiny_testbed / "corpus" / "validation.jsonl"),
        },
    )
    train, val = set(ds["train"]["path"]), set(ds["validation"]["path"])
    assert train and val and not train & val
    assert all(p.endswith(".py") for p in train | val)
    assert not any(part in ("test", "tests", "site-packages") for p in train | val for part in p.split("/"))


def test_tokenizer_special_tokens_and_chat_template(tiny_testbed):
    tok = AutoTokenizer.from_pretrained(tiny_testbed / "tokenizer")
    assert tok.bos_token == "<|bos|>" and tok.eos_token == "<|eos|>" and tok.pad_token == "<|pad|>"
    ids = tok("def f(x):\n    return x")["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == "def f(x):\n    return x"  # byte-level: lossless
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], tokenize=False
    )
    assert text == "<|bos|><|user|>\nhi<|eos|>\n<|assistant|>\nyo<|eos|>\n"
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|assistant|>\n")


def test_second_build_with_same_settings_does_nothing(tiny_testbed):
    before = {p: p.stat().st_mtime_ns for p in tiny_testbed.rglob("*") if p.is_file()}
    proc = run_script("data/build_testbed.py", "--out", str(tiny_testbed), "--tiny", "--quiet")
    after = {p: p.stat().st_mtime_ns for p in tiny_testbed.rglob("*") if p.is_file()}
    assert before == after
    assert json.loads(proc.stdout)["target"]["steps"] == 20


def test_build_is_deterministic(tmp_path):
    def cfg():
        return Config(
            vocab_size=300,
            max_files=20,
            val_fraction=0.25,
            eval_tokens=512,
            target=ModelSpec(
                layers=8,
                hidden=16,
                heads=2,
                kv_heads=1,
                ffn=32,
                steps=4,
                batch_size=2,
                seq_len=32,
                warmup_steps=2,
                compile=False,
            ),
            draft=ModelSpec(
                layers=2,
                hidden=16,
                heads=2,
                kv_heads=1,
                ffn=32,
                steps=3,
                batch_size=2,
                seq_len=32,
                warmup_steps=2,
                compile=False,
            ),
        )

    torch.set_num_threads(1)
    a = build_testbed(tmp_path / "a", cfg(), progress=False)
    assert torch.get_num_threads() == 1  # the caller's thread count is given back (a pytest worker's share)
    b = build_testbed(tmp_path / "b", cfg(), progress=False)
    assert a["target"]["validation_loss"] == b["target"]["validation_loss"]
    wa = AutoModelForCausalLM.from_pretrained(tmp_path / "a" / "target").state_dict()
    wb = AutoModelForCausalLM.from_pretrained(tmp_path / "b" / "target").state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert (tmp_path / "a" / "tokenizer" / "tokenizer.json").read_text() == (
        tmp_path / "b" / "tokenizer" / "tokenizer.json"
    ).read_text()


def test_stdlib_files_exclude_tests():
    files = stdlib_source_files(stdlib_dir())
    assert len(files) > 100
    assert not any("test" in p.relative_to(stdlib_dir()).parts[:-1] for p in files)


def test_bad_budget_is_a_clear_error():
    proc = run_script("data/build_testbed.py", "--out", "/tmp/unused", "--minutes", "0", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "--minutes" in proc.stderr


def test_deep_preset_is_the_default_target_four_times_deeper(tmp_path, monkeypatch):
    """--preset deep: 32 layers (n = 4, 8 and 16 divide it), everything else as the default build; its own
    directory by default. A miniature deep build loads and cuts into 16 stages."""
    from spd.target.staging import StagedModel
    from spd.testbed.presets import preset_config, preset_dir

    monkeypatch.delenv("SPD_TESTBED", raising=False)
    assert preset_dir("default") == "testbed" and preset_dir("deep") == "testbed-deep"
    a, b = preset_config("default"), preset_config("deep")
    assert (a.target.layers, b.target.layers) == (8, 32)
    assert dataclasses.replace(b.target, layers=8) == a.target and b.draft == a.draft
    assert b.vocab_size == a.vocab_size
    run_script("data/build_testbed.py", "--preset", "deep", "--tiny", "--out", str(tmp_path / "deep"), "--quiet")
    info = json.loads((tmp_path / "deep" / "testbed.json").read_text())
    assert info["target"]["spec"]["layers"] == 32 and info["draft"]["spec"]["layers"] == 2
    assert StagedModel.from_pretrained(tmp_path / "deep" / "target", n_stages=16).boundaries[1] == 2
