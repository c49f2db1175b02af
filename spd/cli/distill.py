"""Distil an SPD speculation head from a frozen target (spd-distill; the trainer is spd.training.trainer).

    accelerate launch train/distill.py --config configs/testbed-n8.yaml
    accelerate launch -m spd.cli.distill --config configs/testbed-n8.yaml       # the same program
    accelerate launch --cpu --num_processes 2 train/distill.py --config configs/testbed-n4.yaml max_steps=50
    accelerate launch train/distill.py --config configs/qwen3-8b-n8.yaml output_dir=runs/q8 --resume

Every config key can be overridden as ``key=value``. The head is written to ``<output_dir>/final``
(a ``from_pretrained`` directory); checkpoints go to ``<output_dir>/checkpoints/step-N`` and ``--resume``
continues the newest one exactly (weights, optimizer, scheduler, data position, RNG). A checkpoint is written
under a new temporary name, synced to disk and renamed into place; the one it replaces is removed only after.
``tensorboard=true`` logs to ``<output_dir>/logs`` (``tensorboard --logdir <output_dir>/logs``); ``wandb=true``
logs offline by default (``wandb_mode=offline``) to ``<output_dir>/wandb`` (upload later with ``wandb sync``).
"""

from __future__ import annotations

import argparse
import sys

from spd.cli.common import Parser
from spd.errors import run_cli


def parse_args(argv=None):
    p = Parser(prog="spd-distill", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML preset (configs/*.yaml)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in output_dir")
    p.add_argument("overrides", nargs="*", help="key=value settings")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    return run_cli(_configure_and_train, args)


def _configure_and_train(args) -> int:
    from spd.training.presets import load_config
    from spd.training.trainer import train

    train(load_config(args.config, args.overrides), args.resume)
    return 0


if __name__ == "__main__":
    sys.exit(main())
