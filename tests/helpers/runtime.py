"""The torch.distributed runtime: torchrun of spd.cli.run_pipeline (one rank per stage and rank 0), the prompts its
tests run, and the single-process engine's outputs for them."""

import os
import subprocess
import sys

import torch

from conftest import REPO
from spd.decoding.engine import Engine
from spd.decoding.proposers import DraftModelProposer, SpdHeadProposer
from spd.heads.loading import load_speculator
from spd.target.staging import StagedModel
from spd.target.tokenizer import load_tokenizer

PROMPTS = [
    "def main(argv):\n    ",
    "import os\n",
    "class A:\n    def __init__(self):",
    # long enough that the prefill's activations do not fit one message slot (the spilled path)
    "import sys\nimport os\n\n\ndef parse(argv):\n    options = {}\n    for arg in argv[1:]:\n"
    "        key, _, value = arg.partition('=')\n        options[key.lstrip('-')] = value\n"
    "    return options\n\n\nclass Runner:\n    def __init__(self, options):\n        self.",
]


def torchrun(n: int, *args: str, timeout: int = 400, **popen) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(n + 1),
        "--master-port",
        str(master_port()),
        "-m",
        "spd.cli.run_pipeline",
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env, **popen)


def master_port() -> int:
    from spd.runtime.world import free_port

    return free_port()


def reference_outputs(tiny_testbed, head_dir, n, mode, temperature, top_k, seed, max_new, width=2, draft=None):
    """The single-process engine's outputs for PROMPTS (tree mode: SPD-head tree of ``width``, or a draft tree)."""
    torch.set_num_threads(1)
    staged = StagedModel.from_pretrained(tiny_testbed / "target", n_stages=n)
    tok = load_tokenizer(tiny_testbed / "target")
    if mode == "tree" and draft is not None:
        source = DraftModelProposer(StagedModel.from_pretrained(draft, n_stages=1), staged, 4)
        engine = Engine.tree(staged, source, width, tok)
    elif mode == "tree":
        engine = Engine.tree(staged, SpdHeadProposer(load_speculator(head_dir), staged, 4), width, tok)
    else:
        engine = Engine.chain(staged, load_speculator(head_dir), tok)
    return [
        engine.generate(
            tok(p)["input_ids"],
            max_new,
            mode=mode,
            temperature=temperature,
            top_k=top_k,
            seed=None if seed is None else seed + i,
        )
        for i, p in enumerate(PROMPTS)
    ]
