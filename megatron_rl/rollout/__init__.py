"""Rollout: the engine interface, engines, sampling and workflows."""
