"""Token trees at T > 0. Sampled children (drawn from the source's warped q without replacement, verified by
recursive rejection sampling) follow the target's distribution exactly - chi-square against the exact warped
target distribution, with the draft model and with an SPD head, at T = 1 and at T = 0.7 with top-k and top-p -
and rules that are not lossless fail the same test (negative controls). Also: the deterministic top-K rule at
T > 0, the draws themselves, the child counts, and the adaptive width."""

import pytest
import torch

from conftest import tiny_model
from helpers.proposers import IndependentBranches, noisy_copy
from helpers.stats import chi_square_p_value, sample_outcomes, sequence_probs
from spd.decoding.engine import Engine
from spd.decoding.generation import generate_ar
from spd.decoding.proposers import DraftModelProposer, SpdHeadProposer
from spd.decoding.sampling import SamplingParams
from spd.decoding.tree import TokenTree, grow_sampled, grow_top_k
from spd.decoding.tree_width import AdaptiveWidth, FixedWidth, parse_tree_width, tree_width
from spd.decoding.verify import verify_sampled_recursive
from spd.errors import SpdInputError
from spd.target.staging import StagedModel
from spd.training.distill import DistillConfig, new_head

T1 = SamplingParams(temperature=1.0)
T07 = SamplingParams(temperature=0.7, top_k=4, top_p=0.9)
VOCAB, LENGTH, SAMPLES, PROMPT = 6, 3, 800, [1, 4, 2]


# ------------------------------------------------------------------------------------ the draws


def _wide_tree(rows: int) -> TokenTree:
    """A root with ``rows`` equally likely children: a bottom level of ``rows`` nodes with equal scores."""
    tree = TokenTree(0)
    tree.append_level(torch.arange(rows)[None], torch.zeros(1, rows), rows)
    return tree


def _wide_trees(rows: int, per_tree: int = 1000):
    """``rows`` such nodes in wide trees of at most ``per_tree`` each (a tree's ancestor mask is dense: one tree
    of 20000 nodes with two children each would hold 3.6 GB of it)."""
    for start in range(0, rows, per_tree):
        yield _wide_tree(min(per_tree, rows - start))


@pytest.mark.slow
def test_children_are_drawn_in_order_without_replacement():
    """Over many nodes with one q: the ordered pair of children has P(x1) P(x2 | x1) = q1 q2 / (1 - q1)."""
    vocab, rows = 5, 20000
    q = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    gen = torch.Generator().manual_seed(0)
    first, second = [], []
    for tree in _wide_trees(rows):
        size = tree.bottom_level().numel()
        new = grow_sampled(tree, q.log().expand(size, -1), None, 2 * size, 2, T1, gen, vocab)
        assert new.numel() == 2 * size and bool((tree.parents_N[new[0::2]] == tree.parents_N[new[1::2]]).all())
        first += tree.tokens_N[new[0::2]].tolist()
        second += tree.tokens_N[new[1::2]].tolist()
        # The parent's q is kept for verification, over the target's vocabulary; edge log-probs are log q.
        torch.testing.assert_close(tree.drafts[int(tree.parents_N[new[0]])], q)
        torch.testing.assert_close(tree.logprobs_N[new], q.log()[tree.tokens_N[new]])
    assert len(first) == rows and all(a != b for a, b in zip(first, second))
    counts = {}
    for pair in zip(first, second):
        counts[pair] = counts.get(pair, 0) + 1
    exact = {(a, b): float(q[a] * q[b] / (1 - q[a])) for a in range(vocab) for b in range(vocab) if a != b}
    assert chi_square_p_value(counts, exact, rows) > 1e-3


def test_child_counts_never_depend_on_the_draws():
    """Every branch keeps one child while slots last, the rest go to the best expected scores; counts never
    exceed q's support; a draft vocabulary maps drawn outputs to target ids with q scattered into the target
    vocabulary."""
    tree = TokenTree(0)
    tree.append_level(torch.tensor([[3, 4]]), torch.tensor([[-0.1, -2.0]]), 2)  # two nodes, unequal scores
    logprobs = torch.log(torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.97, 0.01, 0.01, 0.01]]))
    assert tree.child_counts(torch.topk(logprobs, 3).values, 4).tolist() == [3, 1]
    assert tree.child_counts(torch.topk(logprobs, 3).values, 1).tolist() == [1, 0]  # the better branch first
    # Ranking every candidate by score would give node 1 all four slots and end node 2's branch; not here.
    flat = torch.log(torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.25, 0.25, 0.25, 0.25]]))
    starved = TokenTree(0)
    starved.append_level(torch.tensor([[3, 4]]), torch.tensor([[-0.1, -5.0]]), 2)
    assert starved.child_counts(flat, 4).tolist() == [3, 1]
    assert starved.child_counts(flat, 8).tolist() == [4, 4]
    for seed in range(20):
        t = TokenTree(0)
        t.append_level(torch.tensor([[3, 4]]), torch.tensor([[-0.1, -2.0]]), 2)
        new = grow_sampled(t, logprobs, None, 4, 3, T1, torch.Generator().manual_seed(seed), 4)
        assert t.parents_N[new].tolist() == [1, 1, 1, 2]  # the same counts whatever was drawn
        assert sorted(t.tokens_N[new[:3]].tolist()) == [0, 1, 2]  # node 1's support is 3 tokens: all drawn
    t = TokenTree(0)
    ids = torch.tensor([7, 9, 11, 12])  # a draft vocabulary of 4 target ids, target vocabulary 16
    new = grow_sampled(t, logprobs[:1], ids, 3, 3, T1, torch.Generator().manual_seed(1), 16)
    assert set(t.tokens_N[new].tolist()) == {7, 9, 11}
    q_V = t.drafts[0]
    assert q_V.shape == (16,) and float(q_V[[7, 9, 11]].sum()) == pytest.approx(1.0) and float(q_V[12]) == 0.0


def _rule_outcomes(p, q, trials, without_replacement):
    """Tokens output by recursive rejection sampling over 3 children drawn without replacement from q."""
    gen = torch.Generator().manual_seed(0)
    counts = {}
    for tree in _wide_trees(trials):
        size = tree.bottom_level().numel()
        new = grow_sampled(tree, q.log().expand(size, -1), None, 3 * size, 3, T1, gen, q.numel())
        for cands in tree.tokens_N[new].view(size, 3).tolist():
            _, token = verify_sampled_recursive(p, cands, q, gen, without_replacement=without_replacement)
            counts[(token,)] = counts.get((token,), 0) + 1
    assert sum(counts.values()) == trials
    return counts


@pytest.mark.slow
def test_recursive_rejection_without_replacement_is_exact_and_the_iid_rule_is_not():
    vocab, trials = 12, 12000
    gen = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(vocab, generator=gen), -1)
    q = torch.softmax(2 * torch.randn(vocab, generator=gen), -1)  # a draft quite unlike the target
    exact = {(t,): float(p[t]) for t in range(vocab)}
    assert chi_square_p_value(_rule_outcomes(p, q, trials, True), exact, trials) > 1e-3
    # Negative control: the same draws verified as if they were i.i.d. from q.
    assert chi_square_p_value(_rule_outcomes(p, q, trials, False), exact, trials) < 1e-6
    with pytest.raises(SpdInputError, match="one \\(V,\\) draft distribution"):
        verify_sampled_recursive(p, [1, 2], torch.stack([q, q]), gen, without_replacement=True)


# ------------------------------------------------------------------------------ whole engines


# One layer a stage (each seed's run costs about half what 6 layers cost): with injected faults (the i.i.d. rule on
# children drawn without replacement, a rejection's residual drawn from p without the rejected token, a top-k rule that
# keeps a rejected candidate's mass) every test below fails wherever it failed on the 6-layer target, its p-value
# below 1e-5; the adaptive width's test keeps the 6-layer target (no such fault moved its p-value below 1e-3 on either).
def _target(n: int, scale: float, layers: int | None = None) -> tuple[torch.nn.Module, StagedModel]:
    model = tiny_model(
        "llama", seed=3, layers=layers or n, vocab=VOCAB, bos_token_id=0, eos_token_id=None, pad_token_id=0
    )
    staged = StagedModel(model, n)
    with torch.no_grad():
        staged.lm_head.weight.mul_(scale)  # < 1: flatter next-token distributions (more outcomes above 5 counts)
    return model, staged


def _source(kind: str, model, staged, n: int, children: int):
    if kind == "draft":
        return DraftModelProposer(StagedModel(noisy_copy(model, 1.0), 1), staged, children)
    torch.manual_seed(4)
    head = new_head(staged, DistillConfig(n_stages=n)).eval()
    with torch.no_grad():
        head.lm_head.weight.normal_(0, 0.5)  # a head whose q differs from p: rejections, residual draws
    return SpdHeadProposer(head, staged, children)


def _chi_square(engine_cls, kind, n, params, scale, width=3, children=3):
    model, staged = _target(n, scale)
    engine = engine_cls.tree(staged, _source(kind, model, staged, n, children), width, candidates="sampled")
    counts, stats = sample_outcomes(engine, PROMPT, params, LENGTH, SAMPLES)
    return chi_square_p_value(counts, sequence_probs(staged, PROMPT, params, LENGTH), SAMPLES), stats


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["draft", "head"])
@pytest.mark.parametrize("n,params,scale", [(2, T1, 1.0), (3, T07, 0.2)])
def test_sampled_tree_follows_the_target_distribution(kind, n, params, scale):
    """3-token continuations from 800 seeds vs the exact warped target distribution (p > 1e-3)."""
    p_value, stats = _chi_square(Engine, kind, n, params, scale)
    assert all(s.candidates == "sampled" for s in stats)
    flushes, accepted = sum(s.flushes for s in stats), sum(s.accepted for s in stats)
    later_sibling = sum(sum(s.accepted_by_sibling[1:]) for s in stats)
    assert flushes > 20 and accepted > 20 and later_sibling > 20  # every verification outcome occurs
    assert p_value > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["draft", "head"])
def test_negative_control_fails_the_same_test(kind):
    """Checking each child on its own (IndependentBranches) over-samples the children: the test rejects it. (The
    i.i.d. rule applied to draws without replacement is the control of the rule's own test above.)"""
    p_value, _ = _chi_square(IndependentBranches, kind, 2, T1, 1.0)
    assert p_value < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("n,width,children,params", [(2, 3, 2, T1), (3, 2, 3, T07)])
def test_top_k_tree_follows_the_target_distribution(n, width, children, params):
    """The deterministic rule (--tree-candidates top-k) at T > 0: children are the source's top-K."""
    model, staged = _target(n, 0.2 if n == 2 else 0.05)
    engine = Engine.tree(staged, _source("draft", model, staged, n, children), width, candidates="top-k")
    counts, stats = sample_outcomes(engine, PROMPT, params, LENGTH, SAMPLES)
    flushes, verified = sum(s.flushes for s in stats), sum(s.verified for s in stats)
    later_sibling = sum(sum(s.accepted_by_sibling[1:]) for s in stats)
    assert 0.1 * verified < flushes < 0.9 * verified and later_sibling > 0  # every verification outcome occurs
    assert all(s.candidates == "top-k" for s in stats)
    assert chi_square_p_value(counts, sequence_probs(staged, PROMPT, params, LENGTH), SAMPLES) > 1e-3


@pytest.mark.slow
def test_adaptive_width_follows_the_target_distribution():
    """A width that changes after every verification (window 1) keeps sampled trees exact."""
    model, staged = _target(2, 0.2, layers=6)
    policy = AdaptiveWidth(max_width=4, children=3, window=1)
    engine = Engine.tree(staged, _source("draft", model, staged, 2, 3), policy)
    counts, stats = sample_outcomes(engine, PROMPT, T1, LENGTH, SAMPLES)
    assert len({s.mean_width for s in stats}) > 1  # the width did move
    assert chi_square_p_value(counts, sequence_probs(staged, PROMPT, T1, LENGTH), SAMPLES) > 1e-3


# ------------------------------------------------------------------------------ the rule per request


def test_the_rule_follows_the_request():
    """auto: top-K when greedy (output == ar), sampled at T > 0; a seed reproduces; bad names are refused."""
    model = tiny_model("llama", seed=0, layers=8)
    staged = StagedModel(model, 4)
    engine = Engine.tree(staged, DraftModelProposer(StagedModel(noisy_copy(model, 0.3), 1), staged, 4), 4)
    greedy = engine.run([5, 17, 3], 20, SamplingParams())
    assert greedy.stats.candidates == "top-k" and greedy.token_ids == generate_ar(staged, [5, 17, 3], 20).token_ids
    params = SamplingParams(temperature=1.0, top_k=20, seed=3)
    sampled = engine.run([5, 17, 3], 20, params)
    assert sampled.stats.candidates == "sampled" and sampled.token_ids == engine.run([5, 17, 3], 20, params).token_ids
    with pytest.raises(SpdInputError, match="unknown tree candidate rule 'random'"):
        Engine.tree(staged, engine.proposer, 4, candidates="random")


# ------------------------------------------------------------------------------------ width policy


def test_adaptive_width_policy():
    policy = AdaptiveWidth(max_width=8, children=4, window=4)
    assert policy.ladder == [1, 2, 4, 8] and (policy.width, policy.children) == (4, 4)
    for _ in range(8):
        policy.observe(0)  # every hit on the first child: the extra width never pays
    assert policy.width == 1 and policy.children == 1
    for _ in range(4):
        policy.observe(None)  # misses at W = 1: grow...
    assert policy.width == 1  # ...not yet: a shrink holds growth for a window
    for _ in range(4):
        policy.observe(None)
    assert policy.width == 2
    for _ in range(4):
        policy.observe(None)  # misses that the second child never caught: back to 1, and wait longer
    assert policy.width == 1 and policy._backoff == 2
    for _ in range(12):
        policy.observe(None)
    assert policy.width == 2
    for _ in range(16):
        policy.observe([None, 1][_ % 2])  # half misses, half won by a later sibling: the tree pays, grow
    assert policy.width == 8 and policy.children == 4
    policy.reset()
    assert policy.width == 4
    assert AdaptiveWidth(max_width=3).ladder == [1, 2, 3]


def test_tree_width_parsing():
    assert parse_tree_width("auto") == "auto" and parse_tree_width("4") == 4 and parse_tree_width(2) == 2
    for bad in ("0", "-1", "wide", "2.5"):
        with pytest.raises(SpdInputError, match="positive integer or 'auto'"):
            parse_tree_width(bad)
    assert isinstance(tree_width("auto", 4, 16), AdaptiveWidth) and tree_width("auto", 4, 16).max_width == 16
    assert isinstance(tree_width(3, 2), FixedWidth) and tree_width(3, 2).children == 2


def test_greedy_auto_width_equals_ar(tiny_testbed):
    target = StagedModel.from_pretrained(tiny_testbed / "target", n_stages=4)
    draft = StagedModel.from_pretrained(tiny_testbed / "draft", n_stages=1)
    engine = Engine.tree(target, DraftModelProposer(draft, target, 4), AdaptiveWidth(max_width=8, children=4, window=2))
    for prompt in ([5, 17, 3, 99], [7]):
        out = engine.run(prompt, 40, SamplingParams())
        assert out.token_ids == generate_ar(target, prompt, 40).token_ids
        assert out.stats.width == "auto" and 1 <= out.stats.mean_width <= 8


def test_top_k_growth_matches_append_level():
    tree, reference = TokenTree(0), TokenTree(0)
    logprobs = torch.log_softmax(torch.randn(1, 10, generator=torch.Generator().manual_seed(0)), -1)
    grow_top_k(tree, logprobs, None, 3, 4)
    top = torch.topk(logprobs, 4)
    reference.append_level(top.indices, top.values, 3)
    assert tree.tokens_N.tolist() == reference.tokens_N.tolist()
