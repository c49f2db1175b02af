"""Benchmark: what rolling back a hybrid stage's linear-attention state costs per token.

One pipeline stage of a Qwen3.5-shaped hybrid target (default: the Qwen3.5-4B text widths, 3 linear-attention
layers + 1 full-attention layer, i.e. 32 layers cut into 8 stages; random weights) decodes tokens one at a time
after a prefill, with three ways of keeping the linear layers' state:

- ``ring``: ours (spd.target.linear_state): a ring of states indexed by length; the new state is written into its own
  slot, a rollback moves an integer;
- ``snapshot``: a live state plus a ring of snapshots copied after every token (docs/method.md §5 read literally);
  a rollback copies a snapshot back;
- ``none``: one live state, no rollback possible (the lower bound).

Every ``--flush-every`` tokens the stage is rolled back by ``--rollback`` tokens (as a pipeline flush does).
The variants run interleaved, round after round, and the table gives the median ms per token of each and its
ratio to ``none``; ``--out`` writes the JSON.

``--tree-widths W ...`` measures token trees instead: the same stage runs tree levels of ``W`` nodes (every node
with its own linear state: docs/method.md, "Hybrid targets"), as in a pipeline of ``--stages`` levels in flight
with a hit every step (prune to the first child of the root, a new level of ``W`` below the surviving path), and
reports per level the stage's time, the part spent gathering and storing node states (the linear-state calls,
timed inside), and the state memory per node and for a full tree of ``n W + 1`` nodes.

    spd-bench linear-state                      # Qwen3.5-4B widths
    spd-bench linear-state --hidden 1024 --rounds 7
    spd-bench linear-state --tree-widths 1 4 8  # per-node state in token trees
"""

from __future__ import annotations

import statistics
import time

import torch

from spd.bench.report import argument_parser, sync, write_result
from spd.target.linear_state import LinearStateRing
from spd.target.staging import StagedModel


class SnapshotRing(LinearStateRing):
    """The alternative: one live state (slot 0) plus snapshots copied out after every token."""

    def __init__(self, layer_ids: list[int], depth: int):
        super().__init__(layer_ids, 1)
        self.snap_depth = depth
        self.snaps: list[tuple[list, list] | None] = [None] * depth
        self.snap_len = [-1] * depth

    def advance(self, n_tokens: int) -> None:
        super().advance(n_tokens)
        i = self.length % self.snap_depth
        conv = [c.clone() for c in self.conv_RBCK]  # the copies a snapshot ring makes every token
        rec = [r.clone() for r in self.recurrent_RBHDkDv]
        self.snaps[i], self.snap_len[i] = (conv, rec), self.length

    def truncate(self, length: int) -> None:
        if length >= self.length:
            return
        i = length % self.snap_depth
        if self.snap_len[i] != length:
            raise RuntimeError("snapshot not held")
        conv, rec = self.snaps[i]
        for live, saved in zip(self.conv_RBCK + self.recurrent_RBHDkDv, conv + rec):
            live.copy_(saved)
        self.length = length
        self._held[0] = length


def build_stage(args) -> StagedModel:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        vocab_size=1024,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=4,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        linear_num_key_heads=args.linear_k_heads,
        linear_num_value_heads=args.linear_v_heads,
        linear_key_head_dim=args.linear_dim,
        linear_value_head_dim=args.linear_dim,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(cfg).to(dtype=getattr(torch, args.dtype), device=args.device).eval()
    return StagedModel(model, 1)


def run_variant(staged: StagedModel, kind: str, args) -> float:
    """ms per decoded token (rollbacks included)."""
    depth = args.stages + 1
    cache = staged.new_stage_cache(0, capacity=args.prompt + args.tokens + 8, ring_depth=depth)
    if kind == "snapshot":
        cache.linear = SnapshotRing(cache.linear.layers, depth)
    elif kind == "none":
        cache.linear = LinearStateRing(cache.linear.layers, 1)
    ids = torch.randint(0, 1024, (1, args.prompt + args.tokens), generator=torch.Generator().manual_seed(1))
    hidden = staged.embed(ids.to(staged.device))
    with torch.inference_mode():
        staged.run_stage(0, hidden[:, : args.prompt], cache)
        sync(staged.device)
        start = time.perf_counter()
        position = args.prompt
        for step in range(args.tokens):
            staged.run_stage(0, hidden[:, position : position + 1], cache)
            position += 1
            if kind != "none" and (step + 1) % args.flush_every == 0:
                staged.truncate([cache], position - args.rollback)
                position -= args.rollback
        sync(staged.device)
    return 1000 * (time.perf_counter() - start) / args.tokens


class TimedRing(LinearStateRing):
    """The ring with the time of its tree-node state work counted (gather into the level's slots, store, prune)."""

    def __init__(self, layer_ids: list[int], depth: int):
        super().__init__(layer_ids, depth)
        self.state_s = 0.0

    def _timed(name):
        def call(self, *args, **kwargs):
            if self._call is None and name != "keep":
                return getattr(LinearStateRing, name)(self, *args, **kwargs)
            start = time.perf_counter()
            out = getattr(LinearStateRing, name)(self, *args, **kwargs)
            if out is not None and hasattr(out, "device"):
                sync(out.device)
            self.state_s += time.perf_counter() - start
            return out

        return call

    get_conv_state = _timed("get_conv_state")
    get_recurrent_state = _timed("get_recurrent_state")
    update_recurrent_state = _timed("update_recurrent_state")
    keep = _timed("keep")


def run_tree(staged: StagedModel, width: int, args) -> tuple[float, float, int]:
    """(ms per tree level, ms of it in node-state work, nodes held at most) for levels of ``width`` nodes."""
    from spd.decoding.tree import TokenTree

    n = args.stages
    cache = staged.new_stage_cache(0, capacity=args.prompt + n * width + 8, ring_depth=n + 1)
    cache.linear = ring = TimedRing(cache.linear.layers, n + 1)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1024, (1, args.prompt), generator=gen)
    committed = args.prompt
    levels = peak = 0
    with torch.inference_mode():
        staged.run_stage(0, staged.embed(ids.to(staged.device)), cache)
        tree = TokenTree(int(torch.randint(0, 1024, (), generator=gen)))
        sync(staged.device)
        start = time.perf_counter()
        for step in range(args.tokens + n):
            if step == n:  # the pipeline is full: count from here
                sync(staged.device)
                start, ring.state_s, levels = time.perf_counter(), 0.0, 0
            if tree.depth >= n - 1:  # the root's level left the last stage: a hit on its first child
                kept = tree.prune_to_child(int(tree.children(0)[0]))
                StagedModel.prune_tree([cache], committed, kept)
                committed += 1
            held = len(tree)
            bottom = tree.bottom_level()
            k = max(1, width // bottom.numel())  # W children in all, spread over the bottom nodes
            tokens = torch.randint(0, 1024, (bottom.numel(), k), generator=gen)
            tree.append_level(tokens, -torch.rand(bottom.numel(), k, generator=gen), width)
            if step == 0:  # the root runs first, alone
                held = 0
            nodes = tree.tokens_N[held:][None].to(staged.device)
            staged.run_stage(
                0,
                staged.embed(nodes),
                cache,
                tree.positions(committed)[held:][None].to(staged.device),
                tree_mask_TN=tree.mask()[held:],
            )
            levels += 1
            peak = max(peak, ring.nodes)
        sync(staged.device)
    return 1000 * (time.perf_counter() - start) / levels, 1000 * ring.state_s / levels, peak


def state_bytes(staged: StagedModel, args) -> int:
    """The bytes of the stage's linear-attention state at one length (one node of a tree)."""
    cache = staged.new_stage_cache(0, capacity=args.prompt + 8, ring_depth=2)
    with torch.inference_mode():
        staged.run_stage(0, staged.embed(torch.zeros(1, 4, dtype=torch.long, device=staged.device)), cache)
    return sum(r[0].numel() * r[0].element_size() for r in cache.linear.conv_RBCK + cache.linear.recurrent_RBHDkDv)


def tree_main(staged: StagedModel, args) -> None:
    times: dict[int, list[tuple[float, float]]] = {w: [] for w in args.tree_widths}
    chain: list[float] = []  # the chain's ms per token on the same stage (the ring, flushes included), alternating
    run_tree(staged, args.tree_widths[-1], args)  # warm-up
    for _ in range(args.rounds):
        chain.append(run_variant(staged, "ring", args))
        for w in args.tree_widths:
            times[w].append(run_tree(staged, w, args)[:2])
    per_node = state_bytes(staged, args)
    rows = []
    chain_ms = statistics.median(chain)
    print(f"chain (one token a step, the ring): {chain_ms:.2f} ms per token")
    print(
        f"{'W':>3} {'ms/level':>9} {'vs chain':>9} {'node state ms':>14} {'share':>6} {'state/node MiB':>15} "
        f"{'full tree (n W + 1 nodes) MiB':>30}"
    )
    for w, v in times.items():
        level = statistics.median(t for t, _ in v)
        state = statistics.median(s for _, s in v)
        full = per_node * (args.stages * w + 1)
        rows.append(
            {
                "width": w,
                "ms_per_level_median": round(level, 3),
                "min": round(min(t for t, _ in v), 3),
                "max": round(max(t for t, _ in v), 3),
                "node_state_ms_median": round(state, 3),
                "node_state_share": round(state / level, 4),
                "ratio_to_chain_token": round(level / chain_ms, 3),
                "state_bytes_per_node": per_node,
                "state_bytes_full_tree": full,
            }
        )
        print(
            f"{w:>3} {level:>9.2f} {level / chain_ms:>9.2f} {state:>14.3f} {state / level:>6.1%} "
            f"{per_node / 2**20:>15.2f} {full / 2**20:>30.1f}"
        )
    if args.out:
        write_result(
            args.out,
            {
                "args": vars(args),
                "chain_ms_per_token_median": round(chain_ms, 3),
                "chain_ms": chain,
                "tree_rows": rows,
                "device": str(staged.device),
            },
            indent=2,
        )


def main(argv=None) -> int:
    p = argument_parser("linear-state", __doc__)
    p.add_argument("--hidden", type=int, default=2560)
    p.add_argument("--intermediate", type=int, default=9216)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--linear-k-heads", type=int, default=16)
    p.add_argument("--linear-v-heads", type=int, default=32)
    p.add_argument("--linear-dim", type=int, default=128)
    p.add_argument("--stages", type=int, default=8, help="n: the ring keeps n + 1 states")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--flush-every", type=int, default=4)
    p.add_argument("--rollback", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--tree-widths",
        type=int,
        nargs="+",
        default=None,
        help="measure token-tree levels of these widths instead (per-node linear state)",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    staged = build_stage(args)
    if args.tree_widths:
        tree_main(staged, args)
        return 0
    kinds = ("none", "ring", "snapshot")
    times: dict[str, list[float]] = {k: [] for k in kinds}
    run_variant(staged, "ring", args)  # warm-up
    for _ in range(args.rounds):
        for kind in kinds:
            times[kind].append(run_variant(staged, kind, args))
    per_slot = state_bytes(staged, args)
    ring_bytes = per_slot * (args.stages + 1)
    base = statistics.median(times["none"])
    rows = [
        {
            "variant": k,
            "ms_per_token_median": round(statistics.median(v), 3),
            "min": round(min(v), 3),
            "max": round(max(v), 3),
            "ratio_to_none": round(statistics.median(v) / base, 4),
        }
        for k, v in times.items()
    ]
    print(f"{'variant':<10} {'ms/token (median)':>18} {'min':>8} {'max':>8} {'vs none':>8}")
    for r in rows:
        print(
            f"{r['variant']:<10} {r['ms_per_token_median']:>18.3f} {r['min']:>8.3f} {r['max']:>8.3f} "
            f"{r['ratio_to_none']:>8.4f}"
        )
    print(
        f"linear state per stage: {per_slot / 2**20:.2f} MiB per length; ring of {args.stages + 1}: "
        f"{ring_bytes / 2**20:.1f} MiB"
    )
    if args.out:
        write_result(
            args.out,
            {
                "args": vars(args),
                "rows": rows,
                "state_bytes_per_length": per_slot,
                "ring_bytes": ring_bytes,
                "device": str(staged.device),
            },
            indent=2,
        )
    return 0
