"""``spd-bench NAME [ARGS]`` (or ``python -m spd.bench NAME [ARGS]``): every benchmark of spd/bench/ behind one
command. ``spd-bench --help`` lists them with their purpose, ``spd-bench NAME --help`` gives one's flags.

A benchmark is the module ``spd.bench.<NAME>`` (a ``-`` in NAME is a ``_`` in the module's name) with a
``main(argv)``. Only the benchmark that runs is imported: the list is read from the modules' docstrings, so
``--help`` loads no torch.
"""

from __future__ import annotations

import ast
import importlib
import sys
from collections.abc import Sequence
from importlib.util import find_spec
from pathlib import Path

# In the order --help lists them: decoding, serving and the runtime, the machine's costs, training, data.
BENCHMARKS = (
    "decode",
    "ar",
    "batch",
    "serve",
    "runtime",
    "prefill",
    "link",
    "gpu",
    "hybrid-tree",
    "linear-state",
    "layout",
    "training",
    "train-memory",
    "regenerate",
    "adapt",
    "reproduce",
)


def module_of(name: str) -> str:
    """The module that holds the benchmark ``name``."""
    return "spd.bench." + name.replace("-", "_")


def purpose(name: str) -> str:
    """A benchmark's purpose: the first line of its module's docstring, read without importing the module."""
    spec = find_spec(module_of(name))
    source = Path(spec.origin).read_text(encoding="utf-8") if spec and spec.origin else ""
    return (ast.get_docstring(ast.parse(source)) or "").split("\n", 1)[0].replace("``", "")


def usage() -> str:
    width = max(map(len, BENCHMARKS))
    lines = [f"  {name:<{width}}  {purpose(name)}" for name in BENCHMARKS]
    return "\n".join(
        [
            "usage: spd-bench NAME [ARGS]  (or python -m spd.bench NAME [ARGS])",
            "",
            "The benchmarks of speculative pipeline decoding; spd-bench NAME --help gives a benchmark's flags.",
            "",
            "benchmarks:",
            *lines,
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(usage())
        return 0
    known = ", ".join(BENCHMARKS)
    if not argv or argv[0].startswith("-"):
        print(f"error: spd-bench needs a benchmark NAME first; expected one of {known}", file=sys.stderr)
        return 2
    name, args = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"error: there is no benchmark '{name}'; expected one of {known}", file=sys.stderr)
        return 2
    return importlib.import_module(module_of(name)).main(args)
