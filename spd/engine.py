"""The old place of :mod:`spd.decoding.engine`: importing from here still works, with a DeprecationWarning,
until spd 0.3."""

import warnings

from .decoding.engine import *  # noqa: F401,F403

warnings.warn("spd.engine moved to spd.decoding.engine; the old path stops working in spd 0.3", DeprecationWarning,
              stacklevel=2)
