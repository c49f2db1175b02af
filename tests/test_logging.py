"""The trainer's experiment trackers (``tensorboard=true``, ``wandb=true``) as users run them: real runs, real files."""

import json
import math
import os
import struct
import subprocess
import sys

import pytest

from conftest import REPO
from helpers.distill import distill_args

STEPS = 4


def _args(tb, out, *extra):
    """A short run that evaluates every 2 steps and logs every step."""
    return distill_args(tb, out, *extra, max_steps=STEPS, save_every=0, eval_every=2, log_every=1)


def _train(tmp_path, *args, env=None):
    """Run the trainer from an empty working directory, which must stay empty (logs belong in output_dir)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}, **(env or {})}
    proc = subprocess.run(
        [sys.executable, str(REPO / "train" / "distill.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(cwd.iterdir()) == []
    return proc


def _expected_lr(step):  # linear warmup over 2 steps, then linear decay to 0 at STEPS
    return 3e-3 * ((step + 1) / 2 if step < 2 else (STEPS - step) / (STEPS - 2))


def test_tensorboard_logs_train_and_eval_scalars_under_output_dir(tiny_testbed, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    # boundaries is a list: TensorBoard's hparams accept only scalars and strings, so this also checks the config
    _train(tmp_path, *_args(tiny_testbed, out, "tensorboard=true", "boundaries=[2,4,6]"))
    events = sorted((out / "logs").rglob("events.out.tfevents.*"))
    assert events, f"no TensorBoard events under {out / 'logs'}"
    scalars = {}
    for path in events:
        acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    assert [s for s, _ in scalars["train/kd_loss"]] == list(range(1, STEPS + 1))
    assert all(math.isfinite(v) and v >= 0 for _, v in scalars["train/kd_loss"])
    assert [v for _, v in scalars["train/lr"]] == pytest.approx([_expected_lr(s) for s in range(1, STEPS + 1)])
    assert [s for s, _ in scalars["eval/kd_loss"]] == [2, STEPS]
    final_eval = json.loads((out / "summary.json").read_text())["eval"]
    assert scalars["eval/kd_loss"][-1][1] == pytest.approx(final_eval["kd_loss"], rel=1e-5)
    assert scalars["eval/top1_full"][-1][1] == pytest.approx(final_eval["top1_full"], rel=1e-5)
    assert {f"eval/top1_fill{a}" for a in range(1, 5)} <= scalars.keys()


def _wandb_records(path):
    """The records of a ``.wandb`` file: a 7-byte W&B header, then LevelDB-log framing (32 KiB blocks, chunks with a
    crc32/length/type header, type 1 = full, 2/3/4 = first/middle/last) around ``Record`` protobufs."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:16]
    records, parts, pos, block = [], [], 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        parts.append(data[pos + 7 : pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            records.append(record)
            parts = []
    return records


def test_wandb_offline_run_lands_under_output_dir_with_the_logged_scalars(tiny_testbed, tmp_path):
    pytest.importorskip("wandb")
    out = tmp_path / "run"
    wandb_home = tmp_path / "wandb-home"  # keep wandb's own caches and settings out of the user's home
    env = {
        "WANDB_CACHE_DIR": str(wandb_home / "cache"),
        "WANDB_CONFIG_DIR": str(wandb_home / "config"),
        "WANDB_DATA_DIR": str(wandb_home / "data"),
    }
    proc = _train(
        tmp_path, *_args(tiny_testbed, out, "wandb=true", "wandb_mode=offline", "wandb_project=spd-test"), env=env
    )
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, sorted(p.name for p in out.rglob("*"))
    assert str(runs[0]) in proc.stdout + proc.stderr  # the `wandb sync <dir>` hint points at it
    (log,) = runs[0].glob("run-*.wandb")
    records = _wandb_records(log)
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.project == "spd-test"
    config = {
        item.key or "/".join(item.nested_key): json.loads(item.value_json)
        for r in records
        if r.WhichOneof("record_type") == "config"
        for item in r.config.update
    }
    assert config["max_steps"] == STEPS and config["wandb_mode"] == "offline"
    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            history.setdefault(r.history.step.num, {}).update(row)
    assert sorted(history) == list(range(1, STEPS + 1))
    for step, row in history.items():
        assert math.isfinite(row["train/kd_loss"]) and row["train/top1"] >= 0
        assert row["train/lr"] == pytest.approx(_expected_lr(step))
    assert {"eval/kd_loss", "eval/top1_full", "eval/L_acc_est", "eval/top1_fill1"} <= history[STEPS].keys()
    assert "eval/kd_loss" in history[2] and "eval/kd_loss" not in history[1]
    final_eval = json.loads((out / "summary.json").read_text())["eval"]
    assert history[STEPS]["eval/kd_loss"] == pytest.approx(final_eval["kd_loss"])
    assert any(r.WhichOneof("record_type") == "exit" for r in records), "the run was not finished (end_training)"


@pytest.mark.parametrize("tracker,blocked", [("wandb", ["wandb"]), ("tensorboard", ["tensorboard", "tensorboardX"])])
def test_missing_tracker_package_is_one_clear_error(tiny_testbed, tmp_path, tracker, blocked):
    """Without the tracker's package the trainer stops with one line, before any model is loaded.

    The package is made unimportable in the child (``sys.modules[name] = None``), as if it were not installed.
    """
    out = tmp_path / "run"
    code = (
        f"import runpy, sys\nfor name in {blocked!r}: sys.modules[name] = None\n"
        f"sys.argv = {[str(REPO / 'train' / 'distill.py'), *_args(tiny_testbed, out, f'{tracker}=true')]!r}\n"
        f"runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith(f"error: {tracker}=true needs the {tracker} package (pip install"), lines[-1]
    assert "Traceback" not in proc.stderr
    assert not out.exists()
