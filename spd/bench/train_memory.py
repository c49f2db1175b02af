"""The trainer's memory and step time over a run, with and without bounded batch shapes.

    spd-bench train-memory --config configs/smollm2-n8-mix.yaml --steps 80 \\
        --out docs/results/bench_train_memory_smollm2.json

Trains the preset's head for ``--steps`` steps once per ``--pad`` value (``pad_to_multiple_of``: 1 pads each batch
only to its longest row, so every batch and the KD loss's last chunk have a shape of their own; 64 rounds both up),
one process at a time, from the same seed and rows, without checkpoints or evaluations. While each runs it reads
the process's resident memory (``VmRSS``) at every step the progress bar reports, and prints and writes per run:
the memory at the first and last steps, its growth per step (a least-squares line from step 10 on), and the
seconds per step over the first and the last 20 steps.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from spd.bench.report import REPO, argument_parser, command_line, line_fit, markdown_table, write_result

STEP = re.compile(r"distill:\s+\d+%\|[^|]*\|\s*(\d+)/(\d+)")


def rss_mib(pid: int) -> float | None:
    """The resident memory of process ``pid`` in MiB (None once it has ended)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def run(config: str, steps: int, pad: int, out_dir: Path, extra: list[str]) -> dict:
    """One training run; its (step, seconds, MiB) at every step the bar reports."""
    cmd = [
        sys.executable,
        str(REPO / "train" / "distill.py"),
        "--config",
        config,
        f"max_steps={steps}",
        f"pad_to_multiple_of={pad}",
        f"output_dir={out_dir}",
        "save_every=0",
        "eval_every=0",
        "eval_steps=none",
        "eval_data=none",
        "wandb=false",
        "tensorboard=false",
        *extra,
    ]
    print(f"[run] pad_to_multiple_of={pad}: {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, bufsize=1)
    points, last, t0, buf, tail = [], 0, time.time(), "", []
    while True:
        ch = proc.stderr.read(1)
        if not ch:
            break
        if ch not in "\r\n":
            buf += ch
            continue
        match = STEP.search(buf)
        if match and int(match.group(1)) > last:
            last = int(match.group(1))
            points.append({"step": last, "seconds": round(time.time() - t0, 2), "rss_mib": rss_mib(proc.pid)})
            if last % 10 == 0:
                print(f"  step {last}: {points[-1]['rss_mib']:.0f} MiB", flush=True)
        elif buf.strip():
            tail = [*tail[-20:], buf]
        buf = ""
    if proc.wait() != 0:
        raise SystemExit(f"error: the training run with pad_to_multiple_of={pad} failed:\n" + "\n".join(tail))
    return {"pad_to_multiple_of": pad, "points": points, **summarise(points)}


def summarise(points: list[dict]) -> dict:
    """Memory at the first and last steps, its growth per step from step 10 on, seconds per step at both ends."""
    late = [p for p in points if p["step"] >= 10 and p["rss_mib"] is not None]
    slope = line_fit([p["step"] for p in late], [p["rss_mib"] for p in late])[1]

    def per_step(window: list[dict]) -> float:
        return (window[-1]["seconds"] - window[0]["seconds"]) / max(1, window[-1]["step"] - window[0]["step"])

    return {
        "rss_mib_first": points[0]["rss_mib"],
        "rss_mib_last": points[-1]["rss_mib"],
        "rss_growth_mib_per_step": round(slope, 2),
        "s_per_step_first_20": round(per_step(points[1:21]), 3),
        "s_per_step_last_20": round(per_step(points[-21:]), 3),
    }


def main(argv=None) -> int:
    parser = argument_parser("train-memory", __doc__)
    parser.add_argument("--config", required=True, help="a training preset (configs/*.yaml)")
    parser.add_argument("--steps", type=int, default=80, help="optimizer steps per run (at least 30)")
    parser.add_argument("--pad", type=int, nargs="+", default=[1, 64], help="pad_to_multiple_of values to compare")
    parser.add_argument("--out", help="write the JSON here")
    parser.add_argument("overrides", nargs="*", help="further key=value settings for every run")
    args = parser.parse_args(argv)
    if args.steps < 30:
        parser.error(f"--steps must be at least 30 (two windows of 20 steps), got {args.steps}")
    if not Path(args.config).is_file():
        parser.error(f"--config '{args.config}' is not a file")
    if any(p < 1 for p in args.pad):
        parser.error(f"--pad values must be at least 1, got {args.pad}")
    runs = []
    with tempfile.TemporaryDirectory(prefix="spd-train-memory-") as tmp:
        for pad in args.pad:
            runs.append(run(args.config, args.steps, pad, Path(tmp) / f"pad{pad}", args.overrides))
    header = ("pad_to_multiple_of", "MiB at step 1", "MiB at the end", "MiB per step", "s/step, first 20", "last 20")
    rows = [
        (
            r["pad_to_multiple_of"],
            f"{r['rss_mib_first']:.0f}",
            f"{r['rss_mib_last']:.0f}",
            f"{r['rss_growth_mib_per_step']:.2f}",
            f"{r['s_per_step_first_20']:.2f}",
            f"{r['s_per_step_last_20']:.2f}",
        )
        for r in runs
    ]
    print(markdown_table(header, rows, rule=" --- "))
    if args.out:
        report = {
            "command": command_line("train-memory", argv),
            "config": args.config,
            "steps": args.steps,
            "cpu_count": os.cpu_count(),
            "runs": runs,
        }
        write_result(args.out, report)
        print(f"[out] {args.out}")
    return 0
