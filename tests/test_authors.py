"""The SPD authors' released head format: our implementation proposes exactly what their code proposes.

The references in tests/fixtures/authors were made by running the authors' own code (v10 at commit 0c068eb, v11
at 186f366, transformers 5.8.0) on tiny random Qwen3 and Qwen3.5 targets; see its README and make_fixtures.py.
"""

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, run_main
from helpers.authors import EXPECTED, FIXTURES, head_file, staged_target
from spd.decoding.engine import Engine
from spd.decoding.sampling import SamplingParams
from spd.errors import SpdInputError
from spd.heads.loading import load_speculator
from spd.heads.published.authors_file import load_authors_file, parse_hub_reference
from spd.heads.published.authors_head import AuthorsHead, load_authors_head
from spd.target.staging import StagedModel

HEADS = sorted(EXPECTED["heads"])


def _cli(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )


# ----------------------------------------------------------------------------- exactness against their code


@pytest.mark.slow
@pytest.mark.parametrize("name", HEADS)
def test_greedy_generate_reproduces_the_authors_code(name):
    """Tokens, per-token acceptance and step counts of their greedy generate, for every fixture run of a head."""
    info = EXPECTED["heads"][name]
    staged = staged_target(info["target"], info["num_stages"])
    runs = [r for r in EXPECTED["generate"] if r["head"] == name]
    assert runs
    for rec in runs:
        head = load_authors_head(str(head_file(name)), staged, use_deepest=rec["use_deepest_effective"])
        assert head.config.version == info["version"]
        out = Engine.chain(staged, head).run(
            rec["prompt_ids"],
            rec["max_new_tokens"],
            SamplingParams(),
            eos_token_id=EXPECTED["targets"][info["target"]]["eos_token_id"],
        )
        assert out.token_ids == rec["output_ids"] == rec["target_greedy_ids"]
        # Their flag for the first token (from the prefill) is always True; ours is False (not a speculation).
        assert out.stats.token_acceptance[1:] == rec["accepted"][1:], rec["prompt_index"]
        assert out.stats.steps == rec["steps"]
        assert out.stats.flushes == rec["num_rejections"]


@pytest.mark.slow
@pytest.mark.parametrize("name", HEADS)
def test_their_head_as_a_tree_source_of_width_1_is_their_chain(name):
    """Our tree engine with their head at W = 1 reproduces their greedy generate (tokens, flags, steps); at W = 4
    the output still equals the target's greedy output."""
    from spd.decoding.engine import Engine
    from spd.decoding.proposers import HeadProposer

    info = EXPECTED["heads"][name]
    staged = staged_target(info["target"], info["num_stages"])
    eos = EXPECTED["targets"][info["target"]]["eos_token_id"]
    for rec in (r for r in EXPECTED["generate"] if r["head"] == name):
        head = load_authors_head(str(head_file(name)), staged, use_deepest=rec["use_deepest_effective"])
        out = Engine.tree(staged, HeadProposer(head, staged, 1), 1).run(
            rec["prompt_ids"], rec["max_new_tokens"], SamplingParams(), eos_token_id=eos
        )
        assert out.token_ids == rec["output_ids"]
        assert out.stats.token_acceptance[1:] == rec["accepted"][1:], rec["prompt_index"]
        assert (out.stats.steps, out.stats.flushes) == (rec["steps"], rec["num_rejections"])
        wide = Engine.tree(staged, HeadProposer(head, staged, 4), 4).run(
            rec["prompt_ids"], rec["max_new_tokens"], SamplingParams(), eos_token_id=eos
        )
        assert wide.token_ids == rec["target_greedy_ids"]


def test_draft_vocabulary_maps_back_to_target_ids():
    name = next(h for h in HEADS if h.endswith("_draft"))
    info = EXPECTED["heads"][name]
    staged = staged_target(info["target"], info["num_stages"])
    head = load_authors_head(str(head_file(name)), staged)
    ids = sorted({int(t) for t in load_authors_file(head_file(name)).config["draft_token_ids"]})
    assert head.lm_head.weight.shape[0] == len(ids) == info["draft_vocab_size"] < staged.vocab_size
    logits = head.logits(torch.randn(1, staged.config.hidden_size))
    outside = torch.ones(staged.vocab_size, dtype=torch.bool)
    outside[ids] = False
    assert torch.isinf(logits[0, outside]).all() and torch.isfinite(logits[0, ids]).all()


@pytest.mark.slow
def test_loaded_through_every_entry_point(tmp_path):
    """load_speculator, Engine.from_pretrained and spd-generate --speculator all take the file."""
    name = "v11_qwen3_n4_l1_draft"
    rec = next(r for r in EXPECTED["generate"] if r["head"] == name and r["prompt_index"] == 1)
    target = FIXTURES / EXPECTED["targets"]["qwen3"]["path"]
    staged = staged_target("qwen3", 4)
    assert isinstance(load_speculator(str(head_file(name)), target=staged), AuthorsHead)
    with pytest.raises(SpdInputError, match="attached to its target"):
        load_speculator(str(head_file(name)))
    engine = Engine.from_pretrained(str(target), speculator=str(head_file(name)))
    assert engine.staged.n_stages == 4
    out = engine.generate(rec["prompt_ids"], rec["max_new_tokens"])
    assert out.token_ids == rec["output_ids"]
    proc = _cli(
        "-m",
        "spd.cli.generate",
        "--target",
        str(target),
        "--mode",
        "spd",
        "--speculator",
        str(head_file(name)),
        "--prompt-ids",
        ",".join(map(str, rec["prompt_ids"])),
        "--max-new-tokens",
        str(rec["max_new_tokens"]),
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["token_ids"] == rec["output_ids"]
    assert got["stats"]["token_acceptance"][1:] == rec["accepted"][1:]


# ------------------------------------------------------------------------------------------- hub reference


def test_hub_reference_syntax():
    assert parse_hub_reference("hf://yuyijiong/speculative_pipeline_decoding@v10/Qwen3.5-4B_s4_l4.pt") == (
        "yuyijiong/speculative_pipeline_decoding",
        "Qwen3.5-4B_s4_l4.pt",
        "v10",
    )
    assert parse_hub_reference("hf://a/b/dir/f.pt") == ("a/b", "dir/f.pt", None)
    assert parse_hub_reference("hf://a/b@refs%2Fpr%2F1/f.pt")[2] == "refs/pr/1"
    with pytest.raises(SpdInputError, match="malformed"):
        parse_hub_reference("hf://a/f.pt")


@pytest.mark.slow
def test_hub_reference_resolves_through_an_offline_hub_cache(tmp_path):
    """hf://OWNER/REPO@BRANCH/FILE.pt through huggingface_hub's real cache layout, HF_HUB_OFFLINE=1."""
    name = "v10_qwen3_n4_l1"
    commit = "89abcdef0123456789abcdef0123456789abcdef"
    entry = tmp_path / "hub" / "models--spd-tests--authors-heads"
    (entry / "refs").mkdir(parents=True)
    (entry / "refs" / "v10").write_text(commit)
    (entry / "snapshots" / commit).mkdir(parents=True)
    shutil.copy(head_file(name), entry / "snapshots" / commit / "Qwen3-tiny_s4_l1.pt")
    rec = next(r for r in EXPECTED["generate"] if r["head"] == name and r["use_deepest_effective"])
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    args = [
        "-m",
        "spd.cli.generate",
        "--target",
        str(FIXTURES / "targets" / "qwen3"),
        "--mode",
        "spd",
        "--prompt-ids",
        ",".join(map(str, rec["prompt_ids"])),
        "--max-new-tokens",
        str(rec["max_new_tokens"]),
        "--json",
    ]
    proc = _cli(*args, "--speculator", "hf://spd-tests/authors-heads@v10/Qwen3-tiny_s4_l1.pt", env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["token_ids"] == rec["output_ids"]
    # The same through --speculator-revision; a revision the cache does not have is one error line.
    proc = _cli(
        *args,
        "--speculator",
        "hf://spd-tests/authors-heads/Qwen3-tiny_s4_l1.pt",
        "--speculator-revision",
        "v10",
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    proc = _cli(*args, "--speculator", "hf://spd-tests/authors-heads@main/Qwen3-tiny_s4_l1.pt", env=env)
    assert proc.returncode == 2 and proc.stderr.startswith("error: could not fetch") and "Traceback" not in proc.stderr


# ---------------------------------------------------------------------------------------------- converter


@pytest.mark.slow
@pytest.mark.parametrize("name", ["v10_qwen3_n8_l2_draft", "v11_qwen35_n4_l1"])
def test_converter_round_trip_is_bit_exact(tmp_path, name):
    """spd-convert's main in this process, both ways (the converter as a user starts it, in a fresh process:
    test_our_head_in_their_layout_computes_what_ours_does)."""
    from spd.cli.convert import main as convert_main

    proc = run_main(convert_main, str(head_file(name)), str(tmp_path / "dir"))
    assert proc.returncode == 0, proc.stderr
    proc = run_main(convert_main, str(tmp_path / "dir"), str(tmp_path / "back.pt"))
    assert proc.returncode == 0, proc.stderr
    a = torch.load(head_file(name), weights_only=True)
    b = torch.load(tmp_path / "back.pt", weights_only=True)
    assert a["config"] == b["config"] and a["state_dict"].keys() == b["state_dict"].keys()
    for key, tensor in a["state_dict"].items():
        assert tensor.dtype == b["state_dict"][key].dtype and torch.equal(tensor, b["state_dict"][key]), key
    # The directory is a head like any other.
    info = EXPECTED["heads"][name]
    staged = staged_target(info["target"], info["num_stages"])
    rec = next(r for r in EXPECTED["generate"] if r["head"] == name and r["use_deepest_effective"])
    head = load_speculator(str(tmp_path / "dir"), target=staged)
    out = Engine.chain(staged, head).run(rec["prompt_ids"], rec["max_new_tokens"], SamplingParams(), eos_token_id=1)
    assert out.stats.token_acceptance[1:] == rec["accepted"][1:]


@pytest.mark.slow
def test_our_head_in_their_layout_computes_what_ours_does(tmp_path):
    """Our one-layer head on a Qwen3 target, written as their v10 file and loaded back as an authors' head:
    their training forward equals ours at every fill (the final-norm ratio folded into the LM head)."""
    from spd.training.distill import DistillConfig, new_head

    staged = staged_target("qwen3", 4)
    torch.manual_seed(3)
    head = new_head(staged, DistillConfig(n_stages=4))
    with torch.no_grad():
        head.norm.weight.uniform_(0.5, 1.5)  # a trained head's norm differs from the target's
        for layer in head.layers:
            layer.q_norm.weight.uniform_(0.5, 1.5)
    head.save_pretrained(tmp_path / "ours")
    proc = _cli(
        "-m",
        "spd.cli.convert",
        str(tmp_path / "ours"),
        str(tmp_path / "theirs.pt"),
        "--target",
        str(FIXTURES / "targets" / "qwen3"),
    )
    assert proc.returncode == 0, proc.stderr
    theirs = load_authors_head(str(tmp_path / "theirs.pt"), staged)
    ids = torch.tensor([EXPECTED["training_forward"][0]["input_ids"]])
    anchors = sorted(set(head.needed_anchors()) | set(theirs.needed_anchors()))
    hidden = staged.hidden_states(ids, anchors)
    for fill in range(1, 5):
        with torch.no_grad():
            ours = head.logits(head.forward_train(hidden, torch.tensor([fill])))
        torch.testing.assert_close(theirs.train_logits(hidden, fill), ours, atol=2e-4, rtol=1e-4)


def test_converter_refuses_what_their_layout_cannot_express(tmp_path, tiny_testbed):
    from spd.cli.convert import main as convert_main
    from spd.training.distill import DistillConfig, new_head

    staged = staged_target("qwen3", 4)
    new_head(staged, DistillConfig(n_stages=4, num_layers=2)).save_pretrained(tmp_path / "deep")
    proc = run_main(
        convert_main,
        str(tmp_path / "deep"),
        str(tmp_path / "x.pt"),
        "--target",
        str(FIXTURES / "targets" / "qwen3"),
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "it has 2 layers" in proc.stderr
    llama = StagedModel.from_pretrained(tiny_testbed / "target", n_stages=4)
    new_head(llama, DistillConfig(n_stages=4)).save_pretrained(tmp_path / "llama")
    proc = run_main(
        convert_main,
        str(tmp_path / "llama"),
        str(tmp_path / "x.pt"),
        "--target",
        str(tiny_testbed / "target"),
    )
    assert proc.returncode == 2 and "no q/k norms" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_main(convert_main, str(tmp_path / "llama"), str(tmp_path / "x.pt"))
    assert proc.returncode == 2 and "--target" in proc.stderr


# -------------------------------------------------------------------------------------------- bad files


class _Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned > /tmp/spd-should-not-exist",))


def _bad_files(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    good = torch.load(head_file("v10_qwen3_n4_l1"), weights_only=True)
    files = {}
    raw = head_file("v10_qwen3_n4_l1").read_bytes()
    files["truncated"] = (tmp_path / "truncated.pt", "truncated or not a torch.save file")
    files["truncated"][0].write_bytes(raw[: len(raw) // 2])
    files["random"] = (tmp_path / "random.pt", "not a torch.save file")
    files["random"][0].write_bytes(
        torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8).numpy().tobytes()
    )
    files["code"] = (tmp_path / "code.pt", "needs arbitrary unpickling")
    torch.save({"state_dict": good["state_dict"], "config": good["config"], "x": _Payload()}, files["code"][0])
    files["pickle"] = (tmp_path / "plain.pt", "needs arbitrary unpickling")
    files["pickle"][0].write_bytes(pickle.dumps(_Payload(), protocol=2))
    files["version"] = (tmp_path / "v12.pt", "head version 12")
    torch.save({"state_dict": good["state_dict"], "config": {**good["config"], "version": 12}}, files["version"][0])
    files["other"] = (tmp_path / "other.pt", "expected a dict with 'state_dict' and 'config'")
    torch.save({"weight": torch.zeros(3)}, files["other"][0])
    files["layout"] = (tmp_path / "layout.pt", "does not match its version's layout")
    torch.save(
        {"state_dict": {k: v for k, v in good["state_dict"].items() if "g0" not in k}, "config": good["config"]},
        files["layout"][0],
    )
    files["hidden"] = (tmp_path / "hidden.pt", "does not fit this target: hidden size 32")
    torch.save({"state_dict": good["state_dict"], "config": {**good["config"], "hidden_size": 32}}, files["hidden"][0])
    files["stages"] = (tmp_path / "stages.pt", "n = 3 stages, which do not divide the target's 8 layers")
    torch.save({"state_dict": good["state_dict"], "config": {**good["config"], "num_stages": 3}}, files["stages"][0])
    return files


def test_random_and_corrupted_bytes_are_refused_with_one_sentence(tmp_path):
    """Whatever the bytes, torch.load's failure (it can raise many kinds) becomes one sentence."""
    raw = head_file("v10_qwen3_n4_l1").read_bytes()
    gen = torch.Generator().manual_seed(1)
    for i in range(40):
        noise = (
            torch.randint(0, 256, (int(torch.randint(1, 5000, (1,), generator=gen)),), generator=gen, dtype=torch.uint8)
            .numpy()
            .tobytes()
        )
        data = noise if i % 2 else raw[: len(raw) // 3] + noise  # pure noise, or a zip cut and continued by noise
        path = tmp_path / f"bad{i}.pt"
        path.write_bytes(data)
        with pytest.raises(SpdInputError, match="not a torch.save file"):
            load_authors_file(path)


def test_bad_files_are_refused_with_one_sentence(tmp_path):
    staged = staged_target("qwen3", 4)
    for path, message in _bad_files(tmp_path).values():
        with pytest.raises(SpdInputError, match=message):
            load_authors_head(str(path), staged)
    assert not Path("/tmp/spd-should-not-exist").exists()


def test_bad_files_in_the_cli_are_one_error_line(tmp_path):
    from spd.cli.generate import main as generate_main

    bad = _bad_files(tmp_path)
    # spd-generate's main(argv) per bad file, in this process: a payload that ran would show here as well.
    procs = [
        run_main(
            generate_main,
            "--target",
            str(FIXTURES / "targets" / "qwen3"),
            "--mode",
            "spd",
            "--stages",
            "4",
            "--speculator",
            str(path),
            "--prompt-ids",
            "5,6,7,8,9",
            "--max-new-tokens",
            "4",
        )
        for path, _ in bad.values()
    ]
    for (kind, (_, message)), proc in zip(bad.items(), procs):
        assert proc.returncode == 2, (kind, proc.stderr)
        assert proc.stderr.startswith("error:") and message in proc.stderr and "Traceback" not in proc.stderr, kind
    assert not Path("/tmp/spd-should-not-exist").exists()


@pytest.mark.parametrize("name", HEADS)
def test_training_forward_top1_per_fill_reproduces_the_authors_code(name):
    """Their training forward (the layout their heads were distilled with): the head's top-1 at every position
    for every simulated fill a = 1..n."""
    rec = next(r for r in EXPECTED["training_forward"] if r["head"] == name)
    info = EXPECTED["heads"][name]
    staged = staged_target(info["target"], info["num_stages"])
    head = load_authors_head(str(head_file(name)), staged)
    hidden = staged.hidden_states(torch.tensor([rec["input_ids"]]), head.needed_anchors())
    assert sorted(map(int, rec["fills"])) == list(range(1, info["num_stages"] + 1))
    for fill, want in rec["fills"].items():
        logits = head.train_logits(hidden, int(fill))[0]
        assert logits.argmax(-1).tolist() == want["top1"], fill


@pytest.mark.slow
def test_distributed_runtime_with_an_authors_head_on_a_hybrid_target():
    """Stage processes with linear-attention rings; rank 0 runs their head: the same tokens and flags."""
    rec = next(r for r in EXPECTED["generate"] if r["head"] == "v11_qwen35_n4_l1" and r["prompt_index"] == 0)
    proc = _cli(
        "-m",
        "spd.cli.generate",
        "--target",
        str(FIXTURES / "targets" / "qwen35"),
        "--mode",
        "spd",
        "--speculator",
        str(head_file("v11_qwen35_n4_l1")),
        "--prompt-ids",
        ",".join(map(str, rec["prompt_ids"])),
        "--max-new-tokens",
        str(rec["max_new_tokens"]),
        "--runtime",
        "distributed",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["token_ids"] == rec["output_ids"]
    assert out["stats"]["token_acceptance"][1:] == rec["accepted"][1:]
    assert out["stats"]["flushes"] == rec["num_rejections"] > 5


@pytest.mark.slow
def test_tree_mode_takes_their_heads_in_the_cli():
    """spd-generate --mode tree with their file: the W = 4 tree's tokens equal --mode spd's (the greedy output). The
    tree run as a user starts it, in a fresh process; the spd run, its reference, with spd-generate's main in this
    one."""
    import json

    from spd.cli.generate import main as generate_main

    rec = next(r for r in EXPECTED["generate"] if r["head"] == "v11_qwen35_n4_l1" and r["prompt_index"] == 1)
    common = [
        "--target",
        str(FIXTURES / "targets" / "qwen35"),
        "--speculator",
        str(head_file("v11_qwen35_n4_l1")),
        "--prompt-ids",
        ",".join(map(str, rec["prompt_ids"])),
        "--max-new-tokens",
        str(rec["max_new_tokens"]),
        "--json",
    ]
    outs = {}
    for mode, proc in (
        ("spd", run_main(generate_main, *common, "--mode", "spd")),
        ("tree", _cli("-m", "spd.cli.generate", *common, "--mode", "tree", "--tree-width", "4")),
    ):
        assert proc.returncode == 0, proc.stderr[-2000:]
        outs[mode] = json.loads(proc.stdout)
    assert outs["tree"]["token_ids"] == outs["spd"]["token_ids"] == rec["target_greedy_ids"]
    assert outs["tree"]["stats"]["source"] == "head"


@pytest.mark.slow
def test_sampling_with_an_authors_draft_vocabulary_head_follows_the_target(tmp_path):
    """A head predicting over a subset of the vocabulary (q is zero elsewhere): chi-square, 1000 seeds, in the chain
    and as the source of a sampled tree."""
    from conftest import tiny_model
    from helpers.stats import chi_square_p_value, sample_outcomes, sequence_probs
    from spd.decoding.engine import Engine
    from spd.decoding.proposers import HeadProposer
    from spd.heads.published.convert import head_to_authors_file
    from spd.training.distill import DistillConfig, new_head

    vocab, params = 6, SamplingParams(temperature=0.9, top_p=0.95)
    staged = StagedModel(
        tiny_model("qwen3", seed=3, layers=4, vocab=vocab, bos_token_id=0, eos_token_id=None, pad_token_id=0), 2
    )
    with torch.no_grad():
        staged.lm_head.weight.mul_(0.05)
    torch.manual_seed(4)
    head = new_head(staged, DistillConfig(n_stages=2))
    with torch.no_grad():
        head.lm_head.weight.normal_(0, 0.5)
    head.save_pretrained(tmp_path / "ours")
    head_to_authors_file(tmp_path / "ours", staged, tmp_path / "full.pt")
    blob = torch.load(tmp_path / "full.pt", weights_only=True)
    draft = [0, 2, 3, 5]
    blob["state_dict"]["lm_head.weight"] = blob["state_dict"]["lm_head.weight"][draft]
    blob["config"].update(draft_token_ids=draft, draft_vocab_size=len(draft))
    torch.save(blob, tmp_path / "draft.pt")
    authors = load_authors_head(str(tmp_path / "draft.pt"), staged)
    prompt = [1, 4, 2]
    exact = sequence_probs(staged, prompt, params, 3)
    # The chain on their schedule, and our tree (W = 3, sampled children: q is zero outside the draft vocabulary).
    for engine in (Engine.chain(staged, authors), Engine.tree(staged, HeadProposer(authors, staged, 2), 3)):
        counts, stats = sample_outcomes(engine, prompt, params, 3, 1000)
        flushes, verified = sum(s.flushes for s in stats), sum(s.verified for s in stats)
        assert 0.1 * verified < flushes < 0.9 * verified, type(engine).__name__
        assert chi_square_p_value(counts, exact, 1000) > 1e-3, type(engine).__name__
