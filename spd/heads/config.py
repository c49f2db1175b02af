"""A speculation head's configuration (:class:`SpeculatorConfig`: the pipeline it was trained for, its schedule and
sizes), the check that a head fits a staged target, and the default anchors (docs/method.md §2-3). The model that
reads it is :mod:`spd.heads.speculator`."""

from __future__ import annotations

import math

from transformers import PretrainedConfig

from ..errors import SpdInputError
from .interface import HeadConfig

SCHEDULES = {"input": 0, "output": 1, "serial": 0}  # schedule -> depth offset of the newest position


class SpeculatorConfig(PretrainedConfig):
    """Configuration of a speculation head (saved as ``config.json`` next to ``model.safetensors``)."""

    model_type = "spd_speculator"

    def __init__(
        self,
        hidden_size: int = 256,  # D: the target's hidden size (features and the body share it)
        vocab_size: int = 4096,  # the target's vocabulary
        n_stages: int = 4,  # n: pipeline stages of the target this head is trained for
        boundaries: list[int] | None = None,  # stage boundaries [0, b1, ..., L]; default: equal split
        target_num_layers: int = 8,  # L
        anchors: list[list[int]] | None = None,  # anchors[d]: hidden-state indices fused into g^d (d = 0..n)
        num_layers: int = 1,  # L_s: decoder layers of the body
        num_attention_heads: int = 4,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        intermediate_size: int | None = None,  # SwiGLU width (default 4D*2/3 rounded like Llama's)
        rms_norm_eps: float = 1e-6,
        qk_norm: bool = False,  # per-head RMSNorm on q and k (Qwen3 style)
        rope_parameters: dict | None = None,  # as in the target's config (rope_type, rope_theta, ...)
        max_position_embeddings: int = 4096,
        schedule: str = "input",  # "input" (SPD), "output" (ablation; PPSD) or "serial" (EAGLE-style, --mode sd)
        max_depth: int | None = None,  # deepest features used: n (SPD) or 1 (PPSD, serial)
        draft_steps: int | None = None,  # serial: the most drafts in flight it is trained for (default 8)
        memory_proj: bool = False,  # per-layer per-depth identity-initialised memory projections
        draft_vocab_size: int | None = None,  # K: the LM head predicts K target tokens (None: the whole vocabulary)
        draft_vocab_sha256: str | None = None,  # hash of the K tokens' strings, checked against a tokenizer at load
        target_name_or_path: str | None = None,  # the target this head was trained for (informational)
        target_revision: str | None = None,
        target_model_type: str | None = None,
        **kwargs,
    ):
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.n_stages = n_stages
        self.target_num_layers = target_num_layers
        self.boundaries = list(boundaries) if boundaries is not None else _equal_split(target_num_layers, n_stages)
        self.anchors = [list(a) for a in anchors] if anchors is not None else default_anchors(self.boundaries)
        self.num_layers = num_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.intermediate_size = intermediate_size or 64 * math.ceil(8 * hidden_size / 3 / 64)
        self.rms_norm_eps = rms_norm_eps
        self.qk_norm = qk_norm
        self.rope_parameters = dict(rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})
        self.max_position_embeddings = max_position_embeddings
        self.schedule = schedule
        self.max_depth = n_stages if max_depth is None else max_depth
        self.draft_steps = (draft_steps or 8) if schedule == "serial" else None
        self.memory_proj = memory_proj
        self.draft_vocab_size = draft_vocab_size
        self.draft_vocab_sha256 = draft_vocab_sha256
        self.target_name_or_path = target_name_or_path
        self.target_revision = target_revision
        self.target_model_type = target_model_type
        super().__init__(**kwargs)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError with one clear sentence if the settings are inconsistent."""
        n = self.n_stages
        b = self.boundaries
        if len(b) != n + 1 or b[0] != 0 or b[-1] != self.target_num_layers or any(x >= y for x, y in zip(b, b[1:])):
            raise ValueError(f"boundaries {b} do not cut {self.target_num_layers} layers into {n} stages")
        if len(self.anchors) != n + 1:
            raise ValueError(f"anchors must list n+1 = {n + 1} depths, got {len(self.anchors)}")
        for d, anchor in enumerate(self.anchors):
            if not anchor or any(not 0 <= a <= b[d] for a in anchor):
                raise ValueError(
                    f"anchors[{d}] = {anchor} must be non-empty hidden-state indices in 0..{b[d]} "
                    f"(a token at depth {d} has completed layers up to {b[d]})"
                )
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {list(SCHEDULES)}, got '{self.schedule}'")
        if not 1 <= self.max_depth <= n:
            raise ValueError(f"max_depth must be in 1..{n}, got {self.max_depth}")
        if self.schedule == "serial":
            assert self.draft_steps is not None  # __init__ gives the serial schedule its number of drafts
            if n != 1 or self.draft_steps < 1:
                raise ValueError(
                    f"the serial schedule reads the whole target (n_stages 1) with draft_steps >= 1, got "
                    f"n_stages {n} and draft_steps {self.draft_steps}"
                )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in 1..{self.vocab_size}, got {self.draft_vocab_size}")

    @property
    def offset(self) -> int:
        """Depth of the newest position at speculation time (0: input-state schedule)."""
        return SCHEDULES[self.schedule]

    @property
    def max_fill(self) -> int:
        """The most positions in flight (the fill ``a``): n for the pipelined schedules, draft_steps for serial."""
        if self.schedule == "serial":
            assert self.draft_steps is not None  # __init__ gives the serial schedule its number of drafts
            return self.draft_steps
        return self.n_stages

    @property
    def used_depths(self) -> list[int]:
        """Depths whose features the head can ever see: band depths and max_depth."""
        return sorted({self.depth(j, j + 1) for j in range(self.max_fill)} | {self.max_depth})

    def depth(self, distance: int, fill: int) -> int:
        """Depth of a position ``distance = t - i`` back from the query when ``fill`` tokens are in flight."""
        if distance >= fill:
            return self.max_depth
        return 0 if self.schedule == "serial" else min(self.max_depth, distance + self.offset)


def check_compatible(head_config: HeadConfig, staged, mode: str | None = None) -> None:
    """Refuse a head trained for another target shape or another pipeline (one clear sentence).

    ``staged`` is a :class:`spd.target.staging.StagedModel` (not imported here: the head does not need the target);
    ``mode`` (spd, tree or sd) the engine that will run it: a serial head (variant eagle) drafts in ``sd`` only,
    and ``sd`` takes no pipelined head.
    """
    serial = head_config.schedule == "serial"
    if mode is not None and serial and mode != "sd":
        raise SpdInputError(
            f"this head was trained with variant=eagle, a serial drafter for --mode sd; --mode {mode} "
            "takes a head trained for the pipeline (variant spd, output_state or ppsd)"
        )
    if mode == "sd" and not serial:
        raise SpdInputError(
            f"--mode sd drafts serially and takes a head trained with variant=eagle (or --draft-model), "
            f"but this head has the '{head_config.schedule}' schedule of a pipeline; run it with "
            "--mode spd"
        )
    problems = []
    if head_config.hidden_size != staged.config.hidden_size:
        problems.append(f"hidden size {head_config.hidden_size} vs the target's {staged.config.hidden_size}")
    if head_config.vocab_size != staged.vocab_size:
        problems.append(f"vocabulary {head_config.vocab_size} vs the target's {staged.vocab_size}")
    if head_config.target_num_layers != staged.num_layers:
        problems.append(f"{head_config.target_num_layers} target layers vs the target's {staged.num_layers}")
    elif head_config.boundaries != staged.boundaries:
        problems.append(cut_problem(head_config.boundaries, staged.boundaries))
    if problems:
        raise misfit(problems)


def misfit(problems: list[str]) -> SpdInputError:
    """The one error for a head that does not fit its target (ours or the authors'), naming each problem."""
    return SpdInputError("the speculator does not fit this target: " + "; ".join(problems))


def depth_problem(head_layers: int, num_layers: int) -> str:
    """A head made for a target of another depth."""
    return f"it was trained for a target of {head_layers} layers, and this one has {num_layers}"


def equal_cut_problem(head_stages: int, num_layers: int) -> str | None:
    """A head that cuts its target equally (the SPD authors') made for an n that does not divide this one's layers."""
    if head_stages < 1 or num_layers % head_stages:
        return f"it is for n = {head_stages} stages, which do not divide the target's {num_layers} layers"
    return None


def cut_problem(head_boundaries: list[int], boundaries: list[int], asked: str = "the pipeline has") -> str:
    """A head made for another cut than the pipeline's (``asked``: who chose it, e.g. ``--stages 8 asks for``),
    both cuts named, and what to do."""
    from ..target.cut import cut_flag, describe_cut

    return (
        f"it was trained for n = {describe_cut(head_boundaries)} ({cut_flag(head_boundaries)}) but {asked} "
        f"{describe_cut(boundaries)}; leave --stages and --boundaries out (the head's cut is the default) or use "
        "a head trained for that cut"
    )


def _equal_split(num_layers: int, n: int) -> list[int]:
    if n < 1 or num_layers % n:
        raise ValueError(f"{n} stages do not divide {num_layers} layers evenly; pass boundaries")
    return [num_layers // n * s for s in range(n + 1)]


def default_anchors(boundaries: list[int]) -> list[list[int]]:
    """The default (docs/method.md §2): ``anchors[0] = [0]``, ``anchors[d] = [0, b[d] // 2, b[d]]``."""
    return [[0]] + [[0, b // 2, b] for b in boundaries[1:]]
