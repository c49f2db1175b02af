"""Every file the toolkit reads, damaged the ways files get damaged, is one sentence naming it.

Each case copies a tiny fixture (a 2-layer Llama target with a tokenizer, a head for it, an SPD authors' head file,
a GGUF file, a capture, a training preset, data and prompt files), damages one file of it and runs one loader on it:
the loader raises SpdInputError with one line that names the damaged file and says what was expected. The programs
print that error as one ``error:`` line and exit with status 2 (checked through spd-generate and train/distill.py).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, tiny_model
from helpers.cli import spd_generate_command
from spd.errors import SpdInputError

AUTHORS_HEAD = REPO / "tests" / "fixtures" / "authors" / "heads" / "v10_qwen3_n4_l1.pt"
HIDDEN, TOKENS = 64, 12  # the capture's hidden size (the tiny target's) and token count


def _tokenizer(out: Path) -> None:
    """A character-level tokenizer for the tiny target (ids below its vocabulary of 64)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<bos>", "<eos>", "<pad>", "<unk>", *map(chr, range(97, 123))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.save_pretrained(out)


def _gguf(path: Path) -> None:
    gguf = pytest.importorskip("gguf", reason="the gguf package writes the GGUF fixture: pip install gguf")
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    for name in ("token_embd.weight", "output.weight"):
        writer.add_tensor(name, torch.ones(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _capture(root: Path, target_config: dict) -> None:
    """A capture of one shard of two rows, as data/capture.py writes one (format 1)."""
    from safetensors.torch import save_file

    root.mkdir()
    save_file(
        {
            "input_ids": torch.arange(TOKENS, dtype=torch.int32),
            "loss_mask": torch.ones(TOKENS, dtype=torch.uint8),
            "offsets": torch.tensor([0, 5, TOKENS], dtype=torch.int64),
            "hidden.0": torch.randn(TOKENS, HIDDEN),
        },
        str(root / "shard-00000.safetensors"),
    )
    save_file({"lm_head": torch.randn(64, HIDDEN), "norm_scale": torch.ones(HIDDEN)}, str(root / "teacher.safetensors"))
    (root / "tokens.json").write_text(json.dumps([chr(97 + i % 26) for i in range(64)]))
    manifest = {
        "format": 1,
        "settings": {"teacher": "full", "dtype": "float32"},
        "target_config": target_config,
        "num_layers": 2,
        "hidden_size": HIDDEN,
        "vocab_size": 64,
        "norm_eps": 1e-5,
        "pad_id": 2,
        "states": [0],
        "rows": 2,
        "tokens": TOKENS,
        "shards": [{"file": "shard-00000.safetensors", "rows": 2, "tokens": TOKENS}],
        "complete": True,
    }
    (root / "capture.json").write_text(json.dumps(manifest, indent=2))


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory) -> Path:
    """Every kind of file a loader reads, whole (built once; each case damages a copy)."""
    from spd.target.staging import StagedModel
    from spd.training.distill import DistillConfig, new_head

    root = tmp_path_factory.mktemp("whole")
    tiny_model("llama", layers=2, vocab=64).save_pretrained(root / "target")
    _tokenizer(root / "target")
    staged = StagedModel.from_pretrained(root / "target", n_stages=2)
    torch.manual_seed(0)
    new_head(staged, DistillConfig(n_stages=2, target=str(root / "target"))).save_pretrained(root / "head")
    shutil.copy(AUTHORS_HEAD, root / "authors.pt")
    _gguf(root / "model.gguf")
    config = json.loads((root / "target" / "config.json").read_text())
    _capture(root / "capture", config)
    (root / "preset.yaml").write_text("n_stages: 2\nmax_steps: 3\nlr: 0.001\n")
    rows = [{"text": "abc " * 5}, {"messages": [{"role": "user", "content": "hi"}]}, {"text": "def"}]
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("abc", "de", "fgh")))
    return root


# ------------------------------------------------------------------------------------------ the damage


def _truncated(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _text(path: Path) -> None:
    path.write_text("these are notes, not the file that was here\n")


def _random(path: Path) -> None:
    path.write_bytes(random.Random(0).randbytes(4096))


def _directory(path: Path) -> None:
    path.unlink()
    path.mkdir()
    (path / "stray").write_text("x")


def _lfs_pointer(path: Path) -> None:
    path.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0123\nsize 435856\n")


def _int_tensors(path: Path) -> None:
    """Weights stored as integers (a wrong dtype): every floating tensor cast to int64."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file, save_file

        save_file({k: v.to(torch.int64) for k, v in load_file(str(path)).items()}, str(path))
    else:
        blob = torch.load(path, weights_only=True)
        blob["state_dict"] = {k: v.to(torch.int64) for k, v in blob["state_dict"].items()}
        torch.save(blob, path)


BINARY = {"truncated": _truncated, "empty": _empty, "text": _text, "random": _random, "directory": _directory}
DAMAGE = {**BINARY, "lfs pointer": _lfs_pointer}
WEIGHTS = {**DAMAGE, "int tensors": _int_tensors}
JSON = BINARY
# A YAML file cut in half is often a shorter valid one: the cut cannot be told from the text.
YAML = {k: v for k, v in BINARY.items() if k != "truncated"}


# ------------------------------------------------------------------------------------------ the loaders


def _resolve_cut(root: Path, **spec) -> None:
    from spd.decoding.loader import resolve_cut
    from spd.decoding.spec import DecodingSpec

    resolve_cut(DecodingSpec(target=str(root / "target"), **spec))


def _load_target(root: Path) -> None:
    from spd.target.staging import StagedModel

    StagedModel.from_pretrained(root / "target", n_stages=2)


def _load_partial(root: Path) -> None:
    from spd.runtime.loading import load_partial

    load_partial(str(root / "target"), 2, 1)


def _target_layers(root: Path) -> None:
    from spd.target.cut import target_num_layers

    target_num_layers(str(root / "target"))


def _tokenizer_load(root: Path) -> None:
    from spd.target.tokenizer import load_tokenizer

    load_tokenizer(root / "target")


def _head(root: Path) -> None:
    from spd.heads.loading import load_speculator

    load_speculator(str(root / "head"))


def _authors(root: Path) -> None:
    from spd.heads.published.authors_file import load_authors_file

    load_authors_file(root / "authors.pt")


def _gguf_load(root: Path) -> None:
    from spd.target.gguf import load_gguf

    load_gguf(root / "model.gguf")


def _capture_rows(root: Path) -> None:
    from spd.training.capture import CapturedDataset

    CapturedDataset(root / "capture")


def _capture_target(root: Path) -> None:
    from spd.training.capture import CapturedTarget

    CapturedTarget(root / "capture", n_stages=2).token_strings([0, 1])


def _preset(root: Path) -> None:
    from spd.training.presets import load_config

    load_config(str(root / "preset.yaml"), [])


def _data(root: Path) -> None:
    from spd.data.prepare import DataConfig, _load_raw

    _load_raw(str(root / "data.jsonl"), DataConfig())


def _prompts(root: Path) -> None:
    from spd.data.prompt_sets import load_prompt_set

    load_prompt_set(str(root / "prompts.jsonl"))


# (file, the loaders that read it, the damage it is put through)
CASES = [
    ("target/model.safetensors", (_load_target, _load_partial, _resolve_cut), WEIGHTS),
    ("target/config.json", (_load_target, _load_partial, _target_layers, _tokenizer_load, _resolve_cut), JSON),
    ("target/generation_config.json", (_load_target, _load_partial, _resolve_cut), JSON),
    ("target/tokenizer.json", (_tokenizer_load,), JSON),
    ("target/tokenizer_config.json", (_tokenizer_load,), JSON),
    ("head/model.safetensors", (_head,), WEIGHTS),
    ("head/config.json", (_head, lambda root: _resolve_cut(root, speculator=str(root / "head"))), JSON),
    ("authors.pt", (_authors,), WEIGHTS),
    ("model.gguf", (_gguf_load,), DAMAGE),
    ("capture/capture.json", (_capture_rows, _capture_target), JSON),
    ("capture/shard-00000.safetensors", (_capture_rows,), WEIGHTS),  # int tensors: its states are cast too
    ("capture/teacher.safetensors", (_capture_target,), WEIGHTS),
    ("capture/tokens.json", (_capture_target,), JSON),
    ("preset.yaml", (_preset,), YAML),
    ("data.jsonl", (_data,), JSON),
    ("prompts.jsonl", (_prompts,), JSON),
]


def _params():
    for file, loaders, damages in CASES:
        for loader in loaders:
            name = loader.__name__.strip("_") if loader.__name__ != "<lambda>" else "resolve_cut_head"
            for kind, damage in damages.items():
                yield pytest.param(file, loader, damage, id=f"{file}-{name}-{kind}")


@pytest.mark.parametrize("file,loader,damage", list(_params()))
def test_a_damaged_file_is_one_sentence_naming_it(fixtures, tmp_path, file, loader, damage):
    root = tmp_path / "copy"
    shutil.copytree(fixtures, root)
    path = root / file
    damage(path)
    with pytest.raises(SpdInputError) as info:
        loader(root)
    message = str(info.value)
    assert "\n" not in message, message
    # The damaged file itself, not only its directory (a directory in its place: it, or the file looked for in it).
    assert f"'{path}'" in message or f"'{path}/" in message, message
    assert "expected" in message, message


def test_the_whole_fixtures_load(fixtures):
    """The damage is what the loaders refuse: every loader reads the whole files without complaint."""
    for _, loaders, _ in CASES:
        for loader in loaders:
            if loader is not _gguf_load:  # transformers cannot build a model from the GGUF fixture's two tensors
                loader(fixtures)
    from spd.reading import check_gguf

    check_gguf(fixtures / "model.gguf")


def test_messages_say_what_is_wrong(fixtures, tmp_path):
    """The problem half of the sentence for each kind of damage, for one weights file and one JSON file."""
    from spd.reading import read_json, safetensors_header

    weights = tmp_path / "model.safetensors"
    expected = {
        _truncated: "is cut short (",
        _empty: "is empty (0 bytes)",
        _text: "is not a safetensors file but text (it starts 'these are notes",
        _random: "is not a safetensors file",
        _directory: "is a directory",
        _lfs_pointer: "is a Git LFS pointer",
        _int_tensors: "as I64 (and 13 more); expected floating-point tensors (BF16, F16, F32",
    }
    for damage, words in expected.items():
        shutil.rmtree(weights) if weights.is_dir() else None
        shutil.copy(fixtures / "head" / "model.safetensors", weights)
        damage(weights)
        with pytest.raises(SpdInputError, match=r"^the weights file '.*model\.safetensors' ") as info:
            safetensors_header(weights, "weights file")
        assert words in str(info.value), (damage.__name__, str(info.value))
    config = tmp_path / "config.json"
    for damage, words in {
        _truncated: "is cut short (its JSON stops at line",
        _text: "is not valid JSON (",
        _random: "is not UTF-8 text",
    }.items():
        shutil.copy(fixtures / "target" / "config.json", config)
        damage(config)
        with pytest.raises(SpdInputError, match=r"^the config '.*config\.json' ") as info:
            read_json(config, "config", "the file that save_pretrained writes")
        assert words in str(info.value) and str(info.value).endswith("expected the file that save_pretrained writes")
    config.write_text("[1, 2]")
    with pytest.raises(SpdInputError, match="holds a JSON list, not an object"):
        read_json(config, "config")


def test_a_shard_the_index_lists_is_checked(fixtures, tmp_path):
    """A sharded target (model.safetensors.index.json): each shard's header is checked; the index itself too."""
    from safetensors.torch import load_file, save_file

    from spd.target.staging import StagedModel

    target = tmp_path / "target"
    shutil.copytree(fixtures / "target", target)
    tensors = load_file(str(target / "model.safetensors"))
    (target / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(target / shard), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    StagedModel.from_pretrained(target, n_stages=2)  # whole: loads
    _truncated(target / "model-00002-of-00002.safetensors")
    for load in (lambda: StagedModel.from_pretrained(target), lambda: _load_partial(tmp_path)):
        with pytest.raises(SpdInputError, match=r"weights shard '.*model-00002-of-00002\.safetensors' is cut short"):
            load()
    _text(target / "model.safetensors.index.json")
    with pytest.raises(SpdInputError, match=r"weights index '.*model\.safetensors\.index\.json' is not valid JSON"):
        StagedModel.from_pretrained(target)


# ------------------------------------------------------------------------------------------- the programs


def _env() -> dict:
    # No hub: a test never reaches the network, whatever it names.
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _one_error_line(proc: subprocess.CompletedProcess, path: Path) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"'{path}'" in errors[0], proc.stderr[-3000:]
    return errors[0]


def test_spd_generate_prints_one_error_line_for_damaged_weights(fixtures, tmp_path):
    target = tmp_path / "target"
    shutil.copytree(fixtures / "target", target)
    _truncated(target / "model.safetensors")
    proc = subprocess.run(
        [*spd_generate_command(), "--target", str(target), "--prompt", "abc", "--max-new-tokens", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=_env(),
    )
    line = _one_error_line(proc, target / "model.safetensors")
    assert line.startswith(f"error: the target's weights file '{target / 'model.safetensors'}' is cut short ("), line


def test_spd_generate_names_a_damaged_head_and_tokenizer(fixtures, tmp_path):
    """The same through spd-generate's main in this process, for a head's config and the target's tokenizer."""
    from conftest import run_main
    from spd.cli.generate import main

    root = tmp_path / "copy"
    shutil.copytree(fixtures, root)
    _empty(root / "head" / "config.json")
    _truncated(root / "target" / "tokenizer.json")
    for args, path, words in (
        (["--target", str(fixtures / "target"), "--speculator", str(root / "head")], "head/config.json", "is empty"),
        (["--target", str(root / "target")], "target/tokenizer.json", "is cut short"),
    ):
        proc = run_main(main, *args, "--prompt", "abc", "--max-new-tokens", "2")
        assert words in _one_error_line(proc, root / path)


def test_distill_prints_one_error_line_for_a_damaged_preset(fixtures, tmp_path):
    preset = tmp_path / "preset.yaml"
    _random(preset)
    proc = subprocess.run(
        [sys.executable, str(REPO / "train" / "distill.py"), "--config", str(preset)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=_env(),
    )
    assert "is not UTF-8 text" in _one_error_line(proc, preset)
