"""The paper's comparison (its Table 1) on a target, in one command: what is missing is trained, then measured.

    spd-bench reproduce --testbed testbed --out docs/results/reproduction
    spd-bench reproduce --testbed testbed-deep --stages 4 8 16 --out docs/results/reproduction-deep
    spd-bench reproduce --testbed smollm2 --config configs/smollm2-n4.yaml --prompts humaneval-chat \
        --stages 4 8 --draft-steps 3 7 --max-length 512 --steps 240 --num-prompts 30 --max-new-tokens 96 \
        --batch 20 --out docs/results/reproduction-smollm2

``--testbed DIR`` is a testbed (``DIR/target``, training text in ``DIR/corpus``) or a target prepared with its
own answers by ``data/smollm2.py --out DIR`` (``DIR/target``, conversations in ``DIR/data``). An n that does not
divide the target's layers takes the balanced cut (``spd.target.cut.balanced_boundaries``: the first
``L mod n`` stages one layer longer), in the capture, the heads and the benchmark alike.

1. One offline capture of the target's states over the training text and the first ``--eval-rows`` rows of the
   validation text (``data/capture.py``, resumed if interrupted), shared by every head.
2. The heads, each trained from that capture by ``train/distill.py`` unless ``<runs>/<name>/final`` exists:
   SPD (``variant=spd``) for every n of ``--stages`` and L_s of ``--layers``; its output-state ablation
   (``variant=output_state``, the first L_s of ``--layers``) and PPSD (``variant=ppsd``, L_s 1) for every n;
   and the EAGLE-style serial drafter (``variant=eagle``, trained for up to max(--draft-steps)). A head is
   checkpointed every 40 steps, so a killed run resumes where its heads stood.
3. One ``spd-bench decode`` run on ``--prompts`` (default: HumanEval's 164 problems, the first
   ``--num-prompts``) at every temperature of ``--temperatures``: EAGLE-style ``sd`` for every m, SPD,
   output-state and PPSD chains, and the SPD head's token tree of width 4 (sampled candidates at T > 0).
   It journals every finished prompt and resumes; ``--batch B`` runs the pipeline rows B prompts at a time
   through the batched pipeline (the same outputs and acceptance per prompt, in less wall time).
4. The Table-1-shaped result in ``--out``: ``table.md`` (acceptance length and theoretical speedup per
   method and setting), ``table.json`` (the same rows plus the benchmark's command and data set) and
   ``table.png``.

Acceptance lengths: ``sd`` rows give L_acc (tokens per target forward, the bonus token included), pipeline
rows L'_acc (n x tokens per step); the theoretical speedups are the paper's (serial:
``L_acc * L / (L_s * m + L)``; SPD: L'_acc; output-state and PPSD: the head's cost after the last stage
included; spd/decoding/engine.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from spd.bench.report import REPO, argument_parser, bench_command, command_line, markdown_table, write_result
from spd.errors import SpdInputError, run_cli
from spd.paths import default_testbed_dir

CHECKPOINT_EVERY = 40  # optimizer steps: a head whose training is killed resumes from its last checkpoint


@dataclass
class Head:
    name: str
    variant: str
    stages: int  # n (1 for the serial drafter)
    layers: int  # L_s

    def overrides(self, steps: int, draft_steps: int, num_layers: int) -> list[str]:
        keys = [
            f"variant={self.variant}",
            f"n_stages={self.stages}",
            f"num_layers={self.layers}",
            f"max_steps={steps}",
            "max_minutes=none",
            f"save_every={min(steps, CHECKPOINT_EVERY)}",
            f"eval_every={steps}",
        ]
        if self.variant == "eagle":
            return keys + [f"draft_steps={draft_steps}", "boundaries=null"]
        from spd.target.cut import balanced_boundaries

        cut = balanced_boundaries(num_layers, self.stages)  # the equal cut where n divides the layers
        return keys + ["boundaries=[" + ",".join(map(str, cut)) + "]"]


def parse_args(argv=None):
    p = argument_parser("reproduce", __doc__)
    p.add_argument(
        "--testbed",
        default=str(default_testbed_dir()),
        help="a testbed, or a target prepared by data/smollm2.py --out DIR (default: %(default)s)",
    )
    p.add_argument(
        "--stages",
        type=int,
        nargs="+",
        default=None,
        help="pipeline sizes n (default: those of 4, 8, 16 up to the target's layers; an n that does not "
        "divide them takes the balanced cut)",
    )
    p.add_argument("--layers", type=int, nargs="+", default=[1, 2], help="SPD head layers L_s (default: 1 2)")
    p.add_argument(
        "--draft-steps",
        type=int,
        nargs="+",
        default=[3, 7, 15],
        help="EAGLE-style serial drafts per target forward, m (default: 3 7 15)",
    )
    p.add_argument("--steps", type=int, default=800, help="optimizer steps per head (default: %(default)s)")
    p.add_argument(
        "--config",
        default=str(REPO / "configs" / "testbed-n4.yaml"),
        help="trainer preset the heads start from (default: %(default)s)",
    )
    p.add_argument("--prompts", default="humaneval", help="spd-bench decode --prompts (default: %(default)s)")
    p.add_argument("--num-prompts", type=int, default=50)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument(
        "--batch",
        type=int,
        default=1,
        help="spd-bench decode --batch: the pipeline rows run this many prompts at a time through the batched "
        "pipeline (default: 1, one at a time); the serial rows stay one at a time",
    )
    p.add_argument("--max-length", type=int, default=256, help="tokens per captured row (default: %(default)s)")
    p.add_argument(
        "--eval-rows",
        type=int,
        default=64,
        help="held-out rows each head is evaluated on, and so the validation rows captured (default: %(default)s)",
    )
    p.add_argument(
        "--capture-tokens",
        type=int,
        default=None,
        help="capture only this many training tokens (default: the whole training text)",
    )
    p.add_argument(
        "--runs",
        default=None,
        help="where captures, heads and the raw benchmark go (default: runs/reproduce-<testbed name>)",
    )
    p.add_argument("--out", default="reproduction", help="directory of table.md / table.json / table.png")
    return p.parse_args(argv)


def plan_heads(stages: list[int], layers: list[int]) -> list[Head]:
    heads = [Head(f"spd-n{n}-ls{ls}", "spd", n, ls) for n in stages for ls in layers]
    heads += [Head(f"output-n{n}-ls{layers[0]}", "output_state", n, layers[0]) for n in stages]
    heads += [Head(f"ppsd-n{n}", "ppsd", n, 1) for n in stages]
    return heads + [Head("eagle", "eagle", 1, 1)]


METHODS = {"eagle": "EAGLE-style (sd)", "spd": "SPD", "output": "SPD, output state", "ppsd": "PPSD"}


def _run(cmd: list[str], what: str) -> None:
    print(f"[reproduce] {what}: {' '.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, cwd=REPO)
    if proc.returncode != 0:
        raise SpdInputError(f"{what} failed (exit {proc.returncode}); its output is above")


def training_text(testbed: Path) -> dict[str, Path] | None:
    """The train and validation files beside the target: a testbed's corpus, or the conversations that
    data/smollm2.py regenerated; None when neither is there."""
    for folder in ("corpus", "data"):
        files = {split: testbed / folder / f"{split}.jsonl" for split in ("train", "validation")}
        if all(f.is_file() for f in files.values()):
            return files
    return None


def capture(args, testbed: Path, runs: Path, stages: list[int], text: dict[str, Path]) -> tuple[Path, Path]:
    """One capture per split (data/capture.py resumes an interrupted one and skips a finished one)."""
    out = {}
    for split in ("train", "validation"):
        out[split] = runs / f"capture-{split}"
        cmd = [
            sys.executable,
            str(REPO / "data" / "capture.py"),
            "--target",
            str(testbed / "target"),
            "--data",
            str(text[split]),
            "--stages",
            ",".join(map(str, stages)),
            "--max-length",
            str(args.max_length),
            "--out",
            str(out[split]),
        ]
        if split == "train" and args.capture_tokens:
            cmd += ["--max-tokens", str(args.capture_tokens)]
        if split == "validation":  # the trainer reads only its first eval_rows rows
            cmd += ["--max-rows", str(args.eval_rows)]
        _run(cmd, f"capture ({split})")
    return out["train"], out["validation"]


def train(args, testbed: Path, runs: Path, head: Head, data: Path, eval_data: Path, num_layers: int) -> Path:
    final = runs / head.name / "final"
    if (final / "config.json").is_file():
        print(f"[reproduce] {head.name}: trained already ({final})", flush=True)
        return final
    cmd = [
        sys.executable,
        str(REPO / "train" / "distill.py"),
        "--config",
        args.config,
        f"target={testbed / 'target'}",
        f"data={data}",
        f"eval_data={eval_data}",
        f"output_dir={runs / head.name}",
        f"max_length={args.max_length}",
        f"eval_rows={args.eval_rows}",
        *head.overrides(args.steps, max(args.draft_steps), num_layers),
    ]
    _run(cmd + (["--resume"] if (runs / head.name / "checkpoints").is_dir() else []), f"training {head.name}")
    return final


def bench(args, testbed: Path, runs: Path, finals: dict[str, Path], stages: list[int]) -> dict:
    spec = [f"eagle m={m}=sd:{finals['eagle']}:{m}" for m in args.draft_steps]
    for n in stages:
        spec += [f"spd n={n} Ls={ls}=spd:{finals[f'spd-n{n}-ls{ls}']}" for ls in args.layers]
        spec += [f"output n={n} Ls={args.layers[0]}=spd:{finals[f'output-n{n}-ls{args.layers[0]}']}"]
        spec += [f"ppsd n={n}=spd:{finals[f'ppsd-n{n}']}"]
        spec += [f"spd n={n} Ls={args.layers[0]} W=4=tree:{finals[f'spd-n{n}-ls{args.layers[0]}']}:{n}:4:4"]
    out = runs / "bench.json"
    cmd = [
        *bench_command("decode"),
        "--target",
        str(testbed / "target"),
        "--prompts",
        args.prompts,
        "--num-prompts",
        str(args.num_prompts),
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--temperatures",
        *map(str, args.temperatures),
        "--out",
        str(out),
    ]
    cmd += ["--batch", str(args.batch)] if args.batch > 1 else []
    _run(cmd + [x for s in spec for x in ("--run", s)], "benchmark")
    return json.loads(out.read_text())


def table(report: dict) -> list[dict]:
    """One row per method and setting: acceptance length and theoretical speedup at every temperature."""
    rows: dict[str, dict] = {}
    for temperature, runs in report["results"].items():
        for name, run in runs.items():
            if name == "ar":
                continue
            method, _, setting = name.partition(" ")
            summary = run["summary"]
            row = rows.setdefault(name, {"method": METHODS[method], "setting": setting})
            row[temperature] = {
                "acceptance_length": summary["L_acc"],
                "theoretical_speedup": summary.get("theoretical_speedup"),
                "identical_to_ar": summary.get("identical_to_ar"),
            }
    return list(rows.values())


def markdown(rows: list[dict], temperatures: list[str], report: dict) -> str:
    header = ["method", "setting", *(f"{t}: {what}" for t in temperatures for what in ("length", "speedup"))]
    cells = [
        [row["method"], row["setting"]]
        + [
            "-" if row.get(t, {}).get(k) is None else f"{row[t][k]:.2f}"
            for t in temperatures
            for k in ("acceptance_length", "theoretical_speedup")
        ]
        for row in rows
    ]
    return (
        f"Data set: {report['dataset']} ({report['num_prompts']} prompts, {report['max_new_tokens']} new tokens). "
        "Length: L_acc for sd (bonus token included), L'_acc for the pipeline; speedup: theoretical.\n\n"
        + markdown_table(header, cells, rule=" --- ")
        + "\n"
    )


def plot(rows: list[dict], temperatures: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        1, len(temperatures), figsize=(6 * len(temperatures), 0.35 * len(rows) + 1.5), squeeze=False
    )
    for ax, t in zip(axes[0], temperatures):
        labels = [f"{r['method']} {r['setting']}" for r in rows if t in r]
        ax.barh(labels, [r[t]["theoretical_speedup"] or 0.0 for r in rows if t in r])
        ax.set_title(f"theoretical speedup, {t}")
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    return run_cli(_reproduce, parse_args(argv), argv)


def _reproduce(args, argv) -> int:
    """Capture, train every head, benchmark them, and write the table (markdown, JSON and a plot)."""
    testbed = Path(args.testbed)
    config = (
        json.loads((testbed / "target" / "config.json").read_text())
        if (testbed / "target" / "config.json").is_file()
        else None
    )
    text = training_text(testbed)
    if config is None or text is None:
        raise SpdInputError(
            f"'{testbed}' is neither a testbed nor a prepared target (expected target/config.json "
            "and corpus/ or data/ with train.jsonl and validation.jsonl; build one with "
            "data/build_testbed.py or data/smollm2.py)"
        )
    num_layers = config["num_hidden_layers"]
    stages = args.stages or [n for n in (4, 8, 16) if n <= num_layers]
    bad = [n for n in stages if not 1 <= n <= num_layers]
    if bad or not stages:
        raise SpdInputError(f"--stages {bad or stages} must be between 1 and the target's {num_layers} layers")
    if min(args.draft_steps) < 1 or min(args.layers) < 1 or args.steps < 1 or args.max_length < 2 or args.batch < 1:
        raise SpdInputError("--draft-steps, --layers, --steps, --max-length and --batch must be positive")
    if args.eval_rows < 1:
        raise SpdInputError(f"--eval-rows must be at least 1, got {args.eval_rows}")
    runs = Path(args.runs or REPO / "runs" / f"reproduce-{testbed.resolve().name}")
    data, eval_data = capture(args, testbed, runs, stages, text)
    finals = {
        h.name: train(args, testbed, runs, h, data, eval_data, num_layers) for h in plan_heads(stages, args.layers)
    }
    report = bench(args, testbed, runs, finals, stages)
    rows = table(report)
    temperatures = list(report["results"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(markdown(rows, temperatures, report))
    write_result(
        out / "table.json",
        {
            "command": command_line("reproduce", argv),
            "bench_command": report["command"],
            "dataset": report["dataset"],
            "testbed": str(testbed),
            "steps_per_head": args.steps,
            "rows": rows,
        },
    )
    plot(rows, temperatures, out / "table.png")
    print((out / "table.md").read_text())
    print(f"written: {out / 'table.md'}, {out / 'table.json'}, {out / 'table.png'}")
    return 0
