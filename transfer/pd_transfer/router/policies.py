"""Which engine of a role serves a request: ``round-robin``, ``least-load``, ``cache-aware``.

Every policy picks from the role's ready endpoints at the moment of the request (sorted
by name, never empty: the dispatcher answers 503 first), so an engine that joins is in the
next pick and one that leaves is in none.

- ``round-robin``: each role's endpoints in turn.
- ``least-load``: the endpoint with the fewest requests in flight (``InFlight``); ties
  in turn, so an idle fleet is used evenly.
- ``cache-aware``: rendezvous (highest random weight) hashing of the request's affinity
  key (``prompts``) over the endpoints: the same key ranks the endpoints the same way, so
  a shared prompt prefix lands on the same prefill and the same decode engine, and an
  endpoint joining or leaving moves only the keys it wins or held. Bounded by load: the
  best-ranked endpoint with at most ``balance_threshold`` more requests in flight than the
  idlest one wins, so one hot prefix cannot pile onto one engine. No key: least-load.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from typing import Protocol, assert_never

from pd_contract.transferagent import Role
from pd_transfer.router.endpoints import Endpoint
from pd_transfer.router.inflight import InFlight
from pd_transfer.router.settings import PolicyName

__all__ = ["CacheAware", "LeastLoad", "Policy", "RoundRobin", "make_policy",
           "rendezvous_score"]


class Policy(Protocol):
    def pick(self, role: Role, endpoints: Sequence[Endpoint], key: str | None) -> Endpoint:
        """One of ``endpoints`` (non-empty, all of ``role``) for a request with ``key``."""
        ...


class RoundRobin:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._turn = dict.fromkeys(Role, 0)

    def pick(self, role: Role, endpoints: Sequence[Endpoint], key: str | None) -> Endpoint:
        with self._lock:
            turn = self._turn[role]
            self._turn[role] = turn + 1
        return endpoints[turn % len(endpoints)]


class LeastLoad:
    def __init__(self, inflight: InFlight) -> None:
        self._inflight = inflight
        self._ties = RoundRobin()

    def pick(self, role: Role, endpoints: Sequence[Endpoint], key: str | None) -> Endpoint:
        loads = [self._inflight.load(e) for e in endpoints]
        least = min(loads)
        idlest = [e for e, load in zip(endpoints, loads, strict=True) if load == least]
        return self._ties.pick(role, idlest, None)


def rendezvous_score(key: str, endpoint: Endpoint) -> int:
    """The endpoint's weight for ``key``: 64 bits of BLAKE2b over both (stable across
    processes and restarts, unlike ``hash()``)."""
    digest = hashlib.blake2b(f"{key}\x00{endpoint.name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class CacheAware:
    def __init__(self, inflight: InFlight, balance_threshold: int) -> None:
        self._inflight = inflight
        self._threshold = balance_threshold
        self._unkeyed = LeastLoad(inflight)

    def pick(self, role: Role, endpoints: Sequence[Endpoint], key: str | None) -> Endpoint:
        if key is None:
            return self._unkeyed.pick(role, endpoints, None)
        ranked = sorted(endpoints, key=lambda e: rendezvous_score(key, e), reverse=True)
        loads = {e: self._inflight.load(e) for e in ranked}
        bound = min(loads.values()) + self._threshold
        return next(e for e in ranked if loads[e] <= bound)


def make_policy(name: PolicyName, inflight: InFlight, balance_threshold: int) -> Policy:
    match name:
        case PolicyName.ROUND_ROBIN:
            return RoundRobin()
        case PolicyName.LEAST_LOAD:
            return LeastLoad(inflight)
        case PolicyName.CACHE_AWARE:
            return CacheAware(inflight, balance_threshold)
    assert_never(name)
