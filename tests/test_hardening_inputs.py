"""Bad values and hostile bytes get one clear error: distill overrides, run_pipeline's numbers, authors' configs,
and message headers of the distributed runtime (real processes where they run)."""

import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO, run_main
from spd.errors import SpdInputError
from spd.runtime.link import Link
from spd.runtime.protocol import DATA_TAG, HEADER, TOKEN, PipelineLost, RuntimeConfig
from spd.runtime.stage import check_level_extra, pack_level
from spd.runtime.world import bind_local_world, free_port, local_world_env, loopback_interface
from spd.training.presets import load_config

AUTHORS_HEAD = REPO / "tests" / "fixtures" / "authors" / "heads" / "v10_qwen3_n4_l1.pt"


@pytest.mark.parametrize(
    "override,message",
    [
        ("lr=nan", "lr must be a positive finite number, got nan"),
        ("tau=nan", "tau must be a positive finite number, got nan"),
        ("epochs=inf", "epochs must be a positive finite number, got inf"),
        ("max_grad_norm=inf", "max_grad_norm must be a positive finite number"),
        ("weight_decay=nan", "weight_decay must be a finite number >= 0"),
        ("max_minutes=nan", "max_minutes must be a positive finite number"),
        ("warmup_steps=-1", "warmup_steps must be 0 or more"),
    ],
)
def test_distill_refuses_non_finite_and_negative_numbers(override, message):
    with pytest.raises(SpdInputError, match=message):
        load_config(None, [override])


def test_run_cli_turns_a_wrong_input_into_one_error_line_and_status_2(capsys):
    from spd.errors import cli_error, run_cli

    def body(value):
        if value < 0:
            raise SpdInputError(f"--value must be 0 or more, got {value}")
        if value == 1:
            raise KeyboardInterrupt
        if value == 2:
            raise RuntimeError("a bug")
        return 0

    assert run_cli(body, 0) == 0 and capsys.readouterr().err == ""
    assert run_cli(body, -3) == 2 and capsys.readouterr().err == "error: --value must be 0 or more, got -3\n"
    assert run_cli(body, -3, flush=True) == 2 and capsys.readouterr().err.count("\n") == 1
    assert run_cli(body, 1, interrupted=130) == 130 and capsys.readouterr().err == ""
    with pytest.raises(KeyboardInterrupt):  # only a program that says how it ends on Ctrl-C ends quietly
        run_cli(body, 1)
    with pytest.raises(RuntimeError, match="a bug"):  # anything else is not an input error: a traceback
        run_cli(body, 2)
    assert cli_error("no such file") == 2 and capsys.readouterr().err == "error: no such file\n"


def test_distill_cli_nan_is_one_error_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "train" / "distill.py"), "lr=nan", f"output_dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == ["error: lr must be a positive finite number, got nan"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--timeout-s", "-1"], "--timeout-s must be a positive number of seconds, got -1.0"),
        (["--timeout-s", "nan"], "--timeout-s must be a positive number of seconds, got nan"),
        (["--threads", "0"], "--threads must be at least 1, got 0"),
        (["--num-prompts", "-1"], "--num-prompts must be at least 1, got -1"),
        (["--emulate-link-ms", "inf"], "--emulate-link-ms must be a finite number >= 0, got inf"),
        (["--max-batch", "2", "--prefill-chunk", "0"], "--prefill-chunk must be at least 1, got 0"),
        (
            ["--prefill-chunk", "8"],
            "--prefill-chunk sets how a batched run admits prompts; it needs --max-batch above 1",
        ),
        (["--spread-prefill"], "--spread-prefill sets how a batched run admits prompts; it needs --max-batch above 1"),
        (["--max-batch", "2", "--tree-nodes", "4"], "--tree-nodes narrows token trees; it needs --mode tree"),
    ],
)
def test_run_pipeline_bad_numbers_are_one_error_line(args, message):
    from spd.cli.run_pipeline import main

    proc = run_main(main, "--target", "testbed/target", "--prompt", "x", *args)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [f"error: {message}"], proc.stderr


# ------------------------------------------------------------------------------------ authors' configs


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("num_spec_layers", "x", "num_spec_layers = 'x'; expected a positive integer"),
        ("num_spec_layers", 100000, "num_spec_layers = 100000 but holds tensors for 1 spec layer"),
        ("num_stages", 2.5, "num_stages = 2.5; expected a positive integer"),
        ("hidden_size", True, "hidden_size = True; expected a positive integer"),
        ("shallow_hidden_layer_indices", [["a"]], "shallow_hidden_layer_indices that are not lists of layer indices"),
        ("draft_token_ids", [0, -1], "draft_token_ids that are not a list"),
    ],
)
def test_authors_config_values_are_checked_before_modules_are_built(tmp_path, key, value, message):
    from spd.heads.published.authors_file import load_authors_file

    good = torch.load(AUTHORS_HEAD, weights_only=True)
    path = tmp_path / "bad.pt"
    torch.save({"state_dict": good["state_dict"], "config": {**good["config"], key: value}}, path)
    with pytest.raises(SpdInputError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_authors_file(path)


def test_authors_config_with_a_huge_layer_count_is_one_error_line_in_the_cli(tmp_path):
    good = torch.load(AUTHORS_HEAD, weights_only=True)
    torch.save(
        {"state_dict": good["state_dict"], "config": {**good["config"], "num_spec_layers": 100000}},
        tmp_path / "huge.pt",
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "spd.cli.generate",
            "--target",
            str(REPO / "tests" / "fixtures" / "authors" / "targets" / "qwen3"),
            "--mode",
            "spd",
            "--stages",
            "4",
            "--speculator",
            str(tmp_path / "huge.pt"),
            "--prompt-ids",
            "5,6,7",
            "--max-new-tokens",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: '{tmp_path / 'huge.pt'}' has config num_spec_layers = 100000 but holds tensors for 1 spec layer(s)"
    ]


# ----------------------------------------------------------------------------------- runtime headers


def _header(kind=TOKEN, epoch=1, position=3, length=1, stage=0, width=1, n_extra=0):
    return [kind, epoch, position, length, stage, 0, width, n_extra]


def test_every_header_field_is_bounded():
    link = Link(1, RuntimeConfig(), torch.float32, torch.device("cpu"), 8, max_tokens=64, max_width=4)
    assert link.check_header(_header(length=64, width=4, n_extra=3), 0) == 3 * 8 + 64 * 4 * 8 * 4
    for fields, what in [
        ({"length": 2**40}, "length 1099511627776, expected 0..64"),
        ({"width": 5}, "payload width 5, expected 0..4"),
        ({"n_extra": -1}, "extra length -1"),
        ({"n_extra": 2**40}, "extra length"),
        ({"kind": 99}, "kind 99"),
        ({"epoch": -5}, "epoch -5"),
        ({"position": -1}, "position -1"),
        ({"length": 3, "width": 0}, "a payload of 3 tokens x 0 rows"),
    ]:
        with pytest.raises(PipelineLost, match=f"rank 1: a message from rank 0 has a bad header \\({what}"):
            link.check_header(_header(**fields), 0)
    positions, mask = torch.arange(5, 7), torch.ones(2, 4, dtype=torch.bool)
    check_level_extra(pack_level(2, positions, mask), torch.zeros(2, 1, 8))
    with pytest.raises(PipelineLost, match="a tree level message is malformed"):
        check_level_extra(pack_level(2, positions, mask)[:-1], torch.zeros(2, 1, 8))
    with pytest.raises(PipelineLost, match="a tree level message is malformed"):
        check_level_extra(torch.tensor([0, 10**9, 10**9]), torch.zeros(2, 1, 8))


def test_local_worlds_bind_gloo_to_loopback_unless_told_otherwise():
    lo = loopback_interface()
    assert lo in ("lo", "lo0")
    env = {"MASTER_ADDR": "127.0.0.1"}
    bind_local_world(env)
    assert env["GLOO_SOCKET_IFNAME"] == lo
    mine = {"MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "eth7"}
    bind_local_world(mine)
    assert mine["GLOO_SOCKET_IFNAME"] == "eth7"  # the user's choice stays
    remote = {"MASTER_ADDR": "10.1.2.3"}
    bind_local_world(remote)
    assert "GLOO_SOCKET_IFNAME" not in remote  # a multi-machine world is left alone
    assert local_world_env(1234, {})["GLOO_SOCKET_IFNAME"] == lo


def _hostile_peer_main() -> int:
    """Under torchrun, 2 processes: rank 0 sends a header announcing a 2^40-token payload; rank 1 must refuse it."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    link = Link(rank, RuntimeConfig(timeout_s=30), torch.float32, torch.device("cpu"), 16, max_tokens=256, max_width=4)
    if rank == 0:
        message = torch.zeros(link.slot, dtype=torch.uint8)
        message[: HEADER * 8] = torch.tensor(_header(length=2**40, width=1)).view(torch.uint8)
        dist.isend(message, 1, tag=DATA_TAG).wait()
        print("rank 0: sent", flush=True)
        return 0
    try:
        link.recv(0, DATA_TAG)
    except PipelineLost as exc:
        print(f"error: {exc}", flush=True)
        return 1
    print("rank 1: accepted the header", flush=True)
    return 0


@pytest.mark.slow
def test_a_hostile_header_from_a_real_peer_is_refused_without_allocating():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            "-m",
            "test_hardening_inputs",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
        env=env,
    )
    assert "rank 0: sent" in proc.stdout, proc.stderr[-3000:]
    assert (
        "error: rank 1: a message from rank 0 has a bad header (length 1099511627776, expected 0..256)" in proc.stdout
    ), proc.stdout + proc.stderr[-3000:]


@pytest.mark.slow
def test_a_local_world_started_without_a_launcher_runs_on_loopback(tiny_testbed):
    """Three processes given only MASTER_ADDR=127.0.0.1 and a port: rank 0 serves the store on loopback."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "spd.cli.run_pipeline",
        "--target",
        str(tiny_testbed / "target"),
        "--mode",
        "pp",
        "--stages",
        "2",
        "--prompt-ids",
        "5,6,7",
        "--max-new-tokens",
        "4",
        "--json",
        "--timeout-s",
        "60",
    ]
    procs = [
        subprocess.Popen(
            cmd,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={
                **local_world_env(port),
                "RANK": str(r),
                "LOCAL_RANK": str(r),
                "WORLD_SIZE": "3",
                "OMP_NUM_THREADS": "1",
                "PYTHONPATH": str(REPO),
            },
        )
        for r in range(3)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    assert '"new_tokens": 4' in outs[0][0]


if __name__ == "__main__":
    sys.exit(_hostile_peer_main())


# ------------------------------------------------------------------------------------------------- devices


def test_a_device_that_cannot_be_had_is_one_sentence():
    """Not a device name; CUDA asked of a torch or a machine without it (on this CPU-only CI)."""
    from spd.target.loading import check_device

    assert check_device("cpu") == torch.device("cpu")
    with pytest.raises(SpdInputError, match="^device 'cdua' is not a torch device; expected cpu, cuda or cuda:N$"):
        check_device("cdua")
    if torch.cuda.is_available():
        with pytest.raises(SpdInputError, match=r"device 'cuda:64' does not exist: torch sees \d+ CUDA GPU"):
            check_device("cuda:64")
    else:
        with pytest.raises(SpdInputError, match="^device 'cuda' needs a CUDA GPU, but "):
            check_device("cuda")


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA where there is none")
def test_cuda_on_a_cpu_machine_is_one_error_line_in_the_clis(tiny_testbed):
    """spd-generate, spd-serve over the distributed runtime and spd-bench decode with --device cuda here: exit 2 and one
    line, before any model loads."""
    target = str(tiny_testbed / "target")
    cmds = [
        [sys.executable, "-m", "spd.cli.generate", "--target", target, "--prompt", "x", "--device", "cuda"],
        [
            sys.executable,
            "-m",
            "spd.cli.serve",
            "--target",
            target,
            "--mode",
            "pp",
            "--stages",
            "2",
            "--runtime",
            "distributed",
            "--device",
            "cuda",
            "--port",
            "0",
        ],
        [
            sys.executable,
            "-m",
            "spd.bench",
            "decode",
            "--target",
            target,
            "--prompts",
            str(tiny_testbed / "prompts.jsonl"),
            "--device",
            "cuda",
        ],
    ]
    for cmd in cmds:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
        assert proc.returncode == 2, proc.stderr[-2000:]
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: device 'cuda' needs a CUDA GPU, but "), proc.stderr
