"""The pipelined engine (``pp``, ``spd`` and ``tree``): the semantic reference of docs/method.md §5-6.

One class, :class:`Engine`, runs the step loop of :mod:`spd.decoding.loop`; its width policy makes it a chain or a
tree. A chain (``pp``, ``spd``) is the loop at width 1 (every tree level one token), with the head as its proposer
(:class:`spd.decoding.proposers.SpdHeadProposer` for SPD heads, :class:`spd.decoding.proposers.HeadProposer` for the
output-state ablation, PPSD and the SPD authors' heads) or with none (``pp``). A tree (``tree``) is the loop with a
proposer of width ``W`` (``--tree-width``, fixed or adaptive: :mod:`spd.decoding.tree_width`) and at most ``K``
children per node (``--tree-children``): an SPD head or a draft model (:mod:`spd.decoding.proposers`).
:meth:`Engine.from_pretrained` loads a target and its proposer by name (through :mod:`spd.decoding.loader`, as
every program does); :meth:`Engine.build`, :meth:`Engine.chain` and :meth:`Engine.tree` build one from loaded parts.

One step of the loop, the flush and reseed on a miss, and why the output is lossless are described once, in
:mod:`spd.decoding.loop` (and for readers, docs/architecture.md, "One step of the pipeline").

In a chain the proposer proposes one token per step. With a speculation head it reads the *input state*
(docs/method.md §3: the newest token at depth 0, in-flight tokens at their depths, everything older at
depth ``n``), so in a real deployment it runs concurrently with the stages. The output-state ablation
and the PPSD baseline are the same head with other settings (``schedule="output"``: the head reads
the state after the stages have run, so it is serial with them). With no head the engine is the
standard pipeline (``pp``): one token in flight, ``K = n * N``.

Metrics (docs/method.md §5): ``K`` steps, ``N`` tokens committed by decode steps (the first new token,
taken from the prefill logits, is not one; ``new_tokens = N + 1`` counts it), ``alpha = N / K``,
``L'_acc = n * N / K``, theoretical speedups of paper section 4.2.

Statistics: :class:`spd.decoding.stats.PipelineStats`.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Sequence
from typing import Any, cast, overload

import torch

from ..errors import SpdInputError
from ..heads.interface import SpeculationHead
from ..heads.speculator import Speculator
from ..target.staging import StagedModel
from ..target.tokenizer import load_target_tokenizer
from .backend import LocalStages, StageBackend
from .generation import GenerationOutput, OnToken
from .loop import StepLoop, verify_sampled
from .modes import NEEDS_HEAD, NEEDS_PROPOSER, check_engine_mode, in_python_terms
from .proposers import Draft, DraftModelProposer, HeadProposer, Proposer, SpdHeadProposer, load_draft_model
from .request import Generates
from .sampling import SamplingParams
from .spec import CANDIDATES, DecodingSpec
from .stats import PipelineStats, TreeStats
from .tree_width import AdaptiveWidth, FixedWidth, tree_width

CHAIN_MODES = ("spd", "pp", "ar")  # a chain engine's; a tree engine runs tree and ar


class Engine(Generates):
    """Runs one request at a time through the staged target on the step loop (see the module docstring).

    ``mode`` is ``"tree"`` (a proposer of width ``width``: W, ``"auto"`` for :class:`~.tree_width.AdaptiveWidth`
    up to ``max_width``, or a policy) or a chain: ``"spd"`` with a proposer, ``"pp"`` without (the default mode
    follows from ``width`` and ``proposer``). ``candidates`` is how a tree's children are chosen at T > 0 (``auto`` =
    ``sampled``; greedy always uses top-k). ``stages`` is the stage back-end (``backend``), where the stages
    run: this process (default) or other processes (:class:`spd.runtime.remote.RemoteStages`). ``generate`` and ``chat`` are
    :class:`Generates`'.
    """

    def __init__(
        self,
        staged: StagedModel,
        proposer: Proposer | None = None,
        width: int | str | FixedWidth | AdaptiveWidth = 1,
        tokenizer=None,
        stages: StageBackend | None = None,
        candidates: str = "auto",
        max_width: int = 8,
        *,
        mode: str | None = None,
    ):
        one_wide = width == 1 or (isinstance(width, FixedWidth) and width.max_width == width.max_children == 1)
        mode = mode or ("tree" if not one_wide else "spd" if proposer is not None else "pp")
        check_engine_mode(mode, head=proposer is not None)
        if candidates not in CANDIDATES:
            raise SpdInputError(f"unknown tree candidate rule '{candidates}'; expected one of: {', '.join(CANDIDATES)}")
        if mode == "tree":
            assert proposer is not None  # check_engine_mode: a tree has a proposer
            policy = (
                width
                if isinstance(width, (FixedWidth, AdaptiveWidth))
                else tree_width(width, proposer.children, max_width)
            )
            if proposer.chain_only and policy.max_width > 1:
                raise SpdInputError(
                    f"this head's schedule ('{proposer.schedule}', keeping rows before they leave "
                    "stage n) has no tree semantics; run it with --mode spd (or a tree width of 1)"
                )
        else:
            if not one_wide:
                raise SpdInputError(f"mode '{mode}' is a chain (width 1), got width {width!r}; use mode 'tree'")
            policy = FixedWidth(1, 1)
        self.staged, self.proposer, self.tokenizer, self.mode, self.candidates = (
            staged,
            proposer,
            tokenizer,
            mode,
            candidates,
        )
        self.policy = policy
        # What Generates.check_mode's message calls this engine (a tree's modes are its own and ar).
        self.engine_name = "the tree engine" if mode == "tree" else "the chain engine"
        self.width = "auto" if policy.adaptive else policy.width
        self.backend: StageBackend = stages if stages is not None else LocalStages(staged)
        self.loop = StepLoop(staged, self.backend, policy, candidates)
        self.loop.verify_sampled = self._verify_sampled

    _verify_sampled = staticmethod(verify_sampled)  # how sampled children are verified (a test swaps in a control)

    # ------------------------------------------------------------------------------------ building
    @classmethod
    def chain(
        cls, staged: StagedModel, head=None, tokenizer=None, stages: StageBackend | None = None, mode: str | None = None
    ) -> Engine:
        """The chain engine with a loaded head (``spd`` and ``pp``; ``mode``, the default of ``generate``, is
        ``spd``) or none (``pp``)."""
        return cls(staged, chain_proposer(staged, head, tokenizer), tokenizer=tokenizer, stages=stages, mode=mode)

    @classmethod
    def tree(
        cls,
        staged: StagedModel,
        proposer: Proposer,
        width: int | str | FixedWidth | AdaptiveWidth = 4,
        tokenizer=None,
        stages: StageBackend | None = None,
        candidates: str = "auto",
        max_width: int = 8,
    ) -> Engine:
        """The tree engine with a proposer (:func:`tree_proposer_of` makes one from a head or a draft model)."""
        return cls(staged, proposer, width, tokenizer, stages, candidates, max_width, mode="tree")

    @classmethod
    def build(
        cls,
        spec: DecodingSpec,
        staged: StagedModel,
        head=None,
        tokenizer=None,
        draft: Draft | None = None,
        stages: StageBackend | None = None,
        mode: str | None = None,
    ) -> Engine:
        """The engine of ``spec.mode`` over loaded parts: a tree with the head or the draft model (``spec``'s width,
        children and candidate rule), else a chain with the head (``mode``: its default, as :meth:`chain`)."""
        if spec.mode != "tree":
            return cls.chain(staged, head, tokenizer, stages=stages, mode=mode)
        proposer = tree_proposer_of(staged, head, tokenizer, draft, spec.tree_children)
        return cls.tree(staged, proposer, spec.tree_width, tokenizer, stages, spec.tree_candidates, spec.tree_max_width)

    @classmethod
    def from_pretrained(
        cls,
        target: str,
        speculator: str | None = None,
        *,
        mode: str | None = None,
        draft_model: str | None = None,
        n_stages: int | None = None,
        boundaries: list[int] | None = None,
        width: int | str = 4,
        children: int = 4,
        revision: str | None = None,
        speculator_revision: str | None = None,
        draft_revision: str | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        tokenizer: str | None = None,
        stages: int | None = None,
    ) -> Engine:
        """Load a target (directory or hub id) and its proposer: a head (``speculator``) or a draft model.

        ``mode``: ``spd`` (the default with a head), ``pp`` (the default without one) or ``tree`` (the default with
        only a draft model; ``width`` W and ``children`` K). The target is cut into ``n_stages`` equal stages
        (``--stages``; default: the head's cut, else 1) or at ``boundaries`` (``--boundaries``; e.g.
        ``[0, 8, 16, 23, 30]``). The tokenizer is ``tokenizer`` or the target's; a target without one gives an engine
        for token-id prompts. ``stages`` is the old name of ``n_stages``. A wrong input raises
        :class:`~spd.errors.SpdInputError`, in these arguments' names.
        """
        from .loader import load_parts, resolve_cut

        n_stages = _renamed_n_stages(n_stages, stages)
        check_cut(n_stages, boundaries)
        mode = mode or ("spd" if speculator else "tree" if draft_model else "pp")
        check_engine_mode(mode, head=bool(speculator), draft_model=bool(draft_model))
        spec = DecodingSpec(
            mode,
            target=target,
            revision=revision,
            tokenizer=tokenizer,
            stages=n_stages,
            boundaries=boundaries,
            speculator=speculator,
            speculator_revision=speculator_revision,
            draft_model=draft_model,
            draft_revision=draft_revision,
            tree_width=width,
            tree_children=children,
            device=str(device),
            dtype=str(dtype).removeprefix("torch."),
        )
        try:  # the rules every program shares, in the words of this call's arguments
            cut = resolve_cut(spec)  # the sources and the head's fit, before anything loads
            parts = load_parts(spec, load_target_tokenizer(target, revision, tokenizer), cut)
            return cls.build(spec, parts.staged, parts.head, parts.tokenizer, parts.draft, mode=mode)
        except SpdInputError as exc:
            exc.args = (in_python_terms(str(exc)),)
            raise

    # ------------------------------------------------------------------------------------- public
    def check_mode(self, mode: str) -> None:
        """A tree runs ``tree`` and ``ar``; a chain ``spd``, ``pp`` and ``ar`` (``pp``: the head left unused)."""
        if self.mode == "tree":
            super().check_mode(mode)
        elif mode not in CHAIN_MODES:
            raise SpdInputError(f"unknown mode '{mode}'; expected one of: {', '.join(CHAIN_MODES)}")

    def proposer_for(self, head: torch.nn.Module) -> Proposer:
        """The proposer this engine would build for ``head`` (a loaded head to swap in with :meth:`use_proposer`),
        refused with one sentence where the head cannot run here; nothing of the engine changes."""
        if self.proposer is None or isinstance(self.proposer, DraftModelProposer):
            raise SpdInputError("this engine runs no head (--mode pp, or a draft model); a head cannot be swapped in")
        if self.mode != "tree":
            return chain_proposer(self.staged, head, self.tokenizer)
        proposer = tree_proposer_of(self.staged, head, self.tokenizer, None, self.proposer.children)
        if proposer.chain_only and self.policy.max_width > 1:
            raise SpdInputError(
                f"this head's schedule ('{proposer.schedule}') has no tree semantics; a tree server takes SPD heads"
            )
        return proposer

    def use_proposer(self, proposer: Proposer) -> None:
        """Requests started from now on are proposed by ``proposer`` (:meth:`proposer_for`); the ones running keep
        theirs (a request takes the engine's proposer when it starts)."""
        self.proposer = proposer

    def decode(self, prompt_ids, max_new_tokens: int, sampling: SamplingParams, eos_token_id, on_token, mode: str):
        return self.run(prompt_ids, max_new_tokens, sampling, eos_token_id, on_token, use_head=mode != "pp")

    def run(
        self,
        input_ids: Sequence[int] | torch.Tensor,
        max_new_tokens: int,
        sampling: SamplingParams,
        eos_token_id: int | Sequence[int] | None = None,
        on_token: OnToken | None = None,
        use_head: bool = True,
    ) -> GenerationOutput:
        """One request through the step loop (``use_head=False`` on a chain: the standard pipeline); no EOS unless
        given."""
        proposer, stats = self.request_parts(use_head)
        return self.loop.run(proposer, input_ids, max_new_tokens, sampling, eos_token_id, on_token, stats)

    def request_parts(self, use_head: bool = True) -> tuple[Proposer | None, PipelineStats]:
        """The proposer (None: the standard pipeline) and fresh statistics of one request."""
        proposer = self.proposer
        if self.mode == "tree":
            assert proposer is not None  # a tree always has one (__init__, use_proposer)
            policy = self.policy
            return proposer, TreeStats(
                mode="tree",
                prompt_tokens=0,
                schedule=proposer.schedule,
                speculator_layers=proposer.num_layers,
                source="draft" if isinstance(proposer, DraftModelProposer) else "head",
                width=self.width,
                children=policy.max_children,
                accepted_by_sibling=[0] * max(policy.max_width, policy.max_children),
            )
        if use_head and proposer is None:
            raise SpdInputError(NEEDS_HEAD)
        proposer = proposer if use_head else None
        stats = PipelineStats(
            mode="spd" if proposer is not None else "pp",
            prompt_tokens=0,
            schedule=proposer.schedule if proposer is not None else "none",
            speculator_layers=proposer.num_layers if proposer is not None else 0,
        )
        return proposer, stats


def _renamed_n_stages(n_stages: int | None, stages: int | None) -> int | None:
    """:meth:`Engine.from_pretrained`'s stage count: ``n_stages``, or ``stages``, its old name (deprecated)."""
    if stages is not None:
        # stacklevel 3: the warning names from_pretrained's caller.
        warnings.warn("Engine.from_pretrained's stages= is now n_stages=", DeprecationWarning, stacklevel=3)
        if n_stages is not None and n_stages != stages:
            raise SpdInputError(f"n_stages={n_stages} and stages={stages} disagree; pass n_stages only")
        n_stages = stages
    return n_stages


def check_cut(n_stages, boundaries) -> None:
    """``n_stages`` a positive integer and ``boundaries`` a list of layer indices (or None): their types, before the
    target's layer count checks their values."""
    if n_stages is not None and (
        not isinstance(n_stages, numbers.Integral) or isinstance(n_stages, bool) or n_stages < 1
    ):
        raise SpdInputError(f"n_stages must be a positive integer (or None: the head's cut, else 1), got {n_stages!r}")
    if boundaries is not None and (
        not isinstance(boundaries, (list, tuple))
        or not all(isinstance(b, numbers.Integral) and not isinstance(b, bool) for b in boundaries)
    ):
        raise SpdInputError(f"boundaries must be a list of layer indices, e.g. [0, 8, 16, 23, 30], got {boundaries!r}")


@overload
def chain_proposer(staged: StagedModel, head: None, tokenizer=None) -> None: ...


@overload
def chain_proposer(staged: StagedModel, head: torch.nn.Module, tokenizer=None) -> Proposer: ...


def chain_proposer(staged: StagedModel, head: torch.nn.Module | None, tokenizer=None) -> Proposer | None:
    """The proposer of a chain with ``head`` (None: none, the standard pipeline); it checks the head fits the target."""
    if head is None:
        return None
    head_param = next(head.parameters())
    if head_param.dtype != staged.dtype or head_param.device != staged.device:
        raise SpdInputError(
            f"the speculator is {head_param.dtype} on {head_param.device} but the target is "
            f"{staged.dtype} on {staged.device}; load both with the same dtype and device"
        )
    if isinstance(head, Speculator) and head.config.schedule == "input" and head.config.max_depth == staged.n_stages:
        return SpdHeadProposer(head, staged, children=1, mode="spd", tokenizer=tokenizer)
    # a loaded head module makes the engine calls (spd/heads/interface.py); nn.Module's types cannot say so
    return HeadProposer(cast("SpeculationHead[Any]", head), staged, children=1, mode="spd", tokenizer=tokenizer)


def tree_proposer_of(staged: StagedModel, head, tokenizer, draft: Draft | None, children: int) -> Proposer:
    """The proposer of a tree: an SPD head (any other head through its engine calls), or else a loaded draft model
    (refused unless it shares the target's tokenizer)."""
    if head is not None and not isinstance(head, Speculator):
        return HeadProposer(head, staged, children, tokenizer=tokenizer)
    if head is not None:
        return SpdHeadProposer(head, staged, children, tokenizer=tokenizer)
    if draft is None:
        raise SpdInputError(NEEDS_PROPOSER)
    return DraftModelProposer(draft.model, staged, children, tokenizer, draft.tokenizer)


def tree_proposer(
    staged: StagedModel,
    head,
    tokenizer,
    draft_model: str | None,
    draft_revision: str | None,
    children: int,
    dtype: torch.dtype,
    device: str | torch.device,
) -> Proposer:
    """:func:`tree_proposer_of` with a draft model named by directory or hub id (loaded here when there is no head)."""
    draft = load_draft_model(draft_model, draft_revision, dtype, device) if head is None and draft_model else None
    return tree_proposer_of(staged, head, tokenizer, draft, children)
