"""Training-layout benchmark: the efficient path vs the dense (n+1)x reference, forward + backward of the head.

    python train/bench_layout.py --out docs/results/bench_layout.json

For every sequence length and n, both paths run in fresh processes (so that peak memory is theirs
alone) on the same random anchor states with the testbed's dimensions (D=128, 4 heads, L_s=1) unless
told otherwise. Peak memory is CUDA's max_memory_allocated on a GPU, else the growth of the process's
peak RSS during the first step. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", default="512,1024,2048")
    p.add_argument("--stages", default="4,8")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=1, help="L_s")
    p.add_argument("--target-layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="bench_layout.json")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: "path,n,seq_len" measured in this process
    return p.parse_args(argv)


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def measure_one(args, path: str, n: int, seq_len: int) -> dict:
    from spd.speculator import Speculator, SpeculatorConfig

    torch.manual_seed(0)
    dev = torch.device(args.device)
    cfg = SpeculatorConfig(hidden_size=args.hidden, vocab_size=64, n_stages=n, target_num_layers=args.target_layers,
                           num_layers=args.layers, num_attention_heads=args.heads)
    head = Speculator(cfg).to(dev)
    hidden = {a: torch.randn(args.batch, seq_len, args.hidden, device=dev) for a in range(args.target_layers + 1)}
    fill = torch.full((args.batch,), n, dtype=torch.long, device=dev)
    forward = head.forward_train if path == "efficient" else head.forward_dense

    def step():
        out = forward(hidden, fill)
        out.float().pow(2).mean().backward()

    # Memory: the high-water mark of the first step over what was held before it (the allocator keeps
    # freed memory, so later steps would not raise the process's peak again).
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    rss_before = _rss_mb()
    step()  # also the warm-up (allocator, kernels) for the timed steps
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.iters):
        step()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    elapsed = (time.perf_counter() - t0) / args.iters
    peak_mb = ((torch.cuda.max_memory_allocated() - base) / 2**20 if dev.type == "cuda"
               else _rss_mb() - rss_before)
    return {"path": path, "n": n, "seq_len": seq_len, "step_s": elapsed,
            "tokens_per_s": args.batch * seq_len / elapsed, "peak_mem_mb": peak_mb}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.one:
        path, n, seq_len = args.one.split(",")
        print(json.dumps(measure_one(args, path, int(n), int(seq_len))))
        return 0
    rows = []
    passthrough = ["--hidden", str(args.hidden), "--heads", str(args.heads), "--layers", str(args.layers),
                   "--target-layers", str(args.target_layers), "--batch", str(args.batch), "--iters", str(args.iters),
                   "--device", args.device]
    for n in (int(x) for x in args.stages.split(",")):
        for seq_len in (int(x) for x in args.seq_lens.split(",")):
            pair = {}
            for path in ("efficient", "dense"):
                proc = subprocess.run([sys.executable, __file__, "--one", f"{path},{n},{seq_len}", *passthrough],
                                      capture_output=True, text=True)
                if proc.returncode != 0:
                    print(f"error: {path} n={n} N={seq_len} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
                    return 1
                pair[path] = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append({"n": n, "seq_len": seq_len, **{f"{p}_{k}": v[k] for p, v in pair.items()
                                                        for k in ("tokens_per_s", "peak_mem_mb", "step_s")},
                         "speedup": pair["dense"]["step_s"] / pair["efficient"]["step_s"],
                         "memory_ratio": pair["dense"]["peak_mem_mb"] / max(pair["efficient"]["peak_mem_mb"], 1e-9)})
            r = rows[-1]
            print(f"n={n:<2} N={seq_len:<5} efficient {r['efficient_tokens_per_s']:>9.0f} tok/s {r['efficient_peak_mem_mb']:>8.0f} MB | "
                  f"dense {r['dense_tokens_per_s']:>9.0f} tok/s {r['dense_peak_mem_mb']:>8.0f} MB | "
                  f"speedup {r['speedup']:.2f}x, memory {r['memory_ratio']:.1f}x", flush=True)
    Path(args.out).write_text(json.dumps({"device": args.device, "settings": {k: v for k, v in vars(args).items()
                                                                              if k != "one"}, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
