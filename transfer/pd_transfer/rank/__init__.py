"""Rank wiring: one rank opened the same way for every engine (``opening``: endpoint,
bootstrap server and worker, all or nothing), the thread that steps it (``worker``), a peer
pod's rank documents connected to every local rank (``pod_peers``), and the transfer config
document the operator renders into every engine pod (``config_file``).

Imported by path (``pd_transfer.rank.opening``); this package's import loads nothing, so the
torch-free engine-native agent may read the config file.
"""
