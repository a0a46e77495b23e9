"""Trust and the rank documents: the deployment's transfer key and the frames every message,
notification and document travels in (``auth``), and the per-rank bootstrap document a peer
fetches, decrypts and validates before it talks to a rank (``bootstrap``).

Imported by path (``pd_transfer.trust.auth``); this package's import loads nothing.
"""
