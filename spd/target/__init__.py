"""The target: a Hugging Face causal LM cut into pipeline stages, its KV caches and linear-attention state,
model loading (GGUF included), and the testbed built on this machine."""
