"""Writers that replace only what they wrote: spd-convert, the testbed builder and the trainer's checkpoints."""

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, run_script
from helpers.distill import distill_args, train
from spd.errors import SpdInputError
from spd.heads.published.convert import to_authors_file, to_directory

HEAD = REPO / "tests" / "fixtures" / "authors" / "heads" / "v10_qwen3_n4_l1.pt"


def _cli(*args, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def _listing(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------- spd.files primitives


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_atomic_file_replaces_the_file_and_a_failed_write_leaves_the_old_one(tmp_path):
    from spd.files import atomic_file, write_json_atomic, write_text_atomic

    path = tmp_path / "state.json"
    write_text_atomic(path, "old\n")
    for fail_inside in (True, False):
        with pytest.raises((RuntimeError, TypeError)):
            with atomic_file(path) as f:
                f.write("half of a new")
                if fail_inside:
                    raise RuntimeError("disk full")
                f.write(b"bytes")  # the writer itself fails
        assert path.read_text() == "old\n"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]  # no temporary left
    with atomic_file(path, "wb") as f:
        f.write(b"new\n")
        assert path.read_text() == "old\n"  # not in place until the block ends
    assert path.read_bytes() == b"new\n"
    write_json_atomic(path, {"a": [1]})
    assert path.read_text() == '{\n  "a": [\n    1\n  ]\n}\n'
    write_json_atomic(path, {"a": 1}, indent=1)
    assert path.read_text() == '{\n "a": 1\n}\n'
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~_umask()  # as open() makes a file, not mkstemp's 0600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]
    with pytest.raises(ValueError, match="expected a mode 'w' or 'wb'"):
        with atomic_file(path, "a"):
            pass


def test_write_json_compact_keeps_lists_of_scalars_and_flat_rows_on_one_line(tmp_path):
    from spd.files import write_json_compact

    path = tmp_path / "result.json"
    result = {
        "flags": [True, False, None],
        "rows": [{"a": 1.5, "b": []}, {}, {"c": {"d": 1}}],
        "nested": [[1, 2], ["x"]],
        3: (4, 5),
    }
    write_json_compact(path, result)
    assert path.read_text() == (
        '{\n "flags": [true, false, null],\n "rows": [\n  {"a": 1.5, "b": []},\n  {},\n  {\n   "c": {\n    "d": 1\n'
        '   }\n  }\n ],\n "nested": [\n  [1, 2],\n  ["x"]\n ],\n "3": [4, 5]\n}\n'
    )
    assert json.loads(path.read_text()) == json.loads(json.dumps(result))  # what json.dump would have written
    write_json_compact(path, {"a": [1]}, indent=2)
    assert path.read_text() == '{\n  "a": [1]\n}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]


def test_atomic_path_is_for_writers_that_take_a_name(tmp_path):
    from spd.files import atomic_path, temp_pattern

    path = tmp_path / "shard-00000.safetensors"
    path.write_bytes(b"old")
    with pytest.raises(OSError):
        with atomic_path(path) as tmp:
            assert tmp.parent == tmp_path and temp_pattern(r"shard-\d{5}\.safetensors").fullmatch(tmp.name)
            assert tmp.read_bytes() == b""  # created, empty: the name is ours
            tmp.write_bytes(b"half")
            raise OSError("no space left on device")
    assert path.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    with atomic_path(path) as tmp:
        tmp.write_bytes(b"new")
    assert path.read_bytes() == b"new" and sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    # The pattern is of whole names: another file's temporaries do not match it.
    assert not temp_pattern("shard").fullmatch(".shard-00000.safetensors.abcd1234.tmp")


def test_temp_dir_beside_and_rename_dir_put_a_new_directory_in_place(tmp_path):
    from spd.files import rename_dir, temp_dir_beside, temp_pattern

    final = tmp_path / "head"
    tmp = temp_dir_beside(final)
    assert tmp.parent == tmp_path and temp_pattern("head").fullmatch(tmp.name)
    (tmp / "config.json").write_text("{}")
    rename_dir(tmp, final)
    assert _listing(tmp_path) == {"head/config.json": b"{}"} and not tmp.exists()
    other = temp_dir_beside(final)
    (other / "config.json").write_text("[]")
    with pytest.raises(OSError):  # not over a directory that has files
        rename_dir(other, final)
    assert (final / "config.json").read_text() == "{}" and (other / "config.json").read_text() == "[]"


def _whole(path: Path, value: str) -> bool:
    return _listing(path) == {"a.txt": value.encode(), "b.txt": value.encode()}


def _two_files(path: Path, value: str) -> Path:
    path.mkdir()
    for name in ("a.txt", "b.txt"):
        (path / name).write_text(value)
    return path


def test_replace_dir_leaves_exactly_one_complete_directory(tmp_path):
    from spd.files import replace_dir

    final = _two_files(tmp_path / "final", "old")
    replace_dir(_two_files(tmp_path / ".final.1.tmp", "new"), final)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"] and _whole(final, "new")
    replace_dir(_two_files(tmp_path / ".fresh.tmp", "new"), tmp_path / "fresh")  # nothing there before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final", "fresh"] and _whole(tmp_path / "fresh", "new")
    # discard decides what happens to the old one (here: kept, to look at it)
    kept = []
    replace_dir(_two_files(tmp_path / ".final.2.tmp", "newer"), final, tmp_path / "final.x.old", kept.append)
    assert kept == [tmp_path / "final.x.old"] and _whole(final, "newer") and _whole(kept[0], "new")


def test_replace_dir_puts_the_old_directory_back_when_the_rename_fails(tmp_path, monkeypatch):
    from spd import files

    final = _two_files(tmp_path / "final", "old")
    tmp = _two_files(tmp_path / ".final.1.tmp", "new")
    real = os.rename

    def rename(src, dst):
        if Path(src) == tmp:
            raise OSError("the disk went away")
        real(src, dst)

    monkeypatch.setattr(files.os, "rename", rename)
    with pytest.raises(OSError, match="the disk went away"):
        files.replace_dir(tmp, final)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".final.1.tmp", "final"] and _whole(final, "old")


@pytest.mark.parametrize("killed_after", [1, 2])
def test_replace_dir_killed_at_either_rename_leaves_a_complete_directory(tmp_path, killed_after):
    """A process killed (no cleanup at all) after the first or second rename: the old directory is whole beside
    the new one, and the new one is whole once it has its name."""
    final = _two_files(tmp_path / "final", "old")
    _two_files(tmp_path / ".final.1.tmp", "new")
    script = (
        f"import os, sys\nfrom spd import files\nreal, n = os.rename, [0]\n"
        f"def rename(a, b):\n    real(a, b)\n    n[0] += 1\n    if n[0] == {killed_after}: os._exit(9)\n"
        f"files.os.rename = rename\nfiles.replace_dir(sys.argv[1], sys.argv[2])\n"
    )
    proc = _cli("-c", script, str(tmp_path / ".final.1.tmp"), str(final))
    assert proc.returncode == 9, proc.stderr
    aside = tmp_path / ".final.1.tmp.old"
    assert _whole(aside, "old")
    if killed_after == 1:
        assert not final.exists() and _whole(tmp_path / ".final.1.tmp", "new")
    else:
        assert _whole(final, "new") and not (tmp_path / ".final.1.tmp").exists()


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
    assert (
        torch.load(tmp_path / "back.pt", weights_only=True)["config"] == torch.load(HEAD, weights_only=True)["config"]
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "back.pt", "head"]


def test_convert_cli_into_the_current_directory_is_one_error_line(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    proc = _cli("-m", "spd.cli.convert", str(HEAD), ".", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines() == [
        "error: the output directory '.' already holds files that spd-convert did not "
        "write; pass a new directory, or --force to write config.json and "
        "model.safetensors beside them"
    ]
    assert "wrote" not in proc.stdout and _listing(tmp_path) == {"notes.txt": b"mine"}
    assert sorted(p.name for p in tmp_path.parent.iterdir() if p.name.startswith(f".{tmp_path.name}.")) == []


# -------------------------------------------------------------------------------------------- testbed


def test_testbed_builder_refuses_paths_it_did_not_write(tmp_path):
    """``--out .`` in a Rust project: its target/ is not the testbed's."""
    (tmp_path / "Cargo.toml").write_text("[package]\n")
    (tmp_path / "target" / "debug").mkdir(parents=True)
    (tmp_path / "target" / "debug" / "app").write_text("binary")
    before = _listing(tmp_path)
    proc = subprocess.run(
        [sys.executable, str(REPO / "data" / "build_testbed.py"), "--out", ".", "--tiny", "--quiet"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == [
        "error: '.' already holds target/, which the testbed builder did not write; "
        "pass another --out, or --force to write the testbed's files beside their "
        "contents"
    ]
    assert _listing(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["Cargo.toml", "target"]
    (tmp_path / "testbed.json").mkdir()  # a directory where the builder writes a file: not even --force
    proc = run_script("data/build_testbed.py", "--out", str(tmp_path), "--tiny", "--quiet", "--force", check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "testbed.json (not a file)" in proc.stderr


@pytest.mark.slow
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


# ------------------------------------------------------------------------------------------ checkpoints


def _fake_checkpoint(path: Path, step: int) -> Path:
    path.mkdir(parents=True)
    (path / "weights.bin").write_bytes(bytes([step]) * 64)
    (path / "trainer_state.json").write_text(json.dumps({"step": step}))
    return path


def test_checkpoint_replacement_never_loses_the_newest_checkpoint(tmp_path):
    from spd.training.checkpoints import clean_checkpoints, commit_checkpoint, latest_checkpoint, list_checkpoints

    root = tmp_path / "checkpoints"
    _fake_checkpoint(root / "step-2", 2)
    _fake_checkpoint(root / "step-4", 4)
    # Killed while replacing step-4: the old copy is renamed aside, its replacement not yet renamed in (and a
    # half-written checkpoint and a half-deleted one lie beside it).
    (root / "step-4").rename(root / "step-4.run1.old")
    _fake_checkpoint(root / "step-6.run1.tmp", 6).joinpath("trainer_state.json").unlink()
    _fake_checkpoint(root / "step-1.run1.del.tmp", 1)
    assert latest_checkpoint(tmp_path) == root / "step-4.run1.old"
    assert list_checkpoints(tmp_path) == [root / "step-2", root / "step-4.run1.old"]
    clean_checkpoints(tmp_path)  # the resumed run's start: the copy it resumes from stays
    assert sorted(p.name for p in root.iterdir()) == ["step-2", "step-4.run1.old"]
    # The resumed run writes step-4 again (under its own temporary name) and step-6; two are kept.
    commit_checkpoint(_fake_checkpoint(root / "step-4.run2.tmp", 40), root / "step-4", 2, "run2")
    assert sorted(p.name for p in root.iterdir()) == ["step-2", "step-4", "step-4.run1.old"]
    assert json.loads((root / "step-4" / "trainer_state.json").read_text()) == {"step": 40}
    clean_checkpoints(tmp_path)  # superseded now
    commit_checkpoint(_fake_checkpoint(root / "step-6.run2.tmp", 6), root / "step-6", 2, "run2")
    assert sorted(p.name for p in root.iterdir()) == ["step-4", "step-6"]
    # Replacing an existing step-N: the new one is in place and the old one gone, nothing else left.
    commit_checkpoint(_fake_checkpoint(root / "step-6.run3.tmp", 60), root / "step-6", 2, "run3")
    assert sorted(p.name for p in root.iterdir()) == ["step-4", "step-6"]
    assert (root / "step-6" / "weights.bin").read_bytes() == bytes([60]) * 64


def _train(*args) -> subprocess.CompletedProcess:
    return train(*args, check=False)


def _train_args(tb, out, *extra):
    return distill_args(tb, out, *extra, eval_data="none", max_steps=4, warmup_steps=1)


class _Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned > /tmp/spd-fill-rng-ran-code",))


@pytest.mark.slow
def test_resume_replaces_its_checkpoint_in_place_and_loads_rng_state_without_code(tiny_testbed, tmp_path):
    out = tmp_path / "run"
    proc = _train(*_train_args(tiny_testbed, out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = (out / "final" / "model.safetensors").read_bytes()
    # Resumed at its last step: step-4 is written again over itself, the head is the same.
    proc = _train(*_train_args(tiny_testbed, out), "--resume")
    assert proc.returncode == 0 and "[resume] step-4" in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-4"]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(("final", "."))) == ["final"]
    assert (out / "final" / "model.safetensors").read_bytes() == final
    # A fill-RNG file that unpickles code is refused (weights_only), in one line.
    Path("/tmp/spd-fill-rng-ran-code").unlink(missing_ok=True)
    torch.save({"state": _Payload()}, out / "checkpoints" / "step-4" / "fill_rng_0.pt")
    proc = _train(*_train_args(tiny_testbed, out), "--resume")
    assert not Path("/tmp/spd-fill-rng-ran-code").exists()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith(f"error: the checkpoint '{out / 'checkpoints' / 'step-4'}' cannot be resumed (UnpicklingError")
    )


# ---------------------------------------------------------------------------------------- captures


@pytest.fixture(scope="module")
def small_capture(tiny_testbed, tmp_path_factory):
    out = tmp_path_factory.mktemp("capture") / "cap"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "data" / "capture.py"),
            "--target",
            str(tiny_testbed / "target"),
            "--data",
            str(tiny_testbed / "corpus" / "train.jsonl"),
            "--max-length",
            "48",
            "--out",
            str(out),
            "--stages",
            "4",
            "--max-rows",
            "24",
            "--shard-tokens",
            "300",
            "--cache-dir",
            str(out.parent / "cache"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(json.loads((out / "capture.json").read_text())["shards"]) >= 3
    return out


@pytest.mark.slow
def test_a_damaged_capture_is_one_error_line_before_training(small_capture, tmp_path):
    cases = {}
    corrupt = tmp_path / "corrupt"
    shutil.copytree(small_capture, corrupt)
    text = (corrupt / "capture.json").read_text()
    (corrupt / "capture.json").write_text(text[: len(text) // 2])  # as a full disk or a crash leaves it
    cases[corrupt] = f"the capture manifest '{corrupt / 'capture.json'}' is cut short ("
    truncated = tmp_path / "truncated"
    shutil.copytree(small_capture, truncated)
    last = json.loads((truncated / "capture.json").read_text())["shards"][-1]["file"]
    raw = (truncated / last).read_bytes()
    (truncated / last).write_bytes(raw[: len(raw) - 1000])
    cases[truncated] = f"the capture shard '{truncated / last}' is cut short ("
    escaped = tmp_path / "escaped"
    shutil.copytree(small_capture, escaped)
    manifest = json.loads((escaped / "capture.json").read_text())
    manifest["shards"][0]["file"] = "../../etc/passwd"
    (escaped / "capture.json").write_text(json.dumps(manifest))
    cases[escaped] = f"the capture '{escaped}' has a corrupt capture.json (missing or malformed: shards[0])"
    for path, message in cases.items():
        proc = _train(
            f"data={path}",
            "eval_data=none",
            "n_stages=4",
            "max_steps=2",
            "batch_size=4",
            "save_every=0",
            f"output_dir={tmp_path / 'run'}",
        )
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        lines = proc.stderr.strip().splitlines()
        assert lines[-1].startswith(f"error: {message}"), lines[-1]
        assert not (tmp_path / "run" / "checkpoints").exists()  # refused at the start, not mid-training


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    if os.geteuid() != 0:
        return False
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
        ).returncode
        == 0
    )


@pytest.mark.slow
def test_training_checks_free_disk_space(tiny_testbed, tmp_path):
    """A run whose checkpoints and head will not fit where output_dir is is refused in one line before its first
    step, and writes nothing there."""
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "64k"):
        pytest.skip("needs root to mount a small tmpfs")
    try:
        proc = _train(*_train_args(tiny_testbed, disk / "run", f"cache_dir={tmp_path / 'cache'}"))
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        line = proc.stderr.strip().splitlines()[-1]
        assert line.startswith("error: this run (3 checkpoint(s) of ") and "MiB are free under" in line, line
        assert "keep_checkpoints=1" in line
        assert [p.name for p in (disk / "run").iterdir()] == []
        # A disk that fills while the job writes (here the tokenized data's cache) is one line as well.
        proc = _train(*_train_args(tiny_testbed, tmp_path / "run", f"cache_dir={disk / 'cache'}"))
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        line = proc.stderr.strip().splitlines()[-1]
        assert line.startswith("error: the disk is full") and line.endswith("run the same command again"), line
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


@pytest.mark.slow
def test_resumed_capture_checks_free_disk_space(tiny_testbed, small_capture, tmp_path):
    """The space the remaining shards need is checked on resume too, as at the start."""
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "512k"):
        pytest.skip("needs root to mount a small tmpfs")
    try:
        out = disk / "cap"
        out.mkdir()
        manifest = json.loads((small_capture / "capture.json").read_text())
        first = manifest["shards"][0]
        # A capture killed after its first shard, resumed where the rest cannot fit.
        shutil.copy(small_capture / first["file"], out / first["file"])
        shutil.copy(small_capture / "teacher.safetensors", out / "teacher.safetensors")
        (out / "capture.json").write_text(json.dumps({**manifest, "shards": [first], "complete": False}))
        (disk / "filler").write_bytes(b"\0" * (shutil.disk_usage(disk).free - 4096))
        proc = subprocess.run(
            [
                sys.executable,
                str(REPO / "data" / "capture.py"),
                "--target",
                str(tiny_testbed / "target"),
                "--data",
                str(tiny_testbed / "corpus" / "train.jsonl"),
                "--max-length",
                "48",
                "--out",
                str(out),
                "--stages",
                "4",
                "--max-rows",
                "24",
                "--shard-tokens",
                "300",
                "--cache-dir",
                str(small_capture.parent / "cache"),
            ],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=REPO,
        )
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert proc.stderr.strip().splitlines()[-1].startswith("error: the rest of the capture needs ")
        assert sorted(p.name for p in out.iterdir()) == ["capture.json", first["file"], "teacher.safetensors"]
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
