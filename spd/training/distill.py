"""Distillation of a speculation head from a frozen target: config, batches, loss (presets: :mod:`.presets`;
evaluation: :mod:`.evaluation`; checkpoints: :mod:`.checkpoints`).

The training loop is :mod:`.trainer` (run by ``train/distill.py``); this module holds the pieces it calls, so that
they are importable and tested on their own. docs/method.md §4 and Appendix A of the paper.

Shape suffixes: B batch, N positions, D hidden, V vocabulary.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import SpdInputError
from ..heads.config import SpeculatorConfig, default_anchors
from ..heads.speculator import Speculator
from ..paths import default_cache_dir, default_testbed_dir
from ..target.staging import StagedModel
from .head_forward import kd_objective
from .kd import padded_length

VARIANTS = {  # variant -> (schedule, max_depth or None for n); docs/method.md §3
    "spd": ("input", None),
    "output_state": ("output", None),
    "ppsd": ("output", 1),
    "eagle": ("serial", 1),  # the EAGLE-style serial drafter of --mode sd (n_stages 1, see DistillConfig)
}


def _testbed(*parts: str) -> str:
    return str(default_testbed_dir().joinpath(*parts))


@dataclass
class DistillConfig:
    """Every setting of a distillation run; presets are YAML files of these keys (configs/)."""

    # what is trained
    target: str = field(default_factory=lambda: _testbed("target"))  # target dir or hub id
    target_revision: str | None = None
    n_stages: int = 8  # n (variant eagle: always 1, the whole target; its drafts in flight are draft_steps)
    boundaries: list[int] | None = None  # explicit stage boundaries (default: equal split)
    variant: str = "spd"  # spd | output_state | ppsd | eagle
    draft_steps: int = 8  # eagle: trained for up to this many serial drafts per target forward (--draft-steps m)
    num_layers: int = 1  # L_s
    anchors: list[list[int]] | None = None  # per depth; default (0, b[k]//2, b[k]) (docs/method.md §2)
    memory_proj: bool = False  # per-layer per-depth memory projections
    fc_init: str = "random"  # random | deepest (FC_k = identity on its deepest anchor) | scaled (per-anchor std)
    layer_init: str = "random"  # random | target (every head layer starts as a copy of target layer layer_init_from)
    layer_init_from: int = -1  # the target decoder layer layer_init=target copies (negative: from the end)
    init_from: str | None = None  # start from an existing head (dir or hub id) instead of a fresh one
    draft_vocab_size: int = 0  # K: the head's LM head covers the K most frequent supervised tokens (0: all)
    # data: a dataset (the target runs online), a list of datasets (their rows mixed), or a capture directory
    # (data/capture.py: no target needed)
    data: str | list[str] = field(default_factory=lambda: _testbed("corpus", "train.jsonl"))
    data_revision: str | None = None
    # held-out data: one dataset (or capture), or named sets ({chat: a.jsonl, math: b.jsonl}), each evaluated on its
    # own (eval_rows rows each) and together
    eval_data: str | dict[str, str] | None = field(default_factory=lambda: _testbed("corpus", "validation.jsonl"))
    max_length: int = 2048  # tokens per training row
    # each batch right-padded to a multiple of this many tokens (never past max_length), and the KD loss's last chunk
    # of positions too: few distinct shapes, so a CPU's kernel cache and heap stay flat over a long run
    # (docs/training.md, "Memory on a long CPU run"); 1: no padding beyond the batch's longest row
    pad_to_multiple_of: int = 64
    overflow: str = "auto"  # drop | truncate | split | auto (drop chats, split text)
    cache_dir: str = field(default_factory=default_cache_dir)  # prepared datasets ($SPD_CACHE, ~/.cache/spd)
    # optimisation (paper: lr 1e-4, linear decay, 1 epoch)
    batch_size: int = 8  # rows per device per micro-batch
    grad_accum: int = 1
    lr: float = 1e-4
    warmup_steps: int = 100
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    epochs: float = 1.0
    max_steps: int | None = None  # optimizer steps; when set it replaces epochs (the data loops as needed)
    max_minutes: float | None = None  # stop (and save) when this much wall time has passed
    tau: float = 1.0  # KD temperature
    p_full: float = 0.5  # probability of a fully occupied pipeline per example (Appendix A.2)
    kd_chunk: int = 512  # positions per chunk of the KD loss
    mixed_precision: str = "auto"  # auto (bf16 on GPU, no on CPU) | no | bf16 | fp16
    # the frozen target of online distillation: auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16. On a CPU with
    # AMX, bf16 with mixed_precision=bf16 makes a SmolLM2 step 2.2x faster (docs/smollm2.md, training at scale).
    target_dtype: str = "auto"
    seed: int = 0
    # intra-op threads per process on a CPU; None: the machine's cores divided among its processes under
    # `accelerate launch` (which would leave 1), else OMP_NUM_THREADS (spd/training/backends.py:cpu_threads)
    threads: int | None = None
    # evaluation, logging, checkpoints
    eval_every: int = 200  # optimizer steps (0 = only at the end)
    # evaluate at these steps as well (e.g. [25, 50, 100]: points of a data curve; 0: the head before training)
    eval_steps: list[int] | None = None
    eval_rows: int = 64  # held-out rows used per evaluation
    log_every: int = 10
    wandb: bool = False  # log to Weights & Biases; its run files go to <output_dir>/wandb (needs wandb)
    wandb_project: str = "spd"  # wandb project; also the TensorBoard run name (<output_dir>/logs/<wandb_project>)
    wandb_mode: str = "offline"  # offline (upload later with `wandb sync`) | online | disabled
    tensorboard: bool = False  # log to <output_dir>/logs: `tensorboard --logdir <output_dir>/logs` (needs tensorboard)
    output_dir: str = "runs/spd"
    save_every: int = 500  # optimizer steps (0 = only at the end)
    keep_checkpoints: int = 2

    def __post_init__(self):
        # The checks run in this order: a config with several wrong values is refused for the first of them.
        self._check_variant()
        self._check_sizes()
        self._check_optimiser()
        self._check_steps()
        self._check_choices()

    def _check_variant(self) -> None:
        """``variant`` one of :data:`VARIANTS`; eagle reads the whole target (one stage) and drafts at least once."""
        if self.variant not in VARIANTS:
            raise SpdInputError(f"variant must be one of {', '.join(VARIANTS)}, got '{self.variant}'")
        if self.variant == "eagle":
            # The serial drafter reads the whole target's features: one stage, whatever a preset's n says.
            if self.boundaries is not None:
                raise SpdInputError("variant eagle reads the whole target (one stage); remove boundaries")
            self.n_stages = 1
            if self.draft_steps < 1:
                raise SpdInputError(f"draft_steps must be at least 1, got {self.draft_steps}")

    def _check_sizes(self) -> None:
        """Sizes and intervals that must be at least 1."""
        for name in (
            "n_stages",
            "num_layers",
            "batch_size",
            "grad_accum",
            "max_length",
            "pad_to_multiple_of",
            "kd_chunk",
            "eval_rows",
            "log_every",
            "keep_checkpoints",
        ):
            if getattr(self, name) < 1:
                raise SpdInputError(f"{name} must be at least 1, got {getattr(self, name)}")

    def _check_optimiser(self) -> None:
        """The optimiser's numbers (finite; positive, or at least 0 for weight_decay) and the run's threads and time."""
        # nan passes every comparison and inf every lower bound: each number must be finite as well.
        for name in ("lr", "tau", "epochs", "max_grad_norm"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise SpdInputError(f"{name} must be a positive finite number, got {value}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise SpdInputError(f"weight_decay must be a finite number >= 0, got {self.weight_decay}")
        if self.threads is not None and (isinstance(self.threads, bool) or self.threads < 1):
            raise SpdInputError(f"threads must be at least 1 (or unset), got {self.threads}")
        if self.max_minutes is not None and not (math.isfinite(self.max_minutes) and self.max_minutes > 0):
            raise SpdInputError(f"max_minutes must be a positive finite number, got {self.max_minutes}")

    def _check_steps(self) -> None:
        """Steps that may be 0 (intervals, ``eval_steps``), ``max_steps``, the draft vocabulary's size and ``p_full``."""
        for name in ("warmup_steps", "eval_every", "save_every"):
            if getattr(self, name) < 0:
                raise SpdInputError(f"{name} must be 0 or more, got {getattr(self, name)}")
        if self.eval_steps is not None and not all(
            isinstance(step, int) and not isinstance(step, bool) and step >= 0 for step in self.eval_steps
        ):
            raise SpdInputError(
                f"eval_steps must be a list of steps of at least 0 (0: the head before training), e.g. [0, 25, 50], "
                f"got {self.eval_steps}"
            )
        if self.draft_vocab_size < 0:
            raise SpdInputError(
                f"draft_vocab_size must be 0 (the whole vocabulary) or positive, got {self.draft_vocab_size}"
            )
        if self.max_steps is not None and self.max_steps < 1:
            raise SpdInputError(f"max_steps must be at least 1, got {self.max_steps}")
        if not 0 <= self.p_full <= 1:
            raise SpdInputError(f"p_full must be in [0, 1], got {self.p_full}")

    def _check_choices(self) -> None:
        """The settings named by a word: how the head starts, the target's dtype, mixed precision."""
        if self.fc_init not in ("random", "deepest", "scaled"):
            raise SpdInputError(f"fc_init must be random, deepest or scaled, got '{self.fc_init}'")
        if self.layer_init not in ("random", "target"):
            raise SpdInputError(f"layer_init must be random or target, got '{self.layer_init}'")
        if self.target_dtype not in ("auto", "float32", "bfloat16"):
            raise SpdInputError(f"target_dtype must be auto, float32 or bfloat16, got '{self.target_dtype}'")
        if self.mixed_precision not in ("auto", "no", "bf16", "fp16"):
            raise SpdInputError(f"mixed_precision must be auto, no, bf16 or fp16, got '{self.mixed_precision}'")


# ------------------------------------------------------------------------------------------ the head


def new_head(
    staged: StagedModel, cfg: DistillConfig, draft_ids: torch.Tensor | None = None, draft_sha256: str | None = None
) -> Speculator:
    """A fresh head for ``staged``: the target's attention shape, rope, norm and LM head (copied; only the rows
    of ``draft_ids`` with a draft vocabulary, spd.heads.draft_vocab).

    ``staged`` is a :class:`StagedModel` or, offline, a :class:`spd.training.capture.CapturedTarget`.
    """
    tcfg = staged.config
    schedule, max_depth = VARIANTS[cfg.variant]
    head_cfg = SpeculatorConfig(
        hidden_size=tcfg.hidden_size,
        vocab_size=staged.vocab_size,
        n_stages=staged.n_stages,
        boundaries=staged.boundaries,
        target_num_layers=staged.num_layers,
        anchors=cfg.anchors or default_anchors(staged.boundaries),
        num_layers=cfg.num_layers,
        num_attention_heads=tcfg.num_attention_heads,
        num_key_value_heads=staged.kv_heads,
        head_dim=staged.head_dim,
        intermediate_size=tcfg.intermediate_size,
        rms_norm_eps=getattr(tcfg, "rms_norm_eps", 1e-6),
        qk_norm=tcfg.model_type in ("qwen3", "qwen3_moe"),
        rope_parameters=dict(
            getattr(tcfg, "rope_parameters", None)
            or {"rope_type": "default", "rope_theta": getattr(tcfg, "rope_theta", 1e4)}
        ),
        max_position_embeddings=staged.max_positions or 4096,
        schedule=schedule,
        max_depth=max_depth,
        draft_steps=cfg.draft_steps if schedule == "serial" else None,
        memory_proj=cfg.memory_proj,
        target_name_or_path=cfg.target,
        target_revision=cfg.target_revision,
        target_model_type=tcfg.model_type,
        draft_vocab_size=None if draft_ids is None else len(draft_ids),
        draft_vocab_sha256=draft_sha256,
    )
    head = Speculator(head_cfg).to(device=staged.device, dtype=staged.dtype)
    with torch.no_grad():
        if draft_ids is None:
            head.lm_head.weight.copy_(staged.lm_head.weight)
        else:
            head.draft_ids.copy_(draft_ids)
            head.lm_head.weight.copy_(staged.lm_head.weight[draft_ids.to(staged.device)])
        head.norm.weight.copy_(staged.norm_scale())  # the target's scale (1 + w for Qwen3.5-style norms)
        if cfg.fc_init == "deepest":
            d = tcfg.hidden_size
            for k, fc in head.fc.items():
                anchors = head_cfg.anchors[int(k)]
                deepest = anchors.index(max(anchors))
                fc.weight.zero_()
                fc.weight[:, deepest * d : (deepest + 1) * d] = torch.eye(d, dtype=fc.weight.dtype)
        if cfg.layer_init == "target":
            for layer in head.layers:
                copy_target_layer(layer, staged, cfg.layer_init_from)
    return head


def with_draft_vocab(head: Speculator, staged: StagedModel, draft_ids: torch.Tensor, sha256: str | None) -> Speculator:
    """``head`` over the draft vocabulary ``draft_ids`` (sorted target ids): every other weight as it was, the LM-head
    row of a token ``head`` had kept as trained, a new token's row the target's own (as :func:`new_head` starts)."""
    device = head.lm_head.weight.device
    draft_ids = draft_ids.to(device)
    config = copy.deepcopy(head.config)
    config.draft_vocab_size, config.draft_vocab_sha256 = len(draft_ids), sha256
    moved = Speculator(config).to(device=device, dtype=head.lm_head.weight.dtype)
    state = {k: v for k, v in head.state_dict().items() if k not in ("lm_head.weight", "draft_ids")}
    missing, unexpected = moved.load_state_dict(state, strict=False)
    assert set(missing) == {"lm_head.weight", "draft_ids"} and not unexpected, (missing, unexpected)
    with torch.no_grad():
        moved.draft_ids.copy_(draft_ids)
        rows_D = staged.lm_head.weight[draft_ids.to(staged.lm_head.weight.device)].to(
            device, moved.lm_head.weight.dtype
        )
        old_ids = head.draft_ids if head.draft_ids is not None else torch.arange(head.lm_head.weight.shape[0])
        old_ids = old_ids.to(device)
        # position of each new id in the old (sorted) vocabulary, and whether it is there
        where = torch.searchsorted(old_ids, draft_ids).clamp(max=len(old_ids) - 1)
        known = old_ids[where] == draft_ids
        rows_D[known] = head.lm_head.weight[where[known]]
        moved.lm_head.weight.copy_(rows_D)
    return moved


# head layer parameter -> the Hugging Face decoder layer's (Llama/Qwen3 layout); norms are read off separately
_TARGET_LAYER_NAMES = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
    "input_layernorm": "input_layernorm",
    "post_attention_layernorm": "post_attention_layernorm",
    "q_norm": "self_attn.q_norm",
    "k_norm": "self_attn.k_norm",
}


@torch.no_grad()
def copy_target_layer(layer: nn.Module, staged: StagedModel, index: int) -> None:
    """Start a head decoder layer as a copy of the target's decoder layer ``index`` (negative: from the end).

    The layer must be a full-attention layer with a dense MLP of the head's shapes; a norm's scale is read off
    the norm applied to a unit vector, so ``w`` and ``1 + w`` conventions both copy correctly.
    """
    layers = getattr(staged, "layers", None)
    if layers is None:
        raise SpdInputError(
            "layer_init=target needs the target's weights, which offline captures do not hold; "
            "train online (no capture) or use layer_init=random"
        )
    if not -len(layers) <= index < len(layers):
        raise SpdInputError(f"layer_init_from must name one of the target's {len(layers)} decoder layers, got {index}")
    source = layers[index]
    for name, path in _TARGET_LAYER_NAMES.items():
        dest = getattr(layer, name)
        if dest is None:
            continue
        try:
            src = source.get_submodule(path)
        except AttributeError:
            raise SpdInputError(
                f"target layer {index} has no {path} (a linear-attention or MoE layer?); "
                f"layer_init=target needs a full-attention layer with a dense MLP"
            ) from None
        if isinstance(dest, nn.Linear):
            if src.weight.shape != dest.weight.shape:
                raise SpdInputError(
                    f"target layer {index}'s {path} is {tuple(src.weight.shape)}, "
                    f"the head's {name} {tuple(dest.weight.shape)}"
                )
            dest.weight.copy_(src.weight)
        else:
            unit = torch.ones(1, dest.weight.shape[0], dtype=torch.float64, device=src.weight.device)
            eps = getattr(src, "variance_epsilon", getattr(src, "eps", 0.0))
            dest.weight.copy_(src(unit.to(src.weight.dtype))[0].double() * (1.0 + eps) ** 0.5)


def scale_fc_init(head: Speculator, rms: dict[int, float]) -> None:
    """Re-draw every FC_k so that each anchor block contributes equally and g^k has unit RMS.

    ``rms[a]`` is the RMS of ``H^a`` over real positions of a fixed batch. Hidden states grow along the residual
    stream (on the testbed H^0 is ~0.06, H^1 ~2.3, H^8 ~3.7), so with one std for the whole FC the embedding's
    share, and ``g^0`` (the query's own input), start tiny.
    """
    d = head.config.hidden_size
    with torch.no_grad():
        for k, fc in head.fc.items():
            anchors = head.config.anchors[int(k)]
            for i, a in enumerate(anchors):
                std = 1.0 / (rms[a] * math.sqrt(len(anchors) * d))
                fc.weight[:, i * d : (i + 1) * d].normal_(0.0, std)


# --------------------------------------------------------------------------------------------- batches


def collate(rows: list[dict], pad_id: int, multiple: int = 1, limit: int | None = None) -> dict[str, torch.Tensor]:
    """Right-pad rows to one length, the longest row's rounded up to a ``multiple`` (but not past ``limit``, nor
    shorter than the longest row); ``supervised_BN[b, t]`` marks positions whose next token has a loss.

    Padding is neither attended to (it comes after every real token, under a causal mask) nor supervised: it
    changes no loss, only how many shapes the kernels see."""
    n = padded_length(max(len(r["input_ids"]) for r in rows), multiple, limit)
    ids = torch.full((len(rows), n), pad_id, dtype=torch.long)
    valid = torch.zeros(len(rows), n, dtype=torch.bool)
    supervised = torch.zeros(len(rows), n, dtype=torch.bool)
    for b, r in enumerate(rows):
        length = len(r["input_ids"])
        ids[b, :length] = torch.as_tensor(r["input_ids"])
        valid[b, :length] = True
        mask = torch.as_tensor(r["loss_mask"], dtype=torch.bool)
        supervised[b, : length - 1] = mask[1:]
    return {"input_ids": ids, "valid": valid, "supervised": supervised}


def to_device(batch: dict, device) -> dict:
    """A batch (with nested ``hidden`` states) on ``device``."""
    return {k: to_device(v, device) if isinstance(v, dict) else v.to(device) for k, v in batch.items()}


def teacher_anchors(head: Speculator, staged: StagedModel) -> list[int]:
    """Hidden-state indices one teacher pass must capture: the head's anchors and H^L."""
    return sorted(set(head.needed_anchors()) | {staged.num_layers})


def teacher_pass(staged: StagedModel, anchors: list[int], batch: dict) -> dict[int, torch.Tensor]:
    """``{a: H^a}`` of a batch: from the target (online), or the states a captured batch carries (offline)."""
    if "hidden" in batch:  # H^L is absent from a top-k capture, whose teacher does not need it
        return {a: batch["hidden"][a] for a in anchors if a in batch["hidden"]}
    with torch.no_grad():
        return staged.hidden_states(batch["input_ids"], anchors)


def distill_step(
    head,
    staged: StagedModel,
    hidden: dict[int, torch.Tensor],
    batch: dict,
    fill_B: torch.Tensor,
    tau: float,
    chunk: int,
    pad_to: int = 1,
):
    """The head's KD loss for one batch: (mean over supervised positions, KDResult); the loss's last chunk of
    positions padded to a multiple of ``pad_to`` (``pad_to_multiple_of``: fewer shapes, the same loss).

    ``head`` may be wrapped (DDP/DeepSpeed): its ``forward`` computes the loss, so the wrapper sees it all.
    """
    topk = (batch["topk_ids"], batch["topk_logprobs"]) if "topk_ids" in batch else None
    supervised = batch["supervised"]
    result = head(hidden, fill_B, batch["valid"], kd_objective, supervised, staged.logits, tau, chunk, topk, pad_to)
    return result.loss_sum / max(1, result.count), result


def training_fills(cfg: DistillConfig) -> tuple[int, float]:
    """``(max fill, p_full)`` for :func:`spd.training.kd.sample_fills`: the pipeline's n and the paper's rule, or for the
    serial drafter (variant eagle) every number of drafts in flight 1..draft_steps equally often (p_full 1/m)."""
    if cfg.variant == "eagle":
        return cfg.draft_steps, 1.0 / cfg.draft_steps
    return cfg.n_stages, cfg.p_full
