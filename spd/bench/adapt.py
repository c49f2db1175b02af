"""Does a head learn what it serves? A stream of requests replayed through spd-serve with and without ``--adapt``.

    spd-bench adapt --target smollm2/target --head heads/smollm2-135m-instruct-spd-n8 \\
        --stream smollm2/data/self/prompts-shell.jsonl --requests 300 --max-tokens 96 --arms adapt,static,ar \\
        --adapt-every 3000 --adapt-replay smollm2/data/self/greedy-{code,chat,math}.jsonl --adapt-args "--steps 40" \\
        --eval docs/results/self-eval/shell.jsonl --humaneval 64 --workdir runs/bench-adapt \\
        --out docs/results/adapt_shell.json --plot docs/results/adapt_shell.png

Each arm (``--arms``) starts its own server and sends the same requests in the same order, one at a time, as chat
requests (greedy, streamed): ``static`` serves with the head as it is; ``adapt`` with ``--record DIR --adapt``, so
its niced spd-adapt child fine-tunes the head every ``--adapt-every`` answer tokens and the server swaps each better
version in between requests; ``ar`` serves the target alone, the outputs both must equal. Every answer is appended
to ``WORKDIR/ARM/answers.jsonl`` as it comes: a killed run, run again, goes on where it stopped (the adapt arm's
server restarts on its newest good version and its spd-adapt where its records were read to).

Reported per arm: L'_acc over the last ``--window`` requests against requests served (the plot, with the swaps), the
head version of each request, failed requests, the longest pause between two streamed tokens beside the median
one, the CPU seconds the adaptation spent per served answer token; whether every answer equals ar's; with ``--eval``
(held-out requests of the stream's kind) and ``--humaneval N``, spd-bench decode's L'_acc of the starting head and of
the adapt arm's last version on them (no forgetting: HumanEval within a few percent).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from spd.bench.report import argument_parser, bench_command, command_line, markdown_table, streamed, write_result
from spd.files import complete_lines
from spd.reading import read_jsonl
from spd.testing.server import ServerProcess

ARMS = ("static", "adapt", "ar")


def read_rows(path: Path) -> list[dict]:
    """The rows of an append-only jsonl file of this benchmark (a torn last line dropped, with a warning)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in complete_lines(path).splitlines() if line.strip()]


def append_row(path: Path, row: dict) -> None:
    """Append one row, whole, and sync it: a kill loses at most the row being written."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def stream_chat(url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One greedy chat request, streamed: its token ids, the server's statistics and the pauses between tokens."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    start = time.perf_counter()
    arrivals, ids, stats = [], [], None
    for chunk in streamed(url, "/v1/chat/completions", body):
        spd = chunk.get("spd") or {}
        if spd.get("token_ids"):
            ids += spd["token_ids"]
            arrivals.append(time.perf_counter())
        if chunk["choices"][0]["finish_reason"] is not None:
            stats = spd
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    keep = ("decode_tokens", "steps", "stages", "equivalent_accept_length", "head_version")
    return {
        "token_ids": ids,
        "latency_s": round(time.perf_counter() - start, 4),
        "max_gap_s": round(max(gaps), 4) if gaps else None,
        "median_gap_s": round(statistics.median(gaps), 4) if gaps else None,
        "stats": {k: stats[k] for k in keep if stats and k in stats},
    }


def conversation(row: dict) -> list[dict] | None:
    """A stream row as chat messages: its ``messages``, or its ``prompt`` (data/self_instruct.py's rows) as the user
    turn; None for neither."""
    if isinstance(row.get("messages"), list):
        return row["messages"]
    return [{"role": "user", "content": row["prompt"]}] if isinstance(row.get("prompt"), str) else None


def descendants_cpu_s(pid: int) -> float:
    """CPU seconds of a process's descendants, those they have waited for included (spd-adapt's finished
    trainers)."""
    import psutil

    total = 0.0
    for child in psutil.Process(pid).children(recursive=True):
        try:
            t = child.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def server_args(args, arm: str, arm_dir: Path) -> list[str]:
    """spd-serve's flags for an arm."""
    common = ["--target", args.target, "--max-queue", str(4 * args.concurrency)]
    if arm == "ar":  # one request at a time: ar does not batch
        return [*common, "--mode", "ar"]
    spd = [*common, "--mode", "spd", "--head", args.head]
    spd += ["--max-batch", str(args.concurrency)] if args.concurrency > 1 else []
    if arm == "static":
        return spd
    adapt = ["--record", str(arm_dir / "records"), "--adapt", "--adapt-every", str(args.adapt_every)]
    adapt += ["--adapt-threads", str(args.adapt_threads)]
    adapt += ["--adapt-replay", *args.adapt_replay] if args.adapt_replay else []
    return spd + adapt + (["--adapt-args", args.adapt_args] if args.adapt_args else [])


def run_arm(args, arm: str, prompts: list[list[dict]]) -> list[dict]:
    """The arm's answers in request order: those already in its answers file, the rest asked of a server of its own
    by ``--concurrency`` clients (the server batching as many)."""
    arm_dir = Path(args.workdir) / arm
    arm_dir.mkdir(parents=True, exist_ok=True)
    answers_path, cpu_path = arm_dir / "answers.jsonl", arm_dir / "cpu.jsonl"
    done = {row["request"]: row for row in read_rows(answers_path) if row["request"] < len(prompts)}
    todo = [i for i in range(len(prompts)) if i not in done]
    if todo:
        print(f"[bench_adapt] {arm}: {len(todo)} of {len(prompts)} requests to ask", file=sys.stderr, flush=True)
        _ask_all(args, arm, arm_dir, prompts, todo, done, answers_path, cpu_path)
    return [done[i] for i in range(len(prompts))]


def _ask_all(args, arm, arm_dir, prompts, todo, done, answers_path, cpu_path) -> None:
    """Ask ``todo`` of one server, each answer appended as it comes; the server stopped in the end, its spd-adapt's
    CPU counted first."""
    server = ServerProcess(*server_args(args, arm, arm_dir), threads=args.threads)
    started, lock, stopping, served = time.time(), threading.Lock(), threading.Event(), [0]

    def ask(i: int) -> None:
        try:
            row = {"request": i, **stream_chat(server.url, server.model, prompts[i], args.max_tokens)}
        except Exception as exc:  # a failed request is a result: counted, and the stream goes on
            if stopping.is_set():
                return  # cut off by the run's own end: asked again by the next run
            if server.proc.poll() is not None:
                raise RuntimeError(f"the {arm} server died at request {i}:\n" + "".join(server.lines[-20:])) from exc
            row = {"request": i, "error": str(exc)}
        with lock:
            append_row(answers_path, row)
            done[i] = row
            served[0] += len(row.get("token_ids", []))
            if len(done) % 10 == 0:
                ordered = [done[j] for j in sorted(done)]
                print(f"[bench_adapt] {arm}: {len(done)}/{len(prompts)}, L'_acc {_rolling(ordered, args.window)[-1]}",
                      file=sys.stderr, flush=True)  # fmt: skip

    pool = ThreadPoolExecutor(args.concurrency)
    try:
        for future in [pool.submit(ask, i) for i in todo]:
            future.result()
    finally:
        stopping.set()
        pool.shutdown(wait=False, cancel_futures=True)
        adapt_cpu = descendants_cpu_s(server.proc.pid) if server.proc.poll() is None else 0.0
        server.stop()
        row = {"adapt_cpu_s": round(adapt_cpu, 2), "answer_tokens": served[0], "wall_s": round(time.time() - started)}
        append_row(cpu_path, row)
        (arm_dir / "server.log").write_text("".join(server.lines), encoding="utf-8")


def _rolling(answers: list[dict], window: int) -> list[float | None]:
    """L'_acc over the last ``window`` answered requests, after each request: n * decode tokens / steps."""
    out: list[float | None] = []
    for i in range(len(answers)):
        recent = [a["stats"] for a in answers[max(0, i + 1 - window) : i + 1] if a.get("stats", {}).get("steps")]
        steps = sum(s["steps"] for s in recent)
        out.append(round(recent[0]["stages"] * sum(s["decode_tokens"] for s in recent) / steps, 4) if steps else None)
    return out


def summarize(args, arm: str, answers: list[dict]) -> dict:
    """One arm's figures."""
    rolling = _rolling(answers, args.window)
    versions = [a.get("stats", {}).get("head_version", 0) for a in answers]
    swaps = [i for i in range(1, len(versions)) if versions[i] != versions[i - 1]]
    gaps = [a["median_gap_s"] for a in answers if a.get("median_gap_s") is not None]
    cpu = read_rows(Path(args.workdir) / arm / "cpu.jsonl")
    tokens = sum(len(a.get("token_ids", [])) for a in answers)
    adapt_cpu = sum(c["adapt_cpu_s"] for c in cpu)
    return {
        "arm": arm,
        "requests": len(answers),
        "failed": sum("error" in a for a in answers),
        "answer_tokens": tokens,
        "L_acc_first_window": rolling[min(args.window, len(rolling)) - 1] if rolling else None,
        "L_acc_last_window": rolling[-1] if rolling else None,
        "rolling_L_acc": rolling,
        "head_version": versions,
        "swaps_at_request": swaps,
        "median_gap_s": round(statistics.median(gaps), 4) if gaps else None,
        "max_gap_s_after_swap": [answers[i].get("max_gap_s") for i in swaps],
        "adapt_cpu_s": round(adapt_cpu, 1),
        "adapt_cpu_s_per_answer_token": round(adapt_cpu / tokens, 4) if tokens else None,
    }


def evaluate(args, last_version: Path | None) -> dict:
    """spd-bench decode on the held-out requests and on HumanEval: the starting head, and the last version."""
    runs = ["--run", f"before=spd:{args.head}"]
    if last_version is not None:
        runs += ["--run", f"after=spd:{last_version}"]
    out = {}
    sets = [("heldout", ["--prompts", args.eval])] if args.eval else []
    if args.humaneval:
        sets.append(("humaneval", ["--prompts", "humaneval-chat", "--num-prompts", str(args.humaneval)]))
    for name, prompts in sets:
        path = Path(args.workdir) / f"eval-{name}.json"
        if not path.exists():
            cmd = [*bench_command("decode"), "--target", args.target, *prompts, *runs]
            cmd += ["--temperatures", "0", "--max-new-tokens", str(args.max_tokens), "--out", str(path)]
            print("[bench_adapt] " + shlex.join(cmd), file=sys.stderr, flush=True)
            subprocess.run(cmd, check=True)
        result = json.loads(path.read_text(encoding="utf-8"))["results"]["T=0"]
        out[name] = {run: figures["summary"]["L_acc"] for run, figures in result.items()}
    return out


def plot(path: str, arms: dict[str, dict], window: int) -> None:
    """Rolling L'_acc against requests served, one line per arm, the swaps marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for arm, s in arms.items():
        if arm == "ar":
            continue
        xs = range(1, len(s["rolling_L_acc"]) + 1)
        ax.plot(
            xs, s["rolling_L_acc"], label=f"{arm} ({s['adapt_cpu_s_per_answer_token'] or 0:.3f} CPU s/token trained)"
        )
        for i in s["swaps_at_request"]:
            ax.axvline(i + 1, color="grey", linewidth=0.6, linestyle=":")
    ax.set_xlabel("requests served")
    ax.set_ylabel(f"L'_acc, last {window} requests")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _interrupted(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    p = argument_parser("adapt", __doc__)
    p.add_argument("--target", required=True, help="the target's directory")
    p.add_argument("--head", required=True, help="the head the servers start with")
    p.add_argument("--stream", required=True, help='jsonl of requests ("prompt"; rows with "keep": false skipped)')
    p.add_argument("--requests", type=int, default=300, help="requests replayed (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=128, help="answer tokens per request (default: %(default)s)")
    p.add_argument("--arms", default="static,adapt,ar", help="of static, adapt, ar (default: %(default)s)")
    p.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="clients at once, and the servers' --max-batch (default: %(default)s)",
    )
    p.add_argument("--window", type=int, default=50, help="requests in the rolling L'_acc (default: %(default)s)")
    p.add_argument("--adapt-every", type=int, default=4000, help="spd-serve --adapt-every (default: %(default)s)")
    p.add_argument("--adapt-threads", type=int, default=1, help="spd-serve --adapt-threads (default: %(default)s)")
    p.add_argument("--adapt-replay", nargs="+", default=[], help="spd-serve --adapt-replay (default: none)")
    p.add_argument("--adapt-args", default="", help="spd-serve --adapt-args (default: none)")
    p.add_argument("--threads", type=int, default=1, help="the server's torch threads (default: %(default)s)")
    p.add_argument("--eval", help="held-out requests of the stream's kind (an spd-bench decode --prompts file)")
    p.add_argument("--humaneval", type=int, default=0, help="HumanEval problems measured before and after (0: none)")
    p.add_argument("--workdir", required=True, help="answers, records and versions; a rerun resumes from it")
    p.add_argument("--out", help="the JSON result")
    p.add_argument("--plot", help="the plot (PNG; matplotlib)")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupted)  # a killed run stops its server (and its spd-adapt) on the way out
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arms or any(a not in ARMS for a in arms):
        p.error(f"--arms '{args.arms}' is not a list of {', '.join(ARMS)}")
    if not Path(args.stream).is_file():
        p.error(f"the stream '{args.stream}' does not exist; expected a jsonl file with a \"prompt\" per row")
    prompts = [conversation(r) for r in read_jsonl(args.stream, "stream of requests") if r.get("keep", True)]
    if len(prompts) < args.requests or None in prompts:
        p.error(
            f"the stream '{args.stream}' holds {len(prompts)} requests; expected at least --requests "
            f'{args.requests}, each a "prompt" string or "messages"'
        )
    prompts = prompts[: args.requests]

    answers = {arm: run_arm(args, arm, prompts) for arm in arms}
    summaries = {arm: summarize(args, arm, a) for arm, a in answers.items()}
    ids = {arm: [a.get("token_ids") for a in rows_] for arm, rows_ in answers.items()}
    reference = ids.get("ar")
    for arm, s in summaries.items():
        s["identical_to_ar"] = None if reference is None else ids[arm] == reference
    last = None
    if "adapt" in summaries and summaries["adapt"]["head_version"][-1]:
        last = Path(args.workdir) / "adapt" / "records" / "heads" / f"v{summaries['adapt']['head_version'][-1]}"
    evaluation = evaluate(args, last) if (args.eval or args.humaneval) else {}

    rows_out = [
        [
            arm,
            s["requests"],
            s["failed"],
            s["L_acc_first_window"],
            s["L_acc_last_window"],
            len(s["swaps_at_request"]),
            s["adapt_cpu_s_per_answer_token"],
            s["identical_to_ar"],
        ]
        for arm, s in summaries.items()
    ]
    header = ["arm", "requests", "failed", "L'_acc first window", "last window", "swaps", "CPU s/token", "== ar"]
    print(markdown_table(header, rows_out, rule=" --- "))
    for name, figures in evaluation.items():
        print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in figures.items()))
    if args.out:
        result = {
            "command": command_line("adapt", argv),
            "target": args.target,
            "head": args.head,
            "stream": args.stream,
            "max_tokens": args.max_tokens,
            "window": args.window,
            "adapt_every": args.adapt_every,
            "adapt_args": args.adapt_args,
            "adapt_replay": args.adapt_replay,
            "arms": summaries,
            "evaluation": evaluation,
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        write_result(args.out, result)
    if args.plot:
        plot(args.plot, summaries, args.window)
    failed = any(s["failed"] or s["identical_to_ar"] is False for s in summaries.values())
    return 1 if failed else 0
