"""The pipelined token-tree engine: greedy output equals AR (testbed draft, tiny models, SPD head), flush
corner cases with a scripted source, W = 1 degenerates to the chain engine, lossless sampling (chi-square
against the target's exact distribution), and clear errors."""

import copy

import pytest
import torch

from conftest import tiny_model
from helpers.proposers import ScriptedSource, noisy_copy
from spd.decoding.engine import Engine
from spd.decoding.generation import generate_ar
from spd.decoding.proposers import DraftModelProposer, HeadProposer, Proposer, SpdHeadProposer
from spd.decoding.sampling import SamplingParams
from spd.errors import SpdInputError
from spd.target.staging import StagedModel
from spd.target.tokenizer import load_tokenizer
from spd.training.distill import DistillConfig, new_head

PROMPTS = [[5, 17, 3, 99, 42, 8], [7], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]


@pytest.fixture(scope="module")
def target_model():
    return tiny_model("llama", seed=0, layers=8)


def _draft_engine(target_model, n, width, children, draft_model=None, noise=0.3):
    staged = StagedModel(target_model, n)
    draft = StagedModel(draft_model if draft_model is not None else noisy_copy(target_model, noise), 1)
    return Engine.tree(staged, DraftModelProposer(draft, staged, children), width)


def _scripted(target_model, n, right, width=1, children=1, max_new=24, prompt=(5, 17, 3, 99), eos=None, rank=0):
    engine = _draft_engine(target_model, n, width, children)
    prompt = list(prompt)
    reference = generate_ar(engine.staged, prompt, max_new, eos_token_id=eos).token_ids
    engine.proposer = ScriptedSource(engine.proposer, prompt + reference, right, rank)
    out = engine.run(prompt, max_new, SamplingParams(), eos_token_id=eos)
    assert out.token_ids == reference
    s = out.stats
    assert s.verified == s.accepted + s.flushes
    assert sum(s.verified_by_position) == s.verified and sum(s.accepted_by_position) == s.accepted
    # Every position after the first had candidates; its token is a tree hit exactly where the script was right.
    assert s.token_acceptance == [False] + [bool(right(len(prompt) + i)) for i in range(1, len(reference))]
    return s, reference


# ---------------------------------------------------------------------------------------- greedy


def test_greedy_tree_equals_ar_on_the_testbed(tiny_testbed):
    tok = load_tokenizer(tiny_testbed / "target")
    draft = StagedModel.from_pretrained(tiny_testbed / "draft", n_stages=1)
    prompts = [tok(text)["input_ids"] for text in ("def main(argv):\n    ", "import os\n", "class A:\n    def")]
    for n in (2, 4, 8):
        staged = StagedModel.from_pretrained(tiny_testbed / "target", n_stages=n)
        refs = [generate_ar(staged, ids, 20).token_ids for ids in prompts]
        for i, (width, children) in enumerate(((1, 1), (4, 1), (4, 4), (16, 4))):
            engine = Engine.tree(staged, DraftModelProposer(draft, staged, children, tok, tok), width)
            out = engine.run(prompts[i % 3], 20, SamplingParams())
            assert out.token_ids == refs[i % 3], (n, width, children)
            assert out.stats.max_tree_size <= 1 + n * width


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_greedy_tree_equals_ar_with_drafts_of_every_quality(target_model, n):
    """A perfect draft (only hits), a noisy one (hits, misses, prunes that leave the tree shallow), a random one."""
    perfect, noisy, random = target_model, noisy_copy(target_model, 0.5), tiny_model("llama", seed=5, layers=2)
    runs = [(perfect, 1, 1), (perfect, 16, 4), (noisy, 4, 4), (noisy, 16, 4), (random, 4, 4)]
    staged = StagedModel(target_model, n)
    refs = [generate_ar(staged, prompt, 24).token_ids for prompt in PROMPTS[:2]]
    for model, width, children in runs:
        engine = Engine.tree(staged, DraftModelProposer(StagedModel(model, 1), staged, children), width)
        for prompt, ref in zip(PROMPTS, refs):
            out = engine.run(prompt, 24, SamplingParams())
            assert out.token_ids == ref, (width, children)
            s = out.stats
            assert s.decode_tokens == len(ref) - 1 and s.verified == s.accepted + s.flushes
            if model is perfect:
                assert s.flushes == 0
            if model is perfect and width == 1:
                assert s.steps == s.decode_tokens + n - 1  # warm-up once, then one token per step
            if model is noisy:
                assert s.accepted > 0 and (n == 1 or s.flushes > 0)


@pytest.mark.parametrize("family,overrides", [("qwen3", {}), ("mistral", {"sliding_window": 4})])
def test_greedy_tree_equals_ar_other_families(family, overrides):
    model = tiny_model(family, **overrides)
    engine = Engine.tree(
        StagedModel(model, 4), DraftModelProposer(StagedModel(noisy_copy(model, 0.3), 1), StagedModel(model, 4), 4), 4
    )
    for prompt in PROMPTS[:2]:
        out = engine.run(prompt, 24, SamplingParams())
        assert out.token_ids == generate_ar(engine.staged, prompt, 24).token_ids
        assert out.stats.accepted > 0


class ConfidentDetours:
    """A source that is right but unsure on the reference path (the reference token best at -0.7, a wrong one at
    -0.75) and sure of two tokens everywhere off it: ranked by score alone, the detours push the right path out of
    the beam within a few levels."""

    batches = False  # asked alone (a wrapper has no expand_many)

    def __init__(self, inner, sequence):
        self.inner, self.sequence = inner, sequence

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def expand(self, tree, context, levels):
        logprobs_LX = torch.full_like(self.inner.expand(tree, context, levels), float("-inf"))
        committed = len(context)
        for row, node in enumerate(tree.bottom_level().tolist()):
            path = tree.path(node).tolist()
            position = committed + len(path)
            if self.sequence[committed:position] == path and position < len(self.sequence):
                good = self.sequence[position]
                logprobs_LX[row, good], logprobs_LX[row, (good + 1) % logprobs_LX.shape[1]] = -0.7, -0.75
            else:
                logprobs_LX[row, 3], logprobs_LX[row, 4] = -0.01, -0.02
        return logprobs_LX


@pytest.mark.parametrize("n", [4, 8])
def test_the_tree_keeps_its_sources_greedy_path(target_model, n):
    """With the greedy path kept, a W = 2 tree takes exactly the chain's steps (every proposal on the path is right);
    a beam ranked by score alone would lose the path under the detours and take more."""
    staged = StagedModel(target_model, n)
    prompt = [5, 17, 3, 99]
    reference = generate_ar(staged, prompt, 32).token_ids
    steps = {}
    for width in (1, 2):
        engine = _draft_engine(target_model, n, width, 2)
        engine.proposer = ConfidentDetours(engine.proposer, prompt + reference)
        out = engine.run(prompt, 32, SamplingParams())
        assert out.token_ids == reference and out.stats.flushes == 0
        steps[width] = out.stats.steps
    assert steps[2] == steps[1] == len(reference) - 1 + n - 1


def test_noisy_draft_gains_from_width(target_model):
    """Sanity of the statistics: more width, more hits; the accepted child is not always the first sibling."""
    by_width = {}
    for width in (1, 4):
        engine = _draft_engine(target_model, 4, width, 4, noise=0.5)
        stats = [engine.run(p, 30, SamplingParams()).stats for p in PROMPTS]
        by_width[width] = sum(s.accepted for s in stats) / sum(s.verified for s in stats)
        if width == 4:
            assert sum(sum(s.accepted_by_sibling[1:]) for s in stats) > 0
            d = stats[0].as_dict()
            for key in (
                "steps",
                "decode_tokens",
                "flushes",
                "equivalent_accept_length",
                "mean_tree_size",
                "max_tree_size",
                "accepted_by_sibling",
                "verified_by_position",
                "tokens_per_s",
                "width",
            ):
                assert key in d
            assert d["mode"] == "tree" and d["source"] == "draft" and d["children"] == 4
    assert by_width[4] > by_width[1]


# ------------------------------------------------------------------------- W = 1: the chain engine


@pytest.mark.parametrize("n", [2, 4])
def test_width_one_is_a_chain(target_model, n):
    """W = 1 (any K) keeps one node per level: the chain engine's step counts for all-right and all-wrong."""
    for children in (1, 4):
        stats, _ = _scripted(target_model, n, right=lambda pos: True, children=children)
        assert stats.flushes == 0 and stats.steps == stats.decode_tokens + n - 1
        assert stats.max_tree_size == n + 1
        stats, _ = _scripted(target_model, n, right=lambda pos: False, children=children)
        assert stats.flushes == stats.decode_tokens == stats.verified
        assert stats.steps == n * stats.decode_tokens  # as slow as the plain pipeline, never slower


class _Recorder:
    """Wraps a head's query to record every output (the proposals' inputs are the same iff the outputs are)."""

    def __init__(self, head):
        self.head, self.outputs = head, []
        self._query = head.query

    def __enter__(self):
        def query(*args, **kwargs):
            out = self._query(*args, **kwargs)
            self.outputs.append(out.clone())
            return out

        self.head.query = query
        return self

    def __exit__(self, *exc):
        del self.head.query


@pytest.mark.parametrize("n", [1, 2, 4])
def test_spd_head_width_one_reproduces_the_chain_engine(target_model, n):
    staged = StagedModel(target_model, n)
    torch.manual_seed(n)
    head = new_head(staged, DistillConfig(n_stages=n)).eval()
    chain = Engine.chain(staged, head)
    for children in (1, 4):
        tree = Engine.tree(staged, SpdHeadProposer(head, staged, children), 1)
        for prompt in PROMPTS:
            with _Recorder(head) as rec_chain:
                c = chain.run(prompt, 30, SamplingParams())
            with _Recorder(head) as rec_tree:
                t = tree.run(prompt, 30, SamplingParams())
            assert t.token_ids == c.token_ids
            for key in ("steps", "flushes", "accepted", "verified_by_position", "accepted_by_position"):
                assert getattr(t.stats, key) == getattr(c.stats, key), key
            assert len(rec_tree.outputs) == len(rec_chain.outputs) == c.stats.proposals
            for a, b in zip(rec_tree.outputs, rec_chain.outputs):
                torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


class CheckedHeadSource(SpdHeadProposer):
    """Checks every bottom node's candidates against a from-scratch query: the anchors of each path node come
    from a plain forward of ``committed + path``, at the depth the node's level has reached."""

    def __init__(self, head, staged, children):
        super().__init__(head, staged, children)
        self.staged, self.checked = staged, 0

    def expand(self, tree, context, levels):
        logprobs_LX = super().expand(tree, context, levels)
        head, cfg = self.head, self.head.config
        depths = [min(level.depth, cfg.max_depth) for level in levels]
        for row, node in enumerate(tree.bottom_level().tolist()):
            path = tree.path(node).tolist()
            assert len(path) == len(levels)
            hidden = self.staged.hidden_states(torch.tensor([context + path]), list(self.needed_anchors))
            at = [{a: h[:, len(context) + j] for a, h in hidden.items()} for j in range(len(path))]
            rows = [(d, head.features(d, at[j])) for j, d in enumerate(depths)]
            query = rows[-1][1] if depths[-1] == cfg.offset else head.features(cfg.offset, at[-1])
            ref_V = torch.log_softmax(head.logits(head.query(self.cache, rows, query))[0], dim=-1)
            torch.testing.assert_close(ref_V, logprobs_LX[row], atol=1e-4, rtol=1e-4)
            self.checked += 1
        return logprobs_LX


@pytest.mark.parametrize("n", [2, 4])
def test_spd_head_with_width_reads_the_right_states(target_model, n):
    """W = 4 with the head, hits forced on the reference path (prunes, shallow trees, misses): lossless, and
    every query equals the from-scratch one."""
    staged = StagedModel(target_model, n)
    torch.manual_seed(n)
    head = new_head(staged, DistillConfig(n_stages=n)).eval()
    prompt = [5, 17, 3, 99]
    reference = generate_ar(staged, prompt, 20).token_ids
    checked = CheckedHeadSource(head, staged, 4)
    engine = Engine.tree(staged, ScriptedSource(checked, prompt + reference, lambda pos: pos % 5 != 0, rank=1), 4)
    out = engine.run(prompt, 20, SamplingParams())
    assert out.token_ids == reference
    assert out.stats.accepted > 5 and out.stats.flushes > 0 and checked.checked > 20


# ------------------------------------------------------------------------------ flush corner cases


def test_miss_at_the_first_level(target_model):
    prompt_len = 4
    stats, _ = _scripted(target_model, 4, right=lambda pos: pos != prompt_len + 1, width=4, children=2)
    assert stats.flushes == 1
    assert stats.verified_by_position[0] == 2 and stats.accepted_by_position[0] == 1  # missed, then the reseed's


@pytest.mark.parametrize("n,width", [(2, 1), (4, 4), (8, 16)])
def test_consecutive_and_alternating_misses(target_model, n, width):
    _scripted(target_model, n, right=lambda pos: pos % 3 != 0, width=width, children=4)
    _scripted(target_model, n, right=lambda pos: pos % 2 == 0, width=width, children=4)
    stats, _ = _scripted(target_model, n, right=lambda pos: False, width=width, children=4)
    assert stats.flushes == stats.decode_tokens and stats.steps == n * stats.decode_tokens


def test_accepted_child_is_a_later_sibling(target_model):
    stats, _ = _scripted(target_model, 4, right=lambda pos: True, width=4, children=4, rank=2)
    assert stats.flushes == 0 and stats.steps == stats.decode_tokens + 3
    assert stats.accepted_by_sibling[0] == 0 and sum(stats.accepted_by_sibling[1:]) == stats.accepted


def test_eos_inside_the_pipeline(target_model):
    prompt = [5, 17, 3, 99]
    free = generate_ar(StagedModel(target_model, 4), prompt, 24).token_ids
    eos = free[6]  # several levels are in flight behind it when it is committed
    stats, ref = _scripted(target_model, 4, right=lambda pos: True, width=4, children=4, eos=eos)
    assert ref[-1] == eos and len(ref) == free.index(eos) + 1
    assert stats.stop_reason == "eos"


@pytest.mark.parametrize("max_new", [1, 2, 5, 7])
def test_max_new_tokens_reached_mid_pipeline(target_model, max_new):
    stats, ref = _scripted(target_model, 4, right=lambda pos: True, width=4, children=4, max_new=max_new)
    assert len(ref) == max_new and stats.new_tokens == max_new and stats.stop_reason == "max_new_tokens"
    assert stats.steps == (0 if max_new == 1 else max_new - 1 + 3)


def test_prompt_of_length_one(target_model):
    _scripted(target_model, 4, right=lambda pos: pos % 2 == 1, width=4, children=4, prompt=(7,))
    _scripted(target_model, 2, right=lambda pos: False, width=16, children=4, prompt=(7,))


def test_context_full_stops_at_the_model_limit(target_model):
    engine = _draft_engine(target_model, 4, 4, 4, draft_model=target_model)  # max_position_embeddings = 256
    prompt = [3 + i % 100 for i in range(250)]
    out = engine.run(prompt, 40, SamplingParams())
    assert out.token_ids == generate_ar(engine.staged, prompt, 40).token_ids
    assert len(out.token_ids) == 6 and out.stats.stop_reason == "context_full"


# -------------------------------------------------------------------------------------- sampling


def test_sampling_is_reproducible_for_a_seed(target_model):
    engine = _draft_engine(target_model, 4, 4, 4)
    params = SamplingParams(temperature=1.0, top_k=20, seed=11)
    assert engine.run([5, 6, 7], 30, params).token_ids == engine.run([5, 6, 7], 30, params).token_ids


# ------------------------------------------------------------------------------------------ errors


def test_vocabulary_mismatch_is_refused(tiny_testbed, target_model):
    staged = StagedModel(target_model, 2)
    with pytest.raises(SpdInputError, match="draft model's vocabulary has 64 tokens but the target's has 128"):
        DraftModelProposer(StagedModel(tiny_model("llama", layers=2, vocab=64), 1), staged)
    tok = load_tokenizer(tiny_testbed / "target")
    other = copy.deepcopy(tok)
    other.add_tokens(["<|extra|>"])
    target = StagedModel.from_pretrained(tiny_testbed / "target", n_stages=2)
    draft = StagedModel.from_pretrained(tiny_testbed / "draft", n_stages=1)
    with pytest.raises(SpdInputError, match=r"draft model's tokenizer .* differs from the target's"):
        DraftModelProposer(draft, target, 4, tok, other)
    DraftModelProposer(draft, target, 4, tok, copy.deepcopy(tok))  # the same vocabulary is fine


def test_bad_settings_and_heads_are_refused(target_model):
    staged = StagedModel(target_model, 4)
    draft = StagedModel(target_model, 1)
    with pytest.raises(SpdInputError, match="tree width"):
        Engine.tree(staged, DraftModelProposer(draft, staged, 4), 0)
    with pytest.raises(SpdInputError, match="tree children"):
        DraftModelProposer(draft, staged, 0)
    for variant in ("output_state", "ppsd"):
        head = new_head(staged, DistillConfig(n_stages=4, variant=variant))
        with pytest.raises(SpdInputError, match="needs an SPD head"):
            SpdHeadProposer(head, staged)
    with pytest.raises(
        SpdInputError,
        match=r"trained for n = 4 stages of 2, 2, 2, 2 layers \(--boundaries 2,4,6\) but the pipeline has 2 stages of 4, 4",
    ):
        SpdHeadProposer(new_head(staged, DistillConfig(n_stages=4)), StagedModel(target_model, 2))
    for variant in ("output_state", "ppsd"):  # a chain only: through HeadProposer at width 1, refused wider
        head = new_head(staged, DistillConfig(n_stages=4, variant=variant))
        Engine.tree(staged, HeadProposer(head, staged, 1), 1)
        with pytest.raises(SpdInputError, match="no tree semantics"):
            Engine.tree(staged, HeadProposer(head, staged, 2), 2)


def test_every_token_source_is_a_proposer(target_model):
    staged = StagedModel(target_model, 4)
    head = new_head(staged, DistillConfig(n_stages=4)).eval()
    for source in (
        SpdHeadProposer(head, staged),
        HeadProposer(head, staged),
        DraftModelProposer(StagedModel(target_model, 1), staged),
    ):
        assert isinstance(source, Proposer), type(source).__name__


def test_from_pretrained_and_generate_api(tiny_testbed):
    engine = Engine.from_pretrained(
        str(tiny_testbed / "target"), draft_model=str(tiny_testbed / "draft"), n_stages=4, width=4, children=4
    )
    seen, pieces = [], []
    out = engine.generate(
        "def main():\n", max_new_tokens=12, streamer=pieces.append, on_token=lambda t, a: seen.append(t)
    )
    ar = engine.generate("def main():\n", max_new_tokens=12, mode="ar")
    assert out.token_ids == seen == ar.token_ids and out.stats.stages == 4
    assert "".join(pieces) == out.text == ar.text == engine.tokenizer.decode(ar.token_ids, skip_special_tokens=True)
    with pytest.raises(SpdInputError, match="unknown mode"):
        engine.generate([5], mode="spd")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_token_acceptance_flags(target_model, temperature):
    """One flag per new token (True: a tree hit), summing to ``accepted``, handed to ``on_token``; ar: all False."""
    engine = _draft_engine(target_model, 4, 4, 4)
    for mode in ("tree", "ar"):
        seen = []
        out = engine.generate(
            [5, 17, 3, 99],
            max_new_tokens=30,
            mode=mode,
            temperature=temperature,
            seed=2,
            eos_token_id=[],
            on_token=lambda token, accepted: seen.append((token, accepted)),  # noqa: B023 - on_token runs inside this generate call
        )
        flags = out.stats.token_acceptance
        assert len(flags) == out.stats.new_tokens == 30 and flags[0] is False
        assert seen == list(zip(out.token_ids, flags)) and out.stats.as_dict()["token_acceptance"] == flags
        if mode == "tree":
            assert sum(flags) == out.stats.accepted > 0
        else:
            assert not any(flags)
