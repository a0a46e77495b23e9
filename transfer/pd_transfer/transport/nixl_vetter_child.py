"""The vetting process of ``nixl_vetter``: loads NIXL agent metadata, removes it again, and
answers whether NIXL loaded it; UCX's crashes on hostile metadata kill this process only.

Self-contained on purpose (the standard library and NIXL, nothing of pd_transfer): importing
``pd_transfer.transport`` imports torch, which would triple this process's start time and
quintuple its memory. It is started by path (``python -P <this file>``, so that this
directory, which holds a ``nixl.py``, is not on ``sys.path``; ``python -m
pd_transfer.transport.nixl_vetter_child`` works too, slower), with the engine's environment
and the module of the engine's NIXL build (``--nixl-module``, e.g. ``nixl_cu13._api``: the
CUDA-matched build the engine's ``import nixl`` chose, imported here by name).

Protocol, over stdin/stdout: frames of a u32 big-endian length and a payload. The first frame
out, once the agent exists, is ``{"outcome": "loaded", "detail": <agent name>}`` or
``{"outcome": "unavailable", "detail": <why>}`` (then the process exits). Then each frame in
is one metadata blob, already under a name no other blob had (a refused load poisons its
name in NIXL 1.5.1); each answer is ``{"outcome": "loaded" | "refused", "detail": ...}``.
The process ends at the end of its input. Its stdout carries answers only: whatever UCX or
NIXL print goes to stderr.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import struct
import sys
from collections.abc import Sequence
from typing import IO, Any, Final

_FRAME: Final = struct.Struct(">I")
_MAX_FRAME: Final = 2 << 20


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nixl-module", required=True, help="e.g. nixl_cu13._api")
    parser.add_argument("--name", required=True, help="this process's own NIXL agent name")
    parser.add_argument("--backend", action="append", required=True, dest="backends")
    parser.add_argument("--num-threads", type=int, default=0)
    args = parser.parse_args(argv)
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # what UCX prints stays off the answers
    try:
        agent = _agent(args.nixl_module, args.name, args.backends, args.num_threads)
    except Exception as exc:  # any failure to build the agent is the answer
        _answer(answers, "unavailable", f"{type(exc).__name__}: {exc}")
        return 1
    _answer(answers, "loaded", args.name)
    while (blob := _read_frame(sys.stdin.buffer)) is not None:
        try:
            loaded = agent.add_remote_agent(blob)
        except Exception as exc:  # NIXL's refusal, whatever its class
            _answer(answers, "refused", f"{type(exc).__name__}: {exc}")
            continue
        try:
            agent.remove_remote_agent(loaded.decode() if isinstance(loaded, bytes) else loaded)
        except Exception as exc:  # loaded all the same; the name is never reused
            print(f"nixl vetter {args.name}: removing {loaded!r}: {exc}", file=sys.stderr)
        _answer(answers, "loaded", "")
    return 0


def _agent(module_name: str, name: str, backends: list[str], num_threads: int) -> Any:
    """A NIXL agent with the engine's backends and thread count, as ``NixlTransport`` builds
    it (no progress thread: loading metadata needs none)."""
    api = importlib.import_module(module_name)
    agent = api.nixl_agent(name, api.nixl_agent_config(
        enable_prog_thread=False, enable_listen_thread=False, num_threads=num_threads,
        backends=backends))
    missing = set(backends) - set(agent.backends)
    if missing:
        raise RuntimeError(f"NIXL backends {sorted(missing)} failed to load in the vetting "
                           f"process (available plugins: {agent.get_plugin_list()})")
    return agent


def _answer(stream: IO[bytes], outcome: str, detail: str) -> None:
    payload = json.dumps({"outcome": outcome, "detail": detail}).encode()
    stream.write(_FRAME.pack(len(payload)) + payload)
    stream.flush()


def _read_frame(stream: IO[bytes]) -> bytes | None:
    """The next frame; None at the end of the input (or on a frame too large to be ours)."""
    head = stream.read(_FRAME.size)
    if len(head) < _FRAME.size:
        return None
    (size,) = _FRAME.unpack(head)
    if size > _MAX_FRAME:
        print(f"nixl vetter: a frame of {size} bytes (at most {_MAX_FRAME}); ending",
              file=sys.stderr)
        return None
    payload = stream.read(size)
    return payload if len(payload) == size else None


if __name__ == "__main__":
    sys.exit(main())
