"""The old place of :mod:`spd.decoding.generation`: importing from here still works, with a DeprecationWarning,
until spd 0.3."""

import warnings

from .decoding.generation import *  # noqa: F401,F403

warnings.warn("spd.generation moved to spd.decoding.generation; the old path stops working in "
              "spd 0.3", DeprecationWarning, stacklevel=2)
