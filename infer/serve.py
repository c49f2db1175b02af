"""spd-serve: an OpenAI-compatible HTTP server on a persistent pipeline.

    spd-serve --target testbed/target --mode spd --speculator runs/quickstart-n4/final --port 8000
    spd-serve --mode pp --stages 4 --runtime distributed          # one process per stage, started once
    spd-serve --mode tree --draft-model testbed/draft --stages 4 --tree-width 4

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with "stream": true as server-sent
events), GET /v1/models, GET /health, GET /metrics (Prometheus). The model flags are spd-generate's. The
model loads once, requests run one at a time on the pipeline in arrival order, at most --max-queue wait
(then 503 with Retry-After). A wrong flag prints one ``error:`` line and exits with 2.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from spd.errors import SpdInputError
from infer.generate import _finite_float, _Parser, _positive_int, _quiet_libraries, add_model_flags, check_model_flags


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="spd-serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port (default: %(default)s; 0 = a free one)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: the target's directory name or hub id)")
    p.add_argument("--max-queue", type=_positive_int, default=64,
                   help="requests that may wait for the pipeline; one more gets 503 (default: %(default)s)")
    p.add_argument("--idle-ping-s", type=_finite_float, default=None,
                   help="--runtime distributed: ping idle stages this often (default: a quarter of --timeout-s)")
    p.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level (default: %(default)s)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return serve(args)
    except SpdInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def serve(args) -> int:
    check_model_flags(args)
    if not 0 <= args.port < 65536:
        raise SpdInputError(f"--port must be in 0..65535, got {args.port}")
    try:
        import uvicorn

        from spd.serving.app import create_app
    except ImportError as exc:
        raise SpdInputError(f"spd-serve needs the serve extra ({exc.name} is missing); pip install 'spd[serve]'") \
            from None
    from spd.serving.metrics import ServerMetrics
    from spd.serving.pipeline import PipelineSpec, open_pipeline
    from spd.serving.scheduler import Scheduler

    _quiet_libraries()
    spec = PipelineSpec(target=args.target, mode=args.mode, stages=args.stages, revision=args.revision,
                        tokenizer=args.tokenizer, speculator=args.speculator,
                        speculator_revision=args.speculator_revision, draft_model=args.draft_model,
                        draft_revision=args.draft_revision, tree_width=args.tree_width,
                        tree_children=args.tree_children, tree_max_width=args.tree_max_width,
                        tree_candidates=args.tree_candidates, draft_steps=args.draft_steps, dtype=args.dtype, device=args.device,
                        runtime=args.runtime,
                        emulate_stage_ms=args.emulate_stage_ms, emulate_link_ms=args.emulate_link_ms,
                        timeout_s=args.timeout_s)
    name = args.served_model_name or (Path(args.target).name if Path(args.target).is_dir() else args.target)
    pipeline = open_pipeline(spec)
    metrics = ServerMetrics(name, args.mode, pipeline.n_stages, args.runtime)
    idle_s = args.idle_ping_s or min(5.0, args.timeout_s / 4)
    scheduler = Scheduler(pipeline, metrics, max_queue=args.max_queue, idle_s=idle_s)
    scheduler.start()
    config = uvicorn.Config(create_app(scheduler, metrics, name), host=args.host, port=args.port,
                            log_level=args.log_level, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    _announce(server, args, name, pipeline)
    # uvicorn handles SIGTERM while it runs and raises it again once it has stopped; then it must unwind through
    # the finally below (stop the stage processes cleanly) instead of killing the process at once.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    try:
        server.run()
    finally:
        scheduler.stop()
    return 0


def _exit_cleanly(*_) -> None:
    raise SystemExit(0)


def _announce(server, args, name: str, pipeline) -> None:
    """One line on stderr once the socket listens (with --port 0, the port it got)."""
    import threading
    import time

    def wait_and_print():
        while not server.started and not server.should_exit:
            time.sleep(0.05)
        if server.started:
            port = server.servers[0].sockets[0].getsockname()[1] if server.servers else args.port
            print(f"[spd-serve] {name}: mode {args.mode}, {pipeline.n_stages} stages, runtime {args.runtime}; "
                  f"listening on http://{args.host}:{port}", file=sys.stderr, flush=True)

    threading.Thread(target=wait_and_print, daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
