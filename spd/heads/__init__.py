"""Speculation heads: our head (config, layers, its memory at inference), the engine's calls on a head
(``interface``), draft vocabularies, and the SPD authors' published formats (``published``)."""
