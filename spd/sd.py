"""Classic speculative decoding on the whole target (``--mode sd``): serial drafting, the paper's baseline.

No pipeline: a token source drafts ``m`` tokens one after another (``--draft-steps``), then the target
runs the last committed token and the ``m`` drafts in **one** forward and verifies them left to right.
One *iteration*:

1. The draft model catches up on the committed tokens it has not run (at least the newest one) and
   drafts ``x_1..x_m``: greedy, its argmax; sampling, a draw from its warped distribution ``q_i``
   (temperature, top-k, top-p, as the target's).
2. The target runs ``[t, x_1..x_m]`` (``t`` the newest committed token) over its KV cache: the
   distributions ``p_1..p_{m+1}`` after ``t``, ``x_1``, ..., ``x_m``.
3. Verification, left to right: greedy, ``x_i`` is accepted iff it is ``argmax p_i``; sampling,
   with probability ``min(1, p_i(x_i) / q_i(x_i))`` (:func:`spd.tree.verify_sampled_recursive` with one
   candidate). At the first rejection the target's token replaces ``x_i`` (greedy: the argmax;
   sampling: a draw from ``normalise(max(p_i - q_i, 0))``) and the iteration ends; if every draft is
   accepted, a bonus token is drawn from ``p_{m+1}``. So an iteration commits ``a + 1`` tokens for
   ``a`` accepted drafts: the *acceptance length* (the bonus or replacement included, as the paper
   and EAGLE count it).
4. Both KV caches are cut back to the tokens that stay (``StageKVCache.truncate``).

Lossless: greedy output is the target's argmax chain (each committed token is ``argmax p`` after the
committed prefix); sampled output follows the target's warped distribution exactly (standard
speculative sampling; chi-square tested in ``tests/test_sd.py``).

Metrics (:class:`SdStats`): ``mean_acceptance_length`` ``L_acc`` = decode tokens per iteration, and
the paper's theoretical speedup ``L_acc * L / (L_s * m + L)`` for a drafter of ``L_s`` layers (a draft
model's layers counted as the target's, which favours the draft model: its layers are narrower). The
measured tokens/s is this process's real speed, comparable with ``--mode ar`` on the same target.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .engine import OneModeEngine, _stop_reason
from .errors import SpdInputError
from .generation import GenerationOutput, GenerationStats, OnToken, as_prompt_ids, check_request, eos_set
from .sampling import SamplingParams, select_token, warped_probs
from .staging import StagedModel, load_target_tokenizer
from .tree import verify_sampled_recursive
from .tree_engine import check_same_vocabulary, load_draft_model



@dataclass
class SdStats(GenerationStats):
    """GenerationStats plus what speculative decoding did (``as_dict()``: the CLI's ``--json`` stats)."""

    draft_steps: int = 0  # m
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


class SpeculativeDecoder(OneModeEngine):
    """Serial speculative decoding of a whole target with a draft model (one process, no pipeline)."""

    mode, engine_name = "sd", "speculative decoding"

    def __init__(self, target: StagedModel, draft: StagedModel, draft_steps: int = 4, tokenizer=None,
                 target_tokenizer=None, draft_tokenizer=None):
        if not isinstance(draft_steps, int) or draft_steps < 1:
            raise SpdInputError(f"the number of draft steps must be a positive integer, got {draft_steps!r}")
        if target.is_hybrid or draft.is_hybrid:
            raise SpdInputError("--mode sd does not run hybrid (linear-attention) models: the target verifies m drafts "
                                "in one forward and would need its recurrent state after each of them; use --mode "
                                "spd or pp")
        self.vocab = check_same_vocabulary(target, draft, target_tokenizer or tokenizer, draft_tokenizer)
        self.target, self.draft, self.draft_steps, self.tokenizer = target, draft, draft_steps, tokenizer
        self.staged = target  # OneModeEngine's name for the target

    @classmethod
    def from_pretrained(cls, target: str, draft: str, draft_steps: int = 4, revision: str | None = None,
                        draft_revision: str | None = None, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu", tokenizer: str | None = None) -> "SpeculativeDecoder":
        """Load a target and a draft model (directories or hub ids); the draft must share the target's tokenizer."""
        staged = StagedModel.from_pretrained(target, n_stages=1, revision=revision, dtype=dtype, device=device)
        tok = load_target_tokenizer(target, revision, tokenizer)
        return build_sd_engine(staged, tok, draft, draft_revision, draft_steps, dtype, device)

    @torch.inference_mode()
    def run(self, input_ids: Sequence[int] | torch.Tensor, max_new_tokens: int, sampling: SamplingParams,
            eos_token_id: int | Sequence[int] | None = None, on_token: OnToken | None = None) -> GenerationOutput:
        """The iterations of the module docstring (no EOS unless given)."""
        target, draft, m = self.target, self.draft, self.draft_steps
        prompt = as_prompt_ids(input_ids)
        budget = check_request(target, prompt, max_new_tokens)
        eos = eos_set(eos_token_id)
        stats = SdStats(mode="sd", prompt_tokens=len(prompt), draft_steps=m, draft_layers=draft.num_layers,
                        target_layers=target.num_layers, verified_by_position=[0] * m,
                        accepted_by_position=[0] * m)
        generator = None if sampling.greedy else sampling.generator(target.device)
        capacity = len(prompt) + budget + m + 1
        # The target runs 1 + m tokens and is cut back by up to m; KV caches truncate freely.
        target_caches = target.new_caches(capacity=capacity, rollback=m)
        draft_caches = draft.new_caches(capacity=capacity, rollback=m)

        t0 = time.perf_counter()
        hidden_1TD = target.forward_stages(self._ids(prompt, target), target_caches).hidden_BTD
        first = int(select_token(target.logits(hidden_1TD[:, -1]), sampling, generator)[0])
        stats.prefill_time_s = time.perf_counter() - t0
        out = [first]
        stats.token_acceptance.append(False)
        stop = _stop_reason(first, out, eos, budget, max_new_tokens)
        if on_token is not None and on_token(first, False) and not stop:
            stop = "stopped"
        context = prompt + [first]  # committed; every cache holds at most len(context) - 1 of them

        while not stop:
            steps = min(m, budget - len(out) - 1)  # an iteration commits at most steps + 1 tokens
            tick = time.perf_counter()
            drafts, qs = self._draft(context, draft_caches, steps, sampling, generator)
            stats.draft_time_s += time.perf_counter() - tick
            tick = time.perf_counter()
            start = target_caches[0].length
            hidden_1TD = target.forward_stages(self._ids([context[-1]] + drafts, target), target_caches).hidden_BTD
            logits_TV = target.logits(hidden_1TD[0])
            new, accepted = self._verify(logits_TV, drafts, qs, sampling, generator, stats)
            stats.target_time_s += time.perf_counter() - tick
            stats.iterations += 1
            stats.drafted += len(drafts)
            stats.accepted += accepted
            # Keep the rows of the newest committed token and the accepted drafts; the rest is cut.
            StagedModel.truncate(target_caches, start + 1 + accepted)
            StagedModel.truncate(draft_caches, min(draft_caches[0].length, start + 1 + accepted))
            for j, token in enumerate(new):
                out.append(token)
                context.append(token)
                stats.token_acceptance.append(j < accepted)
                stop = _stop_reason(token, out, eos, budget, max_new_tokens)
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
    @staticmethod
    def _ids(tokens: list[int], model: StagedModel) -> torch.Tensor:
        return torch.tensor([tokens], dtype=torch.long, device=model.device)

    def _draft(self, context: list[int], caches, steps: int, sampling: SamplingParams,
               generator: torch.Generator | None) -> tuple[list[int], list[torch.Tensor | None]]:
        """``steps`` drafts, one after another, and the warped distributions they were drawn from (greedy: None)."""
        draft, drafts, qs = self.draft, [], []
        if steps == 0:
            return drafts, qs
        pending = context[caches[0].length:]  # committed tokens the draft has not run (at least the newest)
        hidden_1TD = draft.forward_stages(self._ids(pending, draft), caches).hidden_BTD
        for i in range(steps):
            logits_1V = draft.logits(hidden_1TD[:, -1]).float()[:, :self.vocab]
            if sampling.greedy:
                token, q_V = int(torch.argmax(logits_1V, dim=-1)), None
            else:
                q_V = warped_probs(logits_1V, sampling)[0]
                token = int(torch.multinomial(q_V, 1, generator=generator))
            drafts.append(token)
            qs.append(q_V)
            if i + 1 < steps:
                hidden_1TD = draft.forward_stages(self._ids([token], draft), caches).hidden_BTD
        return drafts, qs

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


def build_sd_engine(staged: StagedModel, tokenizer, draft_model: str, draft_revision: str | None, draft_steps: int,
                    dtype: torch.dtype, device: str | torch.device) -> SpeculativeDecoder:
    """Serial speculative decoding of ``staged`` with a draft model (refused unless it shares the tokenizer)."""
    draft, draft_tokenizer = load_draft_model(draft_model, draft_revision, dtype, device)
    return SpeculativeDecoder(staged, draft, draft_steps, tokenizer, draft_tokenizer=draft_tokenizer)
