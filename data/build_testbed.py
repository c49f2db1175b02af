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
import json
import sys

from spd.errors import cli_error, run_cli
from spd.paths import default_testbed_dir


def parse_args(argv=None):
    from spd.testbed import TestbedConfig
    from spd.testbed.presets import PRESETS

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


def main(argv=None) -> int:
    args = parse_args(argv)
    for name in ("minutes", "draft_minutes", "target_steps", "draft_steps"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            return cli_error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    from spd.testbed.presets import preset_dir

    return run_cli(_build, args, preset_dir(args.preset) if args.out is None else args.out)


def _build(args, out: str) -> int:
    from spd.testbed import build_testbed
    from spd.testbed.presets import preset_config

    config = preset_config(
        args.preset,
        tiny=args.tiny,
        vocab_size=args.vocab_size,
        max_files=args.max_files,
        seed=args.seed,
        target_steps=args.target_steps,
        draft_steps=args.draft_steps,
        minutes=args.minutes,
        draft_minutes=args.draft_minutes,
        compile=not args.no_compile,
    )
    result = build_testbed(out, config, progress=not args.quiet, force=args.force)
    summary = {
        name: {k: result[name][k] for k in ("parameters", "steps", "train_tokens", "validation_perplexity")}
        for name in ("target", "draft")
    }
    print(json.dumps({"testbed": out, **summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
