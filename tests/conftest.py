"""Shared fixtures: tiny random Hugging Face models of several families, and a miniature testbed."""

from __future__ import annotations

import contextlib
import io
import math
import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from spd.testing.ties import first_difference

REPO = Path(__file__).resolve().parents[1]

# At most 2 intra-op threads (the CI machine has 2 cores); OMP_NUM_THREADS=1 wins when the machine is shared,
# because spinning OpenMP threads on a busy core make every small op orders of magnitude slower. Under pytest-xdist
# (scripts/test.sh runs two workers) the cores are shared out among the workers, and the CLI processes and
# distributed ranks that tests start inherit the same share through OMP_NUM_THREADS.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))
_THREADS = int(os.environ.get("OMP_NUM_THREADS") or min(2, os.cpu_count() or 1))
torch.set_num_threads(_THREADS)


@pytest.fixture(autouse=True)
def _own_thread_share():
    """Every test starts with the worker's share of the cores: a test (or the library code it calls) that sets
    torch's thread count must not leave it for the tests after it: spinning threads on a shared core are slow
    (tests/test_tree_sampling.py on two workers: 112 s at 1 thread each, 594 s at 2 each)."""
    yield
    if torch.get_num_threads() != _THREADS:
        torch.set_num_threads(_THREADS)


def differences_are_near_ties(
    staged, prompt: list[int], solo: list[int], other: list[int], what: str = "outputs"
) -> int:
    """0 if ``other`` equals the solo run's ``solo``; 1 if they first differ where the solo run's top-two logits are
    a near tie (:func:`spd.testing.ties.near_tie_tolerance`; printed with its margin); fails otherwise."""
    difference = first_difference(staged, prompt, solo, other)
    if difference is None:
        return 0
    assert difference.margin != math.inf, f"{what}: {len(other)} tokens instead of the solo run's {len(solo)}"
    assert difference.near_tie, (
        f"{what} differ at token {difference.token} where the solo run's top-two margin is "
        f"{difference.margin:.2e} (near-tie tolerance {difference.tolerance:.2e})"
    )
    print(f"{what}: near-tie at token {difference.token} (margin {difference.margin:.2e})")
    return 1


def tiny_config(family: str, layers: int = 8, vocab: int = 128, **overrides):
    """A tiny random config of a Hugging Face decoder-only family (fp32, sdpa)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "mistral":
        return MistralConfig(**{"sliding_window": None, **common})
    if family == "qwen2":
        return Qwen2Config(**common)
    if family == "qwen3":
        return Qwen3Config(**{"head_dim": 16, **common})
    if family == "qwen3_5":
        # Hybrid: three linear-attention (Gated DeltaNet) layers per full-attention layer, as in Qwen3.5.
        from transformers import Qwen3_5TextConfig

        return Qwen3_5TextConfig(
            **{
                "head_dim": 16,
                "linear_num_key_heads": 2,
                "linear_num_value_heads": 4,
                "linear_key_head_dim": 16,
                "linear_value_head_dim": 16,
                "linear_conv_kernel_dim": 4,
                **common,
            }
        )
    if family == "qwen3_moe":
        # Mixture of experts in every layer (Qwen3-30B-A3B's layout): 4 experts, 2 routed per token.
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            **{
                "head_dim": 16,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
                "decoder_sparse_step": 1,
                **common,
            }
        )
    if family == "qwen3_5_moe":
        # Hybrid and mixture of experts (Qwen3.5's larger released models): routed experts plus a shared one.
        from transformers import Qwen3_5MoeTextConfig

        return Qwen3_5MoeTextConfig(
            **{
                "head_dim": 16,
                "linear_num_key_heads": 2,
                "linear_num_value_heads": 4,
                "linear_key_head_dim": 16,
                "linear_value_head_dim": 16,
                "linear_conv_kernel_dim": 4,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 32,
                **common,
            }
        )
    if family == "qwen3_next":
        from transformers import Qwen3NextConfig

        return Qwen3NextConfig(
            **{
                "head_dim": 16,
                "linear_num_key_heads": 2,
                "linear_num_value_heads": 4,
                "linear_key_head_dim": 16,
                "linear_value_head_dim": 16,
                "linear_conv_kernel_dim": 4,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 32,
                **common,
            }
        )
    raise ValueError(family)


def tiny_model(family: str, seed: int = 0, attn: str = "sdpa", **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(family, **overrides)
    config._attn_implementation = attn
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    # Random init has tiny weights; scale up so that logits are far from uniform (ties would hide bugs).
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(8.0)
    return model.eval()


def tiny_multimodal(family: str = "qwen3_5", **text_overrides):
    """A tiny random Qwen3.5 (or Qwen3.5-MoE) ForConditionalGeneration, the layout of the released checkpoints: a
    one-block vision tower beside the text decoder of :func:`tiny_config`."""
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
    )

    config_cls, model_cls = (
        (Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration)
        if family == "qwen3_5_moe"
        else (Qwen3_5Config, Qwen3_5ForConditionalGeneration)
    )
    torch.manual_seed(0)
    config = config_cls(
        text_config=tiny_config(family, **text_overrides).to_dict(),
        tie_word_embeddings=text_overrides.get("tie_word_embeddings", False),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64),
    )
    return model_cls(config).eval()


@pytest.fixture(scope="session")
def tiny_testbed(tmp_path_factory) -> Path:
    """A miniature testbed built once per run with the real builder (seconds); under pytest-xdist the workers share
    it (the first to ask builds it, the others wait on a lock), so read it and copy what a test would change."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above each worker's own
    out = root / "tiny-testbed"
    with FileLock(str(root / "tiny-testbed.lock")):
        if not (root / "tiny-testbed.done").is_file():
            run_script("data/build_testbed.py", "--out", str(out), "--tiny", "--quiet")
            (root / "tiny-testbed.done").touch()
    return out


@pytest.fixture(scope="module")
def tiny_heads(tiny_testbed, tmp_path_factory) -> dict[int, Path]:
    """Untrained heads for the miniature testbed at n = 2 and 4, saved as from_pretrained directories."""
    import torch

    from spd.target.staging import StagedModel
    from spd.training.distill import DistillConfig, new_head

    root = tmp_path_factory.mktemp("heads")
    heads = {}
    for n in (2, 4):
        staged = StagedModel.from_pretrained(tiny_testbed / "target", n_stages=n)
        torch.manual_seed(n)
        new_head(staged, DistillConfig(n_stages=n, target=str(tiny_testbed / "target"))).save_pretrained(root / f"n{n}")
        heads[n] = root / f"n{n}"
    return heads


@pytest.fixture(scope="module")
def heads(tiny_testbed, tmp_path_factory) -> dict[int, Path]:
    """Untrained heads for the miniature testbed at n = 2, 4 and 8 (the runtime tests' own seeds)."""
    from spd.target.staging import StagedModel
    from spd.training.distill import DistillConfig, new_head

    root = tmp_path_factory.mktemp("runtime-heads")
    out = {}
    for n in (2, 4, 8):
        staged = StagedModel.from_pretrained(tiny_testbed / "target", n_stages=n)
        torch.manual_seed(10 + n)
        head = new_head(staged, DistillConfig(n_stages=n, target=str(tiny_testbed / "target")))
        head.save_pretrained(root / f"n{n}")
        out[n] = root / f"n{n}"
    return out


def run_main(main: Callable[[list[str]], int], *args: str) -> subprocess.CompletedProcess:
    """A program's ``main(argv)`` called in this process, reported as its finished process would be: the exit code
    (argparse's SystemExit included) and what it printed. For wrong-input cases, where a fresh interpreter proves
    nothing more; each program keeps end-to-end tests that start it as a user does."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's errors: exit(2, message)
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return subprocess.CompletedProcess(["main", *args], code, out.getvalue(), err.getvalue())


def two_at_a_time(run: Callable, cases: Iterable) -> list:
    """``[run(case) for case in cases]``, two at a time: for independent CLI processes, which spend most of
    their time importing torch and transformers (CI has 2 cores)."""
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(run, cases))


def run_script(script: str, *args: str, check: bool = True, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run one of the repo's scripts in a fresh interpreter, as a user would."""
    return _run_python([str(REPO / script), *args], script, check, timeout)


def run_bench(name: str, *args: str, check: bool = True, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run ``spd-bench NAME ARGS`` (as ``python -m spd.bench``) in a fresh interpreter, as a user would."""
    return _run_python(["-m", "spd.bench", name, *args], f"spd-bench {name}", check, timeout)


def _run_python(argv: list[str], what: str, check: bool, timeout: int) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if check and proc.returncode != 0:
        raise AssertionError(f"{what} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc
