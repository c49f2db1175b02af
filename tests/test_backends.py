"""The trainer on its sharded back-ends, launched as users launch it, in two CPU processes (gloo):

    accelerate launch --config_file configs/accelerate/deepspeed-zero2.yaml --num_processes 2 train/distill.py ...
    accelerate launch --config_file configs/accelerate/fsdp.yaml --num_processes 2 train/distill.py ...

Each back-end: an uninterrupted run; the same run killed (SIGKILL to every process) once a checkpoint exists,
then ``--resume``d; the two final heads agree, match the DDP run's, and load with ``load_speculator``.
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO
from helpers.distill import distill_args
from spd.heads.loading import load_speculator

STEPS = 8
# The files each back-end writes into a checkpoint for each of its two processes (besides accelerate's RNG states,
# the trainer's fill RNGs, head/ and trainer_state.json).
SHARDS = {
    "deepspeed-zero2": [
        "pytorch_model/mp_rank_00_model_states.pt",
        "pytorch_model/zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ],
    "fsdp": [
        "pytorch_model_fsdp_0/__0_0.distcp",
        "pytorch_model_fsdp_0/__1_0.distcp",
        "optimizer_0/__0_0.distcp",
        "optimizer_0/__1_0.distcp",
    ],
}


def _command(launch: list[str], tb, out, *extra) -> list[str]:
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *launch,
        "--num_processes",
        "2",
        "--main_process_port",
        str(random.randint(20000, 40000)),
        str(REPO / "train" / "distill.py"),
        *distill_args(tb, out, *extra, max_steps=STEPS, keep_checkpoints=2),
    ]


# CPU even where there are GPUs; DeepSpeed's CPU accelerator (it would pick it anyway without CUDA).
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}


def _run(launch, tb, out, *extra, env=None):
    proc = subprocess.run(
        _command(launch, tb, out, *extra), capture_output=True, text=True, timeout=900, cwd=REPO, env=env or ENV
    )
    # The lines naming a cause, from anywhere in stderr (a crashed worker's own message comes long before the
    # launcher's summary at the end).
    causes = [
        line
        for line in proc.stderr.splitlines()
        if any(key in line for key in ("error", "Error", "terminate called", "what()", "Signal", "Abort"))
    ]
    assert proc.returncode == 0, "\n".join(
        ["causes:", *causes[-40:], "stdout:", proc.stdout[-2000:], "stderr:", proc.stderr[-4000:]]
    )
    return proc


def _launch_args(backend: str) -> list[str]:
    return ["--config_file", str(REPO / "configs" / "accelerate" / f"{backend}.yaml")]


def _assert_checkpoints_complete(out) -> list[str]:
    """Every checkpoint directory under its final name is complete; returns their names."""
    names = []
    for path in (out / "checkpoints").iterdir():
        if not path.name.endswith(".tmp"):
            # (or gone since the listing: an older checkpoint rotated out)
            assert (path / "trainer_state.json").is_file() or not path.exists(), f"{path.name} is incomplete"
            names.append(path.name)
    return names


def _assert_same_weights(a: dict, b: dict, atol: float = 0.0):
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=atol, msg=key)


@pytest.fixture(scope="module")
def ddp_head(tiny_testbed, tmp_path_factory) -> dict:
    """The same training in plain DDP (2 CPU processes): what the sharded back-ends must reproduce."""
    out = tmp_path_factory.mktemp("backends") / "ddp"
    _run(
        ["--multi_gpu", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"],
        tiny_testbed,
        out,
        env={**ENV, "ACCELERATE_USE_CPU": "true"},
    )
    return load_file(out / "final" / "model.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["deepspeed-zero2", "fsdp"])
def test_backend_trains_checkpoints_resumes_and_loads(backend, tiny_testbed, tmp_path, ddp_head):
    if backend.startswith("deepspeed"):
        pytest.importorskip("deepspeed")
        # DeepSpeed on CPU builds its shared-memory communication op at start-up (once; ~/.cache/torch_extensions)
        headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
        if not shutil.which(os.environ.get("CXX", "c++")) or not headers.is_file():
            pytest.skip("DeepSpeed on CPU builds a C++ op at start-up: needs a C++ compiler and the Python headers")
    launch = _launch_args(backend)

    # Uninterrupted.
    straight = tmp_path / "straight"
    _run(launch, tiny_testbed, straight)
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["step"] == STEPS, summary
    assert sorted(_assert_checkpoints_complete(straight)) == [f"step-{STEPS - 2}", f"step-{STEPS}"]
    assert not list((straight / "checkpoints").glob("*.tmp"))
    newest = straight / "checkpoints" / f"step-{STEPS}"
    for name in [
        "trainer_state.json",
        "head/model.safetensors",
        "random_states_0.pkl",
        "random_states_1.pkl",
        "fill_rng_0.pt",
        "fill_rng_1.pt",
        *SHARDS[backend],
    ]:
        assert (newest / name).is_file(), f"{backend} checkpoint lacks {name}"
    final = load_file(straight / "final" / "model.safetensors")
    _assert_same_weights(final, load_file(newest / "head" / "model.safetensors"))  # the gathered head, in full
    # Data-parallel over the same batches: the same head as DDP, up to the order of floating-point sums.
    _assert_same_weights(ddp_head, final, atol=1e-6)
    head = load_speculator(str(straight / "final"))
    assert head.config.n_stages == 4
    _assert_same_weights(final, {k: v for k, v in head.state_dict().items() if k in final})

    # The same run, killed with SIGKILL (every process, no clean-up) once a checkpoint exists, then resumed.
    out = tmp_path / "killed"
    proc = subprocess.Popen(
        _command(launch, tiny_testbed, out),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=REPO,
        env=ENV,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 600
        while not (out / "checkpoints" / "step-2" / "trainer_state.json").exists():
            assert proc.poll() is None, "the run ended before it could be killed"
            assert time.time() < deadline
            if (out / "checkpoints").is_dir():
                _assert_checkpoints_complete(out)  # checked while the run writes them
            time.sleep(0.05)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    assert not (out / "final").exists()
    resumed = _run(launch, tiny_testbed, out, "--resume")
    assert "[resume] step-" in resumed.stdout + resumed.stderr
    assert json.loads((out / "summary.json").read_text())["step"] == STEPS
    _assert_checkpoints_complete(out)
    # Resuming restores everything (weights, sharded optimizer state, scheduler, data position, RNGs).
    _assert_same_weights(final, load_file(out / "final" / "model.safetensors"), atol=1e-6)


@pytest.mark.slow
def test_processes_that_would_each_train_alone_are_refused(tiny_testbed, tmp_path):
    """Two processes that accelerate sets up as two single-process runs (here: --multi_gpu on a machine without
    GPUs, without ACCELERATE_USE_CPU) stop with one error instead of writing over each other's files."""
    out = tmp_path / "alone"
    proc = subprocess.run(
        _command(
            ["--multi_gpu", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"],
            tiny_testbed,
            out,
        ),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env=ENV,
    )
    assert proc.returncode != 0
    assert "error: the launcher started 2 processes, but accelerate sees 1" in proc.stderr
    assert not (out / "checkpoints").exists()
