"""A head that learns from what its server served (spd-adapt; the loop is spd.traffic.adapt).

    spd-serve --target T --mode spd --speculator HEAD --record runs/traffic &
    spd-adapt --records runs/traffic --head HEAD --replay data/train.jsonl

Whenever the records hold --every answer tokens newer than the last round's, the current head (the newest version,
else HEAD) is fine-tuned on them for --steps steps, mixed with --replay rows, by the trainer in a child process
(niced, with --threads threads). The candidate is kept only if its L'_acc estimate on the newest records, held out,
beats the current head's by --margin; it is then published in bf16 as <versions>/vN with a model card and a
version.json. How far the records were read is remembered in the versions directory. SIGTERM or Ctrl-C ends it
between rounds (a round in progress is abandoned, leaving no half-written version).
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys

from spd.cli.common import Parser
from spd.errors import run_cli


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """spd-adapt's flags, parsed from ``argv`` (default: the command line)."""
    from spd.traffic.config import AdaptConfig

    defaults = {f.name: f.default for f in AdaptConfig.__dataclass_fields__.values()}
    p = Parser(prog="spd-adapt", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_source_flags(p)
    add_round_flags(p, defaults)
    add_process_flags(p, defaults)
    return p.parse_args(argv)


def add_source_flags(p: argparse.ArgumentParser) -> None:
    """What it learns from and where the versions go: the records, the starting head, the versions directory."""
    p.add_argument("--records", required=True, metavar="DIR", help="the server's records (spd-serve --record DIR)")
    p.add_argument("--head", required=True, help="the head the server starts with: a trained head directory")
    p.add_argument("--versions", metavar="DIR", help="where the versions vN go (default: <records>/heads)")


def add_round_flags(p: argparse.ArgumentParser, defaults: dict) -> None:
    """A round: when it starts, how long it trains, its data (replay and held-out shares) and what a candidate must
    beat."""
    p.add_argument(
        "--every",
        type=int,
        default=defaults["every"],
        metavar="TOKENS",
        help="new answer tokens that start a round (default: %(default)s)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=defaults["steps"],
        metavar="K",
        help="training steps per round (default: %(default)s)",
    )
    p.add_argument(
        "--replay",
        nargs="+",
        default=[],
        metavar="DATA",
        help="the head's original data (the trainer's data= sources), mixed in so that it does not forget "
        "(default: none)",
    )
    p.add_argument(
        "--replay-share",
        type=float,
        default=defaults["replay_share"],
        metavar="F",
        help="share of the training rows drawn from --replay (default: %(default)s)",
    )
    p.add_argument(
        "--heldout-share",
        type=float,
        default=defaults["heldout_share"],
        metavar="F",
        help="share of the new records, the newest, held out to compare the heads on (default: %(default)s; "
        "4 to 256 records)",
    )
    p.add_argument(
        "--margin",
        type=float,
        default=defaults["margin"],
        metavar="F",
        help="keep a candidate whose held-out L'_acc estimate beats the current head's by this share "
        "(default: %(default)s, 1%%)",
    )


def add_process_flags(p: argparse.ArgumentParser, defaults: dict) -> None:
    """How the process runs: its trainer child (threads, niceness, settings) and its looks at the records."""
    from spd.traffic.config import TRAINER_SETTINGS, default_threads

    p.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help=f"the trainer's threads (default: a quarter of the cores, at least 1: {default_threads()} here)",
    )
    p.add_argument(
        "--nice",
        type=int,
        default=defaults["nice"],
        metavar="N",
        help="the trainer's niceness, added to this process's (default: %(default)s)",
    )
    p.add_argument(
        "--poll",
        type=float,
        default=defaults["poll"],
        metavar="SECONDS",
        help="how often to look at the records (default: %(default)s)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        dest="settings",
        metavar="KEY=VALUE",
        help=f"a trainer setting, repeatable; keys: {', '.join(TRAINER_SETTINGS)} (default: lr=1e-4, the trainer's "
        "defaults for the others)",
    )
    p.add_argument("--once", action="store_true", help="look once, run a round if there is enough traffic, and exit")
    p.add_argument(
        "--from-start",
        action="store_true",
        help="learn from every record there, not only from those after the position remembered in the versions dir",
    )


def main(argv: list[str] | None = None) -> int:
    """spd-adapt with ``argv`` (default: the command line); returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    return run_cli(_adapt, args, "spd-adapt " + shlex.join(argv), interrupted=130)


def _adapt(args, command: str) -> int:
    from spd.cli.common import quiet_libraries
    from spd.traffic.adapt import Adapter
    from spd.traffic.config import AdaptConfig

    settings = {key: value for key, value in vars(args).items() if value is not None}
    cfg = AdaptConfig(**settings, command=command)
    quiet_libraries()
    import datasets
    import torch

    datasets.disable_progress_bars()
    torch.set_num_threads(cfg.threads)  # this process prepares the data and publishes; the trainer has its own
    adapter = Adapter(cfg)

    def stop(signum, frame):
        if adapter.stopping:  # a second Ctrl-C: at once
            raise KeyboardInterrupt
        adapter.stop()

    before = {signum: signal.signal(signum, stop) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        return adapter.run()
    finally:
        adapter.close()
        for signum, handler in before.items():
            signal.signal(signum, handler)


if __name__ == "__main__":
    sys.exit(main())
