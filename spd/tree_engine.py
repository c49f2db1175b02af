"""The old place of :mod:`spd.decoding.tree_engine`: importing from here still works, with a DeprecationWarning,
until spd 0.3."""

import warnings

from .decoding.tree_engine import *  # noqa: F401,F403

warnings.warn("spd.tree_engine moved to spd.decoding.tree_engine; the old path stops working in "
              "spd 0.3", DeprecationWarning, stacklevel=2)
