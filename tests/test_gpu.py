"""The GPU path (docs/gpu.md): every in-process decoding mode on CUDA, in fp32 and bf16.

fp32 on the GPU: greedy spd (three head variants), pp, tree (head and draft model), sd (draft model and serial
head) and the batched pipeline equal the same staged model's own greedy ``ar`` on the GPU, except where a
difference starts at a near-tie (top-two logits within 1e-4); sampled spd and tree follow the target's
distribution (chi-square against the exact distribution); a seed reproduces its sample.

bf16: the same greedy comparisons against bf16 ``ar`` of the same staged model; a difference may start only where
the top-two logits are within 8 bf16 spacings of the top logit (bf16 logits that close are rounding away from a
tie: other matrix shapes round differently). The margins of every such difference are printed.

Marked ``gpu`` and skipped without CUDA (CI has none). ``SPD_TEST_DEVICE=cpu`` runs the same checks on the CPU,
to check the tests themselves. The last two tests run everywhere: the attention-kernel switch (spd.target.sdpa)
and spd-bench gpu on a small model on the CPU.
"""

import copy
import json
import os

import pytest
import torch

from conftest import differences_are_near_ties, tiny_model
from helpers.proposers import noisy_copy
from helpers.stats import chi_square_p_value, sample_outcomes, sequence_probs
from spd.decoding.batch import BatchedPipeline
from spd.decoding.engine import Engine
from spd.decoding.generation import generate_ar
from spd.decoding.proposers import DraftModelProposer, SpdHeadProposer
from spd.decoding.proposers.serial_head import SerialHeadProposer
from spd.decoding.sampling import SamplingParams
from spd.decoding.sd import SpeculativeDecoder
from spd.target.staging import StagedModel
from spd.training.distill import DistillConfig, new_head

DEVICE = os.environ.get("SPD_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else None)


def on_gpu(test):
    """Marked ``gpu`` and skipped without CUDA."""
    skip = pytest.mark.skipif(DEVICE is None, reason="needs a CUDA GPU (SPD_TEST_DEVICE=cpu runs it on the CPU)")
    return pytest.mark.gpu(skip(test))


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PROMPTS = [[5, 17, 3, 99, 42, 8], [7], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]
NEW = 32


def _on_device(model, dtype):
    """A copy of ``model`` on the test device in ``dtype`` (the CPU original stays as it is)."""
    return copy.deepcopy(model).to(device=DEVICE, dtype=dtype)


def _head(staged: StagedModel, n: int, variant: str = "spd", seed: int = 1):
    torch.manual_seed(seed)
    return new_head(staged, DistillConfig(n_stages=n, variant=variant)).eval()


@pytest.fixture(scope="module", params=list(DTYPES))
def dtype(request):
    return DTYPES[request.param]


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", seed=0, layers=8)


@on_gpu
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_chain_modes_equal_ar(family, dtype):
    """spd with each head variant, and pp, at n = 2 and 4."""
    staged_by_n = {n: StagedModel(_on_device(tiny_model(family, seed=0, layers=8), dtype), n) for n in (2, 4)}
    near, runs = 0, 0
    for n, staged in staged_by_n.items():
        engines = {v: Engine.chain(staged, _head(staged, n, v)) for v in ("spd", "output_state", "ppsd")}
        for prompt in PROMPTS:
            ar = generate_ar(staged, prompt, NEW).token_ids
            assert len(ar) == NEW
            for variant, engine in engines.items():
                out = engine.run(prompt, NEW, SamplingParams())
                near += differences_are_near_ties(staged, prompt, ar, out.token_ids, f"{family} n={n} spd/{variant}")
                runs += 1
                assert out.stats.verified == out.stats.accepted + out.stats.flushes
            pp = engines["spd"].run(prompt, NEW, SamplingParams(), use_head=False)
            near += differences_are_near_ties(staged, prompt, ar, pp.token_ids, f"{family} n={n} pp")
            runs += 1
            assert pp.stats.steps == n * pp.stats.decode_tokens
    print(f"{near} near-tie difference(s) in {runs} runs")


@on_gpu
def test_greedy_tree_equals_ar(llama, dtype):
    """Width 4 with an SPD head and with a draft model (the target with a noisy LM head), n = 4."""
    staged = StagedModel(_on_device(llama, dtype), 4)
    draft = StagedModel(_on_device(noisy_copy(llama, 0.3), dtype), 1)
    engines = {
        "head": Engine.tree(staged, SpdHeadProposer(_head(staged, 4), staged, 4), 4),
        "draft": Engine.tree(staged, DraftModelProposer(draft, staged, 4), 4),
    }
    hits = 0
    for prompt in PROMPTS:
        ar = generate_ar(staged, prompt, NEW).token_ids
        for name, engine in engines.items():
            out = engine.run(prompt, NEW, SamplingParams())
            differences_are_near_ties(staged, prompt, ar, out.token_ids, f"tree/{name}")
            hits += out.stats.accepted
    assert hits > 0  # the draft model's trees are hit


@on_gpu
def test_greedy_sd_equals_ar(llama, dtype):
    """Serial drafting with m = 3: a draft model, and a head trained as variant=eagle (untrained here)."""
    target = StagedModel(_on_device(llama, dtype), 1)
    draft = StagedModel(_on_device(noisy_copy(llama, 0.5), dtype), 1)
    torch.manual_seed(4)
    eagle = new_head(target, DistillConfig(variant="eagle", draft_steps=3)).eval()
    for name, drafter in {"draft": draft, "eagle head": SerialHeadProposer(eagle, target)}.items():
        sd = SpeculativeDecoder(target, drafter, 3)
        for prompt in PROMPTS:
            ar = generate_ar(target, prompt, NEW).token_ids
            differences_are_near_ties(target, prompt, ar, sd.run(prompt, NEW, SamplingParams()).token_ids, f"sd/{name}")


@on_gpu
@pytest.mark.parametrize("mode", ["spd", "tree"])
def test_batched_requests_each_get_their_own_answer(llama, dtype, mode):
    """12 requests of 1-38 prompt tokens, at most 6 in flight over a KV pool that holds fewer: greedy ones equal
    their solo ar (near-ties reported); in fp32, seeded sampled ones equal the engine's own seeded run."""
    staged = StagedModel(_on_device(llama, dtype), 4)
    if mode == "spd":
        engine = Engine.chain(staged, _head(staged, 4))
    else:
        engine = Engine.tree(
            staged, DraftModelProposer(StagedModel(_on_device(noisy_copy(llama, 0.5), dtype), 1), staged, 4), 4
        )
    batched = BatchedPipeline(engine, max_batch=6, kv_rows=2 * (38 + 30 + 4 * 4 + 1), prefill_chunk=8)
    settings = [
        (
            [(7 * i + 3 * j) % 120 + 1 for j in range(1 + (i * 5) % 38)],
            5 + (i * 7) % 26,
            SamplingParams(temperature=(0.0, 0.0, 1.0, 0.7)[i % 4], seed=100 + i),
        )
        for i in range(12)
    ]
    requests = [batched.submit(prompt, budget, sampling) for prompt, budget, sampling in settings]
    batched.run()
    assert batched.kv_waits > 0 and max(batched.batch_sizes) <= 6
    assert batched.pool.free_rows == batched.pool.rows
    near = 0
    for i, (request, (prompt, budget, sampling)) in enumerate(zip(requests, settings)):
        assert request.state == "done", (i, request.error)
        if sampling.greedy:
            solo = generate_ar(staged, prompt, budget).token_ids
            near += differences_are_near_ties(staged, prompt, solo, request.output.token_ids, f"batched {mode} #{i}")
        elif dtype == torch.float32:
            assert request.output.token_ids == engine.run(prompt, budget, sampling).token_ids, i
    print(f"batched {mode}: {near} near-tie difference(s) among 6 greedy requests")


@on_gpu
@pytest.mark.parametrize("mode", ["spd", "tree"])
def test_sampled_decoding_follows_the_target_distribution(mode):
    """3-token continuations from 1000 seeds on the GPU (fp32) vs the exact warped distribution (chi-square)."""
    vocab, length, samples, params = 6, 3, 1000, SamplingParams(temperature=1.0)
    model = tiny_model("llama", seed=3, layers=6, vocab=vocab, bos_token_id=0, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.05)  # peaked but not degenerate next-token distributions
    exact = sequence_probs(StagedModel(model, 2), [1, 4, 2], params, length)  # on the CPU, in fp32
    staged = StagedModel(_on_device(model, torch.float32), 2)
    head = _head(staged, 2, seed=4)
    with torch.no_grad():
        head.lm_head.weight.normal_(0, 0.5)  # q differs from p: rejections and residual draws
    engine = Engine.chain(staged, head) if mode == "spd" else Engine.tree(staged, SpdHeadProposer(head, staged, 2), 2)
    counts, stats = sample_outcomes(engine, [1, 4, 2], params, length, samples)
    assert sum(s.flushes for s in stats) > 0
    assert chi_square_p_value(counts, exact, samples) > 1e-3


@on_gpu
def test_a_seed_reproduces_its_sample(llama):
    staged = StagedModel(_on_device(llama, torch.float32), 4)
    engines = {
        "spd": Engine.chain(staged, _head(staged, 4)),
        "tree": Engine.tree(staged, SpdHeadProposer(_head(staged, 4), staged, 4), 4),
    }
    params = SamplingParams(temperature=1.0, top_k=20, seed=11)
    for name, engine in engines.items():
        a, b = (engine.run([5, 6, 7], 30, params).token_ids for _ in range(2))
        assert a == b, name
        assert engine.run([5, 6, 7], 30, SamplingParams(temperature=1.0, top_k=20, seed=12)).token_ids != a, name


def test_decode_attention_keeps_cudnn_out_on_cuda_only():
    """spd.target.sdpa: on a CUDA device cuDNN's attention kernel is switched off (the others stay on); elsewhere, or
    with ALLOW_CUDNN, nothing changes."""
    from spd.target import sdpa

    cudnn, flash = torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()
    with sdpa.decode_kernels(torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == cudnn and torch.backends.cuda.flash_sdp_enabled() == flash
    with sdpa.decode_kernels(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled() == cudnn
    sdpa.ALLOW_CUDNN = True
    try:
        with sdpa.decode_kernels(torch.device("cuda")):
            assert torch.backends.cuda.cudnn_sdp_enabled() == cudnn
    finally:
        sdpa.ALLOW_CUDNN = False


def test_the_gpu_benchmark_runs_a_small_model_on_the_cpu(tmp_path, capsys):
    """spd-bench gpu end to end at a small size: a table per part and JSON with every mode and shape."""
    from spd.bench import gpu as bench_gpu

    out = tmp_path / "gpu.json"
    assert (
        bench_gpu.main(
            [
                "--size",
                "tiny",
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--stages",
                "2",
                "3",
                "--prompt-tokens",
                "12",
                "--new-tokens",
                "4",
                "--contexts",
                "32",
                "--nodes",
                "4",
                "--repeats",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "n=3 spd" in printed and "C=32" in printed
    results = json.loads(out.read_text())
    assert [(r["n"], r["mode"]) for r in results["decode"]] == [(n, m) for n in (2, 3) for m in ("ar", "pp", "spd")]
    for row in results["decode"]:
        assert row["decode_tokens"] == 3 and row["step_ms"] > 0 and len(row["stage_ms_per_step"]) == row["n"]
        assert row["all_stages_ms_per_step"] > 0 and (row["head_ms_per_step"] > 0) == (row["mode"] == "spd")
    assert [(r["n"], r["stage_layers"]) for r in results["tree"]] == [(2, 4), (3, 3)]  # 8 layers: 3,3,2 at n = 3
