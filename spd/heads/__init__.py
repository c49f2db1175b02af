"""Speculation heads: our head (config, layers, engine cache API), draft vocabularies, and the SPD authors'
published formats (``published``)."""
