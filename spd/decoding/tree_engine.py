"""The token-tree engine (docs/method.md §6) and the token sources (:class:`spd.decoding.proposers.Proposer`).

The engine runs the step loop of :mod:`spd.decoding.loop` with a proposer of width ``W`` (``--tree-width``, fixed or
adaptive: :mod:`spd.decoding.tree_width`) and at most ``K`` children per node (``--tree-children``). With
``W = 1`` the tree is a chain: the chain engine (:class:`spd.decoding.engine.PipelineEngine`) is this loop at
width 1.

Three token sources implement the proposer interface (``start``, ``expand`` - log-probabilities ``(L, X)`` over
the source's outputs, which ``ids`` maps to target ids when they are not the target's vocabulary -
``advanced``, ``commit_root``, ``prune``, ``reset``): :class:`DraftModelProposer`, a small causal LM with the
target's tokenizer and its own KV cache over committed tokens and tree nodes, pruned with the tree (the
training-free SpecPipe/PipeDec mode); :class:`SpdHeadProposer`, a trained input-state SPD head queried once for all
bottom nodes, each with its root path at its current depths; and :class:`HeadProposer`, any head through its
engine calls (``prefill_anchors``, ``prefill_memory``, ``retire``, ``propose_logits``), one query per bottom
node: the SPD authors' heads at any width, and our heads' output-state and PPSD schedules (chains only).

Shape suffixes: T nodes of one level, N tree nodes, L nodes of the bottom level, K candidates per node,
D hidden size, V vocabulary; a leading 1 is the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .request import OneModeEngine
from ..errors import SpdInputError
from .generation import GenerationOutput, OnToken
from .loop import LocalStages, StepLoop, verify_sampled
from .sampling import SamplingParams
from .stats import TreeStats
from ..heads.speculator import Speculator
from ..target.staging import StagedModel, load_target_tokenizer
from .proposers import DraftModelProposer, HeadProposer, SpdHeadProposer, load_draft_model
from .tree_width import AdaptiveWidth, FixedWidth, tree_width

CANDIDATES = ("auto", "sampled", "top-k")  # how children are chosen at T > 0 (greedy: always top-k)


class TreeEngine(OneModeEngine):
    """Runs one request at a time through the staged target with a token tree fed by a token source."""

    mode, engine_name = "tree", "the tree engine"

    def __init__(self, staged: StagedModel, source: DraftModelProposer | SpdHeadProposer | HeadProposer,
                 width: int | str | FixedWidth | AdaptiveWidth = 4, tokenizer=None,
                 stages: LocalStages | None = None, candidates: str = "auto", max_width: int = 8):
        """``width``: W, ``"auto"`` (:class:`spd.decoding.tree_width.AdaptiveWidth` up to ``max_width``) or a policy;
        ``candidates``: how children are chosen at T > 0 (``auto`` = ``sampled``; greedy always uses top-k)."""
        if candidates not in CANDIDATES:
            raise SpdInputError(f"unknown tree candidate rule '{candidates}'; expected one of: {', '.join(CANDIDATES)}")
        self.staged, self.source, self.tokenizer, self.candidates = staged, source, tokenizer, candidates
        self.policy = width if isinstance(width, (FixedWidth, AdaptiveWidth)) else \
            tree_width(width, source.children, max_width)
        if getattr(source, "chain_only", False) and self.policy.max_width > 1:
            raise SpdInputError(f"this head's schedule ('{source.schedule}', keeping rows before they leave stage n) "
                                "has no tree semantics; run it with --mode spd (or a tree width of 1)")
        self.width = "auto" if self.policy.adaptive else self.policy.width
        # Where the stages run: this process (default) or other processes (spd.runtime.remote.RemoteStages).
        self.stages = stages if stages is not None else LocalStages(staged)
        self.loop = StepLoop(staged, self.stages, self.policy, candidates)
        self.loop.verify_sampled = self._verify_sampled

    _verify_sampled = staticmethod(verify_sampled)  # how sampled children are verified (a test swaps in a control)

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
        source = DraftModelProposer(draft_staged, staged, children, tok, draft_tokenizer or own_tokenizer)
        return cls(staged, source, width, tok)

    def run(self, input_ids: Sequence[int] | torch.Tensor, max_new_tokens: int, sampling: SamplingParams,
            eos_token_id: int | Sequence[int] | None = None,
            on_token: OnToken | None = None) -> GenerationOutput:
        """One request through the step loop (:mod:`spd.decoding.loop`; no EOS unless given)."""
        source, stats = self.request_parts()
        return self.loop.run(source, input_ids, max_new_tokens, sampling, eos_token_id, on_token, stats)

    def request_parts(self, use_head: bool = True) -> tuple[DraftModelProposer | SpdHeadProposer | HeadProposer, TreeStats]:
        """The proposer and fresh statistics of one request."""
        source, policy = self.source, self.policy
        stats = TreeStats(mode="tree", prompt_tokens=0, schedule=source.schedule,
                          speculator_layers=source.num_layers,
                          source="draft" if isinstance(source, DraftModelProposer) else "head", width=self.width,
                          children=policy.max_children,
                          accepted_by_sibling=[0] * max(policy.max_width, policy.max_children))
        return source, stats


LocalTreeStages = LocalStages  # the tree engine's back-end is the one stage back-end

def build_tree_engine(staged: StagedModel, head, tokenizer, draft_model: str | None, draft_revision: str | None,
                      width: int | str, children: int, dtype: torch.dtype, device: str | torch.device,
                      stages=None, candidates: str = "auto", max_width: int = 8) -> TreeEngine:
    """The tree engine with an SPD head of width W, or with a draft model (refused unless it shares the tokenizer).

    ``width`` is W or ``"auto"`` (adaptive up to ``max_width``); ``candidates`` the rule at T > 0 (see
    :class:`TreeEngine`); ``stages`` the stage backend (default: this process; :class:`spd.runtime.remote.RemoteStages`
    across processes).
    """
    if head is not None and not isinstance(head, Speculator):
        source = HeadProposer(head, staged, children, tokenizer=tokenizer)
    elif head is not None:
        source = SpdHeadProposer(head, staged, children, tokenizer=tokenizer)
    else:
        draft, draft_tokenizer = load_draft_model(draft_model, draft_revision, dtype, device)
        source = DraftModelProposer(draft, staged, children, tokenizer, draft_tokenizer)
    return TreeEngine(staged, source, width, tokenizer, stages=stages, candidates=candidates, max_width=max_width)

