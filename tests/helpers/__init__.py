"""Helpers that several test modules share (fixtures stay in tests/conftest.py)."""
