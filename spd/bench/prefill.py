"""Prefill time against link bandwidth, across machines emulated on this one (root; spd/testing/netns.py).

    sudo .venv/bin/spd-bench prefill --target testbed/target --lengths 256 1024 2048 \\
        --rates none 1gbit 100mbit --out docs/results/bench_prefill_links.json

Two hosts on one bridge: host 0 runs rank 0 and stage 1, host 1 the other stages (one ``torchrun`` each, as
docs/runtime.md "Across machines"). For each rate (tc tbf on both hosts' links, both ways; ``none``: the veth link
uncapped) one job prefills ``--repeats`` prompts of each length (``--mode pp``, one new token) and the table gives
the median prefill time, what crosses the link (the prompt's activations from stage 1 to stage 2, ``T x D`` values,
and the last stage's report to rank 0, the last position's ``D``) and the time that traffic takes at the rate
alone.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from spd.bench.report import REPO, argument_parser, command_line, markdown_table, write_result
from spd.paths import default_testbed_dir
from spd.testing.netns import Lan, rate_bits, torchrun_command, unavailable


def parse_args(argv=None):
    tb = default_testbed_dir()
    p = argument_parser("prefill", __doc__)
    p.add_argument("--target", default=str(tb / "target"))
    p.add_argument("--stages", type=int, default=2, help="n; stage 1 shares host 0 with rank 0, the rest are on host 1")
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048], help="prompt lengths in tokens")
    p.add_argument(
        "--rates", nargs="+", default=["none", "1gbit", "100mbit"], help="link caps in tc units (none: uncapped)"
    )
    p.add_argument("--repeats", type=int, default=3, help="prompts of each length per job (the median is reported)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--out", default="bench_prefill_links.json")
    return p.parse_args(argv)


def prompt_texts(tokenizer, lengths: list[int]) -> dict[int, str]:
    """A code-like text per length whose tokenization has about that many tokens."""
    unit = "def handle(request, options):\n    value = request.get('key', options.default)\n    return value\n\n"
    ids = tokenizer(unit * (max(lengths) // 8 + 8))["input_ids"]
    return {n: tokenizer.decode(ids[:n], skip_special_tokens=True) for n in lengths}


def run_job(lan: Lan, args, prompts: Path, out: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    job_id = f"prefill-{os.getpid()}-{time.monotonic_ns()}"
    procs = []
    for node, nproc in enumerate([2, args.stages - 1]):
        argv = [
            "-m",
            "spd.cli.run_pipeline",
            "--target",
            args.target,
            "--mode",
            "pp",
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "1",
            "--dtype",
            args.dtype,
            "--timeout-s",
            str(args.timeout_s),
            "--out",
            str(out),
        ]
        procs.append(
            subprocess.Popen(
                torchrun_command(lan.hosts, node, nproc, 29621, job_id, argv),
                cwd=REPO,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
        time.sleep(0.5)
    failed = []
    for proc in procs:
        _, err = proc.communicate(timeout=args.timeout_s * 10)
        if proc.returncode != 0:
            failed += [line for line in err.splitlines() if line.startswith("error:")] or [err[-2000:]]
    if failed:
        raise SystemExit("error: a prefill job failed; its ranks said:\n" + "\n".join(failed))


def main(argv=None) -> int:
    args = parse_args(argv)
    why = unavailable()
    if why is not None:
        print(f"error: {why}; this benchmark emulates machines with network namespaces", file=sys.stderr)
        return 2
    if args.stages < 2:
        print("error: --stages must be at least 2 (stage 1 on host 0, the others on host 1)", file=sys.stderr)
        return 2
    for rate in args.rates:
        if rate != "none":
            try:
                rate_bits(rate)
            except ValueError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
    from transformers import AutoConfig

    from spd.target.tokenizer import load_target_tokenizer

    tokenizer = load_target_tokenizer(args.target, None, None)
    config = AutoConfig.from_pretrained(args.target).get_text_config()
    hidden, itemsize = config.hidden_size, {"float32": 4, "bfloat16": 2, "float16": 2}[args.dtype]
    texts = prompt_texts(tokenizer, args.lengths)
    tokens = {n: len(tokenizer(t)["input_ids"]) for n, t in texts.items()}
    rows = []
    with tempfile.TemporaryDirectory() as tmp, Lan(2) as lan:
        prompts = Path(tmp) / "prompts.jsonl"
        order = [n for n in args.lengths for _ in range(args.repeats)]
        prompts.write_text("".join(json.dumps({"prompt": texts[n]}) + "\n" for n in order))
        for rate in args.rates:
            lan.cap(None if rate == "none" else rate)
            out = Path(tmp) / f"{rate}.json"
            run_job(lan, args, prompts, out)
            records = json.loads(out.read_text())["results"]["pp"]
            for n in args.lengths:
                times = [r["stats"]["prefill_time_s"] for r, m in zip(records, order) if m == n]
                link_bytes = (tokens[n] + 1) * hidden * itemsize  # stage 1 -> 2, and the last stage's report back
                wire_ms = None if rate == "none" else link_bytes * 8 / rate_bits(rate) * 1000
                rows.append(
                    {
                        "rate": rate,
                        "prompt_tokens": tokens[n],
                        "prefill_ms": statistics.median(times) * 1000,
                        "prefill_ms_all": [t * 1000 for t in times],
                        "link_bytes": link_bytes,
                        "wire_ms_at_rate": wire_ms,
                    }
                )
    base = {r["prompt_tokens"]: r["prefill_ms"] for r in rows if r["rate"] == "none"}
    cells = []
    for r in rows:
        ratio = r["prefill_ms"] / base[r["prompt_tokens"]] if r["prompt_tokens"] in base else None
        r["vs_uncapped"] = ratio
        wire = "-" if r["wire_ms_at_rate"] is None else f"{r['wire_ms_at_rate']:.0f}"
        cells.append(
            [
                r["rate"],
                r["prompt_tokens"],
                f"{r['prefill_ms']:.0f}",
                "-" if ratio is None else f"{ratio:.2f}x",
                f"{r['link_bytes'] / 1e6:.2f}",
                wire,
            ]
        )
    print(
        markdown_table(
            [
                "rate",
                "prompt tokens",
                f"prefill ms (median of {args.repeats})",
                "vs uncapped",
                "MB over the link",
                "wire time at the rate (ms)",
            ],
            cells,
        )
    )
    report = {
        "command": command_line("prefill", argv),
        "target": args.target,
        "stages": args.stages,
        "hidden": hidden,
        "dtype": args.dtype,
        "repeats": args.repeats,
        "rows": rows,
    }
    write_result(args.out, report)
    print(f"wrote {args.out}")
    return 0
