"""What a run did, the statistics every decoder returns: :class:`GenerationStats` (every mode; ``ar`` alone),
:class:`PipelineStats` (chain: ``spd`` and ``pp``), :class:`TreeStats` (``tree``) and :class:`SdStats` (``sd``).

The pipelined modes report the metrics of docs/method.md §5: ``K`` steps, ``N`` tokens committed by decode steps (the
first new token, taken from the prefill logits, is not one; ``new_tokens = N + 1`` counts it), ``alpha = N / K``,
``L'_acc = n * N / K``, the theoretical speedups of paper section 4.2; serial drafting its mean acceptance length and
the speedup of the paper's EAGLE row (:mod:`spd.decoding.sd`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    """What one generate call did; ``as_dict()`` is the ``stats`` object of ``spd-generate --json``."""

    mode: str
    prompt_tokens: int
    new_tokens: int = 0  # tokens returned (the first one comes from the prefill logits)
    stop_reason: str = ""  # "eos", "max_new_tokens", "context_full" or "stopped" (on_token returned True)
    prefill_time_s: float = 0.0
    wall_time_s: float = 0.0  # prefill + decode
    # One flag per new token: True where it is a speculated token that verification accepted (the first
    # token, a replacement after a rejection, and every AR / plain-pipeline token are False).
    token_acceptance: list[bool] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["wall_time_s"] = round(self.wall_time_s, 4)
        d["prefill_time_s"] = round(self.prefill_time_s, 4)
        d["tokens_per_s"] = round(self.tokens_per_s, 2)
        return d


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
        return (
            self.mean_acceptance_length
            * self.target_layers
            / (self.draft_layers * self.draft_steps + self.target_layers)
        )

    def as_dict(self) -> dict:
        d = super().as_dict()
        d["mean_acceptance_length"] = round(self.mean_acceptance_length, 4)
        d["theoretical_speedup"] = round(self.theoretical_speedup, 4)
        return d
