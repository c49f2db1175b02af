"""The one engine factory every caller uses: each mode gets its engine, and the engines it builds are lossless."""

import pytest

from conftest import tiny_model
from spd.decoding.engine import Engine
from spd.decoding.factory import build_engine
from spd.decoding.generation import generate_ar
from spd.decoding.sd import SpeculativeDecoder
from spd.decoding.spec import DecodingSpec
from spd.errors import SpdInputError
from spd.target.staging import StagedModel
from spd.training.distill import DistillConfig, new_head


@pytest.fixture(scope="module")
def staged():
    return StagedModel(tiny_model("llama", layers=4), n_stages=2)


def test_every_mode_gets_its_engine_and_stays_lossless(staged):
    head = new_head(staged, DistillConfig(n_stages=2)).eval()
    whole = StagedModel(staged.model, n_stages=1)  # serial drafting verifies on the whole target
    eagle = new_head(whole, DistillConfig(variant="eagle", draft_steps=3)).eval()
    prompt = [3, 17, 9, 41]
    ar = generate_ar(staged, prompt, 12).token_ids
    for spec, source, kind in [
        (DecodingSpec("ar"), None, Engine),
        (DecodingSpec("pp"), None, Engine),
        (DecodingSpec("spd"), head, Engine),
        (DecodingSpec("tree", tree_width=2, tree_children=2), head, Engine),
        (DecodingSpec("sd", draft_steps=3), eagle, SpeculativeDecoder),
    ]:
        engine = build_engine(spec, whole if spec.mode == "sd" else staged, source, None)
        assert isinstance(engine, kind), spec.mode
        assert engine.generate(prompt, 12, mode=spec.mode).token_ids == ar, spec.mode


def test_settings_come_from_any_object_with_the_flag_names():
    class Flags:
        mode, tree_width, tree_children, draft_steps, unrelated = "tree", "auto", 3, 5, "x"

    spec = DecodingSpec.of(Flags(), tree_max_width=6)
    assert (spec.mode, spec.tree_width, spec.tree_children, spec.draft_steps, spec.tree_max_width) == (
        "tree",
        "auto",
        3,
        5,
        6,
    )


def test_bad_modes_are_one_clear_error(staged):
    with pytest.raises(SpdInputError, match="'beam' is not a decoding mode; expected one of ar, pp, spd, tree, sd"):
        build_engine(DecodingSpec("beam"), staged, None, None)
    with pytest.raises(SpdInputError, match="--mode sd runs the whole target in one process"):
        build_engine(DecodingSpec("sd", draft_model="x"), staged, None, None, stages=object())


def test_head_is_the_speculator_flag_by_its_other_name():
    from spd.cli.generate import build_parser
    from spd.cli.serve import build_parser as serve_parser

    for parser in (build_parser(), serve_parser()):
        head = DecodingSpec.of(parser.parse_args(["--target", "t", "--head", "h"]))
        assert head.speculator == "h" and head.mode == "spd"
        assert head == DecodingSpec.of(parser.parse_args(["--target", "t", "--speculator", "h"]))


def test_the_flags_and_the_runtime_command_line_come_from_the_spec():
    """spd-generate and spd-serve take every field of DecodingSpec as a flag; the command line the distributed
    runtime gets (DecodingSpec.argv) parses back to the same settings; --mode defaults by the proposer given."""
    from dataclasses import fields

    from spd.cli.generate import RUNTIME_FLAGS, build_parser
    from spd.cli.run_pipeline import build_parser as runtime_parser
    from spd.cli.serve import build_parser as serve_parser

    names = {f.name for f in fields(DecodingSpec)}
    least = ["--target", "t"]  # the one flag without a default
    assert names <= set(vars(build_parser().parse_args(least))) and names <= set(vars(serve_parser().parse_args(least)))
    args = build_parser().parse_args(
        [
            *least,
            "--speculator",
            "h",
            "--boundaries",
            "2,4",
            "--tree-width",
            "auto",
            "--timeout-s",
            "9",
            "--dtype",
            "bfloat16",
            "--prompt",
            "x",
        ]
    )
    spec = DecodingSpec.of(args)
    assert (spec.mode, spec.boundaries, spec.tree_width, spec.timeout_s) == ("spd", [2, 4], "auto", 9.0)
    back = runtime_parser().parse_args(["--prompt", "x", *spec.argv(RUNTIME_FLAGS)])
    assert DecodingSpec.of(back, mode=spec.mode) == spec
    assert DecodingSpec().mode == "ar" and DecodingSpec(draft_model="d").mode == "tree"
    assert DecodingSpec(speculator="h", draft_model="d").mode == "spd"
    with pytest.raises(SpdInputError, match="--mode tree takes one proposer"):
        DecodingSpec("tree", speculator="h", draft_model="d").check()
    with pytest.raises(SpdInputError, match="--timeout-s must be a positive number of seconds, got nan"):
        DecodingSpec(timeout_s=float("nan")).check()


def test_the_sampling_flags_and_their_runtime_command_line_come_from_sampling_params():
    """spd-generate and run_pipeline take SamplingParams' fields as flags; the command line the distributed runtime
    gets (SamplingParams.argv) parses back to the same settings; a wrong value names its flag."""
    from spd.cli.generate import build_parser
    from spd.cli.run_pipeline import build_parser as runtime_parser
    from spd.decoding.sampling import SamplingParams

    flags = ["--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--seed", "-3"]
    sampling = SamplingParams.from_args(build_parser().parse_args(["--target", "t", *flags]))
    assert sampling == SamplingParams(0.8, 20, 0.9, -3)
    for settings in (sampling, SamplingParams()):
        back = runtime_parser().parse_args(["--target", "t", *settings.argv()])
        assert SamplingParams.from_args(back) == settings
    with pytest.raises(SpdInputError, match=r"^--top-k must be an integer >= 0 \(0: off\), got -3$"):
        SamplingParams.from_args(runtime_parser().parse_args(["--target", "t", "--top-k", "-3"]))
