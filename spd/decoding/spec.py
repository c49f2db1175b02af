"""The decoding settings, defined once: :class:`DecodingSpec`.

Every field is one command-line flag of the same name (``tree_width`` is ``--tree-width``). From the dataclass come
spd-generate's and spd-serve's flags (:meth:`DecodingSpec.add_flags`, with their parsers, defaults and help), their
checks (:meth:`DecodingSpec.check`, one :class:`~spd.errors.SpdInputError` each), the distributed runtime's command
line (:meth:`DecodingSpec.argv`) and the engine (:func:`spd.decoding.factory.build_engine`). The server's
:class:`~spd.serving.pipeline.PipelineSpec` adds where the stages run.

``--mode`` has one default everywhere, :func:`default_mode`: ``spd`` with a ``--speculator``, ``tree`` with only a
``--draft-model``, else ``ar``.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

from ..errors import SpdInputError
from ..paths import check_model_source
from .modes import MODES, check_mode, check_proposer, check_unused, require_pipelined

CANDIDATES = ("auto", "sampled", "top-k")  # how a tree's children are chosen at T > 0 (greedy: always top-k)


def default_mode(speculator: str | None, draft_model: str | None) -> str:
    """The mode when none is given: ``spd`` with a head, ``tree`` with only a draft model, else ``ar``."""
    return "spd" if speculator is not None else "tree" if draft_model is not None else "ar"


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got '{text}'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got '{text}'") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got '{text}'")
    return value


def tree_width_flag(text: str) -> int | str:
    from .tree_width import parse_tree_width

    try:
        return parse_tree_width(text)
    except SpdInputError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got '{text}'") from None


def boundaries_flag(text: str) -> list[int]:
    from ..target.cut import parse_boundaries

    try:
        return parse_boundaries(text)
    except SpdInputError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--boundaries ")) from None


def flag(default, help: str, parse=None, choices=None, factory=None, required=False, aliases: tuple[str, ...] = ()):
    """A field that is also a flag: its default, help text, parser and choices (``required``: a flag that must be
    given; the field's default None is refused where a model is loaded; ``aliases``: other names of the flag)."""
    metadata = {"help": help, "parse": parse, "choices": choices, "required": required, "aliases": aliases}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def add_field_flags(settings: type, parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    """Add every :func:`flag` of the dataclass ``settings`` but ``exclude`` to ``parser`` as
    ``--name-with-dashes``."""
    for f in fields(settings):
        if f.name in exclude or "help" not in f.metadata:
            continue
        if f.default is not MISSING:
            default = f.default
        else:
            assert f.default_factory is not MISSING  # flag() gives every field a default or a factory
            default = f.default_factory()
        kwargs = {"default": default, "help": f.metadata["help"]}
        if f.metadata["required"]:
            kwargs = {"required": True, "help": f.metadata["help"]}
        if f.metadata["parse"] is not None:
            kwargs["type"] = f.metadata["parse"]
        if f.metadata["choices"] is not None:
            kwargs["choices"] = f.metadata["choices"]
        names = ("--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ()))
        parser.add_argument(*names, dest=f.name, **kwargs)


def fields_argv(settings, names) -> list[str]:
    """The command line that gives another program these fields of ``settings``: ``--flag value`` for each of
    ``names`` that is set (a list as comma-separated values)."""
    out = []
    for name in names:
        value = getattr(settings, name)
        if isinstance(value, list):
            value = ",".join(map(str, value))
        if value is not None:
            out += ["--" + name.replace("_", "-"), str(value)]
    return out


@dataclass
class DecodingSpec:
    """What to run and how: a mode, the target, its head or draft model, and the runtime (see the module docstring)."""

    mode: str | None = flag(
        None,
        f"decoding mode: one of {', '.join(MODES)} (default: spd with --speculator, tree "
        "with only --draft-model, else ar)",
    )
    target: str | None = flag(
        None, "target model: a local directory or a Hugging Face hub id (owner/name); required", required=True
    )
    revision: str | None = flag(None, "hub revision (branch, tag or commit) of --target (default: the default branch)")
    tokenizer: str | None = flag(None, "tokenizer directory or hub id (default: the target's)")
    stages: int | None = flag(
        None,
        "pipeline stages the target is cut into: equal where they divide its layers, else the larger stages "
        "first, e.g. 8 stages of 4, 4, 4, 4, 4, 4, 3, 3 layers for 30 (default: the speculator's cut, else 1)",
        positive_int,
    )
    boundaries: list[int] | None = flag(
        None,
        "cut the target at these layer indices instead, e.g. 8,16,23 "
        "for 30 layers in 4 stages of 8, 8, 7, 7 (default: the speculator's "
        "cut, else --stages)",
        boundaries_flag,
    )
    speculator: str | None = flag(
        None,
        "speculation head for --mode spd or tree (a head trained for the pipeline), "
        "or --mode sd (a head trained with variant=eagle): a directory or hub id; --head is the same flag "
        "(default: none)",
        aliases=("--head",),
    )
    speculator_revision: str | None = flag(None, "hub revision of --speculator (default: the default branch)")
    draft_model: str | None = flag(
        None,
        "draft model for --mode tree or sd: a directory or hub id of a small causal LM with the target's tokenizer "
        "(default: none)",
    )
    draft_steps: int = flag(
        4, "--mode sd: tokens drafted one after another per target forward, m (default: %(default)s)", positive_int
    )
    draft_revision: str | None = flag(None, "hub revision of --draft-model (default: the default branch)")
    tree_width: int | str = flag(
        4,
        "--mode tree: tree nodes kept per level, W, or 'auto' (follows the measured "
        "acceptance, up to --tree-max-width) (default: %(default)s)",
        tree_width_flag,
    )
    tree_children: int = flag(4, "--mode tree: candidate children per node, K (default: %(default)s)", positive_int)
    tree_max_width: int = flag(
        8, "--mode tree --tree-width auto: the largest width (default: %(default)s)", positive_int
    )
    tree_candidates: str = flag(
        "auto",
        "--mode tree at T > 0: children drawn from the proposer's distribution "
        "(sampled) or its top-K (top-k); auto = sampled (greedy always uses top-k) "
        "(default: %(default)s)",
        choices=CANDIDATES,
    )
    device: str = flag("cpu", "torch device (cpu, cuda, cuda:1, ...) (default: %(default)s)")
    dtype: str = flag(
        "float32", "the weights' dtype (default: %(default)s)", choices=("float32", "bfloat16", "float16")
    )
    runtime: str = flag(
        "local",
        "local: one process; distributed: one process per stage plus rank 0 on "
        "torch.distributed (modes spd, pp and tree) (default: %(default)s)",
        choices=("local", "distributed"),
    )
    emulate_stage_ms: float = flag(
        0.0,
        "--runtime distributed: added compute time per stage call (a token, a tree level, a batch) "
        "(default: %(default)s)",
        float,
    )
    emulate_link_ms: float = flag(0.0, "--runtime distributed: added latency per message (default: %(default)s)", float)
    timeout_s: float = flag(
        60.0, "--runtime distributed: a rank silent this long counts as lost (default: %(default)s)", float
    )

    def __post_init__(self):
        if self.mode is None:
            self.mode = default_mode(self.speculator, self.draft_model)

    # ------------------------------------------------------------------------------------ the flags
    @classmethod
    def add_flags(cls, parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
        """Add every field but ``exclude`` to ``parser`` as ``--name-with-dashes``."""
        add_field_flags(cls, parser, exclude)

    @classmethod
    def of(cls, settings, **overrides) -> DecodingSpec:
        """From any object with these attribute names (the CLIs' parsed flags, another spec)."""
        values = {f.name: getattr(settings, f.name) for f in fields(cls) if hasattr(settings, f.name)}
        return cls(**{**values, **overrides})

    def argv(self, names: tuple[str, ...]) -> list[str]:
        """The command line that gives another program (the distributed runtime's) these fields' values: ``--flag
        value`` for each of ``names`` that is set."""
        return fields_argv(self, names)

    # ----------------------------------------------------------------------------------- the checks
    def check_numbers(self) -> None:
        """The runtime's numbers: finite, ``>= 0`` for the emulated delays, ``> 0`` for the timeout."""
        check_runtime_numbers(
            self.timeout_s, emulate_stage_ms=self.emulate_stage_ms, emulate_link_ms=self.emulate_link_ms
        )

    def check(self) -> None:
        """The checks that need no model loaded (one SpdInputError each)."""
        mode, speculator, draft = self.mode, self.speculator is not None, self.draft_model is not None
        assert mode is not None  # __post_init__ resolves the default
        check_mode(mode)
        check_proposer(mode, speculator, draft)
        check_unused(mode, speculator, draft)
        if mode == "sd" and self.stages not in (None, 1):
            raise SpdInputError(
                f"--mode sd runs the whole target in one process (no pipeline), so --stages must be "
                f"1, got {self.stages}"
            )
        if self.runtime == "distributed":
            require_pipelined(mode, "--runtime distributed runs")
        if self.runtime == "local" and (self.emulate_stage_ms or self.emulate_link_ms):
            raise SpdInputError("--emulate-stage-ms / --emulate-link-ms need --runtime distributed")
        self.check_numbers()

    def check_sources(self) -> None:
        """The target, tokenizer, head and draft model can be had: a local path that does not exist is refused at
        once, a hub id asked for once (:func:`~spd.paths.check_model_source`); cheap, before torch is imported."""
        check_model_source(self.target, "target", self.revision)
        if self.tokenizer is not None:
            check_model_source(self.tokenizer, "tokenizer")
        speculator = self.speculator
        # The SPD authors' head files (.pt, hf://) are found by their own loader (spd.heads.published).
        if speculator is not None and not (
            speculator.startswith("hf://")
            or Path(speculator).suffix in (".pt", ".pth", ".bin")
            or Path(speculator).expanduser().is_file()
        ):
            check_model_source(speculator, "speculator", self.speculator_revision)
        if self.draft_model is not None:
            check_model_source(self.draft_model, "draft model", self.draft_revision)


def check_runtime_numbers(timeout_s: float, **delays: float) -> None:
    """``timeout_s`` finite and positive; each emulated delay (named by its field) finite and ``>= 0``."""
    # nan passes every comparison and inf every lower bound: the numbers must be finite as well.
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise SpdInputError(f"--timeout-s must be a positive number of seconds, got {timeout_s}")
    for name, value in delays.items():
        if not (math.isfinite(value) and value >= 0):
            raise SpdInputError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {value}")
