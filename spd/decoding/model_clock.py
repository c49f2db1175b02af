"""The model clock: the time a run takes with one device per stage, from its stage times.

A single process runs the n stages of a pipeline one after another, so its wall clock shows no pipeline speedup. On
the model clock each stage runs on its own device: a pipeline step lasts as long as its busiest stage, a stage call
costing a fixed time plus a time per token, ``a + b * tokens`` (an idle stage costs nothing). The batched benchmark
(spd-bench batch) steps this clock with measured or given ``a`` and ``b``; spd-generate reports one run on it
(:func:`model_clock`), beside the standard pipeline's tokens/s at the same stage times.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .stats import PipelineStats


def step_ms(tokens: Sequence[int], stage_ms: float | Sequence[float], token_ms: float = 0.0) -> float:
    """One pipeline step on the model clock: its busiest stage's ``a + b * tokens`` (``tokens[s]``: the tokens stage
    ``s`` ran this step; ``stage_ms``: ``a``, one for every stage or one per stage; ``token_ms``: ``b``)."""
    fixed = [stage_ms] * len(tokens) if isinstance(stage_ms, (int, float)) else stage_ms
    return max((a + token_ms * t for a, t in zip(fixed, tokens) if t), default=0.0)


@dataclass(frozen=True)
class ModelClock:
    """One run on the model clock (decode only: the prefill and the first token, which it gives, are left out)."""

    stage_ms: list[float]  # a call of each stage, one token, this run's measured time (the last: with verification)
    head_ms: float  # the head's time per step (0: none); input-state heads run beside the stages
    decode_ms: float  # the run's decode steps, each as long as its busiest stage (or the head)
    decode_tokens: int

    @property
    def tokens_per_s(self) -> float:
        """This run's decode tokens per second with one device per stage."""
        return 1000 * self.decode_tokens / self.decode_ms if self.decode_ms > 0 else 0.0

    @property
    def pp_tokens_per_s(self) -> float:
        """The standard pipeline's at the same stage times: one token in flight, so a token takes one call of every
        stage, one after another (n steps of one busy stage each)."""
        per_token_ms = sum(self.stage_ms)
        return 1000 / per_token_ms if per_token_ms > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "stage_ms": [round(ms, 4) for ms in self.stage_ms],
            "head_ms": round(self.head_ms, 4),
            "tokens_per_s": round(self.tokens_per_s, 2),
            "pp_tokens_per_s": round(self.pp_tokens_per_s, 2),
        }


def model_clock(stats: PipelineStats) -> ModelClock | None:
    """A chain run (``spd`` or ``pp``) of the single-process engine on the model clock, from the stage times it
    recorded (None: no decode step, or a tree, whose stage calls hold several tokens).

    The stages ran one after another in this process, ``stats.stage_tokens`` saying which ran each step, so their
    time is shared out by layers (a call of a stage of ``l`` layers costs ``l`` times a layer's share, an uneven
    cut's longer stages longer); the verification after stage n (final norm, LM head) is the last stage's. The
    head runs on its own device: beside the stages for an input-state head (a step lasts as long as the slower),
    after them for an output-state one (paper section 4.2).
    """
    steps = stats.stage_tokens
    if not steps or stats.decode_tokens < 1 or any(t > 1 for tokens in steps for t in tokens):
        return None
    layers = stats.stage_layers
    layer_calls = sum(n for tokens in steps for n, t in zip(layers, tokens) if t)
    per_layer_ms = 1000 * stats.stage_time_s / layer_calls if layer_calls else 0.0
    stage_ms = [per_layer_ms * n for n in layers]
    stage_ms[-1] += 1000 * stats.verify_time_s / stats.decode_tokens  # one verification per committed token
    head_ms = 1000 * stats.speculator_time_s / len(steps)
    if stats.schedule == "output":
        decode_ms = sum(step_ms(tokens, stage_ms) + head_ms for tokens in steps)
    else:
        decode_ms = sum(max(step_ms(tokens, stage_ms), head_ms) for tokens in steps)
    return ModelClock(stage_ms, head_ms, decode_ms, stats.decode_tokens)
