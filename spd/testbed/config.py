"""The settings of a testbed build: the corpus, the tokenizer, and each model's architecture and training budget."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelSpec:
    """Architecture and training budget of one testbed model."""

    layers: int  # decoder layers
    hidden: int  # hidden size D
    heads: int  # attention heads
    kv_heads: int  # key/value heads (GQA when smaller than heads)
    ffn: int  # SwiGLU intermediate size
    steps: int | None  # optimizer steps (deterministic); None: derive them from `minutes`
    minutes: float | None = None  # wall-clock training budget, used only when `steps` is None
    lr: float = 3e-3  # peak AdamW learning rate (warmup, then cosine decay to 10%)
    warmup_steps: int = 100
    batch_size: int = 16
    seq_len: int = 256  # training window; the models' max_position_embeddings is 4x this
    compile: bool = True  # torch.compile the forward/backward (~1.4x tokens/s on a 2-core CPU); eager fallback


@dataclass
class TestbedConfig:
    """All settings of a testbed build; the cache key of every component."""

    vocab_size: int = 4096
    val_fraction: float = 0.05  # share of files (by hash of the path) held out for validation
    max_files: int | None = None  # use only the first N files (sorted by path): for miniature builds
    seed: int = 0
    eval_tokens: int = 131072  # validation tokens used for the reported loss/perplexity (cap)
    # The target: 8 layers so that 1, 2, 4 and 8 stages divide it. Calibrated on a 2-core CPU (MEASURED.md):
    # smaller-and-longer beats wider-and-shorter within a 20-minute budget.
    # Step counts: what a 15- and a 4-minute budget gave on the idle reference machine (docs/testbed.md).
    target: ModelSpec = field(
        default_factory=lambda: ModelSpec(layers=8, hidden=128, heads=4, kv_heads=4, ffn=384, steps=1023)
    )
    draft: ModelSpec = field(
        default_factory=lambda: ModelSpec(layers=2, hidden=96, heads=4, kv_heads=4, ffn=256, steps=810)
    )
