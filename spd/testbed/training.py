"""Training one testbed model from scratch: a Llama-architecture causal LM on random windows of the token stream."""

from __future__ import annotations

import math
import time

import numpy as np
import torch
from tqdm.auto import tqdm

from .config import ModelSpec


def make_llama(spec: ModelSpec, tokenizer, seed: int):
    """A freshly initialised LlamaForCausalLM for ``spec`` (fp32, sdpa attention)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden,
        intermediate_size=spec.ffn,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=4 * spec.seq_len,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    return model


def _lr_at(step: int, total: int, spec: ModelSpec) -> float:
    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    progress = min(1.0, (step - spec.warmup_steps) / max(1, total - spec.warmup_steps))
    return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate_loss(model, tokens: np.ndarray, seq_len: int, max_tokens: int, batch_size: int = 16) -> float:
    """Mean next-token cross-entropy over consecutive windows of the validation stream."""
    model.eval()
    n_windows = max(1, min(len(tokens) - 1, max_tokens) // seq_len)
    data = torch.from_numpy(tokens[: n_windows * seq_len + 1].astype(np.int64))
    total, count = 0.0, 0
    for start in range(0, n_windows, batch_size):
        idx = torch.arange(start, min(n_windows, start + batch_size))[:, None] * seq_len
        x = data[idx + torch.arange(seq_len)]
        y = data[idx + torch.arange(1, seq_len + 1)]
        logits = model(input_ids=x).logits
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
        count += y.numel()
    return total / count


def train_model(
    name: str, spec: ModelSpec, tokenizer, train_tokens: np.ndarray, seed: int, progress: bool = True
) -> tuple[object, dict]:
    """Train a model from scratch on random windows of the train stream; returns (model, training record)."""
    if spec.steps is None and not (spec.minutes and spec.minutes > 0):
        raise ValueError(f"the {name} needs a step count or a positive time budget")
    model = make_llama(spec, tokenizer, seed)
    model.train()
    params = [p for p in model.parameters()]
    opt = _adamw(params, spec)
    data = torch.from_numpy(train_tokens.astype(np.int64))
    if len(data) <= spec.seq_len + 1:
        raise RuntimeError(f"the train split has {len(data)} tokens, fewer than one window of {spec.seq_len}")
    gen = torch.Generator().manual_seed(seed + 1)
    offsets = torch.arange(spec.seq_len + 1)
    forward_backward = _forward_backward(model)
    step_fn = torch.compile(forward_backward) if spec.compile else forward_backward
    total = spec.steps
    calibrate_after = 20  # steps timed to turn the time budget into a step count (inside the warmup)
    bar = tqdm(total=total, desc=f"train {name}", unit="step", disable=not progress)
    t0 = time.perf_counter()
    t_cal = None
    step, losses = 0, []
    while total is None or step < total:
        if total is None and step == 3:
            t_cal = time.perf_counter()  # the first steps include one-off warm-up costs
        if total is None and step == 3 + calibrate_after:
            per_step = (time.perf_counter() - t_cal) / calibrate_after
            total = max(step + 1, int(spec.minutes * 60 / per_step))
            bar.total = total
            bar.refresh()
        lr = _lr_at(step, total or 10**9, spec)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(data) - spec.seq_len - 1, (spec.batch_size,), generator=gen)
        window = data[starts[:, None] + offsets]
        loss, step_fn = _step(step_fn, forward_backward, window, opt, first=step == 0)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        step += 1
        bar.update(1)
        if step % 10 == 0:
            bar.set_postfix(loss=f"{sum(losses[-10:]) / 10:.3f}", lr=f"{lr:.2e}")
    bar.close()
    elapsed = time.perf_counter() - t0
    model.eval()
    return model, _record(spec, step, elapsed, losses)


def _adamw(params: list[torch.nn.Parameter], spec: ModelSpec) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices only (not on norms and biases)."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=spec.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


def _forward_backward(model):
    """The step's forward and backward pass over a batch of windows; returns the loss."""

    def forward_backward(window):
        logits = model(input_ids=window[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
        loss.backward()
        return loss.detach()

    return forward_backward


def _step(step_fn, eager, window: torch.Tensor, opt: torch.optim.Optimizer, first: bool):
    """``step_fn`` over ``window``: (loss, the step function from now on). A compiled step that fails on the first
    window falls back to ``eager`` for the rest of the run."""
    try:
        return step_fn(window), step_fn
    except Exception as exc:  # a compiler toolchain problem must not stop the build: train eagerly
        if step_fn is eager or not first:
            raise
        tqdm.write(f"warning: torch.compile failed ({type(exc).__name__}); training without it")
        opt.zero_grad(set_to_none=True)
        return eager(window), eager


def _record(spec: ModelSpec, steps: int, elapsed: float, losses: list[float]) -> dict:
    """What the training did: steps, tokens, minutes, throughput and the final loss (the mean of the last 50)."""
    return {
        "steps": steps,
        "train_tokens": steps * spec.batch_size * spec.seq_len,
        "train_minutes": round(elapsed / 60, 2),
        "tokens_per_s": round(steps * spec.batch_size * spec.seq_len / elapsed, 1),
        "final_train_loss": round(sum(losses[-50:]) / len(losses[-50:]), 4),
    }
