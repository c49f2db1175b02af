"""The flags of a batched pipeline's prompt admission and tree width (``--max-batch B > 1``), shared by
``spd-serve`` and ``run_pipeline`` (docs/method.md §9, docs/serving.md)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from ..errors import SpdInputError

FLAGS = ("prefill_chunk", "step_tokens", "spread_prefill", "tree_nodes")


def add_prefill_flags(p: argparse.ArgumentParser, number: Callable[[str], int] = int) -> None:
    """``--prefill-chunk``, ``--step-tokens`` and ``--spread-prefill``; ``number`` parses the two counts."""
    p.add_argument(
        "--prefill-chunk",
        type=number,
        default=None,
        help="--max-batch B > 1: prompt tokens that enter the pipeline per step, all newcomers together "
        "(oldest first); smaller chunks shorten the steps that carry them, for every request in "
        "flight, and lengthen the newcomers' time to first token (default: 64)",
    )
    p.add_argument(
        "--step-tokens",
        type=number,
        default=None,
        help="--max-batch B > 1: a stage call's token budget; prompts enter with what the requests in "
        "flight leave of it, so a step that carries a prompt is no longer than a full one (bounds "
        "the time between tokens; above B x the tree width; default: no budget, --prefill-chunk "
        "alone)",
    )
    p.add_argument(
        "--spread-prefill",
        action="store_true",
        help="--max-batch B > 1: each prompt enters in n equal chunks (n stages), so every stage call "
        "carries 1/n of it: shorter steps for the requests in flight, n - 1 more steps to the "
        "newcomer's first token (default: off)",
    )
    p.add_argument(
        "--tree-nodes",
        type=number,
        default=None,
        help="--max-batch B > 1, --mode tree: a node budget per tree level across the batch; each "
        "request's tree is at most N / (requests in flight) wide, so the trees narrow as the batch "
        "grows and a stage call carries about N tree nodes (at least B; default: no budget)",
    )


def check_prefill_flags(args: argparse.Namespace, what: str) -> None:
    """These flags only mean something to a batched ``what`` (a server, a run): one sentence otherwise."""
    for flag in FLAGS:
        if getattr(args, flag) not in (None, False) and args.max_batch == 1:
            raise SpdInputError(
                f"--{flag.replace('_', '-')} sets how a batched {what} admits prompts; it needs --max-batch above 1"
            )
    if args.tree_nodes is not None and args.tree_nodes < args.max_batch:
        raise SpdInputError(
            f"--tree-nodes must be at least --max-batch ({args.max_batch}: one node per request and "
            f"level), got {args.tree_nodes}"
        )
    modes = args.mode if isinstance(args.mode, list) else [args.mode]
    if args.tree_nodes is not None and "tree" not in modes:
        raise SpdInputError("--tree-nodes narrows token trees; it needs --mode tree")


def prefill_options(args: argparse.Namespace) -> dict:
    """The flags as :class:`~spd.decoding.batch.BatchedPipeline` keyword arguments."""
    from ..decoding.batch import DEFAULT_PREFILL_CHUNK

    return {
        "prefill_chunk": args.prefill_chunk or DEFAULT_PREFILL_CHUNK,
        "step_tokens": args.step_tokens,
        "spread_prefill": args.spread_prefill,
        "tree_nodes": args.tree_nodes,
    }
