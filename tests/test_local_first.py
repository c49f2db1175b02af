"""Local first: a model named by a path that does not exist is refused at once, never looked up on the hub; a hub
id is asked for once (only the local cache with HF_HUB_OFFLINE=1), and the message says what was tried.

No test here reaches the network: the programs run with HF_ENDPOINT at a closed port on this machine and an empty
hub cache, so a lookup that should not happen fails at once instead of retrying for a minute.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO
from helpers.cli import spd_generate_command
from spd.errors import SpdInputError
from spd.paths import check_model_source, local_only


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tmp_path: Path, offline: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("TRANSFORMERS_OFFLINE", None)
    env.update(HF_ENDPOINT=f"http://127.0.0.1:{_closed_port()}", HF_HUB_CACHE=str(tmp_path / "hub"))
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return env


def _generate(tmp_path: Path, offline: bool, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = subprocess.run(
        [*spd_generate_command(), *args, "--prompt", "x"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=_env(tmp_path, offline),
    )
    return proc, time.monotonic() - start


def _one_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize(
    "source,why",
    [
        ("./model", "it is a path"),
        ("../model", "it is a path"),
        ("~/model", "it is a path"),
        ("/models/target", "it is a path"),
        ("runs/n4/final", "a hub id has at most one '/'"),
        ("models/", "a hub id has at most one '/'"),
        ("with space/model", "it cannot be a hub id"),
        ("a--b/model", "it cannot be a hub id"),
        ("Qwen/Qwen3-8B", None),
        ("gpt2", None),
        ("spd-tests/tiny_target.v2", None),
    ],
)
def test_what_can_only_be_a_local_path(source, why):
    assert local_only(source) == why


def test_owner_slash_name_is_local_when_the_owner_is_a_local_directory(tmp_path, monkeypatch):
    """``smollm2/targt`` (a typo) with ./smollm2 here is a path, not a hub id; without ./smollm2 it may be one."""
    monkeypatch.chdir(tmp_path)
    assert local_only("smollm2/targt") is None
    (tmp_path / "smollm2").mkdir()
    assert local_only("smollm2/targt") == "'smollm2' is a local directory"


def test_a_missing_path_is_refused_without_asking_the_hub(tmp_path, monkeypatch):
    import spd.paths

    def hub(*args):
        raise AssertionError("the hub was asked about a local path")

    monkeypatch.setattr(spd.paths, "hub_problem", hub)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2").mkdir()
    for source in ("./nope", str(tmp_path / "nope"), "smollm2/targt", "runs/x/final"):
        with pytest.raises(SpdInputError, match=rf"^the target directory '{source}' does not exist \(") as info:
            check_model_source(source, "target")
        assert "so it was not looked up on the hub" in str(info.value)
    (tmp_path / "weights.bin").write_text("x")
    with pytest.raises(SpdInputError, match="^the target 'weights.bin' is a file; expected a model directory"):
        check_model_source("weights.bin", "target")
    with pytest.raises(SpdInputError, match="^no target given"):
        check_model_source(None, "target")


@pytest.mark.parametrize("offline", [False, True], ids=["online", "offline"])
def test_spd_generate_refuses_a_missing_path_at_once(tmp_path, offline):
    (tmp_path / "smollm2").mkdir()
    for flags, named in (
        (["--target", "smollm2/targt"], "the target directory 'smollm2/targt' does not exist"),
        (["--target", "./no-such-model"], "the target directory './no-such-model' does not exist"),
        (
            ["--target", "smollm2", "--speculator", "runs/n4/final"],
            "the speculator directory 'runs/n4/final' does not exist",
        ),
        (
            ["--target", "smollm2", "--draft-model", "smollm2/draft"],
            "the draft model directory 'smollm2/draft' does not exist",
        ),
        (["--target", "smollm2", "--tokenizer", "./tok"], "the tokenizer directory './tok' does not exist"),
    ):
        proc, seconds = _generate(tmp_path, offline, *flags)
        line = _one_line(proc)
        assert named in line and "not looked up on the hub" in line, line
        assert seconds < 5, f"{seconds:.1f} s to refuse {flags}"


def test_spd_serve_refuses_a_missing_path_before_it_loads_anything(tmp_path):
    (tmp_path / "smollm2").mkdir()
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "spd.cli.serve", "--target", "smollm2/targt", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=_env(tmp_path, False),
    )
    seconds = time.monotonic() - start
    line = _one_line(proc)
    assert "the target directory 'smollm2/targt' does not exist" in line and "not looked up on the hub" in line
    assert seconds < 5, f"{seconds:.1f} s to refuse a missing target"


def test_a_hub_id_offline_is_one_line_naming_what_was_tried(tmp_path):
    proc, seconds = _generate(tmp_path, True, "--target", "spd-tests/no-such-model")
    line = _one_line(proc)
    assert line.startswith(
        f"error: the target 'spd-tests/no-such-model' is not a local directory "
        f"('{tmp_path / 'spd-tests' / 'no-such-model'}' does not exist) and the hub id 'spd-tests/no-such-model' "
        "is not in the local hub cache (HF_HUB_OFFLINE is set"
    ), line
    assert seconds < 5, f"{seconds:.1f} s"


def test_an_unreachable_hub_is_asked_once_without_retries(tmp_path):
    """Online but with no hub to reach (a closed port here): one request, one line, no minute of retries."""
    proc, seconds = _generate(tmp_path, False, "--target", "spd-tests/no-such-model")
    line = _one_line(proc)
    assert "and the hub could not be reached to fetch 'spd-tests/no-such-model' (" in line, line
    assert "Retrying" not in proc.stderr
    assert seconds < 10, f"{seconds:.1f} s"


def test_target_is_required(tmp_path):
    proc, _ = _generate(tmp_path, True)
    assert _one_line(proc) == "error: the following arguments are required: --target (see spd-generate --help)"


def test_an_unreachable_hub_falls_back_to_the_cache_at_once(tiny_testbed, tmp_path):
    """Online, the hub unreachable, the model in the local hub cache: it runs from the cache, with one warning line,
    without the retries huggingface_hub makes for each file the cache lacks (a tokenizer.model, ...)."""
    import shutil

    commit = "0123456789abcdef0123456789abcdef01234567"
    entry = tmp_path / "hub" / "models--spd-tests--tiny-target"
    (entry / "refs").mkdir(parents=True)
    (entry / "refs" / "main").write_text(commit)
    shutil.copytree(tiny_testbed / "target", entry / "snapshots" / commit)
    proc, seconds = _generate(tmp_path, False, "--target", "spd-tests/tiny-target", "--max-new-tokens", "2", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.startswith("warning: the hub cannot be reached (") and "Retrying" not in proc.stderr
    assert seconds < 60, f"{seconds:.1f} s"
