"""The old place of :mod:`spd.target.staging`: importing from here still works, with a DeprecationWarning,
until spd 0.3."""

import warnings

from .target.staging import *  # noqa: F401,F403

warnings.warn("spd.staging moved to spd.target.staging; the old path stops working in spd 0.3", DeprecationWarning,
              stacklevel=2)
