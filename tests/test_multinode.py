"""The runtime across machines, on one machine: each "host" is a Linux network namespace with its own network
stack, joined to the others by a veth link on a private subnet; one torchrun per host (c10d rendezvous) starts
the ranks of its stages. The hosts share this machine's host name, which resolves to a loopback address: the
trap that left every rank waiting silently for the whole join timeout.

Needs root and ``ip netns`` (skipped with the reason otherwise).
"""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from conftest import REPO
from test_runtime import PROMPTS, _reference, heads  # noqa: F401  (heads: a fixture)


def _can_make_namespaces() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    name = f"spdprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


pytestmark = pytest.mark.skipif(_can_make_namespaces() is not None, reason=str(_can_make_namespaces()))


@pytest.fixture(scope="module")
def hosts():
    """Two namespaces, host 0 at 10.231.0.1 and host 1 at 10.231.0.2, joined by one veth pair."""
    tag = os.getpid() % 100000
    names, links = [f"spdh0-{tag}", f"spdh1-{tag}"], [f"spdv0-{tag}", f"spdv1-{tag}"]
    addresses = ["10.231.0.1", "10.231.0.2"]

    def ip(*args):
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    try:
        for name in names:
            ip("netns", "add", name)
        ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for name, link, address in zip(names, links, addresses):
            ip("link", "set", link, "netns", name)
            ip("-n", name, "addr", "add", f"{address}/24", "dev", link)
            ip("-n", name, "link", "set", link, "up")
            ip("-n", name, "link", "set", "lo", "up")
        yield list(zip(names, addresses))
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _job(hosts, nprocs, args, local_addr=True, timeout=300):
    """One torchrun per host, started side by side; their (returncode, stderr) and the wall time."""
    endpoint = f"{hosts[0][1]}:29611"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    job_id = f"spd-{os.getpid()}-{time.monotonic_ns()}"  # one rendezvous id for the whole job
    procs = []
    start = time.monotonic()
    for node, ((name, address), nproc) in enumerate(zip(hosts, nprocs)):
        cmd = ["ip", "netns", "exec", name, sys.executable, "-m", "torch.distributed.run", "--nnodes",
               str(len(hosts)), "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint",
               endpoint, "--rdzv-id", job_id]
        cmd += ["--rdzv-conf", "is_host=1"] if node == 0 else []
        cmd += ["--local-addr", address] if local_addr else []
        cmd += ["-m", "spd.cli.run_pipeline", *args]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True))
        time.sleep(0.5)  # the rendezvous host first
    results = []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        results.append((proc.returncode, err))
    return results, time.monotonic() - start


def test_two_hosts_give_the_single_process_tokens(tiny_testbed, heads, hosts, tmp_path):
    """Host 0 runs rank 0 and stage 1, host 1 stage 2, over the veth link; gloo finds the link's interface by
    itself (the route to the master address), with no GLOO_SOCKET_IFNAME."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "out.json"
    args = ["--target", str(tiny_testbed / "target"), "--speculator", str(heads[2]), "--mode", "spd", "pp", "tree",
            "--tree-width", "2", "--prompts", str(prompts), "--max-new-tokens", "16", "--timeout-s", "30",
            "--out", str(out)]
    results, _ = _job(hosts, [2, 1], args)
    for returncode, err in results:
        assert returncode == 0, err[-3000:]
    report = json.loads(out.read_text())
    for mode in ("spd", "pp", "tree"):
        want = _reference(tiny_testbed, heads[2], 2, mode, 0.0, 0, None, 16)
        assert [r["token_ids"] for r in report["results"][mode]] == [o.token_ids for o in want], mode


def test_a_job_that_cannot_meet_says_so_at_once_on_every_host(tiny_testbed, hosts):
    """Without --local-addr every host is told to meet at 'localhost': one error line on each host within
    seconds, instead of a silent wait for the whole join timeout."""
    args = ["--target", str(tiny_testbed / "target"), "--mode", "pp", "--prompt", "x", "--max-new-tokens", "4"]
    results, wall = _job(hosts, [2, 1], args, local_addr=False, timeout=120)
    for returncode, err in results:
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert returncode != 0 and lines, err[-3000:]
        assert "meets at MASTER_ADDR=localhost" in lines[0] and "--local-addr" in lines[0]
    assert wall < 90
