"""What the tests and the benchmarks both use, importable from either without the repository on the path.

``server.py`` (``spd-serve`` in its own process, waited for until it listens), ``ties.py`` (where two greedy runs
of the same model may part: near ties of the top-two logits), ``netns.py`` (several "machines" on this one as
network namespaces, for the multi-node tests and ``spd-bench prefill``).
"""
