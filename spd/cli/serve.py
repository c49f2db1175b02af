"""spd-serve: an OpenAI-compatible HTTP server on a persistent pipeline.

    spd-serve --target testbed/target --mode spd --speculator runs/quickstart-n4/final --port 8000
    spd-serve --mode pp --stages 4 --runtime distributed          # one process per stage, started once
    spd-serve --mode tree --draft-model testbed/draft --stages 4 --tree-width 4
    spd-serve --mode spd --speculator H --runtime distributed --local-stages 2 --stage-addr 10.0.0.1:29500
        # stages 3-4 on another machine: spd-stage --server 10.0.0.1:29500 --target DIR (docs/runtime.md)

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with "stream": true as server-sent
events), GET /v1/models, GET /health, GET /metrics (Prometheus). The model flags are spd-generate's. The
model loads once, requests run one at a time on the pipeline in arrival order, at most --max-queue wait
(then 503 with Retry-After). Limits (docs/serving.md): --max-body-bytes, --max-model-len (prompt +
max_tokens; the KV cache of the one running request is sized for at most this), --api-key (or SPD_API_KEY)
for /v1/*, --enable-docs for /docs. A wrong flag prints one ``error:`` line and exits with 2.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from spd.errors import SpdInputError, run_cli
from spd.cli.generate import _Parser, _quiet_libraries
from spd.decoding.spec import DecodingSpec, finite_float, positive_int
from spd.cli.batch_flags import add_prefill_flags, check_prefill_flags, prefill_options


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="spd-serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    DecodingSpec.add_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port (default: %(default)s; 0 = a free one)")
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients send (default: the target's directory name or hub id)",
    )
    p.add_argument(
        "--max-queue",
        type=positive_int,
        default=64,
        help="requests that may wait for the pipeline; one more gets 503 (default: %(default)s)",
    )
    p.add_argument(
        "--max-batch",
        type=positive_int,
        default=1,
        help="requests in flight at once: 1 runs them one after another (SPD's lowest latency); B > 1 "
        "batches up to B in the pipeline, admitted at step boundaries (local runtime, --mode spd, "
        "pp or tree; default: %(default)s)",
    )
    p.add_argument(
        "--kv-rows",
        type=positive_int,
        default=None,
        help="--max-batch B > 1: KV rows shared by the requests in flight (each needs prompt + max_tokens "
        "+ the tree in flight; more wait); default: 2048 per request of B",
    )
    add_prefill_flags(p, positive_int)
    p.add_argument(
        "--idle-ping-s",
        type=_positive_seconds,
        default=None,
        help="--runtime distributed: ping idle stages this often, in seconds, less than --timeout-s "
        "(default: a quarter of --timeout-s, at most 5)",
    )
    p.add_argument(
        "--local-stages",
        type=_non_negative_int,
        default=None,
        help="--runtime distributed: run stages 1..K on this machine; the others join from other machines "
        "with spd-stage (default: all stages here)",
    )
    p.add_argument(
        "--stage-addr",
        default=None,
        help="--runtime distributed with --local-stages: this machine's HOST[:PORT] on the stage network, "
        "where the other machines' stages join (port default 29500); listens on that address only",
    )
    p.add_argument(
        "--join-timeout-s",
        type=_positive_seconds,
        default=600.0,
        help="--runtime distributed: how long the stages may take to load and join (default: %(default)s)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=positive_int,
        default=8 * 2**20,
        help="largest request body; a larger one gets 413 before it is read (default: %(default)s = 8 MiB)",
    )
    p.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="most tokens of prompt + max_tokens per request, which sizes the running request's KV "
        "cache (default: the model's context)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $SPD_API_KEY, else none); /health "
        "and /metrics stay open",
    )
    p.add_argument("--enable-docs", action="store_true", help="serve /docs, /redoc and /openapi.json")
    p.add_argument(
        "--log-level",
        default="warning",
        choices=("critical", "error", "warning", "info", "debug"),
        help="uvicorn's log level (default: %(default)s)",
    )
    return p


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text}")
    return value


def _positive_seconds(text: str) -> float:
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_cli(serve, args, interrupted=130)


def serve(args) -> int:
    decoding = DecodingSpec.of(args)
    args.mode = decoding.mode  # the default follows --speculator and --draft-model
    decoding.check()
    api_key = _check_server_flags(args)
    try:
        import uvicorn

        from spd.serving.app import create_app
    except ImportError as exc:
        raise SpdInputError(
            f"spd-serve needs the serve extra ({exc.name} is missing); pip install 'spd[serve]'"
        ) from None
    from spd.serving.app import Limits
    from spd.serving.metrics import ServerMetrics
    from spd.serving.pipeline import PipelineSpec, open_pipeline
    from spd.serving.scheduler import Scheduler

    _quiet_libraries()
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
        idle_s = args.idle_ping_s or min(5.0, args.timeout_s / 4)
        scheduler = Scheduler(
            pipeline,
            metrics,
            max_queue=args.max_queue,
            idle_s=idle_s,
            max_batch=args.max_batch,
            kv_rows=args.kv_rows,
            batch_options=prefill_options(args),
        )
    except BaseException:
        pipeline.close()
        raise
    scheduler.start()
    try:
        limits = Limits(
            max_body_bytes=args.max_body_bytes,
            max_model_len=max_model_len,
            api_key=api_key,
            enable_docs=args.enable_docs,
        )
        # Connections beyond what the queue can take get uvicorn's 503 before their body is read: with the
        # body cap this bounds the memory that request bodies can hold at once.
        config = uvicorn.Config(
            create_app(scheduler, metrics, name, limits),
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=5,
            limit_concurrency=2 * args.max_queue + 16,
        )
        server = uvicorn.Server(config)
        _announce(server, args, name, pipeline, max_model_len, scheduler.batch)
        server.run()
    finally:
        scheduler.stop()
    return 0


def _check_server_flags(args) -> str | None:
    """The server's own flags checked before anything loads (one error each); returns the API key, if any."""
    if not 0 <= args.port < 65536:
        raise SpdInputError(f"--port must be in 0..65535, got {args.port}")
    if args.idle_ping_s is not None and args.runtime == "distributed" and args.idle_ping_s >= args.timeout_s:
        raise SpdInputError(
            f"--idle-ping-s ({args.idle_ping_s:g}) must be less than --timeout-s "
            f"({args.timeout_s:g}), or idle stages time out between pings"
        )
    if args.runtime != "distributed" and (args.local_stages is not None or args.stage_addr is not None):
        raise SpdInputError(
            "--local-stages and --stage-addr place stages on other machines; they need --runtime distributed"
        )
    from spd.serving.pipeline import check_batching

    check_batching(args.max_batch, args.runtime, args.mode)  # before the model loads
    if args.kv_rows is not None and args.max_batch == 1:
        raise SpdInputError("--kv-rows sizes the KV pool of a batched server; it needs --max-batch above 1")
    check_prefill_flags(args, "server")
    api_key = args.api_key if args.api_key is not None else os.environ.get("SPD_API_KEY") or None
    if api_key is not None and not api_key.strip():
        raise SpdInputError(
            "the API key (--api-key or SPD_API_KEY) is empty; expected a key clients will send as "
            "'Authorization: Bearer KEY'"
        )
    return api_key


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


def _kv_bytes_per_token(pipeline) -> int | None:
    """The target's KV cache bytes per token position (all layers, keys and values), if the config says."""
    import torch

    try:
        staged = pipeline.staged
        return (
            2
            * staged.config.num_hidden_layers
            * staged.kv_heads
            * staged.head_dim
            * getattr(torch, pipeline.spec.dtype).itemsize
        )
    except (AttributeError, TypeError):
        return None


def _exit_cleanly(*_) -> None:
    raise SystemExit(0)


def _announce(server, args, name: str, pipeline, max_model_len: int, batch=None) -> None:
    """One line on stderr once the socket listens (with --port 0, the port it got)."""
    import threading
    import time

    def wait_and_print():
        while not server.started and not server.should_exit:
            time.sleep(0.05)
        if server.started:
            port = server.servers[0].sockets[0].getsockname()[1] if server.servers else args.port
            per_token = _kv_bytes_per_token(pipeline)
            kv = f" (target KV at most {per_token * max_model_len / 2**20:.0f} MiB)" if per_token else ""
            if batch is not None:  # the pool is allocated once, whatever the requests
                kv = (
                    f", max batch {batch.max_batch} (KV pool of {batch.pool.rows} rows, "
                    f"{batch.pool.row_bytes(batch.staged) * batch.pool.rows / 2**20:.0f} MiB; "
                    f"{batch.prefill_chunk} prompt tokens a step"
                    + (f", {batch.step_tokens} tokens a stage call" if batch.step_tokens else "")
                    + (", each prompt in n chunks" if batch.spread_prefill else "")
                    + (f", trees of at most {batch.tree_nodes} nodes a level" if batch.tree_nodes else "")
                    + ")"
                )
            print(
                f"[spd-serve] {name}: mode {args.mode}, {pipeline.n_stages} stages, runtime {args.runtime}, "
                f"max model len {max_model_len}{kv}; listening on http://{args.host}:{port}",
                file=sys.stderr,
                flush=True,
            )

    threading.Thread(target=wait_and_print, daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
