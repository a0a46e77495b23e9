"""Rollout of staging pool sizes to running pods, without restarts.

Two parts, each its own face: the `planner` package (pure: no I/O, no clock) decides the
next step as a function of the observed pods; the `executor` module (API calls only) carries
the decision out. Nothing is re-exported here, so an import names which half it needs. See
README.md for the reading order.
"""

__all__: list[str] = []
