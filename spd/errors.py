"""User-facing errors (importing this module is cheap: no torch)."""


class SpdInputError(ValueError):
    """A wrong input: the message is one sentence naming the input and what was expected."""
