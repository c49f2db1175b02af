"""spd-generate: generate text from a target model cut into pipeline stages, with or without a speculator.

    spd-generate --target testbed/target --prompt "def fibonacci(n):" --max-new-tokens 64
    spd-generate --target testbed/target --mode spd --speculator runs/testbed-n4/final --prompt "import os" --json
    spd-generate --target Qwen/Qwen3-8B --revision main --prompt-file p.txt --temperature 0.7 --json
    spd-generate --target testbed/target --mode tree --draft-model testbed/draft --stages 4 --prompt "import os"
    spd-generate --target DIR --prompt-ids 1,15,27 --json      # a target without a tokenizer

Modes:
  ar    autoregressive decoding, every stage per token
  pp    the standard pipeline: one token in flight
  spd   speculative pipeline decoding with a trained head (--stages defaults to the head's n)
  tree  a token tree in the pipeline, one level per step: --draft-model for the training-free draft-model
        mode, or --speculator for an SPD head with width --tree-width
  sd    serial speculative decoding of the whole target, no pipeline: --draft-model or a head trained
        with variant=eagle drafts --draft-steps tokens, the target verifies them in one forward

--stages N cuts the target into N stages, equal where N divides its layers, else the larger stages first
(30 layers in 8 stages: 4, 4, 4, 4, 4, 4, 3, 3); --boundaries gives any cut; a head brings its own.

One line on stderr says what loaded and how long it took. Text streams to stdout and a one-line summary
goes to stderr: tokens/s of this process, which runs the stages one after another, and for spd and pp
the model clock, tokens/s with one device per stage from the stage times measured in the run, beside
the standard pipeline's at the same stage times. --json prints one JSON object {"text", "token_ids",
"stats"} instead. --prompt-ids gives the prompt as token ids; without a tokenizer (the target has none
and no --tokenizer was given) the new token ids stream instead of text, separated by spaces, and --json
has "text": null. --show-acceptance colours the streamed tokens that were accepted speculations
(stats.token_acceptance) green with ANSI escape codes. A wrong input prints one error: line and exits
with 2.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from spd.cli.common import Parser, quiet_libraries
from spd.decoding.sampling import SamplingParams
from spd.decoding.spec import DecodingSpec, positive_int
from spd.errors import SpdInputError, run_cli

# The fields of DecodingSpec that the distributed runtime's program (spd/cli/run_pipeline.py) takes as flags; its
# --mode takes several modes, and device, runtime and draft_steps are not its.
RUNTIME_FLAGS = tuple(
    f for f in DecodingSpec.__dataclass_fields__ if f not in ("mode", "device", "runtime", "draft_steps")
)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="spd-generate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    DecodingSpec.add_flags(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text (one of --prompt, --prompt-file and --prompt-ids is required)")
    src.add_argument("--prompt-file", help="file whose contents are the prompt (default: none)")
    src.add_argument(
        "--prompt-ids", help="the prompt as token ids, e.g. 1,15,27, for targets without a tokenizer (default: none)"
    )
    p.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user turn with the chat template (default: off)"
    )
    p.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=128,
        help="the most new tokens; generation also stops at EOS or a full context (default: %(default)s)",
    )
    SamplingParams.add_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text (default: off)")
    p.add_argument(
        "--show-acceptance",
        action="store_true",
        help="colour the streamed tokens that were accepted speculations (ANSI green) (default: off)",
    )
    return p


def _read_prompt(args) -> str | list[int]:
    """The prompt text, or its token ids with --prompt-ids."""
    if args.prompt_ids is not None:
        return parse_prompt_ids(args.prompt_ids)
    if args.prompt_file is not None:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise SpdInputError(f"the prompt file '{args.prompt_file}' does not exist")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise SpdInputError(f"cannot read the prompt file '{args.prompt_file}' as UTF-8 text ({exc})") from None
    elif args.prompt is not None:
        text = args.prompt
    else:
        raise SpdInputError("no prompt given; expected --prompt TEXT, --prompt-file FILE or --prompt-ids IDS")
    if not text.strip():
        raise SpdInputError("the prompt is empty; expected some text")
    return text


def parse_prompt_ids(text: str) -> list[int]:
    """Token ids separated by commas and/or spaces ("1,15,27"); refuses empty lists, non-integers, negatives."""
    parts = [part for part in re.split(r"[,\s]+", text) if part]
    if not parts:
        raise SpdInputError("--prompt-ids is empty; expected comma-separated token ids such as 1,15,27")
    ids = []
    for part in parts:
        if not re.fullmatch(r"[+-]?\d+", part):
            raise SpdInputError(f"--prompt-ids expects comma-separated integers, got '{part}'")
        if int(part) < 0:
            raise SpdInputError(f"--prompt-ids expects non-negative token ids, got {int(part)}")
        ids.append(int(part))
    return ids


def _check_numbers(args) -> SamplingParams:
    """Refuse a wrong flag (one SpdInputError); the sampling settings."""
    sampling = SamplingParams.from_args(args)
    spec = DecodingSpec.of(args)
    args.mode = spec.mode  # the default follows --speculator and --draft-model
    spec.check()
    spec.check_sources()  # before torch is imported: a path that does not exist is refused at once
    if args.chat and args.prompt_ids is not None:
        raise SpdInputError(
            "--chat wraps a text prompt in the chat template; --prompt-ids are used as given, "
            "so pass the template's token ids yourself"
        )
    if args.show_acceptance and args.json:
        raise SpdInputError(
            "--show-acceptance colours the streamed text; with --json the flags are in stats.token_acceptance"
        )
    return sampling


def _load_tokenizer(source: str, revision: str | None):
    from spd.reading import DamagedFile
    from spd.target.tokenizer import load_tokenizer

    try:
        return load_tokenizer(source, revision)
    except SpdInputError as exc:
        if "does not exist" in str(exc) or isinstance(exc, DamagedFile):
            raise
        raise SpdInputError(f"{exc}; pass --tokenizer DIR_OR_ID") from None


ACCEPTED_COLOUR, RESET_COLOUR = "\x1b[32m", "\x1b[0m"  # ANSI green for --show-acceptance


class TokenStreamer:
    """The engines' ``on_token(token, accepted)``: writes the decoded text of the tokens seen so far (holding
    back incomplete UTF-8 characters) or, without a tokenizer, the token ids separated by spaces.

    With ``colour``, a written piece is wrapped in ANSI green when its tokens were accepted speculations: the
    flag arrives with the token, so each piece is coloured when it is written. A piece held back over several
    tokens (one UTF-8 character split across them) is green only if all of them were accepted.
    """

    def __init__(self, tokenizer, stream, colour: bool = False):
        self.tokenizer, self.stream, self.colour = tokenizer, stream, colour
        self.ids: list[int] = []
        self.held_accepted = True  # every token not yet written was accepted
        self.printed = 0

    def _write(self, piece: str, accepted: bool) -> None:
        if self.colour and accepted and piece:
            piece = f"{ACCEPTED_COLOUR}{piece}{RESET_COLOUR}"
        self.stream.write(piece)
        self.stream.flush()

    def __call__(self, token: int, accepted: bool = False) -> None:
        self.ids.append(token)
        self.held_accepted = self.held_accepted and accepted
        if self.tokenizer is None:
            self.stream.write(" " if len(self.ids) > 1 else "")
            self._write(str(token), accepted)
            self.held_accepted = True
            return
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return
        self._write(text[self.printed :], self.held_accepted)
        self.printed, self.held_accepted = len(text), True

    def close(self) -> None:
        if self.tokenizer is not None:
            text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            self._write(text[self.printed :], self.held_accepted)
        self.stream.write("\n")
        self.stream.flush()


def load_cli_tokenizer(args, prompt: str | list[int]):
    """--tokenizer or the target's; with --prompt-ids a target without one is fine (None: ids are printed)."""
    from spd.target.tokenizer import has_tokenizer_files

    if args.tokenizer is None and not has_tokenizer_files(args.target, args.revision):
        if isinstance(prompt, list):
            return None
        raise SpdInputError(
            f"the target '{args.target}' has no tokenizer; pass --tokenizer DIR_OR_ID, or the "
            "prompt as token ids with --prompt-ids"
        )
    return _load_tokenizer(args.tokenizer or args.target, args.revision if args.tokenizer is None else None)


def check_prompt_ids(prompt_ids: list[int], vocab_size: int) -> None:
    """Refuse --prompt-ids outside the target's vocabulary."""
    bad = [t for t in prompt_ids if t >= vocab_size]
    if bad:
        raise SpdInputError(
            f"--prompt-ids has token id {bad[0]}, outside the target's vocabulary (0..{vocab_size - 1})"
        )


def run(args) -> int:
    sampling = _check_numbers(args)
    prompt = _read_prompt(args)
    if args.runtime == "distributed":
        return run_distributed(args, prompt, sampling)
    started = time.perf_counter()
    from spd.decoding.factory import load_pipeline
    from spd.decoding.loader import resolve_cut
    from spd.decoding.model_clock import model_clock
    from spd.decoding.stats import PipelineStats

    spec = DecodingSpec.of(args)
    cut = resolve_cut(spec)  # the sources, the cut and the head's fit: one line each, before anything loads
    quiet_libraries()
    tokenizer = load_cli_tokenizer(args, prompt)
    if isinstance(prompt, list):
        prompt_ids = prompt
    elif args.chat:
        if not tokenizer.chat_template:
            raise SpdInputError(
                f"--chat was given but the tokenizer of '{args.tokenizer or args.target}' has no chat template"
            )
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        prompt_ids = tokenizer(prompt)["input_ids"]
    parts = load_pipeline(spec, tokenizer, cut)
    check_prompt_ids(prompt_ids, parts.staged.vocab_size)
    print(loaded_line(spec, cut, time.perf_counter() - started), file=sys.stderr, flush=True)
    engine = parts.engine
    streamer = None if args.json else TokenStreamer(tokenizer, sys.stdout, colour=args.show_acceptance)
    out = engine.generate(prompt_ids, args.max_new_tokens, mode=args.mode, on_token=streamer, sampling=sampling)
    stats = out.stats.as_dict()
    clock = model_clock(out.stats) if isinstance(out.stats, PipelineStats) else None
    if clock is not None:
        stats["model_clock"] = clock.as_dict()
    if args.json:
        # Without a tokenizer the tokens cannot be decoded: "text" is null, the token ids are the output.
        text = tokenizer.decode(out.token_ids, skip_special_tokens=True) if tokenizer is not None else None
        print(json.dumps({"text": text, "token_ids": out.token_ids, "stats": stats}))
    else:
        streamer.close()
        print(summary_line(stats), file=sys.stderr)
    return 0


def loaded_line(spec: DecodingSpec, cut, seconds: float) -> str:
    """The line once everything is loaded: the target, the mode, the cut, the proposer and the time it took."""
    from spd.target.cut import describe_cut

    proposer = f", head {spec.speculator}" if spec.speculator else ""
    proposer += f", draft model {spec.draft_model}" if spec.draft_model else ""
    return f"[spd] loaded {spec.target}: {spec.mode}, {describe_cut(cut.boundaries)}{proposer}; {seconds:.1f} s"


def summary_line(stats: dict) -> str:
    """The run in one line: what this process measured (it runs the stages one after another), the pipeline's
    counts and, for a chain, the model clock: tokens/s with one device per stage, beside pp's at the same stage
    times (:mod:`spd.decoding.model_clock`)."""
    stages = stats.get("stages", 1)
    where = f"one process, its {stages} stages in turn" if stages > 1 else "one process"
    line = (
        f"[{stats['mode']}] {stats['new_tokens']} tokens in {stats['wall_time_s']:.2f} s "
        f"({stats['tokens_per_s']:.1f} tokens/s, {where}), stop: {stats['stop_reason']}"
    )
    if "steps" in stats:
        line += (
            f"; {stats['stages']} stages, {stats['steps']} steps, {stats['flushes']} flushes, "
            f"L'_acc {stats['equivalent_accept_length']:.2f}, "
            f"theoretical speedup {stats['theoretical_speedup']:.2f}"
        )
    if "mean_acceptance_length" in stats:
        line += (
            f"; m = {stats['draft_steps']}, {stats['iterations']} target forwards, mean acceptance length "
            f"{stats['mean_acceptance_length']:.2f}, theoretical speedup {stats['theoretical_speedup']:.2f}"
        )
    if "mean_tree_size" in stats:
        line += f"; tree W={stats['width']} K={stats['children']}, mean size {stats['mean_tree_size']:.1f}"
    clock = stats.get("model_clock")
    if clock is not None:
        line += (
            f"; model clock (one device per stage, this run's stage times): {clock['tokens_per_s']:.1f} decode tokens/s"
        )
        if stats["mode"] != "pp":
            line += f", pp {clock['pp_tokens_per_s']:.1f}"
    return line


def run_distributed(args, prompt: str | list[int], sampling: SamplingParams) -> int:
    """Check the request here, then start ``stages + 1`` processes of spd/cli/run_pipeline.py (one per rank)."""
    import os
    import subprocess

    from spd.runtime.world import free_port, local_world_env

    stages = _world_stages(args)
    cmd = _rank_command(args, prompt, stages, sampling)
    # One process per rank, started here rather than by torchrun: rank 0 then serves the rendezvous store on
    # loopback only (torchrun's agent store listens on every interface), and gloo binds to loopback too.
    env = {
        **local_world_env(free_port()),
        "WORLD_SIZE": str(stages + 1),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    from spd.runtime.children import end_child, sigterm_unwinds, start_child

    # The ranks end with this process: SIGTERM or Ctrl-C here stops them, and a kill that runs no handler reaches
    # them through their parent-death signal. A rank that fails makes the others exit with an error line within
    # --timeout-s (the runtime's promise); whatever is still running after that is stopped here.
    sigterm_unwinds()
    procs, errs = [], []
    try:
        for rank in range(stages + 1):
            procs.append(
                start_child(
                    cmd,
                    stdout=sys.stdout if rank == 0 else subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                    env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                )
            )
        errs = _collect_stderr(procs, grace_s=args.timeout_s + 10)
    except BaseException:
        for proc in procs:
            end_child(proc)
        raise
    stderr = errs[0] + "".join(e for e in errs[1:])  # rank 0's lines first: its summary and its error
    returncode = next((p.returncode for p in procs if p.returncode != 0), 0)
    lines = stderr.splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    if returncode != 0:
        print(errors[0] if errors else f"error: the distributed runtime failed (exit {returncode})", file=sys.stderr)
        return 1 if errors and errors[0].startswith("error: rank") else 2  # a lost rank vs a wrong input
    for line in lines:
        if line.startswith("["):
            print(line, file=sys.stderr)
    return 0


def _world_stages(args) -> int:
    """The pipeline's stage count, checked here before any process starts (the loader's cut: a head made for
    another target or n is one error)."""
    from spd.decoding.loader import resolve_cut

    return resolve_cut(DecodingSpec.of(args)).n_stages


def _rank_command(args, prompt: str | list[int], stages: int, sampling: SamplingParams) -> list[str]:
    """The command line every rank runs (spd/cli/run_pipeline.py), the decoding and sampling flags derived from
    DecodingSpec and SamplingParams."""
    spec = DecodingSpec.of(args, stages=stages)
    cmd = [
        sys.executable,
        "-m",
        "spd.cli.run_pipeline",
        "--mode",
        args.mode,
        *spec.argv(RUNTIME_FLAGS),
        *(["--prompt-ids", ",".join(map(str, prompt))] if isinstance(prompt, list) else ["--prompt", prompt]),
        "--max-new-tokens",
        str(args.max_new_tokens),
        *sampling.argv(),
    ]
    cmd += ["--chat"] if args.chat else []
    cmd += ["--json"] if args.json else []
    cmd += ["--show-acceptance"] if args.show_acceptance else []
    return cmd


def _collect_stderr(procs, grace_s: float) -> list[str]:
    """Each process's stderr, read on threads until all have exited; once one has failed, those still running
    after ``grace_s`` are stopped."""
    import threading
    import time

    from spd.runtime.children import end_child

    out = [""] * len(procs)

    def read(i):
        out[i] = procs[i].stderr.read()

    threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(procs))]
    for t in threads:
        t.start()
    failed_at = None
    while any(p.poll() is None for p in procs):
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > grace_s:
            for p in procs:
                end_child(p)
        time.sleep(0.1)
    for t in threads:
        t.join(timeout=5)
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_cli(run, args, interrupted=130)


if __name__ == "__main__":
    sys.exit(main())
