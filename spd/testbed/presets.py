"""The testbed builds by name: ``default`` (the 8-layer target), ``deep`` (the same target four times deeper: 32
layers, so that n = 4, 8 and 16 divide it, as the paper's targets; same width, tokenizer, draft and steps) and the
miniature build of either, which the tests use."""

from __future__ import annotations

import dataclasses

from ..paths import default_testbed_dir
from .config import ModelSpec, TestbedConfig

PRESETS = ("default", "deep")
DEEP_LAYERS = 32


def preset_dir(preset: str) -> str:
    """Where a preset's testbed goes unless told otherwise: the testbed directory (``-deep`` added for deep)."""
    return str(default_testbed_dir()) + ("-deep" if preset == "deep" else "")


def preset_config(
    preset: str = "default",
    *,
    tiny: bool = False,
    vocab_size: int | None = None,
    max_files: int | None = None,
    seed: int | None = None,
    target_steps: int | None = None,
    draft_steps: int | None = None,
    minutes: float | None = None,
    draft_minutes: float | None = None,
    compile: bool = True,
) -> TestbedConfig:
    """The settings of a preset's build. ``tiny``: the miniature build (60 files, a 512-token vocabulary, tiny models
    trained for a few steps). Otherwise the default build's, with what is given instead: the vocabulary, the first
    ``max_files`` files, the seed, each model's optimizer steps or a wall-clock budget in minutes (the steps then
    follow from the speed measured), and torch.compile. None keeps the default build's value."""
    seed = TestbedConfig.seed if seed is None else seed
    if tiny:
        small = dict(hidden=32, heads=2, ffn=64, batch_size=4, seq_len=64, warmup_steps=5, compile=False)
        cfg = TestbedConfig(
            vocab_size=512,
            max_files=max_files or 60,
            val_fraction=0.2,
            seed=seed,
            eval_tokens=4096,
            target=ModelSpec(layers=8, kv_heads=1, steps=20, **small),
            draft=ModelSpec(layers=2, kv_heads=2, steps=10, **small),
        )
    else:
        vocab_size = TestbedConfig.vocab_size if vocab_size is None else vocab_size
        cfg = TestbedConfig(vocab_size=vocab_size, max_files=max_files, seed=seed)
        # A time budget replaces the step count (and then the step count is machine-dependent).
        target_steps = cfg.target.steps if target_steps is None else target_steps
        draft_steps = cfg.draft.steps if draft_steps is None else draft_steps
        cfg.target = dataclasses.replace(
            cfg.target, minutes=minutes, compile=compile, steps=None if minutes else target_steps
        )
        cfg.draft = dataclasses.replace(
            cfg.draft, minutes=draft_minutes, compile=compile, steps=None if draft_minutes else draft_steps
        )
    if preset == "deep":
        cfg.target = dataclasses.replace(cfg.target, layers=DEEP_LAYERS)
    return cfg
