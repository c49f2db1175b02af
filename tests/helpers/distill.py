"""The distillation trainer as users run it: train/distill.py in a fresh process, on the miniature testbed."""

import subprocess
import sys

from conftest import REPO


def distill_args(tb, out, *extra, **settings):
    """train/distill.py's ``key=value`` arguments for a short run on the miniature testbed ``tb`` into ``out``:
    ``settings`` replace the defaults below, ``extra`` ("key=value" strings) follow them."""
    values = {
        "target": tb / "target",
        "data": tb / "corpus" / "train.jsonl",
        "eval_data": tb / "corpus" / "validation.jsonl",
        "n_stages": 4,
        "max_length": 48,
        "batch_size": 3,
        "max_steps": 8,
        "save_every": 2,
        "eval_every": 0,
        "eval_rows": 6,
        "log_every": 2,
        "lr": "3e-3",
        "warmup_steps": 2,
        "output_dir": out,
        "cache_dir": out.parent / "cache",
    }
    values.update(settings)
    return [f"{key}={value}" for key, value in values.items()] + list(extra)


def train(*args, check=True):
    proc = subprocess.run(
        [sys.executable, str(REPO / "train" / "distill.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc
