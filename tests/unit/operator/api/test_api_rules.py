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
from pd_testbed.cel_functions import KUBERNETES_FUNCTIONS
from pd_testbed.crd_schema import SPEC_SCHEMA, apply_schema_defaults
from pd_testbed.factories import make_spec_dict
from pd_testbed.spec_cases import INVALID, MIRRORED, SGLANG, VALID, VLLM


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
