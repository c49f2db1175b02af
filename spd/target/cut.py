"""Cuts: which decoder layers each pipeline stage owns (docs/method.md §1).

A cut is a list of boundaries ``[0, b1, ..., L]``: stage ``s`` (0-based here, 1..n in the paper) owns layers
``[boundaries[s], boundaries[s+1])``. This module makes, checks, parses and names cuts; it loads no model.
"""

from __future__ import annotations

from ..errors import SpdInputError, first_line
from ..reading import check_model_files


def split_layers(num_layers: int, n_stages: int | None = None, boundaries: list[int] | None = None) -> list[int]:
    """Stage boundaries ``[0, b1, ..., L]``: ``n_stages`` stages cut by :func:`balanced_boundaries` (equal where n
    divides L), or checked explicit ones."""
    if boundaries is not None:
        b = list(boundaries)
        if b and b[0] != 0:
            b = [0] + b
        if b and b[-1] != num_layers:
            b = b + [num_layers]
        if len(b) < 2 or any(x >= y for x, y in zip(b, b[1:])) or b[0] != 0 or b[-1] != num_layers:
            raise SpdInputError(
                f"stage boundaries {list(boundaries)} are invalid: expected strictly increasing layer indices "
                f"between 0 and {num_layers} (the model has {num_layers} layers)"
            )
        if n_stages is not None and len(b) - 1 != n_stages:
            raise SpdInputError(f"{len(b) - 1} stages from boundaries {b} but {n_stages} stages were requested")
        return b
    if n_stages is None or n_stages < 1:
        raise SpdInputError(f"the number of stages must be a positive integer, got {n_stages}")
    if n_stages > num_layers:
        raise SpdInputError(f"{n_stages} stages need at least {n_stages} layers, but the model has {num_layers}")
    return balanced_boundaries(num_layers, n_stages)


def balanced_boundaries(num_layers: int, n_stages: int) -> list[int]:
    """The most even cut of ``num_layers`` into ``n_stages``: the first ``L mod n`` stages get one layer more.

    This is the cut of ``--stages N`` and the one the published SmolLM2 heads were trained on (30 layers: 8,8,7,7 at
    n = 4 and 4,4,4,4,4,4,3,3 at n = 8). A pipeline step lasts as long as its slowest stage, so an uneven cut costs
    ``ceil(L/n) / (L/n)`` in step time against an ideal equal one (1.067 at both).
    """
    per, extra = divmod(num_layers, n_stages)
    sizes = [per + (s < extra) for s in range(n_stages)]
    return [sum(sizes[:s]) for s in range(n_stages + 1)]


def describe_cut(boundaries: list[int]) -> str:
    """A cut in words: ``8 stages of 4, 4, 4, 4, 4, 4, 3, 3 layers`` (``1 stage of 30 layers``)."""
    sizes = [b - a for a, b in zip(boundaries, boundaries[1:])]
    stages = f"{len(sizes)} stage" + ("s" if len(sizes) > 1 else "")
    return f"{stages} of {', '.join(map(str, sizes))} layers"


def cut_flag(boundaries: list[int]) -> str:
    """The flag that asks for this cut: ``--boundaries 8,16,23`` (``--stages 1`` for the whole target)."""
    inner = boundaries[1:-1]
    return f"--boundaries {','.join(map(str, inner))}" if inner else "--stages 1"


def parse_boundaries(text: str) -> list[int]:
    """``--boundaries`` as given on a command line: comma-separated layer indices (inner ones, or 0,...,L)."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SpdInputError(f"--boundaries '{text}' is not a list of layer indices; expected e.g. 8,16,23") from None
    if not values:
        raise SpdInputError("--boundaries is empty; expected comma-separated layer indices, e.g. 8,16,23")
    return values


def target_num_layers(target: str, revision: str | None = None) -> int:
    """The decoder depth of ``target`` (a directory or hub id), read from its config alone."""
    from transformers import AutoConfig

    check_model_files(target, "target")
    try:
        config = AutoConfig.from_pretrained(target, revision=revision)
    except (OSError, ValueError) as exc:
        raise SpdInputError(f"could not read the target's config from '{target}': {first_line(exc)}") from None
    return config.get_text_config().num_hidden_layers
