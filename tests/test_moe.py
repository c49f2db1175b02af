"""Mixture-of-experts targets: ``qwen3_moe`` (experts in every layer, Qwen3-30B-A3B's layout) and ``qwen3_5_moe``
(hybrid and MoE, Qwen3.5's larger released models) staged and decoded in every mode: staging equals the full
forward, ar / pp / spd / tree equal ``model.generate``, the released checkpoints'
multimodal layout, a stage rank's share of the weights, the distributed runtime, and a head trained here.

A token's route through the experts is a function of its own hidden state, so a stage computing one token, a
tree level or a whole prompt routes every token as the full forward does; nothing in the engine is MoE-specific.
"""

import shutil

import pytest
import torch

from conftest import tiny_model, tiny_multimodal
from helpers.equivalence import (
    PROMPT,
    check_ar_pp_spd_equal_generate,
    check_distributed_equals_single_process,
    generate_reference,
)
from spd.decoding.engine import Engine
from spd.decoding.generation import generate_ar
from spd.decoding.proposers import DraftModelProposer, SpdHeadProposer
from spd.decoding.sampling import SamplingParams
from spd.target.staging import StagedModel
from spd.training.distill import DistillConfig, new_head

MOES = ["qwen3_moe", "qwen3_5_moe"]
# The hybrid one's chunked (prompt) and recurrent (one token) linear-attention kernels differ by rounding.
TOLS = {"qwen3_moe": 1e-5, "qwen3_5_moe": 2e-4}


@pytest.fixture(scope="module", params=MOES)
def moe(request):
    """(family, model, greedy reference for PROMPT)."""
    model = tiny_model(request.param)
    return request.param, model, generate_reference(model, PROMPT, 40)


def test_the_fixtures_are_mixtures_of_experts():
    for family in MOES:
        model = tiny_model(family)
        layer = model.model.layers[0]
        assert type(layer.mlp).__name__.endswith("SparseMoeBlock"), (family, type(layer.mlp).__name__)
        assert model.config.num_experts == 4 and model.config.num_experts_per_tok == 2
    assert StagedModel(tiny_model("qwen3_5_moe"), 2).is_hybrid and not StagedModel(tiny_model("qwen3_moe"), 2).is_hybrid


@pytest.mark.parametrize("n_stages", [1, 2, 4, 8])
def test_moe_stage_by_stage_equals_full_forward(moe, n_stages):
    family, model, _ = moe
    staged = StagedModel(model, n_stages)
    ids = torch.randint(3, 128, (1, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        caches = staged.new_caches(capacity=4)
        pieces = [
            staged.logits(staged.forward_stages(ids[:, lo:hi], caches).hidden_BTD)
            for lo, hi in [(0, 7), (7, 8), (8, 12), (12, 13), (13, 23)]
        ]
        torch.testing.assert_close(torch.cat(pieces, 1), ref, atol=TOLS[family], rtol=0)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_moe_ar_pp_spd_greedy_equal_generate(moe, n):
    family, model, reference = moe
    check_ar_pp_spd_equal_generate(model, n, PROMPT, reference)


# W = 4 only: a tree of width 1 is the chain (the same step loop, one node a level), which
# test_moe_ar_pp_spd_greedy_equal_generate runs with the head on every n, and the levels of one node (the roots) are in
# every tree below.
@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("width", [4])
def test_moe_tree_greedy_equals_generate(moe, n, width):
    """Head and draft-model trees on the MoE targets (the hybrid one with per-node linear state): a level of W nodes
    routes each node by its own state."""
    family, model, reference = moe
    staged = StagedModel(model, n)
    torch.manual_seed(1)
    head = new_head(staged, DistillConfig(n_stages=n)).eval()
    draft = StagedModel(tiny_model(family, seed=3, layers=2), 1)  # a weak draft: misses, the odd hit
    for source in (
        SpdHeadProposer(head, staged, children=4),
        DraftModelProposer(draft, staged, 4),
        DraftModelProposer(StagedModel(model, 1), staged, 4),
    ):  # the target itself: hits and prunes only
        out = Engine.tree(staged, source, width).run(PROMPT, 40, SamplingParams())
        assert out.token_ids == reference, (type(source).__name__, width)


def test_the_released_multimodal_moe_layout_is_staged_and_split(tmp_path):
    """Qwen3.5's released MoE checkpoints are Qwen3_5MoeForConditionalGeneration: the text decoder is staged, and
    a stage rank loads its share of the experts only."""
    from spd.runtime.loading import load_partial, materialized_bytes

    model = tiny_multimodal("qwen3_5_moe")
    model.save_pretrained(tmp_path)
    ids = torch.randint(3, 128, (1, 15), generator=torch.Generator().manual_seed(2))
    tol = TOLS["qwen3_5_moe"]
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        staged = StagedModel.from_pretrained(tmp_path, n_stages=4)
        assert staged.num_layers == 8 and staged.is_hybrid
        torch.testing.assert_close(
            staged.logits(staged.forward_stages(ids, staged.new_caches()).hidden_BTD), ref, atol=tol, rtol=0
        )
        parts = [load_partial(str(tmp_path), 2, role) for role in range(3)]
        assert materialized_bytes(parts[1]) < materialized_bytes(model) / 2
        hidden = parts[0].embed(ids)
        for s in range(2):
            hidden = parts[s + 1].run_stage(s, hidden, parts[s + 1].new_stage_cache(s, device="cpu")).hidden_BTD
        torch.testing.assert_close(parts[0].logits(hidden), ref, atol=tol, rtol=0)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_a_stage_rank_stacks_experts_stored_one_at_a_time(tmp_path, family):
    """save_pretrained (as the released checkpoints) stores experts one by one; a stage rank's partial load fuses
    them as transformers does (Qwen3-Next too: hybrid, with experts in every layer)."""
    from safetensors import safe_open

    from spd.runtime.loading import load_partial

    model = tiny_model(family)
    model.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        assert "model.layers.0.mlp.experts.3.up_proj.weight" in f.keys()
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(4))
    parts = [load_partial(str(tmp_path), 4, role) for role in range(5)]
    with torch.no_grad():
        hidden = parts[0].embed(ids)
        for s in range(4):
            hidden = parts[s + 1].run_stage(s, hidden, parts[s + 1].new_stage_cache(s, device="cpu")).hidden_BTD
        torch.testing.assert_close(parts[0].logits(hidden), model(input_ids=ids).logits, atol=3e-3, rtol=0)


# ------------------------------------------------------------- distributed runtime and training (slow)


@pytest.fixture(scope="module")
def moe_targets(tiny_testbed, tmp_path_factory):
    """Tiny random MoE targets with the miniature testbed's tokenizer (for text data and prompts)."""
    from spd.target.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_testbed / "target")
    targets = {}
    for family in MOES:
        out = tmp_path_factory.mktemp(family)
        tiny_model(family, vocab=len(tok), max_position_embeddings=512, eos_token_id=tok.eos_token_id).save_pretrained(
            out
        )
        for f in (tiny_testbed / "target").iterdir():
            if "token" in f.name or f.name == "special_tokens_map.json":
                shutil.copy(f, out / f.name)
        targets[family] = out
    return targets


@pytest.mark.slow
def test_distributed_runtime_on_a_moe_target_equals_single_process(moe_targets, tmp_path):
    """Stage processes on the MoE target: spd, pp and the W = 2 tree give the single-process engines' tokens."""
    check_distributed_equals_single_process(moe_targets["qwen3_moe"], tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("family", MOES)
def test_trainer_distils_a_head_for_a_moe_target(tiny_testbed, moe_targets, tmp_path, family):
    """train/distill.py on an MoE target; the head decodes losslessly (spd and tree)."""
    from helpers.distill import train
    from spd.heads.speculator import Speculator

    out, target = tmp_path / "run", moe_targets[family]
    train(
        f"target={target}",
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
    staged = StagedModel.from_pretrained(target, n_stages=4)
    prompt = list(range(10, 30))
    reference = generate_ar(staged, prompt, 24).token_ids
    assert Engine.chain(staged, head).run(prompt, 24, SamplingParams()).token_ids == reference
    tree = Engine.tree(staged, SpdHeadProposer(head, staged), 4)
    assert tree.run(prompt, 24, SamplingParams()).token_ids == reference
