"""The testbed: a small real target model, a smaller draft model and their tokenizer, built on this machine.

Everything is derived from the Python standard library's own source files (found with ``sysconfig``):
a train/validation corpus split by file, a byte-level BPE tokenizer trained on the train split, and two
Llama-architecture causal LMs trained from scratch on it. The result is a set of ordinary Hugging Face
directories (``target/``, ``draft/``, ``tokenizer/``) plus ``testbed.json`` with the settings and the
measured validation loss / perplexity of both models.

Builds are deterministic and cached per component: calling :func:`build_testbed` again with the same
settings does nothing. By default the models train for fixed step counts (about 15 + 4 minutes on the
2-core reference machine), so the result does not depend on how busy the machine is. A time budget
(``minutes``) instead derives the step count from the measured speed of the first steps; ``testbed.json``
records it, and passing it back as ``steps`` rebuilds the identical model.

The builder replaces only what it wrote itself: ``corpus/`` (recognised by its ``corpus.json``),
``tokenizer/``, ``target/`` and ``draft/`` (by their ``testbed_build.json``, which lists the files the build
wrote), ``prompts.jsonl`` and ``testbed.json`` (by their contents). Anything else at those paths is refused
(:class:`spd.errors.SpdInputError`) unless ``force``; even then the builder only writes its own files beside
what is there, and removes nothing it did not write.
"""

from .build import build_testbed, check_outputs
from .config import ModelSpec, TestbedConfig
from .corpus import build_corpus, stdlib_dir, stdlib_source_files

__all__ = [
    "ModelSpec",
    "TestbedConfig",
    "build_corpus",
    "build_testbed",
    "check_outputs",
    "stdlib_dir",
    "stdlib_source_files",
]
