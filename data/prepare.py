"""Prepare (tokenise, mask, filter and cache) a training dataset for a target's tokenizer.

    python data/prepare.py --target testbed/target --data testbed/corpus/train.jsonl
    python data/prepare.py --target Qwen/Qwen3-8B --data HuggingFaceH4/ultrachat_200k --split train_sft

Training (train/distill.py) calls the same code with the same cache, so a prepared dataset is reused.
"""

import argparse
import sys

from spd.errors import run_cli
from spd.paths import default_cache_dir


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="target (for its tokenizer and chat template)")
    p.add_argument("--revision", default=None)
    p.add_argument("--data", required=True, help="local file/dir or hub dataset id")
    p.add_argument("--data-revision", default=None)
    p.add_argument("--split", default="train")
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--overflow", default="auto", choices=("auto", "drop", "truncate", "split"))
    p.add_argument("--cache-dir", default=default_cache_dir())
    args = p.parse_args(argv)
    return run_cli(_prepare, args)


def _prepare(args) -> int:
    from spd.data.prepare import DataConfig, prepare_dataset
    from spd.target.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.target, revision=args.revision)
    cfg = DataConfig(max_length=args.max_length, overflow=args.overflow, split=args.split, revision=args.data_revision)
    ds = prepare_dataset(args.data, tokenizer, cfg, args.cache_dir)
    print(f"{len(ds)} rows ready (cache: {args.cache_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
