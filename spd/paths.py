"""Default locations (importing this module is cheap: no torch)."""

import os
from pathlib import Path

from .errors import SpdInputError


def default_testbed_dir() -> Path:
    """Where the testbed lives unless told otherwise: ``$SPD_TESTBED`` or ``./testbed``."""
    return Path(os.environ.get("SPD_TESTBED", "testbed"))


def default_cache_dir() -> str:
    """Where prepared datasets are cached: ``$SPD_CACHE`` or ``~/.cache/spd``."""
    return os.environ.get("SPD_CACHE", str(Path.home() / ".cache" / "spd"))


def check_model_source(source: str, what: str) -> None:
    """Refuse a local-looking path that does not exist before any hub lookup is attempted."""
    # Hub ids are "name" or "org/name"; anything else is meant as a local path.
    looks_local = source.startswith((".", "/", "~")) or source.count("/") > 1
    path = Path(source).expanduser()
    if path.exists() and not path.is_dir():
        raise SpdInputError(f"the {what} '{source}' is a file; expected a model directory or a hub id")
    if looks_local and not path.is_dir():
        raise SpdInputError(f"the {what} directory '{source}' does not exist")
