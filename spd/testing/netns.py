"""Several "machines" on one Linux machine, for multi-node tests and benchmarks: each host is a network namespace
with its own network stack, joined by a veth link to a bridge in one more namespace (the switch), all on one
private subnet, as machines on a LAN. Links can be capped with ``tc ... tbf`` (bandwidth; this kernel's lack of
``netem`` leaves latency to the runtime's ``--emulate-link-ms``). Needs root and ``ip`` (iproute2).

    with Lan(3) as lan:
        lan.cap("100mbit")                   # every host's link, both directions
        subprocess.run(lan.command(0, ["python", "-c", "..."]))  # a process on host 0 (ip netns exec)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
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


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Lan:
    """``hosts`` namespaces at 10.231.0.1, .2, ... on one bridge; removed on exit (with whatever runs in them)."""

    def __init__(self, hosts: int, subnet: str = "10.231.0"):
        tag = os.getpid() % 100000
        self.names = [f"spdh{i}-{tag}" for i in range(hosts)]
        self.addresses = [f"{subnet}.{i + 1}" for i in range(hosts)]
        self.links = [f"spdv{i}-{tag}" for i in range(hosts)]  # each host's end of its link
        self.ports = [f"spdp{i}-{tag}" for i in range(hosts)]  # the switch's end
        self.switch = f"spdsw-{tag}"

    @property
    def hosts(self) -> list[tuple[str, str]]:
        """(namespace, address) of each host."""
        return list(zip(self.names, self.addresses))

    def __enter__(self) -> Lan:
        try:
            for name in (*self.names, self.switch):
                _ip("netns", "add", name)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for name, address, link, port in zip(self.names, self.addresses, self.links, self.ports):
                _ip("link", "add", link, "type", "veth", "peer", "name", port)
                _ip("link", "set", link, "netns", name)
                _ip("link", "set", port, "netns", self.switch)
                _ip("-n", self.switch, "link", "set", port, "master", "br0")
                _ip("-n", self.switch, "link", "set", port, "up")
                _ip("-n", name, "addr", "add", f"{address}/24", "dev", link)
                _ip("-n", name, "link", "set", link, "up")
                _ip("-n", name, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        for name in (*self.names, self.switch):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)

    def cap(self, rate: str | None, hosts: list[int] | None = None) -> None:
        """Cap each host's link at ``rate`` (tc's units, e.g. "100mbit", "1gbit") both ways; None lifts the cap.
        The bucket holds 10 ms of traffic (at least 32 KB) and the queue 200 ms."""
        for i in range(len(self.names)) if hosts is None else hosts:
            for namespace, device in ((self.names[i], self.links[i]), (self.switch, self.ports[i])):
                subprocess.run(["tc", "-n", namespace, "qdisc", "del", "dev", device, "root"], capture_output=True)
                if rate is not None:
                    burst = max(rate_bits(rate) // 8 // 100, 32 * 1024)
                    subprocess.run(
                        [
                            "tc",
                            "-n",
                            namespace,
                            "qdisc",
                            "add",
                            "dev",
                            device,
                            "root",
                            "tbf",
                            "rate",
                            rate,
                            "burst",
                            str(burst),
                            "latency",
                            "200ms",
                        ],
                        check=True,
                        capture_output=True,
                        text=True,
                    )

    def set_link(self, host: int, up: bool) -> None:
        """Take a host's link down (as a pulled cable) or bring it back."""
        _ip("-n", self.names[host], "link", "set", self.links[host], "up" if up else "down")

    def command(self, host: int, argv: list[str]) -> list[str]:
        """``argv`` run on ``host``."""
        return ["ip", "netns", "exec", self.names[host], *argv]


def torchrun_command(
    hosts: list[tuple[str, str]],
    node: int,
    nproc: int,
    port: int,
    job_id: str,
    argv: list[str],
    local_addr: bool = True,
) -> list[str]:
    """The torchrun that starts ``nproc`` ranks of one job on host ``node`` of ``hosts`` ((namespace, address)
    each), as docs/runtime.md "Across machines" starts them on machines: c10d rendezvous at host 0, which hosts
    it (``is_host=1``), and ``--local-addr`` unless ``local_addr`` is False. ``argv`` follows torchrun's options
    (e.g. ``["-m", "spd.cli.run_pipeline", ...]``)."""
    name, address = hosts[node]
    cmd = [
        "ip",
        "netns",
        "exec",
        name,
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(len(hosts)),
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{hosts[0][1]}:{port}",
        "--rdzv-id",
        job_id,
    ]
    cmd += ["--rdzv-conf", "is_host=1"] if node == 0 else []
    cmd += ["--local-addr", address] if local_addr else []
    return cmd + list(argv)


def rate_bits(rate: str) -> int:
    """tc's rate units in bits per second: "100mbit" -> 100_000_000."""
    units = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "bit": 1}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return int(float(rate[: -len(unit)]) * scale)
    raise ValueError(f"rate '{rate}' is not in kbit, mbit or gbit, e.g. 100mbit")
