"""The runtime across machines, on one machine: each "host" is a Linux network namespace with its own network
stack, joined to the others by veth links to a bridge on a private subnet (spd/testing/netns.py); one torchrun per host
(c10d rendezvous) starts the ranks of its stages. The hosts share this machine's host name, which resolves to a loopback address: the
trap that left every rank waiting silently for the whole join timeout.

Needs root and ``ip netns`` (skipped with the reason otherwise).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from conftest import REPO
from helpers.runtime import PROMPTS, reference_outputs
from spd.testing.netns import Lan, torchrun_command, unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))


@pytest.fixture(scope="module")
def lan():
    """Three hosts at 10.231.0.1-3 on one bridge (spd/testing/netns.py)."""
    with Lan(3) as network:
        yield network


@pytest.fixture(scope="module")
def hosts(lan):
    return lan.hosts


def _start(hosts, nprocs, args, local_addr=True, per_host_args=None) -> list[subprocess.Popen]:
    """One torchrun per host, started side by side (stderr piped); ``per_host_args`` replace ``args`` on a host."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    job_id = f"spd-{os.getpid()}-{time.monotonic_ns()}"  # one rendezvous id for the whole job
    procs = []
    for node, nproc in enumerate(nprocs):
        own = per_host_args[node] if per_host_args and per_host_args[node] is not None else args
        cmd = torchrun_command(hosts, node, nproc, 29611, job_id, ["-m", "spd.cli.run_pipeline", *own], local_addr)
        procs.append(
            subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        )
        time.sleep(0.5)  # the rendezvous host first
    return procs


def _job(hosts, nprocs, args, local_addr=True, timeout=300, per_host_args=None):
    """A whole job: its hosts' (returncode, stderr) and the wall time."""
    start = time.monotonic()
    procs = _start(hosts, nprocs, args, local_addr, per_host_args)
    results = []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        results.append((proc.returncode, err))
    return results, time.monotonic() - start


@pytest.mark.slow
def test_three_hosts_give_the_single_process_tokens(tiny_testbed, heads, hosts, tmp_path):
    """Rank 0 on host 0, stages 1-2 on host 1, stages 3-4 on host 2 (n = 4): spd, pp and the tree over two hops
    between machines and one inside each; gloo finds each link's interface by itself (the route to the master
    address), with no GLOO_SOCKET_IFNAME. (Rank 0 beside stage 1 on host 0, host 1 with stage 2: the layout the
    tests of a killed stage and a link taken down decode over.)"""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "out.json"
    args = [
        "--target",
        str(tiny_testbed / "target"),
        "--speculator",
        str(heads[4]),
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
        "--timeout-s",
        "30",
        "--out",
        str(out),
    ]
    results, _ = _job(hosts, [1, 2, 2], args)
    for returncode, err in results:
        assert returncode == 0, err[-3000:]
    report = json.loads(out.read_text())
    for mode in ("spd", "pp", "tree"):
        want = reference_outputs(tiny_testbed, heads[4], 4, mode, 0.0, 0, None, 16)
        assert [r["token_ids"] for r in report["results"][mode]] == [o.token_ids for o in want], mode


@pytest.mark.slow
def test_a_job_that_cannot_meet_says_so_at_once_on_every_host(tiny_testbed, hosts):
    """Without --local-addr every host is told to meet at 'localhost': one error line on each host within
    seconds, instead of a silent wait for the whole join timeout."""
    args = ["--target", str(tiny_testbed / "target"), "--mode", "pp", "--prompt", "x", "--max-new-tokens", "4"]
    results, wall = _job(hosts[:2], [2, 1], args, local_addr=False, timeout=120)
    for returncode, err in results:
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert returncode != 0 and lines, err[-3000:]
        assert "meets at MASTER_ADDR=localhost" in lines[0] and "--local-addr" in lines[0]
    assert wall < 90


def _follow(procs) -> list[list[str]]:
    """Each process's stderr lines, collected as they come by a thread per process."""
    lines: list[list[str]] = [[] for _ in procs]

    def read(i):
        for line in procs[i].stderr:
            lines[i].append(line)

    for i in range(len(procs)):
        threading.Thread(target=read, args=(i,), daemon=True).start()
    return lines


def _wait_for(lines, text, proc, seconds=240):
    deadline = time.monotonic() + seconds
    while not any(text in line for line in lines):
        assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)[-3000:]
        time.sleep(0.2)


def _errors(lines) -> list[str]:
    return [line for line in lines if line.startswith("error:")]


def _no_spd_traceback(lines) -> bool:
    """(torchrun's own report of a failed worker has a traceback of torchrun's)"""
    return not any("/spd/" in line and 'File "' in line for line in lines)


def _decoding_job(tiny_testbed, heads, hosts, tmp_path):
    """A 2-host spd job over 40 prompts with a 5 s timeout, once its second prompt is done: (procs, stderr lines)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS * 10))
    args = [
        "--target",
        str(tiny_testbed / "target"),
        "--speculator",
        str(heads[2]),
        "--mode",
        "spd",
        "--prompts",
        str(prompts),
        "--max-new-tokens",
        "32",
        "--timeout-s",
        "5",
        "--emulate-stage-ms",
        "20",
    ]
    procs = _start(hosts[:2], [2, 1], args)
    lines = _follow(procs)
    try:
        _wait_for(lines[0], "[spd] 2/", procs[0])
    except BaseException:
        for proc in procs:
            proc.kill()
            proc.wait()
        raise
    return procs, lines


@pytest.mark.slow
def test_a_killed_stage_process_ends_the_ranks_on_the_other_host_with_an_error_line(
    tiny_testbed, heads, hosts, tmp_path
):
    """Host 1's stage process is killed (SIGKILL) mid-job: host 0's ranks end with an ``error:`` line naming the
    lost rank and host 0's whole launch ends within seconds, with no traceback of ours."""
    procs, lines = _decoding_job(tiny_testbed, heads, hosts, tmp_path)
    try:
        # host 1's torchrun (ip netns exec execs it) has one child: the worker of rank 2
        children = Path(f"/proc/{procs[1].pid}/task/{procs[1].pid}/children").read_text().split()
        assert len(children) == 1, children
        os.kill(int(children[0]), signal.SIGKILL)
        killed = time.monotonic()
        returncode = procs[0].wait(timeout=90)
        assert returncode != 0 and time.monotonic() - killed < 60
        # the rank that notices first names the lost one (torchrun then stops the other beside it)
        assert any("rank 2" in line for line in _errors(lines[0])), "".join(lines[0])[-3000:]
        assert _no_spd_traceback(lines[0]), "".join(lines[0])[-3000:]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_a_link_taken_down_mid_job_ends_the_ranks_on_both_hosts_with_an_error_line(
    tiny_testbed, heads, lan, hosts, tmp_path
):
    """Host 1's link goes down while the job decodes: host 0's ranks and stage 2 on host 1 end with an ``error:``
    line within a few of their --timeout-s, none with a traceback of ours (the driver's was a failed shutdown
    message to the lost peer), and host 0's launch ends."""
    procs, lines = _decoding_job(tiny_testbed, heads, hosts, tmp_path)
    try:
        lan.set_link(1, up=False)
        down = time.monotonic()
        returncode = procs[0].wait(timeout=90)  # host 0: a rank fails, torchrun stops the other beside it
        while not _errors(lines[1]) and time.monotonic() - down < 90:
            time.sleep(0.2)
        assert returncode != 0 and _errors(lines[1]), "".join(lines[0] + lines[1])[-5000:]
        assert time.monotonic() - down < 60
        assert any("rank 2" in line for line in _errors(lines[0])), "".join(lines[0])[-3000:]
        for i in range(len(procs)):
            assert _no_spd_traceback(lines[i]), "".join(lines[i])[-3000:]
    finally:
        # host 1's torchrun agent may keep waiting for the job's store across the dead link: stopped here
        for proc in procs:
            proc.kill()
            proc.wait()
        lan.set_link(1, up=True)


@pytest.mark.slow
def test_a_host_with_other_weights_is_refused_at_start_on_every_host(tiny_testbed, hosts, tmp_path):
    """Host 1 holds another training of the same architecture (one weight changed): every rank refuses the job
    at start with one line naming the target, instead of decoding with mixed weights."""
    other = tmp_path / "other"
    shutil.copytree(tiny_testbed / "target", other)
    weights = load_file(other / "model.safetensors")
    name = next(k for k in sorted(weights) if "layers.6." in k and k.endswith("proj.weight"))
    weights[name][0, 0] += 1.0
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    common = ["--mode", "pp", "--prompt", "x", "--max-new-tokens", "4", "--timeout-s", "30"]
    results, wall = _job(
        hosts[:2],
        [2, 1],
        ["--target", str(tiny_testbed / "target"), *common],
        per_host_args=[None, ["--target", str(other), *common]],
    )
    for returncode, err in results:
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert returncode != 0 and lines, err[-3000:]
        assert all("disagree on the target (config and weights)" in line and "rank 2 has" in line for line in lines), (
            lines
        )
    assert wall < 90


@pytest.mark.slow
def test_the_prefill_benchmark_measures_capped_links(tiny_testbed, tmp_path):
    out = tmp_path / "prefill.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "spd.bench",
            "prefill",
            "--target",
            str(tiny_testbed / "target"),
            "--lengths",
            "16",
            "48",
            "--rates",
            "none",
            "100mbit",
            "--repeats",
            "1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["rate"], r["prompt_tokens"] > 0) for r in rows] == [("none", True)] * 2 + [("100mbit", True)] * 2
    assert all(r["prefill_ms"] > 0 for r in rows) and "| 100mbit |" in proc.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "spd.bench", "prefill", "--rates", "fast"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert bad.returncode == 2 and bad.stderr.startswith("error: rate 'fast'"), bad.stderr


# ------------------------------------------------------------------- spd-serve with stages on other machines

CLIENT = """
import json, sys, urllib.error, urllib.request
request = urllib.request.Request(sys.argv[1], data=sys.argv[2].encode() if len(sys.argv) > 2 else None,
                                 headers={"Content-Type": "application/json"})
try:
    with urllib.request.urlopen(request, timeout=120) as response:
        print(response.status, response.read().decode())
except urllib.error.HTTPError as exc:
    print(exc.code, exc.read().decode())
"""


def _http(lan, host: int, url: str, body: dict | None = None) -> tuple[int, dict]:
    """A request from a client on ``host`` (the server listens on that host's loopback): (status, JSON body)."""
    argv = [sys.executable, "-c", CLIENT, url] + ([json.dumps(body)] if body is not None else [])
    proc = subprocess.run(lan.command(host, argv), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    status, _, text = proc.stdout.partition(" ")
    return int(status), json.loads(text)


def _spd_cli(lan, host: int, name: str, *args: str, **popen) -> subprocess.Popen:
    """A console script of this checkout's environment run on ``host``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        lan.command(host, [str(Path(sys.executable).parent / name), *args]), cwd=REPO, env=env, text=True, **popen
    )


@pytest.mark.slow
def test_a_server_with_stages_on_another_machine_serves_their_tokens_and_503_once_that_machine_is_gone(
    tiny_testbed, heads, lan, hosts
):
    """spd-serve on host 0 runs rank 0 and stages 1-2, spd-stage on host 1 stages 3-4: the completions equal the
    single-process engine's; a second machine asking for the same stages, or for one the server runs, is refused
    with one line; once host 1's link goes down the server answers 503 saying it must be restarted (and keeps
    answering), host 1's stages end with an error line, and the server stops cleanly on SIGTERM."""
    target, port = str(tiny_testbed / "target"), 29631
    server = _spd_cli(
        lan,
        0,
        "spd-serve",
        "--target",
        target,
        "--mode",
        "spd",
        "--speculator",
        str(heads[4]),
        "--runtime",
        "distributed",
        "--local-stages",
        "2",
        "--stage-addr",
        f"{hosts[0][1]}:{port}",
        "--port",
        "8131",
        "--timeout-s",
        "8",
        "--join-timeout-s",
        "120",
        stderr=subprocess.PIPE,
    )
    worker = None
    try:
        lines = _follow([server])[0]
        _wait_for(lines, "waiting up to", server)
        assert f"spd-stage --server {hosts[0][1]}:{port}" in "".join(lines)
        # A stage the server runs itself: refused before anything starts.
        wrong = _spd_cli(
            lan,
            1,
            "spd-stage",
            "--server",
            f"{hosts[0][1]}:{port}",
            "--target",
            target,
            "--hold",
            "2",
            stderr=subprocess.PIPE,
        )
        _, err = wrong.communicate(timeout=60)
        errors = _errors(err.splitlines())
        assert wrong.returncode == 2 and len(errors) == 1 and errors[0].startswith("error: stage 2 is not one"), err
        assert "3, 4 of 4" in errors[0]
        worker = _spd_cli(
            lan, 1, "spd-stage", "--server", f"{hosts[0][1]}:{port}", "--target", target, stderr=subprocess.PIPE
        )
        worker_lines = _follow([worker])[0]
        _wait_for(lines, "listening on", server)
        assert any("running 2 of the 4 stages" in line for line in worker_lines), worker_lines
        twice = _spd_cli(
            lan, 2, "spd-stage", "--server", f"{hosts[0][1]}:{port}", "--target", target, stderr=subprocess.PIPE
        )
        _, err = twice.communicate(timeout=60)
        errors = _errors(err.splitlines())
        assert twice.returncode == 2 and len(errors) == 1 and "already run by another machine" in errors[0], err
        want = reference_outputs(tiny_testbed, heads[4], 4, "spd", 0.0, 0, None, 16)
        from spd.target.tokenizer import load_target_tokenizer

        tok = load_target_tokenizer(target)
        for prompt, expected in zip(PROMPTS, want):
            status, body = _http(
                lan,
                0,
                "http://127.0.0.1:8131/v1/completions",
                {"model": "target", "prompt": prompt, "max_tokens": 16, "temperature": 0},
            )
            assert status == 200, body
            assert body["choices"][0]["text"] == tok.decode(expected.token_ids, skip_special_tokens=True)
            assert body["spd"]["token_acceptance"] == expected.stats.token_acceptance
        # Host 1 is taken away (its cable pulled): idle pings or the next request find it gone.
        lan.set_link(1, up=False)
        down = time.monotonic()
        status, body = _http(
            lan, 0, "http://127.0.0.1:8131/v1/completions", {"model": "target", "prompt": PROMPTS[0], "max_tokens": 16}
        )
        assert status == 503 and "must be restarted" in body["error"]["message"], body
        assert time.monotonic() - down < 60
        status, body = _http(lan, 0, "http://127.0.0.1:8131/health")
        assert status == 503 and "pipeline is down" in body["error"]["message"], body
        # The stages on host 1 end by their timeout with one error line each, and spd-stage with them.
        assert worker.wait(timeout=60) == 1
        assert any(line.startswith("error:") for line in worker_lines), worker_lines
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
        assert _no_spd_traceback(lines) and _no_spd_traceback(worker_lines), "".join(lines + worker_lines)[-3000:]
    finally:
        lan.set_link(1, up=True)
        for proc in (server, worker):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.slow
def test_a_server_whose_other_machines_never_join_says_so_and_exits(tiny_testbed, hosts, lan):
    """No spd-stage ever comes: after --join-timeout-s the server exits with one line naming the missing stages
    and the command that runs them; its own stage process goes with it."""
    server = _spd_cli(
        lan,
        0,
        "spd-serve",
        "--target",
        str(tiny_testbed / "target"),
        "--mode",
        "pp",
        "--stages",
        "2",
        "--runtime",
        "distributed",
        "--local-stages",
        "1",
        "--stage-addr",
        f"{hosts[0][1]}:29632",
        "--port",
        "8132",
        "--join-timeout-s",
        "5",
        stderr=subprocess.PIPE,
    )
    try:
        _, err = server.communicate(timeout=120)
    finally:
        if server.poll() is None:
            server.kill()
    errors = _errors(err.splitlines())
    assert server.returncode == 2 and len(errors) == 1, err[-3000:]
    assert errors[0].startswith(f"error: stage 2 did not join at {hosts[0][1]}:29632 within 5 s"), errors
    assert f"spd-stage --server {hosts[0][1]}:29632" in errors[0], errors
