"""The engines a router may send to: ``Endpoint`` and the per-role ``EndpointTable``.

A discovery (static flags, or the Kubernetes pod watch) replaces a role's endpoints whole;
every request reads the current tuple once, so a request never sees half an update. An
endpoint is an engine's OpenAI API (``host:port``) and, for the ``pd-transfer`` protocol,
its pod's bootstrap address (``host:port`` of rank 0's bootstrap server), and its pod's
KV-compatibility key (the ``pd.serving.dev/kv-compat`` label; None where none is known, as
for engines given by URL): a request's prefill and decode have the same key.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from pd_contract.transferagent import Role

__all__ = ["Endpoint", "EndpointTable", "parse_engine"]

_log = logging.getLogger("pd_transfer.router")


@dataclass(frozen=True)
class Endpoint:
    """One engine. Equal endpoints are the same engine (the pod name is only for logs)."""

    role: Role
    host: str
    port: int
    bootstrap: str | None = None
    pod: str | None = field(default=None, compare=False)
    compat: str | None = field(default=None, compare=False)

    @property
    def name(self) -> str:
        """``host:port`` (an IPv6 host in brackets): the ``endpoint`` metric label."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.name}"

    def describe(self) -> str:
        return f"{self.name} (pod {self.pod})" if self.pod else self.name


def parse_engine(spec: str, role: Role, bootstrap_port: int | None) -> Endpoint:
    """``http://HOST:PORT[@BOOTSTRAP_HOST:PORT]`` → Endpoint; without ``@`` the bootstrap
    address is HOST and ``bootstrap_port`` (none when that is None). ValueError names the
    spec."""
    url, at, bootstrap = spec.strip().partition("@")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"engine {spec!r}: {exc}") from exc
    if parts.scheme != "http" or not parts.hostname or port is None or parts.path not in ("",
                                                                                        "/"):
        raise ValueError(f"engine {spec!r}: the URL must be http://host:port")
    if at:
        host, sep, bport = bootstrap.rpartition(":")
        if not sep or not host or not bport.isdigit() or not 0 < int(bport) < 65536:
            raise ValueError(f"engine {spec!r}: the bootstrap address must be host:port")
    elif bootstrap_port is not None:
        bootstrap = f"{parts.hostname}:{bootstrap_port}"
    return Endpoint(role, parts.hostname, port, bootstrap or None)


class EndpointTable:
    """The ready endpoints of each role; thread-safe; each role replaced whole. A request
    that finds a role empty can wait for it (``wait_ready``): a pod briefly out of rotation
    (a restart, a readiness probe that missed) then costs latency, not an error."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._ready: dict[Role, tuple[Endpoint, ...]] = {role: () for role in Role}
        self._waiting: dict[Role, int] = {role: 0 for role in Role}

    def replace(self, role: Role, endpoints: Iterable[Endpoint]) -> None:
        """Make ``endpoints`` (all of ``role``) the role's rotation, sorted by name; logs
        each endpoint that joins or leaves."""
        unique = {e.name: e for e in endpoints}
        wrong = sorted(n for n, e in unique.items() if e.role is not role)
        if wrong:
            raise ValueError(f"endpoints {wrong} are not {role.value} endpoints")
        new = tuple(unique[name] for name in sorted(unique))
        with self._lock:
            old = self._ready[role]
            self._ready[role] = new
            self._changed.notify_all()
        for endpoint in sorted(set(new) - set(old), key=lambda e: e.name):
            _log.info("%s endpoint %s joined the rotation", role.value, endpoint.describe())
        for endpoint in sorted(set(old) - set(new), key=lambda e: e.name):
            _log.info("%s endpoint %s left the rotation", role.value, endpoint.describe())

    def ready(self, role: Role) -> tuple[Endpoint, ...]:
        with self._lock:
            return self._ready[role]

    def wait_ready(self, role: Role, timeout_s: float) -> tuple[Endpoint, ...]:
        """The role's rotation, waiting up to ``timeout_s`` for one to join while it is
        empty (empty again after the timeout)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if self._ready[role] or timeout_s <= 0:
                return self._ready[role]
            self._waiting[role] += 1
            try:
                while not self._ready[role]:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._changed.wait(left)
                return self._ready[role]
            finally:
                self._waiting[role] -= 1

    def wait_until(self, done: Callable[[Mapping[Role, tuple[Endpoint, ...]]], bool],
                   timeout_s: float, waiting_for: Role) -> dict[Role, tuple[Endpoint, ...]]:
        """Every role's rotation once ``done(rotations)`` holds, or after ``timeout_s`` (the
        caller checks again); counted as a request waiting for ``waiting_for``."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._waiting[waiting_for] += 1
            try:
                while not done(self._ready):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._changed.wait(left)
                return dict(self._ready)
            finally:
                self._waiting[waiting_for] -= 1

    def waiting(self) -> dict[Role, int]:
        """Requests waiting now, per role, for an endpoint to join the rotation."""
        with self._lock:
            return dict(self._waiting)

    def counts(self) -> dict[Role, int]:
        with self._lock:
            return {role: len(endpoints) for role, endpoints in self._ready.items()}
