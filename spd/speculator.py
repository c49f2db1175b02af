"""The old place of :mod:`spd.heads.config`, :mod:`spd.heads.speculator` and :mod:`spd.heads.loading`: importing
from here still works, with a DeprecationWarning, until spd 0.3."""

import warnings

from .heads.config import *  # noqa: F401,F403
from .heads.speculator import *  # noqa: F401,F403
from .heads.loading import *  # noqa: F401,F403

warnings.warn("spd.speculator moved to spd.heads.config, spd.heads.speculator and spd.heads.loading; the old path "
              "stops working in spd 0.3", DeprecationWarning, stacklevel=2)
