"""Errors of the local development control plane.

    DevClusterError            anything that stops `dev-cluster` from doing its job;
     └── ToolchainMissingError the binaries are not built yet (run `pd-dev cluster build`)

Every message says what went wrong and what to do about it, so the CLI prints it as is
and exits non-zero instead of showing a traceback.
"""

from __future__ import annotations

__all__ = ["DevClusterError", "ToolchainMissingError"]


class DevClusterError(Exception):
    """A dev-cluster step failed; the message names the cause and the fix."""


class ToolchainMissingError(DevClusterError):
    """A binary the control plane needs is not in the cache yet."""
