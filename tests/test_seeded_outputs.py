"""Seeded sampled outputs of the chain engine, pinned: a change of the random draws (verification, sampling,
warping) must be deliberate and stated here, with what it changed.

The values were recorded with torch 2.13 on CPU from a tiny random Llama (4 layers, 2 stages) and an untrained
head, so most proposals are rejected and both branches of verification (accept, and the residual draw) run.
History:
- first recorded with the chain engine's own rejection sampler (u ~ U[0,1) drawn in float32, the residual
  max(p - q, 0) formed and drawn in float32);
- then the chain engine moved to the one sampled verification of the package,
  :func:`spd.decoding.verify.verify_sampled_recursive` (what the tree engine and serial drafting use): u is drawn
  in float64, which advances the generator differently, and the residual is formed in float64. Every token
  after the first verification therefore changed (the first token comes from the prefill and kept its value:
  58, 80, 31); the statistics stayed alike (acceptances 8, 9, 1 before, 8, 8, 0 after), and the output
  distribution is exactly the target's under both (tests/test_engine.py's chi-square tests).
"""

import pytest
import torch

from conftest import tiny_model
from spd.decoding.engine import Engine
from spd.decoding.sampling import SamplingParams
from spd.target.staging import StagedModel
from spd.training.distill import DistillConfig, new_head

PINNED = [
    # (seed, temperature, top_k), committed tokens, (steps, flushes, accepted)
    (
        (0, 1.0, 0),
        [58, 17, 85, 39, 43, 16, 67, 76, 77, 43, 64, 46, 43, 108, 45, 42, 56, 68, 118, 19, 64, 55, 46, 25],
        (38, 15, 8),
    ),
    (
        (1, 1.0, 0),
        [80, 125, 107, 54, 28, 114, 31, 92, 98, 109, 66, 78, 117, 121, 73, 73, 91, 114, 47, 6, 48, 63, 126, 81],
        (39, 15, 8),
    ),
    (
        (2, 0.7, 20),
        [31, 67, 36, 91, 67, 102, 15, 96, 73, 29, 86, 32, 73, 2, 110, 81, 15, 102, 67, 86, 58, 81, 95, 72],
        (46, 23, 0),
    ),
]


@pytest.fixture(scope="module")
def engine():
    torch.manual_seed(0)
    staged = StagedModel(tiny_model("llama", layers=4), n_stages=2)
    torch.manual_seed(1)
    return Engine.chain(staged, new_head(staged, DistillConfig(n_stages=2)).eval())


@pytest.mark.parametrize("settings,tokens,stats", PINNED)
def test_seeded_sampled_chain_outputs_are_pinned(engine, settings, tokens, stats):
    seed, temperature, top_k = settings
    out = engine.run([3, 17, 9, 41], 24, SamplingParams(temperature=temperature, top_k=top_k, seed=seed))
    assert out.token_ids == tokens
    assert (out.stats.steps, out.stats.flushes, out.stats.accepted) == stats
