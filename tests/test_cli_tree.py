"""spd-generate --mode tree and the bench's tree runs, as a user runs them (fresh processes; the ar runs they are compared
with come from spd-generate's main in this process)."""

import json
import shutil

import pytest

from conftest import run_bench, run_main
from helpers.cli import spd_generate, spd_generate_main


def _ids(proc) -> list[int]:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["token_ids"]


@pytest.mark.slow
def test_tree_mode_with_a_draft_model_is_lossless_and_reports_tree_stats(tiny_testbed):
    common = [
        "--target",
        str(tiny_testbed / "target"),
        "--prompt",
        "def main(argv):\n",
        "--max-new-tokens",
        "24",
        "--json",
    ]
    ar = json.loads(spd_generate_main(*common).stdout)
    proc = spd_generate(
        *common,
        "--mode",
        "tree",
        "--draft-model",
        str(tiny_testbed / "draft"),
        "--stages",
        "4",
        "--tree-width",
        "4",
        "--tree-children",
        "2",
    )
    assert proc.returncode == 0, proc.stderr
    tree = json.loads(proc.stdout)
    assert tree["token_ids"] == ar["token_ids"] and tree["text"] == ar["text"]
    stats = tree["stats"]
    assert stats["mode"] == "tree" and stats["source"] == "draft" and stats["stages"] == 4
    assert stats["width"] == 4 and stats["children"] == 2 and 1 <= stats["max_tree_size"] <= 1 + 4 * 4
    for key in (
        "steps",
        "flushes",
        "accepted",
        "verified_by_position",
        "accepted_by_sibling",
        "mean_tree_size",
        "equivalent_accept_length",
        "theoretical_speedup",
        "tokens_per_s",
    ):
        assert key in stats
    assert stats["equivalent_accept_length"] == pytest.approx(4 * (stats["new_tokens"] - 1) / stats["steps"], abs=1e-3)


@pytest.mark.slow
def test_tree_mode_auto_width_and_candidate_rules(tiny_testbed):
    common = [
        "--target",
        str(tiny_testbed / "target"),
        "--prompt",
        "def main(argv):\n",
        "--max-new-tokens",
        "24",
        "--json",
        "--mode",
        "tree",
        "--draft-model",
        str(tiny_testbed / "draft"),
        "--stages",
        "4",
    ]
    auto = json.loads(spd_generate(*common, "--tree-width", "auto", "--tree-max-width", "16").stdout)
    ar = json.loads(
        spd_generate_main(
            "--target",
            str(tiny_testbed / "target"),
            "--prompt",
            "def main(argv):\n",
            "--max-new-tokens",
            "24",
            "--json",
        ).stdout
    )
    assert auto["token_ids"] == ar["token_ids"]
    assert auto["stats"]["width"] == "auto" and 1 <= auto["stats"]["mean_width"] <= 16
    assert auto["stats"]["candidates"] == "top-k"  # greedy
    sampled = json.loads(spd_generate_main(*common, "--temperature", "0.8", "--seed", "3").stdout)
    assert sampled["stats"]["candidates"] == "sampled"
    top_k = json.loads(
        spd_generate_main(*common, "--temperature", "0.8", "--seed", "3", "--tree-candidates", "top-k").stdout
    )
    assert top_k["stats"]["candidates"] == "top-k"


def test_tree_mode_streams_text_with_a_summary(tiny_testbed):
    proc = spd_generate(
        "--target",
        str(tiny_testbed / "target"),
        "--mode",
        "tree",
        "--draft-model",
        str(tiny_testbed / "draft"),
        "--stages",
        "2",
        "--prompt",
        "import os\n",
        "--max-new-tokens",
        "10",
    )
    assert proc.returncode == 0, proc.stderr
    assert "[tree]" in proc.stderr and "2 stages" in proc.stderr and "tree W=4 K=4" in proc.stderr


@pytest.mark.slow
def test_tree_mode_with_an_spd_head_of_width_four(tiny_testbed, tiny_heads):  # noqa: F811
    common = ["--target", str(tiny_testbed / "target"), "--prompt", "class A:\n", "--max-new-tokens", "16", "--json"]
    proc = spd_generate(*common, "--mode", "tree", "--speculator", str(tiny_heads[4]), "--tree-width", "4")
    assert _ids(proc) == _ids(spd_generate_main(*common))
    stats = json.loads(proc.stdout)["stats"]
    assert stats["source"] == "head" and stats["stages"] == 4 and stats["schedule"] == "input"


@pytest.fixture(scope="module")
def mismatched_drafts(tiny_testbed, tmp_path_factory):
    """A draft with another vocabulary size (no tokenizer), and the testbed draft with a tokenizer of one more token."""
    from transformers import AutoTokenizer

    from conftest import tiny_model

    root = tmp_path_factory.mktemp("drafts")
    tiny_model("llama", layers=2, vocab=64).save_pretrained(root / "small_vocab")
    shutil.copytree(tiny_testbed / "draft", root / "other_tokenizer")
    tok = AutoTokenizer.from_pretrained(root / "other_tokenizer")
    tok.add_tokens(["<|extra|>"])
    tok.save_pretrained(root / "other_tokenizer")
    return root


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--mode", "tree"], "--mode tree needs --draft-model DIR_OR_ID"),
        (
            ["--mode", "tree", "--draft-model", "/no/such/draft"],
            "draft model directory '/no/such/draft' does not exist",
        ),
        (["--mode", "pp", "--draft-model", "DRAFT"], "--draft-model is only used by --mode tree"),
        (["--mode", "tree", "--draft-model", "DRAFT", "--speculator", "HEAD4"], "not both"),
        (
            ["--mode", "tree", "--draft-model", "DRAFT", "--tree-width", "0"],
            "--tree-width: expected a positive integer",
        ),
        (
            ["--mode", "tree", "--draft-model", "DRAFT", "--tree-width", "wide"],
            "--tree-width: expected a positive integer or 'auto'",
        ),
        (
            ["--mode", "tree", "--draft-model", "DRAFT", "--tree-candidates", "random"],
            "--tree-candidates: invalid choice",
        ),
        (["--mode", "tree", "--draft-model", "DRAFT", "--tree-children", "x"], "--tree-children: expected a positive"),
        (
            ["--mode", "tree", "--draft-model", "SMALL_VOCAB"],
            "the draft model's vocabulary has 64 tokens but the target's has 512",
        ),
        (["--mode", "tree", "--draft-model", "OTHER_TOKENIZER"], "the draft model's tokenizer"),
        (
            ["--mode", "tree", "--speculator", "HEAD4", "--stages", "2"],
            "trained for n = 4 stages of 2, 2, 2, 2 layers (--boundaries 2,4,6) but --stages 2 asks for 2 stages",
        ),
    ],
)
def test_bad_tree_input_is_one_clear_line_and_exit_2(
    tiny_testbed,
    tiny_heads,
    mismatched_drafts,
    args,  # noqa: F811
    expected,
):
    subs = {
        "DRAFT": str(tiny_testbed / "draft"),
        "HEAD4": str(tiny_heads[4]),
        "SMALL_VOCAB": str(mismatched_drafts / "small_vocab"),
        "OTHER_TOKENIZER": str(mismatched_drafts / "other_tokenizer"),
    }
    proc = spd_generate_main("--target", str(tiny_testbed / "target"), "--prompt", "x", *[subs.get(a, a) for a in args])
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and expected in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_bench_compares_tree_runs_with_the_pipeline(tiny_testbed, tiny_heads, tmp_path):  # noqa: F811
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "import os\n"}) + "\n" + json.dumps({"prompt": "def f(x):\n"}) + "\n")
    out = tmp_path / "bench.json"
    draft = tiny_testbed / "draft"
    proc = run_bench(
        "decode",
        "--target",
        str(tiny_testbed / "target"),
        "--prompts",
        str(prompts),
        "--run",
        "pp:4",
        "--run",
        f"w4=tree:{draft}:4:4:2",
        "--run",
        f"head=tree:{tiny_heads[4]}:4:4:4",
        "--run",
        f"auto=tree:{draft}:4:auto:4",
        "--run",
        f"topk=tree:{tiny_heads[4]}:4:2:2:top-k",
        "--temperatures",
        "0",
        "1",
        "--max-new-tokens",
        "12",
        "--out",
        str(out),
    )
    assert "| 0 | w4 | tree-draft W=4 K=2 | 4 |" in proc.stdout and "| 0 | head | tree-spd W=4 K=4 | 4 |" in proc.stdout
    assert "| 1 | auto | tree-draft W=auto K=4 | 4 |" in proc.stdout
    results = json.loads(out.read_text())["results"]
    greedy = results["T=0"]
    for name in ("pp n=4", "w4", "head", "auto", "topk"):
        assert greedy[name]["summary"]["identical_to_ar"] == 2
    assert results["T=1"]["topk"]["candidates"] == "top-k" and results["T=1"]["head"]["candidates"] == "auto"
    assert 1 <= results["T=1"]["auto"]["summary"]["mean_width"] <= 8
    assert greedy["pp n=4"]["summary"]["steps_per_token"] == 4.0
    assert 1.0 <= greedy["w4"]["summary"]["mean_tree_size"] <= 1 + 4 * 4
    from spd.bench.decode import main as bench_main

    bad = run_main(bench_main, "--run", f"tree:{draft}:4:4", "--prompts", str(prompts))
    assert bad.returncode == 2 and bad.stderr.startswith("error: --run") and "tree:SOURCE:N:W:K" in bad.stderr
