"""Ask Linux for the AMX tile state on behalf of vLLM's CPU kernels in the dev cluster's vLLM env.

vLLM 0.32's CPU attention (bf16, block size a multiple of 32) runs AMX tile instructions on
hosts that have them without first asking the kernel for the tile state
(``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``, which torch's own AMX users ask
for). On such a host the first of those instructions kills the worker with SIGILL: a P/D
decode worker dies on its first request, whichever KV connector loaded it.
``vllm_env.install_amx_hook`` copies this file into that virtualenv's site-packages with a
``.pth`` line that calls ``request_amx_tiles()`` as each of its interpreters starts, vLLM's
spawned workers included. Standard library only, and nothing at import: it runs before
anything else in those interpreters.
"""

from __future__ import annotations

import ctypes
import platform
import sys

__all__ = ["amx_tiles_permitted", "request_amx_tiles"]

_SYS_ARCH_PRCTL = 158  # x86-64 syscall number
_ARCH_GET_XCOMP_PERM = 0x1022
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def _libc() -> ctypes.CDLL | None:
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def request_amx_tiles() -> bool:
    """Ask for the tile state (granted to the whole process); True if it may use AMX tiles
    now. False on hosts without AMX, or outside Linux on x86-64: nothing is changed then."""
    libc = _libc()
    if libc is None:
        return False
    libc.syscall(ctypes.c_long(_SYS_ARCH_PRCTL), ctypes.c_long(_ARCH_REQ_XCOMP_PERM),
                 ctypes.c_long(_XFEATURE_XTILEDATA))
    return amx_tiles_permitted()


def amx_tiles_permitted() -> bool:
    """Whether this process may use AMX tiles (``ARCH_GET_XCOMP_PERM``)."""
    libc = _libc()
    if libc is None:
        return False
    features = ctypes.c_ulong(0)
    if libc.syscall(ctypes.c_long(_SYS_ARCH_PRCTL), ctypes.c_long(_ARCH_GET_XCOMP_PERM),
                    ctypes.byref(features)) != 0:
        return False
    return bool(features.value >> _XFEATURE_XTILEDATA & 1)
