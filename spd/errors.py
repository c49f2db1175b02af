"""User-facing errors (importing this module is cheap: no torch)."""

from __future__ import annotations

import errno
import sys
from collections.abc import Callable


class SpdInputError(ValueError):
    """A wrong input: the message is one sentence naming the input and what was expected."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when the message is empty)."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def cli_error(exc: BaseException | str, flush: bool = False) -> int:
    """Report a wrong input as a program does: ``error: <message>`` as one line on stderr; returns the exit status 2."""
    print(f"error: {exc}", file=sys.stderr, flush=flush)
    return 2


def run_cli(main: Callable[..., int], *args, flush: bool = False, interrupted: int | None = None) -> int:
    """Run a program's body, ``main(*args)``, and return its exit status; a wrong input (:class:`SpdInputError`)
    is reported by :func:`cli_error` (``error: <message>``, status 2) instead of a traceback.

    A full disk (``ENOSPC``) is reported the same way, naming the file that could not be written: every writer
    here writes beside and renames, so what was there before is intact and a resumable job continues when run again.

    ``flush`` flushes that line at once (programs whose processes share a terminal); with ``interrupted``, Ctrl-C
    (KeyboardInterrupt) ends the program quietly with that status (130 by convention).
    """
    try:
        return main(*args)
    except SpdInputError as exc:
        return cli_error(exc, flush=flush)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        where = f" writing '{exc.filename}'" if exc.filename else ""
        return cli_error(f"the disk is full{where}; free some space and run the same command again", flush=flush)
    except KeyboardInterrupt:
        if interrupted is None:
            raise
        return interrupted
