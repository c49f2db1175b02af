"""SPD: Speculative Pipeline Decoding - speculation heads, their training, and a pipelined inference engine."""

__version__ = "0.1.0"
