"""Offline training from a capture, and draft vocabularies: equal to online training, resumable, lossless."""

import json
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO
from helpers.distill import train
from spd.data.prepare import DataConfig, prepare_dataset
from spd.decoding.engine import Engine
from spd.errors import SpdInputError
from spd.heads.draft_vocab import check_draft_vocab, select_draft_vocab, token_counts, tokens_sha256
from spd.heads.loading import load_speculator
from spd.target.staging import StagedModel
from spd.target.tokenizer import load_tokenizer
from spd.training.capture import CapturedDataset, CapturedTarget, collate_captured
from spd.training.capture_writer import plan_shards
from spd.training.distill import DistillConfig, collate, distill_step, new_head, teacher_anchors, teacher_pass
from spd.training.kd import kd_loss, kd_loss_topk

MAX_LENGTH = 48


def _capture(tb, out, *extra, check=True, cache=None, data=None):
    args = [
        sys.executable,
        str(REPO / "data" / "capture.py"),
        "--target",
        str(tb / "target"),
        "--data",
        str(data or tb / "corpus" / "train.jsonl"),
        "--max-length",
        str(MAX_LENGTH),
        "--out",
        str(out),
        "--stages",
        "2,4",
        "--cache-dir",
        str(cache or out.parent / "cache"),
        *extra,
    ]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=REPO)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def subset(tiny_testbed, tmp_path_factory):
    """The first file of the tiny testbed's corpus (a few hundred rows at MAX_LENGTH)."""
    path = tmp_path_factory.mktemp("subset") / "subset.jsonl"
    path.write_text((tiny_testbed / "corpus" / "train.jsonl").read_text().splitlines()[0] + "\n")
    return path


@pytest.fixture(scope="module")
def captured(tiny_testbed, subset):
    """A full-teacher capture of ``subset``, in several shards."""
    out = subset.parent / "capture"
    proc = _capture(tiny_testbed, out, "--shard-tokens", "600", "--batch-tokens", "256", data=subset)
    assert "needs" in proc.stdout and "GiB on disk" in proc.stdout  # the size is announced before the work
    return out


def _rows(tb, data=None):
    tok = load_tokenizer(str(tb / "target"))
    ds = prepare_dataset(str(data or tb / "corpus" / "train.jsonl"), tok, DataConfig(max_length=MAX_LENGTH))
    return [ds[i] for i in range(len(ds))], tok


@pytest.mark.slow
def test_capture_holds_the_targets_states_and_rows(tiny_testbed, subset, captured):
    ds = CapturedDataset(captured)
    manifest = ds.manifest
    rows, _ = _rows(tiny_testbed, subset)
    assert manifest["complete"] and len(ds) == len(rows) and len(manifest["shards"]) > 2
    staged = StagedModel.from_pretrained(str(tiny_testbed / "target"))
    big_l = staged.num_layers
    assert big_l == 8 and ds.states == [0, 1, 2, 3, 4, 6, 8]  # the default anchors of n = 2 and n = 4
    for i in (0, len(rows) // 2, len(rows) - 1):  # rows in the first, a middle and the last shard
        row = ds[i]
        assert row["input_ids"].tolist() == rows[i]["input_ids"]
        assert row["loss_mask"].long().tolist() == rows[i]["loss_mask"]
        want = staged.hidden_states(torch.tensor([rows[i]["input_ids"]]), ds.states)
        for a in ds.states:
            torch.testing.assert_close(row["hidden"][a], want[a][0], atol=1e-5, rtol=1e-5)
    # The stand-in target: same shape, same teacher logits.
    target = CapturedTarget(captured, n_stages=2)
    assert (target.vocab_size, target.num_layers, target.boundaries) == (
        staged.vocab_size,
        big_l,
        [0, big_l // 2, big_l],
    )
    h = torch.randn(3, staged.config.hidden_size)
    torch.testing.assert_close(target.logits(h), staged.logits(h), atol=1e-5, rtol=1e-5)


def test_offline_step_equals_online_step(tiny_testbed, subset, captured):
    """The same batch, online (target forward) and offline (capture): same loss, same gradients."""
    staged = StagedModel.from_pretrained(str(tiny_testbed / "target"), n_stages=4)
    offline_target = CapturedTarget(captured, n_stages=4)
    cfg = DistillConfig(target=str(tiny_testbed / "target"), n_stages=4)
    torch.manual_seed(0)
    head = new_head(staged, cfg)
    rows, tok = _rows(tiny_testbed, subset)
    online = collate(rows[:6], tok.pad_token_id or 0)
    ds = CapturedDataset(captured)
    offline = collate_captured([ds[i] for i in range(6)], ds.manifest["pad_id"])
    assert torch.equal(online["input_ids"], offline["input_ids"]) and torch.equal(
        online["supervised"], offline["supervised"]
    )
    fill = torch.tensor([4, 1, 2, 4, 3, 4])
    results = []
    for target, batch in ((staged, online), (offline_target, offline)):
        head.zero_grad()
        hidden = teacher_pass(target, teacher_anchors(head, target), batch)
        loss, result = distill_step(head, target, hidden, batch, fill, 1.0, 64)
        loss.backward()
        results.append((float(loss.detach()), result.agree, {k: p.grad.clone() for k, p in head.named_parameters()}))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-5) and results[0][1] == results[1][1]
    for name, grad in results[0][2].items():
        torch.testing.assert_close(results[1][2][name], grad, atol=1e-6, rtol=1e-4)


def _common(out):
    return [
        "n_stages=4",
        f"max_length={MAX_LENGTH}",
        "batch_size=4",
        "max_steps=5",
        "save_every=0",
        "eval_every=0",
        "eval_rows=4",
        "lr=3e-3",
        "warmup_steps=1",
        f"output_dir={out}",
        f"cache_dir={out.parent / 'cache'}",
    ]


@pytest.mark.slow
def test_offline_training_equals_online_training(tiny_testbed, subset, captured, tmp_path):
    """Five optimizer steps on the same rows: the trainer online and from the capture ends with the same head."""
    tb = tiny_testbed
    train(f"target={tb / 'target'}", f"data={subset}", "eval_data=none", *_common(tmp_path / "online"))
    train(f"data={captured}", "eval_data=none", *_common(tmp_path / "offline"))
    online = load_file(tmp_path / "online" / "final" / "model.safetensors")
    offline = load_file(tmp_path / "offline" / "final" / "model.safetensors")
    assert online.keys() == offline.keys()
    for name, weight in online.items():
        torch.testing.assert_close(offline[name], weight, atol=1e-4, rtol=1e-3)
    summary = json.loads((tmp_path / "offline" / "summary.json").read_text())
    assert summary["config"]["target"] == str(tb / "target")  # the head records the captured target


@pytest.mark.slow
def test_killed_capture_resumes_to_the_same_files(tiny_testbed, subset, tmp_path, captured):
    out = tmp_path / "cap"
    args = [
        sys.executable,
        str(REPO / "data" / "capture.py"),
        "--target",
        str(tiny_testbed / "target"),
        "--data",
        str(subset),
        "--max-length",
        str(MAX_LENGTH),
        "--out",
        str(out),
        "--stages",
        "2,4",
        "--cache-dir",
        str(tmp_path / "cache"),
        "--shard-tokens",
        "600",
        "--batch-tokens",
        "256",
    ]
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    # Killed as soon as the first shard is in: the later ones are still to come however fast this machine is.
    while time.time() < deadline and not (out / "shard-00000.safetensors").exists():
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    manifest = json.loads((out / "capture.json").read_text())
    assert not manifest["complete"], "the capture finished before it could be killed"
    with pytest.raises(SpdInputError, match="incomplete"):
        CapturedDataset(out)
    # What a kill in the middle of a write leaves (and what an earlier version's writer left) goes on resume.
    (out / ".shard-00001.safetensors.k1ll3d0k.tmp").write_bytes(b"half")
    (out / "shard-00002.safetensors.tmp").write_bytes(b"half")
    (out / "notes.txt").write_text("mine")
    rerun = subprocess.run(args, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert rerun.returncode == 0 and "resuming" in rerun.stdout, rerun.stderr
    assert not list(out.glob("*.tmp")) and (out / "notes.txt").read_text() == "mine"
    for shard in json.loads((captured / "capture.json").read_text())["shards"]:
        want, got = load_file(captured / shard["file"]), load_file(out / shard["file"])
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    # Other settings into the same directory: refused, naming the difference.
    other = _capture(
        tiny_testbed,
        out,
        "--shard-tokens",
        "600",
        "--batch-tokens",
        "256",
        "--teacher",
        "topk",
        check=False,
        data=subset,
    )
    assert other.returncode == 2 and "other settings" in other.stderr and "teacher" in other.stderr


@pytest.mark.slow
def test_topk_teacher_capture_trains(tiny_testbed, tmp_path):
    out = tmp_path / "topk"
    _capture(tiny_testbed, out, "--max-rows", "24", "--teacher", "topk", "--topk", "8")
    ds = CapturedDataset(out)
    row = ds[0]
    assert row["topk_ids"].shape == (len(row["input_ids"]), 8)
    assert bool((row["topk_logprobs"][:, :-1] >= row["topk_logprobs"][:, 1:]).all())
    train(f"data={out}", "eval_data=none", *_common(tmp_path / "run"))
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
    bad = train(f"data={out}", "eval_data=none", "tau=2", *_common(tmp_path / "run2"), check=False)
    assert bad.returncode == 2 and "tau=1" in bad.stderr


@torch.no_grad()
def test_topk_loss_with_every_token_is_the_full_loss():
    torch.manual_seed(0)
    student, teacher = torch.nn.Linear(8, 16), torch.nn.Linear(8, 16)
    s, t = torch.randn(10, 8), torch.randn(10, 8)
    full = kd_loss(s, t, student, teacher, 1.0, 4)
    logp = torch.log_softmax(teacher(t).detach(), dim=-1).topk(16)
    top = kd_loss_topk(s, logp.indices, logp.values, student, 4)
    assert float(top.loss_sum) == pytest.approx(float(full.loss_sum), rel=1e-4, abs=1e-5) and top.agree == full.agree
    # Fewer tokens: the rest of the mass is one bucket; the loss is the KL between the bucketed distributions.
    logp3 = torch.log_softmax(teacher(t).detach(), dim=-1).topk(3)
    top3 = kd_loss_topk(s, logp3.indices, logp3.values, student, 4)
    q = torch.softmax(student(s), -1)
    p = torch.softmax(teacher(t), -1)
    qk, pk = q.gather(-1, logp3.indices), p.gather(-1, logp3.indices)
    pb = torch.cat([pk, 1 - pk.sum(-1, keepdim=True)], -1)
    qb = torch.cat([qk, 1 - qk.sum(-1, keepdim=True)], -1)
    assert float(top3.loss_sum) == pytest.approx(float((pb * (pb.log() - qb.log())).sum()), rel=1e-4)


@pytest.mark.slow
def test_offline_training_refuses_bad_input(tiny_testbed, captured, tmp_path):
    proc = train(
        f"data={captured}",
        f"eval_data={tiny_testbed / 'corpus' / 'validation.jsonl'}",
        *_common(tmp_path / "a"),
        check=False,
    )
    assert proc.returncode == 2 and "eval_data must be one too" in proc.stderr
    proc = train(f"data={captured}", "eval_data=none", *_common(tmp_path / "b"), "n_stages=8", check=False)
    assert proc.returncode == 2 and "capture with --stages 8" in proc.stderr
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "data" / "capture.py"),
            "--target",
            str(tiny_testbed / "target"),
            "--data",
            str(tiny_testbed / "corpus" / "train.jsonl"),
            "--out",
            str(tmp_path / "c"),
            "--stages",
            "9",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 2 and "error: 9 stages cannot cut the target's 8 layers" in proc.stderr


def test_capture_anchors_for_uneven_cuts():
    """n that does not divide the layers stores the anchors of the balanced cut (what the presets train)."""
    from spd.heads.config import default_anchors
    from spd.target.cut import balanced_boundaries
    from spd.training.capture_writer import anchors_for_stages

    assert anchors_for_stages(8, [3]) == sorted({a for d in default_anchors(balanced_boundaries(8, 3)) for a in d})
    assert anchors_for_stages(30, [4]) == [0, 4, 8, 11, 15, 16, 23, 30]


def test_shards_are_planned_from_row_lengths():
    assert plan_shards([5, 5, 5, 5, 5], 10) == [(0, 2), (2, 4), (4, 5)]
    assert plan_shards([30, 1], 10) == [(0, 1), (1, 2)]


# ------------------------------------------------------------------------------------- draft vocabulary


def test_draft_vocab_selection_breaks_ties_by_id():
    counts = torch.tensor([0, 5, 3, 5, 1, 3, 0])
    assert select_draft_vocab(counts, 3).tolist() == [1, 2, 3]  # 5, 5, then the lower of the two 3s
    assert select_draft_vocab(counts, 6).tolist() == [0, 1, 2, 3, 4, 5]
    assert token_counts([([1, 2, 2, 3], [0, 1, 1, 0])], 5).tolist() == [0, 0, 2, 0, 0]
    with pytest.raises(SpdInputError, match="draft_vocab_size"):
        select_draft_vocab(counts, 8)


@torch.no_grad()
def test_kd_over_the_whole_vocab_as_draft_vocab_is_the_full_kd():
    torch.manual_seed(0)
    student, teacher = torch.nn.Linear(8, 16), torch.nn.Linear(8, 16)
    s, t = torch.randn(10, 8), torch.randn(10, 8)
    full = kd_loss(s, t, student, teacher, 1.0, 4)
    as_draft = kd_loss(s, t, student, teacher, 1.0, 4, torch.arange(16))
    assert float(as_draft.loss_sum) == pytest.approx(float(full.loss_sum), rel=1e-6) and as_draft.agree == full.agree


@pytest.fixture(scope="module")
def draft_head(tiny_testbed, tmp_path_factory):
    """A head with a 64-token draft vocabulary trained briefly from the target online."""
    out = tmp_path_factory.mktemp("draft") / "run"
    tb = tiny_testbed
    train(
        f"target={tb / 'target'}",
        f"data={tb / 'corpus' / 'train.jsonl'}",
        "eval_data=none",
        "draft_vocab_size=64",
        *_common(out),
        "max_steps=30",
    )
    return out / "final"


@pytest.mark.slow
def test_draft_vocab_head_round_trip(tiny_testbed, draft_head):
    head = load_speculator(str(draft_head))
    tok = load_tokenizer(str(tiny_testbed / "target"))
    rows, _ = _rows(tiny_testbed)
    want = select_draft_vocab(
        token_counts([(r["input_ids"], r["loss_mask"]) for r in rows], head.config.vocab_size), 64
    )
    assert head.config.draft_vocab_size == 64 and head.lm_head.weight.shape[0] == 64
    assert torch.equal(head.draft_ids, want)
    assert head.config.draft_vocab_sha256 == tokens_sha256(tok.convert_ids_to_tokens(want.tolist()))
    logits = head.vocab_logits(torch.randn(2, head.config.hidden_size))
    assert logits.shape == (2, head.config.vocab_size)
    assert torch.isinf(logits).sum() == 2 * (head.config.vocab_size - 64)

    # Validated against the target at load: a tokenizer with other strings, or ids out of range, are refused.
    class Renamed:
        def convert_ids_to_tokens(self, ids):
            return [f"x{i}" for i in ids]

    with pytest.raises(SpdInputError, match="does not match this target's tokenizer"):
        check_draft_vocab(head, head.config.vocab_size, Renamed())
    with pytest.raises(SpdInputError, match="outside the target's vocabulary"):
        check_draft_vocab(head, int(head.draft_ids.max()), tok)


@pytest.mark.parametrize("mode", ["spd", "tree"])
def test_draft_vocab_head_decodes_losslessly(tiny_testbed, draft_head, mode):
    engine = Engine.from_pretrained(str(tiny_testbed / "target"), speculator=str(draft_head))
    prompts = ["def parse(", "import os\n", "class A:"]
    for prompt in prompts:
        ar = engine.generate(prompt, 40, mode="ar")
        if mode == "spd":
            out = engine.generate(prompt, 40, mode="spd")
        else:
            from spd.decoding.engine import tree_proposer

            tree = Engine.tree(
                engine.staged,
                tree_proposer(
                    engine.staged, engine.proposer.head, engine.tokenizer, None, None, 2, torch.float32, "cpu"
                ),
                2,
                engine.tokenizer,
            )
            out = tree.generate(prompt, 40)
        assert out.token_ids == ar.token_ids
        assert out.stats.accepted > 0  # the head's draft tokens do get accepted
