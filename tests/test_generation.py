"""The AR baseline: greedy output equals ``model.generate``; sampling follows the warped distribution."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from conftest import tiny_model
from spd.decoding.generation import generate_ar
from spd.decoding.sampling import SamplingParams, select_token, warped_probs
from spd.target.staging import SpdInputError, StagedModel


def _hf_greedy(model, prompt, max_new_tokens, eos=None):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, eos_token_id=eos, pad_token_id=2
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("n_stages", [1, 2, 4])
def test_ar_greedy_equals_generate(family, n_stages):
    model = tiny_model(family, seed=n_stages)
    staged = StagedModel(model, n_stages)
    gen = torch.Generator().manual_seed(11)
    for length in (1, 5, 17):
        prompt = torch.randint(3, 128, (length,), generator=gen).tolist()
        ours = generate_ar(staged, prompt, 40).token_ids
        assert ours == _hf_greedy(model, prompt, 40)


def test_ar_greedy_equals_generate_on_the_testbed(tiny_testbed):
    model = AutoModelForCausalLM.from_pretrained(tiny_testbed / "target").eval()
    tok = AutoTokenizer.from_pretrained(tiny_testbed / "target")
    staged = StagedModel(model, 4)
    for text in ["import os\n", "def main(argv):\n    ", "class Foo(object):"]:
        prompt = tok(text)["input_ids"]
        out = generate_ar(staged, prompt, 48, eos_token_id=tok.eos_token_id)
        assert out.token_ids == _hf_greedy(model, prompt, 48, eos=tok.eos_token_id)
        assert out.stats.new_tokens == len(out.token_ids)


def test_stops_at_eos_and_reports_why():
    model = tiny_model("llama")
    staged = StagedModel(model, 2)
    prompt = [5, 6, 7]
    free = generate_ar(staged, prompt, 30).token_ids
    eos = free[4]  # pretend the fifth generated token is EOS
    out = generate_ar(staged, prompt, 30, eos_token_id=eos)
    assert out.token_ids == free[: free.index(eos) + 1]
    assert out.stats.stop_reason == "eos"
    assert generate_ar(staged, prompt, 3).stats.stop_reason == "max_new_tokens"


def test_stops_when_the_context_is_full():
    model = tiny_model("llama", max_position_embeddings=20)
    staged = StagedModel(model, 2)
    out = generate_ar(staged, list(range(3, 18)), 50)
    assert len(out.token_ids) == 5 and out.stats.stop_reason == "context_full"


def test_bad_requests_are_clear_errors():
    staged = StagedModel(tiny_model("llama", max_position_embeddings=20), 2)
    with pytest.raises(SpdInputError, match="empty"):
        generate_ar(staged, [], 5)
    with pytest.raises(SpdInputError, match="context"):
        generate_ar(staged, list(range(3, 23)), 5)
    with pytest.raises(SpdInputError, match="outside the vocabulary"):
        generate_ar(staged, [5, 999], 5)
    with pytest.raises(SpdInputError, match="max_new_tokens"):
        generate_ar(staged, [5], 0)


def test_streaming_callback_sees_every_token_in_order():
    staged = StagedModel(tiny_model("qwen3"), 2)
    seen = []
    out = generate_ar(staged, [4, 5, 6], 12, on_token=lambda token, accepted: seen.append((token, accepted)))
    assert seen == [(token, False) for token in out.token_ids]
    assert out.stats.token_acceptance == [False] * len(out.token_ids)  # AR speculates nothing


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    staged = StagedModel(tiny_model("llama"), 4)
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=123)
    a = generate_ar(staged, [5, 6], 30, params).token_ids
    b = generate_ar(staged, [5, 6], 30, params).token_ids
    c = generate_ar(staged, [5, 6], 30, SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=124)).token_ids
    assert a == b
    assert a != c


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 1.0), (0, 0.8), (7, 0.6), (0, 0.05)])
def test_warping_matches_transformers(top_k, top_p):
    logits = torch.randn(6, 64, generator=torch.Generator().manual_seed(3)) * 3
    params = SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p)
    expected = logits / 0.7
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1:
        expected = TopPLogitsWarper(top_p)(None, expected)
    torch.testing.assert_close(warped_probs(logits, params), torch.softmax(expected, -1), atol=1e-6, rtol=0)


def _chi2_upper(dof: int, z: float = 4.0) -> float:
    # Wilson-Hilferty approximation of the chi-square quantile at z standard deviations (~3e-5 tail).
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 8, 1.0), (1.0, 0, 0.9)])
def test_sampled_tokens_follow_the_warped_distribution(temperature, top_k, top_p):
    logits = torch.randn(16, generator=torch.Generator().manual_seed(5)) * 2
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=0)
    draws = 40000
    tokens = select_token(logits.expand(draws, -1), params, params.generator())
    counts = torch.bincount(tokens, minlength=16).double()
    probs = warped_probs(logits[None], params)[0].double()
    assert counts[probs == 0].sum() == 0  # nothing outside the top-k / top-p set is ever drawn
    support = probs > 0
    expected = probs[support] * draws
    chi2 = ((counts[support] - expected) ** 2 / expected).sum().item()
    assert chi2 < _chi2_upper(int(support.sum()) - 1)


def test_greedy_selection_is_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0], [5.0, 0.0, 4.9]])
    assert select_token(logits, SamplingParams(), None).tolist() == [1, 0]


def test_sampling_params_validation():
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError):
        SamplingParams(top_k=-2)
