"""Benchmark many concurrent clients on one pipeline: batched spd vs batched pp vs one-at-a-time spd.

    spd-bench batch --speculator runs/testbed-n4/final --clients 1 2 4 8 16 32 \\
        --requests-per-client 3 --max-new-tokens 48 --out bench_batch.json
    # the same over the distributed runtime: n stage processes, each call sleeping a + b * tokens
    spd-bench batch --speculator runs/testbed-n4/final --runtime distributed \\
        --emulate-stage-ms 10 --emulate-token-ms 0.1 --out bench_batch_runtime.json

``C`` closed-loop clients (each sends its next request as soon as its last one ends, no think time) share one
pipeline, run three ways on the same target and head. With ``--rates R ...`` the load is open-loop instead (or as
well): ``--requests`` requests arrive at random times, a Poisson process of ``R`` requests per second (seeded, the
same arrival times and prompts for every system), whether or not earlier ones have finished, and the batched
systems hold up to ``--max-batch`` of them at once (the others queue). Every request asks for ``--max-new-tokens``
tokens (no EOS), or with ``--new-tokens-jitter J`` for that many plus a whole number from ``-J`` to ``J`` of its own
(seeded by the request's index, the same for every system): with equal budgets the closed-loop clients of batched
pp finish in the same step and their newcomers' prompts never overlap another request's tokens, a lockstep that
real requests, whose lengths differ, do not keep:

- ``spd batched``: the batched pipeline (spd.decoding.batch) with up to ``C`` requests in flight;
- ``pp batched``: the same batched pipeline without a head: the standard pipeline with dynamic batching (what a
  pipelined vLLM deployment does);
- ``spd 1-at-a-time``: today's server (``--max-batch 1``): one request in the pipeline, the others wait (left out
  with ``--batched-only``).

With ``--draft-model DIR --stages N`` (instead of ``--speculator``) the speculative systems are a draft model's token
tree of width ``--tree-width`` (default 4; SpecPipe-DB's configuration): ``tree batched`` and ``tree 1-at-a-time``,
beside the same ``pp batched``. With ``--speculator`` and ``--tree-width W`` (or ``auto``, up to
``--tree-max-width``) the head proposes the trees instead of chains (``--mode tree`` with a head).

Every row reports output tokens/s over the whole run, time between tokens and time to first token (p50, from the
request's submission), under two clocks. Time between tokens is given two ways: over every gap between two tokens
of a request (``tbt_mean_ms``, ``tbt_p50_ms``, ``tbt_p99_ms``: a speculative request's tokens come one step apart
after a hit and ``n`` steps apart after a miss, so its per-gap tail is ``n`` of its steps), and per request
(``tbt_request_p50_ms``, ``tbt_request_p99_ms`` over the requests, ``tbt_request_mean_ms`` their mean: each
request's own mean time between tokens, from its first token to its last over its gaps; SpecPipe-DB's "average
single-request TBT" and its 99th percentile; the JSON's ``per_request`` lists each request's own, with its prompt,
its steps per token and the share of its verifications that accepted a speculated token):

- ``model``: the emulated deployment. Each stage runs on its own device, so a pipeline step lasts as long as its
  busiest stage, and a stage's time is a fixed cost plus a per-token cost, ``a + b * tokens`` (idle stages cost
  nothing). ``a`` and ``b`` are measured on this machine (a least-squares fit of the time of one stage's call,
  :func:`spd.target.ragged.run_ragged`, over 1..64 tokens at the benchmark's context length), or given with
  ``--stage-ms A --token-ms B`` (:func:`spd.decoding.model_clock.step_ms`, as spd-generate's summary line). The
  head runs concurrently with the stages (input-state SPD), so it adds no time.
- ``real``: the wall clock. With ``--runtime local`` (default) every stage runs in this process, one after
  another, on this machine's cores: real compute, no pipeline overlap. With ``--runtime distributed`` the stages
  run in their own processes (spd/runtime/batch.py) and each stage call also sleeps ``--emulate-stage-ms`` +
  ``--emulate-token-ms`` * its tokens (the model clock's a and b, unless given apart): the emulated deployment
  run for real, with rank 0's own work (the proposers, verification, messages) on the clock.

A closed-loop row also splits a step's wall time (``own/step`` in the table, ``stage_ms_per_step`` and
``own_ms_per_step`` in the JSON): the time in the stage back-end (in one process the stage calls themselves; over
the runtime, sending to the stages and waiting for their outputs) and the rest, the driver's own work per step
(rank 0's: admission, the proposers, the verifications, the bookkeeping), which the stages must hide. Of the own
work, ``overlap_ms_per_step`` is what ran between starting the stage calls and taking their outputs (the
proposers: over the runtime the stages compute meanwhile, on the same cores); the rest is on the step's critical
path. ``cpu_ms_per_step`` counts the CPU time (user + system) of this process (``driver``) and of each of its child
processes (``stages``: over the runtime, the stage ranks), per step, and ``cores_busy`` their sum over the wall
time: where stage processes and rank 0 share a machine's cores, a stage call may wait for CPU that the other
processes use (``cpu/step`` in the table: driver + stages). Over the runtime,
``stage_clock_ms_per_step`` gives each stage's wall time per step in its ragged calls (``compute``), its emulated
sleep (``emulated_compute``), waiting for rank 0's manifest or the previous stage's outputs (``receive_wait``) and
sending (``send``).

The token counts, steps and acceptance come from the real run; only the time per step differs between the
clocks. An open-loop run has one clock, the one its arrivals follow: the model clock with ``--runtime local``
(the pipeline idles until the next arrival when it has nothing to run), the real clock with ``--runtime
distributed``; its time to first token counts from the request's arrival, the time it spent queued included.
The systems run one after another on the same machine; the table prints ratios to ``pp batched``.
"""

from __future__ import annotations

import statistics
import sys
import time

from spd.bench.report import argument_parser, command_line, line_fit, write_result
from spd.decoding.model_clock import step_ms
from spd.decoding.tree_width import parse_tree_width
from spd.errors import SpdInputError, run_cli
from spd.paths import default_testbed_dir

SYSTEMS = ("spd batched", "pp batched", "spd 1-at-a-time")
TREE_SYSTEMS = ("tree batched", "pp batched", "tree 1-at-a-time")  # --draft-model or --tree-width
# A stage's clock over the runtime, per step: its ragged calls, the emulated sleep, waiting for messages, sending.
STAGE_CLOCKS = ("compute", "emulated_compute", "receive_wait", "send")


def parse_args(argv=None):
    tb = default_testbed_dir()
    p = argument_parser("batch", __doc__)
    p.add_argument("--target", default=str(tb / "target"))
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--speculator", help="the SPD head (its n cuts the pipeline)")
    source.add_argument("--draft-model", help="a draft model proposing a token tree (mode tree; needs --stages)")
    p.add_argument("--stages", type=int, default=None, help="with --draft-model: the number of pipeline stages, n")
    p.add_argument(
        "--tree-width",
        default=None,
        help="the tree's width W, or 'auto' (default 4 with --draft-model; with --speculator: the head "
        "proposes trees of this width instead of chains)",
    )
    p.add_argument("--tree-children", type=int, default=4, help="with a tree: candidates per node")
    p.add_argument("--tree-max-width", type=int, default=8, help="with --tree-width auto: the largest width")
    p.add_argument("--prompts", default=str(tb / "prompts.jsonl"), help="as spd-bench decode --prompts")
    p.add_argument(
        "--clients",
        type=int,
        nargs="+",
        default=None,
        help="closed-loop clients, one row each (default 1 2 4 8 16 32 unless --rates is given)",
    )
    p.add_argument("--requests-per-client", type=int, default=3)
    p.add_argument(
        "--rates",
        type=float,
        nargs="+",
        default=None,
        help="open-loop: requests per second arriving at random (Poisson), one row each",
    )
    p.add_argument("--requests", type=int, default=64, help="open-loop: requests per rate")
    p.add_argument("--max-batch", type=int, default=32, help="open-loop: requests in flight at most, batched")
    p.add_argument("--seed", type=int, default=0, help="open-loop: the arrival times' seed")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument(
        "--new-tokens-jitter",
        type=int,
        default=0,
        help="request i's budget is --max-new-tokens + a whole number from -J to J, drawn with seed i (the "
        "same for every system); 0: every request gets --max-new-tokens",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=64,
        help="prompt tokens that enter the pipeline per step, all newcomers together",
    )
    p.add_argument(
        "--step-tokens",
        type=int,
        default=None,
        help="a stage call's token budget: prompts enter with what the levels in flight leave of it",
    )
    p.add_argument(
        "--spread-prefill",
        action="store_true",
        help="each prompt enters in n equal chunks, 1/n of it in each stage call",
    )
    p.add_argument(
        "--tree-nodes",
        type=int,
        default=None,
        help="with a tree: a node budget per level across the batch (the trees narrow as it grows)",
    )
    p.add_argument("--stage-ms", type=float, default=None, help="the model clock's fixed cost per stage call, a")
    p.add_argument("--token-ms", type=float, default=None, help="the model clock's cost per token, b")
    p.add_argument(
        "--runtime",
        default="local",
        choices=("local", "distributed"),
        help="the stages in this process, or in their own processes (the distributed runtime)",
    )
    p.add_argument("--emulate-stage-ms", type=float, default=0.0, help="distributed: sleep per stage call, a")
    p.add_argument("--emulate-token-ms", type=float, default=0.0, help="distributed: and per token of the call, b")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument(
        "--batched-only",
        action="store_true",
        help="run the two batched systems only, not the one-at-a-time baseline (the slowest to run)",
    )
    p.add_argument("--out", default="bench_batch.json")
    args = p.parse_args(argv)
    if (args.stage_ms is None) != (args.token_ms is None):
        raise SpdInputError("--stage-ms and --token-ms go together (the model clock's a and b)")
    if args.runtime == "local" and (args.emulate_stage_ms or args.emulate_token_ms):
        raise SpdInputError("--emulate-stage-ms and --emulate-token-ms need --runtime distributed")
    if min(args.emulate_stage_ms, args.emulate_token_ms) < 0:
        raise SpdInputError("--emulate-stage-ms and --emulate-token-ms must be >= 0")
    if args.clients is None:
        args.clients = [] if args.rates else [1, 2, 4, 8, 16, 32]
    if min(args.clients, default=1) < 1 or args.requests_per_client < 1 or args.max_new_tokens < 1:
        raise SpdInputError("--clients, --requests-per-client and --max-new-tokens must be positive")
    if not 0 <= args.new_tokens_jitter < args.max_new_tokens:
        raise SpdInputError(
            f"--new-tokens-jitter must be from 0 to --max-new-tokens - 1 ({args.max_new_tokens - 1}), "
            f"got {args.new_tokens_jitter}"
        )
    if min(args.rates or [1.0]) <= 0 or args.requests < 1 or args.max_batch < 1:
        raise SpdInputError("--rates, --requests and --max-batch must be positive")
    if args.tree_width is None and args.draft_model is not None:
        args.tree_width = 4
    if args.tree_width is not None:  # a token tree: a draft model's, or the head's with --tree-width
        args.tree_width = parse_tree_width(args.tree_width)
        if args.tree_max_width < 1 or args.tree_children < 1:
            raise SpdInputError("--tree-max-width and --tree-children must be positive")
    elif args.tree_nodes is not None:
        raise SpdInputError("--tree-nodes narrows token trees; it needs --draft-model or --tree-width")
    return args


def calibrate(staged, context: int) -> tuple[float, float]:
    """``a`` and ``b`` (ms) of ``a + b * tokens`` for one stage call of ``staged`` over ``context`` cached rows."""
    import torch

    from spd.target.kv_pool import KVPool
    from spd.target.ragged import run_ragged
    from spd.target.segments import Segment

    sizes, times = [1, 2, 4, 8, 16, 32, 64], []
    pool = KVPool(staged, context + 64)
    region = pool.allocate(context + 64)
    with torch.inference_mode():
        for size in sizes:
            best = float("inf")
            for _ in range(7):
                cache = pool.caches(region)[0]
                cache.length = context
                hidden = torch.randn(1, size, staged.config.hidden_size, dtype=staged.dtype)
                tick = time.perf_counter()
                run_ragged(pool, 0, [Segment(cache, hidden)])
                best = min(best, time.perf_counter() - tick)
            times.append(best * 1000)
    a, b = line_fit(sizes, times)
    return max(a, 0.0), max(b, 0.0)


def new_tokens(index: int, max_new_tokens: int, jitter: int) -> int:
    """Request ``index``'s budget: ``max_new_tokens``, moved by a whole number from ``-jitter`` to ``jitter`` drawn
    with seed ``index`` (so every system gives request ``index``, and its prompt, the same budget)."""
    import random

    return max_new_tokens + (random.Random(index).randint(-jitter, jitter) if jitter else 0)


def cpu_seconds() -> dict[int, float]:
    """CPU seconds (user + system) used so far by this process and by each of its live child processes (over the
    distributed runtime, the stage ranks), by process id; this process is the first entry."""
    import psutil

    me = psutil.Process()
    used = {me.pid: sum(me.cpu_times()[:2])}
    for child in me.children(recursive=True):
        try:
            used[child.pid] = sum(child.cpu_times()[:2])
        except psutil.Error:  # it ended meanwhile: nothing of it to count
            pass
    return used


def cpu_used(before: dict[int, float], after: dict[int, float]) -> dict:
    """The CPU seconds between two :func:`cpu_seconds`: ``driver`` (this process) and ``stages`` (each child process
    alive at both, in process-id order)."""
    driver = next(iter(before))
    return {
        "driver": after[driver] - before[driver],
        "stages": [after[pid] - before[pid] for pid in sorted(before) if pid != driver and pid in after],
    }


def run_system(
    engines: dict,
    system: str,
    prompts: list[list[int]],
    clients: int,
    per_client: int,
    max_new_tokens: int,
    prefill_chunk: int,
    step_tokens: int | None = None,
    spread_prefill: bool = False,
    tree_nodes: int | None = None,
    jitter: int = 0,
) -> dict:
    """C closed-loop clients on one batched pipeline; per request its token steps and wall times. ``engines``: the
    engine of each mode (spd and pp share one; a draft model's tree has its own)."""
    mode, batched = _pipeline(
        engines,
        system,
        prompts,
        clients,
        max_new_tokens + jitter,
        prefill_chunk,
        step_tokens,
        spread_prefill,
        tree_nodes,
    )
    # Over the distributed runtime the stages keep clocks (their layers, the emulated sleep, their sends and
    # receives): asked now, they start anew for this run (the batch mode is entered at the first step).
    stage_clocks = getattr(engines[mode].backend, "clocks", None)
    if stage_clocks is not None:
        stage_clocks()
    records, next_prompt = [], iter(range(10**9))

    def send(client: int, left: int) -> None:
        index = next(next_prompt)
        record = {
            "client": client,
            "prompt": index % len(prompts),
            "submit_step": batched.steps,
            "submit_s": time.perf_counter(),
            "steps": [],
            "times": [],
            "tokens": [],
        }

        def on_token(token: int, accepted: bool) -> None:
            record["tokens"].append(token)
            record["steps"].append(batched.steps)
            record["times"].append(time.perf_counter())

        def on_done(request) -> None:
            if request.error is not None:
                raise request.error
            record["stats"] = request.output.stats
            if left > 1:
                send(client, left - 1)

        records.append(record)
        _submit(batched, prompts, index, new_tokens(index, max_new_tokens, jitter), mode, on_token, on_done)

    cpu_before = cpu_seconds()
    start = time.perf_counter()
    for client in range(clients):
        send(client, per_client)
    while batched.busy:
        batched.step()
    wall_s = time.perf_counter() - start
    cpu_s = cpu_used(cpu_before, cpu_seconds())
    return {
        "records": records,
        "stage_tokens": batched.stage_tokens,
        "batch_sizes": batched.batch_sizes,
        "start_s": start,
        "wall_s": wall_s,
        "stage_s": batched.stage_s,
        "overlap_s": batched.overlap_s,
        "cpu_s": cpu_s,
        "stage_clocks": stage_clocks()["stages"] if stage_clocks is not None else None,
    }


def _pipeline(
    engines: dict,
    system: str,
    prompts: list[list[int]],
    max_batch: int,
    max_new_tokens: int,
    prefill_chunk: int,
    step_tokens: int | None,
    spread_prefill: bool,
    tree_nodes: int | None = None,
):
    """The mode ``system`` runs and its batched pipeline, with KV rows for ``max_batch`` requests (a tree's node
    budget for the tree systems only)."""
    from spd.decoding.batch import BatchedPipeline

    mode = "pp" if system == "pp batched" else system.split()[0]
    engine = engines[mode]
    # The tree (or chain) in flight at its policy's widest, with room to spare.
    in_flight = engine.staged.n_stages * engine.loop.policy.max_width + 8
    batched = BatchedPipeline(
        engine,
        max_batch=1 if system.endswith("1-at-a-time") else max_batch,
        kv_rows=max_batch * (max(map(len, prompts)) + max_new_tokens + in_flight),
        prefill_chunk=prefill_chunk,
        step_tokens=step_tokens,
        spread_prefill=spread_prefill,
        tree_nodes=tree_nodes if mode == "tree" and not system.endswith("1-at-a-time") else None,
    )
    return mode, batched


def _submit(batched, prompts: list, index: int, max_new_tokens: int, mode: str, on_token, on_done) -> None:
    """Request ``index`` (prompt ``index`` modulo the prompts), greedy, into the batched pipeline."""
    from spd.decoding.sampling import SamplingParams

    batched.submit(prompts[index % len(prompts)], max_new_tokens, SamplingParams(), [], on_token, mode, on_done)


def poisson_arrivals(rate: float, count: int, seed: int) -> list[float]:
    """``count`` arrival times (s) of a Poisson process of ``rate`` requests per second: exponential gaps."""
    import random

    rng, clock, times = random.Random(seed), 0.0, []
    for _ in range(count):
        clock += rng.expovariate(rate)
        times.append(clock)
    return times


def run_open(
    engines: dict,
    system: str,
    prompts: list[list[int]],
    arrivals: list[float],
    max_batch: int,
    max_new_tokens: int,
    prefill_chunk: int,
    step_tokens: int | None,
    spread_prefill: bool,
    clock: str,
    a_ms: float = 0.0,
    b_ms: float = 0.0,
    tree_nodes: int | None = None,
    jitter: int = 0,
) -> dict:
    """Open-loop load: request ``i`` (prompt ``i``) arrives at ``arrivals[i]`` seconds of ``clock`` ("model": the
    emulated deployment's clock, a step costing its busiest stage's ``a + b * tokens``; "real": the wall clock) and is
    submitted at the first step boundary after it; per request its token steps and times on that clock."""
    mode, batched = _pipeline(
        engines,
        system,
        prompts,
        max_batch,
        max_new_tokens + jitter,
        prefill_chunk,
        step_tokens,
        spread_prefill,
        tree_nodes,
    )
    records, ends, clock_s = [], [0.0], 0.0  # ends[k]: the model clock (s) when step k ends; clock_s: now

    def submit(index: int) -> None:
        record = {"prompt": index % len(prompts), "arrival_s": arrivals[index], "steps": [], "times": [], "tokens": []}

        def on_token(token: int, accepted: bool) -> None:
            record["tokens"].append(token)
            record["steps"].append(batched.steps)
            record["times"].append(time.perf_counter() - start)

        def on_done(request) -> None:
            if request.error is not None:
                raise request.error
            record["stats"] = request.output.stats

        records.append(record)
        _submit(batched, prompts, index, new_tokens(index, max_new_tokens, jitter), mode, on_token, on_done)

    start, waiting = time.perf_counter(), 0
    while waiting < len(arrivals) or batched.busy:
        now = clock_s if clock == "model" else time.perf_counter() - start
        while waiting < len(arrivals) and arrivals[waiting] <= now:
            submit(waiting)
            waiting += 1
        if not batched.busy:  # idle until the next arrival
            if clock == "model":
                clock_s = arrivals[waiting]
            else:
                time.sleep(max(arrivals[waiting] - now, 0.0))
            continue
        batched.step()
        clock_s += step_ms(batched.stage_tokens[-1], a_ms, b_ms) / 1000
        ends.append(clock_s)
    wall_s = time.perf_counter() - start
    if clock == "model":
        for record in records:
            record["times"] = [ends[s] for s in record["steps"]]
    return {
        "records": records,
        "stage_tokens": batched.stage_tokens,
        "batch_sizes": batched.batch_sizes,
        "clock": clock,
        "total_s": clock_s if clock == "model" else wall_s,
    }


def summarize(run: dict, n: int, a_ms: float, b_ms: float) -> dict:
    """Throughput, time between tokens and time to first token under both clocks."""
    # The model clock: step k ends at the sum of the first k step costs (a step is as long as its busiest stage).
    ends_ms, clock = [0.0], 0.0
    for tokens in run["stage_tokens"]:
        clock += step_ms(tokens, a_ms, b_ms)
        ends_ms.append(clock)
    tokens = sum(len(r["steps"]) for r in run["records"])
    out = {
        "requests": len(run["records"]),
        "tokens": tokens,
        "steps": len(run["stage_tokens"]),
        "mean_batch": round(statistics.fmean(run["batch_sizes"]), 2),
    }
    if "stage_s" in run and out["steps"]:  # closed loop: a step's wall time, in the stage back-end and the rest
        out["stage_ms_per_step"] = round(1000 * run["stage_s"] / out["steps"], 3)
        out["own_ms_per_step"] = round(1000 * (run["wall_s"] - run["stage_s"]) / out["steps"], 3)
        out["overlap_ms_per_step"] = round(1000 * run["overlap_s"] / out["steps"], 3)
        cpu = run["cpu_s"]
        out["cpu_ms_per_step"] = {
            "driver": round(1000 * cpu["driver"] / out["steps"], 3),
            "stages": [round(1000 * s / out["steps"], 3) for s in cpu["stages"]],
        }
        out["cores_busy"] = round((cpu["driver"] + sum(cpu["stages"])) / run["wall_s"], 3)
        if run.get("stage_clocks"):  # each stage's wall time per step: its layers, its sleep, its waits and sends
            out["stage_clock_ms_per_step"] = [
                {name: round(1000 * clock[name] / out["steps"], 3) for name in STAGE_CLOCKS}
                for clock in run["stage_clocks"]
            ]
    decode = sum(r["stats"].decode_tokens for r in run["records"])
    steps = sum(r["stats"].steps for r in run["records"])
    out["accept_length"] = round(n * decode / steps, 3) if steps else 0.0
    if "clock" in run:  # open-loop: the one clock its arrivals followed
        clocks = {
            run["clock"]: (
                [r["times"] for r in run["records"]],
                [r["arrival_s"] for r in run["records"]],
                run["total_s"],
            )
        }
    else:
        clocks = {
            "model": (
                [[ends_ms[s] / 1000 for s in r["steps"]] for r in run["records"]],
                [ends_ms[r["submit_step"]] / 1000 for r in run["records"]],
                ends_ms[-1] / 1000,
            ),
            "real": (
                [[t - run["start_s"] for t in r["times"]] for r in run["records"]],
                [r["submit_s"] - run["start_s"] for r in run["records"]],
                run["wall_s"],
            ),
        }
    # Each request's own figures (the tail of the per-request time between tokens is a few requests: which ones, and
    # how many steps per token the head gave them); the clocks' time between tokens is added below.
    out["per_request"] = [
        {
            "prompt": r.get("prompt"),
            "tokens": len(r["steps"]),
            "steps_per_token": round((r["steps"][-1] - r["steps"][0]) / (len(r["steps"]) - 1), 3)
            if len(r["steps"]) > 1
            else None,
            "acceptance": round(r["stats"].accepted / r["stats"].verified, 3)
            if getattr(r["stats"], "verified", 0)
            else None,
            "tbt_ms": {},
        }
        for r in run["records"]
    ]
    for name, (times, submits, total_s) in clocks.items():
        gaps = sorted(b - a for ts in times for a, b in zip(ts, ts[1:]))
        for row, ts in zip(out["per_request"], times):
            row["tbt_ms"][name] = round(1000 * (ts[-1] - ts[0]) / (len(ts) - 1), 2) if len(ts) > 1 else None
        per_request = sorted((ts[-1] - ts[0]) / (len(ts) - 1) for ts in times if len(ts) > 1)
        first = sorted(ts[0] - s for ts, s in zip(times, submits) if ts)
        out[name] = {
            "tokens_per_s": round(tokens / total_s, 2) if total_s else 0.0,
            "tbt_mean_ms": round(1000 * statistics.fmean(gaps), 2) if gaps else 0.0,
            "tbt_p50_ms": round(1000 * _percentile(gaps, 50), 2),
            "tbt_p99_ms": round(1000 * _percentile(gaps, 99), 2),
            "tbt_request_mean_ms": round(1000 * statistics.fmean(per_request), 2) if per_request else 0.0,
            "tbt_request_p50_ms": round(1000 * _percentile(per_request, 50), 2),
            "tbt_request_p99_ms": round(1000 * _percentile(per_request, 99), 2),
            "ttft_p50_ms": round(1000 * _percentile(first, 50), 2),
            "total_s": round(total_s, 3),
        }
    return out


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    k = (len(values) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def render(results: dict) -> str:
    lines = [
        f"model clock: a = {results['stage_ms']:.3f} ms + b = {results['token_ms']:.4f} ms/token per stage call "
        f"({results['clock_source']}); n = {results['stages']}",
        f"real clock: {results.get('real_clock', 'one process, the stages in turn')}",
        f"{'load':>7} {'system':<16} {'clock':<5} {'tok/s':>9} {'x pp':>6} {'TBT mean':>9} {'TBT p50':>9} "
        f"{'TBT p99':>9} {'req p50':>8} {'req p99':>8} "
        f"{'TTFT p50':>10} {'batch':>6} {'Lacc':>5} {'own/step':>8} {'cpu/step':>11}",
    ]
    for row in results["rows"]:
        load = f"C={row['clients']}" if row.get("rate") is None else f"{row['rate']:g}/s"
        pp = next(
            r
            for r in results["rows"]
            if r["clients"] == row["clients"] and r.get("rate") == row.get("rate") and r["system"] == "pp batched"
        )
        own = f"{row['own_ms_per_step']:.2f}" if "own_ms_per_step" in row else ""
        cpu = row.get("cpu_ms_per_step")
        cpu = f"{cpu['driver']:.1f}+{sum(cpu['stages']):.1f}" if cpu else ""
        for clock in ("model", "real"):
            if clock not in row:  # an open-loop row has the clock its arrivals followed
                continue
            ratio = row[clock]["tokens_per_s"] / pp[clock]["tokens_per_s"] if pp[clock]["tokens_per_s"] else 0.0
            lines.append(
                f"{load:>7} {row['system']:<16} {clock:<5} {row[clock]['tokens_per_s']:>9.1f} "
                f"{ratio:>6.2f} {row[clock]['tbt_mean_ms']:>9.2f} {row[clock]['tbt_p50_ms']:>9.2f} "
                f"{row[clock]['tbt_p99_ms']:>9.2f} {row[clock]['tbt_request_p50_ms']:>8.2f} "
                f"{row[clock]['tbt_request_p99_ms']:>8.2f} "
                f"{row[clock]['ttft_p50_ms']:>10.1f} {row['mean_batch']:>6.2f} {row['accept_length']:>5.2f} "
                f"{own if clock == 'real' else '':>8} {cpu if clock == 'real' else '':>11}"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    # parse_args checks the numbers: its refusals are error lines
    return run_cli(lambda: _bench(parse_args(argv), command_line("batch", argv)))


def _bench(args, command: str) -> int:
    import torch
    import transformers

    from spd.bench.decode import load_prompts
    from spd.decoding.factory import build_engine, load_pipeline
    from spd.decoding.spec import DecodingSpec
    from spd.target.tokenizer import load_tokenizer

    transformers.utils.logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    tree = args.tree_width is not None
    if args.draft_model is not None and args.stages is None:
        raise SpdInputError("--draft-model needs --stages N: the number of pipeline stages to cut the target into")
    tokenizer = load_tokenizer(args.target)
    wanted = max(max(args.clients, default=0) * args.requests_per_client, args.requests if args.rates else 0)
    dataset, prompts = load_prompts(args.prompts, tokenizer, wanted)
    mode = "tree" if tree else "spd"
    decoding = DecodingSpec(
        mode,
        draft_model=args.draft_model,
        tree_width=args.tree_width or 4,
        tree_children=args.tree_children,
        tree_max_width=args.tree_max_width,
    )
    pipeline = None
    if args.runtime == "distributed":
        from spd.serving.pipeline import PipelineSpec, open_pipeline

        pipeline = open_pipeline(
            PipelineSpec.of(
                decoding,
                target=args.target,
                stages=args.stages,
                speculator=args.speculator,
                runtime="distributed",
                emulate_stage_ms=args.emulate_stage_ms,
                emulate_token_ms=args.emulate_token_ms,
                timeout_s=300,
            )
        )
        engine, staged = pipeline.engine, pipeline.staged
        if args.stage_ms is None:
            args.stage_ms, args.token_ms = args.emulate_stage_ms, args.emulate_token_ms
    else:
        parts = load_pipeline(
            DecodingSpec.of(decoding, target=args.target, stages=args.stages, speculator=args.speculator), tokenizer
        )
        engine, staged = parts.engine, parts.staged
    engines = {mode: engine, "pp": engine}
    if tree:  # the standard pipeline over the same stages
        engines["pp"] = build_engine(DecodingSpec("pp"), staged, None, tokenizer, stages=engine.backend)
    try:
        return _run_all(args, engines, staged, dataset, prompts, command)
    finally:
        if pipeline is not None:
            pipeline.close()


def _systems(args) -> tuple[str, ...]:
    """The systems a run compares, in order (the first is the one every other's outputs are checked against)."""
    systems = SYSTEMS if args.tree_width is None else TREE_SYSTEMS
    return systems[:2] if args.batched_only else systems


def _run_all(args, engines, staged, dataset, prompts, command: str) -> int:
    import torch

    if args.stage_ms is None:
        context = int(statistics.fmean(map(len, prompts))) + args.max_new_tokens // 2
        a_ms, b_ms = calibrate(staged, context)
        source = f"measured here: one stage call at {context} cached rows, 1..64 tokens, least squares"
    else:
        a_ms, b_ms = args.stage_ms, args.token_ms
        source = "given" if args.runtime == "local" else "given: the runtime's emulated stage time"
    wall = (
        "the distributed runtime: stage processes, each call sleeping "
        f"{args.emulate_stage_ms:g} ms + {args.emulate_token_ms:g} ms/token"
        if args.runtime == "distributed"
        else "one process, the stages in turn"
    )
    results = {
        "target": args.target,
        "speculator": args.speculator,
        "draft_model": args.draft_model,
        "tree_width": args.tree_width,
        "tree_children": args.tree_children if args.tree_width else None,
        "tree_max_width": args.tree_max_width if args.tree_width == "auto" else None,
        "prompts": dataset,
        "stages": staged.n_stages,
        "max_new_tokens": args.max_new_tokens,
        "new_tokens_jitter": args.new_tokens_jitter,
        "requests_per_client": args.requests_per_client,
        "rates": args.rates,
        "requests": args.requests if args.rates else None,
        "max_batch": args.max_batch if args.rates else None,
        "seed": args.seed if args.rates else None,
        "prefill_chunk": args.prefill_chunk,
        "step_tokens": args.step_tokens,
        "spread_prefill": args.spread_prefill,
        "tree_nodes": args.tree_nodes,
        "stage_ms": a_ms,
        "token_ms": b_ms,
        "clock_source": source,
        "runtime": args.runtime,
        "real_clock": wall,
        "threads": torch.get_num_threads(),
        "systems": list(_systems(args)),
        "command": command,
        "rows": [],
    }
    for clients in args.clients:
        outputs = []
        for system in _systems(args):
            run = run_system(
                engines,
                system,
                prompts,
                clients,
                args.requests_per_client,
                args.max_new_tokens,
                args.prefill_chunk,
                args.step_tokens,
                args.spread_prefill,
                args.tree_nodes,
                args.new_tokens_jitter,
            )
            outputs.append(sorted((r["prompt"], r["tokens"]) for r in run["records"]))
            row = {"clients": clients, "system": system, **summarize(run, staged.n_stages, a_ms, b_ms)}
            results["rows"].append(row)
            row["identical_outputs"] = outputs[-1] == outputs[0]  # the same tokens for every prompt as the first
            print(
                f"C={clients:<3} {system:<16} model {row['model']['tokens_per_s']:>8.1f} tok/s, real "
                f"{row['real']['tokens_per_s']:>8.1f} tok/s, L'acc {row['accept_length']}",
                file=sys.stderr,
                flush=True,
            )
    clock = "model" if args.runtime == "local" else "real"
    for rate in args.rates or []:
        arrivals, outputs = poisson_arrivals(rate, args.requests, args.seed), []
        for system in _systems(args):
            run = run_open(
                engines,
                system,
                prompts,
                arrivals,
                args.max_batch,
                args.max_new_tokens,
                args.prefill_chunk,
                args.step_tokens,
                args.spread_prefill,
                clock,
                a_ms,
                b_ms,
                args.tree_nodes,
                args.new_tokens_jitter,
            )
            outputs.append(sorted((r["prompt"], r["tokens"]) for r in run["records"]))
            row = {"clients": None, "rate": rate, "system": system, **summarize(run, staged.n_stages, a_ms, b_ms)}
            results["rows"].append(row)
            row["identical_outputs"] = outputs[-1] == outputs[0]
            print(
                f"{rate:g}/s {system:<16} {clock} {row[clock]['tokens_per_s']:>8.1f} tok/s, "
                f"TBT p99 {row[clock]['tbt_p99_ms']} ms (per request {row[clock]['tbt_request_p99_ms']}), "
                f"L'acc {row['accept_length']}",
                file=sys.stderr,
                flush=True,
            )
    print(render(results))
    print("identical outputs across the systems:", all(row["identical_outputs"] for row in results["rows"]))
    write_result(args.out, results)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0
