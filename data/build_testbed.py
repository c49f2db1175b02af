"""Build the testbed: stdlib corpus, BPE tokenizer, 8-layer Llama target and 2-layer draft (cached).

    python data/build_testbed.py --out testbed              # the default build (~20 minutes on 2 CPU cores)
    python data/build_testbed.py --out tb --minutes 30      # train the target for a 30-minute budget instead
    python data/build_testbed.py --out /tmp/tb --tiny       # a miniature build in seconds (for tests)
    python data/build_testbed.py --preset deep              # paper-shaped: a 32-layer target in testbed-deep

The builder replaces only what it wrote itself (spd/testbed/ says how it recognises that): an ``--out``
whose ``corpus/``, ``tokenizer/``, ``target/``, ``draft/``, ``prompts.jsonl`` or ``testbed.json`` someone else
wrote is refused with one ``error:`` line, unless ``--force``, which writes the testbed's files beside what is
there and removes nothing.

The ``deep`` preset is the default target made four times deeper (32 layers, so that n = 4, 8 and 16
divide it, as the paper's targets), same width, tokenizer, draft and steps: about twice the target's
training time (40 minutes on the 2-core project machine; docs/testbed.md). The default 8-layer testbed
stays the quickstart's.
"""

import argparse
import dataclasses
import json
import sys

from spd.errors import cli_error, run_cli
from spd.paths import default_testbed_dir


def parse_args(argv=None):
    from spd.testbed import TestbedConfig

    d = TestbedConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--preset",
        choices=PRESETS,
        default="default",
        help="default (8-layer target) or deep (32-layer target) (default: %(default)s)",
    )
    p.add_argument(
        "--out",
        default=None,
        help=f"output directory (default: {default_testbed_dir()}, or {default_testbed_dir()}-deep with --preset deep)",
    )
    p.add_argument(
        "--target-steps",
        type=int,
        default=d.target.steps,
        help="target optimizer steps (default: %(default)s, ~15 min on 2 cores)",
    )
    p.add_argument(
        "--draft-steps",
        type=int,
        default=d.draft.steps,
        help="draft optimizer steps (default: %(default)s, ~4 min on 2 cores)",
    )
    p.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="train the target for this wall-clock budget instead of --target-steps",
    )
    p.add_argument(
        "--draft-minutes",
        type=float,
        default=None,
        help="train the draft for this wall-clock budget instead of --draft-steps",
    )
    p.add_argument("--vocab-size", type=int, default=d.vocab_size)
    p.add_argument("--max-files", type=int, default=None, help="use only the first N stdlib files")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--tiny",
        action="store_true",
        help="miniature build for tests: 60 files, 512-token vocab, tiny models, a few steps",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="build even where --out holds paths the builder did not write (its files go beside theirs; "
        "nothing is removed)",
    )
    p.add_argument("--no-compile", action="store_true", help="train without torch.compile")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p.parse_args(argv)


PRESETS = ("default", "deep")
DEEP_LAYERS = 32


def output_dir(args) -> str:
    if args.out is not None:
        return args.out
    return str(default_testbed_dir()) + ("-deep" if args.preset == "deep" else "")


def config_from_args(args):
    from spd.testbed import ModelSpec, TestbedConfig

    cfg = TestbedConfig(vocab_size=args.vocab_size, max_files=args.max_files, seed=args.seed)
    if args.tiny:
        cfg = TestbedConfig(
            vocab_size=512,
            max_files=args.max_files or 60,
            val_fraction=0.2,
            seed=args.seed,
            eval_tokens=4096,
            target=ModelSpec(
                layers=8,
                hidden=32,
                heads=2,
                kv_heads=1,
                ffn=64,
                steps=20,
                batch_size=4,
                seq_len=64,
                warmup_steps=5,
                compile=False,
            ),
            draft=ModelSpec(
                layers=2,
                hidden=32,
                heads=2,
                kv_heads=2,
                ffn=64,
                steps=10,
                batch_size=4,
                seq_len=64,
                warmup_steps=5,
                compile=False,
            ),
        )
    if not args.tiny:
        # A time budget replaces the step count (and then the step count is machine-dependent).
        cfg.target = dataclasses.replace(
            cfg.target,
            minutes=args.minutes,
            compile=not args.no_compile,
            steps=None if args.minutes else args.target_steps,
        )
        cfg.draft = dataclasses.replace(
            cfg.draft,
            minutes=args.draft_minutes,
            compile=not args.no_compile,
            steps=None if args.draft_minutes else args.draft_steps,
        )
    if args.preset == "deep":
        cfg.target = dataclasses.replace(cfg.target, layers=DEEP_LAYERS)
    return cfg


def main(argv=None) -> int:
    args = parse_args(argv)
    for name in ("minutes", "draft_minutes", "target_steps", "draft_steps"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            return cli_error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    return run_cli(_build, args, output_dir(args))


def _build(args, out: str) -> int:
    from spd.testbed import build_testbed

    result = build_testbed(out, config_from_args(args), progress=not args.quiet, force=args.force)
    summary = {
        name: {k: result[name][k] for k in ("parameters", "steps", "train_tokens", "validation_perplexity")}
        for name in ("target", "draft")
    }
    print(json.dumps({"testbed": out, **summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
