"""Distil an SPD speculation head from a frozen target: the documented entry point of the trainer.

    accelerate launch train/distill.py --config configs/testbed-n8.yaml
    accelerate launch --cpu --num_processes 2 train/distill.py --config configs/testbed-n4.yaml max_steps=50
    accelerate launch train/distill.py --config configs/qwen3-8b-n8.yaml output_dir=runs/q8 --resume

The program is spd.cli.distill (also installed as spd-distill); ``--help`` lists its options.
"""

import sys

from spd.cli.distill import main

if __name__ == "__main__":
    sys.exit(main())
