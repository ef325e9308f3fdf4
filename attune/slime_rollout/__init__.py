"""Rollout functions that slime imports by path (--rollout-function-path); importable without slime installed."""
