"""The torch.distributed runtime: real processes (torchrun, gloo) produce exactly the single-process engine's
tokens; each stage rank holds only its layers; a killed stage makes the whole run exit cleanly."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO
from spd.distill import DistillConfig, new_head
from spd.engine import PipelineEngine
from spd.runtime import load_partial, materialized_bytes
from spd.staging import StagedModel, load_tokenizer

PROMPTS = ["def main(argv):\n    ", "import os\n", "class A:\n    def __init__(self):"]


@pytest.fixture(scope="module")
def heads(tiny_testbed, tmp_path_factory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("runtime-heads")
    out = {}
    for n in (2, 4, 8):
        staged = StagedModel.from_pretrained(tiny_testbed / "target", n_stages=n)
        torch.manual_seed(10 + n)
        head = new_head(staged, DistillConfig(n_stages=n, target=str(tiny_testbed / "target")))
        head.save_pretrained(root / f"n{n}")
        out[n] = root / f"n{n}"
    return out


def _torchrun(n: int, *args: str, timeout: int = 400, **popen) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n + 1), "--master-port",
           str(_port()), "-m", "infer.run_pipeline", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env, **popen)


def _port() -> int:
    from spd.runtime import free_port

    return free_port()


def _reference(tiny_testbed, head_dir, n, mode, temperature, top_k, seed, max_new):
    torch.set_num_threads(1)
    staged = StagedModel.from_pretrained(tiny_testbed / "target", n_stages=n)
    tok = load_tokenizer(tiny_testbed / "target")
    from spd.speculator import load_speculator

    engine = PipelineEngine(staged, load_speculator(head_dir), tok)
    return [engine.generate(tok(p)["input_ids"], max_new, mode=mode, temperature=temperature, top_k=top_k,
                            seed=None if seed is None else seed + i).token_ids for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize("n,temperature", [(2, 0.0), (4, 1.0), (8, 0.0)])
def test_distributed_runtime_equals_single_process_engine(tiny_testbed, heads, tmp_path, n, temperature):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "out.json"
    args = ["--target", str(tiny_testbed / "target"), "--speculator", str(heads[n]), "--mode", "spd", "pp",
            "--prompts", str(prompts), "--max-new-tokens", "24", "--temperature", str(temperature), "--top-k", "20",
            "--seed", "5", "--out", str(out)]
    proc = _torchrun(n, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    for mode in ("spd", "pp"):
        got = [r["token_ids"] for r in report["results"][mode]]
        want = _reference(tiny_testbed, heads[n], n, mode, temperature, 20, 5, 24)
        assert got == want, mode
    spd_stats = [r["stats"] for r in report["results"]["spd"]]
    assert all(s["stages"] == n and s["steps"] > 0 for s in spd_stats)


def test_stage_ranks_load_only_their_layers(tiny_testbed):
    full = StagedModel.from_pretrained(tiny_testbed / "target", n_stages=4)
    layer_bytes = materialized_bytes(full.layers[0])
    parts = [load_partial(str(tiny_testbed / "target"), 4, role) for role in range(5)]
    for role in range(1, 5):
        assert materialized_bytes(parts[role]) == 2 * layer_bytes  # 8 layers / 4 stages
    driver = parts[0]
    assert materialized_bytes(driver) == sum(materialized_bytes(m) for m in (full.embed_tokens, full.norm,
                                                                           full.lm_head))
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


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc to find the stage process")
def test_killed_stage_makes_every_rank_exit_cleanly(tiny_testbed, heads, tmp_path):
    marker = f"--prompts={tmp_path}/kill.jsonl"  # unique in this test's command lines
    (tmp_path / "kill.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS * 20))
    log = tmp_path / "stderr.txt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "5", "--master-port", str(_port()),
           "-m", "infer.run_pipeline", "--target", str(tiny_testbed / "target"), "--speculator", str(heads[4]),
           "--mode", "spd", marker, "--max-new-tokens", "64", "--emulate-stage-ms", "20", "--timeout-s", "20"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, cwd=REPO, env=env)
        deadline = time.monotonic() + 240
        while "1/60 prompts" not in log.read_text() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
        assert "1/60 prompts" in log.read_text(), log.read_text()[-2000:]
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


def test_spd_generate_runtime_distributed_matches_local(tiny_testbed, heads):
    from test_cli import spd_generate

    common = ["--target", str(tiny_testbed / "target"), "--mode", "spd", "--speculator", str(heads[2]),
              "--prompt", "import os\n", "--max-new-tokens", "16", "--json"]
    # Greedy: the local process may use 2 threads and the ranks 1, and sampled draws could then differ in
    # the last bits; seeded sampling equality is tested above with the thread count pinned.
    local = spd_generate(*common)
    remote = spd_generate(*common, "--runtime", "distributed", "--emulate-stage-ms", "1")
    assert local.returncode == 0 and remote.returncode == 0, remote.stderr
    a, b = json.loads(local.stdout), json.loads(remote.stdout)
    assert a["token_ids"] == b["token_ids"] and a["stats"]["steps"] == b["stats"]["steps"]
    bad = spd_generate(*common[:-1], "--runtime", "distributed", "--stages", "4")
    assert bad.returncode == 2 and bad.stderr.startswith("error: the speculator does not fit"), bad.stderr
    ar = spd_generate("--target", str(tiny_testbed / "target"), "--prompt", "x", "--runtime", "distributed")
    assert ar.returncode == 2 and "--runtime distributed runs --mode spd or pp" in ar.stderr
