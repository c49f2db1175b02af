"""Distilling a head from a frozen target: config, batches and checkpoints, the KD loss with simulated pipeline
fills, offline captures of the target's states, and the accelerate back-ends."""
