"""What both sides (and the hosts above them) use beside the endpoint: the transfer metrics
and the agent's snapshot (``metrics``), per-part stamps (``phases``), the descriptor
arithmetic of the direct paths and the path choice (``paths``), and the retry delays of the
Kubernetes clients (``backoff``).

Imported by path (``pd_transfer.common.metrics``); this package's import loads nothing, so
the torch-free sidecars (``native``, the router) may take ``metrics`` and ``backoff``.
"""
