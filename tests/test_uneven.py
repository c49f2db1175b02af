"""Uneven pipeline cuts (a layer count that n does not divide, e.g. 30 layers in 4 or 8 stages): --stages N takes the
most even cut, the head carries its own, and every mode stays lossless over it."""

import json
import re

import pytest
import torch

from conftest import REPO, run_bench, run_script, tiny_model
from helpers.cli import spd_generate_main
from spd.decoding.engine import Engine
from spd.decoding.generation import generate_ar
from spd.decoding.proposers import SpdHeadProposer
from spd.decoding.sampling import SamplingParams
from spd.errors import SpdInputError
from spd.heads.loading import pipeline_cut
from spd.target.cut import balanced_boundaries, describe_cut, split_layers
from spd.target.staging import StagedModel
from spd.training.distill import DistillConfig, new_head

PROMPTS = [[5, 17, 3, 99, 42, 8], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]


def test_stages_cut_unevenly():
    """--stages N where N does not divide the layers: the larger stages first, the cut of the published heads."""
    assert split_layers(30, 4) == balanced_boundaries(30, 4) == [0, 8, 16, 23, 30]
    assert split_layers(30, 8) == [0, 4, 8, 12, 16, 20, 24, 27, 30]
    for head in sorted((REPO / "heads").glob("*/config.json")):  # n = 4: 8,8,7,7; n = 8: 4,4,4,4,4,4,3,3
        config = json.loads(head.read_text())
        assert split_layers(config["target_num_layers"], config["n_stages"]) == config["boundaries"], head
    assert split_layers(30, 5) == [0, 6, 12, 18, 24, 30]  # equal when n divides L
    assert describe_cut(split_layers(30, 8)) == "8 stages of 4, 4, 4, 4, 4, 4, 3, 3 layers"
    assert describe_cut([0, 8]) == "1 stage of 8 layers"
    with pytest.raises(SpdInputError, match="at least 9 layers"):
        split_layers(8, 9)


def test_uneven_stages_flag_equals_ar(tiny_testbed, tmp_path):
    """spd-generate --stages 3 on the testbed's 8 layers cuts 3, 3, 2, says so, and gives ar's tokens (pp, and spd
    with a head trained for that cut); the Python API's n_stages=3 is the same cut."""
    target = str(tiny_testbed / "target")
    torch.manual_seed(3)
    new_head(StagedModel.from_pretrained(target, n_stages=3), DistillConfig(n_stages=3, target=target)).save_pretrained(
        tmp_path / "head"
    )
    common = ["--target", target, "--prompt", "def main(argv):", "--max-new-tokens", "16", "--json"]
    ar = spd_generate_main(*common, "--mode", "ar")
    pp = spd_generate_main(*common, "--mode", "pp", "--stages", "3")
    spd = spd_generate_main(*common, "--mode", "spd", "--speculator", str(tmp_path / "head"), "--stages", "3")
    assert ar.returncode == pp.returncode == spd.returncode == 0, pp.stderr + spd.stderr
    ar, pp_out, spd_out = (json.loads(proc.stdout) for proc in (ar, pp, spd))
    assert pp_out["token_ids"] == spd_out["token_ids"] == ar["token_ids"]
    assert pp_out["stats"]["stage_layers"] == spd_out["stats"]["stage_layers"] == [3, 3, 2]
    assert f"[spd] loaded {target}: pp, 3 stages of 3, 3, 2 layers; " in pp.stderr
    assert Engine.from_pretrained(target, n_stages=3).staged.boundaries == [0, 3, 6, 8]


def test_a_cut_other_than_the_heads_is_one_message_before_loading(tiny_testbed, tiny_heads, monkeypatch):
    """--stages or --boundaries that differ from the head's cut: one message naming both cuts, before any weights
    load (in the Python API's names through Engine.from_pretrained)."""
    target, head = str(tiny_testbed / "target"), str(tiny_heads[4])

    def no_loading(*args, **kwargs):
        raise AssertionError("weights were loaded before the cut was checked")

    monkeypatch.setattr(StagedModel, "from_pretrained", no_loading)
    bad = spd_generate_main("--target", target, "--prompt", "x", "--speculator", head, "--stages", "3")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    assert bad.stderr == (
        "error: the speculator does not fit this target: it was trained for n = 4 stages of 2, 2, 2, 2 layers "
        "(--boundaries 2,4,6) but --stages 3 asks for 3 stages of 3, 3, 2 layers; leave --stages and --boundaries "
        "out (the head's cut is the default) or use a head trained for that cut\n"
    )
    bad = spd_generate_main("--target", target, "--prompt", "x", "--speculator", head, "--boundaries", "1,2,3")
    assert bad.returncode == 2 and "but --boundaries 1,2,3 asks for 4 stages of 1, 1, 1, 5 layers" in bad.stderr
    with pytest.raises(SpdInputError, match=r"\(boundaries=\[2, 4, 6\]\) but n_stages=8 asks for 8 stages of 1,"):
        Engine.from_pretrained(target, speculator=head, n_stages=8)


@pytest.mark.parametrize("boundaries", [[0, 2, 4, 6, 7], [0, 1, 2, 3, 4, 5, 6, 7]])
def test_uneven_cut_every_mode_equals_ar(boundaries):
    """7 layers cut 2,2,2,1 (n = 4) and 1,1,1,1,1,1,1 with stages of one layer: spd, pp, tree == ar."""
    staged = StagedModel(tiny_model("llama", layers=7), boundaries=boundaries)
    torch.manual_seed(1)
    head = new_head(staged, DistillConfig(n_stages=len(boundaries) - 1, boundaries=boundaries)).eval()
    assert head.config.boundaries == boundaries
    engine = Engine.chain(staged, head)
    tree = Engine.tree(staged, SpdHeadProposer(head, staged, 3), 3)
    for prompt in PROMPTS:
        ar = generate_ar(staged, prompt, 24).token_ids
        assert engine.run(prompt, 24, SamplingParams()).token_ids == ar
        assert engine.run(prompt, 24, SamplingParams(), use_head=False).token_ids == ar
        assert tree.generate(prompt, 24).token_ids == ar


def test_head_carries_its_cut(tmp_path):
    """A saved uneven head gives its cut to the engine; a pipeline cut otherwise is refused with the flag to use."""
    staged = StagedModel(tiny_model("llama", layers=7), boundaries=[0, 2, 4, 6, 7])
    head = new_head(staged, DistillConfig(n_stages=4, boundaries=[0, 2, 4, 6, 7]))
    head.save_pretrained(tmp_path / "head")
    staged.model.save_pretrained(tmp_path / "target")
    assert pipeline_cut(None, None, str(tmp_path / "head")) == (None, [0, 2, 4, 6, 7])
    assert pipeline_cut(4, None, str(tmp_path / "head")) == (None, [0, 2, 4, 6, 7])
    assert pipeline_cut(None, [3, 5], str(tmp_path / "head")) == (None, [3, 5])
    assert pipeline_cut(None, None) == (1, None)
    assert pipeline_cut(None, None, str(tmp_path / "head"), target=str(tmp_path / "target")) == (None, [0, 2, 4, 6, 7])
    tiny_model("llama", layers=3).save_pretrained(tmp_path / "shallow")
    with pytest.raises(
        SpdInputError, match="does not fit this target: it was trained for a target of 7 layers, and this one has 3"
    ):
        pipeline_cut(None, None, str(tmp_path / "head"), target=str(tmp_path / "shallow"))
    engine = Engine.from_pretrained(str(tmp_path / "target"), speculator=str(tmp_path / "head"))
    assert engine.staged.boundaries == [0, 2, 4, 6, 7]
    with pytest.raises(SpdInputError, match=r"boundaries=\[2, 4, 6\]"):
        Engine.from_pretrained(str(tmp_path / "target"), speculator=str(tmp_path / "head"), boundaries=[0, 1, 2, 3, 7])


@pytest.mark.slow
def test_cli_and_bench_take_boundaries(tmp_path):
    """spd-generate --boundaries and --stages, and bench pp:B1,B2,... run the uneven cut; the head's cut is the
    default, and another cut asked for with the head is one error line."""
    staged = StagedModel(tiny_model("llama", layers=7), boundaries=[0, 2, 4, 6, 7])
    head = new_head(staged, DistillConfig(n_stages=4, boundaries=[0, 2, 4, 6, 7]))
    head.save_pretrained(tmp_path / "head")
    staged.model.save_pretrained(tmp_path / "target")
    target, ids = str(tmp_path / "target"), "5,17,3,99"
    common = ["--target", target, "--prompt-ids", ids, "--max-new-tokens", "12", "--json"]
    ar = json.loads(run_script("spd/cli/generate.py", *common).stdout)
    pp = json.loads(run_script("spd/cli/generate.py", *common, "--mode", "pp", "--boundaries", "2,4,6").stdout)
    spd = json.loads(
        run_script("spd/cli/generate.py", *common, "--mode", "spd", "--speculator", str(tmp_path / "head")).stdout
    )
    assert pp["token_ids"] == spd["token_ids"] == ar["token_ids"]
    assert pp["stats"]["stages"] == spd["stats"]["stages"] == 4
    stages = json.loads(run_script("spd/cli/generate.py", *common, "--mode", "pp", "--stages", "4").stdout)
    assert stages["token_ids"] == ar["token_ids"] and stages["stats"]["stage_layers"] == [2, 2, 2, 1]
    bad = spd_generate_main(*common, "--mode", "spd", "--speculator", str(tmp_path / "head"), "--stages", "3")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: the speculator does not fit this target: it was trained for n = 4 stages of 2, 2, 2, 1 layers "
        "(--boundaries 2,4,6) but --stages 3 asks for 3 stages of 3, 2, 2 layers; leave --stages and --boundaries "
        "out (the head's cut is the default) or use a head trained for that cut"
    ]


@pytest.mark.slow
def test_bench_uneven_pp(tiny_testbed, tmp_path):
    """bench pp:B1,B2 runs the standard pipeline over an uneven cut and matches ar."""
    out = tmp_path / "bench.json"
    run_bench(
        "decode",
        "--target",
        str(tiny_testbed / "target"),
        "--prompts",
        str(tiny_testbed / "prompts.jsonl"),
        "--num-prompts",
        "2",
        "--max-new-tokens",
        "8",
        "--run",
        "ar",
        "--run",
        "pp:3,5",
        "--run",
        "flags=--mode pp --boundaries 3,5",
        "--out",
        str(out),
    )
    results = json.loads(out.read_text())["results"]["T=0"]
    for row in (results["pp b=3,5"], results["flags"]):  # the short notation and spd-generate's flags
        assert row["boundaries"] == [0, 3, 5, 8] and row["stages"] == 3
        assert row["summary"]["identical_to_ar"] == 2


@pytest.mark.slow
def test_server_takes_boundaries(tiny_testbed):
    """spd-serve --boundaries serves the standard pipeline over an uneven cut, with ar's text."""
    from helpers.serve import PROMPT, Server, cli_json

    server = Server("--target", str(tiny_testbed / "target"), "--mode", "pp", "--boundaries", "3,5")
    try:
        expected = cli_json(tiny_testbed, "--mode", "ar", "--prompt", PROMPT, "--max-new-tokens", "20")
        out = server.client().completions.create(model=server.model, prompt=PROMPT, max_tokens=20, temperature=0)
        assert out.choices[0].text == expected["text"]
        assert out.model_extra["spd"]["stages"] == 3
    finally:
        server.stop()


@pytest.mark.slow
def test_distributed_runtime_takes_boundaries(tiny_testbed):
    """--runtime distributed over an uneven cut: each stage process loads its own layers; the tokens are ar's."""
    common = [
        "--target",
        str(tiny_testbed / "target"),
        "--prompt",
        "def main(argv):",
        "--max-new-tokens",
        "12",
        "--json",
    ]
    ar = json.loads(run_script("spd/cli/generate.py", *common).stdout)
    pp = json.loads(
        run_script(
            "spd/cli/generate.py", *common, "--mode", "pp", "--boundaries", "3,5", "--runtime", "distributed"
        ).stdout
    )
    assert pp["token_ids"] == ar["token_ids"] and pp["stats"]["stages"] == 3


def test_bench_run_specs():
    """Every run kind keeps its fields (the cut is the last field of a run)."""
    from spd.bench.decode import parse_run

    tree = parse_run("t=tree:runs/h:4:3:2")
    fields = (tree.source, tree.spec.stages, tree.spec.tree_width, tree.spec.tree_children, tree.spec.boundaries)
    assert fields == ("runs/h", 4, 3, 2, None)
    sd = parse_run("sd:runs/d:3")
    assert (sd.source, sd.spec.draft_steps, sd.spec.boundaries) == ("runs/d", 3, None)
    assert parse_run("pp:8,16,23").spec.boundaries == [0, 8, 16, 23]


def test_bench_runs_are_decoding_specs():
    """A --run is spd-generate's decoding settings: the short notation and the quoted flags give the same spec,
    checked by the same checks; a wrong flag is one error."""
    from spd.bench.decode import parse_run

    short = parse_run("t=tree:runs/d:4:3:2:top-k")
    flags = parse_run(
        "t=--mode tree --draft-model runs/d --stages 4 --tree-width 3 --tree-children 2 --tree-candidates top-k"
    )
    assert (short.name, short.spec) == (flags.name, flags.spec)
    assert parse_run("--mode pp --stages 2").name == "--mode pp --stages 2"
    assert parse_run("pp n=2=--mode pp --stages 2").name == parse_run("pp n=2=pp:2").name == "pp n=2"
    assert parse_run("--mode pp --boundaries 3,5").spec.boundaries == parse_run("pp:3,5").spec.boundaries[1:]
    for bad, says in [
        ("--mode spd", "--mode spd needs --speculator"),
        ("--mode pp --stages 0", "--run: argument --stages: expected a positive integer, got 0"),
        ("--mode ar --tree-wdth 2", "--run: unrecognized arguments: --tree-wdth 2"),
        ("--mode spd --speculator h --stages 4", "an spd run has its head's stages and cut"),
        ("--mode pp --target other", "--run: unrecognized arguments: --target other"),
    ]:
        with pytest.raises(SpdInputError, match=re.escape(says)):
            parse_run(bad)
