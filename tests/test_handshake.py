"""The job identity every rank shows the others before the first request (spd/runtime/handshake.py)."""

import shutil

import pytest
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from spd.runtime.handshake import mismatch, runtime_settings, target_fingerprint
from spd.runtime.loading import Checkpoint
from spd.runtime.protocol import RuntimeConfig


def _identity(**changes):
    identity = {
        "spd": "0.1.0",
        "torch": "2.13.0",
        "target": "abc",
        "source": "/m/target",
        "cut": [0, 4, 8],
        "dtype": "float32",
        "runtime": {"backend": "gloo", "early_launch": False, "emulate_stage_ms": 0.0, "emulate_link_ms": 0.0},
    }
    return {**identity, **changes}


def test_agreeing_ranks_pass():
    assert mismatch([_identity(), _identity(source="/elsewhere/target"), _identity()]) is None


@pytest.mark.parametrize(
    "change, words",
    [
        ({"spd": "0.2.0"}, "spd version: ranks 0, 1 have 0.1.0; rank 2 has 0.2.0"),
        (
            {"target": "def", "source": "/other"},
            "target (config and weights): ranks 0, 1 have '/m/target' (abc); rank 2 has '/other' (def)",
        ),
        ({"cut": [0, 3, 8]}, "pipeline cut: ranks 0, 1 have [0, 4, 8]; rank 2 has [0, 3, 8]"),
        ({"runtime": {**_identity()["runtime"], "early_launch": True}}, "runtime settings"),
    ],
)
def test_the_first_difference_is_named_with_its_ranks(change, words):
    problem = mismatch([_identity(), _identity(), _identity(**change)])
    assert problem.startswith("the ranks of this job disagree on the ") and words in problem
    assert "\n" not in problem


def test_a_setting_given_as_an_int_on_one_rank_and_a_float_on_another_agrees():
    """A Python caller's ``emulate_stage_ms=10`` meets the stage ranks' ``--emulate-stage-ms 10.0``."""
    given = _identity(runtime=runtime_settings(RuntimeConfig(emulate_stage_ms=10, emulate_token_ms=0.1)))
    parsed = _identity(runtime=runtime_settings(RuntimeConfig(emulate_stage_ms=10.0, emulate_token_ms=0.1)))
    assert mismatch([given, parsed]) is None
    other = _identity(runtime=runtime_settings(RuntimeConfig(emulate_stage_ms=11.0, emulate_token_ms=0.1)))
    assert "runtime settings" in mismatch([given, other])


def test_the_target_fingerprint_sees_weights_not_paths(tiny_testbed, tmp_path):
    source = tiny_testbed / "target"
    config = AutoConfig.from_pretrained(source)
    here = target_fingerprint(config, Checkpoint(str(source)))
    copy = tmp_path / "copy"
    shutil.copytree(source, copy)
    assert target_fingerprint(AutoConfig.from_pretrained(copy), Checkpoint(str(copy))) == here
    weights = load_file(copy / "model.safetensors")
    name = next(k for k in sorted(weights) if "layers.5." in k and k.endswith("weight"))
    weights[name].view(-1)[0] += 1.0  # another training of the same architecture
    save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
    assert target_fingerprint(AutoConfig.from_pretrained(copy), Checkpoint(str(copy))) != here
    assert len(here) == 12
