"""The programs installed with spd: ``spd-generate`` (generate.py), ``spd-serve`` (serve.py), ``spd-convert``
(convert.py), ``spd-bench`` (bench.py: the benchmarks of spd/bench/), and the runtime's rank program
(``python -m spd.cli.run_pipeline``, started by the first two or by torchrun)."""
