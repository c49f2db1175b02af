"""Benchmark the distributed runtime: tokens/s of spd vs pp (and ar on one process), measured vs theoretical.

    python infer/bench_runtime.py --heads runs/testbed-n4/final runs/testbed-n8/final \\
        --emulate-stage-ms 20 --emulate-link-ms 1 --num-prompts 10 --out bench_runtime.json

For every head (its n sets the pipeline) one ``torchrun`` world of n + 1 processes runs the prompts in
``spd`` mode and then in ``pp`` mode (the same processes, one after the other). ``ar`` runs in this
process: the plain decoder with the emulated time of a whole forward (n x stage time) added per token.
The table reports decode tokens/s (prefill excluded), ``speedup_vs_pp``, ``L'_acc`` of the spd run, and
``efficiency = speedup_vs_pp / L'_acc`` (1.0: the pipeline delivers the theoretical speedup). With no
emulation the stages run real CPU compute on this machine's cores, shared by all processes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from spd.errors import SpdInputError
from spd.paths import default_testbed_dir


def parse_args(argv=None):
    tb = default_testbed_dir()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=str(tb / "target"))
    p.add_argument("--prompts", default=str(tb / "prompts.jsonl"))
    p.add_argument("--heads", nargs="+", required=True, help="speculation heads (one pipeline per head)")
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--emulate-stage-ms", type=float, default=0.0)
    p.add_argument("--emulate-link-ms", type=float, default=0.0)
    p.add_argument("--early-launch", action="store_true",
                   help="stage 1 starts a proposal before the step that made it is verified (run_pipeline)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--no-ar", action="store_true", help="skip the single-process ar reference")
    p.add_argument("--out", default="bench_runtime.json")
    return p.parse_args(argv)


def run_world(args, head: str, n: int, out: Path) -> dict:
    """One torchrun world: spd then pp on the same prompts; returns run_pipeline's JSON report."""
    from spd.runtime import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n + 1), "--master-port",
           str(free_port()), "-m", "infer.run_pipeline", "--target", args.target, "--speculator", head,
           "--mode", "spd", "pp", "--prompts", args.prompts, "--num-prompts", str(args.num_prompts),
           "--max-new-tokens", str(args.max_new_tokens), "--emulate-stage-ms", str(args.emulate_stage_ms),
           "--emulate-link-ms", str(args.emulate_link_ms), "--threads", str(args.threads),
           "--timeout-s", str(args.timeout_s), "--out", str(out)] + (["--early-launch"] if args.early_launch else [])
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        raise SpdInputError(errors[0][7:] if errors else f"the runtime failed (exit {proc.returncode})")
    return json.loads(out.read_text())


def run_ar(args, n: int) -> dict:
    """Single-process autoregressive decoding with n x stage time of emulated compute per token."""
    import torch

    from spd.generation import generate_ar
    from spd.staging import StagedModel, load_tokenizer

    torch.set_num_threads(args.threads)
    tok = load_tokenizer(args.target)
    staged = StagedModel.from_pretrained(args.target, n_stages=1)
    texts = [json.loads(line)["prompt"] for line in open(args.prompts, encoding="utf-8") if line.strip()]
    delay = n * args.emulate_stage_ms / 1000

    def emulate(_token: int, _accepted: bool) -> None:
        if delay:
            time.sleep(delay)

    decode, decode_time = 0, 0.0
    for text in texts[: args.num_prompts]:
        out = generate_ar(staged, tok(text)["input_ids"], args.max_new_tokens, eos_token_id=tok.eos_token_id,
                          on_token=emulate)
        decode += out.stats.new_tokens - 1
        # The first token comes from the prefill; its emulated time belongs to the prefill too.
        decode_time += out.stats.wall_time_s - out.stats.prefill_time_s - delay
    return {"decode_tokens": decode, "decode_tokens_per_s": decode / decode_time if decode_time > 0 else None}


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        from spd.speculator import load_speculator_config

        rows = []
        with tempfile.TemporaryDirectory() as tmp:
            for i, head in enumerate(args.heads):
                n = load_speculator_config(head).n_stages
                report = run_world(args, head, n, Path(tmp) / f"world{i}.json")
                spd, pp = report["summary"]["spd"], report["summary"]["pp"]
                ar = None if args.no_ar else run_ar(args, n)
                speedup = spd["decode_tokens_per_s"] / pp["decode_tokens_per_s"]
                rows.append({
                    "head": head, "stages": n, "spd": spd, "pp": pp, "ar": ar,
                    "speedup_vs_pp": speedup, "L_acc": spd["L_acc"], "efficiency": speedup / spd["L_acc"],
                    "speedup_vs_ar": spd["decode_tokens_per_s"] / ar["decode_tokens_per_s"] if ar else None,
                    "identical_tokens_spd_pp": sum(a["token_ids"] == b["token_ids"] for a, b in
                                                   zip(report["results"]["spd"], report["results"]["pp"])),
                })
    except SpdInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    launch = "early" if args.early_launch else "after verification"
    print(f"emulated stage time {args.emulate_stage_ms:g} ms, link {args.emulate_link_ms:g} ms, "
          f"{args.num_prompts} prompts x {args.max_new_tokens} new tokens, proposals launched {launch}")
    print("| n | head | spd tok/s | pp tok/s | ar tok/s | speedup vs pp | L'_acc | efficiency | spd == pp tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ar = f"{r['ar']['decode_tokens_per_s']:.2f}" if r["ar"] else "-"
        print(f"| {r['stages']} | {r['head']} | {r['spd']['decode_tokens_per_s']:.2f} | "
              f"{r['pp']['decode_tokens_per_s']:.2f} | {ar} | {r['speedup_vs_pp']:.3f} | {r['L_acc']:.3f} | "
              f"{r['efficiency']:.3f} | {r['identical_tokens_spd_pp']}/{args.num_prompts} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "emulate_stage_ms": args.emulate_stage_ms,
                                          "emulate_link_ms": args.emulate_link_ms, "launch": launch,
                                          "rows": rows}, indent=1) + "\n")
    print(f"\nJSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
