"""spd-serve: an OpenAI-compatible HTTP server on a persistent pipeline.

    spd-serve --target testbed/target --mode spd --speculator runs/quickstart-n4/final --port 8000
    spd-serve --mode pp --stages 4 --runtime distributed          # one process per stage, started once
    spd-serve --mode tree --draft-model testbed/draft --stages 4 --tree-width 4
    spd-serve --mode spd --speculator H --runtime distributed --local-stages 2 --stage-addr 10.0.0.1:29500
        # stages 3-4 on another machine: spd-stage --server 10.0.0.1:29500 --target DIR (docs/runtime.md)

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with "stream": true as server-sent
events), GET /v1/models, GET /health, GET /metrics (Prometheus). The model flags are spd-generate's
(modes ar, pp, spd, tree and sd; --stages N cuts the target into N stages, equal where N divides its
layers, else the larger stages first). The model loads once, requests run one at a time on the pipeline
in arrival order, at most --max-queue wait (then 503 with Retry-After). Limits (docs/serving.md):
--max-body-bytes, --max-model-len (prompt + max_tokens; the KV cache of the one running request is sized
for at most this), --api-key (or SPD_API_KEY) for /v1/*, --enable-docs for /docs. A wrong flag, or a
--host:--port it cannot listen on, prints one error: line and exits with 2 before the model loads. The
log (stderr, --log-level): one line once it listens (the mode and the cut), one line per request, a
warning for every 503, one line at shutdown. Learning from traffic (docs/serving.md): with --record DIR and
a head the server watches DIR/heads (or --head-versions DIR) and swaps each new version in between steps; --adapt
also runs spd-adapt on DIR as its niced child, which writes those versions.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import shlex
import signal
import socket
import sys
import time
from pathlib import Path

from spd.cli.batch_flags import prefill_options
from spd.cli.common import Parser, quiet_libraries
from spd.cli.serve_flags import (
    add_limit_flags,
    add_listen_flags,
    add_queue_flags,
    add_stage_flags,
    add_traffic_flags,
    check_server_flags,
)
from spd.cli.serve_log import announce, log_shutdown, log_to_stderr, uvicorn_level
from spd.decoding.spec import DecodingSpec
from spd.errors import SpdInputError, run_cli


def build_parser() -> argparse.ArgumentParser:
    """spd-serve's flags: spd-generate's model flags, then the server's own."""
    p = Parser(prog="spd-serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    DecodingSpec.add_flags(p)
    add_listen_flags(p)
    add_queue_flags(p)
    add_stage_flags(p)
    add_limit_flags(p)
    add_traffic_flags(p)
    p.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="what the server logs on stderr: info, one line per request (client, method, path, status, "
        "completion tokens, L'_acc, time) and one at shutdown; warning, only 503s and other failures; error, "
        "only errors; debug adds uvicorn's own messages (default: %(default)s)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """spd-serve with ``argv`` (default: the command line); returns the exit status."""
    args = build_parser().parse_args(argv)
    return run_cli(serve, args, interrupted=130)


def serve(args: argparse.Namespace) -> int:
    """Serve as ``args`` say; the flags and the address are checked before the model loads."""
    decoding = DecodingSpec.of(args)
    args.mode = decoding.mode  # the default follows --speculator and --draft-model
    decoding.check()
    decoding.check_sources()  # before torch is imported: a path that does not exist is refused at once
    api_key = check_server_flags(args)
    try:
        import uvicorn

        from spd.serving.app import create_app
    except ImportError as exc:
        raise SpdInputError(
            f"spd-serve needs the serve extra ({exc.name} is missing); install it with pip install -e '.[serve]' "
            "in the repository, or SPD_EXTRAS=serve bash scripts/install.sh"
        ) from None
    sockets = _listen_sockets(args.host, args.port)  # before the model loads: a port in use fails at once
    recorder = None
    try:
        if args.record is not None:  # before the model loads too: a directory that cannot take records fails at once
            from spd.traffic.records import TrafficRecorder

            recorder = TrafficRecorder(args.record, args.record_max_mb << 20, model=args.target)
        log_to_stderr(args.log_level, _connections(args))
        return _serve(args, decoding, api_key, sockets, uvicorn, create_app, recorder)
    finally:
        if recorder is not None:
            recorder.close()
        for sock in sockets:
            sock.close()


def _serve(
    args, decoding: DecodingSpec, api_key: str | None, sockets: list[socket.socket], uvicorn, create_app, recorder
):
    """Load the pipeline, start the scheduler and serve on ``sockets`` until stopped (``recorder``: where finished
    requests are recorded, or None)."""
    from spd.serving.metrics import ServerMetrics
    from spd.serving.pipeline import PipelineSpec, open_pipeline
    from spd.serving.state import Limits

    quiet_libraries()
    spec = PipelineSpec.of(
        decoding, local_stages=args.local_stages, stage_addr=args.stage_addr, join_timeout_s=args.join_timeout_s
    )
    name = args.served_model_name or (Path(args.target).name if Path(args.target).is_dir() else args.target)
    # SIGTERM unwinds (SystemExit) from here on, through the loading too: open_pipeline then stops the stage
    # processes it started, and the finally below the ones of a running server. uvicorn handles SIGTERM itself
    # while it runs and raises it again once it has stopped.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    pipeline = open_pipeline(spec)
    try:
        max_model_len = _max_model_len(args, pipeline)
        metrics = ServerMetrics(name, args.mode, pipeline.n_stages, args.runtime)
        versions = _versions_dir(args)
        scheduler, heads = _scheduler(args, decoding, pipeline, metrics, versions, recorder)
    except BaseException:
        pipeline.close()
        raise
    scheduler.start()
    server = adapt = None
    try:
        if heads is not None:
            heads.start()
        if args.adapt:
            adapt = _start_adapt(args, versions)
        limits = Limits(
            max_body_bytes=args.max_body_bytes,
            max_model_len=max_model_len,
            api_key=api_key,
            enable_docs=args.enable_docs,
        )
        server = _http_server(args, uvicorn, create_app(scheduler, metrics, name, limits))
        announce(server, args, name, pipeline, max_model_len, scheduler.batch, heads)
        started = time.monotonic()
        server.run(sockets=sockets)
    finally:
        if server is not None and server.started:
            log_shutdown(metrics, time.monotonic() - started, scheduler.queue.qsize())
        if heads is not None:
            heads.stop()
        scheduler.stop()
        if adapt is not None:
            adapt.close()
    return 0


def _scheduler(args, decoding: DecodingSpec, pipeline, metrics, versions: Path | None, recorder):
    """The scheduler over ``pipeline``, and the head versions it swaps in from ``versions`` (None: it watches for
    none)."""
    from spd.serving.heads import HeadVersions
    from spd.serving.scheduler import Scheduler

    heads = None
    if versions is not None:  # the newest version that loads serves from the start
        heads = HeadVersions(versions, pipeline, metrics, label=decoding.speculator)
        heads.start_on_newest()
    idle_s = args.idle_ping_s or min(5.0, args.timeout_s / 4)
    scheduler = Scheduler(
        pipeline,
        metrics,
        max_queue=args.max_queue,
        idle_s=idle_s,
        max_batch=args.max_batch,
        kv_rows=args.kv_rows,
        batch_options=prefill_options(args),
        recorder=recorder,
        head=decoding.speculator or decoding.draft_model,
        heads=heads,
    )
    if recorder is not None:
        metrics.watch_records(recorder.counts)
    return scheduler, heads


def _http_server(args, uvicorn, app):
    """uvicorn's server for ``app``, logging as ``--log-level`` says."""
    # Connections beyond what the queue can take get uvicorn's 503 before their body is read: with the
    # body cap this bounds the memory that request bodies can hold at once.
    config = uvicorn.Config(
        app,
        log_config=None,  # log_to_stderr set it: our format, uvicorn's own messages only at debug or as warnings
        log_level=uvicorn_level(args.log_level),
        access_log=False,  # the app's AccessLog writes the access lines, with tokens and L'_acc
        timeout_graceful_shutdown=5,
        limit_concurrency=_connections(args),
    )
    return uvicorn.Server(config)


def _versions_dir(args) -> Path | None:
    """The directory of head versions the server watches: --head-versions, else DIR/heads of --record when it
    serves a head that can be swapped (--mode spd or tree with --speculator); None: it does not watch."""
    if args.head_versions is not None:
        return Path(args.head_versions).expanduser()
    if args.record is not None and args.mode in ("spd", "tree") and args.speculator:
        return Path(args.record).expanduser() / "heads"
    return None


def _start_adapt(args, versions: Path):
    """spd-adapt on --record's directory as the server's child (spd.serving.heads.AdaptProcess)."""
    from spd.serving.heads import ADAPT_NICE, AdaptProcess

    threads = str(args.adapt_threads or 1)
    cmd = [sys.executable, "-m", "spd.cli.adapt", "--records", args.record, "--head", args.speculator]
    cmd += ["--versions", str(versions), "--threads", threads]
    if args.adapt_every is not None:
        cmd += ["--every", str(args.adapt_every)]
    if args.adapt_replay:
        cmd += ["--replay", *args.adapt_replay]
    cmd += shlex.split(args.adapt_args or "")
    env = dict(
        os.environ,
        OMP_NUM_THREADS=threads,
        MKL_NUM_THREADS=threads,
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    child = AdaptProcess(cmd, env)
    logging.getLogger("spd.serve").info(
        f"spd-adapt (pid {child.proc.pid}) learns from '{args.record}' at niceness +{ADAPT_NICE} with {threads} "
        f"thread(s), its versions in '{versions}'; its lines are marked [spd-adapt]"
    )
    return child


def _connections(args) -> int:
    """Connections open at once (uvicorn's limit_concurrency); one more gets uvicorn's 503 before its body is read."""
    return 2 * args.max_queue + 16


def _listen_sockets(host: str, port: int) -> list[socket.socket]:
    """``--host``:``--port`` bound as uvicorn binds it (address reuse; an IPv6 socket for IPv6 only), before the
    model loads, so that an address that cannot be had is one error at once; uvicorn then serves on these sockets."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise SpdInputError(
            f"cannot listen on {where}: the host is not known ({exc.strerror}); expected --host 127.0.0.1, "
            "0.0.0.0 or an address of this machine"
        ) from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        why = {
            errno.EADDRINUSE: "the address is already in use; expected a free port (stop what listens there, "
            "or pass another --port; 0 picks a free one)",
            errno.EACCES: "permission denied (ports below 1024 need privileges); expected another --port",
            errno.EADDRNOTAVAIL: "the host is not an address of this machine; expected --host 127.0.0.1, 0.0.0.0 "
            "or one of its addresses",
        }.get(exc.errno, f"{exc.strerror or exc}; expected another --host or --port")
        raise SpdInputError(f"cannot listen on {where}: {why}") from None
    return sockets


def _max_model_len(args, pipeline) -> int:
    """--max-model-len, at most the model's context (the model's context by default)."""
    context = pipeline.max_positions
    if args.max_model_len is None:
        if context is None:
            raise SpdInputError("the target names no context length (max_position_embeddings); pass --max-model-len")
        return context
    if context is not None and args.max_model_len > context:
        raise SpdInputError(
            f"--max-model-len {args.max_model_len} is more than the model's context of {context} tokens"
        )
    return args.max_model_len


def _exit_cleanly(*_) -> None:
    raise SystemExit(0)


if __name__ == "__main__":
    sys.exit(main())
