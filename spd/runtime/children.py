"""Child processes that end with their parent: the server's stage processes and spd-adapt, spd-generate's torchrun.

A child started with :func:`start_child` runs in its own session (process group), so that a Ctrl-C in the
terminal reaches the parent alone and the parent decides how its children stop, and on Linux it asks the
kernel for SIGTERM when its parent dies (``prctl(PR_SET_PDEATHSIG)``): even a parent killed with SIGKILL,
which runs no handler, leaves no orphan. :func:`end_child` stops a child's whole group (SIGTERM, then
SIGKILL after a grace period); :func:`sigterm_unwinds` makes SIGTERM raise SystemExit in the main thread, so
that a parent's ``finally`` / ``except`` blocks stop its children on the way out.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h

if sys.platform.startswith("linux"):
    import ctypes

    # Loaded here, in the parent: the function that runs in the forked child must not import or allocate.
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
else:
    _prctl = None


def start_child(cmd: list[str], nice: int = 0, **kwargs) -> subprocess.Popen:
    """``subprocess.Popen(cmd, **kwargs)`` in a new session, with SIGTERM on its parent's death (Linux), ``nice``
    added to its niceness (a background job that must not slow its parent)."""
    parent = os.getpid()

    def die_with_parent() -> None:
        if _prctl is not None:
            _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != parent:  # the parent died before the request took effect
                os._exit(1)
        if nice:
            os.nice(nice)

    return subprocess.Popen(
        cmd, start_new_session=True, preexec_fn=die_with_parent if _prctl or nice else None, **kwargs
    )


def end_child(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Stop a child started by :func:`start_child` and what it started in its process group; wait for it."""
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(proc.pid, signal.SIGKILL)  # whatever is left of the group: the child too after the grace period
    proc.wait()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def sigterm_unwinds() -> None:
    """SIGTERM raises SystemExit(143) in the main thread (128 + SIGTERM, the status a shell reports), so that
    cleanup code runs instead of the process vanishing with its children still running."""
    signal.signal(signal.SIGTERM, _raise_exit)


def _raise_exit(*_) -> None:
    raise SystemExit(128 + signal.SIGTERM)
