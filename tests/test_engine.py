"""The pipelined engine: lossless greedy decoding, flush/rollback corner cases, the head fed the right depths,
and lossless sampling (a chi-square test against the target's exact distribution)."""

import pytest
import torch

from conftest import tiny_model
from helpers.proposers import ScriptedEngine, ScriptedProposer
from helpers.stats import chi_square_p_value, sample_outcomes, sequence_probs
from spd.decoding.backend import LocalStages
from spd.decoding.engine import Engine
from spd.decoding.generation import generate_ar
from spd.decoding.sampling import SamplingParams
from spd.errors import SpdInputError
from spd.target.staging import StagedModel
from spd.training.distill import DistillConfig, new_head

VARIANTS = {"spd": "spd", "output": "output_state", "ppsd": "ppsd"}
PROMPTS = [[5, 17, 3, 99, 42, 8], [7], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], [64, 3]]


def _engine(family="llama", n=4, variant="spd", layers=8, seed=0, head_seed=1, **model_kw):
    staged = StagedModel(tiny_model(family, seed=seed, layers=layers, **model_kw), n)
    torch.manual_seed(head_seed)
    head = new_head(staged, DistillConfig(n_stages=n, variant=VARIANTS[variant]))
    return Engine.chain(staged, head.eval())


# ---------------------------------------------------------------------------------------- greedy


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_spd_equals_ar(n, variant):
    engine = _engine(n=n, variant=variant)
    for prompt in PROMPTS:
        ar = generate_ar(engine.staged, prompt, 40)
        spd = engine.run(prompt, 40, SamplingParams())
        pp = engine.run(prompt, 40, SamplingParams(), use_head=False)
        assert spd.token_ids == ar.token_ids
        assert pp.token_ids == ar.token_ids
        assert pp.stats.steps == n * pp.stats.decode_tokens  # one token in flight: K = n N
        s = spd.stats
        assert s.decode_tokens == len(ar.token_ids) - 1
        assert s.verified == s.accepted + s.flushes
        assert sum(s.verified_by_position) == s.verified and sum(s.accepted_by_position) == s.accepted


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_greedy_spd_equals_ar_other_families(family):
    engine = _engine(family=family, n=4)
    for prompt in PROMPTS[:2]:
        assert engine.run(prompt, 30, SamplingParams()).token_ids == generate_ar(engine.staged, prompt, 30).token_ids


def test_greedy_spd_equals_ar_on_the_testbed(tiny_testbed):
    staged_by_n = {n: StagedModel.from_pretrained(tiny_testbed / "target", n_stages=n) for n in (2, 4, 8)}
    from spd.target.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_testbed / "target")
    prompts = [tok(text)["input_ids"] for text in ("def main(argv):\n    ", "import os\n", "class A:\n    def")]
    for n, staged in staged_by_n.items():
        torch.manual_seed(n)
        engine = Engine.chain(staged, new_head(staged, DistillConfig(n_stages=n)).eval())
        for ids in prompts:
            assert engine.run(ids, 48, SamplingParams()).token_ids == generate_ar(staged, ids, 48).token_ids


# ------------------------------------------------------------------------------ flush corner cases


def _scripted(n, right, max_new=24, prompt=(5, 17, 3, 99), eos=None):
    engine = _engine(n=n)
    prompt = list(prompt)
    reference = generate_ar(engine.staged, prompt, max_new, eos_token_id=eos).token_ids
    scripted = ScriptedEngine(engine, reference, len(prompt), right)
    out = scripted.run(prompt, max_new, SamplingParams(), eos_token_id=eos)
    assert out.token_ids == reference
    # Every token after the first was proposed; it is an accepted speculation exactly where the script was right.
    expected = [False] + [bool(right(len(prompt) + i)) for i in range(1, len(reference))]
    assert out.stats.token_acceptance == expected
    assert sum(out.stats.token_acceptance) == out.stats.accepted
    return out.stats, reference


@pytest.mark.parametrize("n", [2, 4])
def test_every_proposal_right_fills_the_pipeline(n):
    stats, ref = _scripted(n, right=lambda pos: True)
    assert stats.flushes == 0
    assert stats.steps == stats.decode_tokens + n - 1  # warm-up once, then one token per step
    assert stats.equivalent_accept_length == pytest.approx(n * stats.decode_tokens / stats.steps)


@pytest.mark.parametrize("n", [2, 4])
def test_every_proposal_wrong_flushes_every_time(n):
    stats, ref = _scripted(n, right=lambda pos: False)  # consecutive flushes
    assert stats.flushes == stats.decode_tokens == stats.verified
    assert stats.steps == n * stats.decode_tokens  # as slow as the plain pipeline, never slower
    assert stats.verified_by_position[0] == stats.flushes  # every verified proposal is a first one


def test_rejection_at_the_first_speculated_token():
    prompt_len = 4
    stats, ref = _scripted(4, right=lambda pos: pos != prompt_len + 1)
    assert stats.flushes == 1
    assert stats.verified_by_position[0] == 2 and stats.accepted_by_position[0] == 1  # rejected, then the reseed's


def test_alternating_rejections():
    _scripted(4, right=lambda pos: pos % 3 != 0)
    _scripted(2, right=lambda pos: pos % 2 == 0)


def test_eos_inside_the_pipeline():
    engine = _engine(n=4)
    prompt = [5, 17, 3, 99]
    free = generate_ar(engine.staged, prompt, 24).token_ids
    eos = free[6]  # the 7th new token: several proposals are in flight behind it when it is committed
    stats, ref = _scripted(4, right=lambda pos: True, eos=eos)
    assert ref[-1] == eos and len(ref) == free.index(eos) + 1
    assert stats.stop_reason == "eos"


@pytest.mark.parametrize("max_new", [1, 2, 5, 7])
def test_max_new_tokens_reached_mid_pipeline(max_new):
    stats, ref = _scripted(4, right=lambda pos: True, max_new=max_new)
    assert len(ref) == max_new and stats.new_tokens == max_new and stats.stop_reason == "max_new_tokens"
    assert stats.steps == (0 if max_new == 1 else max_new - 1 + 3)


def test_prompt_of_length_one():
    _scripted(4, right=lambda pos: pos % 2 == 1, prompt=(7,))
    _scripted(2, right=lambda pos: False, prompt=(7,))


def test_context_full_stops_at_the_model_limit():
    engine = _engine(n=4)  # max_position_embeddings = 256
    prompt = [3 + i % 100 for i in range(250)]
    out = engine.run(prompt, 40, SamplingParams())
    assert out.token_ids == generate_ar(engine.staged, prompt, 40).token_ids
    assert len(out.token_ids) == 6 and out.stats.stop_reason == "context_full"


# ------------------------------------------------------------- the head sees the depths it trained on


class _CountingStages(LocalStages):
    """The single-process back-end, counting flushes and the prunes that move KV rows."""

    def __init__(self, staged):
        super().__init__(staged)
        self.flushes = self.moves = 0
        prune_tree = staged.prune_tree

        def counting_prune_tree(caches, committed, kept):
            self.moves += 1
            return prune_tree(caches, committed, kept)

        staged.prune_tree = counting_prune_tree

    def flush(self, length):
        self.flushes += 1
        super().flush(length)


def test_the_chain_moves_no_rows_and_pp_flushes_nothing():
    """The chain is the step loop at width 1: a hit leaves every stage's rows where they are (no prune, so remote
    stages get no notice), and the standard pipeline, which proposes nothing, never flushes."""
    base = _engine(n=4)
    reference = generate_ar(base.staged, [5, 17, 3, 99], 30).token_ids
    stages = _CountingStages(base.staged)
    engine = Engine.chain(base.staged, base.proposer.head, stages=stages)
    engine.proposer = ScriptedProposer(engine.proposer, reference, 4, lambda pos: pos % 5 != 0, base.staged.vocab_size)
    out = engine.run([5, 17, 3, 99], 30, SamplingParams())
    assert out.token_ids == reference and out.stats.accepted > 10
    assert stages.moves == 0 and stages.flushes == out.stats.flushes > 0
    pp = engine.run([5, 17, 3, 99], 30, SamplingParams(), use_head=False)
    assert pp.token_ids == reference and stages.flushes == out.stats.flushes


class RecordingEngine(Engine):
    """Records the head's log-probabilities with the tokens and positions of the path they were computed from and
    the fill (tokens in flight)."""

    def __init__(self, engine):
        super().__init__(engine.staged, engine.proposer)
        self.records = []
        inner, records = self.proposer, self.records

        class Recording:
            batches = False  # asked alone (a wrapper has no expand_many)

            def __getattr__(self, name):
                return getattr(inner, name)

            def expand(self, tree, context, levels):
                logprobs_LX = inner.expand(tree, context, levels)
                path = [(int(t), len(context) + i) for i, t in enumerate(tree.tokens_N.tolist())]  # a chain
                records.append((path, len(levels), logprobs_LX[0].clone()))
                return logprobs_LX

        self.proposer = Recording()


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("n", [2, 4])
def test_engine_proposals_equal_the_training_forward(variant, n):
    """Each proposal made from a correct context equals the training forward at that position and fill."""
    engine = RecordingEngine(_engine(n=n, variant=variant))
    prompt = [5, 17, 3, 99, 42, 8]
    out = engine.run(prompt, 30, SamplingParams())
    sequence = prompt + out.token_ids
    ids = torch.tensor([sequence])
    head = engine.proposer.head
    hidden = engine.staged.hidden_states(ids, sorted(set(head.needed_anchors())))
    checked = 0
    for inflight, fill, logits in engine.records:
        if any(sequence[pos] != tok for tok, pos in inflight):
            continue  # proposed behind a wrong speculative token: no training position to compare with
        t = inflight[-1][1]
        with torch.no_grad():
            ref = torch.log_softmax(
                head.vocab_logits(head.forward_train(hidden, torch.tensor([fill]))[0, t]).float(), -1
            )
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
        checked += 1
    assert checked >= 5


# -------------------------------------------------------------------------------------- sampling


# One layer a stage at n = 2 (each seed's run costs half): with injected faults (acceptance min(1, 1.2 p/q), a
# rejection's residual drawn from p without the rejected token) that target fails the test more surely than the
# 6-layer one did (p = 4e-4 and 1e-21, against 0.96 and 5e-3); at n = 3 the 6-layer target is kept (with 3 layers the
# first fault went unseen).
@pytest.mark.slow
@pytest.mark.parametrize(
    "n,params,layers",
    [
        (2, SamplingParams(temperature=1.0), 2),
        (3, SamplingParams(temperature=0.7, top_k=4, top_p=0.9), 6),
    ],
)
def test_sampled_spd_follows_the_target_distribution(n, params, layers):
    """3-token continuations from 2000 seeds vs the exact warped target distribution (chi-square, p > 1e-3)."""
    vocab, length, samples = 6, 3, 2000
    staged = StagedModel(
        tiny_model("llama", seed=3, layers=layers, vocab=vocab, bos_token_id=0, eos_token_id=None, pad_token_id=0), n
    )
    with torch.no_grad():
        staged.lm_head.weight.mul_(0.05)  # peaked but not degenerate next-token distributions
    torch.manual_seed(4)
    head = new_head(staged, DistillConfig(n_stages=n)).eval()
    with torch.no_grad():
        head.lm_head.weight.normal_(0, 0.5)  # a head whose q differs from p: many rejections and residual draws
    engine = Engine.chain(staged, head)
    prompt = [1, 4, 2]
    exact = sequence_probs(staged, prompt, params, length)
    counts, stats = sample_outcomes(engine, prompt, params, length, samples)
    flushes, verified = sum(s.flushes for s in stats), sum(s.verified for s in stats)
    assert 0.1 * verified < flushes < 0.9 * verified  # both verification outcomes are exercised
    assert chi_square_p_value(counts, exact, samples) > 1e-3


def test_sampling_is_reproducible_for_a_seed():
    engine = _engine(n=4)
    params = SamplingParams(temperature=1.0, top_k=20, seed=11)
    a = engine.run([5, 6, 7], 30, params).token_ids
    b = engine.run([5, 6, 7], 30, params).token_ids
    assert a == b


# ------------------------------------------------------------------------------------------ errors


def test_head_for_another_pipeline_is_refused():
    engine = _engine(n=4)
    with pytest.raises(
        SpdInputError,
        match=r"trained for n = 4 stages of 2, 2, 2, 2 layers \(--boundaries 2,4,6\) but the pipeline has 2 stages of 4, 4",
    ):
        Engine.chain(StagedModel(tiny_model("llama"), 2), engine.proposer.head)
    with pytest.raises(SpdInputError, match="hidden size"):
        Engine.chain(StagedModel(tiny_model("llama", hidden_size=32), 4), engine.proposer.head)
    with pytest.raises(SpdInputError, match="dtype|same"):
        Engine.chain(engine.staged, engine.proposer.head.to(torch.float64))


class IdStreamer:
    """The put/end protocol of transformers' streamers (``TextStreamer``): each token id as a tensor, then end."""

    def __init__(self):
        self.ids, self.ended = [], False

    def put(self, value: torch.Tensor) -> None:
        self.ids += value.tolist()

    def end(self) -> None:
        self.ended = True


def test_generate_api_modes_and_streamer():
    engine = _engine(n=2)
    seen = IdStreamer()
    out = engine.generate([5, 6, 7], max_new_tokens=12, streamer=seen)
    assert out.token_ids == seen.ids == generate_ar(engine.staged, [5, 6, 7], 12).token_ids and seen.ended
    assert out.stats.mode == "spd" and out.text is None  # no tokenizer: no text
    with pytest.raises(SpdInputError, match="streamer receives text, but this engine has no tokenizer"):
        engine.generate([5, 6, 7], max_new_tokens=12, streamer=print)
    assert engine.generate([5, 6, 7], max_new_tokens=12, mode="pp").stats.mode == "pp"
    assert engine.generate([5, 6, 7], max_new_tokens=12, mode="ar").token_ids == out.token_ids
    with pytest.raises(SpdInputError, match="unknown mode"):
        engine.generate([5], mode="tree")
    with pytest.raises(SpdInputError, match="tokenizer"):
        engine.generate("text prompt")
    stats = out.stats.as_dict()
    for key in (
        "stages",
        "steps",
        "accepted",
        "flushes",
        "acceptance_rate",
        "equivalent_accept_length",
        "theoretical_speedup",
    ):
        assert key in stats


def test_the_mode_asked_for_is_the_engine_s_default(tiny_testbed, tiny_heads):
    """Engine.from_pretrained and Engine.chain keep an explicit chain mode (pp with a head runs pp by default); spd
    without a head, or a draft model in a chain, is refused; a fixed width of one is a chain."""
    from spd.decoding.tree_width import FixedWidth

    target, head = str(tiny_testbed / "target"), str(tiny_heads[4])
    assert Engine.from_pretrained(target, head).mode == "spd"
    pp = Engine.from_pretrained(target, head, mode="pp")
    assert pp.mode == "pp" and pp.proposer is not None
    assert pp.generate([5, 6, 7], max_new_tokens=6).stats.mode == "pp"
    assert pp.generate([5, 6, 7], max_new_tokens=6, mode="spd").stats.mode == "spd"  # its head, asked for
    assert Engine.chain(pp.staged, pp.proposer.head, mode="pp").mode == "pp"
    for kwargs, message in (
        ({"mode": "spd"}, "mode 'spd' needs a speculation head"),
        ({"mode": "pp", "draft_model": str(tiny_testbed / "draft")}, "a draft model proposes in mode 'tree'"),
    ):
        with pytest.raises(SpdInputError, match=message):
            Engine.from_pretrained(target, **kwargs)
    with pytest.raises(SpdInputError, match="mode 'spd' needs a speculation head"):
        Engine(pp.staged, None, mode="spd")
    assert Engine(pp.staged, pp.proposer, FixedWidth(1, 1)).mode == "spd"


# ------------------------------------------------------------------------------ token acceptance


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_token_acceptance_flags_every_mode(variant, temperature):
    """One flag per new token, summing to ``accepted``; passed to ``on_token`` with its token; in ``as_dict``."""
    engine, prompt = _engine(n=4, variant=variant), [5, 17, 3, 99]
    if temperature == 0:  # the untrained head is never right: script it right at two positions in three
        engine = ScriptedEngine(
            engine, generate_ar(engine.staged, prompt, 30).token_ids, len(prompt), lambda pos: pos % 3 != 0
        )
    for mode in ("spd", "pp", "ar"):
        seen, streamed = [], IdStreamer()
        out = engine.generate(
            prompt,
            max_new_tokens=30,
            mode=mode,
            temperature=temperature,
            seed=3,
            eos_token_id=[],
            streamer=streamed,
            on_token=lambda token, accepted: seen.append((token, accepted)),  # noqa: B023 - on_token runs inside this generate call
        )
        flags = out.stats.token_acceptance
        assert len(flags) == out.stats.new_tokens == len(out.token_ids) == 30
        assert seen == list(zip(out.token_ids, flags)) and streamed.ids == out.token_ids
        assert out.stats.as_dict()["token_acceptance"] == flags
        assert flags[0] is False
        if mode == "spd":
            assert sum(flags) == out.stats.accepted > 0
        else:
            assert not any(flags)
