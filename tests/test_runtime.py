"""The torch.distributed runtime: real processes (torchrun, gloo) produce exactly the single-process engine's
tokens; each stage rank holds only its layers; a killed stage makes the whole run exit cleanly."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, two_at_a_time
from helpers.runtime import PROMPTS, master_port, reference_outputs, torchrun
from spd.decoding.engine import Engine
from spd.decoding.proposers import SpdHeadProposer
from spd.decoding.tree import TokenTree
from spd.errors import SpdInputError
from spd.heads.loading import load_speculator
from spd.runtime.loading import load_partial, materialized_bytes
from spd.runtime.stage import EpochLog, _level_now, pack_level
from spd.target.staging import StagedModel
from spd.target.tokenizer import load_tokenizer
from spd.training.distill import DistillConfig, new_head


# The shallowest pipeline sampled and the deepest greedy (a world of n + 1 processes costs CI time on 2 cores); each
# run serves spd, pp and the SPD-head tree on the same processes. n = 4 runs the same check greedy on a mixture-of-
# experts target (tests/test_moe.py::test_distributed_runtime_on_a_moe_target_equals_single_process) and sampled on a
# hybrid one (tests/test_hybrid.py), batched and sampled with the verification outcomes compared (the batched test
# below), and with a draft tree (test_distributed_draft_tree_equals_single_process_engine).
@pytest.mark.slow
@pytest.mark.parametrize("n,temperature", [(2, 1.0), (8, 0.0)])
def test_distributed_runtime_equals_single_process_engine(tiny_testbed, heads, tmp_path, n, temperature):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "out.json"
    args = [
        "--target",
        str(tiny_testbed / "target"),
        "--speculator",
        str(heads[n]),
        "--mode",
        "spd",
        "pp",
        "tree",
        "--tree-width",
        "2",
        "--prompts",
        str(prompts),
        "--max-new-tokens",
        "16",
        "--temperature",
        str(temperature),
        "--top-k",
        "20",
        "--seed",
        "5",
        "--out",
        str(out),
    ]
    proc = torchrun(n, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    for mode in ("spd", "pp", "tree"):
        got = [r["token_ids"] for r in report["results"][mode]]
        want = reference_outputs(tiny_testbed, heads[n], n, mode, temperature, 20, 5, 16)
        assert got == [out.token_ids for out in want], mode
        # The same verification outcomes, token by token.
        flags = [r["stats"]["token_acceptance"] for r in report["results"][mode]]
        assert flags == [out.stats.token_acceptance for out in want], mode
        assert all(sum(f) == r["stats"]["accepted"] for f, r in zip(flags, report["results"][mode]))
    spd_stats = [r["stats"] for r in report["results"]["spd"]]
    assert all(s["stages"] == n and s["steps"] > 0 for s in spd_stats)
    tree_stats = [r["stats"] for r in report["results"]["tree"]]
    assert all(s["width"] == 2 and s["max_tree_size"] > 1 for s in tree_stats)


# 8 requests of different lengths (4 to 117 tokens), at most 4 at once (the others queue), each with its own seed.
BATCH_PROMPTS = [p[:k] for p in PROMPTS for k in (7, 400)]


@pytest.mark.slow
def test_distributed_runtime_batches_requests_as_the_in_process_batch_does(tiny_testbed, heads, tmp_path):
    """run_pipeline --max-batch: the ragged batches travel stage to stage (spd/runtime/batch.py) and every request
    gets exactly the tokens and verification outcomes of the in-process batched pipeline (the same ragged calls,
    bit for bit; tests/test_batch.py proves that pipeline lossless), in spd, pp and tree mode, sampled, with the
    flushes and prunes of an untrained head; the tree under a node budget (its trees narrowing as the batch grows)."""
    from spd.decoding.batch import BatchedPipeline
    from spd.decoding.generation import default_eos
    from spd.decoding.sampling import SamplingParams

    n = 4
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in BATCH_PROMPTS))
    out = tmp_path / "out.json"
    proc = torchrun(
        n,
        "--target",
        str(tiny_testbed / "target"),
        "--speculator",
        str(heads[n]),
        "--mode",
        "spd",
        "pp",
        "tree",
        "--tree-width",
        "2",
        "--prompts",
        str(prompts),
        "--max-new-tokens",
        "20",
        "--temperature",
        "1",
        "--top-k",
        "20",
        "--seed",
        "7",
        "--max-batch",
        "4",
        "--prefill-chunk",
        "24",
        "--spread-prefill",
        "--tree-nodes",
        "4",
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"[spd] {len(BATCH_PROMPTS)} prompts in" in proc.stderr and "largest batch 4" in proc.stderr
    report = json.loads(out.read_text())
    torch.set_num_threads(1)
    staged = StagedModel.from_pretrained(tiny_testbed / "target", n_stages=n)
    tok = load_tokenizer(tiny_testbed / "target")
    head = load_speculator(heads[n])
    ids = [tok(p)["input_ids"] for p in BATCH_PROMPTS]
    sampling = [SamplingParams(1.0, 20, 1.0, 7 + i) for i in range(len(ids))]
    eos = default_eos(staged.model, tok)
    flushes = 0
    for mode in ("spd", "pp", "tree"):
        engine = (
            Engine.tree(staged, SpdHeadProposer(head, staged, 4), 2, tok)
            if mode == "tree"
            else Engine.chain(staged, head, tok)
        )
        # (--tree-nodes 4 is the tree's: its W = 2 trees narrow to 1 node a level while 3 or 4 requests run)
        want = BatchedPipeline(
            engine, 4, prefill_chunk=24, spread_prefill=True, tree_nodes=4 if mode == "tree" else None
        ).generate(ids, 20, sampling, eos, mode=mode)
        got = report["results"][mode]
        assert [r["token_ids"] for r in got] == [o.token_ids for o in want], mode
        assert [r["stats"]["token_acceptance"] for r in got] == [o.stats.token_acceptance for o in want], mode
        flushes += sum(r["stats"]["flushes"] for r in got)
    assert flushes > 10  # rejections happened, each on its own request's region


@pytest.mark.slow
def test_distributed_runtime_batches_the_heads_asked_through_their_engine_calls(tiny_testbed, tmp_path):
    """run_pipeline --max-batch with a PPSD head (its query after the stages: serial with them) and with an SPD
    authors' head (chain and W = 2 tree), sampled: every request gets exactly the tokens and verification outcomes
    of the in-process batched pipeline, whose joint head calls tests/test_batch.py checks against each request's
    own."""
    from helpers.authors import FIXTURES, head_file
    from spd.decoding.batch import BatchedPipeline
    from spd.decoding.generation import default_eos
    from spd.decoding.proposers import HeadProposer
    from spd.decoding.sampling import SamplingParams
    from spd.heads.published.authors_head import load_authors_head

    # (the PPSD head on 2 stages: its query's place in the step does not depend on n; the authors' head is for 4)
    stages = {"ppsd": 2, "authors": 4}
    staged = StagedModel.from_pretrained(tiny_testbed / "target", n_stages=stages["ppsd"])
    torch.manual_seed(3)
    new_head(
        staged, DistillConfig(n_stages=stages["ppsd"], variant="ppsd", target=str(tiny_testbed / "target"))
    ).save_pretrained(tmp_path / "ppsd")
    authors_target = FIXTURES / "targets" / "qwen3"  # vocabulary 512, as the miniature testbed's tokenizer
    texts = [p[:k] for p in PROMPTS for k in (7, 19)][:6]  # 6 requests of 4 to 12 tokens, at most 3 at once
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in texts))
    common = (
        "--prompts",
        str(prompts),
        "--max-new-tokens",
        "16",
        "--temperature",
        "1",
        "--top-k",
        "20",
        "--seed",
        "7",
        "--max-batch",
        "3",
        "--tokenizer",
        str(tiny_testbed / "target"),
    )
    runs = {
        "ppsd": ("--target", str(tiny_testbed / "target"), "--speculator", str(tmp_path / "ppsd"), "--mode", "spd"),
        "authors": (
            "--target",
            str(authors_target),
            "--speculator",
            str(head_file("v10_qwen3_n4_l1")),
            "--mode",
            "spd",
            "tree",
            "--tree-width",
            "2",
        ),
    }

    def run(name):
        return torchrun(stages[name], *runs[name], *common, "--out", str(tmp_path / f"{name}.json"))

    for proc in two_at_a_time(run, runs):
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "largest batch 3" in proc.stderr
    torch.set_num_threads(1)
    tok = load_tokenizer(tiny_testbed / "target")
    ids = [tok(p)["input_ids"] for p in texts]
    sampling = [SamplingParams(1.0, 20, 1.0, 7 + i) for i in range(len(ids))]
    authors_staged = StagedModel.from_pretrained(authors_target, n_stages=stages["authors"])
    authors_head = load_authors_head(str(head_file("v10_qwen3_n4_l1")), authors_staged)
    cases = [
        ("ppsd", "spd", Engine.chain(staged, load_speculator(tmp_path / "ppsd"), tok), staged),
        ("authors", "spd", Engine.chain(authors_staged, authors_head, tok), authors_staged),
        (
            "authors",
            "tree",
            Engine.tree(authors_staged, HeadProposer(authors_head, authors_staged, 4), 2, tok),
            authors_staged,
        ),
    ]
    for name, mode, engine, target in cases:
        got = json.loads((tmp_path / f"{name}.json").read_text())["results"][mode]
        want = BatchedPipeline(engine, 3).generate(ids, 16, sampling, default_eos(target.model, tok), mode=mode)
        assert [r["token_ids"] for r in got] == [o.token_ids for o in want], (name, mode)
        assert [r["stats"]["token_acceptance"] for r in got] == [o.stats.token_acceptance for o in want], (name, mode)
        assert sum(r["stats"]["flushes"] for r in got) > 5, (name, mode)


def test_a_batch_manifest_round_trips_and_a_corrupt_one_is_refused(tiny_testbed):
    """The manifest's wire format (spd/runtime/batch.py): operations and segments (a tree level from an item of the
    previous stage, pruned to two rows; a chunk carried in the manifest) decode as encoded; truncated, out-of-range
    or overlong manifests are a PipelineLost naming the rank, never a crash or a huge allocation."""
    from spd.runtime.batch import OPEN, PRUNE, decode_manifest, encode_manifest, handles_of
    from spd.runtime.protocol import PipelineLost
    from spd.target.kv_pool import KVPool, Region
    from spd.target.segments import Segment

    staged = StagedModel.from_pretrained(tiny_testbed / "target", n_stages=2)
    pool = KVPool(staged, 64, ledger=True)
    level = pool.caches(Region(0, 32))[1]
    chunk = pool.caches(Region(32, 32))[0]
    mask = torch.tensor([[True, True, False], [True, False, True]])
    tree = Segment(level, handles_of([5], [3], staged.device)[:, [0, 2]], torch.tensor([7, 7]), mask, anchors=[3])
    prompt = Segment(chunk, torch.zeros(1, 4, staged.config.hidden_size))
    ops = [[OPEN, 32, 32], [PRUNE, 0, 6, 2, 1, 3]]
    words = encode_manifest(9, 7, ops, [tree, prompt], [11, 12])
    phase, keep_from, got_ops, segments = decode_manifest(words, 2, 64, 64, staged.num_layers)
    assert (phase, keep_from) == (9, 7)
    assert [op[:3] for op in got_ops] == [(OPEN, 32, 32), (PRUNE, 0, 6)] and got_ops[1][3].tolist() == [1, 3]
    first, second = segments
    assert (first.base, first.key_in, first.size, first.rows, first.anchors, first.key_out) == (
        0,
        5,
        2,
        [0, 2],
        [3],
        11,
    )
    assert first.positions_T.tolist() == [7, 7] and torch.equal(first.tree_mask_TN, mask)
    assert (second.base, second.key_in, second.size, second.rows, second.positions_T, second.tree_mask_TN) == (
        32,
        -1,
        4,
        [],
        None,
        None,
    )
    bad = [
        words[:-1],
        torch.cat([words, torch.tensor([0])]),
        words.clone().index_fill_(0, torch.tensor([5]), 10**6),  # a region past the pool
        words.clone().index_fill_(0, torch.tensor([3]), 10**9),
    ]  # a billion segments announced
    for corrupt in bad:
        with pytest.raises(PipelineLost, match="rank 2: a batch manifest"):
            decode_manifest(corrupt, 2, 64, 64, staged.num_layers)


@pytest.mark.slow
def test_distributed_output_state_head_equals_single_process_engine(tiny_testbed, tmp_path):
    """A head on the stages' output states: the last stage reports anchors (H^L among them) at prefill as well as
    the last position's H^L, in two messages."""
    staged = StagedModel.from_pretrained(tiny_testbed / "target", n_stages=2)
    torch.manual_seed(3)
    head = new_head(staged, DistillConfig(n_stages=2, variant="output_state", target=str(tiny_testbed / "target")))
    assert staged.num_layers in head.prefill_anchors()
    head.save_pretrained(tmp_path / "head")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "out.json"
    proc = torchrun(
        2,
        "--target",
        str(tiny_testbed / "target"),
        "--speculator",
        str(tmp_path / "head"),
        "--mode",
        "spd",
        "--prompts",
        str(prompts),
        "--max-new-tokens",
        "16",
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    want = reference_outputs(tiny_testbed, tmp_path / "head", 2, "spd", 0.0, 0, None, 16)
    assert [r["token_ids"] for r in report["results"]["spd"]] == [o.token_ids for o in want]
    assert [r["stats"]["token_acceptance"] for r in report["results"]["spd"]] == [
        o.stats.token_acceptance for o in want
    ]


@pytest.mark.slow
def test_one_new_token_per_prompt_is_summarised_without_a_decode_rate(tiny_testbed, tmp_path):
    """Prefill only (the first token comes from the prefill's logits): no decode step, no rate to print. (One stage:
    the summary is rank 0's, whatever the stage count.)"""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:2]))
    proc = torchrun(
        1, "--target", str(tiny_testbed / "target"), "--mode", "pp", "--prompts", str(prompts), "--max-new-tokens", "1"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pp: 2 prompts, 2 tokens" in proc.stdout and "(decode -), L'_acc -" in proc.stdout


@pytest.mark.slow
def test_distributed_draft_tree_equals_single_process_engine(tiny_testbed, tmp_path):
    """The training-free mode: a draft model on rank 0 feeding a sampled tree of adaptive width through 4 stage
    processes (the greedy draft tree across processes: test_bench_runtime_compares_the_tree_with_pp_in_one_world)."""
    temperature = 0.8
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "out.json"
    draft = tiny_testbed / "draft"
    proc = torchrun(
        4,
        "--target",
        str(tiny_testbed / "target"),
        "--mode",
        "tree",
        "--draft-model",
        str(draft),
        "--tree-width",
        "auto",
        "--prompts",
        str(prompts),
        "--max-new-tokens",
        "16",
        "--temperature",
        str(temperature),
        "--top-k",
        "20",
        "--seed",
        "5",
        "--emulate-link-ms",
        "1",
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    got = [r["token_ids"] for r in report["results"]["tree"]]
    want = reference_outputs(tiny_testbed, None, 4, "tree", temperature, 20, 5, 16, width="auto", draft=draft)
    assert got == [out.token_ids for out in want]
    assert [r["stats"]["token_acceptance"] for r in report["results"]["tree"]] == [
        out.stats.token_acceptance for out in want
    ]
    assert sum(r["stats"]["accepted"] for r in report["results"]["tree"]) > 0
    assert [r["stats"]["mean_width"] for r in report["results"]["tree"]] == [round(o.stats.mean_width, 4) for o in want]


@pytest.mark.slow
def test_bench_runtime_compares_the_tree_with_pp_in_one_world(tiny_testbed, tmp_path):
    """bench/bench_runtime.py --tree-width: one world per n runs tree then pp; its row compares them."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "bench.json"
    bench = [
        sys.executable,
        "-m",
        "spd.bench",
        "runtime",
        "--target",
        str(tiny_testbed / "target"),
        "--prompts",
        str(prompts),
        "--draft-model",
        str(tiny_testbed / "draft"),
        "--stages",
        "2",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        bench + ["--tree-width", "2", "--num-prompts", "2", "--max-new-tokens", "8", "--no-ar", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=REPO,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    row = report["rows"][0]
    assert report["mode"] == "tree" and row["stages"] == 2 and row["width"] == 2 and row["children"] == 4
    assert row["identical_tokens_tree_pp"] == 2  # greedy: the tree commits the plain pipeline's tokens
    assert row["efficiency"] == pytest.approx(row["speedup_vs_pp"] / row["tree"]["L_acc"])
    assert set(row["step_ms"]) == {"speculator", "verify", "stage"} and row["step_ms"]["speculator"] > 0
    # Where a step's time went on rank 0 and on the stages (the stages' clocks, asked for between the modes):
    # the parts are times (>= 0 apart from the remainders) that add up to the run's wall time per step.
    for mode in ("tree", "pp"):
        parts = row["breakdown_ms_per_step"][mode]
        assert parts["stages"]["compute"] > 0 and parts["rank0"]["verify"] > 0 and parts["rank0"]["wait"] > 0
        assert all(v >= 0 for k, v in {**parts["rank0"], **parts["stages"]}.items() if k != "other"), parts
        assert parts["messages_per_step"]["rank0_received"] > 0
    assert (
        row["breakdown_ms_per_step"]["tree"]["rank0"]["source"]
        > 0
        == row["breakdown_ms_per_step"]["pp"]["rank0"]["source"]
    )
    assert "| 2 | tree |" in proc.stdout and "| 2 | pp |" in proc.stdout
    # A token source without the tree mode is refused with one line.
    proc = subprocess.run(
        bench + ["--out", str(tmp_path / "x.json")], capture_output=True, text=True, timeout=60, cwd=REPO, env=env
    )
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: --draft-model and --stages select the tree mode's token source; add --tree-width W"
    ]


@pytest.mark.slow
def test_link_messages_arrive_intact_inline_and_spilled():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(master_port()),
            str(REPO / "tests" / "link_roundtrip.py"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 1: ok" in proc.stdout and "rank 0: ok" in proc.stdout


def test_tree_level_follows_prunes_like_the_tree():
    """A level sent before one or more prunes, mapped on arrival, equals the level as the pruned tree has it."""
    gen = torch.Generator().manual_seed(0)
    outcomes = {"dropped": 0, "mapped": 0}
    for trial in range(60):
        tree, committed = TokenTree(7), 100
        levels = [(0, 1)]
        for _ in range(4):
            bottom = tree.bottom_level().numel()
            tokens = torch.stack([torch.randperm(50, generator=gen)[:3] for _ in range(bottom)])
            logprobs = -torch.rand(bottom, 3, generator=gen) * 3
            new = tree.append_level(tokens, logprobs, 4)
            levels.append((int(new[0]), len(tree)))
        start, end = levels[1 + trial % 4]
        extra = pack_level(start, tree.positions(committed)[start:end], tree.mask()[start:end, :end])
        payload = torch.arange(end - start, dtype=torch.float32)[:, None, None].expand(-1, 1, 3)
        ids = torch.arange(start, end)  # the level's surviving nodes, followed through the prunes
        rows = torch.arange(end - start)  # and their rows in the level as sent
        log, epoch = EpochLog(), 3
        for _hop in range(1 + trial % 2):
            children = tree.children(0)
            if children.numel() == 0:
                break
            kept = tree.prune_to_child(int(children[torch.randint(children.numel(), (1,), generator=gen)]))
            epoch += 1
            log.record(epoch, kept)
            alive = torch.isin(ids, kept)
            ids, rows = torch.searchsorted(kept, ids[alive]), rows[alive]
        got = _level_now(extra, payload, 3, epoch, committed, log)
        hops = epoch - 3
        if ids.numel() == 0:
            assert got is None
            outcomes["dropped"] += 1
            continue
        outcomes["mapped"] += 1
        c, new_start, positions, mask, hidden = got
        assert c == committed + hops and new_start == int(ids[0])
        new_end = new_start + ids.numel()
        assert torch.equal(positions, tree.positions(committed + hops)[new_start:new_end])
        assert torch.equal(mask, tree.mask()[new_start:new_end, :new_end])
        assert torch.equal(hidden[:, 0, 0], rows.float())
    assert outcomes["dropped"] >= 3 and outcomes["mapped"] >= 10, outcomes
    # Anything but a prune in between (a flush, a new request) makes old work stale.
    log = EpochLog()
    log.record(5, torch.tensor([1, 2]))
    assert log.since(4, 5) is not None and log.since(4, 6) is None and log.since(3, 5) is None


def test_stage_ranks_load_only_their_layers(tiny_testbed):
    full = StagedModel.from_pretrained(tiny_testbed / "target", n_stages=4)
    layer_bytes = materialized_bytes(full.layers[0])
    parts = [load_partial(str(tiny_testbed / "target"), 4, role) for role in range(5)]
    for role in range(1, 5):
        assert materialized_bytes(parts[role]) == 2 * layer_bytes  # 8 layers / 4 stages
    driver = parts[0]
    assert materialized_bytes(driver) == sum(
        materialized_bytes(m) for m in (full.embed_tokens, full.norm, full.lm_head)
    )
    # Each stage's partial model computes what the full model's stage computes.
    ids = torch.tensor([[5, 9, 11, 3, 7]])
    hidden = full.embed(ids)
    torch.testing.assert_close(driver.embed(ids), hidden)
    for s in range(4):
        want = full.run_stage(s, hidden, full.new_caches()[s]).hidden_BTD
        got = parts[s + 1].run_stage(s, hidden, full.new_caches()[s]).hidden_BTD
        torch.testing.assert_close(got, want)
        hidden = want
    torch.testing.assert_close(driver.logits(hidden), full.logits(hidden))


def test_a_stage_machine_needs_only_the_shards_of_its_layers(tiny_testbed, tmp_path):
    """A sharded target copied with only the shards stage 3 of 4 reads: that stage loads and computes as the full
    model; rank 0's part there is refused with one line naming the missing shard; the fingerprint (the index)
    is the same as on a machine holding every shard."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from spd.runtime.handshake import target_fingerprint
    from spd.runtime.loading import Checkpoint

    full_dir, part_dir = tmp_path / "full", tmp_path / "part"
    AutoModelForCausalLM.from_pretrained(tiny_testbed / "target").save_pretrained(full_dir, max_shard_size="20KB")
    weight_map = json.loads((full_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 3
    full = StagedModel.from_pretrained(full_dir, n_stages=4)
    needed = {
        f for name, f in weight_map.items() if any(name.startswith(f"model.layers.{i}.") for i in full.stage_layers(2))
    }
    shutil.copytree(
        full_dir, part_dir, ignore=lambda _, names: [n for n in names if n.endswith(".safetensors") and n not in needed]
    )
    assert len(list(part_dir.glob("*.safetensors"))) < len(set(weight_map.values()))
    stage = load_partial(str(part_dir), 4, 3)
    hidden = full.embed(torch.tensor([[5, 9, 11, 3, 7]]))
    torch.testing.assert_close(
        stage.run_stage(2, hidden, full.new_caches()[2]).hidden_BTD,
        full.run_stage(2, hidden, full.new_caches()[2]).hidden_BTD,
    )
    with pytest.raises(SpdInputError, match="lacks the shard '.*' that holds 'model.embed_tokens.weight'"):
        load_partial(str(part_dir), 4, 0)
    config = AutoConfig.from_pretrained(full_dir)
    assert target_fingerprint(config, Checkpoint(str(part_dir))) == target_fingerprint(
        config, Checkpoint(str(full_dir))
    )


def _pids_with(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes().decode(errors="ignore"):
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc to find the stage process")
def test_killed_stage_makes_every_rank_exit_cleanly(tiny_testbed, heads, tmp_path):
    marker = f"--prompts={tmp_path}/kill.jsonl"  # unique in this test's command lines
    (tmp_path / "kill.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS * 20))
    log = tmp_path / "stderr.txt"
    # torchrun's agent SIGTERMs the survivors once it sees a dead child; polling every 10 s (instead of every
    # 0.1 s) leaves them the time to notice the loss themselves, which is what this test checks.
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "5",
        "--master-port",
        str(master_port()),
        "--monitor-interval",
        "10",
        "-m",
        "spd.cli.run_pipeline",
        "--target",
        str(tiny_testbed / "target"),
        "--speculator",
        str(heads[4]),
        "--mode",
        "spd",
        marker,
        "--max-new-tokens",
        "64",
        "--emulate-stage-ms",
        "20",
        "--timeout-s",
        "20",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, cwd=REPO, env=env)
        deadline = time.monotonic() + 240
        started = f"1/{len(PROMPTS) * 20} prompts"
        while started not in log.read_text() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
        assert started in log.read_text(), log.read_text()[-2000:]
        victim = next(pid for pid in _pids_with(marker) if _rank_of(pid) == 2)
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        try:
            code = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    elapsed = time.monotonic() - killed_at
    text = log.read_text()
    assert code != 0
    assert elapsed < 60, f"took {elapsed:.0f} s to stop"
    assert "error: rank" in text, text[-2000:]
    time.sleep(1)
    assert _pids_with(marker) == [], "orphan processes left behind"


@pytest.mark.slow
def test_spd_generate_runtime_distributed_matches_local(tiny_testbed, heads):
    from helpers.cli import spd_generate, spd_generate_main

    common = [
        "--target",
        str(tiny_testbed / "target"),
        "--mode",
        "spd",
        "--speculator",
        str(heads[2]),
        "--prompt",
        "import os\n",
        "--max-new-tokens",
        "16",
        "--json",
    ]
    # Greedy: the local process may use 2 threads and the ranks 1, and sampled draws could then differ in
    # the last bits; seeded sampling equality is tested above with the thread count pinned.
    runs = [
        common,
        [*common, "--runtime", "distributed", "--emulate-stage-ms", "1"],
        [*common[:-1], "--runtime", "distributed", "--stages", "4"],
        ["--target", str(tiny_testbed / "target"), "--prompt", "x", "--runtime", "distributed"],
    ]
    # The distributed run in its own process (it starts the ranks); the local run and the two refusals, which
    # start none, in this one.
    remote = spd_generate(*runs[1])
    local, bad, ar = (spd_generate_main(*args) for args in (runs[0], runs[2], runs[3]))
    assert local.returncode == 0 and remote.returncode == 0, remote.stderr
    a, b = json.loads(local.stdout), json.loads(remote.stdout)
    assert a["token_ids"] == b["token_ids"] and a["stats"]["steps"] == b["stats"]["steps"]
    assert bad.returncode == 2 and bad.stderr.startswith("error: the speculator does not fit"), bad.stderr
    assert ar.returncode == 2 and "--runtime distributed runs --mode spd, pp or tree" in ar.stderr
