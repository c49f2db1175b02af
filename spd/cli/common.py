"""What the programs share: their argument parser (one ``error:`` line, exit status 2) and quiet libraries."""

from __future__ import annotations

import argparse


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (usage is in --help) and exit code 2."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def quiet_libraries() -> None:
    """Silence the libraries' progress bars and warnings."""
    # Library progress bars and warnings (weight loading, long-sequence notices) would interleave with
    # the streamed text; our own checks report what matters.
    import transformers
    from huggingface_hub.utils import disable_progress_bars

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    disable_progress_bars()
