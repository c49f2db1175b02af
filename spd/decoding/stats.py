"""What a pipelined run did: :class:`PipelineStats` (chain: ``spd`` and ``pp``) and :class:`TreeStats` (``tree``), with
the metrics of docs/method.md §5: ``K`` steps, ``N`` tokens committed by decode steps (the first new token, taken
from the prefill logits, is not one; ``new_tokens = N + 1`` counts it), ``alpha = N / K``, ``L'_acc = n * N / K``,
the theoretical speedups of paper section 4.2."""

from __future__ import annotations

from dataclasses import dataclass, field

from .generation import GenerationStats


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
    stage_layers: list[int] = field(default_factory=list)  # the cut: layers per stage
    # Per decode step, the tokens each stage ran (the model clock's input, spd.decoding.model_clock; not in as_dict).
    stage_tokens: list[list[int]] = field(default_factory=list)
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
        del d["stage_tokens"]
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
