"""Token trees: tree bookkeeping, tree attention equals plain causal forwards, lossless verification."""

import math

import pytest
import torch

from conftest import tiny_model
from spd.decoding.tree import TokenTree
from spd.decoding.verify import verify_greedy, verify_sampled_deterministic, verify_sampled_recursive
from spd.target.kv_cache import StageKVCache
from spd.target.staging import SpdInputError, StagedModel

TOL = 2e-5
LOG = math.log


# ------------------------------------------------------------------------------------- bookkeeping
def _example_tree() -> TokenTree:
    """Root 10; level 1: 11, 12; level 2: 21, 22 (children of 11) and 23 (child of 12)."""
    tree = TokenTree(10)
    new = tree.append_level(torch.tensor([[11, 12, 13]]), torch.tensor([[LOG(0.5), LOG(0.3), LOG(0.2)]]), width=2)
    assert new.tolist() == [1, 2]
    # Cumulative probabilities: 11->21 .30, 11->22 .20, 12->23 .27, 12->24 .03; the best three are kept.
    new = tree.append_level(
        torch.tensor([[21, 22], [23, 24]]), torch.tensor([[LOG(0.6), LOG(0.4)], [LOG(0.9), LOG(0.1)]]), width=3
    )
    assert new.tolist() == [3, 4, 5]
    return tree


def test_append_level_keeps_the_best_cumulative_children_in_bfs_order():
    tree = _example_tree()
    assert len(tree) == 6 and tree.depth == 2
    assert tree.tokens_N.tolist() == [10, 11, 12, 21, 22, 23]
    assert tree.parents_N.tolist() == [-1, 0, 0, 1, 1, 2]
    assert tree.depths_N.tolist() == [0, 1, 1, 2, 2, 2]
    torch.testing.assert_close(tree.logprobs_N.exp(), torch.tensor([1, 0.5, 0.3, 0.6, 0.4, 0.9]))
    torch.testing.assert_close(tree.cum_logprobs_N.exp(), torch.tensor([1, 0.5, 0.3, 0.3, 0.2, 0.27]))
    assert tree.mask().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 1],
    ]
    assert tree.mask().dtype == torch.bool
    assert tree.positions(7).tolist() == [7, 8, 8, 9, 9, 9]
    assert tree.children(0).tolist() == [1, 2]
    assert tree.children(1).tolist() == [3, 4]
    assert tree.children(2).tolist() == [5]
    assert tree.children(4).tolist() == []
    assert tree.bottom_level().tolist() == [3, 4, 5]
    assert tree.path(5).tolist() == [10, 12, 23]
    assert tree.path(0).tolist() == [10]


def test_append_level_ties_and_order_are_deterministic():
    tree = TokenTree(1)
    tree.append_level(torch.tensor([[5, 6]]), torch.tensor([[LOG(0.5), LOG(0.5)]]), width=2)
    # All four candidates tie: the earlier parent wins, then the earlier candidate.
    tree.append_level(torch.tensor([[7, 8], [9, 10]]), torch.full((2, 2), LOG(0.5)), width=3)
    assert tree.tokens_N.tolist() == [1, 5, 6, 7, 8, 9]
    # Within a parent, children keep candidate order even when a later candidate is more likely;
    # -inf candidates are never kept, even when the width allows it.
    tree.append_level(
        torch.tensor([[20, 21], [22, 23], [24, 25]]),
        torch.tensor([[LOG(0.1), LOG(0.9)], [-math.inf, LOG(0.2)], [-math.inf, -math.inf]]),
        width=10,
    )
    assert tree.tokens_N[6:].tolist() == [20, 21, 23]
    assert tree.parents_N[6:].tolist() == [3, 3, 4]
    assert tree.bottom_level().tolist() == [6, 7, 8]


def test_append_level_keeps_the_sources_greedy_path():
    """A confident branch off the source's greedy path would push that path out of a beam ranked by cumulative
    log-prob alone; its best child stays (in place of the worst kept candidate), and after a prune that leaves the
    path, the path goes on from the best of the deepest kept nodes."""
    tree = TokenTree(0)
    tree.append_level(torch.tensor([[1, 2]]), torch.tensor([[-0.7, -0.75]]), 2)  # nodes 1 (greedy), 2
    assert tree.principal == 1
    # Node 1 is unsure of its children, node 2 sure of two: by score alone node 2's two children win both slots.
    new = tree.append_level(torch.tensor([[11, 12], [21, 22]]), torch.tensor([[-0.7, -0.8], [-0.01, -0.02]]), 2)
    assert tree.tokens_N[new].tolist() == [11, 21] and tree.principal == int(new[0])
    new = tree.append_level(torch.tensor([[111, 112], [211, 212]]), torch.tensor([[-0.5, -0.6], [-0.01, -0.02]]), 2)
    assert tree.tokens_N[new].tolist() == [111, 211]
    assert tree.path(tree.principal).tolist() == [0, 1, 11, 111]
    # A hit on node 2 leaves the greedy path: it goes on from the kept bottom node with the best score.
    tree.prune_to_child(2)
    assert tree.path(tree.principal).tolist() == [2, 21, 211]
    # A -inf best candidate (nothing to propose) forces nothing; W = 1 keeps the plain ranking.
    chain = TokenTree(5)
    for _ in range(3):
        chain.append_level(torch.tensor([[7, 8]]), torch.tensor([[-0.1, -0.2]]), 1)
    assert chain.tokens_N.tolist() == [5, 7, 7, 7] and chain.principal == 3


def test_prune_to_child_keeps_the_subtree_and_returns_old_indices():
    tree = _example_tree()
    kept = tree.prune_to_child(1)
    assert kept.tolist() == [1, 3, 4]
    assert tree.tokens_N.tolist() == [11, 21, 22]
    assert tree.parents_N.tolist() == [-1, 0, 0]
    assert tree.depths_N.tolist() == [0, 1, 1]
    torch.testing.assert_close(tree.logprobs_N.exp(), torch.tensor([1, 0.6, 0.4]))
    torch.testing.assert_close(tree.cum_logprobs_N.exp(), torch.tensor([1, 0.6, 0.4]))
    assert tree.mask().tolist() == [[1, 0, 0], [1, 1, 0], [1, 0, 1]]
    assert tree.positions(8).tolist() == [8, 9, 9]

    tree = _example_tree()
    assert tree.prune_to_child(2).tolist() == [2, 5]
    assert tree.tokens_N.tolist() == [12, 23] and tree.parents_N.tolist() == [-1, 0]
    assert tree.bottom_level().tolist() == [1]
    # The pruned tree keeps growing from its bottom level.
    assert tree.append_level(torch.tensor([[30, 31]]), torch.tensor([[LOG(0.5), LOG(0.5)]]), 2).tolist() == [2, 3]
    assert tree.path(3).tolist() == [12, 23, 31]

    tree = _example_tree()
    for bad in (0, 3, 6):  # the root, a grandchild, out of range
        with pytest.raises(SpdInputError, match="child of the root"):
            tree.prune_to_child(bad)
    tree.reset(42)
    assert len(tree) == 1 and tree.tokens_N.tolist() == [42] and tree.mask().tolist() == [[True]]


def test_append_level_rejects_wrong_shapes():
    tree = _example_tree()
    with pytest.raises(SpdInputError, match="bottom level"):
        tree.append_level(torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, 2), 2)
    with pytest.raises(SpdInputError, match="width"):
        tree.append_level(torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 2), 0)


def _check_invariants(tree: TokenTree) -> None:
    m = tree.mask()
    n = len(tree)
    assert m.shape == (n, n) and torch.equal(m, torch.tril(m)) and bool(m.diagonal().all())
    assert tree.parents_N[0] == -1 and tree.depths_N[0] == 0 and tree.cum_logprobs_N[0] == 0
    for i in range(1, n):
        parent = int(tree.parents_N[i])
        assert 0 <= parent < i
        expected = m[parent].clone()
        expected[i] = True
        assert torch.equal(m[i], expected)
        assert tree.depths_N[i] == tree.depths_N[parent] + 1 == int(m[i].sum()) - 1
        torch.testing.assert_close(tree.cum_logprobs_N[i], tree.cum_logprobs_N[parent] + tree.logprobs_N[i])
        assert torch.equal(tree.path(i), torch.cat([tree.path(parent), tree.tokens_N[i : i + 1]]))
    assert bool((tree.depths_N[1:] >= tree.depths_N[:-1]).all())  # BFS: levels are contiguous
    assert bool((tree.parents_N[2:] >= tree.parents_N[1:-1]).all())  # grouped by parent, parents in order


def test_random_grow_and_prune_keeps_the_invariants():
    gen = torch.Generator().manual_seed(0)
    tree = TokenTree(3)
    for step in range(30):
        level = tree.bottom_level().shape[0]
        tree.append_level(
            torch.randint(0, 50, (level, 3), generator=gen),
            torch.log_softmax(torch.randn(level, 3, generator=gen), -1),
            width=4,
        )
        _check_invariants(tree)
        if step % 2:
            children = tree.children(0)
            old_paths = {int(i): tree.path(int(i)) for i in range(len(tree))}
            kept = tree.prune_to_child(int(children[step % len(children)]))
            assert bool((kept[1:] > kept[:-1]).all())
            for new, old in enumerate(kept.tolist()):  # paths lose exactly the old root
                assert torch.equal(tree.path(new), old_paths[old][1:])
            _check_invariants(tree)


def _same_tree(fast: TokenTree, general: TokenTree) -> None:
    # What the step loop reads of a chain, from its lists (before any tensor is made from them below).
    n = len(general)
    assert len(fast) == n and [fast.token(i) for i in range(n)] == general.tokens_N.tolist()
    for start in range(n):
        assert fast.token_ids(start, n).tolist() == general.tokens_N[start:].tolist(), start
    for i in range(-1, n + 1):
        children_C, tokens = fast.child_tokens(i)
        assert torch.equal(children_C, general.children(i)), i
        assert tokens == general.child_tokens(i)[1] == general.tokens_N[general.children(i)].tolist(), i
    for name in ("tokens_N", "parents_N", "depths_N", "mask_NN"):
        assert torch.equal(getattr(fast, name), getattr(general, name)), name
    torch.testing.assert_close(fast.logprobs_N, general.logprobs_N, rtol=0, atol=0)
    torch.testing.assert_close(fast.cum_logprobs_N, general.cum_logprobs_N, rtol=0, atol=0)
    assert fast.principal == general.principal and fast.drafts.keys() == general.drafts.keys()
    assert fast.depth == int(general.depths_N[-1]) and torch.equal(fast.bottom_level(), general.bottom_level())
    for i in range(-1, len(general) + 1):
        assert torch.equal(fast.children(i), general.children(i)), i


@pytest.mark.parametrize("grow", ["append_child", "append_level", "append_children"])
def test_a_chain_grows_and_prunes_as_the_general_tree_does(grow):
    """A chain's fast path (shared depths, parents and mask; a prune that moves every node up by one) gives the
    same tree, step by step, as the general path, which a tree takes whenever it is not a chain."""
    gen = torch.Generator().manual_seed(1)
    fast, general = TokenTree(5), TokenTree(5)
    general._chain = False  # every operation on it goes the general way
    for step in range(40):
        token, logprob = int(torch.randint(0, 50, (1,), generator=gen)), -float(torch.rand(1, generator=gen))
        for tree in (fast, general):
            if grow == "append_child":
                new = tree.append_child(token, logprob)
            elif grow == "append_level":
                new = tree.append_level(torch.tensor([[token, token + 1]]), torch.tensor([[logprob, -9.0]]), 1)
            else:
                new = tree.append_children(torch.tensor([1]), torch.tensor([[token]]), torch.tensor([[logprob]]))
                tree.drafts[len(tree) - 2] = torch.tensor([float(step)])
            assert new.tolist() == [len(tree) - 1]
        general._chain = False
        assert fast.is_chain and len(fast) == fast.depth + 1
        _same_tree(fast, general)
        if step % 3 == 2 or len(fast) > 6:
            assert torch.equal(fast.prune_to_child(1), general.prune_to_child(1))
            general._chain = False
            _same_tree(fast, general)
            assert fast.is_chain
        if step % 11 == 10:
            fast.reset(token)
            general.reset(token)
            general._chain = False
    # A level of two nodes ends the chain; a prune back to one branch of single nodes makes it one again.
    fast.reset(7)
    fast.append_level(torch.tensor([[1, 2]]), torch.tensor([[-0.1, -0.2]]), 2)
    assert not fast.is_chain
    fast.append_level(torch.tensor([[3], [4]]), torch.tensor([[-0.1], [-0.2]]), 2)
    assert fast.prune_to_child(2).tolist() == [2, 4]
    assert fast.is_chain and fast.tokens_N.tolist() == [2, 4] and fast.depth == 1
    _check_invariants(fast)


def test_kv_cache_keep_compacts_rows_in_order():
    cache = StageKVCache([0, 1], kv_heads=1, head_dim=2, capacity=3)
    cache.reserve(9)
    rows = torch.arange(9.0)
    cache.update(rows[None, None, :, None].expand(1, 1, 9, 2), -rows[None, None, :, None].expand(1, 1, 9, 2), 0)
    cache.update(rows[None, None, :, None].expand(1, 1, 9, 2) + 100, rows[None, None, :, None].expand(1, 1, 9, 2), 1)
    cache.positions_C[:9] = torch.tensor([0, 1, 2, 3, 4, 4, 5, 5, 5])
    cache.advance(9)
    cache.keep(3, torch.tensor([1, 3, 4]))  # rows 4, 6, 7 move to 3, 4, 5
    assert cache.length == 6
    assert cache.keys_LBHkCDh[0, 0, 0, :6, 0].tolist() == [0, 1, 2, 4, 6, 7]
    assert cache.values_LBHkCDh[0, 0, 0, :6, 1].tolist() == [0, -1, -2, -4, -6, -7]
    assert cache.keys_LBHkCDh[1, 0, 0, :6, 0].tolist() == [100, 101, 102, 104, 106, 107]
    assert cache.positions_C[:6].tolist() == [0, 1, 2, 4, 5, 5]
    cache.keep(6, [])
    assert cache.length == 6
    with pytest.raises(ValueError, match="indices must lie"):
        cache.keep(3, [3])
    with pytest.raises(ValueError, match="outside"):
        cache.keep(7, [])
    cache.advance(2)  # rows 6 and 7 still hold 6 and 7 from the first fill; a prefix kept stays where it is
    cache.keep(4, [0, 1, 2])
    assert cache.length == 7 and cache.keys_LBHkCDh[0, 0, 0, :7, 0].tolist() == [0, 1, 2, 4, 6, 7, 6]
    assert cache.positions_C[:7].tolist() == [0, 1, 2, 4, 5, 5, 5]


# ---------------------------------------------------------------------------------- tree attention
def test_a_node_that_sees_every_row_needs_no_mask():
    """One tree node whose mask row is all True (a chain's node) gets no SDPA mask, as a chain token's call; any
    other node, a window, or the eager backend gets the full mask, its committed rows visible."""
    from spd.target.masks import tree_attention_mask

    q_pos_T, key_pos_K = torch.tensor([5]), torch.arange(6)
    chain_TN = torch.ones(1, 2, dtype=torch.bool)
    assert tree_attention_mask(q_pos_T, key_pos_K, chain_TN, None, "sdpa", torch.float32) is None
    sibling_TN = torch.tensor([[True, False]])
    assert tree_attention_mask(q_pos_T, key_pos_K, sibling_TN, None, "sdpa", torch.float32)[0, 0].tolist() == [
        [True, True, True, True, True, False]
    ]
    windowed = tree_attention_mask(q_pos_T, key_pos_K, chain_TN, 3, "sdpa", torch.float32)
    assert windowed[0, 0].tolist() == [[False, False, False, True, True, True]]
    eager = tree_attention_mask(q_pos_T, key_pos_K, chain_TN, None, "eager", torch.float32)
    assert eager.shape == (1, 1, 1, 6) and bool((eager == 0).all())


def _reference(model, sequences: list[list[int]]) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """One plain causal forward of right-padded sequences: (H^l at each last token for every l, logits there)."""
    width = max(len(ids) for ids in sequences)
    ids_BN = torch.tensor([ids + [2] * (width - len(ids)) for ids in sequences])  # causal: padding is never seen
    last_B = torch.tensor([len(ids) - 1 for ids in sequences])
    rows_B = torch.arange(len(sequences))
    with torch.no_grad():
        out = model(input_ids=ids_BN, output_hidden_states=True)
    return tuple(h[rows_B, last_B] for h in out.hidden_states), out.logits[rows_B, last_B]


def _random_level(tree: TokenTree, gen: torch.Generator, k: int = 2, width: int = 3) -> torch.Tensor:
    level = tree.bottom_level().shape[0]
    tokens = torch.randint(3, 128, (level, k), generator=gen)
    return tree.append_level(tokens, torch.log_softmax(torch.randn(level, k, generator=gen), -1), width)


@pytest.mark.parametrize(
    "family,attn,overrides",
    [
        ("llama", "sdpa", {}),
        ("qwen3", "sdpa", {}),
        ("llama", "eager", {}),
        ("mistral", "sdpa", {"sliding_window": 3}),  # deeper than the window: tree keys are windowed too
    ],
)
def test_whole_tree_through_the_stages_equals_plain_forwards(family, attn, overrides):
    model = tiny_model(family, attn=attn, **overrides)
    staged = StagedModel(model, 4)
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, 128, (7,), generator=gen).tolist()
    tree = TokenTree(prefix[-1])  # the root: the newest token, whose output the target has not produced
    for _ in range(4):
        _random_level(tree, gen)
    committed = len(prefix) - 1
    caches = staged.new_caches(capacity=4)
    with torch.no_grad():
        staged.forward_stages(torch.tensor([prefix[:-1]]), caches)
        hidden = staged.embed(tree.tokens_N[None])
        for s in range(4):
            hidden = staged.run_stage(
                s, hidden, caches[s], tree.positions(committed)[None], tree_mask_TN=tree.mask()
            ).hidden_BTD
        logits = staged.logits(hidden)[0]
    _, ref = _reference(model, [prefix[:-1] + tree.path(i).tolist() for i in range(len(tree))])
    torch.testing.assert_close(logits, ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@torch.no_grad()
def test_pipelined_tree_decoding_with_pruning_equals_plain_forwards(family):
    """The engine's flow: one tree level enters stage 0 per step while later stages run earlier levels;
    when the last stage finishes the root, the tree is pruned to a child (or reseeded on a miss) and
    every stage's KV, the mask and the in-flight activations are pruned with the same index set.
    Every stage's output for every node must equal a plain causal forward of committed tokens + its path."""
    model = tiny_model(family)
    n = 4
    staged = StagedModel(model, n)
    gen = torch.Generator().manual_seed(2)
    committed_ids = torch.randint(3, 128, (6,), generator=gen).tolist()
    caches = staged.new_caches(capacity=8)
    staged.forward_stages(torch.tensor([committed_ids]), caches)
    committed = len(committed_ids)
    tree = TokenTree(int(torch.randint(3, 128, (), generator=gen)))
    fresh = True  # the root still has to enter stage 0
    inflight: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * n  # stage s input: (node indices, H)
    verified = misses = 0
    outputs: list[tuple[list[int], int, torch.Tensor]] = []  # (committed + path, stage, output), checked last
    for _step in range(24):
        new = torch.tensor([0]) if fresh else _random_level(tree, gen)
        fresh = False
        inflight[0] = (new, staged.embed(tree.tokens_N[new][None]))
        root_done = False
        for s in reversed(range(n)):  # later stages first: each consumes what the previous one made last step
            if inflight[s] is None:
                continue
            idx, hidden = inflight[s]
            inflight[s] = None
            if idx.numel() == 0:
                continue
            a, b = int(idx[0]), int(idx[-1]) + 1
            assert idx.tolist() == list(range(a, b)) and caches[s].length == committed + a
            out = staged.run_stage(
                s, hidden, caches[s], tree.positions(committed)[a:b][None], tree_mask_TN=tree.mask()[a:b, :b]
            ).hidden_BTD
            outputs += [(committed_ids + tree.path(i).tolist(), s, out[0, j]) for j, i in enumerate(idx.tolist())]
            if s + 1 < n:
                inflight[s + 1] = (idx, out)
            else:
                root_done = int(idx[0]) == 0
        if not root_done:
            continue
        # Verification (decided by the test: pick a child, or a token outside the tree every 4th time).
        children = tree.children(0)
        committed_ids.append(int(tree.tokens_N[0]))
        verified += 1
        if verified % 4 == 0 or children.numel() == 0:
            staged.truncate(caches, committed + 1)
            committed += 1
            tree.reset(int(torch.randint(3, 128, (), generator=gen)))
            inflight = [None] * n
            fresh, misses = True, misses + 1
            continue
        kept = tree.prune_to_child(int(children[verified % children.numel()]))
        committed = staged.prune_tree(caches, committed, kept)
        for s, item in enumerate(inflight):
            if item is not None:
                idx, hidden = item
                sel = torch.isin(idx, kept)
                inflight[s] = (torch.searchsorted(kept, idx[sel]), hidden[:, sel])
    assert verified >= 12 and misses >= 3 and len(outputs) >= 60
    hidden_l, logits = _reference(model, [ids for ids, _, _ in outputs])
    for b, (_, s, got) in enumerate(outputs):
        if s + 1 < n:  # H^l of an intermediate stage (large activations: compare relatively too)
            torch.testing.assert_close(got, hidden_l[staged.boundaries[s + 1]][b], atol=TOL, rtol=1e-5)
        else:
            torch.testing.assert_close(staged.logits(got), logits[b], atol=TOL, rtol=0)


def test_tree_mask_errors_are_clear():
    staged = StagedModel(tiny_model("llama"), 2)
    caches = staged.new_caches()
    hidden = staged.embed(torch.tensor([[4, 5]]))
    with pytest.raises(SpdInputError, match="position_ids"):
        staged.run_stage(0, hidden, caches[0], tree_mask_TN=torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(SpdInputError, match="bool"):
        staged.run_stage(0, hidden, caches[0], torch.tensor([[0, 1]]), tree_mask_TN=torch.ones(2, 2))
    with pytest.raises(SpdInputError, match="shape"):
        staged.run_stage(0, hidden, caches[0], torch.tensor([[0, 1]]), tree_mask_TN=torch.ones(2, 3, dtype=torch.bool))
    assert caches[0].length == 0


# ------------------------------------------------------------------------------------ verification
def test_greedy_verification_accepts_the_argmax_child():
    logits = torch.tensor([0.1, 2.0, -1.0, 1.9])
    assert verify_greedy(logits, [3, 1, 0]) == (1, 1)
    assert verify_greedy(torch.softmax(logits, -1), torch.tensor([1])) == (0, 1)
    assert verify_greedy(logits, [3, 0]) == (None, 1)
    assert verify_greedy(logits, []) == (None, 1)


def _chi2_upper(dof: int, z: float = 4.0) -> float:
    # Wilson-Hilferty approximation of the chi-square quantile at z standard deviations (~3e-5 tail).
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def _chi2(tokens: list[int], p: torch.Tensor) -> float:
    """Pearson's statistic of the drawn tokens against ``p``; tokens with p = 0 must never appear."""
    counts = torch.bincount(torch.tensor(tokens), minlength=p.shape[0]).double()
    assert counts[p == 0].sum() == 0
    expected = p[p > 0].double() * len(tokens)
    return float(((counts[p > 0] - expected) ** 2 / expected).sum())


P = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.0, 0.10])  # a warped target distribution (one token cut)
Q = torch.tensor([0.30, 0.10, 0.25, 0.05, 0.10, 0.15, 0.05])  # the draft's distribution
DRAWS = 6000
CONTROL_DRAWS = 2000  # the wrong rules are far off: fewer draws show the statistic rejects them


def _independent_branches(p, cands, gen):
    """A wrong rule (what docs/method.md §6 warns against): each branch checked alone against the same p."""
    for i, x in enumerate(cands):
        if torch.rand((), generator=gen) < p[x]:
            return i, x
    return None, int(torch.multinomial(p, 1, generator=gen))


@pytest.mark.parametrize("cands", [[1, 3], [4, 3, 1], [3, 3, 1, 4], [5, 1, 2]])
def test_deterministic_candidates_verification_is_lossless(cands):
    gen = torch.Generator().manual_seed(3)
    tokens, accepted = [], 0
    for _ in range(DRAWS):
        index, token = verify_sampled_deterministic(P, cands, gen)
        assert index is None or cands[index] == token
        accepted += index is not None
        tokens.append(token)
    dof = int((P > 0).sum()) - 1
    assert _chi2(tokens, P) < _chi2_upper(dof)
    # Acceptance is what the rule promises: a candidate is output iff it was accepted (distinct candidates).
    hit = sum(float(P[x]) for x in set(cands))
    assert abs(accepted / DRAWS - hit) < 4 * math.sqrt(hit * (1 - hit) / DRAWS)
    # The statistic has the power to reject the wrong rule on the same number of draws.
    wrong = [_independent_branches(P, cands, gen)[1] for _ in range(CONTROL_DRAWS)]
    assert _chi2(wrong, P) > 3 * _chi2_upper(dof)


def _draw_without_replacement(q, k, gen):
    cands, qs, q_i = [], [], q.clone()
    for _ in range(k):
        q_i = q_i / q_i.sum()
        x = int(torch.multinomial(q_i, 1, generator=gen))
        cands.append(x)
        qs.append(q_i)
        q_i = q_i.clone()
        q_i[x] = 0
    return cands, qs


def _no_residual(p, cands, qs, gen):
    """A wrong rule: per-candidate min(1, p/q) acceptance against the unchanged p, final draw from p."""
    for i, x in enumerate(cands):
        if torch.rand((), generator=gen) * qs[i][x] < p[x]:
            return i, x
    return None, int(torch.multinomial(p, 1, generator=gen))


@pytest.mark.parametrize("k,replacement", [(1, True), (3, True), (3, False)])
def test_recursive_rejection_sampling_is_lossless(k, replacement):
    gen = torch.Generator().manual_seed(4)
    tokens, wrong = [], []
    for draw in range(DRAWS):
        if replacement:
            cands = torch.multinomial(Q, k, replacement=True, generator=gen).tolist()
            qs = Q if k == 1 else [Q] * k  # one shared q, or one per candidate
        else:
            cands, qs = _draw_without_replacement(Q, k, gen)
        index, token = verify_sampled_recursive(P, cands, qs, gen)
        assert index is None or cands[index] == token
        tokens.append(token)
        if draw < CONTROL_DRAWS:
            wrong.append(_no_residual(P, cands, [Q] * k if replacement else qs, gen)[1])
    dof = int((P > 0).sum()) - 1
    assert _chi2(tokens, P) < _chi2_upper(dof)
    assert _chi2(wrong, P) > 3 * _chi2_upper(dof)


def test_verification_is_reproducible_from_the_generator():
    runs = []
    for _ in range(2):
        gen = torch.Generator().manual_seed(5)
        runs.append(
            [verify_sampled_deterministic(P, [1, 3], gen) for _ in range(50)]
            + [verify_sampled_recursive(P, [0, 2], [Q, Q], gen) for _ in range(50)]
        )
    assert runs[0] == runs[1]
    with pytest.raises(SpdInputError, match="one draft distribution per candidate"):
        verify_sampled_recursive(P, [0, 2], [Q], torch.Generator())
