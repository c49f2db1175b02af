"""spd-serve's log on stderr: its format, uvicorn's messages in the server's words, the line once it listens and the
line as it stops (the access lines are :class:`spd.serving.middleware.AccessLog`'s)."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import uvicorn

    from spd.decoding.batch import BatchedPipeline
    from spd.serving.heads import HeadVersions
    from spd.serving.metrics import ServerMetrics
    from spd.serving.pipeline import Pipeline


_LEVELS = ("debug", "info", "warning", "error", "critical")  # --log-level's choices, least severe first


class _LogFormat(logging.Formatter):
    """``[spd-serve] message``, a warning or an error saying so first (as the one-line ``error:`` of a wrong flag)."""

    def format(self, record: logging.LogRecord) -> str:
        level = record.levelno
        kind = "error: " if level > logging.WARNING else "warning: " if level == logging.WARNING else ""
        return f"[spd-serve] {kind}{super().format(record)}"


class _ConnectionLimit(logging.Filter):
    """uvicorn's own 503 (more connections than it takes) logged in words that say what happened and which flag
    sets the limit."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == "Exceeded concurrency limit.":
            record.msg = (
                f"503 Service Unavailable to a new request: {self.limit} connections are open, the most this server "
                "takes (2 x --max-queue + 16)"
            )
            record.args = ()
        return True


def log_to_stderr(level: str, connections: int) -> None:
    """The server's log (``spd.serve``: access lines, 503s, shutdown) and uvicorn's on stderr, at ``--log-level``;
    uvicorn's own messages only as warnings and errors unless ``debug`` (its start-up lines repeat ours)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_LogFormat())
    for name, at in (("spd.serve", level), ("uvicorn", uvicorn_level(level))):
        logger = logging.getLogger(name)
        logger.handlers, logger.propagate = [handler], False
        logger.setLevel(at.upper())
    uvicorn_errors = logging.getLogger("uvicorn.error")
    uvicorn_errors.filters = [_ConnectionLimit(connections)]


def uvicorn_level(level: str) -> str:
    """uvicorn's log level for ``--log-level``: at least warning, unless debug."""
    return level if level == "debug" else max(level, "warning", key=_LEVELS.index)


def log_shutdown(metrics: ServerMetrics, seconds: float, waiting: int) -> None:
    """One line as the server stops: how long it served and what it answered."""
    counts = metrics.outcomes()
    detail = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items()) if n)
    minutes, secs = divmod(int(seconds), 60)
    if minutes >= 60:
        uptime = f"{minutes // 60} h {minutes % 60} min"
    else:
        uptime = f"{minutes} min {secs} s" if minutes else f"{seconds:.1f} s"
    logging.getLogger("spd.serve").info(
        f"shutting down after {uptime}: {sum(counts.values())} requests answered"
        + (f" ({detail})" if detail else "")
        + (f"; the {waiting} waiting are refused" if waiting else "")
    )


def _kv_bytes_per_token(pipeline: Pipeline) -> int | None:
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


def announce(
    server: uvicorn.Server,
    args: argparse.Namespace,
    name: str,
    pipeline: Pipeline,
    max_model_len: int,
    batch: BatchedPipeline | None = None,
    heads: HeadVersions | None = None,
) -> None:
    """One line on stderr once the socket listens (with --port 0, the port it got)."""
    import threading
    import time

    from spd.target.cut import describe_cut

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
            head = (
                f"head v{heads.current.number} '{heads.current.label}' (new versions from '{heads.directory}'), "
                if heads is not None
                else ""
            )
            print(
                f"[spd-serve] {name}: mode {args.mode}, {describe_cut(pipeline.staged.boundaries)}, "
                f"runtime {args.runtime}, {head}"
                f"max model len {max_model_len}{kv}; listening on http://{args.host}:{port}",
                file=sys.stderr,
                flush=True,
            )

    threading.Thread(target=wait_and_print, daemon=True).start()
