"""Setting up the world: the process group, a loopback-only store and gloo interface for local worlds, free
ports, each rank's device."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from ..errors import SpdInputError
from .protocol import RuntimeConfig


def is_loopback(address: str | None) -> bool:
    """Whether ``address`` (a host name or IP) names this machine's loopback interface."""
    import ipaddress

    if address is None:
        return False
    if address.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


def loopback_interface() -> str | None:
    """The loopback network interface's name (``lo`` on Linux, ``lo0`` on macOS), if there is one."""
    import socket

    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in ("lo", "lo0") if n in names), next((n for n in names if n.startswith("lo")), None))


def bind_local_world(env=None) -> None:
    """For a world that meets on this machine (``MASTER_ADDR`` a loopback address): gloo's sockets on the loopback
    interface too (``GLOO_SOCKET_IFNAME``), unless the user set an interface. Anything else is left alone."""
    env = os.environ if env is None else env
    if not is_loopback(env.get("MASTER_ADDR")) or env.get("GLOO_SOCKET_IFNAME"):
        return
    name = loopback_interface()
    if name is not None:
        env["GLOO_SOCKET_IFNAME"] = name


def spans_machines(env=None) -> bool:
    """Whether this job's processes run on more than one machine (torchrun: fewer here than in the world)."""
    env = os.environ if env is None else env
    world = int(env.get("WORLD_SIZE", "1"))
    return int(env.get("LOCAL_WORLD_SIZE", str(world))) < world


def check_world_address(env=None) -> None:
    """A job over several machines cannot meet at a loopback address: refuse it at once, instead of waiting the
    whole join timeout for a store the other machines cannot reach (torchrun gives the rendezvous host's name;
    where it resolves to a loopback address, as with containers or network namespaces sharing a host name, every
    machine gets ``localhost``)."""
    env = os.environ if env is None else env
    if spans_machines(env) and is_loopback(env.get("MASTER_ADDR")):
        raise SpdInputError(
            f"this job spans several machines ({env.get('WORLD_SIZE')} processes, {env.get('LOCAL_WORLD_SIZE')} on "
            f"this one) but meets at MASTER_ADDR={env.get('MASTER_ADDR')}, a loopback address the other machines "
            "cannot reach; start torchrun with --local-addr <this machine's address on the stage network> on every "
            "machine, or give the machines host names that resolve to those addresses"
        )


def route_interface(address: str) -> str | None:
    """The name of the local network interface through which this machine reaches ``address`` (an IPv4 address
    or host name); None where it cannot be told (not Linux, no route)."""
    import fcntl
    import socket
    import struct

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))  # a UDP connect only chooses the route and source address; nothing is sent
            local = probe.getsockname()[0]
        for _, name in socket.if_nameindex():
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                try:  # SIOCGIFADDR: the interface's IPv4 address
                    packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
                except OSError:
                    continue
            if socket.inet_ntoa(packed[20:24]) == local:
                return name
    except OSError:
        return None
    return None


def bind_stage_network(env=None) -> str | None:
    """For a job over several machines with no ``GLOO_SOCKET_IFNAME``: gloo on the interface that routes to
    ``MASTER_ADDR`` (the stage network), not on whatever the host name resolves to. Returns the interface chosen."""
    env = os.environ if env is None else env
    if not spans_machines(env) or env.get("GLOO_SOCKET_IFNAME") or not env.get("MASTER_ADDR"):
        return None
    name = route_interface(env["MASTER_ADDR"])
    if name is not None and name != loopback_interface():
        env["GLOO_SOCKET_IFNAME"] = name
        return name
    return None


def local_world_env(port: int, env=None) -> dict:
    """The environment for processes of a world spawned on this machine: rendezvous and gloo on loopback."""
    env = dict(os.environ if env is None else env)
    env["MASTER_ADDR"], env["MASTER_PORT"] = "127.0.0.1", str(port)
    bind_local_world(env)
    return env


_STORE_SOCKETS: list = []


def _loopback_store(timeout: datetime.timedelta):
    """Rank 0's store of a local world started without a launcher agent, listening on loopback only (a store
    created from MASTER_ADDR alone listens on every interface); None when this process does not serve it."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        or os.environ.get("RANK", "0") != "0"
        or not is_loopback(addr)
        or not (port or "").isdigit()
    ):
        return None
    return bound_store(addr, int(port), int(os.environ.get("WORLD_SIZE", "1")), timeout)


def bound_store(addr: str, port: int, world: int, timeout: datetime.timedelta, wait_for_workers: bool = True):
    """A TCPStore server for ``world`` processes listening on ``addr`` only: a loopback address for a world on this
    machine, the stage network's address for one across machines (a store created from MASTER_ADDR alone listens on
    every interface). ``wait_for_workers=False`` returns at once (the process group's rendezvous waits instead)."""
    import socket

    family = socket.AF_INET6 if ":" in addr.strip("[]") else socket.AF_INET
    host = addr.strip("[]") if addr.lower() != "localhost" else "127.0.0.1"
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SpdInputError(
            f"cannot listen at {addr}:{port} ({exc.strerror}); give an address of this machine and a free port"
        ) from None
    sock.listen(1024)
    store = dist.TCPStore(
        host, port, world, True, timeout=timeout, wait_for_workers=wait_for_workers, master_listen_fd=sock.fileno()
    )
    _STORE_SOCKETS.append(sock)  # the store listens on this socket: it must stay open as long as the process
    return store


def init_distributed(config: RuntimeConfig):
    """Join the process group (env:// as torchrun sets it) and create the gloo control group."""
    # The group's default timeout only bounds joining and the background send waits; every receive on the data
    # and control paths has its own (config.timeout_s).
    timeout = datetime.timedelta(seconds=max(config.timeout_s, config.join_timeout_s))
    check_world_address()
    bind_local_world()
    bind_stage_network()
    store = _loopback_store(timeout)
    if store is None:
        dist.init_process_group(config.backend, timeout=timeout)
    else:
        # The prefix env:// rendezvous puts on the store (the other ranks join through it).
        dist.init_process_group(
            config.backend,
            store=dist.PrefixStore("default_pg", store),
            rank=0,
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
            timeout=timeout,
        )
    control = dist.new_group(backend="gloo", timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), control


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def local_rank_device(backend: str) -> torch.device:
    if backend == "nccl":
        index = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")
