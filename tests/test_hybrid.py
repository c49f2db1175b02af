"""Hybrid targets (linear-attention + full-attention layers: Qwen3.5, Qwen3-Next) in every pipelined path:
staging equals the full forward, the linear state rolls back exactly, ar/pp/spd equal ``model.generate``,
sampling follows the target's distribution, token trees carry per-node states, the distributed runtime (one request at
a time and batched) equals the single process. The in-process batched pipeline on hybrid targets:
tests/test_batch.py."""

import pytest
import torch

from conftest import tiny_model, tiny_multimodal
from helpers.equivalence import (
    PROMPT,
    check_ar_pp_spd_equal_generate,
    check_distributed_equals_single_process,
    generate_reference,
)
from helpers.proposers import ScriptedEngine
from helpers.stats import chi_square_p_value, sample_outcomes, sequence_probs
from spd.decoding.batch import BatchedPipeline
from spd.decoding.engine import Engine
from spd.decoding.generation import default_eos, generate_ar
from spd.decoding.proposers import DraftModelProposer, SpdHeadProposer
from spd.decoding.sampling import SamplingParams
from spd.target.linear_state import LinearStateRing
from spd.target.staging import StagedModel
from spd.training.distill import DistillConfig, new_head

HYBRIDS = ["qwen3_5", "qwen3_next"]
# Chunked (multi-token) and recurrent (one-token) kernels differ by rounding; logits here are O(5). Hugging
# Face's own cached forward differs from its uncached one by as much (4e-5 for Qwen3.5, 1e-3 for Qwen3-Next).
TOLS = {"qwen3_5": 2e-4, "qwen3_next": 3e-3}
TOL = TOLS["qwen3_5"]


def _linear_layers(staged):
    return [i for i, t in enumerate(staged.layer_types) if t == "linear_attention"]


# ------------------------------------------------------------------------------------------- staging


@pytest.mark.parametrize("family", HYBRIDS)
@pytest.mark.parametrize("n_stages", [1, 2, 4, 8])
def test_hybrid_stage_by_stage_equals_full_forward(family, n_stages):
    model, tol = tiny_model(family), TOLS[family]
    staged = StagedModel(model, n_stages)
    assert staged.is_hybrid and len(_linear_layers(staged)) == 6
    ids = torch.randint(3, 128, (1, 23), generator=torch.Generator().manual_seed(1))
    caches = staged.new_caches(capacity=4)
    with torch.no_grad():
        hidden = staged.embed(ids)
        for s in range(n_stages):
            hidden = staged.run_stage(s, hidden, caches[s]).hidden_BTD
        torch.testing.assert_close(staged.logits(hidden), model(input_ids=ids).logits, atol=tol, rtol=0)
        # Prefill, then chunks and single tokens through the stages: the linear state carries over.
        caches = staged.new_caches(capacity=4)
        pieces = [
            staged.logits(staged.forward_stages(ids[:, lo:hi], caches).hidden_BTD)
            for lo, hi in [(0, 7), (7, 8), (8, 12), (12, 13), (13, 23)]
        ]
        torch.testing.assert_close(torch.cat(pieces, 1), model(input_ids=ids).logits, atol=tol, rtol=0)
        # The training teacher pass reads anchors from linear and full layers alike.
        states = staged.hidden_states(ids, [0, 1, 4, 8])
        torch.testing.assert_close(staged.logits(states[8]), model(input_ids=ids).logits, atol=tol, rtol=0)


def test_multimodal_layout_stages_its_language_model(tmp_path):
    """The real Qwen3.5-4B/9B checkpoints are Qwen3_5ForConditionalGeneration; the text decoder is staged."""
    model = tiny_multimodal("qwen3_5")
    model.save_pretrained(tmp_path)
    ids = torch.randint(3, 128, (1, 15), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        for staged in (StagedModel(model, 4), StagedModel.from_pretrained(tmp_path, n_stages=4)):
            assert staged.num_layers == 8 and staged.is_hybrid
            out = staged.forward_stages(ids, staged.new_caches())
            torch.testing.assert_close(staged.logits(out.hidden_BTD), ref, atol=TOL, rtol=0)


def test_prefill_hands_the_whole_prompt_to_each_linear_layer():
    """Prefill is one chunked call per linear layer (linear in the prompt length), not a loop over tokens."""
    staged = StagedModel(tiny_model("qwen3_5"), 4)
    seen = []
    hooks = [
        staged.layers[i].linear_attn.register_forward_hook(
            lambda m, args, kw, out: seen.append(kw["hidden_states"].shape[1]), with_kwargs=True
        )
        for i in _linear_layers(staged)
    ]
    try:
        with torch.no_grad():
            staged.forward_stages(torch.arange(3, 103)[None], staged.new_caches())
    finally:
        for h in hooks:
            h.remove()
    assert seen == [100] * 6


# ------------------------------------------------------------------------------------------ rollback


@pytest.mark.parametrize("extra", [1, 3, 4])
def test_linear_state_rolls_back_to_the_committed_length(extra):
    model = tiny_model("qwen3_5")
    staged = StagedModel(model, 2)
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(input_ids=ids).logits[:, 10:]
        caches = staged.new_caches(rollback=4)
        staged.forward_stages(ids[:, :10], caches)
        for t in range(extra):  # speculated tokens that verification will reject
            staged.forward_stages(torch.tensor([[100 + t]]), caches)
        staged.truncate(caches, 10)
        got = torch.cat(
            [staged.logits(staged.forward_stages(ids[:, i : i + 1], caches).hidden_BTD) for i in range(10, 20)], 1
        )
    torch.testing.assert_close(got, ref, atol=TOL, rtol=0)


def test_rolling_back_further_than_the_ring_is_an_error():
    staged = StagedModel(tiny_model("qwen3_5"), 2)
    caches = staged.new_caches(rollback=2)
    with torch.no_grad():
        staged.forward_stages(torch.arange(3, 13)[None], caches)
        for t in range(3):
            staged.forward_stages(torch.tensor([[50 + t]]), caches)
    with pytest.raises(RuntimeError, match="ring keeps the last 3 lengths"):
        staged.truncate(caches, 10)
    staged.truncate(caches, 11)  # within the ring
    assert all(c.length == 11 for c in caches)


class _ForgetfulRing(LinearStateRing):
    """Negative control: a rollback that keeps the rejected tokens' linear state (as a KV-only crop would)."""

    def truncate(self, length):
        if length < self.length:
            self._held[length % self.depth] = length
            src, dst = (self.length % self.depth), (length % self.depth)
            for ring in self.conv_RBCK + self.recurrent_RBHDkDv:
                if ring is not None:
                    ring[dst].copy_(ring[src])
            self.length = length


# ----------------------------------------------------------------------------------- greedy decoding


@pytest.mark.slow
@pytest.mark.parametrize("family", HYBRIDS)
@pytest.mark.parametrize("n", [2, 4, 8])
def test_hybrid_ar_pp_spd_greedy_equal_generate(family, n):
    model = tiny_model(family)
    check_ar_pp_spd_equal_generate(model, n, PROMPT, generate_reference(model, PROMPT, 48))


def test_a_rollback_that_keeps_the_rejected_state_is_caught(monkeypatch):
    """The greedy test above fails if flushes do not restore the linear state (the test can fail)."""
    model = tiny_model("qwen3_5")
    reference = generate_reference(model, PROMPT, 48)
    staged = StagedModel(model, 4)
    torch.manual_seed(1)
    engine = Engine.chain(staged, new_head(staged, DistillConfig(n_stages=4)).eval())
    monkeypatch.setattr("spd.target.staging.LinearStateRing", _ForgetfulRing)
    scripted = ScriptedEngine(engine, reference, len(PROMPT), right=lambda pos: pos % 5 not in (0, 2))
    assert scripted.run(PROMPT, 48, SamplingParams()).token_ids != reference


# -------------------------------------------------------------------------------------------- sampling


@pytest.mark.slow
def test_sampled_spd_on_a_hybrid_target_follows_the_target_distribution():
    """3-token continuations from 2000 seeds vs the exact target distribution (chi-square, p > 1e-3)."""
    vocab, length, samples = 6, 3, 2000
    params = SamplingParams(temperature=0.8, top_k=5)
    staged = StagedModel(
        tiny_model("qwen3_5", seed=3, layers=4, vocab=vocab, bos_token_id=0, eos_token_id=None, pad_token_id=0), 2
    )
    with torch.no_grad():
        staged.lm_head.weight.mul_(0.05)
    torch.manual_seed(4)
    head = new_head(staged, DistillConfig(n_stages=2)).eval()
    with torch.no_grad():
        head.lm_head.weight.normal_(0, 0.5)
    engine = Engine.chain(staged, head)
    prompt = [1, 4, 2, 5, 3]
    exact = sequence_probs(staged, prompt, params, length)
    counts, stats = sample_outcomes(engine, prompt, params, length, samples)
    flushes, verified = sum(s.flushes for s in stats), sum(s.verified for s in stats)
    assert 0.1 * verified < flushes < 0.9 * verified
    assert chi_square_p_value(counts, exact, samples) > 1e-3


# ----------------------------------------------------------------------------------------- tree mode


def _run_tree_level(staged, caches, tree, committed, start, end):
    """Run tree nodes ``[start, end)`` through every stage (as the engine does level by level)."""
    hidden_1TD = staged.embed(tree.tokens_N[start:end][None])
    positions_1T = tree.positions(committed)[start:end][None]
    for s, cache in enumerate(caches):
        hidden_1TD = staged.run_stage(
            s, hidden_1TD, cache, positions_1T, tree_mask_TN=tree.mask()[start:end, :end]
        ).hidden_BTD
    return hidden_1TD[0]


def _path_hidden(model_staged, ids):
    """H^L of the last of ``ids`` run as a plain chain (prompt, then one token at a time: the decode kernels)."""
    caches = model_staged.new_caches(capacity=4)
    model_staged.forward_stages(torch.tensor([ids[:-1]]), caches)
    return model_staged.forward_stages(torch.tensor([ids[-1:]]), caches).hidden_BTD[0, -1]


@pytest.mark.parametrize("family", HYBRIDS)
def test_tree_nodes_carry_their_own_linear_state(family):
    """Every node of a tree run level by level (siblings as one batch, each from its parent's state) computes what
    the node's path run as a chain computes; after a prune the kept nodes keep their states and the root's state
    is committed; after a miss the root's state is the committed one."""
    from spd.decoding.tree import TokenTree

    staged, tol = StagedModel(tiny_model(family), 2), TOLS[family]
    prompt = PROMPT[:12]
    with torch.no_grad():
        caches = staged.new_caches(capacity=8)
        staged.forward_stages(torch.tensor([prompt]), caches)
        tree = TokenTree(7)
        tree.append_level(torch.tensor([[11, 12, 13]]), torch.zeros(1, 3), 3)  # nodes 1-3
        tree.append_level(torch.tensor([[21, 22], [31, 32], [41, 42]]), torch.zeros(3, 2), 5)  # nodes 4-8
        tree.append_level(torch.arange(50, 60).view(5, 2), torch.zeros(5, 2), 4)  # nodes 9-12
        levels = [(0, 1), (1, 4), (4, 9), (9, len(tree))]
        hidden = torch.cat([_run_tree_level(staged, caches, tree, len(prompt), a, b) for a, b in levels])
        for node in range(len(tree)):
            want = _path_hidden(staged, prompt + tree.path(node).tolist())
            torch.testing.assert_close(hidden[node], want, atol=tol, rtol=0)
        # Hit on node 2 (token 12): its subtree stays; a new level below it runs from the kept states.
        kept = tree.prune_to_child(2)
        StagedModel.prune_tree(caches, len(prompt), kept)
        committed = prompt + [7]
        assert all(c.linear is None or (c.linear.length, c.linear.nodes) == (13, len(tree)) for c in caches)
        start = len(tree)
        tree.append_level(torch.tensor([[61], [62]]), torch.zeros(2, 1), 2)
        new = _run_tree_level(staged, caches, tree, len(committed), start, len(tree))
        for row, node in enumerate(range(start, len(tree))):
            want = _path_hidden(staged, committed + tree.path(node).tolist())
            torch.testing.assert_close(new[row], want, atol=tol, rtol=0)
        # Miss: the root (token 12) is committed, the rest dropped; the next root runs from its state.
        StagedModel.truncate(caches, len(committed) + 1)
        committed = committed + [12]
        tree.reset(70)
        root = _run_tree_level(staged, caches, tree, len(committed), 0, 1)
        torch.testing.assert_close(root[0], _path_hidden(staged, committed + [70]), atol=tol, rtol=0)
        with pytest.raises(RuntimeError, match="only the root"):
            caches[0].linear.nodes = 3  # a cut inside a tree of three nodes has no single state
            caches[0].linear.truncate(caches[0].linear.length + 2)


@pytest.mark.slow
@pytest.mark.parametrize("family", HYBRIDS)
@pytest.mark.parametrize("n", [2, 4, 8])
def test_hybrid_tree_greedy_equals_generate(family, n):
    """Draft trees (the target itself: hits and prunes every step; a noisy copy: hits, misses, shallow prunes) and
    SPD-head trees (a random head scripted right and wrong at set positions, W = 1 and 4) equal model.generate."""
    from helpers.proposers import ScriptedSource, noisy_copy

    model = tiny_model(family)
    reference = generate_reference(model, PROMPT, 40)
    staged = StagedModel(model, n)
    torch.manual_seed(1)
    head = new_head(staged, DistillConfig(n_stages=n)).eval()
    noisy = StagedModel(noisy_copy(model, 0.5), 1)
    runs = [
        (DraftModelProposer(StagedModel(model, 1), staged, 4), 4, "perfect"),
        (DraftModelProposer(noisy, staged, 4), 4, "noisy"),
        (
            ScriptedSource(SpdHeadProposer(head, staged, 1), PROMPT + reference, lambda pos: pos % 5 not in (0, 2)),
            1,
            "scripted",
        ),
        (
            ScriptedSource(SpdHeadProposer(head, staged, 4), PROMPT + reference, lambda pos: pos % 4 != 1, rank=2),
            4,
            "scripted",
        ),
    ]
    for source, width, kind in runs:
        out = Engine.tree(staged, source, width).run(PROMPT, 40, SamplingParams())
        assert out.token_ids == reference, (kind, width)
        s = out.stats
        if kind == "perfect":
            assert s.flushes == 0 and s.accepted == len(reference) - 1
        else:
            assert s.accepted >= 8 and s.flushes >= 4, (kind, width, s.accepted, s.flushes)


@pytest.mark.slow
def test_sampled_tree_on_a_hybrid_target_follows_the_target_distribution():
    """Sampled children (W = 3, K = 2) from a noisy draft at T = 1 vs the exact target distribution (chi-square), and
    the independent-branches rule on the same target fails it (negative control)."""
    from helpers.proposers import IndependentBranches, noisy_copy

    vocab, length, samples = 6, 3, 800
    params = SamplingParams(temperature=1.0)
    model = tiny_model("qwen3_5", seed=3, layers=4, vocab=vocab, bos_token_id=0, eos_token_id=None, pad_token_id=0)
    staged = StagedModel(model, 2)
    with torch.no_grad():
        staged.lm_head.weight.mul_(0.3)
    draft = StagedModel(noisy_copy(model, 1.5), 1)
    prompt = [1, 4, 2]
    exact = sequence_probs(staged, prompt, params, length)
    counts, stats = sample_outcomes(
        Engine.tree(staged, DraftModelProposer(draft, staged, 2), 3), prompt, params, length, samples
    )
    assert sum(s.flushes for s in stats) > 0.1 * samples and sum(s.accepted for s in stats) > 0.1 * samples
    assert chi_square_p_value(counts, exact, samples) > 1e-3
    control, _ = sample_outcomes(
        IndependentBranches(staged, DraftModelProposer(draft, staged, 2), 3), prompt, params, length, samples
    )
    assert chi_square_p_value(control, exact, samples) < 1e-3


# ------------------------------------------------------------- distributed runtime and training (slow)


@pytest.fixture(scope="module")
def hybrid_target(tiny_testbed, tmp_path_factory):
    """A tiny random Qwen3.5 target with the miniature testbed's tokenizer (for text data and prompts)."""
    import shutil

    from spd.target.tokenizer import load_tokenizer

    out = tmp_path_factory.mktemp("hybrid-target")
    tok = load_tokenizer(tiny_testbed / "target")
    model = tiny_model("qwen3_5", vocab=len(tok), max_position_embeddings=512, eos_token_id=tok.eos_token_id)
    model.save_pretrained(out)
    for f in (tiny_testbed / "target").iterdir():
        if "token" in f.name or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
    return out


# Sampled, one request at a time with early launches, and batched (a world of 5 processes costs CI time on 2 cores).
# Greedy decoding over stage processes on a hybrid target: the draft tree's test below (tree prunes) and
# tests/test_authors.py::test_distributed_runtime_with_an_authors_head_on_a_hybrid_target (spd flushes, with each
# token's verification outcome).
@pytest.mark.slow
@pytest.mark.parametrize("temperature,early,max_batch", [(1.0, True, 0), (1.0, False, 3)])
def test_distributed_runtime_on_a_hybrid_target_equals_single_process(
    hybrid_target, tmp_path, temperature, early, max_batch
):
    """Stage processes keep their linear-state rings and the tree's per-node states; flushes roll them back exactly,
    prunes keep the surviving nodes' states. Batched (``--max-batch 3``): each stage keeps every request's own state
    beside the KV pool, and the ragged batches give the in-process batched pipeline's tokens."""
    check_distributed_equals_single_process(hybrid_target, tmp_path, temperature, early, max_batch)


@pytest.mark.slow
def test_distributed_draft_tree_on_a_hybrid_target_prunes_the_node_states(hybrid_target, tmp_path):
    """The target as its own draft model (W = 3): every step a hit, so every stage prunes its per-node states; with
    a noisy copy also misses, and the prompts as requests of the batched pipeline (``--max-batch 3``: the draft
    proposes for every request in one call, each stage keeps every request's own state). Each equals the same
    engine in one process. (The batched run on 2 stages: what each stage keeps per request does not depend on n.)"""
    import json

    from helpers.proposers import noisy_copy
    from helpers.runtime import PROMPTS, torchrun
    from spd.target.tokenizer import load_tokenizer

    model = StagedModel.from_pretrained(hybrid_target, n_stages=1).model
    noisy_copy(model, 0.5).save_pretrained(tmp_path / "noisy")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    tok = load_tokenizer(hybrid_target)
    torch.set_num_threads(1)  # as each stage process
    for draft, hits_only, n in ((hybrid_target, True, 4), (tmp_path / "noisy", False, 2)):
        staged = StagedModel.from_pretrained(hybrid_target, n_stages=n)
        out = tmp_path / "out.json"
        batch = [] if hits_only else ["--max-batch", "3"]
        proc = torchrun(
            n,
            "--target",
            str(hybrid_target),
            "--draft-model",
            str(draft),
            "--mode",
            "tree",
            "--tree-width",
            "3",
            "--tree-children",
            "2",
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "20",
            "--out",
            str(out),
            *batch,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        results = json.loads(out.read_text())["results"]["tree"]
        engine = Engine.tree(
            staged, DraftModelProposer(StagedModel.from_pretrained(draft, n_stages=1), staged, 2), 3, tok
        )
        ids = [tok(p)["input_ids"] for p in PROMPTS]
        if hits_only:
            want = [engine.generate(p, 20).token_ids for p in ids]
        else:
            assert "largest batch 3" in proc.stderr
            want = [
                o.token_ids
                for o in BatchedPipeline(engine, 3).generate(
                    ids, 20, eos_token_id=default_eos(staged.model, tok), mode="tree"
                )
            ]
        assert [r["token_ids"] for r in results] == want
        flushes, accepted = sum(r["stats"]["flushes"] for r in results), sum(r["stats"]["accepted"] for r in results)
        assert accepted > 30 and (flushes == 0) == hits_only, (accepted, flushes)


@pytest.mark.slow
def test_trainer_distils_a_head_for_a_hybrid_target(tiny_testbed, hybrid_target, tmp_path):
    """train/distill.py on a hybrid target (anchors on linear and full layers); the head decodes losslessly."""
    from helpers.distill import train
    from spd.heads.speculator import Speculator

    out = tmp_path / "run"
    train(
        f"target={hybrid_target}",
        f"data={tiny_testbed / 'corpus' / 'train.jsonl'}",
        f"eval_data={tiny_testbed / 'corpus' / 'validation.jsonl'}",
        "n_stages=4",
        "max_length=48",
        "batch_size=2",
        "max_steps=3",
        "save_every=0",
        "eval_every=0",
        "eval_rows=4",
        f"output_dir={out}",
        f"cache_dir={tmp_path / 'cache'}",
    )
    head = Speculator.from_pretrained(out / "final")
    anchors = sorted({a for depth in head.config.anchors for a in depth})
    staged = StagedModel.from_pretrained(hybrid_target, n_stages=4)
    kinds = {staged.layer_types[a - 1] for a in anchors if a > 0}
    assert kinds == {"linear_attention", "full_attention"}  # H^l read after linear and full layers alike
    engine = Engine.chain(staged, head)
    prompt = list(range(10, 30))
    assert engine.run(prompt, 24, SamplingParams()).token_ids == generate_ar(staged, prompt, 24).token_ids


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_a_new_head_starts_with_the_targets_final_norm(family):
    """Qwen3.5 norms scale by 1 + w (Llama's by w): the head's own norm starts as the same function."""
    staged = StagedModel(tiny_model(family), 4)
    with torch.no_grad():
        staged.norm.weight.uniform_(-0.5, 0.5)
    head = new_head(staged, DistillConfig(n_stages=4))
    x = torch.randn(3, 64)
    with torch.no_grad():
        torch.testing.assert_close(head.norm(x), staged.norm(x), atol=1e-5, rtol=1e-5)


def test_stage_ranks_load_their_layers_from_the_multimodal_tied_layout(tmp_path):
    """load_partial (one rank's share) on the released checkpoints' layout: model.language_model.*, tied head."""
    from spd.runtime.loading import load_partial, materialized_bytes

    model = tiny_multimodal("qwen3_5", tie_word_embeddings=True)
    model.save_pretrained(tmp_path)
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(4))
    parts = [load_partial(str(tmp_path), 2, role) for role in range(3)]
    assert materialized_bytes(parts[1]) < materialized_bytes(model) / 2
    with torch.no_grad():
        hidden = parts[0].embed(ids)
        for s in range(2):
            hidden = parts[s + 1].run_stage(s, hidden, parts[s + 1].new_stage_cache(s, device="cpu")).hidden_BTD
        torch.testing.assert_close(parts[0].logits(hidden), model(input_ids=ids).logits, atol=TOL, rtol=0)
