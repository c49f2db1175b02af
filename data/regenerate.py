"""Regenerate training data: a target's own answers to a set of prompts, stored as conversations.

    python data/regenerate.py --target smollm2/target --prompts stdlib:1024 --out chats.jsonl
    python data/regenerate.py --target my-chat-model --prompts prompts.jsonl --out chats.jsonl --temperature 0.7

``--prompts`` is a jsonl file of ``{"prompt": ...}`` rows (an ``"id"`` is optional; the row number is used
otherwise) or ``stdlib[:N]``: N coding instructions made from the Python standard library's documented
functions (spd/data/instructions.py). Answers are greedy unless ``--temperature`` is set; they are written in
batches and a run that is interrupted continues where it stopped (the ids already in ``--out`` are skipped).
The rows train a head directly: ``accelerate launch train/distill.py ... data=chats.jsonl``.
"""

import argparse
import json
import sys
from pathlib import Path


def read_prompts(spec: str) -> list[dict]:
    """``{"id", "prompt"}`` rows from a jsonl file or ``stdlib[:N]``."""
    from spd.errors import SpdInputError
    from spd.data.instructions import stdlib_instructions

    if spec == "stdlib" or spec.startswith("stdlib:"):
        count = spec.partition(":")[2]
        if count and not (count.isdigit() and int(count) > 0):
            raise SpdInputError(f"--prompts {spec}: expected stdlib or stdlib:N with N a positive integer")
        return stdlib_instructions(int(count) if count else None)
    path = Path(spec)
    if not path.is_file():
        raise SpdInputError(f"the prompts file '{spec}' does not exist; expected a jsonl file or stdlib[:N]")
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise SpdInputError(f"{spec}:{number} is not JSON; expected one {{\"prompt\": ...}} object per line") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise SpdInputError(f"{spec}:{number} has no non-empty \"prompt\" string")
        rows.append({"id": str(row.get("id", number)), "prompt": row["prompt"]})
    if not rows:
        raise SpdInputError(f"the prompts file '{spec}' has no prompts")
    if len({r["id"] for r in rows}) != len(rows):
        raise SpdInputError(f"the prompts file '{spec}' repeats an \"id\"; ids must be unique (resuming relies on them)")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="chat target: a model directory or hub id")
    p.add_argument("--revision", default=None)
    p.add_argument("--prompts", required=True, help="a jsonl file of {\"prompt\"} rows, or stdlib[:N]")
    p.add_argument("--out", required=True, type=Path, help="jsonl of conversations (appended to, resumable)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=384)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy answers (default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = p.parse_args(argv)
    if args.batch_size < 1 or args.max_new_tokens < 1:
        p.error("--batch-size and --max-new-tokens must be positive integers")
    if not 0 <= args.temperature < float("inf"):
        p.error(f"--temperature must be a finite number >= 0, got {args.temperature}")

    from spd.errors import SpdInputError

    try:
        import torch

        from spd.data.regenerate import regenerate
        from spd.target.staging import load_causal_lm, load_tokenizer

        if args.threads:
            torch.set_num_threads(args.threads)
        prompts = read_prompts(args.prompts)
        model, tokenizer = load_causal_lm(args.target, revision=args.revision).eval(), load_tokenizer(args.target,
                                                                                                      args.revision)
        stats = regenerate(model, tokenizer, prompts, args.out, batch_size=args.batch_size,
                           max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    except SpdInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.out}: {stats['generated']} answered now, {stats['skipped_done']} already there; "
          f"{stats['new_tokens']} tokens in {stats['seconds']} s ({stats['tokens_per_s']} tokens/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
