"""Regenerate training data: a target's own answers to a set of prompts, stored as conversations, or a base
model's own continuations of prefixes of a text corpus, stored as text.

    python data/regenerate.py --target smollm2/target --prompts stdlib:1024 --out chats.jsonl
    python data/regenerate.py --target my-chat-model --prompts prompts.jsonl --out chats.jsonl --temperature 0.7
    python data/regenerate.py --target testbed/target --texts testbed/corpus/train.jsonl:8192 --out texts.jsonl

``--prompts`` is a jsonl file of ``{"prompt": ...}`` rows or of ``{"messages": [...]}`` rows (the first user turn is
the prompt; an ``"id"`` is optional, the row number is used otherwise; rows with ``"keep": false``, the samples
data/self_instruct.py rejected, are left out) or
``stdlib[:N]``: N coding instructions made from the Python standard library's documented functions
(spd/data/instructions.py); ``--skip N`` leaves out the first N. ``--texts FILE[:N]`` is for a base model (no chat
template): N prefixes (default: one per row) of the ``"text"`` of FILE's jsonl rows, each a run of whole lines from a line drawn with
``--seed``, at most ``--prefix-chars`` characters, the ``i``-th from row ``i`` modulo the rows; the target continues
each, and the row written is ``{"id", "text": prefix + continuation}``. Answers are greedy unless ``--temperature``
is set; they are written in batches and a run that is interrupted continues where it stopped (the ids already in
``--out`` are skipped). The rows train a head directly: ``accelerate launch train/distill.py ... data=chats.jsonl``.
Take the prefixes from the training split only, never from the prompts the head will be benchmarked on.

A large target can answer from an OpenAI-compatible server instead (vLLM, SGLang, spd-serve); nothing is loaded here:

    python data/regenerate.py --server http://localhost:8000 --concurrency 16 --prompts stdlib --out chats.jsonl

Each prompt is one /v1/chat/completions request (``--texts``: /v1/completions), at most ``--concurrency`` in flight,
``--model`` (default: the first model the server lists); the rows are the same, appended as the answers arrive (in
any order), and a rerun continues as above. Sampled answers (``--temperature``) carry a seed per row, so a rerun
asks for the same ones. A request that fails for want of the server (no connection, a timeout, HTTP 429 or 5xx) is
retried ``--retries`` times with a growing wait; then the run stops with one error, the rows written so far kept.
"""

import argparse
import sys
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="the target: a model directory or hub id (not with --server)")
    p.add_argument("--revision", default=None)
    p.add_argument(
        "--server",
        default=None,
        help="an OpenAI-compatible server's URL (vLLM, SGLang, spd-serve), e.g. http://localhost:8000: it answers, "
        "instead of a target loaded here",
    )
    from spd.data.client import add_client_flags

    add_client_flags(p)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompts", help='chat target: a jsonl file of {"prompt"} rows, or stdlib[:N]')
    source.add_argument("--texts", help='base model: FILE[:N], N prefixes of a jsonl file\'s {"text"} rows to continue')
    p.add_argument(
        "--prefix-chars", type=int, default=400, help="with --texts: a prefix's length at most, in characters"
    )
    p.add_argument(
        "--skip",
        type=int,
        default=0,
        help="leave out the first N prompts (e.g. --prompts stdlib --skip 64: the 64 held out for evaluation "
        "by data/smollm2.py)",
    )
    p.add_argument("--out", required=True, type=Path, help="jsonl of conversations or texts (appended to, resumable)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=384)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy answers (default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="the target's dtype while it answers (bfloat16: faster on CPUs with AMX and on GPUs; the "
        "answers then differ from float32's where two tokens are near ties)",
    )
    args = p.parse_args(argv)
    if args.batch_size < 1 or args.max_new_tokens < 1:
        p.error("--batch-size and --max-new-tokens must be positive integers")
    if args.skip < 0:
        p.error(f"--skip must be 0 or more, got {args.skip}")
    if args.prefix_chars < 1:
        p.error("--prefix-chars must be a positive integer")
    if not 0 <= args.temperature < float("inf"):
        p.error(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if args.server is None and args.target is None:
        p.error("--target is required: the model that answers (or --server URL: a server that does)")
    if args.server is not None:
        if args.target is not None:
            p.error("--target is loaded only without --server; with --server the server answers (--model names it)")
        if not args.server.startswith(("http://", "https://")):
            p.error(f"--server {args.server}: expected an http:// or https:// URL")
        if args.concurrency < 1 or args.retries < 0:
            p.error("--concurrency must be a positive integer and --retries 0 or more")

    from spd.errors import run_cli

    return run_cli(_answer, args)


def _answer(args) -> int:
    """Answer the prompts (or continue the texts) that ``args.out`` lacks; print how many and how fast."""
    from spd.data.prompt_rows import read_prompts, read_texts
    from spd.errors import SpdInputError

    prompts = (
        read_prompts(args.prompts) if args.texts is None else read_texts(args.texts, args.seed, args.prefix_chars)
    )[args.skip :]
    if not prompts:
        raise SpdInputError(f"--skip {args.skip} leaves no prompts to answer")
    stats = _answer_served(args, prompts) if args.server else _answer_here(args, prompts)
    print(
        f"{args.out}: {stats['generated']} answered now, {stats['skipped_done']} already there; "
        f"{stats['new_tokens']} tokens in {stats['seconds']} s ({stats['tokens_per_s']} tokens/s)"
    )
    return 0


def _answer_served(args, prompts: list[dict]) -> dict:
    """The answers of the server at ``args.server``."""
    from spd.data.client import Client
    from spd.data.regenerate import regenerate_served

    client = Client(args.server, args.api_key, retries=args.retries, connections=args.concurrency)
    try:
        return regenerate_served(
            client,
            args.model or client.first_model(),
            prompts,
            args.out,
            concurrency=args.concurrency,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            seed=args.seed,
            chat=args.texts is None,
        )
    finally:
        client.close()


def _answer_here(args, prompts: list[dict]) -> dict:
    """The answers of the target loaded in this process."""
    import torch

    from spd.data.regenerate import regenerate
    from spd.target.loading import load_causal_lm
    from spd.target.tokenizer import load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_causal_lm(args.target, revision=args.revision, dtype=getattr(torch, args.dtype)).eval()
    tokenizer = load_tokenizer(args.target, args.revision)
    return regenerate(
        model,
        tokenizer,
        prompts,
        args.out,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        chat=args.texts is None,
    )


if __name__ == "__main__":
    sys.exit(main())
