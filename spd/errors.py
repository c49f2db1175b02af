"""User-facing errors (importing this module is cheap: no torch)."""


class SpdInputError(ValueError):
    """A wrong input: the message is one sentence naming the input and what was expected."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when the message is empty)."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]
