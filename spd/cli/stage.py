"""spd-stage: run some of a server's pipeline stages on this machine.

    spd-serve --target DIR --speculator H --runtime distributed --local-stages 2 --stage-addr 10.0.0.1:29500
    spd-stage --server 10.0.0.1:29500 --target DIR                  # on the other machine: stages 3 and 4

The server (rank 0 and its own stages) publishes the job at its ``--stage-addr``: the number of stages, the cut,
dtype, backend, timeouts and emulation. This command reads it, claims the stages it holds (``--hold``, default:
every stage the server does not run), loads only those stages' layers from ``--target`` (this machine's copy of the
target; a sharded checkpoint needs only their shards), starts one process per stage and joins the job. Every rank
then checks that all machines run the same spd, torch, target, cut and settings (one line each if not). It ends
with the job: 0 when the server stops it, 1 when a rank is lost, 2 for a wrong input; Ctrl-C or SIGTERM stops its
stages. The stage network must be trusted: ``torch.distributed`` authenticates no peer (docs/runtime.md).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from spd.errors import SpdInputError, run_cli


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="spd-stage", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--server", required=True, help="the server's --stage-addr, HOST[:PORT] (port default 29500)")
    p.add_argument("--target", required=True, help="this machine's copy of the target (directory or hub id)")
    p.add_argument("--revision", default=None)
    p.add_argument(
        "--hold",
        default=None,
        help="the stages this machine runs, e.g. 3,4 (default: every stage the server does not run)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per stage process (default: %(default)s)")
    p.add_argument(
        "--wait-s",
        type=float,
        default=600.0,
        help="how long to wait for the server to offer its job (default: %(default)s)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_cli(run, args, flush=True, interrupted=130)


def _hold(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        stages = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        stages = []
    if not stages or min(stages) < 1:
        raise SpdInputError(f"--hold '{text}' is not a list of stage numbers; expected e.g. 3,4")
    return stages


def run(args) -> int:
    import spd
    from spd.runtime.children import end_child, sigterm_unwinds, start_child
    from spd.runtime.join import claim_stages, parse_address, read_job

    if args.threads < 1:
        raise SpdInputError(f"--threads must be at least 1, got {args.threads}")
    if not args.wait_s > 0:
        raise SpdInputError(f"--wait-s must be a positive number of seconds, got {args.wait_s}")
    hold = _hold(args.hold)
    host, port = parse_address(args.server)
    store, job = read_job(host, port, args.wait_s)
    if job.version != spd.__version__:
        raise SpdInputError(
            f"the server at {host}:{port} runs spd {job.version} and this machine spd "
            f"{spd.__version__}; install the same version on every machine"
        )
    if not job.remote:
        raise SpdInputError(
            f"the server at {host}:{port} runs every stage itself; start it with --local-stages K "
            "for other machines to run the rest"
        )
    stages = claim_stages(store, job, hold)
    cut = job.boundaries
    layers = ", ".join(f"stage {s}: layers {cut[s - 1]}-{cut[s] - 1}" for s in stages)
    print(
        f"[spd-stage] running {len(stages)} of the {job.stages} stages of the job at {host}:{port} ({layers})",
        file=sys.stderr,
        flush=True,
    )
    cmd = job.stage_command(args.target, args.revision, args.threads)
    sigterm_unwinds()
    procs: list[subprocess.Popen] = []
    try:
        for local_rank, stage in enumerate(stages):
            env = job.stage_env(host, port, stage, local_rank, len(stages))
            procs.append(start_child(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
        return _wait(procs)
    finally:
        for proc in procs:
            if proc.poll() is None:
                end_child(proc, grace_s=5)


def _wait(procs: list[subprocess.Popen]) -> int:
    """Until every stage process has ended (0), or one failed: then the others are stopped and its status is
    returned (each printed its own ``error:`` line)."""
    while True:
        codes = [proc.poll() for proc in procs]
        failed = [code for code in codes if code not in (None, 0)]
        if failed:
            return failed[0] if failed[0] > 0 else 1
        if all(code == 0 for code in codes):
            print("[spd-stage] the server ended the job", file=sys.stderr, flush=True)
            return 0
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
