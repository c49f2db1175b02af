"""The decoding modes and their rules, written once: which run on a pipeline of stages (and so batch and run on the
distributed runtime), which need a head, which take a draft model, and the one message each rule gives.

Two surfaces name the same inputs differently: the programs' flags (``--mode spd``, ``--speculator``;
:func:`check_proposer`, :func:`check_unused`, :func:`require_pipelined`) and the Python API (``mode="spd"``,
``speculator=``; :func:`check_engine_mode`). Each rule is written once per surface, here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import SpdInputError

_SD_DRAFTER = (
    "--mode sd takes one drafter: --draft-model DIR_OR_ID (a small causal LM with the "
    "target's tokenizer) or --speculator DIR_OR_ID (a head trained with variant=eagle)"
)


@dataclass(frozen=True)
class Mode:
    """One decoding mode: where it runs and which proposer it takes."""

    name: str
    pipelined: bool  # runs the pipeline's step loop: its own stage count, the distributed runtime, batching
    head: str  # "needs" a --speculator, "either" a head or a draft model (exactly one), or "none"
    missing: str = ""  # the flags' message when its proposer is missing
    both: str = ""  # the flags' message when a head and a draft model are both given

    @property
    def batched(self) -> bool:
        """Whether the batched pipeline (``--max-batch``, ``spd-bench decode --batch``) runs it: it drives the step
        loop."""
        return self.pipelined

    @property
    def takes_head(self) -> bool:
        return self.head != "none"

    @property
    def takes_draft(self) -> bool:
        return self.head == "either"


# In the order the messages list them (spd, pp, tree: the pipelined ones).
RULES: dict[str, Mode] = {
    mode.name: mode
    for mode in (
        Mode("spd", True, "needs", "--mode spd needs --speculator DIR_OR_ID (a head trained by train/distill.py)"),
        Mode("pp", True, "none"),
        Mode(
            "tree",
            True,
            "either",
            "--mode tree needs --draft-model DIR_OR_ID (a small causal LM with the target's "
            "tokenizer) or --speculator DIR_OR_ID (an SPD head)",
            "--mode tree takes one proposer: --draft-model or --speculator, not both",
        ),
        Mode("sd", False, "either", _SD_DRAFTER, _SD_DRAFTER),
        Mode("ar", False, "none"),
    )
}
MODES = ("ar", "pp", "spd", "tree", "sd")  # as --mode's help and its errors list them
PIPELINED = tuple(name for name, mode in RULES.items() if mode.pipelined)  # ("spd", "pp", "tree")
_HEAD_MODES = tuple(name for name, mode in RULES.items() if mode.takes_head)
_DRAFT_MODES = tuple(name for name, mode in RULES.items() if mode.takes_draft)


def _listing(names: tuple[str, ...], last: str = "or") -> str:
    """``a, b or c``."""
    return ", ".join(names[:-1]) + f" {last} " + names[-1] if len(names) > 1 else names[0]


def check_mode(name: str) -> Mode:
    """The mode ``--mode`` names, or one SpdInputError."""
    if name not in RULES:
        raise SpdInputError(f"unknown --mode '{name}'; expected one of: {', '.join(MODES)}")
    return RULES[name]


def check_proposer(name: str, speculator: bool, draft_model: bool) -> None:
    """A mode gets the proposer it needs: spd a head, tree and sd exactly one of a head and a draft model."""
    mode = RULES[name]
    if mode.head == "needs" and not speculator:
        raise SpdInputError(mode.missing)
    if mode.head == "either" and not (speculator or draft_model):
        raise SpdInputError(mode.missing)
    if mode.head == "either" and speculator and draft_model:
        raise SpdInputError(mode.both)


def check_unused(name: str, speculator: bool, draft_model: bool) -> None:
    """No head or draft model given to a mode that would leave it unused."""
    if speculator and not RULES[name].takes_head:
        raise SpdInputError(
            f"--speculator is only used by --mode {_listing(_HEAD_MODES, 'and')}, but --mode is '{name}'"
        )
    if draft_model and not RULES[name].takes_draft:
        raise SpdInputError(
            f"--draft-model is only used by {_listing(tuple('--mode ' + m for m in _DRAFT_MODES), 'and')}, "
            f"but --mode is '{name}'"
        )


def require_pipelined(name: str, what: str) -> None:
    """Refuse a mode without a pipeline where ``what`` (e.g. "--runtime distributed runs") needs one."""
    if not RULES.get(name, RULES["ar"]).pipelined:
        raise SpdInputError(f"{what} --mode {_listing(PIPELINED)}, not '{name}'")


# ------------------------------------------------------------------------------------ the Python API
NEEDS_HEAD = "mode 'spd' needs a speculation head; pass a speculator or use mode 'pp'"
NEEDS_PROPOSER = "the tree mode needs a proposer: an SPD head or a draft model"


def check_engine_mode(name: str, head: bool, draft_model: bool = False) -> None:
    """The Python API's rules (:class:`~spd.decoding.engine.Engine`): a pipelined mode, ``spd`` with a head, ``tree``
    with a proposer, a draft model in ``tree`` only."""
    if name not in PIPELINED:
        raise SpdInputError(f"unknown engine mode '{name}'; expected one of: {', '.join(PIPELINED)}")
    if RULES[name].head == "needs" and not head:
        raise SpdInputError(NEEDS_HEAD)
    if draft_model and not RULES[name].takes_draft:
        raise SpdInputError(
            f"a draft model proposes in mode 'tree', not '{name}' (serial drafting is spd.SpeculativeDecoder)"
        )
    if RULES[name].takes_draft and not (head or draft_model):
        raise SpdInputError(NEEDS_PROPOSER)


# The programs' flags that the Python API names otherwise (the rest: --draft-model is draft_model, and so on).
_PYTHON_NAMES = {"stages": "n_stages", "tree-width": "width", "tree-children": "children"}


def in_python_terms(message: str) -> str:
    """A message of the rules the programs share (the cut, the head's fit), written with their flags (``--stages
    8``, ``--boundaries 4,8,12``, ``--mode spd``), in the Python API's argument names (``n_stages=8``,
    ``boundaries=[4, 8, 12]``, ``mode 'spd'``): :meth:`spd.Engine.from_pretrained` says what its caller typed."""
    flag = r"(?<![\w/.-])--"  # a flag, not the inside of a name ("models--owner--name" in the hub's cache)
    message = re.sub(flag + r"boundaries (\d+(?:,\d+)*)", lambda m: f"boundaries=[{m[1].replace(',', ', ')}]", message)
    message = re.sub(flag + r"stages (\d+)", r"n_stages=\1", message)
    message = re.sub(flag + rf"mode ({'|'.join(MODES)})\b", r"mode '\1'", message)
    return re.sub(flag + r"([a-z][a-z0-9-]*)", lambda m: _PYTHON_NAMES.get(m[1], m[1].replace("-", "_")), message)
