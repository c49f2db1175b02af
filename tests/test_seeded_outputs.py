"""Seeded sampled outputs of the chain engine, pinned: a change of the random draws (verification, sampling,
warping) must be deliberate and stated here, with what it changed.

The values were recorded with torch 2.13 on CPU from a tiny random Llama (4 layers, 2 stages) and an untrained
head, so most proposals are rejected and both branches of verification (accept, and the residual draw) run.
History: recorded with the engine's own float32 rejection sampler (u ~ U[0,1) in float32, the residual drawn in
float32).
"""

import pytest
import torch

from conftest import tiny_model
from spd.decoding.engine import PipelineEngine
from spd.decoding.sampling import SamplingParams
from spd.target.staging import StagedModel
from spd.training.distill import DistillConfig, new_head

PINNED = [
    # (seed, temperature, top_k), committed tokens, (steps, flushes, accepted)
    ((0, 1.0, 0), [58, 123, 1, 67, 91, 105, 42, 88, 59, 73, 6, 23, 67, 22, 108, 31, 17, 78, 59, 16, 76, 0, 73, 13],
     (39, 15, 8)),
    ((1, 1.0, 0), [80, 73, 80, 55, 43, 43, 109, 81, 76, 3, 25, 116, 81, 6, 22, 101, 95, 35, 11, 73, 114, 25, 112, 71],
     (38, 14, 9)),
    ((2, 0.7, 20), [31, 43, 82, 59, 30, 43, 73, 51, 45, 37, 91, 82, 45, 82, 79, 72, 23, 121, 22, 119, 105, 43, 101,
                    108], (45, 22, 1)),
]


@pytest.fixture(scope="module")
def engine():
    torch.manual_seed(0)
    staged = StagedModel(tiny_model("llama", layers=4), n_stages=2)
    torch.manual_seed(1)
    return PipelineEngine(staged, new_head(staged, DistillConfig(n_stages=2)).eval())


@pytest.mark.parametrize("settings,tokens,stats", PINNED)
def test_seeded_sampled_chain_outputs_are_pinned(engine, settings, tokens, stats):
    seed, temperature, top_k = settings
    out = engine.run([3, 17, 9, 41], 24, SamplingParams(temperature=temperature, top_k=top_k, seed=seed))
    assert out.token_ids == tokens
    assert (out.stats.steps, out.stats.flushes, out.stats.accepted) == stats
