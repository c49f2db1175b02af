"""The pipelined SPD inference engine (single process): the semantic reference of docs/method.md §5.

The target is cut into ``n`` stages, each with its own KV cache. Every **step** each in-flight token
advances by one stage; the token that completes stage ``n`` exits, its final hidden state gives the
target's distribution ``p`` for the next position, and that position's token (the next-oldest in
flight, speculated ``n - 1`` steps earlier) is verified against ``p``:

- accept: it is final, the pipeline runs on (one committed token per step in the steady state);
- reject: the replacement drawn from ``p`` (greedy: ``argmax p``; sampling: the residual
  ``max(p - q, 0)``) is final; every younger in-flight token and the step's proposal are discarded,
  every stage's KV cache and the speculator's cache are truncated to the committed length, and the
  replacement enters stage 1 alone (flush and reseed, paper section 3.6).

A token source proposes one token per step. With a speculation head it reads the *input state*
(docs/method.md §3: the newest token at depth 0, in-flight tokens at their depths, everything older at
depth ``n``), so in a real deployment it runs concurrently with the stages. The output-state ablation
and the PPSD baseline are the same head with other settings (``schedule="output"``: the head reads
the state after the stages have run, so it is serial with them). With no head the engine is the
standard pipeline (``pp``): one token in flight, ``K = n * N``.

Why the output is lossless: a stage processes a token at position ``P`` only after every position
``< P`` passed it, so its KV cache always holds exactly the positions before ``P``, and on a flush the
caches are cut back to the committed tokens. The target therefore computes for every committed token
the same function of the same committed prefix as autoregressive decoding does, and verification is
exact (greedy: equality with argmax; sampling: standard speculative rejection sampling).

Metrics (docs/method.md §5): ``K`` steps, ``N`` tokens committed by decode steps (the first new token,
taken from the prefill logits, is not one; ``new_tokens = N + 1`` counts it), ``alpha = N / K``,
``L'_acc = n * N / K``, theoretical speedups of paper section 4.2.

Shape suffixes: B batch (always 1 here), T tokens, D hidden size, V vocabulary.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..errors import SpdInputError
from .generation import (GenerationOutput, GenerationStats, OnToken, as_prompt_ids, check_request, default_eos,
                         eos_set, generate_ar)
from .sampling import SamplingParams, warped_probs
from .tree import verify_sampled_recursive
from ..heads.draft_vocab import check_draft_vocab
from ..heads.config import check_compatible
from ..heads.speculator import Speculator, SpeculatorCache
from ..target.staging import StageKVCache, StagedModel, StageOutput, load_target_tokenizer

MODES = ("spd", "pp", "ar")


# ------------------------------------------------------------------------------------------ statistics


@dataclass
class PipelineStats(GenerationStats):
    """GenerationStats plus what the pipeline did (``as_dict()`` is the CLI's ``--json`` stats object)."""

    stages: int = 1
    steps: int = 0  # K: pipeline steps after the prefill
    decode_tokens: int = 0  # N: tokens committed by decode steps (new_tokens - 1)
    proposals: int = 0  # tokens the head put into the pipeline
    verified: int = 0  # proposals that reached verification (the rest were flushed or outlived the stop)
    accepted: int = 0
    flushes: int = 0  # rejections (each flushes the pipeline)
    # Acceptance by position in the pipeline: index k-1 counts the k-th proposal after a (re)seed, the n-th
    # and later ones (the full pipeline) in the last entry. For the input-state schedule k is the fill a.
    verified_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    schedule: str = "none"  # the head's schedule ("input" / "output"), "none" for pp
    speculator_layers: int = 0  # L_s
    target_layers: int = 0  # L
    stage_time_s: float = 0.0  # time inside target stages during decode
    speculator_time_s: float = 0.0  # time inside the head during decode
    verify_time_s: float = 0.0  # final norm + LM head + verification

    @property
    def acceptance_rate(self) -> float:
        """alpha = N / K (paper section 4.2)."""
        return self.decode_tokens / self.steps if self.steps else 0.0

    @property
    def equivalent_accept_length(self) -> float:
        """L'_acc = n * N / K: the theoretical speedup of SPD over autoregressive decoding."""
        return self.stages * self.acceptance_rate

    @property
    def theoretical_speedup(self) -> float:
        """Paper section 4.2 for the configured variant, one layer costing 1/L of a full forward.

        Input-state head (SPD): its latency is hidden behind a stage when ``L_s <= L / n``, so a step costs
        ``max(1/n, L_s/L)``; output-state heads (the ablation, PPSD) run after the stages: ``1/n + L_s/L``.
        """
        if self.steps == 0:
            return 0.0
        n, big_l, l_s = self.stages, self.target_layers, self.speculator_layers
        step_cost = 1 / n
        if self.schedule == "input":
            step_cost = max(1 / n, l_s / big_l)
        elif self.schedule == "output":
            step_cost = 1 / n + l_s / big_l
        return self.decode_tokens / (self.steps * step_cost)

    @property
    def proposal_acceptance(self) -> float:
        """Accepted / verified proposals."""
        return self.accepted / self.verified if self.verified else 0.0

    @property
    def engine_overhead_per_step_ms(self) -> float:
        """Decode time outside the stages, the head and verification, per step (Python bookkeeping)."""
        decode = self.wall_time_s - self.prefill_time_s
        other = decode - self.stage_time_s - self.speculator_time_s - self.verify_time_s
        return 1000 * other / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        d = super().as_dict()
        for key in ("stage_time_s", "speculator_time_s", "verify_time_s"):
            d[key] = round(d[key], 4)
        d.update(
            acceptance_rate=round(self.acceptance_rate, 4),
            equivalent_accept_length=round(self.equivalent_accept_length, 4),
            theoretical_speedup=round(self.theoretical_speedup, 4),
            proposal_acceptance=round(self.proposal_acceptance, 4),
            engine_overhead_per_step_ms=round(self.engine_overhead_per_step_ms, 4),
        )
        return d


# --------------------------------------------------------------------------------------------- state


@dataclass
class Slot:
    """One in-flight token: where it is in the pipeline and what it has produced so far."""

    token: int
    position: int
    hidden_1TD: torch.Tensor  # input of the next stage (the embedding at depth 0)
    depth: int = 0  # stages completed
    anchors: dict[int, torch.Tensor] = field(default_factory=dict)  # H^l (1, D) the head reads
    q_V: torch.Tensor | None = None  # the head's warped distribution when it proposed this token (sampling)
    rank: int = 0  # k-th proposal after the last (re)seed, capped at n (0: a seed, not a proposal)


class LocalStages:
    """All ``n`` stages in this process, each with its own KV cache: the reference backend of the engine.

    The engine talks to its stages only through these methods; :class:`spd.runtime.remote.RemoteStages` implements
    them over ``torch.distributed`` (one process per stage).
    """

    def __init__(self, staged: StagedModel):
        self.staged = staged
        self.caches: list[StageKVCache] = []
        self.stage_anchors: list[list[int]] = [[] for _ in range(staged.n_stages)]

    def configure(self, stage_anchors: list[list[int]]) -> None:
        """Which hidden states ``H^l`` each stage reports for the head (empty lists: none)."""
        self.stage_anchors = stage_anchors

    def prefill(self, prompt_ids_1T: torch.Tensor, anchors: list[int], capacity: int) -> StageOutput:
        """Start a request: fresh caches, the prompt through every stage; H^L and ``anchors`` for all positions."""
        self.caches = self.staged.new_caches(capacity=capacity)
        return self.staged.forward_stages(prompt_ids_1T, self.caches, anchors=anchors)

    def launch(self, inflight: list[Slot], early: bool = False) -> None:
        """Hand the newest slot, if it is about to enter stage 1, to the stages.

        ``early``: the slot is a proposal made before this step's verification, which may still flush it
        (remote stages start on it at once or once the step is verified; here it runs next step).
        """

    def collect(self, inflight: list[Slot]) -> None:
        """Finish the step: every in-flight slot has advanced by one stage (hidden, anchors, depth)."""
        for slot in inflight:
            stage = slot.depth
            out = self.staged.run_stage(stage, slot.hidden_1TD, self.caches[stage], anchors=self.stage_anchors[stage])
            for index, hidden_1TD in out.anchors.items():
                slot.anchors[index] = hidden_1TD[:, 0]
            slot.hidden_1TD = out.hidden_BTD
            slot.depth += 1

    def flush(self, length: int) -> None:
        """Drop every in-flight activation and cut every stage's KV cache to ``length`` tokens."""
        self.staged.truncate(self.caches, length)


class PipelineEngine:
    """Runs one request at a time through the staged target, with a speculation head (``spd``) or without
    (``pp``); ``ar`` delegates to plain autoregressive decoding. See the module docstring."""

    def __init__(self, staged: StagedModel, speculator: Speculator | None = None, tokenizer=None,
                 stages: LocalStages | None = None):
        if speculator is not None:
            check_compatible(speculator.config, staged, mode="spd")
            if isinstance(speculator, Speculator):
                check_draft_vocab(speculator, staged.vocab_size, tokenizer)
            head_param = next(speculator.parameters())
            if head_param.dtype != staged.dtype or head_param.device != staged.device:
                raise SpdInputError(f"the speculator is {head_param.dtype} on {head_param.device} but the target is "
                                    f"{staged.dtype} on {staged.device}; load both with the same dtype and device")
        self.staged = staged
        self.speculator = speculator
        self.tokenizer = tokenizer
        n, b = staged.n_stages, staged.boundaries
        needed = set(speculator.needed_anchors()) if speculator is not None else set()
        # Anchors each stage hands to the head: H^l for l in [b[s], b[s+1]] (H^{b[s]} is the stage's input).
        self._stage_anchors = [sorted(a for a in needed if b[s] < a <= b[s + 1]) for s in range(n)]
        self._needs_embedding = 0 in needed
        self.stages = stages if stages is not None else LocalStages(staged)

    @classmethod
    def from_pretrained(cls, target: str, speculator: str | None = None, stages: int | None = None,
                        revision: str | None = None, speculator_revision: str | None = None,
                        dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                        tokenizer: str | None = None, boundaries: list[int] | None = None) -> "PipelineEngine":
        """Load a target (directory or hub id), cut it into ``stages`` (default: the head's cut), and a head.

        ``boundaries`` cuts it unevenly (e.g. ``[0, 8, 16, 23, 30]``). The tokenizer is ``tokenizer`` or the
        target's; a target without one gives an engine for token-id prompts.
        """
        from ..heads.loading import load_speculator, pipeline_cut

        stages, boundaries = pipeline_cut(stages, boundaries, speculator, speculator_revision, target, revision)
        staged = StagedModel.from_pretrained(target, n_stages=stages, boundaries=boundaries, revision=revision,
                                             dtype=dtype, device=device)
        head = load_speculator(speculator, speculator_revision, dtype, device, target=staged) if speculator else None
        return cls(staged, head, load_target_tokenizer(target, revision, tokenizer))

    # ------------------------------------------------------------------------------------- public
    def generate(self, prompt: str | Sequence[int] | torch.Tensor, max_new_tokens: int = 128, mode: str | None = None,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 eos_token_id: int | Sequence[int] | None = None,
                 streamer: Callable[[int], None] | object | None = None,
                 on_token: OnToken | None = None) -> GenerationOutput:
        """Generate from a prompt (text needs a tokenizer) or token ids; ``mode`` defaults to spd with a head.

        ``streamer`` is a callable taking each committed token id, or an object with ``put``/``end`` (a
        Hugging Face ``TextStreamer``); ``on_token(token, accepted)`` also gets the token's
        ``stats.token_acceptance`` flag and may return True to end the generation after that token
        (``stop_reason`` "stopped": stop strings, cancelled requests). ``eos_token_id`` defaults as in
        ``model.generate`` (:func:`default_eos`).
        """
        mode = mode or ("spd" if self.speculator is not None else "pp")
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)

        def decode(prompt_ids, eos, on_token):
            if mode == "spd" and self.speculator is None:
                raise SpdInputError("mode 'spd' needs a speculation head; pass a speculator or use mode 'pp'")
            if mode not in MODES:
                raise SpdInputError(f"unknown mode '{mode}'; expected one of: {', '.join(MODES)}")
            return self.run(prompt_ids, max_new_tokens, sampling, eos, on_token, use_head=mode == "spd")

        return generate_request(self.staged, self.tokenizer, prompt, max_new_tokens, mode, sampling, eos_token_id,
                                streamer, decode, on_token)

    @torch.inference_mode()
    def run(self, input_ids: Sequence[int] | torch.Tensor, max_new_tokens: int, sampling: SamplingParams,
            eos_token_id: int | Sequence[int] | None = None, on_token: OnToken | None = None,
            use_head: bool = True) -> GenerationOutput:
        """The step loop of docs/method.md §5 (``use_head=False``: the standard pipeline); no EOS unless given."""
        staged = self.staged
        head = self.speculator if use_head else None
        prompt = as_prompt_ids(input_ids)
        budget = check_request(staged, prompt, max_new_tokens)
        eos = eos_set(eos_token_id)
        n = staged.n_stages
        end_position = len(prompt) + budget  # positions >= this are never committed
        schedule = head.config.schedule if head is not None else "none"
        stats = PipelineStats(mode="spd" if head is not None else "pp", prompt_tokens=len(prompt), stages=n,
                              verified_by_position=[0] * n, accepted_by_position=[0] * n, schedule=schedule,
                              speculator_layers=head.config.num_layers if head is not None else 0,
                              target_layers=staged.num_layers)
        generator = None if sampling.greedy else sampling.generator(staged.device)
        head_cache = head.new_cache(capacity=end_position + n) if head is not None else None
        self.stages.configure(self._stage_anchors if head is not None else [[] for _ in range(n)])

        t0 = time.perf_counter()
        first = self._prefill(prompt, end_position + n, head, head_cache, sampling, generator)
        stats.prefill_time_s = time.perf_counter() - t0
        out, stop = first_output(first, stats, eos, budget, max_new_tokens, on_token)
        inflight = [self._enter(first, len(prompt))]

        while not stop:
            stats.steps += 1
            proposal = None
            self.stages.launch(inflight)
            exits = inflight[0].depth == n - 1  # a token leaves stage n this step and is verified
            # 1. Input-state speculation reads the state at the start of the step (concurrent with 2).
            if head is not None and schedule == "input" and inflight[-1].position + 1 < end_position:
                proposal = self._propose(head, head_cache, inflight, sampling, generator, stats)
                # Remote stage 1 may start on it at once; if this step verifies a token, a flush can still
                # invalidate it (``early``); the single-process backend runs it next step either way.
                self.stages.launch([proposal], early=exits)
            # 2. Every stage advances the token it holds. The token leaving stage n is collected first, so
            #    that its verification (3) releases stage 1's next token before the other reports are read.
            tick = time.perf_counter()
            self.stages.collect(inflight[:1] if exits else inflight)
            stats.stage_time_s += time.perf_counter() - tick
            if not exits:
                if head is not None:
                    self._retire_rows(head, head_cache, inflight)
            else:
                # 3. The token that completed stage n exits and decides its successor.
                tick = time.perf_counter()
                exiting = inflight.pop(0)
                if head is not None:
                    self._retire_rows(head, head_cache, [exiting])
                rest = list(inflight)  # their stages ran this step too; collected below
                if proposal is not None:
                    inflight.append(proposal)  # n == 1: the proposal is the successor itself
                    proposal = None
                token, accepted, flushed = self._verify(exiting, inflight, sampling, generator, stats)
                if flushed:
                    stats.flushes += 1
                    inflight.clear()
                    self.stages.flush(exiting.position + 1)
                    if head_cache is not None:
                        head_cache.truncate(exiting.position + 1)
                if flushed or not inflight:
                    # Reseed (or, without a proposal in flight, the plain pipeline's next token).
                    inflight.append(self._enter(token, exiting.position + 1))
                out.append(token)
                stats.token_acceptance.append(accepted)
                stop = _stop_reason(token, out, eos, budget, max_new_tokens)
                if not stop:
                    self.stages.launch(inflight)  # stage 1's next token, as soon as it is decided
                stats.verify_time_s += time.perf_counter() - tick
                if on_token is not None and on_token(token, accepted) and not stop:
                    stop = "stopped"  # the caller ended the request (tokens still in flight are discarded)
                if stop or flushed:
                    continue  # the other tokens in flight are discarded
                tick = time.perf_counter()
                self.stages.collect(rest)
                stats.stage_time_s += time.perf_counter() - tick
                if head is not None:
                    self._retire_rows(head, head_cache, rest)
            # Output-state speculation reads the state after the stages ran (serial with them).
            if head is not None and schedule == "output" and inflight[-1].depth >= 1 \
                    and inflight[-1].position + 1 < end_position:
                proposal = self._propose(head, head_cache, inflight, sampling, generator, stats)
            if proposal is not None:
                inflight.append(proposal)

        stats.wall_time_s = time.perf_counter() - t0
        stats.stop_reason = stop
        stats.new_tokens = len(out)
        stats.decode_tokens = len(out) - 1
        return GenerationOutput(out, stats, prompt)

    # ------------------------------------------------------------------------------------ pieces
    def _prefill(self, prompt: list[int], capacity: int, head: Speculator | None,
                 head_cache: SpeculatorCache | None, sampling: SamplingParams,
                 generator: torch.Generator | None) -> int:
        """Run the prompt through every stage; every prompt position enters the head's cache at full depth."""
        staged = self.staged
        ids_1T = torch.tensor([prompt], dtype=torch.long, device=staged.device)
        anchors = head.prefill_anchors() if head is not None else []
        out = self.stages.prefill(ids_1T, anchors, capacity)
        if head is not None:
            head.prefill_memory(head_cache, out.anchors)
        logits_1V = staged.logits(out.hidden_BTD[:, -1])
        if sampling.greedy:
            return int(torch.argmax(logits_1V, dim=-1))
        return int(torch.multinomial(warped_probs(logits_1V, sampling), 1, generator=generator))

    def _enter(self, token: int, position: int, q_V: torch.Tensor | None = None, rank: int = 0) -> Slot:
        """A token about to enter stage 1: its embedding is H^0."""
        hidden_1TD = self.staged.embed(torch.tensor([[token]], dtype=torch.long, device=self.staged.device))
        slot = Slot(token, position, hidden_1TD, q_V=q_V, rank=rank)
        if self._needs_embedding:
            slot.anchors[0] = hidden_1TD[:, 0]
        return slot

    @staticmethod
    def _retire_rows(head: Speculator, head_cache: SpeculatorCache, inflight: list[Slot]) -> None:
        """Hand the head the slots that may just have reached its deepest depth (it caches their rows)."""
        head.retire(head_cache, inflight)

    def _propose(self, head: Speculator, head_cache: SpeculatorCache, inflight: list[Slot],
                 sampling: SamplingParams, generator: torch.Generator | None, stats: PipelineStats) -> Slot:
        """The head's next token after the newest in-flight token, from the current depths (docs/method.md §3)."""
        tick = time.perf_counter()
        logits_1V = self._head_logits(head, head_cache, inflight)
        if sampling.greedy:
            q_V, token = None, int(torch.argmax(logits_1V, dim=-1))
        else:
            q_V = warped_probs(logits_1V, sampling)[0]
            token = int(torch.multinomial(q_V, 1, generator=generator))
        stats.proposals += 1
        stats.speculator_time_s += time.perf_counter() - tick
        # While the seed (always the oldest) is in flight the pipeline is still refilling.
        rank = len(inflight) if inflight[0].rank == 0 else self.staged.n_stages
        return self._enter(token, inflight[-1].position + 1, q_V, rank)

    @staticmethod
    def _head_logits(head: Speculator, head_cache: SpeculatorCache, inflight: list[Slot]) -> torch.Tensor:
        """The head's logits (1, V) for the position after the newest in-flight token."""
        return head.propose_logits(head_cache, inflight)

    def _verify(self, exiting: Slot, inflight: list[Slot], sampling: SamplingParams,
                generator: torch.Generator | None, stats: PipelineStats) -> tuple[int, bool, bool]:
        """The committed token for the position after ``exiting``, whether it is the accepted speculated token,
        and whether the pipeline must flush (a speculated token was rejected)."""
        logits_1V = self.staged.logits(exiting.hidden_1TD[:, -1])
        candidate = inflight[0] if inflight else None
        if sampling.greedy:
            token = int(torch.argmax(logits_1V, dim=-1))
            accepted = candidate is not None and candidate.token == token
        else:
            p_V = warped_probs(logits_1V, sampling)[0]
            if candidate is None:
                token, accepted = int(torch.multinomial(p_V, 1, generator=generator)), False
            else:
                index, token = verify_sampled_recursive(p_V, [candidate.token], candidate.q_V, generator)
                accepted = index is not None
        if candidate is None:
            return token, False, False
        stats.verified += 1
        stats.verified_by_position[candidate.rank - 1] += 1
        if accepted:
            stats.accepted += 1
            stats.accepted_by_position[candidate.rank - 1] += 1
        return token, accepted, not accepted


def first_output(first: int, stats: GenerationStats, eos: frozenset[int], budget: int, max_new_tokens: int,
                 on_token: OnToken | None) -> tuple[list[int], str]:
    """The output after the prefill's token (taken from the prefill logits, not speculated) and the reason it
    already stops the request ("" when it does not): what the chain and tree loops share before their steps."""
    out = [first]
    stats.token_acceptance.append(False)
    stop = _stop_reason(first, out, eos, budget, max_new_tokens)
    if on_token is not None and on_token(first, False) and not stop:
        stop = "stopped"
    return out, stop


def _stop_reason(token: int, out: list[int], eos: frozenset[int], budget: int, max_new_tokens: int) -> str:
    if token in eos:
        return "eos"
    if len(out) >= budget:
        return "max_new_tokens" if len(out) >= max_new_tokens else "context_full"
    return ""


def prepare_prompt(tokenizer, prompt, eos_token_id, model=None):
    """Token ids of a text prompt (needs a tokenizer) or ids as given, and the EOS: ``eos_token_id`` if given,
    else :func:`spd.decoding.generation.default_eos` (the model's generation config, as ``model.generate``, then the
    tokenizer's)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise SpdInputError("a text prompt needs a tokenizer, but this engine has none (the target has no "
                                "tokenizer files); pass token ids or load the engine with a tokenizer")
        prompt = tokenizer(prompt)["input_ids"]
    if eos_token_id is None:
        eos_token_id = default_eos(model, tokenizer)
    return prompt, eos_token_id


def generate_request(staged: StagedModel, tokenizer, prompt, max_new_tokens: int, mode: str,
                     sampling: SamplingParams, eos_token_id, streamer,
                     decode: Callable[[list[int], int | Sequence[int] | None, OnToken | None], GenerationOutput],
                     on_token: OnToken | None = None) -> GenerationOutput:
    """What every engine's ``generate`` shares: the prompt and EOS, the streamer, and the ``ar`` mode;
    ``decode(prompt_ids, eos_token_id, on_token)`` runs the engine's own modes."""
    prompt, eos_token_id = prepare_prompt(tokenizer, prompt, eos_token_id, staged.model)
    on_token, end = _as_callback(streamer, on_token)
    try:
        if mode == "ar":
            return generate_ar(staged, prompt, max_new_tokens, sampling, eos_token_id, on_token)
        return decode(prompt, eos_token_id, on_token)
    finally:
        end()


class OneModeEngine:
    """``generate`` for an engine with one decoding mode besides ``ar`` (the tree engine, serial speculative
    decoding): a subclass sets ``mode`` and ``engine_name``, has ``staged`` and ``tokenizer``, and implements
    ``run(prompt_ids, max_new_tokens, sampling, eos_token_id, on_token)``."""

    mode = ""
    engine_name = ""

    def generate(self, prompt: str | Sequence[int] | torch.Tensor, max_new_tokens: int = 128, mode: str | None = None,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 eos_token_id: int | Sequence[int] | None = None,
                 streamer: Callable[[int], None] | object | None = None,
                 on_token: OnToken | None = None) -> GenerationOutput:
        """Generate from a prompt (text needs a tokenizer) or token ids, as :meth:`PipelineEngine.generate`;
        ``mode`` is the engine's own (default) or ``ar``."""
        mode = mode or self.mode
        if mode not in (self.mode, "ar"):
            raise SpdInputError(f"unknown mode '{mode}' for {self.engine_name}; expected one of: {self.mode}, ar")
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        return generate_request(self.staged, self.tokenizer, prompt, max_new_tokens, mode, sampling, eos_token_id,
                                streamer, lambda ids, eos, callback: self.run(ids, max_new_tokens, sampling, eos,
                                                                              callback), on_token)


def _as_callback(streamer, on_token: OnToken | None = None) -> tuple[OnToken | None, Callable[[], None]]:
    """The run loops' callback ``(token, accepted)`` and a finisher, from a streamer (a callable taking a token
    id or a ``put``/``end`` object, which never sees the flag) and ``on_token``."""
    end: Callable[[], None] = lambda: None
    if streamer is None:
        put = None
    elif hasattr(streamer, "put") and hasattr(streamer, "end"):
        put, end = (lambda token: streamer.put(torch.tensor([token]))), streamer.end
    elif callable(streamer):
        put = streamer
    else:
        raise SpdInputError("streamer must be a callable taking a token id or an object with put() and end()")
    if on_token is not None and not callable(on_token):
        raise SpdInputError("on_token must be a callable taking a token id and its acceptance flag")
    if put is None:
        return on_token, end

    def callback(token: int, accepted: bool) -> bool | None:
        put(token)
        return on_token(token, accepted) if on_token is not None else None

    return callback, end
