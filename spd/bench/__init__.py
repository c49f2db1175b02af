"""The benchmarks, one module each, run as ``spd-bench NAME [ARGS]`` (spd/cli/bench.py lists them); ``report.py``
holds what they share."""
