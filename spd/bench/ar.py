"""Benchmark the staged AR decoder against Hugging Face ``model.generate`` (greedy), side by side.

    spd-bench ar --target testbed/target --prompts testbed/prompts.jsonl --num-prompts 20

Both decoders run on every prompt in alternating order (so machine noise hits both alike); the table
shows tokens/s of each, the speed ratio, and whether the tokens are identical. JSON goes to --out.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from spd.bench.report import argument_parser, write_result


def parse_args(argv=None):
    from spd.paths import default_testbed_dir

    tb = default_testbed_dir()
    p = argument_parser("ar", __doc__)
    p.add_argument("--target", default=str(tb / "target"))
    p.add_argument("--prompts", default=str(tb / "prompts.jsonl"), help='jsonl with a "prompt" field per row')
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--out", default="bench_ar.json")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import transformers
    from transformers import AutoTokenizer

    from spd.decoding.generation import generate_ar
    from spd.errors import cli_error
    from spd.target.staging import SpdInputError, StagedModel

    transformers.utils.logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts_path = Path(args.prompts)
    if not prompts_path.is_file():
        return cli_error(f"the prompts file '{args.prompts}' does not exist (build the testbed first)")
    prompts = [json.loads(line)["prompt"] for line in prompts_path.open()][: args.num_prompts]
    try:
        staged = StagedModel.from_pretrained(args.target, n_stages=args.stages)
    except SpdInputError as exc:
        return cli_error(exc)
    model = staged.model
    tok = AutoTokenizer.from_pretrained(args.target)
    eos = tok.eos_token_id

    def run_hf(ids):
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=args.max_new_tokens,
                do_sample=False,
                num_beams=1,
                eos_token_id=eos,
                pad_token_id=tok.pad_token_id,
            )
        return out[0, len(ids) :].tolist()

    def run_ar(ids):
        return generate_ar(staged, ids, args.max_new_tokens, eos_token_id=eos).token_ids

    runners = {"generate": run_hf, "spd_ar": run_ar}
    warm = tok(prompts[0])["input_ids"]
    for fn in runners.values():  # one-off initialisation costs stay out of the timings
        fn(warm)

    rows = []
    for i, text in enumerate(prompts):
        ids = tok(text)["input_ids"]
        order = list(runners) if i % 2 == 0 else list(reversed(runners))
        times, tokens = {}, {}
        for name in order:
            t0 = time.perf_counter()
            tokens[name] = runners[name](ids)
            times[name] = time.perf_counter() - t0
        rows.append(
            {
                "prompt": i,
                "prompt_tokens": len(ids),
                "new_tokens": len(tokens["spd_ar"]),
                "generate_s": times["generate"],
                "spd_ar_s": times["spd_ar"],
                "identical": tokens["generate"] == tokens["spd_ar"],
            }
        )

    total = {name: sum(r[f"{name}_s"] for r in rows) for name in runners}
    new_tokens = sum(r["new_tokens"] for r in rows)
    summary = {
        "target": args.target,
        "stages": args.stages,
        "prompts": len(rows),
        "max_new_tokens": args.max_new_tokens,
        "threads": torch.get_num_threads(),
        "new_tokens": new_tokens,
        "generate_tokens_per_s": new_tokens / total["generate"],
        "spd_ar_tokens_per_s": new_tokens / total["spd_ar"],
        "speedup_vs_generate": total["generate"] / total["spd_ar"],
        "median_per_prompt_speedup": statistics.median(r["generate_s"] / r["spd_ar_s"] for r in rows),
        "identical_outputs": sum(r["identical"] for r in rows),
    }
    print(f"{'prompt':>6} {'tokens':>6} {'generate tok/s':>15} {'spd ar tok/s':>13} {'ratio':>6} {'same':>5}")
    for r in rows:
        print(
            f"{r['prompt']:>6} {r['new_tokens']:>6} {r['new_tokens'] / r['generate_s']:>15.1f} "
            f"{r['new_tokens'] / r['spd_ar_s']:>13.1f} {r['generate_s'] / r['spd_ar_s']:>6.2f} "
            f"{'yes' if r['identical'] else 'NO':>5}"
        )
    print(
        f"{'all':>6} {new_tokens:>6} {summary['generate_tokens_per_s']:>15.1f} "
        f"{summary['spd_ar_tokens_per_s']:>13.1f} {summary['speedup_vs_generate']:>6.2f} "
        f"{summary['identical_outputs']}/{len(rows)}"
    )
    write_result(args.out, {"summary": summary, "rows": rows}, indent=2)
    return 0 if summary["identical_outputs"] == len(rows) else 1
