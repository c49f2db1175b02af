"""Classic speculative decoding on the whole target (``--mode sd``): serial drafting, the paper's baseline.

No pipeline: a proposer drafts ``m`` tokens one after another (``--draft-steps``), then the target
runs the last committed token and the ``m`` drafts in **one** forward and verifies them left to right.
The proposer is a :class:`~spd.decoding.proposers.Proposer`, the interface of the pipelined modes, growing a
chain rooted at the newest committed token one node at a time while the target is idle. Two fit: a draft model
(:class:`~spd.decoding.proposers.DraftModelProposer`), or our head trained with ``variant=eagle``
(:class:`~spd.decoding.proposers.SerialHeadProposer`, the paper's EAGLE-3 row): the serial schedule, where every row
the target has run enters the head's memory with the target's features (low, middle and last layer) and the newest
committed token and the head's own earlier drafts enter at depth 0 (their embeddings), as in training. One
*iteration*:

1. The proposer expands the chain ``m`` times (the draft model runs the committed tokens it has not run, at
   least the newest one, then each draft; the head queries its cached rows with the tokens the target has not
   run) and ``x_1..x_m`` are picked: greedy, its argmax; sampling, a draw from its warped distribution ``q_i``
   (temperature, top-k, top-p, as the target's).
2. The target runs ``[t, x_1..x_m]`` (``t`` the newest committed token) over its KV cache: the
   distributions ``p_1..p_{m+1}`` after ``t``, ``x_1``, ..., ``x_m``.
3. Verification, left to right: greedy, ``x_i`` is accepted iff it is ``argmax p_i``; sampling,
   with probability ``min(1, p_i(x_i) / q_i(x_i))`` (:func:`spd.decoding.verify.verify_sampled_recursive` with one
   candidate). At the first rejection the target's token replaces ``x_i`` (greedy: the argmax;
   sampling: a draw from ``normalise(max(p_i - q_i, 0))``) and the iteration ends; if every draft is
   accepted, a bonus token is drawn from ``p_{m+1}``. So an iteration commits ``a + 1`` tokens for
   ``a`` accepted drafts: the *acceptance length* (the bonus or replacement included, as the paper
   and EAGLE count it).
4. The target's KV cache is cut back to the tokens that stay (``StageKVCache.truncate``); each row that
   stays is committed to the proposer (``commit_root``: the head caches the target's features of it) and the
   chain is dropped (``reset``: the draft model's cache is cut back to the rows that stay).

Lossless: greedy output is the target's argmax chain (each committed token is ``argmax p`` after the
committed prefix); sampled output follows the target's warped distribution exactly (standard
speculative sampling; chi-square tested in ``tests/test_sd.py``).

Metrics (:class:`~spd.decoding.stats.SdStats`): ``mean_acceptance_length`` ``L_acc`` = decode tokens per iteration, and
the paper's theoretical speedup ``L_acc * L / (L_s * m + L)`` for a drafter of ``L_s`` layers (a draft
model's layers counted as the target's, which favours the draft model: its layers are narrower; the
head's ``L_s`` decoder layers, its LM head not counted, as the paper counts it). The
measured tokens/s is this process's real speed, comparable with ``--mode ar`` on the same target.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from ..errors import SpdInputError
from ..target.kv_cache import StageKVCache
from ..target.staging import StagedModel
from ..target.tokenizer import load_target_tokenizer
from .generation import GenerationOutput, OnToken, as_prompt_ids, check_request, eos_set, first_output, stop_reason
from .modes import check_proposer
from .proposers import Draft, DraftModelProposer, Proposer, SerialHeadProposer, load_draft_model
from .request import Generates
from .sampling import SamplingParams, select_token, warped_probs
from .spec import DecodingSpec
from .stats import SdStats
from .tree import Level, TokenTree
from .verify import verify_sampled_recursive


def _ids(tokens: list[int], model: StagedModel) -> torch.Tensor:
    return torch.tensor([tokens], dtype=torch.long, device=model.device)


def _pick(
    logprobs_1X: torch.Tensor,
    ids_X: torch.Tensor | None,
    vocab: int,
    sampling: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[int, float, torch.Tensor | None]:
    """A draft from the proposer's log-probabilities over its outputs X (``ids_X`` maps them to target ids): greedy,
    the argmax (no q); sampling, a draw from the warped q, returned over the target's ``vocab``."""
    if sampling.greedy:
        index = int(torch.argmax(logprobs_1X, dim=-1))
        q_V = None
    else:
        q_X = warped_probs(logprobs_1X, sampling)[0]
        index = int(torch.multinomial(q_X, 1, generator=generator))
        q_V = q_X if ids_X is None else q_X.new_zeros(vocab).index_copy_(0, ids_X.to(q_X.device), q_X)
    token = index if ids_X is None else int(ids_X[index])
    return token, float(logprobs_1X[0, index]), q_V


def serial_proposer(
    drafter: Proposer | StagedModel, target: StagedModel, target_tokenizer=None, draft_tokenizer=None
) -> Proposer:
    """The proposer that drafts serially for ``target``: a bare StagedModel is a draft model; a proposer is kept.

    Two fit: a draft model (:class:`~spd.decoding.proposers.DraftModelProposer`, sharing the target's tokenizer) and
    our head trained with variant=eagle (:class:`~spd.decoding.proposers.SerialHeadProposer`)."""
    if isinstance(drafter, StagedModel):
        if drafter.is_hybrid:
            raise SpdInputError(HYBRID_SD_ERROR)
        drafter = DraftModelProposer(drafter, target, 1, target_tokenizer, draft_tokenizer)
    if not isinstance(drafter, (DraftModelProposer, SerialHeadProposer)):
        raise SpdInputError(
            f"--mode sd drafts with a draft model or a head trained with variant=eagle, not with "
            f"{type(drafter).__name__}"
        )
    return drafter


HYBRID_SD_ERROR = (
    "--mode sd does not run hybrid (linear-attention) models: the target verifies m drafts in one "
    "forward and would need its recurrent state after each of them; use --mode spd or pp"
)


class SpeculativeDecoder(Generates):
    """Serial speculative decoding of a whole target with a drafter (one process, no pipeline)."""

    mode, engine_name = "sd", "speculative decoding"

    def __init__(
        self,
        target: StagedModel,
        drafter: Proposer | StagedModel,
        draft_steps: int = 4,
        tokenizer=None,
        target_tokenizer=None,
        draft_tokenizer=None,
    ):
        """``drafter``: a :class:`~spd.decoding.proposers.DraftModelProposer` or
        :class:`~spd.decoding.proposers.SerialHeadProposer` (a bare StagedModel is a draft model)."""
        if not isinstance(draft_steps, int) or draft_steps < 1:
            raise SpdInputError(f"the number of draft steps must be a positive integer, got {draft_steps!r}")
        if target.is_hybrid:
            raise SpdInputError(HYBRID_SD_ERROR)
        if target.n_stages != 1:
            raise SpdInputError(f"--mode sd runs the whole target as one stage, but it was cut into {target.n_stages}")
        self.proposer = serial_proposer(drafter, target, target_tokenizer or tokenizer, draft_tokenizer)
        self.target, self.draft_steps, self.tokenizer = target, draft_steps, tokenizer
        self.staged = target  # Generates' name for the target
        # The cost model counts a draft model's layers (it runs serially here, not hidden behind a stage).
        proposer = self.proposer
        is_draft = isinstance(proposer, DraftModelProposer)
        self.source = "draft" if is_draft else "head"
        self.draft_layers = (
            proposer.draft.num_layers if isinstance(proposer, DraftModelProposer) else proposer.num_layers
        )

    @classmethod
    def from_pretrained(
        cls,
        target: str,
        draft: str | None = None,
        draft_steps: int = 4,
        revision: str | None = None,
        draft_revision: str | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        tokenizer: str | None = None,
        head: str | None = None,
        head_revision: str | None = None,
    ) -> SpeculativeDecoder:
        """Load a target and a drafter (directories or hub ids): a ``draft`` model sharing the target's tokenizer,
        or a ``head`` trained with variant=eagle."""
        from .loader import load_parts, resolve_cut

        spec = DecodingSpec(
            "sd",
            target=target,
            revision=revision,
            tokenizer=tokenizer,
            speculator=head,
            speculator_revision=head_revision,
            draft_model=draft,
            draft_revision=draft_revision,
            draft_steps=draft_steps,
            device=str(device),
            dtype=str(dtype).removeprefix("torch."),
        )
        check_proposer("sd", head is not None, draft is not None)
        cut = resolve_cut(spec)  # the sources and the head's fit, before anything loads
        parts = load_parts(spec, load_target_tokenizer(target, revision, tokenizer), cut)
        return sd_engine(parts.staged, parts.tokenizer, draft_steps, head=parts.head, draft=parts.draft)

    @torch.inference_mode()
    def run(
        self,
        input_ids: Sequence[int] | torch.Tensor,
        max_new_tokens: int,
        sampling: SamplingParams,
        eos_token_id: int | Sequence[int] | None = None,
        on_token: OnToken | None = None,
    ) -> GenerationOutput:
        """The iterations of the module docstring (no EOS unless given)."""
        target, proposer, m = self.target, self.proposer, self.draft_steps
        prompt = as_prompt_ids(input_ids)
        budget = check_request(target, prompt, max_new_tokens)
        eos = eos_set(eos_token_id)
        stats = SdStats(
            mode="sd",
            prompt_tokens=len(prompt),
            draft_steps=m,
            source=self.source,
            draft_layers=self.draft_layers,
            target_layers=target.num_layers,
            verified_by_position=[0] * m,
            accepted_by_position=[0] * m,
        )
        generator = None if sampling.greedy else sampling.generator(target.device)
        capacity = len(prompt) + budget + m + 1
        # The target runs 1 + m tokens and is cut back by up to m; KV caches truncate freely.
        target_caches = target.new_caches(capacity=capacity, rollback=m)
        anchors = proposer.prefill_anchors  # what the proposer keeps of every row the target runs

        t0 = time.perf_counter()
        prefill = target.forward_stages(_ids(prompt, target), target_caches, anchors=anchors)
        proposer.start(prompt, prefill.anchors, capacity)
        first = int(select_token(target.logits(prefill.hidden_BTD[:, -1]), sampling, generator)[0])
        stats.prefill_time_s = time.perf_counter() - t0
        out, stop = first_output(first, stats, eos, budget, max_new_tokens, on_token)
        context = prompt + [first]  # committed; the target's cache holds all but the newest

        while not stop:
            steps = min(m, budget - len(out) - 1)  # an iteration commits at most steps + 1 tokens
            new, accepted = self._iteration(context, steps, sampling, generator, stats, target_caches, anchors)
            for j, token in enumerate(new):
                out.append(token)
                context.append(token)
                stats.token_acceptance.append(j < accepted)
                stop = stop_reason(token, out, eos, budget, max_new_tokens)
                if on_token is not None and on_token(token, j < accepted) and not stop:
                    stop = "stopped"
                if stop:
                    break

        stats.wall_time_s = time.perf_counter() - t0
        stats.stop_reason = stop
        stats.new_tokens = len(out)
        stats.decode_tokens = len(out) - 1
        return GenerationOutput(out, stats, prompt)

    def _iteration(
        self,
        context: list[int],
        steps: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
        stats: SdStats,
        target_caches: list[StageKVCache],
        anchors: tuple[int, ...],
    ) -> tuple[list[int], int]:
        """One iteration after the committed ``context``: ``steps`` drafts, the target's forward over the newest
        committed token and them, their verification; the target's caches and the proposer keep the rows that stay.
        The tokens it commits (accepted drafts, then the replacement or bonus) and how many drafts were accepted."""
        target, proposer = self.target, self.proposer
        tick = time.perf_counter()
        drafts, qs = self._draft(context, steps, sampling, generator)
        stats.draft_time_s += time.perf_counter() - tick
        tick = time.perf_counter()
        start = target_caches[0].length
        run = target.forward_stages(_ids([context[-1]] + drafts, target), target_caches, anchors=anchors)
        logits_TV = target.logits(run.hidden_BTD[0])
        new, accepted = self._verify(logits_TV, drafts, qs, sampling, generator, stats)
        stats.target_time_s += time.perf_counter() - tick
        stats.iterations += 1
        stats.drafted += len(drafts)
        stats.accepted += accepted
        # Keep the rows of the newest committed token and the accepted drafts; the rest is cut.
        StagedModel.truncate(target_caches, start + 1 + accepted)
        tick = time.perf_counter()
        for i in range(1 + accepted):  # each kept row is committed, as a root leaving the last stage
            proposer.commit_root(
                Level(
                    start + i,
                    run.hidden_BTD[:, i : i + 1],
                    1,
                    anchors={a: h[0, i : i + 1] for a, h in run.anchors.items()},
                )
            )
        proposer.reset(start + 1 + accepted)  # the chain is gone; that many committed rows are final
        stats.draft_time_s += time.perf_counter() - tick
        return new, accepted

    @torch.inference_mode()
    def _draft(
        self, context: list[int], steps: int, sampling: SamplingParams, generator: torch.Generator | None
    ) -> tuple[list[int], list[torch.Tensor | None]]:
        """``steps`` drafts after the newest committed token ``context[-1]``, one after another: the proposer
        expands a chain rooted at it one node at a time; and the distributions q they were drawn from (greedy:
        None)."""
        proposer, vocab = self.proposer, self.target.vocab_size
        tree, drafts, qs = TokenTree(context[-1]), [], []
        for _ in range(steps):
            token, logprob, q_V = _pick(
                proposer.expand(tree, context[:-1], []), proposer.ids, vocab, sampling, generator
            )
            tree.append_child(token, logprob)
            drafts.append(token)
            qs.append(q_V)
        return drafts, qs

    # ------------------------------------------------------------------------------------ pieces
    def _verify(
        self,
        logits_TV: torch.Tensor,
        drafts: list[int],
        qs: list[torch.Tensor | None],
        sampling: SamplingParams,
        generator: torch.Generator | None,
        stats: SdStats,
    ) -> tuple[list[int], int]:
        """The tokens this iteration commits (accepted drafts, then the replacement or bonus) and how many drafts."""
        new = []
        for i, (x, q_V) in enumerate(zip(drafts, qs)):
            stats.verified_by_position[i] += 1
            if sampling.greedy:
                token = int(torch.argmax(logits_TV[i]))
                ok = token == x
            else:
                p_V = warped_probs(logits_TV[i : i + 1], sampling)[0]
                assert q_V is not None  # a sampled draft comes with its q (_pick)
                index, token = self._accept(p_V, x, self._padded(q_V, p_V), generator)
                ok = index is not None
            new.append(token)
            if not ok:
                return new, i
            stats.accepted_by_position[i] += 1
        bonus = select_token(logits_TV[len(drafts) : len(drafts) + 1], sampling, generator)
        return new + [int(bonus[0])], len(drafts)

    @staticmethod
    def _padded(q_V: torch.Tensor, p_V: torch.Tensor) -> torch.Tensor:
        """q over the target's vocabulary (a draft may have fewer rows: padding ids it never proposes)."""
        if q_V.shape[0] == p_V.shape[0]:
            return q_V.to(p_V.device)
        return torch.nn.functional.pad(q_V.to(p_V.device), (0, p_V.shape[0] - q_V.shape[0]))

    @staticmethod
    def _accept(
        p_V: torch.Tensor, token: int, q_V: torch.Tensor, generator: torch.Generator | None
    ) -> tuple[int | None, int]:
        """Speculative sampling for one draft: accept with min(1, p/q), else a draw from (p - q)+."""
        return verify_sampled_recursive(p_V, [token], q_V, generator)


def sd_engine(
    staged: StagedModel, tokenizer, draft_steps: int, head: torch.nn.Module | None = None, draft: Draft | None = None
) -> SpeculativeDecoder:
    """Serial speculative decoding of ``staged`` with one loaded drafter: ``head`` (trained with variant=eagle) or
    ``draft`` (a draft model, refused unless it shares the target's tokenizer)."""
    check_proposer("sd", head is not None, draft is not None)
    if head is not None:
        return SpeculativeDecoder(staged, SerialHeadProposer(head, staged), draft_steps, tokenizer)
    assert draft is not None  # check_proposer: exactly one drafter
    return SpeculativeDecoder(staged, draft.model, draft_steps, tokenizer, draft_tokenizer=draft.tokenizer)


def build_sd_engine(
    staged: StagedModel,
    tokenizer,
    draft_model: str | None,
    draft_revision: str | None,
    draft_steps: int,
    dtype: torch.dtype,
    device: str | torch.device,
    head: torch.nn.Module | None = None,
) -> SpeculativeDecoder:
    """:func:`sd_engine` with a draft model named by directory or hub id (loaded here when there is no head)."""
    check_proposer("sd", head is not None, draft_model is not None)
    draft = None
    if head is None:
        assert draft_model is not None  # check_proposer: exactly one drafter
        draft = load_draft_model(draft_model, draft_revision, dtype, device)
    return sd_engine(staged, tokenizer, draft_steps, head=head, draft=draft)
