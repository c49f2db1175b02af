"""Measure the decode step on a GPU at real sizes: where a step's time goes, and tree attention at long context.

    spd-bench gpu --out gpu.json                         # a Qwen3-4B-shaped target, bf16, on cuda
    spd-bench gpu --size tiny --device cpu --out t.json  # the same code on a small model (a check)
    spd-bench gpu --target smollm2/target --speculator runs/smollm2-n4/final --parts decode \
        --prompt "Write a Python function that reverses a string." --out smollm2_gpu.json   # a real target

The target is a Qwen3-4B-shaped model (the real transformers class: 36 layers, hidden 2560, 32 query and 8 KV
heads of 128, MLP 9728, vocabulary 151,936, tied embeddings) with random bf16 weights, built on the device. Two
parts:

- ``decode``: ``ar``, ``pp`` and ``spd`` in one process, cut into each ``--stages`` n, from a prompt of
  ``--prompt-tokens`` random tokens. Every stage call, the verification LM head and the head's proposals are timed
  (the device synchronised before and after each), and the rest of the step is the engine's own work
  (verification, bookkeeping, Python). Decode-only figures: a run of ``--new-tokens`` minus a run of one token.
  The head is untrained (random), so nearly every proposal is rejected: the step costs are what this measures,
  not acceptance.
  With ``--target DIR`` and ``--speculator HEAD ...`` the target is a real model (loaded in ``--dtype``) and each
  trained head gives the cut (its n and boundaries) and the proposals; ``--prompt`` is its prompt, rendered with
  the target's chat template where it has one. Then the accepted tokens count: tokens/s and steps per token are
  the real ones, and ``L'_acc`` (n / steps per token) is printed beside them.
- ``tree``: one stage (36 / n layers) over a cache of C committed tokens, with T tree nodes (a random tree of
  that size under the ancestor mask) against T tokens of a plain chain, and the attention operation alone
  (``scaled_dot_product_attention`` with the boolean mask) at the same shapes.

Prints tables and writes JSON (``--out``).
"""

from __future__ import annotations

import platform
import sys
import time

import torch

from spd.bench.report import argument_parser, sync, write_result
from spd.decoding.engine import Engine
from spd.decoding.generation import generate_ar
from spd.decoding.sampling import SamplingParams
from spd.target import sdpa
from spd.target.cut import balanced_boundaries
from spd.target.staging import StagedModel
from spd.training.distill import DistillConfig, new_head

SIZES = {
    # Qwen3-4B's shape (its config.json), random weights.
    "4b": dict(
        vocab_size=151936,
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
    # The same structure, small enough for a CPU (checks the script).
    "tiny": dict(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=True,
    ),
}


def parse_args(argv=None):
    p = argument_parser("gpu", __doc__)
    p.add_argument("--size", choices=list(SIZES), default="4b")
    p.add_argument("--target", default=None, help="a real target (model directory) instead of the random --size one")
    p.add_argument(
        "--speculator",
        nargs="+",
        default=None,
        help="trained heads for --target, one per cut (each gives its n and boundaries)",
    )
    p.add_argument(
        "--prompt",
        default="Write a Python function that reverses a string.",
        help="the prompt for --target (chat-rendered when its tokenizer has a chat template)",
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--stages", type=int, nargs="+", default=[4, 8])
    p.add_argument("--parts", nargs="+", choices=["decode", "tree"], default=["decode", "tree"])
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192])
    p.add_argument("--nodes", type=int, nargs="+", default=[16, 64])
    p.add_argument("--repeats", type=int, default=20, help="timed calls per tree-attention shape")
    p.add_argument(
        "--cudnn-attention",
        action="store_true",
        help="let PyTorch pick cuDNN's attention kernel too (spd.target.sdpa; the baseline of its choice)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="also print torch.profiler's top operations of a few ar, pp and spd steps at the first n",
    )
    p.add_argument("--out", default="bench_gpu.json")
    args = p.parse_args(argv)
    if (args.target is None) != (args.speculator is None):
        p.error("--target and --speculator go together: a real target needs its trained heads")
    if args.target is not None and "tree" in args.parts:
        p.error("--target measures the decode part only; add --parts decode")
    return args


def build_target(size: str, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        **SIZES[size],
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def load_real(args, device: str, dtype: torch.dtype):
    """The model of ``--target`` on the device, and ``--prompt`` as its token ids (chat-rendered if it can be)."""
    from spd.target.loading import load_causal_lm
    from spd.target.tokenizer import load_tokenizer

    model = load_causal_lm(args.target, dtype=dtype, device=device)
    tokenizer = load_tokenizer(args.target)
    text = args.prompt
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
    return model, tokenizer(text, add_special_tokens=False)["input_ids"]


def cuts(model, args, device) -> list[tuple[StagedModel, object]]:
    """``(staged target, head)`` per measured cut: each trained head with its own cut, or the random target cut
    into each ``--stages`` n with an untrained head."""
    if args.speculator is None:
        return [(staged := cut(model, n), new_head(staged, DistillConfig(n_stages=n)).eval()) for n in args.stages]
    from spd.decoding.loader import load_parts, resolve_cut
    from spd.decoding.spec import DecodingSpec

    pairs = []
    for path in args.speculator:
        dtype = str(model.dtype).removeprefix("torch.")
        spec = DecodingSpec("spd", target=args.target, speculator=path, dtype=dtype, device=str(device))
        head_cut = resolve_cut(spec)  # the head's own cut, checked against the target
        parts = load_parts(spec, None, head_cut, head_cut.over(model))
        pairs.append((parts.staged, parts.head))
    return pairs


def cut(model, n: int) -> StagedModel:
    """The target in ``n`` stages: equal ones where n divides the layers, else the most even (the first get one
    more layer; spd.target.cut.balanced_boundaries)."""
    return StagedModel(model, boundaries=balanced_boundaries(model.config.num_hidden_layers, n))


class Timers:
    """Wall time of named calls, the device synchronised before and after each."""

    def __init__(self, device: torch.device):
        self.device, self.seconds = device, {}

    def wrap(self, name_of, fn):
        def timed(*args, **kwargs):
            sync(self.device)
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            sync(self.device)
            name = name_of(args)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            return result

        return timed

    def snapshot(self) -> dict:
        return dict(self.seconds)


def instrument(staged: StagedModel, engine, timers: Timers) -> None:
    staged.run_stage = timers.wrap(lambda a: f"stage {a[0]}", staged.run_stage)
    staged.logits = timers.wrap(lambda a: "target LM head", staged.logits)
    if engine is not None:
        engine.proposer.expand = timers.wrap(lambda a: "head", engine.proposer.expand)


def _timed_run(run, timers: Timers, device) -> tuple[float, dict, object]:
    before = timers.snapshot()
    sync(device)
    start = time.perf_counter()
    out = run()
    sync(device)
    seconds = time.perf_counter() - start
    after = timers.snapshot()
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    return seconds, delta, out


def decode_part(model, args, device, prompt: list[int] | None = None) -> list[dict]:
    rows = []
    if prompt is None:
        prompt = torch.randint(
            0, model.config.vocab_size, (args.prompt_tokens,), generator=torch.Generator().manual_seed(1)
        ).tolist()
    greedy = SamplingParams()
    for i, (staged, head) in enumerate(cuts(model, args, device)):
        n = staged.n_stages
        engine = Engine.chain(staged, head)
        outputs = {}
        timers = Timers(device)
        instrument(staged, engine, timers)
        runs = {
            "ar": lambda k: generate_ar(staged, prompt, k),  # noqa: B023 - the runs are timed within this iteration
            "pp": lambda k: engine.run(prompt, k, greedy, use_head=False),  # noqa: B023 - the runs are timed within this iteration
            "spd": lambda k: engine.run(prompt, k, greedy),  # noqa: B023 - the runs are timed within this iteration
        }
        for mode, run in runs.items():
            run(4)  # warm-up (kernels, allocator)
            t1, d1, o1 = _timed_run(lambda: run(1), timers, device)  # noqa: B023 - timed within this iteration
            tn, dn, on = _timed_run(lambda: run(args.new_tokens), timers, device)  # noqa: B023 - timed within this iteration
            tokens = len(on.token_ids) - len(o1.token_ids)
            steps = (on.stats.steps - o1.stats.steps) if mode != "ar" else tokens
            seconds = tn - t1
            parts = {k: (dn.get(k, 0.0) - d1.get(k, 0.0)) for k in set(dn) | set(d1)}
            stage_s = sum(v for k, v in parts.items() if k.startswith("stage "))
            per_stage = [parts.get(f"stage {s}", 0.0) / steps * 1e3 for s in range(n)]
            head_s, lm_s = parts.get("head", 0.0), parts.get("target LM head", 0.0)
            other_s = seconds - stage_s - head_s - lm_s
            row = {
                "n": n,
                "mode": mode,
                "decode_tokens": tokens,
                "steps": steps,
                "seconds": seconds,
                "tokens_per_s": tokens / seconds,
                "step_ms": seconds / steps * 1e3,
                "stage_ms_per_step": per_stage,
                "all_stages_ms_per_step": stage_s / steps * 1e3,
                "max_stage_ms_per_step": max(per_stage),
                "head_ms_per_step": head_s / steps * 1e3,
                "lm_head_ms_per_step": lm_s / steps * 1e3,
                "engine_ms_per_step": other_s / steps * 1e3,
                "accepted": getattr(on.stats, "accepted", None),
            }
            if mode != "ar":
                # Rank 0's own work per step against one stage's compute (a deployment's critical path).
                row["engine_over_stage"] = (other_s + lm_s) / steps * 1e3 / row["max_stage_ms_per_step"]
                row["l_acc"] = n * tokens / steps  # n / (steps per token): 1 for pp, above 1 where proposals hit
            outputs[mode] = list(on.token_ids)
            row["tokens_equal_ar"] = outputs[mode] == outputs["ar"]  # greedy: expected True (bf16: up to near-ties)
            rows.append(row)
            l_acc = f" L'_acc {row['l_acc']:.2f}" if "l_acc" in row else ""
            print(
                f"n={n} {mode:<3} {row['tokens_per_s']:8.1f} tok/s{l_acc}  step {row['step_ms']:7.3f} ms = stages "
                f"{row['all_stages_ms_per_step']:7.3f} (max one {row['max_stage_ms_per_step']:6.3f}) + LM head "
                f"{row['lm_head_ms_per_step']:6.3f} + head {row['head_ms_per_step']:6.3f} + engine "
                f"{row['engine_ms_per_step']:6.3f}; per stage " + " ".join(f"{x:.2f}" for x in per_stage),
                flush=True,
            )
        if args.profile and i == 0:
            profile(runs)
    return rows


def profile(runs: dict) -> None:
    """torch.profiler's top operations (own CPU time and device time) over a few steps of each mode."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    for mode, run in runs.items():
        with torch_profile(activities=activities) as prof:
            run(6)
        print(f"--- profile: {mode}, 6 tokens")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
        if torch.cuda.is_available():
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=10, max_name_column_width=60))


def median_ms(call, repeats: int, device, after=None) -> float:
    """The median wall time of ``repeats`` calls after 3 warm-ups, in ms (``after()`` undoes each call untimed)."""
    seconds = []
    for i in range(repeats + 3):
        sync(device)
        start = time.perf_counter()
        call()
        sync(device)
        if i >= 3:
            seconds.append(time.perf_counter() - start)
        if after is not None:
            after()
    return sorted(seconds)[len(seconds) // 2] * 1e3


def _random_tree_mask(t: int, gen: torch.Generator) -> torch.Tensor:
    """The ancestor mask (self included) of a random tree of ``t`` nodes in BFS order (node 0 the root)."""
    mask = torch.eye(t, dtype=torch.bool)
    for i in range(1, t):
        parent = int(torch.randint(0, i, (), generator=gen))
        mask[i] = mask[parent]
        mask[i, i] = True
    return mask


def tree_part(model, args, device) -> list[dict]:
    import torch.nn.functional as F

    rows = []
    gen = torch.Generator().manual_seed(2)
    cfg = model.config
    for n in args.stages:
        staged = cut(model, n)
        layers = len(staged.stage_layers(0))
        for context in args.contexts:
            cache = staged.new_stage_cache(0, 1, context + max(args.nodes))
            prompt_1C = torch.randint(0, cfg.vocab_size, (1, context), generator=gen).to(device)
            staged.run_stage(0, staged.embed(prompt_1C), cache)
            for t in args.nodes:
                hidden_1TD = torch.randn(1, t, cfg.hidden_size, generator=gen).to(device, model.dtype)
                tree_TT = _random_tree_mask(t, gen)
                depth_T = tree_TT.sum(1) - 1
                tree = dict(position_ids_BT=(context + depth_T)[None].to(device), tree_mask_TN=tree_TT)
                timings = {
                    kind: median_ms(
                        lambda call=call: staged.run_stage(0, hidden_1TD, cache, **call),  # noqa: B023 - timed within this iteration
                        args.repeats,
                        device,
                        after=lambda: cache.truncate(context),  # noqa: B023 - timed within this iteration
                    )
                    for kind, call in (("tree", tree), ("chain", {}))
                }
                # The attention operation alone, as the stages run it: T queries over C + T keys under the mask.
                h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
                q = torch.randn(1, h, t, d, device=device, dtype=model.dtype)
                k = torch.randn(1, kv, context + t, d, device=device, dtype=model.dtype)
                v = torch.randn_like(k)
                mask_TK = torch.cat([torch.ones(t, context, dtype=torch.bool), tree_TT], 1).to(device)

                def attention():
                    with sdpa.decode_kernels(device):
                        F.scaled_dot_product_attention(q, k, v, attn_mask=mask_TK, enable_gqa=True)  # noqa: B023 - timed within this iteration

                op_ms = median_ms(attention, args.repeats, device)
                row = {
                    "n": n,
                    "stage_layers": layers,
                    "context": context,
                    "nodes": t,
                    "stage_tree_ms": timings["tree"],
                    "stage_chain_ms": timings["chain"],
                    "sdpa_masked_op_ms": op_ms,
                }
                rows.append(row)
                print(
                    f"n={n} ({layers} layers) C={context:<5} T={t:<3} stage: tree {row['stage_tree_ms']:7.3f} ms, "
                    f"chain {row['stage_chain_ms']:7.3f} ms; masked SDPA op {row['sdpa_masked_op_ms']:.3f} ms",
                    flush=True,
                )
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    sdpa.ALLOW_CUDNN = args.cudnn_attention
    start = time.perf_counter()
    prompt = None
    if args.target is None:
        model, name = build_target(args.size, args.device, dtype), f"Qwen3 {args.size} shape"
    else:
        (model, prompt), name = load_real(args, args.device, dtype), args.target
    params = sum(p.numel() for p in model.parameters())
    print(
        f"target: {name}, {params / 1e9:.2f} B parameters, {args.dtype} on {device} "
        f"(loaded in {time.perf_counter() - start:.1f} s)",
        flush=True,
    )
    results = {
        "target": args.target,
        "speculators": args.speculator,
        "prompt": args.prompt if prompt else None,
        "size": None if prompt else args.size,
        "config": model.config.to_diff_dict() if prompt else SIZES[args.size],
        "parameters": params,
        "dtype": args.dtype,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "prompt_tokens": len(prompt) if prompt else args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "cudnn_attention": args.cudnn_attention,
    }
    for part, run in (
        ("decode", lambda: decode_part(model, args, device, prompt)),
        ("tree", lambda: tree_part(model, args, device)),
    ):
        if part in args.parts:
            with torch.inference_mode():
                results[part] = run()
            write_result(args.out, results)  # each part kept as soon as it ends
    print(f"wrote {args.out}", file=sys.stderr)
    return 0
