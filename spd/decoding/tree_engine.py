"""The pipelined token-tree engine (single process): docs/method.md §6 on top of the engine of section 5.

The target is cut into ``n`` stages as in :mod:`spd.decoding.engine`, but the pipeline carries tree *levels*
instead of single tokens. The tree (:class:`spd.decoding.tree.TokenTree`) is rooted at the newest known token
(position ``P`` = committed length); its level ``d`` holds speculated tokens for position ``P + d``.
One **step** (the unit ``K`` counts):

1. The token source grows the tree by one level: it gives its distribution after each bottom node and
   the request's *candidate rule* picks at most ``W`` children for the level (``--tree-width``, fixed
   or adaptive: :mod:`spd.decoding.tree_width`), at most ``K`` per node (``--tree-children``): greedy or
   ``top-k``: each node's top-``K``, the ``W`` best by cumulative log-probability kept
   (:func:`spd.decoding.tree.grow_top_k`); ``sampled`` (the default at T > 0): per-node counts fixed from the
   expected scores, then children drawn without replacement from the source's warped ``q``
   (:func:`spd.decoding.tree.grow_sampled`). It reads the state at the start of the step, so in a deployment it
   runs concurrently with 2 on its own device. The new level enters stage 1 next step.
2. Every stage advances the level it holds by one stage: stage ``s`` runs the level's nodes over its
   KV cache (committed rows, causal, plus the tree nodes it has run, under the ancestor mask), at
   position ids ``P + depth``, and appends their KV. The level leaving stage ``n`` is taken first.
3. When the root's level leaves stage ``n``, the target's distribution ``p`` for position ``P + 1``
   is known and the root's children are verified: greedy: the child equal to ``argmax p``; top-K
   candidates at T > 0: children tried in order, accepting ``x`` with probability ``p(x)`` and
   otherwise removing ``x`` from ``p`` (:func:`spd.decoding.tree.verify_sampled_deterministic`); sampled
   candidates: recursive rejection sampling against the ``q`` they were drawn from
   (:func:`spd.decoding.tree.verify_sampled_recursive`). The chosen token is committed, stage 1's next level is
   released, then the other stages' reports are taken;
   - hit (it is a child ``c``): the tree, every stage's tree KV, the in-flight activations and the
     source's own state are pruned with one index set (the subtree of ``c``); the old root's KV row
     becomes the last committed row; ``c`` is the new root, already in flight;
   - miss: the tree is discarded, every stage's KV is truncated to the committed length and the
     committed token reseeds the tree (a lone root entering stage 1: warm-up again).
4. Stop on EOS (committed) or ``max_new_tokens``; the tree in flight is discarded.

With ``W = 1`` the tree is a chain and this is the chain engine of :mod:`spd.decoding.engine` with another
proposer (with the SPD head and ``W = 1`` it reproduces that engine's tokens and step counts).

Why the output is lossless: a stage runs a level only after the level above it passed that stage, so
when it runs a node its cache holds the committed prefix plus exactly that node's ancestors (the mask
hides every other tree row) at consecutive positions: the target computes every node as a plain
forward of ``committed + path`` would. Pruning keeps exactly the rows of the surviving subtree, and a
miss cuts every cache back to the committed tokens. Verification is exact: greedy equality with the
argmax; for top-K candidates the deterministic multi-candidate rule, exact because the candidate list
is fixed before the verification's random draws; for sampled candidates recursive rejection sampling,
exact because each child was drawn from ``q`` without the earlier siblings and the number of children
was fixed before drawing (docs/method.md). Never accept branches independently: that over-samples the
candidates.

Two token sources share one small interface (``start``, ``expand`` - log-probabilities ``(L, X)`` over
the source's outputs, which ``ids`` maps to target ids when they are not the target's vocabulary -
``commit_root``, ``prune``, ``reset``): :class:`DraftModelSource`, a small causal LM with the target's tokenizer and its own KV cache
over committed tokens and tree nodes, pruned with the tree (the training-free SpecPipe/PipeDec mode);
and :class:`SpdHeadSource`, a trained input-state SPD head queried once per bottom node with that
node's root path at its current depths.

Shape suffixes: T nodes of one level, N tree nodes, L nodes of the bottom level, K candidates per
node, D hidden size, V vocabulary; a leading 1 is the batch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from .engine import LocalStages, OneModeEngine, PipelineStats, _stop_reason, first_output
from ..errors import SpdInputError
from .generation import GenerationOutput, OnToken, as_prompt_ids, check_request, eos_set
from .sampling import SamplingParams, warped_probs
from ..heads.draft_vocab import check_draft_vocab
from ..heads.config import check_compatible
from ..heads.speculator import Speculator
from ..target.staging import StageKVCache, StagedModel, load_target_tokenizer
from .tree import (TokenTree, grow_sampled, grow_top_k, verify_greedy, verify_sampled_deterministic,
                   verify_sampled_recursive)
from .tree_width import AdaptiveWidth, FixedWidth, tree_width

CANDIDATES = ("auto", "sampled", "top-k")  # how children are chosen at T > 0 (greedy: always top-k)


# ------------------------------------------------------------------------------------------ statistics


@dataclass
class TreeStats(PipelineStats):
    """PipelineStats of the tree engine. A *verification* checks the root's children (``verified``,
    ``accepted`` = hits, ``flushes`` = misses); ``verified_by_position[k-1]`` counts verifications of the
    k-th level after a (re)seed (k = n: the full pipeline); ``proposals`` counts tree nodes created."""

    source: str = ""  # "draft" or "head"
    width: int | str = 1  # W: nodes kept per level ("auto": adaptive, up to max_width)
    children: int = 1  # K: candidates per node (at most)
    candidates: str = "top-k"  # the rule that chose the children: "top-k" (deterministic) or "sampled"
    width_total: int = 0  # the width used by each expansion, summed (mean_width = width_total / expansions)
    expansions: int = 0
    accepted_by_sibling: list[int] = field(default_factory=list)  # hits by the accepted child's rank among its siblings
    candidates_verified: int = 0  # children offered to verification, summed
    tree_nodes_total: int = 0  # tree size after each step's expansion, summed over steps
    max_tree_size: int = 0
    stage_nodes: int = 0  # node-stage evaluations (the target's work; pp does n per token)

    @property
    def mean_tree_size(self) -> float:
        return self.tree_nodes_total / self.steps if self.steps else 0.0

    @property
    def mean_width(self) -> float:
        return self.width_total / self.expansions if self.expansions else 0.0

    def as_dict(self) -> dict:
        d = super().as_dict()
        d["mean_tree_size"] = round(self.mean_tree_size, 4)
        d["mean_width"] = round(self.mean_width, 4)
        return d


# --------------------------------------------------------------------------------------------- state


@dataclass
class Level:
    """One tree level in flight: a contiguous range of tree indices and what the stages produced so far."""

    start: int  # tree index of the level's first node
    hidden_1TD: torch.Tensor  # input of the next stage (the embeddings at depth 0)
    depth: int = 0  # stages completed
    rank: int = 0  # k-th level after the last (re)seed, capped at n (0: a seed root)
    anchors: dict[int, torch.Tensor] = field(default_factory=dict)  # H^l (T, D) that an SPD head reads
    sent: bool = False  # handed to remote stages already

    @property
    def size(self) -> int:
        return self.hidden_1TD.shape[1]


def check_same_vocabulary(target: StagedModel, draft: StagedModel, target_tokenizer=None,
                          draft_tokenizer=None) -> int:
    """Refuse a draft model whose token ids mean something else than the target's; return the usable vocabulary.

    With both tokenizers the token-to-id maps must be equal; the models' output sizes may then differ
    only by padding rows beyond the tokenizer (those ids are never proposed).
    """
    if target_tokenizer is not None and draft_tokenizer is not None:
        t_vocab, d_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
        if t_vocab != d_vocab:
            raise SpdInputError(
                f"the draft model's tokenizer ('{getattr(draft_tokenizer, 'name_or_path', '?')}', {len(d_vocab)} "
                f"tokens) differs from the target's ('{getattr(target_tokenizer, 'name_or_path', '?')}', "
                f"{len(t_vocab)} tokens); the tree mode needs a draft model with the target's tokenizer")
        if draft.vocab_size != target.vocab_size and len(t_vocab) <= min(draft.vocab_size, target.vocab_size):
            return min(draft.vocab_size, target.vocab_size)
    if draft.vocab_size != target.vocab_size:
        raise SpdInputError(
            f"the draft model's vocabulary has {draft.vocab_size} tokens but the target's has {target.vocab_size}; "
            "the tree mode needs a draft model with the target's tokenizer and vocabulary")
    return target.vocab_size


def load_draft_model(draft: str, revision: str | None, dtype: torch.dtype,
                     device: str | torch.device) -> tuple[StagedModel, object | None]:
    """A draft model (directory or hub id) as a 1-stage StagedModel, and its tokenizer (None: a model-only
    directory, whose vocabulary size is then the only thing :func:`check_same_vocabulary` can compare)."""
    staged = StagedModel.from_pretrained(draft, n_stages=1, revision=revision, dtype=dtype, device=device)
    try:
        return staged, load_target_tokenizer(draft, revision)
    except SpdInputError:
        return staged, None


# --------------------------------------------------------------------------------------- token sources


class DraftModelSource:
    """Token source (a): a small causal LM (one 1-stage :class:`StagedModel`) proposing tree levels, no training.

    Its KV cache holds the committed tokens and the tree nodes it has run (BFS prefix), like a target
    stage; it runs each node once and keeps the node's output, so that a bottom level
    left shallow by a prune is expanded again without recomputation (its log-probabilities per node, N x V
    floats: at most ``n * W + 1`` rows). Committed tokens it never ran
    (a root committed before it was expanded) are run first, as a plain causal chunk.
    """

    needed_anchors: tuple[int, ...] = ()
    prefill_anchors: tuple[int, ...] = ()
    ids = None  # its outputs are target token ids
    schedule = "none"
    num_layers = 0  # not a head: the step cost model assumes the draft is hidden behind a stage

    def __init__(self, draft: StagedModel, target: StagedModel, children: int = 4, target_tokenizer=None,
                 draft_tokenizer=None):
        if children < 1:
            raise SpdInputError(f"the number of tree children must be a positive integer, got {children}")
        self.vocab = check_same_vocabulary(target, draft, target_tokenizer, draft_tokenizer)
        self.draft = draft
        self.children = min(children, self.vocab)
        self.cache: StageKVCache | None = None
        self._empty()

    def _empty(self) -> None:
        # Log-probabilities after each tree node run so far (rows = tree indices 0..held-1).
        self.logprobs_NX = torch.zeros(0, self.vocab, device=self.draft.device)

    def start(self, prompt_ids: list[int], anchors: dict[int, torch.Tensor], capacity: int) -> None:
        """Prefill the draft's cache with the prompt."""
        self.cache = self.draft.new_caches(capacity=capacity)[0]
        self._empty()
        self.draft.forward_stages(torch.tensor([prompt_ids], device=self.draft.device), [self.cache])

    def expand(self, tree: TokenTree, context: list[int], levels: list[Level]) -> torch.Tensor:
        """The draft's log-probabilities after each bottom node, ``(L, X)``; ``context`` = committed tokens."""
        draft, cache, committed = self.draft, self.cache, len(context)
        if cache.length < committed:
            ids_1T = torch.tensor([context[cache.length:]], device=draft.device)
            draft.run_stage(0, draft.embed(ids_1T), cache)
        held = cache.length - committed
        if held < len(tree):
            ids_1T = tree.tokens_N[held:][None].to(draft.device)
            positions_1T = tree.positions(committed)[held:][None].to(draft.device)
            out = draft.run_stage(0, draft.embed(ids_1T), cache, positions_1T, tree_mask_TN=tree.mask()[held:])
            logprobs_TX = torch.log_softmax(draft.logits(out.hidden_BTD[0]).float()[:, :self.vocab], dim=-1)
            self.logprobs_NX = torch.cat([self.logprobs_NX, logprobs_TX])
        return self.logprobs_NX[tree.bottom_level().to(self.logprobs_NX.device)]

    def commit_root(self, root: Level) -> None:
        """Nothing to do: the root's row becomes committed in :meth:`prune` / :meth:`reset`."""

    def prune(self, committed: int, kept: torch.Tensor) -> None:
        """The root (row ``committed``) is committed and the tree keeps the subtree ``kept`` (old indices)."""
        if self.cache.length > committed:  # the draft ran the root (else it catches up in expand)
            StagedModel.prune_tree([self.cache], committed, kept)
        self.logprobs_NX = self.logprobs_NX[kept[kept < self.logprobs_NX.shape[0]].to(self.logprobs_NX.device)]

    def reset(self, committed: int) -> None:
        """Miss: drop the tree; the cache keeps at most the ``committed`` committed rows."""
        self.cache.truncate(committed)
        self._empty()


def path_rows(tree: TokenTree, levels: list[Level]) -> list[torch.Tensor]:
    """Per level in flight, the row (within the level) of each bottom node's ancestor in it, ``(L,)`` each: a bottom
    node has exactly one ancestor (or itself) in every level above it."""
    ancestors_LN = tree.mask()[tree.bottom_level()]
    return [ancestors_LN[:, level.start:level.start + level.size].float().argmax(dim=1) for level in levels]


class SpdHeadSource:
    """Token source (b): a trained input-state SPD head with width W (the paper's W = 4).

    For each node of the bottom level the head is queried as in the chain engine, with the node's root
    path as the trailing rows (each at its level's current depth, docs/method.md §3) after the head's cache
    of committed rows; the bottom nodes are one batch. The head's cache only ever holds committed rows
    (the root's row is appended when it leaves stage n), so pruning and misses need no rollback.
    Only the SPD configuration (input-state schedule, max depth n) has tree semantics; the output-state
    ablation and PPSD are refused.
    """

    schedule = "input"

    def __init__(self, head: Speculator, staged: StagedModel, children: int = 4):
        if not isinstance(head, Speculator):
            raise SpdInputError("SpdHeadSource takes our own heads; the SPD authors' heads are AuthorsHeadSource")
        check_compatible(head.config, staged, mode="tree")
        check_draft_vocab(head, staged.vocab_size)
        cfg = head.config
        if cfg.schedule != "input" or cfg.max_depth != cfg.n_stages:
            raise SpdInputError(f"the tree mode needs an SPD head (input-state schedule, max depth n), but this head "
                                f"has schedule '{cfg.schedule}' and max depth {cfg.max_depth}; use --mode spd for it")
        if children < 1:
            raise SpdInputError(f"the number of tree children must be a positive integer, got {children}")
        self.head = head
        self.vocab = cfg.vocab_size
        self.ids = head.draft_ids  # None, or the target ids of a draft-vocabulary head's outputs
        self.children = min(children, cfg.vocab_size)
        self.needed_anchors = tuple(head.needed_anchors())
        self.prefill_anchors = tuple(cfg.anchors[cfg.max_depth])
        self.num_layers = cfg.num_layers
        self.cache = None

    def start(self, prompt_ids: list[int], anchors: dict[int, torch.Tensor], capacity: int) -> None:
        """Every prompt position enters the head's cache at full depth."""
        head = self.head
        self.cache = head.new_cache(capacity=capacity)
        head.append_memory(self.cache, head.features(head.config.max_depth, anchors))

    def expand(self, tree: TokenTree, context: list[int], levels: list[Level]) -> torch.Tensor:
        """The head's log-probabilities after each bottom node, ``(L, X)``: one batched query over their paths."""
        head, cfg, cache = self.head, self.head.config, self.cache
        if cache.length != len(context):
            raise RuntimeError("speculator cache and committed tokens are out of step")
        rows = []  # (depth, g (L, D)) of every path position, root first: the trailing rows
        for level, pick_L in zip(levels, path_rows(tree, levels)):
            pick_L = pick_L.to(level.hidden_1TD.device)
            depth = min(level.depth, cfg.max_depth)
            rows.append((depth, head.features(depth, {a: level.anchors[a][pick_L] for a in cfg.anchors[depth]})))
        bottom = levels[-1]
        if rows[-1][0] == cfg.offset:
            query_LD = rows[-1][1]
        else:  # the bottom level already went deeper (a prune left the tree shallow)
            query_LD = head.features(cfg.offset, {a: bottom.anchors[a] for a in cfg.anchors[cfg.offset]})
        view = cache
        if query_LD.shape[0] > 1:  # one query per bottom node over the same cached rows
            b = query_LD.shape[0]
            view = SimpleNamespace(length=cache.length,
                                   keys=[k[:, :, :cache.length].expand(b, -1, -1, -1) for k in cache.keys],
                                   values=[v[:, :, :cache.length].expand(b, -1, -1, -1) for v in cache.values])
        # Over the head's own outputs X (V, or its draft vocabulary: ``ids`` maps them to target ids).
        return torch.log_softmax(head.logits(head.query(view, rows, query_LD)).float(), dim=-1)

    def commit_root(self, root: Level) -> None:
        """The root left stage n: its row at full depth joins the head's cache (it is committed either way)."""
        cfg = self.head.config
        features_1D = self.head.features(cfg.max_depth, {a: root.anchors[a] for a in cfg.anchors[cfg.max_depth]})
        self.head.append_memory(self.cache, features_1D[:, None])

    def prune(self, committed: int, kept: torch.Tensor) -> None:
        """Nothing to do: the cache holds committed rows only."""

    def reset(self, committed: int) -> None:
        """Nothing to do: the cache holds committed rows only."""


class AuthorsHeadSource:
    """Token source (c): one of the SPD authors' released heads (:class:`spd.heads.published.authors_head.AuthorsHead`)
    with width W, on the decode schedule it was trained for.

    Each bottom node is queried as their chain would query its newest token: the node's root path are the
    in-flight tokens (each at its level's current depth), the positions before it come from the committed
    anchors the head keeps, and the token that left stage n last is the evicted row (docs/method.md lists their
    schedule). Their window of ``n`` rows ends at the bottom node, at most ``n - 1`` levels below the root, so
    every row before it is committed: the head's cache holds committed rows only and needs no rollback on a
    prune. With ``W = 1`` this is their chain, step for step (their tree at T > 0 is not lossless; the tree and
    its verification here are ours). The bottom nodes are queried one after another (their tower has no batch
    of paths); a node's query is the same whichever came before it.
    """

    schedule = "input"

    def __init__(self, head, staged: StagedModel, children: int = 4):
        cfg = head.config
        check_compatible(cfg, staged, mode="tree")
        self.head = head
        self.ids = None  # its logits are spread over the target's vocabulary (-inf outside a draft vocabulary)
        self.children = min(children, cfg.vocab_size)
        self.needed_anchors = tuple(head.needed_anchors())
        self.prefill_anchors = tuple(head.prefill_anchors())
        self.num_layers = cfg.num_layers
        self.cache = None
        self.committed = 0

    def start(self, prompt_ids: list[int], anchors: dict[int, torch.Tensor], capacity: int) -> None:
        self.cache = self.head.new_cache(capacity=capacity)
        self.head.prefill_memory(self.cache, anchors)
        self.committed = len(prompt_ids)

    def expand(self, tree: TokenTree, context: list[int], levels: list[Level]) -> torch.Tensor:
        """The head's log-probabilities after each bottom node, ``(L, V)``: one query per bottom node."""
        if self.committed != len(context):
            raise RuntimeError("the authors' head and the committed tokens are out of step")
        picks = [pick_L.tolist() for pick_L in path_rows(tree, levels)]
        rows = []
        for node in range(len(picks[0])):  # levels[i] holds the nodes i levels below the root (at committed + i)
            path = [SimpleNamespace(position=self.committed + i, depth=level.depth,
                                    anchors={a: h[pick[node]:pick[node] + 1] for a, h in level.anchors.items()})
                    for i, (level, pick) in enumerate(zip(levels, picks))]
            rows.append(self.head.propose_logits(self.cache, path))
        return torch.log_softmax(torch.cat(rows).float(), dim=-1)

    def commit_root(self, root: Level) -> None:
        """The root left stage n: its anchors are kept and it becomes the evicted row of the next query."""
        slot = SimpleNamespace(position=self.committed, depth=root.depth,
                               anchors={a: h[:1] for a, h in root.anchors.items()})
        self.head.retire(self.cache, [slot])
        self.committed += 1

    def prune(self, committed: int, kept: torch.Tensor) -> None:
        """Nothing to do: the head's cache holds committed rows only."""

    def reset(self, committed: int) -> None:
        """Miss: as their chain's flush (the next query has no evicted row)."""
        self.cache.truncate(committed)


class LocalTreeStages(LocalStages):
    """All ``n`` stages in this process: the tree engine's reference backend (the chain backend's caches
    and prefill, plus tree levels). :class:`spd.runtime.remote.RemoteStages` implements the same methods."""

    def launch_level(self, level: Level, tree: TokenTree, committed: int, early: bool = False) -> None:
        """A level at depth 0 is about to enter stage 1 (``early``: made during this step, before its
        verification); remote stages get it now or at the next step; here it runs at the next advance."""

    def advance(self, levels: list[Level], tree: TokenTree, committed: int) -> None:
        """Every level in flight runs its next stage: committed rows plus its ancestors, at committed + depth."""
        for level in levels:
            stage, start, end = level.depth, level.start, level.start + level.size
            cache = self.caches[stage]
            if cache.length != committed + start:
                raise RuntimeError(f"stage {stage} holds {cache.length} rows but the level starting at tree node "
                                   f"{start} expects {committed + start}")
            positions_1T = tree.positions(committed)[start:end][None].to(self.staged.device)
            out = self.staged.run_stage(stage, level.hidden_1TD, cache, positions_1T,
                                        anchors=self.stage_anchors[stage], tree_mask_TN=tree.mask()[start:end, :end])
            for index, hidden_1TD in out.anchors.items():
                level.anchors[index] = hidden_1TD[0]
            level.hidden_1TD = out.hidden_BTD
            level.depth += 1

    def prune(self, committed: int, kept: torch.Tensor) -> None:
        """The root (row ``committed``) is committed; every stage keeps the subtree ``kept`` (old tree indices)."""
        self.staged.prune_tree(self.caches, committed, kept)


# -------------------------------------------------------------------------------------------- engine


class TreeEngine(OneModeEngine):
    """Runs one request at a time through the staged target with a token tree fed by a token source."""

    mode, engine_name = "tree", "the tree engine"

    def __init__(self, staged: StagedModel, source: DraftModelSource | SpdHeadSource | AuthorsHeadSource,
                 width: int | str | FixedWidth | AdaptiveWidth = 4, tokenizer=None,
                 stages: "LocalTreeStages | None" = None, candidates: str = "auto", max_width: int = 8):
        """``width``: W, ``"auto"`` (:class:`spd.decoding.tree_width.AdaptiveWidth` up to ``max_width``) or a policy;
        ``candidates``: how children are chosen at T > 0 (``auto`` = ``sampled``; greedy always uses top-k)."""
        if candidates not in CANDIDATES:
            raise SpdInputError(f"unknown tree candidate rule '{candidates}'; expected one of: {', '.join(CANDIDATES)}")
        self.staged, self.source, self.tokenizer, self.candidates = staged, source, tokenizer, candidates
        self.policy = width if isinstance(width, (FixedWidth, AdaptiveWidth)) else \
            tree_width(width, source.children, max_width)
        self.width = "auto" if self.policy.adaptive else self.policy.width
        # Where the stages run: this process (default) or other processes (spd.runtime.remote.RemoteStages).
        self.stages = stages if stages is not None else LocalTreeStages(staged)
        b, needed = staged.boundaries, set(source.needed_anchors)
        # Anchors each stage hands to the source: H^l for l in (b[s], b[s+1]] (H^0 is taken at entry).
        self._stage_anchors = [sorted(a for a in needed if b[s] < a <= b[s + 1]) for s in range(staged.n_stages)]
        self._needs_embedding = 0 in needed

    @classmethod
    def from_pretrained(cls, target: str, draft: str, stages: int = 1, width: int = 4, children: int = 4,
                        revision: str | None = None, draft_revision: str | None = None,
                        dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                        tokenizer: str | None = None, draft_tokenizer=None) -> "TreeEngine":
        """Load a target (cut into ``stages``) and a draft model (directories or hub ids) for the draft tree mode.

        ``draft_tokenizer`` (a loaded tokenizer) defaults to the draft directory's own, when it has one. The
        target's tokenizer is ``tokenizer`` or its own; without one, prompts are token ids.
        """
        staged = StagedModel.from_pretrained(target, n_stages=stages, revision=revision, dtype=dtype, device=device)
        tok = load_target_tokenizer(target, revision, tokenizer)
        draft_staged, own_tokenizer = load_draft_model(draft, draft_revision, dtype, device)
        source = DraftModelSource(draft_staged, staged, children, tok, draft_tokenizer or own_tokenizer)
        return cls(staged, source, width, tok)

    # ------------------------------------------------------------------------------------- public
    @torch.inference_mode()
    def run(self, input_ids: Sequence[int] | torch.Tensor, max_new_tokens: int, sampling: SamplingParams,
            eos_token_id: int | Sequence[int] | None = None,
            on_token: OnToken | None = None) -> GenerationOutput:
        """The step loop of the module docstring (no EOS unless given)."""
        staged, source = self.staged, self.source
        prompt = as_prompt_ids(input_ids)
        budget = check_request(staged, prompt, max_new_tokens)
        eos = eos_set(eos_token_id)
        n = staged.n_stages
        end_position = len(prompt) + budget  # positions >= this are never committed
        rule = "top-k" if sampling.greedy or self.candidates == "top-k" else "sampled"
        stats = TreeStats(mode="tree", prompt_tokens=len(prompt), stages=n, verified_by_position=[0] * n,
                          accepted_by_position=[0] * n, schedule=source.schedule,
                          speculator_layers=source.num_layers, target_layers=staged.num_layers,
                          source="draft" if isinstance(source, DraftModelSource) else "head", width=self.width,
                          children=self.policy.max_children, candidates=rule,
                          accepted_by_sibling=[0] * max(self.policy.max_width, self.policy.max_children))
        generator = None if sampling.greedy else sampling.generator(staged.device)
        capacity = end_position + n * self.policy.max_width + 1
        self.policy.reset()
        stages = self.stages
        stages.configure(self._stage_anchors)

        t0 = time.perf_counter()
        first = self._prefill(prompt, sampling, generator, capacity)
        stats.prefill_time_s = time.perf_counter() - t0
        out, stop = first_output(first, stats, eos, budget, max_new_tokens, on_token)
        context = list(prompt)  # committed tokens before the root (the rows every stage keeps)
        tree = TokenTree(first)
        levels = [self._enter(tree, 0, 1, rank=0)]
        grown = 0  # levels added since the last (re)seed

        while not stop:
            stats.steps += 1
            committed = len(context)
            new_level = None
            if levels[-1].depth == 0:
                stages.launch_level(levels[-1], tree, committed)
            exits = levels[0].depth == n - 1  # the root's level leaves stage n this step and is verified
            # 1. The source grows the tree from the state at the start of the step (concurrent with 2).
            if committed + tree.depth + 1 < end_position:
                tick = time.perf_counter()
                logprobs_LX = source.expand(tree, context, levels)
                width, children = self.policy.width, self.policy.children
                if rule == "top-k":
                    new_N = grow_top_k(tree, logprobs_LX, source.ids, width, children)
                else:
                    new_N = grow_sampled(tree, logprobs_LX, source.ids, width, children, sampling, generator,
                                         staged.vocab_size)
                stats.speculator_time_s += time.perf_counter() - tick
                stats.width_total += width
                stats.expansions += 1
                if new_N.numel():
                    grown += 1
                    new_level = self._enter(tree, int(new_N[0]), len(tree), rank=min(grown, n))
                    stats.proposals += new_N.numel()
                    # Remote stages may start on it before this step's verification (a prune or miss
                    # reaches it through the epoch); the single-process backend runs it next step.
                    stages.launch_level(new_level, tree, committed, early=exits)
            stats.tree_nodes_total += len(tree)
            stats.max_tree_size = max(stats.max_tree_size, len(tree))
            stats.stage_nodes += sum(level.size for level in levels)
            # 2. Every stage advances the level it holds. The root's level, leaving stage n, is taken first, so
            #    that its verification (3) releases stage 1's next level before the other reports are read.
            tick = time.perf_counter()
            stages.advance(levels[:1] if exits else levels, tree, committed)
            stats.stage_time_s += time.perf_counter() - tick
            if not exits:
                if new_level is not None:
                    levels.append(new_level)
                continue
            # 3. The root left stage n: the target's p for the next position decides among its children.
            tick = time.perf_counter()
            root = levels.pop(0)
            rest = list(levels)  # their stages ran this step too; taken below, after the prune
            if new_level is not None:
                levels.append(new_level)
            token, child = self._verify(root, tree, levels, sampling, generator, stats, rule)
            context.append(int(tree.tokens_N[0]))
            out.append(token)
            stats.token_acceptance.append(child is not None)  # a hit: the token is a tree node
            stop = _stop_reason(token, out, eos, budget, max_new_tokens)
            if child is not None:
                kept = tree.prune_to_child(child)
                stages.prune(committed, kept)
                levels = [lv for lv in (self._prune_level(lv, kept) for lv in levels) if lv is not None]
                rest = [lv for lv in levels if any(lv is r for r in rest)]
            else:
                # Miss (or nothing to verify): reseed from the committed token.
                tree.reset(token)
                stages.flush(committed + 1)
                levels = [self._enter(tree, 0, 1, rank=0)]
                grown = 0
                rest = []  # discarded with the flush
            if not stop and levels[-1].depth == 0:
                stages.launch_level(levels[-1], tree, len(context))  # stage 1's next level, as soon as it is decided
            # The source's own bookkeeping comes after that release (it is not on the stages' critical path).
            source.commit_root(root)
            if child is not None:
                source.prune(committed, kept)
            else:
                source.reset(committed + 1)
            stats.verify_time_s += time.perf_counter() - tick
            if on_token is not None and on_token(token, child is not None) and not stop:
                stop = "stopped"  # the caller ended the request (levels still in flight are discarded)
            if stop or not rest:
                continue
            tick = time.perf_counter()
            stages.advance(rest, tree, len(context))
            stats.stage_time_s += time.perf_counter() - tick

        stats.wall_time_s = time.perf_counter() - t0
        stats.stop_reason = stop
        stats.new_tokens = len(out)
        stats.decode_tokens = len(out) - 1
        return GenerationOutput(out, stats, prompt)

    # ------------------------------------------------------------------------------------ pieces
    def _prefill(self, prompt: list[int], sampling: SamplingParams, generator: torch.Generator | None,
                 capacity: int) -> int:
        """Run the prompt through every stage and the source; the first new token comes from the last logits."""
        staged = self.staged
        ids_1T = torch.tensor([prompt], dtype=torch.long, device=staged.device)
        out = self.stages.prefill(ids_1T, list(self.source.prefill_anchors), capacity)
        self.source.start(prompt, out.anchors, capacity)
        logits_1V = staged.logits(out.hidden_BTD[:, -1])
        if sampling.greedy:
            return int(torch.argmax(logits_1V, dim=-1))
        return int(torch.multinomial(warped_probs(logits_1V, sampling), 1, generator=generator))

    def _enter(self, tree: TokenTree, start: int, end: int, rank: int) -> Level:
        """Tree nodes ``[start, end)`` about to enter stage 1: their embeddings are H^0."""
        hidden_1TD = self.staged.embed(tree.tokens_N[start:end][None].to(self.staged.device))
        level = Level(start, hidden_1TD, rank=rank)
        if self._needs_embedding:
            level.anchors[0] = hidden_1TD[0]
        return level

    @staticmethod
    def _prune_level(level: Level, kept: torch.Tensor) -> Level | None:
        """Keep the level's nodes that survive the prune (``kept``: old tree indices); None when none do."""
        nodes_T = torch.arange(level.start, level.start + level.size)
        keep_T = torch.isin(nodes_T, kept)
        if not bool(keep_T.any()):
            return None
        level.start = int(torch.searchsorted(kept, nodes_T[keep_T][0]))
        keep_T = keep_T.to(level.hidden_1TD.device)
        level.hidden_1TD = level.hidden_1TD[:, keep_T]
        level.anchors = {index: hidden_TD[keep_T] for index, hidden_TD in level.anchors.items()}
        return level

    def _verify(self, root: Level, tree: TokenTree, levels: list[Level], sampling: SamplingParams,
                generator: torch.Generator | None, stats: TreeStats, rule: str) -> tuple[int, int | None]:
        """The committed token after the root and the tree index of the accepted child (None: a miss)."""
        logits_1V = self.staged.logits(root.hidden_1TD[:, -1])
        children_C = tree.children(0)
        tokens_C = tree.tokens_N[children_C]
        if sampling.greedy:
            index, token = verify_greedy(logits_1V[0], tokens_C)
        elif rule == "sampled" and children_C.numel():
            p_V = warped_probs(logits_1V, sampling)[0]
            index, token = self._verify_sampled(p_V, tokens_C, tree.drafts[0].to(p_V.device), generator)
        else:
            index, token = verify_sampled_deterministic(warped_probs(logits_1V, sampling)[0], tokens_C, generator)
        if children_C.numel() == 0:
            return token, None
        self.policy.observe(index)
        rank = levels[0].rank  # the children's level is the oldest one still in flight
        stats.verified += 1
        stats.candidates_verified += children_C.numel()
        stats.verified_by_position[rank - 1] += 1
        if index is None:
            stats.flushes += 1
            return token, None
        stats.accepted += 1
        stats.accepted_by_position[rank - 1] += 1
        stats.accepted_by_sibling[index] += 1
        return token, int(children_C[index])


    @staticmethod
    def _verify_sampled(p_V: torch.Tensor, tokens_C: torch.Tensor, q_V: torch.Tensor,
                        generator: torch.Generator | None) -> tuple[int | None, int]:
        """Sampled children (drawn without replacement from ``q_V``): recursive rejection sampling."""
        return verify_sampled_recursive(p_V, tokens_C, q_V, generator, without_replacement=True)


def build_tree_engine(staged: StagedModel, head, tokenizer, draft_model: str | None, draft_revision: str | None,
                      width: int | str, children: int, dtype: torch.dtype, device: str | torch.device,
                      stages=None, candidates: str = "auto", max_width: int = 8) -> TreeEngine:
    """The tree engine with an SPD head of width W, or with a draft model (refused unless it shares the tokenizer).

    ``width`` is W or ``"auto"`` (adaptive up to ``max_width``); ``candidates`` the rule at T > 0 (see
    :class:`TreeEngine`); ``stages`` the stage backend (default: this process; :class:`spd.runtime.remote.RemoteStages`
    across processes).
    """
    if head is not None and not isinstance(head, Speculator):
        source = AuthorsHeadSource(head, staged, children)
    elif head is not None:
        source = SpdHeadSource(head, staged, children)
    else:
        draft, draft_tokenizer = load_draft_model(draft_model, draft_revision, dtype, device)
        source = DraftModelSource(draft, staged, children, tokenizer, draft_tokenizer)
    return TreeEngine(staged, source, width, tokenizer, stages=stages, candidates=candidates, max_width=max_width)
