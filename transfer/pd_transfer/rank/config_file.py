"""Read the transfer config document the operator renders into every engine pod.

One reader for every engine the module serves (the reference engine, the vLLM connector):
the same errors for the same broken file, naming the file and the field.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from pd_contract.config import CONFIG_VERSION, TransferConfig

__all__ = ["TransferConfigError", "load_transfer_config"]


class TransferConfigError(ValueError):
    """The transfer config file is missing, unreadable, of another version, or invalid."""


def load_transfer_config(path: Path) -> TransferConfig:
    """Parse the rendered transfer config at ``path``."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise TransferConfigError(f"cannot read the transfer config {path}: {exc}") from exc
    version = raw.get("version") if isinstance(raw, dict) else None
    if version != CONFIG_VERSION:
        raise TransferConfigError(
            f"{path}: config version {version!r}, this module reads {CONFIG_VERSION}; run "
            f"matching operator and engine versions")
    try:
        return TransferConfig.model_validate(raw)
    except ValidationError as exc:
        raise TransferConfigError(f"{path}: invalid transfer config: {exc}") from exc
