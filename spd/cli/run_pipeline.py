"""The distributed pipeline runtime as a program: one process per stage plus rank 0 (spd/runtime/).

    torchrun --nproc-per-node 5 -m spd.cli.run_pipeline --target testbed/target \\
        --speculator runs/testbed-n4/final --mode spd --prompt "import os" --json
    torchrun --nproc-per-node 5 -m spd.cli.run_pipeline --mode spd pp --prompts testbed/prompts.jsonl \\
        --num-prompts 20 --emulate-stage-ms 20 --emulate-link-ms 1 --out runtime.json

``spd-generate --runtime distributed --stages N`` spawns the same program locally. The world size must
be ``stages + 1``. Several ``--mode`` values run one after another on the same processes (the stages serve
every mode). Rank 0 prints the results: with ``--prompt`` or ``--prompt-ids``, the text (the token ids when
there is no tokenizer; ``--show-acceptance`` colours accepted speculations as spd-generate does) or one JSON
object with ``--json``;
with ``--prompts``, a per-mode summary and, with ``--out``, JSON with every prompt's tokens and stats.
A wrong input exits with 2, a lost rank with 1; each prints one ``error:`` line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from spd.cli.batch_flags import add_prefill_flags, check_prefill_flags
from spd.cli.common import Parser
from spd.decoding.modes import PIPELINED, check_proposer
from spd.decoding.sampling import SamplingParams
from spd.decoding.spec import DecodingSpec, check_runtime_numbers, default_mode
from spd.errors import SpdInputError, cli_error, run_cli


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="run_pipeline", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--mode",
        nargs="+",
        default=None,
        choices=PIPELINED,
        help="one or more modes, run one after another on the same processes (default: spd with "
        "--speculator, tree with only --draft-model, else spd, which needs --speculator)",
    )
    DecodingSpec.add_flags(p, exclude=("mode", "device", "runtime", "draft_steps"))
    p.add_argument("--prompt", default=None)
    p.add_argument("--prompt-ids", default=None, help="the prompt as comma-separated token ids")
    p.add_argument("--prompts", default=None, help='jsonl with a "prompt" field per row')
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--chat", action="store_true")
    p.add_argument("--max-new-tokens", type=int, default=128)
    SamplingParams.add_flags(p)
    p.add_argument("--backend", default=None, help="gloo or nccl (default: nccl with CUDA, else gloo)")
    p.add_argument("--emulate-token-ms", type=float, default=0.0, help="and per token of that call")
    p.add_argument(
        "--early-launch",
        action="store_true",
        help="let stage 1 start a proposal before the step that made it is verified (see spd/runtime/)",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=1,
        help="run up to B prompts of --prompts at once through the stages (dynamic batching, "
        "docs/method.md section 9); 1: one after another",
    )
    add_prefill_flags(p)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--json", action="store_true")
    p.add_argument("--show-acceptance", action="store_true", help="colour accepted speculations (ANSI green)")
    p.add_argument("--out", default=None)
    return p


def check_numbers(args) -> SamplingParams:
    """Refuse numbers no run can use (one sentence), before any process joins the world; the sampling settings."""
    check_runtime_numbers(
        args.timeout_s,
        emulate_stage_ms=args.emulate_stage_ms,
        emulate_token_ms=args.emulate_token_ms,
        emulate_link_ms=args.emulate_link_ms,
    )
    sampling = SamplingParams.from_args(args)
    for flag, low in (
        ("threads", 1),
        ("max_new_tokens", 1),
        ("num_prompts", 1),
        ("max_batch", 1),
        ("prefill_chunk", 1),
        ("step_tokens", 1),
        ("tree_nodes", 1),
    ):
        value = getattr(args, flag)
        if value is not None and value < low:
            raise SpdInputError(f"--{flag.replace('_', '-')} must be at least {low}, got {value}")
    check_prefill_flags(args, "run")
    return sampling


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Without a proposer the default (ar) has no pipeline: spd then asks for --speculator, as every spd run does.
    args.mode = args.mode or [default_mode(args.speculator, args.draft_model).replace("ar", "spd")]
    try:
        sampling = check_numbers(args)
    except SpdInputError as exc:
        return cli_error(exc, flush=True)
    import torch

    from spd.runtime.protocol import RuntimeConfig

    torch.set_num_threads(args.threads)
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    config = RuntimeConfig(
        backend=backend,
        timeout_s=args.timeout_s,
        emulate_stage_ms=args.emulate_stage_ms,
        emulate_token_ms=args.emulate_token_ms,
        emulate_link_ms=args.emulate_link_ms,
        early_launch=args.early_launch,
    )
    return run_cli(_run_world, args, config, sampling, flush=True, interrupted=130)


def _run_world(args, config, sampling: SamplingParams) -> int:
    """This process's part of the world: rank 0 drives the pipeline, every other rank runs its stage. A lost rank
    is one ``error:`` line and exit status 1."""
    import torch
    import torch.distributed as dist

    from spd.runtime.protocol import PipelineLost
    from spd.runtime.world import check_world_address, init_distributed, local_rank_device

    backend = config.backend
    try:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        n = world - 1
        if n < 1 or (args.stages is not None and args.stages != n):
            raise SpdInputError(
                f"the world has {world} processes but --stages is {args.stages}; "
                "expected stages + 1 processes (--nproc-per-node, summed over the machines)"
            )
        check_world_address()  # before loading: a world that cannot meet says so at once, on every machine
        device = local_rank_device(backend)
        dtype = getattr(torch, args.dtype)
        _quiet()
        if rank != 0:
            from spd.heads.loading import pipeline_cut
            from spd.runtime.loading import load_partial

            # Load before joining: once the world is complete every stage is ready for the first request. Rank 0
            # checks the head against the cut (_cut); a stage needs only the boundaries, derived the same way.
            _, boundaries = pipeline_cut(
                n, args.boundaries, args.speculator, args.speculator_revision, args.target, args.revision
            )
            staged = load_partial(args.target, n, rank, args.revision, dtype, device, boundaries)
        rank, world, control = init_distributed(config)
        if rank == 0:
            _driver(args, n, config, control, device, dtype, sampling)
        else:
            from spd.runtime.handshake import check_same_job, job_identity
            from spd.runtime.stage import stage_worker

            check_same_job(job_identity(args.target, args.revision, staged, dtype, config), control)
            stage_worker(staged, rank - 1, config, control, device)
        dist.destroy_process_group()
        return 0
    except PipelineLost as exc:
        print(f"error: {exc}; stopping", file=sys.stderr, flush=True)
        return 1


def _cut(args, n: int):
    """Rank 0's cut (the loader's: --boundaries, else the speculator's own cut, else equal) for a world of ``n``
    stages, the head checked against it."""
    from spd.decoding.loader import resolve_cut

    return resolve_cut(_spec(args, n))


def _spec(args, n: int, mode: str | None = None, device=None) -> DecodingSpec:
    """The decoding settings of this world (``mode``: one of its --mode values)."""
    overrides = {"device": str(device)} if device is not None else {}
    return DecodingSpec.of(args, mode=mode or args.mode[0], stages=n, **overrides)


def _driver(args, n: int, config, control, device, dtype, sampling: SamplingParams) -> None:
    from spd.decoding.batch import check_step_tokens, full_batch_width
    from spd.decoding.factory import build_engine
    from spd.decoding.loader import load_parts
    from spd.runtime.handshake import check_same_job, job_identity
    from spd.runtime.loading import load_partial
    from spd.runtime.protocol import PipelineLost
    from spd.runtime.remote import RemoteStages
    from spd.target.tokenizer import load_target_tokenizer

    for mode in args.mode:
        check_proposer(mode, args.speculator is not None, args.draft_model is not None)
    tokenizer = load_target_tokenizer(args.target, args.revision, args.tokenizer)  # None: a target without one
    if tokenizer is None and args.prompt_ids is None:
        raise SpdInputError(f"the target '{args.target}' has no tokenizer; pass --tokenizer DIR_OR_ID or --prompt-ids")
    prompts = _prompts(args, tokenizer)
    cut = _cut(args, n)
    staged = load_partial(args.target, n, 0, args.revision, dtype, device, cut.boundaries)
    check_same_job(job_identity(args.target, args.revision, staged, dtype, config), control)
    parts = load_parts(_spec(args, n, device=device), tokenizer, cut, staged)
    head, draft = parts.head, parts.draft
    remote = RemoteStages(staged, config, control)
    results: dict[str, list[dict]] = {}
    clocks: dict[str, dict] = {}  # per mode, where each rank's time went (--out)
    lost = False
    try:
        chain = build_engine(_spec(args, n, "pp"), staged, head, tokenizer, stages=remote)
        tree = None
        if "tree" in args.mode:
            tree = build_engine(_spec(args, n, "tree"), staged, head, tokenizer, draft, remote)
        for engine in (chain, tree):  # a budget too small for a full batch, before any mode runs
            if engine is not None and args.max_batch > 1:
                width = full_batch_width(
                    engine.loop.policy.max_width, args.max_batch, args.tree_nodes if engine is tree else None
                )
                check_step_tokens(args.step_tokens, args.max_batch, width)
        for mode in args.mode:
            results[mode] = []
            engine = tree if mode == "tree" else chain
            if args.out:
                remote.clocks()  # (a fresh start for this mode's breakdown)
            if args.max_batch > 1:
                results[mode] = _run_batched(args, engine, mode, prompts, tokenizer, staged, sampling)
                prompts_one_by_one = []
            else:
                prompts_one_by_one = prompts
            for i, ids in enumerate(prompts_one_by_one):
                out = engine.generate(ids, args.max_new_tokens, mode=mode, sampling=_nth(sampling, i))
                results[mode].append({"token_ids": out.token_ids, "stats": out.stats.as_dict()})
                if len(prompts) > 1:
                    print(f"[{mode}] {i + 1}/{len(prompts)} prompts", file=sys.stderr, flush=True)
            if args.out:
                clocks[mode] = remote.clocks()
    except PipelineLost:
        lost = True  # a peer is gone or silent: an orderly shutdown would only fail on it and hide this error
        raise
    finally:
        if not lost:
            remote.shutdown()
    _report(args, tokenizer, results, n, clocks)


def _nth(sampling: SamplingParams, i: int) -> SamplingParams:
    """The settings of the ``i``-th prompt of a run: its own seed, ``--seed + i``."""
    return sampling if sampling.seed is None else dataclasses.replace(sampling, seed=sampling.seed + i)


def _run_batched(
    args, engine, mode: str, prompts: list[list[int]], tokenizer, staged, sampling: SamplingParams
) -> list[dict]:
    """Every prompt as a request of one batched pipeline over the stages (up to ``--max-batch`` at once, each with
    its own seed ``--seed + i``); the records in prompt order."""
    from spd.cli.batch_flags import prefill_options
    from spd.decoding.batch import BatchedPipeline
    from spd.decoding.request import prepare_prompt

    options = prefill_options(args)
    if mode != "tree":  # (the node budget is the tree's; --mode pp tree runs pp without it)
        options["tree_nodes"] = None
    batch = BatchedPipeline(engine, args.max_batch, **options)
    requests = []
    for i, ids in enumerate(prompts):
        _, eos = prepare_prompt(tokenizer, ids, None, staged.model)
        requests.append(batch.submit(ids, args.max_new_tokens, _nth(sampling, i), eos, mode=mode))
    batch.run()
    records = []
    for request in requests:
        if request.error is not None:
            raise request.error
        records.append({"token_ids": request.output.token_ids, "stats": request.output.stats.as_dict()})
    print(
        f"[{mode}] {len(prompts)} prompts in {batch.steps} batched steps (largest batch "
        f"{max(batch.batch_sizes, default=0)})",
        file=sys.stderr,
        flush=True,
    )
    return records


def _prompts(args, tokenizer) -> list[list[int]]:
    if sum(x is not None for x in (args.prompt, args.prompt_ids, args.prompts)) != 1:
        raise SpdInputError("give exactly one of --prompt TEXT, --prompt-ids IDS and --prompts FILE")
    if args.prompt_ids is not None:
        from spd.cli.generate import parse_prompt_ids

        if args.chat:
            raise SpdInputError("--chat wraps a text prompt in the chat template; it cannot be used with --prompt-ids")
        return [parse_prompt_ids(args.prompt_ids)]
    if args.prompt is not None:
        texts = [args.prompt]
    else:
        from spd.reading import read_jsonl

        rows = read_jsonl(args.prompts, "prompts file", 'one JSON object with a "prompt" string per line')
        bad = next((n for n, row in enumerate(rows, 1) if not isinstance(row.get("prompt"), str)), None)
        if bad is not None:
            raise SpdInputError(f"row {bad} of the prompts file '{args.prompts}' has no \"prompt\" string")
        texts = [row["prompt"] for row in rows]
        texts = texts[: args.num_prompts] if args.num_prompts is not None else texts
    if args.chat:
        texts = [
            tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
            for t in texts
        ]
        return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    return [tokenizer(t)["input_ids"] for t in texts]


def summarize(records: list[dict], n: int) -> dict:
    """Totals of one mode: tokens/s over the whole run and L'_acc = n N / K."""
    new = sum(r["stats"]["new_tokens"] for r in records)
    decode = sum(r["stats"]["decode_tokens"] for r in records)
    steps = sum(r["stats"]["steps"] for r in records)
    decode_time = sum(r["stats"]["wall_time_s"] - r["stats"]["prefill_time_s"] for r in records)
    return {
        "prompts": len(records),
        "new_tokens": new,
        "decode_tokens": decode,
        "steps": steps,
        "L_acc": n * decode / steps if steps else None,
        "wall_time_s": sum(r["stats"]["wall_time_s"] for r in records),
        "decode_tokens_per_s": decode / decode_time if decode and decode_time > 0 else None,
        "tokens_per_s": new / sum(r["stats"]["wall_time_s"] for r in records),
    }


def _report(args, tokenizer, results: dict[str, list[dict]], n: int, clocks: dict[str, dict]) -> None:
    if args.prompts is None and len(args.mode) == 1:
        record = results[args.mode[0]][0]
        if args.json:
            # As spd-generate --json: "text" is null without a tokenizer.
            text = tokenizer.decode(record["token_ids"], skip_special_tokens=True) if tokenizer is not None else None
            print(json.dumps({"text": text, "token_ids": record["token_ids"], "stats": record["stats"]}), flush=True)
        else:
            from spd.cli.generate import TokenStreamer

            s = record["stats"]
            # The same output as spd-generate's streamer, written once the request is done.
            streamer = TokenStreamer(tokenizer, sys.stdout, colour=args.show_acceptance)
            for token, accepted in zip(record["token_ids"], s["token_acceptance"]):
                streamer(token, accepted)
            streamer.close()
            print(
                f"[{s['mode']}, {n} stages, distributed] {s['new_tokens']} tokens in {s['wall_time_s']:.2f} s "
                f"({s['tokens_per_s']:.1f} tokens/s), {s['steps']} steps, L'_acc "
                f"{s['equivalent_accept_length']:.2f}",
                file=sys.stderr,
                flush=True,
            )
    summary = {mode: summarize(records, n) for mode, records in results.items()}
    if args.prompts is not None or len(args.mode) > 1:
        for mode, s in summary.items():
            decode = "-" if s["decode_tokens_per_s"] is None else f"{s['decode_tokens_per_s']:.2f}"
            accept = "-" if s["L_acc"] is None else f"{s['L_acc']:.3f}"  # (one new token: no decode step)
            print(
                f"{mode}: {s['prompts']} prompts, {s['new_tokens']} tokens, {s['tokens_per_s']:.2f} tokens/s "
                f"(decode {decode}), L'_acc {accept}",
                flush=True,
            )
    if args.out:
        report = {
            "command": " ".join(sys.argv),
            "stages": n,
            "emulate_stage_ms": args.emulate_stage_ms,
            "emulate_link_ms": args.emulate_link_ms,
            "summary": summary,
            "results": results,
            "clocks": clocks,
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report) + "\n")


def _quiet() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


if __name__ == "__main__":
    sys.exit(main())
