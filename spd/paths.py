"""Default locations, and where a model named by the user is: a local path or a hub id (importing this module is
cheap: no torch)."""

import functools
import os
from pathlib import Path

from .errors import SpdInputError, first_line


def default_testbed_dir() -> Path:
    """Where the testbed lives unless told otherwise: ``$SPD_TESTBED`` or ``./testbed``."""
    return Path(os.environ.get("SPD_TESTBED", "testbed"))


def default_cache_dir() -> str:
    """Where prepared datasets are cached: ``$SPD_CACHE`` or ``~/.cache/spd``."""
    return os.environ.get("SPD_CACHE", str(Path.home() / ".cache" / "spd"))


def check_model_source(source: str | None, what: str, revision: str | None = None) -> None:
    """Refuse, in one sentence and before anything loads, a model that cannot be had: a local path that does not
    exist (refused at once, never looked up on the hub), a file where a directory belongs, or a hub id that the hub
    does not have or that cannot be fetched (asked once, with a short timeout and no retries; only the local cache
    with ``HF_HUB_OFFLINE=1``)."""
    if source is None or not str(source).strip():
        raise SpdInputError(f"no {what} given; expected a model directory or a hub id (owner/name)")
    source = str(source)
    path = Path(source).expanduser()
    if path.is_dir():
        return
    if path.exists():
        raise SpdInputError(f"the {what} '{source}' is a file; expected a model directory or a hub id")
    why_local = local_only(source)
    if why_local is not None:
        raise SpdInputError(
            f"the {what} directory '{source}' does not exist ({why_local}, so it was not looked up on the hub); "
            "expected a model directory or a hub id (owner/name)"
        )
    problem = hub_problem(source, revision)
    if problem is not None:
        raise SpdInputError(
            f"the {what} '{source}' is not a local directory ('{path.absolute()}' does not exist) and {problem}; "
            "expected a model directory or a hub id the hub has (with HF_HUB_OFFLINE=1: one in the local hub cache)"
        )


def local_only(source: str) -> str | None:
    """Why ``source`` can only be a local path (a hub id is ``name`` or ``owner/name`` of letters, digits, ``-``,
    ``_`` and ``.``), or None when it may be a hub id."""
    if source.startswith((".", "~", "/")) or "\\" in source or (os.altsep and os.altsep in source):
        return "it is a path"
    if source.count("/") > 1 or source.endswith("/"):
        return "a hub id has at most one '/'"
    first = Path(source.split("/")[0])
    if "/" in source and first.exists():
        return f"'{first}' is a local {'directory' if first.is_dir() else 'file'}"
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(source)
    except HFValidationError:
        return "it cannot be a hub id"
    return None


@functools.cache
def hub_problem(repo_id: str, revision: str | None = None, filename: str | None = None) -> str | None:
    """Why the hub repo ``repo_id`` (its ``filename``; None: a model, whose ``config.json`` is asked for but may be
    missing) cannot be had, as the middle of a sentence that says what was tried, or None when it can: in the local
    cache with ``HF_HUB_OFFLINE=1``, else the hub answers one request for it (``HF_HUB_ETAG_TIMEOUT`` seconds at
    most, no retries) or, unreachable, the cache has it (and the process then reads the cache only,
    :func:`use_the_cache_only`). Asked once per process."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url, try_to_load_from_cache
    from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    names = (filename,) if filename else ("config.json", "tokenizer_config.json")
    cached = any(isinstance(try_to_load_from_cache(repo_id, name, revision=revision), str) for name in names)
    if constants.HF_HUB_OFFLINE:
        if cached:
            return None
        what = f"'{filename}' of the hub repo '{repo_id}'" if filename else f"the hub id '{repo_id}'"
        return f"{what} is not in the local hub cache (HF_HUB_OFFLINE is set, so the hub was not asked)"
    try:
        # One request without retries: huggingface_hub retries a file it cannot fetch for about 20 s, per file.
        url = hf_hub_url(repo_id, filename or "config.json", revision=revision)
        get_hf_file_metadata(url, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except RevisionNotFoundError:
        return f"the hub repo '{repo_id}' has no revision '{revision}'"
    except RepositoryNotFoundError:
        return f"the hub has no repo '{repo_id}' (or it is private or gated: log in with 'hf auth login')"
    except EntryNotFoundError:
        # A model repo without config.json (a tokenizer alone) is its loader's to judge.
        return f"the hub repo '{repo_id}' has no file '{filename}'" if filename else None
    except Exception as exc:  # the network's errors come in many classes (DNS, refused, timeout, proxy, 5xx)
        if not cached:
            return f"the hub could not be reached to fetch '{repo_id}' ({first_line(exc)})"
        use_the_cache_only(first_line(exc))
    return None


def use_the_cache_only(reason: str) -> None:
    """The hub cannot be reached: the rest of this process, and the processes it starts, read only the local hub
    cache, as with ``HF_HUB_OFFLINE=1``, rather than retrying each file they look for (about 20 s a file)."""
    import sys

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return
    constants.HF_HUB_OFFLINE = True  # huggingface_hub and transformers ask is_offline_mode(), which reads it
    os.environ["HF_HUB_OFFLINE"] = "1"
    print(
        f"warning: the hub cannot be reached ({reason}); using the local hub cache only, as HF_HUB_OFFLINE=1 does",
        file=sys.stderr,
    )
