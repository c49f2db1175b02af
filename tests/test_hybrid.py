"""Hybrid targets (linear-attention + full-attention layers: Qwen3.5, Qwen3-Next) in every pipelined path:
staging equals the full forward, the linear state rolls back exactly, ar/pp/spd equal ``model.generate``,
sampling follows the target's distribution, tree mode is refused with one clear line."""

import pytest
import torch

from conftest import tiny_config, tiny_model
from spd.training.distill import DistillConfig, new_head
from spd.decoding.engine import PipelineEngine
from spd.errors import SpdInputError
from spd.decoding.generation import generate_ar
from spd.target.linear_state import LinearStateRing
from spd.decoding.sampling import SamplingParams
from spd.target.staging import StagedModel
from spd.decoding.tree_engine import SpdHeadSource, TreeEngine
from test_engine import ScriptedEngine, _chi_square_p_value, _sample_outcomes, _sequence_probs

HYBRIDS = ["qwen3_5", "qwen3_next"]
# Chunked (multi-token) and recurrent (one-token) kernels differ by rounding; logits here are O(5). Hugging
# Face's own cached forward differs from its uncached one by as much (4e-5 for Qwen3.5, 1e-3 for Qwen3-Next).
TOLS = {"qwen3_5": 2e-4, "qwen3_next": 3e-3}
TOL = TOLS["qwen3_5"]
PROMPT = [3 + (7 * i) % 120 for i in range(40)]  # long enough for many flushes at every fill


def _generate_reference(model, prompt, max_new):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


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
        pieces = [staged.logits(staged.forward_stages(ids[:, lo:hi], caches).hidden_BTD)
                  for lo, hi in [(0, 7), (7, 8), (8, 12), (12, 13), (13, 23)]]
        torch.testing.assert_close(torch.cat(pieces, 1), model(input_ids=ids).logits, atol=tol, rtol=0)
        # The training teacher pass reads anchors from linear and full layers alike.
        states = staged.hidden_states(ids, [0, 1, 4, 8])
        torch.testing.assert_close(staged.logits(states[8]), model(input_ids=ids).logits, atol=tol, rtol=0)


def test_multimodal_layout_stages_its_language_model(tmp_path):
    """The real Qwen3.5-4B/9B checkpoints are Qwen3_5ForConditionalGeneration; the text decoder is staged."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(0)
    config = Qwen3_5Config(text_config=tiny_config("qwen3_5").to_dict(),
                           vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2,
                                              out_hidden_size=64))
    model = Qwen3_5ForConditionalGeneration(config).eval()
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
    hooks = [staged.layers[i].linear_attn.register_forward_hook(lambda m, args, kw, out: seen.append(kw["hidden_states"].shape[1]), with_kwargs=True)
             for i in _linear_layers(staged)]
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
        got = torch.cat([staged.logits(staged.forward_stages(ids[:, i:i + 1], caches).hidden_BTD)
                         for i in range(10, 20)], 1)
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


@pytest.mark.parametrize("family", HYBRIDS)
@pytest.mark.parametrize("n", [2, 4, 8])
def test_hybrid_ar_pp_spd_greedy_equal_generate(family, n):
    model = tiny_model(family)
    reference = _generate_reference(model, PROMPT, 48)
    staged = StagedModel(model, n)
    torch.manual_seed(1)
    engine = PipelineEngine(staged, new_head(staged, DistillConfig(n_stages=n)).eval())
    assert generate_ar(staged, PROMPT, 48).token_ids == reference
    assert engine.run(PROMPT, 48, SamplingParams(), use_head=False).token_ids == reference
    assert engine.run(PROMPT, 48, SamplingParams()).token_ids == reference
    # Proposals right and wrong in a pattern: flushes at every fill, each rolling back a different number of tokens.
    scripted = ScriptedEngine(engine, reference, len(PROMPT), right=lambda pos: pos % 5 not in (0, 2))
    out = scripted.run(PROMPT, 48, SamplingParams())
    assert out.token_ids == reference
    assert out.stats.flushes >= 8 and out.stats.accepted >= 10
    assert len({i for i, v in enumerate(out.stats.verified_by_position) if v}) >= min(n, 3)


def test_a_rollback_that_keeps_the_rejected_state_is_caught(monkeypatch):
    """The greedy test above fails if flushes do not restore the linear state (the test can fail)."""
    model = tiny_model("qwen3_5")
    reference = _generate_reference(model, PROMPT, 48)
    staged = StagedModel(model, 4)
    torch.manual_seed(1)
    engine = PipelineEngine(staged, new_head(staged, DistillConfig(n_stages=4)).eval())
    monkeypatch.setattr("spd.target.staging.LinearStateRing", _ForgetfulRing)
    scripted = ScriptedEngine(engine, reference, len(PROMPT), right=lambda pos: pos % 5 not in (0, 2))
    assert scripted.run(PROMPT, 48, SamplingParams()).token_ids != reference


# -------------------------------------------------------------------------------------------- sampling


@pytest.mark.slow
def test_sampled_spd_on_a_hybrid_target_follows_the_target_distribution():
    """3-token continuations from 2000 seeds vs the exact target distribution (chi-square, p > 1e-3)."""
    vocab, length, samples = 6, 3, 2000
    params = SamplingParams(temperature=0.8, top_k=5)
    staged = StagedModel(tiny_model("qwen3_5", seed=3, layers=4, vocab=vocab, bos_token_id=0, eos_token_id=None,
                                    pad_token_id=0), 2)
    with torch.no_grad():
        staged.lm_head.weight.mul_(0.05)
    torch.manual_seed(4)
    head = new_head(staged, DistillConfig(n_stages=2)).eval()
    with torch.no_grad():
        head.lm_head.weight.normal_(0, 0.5)
    engine = PipelineEngine(staged, head)
    prompt = [1, 4, 2, 5, 3]
    exact = _sequence_probs(staged, prompt, params, length)
    counts, stats = _sample_outcomes(engine, prompt, params, length, samples)
    flushes, verified = sum(s.flushes for s in stats), sum(s.verified for s in stats)
    assert 0.1 * verified < flushes < 0.9 * verified
    assert _chi_square_p_value(counts, exact, samples) > 1e-3


# ----------------------------------------------------------------------------------------- tree mode


def test_tree_mode_on_a_hybrid_target_is_refused():
    staged = StagedModel(tiny_model("qwen3_5"), 4)
    torch.manual_seed(1)
    head = new_head(staged, DistillConfig(n_stages=4)).eval()
    with pytest.raises(SpdInputError, match="tree mode does not support targets with linear-attention layers"):
        TreeEngine(staged, SpdHeadSource(head, staged), width=2)


# ------------------------------------------------------------- distributed runtime and training (slow)


@pytest.fixture(scope="module")
def hybrid_target(tiny_testbed, tmp_path_factory):
    """A tiny random Qwen3.5 target with the miniature testbed's tokenizer (for text data and prompts)."""
    import shutil

    from spd.target.staging import load_tokenizer

    out = tmp_path_factory.mktemp("hybrid-target")
    tok = load_tokenizer(tiny_testbed / "target")
    model = tiny_model("qwen3_5", vocab=len(tok), max_position_embeddings=512, eos_token_id=tok.eos_token_id)
    model.save_pretrained(out)
    for f in (tiny_testbed / "target").iterdir():
        if "token" in f.name or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("temperature,early", [(0.0, False), (1.0, True)])
def test_distributed_runtime_on_a_hybrid_target_equals_single_process(hybrid_target, tmp_path, temperature, early):
    """Stage processes keep their linear-state rings; flushes (many: a random head) roll them back exactly."""
    import json

    from spd.heads.loading import load_speculator
    from spd.target.staging import load_tokenizer
    from test_runtime import PROMPTS, _torchrun

    n = 4
    staged = StagedModel.from_pretrained(hybrid_target, n_stages=n)
    torch.manual_seed(7)
    new_head(staged, DistillConfig(n_stages=n, target=str(hybrid_target))).save_pretrained(tmp_path / "head")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "out.json"
    proc = _torchrun(n, "--target", str(hybrid_target), "--speculator", str(tmp_path / "head"), "--mode", "spd", "pp",
                     "--prompts", str(prompts), "--max-new-tokens", "20", "--temperature", str(temperature),
                     "--top-k", "20", "--seed", "5", "--out", str(out), *(["--early-launch"] if early else []))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    tok = load_tokenizer(hybrid_target)
    engine = PipelineEngine(staged, load_speculator(tmp_path / "head"), tok)
    for mode in ("spd", "pp"):
        want = [engine.generate(tok(p)["input_ids"], 20, mode=mode, temperature=temperature, top_k=20,
                                seed=5 + i).token_ids for i, p in enumerate(PROMPTS)]
        assert [r["token_ids"] for r in report["results"][mode]] == want, mode
    assert sum(r["stats"]["flushes"] for r in report["results"]["spd"]) > 5


@pytest.mark.slow
def test_trainer_distils_a_head_for_a_hybrid_target(tiny_testbed, hybrid_target, tmp_path):
    """train/distill.py on a hybrid target (anchors on linear and full layers); the head decodes losslessly."""
    from spd.heads.speculator import Speculator
    from test_distill import _train

    out = tmp_path / "run"
    _train(f"target={hybrid_target}", f"data={tiny_testbed / 'corpus' / 'train.jsonl'}",
           f"eval_data={tiny_testbed / 'corpus' / 'validation.jsonl'}", "n_stages=4",
           "max_length=48", "batch_size=2", "max_steps=3", "save_every=0", "eval_every=0", "eval_rows=4",
           f"output_dir={out}", f"cache_dir={tmp_path / 'cache'}")
    head = Speculator.from_pretrained(out / "final")
    anchors = sorted({a for depth in head.config.anchors for a in depth})
    staged = StagedModel.from_pretrained(hybrid_target, n_stages=4)
    kinds = {staged.layer_types[a - 1] for a in anchors if a > 0}
    assert kinds == {"linear_attention", "full_attention"}  # H^l read after linear and full layers alike
    engine = PipelineEngine(staged, head)
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
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from spd.runtime.loading import load_partial, materialized_bytes

    torch.manual_seed(0)
    config = Qwen3_5Config(text_config=tiny_config("qwen3_5", tie_word_embeddings=True).to_dict(),
                           tie_word_embeddings=True, vision_config=dict(depth=1, hidden_size=32, intermediate_size=32,
                                                                        num_heads=2, out_hidden_size=64))
    model = Qwen3_5ForConditionalGeneration(config).eval()
    model.save_pretrained(tmp_path)
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(4))
    parts = [load_partial(str(tmp_path), 2, role) for role in range(3)]
    assert materialized_bytes(parts[1]) < materialized_bytes(model) / 2
    with torch.no_grad():
        hidden = parts[0].embed(ids)
        for s in range(2):
            hidden = parts[s + 1].run_stage(s, hidden, parts[s + 1].new_stage_cache(s, device="cpu")).hidden_BTD
        torch.testing.assert_close(parts[0].logits(hidden), model(input_ids=ids).logits, atol=TOL, rtol=0)
