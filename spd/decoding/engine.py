"""The pipelined SPD chain engine (``spd`` and ``pp``, single process): the semantic reference of docs/method.md §5.

The chain is the step loop of :mod:`spd.decoding.loop` at width 1 (every tree level one token), with the head as
its proposer (:class:`spd.decoding.proposers.SpdHeadProposer` for SPD heads,
:class:`spd.decoding.proposers.HeadProposer` for the output-state ablation, PPSD and the SPD authors' heads) or with
none (``pp``).

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

Statistics: :class:`spd.decoding.stats.PipelineStats`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..errors import SpdInputError
from .generation import GenerationOutput, OnToken
from .loop import LocalStages, StepLoop
from .request import generate_request
from .sampling import SamplingParams
from .stats import PipelineStats
from .tree_engine import HeadProposer, SpdHeadProposer
from .tree_width import FixedWidth
from ..heads.speculator import Speculator
from ..target.staging import StagedModel, load_target_tokenizer

MODES = ("spd", "pp", "ar")


class PipelineEngine:
    """Runs one request at a time through the staged target, with a speculation head (``spd``) or without
    (``pp``); ``ar`` delegates to plain autoregressive decoding. See the module docstring."""

    def __init__(self, staged: StagedModel, speculator: Speculator | None = None, tokenizer=None,
                 stages: LocalStages | None = None):
        self.staged = staged
        self.speculator = speculator
        self.tokenizer = tokenizer
        self.source = None  # the head as the loop's proposer (it checks the head fits the target)
        if speculator is not None:
            head_param = next(speculator.parameters())
            if head_param.dtype != staged.dtype or head_param.device != staged.device:
                raise SpdInputError(f"the speculator is {head_param.dtype} on {head_param.device} but the target is "
                                    f"{staged.dtype} on {staged.device}; load both with the same dtype and device")
            spd_head = isinstance(speculator, Speculator) and speculator.config.schedule == "input" \
                and speculator.config.max_depth == staged.n_stages
            source = SpdHeadProposer if spd_head else HeadProposer
            self.source = source(speculator, staged, children=1, mode="spd", tokenizer=tokenizer)
        self.stages = stages if stages is not None else LocalStages(staged)
        self.loop = StepLoop(staged, self.stages, FixedWidth(1, 1))

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
            if mode not in MODES:
                raise SpdInputError(f"unknown mode '{mode}'; expected one of: {', '.join(MODES)}")
            return self.run(prompt_ids, max_new_tokens, sampling, eos, on_token, use_head=mode == "spd")

        return generate_request(self.staged, self.tokenizer, prompt, max_new_tokens, mode, sampling, eos_token_id,
                                streamer, decode, on_token)

    def run(self, input_ids: Sequence[int] | torch.Tensor, max_new_tokens: int, sampling: SamplingParams,
            eos_token_id: int | Sequence[int] | None = None, on_token: OnToken | None = None,
            use_head: bool = True) -> GenerationOutput:
        """One request through the step loop at width 1 (``use_head=False``: the standard pipeline); no EOS unless
        given."""
        source, stats = self.request_parts(use_head)
        return self.loop.run(source, input_ids, max_new_tokens, sampling, eos_token_id, on_token, stats)

    def request_parts(self, use_head: bool = True) -> tuple[object | None, PipelineStats]:
        """The proposer (None: the standard pipeline) and fresh statistics of one request."""
        head = self.speculator if use_head else None
        if use_head and head is None:
            raise SpdInputError("mode 'spd' needs a speculation head; pass a speculator or use mode 'pp'")
        stats = PipelineStats(mode="spd" if head is not None else "pp", prompt_tokens=0,
                              schedule=head.config.schedule if head is not None else "none",
                              speculator_layers=head.config.num_layers if head is not None else 0)
        return (self.source if head is not None else None), stats
