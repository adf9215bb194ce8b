"""Interfaces that every layer may use: the rollout engine's (``engine.py``)."""
