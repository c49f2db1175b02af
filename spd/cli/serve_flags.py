"""spd-serve's own flags, beyond spd-generate's model flags: one function per group, their types, and their checks
before anything loads (each wrong flag one error)."""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path

from spd.cli.batch_flags import add_prefill_flags, check_prefill_flags
from spd.decoding.spec import finite_float, positive_int
from spd.errors import SpdInputError


def add_listen_flags(p: argparse.ArgumentParser) -> None:
    """Where the server listens, and the model id clients send."""
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port (default: %(default)s; 0 = a free one)")
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients send (default: the target's directory name or hub id)",
    )


def add_queue_flags(p: argparse.ArgumentParser) -> None:
    """How many requests may wait, and how many run at once (a batch, and how its prompts enter)."""
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
        help="requests in flight at once (default: %(default)s). 1 runs them one after another on the "
        "single-request path: SPD's regime, the lowest latency per request (a batch of one costs about 4%% more "
        "CPU per step, docs/benchmarks.md), and it works in every mode. B > 1 batches up to B in the pipeline, "
        "admitted at step boundaries, for more tokens/s when many clients wait (--mode spd, pp or tree; see "
        "--kv-rows)",
    )
    p.add_argument(
        "--kv-rows",
        type=positive_int,
        default=None,
        help="--max-batch B > 1: KV rows shared by the requests in flight (each needs prompt + max_tokens "
        "+ the tree in flight; more wait) (default: 2048 per request of B)",
    )
    add_prefill_flags(p, positive_int)


def add_stage_flags(p: argparse.ArgumentParser) -> None:
    """--runtime distributed: the stages' pings, which stages run here and where the others join."""
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
        "where the other machines' stages join; listens on that address only (default: none; the port "
        "defaults to 29500)",
    )
    p.add_argument(
        "--join-timeout-s",
        type=_positive_seconds,
        default=600.0,
        help="--runtime distributed: how long the stages may take to load and join (default: %(default)s)",
    )


def add_limit_flags(p: argparse.ArgumentParser) -> None:
    """What one request may cost, and who may send one (docs/serving.md)."""
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
    p.add_argument("--enable-docs", action="store_true", help="serve /docs, /redoc and /openapi.json (default: off)")


def add_traffic_flags(p: argparse.ArgumentParser) -> None:
    """Learning from traffic: the records, spd-adapt as the server's child, and the head versions swapped in."""
    p.add_argument(
        "--record",
        metavar="DIR",
        default=None,
        help="append every finished request (prompt and answer as token ids, sampling settings, head, acceptance) "
        "to traffic records in DIR, the trainer's data for the head (data=DIR); readable by the owner only "
        "(default: off; docs/serving.md says what is stored)",
    )
    p.add_argument(
        "--record-max-mb",
        type=positive_int,
        default=1024,
        help="--record: the most MiB the records may take; the oldest shards go first (default: %(default)s)",
    )
    p.add_argument(
        "--adapt",
        action="store_true",
        help="--record DIR with --mode spd or tree and --speculator HEAD: run spd-adapt on DIR as a niced child "
        "process that fine-tunes the head on what the server answers and publishes better versions in DIR/heads, "
        "which the server swaps in (default: off)",
    )
    p.add_argument(
        "--adapt-every",
        type=positive_int,
        default=None,
        metavar="TOKENS",
        help="--adapt: new answer tokens that start a round (spd-adapt's --every; default: spd-adapt's, 20000)",
    )
    p.add_argument(
        "--adapt-replay",
        nargs="+",
        default=[],
        metavar="DATA",
        help="--adapt: the head's original data, mixed in so that it does not forget (spd-adapt's --replay; "
        "default: none)",
    )
    p.add_argument(
        "--adapt-threads",
        type=positive_int,
        default=None,
        metavar="N",
        help="--adapt: spd-adapt's threads, its trainer's included (default: 1)",
    )
    p.add_argument(
        "--adapt-args",
        default=None,
        metavar="ARGS",
        help="--adapt: more of spd-adapt's flags as one string, e.g. '--margin 0.02 --steps 100' (default: none)",
    )
    p.add_argument(
        "--head-versions",
        metavar="DIR",
        default=None,
        help="watch DIR for new versions of the head (vN directories, as spd-adapt writes them) and swap each in; "
        "for heads trained elsewhere (default: DIR/heads of --record, with --mode spd or tree and --speculator)",
    )


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


def check_server_flags(args: argparse.Namespace) -> str | None:
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
    _check_adapt_flags(args)
    api_key = args.api_key if args.api_key is not None else os.environ.get("SPD_API_KEY") or None
    if api_key is not None and not api_key.strip():
        raise SpdInputError(
            "the API key (--api-key or SPD_API_KEY) is empty; expected a key clients will send as "
            "'Authorization: Bearer KEY'"
        )
    return api_key


ADAPT_OWN_FLAGS = ("--records", "--head", "--versions", "--every", "--replay", "--threads", "--once")


def _check_adapt_flags(args) -> None:
    """--adapt and --head-versions: what they need, checked before anything loads."""
    if not args.adapt:
        for flag, value in (
            ("--adapt-every", args.adapt_every),
            ("--adapt-replay", args.adapt_replay),
            ("--adapt-threads", args.adapt_threads),
            ("--adapt-args", args.adapt_args),
        ):
            if value:
                raise SpdInputError(f"{flag} sets up the server's spd-adapt; it needs --adapt")
    if args.adapt and args.record is None:
        raise SpdInputError("--adapt learns from the server's traffic records; it needs --record DIR")
    if (args.adapt or args.head_versions is not None) and (args.mode not in ("spd", "tree") or not args.speculator):
        flag = "--adapt" if args.adapt else "--head-versions"
        has = f"--mode {args.mode}" + ("" if args.speculator else " without --speculator")
        raise SpdInputError(
            f"{flag} swaps new versions of the server's head in; it needs --mode spd or tree with --speculator HEAD, "
            f"got {has}"
        )
    if args.adapt:
        from spd.heads.published.authors_file import is_authors_file

        if is_authors_file(args.speculator):
            raise SpdInputError(
                f"--adapt fine-tunes heads trained here, and --speculator '{args.speculator}' is an SPD authors' head "
                "file; convert it first (spd-convert) or leave --adapt out"
            )
    if args.head_versions is not None and Path(args.head_versions).expanduser().is_file():
        raise SpdInputError(f"--head-versions '{args.head_versions}' is a file; expected a directory of head versions")
    try:
        extra = shlex.split(args.adapt_args or "")
    except ValueError as exc:
        raise SpdInputError(f"--adapt-args cannot be split into flags ({exc}); expected e.g. '--margin 0.02'") from None
    own = [item for item in extra if item.split("=")[0] in ADAPT_OWN_FLAGS]
    if own:
        raise SpdInputError(
            f"--adapt-args sets {own[0].split('=')[0]}, which the server sets itself; use its --adapt-* flag or "
            "leave it out"
        )
