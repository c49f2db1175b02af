"""The distillation trainer as users run it: real processes, real files, kill and resume."""

import json
import math
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, run_main, run_script, tiny_model
from helpers.distill import distill_args, train
from spd.errors import SpdInputError
from spd.heads.config import check_compatible
from spd.heads.speculator import Speculator
from spd.target.staging import StagedModel
from spd.training.distill import DistillConfig, new_head, scale_fc_init
from spd.training.evaluation import expected_accept_length
from spd.training.kd import sample_fills
from spd.training.presets import load_config


@pytest.mark.slow
def test_killed_and_resumed_run_ends_with_the_same_weights(tiny_testbed, tmp_path):
    train(*distill_args(tiny_testbed, tmp_path / "straight", eval_every=2))
    # Same run, killed (SIGKILL, no chance to clean up) once a checkpoint exists, then resumed.
    out = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "train" / "distill.py"), *distill_args(tiny_testbed, out, eval_every=2)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=REPO,
    )
    deadline = time.time() + 300
    while not (out / "checkpoints" / "step-4" / "trainer_state.json").exists():
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.time() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "final").exists()
    resumed = train(*distill_args(tiny_testbed, out, eval_every=2), "--resume")
    assert "[resume] step-" in resumed.stdout + resumed.stderr
    a = load_file(tmp_path / "straight" / "final" / "model.safetensors")
    b = load_file(out / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    summary = json.loads((out / "summary.json").read_text())
    assert summary["step"] == 8
    # The data curve survives the kill: the same evaluations at the same supervised token counts.
    straight = json.loads((tmp_path / "straight" / "summary.json").read_text())
    curve = [{k: v for k, v in e.items() if k != "train_minutes"} for e in summary["evals"]]
    assert curve == [{k: v for k, v in e.items() if k != "train_minutes"} for e in straight["evals"]]
    assert [e["step"] for e in curve] == [2, 4, 6, 8] and summary["tokens_seen"] == straight["tokens_seen"]
    loaded = Speculator.from_pretrained(out / "final")
    assert loaded.config.n_stages == 4


def test_final_head_reports_agreement_per_fill(tiny_testbed, tmp_path):
    out = tmp_path / "run"
    train(*distill_args(tiny_testbed, out, "max_steps=3", "save_every=0", eval_steps="[1,2]"))
    summary = json.loads((out / "summary.json").read_text())
    ev = summary["eval"]
    assert set(ev["top1_by_fill"]) == {"1", "2", "3", "4"}
    # Every evaluation, with the supervised tokens trained on by then (3 rows of at most 48 tokens a step).
    assert [e["step"] for e in summary["evals"]] == [1, 2, 3]
    seen = [e["tokens_seen"] for e in summary["evals"]]
    assert 0 < seen[0] < seen[1] < seen[2] == summary["tokens_seen"] <= 3 * 3 * 48
    assert summary["evals"][-1]["top1_full"] == ev["top1_full"]
    assert 0 <= ev["top1_full"] <= 1 and 1 <= ev["L_acc_est"] <= 4
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-3"]


@pytest.mark.slow
def test_named_eval_sets_are_each_measured_and_together(tiny_testbed, tmp_path):
    """eval_data={text: A, code: B}: each set is evaluated on its own (the numbers a run with that set alone gives)
    and the two together (positions add up), at every evaluation, step 0 (before training) included."""
    val = tiny_testbed / "corpus" / "validation.jsonl"
    code = tmp_path / "code.jsonl"
    code.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n"}) + "\n" for i in range(5)))
    cfg = load_config(None, [f"eval_data={{text: {val}, code: {code}}}"])
    assert cfg.eval_data == {"text": str(val), "code": str(code)}
    named, alone = tmp_path / "named", tmp_path / "alone"
    named_sets = f"eval_data={{text: {val}, code: {code}}}"
    train(*distill_args(tiny_testbed, named, "max_steps=2", "save_every=0", "eval_steps=[0]", named_sets))
    train(*distill_args(tiny_testbed, alone, "max_steps=2", "save_every=0", eval_data=val))
    evals = json.loads((named / "summary.json").read_text())["evals"]
    single = json.loads((alone / "summary.json").read_text())["evals"]
    # Step 0 is the head before training (init_from's, here a fresh one); every evaluation has both sets.
    assert [e["step"] for e in evals] == [0, 2] and all(set(e["sets"]) == {"text", "code"} for e in evals)
    assert evals[0]["tokens_seen"] == 0 and evals[0]["sets"]["text"] != evals[1]["sets"]["text"]
    sets = evals[-1]["sets"]
    assert sets["text"]["top1_full"] == pytest.approx(single[-1]["top1_full"])
    assert sets["text"]["L_acc_est"] == pytest.approx(single[-1]["L_acc_est"])
    assert evals[-1]["positions"] == sets["text"]["positions"] + sets["code"]["positions"] > 0
    with pytest.raises(SpdInputError, match="eval_data"):
        load_config(None, ["eval_data={text: }"])


@pytest.mark.slow
def test_two_process_cpu_data_parallel(tiny_testbed, tmp_path):
    """Two real processes on gloo, launched by accelerate (torchrun underneath), both ranks training.

    accelerate's ``--cpu --num_processes 2`` starts one process unless mpirun is configured; the
    launcher that spawns several CPU processes is ``--multi_gpu`` with ``ACCELERATE_USE_CPU=true``.
    """
    out = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            str(random.randint(20000, 40000)),
            str(REPO / "train" / "distill.py"),
            *distill_args(tiny_testbed, out, "max_steps=4"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["step"] == 4
    assert (out / "final" / "model.safetensors").is_file()


def test_bf16_teacher_on_cpu_trains_a_float32_head(tiny_testbed, tmp_path):
    """target_dtype=bfloat16 with bf16 autocast (the fast setting on CPUs with AMX): the run ends, the head is
    stored in float32 and it agrees with the target better than chance on held-out text."""
    out = tmp_path / "run"
    train(
        *distill_args(tiny_testbed, out, "max_steps=4", "save_every=0", "target_dtype=bfloat16", "mixed_precision=bf16")
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["target_dtype"] == "bfloat16" and summary["step"] == 4
    assert 0 < summary["eval"]["top1_full"] <= 1 and math.isfinite(summary["eval"]["kd_loss"])
    assert {t.dtype for t in load_file(out / "final" / "model.safetensors").values()} == {torch.float32}


def test_a_list_of_datasets_trains_on_their_rows_mixed(tiny_testbed, tmp_path):
    """data=[text, chats]: both are prepared and their rows mixed; the draft vocabulary counts both."""
    chats = tmp_path / "chats.jsonl"
    chats.write_text(
        "\n".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"Write f{i}."},
                        {"role": "assistant", "content": f"def f{i}():\n    return {i}"},
                    ]
                }
            )
            for i in range(6)
        )
        + "\n"
    )
    cfg = load_config(None, [f"data=[{tiny_testbed / 'corpus' / 'train.jsonl'}, {chats}]"])
    assert cfg.data == [str(tiny_testbed / "corpus" / "train.jsonl"), str(chats)]
    out = tmp_path / "run"
    base = [
        a
        for a in distill_args(tiny_testbed, out, "max_steps=2", "save_every=0", "draft_vocab_size=64")
        if not a.startswith("data=")
    ]
    train(*base, f"data=[{tiny_testbed / 'corpus' / 'train.jsonl'}, {chats}]")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["data"] == [str(tiny_testbed / "corpus" / "train.jsonl"), str(chats)]
    assert Speculator.from_pretrained(out / "final").config.draft_vocab_size == 64


def _bad_input(tiny_testbed, tmp_path, args, expected, in_process):
    from spd.cli.distill import main

    base = distill_args(tiny_testbed, tmp_path / "x")
    keys = {a.split("=")[0] for a in args if "=" in a}
    argv = [*[a for a in base if a.split("=")[0] not in keys], *args]
    proc = run_main(main, *argv) if in_process else train(*argv, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error:") and expected in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "args,expected",
    [
        (["data=[]"], "bad value for data"),
        (["bogus_key=1"], "unknown config key 'bogus_key'"),
        (["target_dtype=float16"], "target_dtype must be auto, float32 or bfloat16"),
        (["max_steps=ten"], "bad value for max_steps"),
        (["variant=medusa"], "variant must be one of"),
        (["eval_steps=[-1, 5]"], "eval_steps must be a list of steps of at least 0"),
        (["threads=0"], "threads must be at least 1"),
        (["--config", "/no/such.yaml"], "config file"),
    ],
)
def test_bad_settings_are_one_clear_error(tiny_testbed, tmp_path, args, expected):
    """Refused while the settings are read, before anything is loaded: main(argv) in this process."""
    _bad_input(tiny_testbed, tmp_path, args, expected, in_process=True)


@pytest.mark.parametrize(
    "args,expected",
    [(["n_stages=9"], "9 stages need at least 9 layers"), (["data=/no/such/data.jsonl"], "does not exist")],
)
def test_bad_target_or_data_is_one_clear_error(tiny_testbed, tmp_path, args, expected):
    """Refused once the accelerator, the target and the data load: in a process of its own, as a user runs it."""
    _bad_input(tiny_testbed, tmp_path, args, expected, in_process=False)


def test_presets_load_and_override(tmp_path):
    for preset in ("testbed-n4", "testbed-n4-regen", "testbed-n8", "qwen3-8b-n8", "smollm2-n8-text", "smollm2-n8-mix"):
        cfg = load_config(
            str(REPO / "configs" / f"{preset}.yaml"), ["output_dir=/tmp/x", "lr=2e-4", "boundaries=[1,2]"]
        )
        assert cfg.output_dir == "/tmp/x" and cfg.lr == 2e-4 and cfg.boundaries == [1, 2]
    # The serial baseline learns from the SPD mix preset's data, rows and budget.
    spd, eagle = (load_config(str(REPO / "configs" / f"smollm2-{p}.yaml"), []) for p in ("n8-mix", "eagle-mix"))
    assert eagle.variant == "eagle" and eagle.n_stages == 1 and eagle.boundaries is None
    same = ("data", "eval_data", "max_length", "batch_size", "lr", "warmup_steps", "max_steps", "target_dtype")
    assert all(getattr(eagle, key) == getattr(spd, key) for key in (*same, "draft_vocab_size", "mixed_precision"))
    # The one-epoch run (the published head) is the mix preset over the whole mixture, evaluated along the way.
    epoch = load_config(str(REPO / "configs" / "smollm2-n8-epoch.yaml"), [])
    assert epoch.max_steps is None and epoch.epochs == 1 and epoch.eval_steps and epoch.save_every
    assert all(getattr(epoch, key) == getattr(spd, key) for key in (*set(same) - {"max_steps"}, "boundaries"))
    # The n = 4 head is the same epoch on the n = 4 cut of the capture-based n = 4 preset.
    n4, n4_capture = (load_config(str(REPO / "configs" / f"smollm2-{p}.yaml"), []) for p in ("n4-epoch", "n4"))
    assert n4.n_stages == 4 and n4.boundaries == n4_capture.boundaries == [0, 8, 16, 23, 30]
    kept = ("data", "eval_data", "epochs", "lr", "warmup_steps", "batch_size", "target_dtype", "draft_vocab_size")
    assert all(getattr(n4, key) == getattr(epoch, key) for key in kept)
    # The chat, math and code heads start from the epoch heads, on their cuts, measured per kind of request.
    for n, start in ((8, epoch), (4, n4)):
        self_cfg = load_config(str(REPO / "configs" / f"smollm2-n{n}-self.yaml"), [])
        assert self_cfg.init_from == f"runs/smollm2-n{n}-epoch/final" and self_cfg.boundaries == start.boundaries
        assert set(self_cfg.eval_data) == {"chat", "math", "code", "stdlib"} and 0 in self_cfg.eval_steps
        assert self_cfg.draft_vocab_size == start.draft_vocab_size and len(self_cfg.data) > 1
    no_eval = tmp_path / "no-eval.yaml"
    no_eval.write_text("target: /m/target\ndata: '{target}/../d.jsonl'\neval_data: null\n")
    assert (load_config(str(no_eval), []).data, load_config(str(no_eval), []).eval_data) == ("/m/d.jsonl", None)
    bad = tmp_path / "bad.yaml"
    bad.write_text("n_stages: 4\nlearning_rate: 1\n")
    with pytest.raises(SpdInputError, match="learning_rate"):
        load_config(str(bad), [])


def test_cpu_training_threads(monkeypatch):
    """accelerate launch's OMP_NUM_THREADS=1 default gives way to the machine's cores shared among its processes;
    any other setting, a run not started by accelerate, a GPU and an explicit threads=N are kept."""
    import psutil

    from spd.training.backends import cpu_threads

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5}, raising=False)
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 6 if logical else 4)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    assert cpu_threads(None, cpu) is None and cpu_threads(3, cpu) == 3  # python train/distill.py: OMP_NUM_THREADS
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    assert cpu_threads(None, cpu) == 4  # the physical cores, not the 6 logical ones
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert cpu_threads(None, cpu) == 1 and cpu_threads(2, cpu) == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert cpu_threads(None, cpu) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert cpu_threads(None, cpu) is None
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert cpu_threads(None, gpu) is None and cpu_threads(5, gpu) == 5


def test_batches_pad_to_a_multiple_and_the_padding_changes_no_loss():
    """Rows padded to a multiple of 8 (never past the limit) give the loss and gradients of rows padded to the
    longest: padding is neither attended to nor supervised, it only bounds the shapes the kernels see."""
    from spd.training.distill import collate, distill_step, teacher_anchors, teacher_pass

    rows = [{"input_ids": list(range(3, 3 + length)), "loss_mask": [0, 0] + [1] * (length - 2)} for length in (5, 11)]
    assert collate(rows, 0)["input_ids"].shape == (2, 11)
    assert collate(rows, 0, multiple=8)["input_ids"].shape == (2, 16)
    assert collate(rows, 0, multiple=8, limit=13)["input_ids"].shape == (2, 13)
    assert collate(rows, 0, multiple=8, limit=9)["input_ids"].shape == (2, 11)  # never shorter than a row
    padded = collate(rows, 0, multiple=8)
    assert padded["supervised"].sum() == collate(rows, 0)["supervised"].sum() == 3 + 9
    assert not padded["valid"][:, 11:].any() and not padded["supervised"][:, 11:].any()

    staged = StagedModel(tiny_model("llama"), 2)
    torch.manual_seed(0)
    head = new_head(staged, DistillConfig(n_stages=2))
    fill_B = torch.tensor([1, 2])
    results = []
    for batch in (collate(rows, 0), padded):
        head.zero_grad()
        hidden = teacher_pass(staged, teacher_anchors(head, staged), batch)
        loss, _ = distill_step(head, staged, hidden, batch, fill_B, tau=1.0, chunk=4)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in head.parameters() if p.grad is not None]))
    torch.testing.assert_close(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(a, b)


def test_the_last_kd_chunk_is_padded_and_its_padding_left_out():
    """Every chunk the LM heads see has a multiple of ``pad_to`` rows (the last padded with zero rows), and the loss,
    its gradient and the agreements are those of the positions alone: the plain sum over every position."""
    import torch.nn.functional as F

    from spd.training import kd

    torch.manual_seed(0)
    student, teacher = torch.nn.Linear(8, 16), torch.nn.Linear(8, 16)
    rows_seen = []
    student.register_forward_hook(lambda module, args, out: rows_seen.append(args[0].shape[0]))
    s, t = torch.randn(13, 8, requires_grad=True), torch.randn(13, 8)
    result = kd.kd_loss(s, t, student, teacher, 1.0, 8, pad_to=4)
    assert rows_seen[0] == 8 and rows_seen[1] == 8  # 13 positions: 8, then 5 padded to 8
    log_p, log_q = F.log_softmax(teacher(t), -1).detach(), F.log_softmax(student(s), -1)
    expected = (log_p.exp() * (log_p - log_q)).sum()
    torch.testing.assert_close(result.loss_sum, expected)
    assert result.count == 13 and result.agree == int((log_q.argmax(-1) == log_p.argmax(-1)).sum())
    (grad,) = torch.autograd.grad(result.loss_sum, s)
    torch.testing.assert_close(grad, torch.autograd.grad(expected, s)[0])
    top = log_p.topk(16)
    topk = kd.kd_loss_topk(s, top.indices, top.values, student, 8, pad_to=4)
    torch.testing.assert_close(topk.loss_sum, expected, rtol=1e-4, atol=1e-5)
    assert topk.agree == result.agree


def test_head_must_fit_the_target():
    staged = StagedModel(tiny_model("llama"), 4)
    head = new_head(staged, DistillConfig(n_stages=4))
    check_compatible(head.config, staged)
    torch.testing.assert_close(head.lm_head.weight, staged.lm_head.weight)
    with pytest.raises(SpdInputError, match="hidden size"):
        check_compatible(head.config, StagedModel(tiny_model("llama", hidden_size=32), 4))
    with pytest.raises(SpdInputError, match="vocabulary"):
        check_compatible(head.config, StagedModel(tiny_model("llama", vocab=100), 4))
    with pytest.raises(SpdInputError, match="trained for n = 4 stages"):
        check_compatible(head.config, StagedModel(tiny_model("llama"), 2))
    with pytest.raises(SpdInputError, match="but the pipeline has 4 stages of 1, 1, 1, 5 layers"):
        check_compatible(head.config, StagedModel(tiny_model("llama"), boundaries=[0, 1, 2, 3, 8]))
    with pytest.raises(SpdInputError, match="target layers"):
        check_compatible(head.config, StagedModel(tiny_model("llama", layers=4), 4))


def test_a_head_moved_to_another_draft_vocabulary_keeps_what_it_learned():
    """with_draft_vocab: a token both vocabularies hold keeps the head's trained LM-head row (so its logit is
    unchanged), a new token starts from the target's row, every other weight is the head's."""
    from spd.training.distill import with_draft_vocab

    staged = StagedModel(tiny_model("llama"), 4)
    old_ids = torch.arange(0, 60, 2)  # even ids
    head = new_head(staged, DistillConfig(n_stages=4), old_ids, None)
    with torch.no_grad():
        head.lm_head.weight.add_(torch.randn_like(head.lm_head.weight))  # "trained": far from the target's rows
    new_ids = torch.arange(30, 70)  # half of it new (odd ids, and 60 and up)
    moved = with_draft_vocab(head, staged, new_ids, "abc")
    assert moved.config.draft_vocab_size == 40 and moved.config.draft_vocab_sha256 == "abc"
    assert torch.equal(moved.draft_ids, new_ids)
    for row, token in enumerate(new_ids.tolist()):
        source = head.lm_head.weight[token // 2] if token < 60 and token % 2 == 0 else staged.lm_head.weight[token]
        torch.testing.assert_close(moved.lm_head.weight[row], source)
    same = {k: v for k, v in head.state_dict().items() if k not in ("lm_head.weight", "draft_ids")}
    assert all(torch.equal(moved.state_dict()[k], v) for k, v in same.items())
    hidden = torch.randn(1, 3, staged.config.hidden_size)
    both = torch.tensor([30, 32, 58])
    torch.testing.assert_close(moved.vocab_logits(hidden)[..., both], head.vocab_logits(hidden)[..., both])


@pytest.mark.slow
def test_init_from_with_a_draft_vocabulary_trains_on_the_new_datas_tokens(tiny_testbed, tmp_path):
    """init_from + draft_vocab_size: the head starts on the new data's most frequent tokens and trains."""
    from spd.heads.draft_vocab import select_draft_vocab, token_counts

    first, second = tmp_path / "first", tmp_path / "second"
    train(*distill_args(tiny_testbed, first, "max_steps=2", "save_every=0", "draft_vocab_size=40", eval_data="none"))
    chats = tmp_path / "chats.jsonl"
    chats.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"f{i}?"}, {"role": "assistant", "content": f"{i}!"}]})
            + "\n"
            for i in range(40)
        )
    )
    proc = train(
        *distill_args(tiny_testbed, second, "max_steps=2", "save_every=0", "draft_vocab_size=24", eval_data="none"),
        f"init_from={first / 'final'}",
        f"data={chats}",
    )
    assert "moved to the data's draft vocabulary of 24 tokens" in proc.stdout + proc.stderr
    head = Speculator.from_pretrained(second / "final")
    from spd.data.prepare import DataConfig, prepare_dataset
    from spd.target.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_testbed / "target"))
    ds = prepare_dataset(str(chats), tokenizer, DataConfig(max_length=48), str(tmp_path / "cache"))
    counts = token_counts(zip(ds["input_ids"], ds["loss_mask"]), head.config.vocab_size)
    assert torch.equal(head.draft_ids, select_draft_vocab(counts, 24))


def test_fc_init_options():
    staged = StagedModel(tiny_model("llama"), 4)
    with torch.no_grad():
        hidden = staged.hidden_states(torch.randint(0, 100, (2, 12)), list(range(staged.num_layers + 1)))
    # deepest: g^k starts as the deepest hidden state the depth has (identity on that anchor block)
    head = new_head(staged, DistillConfig(n_stages=4, fc_init="deepest"))
    for k in head.config.used_depths:
        torch.testing.assert_close(head.features(k, hidden).detach(), hidden[head.config.boundaries[k]])
    # scaled: every anchor block contributes about equally and g^k has unit RMS, whatever each H^a's scale
    head = new_head(staged, DistillConfig(n_stages=4))
    rms = {a: float(h.pow(2).mean().sqrt()) for a, h in hidden.items()}
    assert max(rms.values()) / min(rms.values()) > 3  # the case the option is for: scales differ
    torch.manual_seed(0)
    scale_fc_init(head, rms)
    for k in head.config.used_depths:
        assert 0.6 < float(head.features(k, hidden).detach().pow(2).mean().sqrt()) < 1.6, k
    with pytest.raises(SpdInputError, match="fc_init"):
        DistillConfig(fc_init="xavier")


def test_layer_init_copies_a_target_decoder_layer():
    staged = StagedModel(tiny_model("llama"), 4)
    head = new_head(staged, DistillConfig(n_stages=4, num_layers=2, layer_init="target", layer_init_from=-2))
    source = staged.layers[-2]
    for layer in head.layers:
        torch.testing.assert_close(layer.q_proj.weight, source.self_attn.q_proj.weight)
        torch.testing.assert_close(layer.down_proj.weight, source.mlp.down_proj.weight)
        torch.testing.assert_close(layer.post_attention_layernorm.weight, source.post_attention_layernorm.weight)
    # the head's layer computes what the target's does on the same input (query and memory the same rows)
    layer = head.layers[0]
    x = torch.randn(1, 5, staged.config.hidden_size)
    pos = torch.arange(5)[None]
    cos, sin = head.rope(pos, x.dtype)
    q = layer.query_heads(x, cos, sin)
    k, v = layer.memory_kv(x, 0, cos, sin)
    attn = torch.nn.functional.scaled_dot_product_attention(q, layer.expand_kv(k), layer.expand_kv(v), is_causal=True)
    ours = layer.finish(x, attn)
    theirs = source(x, attention_mask=None, position_ids=pos, position_embeddings=staged.rotary_emb(x, pos))
    theirs = theirs[0] if isinstance(theirs, tuple) else theirs
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)
    random = new_head(staged, DistillConfig(n_stages=4))
    assert not torch.equal(random.layers[0].q_proj.weight, source.self_attn.q_proj.weight)
    with pytest.raises(SpdInputError, match="layer_init_from"):
        new_head(staged, DistillConfig(n_stages=4, layer_init="target", layer_init_from=9))
    with pytest.raises(SpdInputError, match="layer_init"):
        DistillConfig(layer_init="copy")


def test_fill_sampling_policy():
    fills = sample_fills(20000, 4, torch.Generator().manual_seed(0))
    share_full = (fills == 4).float().mean().item()
    assert abs(share_full - 0.5) < 0.02
    partial = fills[fills < 4]
    assert set(partial.tolist()) == {1, 2, 3}
    assert max(abs((partial == a).float().mean().item() - 1 / 3) for a in (1, 2, 3)) < 0.03


def test_expected_accept_length_matches_simulation():
    n = 4
    agreement = {1: 0.5, 2: 0.6, 3: 0.7, 4: 0.8}
    est = expected_accept_length(agreement, n)
    gen = random.Random(0)
    steps = tokens = 0
    for _ in range(20000):  # segments: seed, proposals with fills 1, 2, .., n, n, ... until a rejection
        k, j = 0, 1
        while gen.random() < agreement[min(j, n)]:
            k, j = k + 1, j + 1
        steps += n + k
        tokens += k + 1
    assert abs(est["L_acc"] - n * tokens / steps) < 0.03
    assert expected_accept_length({a: 0.0 for a in range(1, 5)}, 4)["L_acc"] == pytest.approx(1.0)
    assert expected_accept_length({a: 1.0 for a in range(1, 5)}, 4)["L_acc"] == pytest.approx(4.0)


def test_deepspeed_zero2_config_is_accepted_by_accelerate():
    """The shipped ZeRO-2 setup parses (tests/test_backends.py runs it, on CPU)."""
    pytest.importorskip("deepspeed")
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DeepSpeedPlugin, DistributedType

    cfg = load_config_from_file(str(REPO / "configs" / "accelerate" / "deepspeed-zero2.yaml"))
    assert cfg.distributed_type == DistributedType.DEEPSPEED
    plugin = DeepSpeedPlugin(hf_ds_config=str(REPO / cfg.deepspeed_config["deepspeed_config_file"]))
    assert plugin.zero_stage == 2


@pytest.mark.slow
def test_publish_head_writes_bf16_and_keeps_the_model_card(tmp_path):
    """train/publish_head.py: a head in bf16 beside an existing README.md, loadable, its weights the rounded
    originals; a directory that is not a head is one error line."""
    source = tmp_path / "head"
    new_head(StagedModel(tiny_model("llama"), 2), DistillConfig(n_stages=2)).save_pretrained(source)
    out = tmp_path / "published"
    out.mkdir()
    (out / "README.md").write_text("card\n")
    proc = run_script("train/publish_head.py", str(source), str(out))
    assert "bfloat16" in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    original, published = load_file(source / "model.safetensors"), load_file(out / "model.safetensors")
    assert original.keys() == published.keys()
    for key, value in original.items():
        expected = value.to(torch.bfloat16) if value.is_floating_point() else value
        assert torch.equal(published[key], expected), key
    bad = run_script("train/publish_head.py", str(tmp_path), str(tmp_path / "x"), check=False)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error:") and "Traceback" not in bad.stderr
