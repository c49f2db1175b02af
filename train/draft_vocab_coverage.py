#!/usr/bin/env python
"""The share of a data set's supervised tokens that a head's draft vocabulary holds.

A head with a draft vocabulary (``draft_vocab_size``) proposes only those target tokens: on text whose tokens it
lacks it cannot be right, whatever it learned. This counts, for each head and each data file, the supervised
tokens (assistant turns of chats, every token of text) inside the head's vocabulary, the ceiling on its
top-1 there. Rows are tokenised as the trainer does (``spd.data.prepare``).

    python train/draft_vocab_coverage.py --target smollm2/target \\
        --head code-only=runs/code-only-n8 --head mixture=heads/smollm2-135m-instruct-spd-n8 \\
        --data chat=smollm2/data/self/heldout-chat.jsonl --data math=smollm2/data/self/heldout-math.jsonl \\
        --out docs/results/draft_vocab_coverage_smollm2.json

A head without a draft vocabulary predicts the whole target vocabulary and holds every token (share 1.0).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spd.errors import SpdInputError  # noqa: E402
from spd.files import write_json_atomic  # noqa: E402


def _named(values: list[str], flag: str) -> dict[str, str]:
    out = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep:
            name, path = Path(value).name or value, value
        if not name or not path:
            raise SpdInputError(f"{flag} takes NAME=PATH or PATH, got '{value}'")
        if name in out:
            raise SpdInputError(f"{flag} names '{name}' twice; give each a name of its own (NAME=PATH)")
        out[name] = path
    return out


def draft_ids(head: str):
    """The target ids a head proposes (None: all of them), read from its weights without building it."""
    from safetensors import safe_open

    path = Path(head) / "model.safetensors"
    if not path.is_file():
        raise SpdInputError(f"the head '{head}' has no model.safetensors; expected a head directory")
    with safe_open(str(path), framework="pt") as weights:
        return weights.get_tensor("draft_ids") if "draft_ids" in weights.keys() else None


def coverage(ids_rows, draft) -> tuple[int, int]:
    """(supervised tokens held by ``draft``, supervised tokens) over ``(input_ids, loss_mask)`` rows."""
    import torch

    held = total = 0
    for ids, mask in ids_rows:
        ids = torch.as_tensor(ids)[torch.as_tensor(mask, dtype=torch.bool)]
        total += ids.numel()
        held += ids.numel() if draft is None else int(torch.isin(ids, draft).sum())
    return held, total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="the target whose tokenizer renders the rows")
    parser.add_argument("--head", action="append", required=True, help="NAME=DIR of a head (repeat)")
    parser.add_argument("--data", action="append", required=True, help="NAME=FILE of chat or text rows (repeat)")
    parser.add_argument("--max-length", type=int, default=512, help="tokens per row, as in training (default 512)")
    parser.add_argument("--out", help="also write the figures as JSON here")
    args = parser.parse_args(argv)
    try:
        heads, data = _named(args.head, "--head"), _named(args.data, "--data")
        drafts = {name: draft_ids(head) for name, head in heads.items()}  # a wrong head fails before any work
        from transformers import AutoTokenizer

        from spd.data.prepare import DataConfig, prepare_dataset

        tokenizer = AutoTokenizer.from_pretrained(args.target)
        cfg = DataConfig(max_length=args.max_length)
        rows = {}
        for name, path in data.items():
            ds = prepare_dataset(path, tokenizer, cfg, report=lambda *a, **k: None)
            rows[name] = list(zip(ds["input_ids"], ds["loss_mask"]))
        result = {}
        for head_name, head in heads.items():
            draft = drafts[head_name]
            result[head_name] = {"head": head, "draft_vocab_size": None if draft is None else draft.numel()}
            for name, pairs in rows.items():
                held, total = coverage(pairs, draft)
                result[head_name][name] = {"held": held, "tokens": total, "share": round(held / max(total, 1), 4)}
    except SpdInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for head_name, row in result.items():
        shares = ", ".join(f"{k} {v['share']:.1%}" for k, v in row.items() if isinstance(v, dict))
        print(f"{head_name} ({row['draft_vocab_size'] or 'full'} tokens): {shares}")
    if args.out:
        report = {"command": " ".join(["train/draft_vocab_coverage.py", *(argv or sys.argv[1:])]), "heads": result}
        write_json_atomic(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
