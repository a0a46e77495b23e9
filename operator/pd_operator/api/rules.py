"""Cross-field rules of a PDDeployment spec, each written once for Python and once for CEL.

The operator enforces every rule when it parses a body (`resources.parse_spec` and
`parse_pdd` call `violations()`; any Kubernetes version), never from inside the model; the CRD
carries the same rules as `x-kubernetes-validations` so that API servers with CEL support
(1.25+) refuse a bad object before it is stored. A unit test evaluates both forms on the same
valid and invalid specs, so the two cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pd_operator.api.cel import cel_format, cel_map
from pd_operator.api.sizing import compute_staging_footprint, staging_in_use
from pd_operator.api.spec import PDDeploymentSpec, RoleSpec
from pd_operator.api.transfer_spec import DECODE_POOL_MIB_DEFAULT, PREFILL_BUFFER_MIB_DEFAULT
from pd_operator.api.types import (
    FRAMEWORK_BACKENDS,
    Attention,
    Framework,
    StagingMode,
    TransferBackend,
)


@dataclass(frozen=True)
class CrossFieldRule:
    """One rule: a Python check (message or None) and the CEL form of the same rule."""

    name: str
    check: Callable[[PDDeploymentSpec], str | None]
    cel: str
    cel_message: str
    field_path: str
    cel_message_expression: str | None = None

    def to_validation(self) -> dict[str, str]:
        """The rule as an entry of `x-kubernetes-validations` on the spec schema."""
        entry = {
            "rule": self.cel,
            "message": self.cel_message,
            "fieldPath": self.field_path,
            "reason": "FieldValueInvalid",
        }
        if self.cel_message_expression is not None:
            entry["messageExpression"] = self.cel_message_expression
        return entry


def _data_divides_tensor(role_name: str, role: RoleSpec) -> str | None:
    par = role.parallelism
    if par.tensor % par.data == 0:
        return None
    return (
        f"spec.{role_name}.parallelism.data ({par.data}) must divide "
        f"spec.{role_name}.parallelism.tensor ({par.tensor}): attention runs on tensor/data "
        f"ranks. Set data to a divisor of {par.tensor}."
    )


def _tp_fits_heads(role_name: str, spec: PDDeploymentSpec) -> str | None:
    role: RoleSpec = getattr(spec, role_name)
    par = role.parallelism
    if par.tensor % par.data != 0:
        return None  # reported by the data/tensor rule
    tp = par.attention_tp
    heads = spec.model.num_kv_heads
    if heads % tp == 0 or tp % heads == 0:
        return None
    return (
        f"spec.{role_name}.parallelism: attention tensor parallelism {tp} (tensor/data) "
        f"must divide spec.model.numKVHeads ({heads}) or be a multiple of it, so every rank "
        f"holds whole heads. Use a {role_name} tensor size whose tensor/data is one of "
        f"{_compatible_tps(heads)}."
    )


def _compatible_tps(heads: int) -> str:
    divisors = [d for d in range(1, heads + 1) if heads % d == 0]
    multiples = [heads * m for m in (2, 4, 8) if heads * m <= 64]
    return ", ".join(str(v) for v in sorted(set(divisors + multiples)))


def _layers_split(role_name: str, spec: PDDeploymentSpec) -> str | None:
    role: RoleSpec = getattr(spec, role_name)
    pp = role.parallelism.pipeline
    layers = spec.model.num_layers
    if layers % pp == 0:
        return None
    return (
        f"spec.model.numLayers ({layers}) must be divisible by "
        f"spec.{role_name}.parallelism.pipeline ({pp}) so every stage holds whole layers. "
        f"Choose a pipeline size that divides {layers}."
    )


def _gpus_cover_ranks(role_name: str, spec: PDDeploymentSpec) -> str | None:
    role: RoleSpec = getattr(spec, role_name)
    gpus = role.gpus_per_pod
    if gpus is None or gpus == 0 or gpus >= role.parallelism.gpus:
        return None
    return (
        f"spec.{role_name}.gpusPerPod ({gpus}) is less than tensor × pipeline "
        f"({role.parallelism.gpus}). Set gpusPerPod to at least {role.parallelism.gpus}, to 0 "
        f"for an engine on CPUs, or leave it out."
    )


def _same_page_size(spec: PDDeploymentSpec) -> str | None:
    if spec.prefill.page_size == spec.decode.page_size:
        return None
    return (
        f"spec.prefill.pageSize ({spec.prefill.page_size}) and spec.decode.pageSize "
        f"({spec.decode.page_size}) differ; the transfer moves whole pages. Set both to the "
        f"same value."
    )


def _mla_single_latent(spec: PDDeploymentSpec) -> str | None:
    if spec.model.attention is not Attention.MLA or spec.model.num_kv_heads == 1:
        return None
    return (
        f"spec.model.numKVHeads is {spec.model.num_kv_heads} but attention is MLA, which "
        f"stores one latent per token. Set numKVHeads to 1 and headDim to the latent width."
    )


def _mla_no_staging(spec: PDDeploymentSpec) -> str | None:
    if spec.model.attention is not Attention.MLA:
        return None
    if spec.transfer.staging.mode is not StagingMode.ALWAYS:
        return None
    return (
        "spec.transfer.staging.mode is Always but MLA attention never uses staging (the latent "
        "is replicated on every rank and sent page by page). Set mode to Auto or Never."
    )


def _parallelism_splits(spec: PDDeploymentSpec) -> bool:
    return all(
        role.parallelism.tensor % role.parallelism.data == 0 for role in (spec.prefill, spec.decode)
    )


def _decode_pool_holds_chunk(spec: PDDeploymentSpec) -> str | None:
    if not _parallelism_splits(spec) or not staging_in_use(spec):
        return None
    fp = compute_staging_footprint(spec)
    have = spec.transfer.staging.decode_pool_mib
    if have >= fp.min_decode_pool_mib:
        return None
    return (
        f"spec.transfer.staging.decodePoolMiB ({have}) cannot hold one prefill chunk: "
        f"{fp.chunk_tokens} tokens × {fp.decode_heads} KV heads per decode rank × "
        f"{fp.head_dim} head dim × {fp.dtype_bytes} bytes × 2 (K and V) × "
        f"{fp.decode_layers} layers = {fp.decode_chunk_bytes} bytes. Set decodePoolMiB to at "
        f"least {fp.min_decode_pool_mib}, or lower spec.prefill.chunkedPrefillTokens."
    )


def _prefill_buffer_holds_chunk(spec: PDDeploymentSpec) -> str | None:
    if not _parallelism_splits(spec) or not staging_in_use(spec):
        return None
    fp = compute_staging_footprint(spec)
    have = spec.transfer.staging.prefill_buffer_mib
    if have >= fp.min_prefill_buffer_mib:
        return None
    return (
        f"spec.transfer.staging.prefillBufferMiB ({have}) cannot hold one gathered chunk: "
        f"{fp.chunk_tokens} tokens × {fp.prefill_heads_sent} KV heads sent per prefill rank "
        f"× {fp.head_dim} head dim × {fp.dtype_bytes} bytes × 2 (K and V) × "
        f"{fp.prefill_layers} layers = {fp.prefill_chunk_bytes} bytes. Set prefillBufferMiB "
        f"to at least {fp.min_prefill_buffer_mib}, or lower spec.prefill.chunkedPrefillTokens."
    )


def _router_has_image(spec: PDDeploymentSpec) -> str | None:
    if not spec.router.enabled or spec.router.image is not None:
        return None
    return "spec.router.enabled is true but spec.router.image is not set. Set the router image."


def _supported_backends_text(framework: Framework) -> str:
    return " or ".join(b.value for b in FRAMEWORK_BACKENDS[framework])


def _backend_supported(spec: PDDeploymentSpec) -> str | None:
    backend, framework = spec.transfer.backend, spec.engine.framework
    if backend is None or backend in FRAMEWORK_BACKENDS[framework]:
        return None
    return (
        f"spec.transfer.backend {backend.value} is not available for spec.engine.framework "
        f"{framework.value}, which runs {_supported_backends_text(framework)}. Set "
        f"spec.transfer.backend to {FRAMEWORK_BACKENDS[framework][0].value} or leave it out."
    )


def _native_fix(framework: Framework) -> str:
    if TransferBackend.PD_TRANSFER in FRAMEWORK_BACKENDS[framework]:
        return "Remove them, or set spec.transfer.backend to PDTransfer."
    return f"Remove them: {framework.value} runs only EngineNative."


def _native_has_no_staging_sizes(spec: PDDeploymentSpec) -> str | None:
    if spec.transfer_backend is not TransferBackend.ENGINE_NATIVE:
        return None
    if not spec.transfer.staging.sizes_set:
        return None
    framework = spec.engine.framework.value
    return (
        f"spec.transfer.staging.prefillBufferMiB and decodePoolMiB cannot be set with "
        f"spec.transfer.backend EngineNative: the {framework} engine's own KV connector moves "
        f"the KV and has no staging pool to resize. {_native_fix(spec.engine.framework)}"
    )


def _pipeline_groups_ordered(spec: PDDeploymentSpec) -> str | None:
    lp = spec.transfer.layer_pipeline
    if lp.min_groups <= lp.max_groups:
        return None
    return (
        f"spec.transfer.layerPipeline.minGroups ({lp.min_groups}) is greater than maxGroups "
        f"({lp.max_groups}). Set minGroups ≤ maxGroups."
    )


# CEL building blocks (self is the spec; the API server has applied defaults).
_P = "self.prefill.parallelism"
_D = "self.decode.parallelism"
_PTP = f"({_P}.tensor / {_P}.data)"
_DTP = f"({_D}.tensor / {_D}.data)"
_SPLIT_OK = f"{_P}.tensor % {_P}.data == 0 && {_D}.tensor % {_D}.data == 0"
_H = "self.model.numKVHeads"
_DTYPE_BYTES = (
    "{'bfloat16': 2, 'float16': 2, 'float32': 4, 'fp8_e4m3': 1, 'fp8_e5m2': 1}"
    "[self.model.kvDtype]"
)
_CHUNK = (
    "((self.prefill.chunkedPrefillTokens + self.prefill.pageSize - 1) / self.prefill.pageSize"
    " * self.prefill.pageSize)"
)
_FW = "self.engine.framework"


_DEFAULT_BACKEND = cel_map({f.value: b[0].value for f, b in FRAMEWORK_BACKENDS.items()})
_BACKENDS = "{" + ", ".join(
    f"'{f.value}': [{', '.join(repr(x.value) for x in b)}]"
    for f, b in FRAMEWORK_BACKENDS.items()) + "}"
_BACKEND = f"(has(self.transfer.backend) ? self.transfer.backend : {_DEFAULT_BACKEND}[{_FW}])"
_HAS_SIZES = ("(has(self.transfer.staging.prefillBufferMiB) || "
              "has(self.transfer.staging.decodePoolMiB))")
_PBUF = ("(has(self.transfer.staging.prefillBufferMiB) ? "
         f"self.transfer.staging.prefillBufferMiB : {PREFILL_BUFFER_MIB_DEFAULT})")
_DPOOL = ("(has(self.transfer.staging.decodePoolMiB) ? "
          f"self.transfer.staging.decodePoolMiB : {DECODE_POOL_MIB_DEFAULT})")
_STAGING_USED = (
    f"({_BACKEND} == 'PDTransfer' && self.model.attention != 'MLA' && "
    f"(self.transfer.staging.mode == 'Always' || "
    f"(self.transfer.staging.mode == 'Auto' && {_PTP} != {_DTP})))"
)
_DECODE_HEADS = f"({_H} >= {_DTP} ? {_H} / {_DTP} : 1)"
_PREFILL_HEADS = (
    f"(({_H} >= {_PTP} ? {_H} / {_PTP} : 1) >= ({_DTP} + {_PTP} - 1) / {_PTP} ? "
    f"({_H} >= {_PTP} ? {_H} / {_PTP} : 1) : ({_DTP} + {_PTP} - 1) / {_PTP})"
)
_DECODE_BYTES = (
    f"({_CHUNK} * {_DECODE_HEADS} * self.model.headDim * {_DTYPE_BYTES} * 2 * "
    f"(self.model.numLayers / {_D}.pipeline))"
)
_PREFILL_BYTES = (
    f"({_CHUNK} * {_PREFILL_HEADS} * self.model.headDim * {_DTYPE_BYTES} * 2 * "
    f"(self.model.numLayers / {_P}.pipeline))"
)
_MIB = 1048576


def _tp_heads_cel(par: str) -> str:
    tp = f"({par}.tensor / {par}.data)"
    return f"{par}.tensor % {par}.data != 0 || {_H} % {tp} == 0 || {tp} % {_H} == 0"


_ROLES = ("prefill", "decode")


def _per_role(make: Callable[[str], CrossFieldRule]) -> tuple[CrossFieldRule, ...]:
    """One rule per role, prefill's first: the roles' rules differ only in the role."""
    return tuple(make(role) for role in _ROLES)


def _data_divides_tensor_rule(role: str) -> CrossFieldRule:
    par = f"self.{role}.parallelism"
    return CrossFieldRule(
        name=f"{role}-data-divides-tensor",
        check=lambda s: _data_divides_tensor(role, getattr(s, role)),
        cel=f"{par}.tensor % {par}.data == 0",
        cel_message=f"spec.{role}.parallelism.data must divide spec.{role}.parallelism.tensor",
        field_path=f".{role}.parallelism.data",
    )


def _tp_fits_heads_rule(role: str) -> CrossFieldRule:
    return CrossFieldRule(
        name=f"{role}-tp-fits-kv-heads",
        check=lambda s: _tp_fits_heads(role, s),
        cel=_tp_heads_cel(f"self.{role}.parallelism"),
        cel_message=f"{role} attention TP (tensor/data) must divide spec.model.numKVHeads "
        "or be a multiple of it",
        field_path=f".{role}.parallelism.tensor",
    )


def _layers_split_rule(role: str) -> CrossFieldRule:
    return CrossFieldRule(
        name=f"{role}-pipeline-divides-layers",
        check=lambda s: _layers_split(role, s),
        cel=f"self.model.numLayers % self.{role}.parallelism.pipeline == 0",
        cel_message=f"spec.model.numLayers must be divisible by spec.{role}.parallelism.pipeline",
        field_path=f".{role}.parallelism.pipeline",
    )


def _gpus_cover_ranks_rule(role: str) -> CrossFieldRule:
    par = f"self.{role}.parallelism"
    return CrossFieldRule(
        name=f"{role}-gpus-cover-ranks",
        check=lambda s: _gpus_cover_ranks(role, s),
        cel=f"!has(self.{role}.gpusPerPod) || self.{role}.gpusPerPod == 0 || "
        f"self.{role}.gpusPerPod >= {par}.tensor * {par}.pipeline",
        cel_message=f"spec.{role}.gpusPerPod must be at least tensor × pipeline, or 0 for an "
        "engine on CPUs",
        field_path=f".{role}.gpusPerPod",
    )


RULES: tuple[CrossFieldRule, ...] = (
    *_per_role(_data_divides_tensor_rule),
    *_per_role(_tp_fits_heads_rule),
    *_per_role(_layers_split_rule),
    *_per_role(_gpus_cover_ranks_rule),
    CrossFieldRule(
        name="same-page-size",
        check=_same_page_size,
        cel="self.prefill.pageSize == self.decode.pageSize",
        cel_message="spec.prefill.pageSize and spec.decode.pageSize must be equal",
        field_path=".decode.pageSize",
    ),
    CrossFieldRule(
        name="mla-single-latent",
        check=_mla_single_latent,
        cel=f"self.model.attention != 'MLA' || {_H} == 1",
        cel_message="MLA attention stores one latent per token: set spec.model.numKVHeads to 1",
        field_path=".model.numKVHeads",
    ),
    CrossFieldRule(
        name="mla-no-staging",
        check=_mla_no_staging,
        cel="self.model.attention != 'MLA' || self.transfer.staging.mode != 'Always'",
        cel_message="MLA attention never uses staging: set spec.transfer.staging.mode to "
        "Auto or Never",
        field_path=".transfer.staging.mode",
    ),
    CrossFieldRule(
        name="decode-pool-holds-chunk",
        check=_decode_pool_holds_chunk,
        cel=f"!({_SPLIT_OK}) || !{_STAGING_USED} || "
        f"{_DPOOL} * {_MIB} >= {_DECODE_BYTES}",
        cel_message="spec.transfer.staging.decodePoolMiB cannot hold one prefill chunk",
        cel_message_expression=cel_format(
            "spec.transfer.staging.decodePoolMiB cannot hold one prefill chunk: set it to at "
            "least %d or lower spec.prefill.chunkedPrefillTokens",
            f"({_DECODE_BYTES} + {_MIB} - 1) / {_MIB}"),
        field_path=".transfer.staging.decodePoolMiB",
    ),
    CrossFieldRule(
        name="prefill-buffer-holds-chunk",
        check=_prefill_buffer_holds_chunk,
        cel=f"!({_SPLIT_OK}) || !{_STAGING_USED} || "
        f"{_PBUF} * {_MIB} >= {_PREFILL_BYTES}",
        cel_message="spec.transfer.staging.prefillBufferMiB cannot hold one gathered chunk",
        cel_message_expression=cel_format(
            "spec.transfer.staging.prefillBufferMiB cannot hold one gathered chunk: set it to "
            "at least %d or lower spec.prefill.chunkedPrefillTokens",
            f"({_PREFILL_BYTES} + {_MIB} - 1) / {_MIB}"),
        field_path=".transfer.staging.prefillBufferMiB",
    ),
    CrossFieldRule(
        name="router-image",
        check=_router_has_image,
        cel="!self.router.enabled || has(self.router.image)",
        cel_message="spec.router.image is required when spec.router.enabled is true",
        field_path=".router.image",
    ),
    CrossFieldRule(
        name="backend-supported",
        check=_backend_supported,
        cel=f"!has(self.transfer.backend) || self.transfer.backend in {_BACKENDS}[{_FW}]",
        cel_message="spec.transfer.backend is not available for spec.engine.framework",
        cel_message_expression=cel_format(
            "spec.transfer.backend %s is not available for spec.engine.framework %s, which "
            "runs %s. Set spec.transfer.backend to %s or leave it out.",
            "self.transfer.backend", _FW,
            f"{cel_map({f.value: _supported_backends_text(f) for f in Framework})}[{_FW}]",
            f"{_DEFAULT_BACKEND}[{_FW}]"),
        field_path=".transfer.backend",
    ),
    CrossFieldRule(
        name="engine-native-has-no-staging-sizes",
        check=_native_has_no_staging_sizes,
        cel=f"{_BACKEND} != 'EngineNative' || !{_HAS_SIZES}",
        cel_message="spec.transfer.staging.prefillBufferMiB and decodePoolMiB cannot be set "
        "with spec.transfer.backend EngineNative: the engine's own KV connector has no "
        "staging pool to resize",
        cel_message_expression=cel_format(
            "spec.transfer.staging.prefillBufferMiB and decodePoolMiB cannot be set with "
            "spec.transfer.backend EngineNative: the %s engine's own KV connector moves the "
            "KV and has no staging pool to resize. %s",
            _FW, f"{cel_map({f.value: _native_fix(f) for f in Framework})}[{_FW}]"),
        field_path=".transfer.staging",
    ),
    CrossFieldRule(
        name="layer-pipeline-groups-ordered",
        check=_pipeline_groups_ordered,
        cel="self.transfer.layerPipeline.minGroups <= self.transfer.layerPipeline.maxGroups",
        cel_message="spec.transfer.layerPipeline.minGroups must not exceed maxGroups",
        field_path=".transfer.layerPipeline.minGroups",
    ),
)


def violations(spec: PDDeploymentSpec) -> list[str]:
    """Messages of every cross-field rule the spec breaks, in rule order."""
    return [msg for rule in RULES if (msg := rule.check(spec)) is not None]
