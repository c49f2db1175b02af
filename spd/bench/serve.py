"""Load benchmark of spd-serve: N requests from C concurrent clients, per configuration, side by side.

    spd-bench serve --run spd:runs/quickstart-n4/final --run pp:4 --requests 50 --concurrency 8 \\
        --runtime distributed --emulate-stage-ms 20 --emulate-link-ms 1 --out docs/results/serve-load.json

Each ``--run`` (written as ``spd-bench decode --run`` takes it: ``spd:HEAD_DIR``, SPD with that head, n from the
head; ``pp:N``, the standard pipeline with N stages; a tree, or spd-serve's decoding flags in quotes) starts its
own server, sends the same requests (testbed prompts, greedy, streamed so that the
time to the first token is seen) from ``--concurrency`` client threads, and stops it. Reported per run:
request latency (arrival to last token: queueing included, since requests run one at a time) p50/p95, time
to first token p50/p95, the pipeline's own time per request (the ``spd`` extension's ``wall_time_s``)
p50/p95, completion tokens per second over the whole run, mean L'_acc. Prints a table and writes JSON.

``--record-overhead`` measures what ``spd-serve --record`` costs: each run again with its traffic recorded (into a
fresh temporary directory), the two in turn ``--repeats`` times, and the drop in tokens/s (medians) reported.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from spd.bench.decode import RUN_HELP, parse_run, run_flags
from spd.bench.report import argument_parser, command_line, markdown_table, streamed, write_result
from spd.errors import SpdInputError
from spd.testing.server import ServerProcess


def one_request(url: str, model: str, prompt: str, max_tokens: int) -> dict:
    """A streamed greedy completion: latency, time to first token, tokens, the server's stats."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    start = time.perf_counter()
    first = None
    text, stats = [], None
    for chunk in streamed(url, "/v1/completions", body):
        choice = chunk["choices"][0]
        if choice["text"] and first is None:
            first = time.perf_counter() - start
        text.append(choice["text"])
        if choice["finish_reason"] is not None:
            stats = chunk["spd"]
    return {
        "latency_s": time.perf_counter() - start,
        "ttft_s": first,
        "text": "".join(text),
        "tokens": stats["new_tokens"],
        "pipeline_s": stats["wall_time_s"],
        "L_acc": stats.get("equivalent_accept_length"),
        "queue_s": stats["queue_time_s"],
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def run_load(args, name: str, server_args: list[str], prompts: list[str]) -> dict:
    server = ServerProcess(*server_args, threads=args.threads)
    try:
        one_request(server.url, server.model, prompts[0], 4)  # warm-up
        start = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(lambda p: one_request(server.url, server.model, p, args.max_tokens), prompts))
        wall = time.perf_counter() - start
    finally:
        server.stop()
    tokens = sum(r["tokens"] for r in results)

    def pct(key):
        values = [r[key] for r in results if r[key] is not None]
        return {"p50": round(percentile(values, 50), 4), "p95": round(percentile(values, 95), 4)}

    l_acc = [r["L_acc"] for r in results if r["L_acc"] is not None]
    return {
        "name": name,
        "server_args": server_args,
        "requests": len(results),
        "wall_s": round(wall, 3),
        "completion_tokens": tokens,
        "tokens_per_s": round(tokens / wall, 3),
        "latency_s": pct("latency_s"),
        "ttft_s": pct("ttft_s"),
        "pipeline_s": pct("pipeline_s"),
        "mean_L_acc": round(statistics.mean(l_acc), 4) if l_acc else None,
        "texts": [r["text"] for r in results],
    }


def record_overhead(runs: list[dict]) -> dict[str, float]:
    """Per run, the share of tokens/s lost with ``--record``: 1 - median(recorded) / median(not recorded)."""
    out = {}
    for name in dict.fromkeys(r["name"] for r in runs if not r["name"].endswith(" +record")):
        plain = statistics.median(r["tokens_per_s"] for r in runs if r["name"] == name)
        recorded = statistics.median(r["tokens_per_s"] for r in runs if r["name"] == f"{name} +record")
        out[name] = round(1 - recorded / plain, 4)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argument_parser("serve", __doc__)
    p.add_argument("--target", default="testbed/target")
    p.add_argument("--prompts", default="testbed/prompts.jsonl", help='jsonl with a "prompt" field per row')
    p.add_argument(
        "--run",
        action="append",
        required=True,
        help="a run as spd-bench decode takes it: " + RUN_HELP + " (repeatable)",
    )
    p.add_argument("--requests", type=int, default=50)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--runtime", default="local", choices=("local", "distributed"))
    p.add_argument("--emulate-stage-ms", type=float, default=0.0)
    p.add_argument("--emulate-link-ms", type=float, default=0.0)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the server process")
    p.add_argument(
        "--record-overhead",
        action="store_true",
        help="each run also with --record DIR, in turn --repeats times: the tokens/s that recording costs",
    )
    p.add_argument("--repeats", type=int, default=2, help="--record-overhead: pairs per run (default: %(default)s)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    try:
        flags = {spec: run_flags(parse_run(spec)) for spec in args.run}
    except SpdInputError as exc:
        p.error(str(exc))
    if not Path(args.prompts).is_file():
        p.error(f"the prompts file '{args.prompts}' does not exist; expected a jsonl file with a \"prompt\" per row")
    rows = [json.loads(line)["prompt"] for line in Path(args.prompts).open(encoding="utf-8") if line.strip()]
    prompts = [rows[i % len(rows)] for i in range(args.requests)]
    common = ["--target", args.target, "--runtime", args.runtime, "--max-queue", str(max(64, args.requests))]
    if args.runtime == "distributed":
        common += ["--emulate-stage-ms", str(args.emulate_stage_ms), "--emulate-link-ms", str(args.emulate_link_ms)]
    runs = []
    for spec in args.run:
        server_args = [*common, *flags[spec]]
        for _ in range(args.repeats if args.record_overhead else 1):
            print(
                f"[bench_serve] {spec}: {args.requests} requests, {args.concurrency} clients",
                file=sys.stderr,
                flush=True,
            )
            runs.append(run_load(args, spec, server_args, prompts))
            if args.record_overhead:
                with tempfile.TemporaryDirectory() as records:
                    print(f"[bench_serve] {spec} +record: the same, recorded", file=sys.stderr, flush=True)
                    runs.append(run_load(args, f"{spec} +record", [*server_args, "--record", records], prompts))
    overhead = record_overhead(runs) if args.record_overhead else {}
    same = all(r["texts"] == runs[0]["texts"] for r in runs)
    print(
        f"\n{args.requests} requests x {args.max_tokens} tokens, {args.concurrency} concurrent clients, runtime "
        f"{args.runtime}"
        + (
            f", emulated stage {args.emulate_stage_ms} ms, link {args.emulate_link_ms} ms"
            if args.runtime == "distributed"
            else ""
        )
        + f"; identical outputs: {same}"
    )
    print(
        markdown_table(
            [
                "run",
                "tokens/s",
                "latency p50 / p95 (s)",
                "TTFT p50 / p95 (s)",
                "pipeline time per request p50 / p95 (s)",
                "mean L'_acc",
            ],
            [
                [
                    r["name"],
                    f"{r['tokens_per_s']:.2f}",
                    f"{r['latency_s']['p50']:.2f} / {r['latency_s']['p95']:.2f}",
                    f"{r['ttft_s']['p50']:.2f} / {r['ttft_s']['p95']:.2f}",
                    f"{r['pipeline_s']['p50']:.2f} / {r['pipeline_s']['p95']:.2f}",
                    r["mean_L_acc"] if r["mean_L_acc"] is not None else "-",
                ]
                for r in runs
            ],
            rule=" --- ",
        )
    )
    for spec, drop in overhead.items():
        print(f"{spec}: recording costs {100 * drop:.1f}% of tokens/s (medians of {args.repeats} runs each)")
    if args.out:
        report = {
            "command": command_line("serve", argv),
            "identical_outputs": same,
            "requests": args.requests,
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "runtime": args.runtime,
            "emulate_stage_ms": args.emulate_stage_ms,
            "emulate_link_ms": args.emulate_link_ms,
            "runs": [{k: v for k, v in r.items() if k != "texts"} for r in runs],
            **({"record_overhead": overhead} if args.record_overhead else {}),
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        write_result(args.out, report)
    return 0 if same else 1
