"""``python -m spd.bench NAME [ARGS]``: the same as ``spd-bench NAME [ARGS]`` (spd/cli/bench.py)."""

import sys

from spd.cli.bench import main

sys.exit(main())
