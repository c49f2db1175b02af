"""Capture a frozen target's states once over a dataset, for training heads without the target (offline mode).

    python data/capture.py --target testbed/target --data testbed/corpus/train.jsonl --stages 4,8 \
        --max-length 256 --out captures/testbed-train
    python data/capture.py --target testbed/target --data testbed/corpus/validation.jsonl --stages 4,8 \
        --max-length 256 --out captures/testbed-val
    accelerate launch train/distill.py --config configs/testbed-n4.yaml \
        data=captures/testbed-train eval_data=captures/testbed-val

It prints the disk space it needs before it starts, and an interrupted capture resumes when run again with
the same arguments. ``--stages`` stores the anchors every default head for those n needs, on the balanced
cut where n does not divide the layers (``--anchors`` names them instead); ``--teacher full`` (default) stores H^L and the target's LM head, so training sees the
target's exact distribution; ``--teacher topk --topk K`` stores the top-K log-probabilities instead
(spd/training/capture.py says when each pays).
"""

from __future__ import annotations

import argparse
import sys

import torch

from spd.cli.common import Parser
from spd.errors import SpdInputError, run_cli
from spd.paths import default_cache_dir


def parse_args(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="target directory or hub id")
    p.add_argument("--revision", default=None)
    p.add_argument("--data", required=True, help="local file/dir or hub dataset id (as train/distill.py's data)")
    p.add_argument("--data-revision", default=None)
    p.add_argument("--split", default="train")
    p.add_argument("--max-length", type=int, default=2048, help="tokens per row (as the trainer's max_length)")
    p.add_argument("--overflow", default="auto", choices=("auto", "drop", "truncate", "split"))
    p.add_argument("--out", required=True, help="capture directory (created; resumed if it holds a partial capture)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--stages", default="4,8", help="store the default anchors of heads for these n (default 4,8)")
    group.add_argument("--anchors", help="hidden-state indices to store, e.g. 0,1,2,4,8 (instead of --stages)")
    p.add_argument("--teacher", default="full", choices=("full", "topk"))
    p.add_argument("--topk", type=int, default=64, help="k of the top-k teacher")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="of the stored states (auto: bfloat16 on GPU, float32 on CPU)",
    )
    p.add_argument("--max-rows", type=int, default=None, help="capture only the first rows of the data")
    p.add_argument("--max-tokens", type=int, default=None, help="capture only the first rows up to this many tokens")
    p.add_argument("--shard-tokens", type=int, default=1 << 18, help="tokens per shard file")
    p.add_argument("--batch-tokens", type=int, default=8192, help="padded tokens per target forward")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--cache-dir", default=default_cache_dir())
    return p.parse_args(argv)


def _ints(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SpdInputError(f"{flag} must be comma-separated integers, got '{text}'") from None


def run(args) -> int:
    from spd.data.prepare import DataConfig, fingerprint, prepare_dataset
    from spd.target.cut import target_num_layers
    from spd.target.staging import StagedModel
    from spd.target.tokenizer import load_tokenizer
    from spd.training.capture_writer import CaptureSettings, anchors_for_stages, capture, row_lengths

    for flag in ("max_length", "topk", "shard_tokens", "batch_tokens"):
        if getattr(args, flag) < 1:
            raise SpdInputError(f"--{flag.replace('_', '-')} must be a positive integer, got {getattr(args, flag)}")
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if args.device.startswith("cuda") else "float32")
    tokenizer = load_tokenizer(args.target, revision=args.revision)
    num_layers = target_num_layers(args.target, args.revision)
    anchors = (
        _ints(args.anchors, "--anchors")
        if args.anchors
        else anchors_for_stages(num_layers, _ints(args.stages, "--stages"))
    )  # checked before the slow work
    data_cfg = DataConfig(
        max_length=args.max_length, overflow=args.overflow, split=args.split, revision=args.data_revision
    )
    ds = prepare_dataset(args.data, tokenizer, data_cfg, args.cache_dir)
    rows = len(ds)
    if args.max_rows is not None:
        rows = min(rows, args.max_rows)
    if args.max_tokens is not None:
        total, cut = 0, 0
        for length in row_lengths(ds.select(range(rows))):
            if total + length > args.max_tokens:
                break
            total, cut = total + length, cut + 1
        rows = cut
    if rows < 1:
        raise SpdInputError("no rows to capture (--max-rows / --max-tokens leave none)")
    ds = ds.select(range(rows))
    staged = StagedModel.from_pretrained(
        args.target, revision=args.revision, dtype=getattr(torch, dtype), device=args.device
    )
    settings = CaptureSettings(
        target=args.target,
        target_revision=args.revision,
        anchors=anchors,
        dtype=dtype,
        teacher=args.teacher,
        topk=args.topk if args.teacher == "topk" else 0,
        shard_tokens=args.shard_tokens,
        batch_tokens=args.batch_tokens,
        data_fingerprint=f"{fingerprint(args.data, tokenizer, data_cfg)}-{rows}",
    )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    source = {
        "data": args.data,
        "data_revision": args.data_revision,
        "split": args.split,
        "max_length": args.max_length,
        "overflow": args.overflow,
    }
    capture(
        staged,
        ds,
        args.out,
        settings,
        pad_id=pad_id,
        source=source,
        tokens=tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))),
    )
    return 0


def main(argv=None) -> int:
    return run_cli(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
