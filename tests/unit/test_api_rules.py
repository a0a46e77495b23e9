"""Cross-field rules: the Python check and the CEL rule agree, and messages say what to change.

Pure: no API server. CEL is evaluated with cel-python on the object as the API server would
see it (schema defaults applied), because the local 1.20 control plane cannot run CEL.
"""

from __future__ import annotations

from typing import Any

import celpy
import pytest
from pydantic import ValidationError

from pd_operator.api import RULES, format_validation_error, parse_spec
from pd_operator.api.crd import pddeployment_schema
from tests.cel_functions import KUBERNETES_FUNCTIONS
from tests.factories import make_spec_dict

SPEC_SCHEMA: dict[str, Any] = pddeployment_schema()["properties"]["spec"]


def apply_schema_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Apply OpenAPI defaults the way the API server does (absent fields, recursively)."""
    if not isinstance(value, dict) or "properties" not in schema:
        if isinstance(value, list) and "items" in schema:
            return [apply_schema_defaults(schema["items"], v) for v in value]
        return value
    out = dict(value)
    for name, prop in schema["properties"].items():
        if name not in out and "default" in prop:
            out[name] = prop["default"]
        if name in out:
            out[name] = apply_schema_defaults(prop, out[name])
    return out


def failing_cel_rules(spec: dict[str, Any]) -> set[str]:
    env = celpy.Environment()
    activation = {"self": celpy.json_to_cel(apply_schema_defaults(SPEC_SCHEMA, spec))}
    failed = set()
    for rule in RULES:
        result = env.program(env.compile(rule.cel)).evaluate(activation)
        assert isinstance(result, celpy.celtypes.BoolType), f"{rule.name} gave {result!r}"
        if not result:
            failed.add(rule.name)
    return failed


def python_message(spec: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as info:
        parse_spec({"spec": spec})
    return format_validation_error(info.value, "spec")


# The base spec runs vLLM (PDTransfer by default); SGLang runs only EngineNative.
VLLM: dict[str, Any] = {"engine": {"framework": "vllm", "image": "vllm/vllm-openai:v0.32.0"}}
SGLANG: dict[str, Any] = {"engine": {"framework": "sglang", "image": "lmsysorg/sglang:latest"}}

# (case id, spec sections to merge into the valid base, failing rule names, message fragment)
INVALID = [
    (
        "prefill-tp-not-fitting-heads",
        {"prefill": {"parallelism": {"tensor": 3}}},
        {"prefill-tp-fits-kv-heads"},
        "spec.prefill.parallelism: attention tensor parallelism 3 (tensor/data) must divide "
        "spec.model.numKVHeads (8) or be a multiple of it",
    ),
    (
        "decode-tp-not-fitting-heads",
        # 8 heads, decode TP 12: neither 8 % 12 nor 12 % 8 is zero.
        {"decode": {"parallelism": {"tensor": 12}}, "transfer": {"staging": {"mode": "Never"}}},
        {"decode-tp-fits-kv-heads"},
        "attention tensor parallelism 12 (tensor/data) must divide spec.model.numKVHeads (8)",
    ),
    (
        "data-not-dividing-tensor",
        {"prefill": {"parallelism": {"tensor": 4, "data": 3}}},
        {"prefill-data-divides-tensor"},
        "spec.prefill.parallelism.data (3) must divide spec.prefill.parallelism.tensor (4)",
    ),
    (
        "layers-not-divisible-by-pipeline",
        {"decode": {"parallelism": {"pipeline": 3}}},
        {"decode-pipeline-divides-layers"},
        "spec.model.numLayers (80) must be divisible by spec.decode.parallelism.pipeline (3)",
    ),
    (
        "gpus-below-ranks",
        {"prefill": {"gpusPerPod": 2, "parallelism": {"tensor": 2, "pipeline": 2}}},
        {"prefill-gpus-cover-ranks"},
        "spec.prefill.gpusPerPod (2) is less than tensor × pipeline (4)",
    ),
    (
        "page-sizes-differ",
        {"prefill": {"pageSize": 16}, "decode": {"pageSize": 32}},
        {"same-page-size"},
        "spec.prefill.pageSize (16) and spec.decode.pageSize (32) differ",
    ),
    (
        "mla-with-heads",
        {"model": {"attention": "MLA", "numKVHeads": 8}},
        {"mla-single-latent"},
        "spec.model.numKVHeads is 8 but attention is MLA",
    ),
    (
        "mla-with-staging",
        {"model": {"attention": "MLA", "numKVHeads": 1, "headDim": 576},
         "transfer": {"staging": {"mode": "Always"}}},
        {"mla-no-staging"},
        "spec.transfer.staging.mode is Always but MLA attention never uses staging",
    ),
    (
        # TP2 -> TP4, 8 heads: a decode rank holds 8/4 = 2 heads; one chunk is
        # 8192 tokens × 2 heads × 128 × 2 B × 2 × 80 layers = 671088640 B = 640 MiB.
        "decode-pool-too-small",
        {**VLLM, "prefill": {"parallelism": {"tensor": 2}},
         "decode": {"parallelism": {"tensor": 4}}, "transfer": {"staging": {"decodePoolMiB": 639}}},
        {"decode-pool-holds-chunk"},
        "spec.transfer.staging.decodePoolMiB (639) cannot hold one prefill chunk: 8192 tokens "
        "× 2 KV heads per decode rank × 128 head dim × 2 bytes × 2 (K and V) × 80 layers = "
        "671088640 bytes. Set decodePoolMiB to at least 640",
    ),
    (
        # TP2 -> TP4: a prefill rank holds 4 heads and sends all of them (2 per decode rank);
        # 8192 × 4 × 128 × 2 × 2 × 80 = 1342177280 B = 1280 MiB.
        "prefill-buffer-too-small",
        {**VLLM, "prefill": {"parallelism": {"tensor": 2}},
         "decode": {"parallelism": {"tensor": 4}},
         "transfer": {"staging": {"prefillBufferMiB": 1279}}},
        {"prefill-buffer-holds-chunk"},
        "Set prefillBufferMiB to at least 1280",
    ),
    (
        # 2 KV heads, TP4 -> TP8: decode ranks replicate heads, each needs 1 head; a prefill
        # rank (1 head) serves 8/4 = 2 decode ranks: 2 heads sent. 1000 tokens round up to
        # 63 pages of 16 = 1008 tokens; decode: 1008 × 1 × 128 × 1 B (fp8) × 2 × 80 =
        # 20643840 B = 19.7 MiB -> at least 20 MiB.
        "decode-pool-replicated-heads-fp8",
        {**VLLM, "model": {"numKVHeads": 2, "kvDtype": "fp8_e4m3"},
         "prefill": {"parallelism": {"tensor": 4}, "chunkedPrefillTokens": 1000},
         "decode": {"parallelism": {"tensor": 8}},
         "transfer": {"staging": {"decodePoolMiB": 19}}},
        {"decode-pool-holds-chunk"},
        "1008 tokens × 1 KV heads per decode rank × 128 head dim × 1 bytes × 2 (K and V) × "
        "80 layers = 20643840 bytes. Set decodePoolMiB to at least 20",
    ),
    (
        "backend-not-available",
        {**SGLANG, "transfer": {"backend": "PDTransfer"}},
        {"backend-supported"},
        "spec.transfer.backend PDTransfer is not available for spec.engine.framework sglang, "
        "which runs EngineNative. Set spec.transfer.backend to EngineNative or leave it out.",
    ),
    (
        # The staging patch a user tries on a deployment whose engine keeps its own connector.
        "engine-native-with-staging-sizes",
        {**VLLM, "transfer": {"backend": "EngineNative", "staging": {"decodePoolMiB": 6144}}},
        {"engine-native-has-no-staging-sizes"},
        "spec.transfer.staging.prefillBufferMiB and decodePoolMiB cannot be set with "
        "spec.transfer.backend EngineNative: the vllm engine's own KV connector moves the KV "
        "and has no staging pool to resize. Remove them, or set spec.transfer.backend to "
        "PDTransfer.",
    ),
    (
        "sglang-with-staging-sizes",
        {**SGLANG, "transfer": {"staging": {"prefillBufferMiB": 64}}},
        {"engine-native-has-no-staging-sizes"},
        "the sglang engine's own KV connector moves the KV and has no staging pool to resize. "
        "Remove them: sglang runs only EngineNative.",
    ),
    (
        "router-without-image",
        {"router": {"enabled": True}},
        {"router-image"},
        "spec.router.enabled is true but spec.router.image is not set",
    ),
    (
        "layer-groups-inverted",
        {"transfer": {"layerPipeline": {"minGroups": 9, "maxGroups": 4}}},
        {"layer-pipeline-groups-ordered"},
        "minGroups (9) is greater than maxGroups (4)",
    ),
]

VALID = [
    ("base", {}),
    ("equal-tp-no-staging-needed", {**VLLM, "transfer": {"staging": {"decodePoolMiB": 1}}}),
    ("staging-never-ignores-pool", {**VLLM, "prefill": {"parallelism": {"tensor": 2}},
                                    "decode": {"parallelism": {"tensor": 4}},
                                    "transfer": {"staging": {"mode": "Never",
                                                             "decodePoolMiB": 1}}}),
    ("pool-exactly-enough", {**VLLM, "prefill": {"parallelism": {"tensor": 2}},
                             "decode": {"parallelism": {"tensor": 4}},
                             "transfer": {"staging": {"decodePoolMiB": 640,
                                                      "prefillBufferMiB": 1280}}}),
    ("tp-multiple-of-heads", {"model": {"numKVHeads": 2},
                              "prefill": {"parallelism": {"tensor": 8}},
                              "decode": {"parallelism": {"tensor": 8}}}),
    ("dp-attention", {"decode": {"parallelism": {"tensor": 8, "data": 8}},
                      "prefill": {"parallelism": {"tensor": 1}}}),
    ("mla", {"model": {"attention": "MLA", "numKVHeads": 1, "headDim": 576},
             "prefill": {"parallelism": {"tensor": 8}},
             "decode": {"parallelism": {"tensor": 16}}}),
    ("router", {"router": {"enabled": True, "image": "lmsysorg/sglang:latest"}}),
    ("sglang", {**SGLANG, "prefill": {"parallelism": {"tensor": 2}},
                "decode": {"parallelism": {"tensor": 4}}}),
    ("vllm-default-pools-too-small-for-no-chunk", {**VLLM}),
    ("vllm-engine-native-default-pools", {**VLLM, "transfer": {"backend": "EngineNative"},
                                          "prefill": {"parallelism": {"tensor": 2}},
                                          "decode": {"parallelism": {"tensor": 4}}}),
    ("cpu-engine", {**VLLM, "prefill": {"gpusPerPod": 0, "parallelism": {"tensor": 2}}}),
]


@pytest.mark.parametrize(("case", "overrides", "rules", "fragment"), INVALID,
                         ids=[c[0] for c in INVALID])
def test_invalid_spec_is_refused_by_python_and_cel(
    case: str, overrides: dict[str, Any], rules: set[str], fragment: str
) -> None:
    spec = make_spec_dict(**overrides)
    assert fragment in python_message(spec)
    assert failing_cel_rules(spec) == rules


@pytest.mark.parametrize(("case", "overrides"), VALID, ids=[c[0] for c in VALID])
def test_valid_spec_passes_python_and_cel(case: str, overrides: dict[str, Any]) -> None:
    spec = make_spec_dict(**overrides)
    parse_spec({"spec": spec})
    assert failing_cel_rules(spec) == set()


MIRRORED = [
    ({"decode": {"parallelism": {"tensor": 4, "data": 3}}}, "decode-data-divides-tensor"),
    ({"prefill": {"parallelism": {"pipeline": 3}}}, "prefill-pipeline-divides-layers"),
    ({"decode": {"gpusPerPod": 1, "parallelism": {"tensor": 2}},
      "prefill": {"parallelism": {"tensor": 2}}}, "decode-gpus-cover-ranks"),
]


@pytest.mark.parametrize(("overrides", "rule"), MIRRORED, ids=[m[1] for m in MIRRORED])
def test_mirrored_role_rules(overrides: dict[str, Any], rule: str) -> None:
    spec = make_spec_dict(**overrides)
    python_message(spec)
    assert failing_cel_rules(spec) == {rule}


def test_every_rule_has_an_invalid_case() -> None:
    covered = set().union(*(case[2] for case in INVALID)) | {m[1] for m in MIRRORED}
    assert covered == {rule.name for rule in RULES}


def test_all_problems_reported_at_once() -> None:
    spec = make_spec_dict(
        prefill={"pageSize": 8, "parallelism": {"pipeline": 3}},
        router={"enabled": True},
    )
    message = python_message(spec)
    assert "spec.prefill.pageSize (8) and spec.decode.pageSize (16) differ" in message
    assert "spec.prefill.parallelism.pipeline (3)" in message
    assert "spec.router.image is not set" in message


def cel_message(rule_name: str, spec: dict[str, Any]) -> str:
    rule = next(r for r in RULES if r.name == rule_name)
    assert rule.cel_message_expression is not None
    env = celpy.Environment()
    activation = {"self": celpy.json_to_cel(apply_schema_defaults(SPEC_SCHEMA, spec))}
    return str(env.program(env.compile(rule.cel_message_expression),
                           functions=KUBERNETES_FUNCTIONS).evaluate(activation))


@pytest.mark.parametrize(("rule", "overrides"), [
    ("engine-native-has-no-staging-sizes",
     {**VLLM, "transfer": {"backend": "EngineNative", "staging": {"decodePoolMiB": 6144}}}),
    ("engine-native-has-no-staging-sizes",
     {**SGLANG, "transfer": {"staging": {"decodePoolMiB": 6144}}}),
    ("backend-supported", {"engine": {"framework": "reference"},
                           "transfer": {"backend": "EngineNative"}}),
    ("backend-supported", {**SGLANG, "transfer": {"backend": "PDTransfer"}}),
])
def test_backend_rules_say_the_same_from_the_api_server_and_the_operator(
        rule: str, overrides: dict[str, Any]) -> None:
    """A refused staging patch reads the same whether the API server (CEL) or the operator
    (on API servers without CEL) refuses it."""
    spec = make_spec_dict(**overrides)
    assert python_message(spec) == cel_message(rule, spec)


def test_cel_message_expression_names_minimum() -> None:
    rule = next(r for r in RULES if r.name == "decode-pool-holds-chunk")
    assert rule.cel_message_expression is not None
    spec = make_spec_dict(**VLLM, prefill={"parallelism": {"tensor": 2}},
                          decode={"parallelism": {"tensor": 4}},
                          transfer={"staging": {"decodePoolMiB": 100}})
    env = celpy.Environment()
    activation = {"self": celpy.json_to_cel(apply_schema_defaults(SPEC_SCHEMA, spec))}
    message = env.program(env.compile(rule.cel_message_expression),
                          functions=KUBERNETES_FUNCTIONS).evaluate(activation)
    assert str(message) == (
        "spec.transfer.staging.decodePoolMiB cannot hold one prefill chunk: set it to at "
        "least 640 or lower spec.prefill.chunkedPrefillTokens"
    )
