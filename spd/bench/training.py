"""Training-at-scale benchmark: online vs offline head training, full vs top-k teacher, full vs draft vocabulary.

    spd-bench training --out docs/results/bench_training.json

On the testbed, with one preset (default configs/quickstart-n4.yaml) and the same rows for every run (the
first corpus files, enough for ``--steps`` batches): captures the rows once (full teacher, and top-k),
then trains one head per setting from the same seed and measures

- head-training throughput (training-loop tokens/s, from the trainer's own timing: the target forward is
  inside the loop online, absent offline),
- L'_acc of every head, measured by decoding ``--num-prompts`` testbed prompts at T = 0 (spd-bench decode, all
  heads side by side, each checked token for token against ar),

and, separately, the LM head's cost at a Qwen-sized vocabulary: KD forward + backward over a chunk of
positions with the whole vocabulary vs a draft vocabulary (``--lm-*`` flags). Prints a table and writes JSON.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from spd.bench.report import REPO, argument_parser, command_line, write_result


def parse_args(argv=None):
    p = argument_parser("training", __doc__)
    p.add_argument("--testbed", default="testbed")
    p.add_argument("--config", default="configs/quickstart-n4.yaml")
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--draft-vocab", default="1024,256", help="draft vocabulary sizes K to train")
    p.add_argument("--topk", type=int, default=32, help="k of the top-k teacher capture")
    p.add_argument("--num-prompts", type=int, default=30)
    p.add_argument("--work", default="runs/bench-training", help="captures and heads go here")
    p.add_argument("--lm-hidden", type=int, default=2048)
    p.add_argument("--lm-vocab", type=int, default=151936, help="Qwen3's vocabulary")
    p.add_argument("--lm-draft", type=int, default=32768)
    p.add_argument("--lm-positions", type=int, default=1024)
    p.add_argument("--out", default="bench_training.json")
    p.add_argument("--skip-training", action="store_true", help="only the LM-head measurement")
    return p.parse_args(argv)


def _run(*args: str) -> None:
    print("$", " ".join(args), flush=True)
    subprocess.run([sys.executable, *args], check=True, cwd=REPO)


def _subset(args, work: Path) -> tuple[Path, int]:
    """The first corpus files that give at least steps x batch rows (prepared as the preset prepares them)."""
    import yaml

    from spd.data.prepare import DataConfig, prepare_dataset
    from spd.target.tokenizer import load_tokenizer

    preset = yaml.safe_load(Path(args.config).read_text())
    need = args.steps * int(preset.get("batch_size", 8))
    tok = load_tokenizer(str(Path(args.testbed) / "target"))
    lines = (Path(args.testbed) / "corpus" / "train.jsonl").read_text().splitlines()
    path = work / "subset.jsonl"
    rows, count = 0, 0
    while rows < need and count < len(lines):
        count = min(len(lines), max(count + 1, count * 2))
        path.write_text("\n".join(lines[:count]) + "\n")
        rows = len(
            prepare_dataset(
                str(path), tok, DataConfig(max_length=int(preset.get("max_length", 2048))), report=lambda *_: None
            )
        )
    return path, rows


def train_runs(args, work: Path) -> dict:
    import yaml

    preset = yaml.safe_load(Path(args.config).read_text())
    tb = Path(args.testbed)
    subset, rows = _subset(args, work)
    common_capture = [
        "data/capture.py",
        "--target",
        str(tb / "target"),
        "--max-length",
        str(preset["max_length"]),
        "--stages",
        str(preset["n_stages"]),
    ]
    timings = {}
    for name, extra in (("full", []), ("topk", ["--teacher", "topk", "--topk", str(args.topk)])):
        t0 = time.perf_counter()
        _run(*common_capture, "--data", str(subset), "--out", str(work / f"capture-{name}"), *extra)
        timings[f"capture_{name}_s"] = time.perf_counter() - t0
    _run(
        *common_capture,
        "--data",
        str(tb / "corpus" / "validation.jsonl"),
        "--max-rows",
        str(preset["eval_rows"]),
        "--out",
        str(work / "capture-val"),
    )
    train = [
        "train/distill.py",
        "--config",
        args.config,
        f"max_steps={args.steps}",
        "max_minutes=none",
        "save_every=0",
        "eval_every=0",
    ]
    runs = {
        "online": [f"target={tb / 'target'}", f"data={subset}", f"eval_data={tb / 'corpus' / 'validation.jsonl'}"],
        "offline": [f"data={work / 'capture-full'}", f"eval_data={work / 'capture-val'}"],
        f"offline-top{args.topk}": [f"data={work / 'capture-topk'}", f"eval_data={work / 'capture-val'}"],
    }
    for k in (int(x) for x in args.draft_vocab.split(",") if x):
        runs[f"offline-K{k}"] = [
            f"data={work / 'capture-full'}",
            f"eval_data={work / 'capture-val'}",
            f"draft_vocab_size={k}",
        ]
    tokens = json.loads((work / "capture-full" / "capture.json").read_text())["tokens"]
    results = {}
    for name, extra in runs.items():
        out = work / name
        shutil.rmtree(out, ignore_errors=True)
        _run(*train, f"output_dir={out}", *extra)
        summary = json.loads((out / "summary.json").read_text())
        seconds = summary["loop_minutes"] * 60
        rows_seen = args.steps * int(preset["batch_size"])
        results[name] = {
            "head": str(out / "final"),
            "train_s": seconds,
            "steps": summary["step"],
            "step_ms": 1000 * seconds / summary["step"],
            "tokens_per_s": rows_seen * tokens / rows / seconds,  # mean row length x rows / time
            "L_acc_est": summary["eval"].get("L_acc_est"),
            "top1_full": summary["eval"].get("top1_full"),
        }
    bench_out = work / "bench.json"
    _run(
        "-m",
        "spd.bench",
        "decode",
        "--target",
        str(tb / "target"),
        "--prompts",
        str(tb / "prompts.jsonl"),
        "--num-prompts",
        str(args.num_prompts),
        "--run",
        "ar",
        *[x for name in runs for x in ("--run", f"{name}=spd:{results[name]['head']}")],
        "--out",
        str(bench_out),
    )
    measured = json.loads(bench_out.read_text())["results"]["T=0"]
    for name in runs:
        summary = measured[name]["summary"]
        results[name]["L_acc"] = summary["L_acc"]
        results[name]["identical_to_ar"] = f"{summary['identical_to_ar']}/{args.num_prompts}"
    return {"rows": rows, "tokens": tokens, **timings, "runs": results}


def lm_head_cost(args) -> dict:
    """KD forward + backward of the head's LM head (and the teacher's logits) over one chunk of positions."""
    from spd.training.kd import kd_loss

    torch.manual_seed(0)
    d, v, k, n = args.lm_hidden, args.lm_vocab, args.lm_draft, args.lm_positions
    teacher = torch.nn.Linear(d, v, bias=False).requires_grad_(False)
    student_h = torch.randn(n, d, requires_grad=True)
    teacher_h = torch.randn(n, d)
    out = {"hidden": d, "vocab": v, "draft": k, "positions": n}
    for name, rows in (("full", None), ("draft", torch.arange(0, v, v // k)[:k])):
        student = torch.nn.Linear(d, v if rows is None else k, bias=False)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            result = kd_loss(student_h, teacher_h, student, teacher, 1.0, 512, rows)
            result.loss_sum.backward()
            times.append(time.perf_counter() - t0)
        out[f"{name}_ms"] = 1000 * min(times[1:])  # the first call warms the allocator
        del student
    out["ratio"] = out["full_ms"] / out["draft_ms"]
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    report = {
        "command": command_line("training", argv),
        "threads": torch.get_num_threads(),
    }
    if not args.skip_training:
        report["training"] = train_runs(args, work)
        t = report["training"]
        print(
            f"\n{t['rows']} rows, {t['tokens']} tokens; capture {t['capture_full_s']:.0f} s (full teacher), "
            f"{t['capture_topk_s']:.0f} s (top-{args.topk})"
        )
        print(f"{'run':<16} {'step ms':>8} {'tokens/s':>9} {'L_acc est':>9} {'L_acc':>6}  identical")
        for name, r in t["runs"].items():
            print(
                f"{name:<16} {r['step_ms']:>8.0f} {r['tokens_per_s']:>9.0f} {r['L_acc_est']:>9.3f} "
                f"{r['L_acc']:>6.3f}  {r['identical_to_ar']}"
            )
    report["lm_head"] = lm_head_cost(args)
    lm = report["lm_head"]
    print(
        f"\nLM head + KD, forward + backward, {lm['positions']} positions, D = {lm['hidden']}: "
        f"V = {lm['vocab']}: {lm['full_ms']:.0f} ms, K = {lm['draft']}: {lm['draft_ms']:.0f} ms "
        f"({lm['ratio']:.2f}x)"
    )
    write_result(args.out, report, indent=2)
    print(f"JSON: {args.out}")
    return 0
