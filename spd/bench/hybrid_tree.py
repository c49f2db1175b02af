"""Benchmark: token tree vs chain on a tiny hybrid target (L'_acc, lossless check), with SPD heads trained here.

The target is the tiny Qwen3.5 of the authors'-code fixtures (``tests/fixtures/authors/targets/qwen35``: 8 layers,
3 linear-attention (Gated DeltaNet) layers per full-attention layer, hidden 64, vocabulary 512, large embeddings so
that the next token depends mostly on the current one: an easily learnt, partly context-dependent target). Its
training data are its own greedy continuations of random 8-token prefixes (as the fixtures' heads were trained);
held-out prompts are further continuations. For each ``n`` an SPD head (L_s = 1, the SPD variant, input-state
schedule) is distilled in this process for ``--steps`` steps, then every held-out prompt is decoded with the chain
(``--mode spd``) and with token trees of width W (K = 4 children per node) from the same head, greedy and at T = 1;
the table gives L'_acc = n N / K (the theoretical speedup) per run, and whether every greedy output equals ``ar``.

``--authors``: instead, every head of the authors'-code fixtures (``tests/fixtures/authors``: v10 and v11, Qwen3 /
Qwen3.5 / MoE targets, n = 4 and 8) as the token source of the chain (their schedule, ``--mode spd``) and of our
tree at W = 1 and W = 4 (K = 4), on the fixtures' prompts (greedy continuations of the target), T = 0 and 1.

    spd-bench hybrid-tree --out docs/results/hybrid-tree-vs-chain.json
    spd-bench hybrid-tree --authors --out docs/results/authors-heads-tree.json
    spd-bench hybrid-tree --target qwen3 --out docs/results/dense-tree-vs-chain.json   # the dense twin
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from spd.bench.report import REPO, argument_parser, write_result
from spd.decoding.engine import Engine
from spd.decoding.generation import generate_ar
from spd.decoding.proposers import SpdHeadProposer
from spd.decoding.sampling import SamplingParams
from spd.target.staging import StagedModel
from spd.training.distill import DistillConfig, distill_step, new_head, teacher_anchors
from spd.training.kd import sample_fills

TARGETS = REPO / "tests" / "fixtures" / "authors" / "targets"


def greedy_continue(staged: StagedModel, prefix_BT: torch.Tensor, new: int) -> torch.Tensor:
    """Greedy continuations (the target's own text), batched."""
    out = prefix_BT
    with torch.no_grad():
        for _ in range(new):
            logits = staged.model(out).logits[:, -1]
            out = torch.cat([out, logits.argmax(-1, keepdim=True)], dim=1)
    return out


def train_head(staged: StagedModel, n: int, data_BT: torch.Tensor, steps: int, seed: int):
    torch.manual_seed(seed)
    head = new_head(staged, DistillConfig(n_stages=n, num_layers=1))
    head.train()
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.0)
    anchors = teacher_anchors(head, staged)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, data_BT.shape[0], (8,), generator=gen)
        ids = data_BT[idx]
        batch = {
            "input_ids": ids,
            "valid": torch.ones_like(ids, dtype=torch.bool),
            "supervised": torch.ones_like(ids, dtype=torch.bool),
        }
        with torch.no_grad():
            hidden = staged.hidden_states(ids, anchors)
        loss, _ = distill_step(head, staged, hidden, batch, sample_fills(8, n, gen), 1.0, 512)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
    head.eval()
    return head, sum(losses[-20:]) / 20


def authors_main(args) -> None:
    from spd.decoding.proposers import HeadProposer
    from spd.heads.published.authors_head import load_authors_head

    fixtures = TARGETS.parent
    expected = json.loads((fixtures / "expected.json").read_text())
    rows = []
    for name, info in sorted(expected["heads"].items()):
        target = expected["targets"][info["target"]]
        staged = StagedModel.from_pretrained(
            fixtures / target["path"], n_stages=info["num_stages"], dtype=torch.float32
        )
        head = load_authors_head(str(fixtures / info["path"]), staged)
        runs = [r for r in expected["generate"] if r["head"] == name and r["use_deepest_arg"] is None]
        engines = [("chain", Engine.chain(staged, head))]
        engines += [(f"tree W = {w}", Engine.tree(staged, HeadProposer(head, staged, 4), w)) for w in args.widths]
        for temperature in (0.0, 1.0):
            for run, engine in engines:
                l_acc, same = [], 0
                for i, rec in enumerate(runs):
                    sampling = SamplingParams(temperature=temperature, seed=i if temperature else None)
                    out = engine.run(
                        rec["prompt_ids"], rec["max_new_tokens"], sampling, eos_token_id=target["eos_token_id"]
                    )
                    l_acc.append(out.stats.equivalent_accept_length)
                    same += out.token_ids == rec["target_greedy_ids"]
                row = {
                    "head": name,
                    "target": info["target"],
                    "n": info["num_stages"],
                    "T": temperature,
                    "run": run,
                    "prompts": len(runs),
                    "l_acc_mean": round(statistics.mean(l_acc), 3),
                    "identical_to_target_greedy": same if not temperature else None,
                }
                rows.append(row)
                print(
                    f"{name:<26} T = {temperature:g} {run:<11} L'_acc {row['l_acc_mean']:.2f}"
                    + (f", identical {same}/{len(runs)}" if not temperature else "")
                )
    if args.out:
        write_result(args.out, {"args": vars(args), "rows": rows}, indent=2)


def main(argv=None) -> int:
    p = argument_parser("hybrid-tree", __doc__)
    p.add_argument("--stages", type=int, nargs="+", default=[4, 8])
    p.add_argument("--widths", type=int, nargs="+", default=[1, 4])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", default="qwen35", help="a fixture target: qwen35 (hybrid) or qwen3 (its dense twin)")
    p.add_argument("--out", default=None)
    p.add_argument("--authors", action="store_true", help="the authors' fixture heads as tree sources (see above)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.authors:
        authors_main(args)
        return 0
    model = StagedModel.from_pretrained(TARGETS / args.target, n_stages=1, dtype=torch.float32).model
    gen = torch.Generator().manual_seed(args.seed)
    vocab = model.config.vocab_size
    data = greedy_continue(StagedModel(model, 1), torch.randint(2, vocab, (96, 8), generator=gen), 56)
    prompts = greedy_continue(StagedModel(model, 1), torch.randint(2, vocab, (args.prompts, 8), generator=gen), 16)
    rows = []
    for n in args.stages:
        staged = StagedModel(model, n)
        tick = time.perf_counter()
        head, loss = train_head(staged, n, data, args.steps, args.seed + n)
        print(f"n = {n}: head trained, {args.steps} steps in {time.perf_counter() - tick:.0f} s, final loss {loss:.3f}")
        engines = [("chain", Engine.chain(staged, head))]
        engines += [(f"tree W = {w}", Engine.tree(staged, SpdHeadProposer(head, staged, 4), w)) for w in args.widths]
        for temperature in (0.0, 1.0):
            for name, engine in engines:
                l_acc, same, steps = [], 0, 0
                for i, prompt in enumerate(prompts.tolist()):
                    sampling = SamplingParams(temperature=temperature, seed=i if temperature else None)
                    out = engine.run(prompt, args.max_new_tokens, sampling)
                    l_acc.append(out.stats.equivalent_accept_length)
                    steps += out.stats.steps
                    if not temperature:
                        same += out.token_ids == generate_ar(staged, prompt, args.max_new_tokens).token_ids
                row = {
                    "n": n,
                    "T": temperature,
                    "run": name,
                    "prompts": len(prompts),
                    "l_acc_mean": round(statistics.mean(l_acc), 3),
                    "alpha": round(statistics.mean(l_acc) / n, 3),
                    "steps": steps,
                    "identical_to_ar": same if not temperature else None,
                }
                rows.append(row)
                print(
                    f"  T = {temperature:g} {name:<11} L'_acc {row['l_acc_mean']:.2f} (alpha {row['alpha']:.2f}), "
                    f"{steps} steps" + (f", identical to ar {same}/{len(prompts)}" if not temperature else "")
                )
    if args.out:
        write_result(args.out, {"args": vars(args), "rows": rows}, indent=2)
    return 0
