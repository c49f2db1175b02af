"""Writers that replace only what they wrote: spd-convert, the testbed builder and the trainer's checkpoints."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, run_script
from spd.errors import SpdInputError
from spd.published.convert import to_authors_file, to_directory

HEAD = REPO / "tests" / "fixtures" / "authors" / "heads" / "v10_qwen3_n4_l1.pt"


def _cli(*args, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def _listing(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------------- spd-convert


def test_convert_refuses_a_directory_it_did_not_write_and_keeps_its_files(tmp_path):
    out = tmp_path / "notes"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(SpdInputError, match="did not write; pass a new directory, or --force"):
        to_directory(str(HEAD), out)
    assert _listing(out) == {"notes.txt": b"mine"}
    # --force writes our two files beside theirs and removes nothing.
    to_directory(str(HEAD), out, force=True)
    assert sorted(_listing(out)) == ["config.json", "model.safetensors", "notes.txt"]
    assert (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes"]  # no temporary directory left beside it


def test_convert_replaces_its_own_output_and_refuses_a_file(tmp_path):
    out = tmp_path / "head"
    to_directory(str(HEAD), out)
    first = _listing(out)
    to_directory(str(HEAD), out)  # our own layout, exactly: replaced without --force
    assert _listing(out) == first
    (tmp_path / "afile").write_text("x")
    for force in (False, True):  # a file is never replaced by a directory
        with pytest.raises(SpdInputError, match="exists and is not a directory"):
            to_directory(str(HEAD), tmp_path / "afile", force=force)
    assert (tmp_path / "afile").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "head"]
    # Back to their .pt: an existing file only with force.
    to_authors_file(out, tmp_path / "back.pt")
    with pytest.raises(SpdInputError, match="already exists; pass another path, or --force"):
        to_authors_file(out, tmp_path / "back.pt")
    to_authors_file(out, tmp_path / "back.pt", force=True)
    assert torch.load(tmp_path / "back.pt", weights_only=True)["config"] == torch.load(HEAD, weights_only=True)["config"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "back.pt", "head"]


def test_convert_cli_into_the_current_directory_is_one_error_line(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    proc = _cli("-m", "infer.convert", str(HEAD), ".", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines() == ["error: the output directory '.' already holds files that spd-convert did not "
                                        "write; pass a new directory, or --force to write config.json and "
                                        "model.safetensors beside them"]
    assert "wrote" not in proc.stdout and _listing(tmp_path) == {"notes.txt": b"mine"}
    assert sorted(p.name for p in tmp_path.parent.iterdir() if p.name.startswith(f".{tmp_path.name}.")) == []


# -------------------------------------------------------------------------------------------- testbed


def test_testbed_builder_refuses_paths_it_did_not_write(tmp_path):
    """``--out .`` in a Rust project: its target/ is not the testbed's."""
    (tmp_path / "Cargo.toml").write_text("[package]\n")
    (tmp_path / "target" / "debug").mkdir(parents=True)
    (tmp_path / "target" / "debug" / "app").write_text("binary")
    before = _listing(tmp_path)
    proc = subprocess.run([sys.executable, str(REPO / "data" / "build_testbed.py"), "--out", ".", "--tiny", "--quiet"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == ["error: '.' already holds target/, which the testbed builder did not write; "
                                        "pass another --out, or --force to write the testbed's files beside their "
                                        "contents"]
    assert _listing(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["Cargo.toml", "target"]
    (tmp_path / "testbed.json").mkdir()  # a directory where the builder writes a file: not even --force
    proc = run_script("data/build_testbed.py", "--out", str(tmp_path), "--tiny", "--quiet", "--force", check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "testbed.json (not a file)" in proc.stderr


def test_testbed_force_writes_beside_foreign_files_and_rebuilds_only_its_own(tiny_testbed, tmp_path):
    out = tmp_path / "tb"
    shutil.copytree(tiny_testbed, out)
    # The draft directory becomes someone else's; the target keeps our marker but gains a user's file, and
    # lists a file an older build wrote that this one does not.
    shutil.rmtree(out / "draft")
    (out / "draft" / "debug").mkdir(parents=True)
    (out / "draft" / "debug" / "app").write_text("binary")
    (out / "target" / "notes.txt").write_text("mine")
    (out / "target" / "old-shard.bin").write_text("stale")
    marker = json.loads((out / "target" / "testbed_build.json").read_text())
    marker["files"].append("old-shard.bin")
    (out / "target" / "testbed_build.json").write_text(json.dumps(marker))
    old_key = marker["key"]
    proc = run_script("data/build_testbed.py", "--out", str(out), "--tiny", "--quiet", "--seed", "1", check=False)
    assert proc.returncode == 2 and "already holds draft/" in proc.stderr
    # Another seed: both models are rebuilt (the corpus and tokenizer are reused).
    run_script("data/build_testbed.py", "--out", str(out), "--tiny", "--quiet", "--seed", "1", "--force")
    assert (out / "draft" / "debug" / "app").read_text() == "binary"  # kept, with the draft written beside it
    assert (out / "target" / "notes.txt").read_text() == "mine"
    assert not (out / "target" / "old-shard.bin").exists()  # ours by the marker's record, and no longer written
    for name in ("target", "draft"):
        meta = json.loads((out / name / "testbed_build.json").read_text())
        assert meta["key"] and meta["key"] != old_key and not {"debug", "notes.txt"} & set(meta["files"])
        assert (out / name / "model.safetensors").is_file()
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary directories left
    # Built once, the directories are the builder's own: a second run needs no --force and changes nothing.
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    run_script("data/build_testbed.py", "--out", str(out), "--tiny", "--quiet", "--seed", "1")
    assert before == {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
