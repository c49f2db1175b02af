"""Benchmark the distributed runtime: tokens/s of spd (or tree) vs pp (and ar on one process), measured vs theoretical.

    spd-bench runtime --heads runs/testbed-n4/final runs/testbed-n8/final \\
        --emulate-stage-ms 20 --emulate-link-ms 1 --num-prompts 10 --out bench_runtime.json
    spd-bench runtime --tree-width 4 --heads runs/testbed-n4/final \\
        --emulate-stage-ms 20 --emulate-link-ms 1 --out bench_runtime_tree.json
    spd-bench runtime --tree-width 4 --draft-model testbed/draft --stages 4 8 \\
        --emulate-stage-ms 20 --emulate-link-ms 1 --out bench_runtime_tree_draft.json

For every head (its n sets the pipeline) one ``torchrun`` world of n + 1 processes runs the prompts in
``spd`` mode and then in ``pp`` mode (the same processes, one after the other). ``ar`` runs in this
process: the plain decoder with the emulated time of a whole forward (n x stage time) added per token.
The table reports decode tokens/s (prefill excluded), ``speedup_vs_pp``, ``L'_acc`` of the spd run, and
``efficiency = speedup_vs_pp / L'_acc`` (1.0: the pipeline delivers the theoretical speedup). With no
emulation the stages run real CPU compute on this machine's cores, shared by all processes.

With ``--tree-width W`` the worlds run the token-tree engine (``tree``) instead of ``spd``, side by side
with ``pp``: its token source is each head of ``--heads``, or the draft model of ``--draft-model`` in one
world per n of ``--stages``. Every row also gives rank 0's time per step (``step_ms``: the token source,
the verification with its prune and flush notices, the waits for the stages' reports).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from spd.bench.report import argument_parser, command_line, markdown_table, write_result
from spd.errors import SpdInputError, run_cli
from spd.paths import default_testbed_dir


def parse_args(argv=None):
    tb = default_testbed_dir()
    p = argument_parser("runtime", __doc__)
    p.add_argument("--target", default=str(tb / "target"))
    p.add_argument(
        "--prompts",
        default=str(tb / "prompts.jsonl"),
        help="a jsonl of prompts or a named set (humaneval-chat, ...: spd-bench decode --prompts); sets of "
        "user messages are rendered with the chat template",
    )
    p.add_argument("--heads", nargs="+", default=[], help="speculation heads (one pipeline per head)")
    p.add_argument(
        "--tree-width",
        type=int,
        default=None,
        help="run the tree mode with W nodes per level instead of spd (run_pipeline --mode tree)",
    )
    p.add_argument("--tree-children", type=int, default=4, help="with --tree-width: candidate children per node, K")
    p.add_argument("--draft-model", default=None, help="with --tree-width: the token source instead of the heads")
    p.add_argument("--stages", type=int, nargs="+", default=[], help="with --draft-model: one pipeline per n")
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--emulate-stage-ms", type=float, default=0.0)
    p.add_argument("--emulate-link-ms", type=float, default=0.0)
    p.add_argument(
        "--early-launch",
        action="store_true",
        help="stage 1 starts a proposal before the step that made it is verified (run_pipeline)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--no-ar", action="store_true", help="skip the single-process ar reference")
    p.add_argument("--out", default="bench_runtime.json")
    return p.parse_args(argv)


def run_world(args, source: list[str], mode: str, n: int, out: Path) -> dict:
    """One torchrun world: ``mode`` (spd or tree) then pp on the same prompts; returns run_pipeline's JSON report.

    ``source`` is the token source's flags (``--speculator DIR`` or ``--draft-model DIR``).
    """
    from spd.runtime.world import free_port

    tree = ["--tree-width", str(args.tree_width), "--tree-children", str(args.tree_children)] if mode == "tree" else []
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(n + 1),
        "--master-port",
        str(free_port()),
        "-m",
        "spd.cli.run_pipeline",
        "--target",
        args.target,
        *source,
        *tree,
        "--mode",
        mode,
        "pp",
        "--prompts",
        args.prompts_file,
        "--num-prompts",
        str(args.num_prompts),
        *(["--chat"] if args.chat else []),
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--emulate-stage-ms",
        str(args.emulate_stage_ms),
        "--emulate-link-ms",
        str(args.emulate_link_ms),
        "--threads",
        str(args.threads),
        "--timeout-s",
        str(args.timeout_s),
        "--out",
        str(out),
    ] + (["--early-launch"] if args.early_launch else [])
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        raise SpdInputError(errors[0][7:] if errors else f"the runtime failed (exit {proc.returncode})")
    return json.loads(out.read_text())


def prompt_file(spec: str, path: Path) -> tuple[str, bool]:
    """A jsonl of ``{"prompt"}`` rows for run_pipeline, and whether they are user turns (``--chat``)."""
    from spd.data.prompt_sets import SETS, load_prompt_set

    if spec.partition(":")[0] not in SETS:
        if not Path(spec).is_file():
            raise SpdInputError(f"the prompts file '{spec}' does not exist")
        return spec, False
    _, rows = load_prompt_set(spec)
    chat = "messages" in rows[0]
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps({"prompt": row["messages"][0]["content"] if chat else row["prompt"]}) + "\n")
    return str(path), chat


def run_ar(args, n: int) -> dict:
    """Single-process autoregressive decoding with n x stage time of emulated compute per token."""
    import torch

    from spd.decoding.generation import generate_ar
    from spd.target.staging import StagedModel
    from spd.target.tokenizer import load_tokenizer

    torch.set_num_threads(args.threads)
    tok = load_tokenizer(args.target)
    staged = StagedModel.from_pretrained(args.target, n_stages=1)
    texts = [json.loads(line)["prompt"] for line in open(args.prompts_file, encoding="utf-8") if line.strip()]
    if args.chat:
        texts = [
            tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
            for t in texts
        ]
    delay = n * args.emulate_stage_ms / 1000

    def emulate(_token: int, _accepted: bool) -> None:
        if delay:
            time.sleep(delay)

    decode, decode_time = 0, 0.0
    for text in texts[: args.num_prompts]:
        ids = tok(text, add_special_tokens=not args.chat)["input_ids"]  # a rendered template has its own tokens
        out = generate_ar(staged, ids, args.max_new_tokens, eos_token_id=tok.eos_token_id, on_token=emulate)
        decode += out.stats.new_tokens - 1
        # The first token comes from the prefill; its emulated time belongs to the prefill too.
        decode_time += out.stats.wall_time_s - out.stats.prefill_time_s - delay
    return {"decode_tokens": decode, "decode_tokens_per_s": decode / decode_time if decode_time > 0 else None}


def worlds(args) -> list[tuple[str, list[str], int]]:
    """The pipelines to run: (label, token source flags, n) each."""
    from spd.heads.loading import load_speculator_config

    if args.tree_width is None and (args.draft_model is not None or args.stages):
        raise SpdInputError("--draft-model and --stages select the tree mode's token source; add --tree-width W")
    if args.draft_model is not None:
        if args.heads or not args.stages:
            raise SpdInputError("--draft-model needs --stages N [N ...] (one pipeline per n) and no --heads")
        return [(args.draft_model, ["--draft-model", args.draft_model], n) for n in args.stages]
    if not args.heads:
        raise SpdInputError("give --heads DIR [DIR ...], or --tree-width W --draft-model DIR --stages N [N ...]")
    return [(head, ["--speculator", head], load_speculator_config(head).n_stages) for head in args.heads]


def step_ms(records: list[dict]) -> dict:
    """Rank 0's time per step in ms, over a mode's prompts: token source, verification, waits for the stages."""
    steps = sum(r["stats"]["steps"] for r in records)
    return {
        name: round(1000 * sum(r["stats"][f"{name}_time_s"] for r in records) / steps, 3) if steps else None
        for name in ("speculator", "verify", "stage")
    }


def breakdown(report: dict, mode: str) -> dict | None:
    """Where a step's time went, in ms per step of ``mode`` (the whole run, prefills included), from run_pipeline's
    clocks: rank 0 (token source, verification with the next launch's send, sends, receiving apart from its waits,
    emulated link latency, blocked waits for the stages, the rest: bookkeeping) and the stages' mean (their layers,
    emulated compute, notices, sends, receiving, emulated latency, waiting for input, the rest)."""
    clocks = report.get("clocks", {}).get(mode)
    records = report["results"][mode]
    steps = sum(r["stats"]["steps"] for r in records)
    if not clocks or not steps:
        return None
    wall = sum(r["stats"]["wall_time_s"] for r in records)
    link = clocks["rank0"]
    rank0 = {
        "source": sum(r["stats"]["speculator_time_s"] for r in records),
        "verify": sum(r["stats"]["verify_time_s"] for r in records),
        "send": link["send"],
        "receive_work": link["receive"] - link["receive_wait"] - link["link_delay"],
        "link_delay": link["link_delay"],
        "wait": link["receive_wait"],
    }
    rank0["other"] = wall - sum(rank0.values())
    stages = clocks["stages"]
    mean = {
        name: sum(c[name] for c in stages) / len(stages)
        for name in (
            "elapsed",
            "compute",
            "emulated_compute",
            "notices",
            "send",
            "receive",
            "receive_wait",
            "link_delay",
        )
    }
    stage = {
        "compute": mean["compute"],
        "emulated_compute": mean["emulated_compute"],
        "notices": mean["notices"],
        "send": mean["send"],
        "receive_work": mean["receive"] - mean["receive_wait"] - mean["link_delay"],
        "link_delay": mean["link_delay"],
        "wait": mean["receive_wait"],
    }
    stage["other"] = mean["elapsed"] - sum(stage.values())
    per_step = lambda part: {k: round(1000 * v / steps, 3) for k, v in part.items()}  # noqa: E731
    return {
        "rank0": per_step(rank0),
        "stages": per_step(stage),
        "messages_per_step": {
            "rank0_sent": round(link["messages_sent"] / steps, 2),
            "rank0_received": round(link["messages_received"] / steps, 2),
        },
    }


def main(argv=None) -> int:
    return run_cli(_bench, parse_args(argv), argv)


def measure(args, mode: str) -> list[dict]:
    """One row per world (head or source, and n): the mode against pp (and ar), tokens per second and where the
    time of a step goes."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        args.prompts_file, args.chat = prompt_file(args.prompts, Path(tmp) / "prompts.jsonl")
        for i, (label, source, n) in enumerate(worlds(args)):
            report = run_world(args, source, mode, n, Path(tmp) / f"world{i}.json")
            spec, pp = report["summary"][mode], report["summary"]["pp"]
            ar = None if args.no_ar else run_ar(args, n)
            speedup = spec["decode_tokens_per_s"] / pp["decode_tokens_per_s"]
            row = {
                "head": label,
                "stages": n,
                mode: spec,
                "pp": pp,
                "ar": ar,
                "speedup_vs_pp": speedup,
                "L_acc": spec["L_acc"],
                "efficiency": speedup / spec["L_acc"],
                "speedup_vs_ar": spec["decode_tokens_per_s"] / ar["decode_tokens_per_s"] if ar else None,
                f"identical_tokens_{mode}_pp": sum(
                    a["token_ids"] == b["token_ids"] for a, b in zip(report["results"][mode], report["results"]["pp"])
                ),
                "step_ms": step_ms(report["results"][mode]),
                "breakdown_ms_per_step": {m: breakdown(report, m) for m in (mode, "pp")},
            }
            if mode == "tree":
                row.update(width=args.tree_width, children=args.tree_children)
            rows.append(row)
    return rows


def _bench(args, argv) -> int:
    mode = "spd" if args.tree_width is None else "tree"
    load_before = os.getloadavg()  # other work on the machine's cores slows the stages: recorded with the result
    rows = measure(args, mode)
    launch = "early" if args.early_launch else "after verification"
    tree = f", tree W = {args.tree_width}, K = {args.tree_children}" if mode == "tree" else ""
    print(
        f"emulated stage time {args.emulate_stage_ms:g} ms, link {args.emulate_link_ms:g} ms, "
        f"{args.num_prompts} prompts x {args.max_new_tokens} new tokens, proposals launched {launch}{tree}"
    )
    source = "head" if mode == "spd" else "source"
    print(
        markdown_table(
            [
                "n",
                source,
                f"{mode} tok/s",
                "pp tok/s",
                "ar tok/s",
                "speedup vs pp",
                "L'_acc",
                "efficiency",
                f"{mode} == pp tokens",
            ],
            [
                [
                    r["stages"],
                    r["head"],
                    f"{r[mode]['decode_tokens_per_s']:.2f}",
                    f"{r['pp']['decode_tokens_per_s']:.2f}",
                    f"{r['ar']['decode_tokens_per_s']:.2f}" if r["ar"] else "-",
                    f"{r['speedup_vs_pp']:.3f}",
                    f"{r['L_acc']:.3f}",
                    f"{r['efficiency']:.3f}",
                    f"{r[f'identical_tokens_{mode}_pp']}/{args.num_prompts}",
                ]
                for r in rows
            ],
        )
    )
    print(
        "\nms per step (whole run, prefills included): rank 0 = source + verify + send + receive work + link delay "
        "+ wait + other (verify holds one send); a stage (mean) = compute + emulated + notices + send + receive work "
        "+ link delay + wait for input + other"
    )
    breakdown = []
    for r in rows:
        for m, b in r["breakdown_ms_per_step"].items():
            if b is None:
                continue
            cells = [b["rank0"][k] for k in ("source", "verify", "send", "receive_work", "link_delay", "wait", "other")]
            cells += [
                b["stages"][k]
                for k in (
                    "compute",
                    "emulated_compute",
                    "notices",
                    "send",
                    "receive_work",
                    "link_delay",
                    "wait",
                    "other",
                )
            ]
            breakdown.append([r["stages"], m, *(f"{c:.2f}" for c in cells)])
    print(
        markdown_table(
            [
                "n",
                "mode",
                "rank 0: source",
                "verify",
                "send",
                "recv work",
                "link delay",
                "wait",
                "other",
                "stage: compute",
                "emulated",
                "notices",
                "send",
                "recv work",
                "link delay",
                "wait",
                "other",
            ],
            breakdown,
        )
    )
    write_result(
        args.out,
        {
            "command": command_line("runtime", argv),
            "emulate_stage_ms": args.emulate_stage_ms,
            "emulate_link_ms": args.emulate_link_ms,
            "launch": launch,
            "mode": mode,
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "rows": rows,
        },
    )
    print(f"\nJSON: {args.out}")
    return 0
