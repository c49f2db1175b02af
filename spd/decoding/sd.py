"""Classic speculative decoding on the whole target (``--mode sd``): serial drafting, the paper's baseline.

No pipeline: a token source drafts ``m`` tokens one after another (``--draft-steps``), then the target
runs the last committed token and the ``m`` drafts in **one** forward and verifies them left to right.
Two token sources (*drafters*): a draft model (:class:`DraftModelDrafter`), or our head trained with
``variant=eagle`` (:class:`HeadDrafter`, the paper's EAGLE-3 row): the serial schedule, where every row the
target has run enters the head's memory with the target's features (low, middle and last layer) and the
newest committed token and the head's own earlier drafts enter at depth 0 (their embeddings), as in
training. One *iteration*:

1. The drafter catches up on the committed tokens (the draft model runs those it has not run, at least
   the newest one; the head caches the features of the rows the target ran) and drafts ``x_1..x_m``:
   greedy, its argmax; sampling, a draw from its warped distribution ``q_i`` (temperature, top-k, top-p,
   as the target's).
2. The target runs ``[t, x_1..x_m]`` (``t`` the newest committed token) over its KV cache: the
   distributions ``p_1..p_{m+1}`` after ``t``, ``x_1``, ..., ``x_m``.
3. Verification, left to right: greedy, ``x_i`` is accepted iff it is ``argmax p_i``; sampling,
   with probability ``min(1, p_i(x_i) / q_i(x_i))`` (:func:`spd.decoding.tree.verify_sampled_recursive` with one
   candidate). At the first rejection the target's token replaces ``x_i`` (greedy: the argmax;
   sampling: a draw from ``normalise(max(p_i - q_i, 0))``) and the iteration ends; if every draft is
   accepted, a bonus token is drawn from ``p_{m+1}``. So an iteration commits ``a + 1`` tokens for
   ``a`` accepted drafts: the *acceptance length* (the bonus or replacement included, as the paper
   and EAGLE count it).
4. The target's KV cache is cut back to the tokens that stay (``StageKVCache.truncate``), and so is the
   draft model's; the head caches the target's features of the rows that stay.

Lossless: greedy output is the target's argmax chain (each committed token is ``argmax p`` after the
committed prefix); sampled output follows the target's warped distribution exactly (standard
speculative sampling; chi-square tested in ``tests/test_sd.py``).

Metrics (:class:`SdStats`): ``mean_acceptance_length`` ``L_acc`` = decode tokens per iteration, and
the paper's theoretical speedup ``L_acc * L / (L_s * m + L)`` for a drafter of ``L_s`` layers (a draft
model's layers counted as the target's, which favours the draft model: its layers are narrower; the
head's ``L_s`` decoder layers, its LM head not counted, as the paper counts it). The
measured tokens/s is this process's real speed, comparable with ``--mode ar`` on the same target.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..heads.draft_vocab import check_draft_vocab
from ..errors import SpdInputError
from .generation import (GenerationOutput, GenerationStats, OnToken, as_prompt_ids, check_request, eos_set,
                         stop_reason)
from .request import OneModeEngine
from .sampling import SamplingParams, select_token, warped_probs
from ..heads.config import check_compatible
from ..heads.speculator import Speculator
from ..target.staging import StagedModel, load_target_tokenizer
from .tree import verify_sampled_recursive
from .tree_engine import check_same_vocabulary, load_draft_model


@dataclass
class SdStats(GenerationStats):
    """GenerationStats plus what speculative decoding did (``as_dict()``: the CLI's ``--json`` stats)."""

    draft_steps: int = 0  # m
    source: str = "draft"  # the drafter: "draft" (a draft model) or "head" (variant eagle)
    iterations: int = 0  # target forwards after the prefill (one per verification)
    decode_tokens: int = 0  # tokens committed by iterations (new_tokens - 1)
    drafted: int = 0
    accepted: int = 0  # drafts accepted
    # accepted_by_position[i] / verified_by_position[i]: acceptance of the (i+1)-th draft of an iteration.
    verified_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    draft_layers: int = 0  # L_s
    target_layers: int = 0  # L
    draft_time_s: float = 0.0
    target_time_s: float = 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """L_acc: tokens committed per iteration, the bonus / replacement token included."""
        return self.decode_tokens / self.iterations if self.iterations else 0.0

    @property
    def theoretical_speedup(self) -> float:
        """``L_acc * L / (L_s * m + L)`` (the paper's EAGLE row): m serial draft steps, then one target forward."""
        if not self.iterations:
            return 0.0
        return self.mean_acceptance_length * self.target_layers / (
            self.draft_layers * self.draft_steps + self.target_layers)

    def as_dict(self) -> dict:
        d = super().as_dict()
        d["mean_acceptance_length"] = round(self.mean_acceptance_length, 4)
        d["theoretical_speedup"] = round(self.theoretical_speedup, 4)
        return d


def _ids(tokens: list[int], model: StagedModel) -> torch.Tensor:
    return torch.tensor([tokens], dtype=torch.long, device=model.device)


def _pick(logits_1V: torch.Tensor, sampling: SamplingParams,
          generator: torch.Generator | None) -> tuple[int, torch.Tensor | None]:
    """A draft from the drafter's logits: greedy, the argmax (no q); sampling, a draw from the warped q."""
    if sampling.greedy:
        return int(torch.argmax(logits_1V, dim=-1)), None
    q_V = warped_probs(logits_1V, sampling)[0]
    return int(torch.multinomial(q_V, 1, generator=generator)), q_V


class DraftModelDrafter:
    """A small causal LM with the target's tokenizer drafts; its KV cache follows the committed tokens."""

    source = "draft"
    anchors: tuple[int, ...] = ()  # it needs none of the target's hidden states

    def __init__(self, draft: StagedModel, target: StagedModel, target_tokenizer=None, draft_tokenizer=None):
        if draft.is_hybrid:
            raise SpdInputError(HYBRID_SD_ERROR)
        self.vocab = check_same_vocabulary(target, draft, target_tokenizer, draft_tokenizer)
        self.draft, self.num_layers = draft, draft.num_layers
        self.caches = []

    def start(self, prompt: list[int], anchors: dict[int, torch.Tensor], capacity: int, rollback: int) -> None:
        self.caches = self.draft.new_caches(capacity=capacity, rollback=rollback)

    def draft_tokens(self, context: list[int], steps: int, sampling: SamplingParams,
                     generator: torch.Generator | None) -> tuple[list[int], list[torch.Tensor | None]]:
        draft, caches, drafts, qs = self.draft, self.caches, [], []
        pending = context[caches[0].length:]  # committed tokens the draft has not run (at least the newest)
        hidden_1TD = draft.forward_stages(_ids(pending, draft), caches).hidden_BTD
        for i in range(steps):
            token, q_V = _pick(draft.logits(hidden_1TD[:, -1]).float()[:, :self.vocab], sampling, generator)
            drafts.append(token)
            qs.append(q_V)
            if i + 1 < steps:
                hidden_1TD = draft.forward_stages(_ids([token], draft), caches).hidden_BTD
        return drafts, qs

    def commit(self, kept: int, anchors: dict[int, torch.Tensor]) -> None:
        """The first ``kept`` committed tokens stay; the draft's cache keeps at most those rows."""
        StagedModel.truncate(self.caches, min(self.caches[0].length, kept))


class HeadDrafter:
    """Our head trained with ``variant=eagle`` drafts serially (see the module docstring).

    Its cache holds one memory row per token the target has run (the target's features at full depth); each
    draft step queries it with the rows in flight, the newest committed token and the drafts so far, at
    depth 0 (``g^0``: the token's embedding through ``FC_0``), the j-th draft seeing j of them.
    """

    source = "head"

    def __init__(self, head: Speculator, target: StagedModel):
        if not isinstance(head, Speculator):
            raise SpdInputError("--mode sd takes our heads trained with variant=eagle; the SPD authors' heads run "
                                "in --mode spd")
        check_compatible(head.config, target, mode="sd")
        check_draft_vocab(head, target.vocab_size)
        self.head, self.target, self.num_layers = head, target, head.config.num_layers
        self.anchors = tuple(head.prefill_anchors())
        self._dtype = next(head.parameters()).dtype  # the target's states are cast to it
        self.cache = None

    def start(self, prompt: list[int], anchors: dict[int, torch.Tensor], capacity: int, rollback: int) -> None:
        self.cache = self.head.new_cache(capacity=capacity)
        self.head.prefill_memory(self.cache, {a: h.to(self._dtype) for a, h in anchors.items()})

    def _row(self, token: int) -> torch.Tensor:
        """``g^0`` of a token (1, D): its embedding in the target, through the head's FC_0."""
        embedding_1D = self.target.embed(_ids([token], self.target))[0].to(self._dtype)
        return self.head.features(0, {0: embedding_1D})

    def draft_tokens(self, context: list[int], steps: int, sampling: SamplingParams,
                     generator: torch.Generator | None) -> tuple[list[int], list[torch.Tensor | None]]:
        trailing = [(0, self._row(token)) for token in context[self.cache.length:]]  # the newest committed token
        drafts, qs = [], []
        for i in range(steps):
            logits_1V = self.head.vocab_logits(self.head.query(self.cache, trailing, trailing[-1][1])).float()
            token, q_V = _pick(logits_1V, sampling, generator)
            drafts.append(token)
            qs.append(q_V)
            if i + 1 < steps:
                trailing.append((0, self._row(token)))
        return drafts, qs

    def commit(self, kept: int, anchors: dict[int, torch.Tensor]) -> None:
        """The target ran rows ``cache.length ..`` with ``anchors``; the first ``kept - cache.length`` stay."""
        rows = kept - self.cache.length
        if rows > 0:
            depth = self.head.config.max_depth
            self.head.append_memory(self.cache, self.head.features(
                depth, {a: anchors[a][:, :rows].to(self._dtype) for a in self.head.config.anchors[depth]}))


HYBRID_SD_ERROR = ("--mode sd does not run hybrid (linear-attention) models: the target verifies m drafts in one "
                   "forward and would need its recurrent state after each of them; use --mode spd or pp")


class SpeculativeDecoder(OneModeEngine):
    """Serial speculative decoding of a whole target with a drafter (one process, no pipeline)."""

    mode, engine_name = "sd", "speculative decoding"

    def __init__(self, target: StagedModel, drafter: "DraftModelDrafter | HeadDrafter | StagedModel",
                 draft_steps: int = 4, tokenizer=None, target_tokenizer=None, draft_tokenizer=None):
        """``drafter``: a :class:`DraftModelDrafter` or :class:`HeadDrafter` (a bare StagedModel is a draft model)."""
        if not isinstance(draft_steps, int) or draft_steps < 1:
            raise SpdInputError(f"the number of draft steps must be a positive integer, got {draft_steps!r}")
        if target.is_hybrid:
            raise SpdInputError(HYBRID_SD_ERROR)
        if target.n_stages != 1:
            raise SpdInputError(f"--mode sd runs the whole target as one stage, but it was cut into {target.n_stages}")
        if isinstance(drafter, StagedModel):
            drafter = DraftModelDrafter(drafter, target, target_tokenizer or tokenizer, draft_tokenizer)
        self.target, self.drafter, self.draft_steps, self.tokenizer = target, drafter, draft_steps, tokenizer
        self.staged = target  # OneModeEngine's name for the target

    @classmethod
    def from_pretrained(cls, target: str, draft: str | None = None, draft_steps: int = 4,
                        revision: str | None = None, draft_revision: str | None = None,
                        dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                        tokenizer: str | None = None, head: str | None = None,
                        head_revision: str | None = None) -> "SpeculativeDecoder":
        """Load a target and a drafter (directories or hub ids): a ``draft`` model sharing the target's tokenizer,
        or a ``head`` trained with variant=eagle."""
        staged = StagedModel.from_pretrained(target, n_stages=1, revision=revision, dtype=dtype, device=device)
        tok = load_target_tokenizer(target, revision, tokenizer)
        loaded = None
        if head is not None:
            from ..heads.loading import load_speculator

            loaded = load_speculator(head, head_revision, dtype, device, target=staged)
        return build_sd_engine(staged, tok, draft, draft_revision, draft_steps, dtype, device, head=loaded)

    @torch.inference_mode()
    def run(self, input_ids: Sequence[int] | torch.Tensor, max_new_tokens: int, sampling: SamplingParams,
            eos_token_id: int | Sequence[int] | None = None, on_token: OnToken | None = None) -> GenerationOutput:
        """The iterations of the module docstring (no EOS unless given)."""
        target, drafter, m = self.target, self.drafter, self.draft_steps
        prompt = as_prompt_ids(input_ids)
        budget = check_request(target, prompt, max_new_tokens)
        eos = eos_set(eos_token_id)
        stats = SdStats(mode="sd", prompt_tokens=len(prompt), draft_steps=m, source=drafter.source,
                        draft_layers=drafter.num_layers, target_layers=target.num_layers,
                        verified_by_position=[0] * m, accepted_by_position=[0] * m)
        generator = None if sampling.greedy else sampling.generator(target.device)
        capacity = len(prompt) + budget + m + 1
        # The target runs 1 + m tokens and is cut back by up to m; KV caches truncate freely.
        target_caches = target.new_caches(capacity=capacity, rollback=m)

        t0 = time.perf_counter()
        prefill = target.forward_stages(_ids(prompt, target), target_caches, anchors=drafter.anchors)
        drafter.start(prompt, prefill.anchors, capacity, m)
        first = int(select_token(target.logits(prefill.hidden_BTD[:, -1]), sampling, generator)[0])
        stats.prefill_time_s = time.perf_counter() - t0
        out = [first]
        stats.token_acceptance.append(False)
        stop = stop_reason(first, out, eos, budget, max_new_tokens)
        if on_token is not None and on_token(first, False) and not stop:
            stop = "stopped"
        context = prompt + [first]  # committed; the target's cache holds all but the newest

        while not stop:
            steps = min(m, budget - len(out) - 1)  # an iteration commits at most steps + 1 tokens
            tick = time.perf_counter()
            drafts, qs = drafter.draft_tokens(context, steps, sampling, generator) if steps else ([], [])
            stats.draft_time_s += time.perf_counter() - tick
            tick = time.perf_counter()
            start = target_caches[0].length
            run = target.forward_stages(_ids([context[-1]] + drafts, target), target_caches, anchors=drafter.anchors)
            logits_TV = target.logits(run.hidden_BTD[0])
            new, accepted = self._verify(logits_TV, drafts, qs, sampling, generator, stats)
            stats.target_time_s += time.perf_counter() - tick
            stats.iterations += 1
            stats.drafted += len(drafts)
            stats.accepted += accepted
            # Keep the rows of the newest committed token and the accepted drafts; the rest is cut.
            StagedModel.truncate(target_caches, start + 1 + accepted)
            tick = time.perf_counter()
            drafter.commit(start + 1 + accepted, run.anchors)
            stats.draft_time_s += time.perf_counter() - tick
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

    # ------------------------------------------------------------------------------------ pieces
    def _verify(self, logits_TV: torch.Tensor, drafts: list[int], qs: list[torch.Tensor | None],
                sampling: SamplingParams, generator: torch.Generator | None,
                stats: SdStats) -> tuple[list[int], int]:
        """The tokens this iteration commits (accepted drafts, then the replacement or bonus) and how many drafts."""
        new = []
        for i, (x, q_V) in enumerate(zip(drafts, qs)):
            stats.verified_by_position[i] += 1
            if sampling.greedy:
                token = int(torch.argmax(logits_TV[i]))
                ok = token == x
            else:
                p_V = warped_probs(logits_TV[i:i + 1], sampling)[0]
                index, token = self._accept(p_V, x, self._padded(q_V, p_V), generator)
                ok = index is not None
            new.append(token)
            if not ok:
                return new, i
            stats.accepted_by_position[i] += 1
        bonus = select_token(logits_TV[len(drafts):len(drafts) + 1], sampling, generator)
        return new + [int(bonus[0])], len(drafts)

    @staticmethod
    def _padded(q_V: torch.Tensor, p_V: torch.Tensor) -> torch.Tensor:
        """q over the target's vocabulary (a draft may have fewer rows: padding ids it never proposes)."""
        if q_V.shape[0] == p_V.shape[0]:
            return q_V.to(p_V.device)
        return torch.nn.functional.pad(q_V.to(p_V.device), (0, p_V.shape[0] - q_V.shape[0]))

    @staticmethod
    def _accept(p_V: torch.Tensor, token: int, q_V: torch.Tensor,
                generator: torch.Generator | None) -> tuple[int | None, int]:
        """Speculative sampling for one draft: accept with min(1, p/q), else a draw from (p - q)+."""
        return verify_sampled_recursive(p_V, [token], q_V, generator)


def build_sd_engine(staged: StagedModel, tokenizer, draft_model: str | None, draft_revision: str | None,
                    draft_steps: int, dtype: torch.dtype, device: str | torch.device,
                    head: Speculator | None = None) -> SpeculativeDecoder:
    """Serial speculative decoding of ``staged`` with a draft model (refused unless it shares the tokenizer) or
    with ``head``, a loaded head trained with variant=eagle."""
    if (head is None) == (draft_model is None):
        raise SpdInputError("--mode sd takes one drafter: --draft-model DIR_OR_ID (a small causal LM with the "
                            "target's tokenizer) or --speculator DIR_OR_ID (a head trained with variant=eagle)")
    if head is not None:
        return SpeculativeDecoder(staged, HeadDrafter(head, staged), draft_steps, tokenizer)
    draft, draft_tokenizer = load_draft_model(draft_model, draft_revision, dtype, device)
    return SpeculativeDecoder(staged, draft, draft_steps, tokenizer, draft_tokenizer=draft_tokenizer)
