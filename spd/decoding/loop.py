"""The step loop of the pipelined engines (single request): docs/method.md §5 (chain) and §6 (token tree) in one loop.
This docstring is where one step is described (docs/architecture.md, "One step of the pipeline", is its picture).

The target is cut into ``n`` stages, each with its own KV cache. The pipeline carries tree *levels*: the tree
(:class:`spd.decoding.tree.TokenTree`) is rooted at the newest known token (position ``P`` = committed length);
its level ``d`` holds speculated tokens for position ``P + d``. A chain is the tree of width 1 (every level one
node), the standard pipeline (``pp``) the loop without a proposer (the tree is the root alone). One **step** (the
unit ``K`` counts):

1. The proposer (:class:`spd.decoding.proposers.Proposer`) grows the tree by one level: it gives its distribution
   after each bottom node and the request's *candidate rule* picks at most ``W`` children for the level (fixed
   or adaptive: :mod:`spd.decoding.tree_width`), at most ``K`` per node: greedy or ``top-k``: each node's
   top-``K``, the ``W`` best by cumulative log-probability kept (:func:`spd.decoding.tree.grow_top_k`);
   ``sampled`` (the default at T > 0): per-node counts fixed from the expected scores, then children drawn
   without replacement from the proposer's warped ``q`` (:func:`spd.decoding.tree.grow_sampled`). An input-state
   proposer reads the state at the start of the step, so in a deployment it runs concurrently with 2 (the loop
   hands the stage work to its driver first and collects the outputs after the proposer's step); an
   output-state one (the ablation, PPSD) reads it after 2 and 3, serially. The new level enters stage 1 next step.
2. Every stage advances the level it holds by one stage: stage ``s`` runs the level's nodes over its KV cache
   (committed rows, causal, plus the tree nodes it has run, under the ancestor mask), at position ids
   ``P + depth``, and appends their KV. The level leaving stage ``n`` is taken first.
3. When the root's level leaves stage ``n``, the target's distribution ``p`` for position ``P + 1`` is known and
   the root's children are verified: greedy: the child equal to ``argmax p``; top-K candidates at T > 0:
   children tried in order, accepting ``x`` with probability ``p(x)`` and otherwise removing ``x`` from ``p``
   (:func:`spd.decoding.verify.verify_sampled_deterministic`); sampled candidates: recursive rejection sampling
   against the ``q`` they were drawn from (:func:`spd.decoding.verify.verify_sampled_recursive`). The chosen token
   is committed, stage 1's next level is released, then the other stages' reports are taken;
   - hit (it is a child ``c``): the tree, every stage's tree KV, the in-flight activations and the proposer's
     own state are pruned with one index set (the subtree of ``c``); the old root's KV row becomes the last
     committed row; ``c`` is the new root, already in flight. A chain's prune keeps every node: the stages have
     nothing to do;
   - miss: the tree is discarded, every stage's KV is truncated to the committed length and the committed token
     reseeds the tree (a lone root entering stage 1: warm-up again, paper section 3.6);
   - nothing proposed (``pp``): the committed token is the next root; nothing is flushed.
4. Stop on EOS (committed) or ``max_new_tokens``; the tree in flight is discarded.

Why the output is lossless: a stage runs a level only after the level above it passed that stage, so when it
runs a node its cache holds the committed prefix plus exactly that node's ancestors (the mask hides every other
tree row) at consecutive positions: the target computes every node as a plain forward of ``committed + path``
would. Pruning keeps exactly the rows of the surviving subtree, and a miss cuts every cache back to the committed
tokens. Verification is exact: greedy equality with the argmax; for top-K candidates the deterministic
multi-candidate rule, exact because the candidate list is fixed before the verification's random draws; for
sampled candidates recursive rejection sampling, exact because each child was drawn from ``q`` without the
earlier siblings and the number of children was fixed before drawing (docs/method.md). Never accept branches
independently: that over-samples the candidates.

Stage back-ends: :class:`spd.decoding.backend.LocalStages` (every stage in this process, the reference) and
:class:`spd.runtime.remote.RemoteStages` (one process per stage) implement the same methods: ``configure``,
``prefill``, ``launch_level``, ``advance``, ``prune``, ``flush``. When every level of the request is one node
(``paths``: width 1), a level travels and runs as a plain token (contiguous positions, the causal mask, the
linear-attention ring), and a hit needs no prune.

Shape suffixes: T nodes of one level, N tree nodes, L nodes of the bottom level, D hidden size, V vocabulary;
a leading 1 is the batch.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

import torch

from ..target.staging import StagedModel
from .backend import StageBackend
from .driver import COLLECT, Advance, Prefill, Propose, Steps, TargetLogits, drive
from .generation import GenerationOutput, OnToken, as_prompt_ids, check_request, eos_set, first_output, stop_reason
from .proposers import Proposer
from .sampling import SamplingParams, select_token, warped_probs
from .stats import PipelineStats, TreeStats
from .tree import Level, TokenTree, grow_sampled, grow_top_k
from .tree_width import WidthPolicy
from .verify import verify_greedy, verify_sampled_deterministic, verify_sampled_recursive


def anchors_by_stage(boundaries: list[int], needed) -> list[list[int]]:
    """The hidden-state indices of ``needed`` that each stage reports: H^l for l in (b[s], b[s+1]] (H^0 is taken at
    entry, before stage 1)."""
    b, needed = boundaries, set(needed)
    return [sorted(a for a in needed if b[s] < a <= b[s + 1]) for s in range(len(b) - 1)]


def verify_sampled(
    p_V: torch.Tensor, tokens_C: torch.Tensor, q_V: torch.Tensor, generator: torch.Generator | None
) -> tuple[int | None, int]:
    """Sampled children (drawn without replacement from ``q_V``): recursive rejection sampling."""
    return verify_sampled_recursive(p_V, tokens_C, q_V, generator, without_replacement=True)


class StepLoop:
    """The step loop of the module docstring over one stage back-end, for any proposer (or none: ``pp``)."""

    def __init__(self, staged: StagedModel, backend: StageBackend, policy: WidthPolicy, candidates: str = "auto"):
        self.staged, self.backend, self.policy, self.candidates = staged, backend, policy, candidates
        self.verify_sampled = verify_sampled  # the rule for sampled children (a test swaps in a lossy control)

    def stage_anchors(self, proposer: Proposer | None) -> list[list[int]]:
        """Anchors each stage hands to the proposer (:func:`anchors_by_stage` of its ``needed_anchors``)."""
        return anchors_by_stage(self.staged.boundaries, proposer.needed_anchors if proposer is not None else ())

    @torch.inference_mode()
    def run(
        self,
        proposer: Proposer | None,
        input_ids,
        max_new_tokens: int,
        sampling: SamplingParams,
        eos_token_id,
        on_token: OnToken | None,
        stats: PipelineStats,
    ) -> GenerationOutput:
        """One request (no EOS unless given); ``stats`` is filled in (a TreeStats gets the tree's counters too)."""
        return drive(
            self.backend, self.steps(proposer, input_ids, max_new_tokens, sampling, eos_token_id, on_token, stats)
        )

    def steps(
        self,
        proposer: Proposer | None,
        input_ids,
        max_new_tokens: int,
        sampling: SamplingParams,
        eos_token_id,
        on_token: OnToken | None,
        stats: PipelineStats,
        backend: StageBackend | None = None,
        policy: WidthPolicy | None = None,
    ) -> Steps:
        """The loop of one request as a generator: it hands its stage work (:class:`~.driver.Prefill`,
        :class:`~.driver.Advance`) and its questions (:class:`~.driver.Propose`: the proposer's query;
        :class:`~.driver.TargetLogits`: the verification's logits) to a driver (:mod:`spd.decoding.driver`) and
        returns the :class:`GenerationOutput`. :meth:`run` drives it alone (:func:`~.driver.drive`); a batched
        driver runs the work of many requests together. ``backend`` and ``policy`` are the request's own (default:
        this loop's); every other call on ``backend`` (``configure``, ``launch_level``, ``prune``, ``flush``) is
        made here, on the request's own back-end. The request's state and its step are :class:`_Request`."""
        backend = self.backend if backend is None else backend
        policy = self.policy if policy is None else policy
        prompt = as_prompt_ids(input_ids)
        budget = check_request(self.staged, prompt, max_new_tokens)
        eos = eos_set(eos_token_id)
        generator = None if sampling.greedy else sampling.generator(self.staged.device)
        request = _Request(
            self, proposer, backend, policy, sampling, generator, stats, eos, budget, max_new_tokens, on_token, prompt
        )
        request.start_stats()
        capacity = request.end_position + self.staged.n_stages * policy.max_width + 1
        policy.reset()
        backend.configure(self.stage_anchors(proposer), paths=policy.max_width == 1)
        yield from request.prefill(capacity)
        while not request.stop:
            yield from request.step()
        return request.output()

    # ------------------------------------------------------------------------------------ pieces
    def _enter(self, tree: TokenTree, start: int, end: int, rank: int, needs_embedding: bool) -> Level:
        """Tree nodes ``[start, end)`` about to enter stage 1: their embeddings are H^0 (also an anchor when the
        proposer reads ``H^0``)."""
        hidden_1TD = self.staged.embed(tree.token_ids(start, end)[None].to(self.staged.device))
        level = Level(start, hidden_1TD, rank=rank)
        if needs_embedding:
            level.anchors[0] = hidden_1TD[0]
        return level

    @staticmethod
    def _prune_level(level: Level, kept: torch.Tensor, kept_list: list[int]) -> Level | None:
        """Keep the level's nodes that survive the prune (``kept``: old tree indices; ``kept_list``: the same as a
        list); None when none do."""
        if level.size == 1:  # a chain's level (and any one-node level): it survives or it does not
            index = bisect.bisect_left(kept_list, level.start)
            if index >= len(kept_list) or kept_list[index] != level.start:
                return None
            level.start = index
            return level
        nodes_T = torch.arange(level.start, level.start + level.size)
        keep_T = torch.isin(nodes_T, kept)
        if not bool(keep_T.any()):
            return None
        level.start = int(torch.searchsorted(kept, nodes_T[keep_T][0]))
        keep_T = keep_T.to(level.hidden_1TD.device)
        level.hidden_1TD = level.hidden_1TD[:, keep_T]
        level.anchors = {index: hidden_TD[keep_T] for index, hidden_TD in level.anchors.items()}
        return level

    def _verify(
        self,
        logits_1V: torch.Tensor,
        tree: TokenTree,
        levels: list[Level],
        sampling: SamplingParams,
        generator: torch.Generator | None,
        stats: PipelineStats,
        rule: str,
        policy: WidthPolicy,
    ) -> tuple[int, int | None]:
        """The committed token after the root (the target's logits ``logits_1V`` after it) and the tree index of the
        accepted child (None: a miss or nothing to verify)."""
        children_C, tokens_C = tree.child_tokens(0)
        if not tokens_C:  # nothing proposed: the target's own next token
            return int(select_token(logits_1V, sampling, generator)[0]), None
        if sampling.greedy:
            index, token = verify_greedy(logits_1V[0], tokens_C)
        elif rule == "sampled":
            p_V = warped_probs(logits_1V, sampling)[0]
            index, token = self.verify_sampled(p_V, torch.tensor(tokens_C), tree.drafts[0].to(p_V.device), generator)
        else:
            index, token = verify_sampled_deterministic(warped_probs(logits_1V, sampling)[0], tokens_C, generator)
        policy.observe(index)
        rank = levels[0].rank  # the children's level is the oldest one still in flight
        stats.verified += 1
        stats.verified_by_position[rank - 1] += 1
        if isinstance(stats, TreeStats):
            stats.candidates_verified += children_C.numel()
        if index is None:
            stats.flushes += 1
            return token, None
        stats.accepted += 1
        stats.accepted_by_position[rank - 1] += 1
        if isinstance(stats, TreeStats):
            stats.accepted_by_sibling[index] += 1
        return token, int(children_C[index])


@dataclass
class _Request:
    """One request's state in :meth:`StepLoop.steps`, and its step (docs/method.md §5-6): ``context`` the committed
    tokens before the root (the rows every stage keeps), ``tree`` the token tree, ``levels`` its levels in flight
    (root level first), ``out`` the committed new tokens, ``stop`` the stop reason once there is one, ``grown`` the
    levels added since the last (re)seed. The generator methods hand their work to the driver as ``steps`` does."""

    loop: StepLoop
    proposer: Proposer | None
    backend: StageBackend
    policy: WidthPolicy
    sampling: SamplingParams
    generator: torch.Generator | None
    stats: PipelineStats
    eos: frozenset[int]
    budget: int
    max_new_tokens: int
    on_token: OnToken | None
    prompt: list[int]
    rule: str = field(init=False)  # the candidate rule: "top-k" or "sampled"
    tree_stats: TreeStats | None = field(init=False)
    end_position: int = field(init=False)  # positions >= this are never committed
    context: list[int] = field(init=False)
    t0: float = field(init=False)  # when the prefill started
    tree: TokenTree = field(init=False)
    out: list[int] = field(init=False)
    stop: str = field(init=False)
    levels: list[Level] = field(default_factory=list)
    grown: int = 0

    def __post_init__(self) -> None:
        self.rule = "top-k" if self.sampling.greedy or self.loop.candidates == "top-k" else "sampled"
        self.tree_stats = self.stats if isinstance(self.stats, TreeStats) else None
        self.end_position = len(self.prompt) + self.budget
        self.context = list(self.prompt)

    @property
    def schedule(self) -> str:
        return self.proposer.schedule if self.proposer is not None else "none"

    def start_stats(self) -> None:
        """The statistics' settings: the prompt, the cut, the candidate rule, the counters by position."""
        stats, staged, n = self.stats, self.loop.staged, self.loop.staged.n_stages
        if self.tree_stats is not None:
            self.tree_stats.candidates = self.rule
        stats.prompt_tokens, stats.stages, stats.target_layers = len(self.prompt), n, staged.num_layers
        stats.stage_layers = [b - a for a, b in zip(staged.boundaries, staged.boundaries[1:])]
        stats.verified_by_position, stats.accepted_by_position = [0] * n, [0] * n

    def prefill(self, capacity: int):
        """The prompt through every stage (caches of ``capacity`` rows) and the proposer; the first new token comes
        from the last logits and the root enters stage 1 (a generator, as ``steps``)."""
        staged, proposer, prompt = self.loop.staged, self.proposer, self.prompt
        self.t0 = time.perf_counter()
        prefill = yield Prefill(
            torch.tensor([prompt], dtype=torch.long, device=staged.device),
            list(proposer.prefill_anchors) if proposer is not None else [],
            capacity,
        )
        if proposer is not None:
            proposer.start(prompt, prefill.anchors, capacity)
        first = int(select_token(staged.logits(prefill.hidden_BTD[:, -1]), self.sampling, self.generator)[0])
        self.stats.prefill_time_s = time.perf_counter() - self.t0
        self.out, self.stop = first_output(first, self.stats, self.eos, self.budget, self.max_new_tokens, self.on_token)
        self.tree = TokenTree(first)
        self.levels = [self.enter_root()]

    def output(self) -> GenerationOutput:
        """The request's output, its statistics completed."""
        stats, out = self.stats, self.out
        stats.wall_time_s = time.perf_counter() - self.t0
        stats.stop_reason = self.stop
        stats.new_tokens = len(out)
        stats.decode_tokens = len(out) - 1
        return GenerationOutput(out, stats, self.prompt)

    def enter_root(self) -> Level:
        """The root alone, about to enter stage 1 (a seed: its rank is 0 while the pipeline refills)."""
        needs_embedding = self.proposer is not None and 0 in self.proposer.needed_anchors
        return self.loop._enter(self.tree, 0, 1, rank=0, needs_embedding=needs_embedding)

    def grow(self):
        """Step 1: the proposer's next level (None: nothing proposed), not yet in flight (a generator: the
        proposer's query goes to the driver)."""
        proposer, tree, policy, stats = self.proposer, self.tree, self.policy, self.stats
        if proposer is None or len(self.context) + tree.depth + 1 >= self.end_position:
            return None
        tick = time.perf_counter()
        logprobs_LX = yield Propose(proposer, tree, self.context, self.levels)
        width, children = policy.width, policy.children
        if self.rule == "top-k":
            new_N = grow_top_k(tree, logprobs_LX, proposer.ids, width, children)
        else:
            new_N = grow_sampled(
                tree,
                logprobs_LX,
                proposer.ids,
                width,
                children,
                self.sampling,
                self.generator,
                self.loop.staged.vocab_size,
            )
        stats.speculator_time_s += time.perf_counter() - tick
        if self.tree_stats is not None:
            self.tree_stats.width_total += width
            self.tree_stats.expansions += 1
        if not new_N.numel():
            return None
        self.grown += 1
        stats.proposals += new_N.numel()
        # While the seed (a root of rank 0) is in flight the pipeline is still refilling.
        n = self.loop.staged.n_stages
        rank = min(self.grown, n) if self.levels[0].rank == 0 else n
        return self.loop._enter(tree, int(new_N[0]), len(tree), rank=rank, needs_embedding=0 in proposer.needed_anchors)

    def advance(self, moving: list[Level], committed: int, after_verify: bool = False, meanwhile=None, then=()):
        """Step 2 for ``moving``, handed to the driver (``then``: see :class:`~.driver.Advance`); ``meanwhile()`` (step 1)
        runs before the outputs are collected, while a driver's stages compute; then the proposer sees their
        new state. Returns what ``meanwhile`` returned."""
        tokens = self.stats.stage_tokens[-1]
        for level in moving:
            tokens[level.depth] += level.size
        tick = time.perf_counter()
        yield Advance(moving, self.tree, committed, after_verify, list(then))
        started = time.perf_counter()
        result = (yield from meanwhile()) if meanwhile is not None else None
        busy = time.perf_counter() - started  # step 1's time, not the stages'
        yield COLLECT
        self.stats.stage_time_s += time.perf_counter() - tick - busy
        if self.proposer is not None:
            self.proposer.advanced(moving, self.tree, committed)
        return result

    def propose(self, committed: int, exits: bool):
        """1. The proposer's next level (it reads the state before this step's stage work)."""
        new_level = (yield from self.grow()) if self.schedule != "output" else None
        if new_level is not None:
            # Remote stages may start on it before this step's verification (a prune or miss reaches it
            # through the epoch); the single-process back-end runs it next step.
            self.backend.launch_level(new_level, self.tree, committed, early=exits)
        if self.tree_stats is not None:
            self.tree_stats.tree_nodes_total += len(self.tree)
            self.tree_stats.max_tree_size = max(self.tree_stats.max_tree_size, len(self.tree))
            self.tree_stats.stage_nodes += sum(level.size for level in self.levels)
        return new_level

    def step(self):
        """One pipeline step: propose, advance, verify the root leaving stage n (a generator, as ``steps``)."""
        self.stats.steps += 1
        self.stats.stage_tokens.append([0] * self.loop.staged.n_stages)
        committed = len(self.context)
        levels = self.levels
        if levels[-1].depth == 0:
            self.backend.launch_level(levels[-1], self.tree, committed)
        exits = levels[0].depth == self.loop.staged.n_stages - 1  # the root's level leaves stage n this step
        # 2. Every stage advances the level it holds. The root's level, leaving stage n, is taken first, so that its
        #    verification (3) releases stage 1's next level before the other reports are read. The new level does
        #    not move this step, so 1 runs while the stages compute.
        new_level = yield from self.advance(
            levels[:1] if exits else levels,
            committed,
            meanwhile=lambda: self.propose(committed, exits),
            then=levels[1:] if exits else (),
        )
        if exits:
            rest = yield from self.verify(committed, new_level)
            new_level = None  # verify put it in flight
            if self.stop:
                return
            if rest:
                yield from self.advance(rest, len(self.context), after_verify=True)
        if new_level is not None:
            self.levels.append(new_level)
        # Output-state proposers read the state after the stages ran (serial with them).
        if self.schedule == "output" and self.levels[-1].depth >= 1:
            new_level = yield from self.grow()
            if new_level is not None:
                self.levels.append(new_level)

    def verify(self, committed: int, new_level: Level | None):
        """3. The root left stage n: the target's p for the next position decides among its children. Commits the
        token, prunes the tree (a hit) or reseeds it (a miss); returns the levels whose stages ran this step too and
        are still to be taken (a generator, as ``steps``)."""
        tick = time.perf_counter()
        tree, stats, backend, proposer = self.tree, self.stats, self.backend, self.proposer
        root = self.levels.pop(0)
        rest = list(self.levels)  # their stages ran this step too; taken after the prune
        if new_level is not None:
            self.levels.append(new_level)
        logits_1V = yield TargetLogits(self.loop.staged, root.hidden_1TD[:, -1])
        token, child = self.loop._verify(
            logits_1V, tree, self.levels, self.sampling, self.generator, stats, self.rule, self.policy
        )
        proposed = len(tree) > 1
        self.context.append(tree.token(0))
        self.out.append(token)
        stats.token_acceptance.append(child is not None)  # a hit: the token is a tree node
        self.stop = stop_reason(token, self.out, self.eos, self.budget, self.max_new_tokens)
        if child is not None:
            kept = tree.prune_to_child(child)
            backend.prune(committed, kept)
            kept_list = kept.tolist()
            self.levels = [
                lv for lv in (self.loop._prune_level(lv, kept, kept_list) for lv in self.levels) if lv is not None
            ]
            rest = [lv for lv in self.levels if any(lv is r for r in rest)]
        else:
            # Miss: reseed from the committed token (nothing proposed: it is simply the next root).
            tree.reset(token)
            if proposed:
                backend.flush(committed + 1)
            self.levels = [self.enter_root()]
            self.grown = 0
            rest = []  # discarded with the flush
        if not self.stop and self.levels[-1].depth == 0:
            backend.launch_level(self.levels[-1], tree, len(self.context))  # stage 1's next level, as soon as decided
        # The proposer's own bookkeeping comes after that release (not on the stages' critical path).
        if proposer is not None:
            proposer.commit_root(root)
            if child is not None:
                proposer.prune(committed, kept)
            else:
                proposer.reset(committed + 1)
        stats.verify_time_s += time.perf_counter() - tick
        if self.on_token is not None and self.on_token(token, child is not None) and not self.stop:
            self.stop = "stopped"  # the caller ended the request (levels still in flight are discarded)
        return rest
