"""How fast a target answers training prompts (``data/regenerate.py``), setting by setting, in one run.

    spd-bench regenerate --target smollm2/target --prompts 128 --skip 64 \\
        --settings float32:32 bfloat16:32 bfloat16:128 --max-new-tokens 256 --threads 2 \\
        --out docs/results/bench_regenerate_smollm2.json

Each setting ``DTYPE:BATCH`` answers the same prompts (the standard library's coding instructions that
``data/regenerate.py --prompts stdlib --skip 64`` answers first) greedily from scratch
(:func:`spd.data.regenerate.regenerate`, what ``data/regenerate.py`` runs: prompts sorted by length, left padding,
``model.generate`` per batch), one setting at a time in this process, the model loaded afresh in its dtype. It
prints and writes, per setting: the answered tokens, the seconds spent answering (loading left out), tokens/s and
its ratio to the first setting, the answers that stopped at EOS, and how many answers equal the first setting's
token for token (lower precision changes an answer only where two tokens are near ties).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
from pathlib import Path

from spd.bench.report import argument_parser, command_line, markdown_table, write_result

DTYPES = ("float32", "bfloat16")


def parse_setting(text: str) -> tuple[str, int]:
    """``DTYPE:BATCH`` -> (dtype, batch size); a wrong one is an argparse error naming what is expected."""
    dtype, _, batch = text.partition(":")
    if dtype not in DTYPES or not batch.isdigit() or int(batch) < 1:
        raise argparse.ArgumentTypeError(f"'{text}' is not DTYPE:BATCH with DTYPE one of {', '.join(DTYPES)}")
    return dtype, int(batch)


def answer(
    target: str, prompts: list[dict], dtype: str, batch: int, max_new_tokens: int, out: Path
) -> tuple[dict, dict[str, str]]:
    """One setting: the prompts answered into ``out``; its statistics and its answers by id."""
    import torch

    from spd.data.regenerate import regenerate
    from spd.target.loading import load_causal_lm
    from spd.target.tokenizer import load_tokenizer

    model = load_causal_lm(target, dtype=getattr(torch, dtype)).eval()
    tokenizer = load_tokenizer(target)
    stats = regenerate(model, tokenizer, prompts, out, batch_size=batch, max_new_tokens=max_new_tokens, progress=False)
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    del model
    gc.collect()
    answers = {r["id"]: r["messages"][-1]["content"] for r in rows}
    stopped = sum(r["finish_reason"] == "stop" for r in rows)
    return {
        "dtype": dtype,
        "batch_size": batch,
        "new_tokens": stats["new_tokens"],
        "seconds": stats["seconds"],
        "tokens_per_s": stats["tokens_per_s"],
        "stopped_at_eos": stopped,
        "answers": len(rows),
    }, answers


def measure(args, argv) -> int:
    """Every setting in turn on the same prompts; the table printed and the JSON written."""
    import torch

    from spd.data.instructions import stdlib_instructions

    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = stdlib_instructions(args.skip + args.prompts)[args.skip :]
    runs, first = [], None
    with tempfile.TemporaryDirectory(prefix="spd-regenerate-") as tmp:
        for number, (dtype, batch) in enumerate(args.settings):
            out = Path(tmp) / f"{number}-{dtype}-{batch}.jsonl"
            run, answers = answer(args.target, prompts, dtype, batch, args.max_new_tokens, out)
            first = first or (run, answers)
            run["speedup"] = round(run["tokens_per_s"] / first[0]["tokens_per_s"], 2)
            run["equal_to_first"] = sum(answers.get(i) == a for i, a in first[1].items())
            runs.append(run)
            print(f"[{dtype}:{batch}] {run['new_tokens']} tokens in {run['seconds']} s, {run['tokens_per_s']}/s")
    header = ("dtype", "batch", "tokens", "seconds", "tokens/s", "speed-up", "stopped at EOS", "equal to first")
    rows = [
        (
            r["dtype"],
            r["batch_size"],
            r["new_tokens"],
            r["seconds"],
            r["tokens_per_s"],
            f"{r['speedup']:.2f}x",
            f"{r['stopped_at_eos']}/{r['answers']}",
            f"{r['equal_to_first']}/{r['answers']}",
        )
        for r in runs
    ]
    print(markdown_table(header, rows, rule=" --- "))
    if args.out:
        report = {
            "command": command_line("regenerate", argv),
            "target": args.target,
            "prompts": len(prompts),
            "skip": args.skip,
            "max_new_tokens": args.max_new_tokens,
            "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "runs": runs,
        }
        write_result(args.out, report)
        print(f"[out] {args.out}")
    return 0


def main(argv=None) -> int:
    parser = argument_parser("regenerate", __doc__)
    parser.add_argument("--target", required=True, help="a chat target: model directory or hub id")
    parser.add_argument("--prompts", type=int, default=128, help="how many of the standard library's instructions")
    parser.add_argument("--skip", type=int, default=64, help="leave out the first N (as data/regenerate.py --skip)")
    parser.add_argument(
        "--settings",
        type=parse_setting,
        nargs="+",
        default=[("float32", 32), ("bfloat16", 32), ("bfloat16", 128)],
        help="DTYPE:BATCH, one per run; the first is the one the others are compared with",
    )
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--out", help="write the JSON here")
    args = parser.parse_args(argv)
    if args.prompts < 1 or args.max_new_tokens < 1 or args.skip < 0:
        parser.error("--prompts and --max-new-tokens must be positive, --skip 0 or more")

    from spd.errors import run_cli

    return run_cli(measure, args, argv)
