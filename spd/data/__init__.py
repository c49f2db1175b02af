"""Data: training rows from conversations or text, regenerated chat data and the instructions it answers, and
the benchmark prompt sets."""
