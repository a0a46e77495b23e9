"""The router's settings: one validated model, read from flags with environment fallbacks.

Precedence per setting: the flag, else the first environment variable of ``ENVIRONMENT``
that is set and non-empty, else the default below. The operator's router builder sets the
environment (``PD_ROUTER_*``); a user's ``router.args`` become flags and win. Lists
(``PD_PREFILL_URLS``) are comma-separated.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from types import MappingProxyType
from typing import Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from pd_contract.names import ENV_POD_NAMESPACE
from pd_contract.transferagent import Role
from pd_transfer.router.endpoints import Endpoint, parse_engine
from pd_transfer.router.errors import SettingsError

__all__ = [
    "ENVIRONMENT",
    "DiscoveryKind",
    "PDProtocol",
    "PolicyName",
    "RouterSettings",
    "flag_of",
    "settings_from",
]


class PDProtocol(StrEnum):
    """How a request reaches prefill and decode (``protocols``)."""

    PD_TRANSFER = "pd-transfer"  # both at once, PDTransferConnector (layer pipelining)
    VLLM_NIXL = "vllm-nixl"  # prefill, then decode with prefill's params (NixlConnector)


class PolicyName(StrEnum):
    """The CRD's ``RouterPolicy`` values."""

    ROUND_ROBIN = "round-robin"
    LEAST_LOAD = "least-load"
    CACHE_AWARE = "cache-aware"


class DiscoveryKind(StrEnum):
    STATIC = "static"  # --prefill / --decode
    KUBERNETES = "kubernetes"  # watch the PDDeployment's ready pods


# A namespace or PDDeployment name (DNS-1123 subdomain; both are at most that).
_DNS_NAME = r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"


class RouterSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field(default="0.0.0.0", min_length=1)
    port: int = Field(default=8000, ge=0, le=65535, description="0: any free port (tests)")
    protocol: PDProtocol = PDProtocol.PD_TRANSFER
    policy: PolicyName = PolicyName.CACHE_AWARE
    discovery: DiscoveryKind = DiscoveryKind.STATIC
    # static discovery: http://HOST:PORT[@BOOTSTRAP_HOST:PORT] per engine
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    # kubernetes discovery: whose pods, and their ports
    namespace: str | None = Field(default=None, pattern=_DNS_NAME)
    deployment: str | None = Field(default=None, pattern=_DNS_NAME)
    engine_port: int | None = Field(default=None, ge=1, le=65535)
    # bootstrap port of every engine pod (pd-transfer protocol; static specs without @)
    bootstrap_port: int | None = Field(default=None, ge=1, le=65535)
    # cache-aware: the prompt prefix hashed (characters of text, or token ids)
    affinity_prefix: int = Field(default=256, ge=1, le=1 << 20)
    # cache-aware: skip an engine with this many more requests in flight than the idlest
    balance_threshold: int = Field(default=16, ge=0, le=1 << 20)
    connect_timeout_s: float = Field(default=5.0, gt=0, le=300)
    upstream_timeout_s: float = Field(default=600.0, gt=0, le=86400)
    max_body_bytes: int = Field(default=16 << 20, ge=1024, le=1 << 30)
    # a request finding a role with none in rotation waits this long for one before a 503
    endpoint_wait_s: float = Field(default=30.0, ge=0, le=3600)
    # on SIGTERM: /health answers 503 while requests in flight finish, at most this long
    drain_s: float = Field(default=20.0, ge=0, le=3600)
    # ... and keeps taking new requests at least this long (within drain_s): a deleted pod
    # leaves its Service's endpoints and every node's proxy only after a few seconds
    linger_s: float = Field(default=5.0, ge=0, le=600)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _discovery_complete(self) -> RouterSettings:
        needs_bootstrap = self.protocol is PDProtocol.PD_TRANSFER
        if self.discovery is DiscoveryKind.STATIC:
            if not self.prefill or not self.decode:
                raise ValueError("static discovery needs at least one prefill and one decode "
                                 "engine (--prefill, --decode)")
            for endpoint in self.static_endpoints():
                if needs_bootstrap and endpoint.bootstrap is None:
                    raise ValueError(
                        f"{endpoint.role.value} engine {endpoint.url} has no bootstrap "
                        f"address, which the pd-transfer protocol needs: name it as "
                        f"URL@HOST:PORT or give --bootstrap-port")
        else:
            if self.prefill or self.decode:
                raise ValueError(
                    "kubernetes discovery finds the engines by watching the PDDeployment's "
                    "pods: drop --prefill and --decode (PD_PREFILL_URLS, PD_DECODE_URLS), "
                    "or use --discovery static")
            missing = [flag for flag, value in (("--namespace", self.namespace),
                                                ("--deployment", self.deployment),
                                                ("--engine-port", self.engine_port))
                       if value is None]
            if needs_bootstrap and self.bootstrap_port is None:
                missing.append("--bootstrap-port")
            if missing:
                raise ValueError(f"kubernetes discovery needs {', '.join(missing)}")
        return self

    def static_endpoints(self) -> list[Endpoint]:
        """The engines named by ``prefill`` and ``decode`` (ValueError if one is malformed)."""
        return [parse_engine(spec, role, self.bootstrap_port)
                for role, specs in ((Role.PREFILL, self.prefill), (Role.DECODE, self.decode))
                for spec in specs]


# Setting → environment variables, first match wins. PD_PREFILL_URLS, PD_DECODE_URLS,
# PD_PREFILL_BOOTSTRAP_PORT, PD_ROUTER_PORT and PD_ROUTER_POLICY are what the operator's
# router builder has set from the start.
ENVIRONMENT: Final[Mapping[str, tuple[str, ...]]] = MappingProxyType({
    "host": ("PD_ROUTER_HOST",),
    "port": ("PD_ROUTER_PORT",),
    "protocol": ("PD_ROUTER_PROTOCOL",),
    "policy": ("PD_ROUTER_POLICY",),
    "discovery": ("PD_ROUTER_DISCOVERY",),
    "prefill": ("PD_PREFILL_URLS",),
    "decode": ("PD_DECODE_URLS",),
    "namespace": ("PD_ROUTER_NAMESPACE", ENV_POD_NAMESPACE),
    "deployment": ("PD_ROUTER_DEPLOYMENT",),
    "engine_port": ("PD_ROUTER_ENGINE_PORT",),
    "bootstrap_port": ("PD_ROUTER_BOOTSTRAP_PORT", "PD_PREFILL_BOOTSTRAP_PORT"),
    "affinity_prefix": ("PD_ROUTER_AFFINITY_PREFIX",),
    "balance_threshold": ("PD_ROUTER_BALANCE_THRESHOLD",),
    "connect_timeout_s": ("PD_ROUTER_CONNECT_TIMEOUT_SECONDS",),
    "upstream_timeout_s": ("PD_ROUTER_UPSTREAM_TIMEOUT_SECONDS",),
    "max_body_bytes": ("PD_ROUTER_MAX_BODY_BYTES",),
    "endpoint_wait_s": ("PD_ROUTER_ENDPOINT_WAIT_SECONDS",),
    "drain_s": ("PD_ROUTER_DRAIN_SECONDS",),
    "linger_s": ("PD_ROUTER_LINGER_SECONDS",),
    "log_level": ("PD_ROUTER_LOG_LEVEL",),
})
_LISTS: Final = frozenset({"prefill", "decode"})
_FLAGS: Final = MappingProxyType({"connect_timeout_s": "--connect-timeout-seconds",
                                  "upstream_timeout_s": "--upstream-timeout-seconds",
                                  "endpoint_wait_s": "--endpoint-wait-seconds",
                                  "drain_s": "--drain-seconds",
                                  "linger_s": "--linger-seconds"})


def flag_of(field: str) -> str:
    """The command-line flag of a setting (``engine_port`` → ``--engine-port``)."""
    return _FLAGS.get(field, "--" + field.replace("_", "-"))


def settings_from(flags: Mapping[str, object], environ: Mapping[str, str]) -> RouterSettings:
    """Settings from ``flags`` (field → value; None: not given) and ``environ``.

    Raises SettingsError naming the flag and the variable a bad value may have come from.
    """
    values: dict[str, object] = {}
    for name, env_names in ENVIRONMENT.items():
        flag = flags.get(name)
        if flag is not None and flag != []:
            values[name] = tuple(flag) if name in _LISTS and isinstance(flag, list) else flag
            continue
        for env in env_names:
            raw = environ.get(env, "").strip()
            if raw:
                values[name] = (tuple(s.strip() for s in raw.split(",") if s.strip())
                                if name in _LISTS else raw)
                break
    unknown = sorted(set(flags) - set(ENVIRONMENT))
    if unknown:
        raise SettingsError(f"unknown router settings {unknown}")
    try:
        return RouterSettings.model_validate(values)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            field = str(error["loc"][0]) if error["loc"] else ""
            source = (f" ({flag_of(field)} or ${' / $'.join(ENVIRONMENT[field])})"
                      if field in ENVIRONMENT else "")
            problems.append(f"{field or 'settings'}{source}: {error['msg']}")
        raise SettingsError("invalid router settings: " + "; ".join(problems)) from exc
