"""Stage machines joining a server's pipeline: the job a server publishes for them, and how a machine reads it.

``spd-serve --runtime distributed --local-stages K --stage-addr ADDR:PORT`` runs rank 0 and stages 1..K on its
own machine and waits at ``ADDR:PORT`` (its store, listening on that address only) for stages K+1..n. Each other
machine runs ``spd-stage --server ADDR:PORT --target DIR`` (spd/cli/stage.py): it reads the job from the store (one
JSON value: stages, cut, dtype, backend, timeouts, emulation, which stages are remote), claims the stages it holds
(so two machines cannot both run one), starts one process per stage (``python -m spd.cli.run_pipeline`` as that
stage's rank) and ends with them. The machines then meet as any multi-machine job does: every rank compares
versions, target and settings at start (spd/runtime/handshake.py) and refuses a mismatch with one line.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass, field

from ..errors import SpdInputError

JOB_KEY = "spd/job"
DEFAULT_PORT = 29500


@dataclass
class StageJob:
    """What a stage machine needs to start its ranks of a server's job (published as JSON, never pickled)."""

    stages: int  # n (the world is n + 1 processes)
    boundaries: list[int]  # the cut, 0..L
    remote: list[int]  # the stages that other machines run
    dtype: str = "float32"
    backend: str = "gloo"
    timeout_s: float = 60.0
    emulate_stage_ms: float = 0.0
    emulate_token_ms: float = 0.0
    emulate_link_ms: float = 0.0
    version: str = field(default_factory=lambda: _spd_version())

    def stage_command(self, target: str, revision: str | None, threads: int = 1) -> list[str]:
        """The program a stage rank runs (its rank comes from the environment, :meth:`stage_env`)."""
        cmd = [
            sys.executable,
            "-m",
            "spd.cli.run_pipeline",
            "--target",
            target,
            "--stages",
            str(self.stages),
            "--boundaries",
            ",".join(map(str, self.boundaries)),
            "--dtype",
            self.dtype,
            "--backend",
            self.backend,
            "--timeout-s",
            str(self.timeout_s),
            "--emulate-stage-ms",
            str(self.emulate_stage_ms),
            "--emulate-token-ms",
            str(self.emulate_token_ms),
            "--emulate-link-ms",
            str(self.emulate_link_ms),
            "--threads",
            str(threads),
        ]
        return cmd + (["--revision", revision] if revision is not None else [])

    def stage_env(self, host: str, port: int, stage: int, local_rank: int, local_world: int, env=None) -> dict:
        """The environment of stage ``stage``'s process on a machine running ``local_world`` of the job's ranks."""
        env = dict(os.environ if env is None else env)
        env.update(
            MASTER_ADDR=host,
            MASTER_PORT=str(port),
            WORLD_SIZE=str(self.stages + 1),
            RANK=str(stage),
            LOCAL_RANK=str(local_rank),
            LOCAL_WORLD_SIZE=str(local_world),
        )
        return env


def _spd_version() -> str:
    import spd

    return spd.__version__


def parse_address(text: str, default_port: int = DEFAULT_PORT) -> tuple[str, int]:
    """``HOST``, ``HOST:PORT`` or ``[IPV6]:PORT`` as ``(host, port)``; one sentence when it is not one."""
    text = text.strip()
    host, port = text, str(default_port)
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if rest:
            if not rest.startswith(":"):
                host = ""
            port = rest[1:]
    elif text.count(":") == 1:
        host, port = text.split(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SpdInputError(
            f"'{text}' is not an address; expected HOST or HOST:PORT with a port in 1..65535, "
            f"e.g. 10.0.0.1:{default_port}"
        )
    return host, int(port)


def _check(job: StageJob) -> None:
    """Refuse (ValueError) a job whose fields are not what a server of this version publishes."""
    ints = lambda xs: isinstance(xs, list) and all(isinstance(x, int) for x in xs)  # noqa: E731
    ok = (
        isinstance(job.stages, int)
        and job.stages >= 1
        and ints(job.boundaries)
        and len(job.boundaries) == job.stages + 1
        and ints(job.remote)
        and all(1 <= s <= job.stages for s in job.remote)
        and job.dtype in ("float32", "bfloat16", "float16")
        and job.backend in ("gloo", "nccl")
        and all(
            isinstance(x, (int, float)) and x >= 0
            for x in (job.timeout_s, job.emulate_stage_ms, job.emulate_token_ms, job.emulate_link_ms)
        )
    )
    if not ok:
        raise ValueError("malformed job")


def publish_job(store, job: StageJob) -> None:
    """Offer ``job`` to the stage machines through the server's store."""
    store.set(JOB_KEY, json.dumps(asdict(job)))


def read_job(host: str, port: int, timeout_s: float):
    """Connect to a server's store and read its job: ``(store, StageJob)``; one sentence when there is none."""
    import torch.distributed as dist

    deadline = time.monotonic() + timeout_s
    # Wait for the server's port with a plain connection first: a store client that cannot connect logs torch's
    # stack traces on every retry.
    while True:
        try:
            socket.create_connection((host, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))).close()
            break
        except OSError:
            if time.monotonic() >= deadline:
                raise SpdInputError(
                    f"no spd-serve with remote stages answered at {host}:{port} within {timeout_s:g} "
                    "s; start spd-serve --runtime distributed --local-stages K --stage-addr ADDR:PORT "
                    "first, and give its --stage-addr here"
                ) from None
            time.sleep(0.5)
    timeout = datetime.timedelta(seconds=max(1.0, deadline - time.monotonic()))
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        store.wait([JOB_KEY], timeout)
        data = json.loads(store.get(JOB_KEY).decode())
        job = StageJob(**data)
        _check(job)
    except (RuntimeError, ValueError, TypeError) as exc:  # DistStoreError is a RuntimeError
        if isinstance(exc, (ValueError, TypeError)):
            raise SpdInputError(
                f"the server at {host}:{port} offered a job this spd {_spd_version()} cannot read; "
                "run the same spd version on every machine"
            ) from None
        raise SpdInputError(
            f"the service at {host}:{port} offered no spd job within {timeout_s:g} s; give the "
            "--stage-addr of an spd-serve started with --local-stages"
        ) from None
    return store, job


def claim_stages(store, job: StageJob, hold: list[int] | None) -> list[int]:
    """The stages this machine runs (``hold``, default: every remote stage), claimed in the store so that no
    other machine runs them too; one sentence when a stage is not remote or already claimed."""
    stages = sorted(set(job.remote if hold is None else hold))
    for stage in stages:
        if stage not in job.remote:
            raise SpdInputError(
                f"stage {stage} is not one that this job's other machines run; they run stages "
                f"{', '.join(map(str, job.remote))} of {job.stages}"
            )
    for stage in stages:
        if store.add(f"spd/claim/{stage}", 1) > 1:
            raise SpdInputError(
                f"stage {stage} is already run by another machine of this job; give each machine "
                "its own stages with --hold"
            )
    return stages
