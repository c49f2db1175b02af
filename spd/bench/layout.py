"""Training-layout benchmark: the efficient path vs the dense (n+1)x reference, forward + backward of the head.

    spd-bench layout --threads 1 --out docs/results/bench_layout.json  # testbed size
    spd-bench layout --hidden 2048 --heads 16 --seq-lens 2048 --stages 8 --iters 2 \\
        --threads 1 --out docs/results/bench_layout_d2048.json         # a real target's size

Defaults are the testbed's dimensions (D=128, 4 heads, L_s=1, 8 target layers). For every sequence length
and n, each path runs in two fresh processes on the same random anchor states (fill a = n):
- time: a warm-up step, then ``--iters`` timed steps (tokens/s);
- memory: the peak over the process's own memory just before a step (model, anchor states and
  everything else the process holds already are excluded), for the first step (parameter gradients
  are allocated inside it, as in training that sets gradients to None) and for a second step whose
  parameter gradients exist already (activations and temporaries only). On CPU the peak is the
  kernel's high-water mark of resident memory (VmHWM, reset through /proc/self/clear_refs before each
  step) and glibc is told to return freed blocks (MALLOC_MMAP_THRESHOLD_), so that memory freed earlier
  is not silently reused; on a GPU it is CUDA's max_memory_allocated.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

from spd.bench.report import argument_parser, bench_command, sync, write_result


def parse_args(argv=None):
    p = argument_parser("layout", __doc__)
    p.add_argument("--seq-lens", default="512,1024,2048")
    p.add_argument("--stages", default="4,8")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=1, help="L_s")
    p.add_argument("--target-layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="bench_layout.json")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: "path,n,seq_len,time|memory" in this process
    return p.parse_args(argv)


def _proc_status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"no {field} in /proc/self/status")


class _PeakMemory:
    """Peak memory of one step over what the process held just before it (MB)."""

    def __init__(self, dev: torch.device):
        self.dev = dev

    def start(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current resident size
            self.base = _proc_status_mb("VmRSS")

    def stop(self) -> float:
        if self.dev.type == "cuda":
            torch.cuda.synchronize()
            return (torch.cuda.max_memory_allocated() - self.base) / 2**20
        return _proc_status_mb("VmHWM") - self.base


def measure_one(args, path: str, n: int, seq_len: int, what: str) -> dict:
    from spd.heads.config import SpeculatorConfig
    from spd.heads.speculator import Speculator

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dev = torch.device(args.device)
    cfg = SpeculatorConfig(
        hidden_size=args.hidden,
        vocab_size=64,
        n_stages=n,
        target_num_layers=args.target_layers,
        num_layers=args.layers,
        num_attention_heads=args.heads,
    )
    head = Speculator(cfg).to(dev)
    hidden = {a: torch.randn(args.batch, seq_len, args.hidden, device=dev) for a in range(args.target_layers + 1)}
    fill = torch.full((args.batch,), n, dtype=torch.long, device=dev)
    forward = head.forward_train if path == "efficient" else head.forward_dense

    def step():
        out = forward(hidden, fill)
        out.float().pow(2).mean().backward()

    if what == "memory":
        peak = _PeakMemory(dev)
        peak.start()
        step()
        first = peak.stop()
        head.zero_grad(set_to_none=False)  # the gradients stay allocated
        peak.start()
        step()
        return {
            "peak_mem_mb": first,
            "activation_peak_mb": peak.stop(),
            "param_grad_mb": sum(
                p.grad.numel() * p.grad.element_size() for p in head.parameters() if p.grad is not None
            )
            / 2**20,
        }
    step()  # warm-up (allocator, kernels)
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(args.iters):
        step()
    sync(dev)
    elapsed = (time.perf_counter() - t0) / args.iters
    return {"step_s": elapsed, "tokens_per_s": args.batch * seq_len / elapsed}


def _run_child(args, passthrough: list[str], spec: str, env: dict) -> dict:
    proc = subprocess.run(
        [*bench_command("layout"), "--one", spec, *passthrough], capture_output=True, text=True, env=env
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{spec} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.one:
        path, n, seq_len, what = args.one.split(",")
        print(json.dumps(measure_one(args, path, int(n), int(seq_len), what)))
        return 0
    rows = []
    passthrough = [
        "--hidden",
        str(args.hidden),
        "--heads",
        str(args.heads),
        "--layers",
        str(args.layers),
        "--target-layers",
        str(args.target_layers),
        "--batch",
        str(args.batch),
        "--iters",
        str(args.iters),
        "--device",
        args.device,
    ] + (["--threads", str(args.threads)] if args.threads else [])
    # Freed blocks go back to the system at once, so that the resident high-water mark is the peak of
    # live memory (glibc would otherwise keep blocks up to 32 MB and reuse them unseen). Memory runs only:
    # it costs time.
    memory_env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    for n in (int(x) for x in args.stages.split(",")):
        for seq_len in (int(x) for x in args.seq_lens.split(",")):
            pair = {}
            for path in ("efficient", "dense"):
                try:
                    pair[path] = {
                        **_run_child(args, passthrough, f"{path},{n},{seq_len},time", dict(os.environ)),
                        **_run_child(args, passthrough, f"{path},{n},{seq_len},memory", memory_env),
                    }
                except RuntimeError as exc:
                    print(f"error: n={n} N={seq_len}: {exc}", file=sys.stderr)
                    return 1
            eff, dense = pair["efficient"], pair["dense"]
            rows.append(
                {
                    "n": n,
                    "seq_len": seq_len,
                    **{
                        f"{p}_{k}": v[k]
                        for p, v in pair.items()
                        for k in ("tokens_per_s", "step_s", "peak_mem_mb", "activation_peak_mb")
                    },
                    "param_grad_mb": eff["param_grad_mb"],
                    "speedup": dense["step_s"] / eff["step_s"],
                    "memory_ratio": dense["peak_mem_mb"] / max(eff["peak_mem_mb"], 1e-9),
                    "activation_memory_ratio": dense["activation_peak_mb"] / max(eff["activation_peak_mb"], 1e-9),
                }
            )
            r = rows[-1]
            print(
                f"n={n:<2} N={seq_len:<5} efficient {r['efficient_tokens_per_s']:>9.1f} tok/s "
                f"{r['efficient_peak_mem_mb']:>7.0f} MB ({r['efficient_activation_peak_mb']:.0f}) | "
                f"dense {r['dense_tokens_per_s']:>9.1f} tok/s {r['dense_peak_mem_mb']:>7.0f} MB "
                f"({r['dense_activation_peak_mb']:.0f}) | speedup {r['speedup']:.2f}x, memory "
                f"{r['memory_ratio']:.2f}x ({r['activation_memory_ratio']:.2f}x); parameter gradients "
                f"{r['param_grad_mb']:.0f} MB",
                flush=True,
            )
    settings = {k: v for k, v in vars(args).items() if k != "one"}
    settings["torch_threads"] = args.threads or torch.get_num_threads()
    write_result(
        args.out, {"device": args.device, "torch": torch.__version__, "settings": settings, "rows": rows}, indent=2
    )
    return 0
