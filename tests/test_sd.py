"""--mode sd (serial speculative decoding on the whole target): greedy output equals AR for every m, sampled
output follows the target's distribution (chi-square, with a negative control), budgets and EOS inside an
iteration, acceptance statistics, and clear errors."""

import json

import pytest
import torch

from conftest import run_script, tiny_model
from spd.errors import SpdInputError
from spd.generation import generate_ar
from spd.sampling import SamplingParams
from spd.sd import SpeculativeDecoder
from spd.staging import StagedModel
from test_cli import spd_generate
from test_engine import _chi_square_p_value, _sample_outcomes, _sequence_probs
from test_tree_engine import _noisy_copy

PROMPTS = [[5, 17, 3, 99, 42, 8], [7], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]


@pytest.fixture(scope="module")
def target_model():
    return tiny_model("llama", seed=0, layers=4)


@pytest.mark.parametrize("m", [1, 3, 7])
@pytest.mark.parametrize("noise", [0.0, 0.5, 3.0])
def test_greedy_sd_equals_ar(target_model, m, noise):
    """A perfect draft (noise 0: every draft accepted, bonus tokens), a partial one and a bad one."""
    target = StagedModel(target_model, 1)
    sd = SpeculativeDecoder(target, StagedModel(_noisy_copy(target_model, noise), 1), m)
    for prompt in PROMPTS:
        out = sd.run(prompt, 30, SamplingParams())
        assert out.token_ids == generate_ar(target, prompt, 30).token_ids
        s = out.stats
        assert s.decode_tokens == 29 and sum(s.token_acceptance) == s.accepted
        assert s.accepted == sum(s.accepted_by_position) and sum(s.verified_by_position) <= s.drafted
        assert s.mean_acceptance_length == pytest.approx(29 / s.iterations)
        if noise == 0.0:
            assert s.accepted == s.drafted and s.iterations == -(-29 // (m + 1))  # only the last one is short


def test_greedy_sd_on_the_testbed(tiny_testbed):
    sd = SpeculativeDecoder.from_pretrained(str(tiny_testbed / "target"), str(tiny_testbed / "draft"), draft_steps=3)
    out = sd.generate("def main():\n", max_new_tokens=24)
    assert out.token_ids == sd.generate("def main():\n", max_new_tokens=24, mode="ar").token_ids
    s = out.stats.as_dict()
    assert s["mode"] == "sd" and s["draft_steps"] == 3 and s["iterations"] > 0
    assert s["theoretical_speedup"] == pytest.approx(
        s["mean_acceptance_length"] * s["target_layers"] / (s["draft_layers"] * 3 + s["target_layers"]), abs=1e-3)


@pytest.mark.parametrize("max_new", [1, 2, 4, 5, 9])
def test_budget_and_eos_inside_an_iteration(target_model, max_new):
    target = StagedModel(target_model, 1)
    sd = SpeculativeDecoder(target, StagedModel(target_model, 1), 4)  # every draft right
    prompt = [5, 17, 3]
    out = sd.run(prompt, max_new, SamplingParams())
    assert out.token_ids == generate_ar(target, prompt, max_new).token_ids and len(out.token_ids) == max_new
    free = generate_ar(target, prompt, 12).token_ids
    eos = free[6]
    out = sd.run(prompt, 12, SamplingParams(), eos_token_id=eos)
    assert out.token_ids == free[:free.index(eos) + 1] and out.stats.stop_reason == "eos"


def test_context_full(target_model):
    target = StagedModel(target_model, 1)  # max_position_embeddings = 256
    sd = SpeculativeDecoder(target, StagedModel(_noisy_copy(target_model, 0.5), 1), 7)
    prompt = [3 + i % 100 for i in range(250)]
    out = sd.run(prompt, 40, SamplingParams())
    assert out.token_ids == generate_ar(target, prompt, 40).token_ids
    assert len(out.token_ids) == 6 and out.stats.stop_reason == "context_full"


class NoResidual(SpeculativeDecoder):
    """Negative control: on a rejection the replacement is drawn from p instead of normalise(max(p - q, 0)) -
    the tokens q over-proposes come out too often; not lossless."""

    @staticmethod
    def _accept(p_V, token, q_V, generator):
        if float(torch.rand((), generator=generator, dtype=torch.float64)) * float(q_V[token]) < float(p_V[token]):
            return 0, token
        return None, int(torch.multinomial(p_V, 1, generator=generator))


@pytest.mark.parametrize("cls,params", [
    (SpeculativeDecoder, SamplingParams(temperature=1.0)),
    (SpeculativeDecoder, SamplingParams(temperature=0.7, top_k=4, top_p=0.9)),
    (NoResidual, SamplingParams(temperature=1.0)),
])
def test_sampled_sd_follows_the_target_distribution(cls, params):
    """3-token continuations from 800 seeds vs the exact warped target distribution (p > 1e-3; the control fails)."""
    vocab, length, samples = 6, 3, 800
    model = tiny_model("llama", seed=3, layers=2, vocab=vocab, bos_token_id=0, eos_token_id=None, pad_token_id=0)
    target = StagedModel(model, 1)
    sd = cls(target, StagedModel(_noisy_copy(model, 1.0), 1), 2)
    prompt = [1, 4, 2]
    counts, stats = _sample_outcomes(sd, prompt, params, length, samples)
    p_value = _chi_square_p_value(counts, _sequence_probs(target, prompt, params, length), samples)
    if cls is NoResidual:
        assert p_value < 1e-3
        return
    accepted, drafted = sum(s.accepted for s in stats), sum(s.drafted for s in stats)
    assert 0.1 * drafted < accepted < 0.9 * drafted  # acceptances and rejections both occur
    assert p_value > 1e-3


def test_sampling_is_reproducible_for_a_seed(target_model):
    sd = SpeculativeDecoder(StagedModel(target_model, 1), StagedModel(_noisy_copy(target_model, 0.5), 1), 3)
    params = SamplingParams(temperature=1.0, top_k=20, seed=11)
    assert sd.run([5, 6, 7], 30, params).token_ids == sd.run([5, 6, 7], 30, params).token_ids


def test_bad_input_is_refused(target_model):
    target = StagedModel(target_model, 1)
    with pytest.raises(SpdInputError, match="draft steps must be a positive integer"):
        SpeculativeDecoder(target, StagedModel(target_model, 1), 0)
    with pytest.raises(SpdInputError, match="draft model's vocabulary has 64 tokens but the target's has 128"):
        SpeculativeDecoder(target, StagedModel(tiny_model("llama", layers=2, vocab=64), 1), 2)
    sd = SpeculativeDecoder(target, StagedModel(target_model, 1), 2)
    with pytest.raises(SpdInputError, match="unknown mode 'tree'"):
        sd.generate([5], mode="tree")


def test_cli_and_bench(tiny_testbed, tmp_path):
    common = ["--target", str(tiny_testbed / "target"), "--prompt", "class A:\n", "--max-new-tokens", "16", "--json"]
    sd = spd_generate(*common, "--mode", "sd", "--draft-model", str(tiny_testbed / "draft"), "--draft-steps", "3")
    assert sd.returncode == 0, sd.stderr
    got = json.loads(sd.stdout)
    assert got["token_ids"] == json.loads(spd_generate(*common).stdout)["token_ids"]
    assert got["stats"]["mode"] == "sd" and got["stats"]["draft_steps"] == 3
    for args, expected in ((["--mode", "sd"], "--mode sd needs --draft-model"),
                           (["--mode", "sd", "--draft-model", str(tiny_testbed / "draft"), "--stages", "2"],
                            "--stages must be 1"),
                           (["--mode", "sd", "--draft-model", str(tiny_testbed / "draft"), "--draft-steps", "0"],
                            "--draft-steps: expected a positive integer")):
        bad = spd_generate(*common, *args)
        lines = bad.stderr.strip().splitlines()
        assert bad.returncode == 2 and len(lines) == 1 and expected in lines[0], bad.stderr
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "import os\n"}) + "\n" + json.dumps({"prompt": "def f(x):\n"}) + "\n")
    out = tmp_path / "bench.json"
    run_script("infer/bench.py", "--target", str(tiny_testbed / "target"), "--prompts", str(prompts), "--run",
               f"sd3=sd:{tiny_testbed / 'draft'}:3", "--temperatures", "0", "1", "--max-new-tokens", "12",
               "--out", str(out))
    results = json.loads(out.read_text())["results"]
    greedy = results["T=0"]["sd3"]["summary"]
    assert greedy["identical_to_ar"] == 2 and greedy["L_acc"] >= 1.0 and len(greedy["acceptance_by_position"]) == 3
    assert results["T=1"]["sd3"]["summary"]["theoretical_speedup"] > 0
