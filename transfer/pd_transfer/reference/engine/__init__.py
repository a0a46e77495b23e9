"""The reference engine (``pd-transfer engine``): one pod's stand-in for SGLang/vLLM.

Reading order: ``errors`` → ``service`` (ranks, pages, peers, prefill/decode requests) →
``faults`` (TEST-ONLY transport wrapper) → ``http_api`` (routes, validation, limits) →
``main`` (start-up order, the agent, signals).
"""

from pd_transfer.reference.engine.errors import (
    EngineBusy,
    EngineConfigError,
    EngineError,
    RequestRejected,
)

__all__ = ["EngineBusy", "EngineConfigError", "EngineError", "RequestRejected"]
