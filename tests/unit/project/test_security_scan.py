"""checkov on what we ship: the chart's manifests and the children of every example.

Every finding is either fixed or listed in ACCEPTED with the reason it stays; a new finding,
or an accepted one that disappears, fails the test so the list stays true. checkov lives in
its own virtualenv in the dev-cluster cache (`pd-dev cluster build` installs it);
without it these tests fail and say how to get it.
"""

from __future__ import annotations

import json
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest
import yaml

from pd_contract.transferagent import Role
from pd_devcluster import ToolchainMissingError, checkov_path, helm_path
from pd_operator.api import parse_pdd
from pd_operator.build import Capabilities, build_children
from pd_operator.build.instances import build_instance_pod
from pd_operator.build.pod import build_pod_template
from pd_testbed.checkout import CHART_DIR, CHART_RELEASE, CHART_RELEASE_NAMESPACE, EXAMPLES
from pd_testbed.factories import example_pdd

# check id -> why it stays.
ACCEPTED: dict[str, str] = {
    "CKV_K8S_10": "CPU requests come from the user's spec (resources.requests); the examples "
                  "size GPU pods by GPUs and leave CPU to the node.",
    "CKV_K8S_11": "CPU limits throttle tokenizer and scheduler threads of an engine; left to "
                  "the user's spec (the chart's operator pod sets none for the same reason).",
    "CKV_K8S_12": "Memory requests come from the user's spec (resources.requests).",
    "CKV_K8S_13": "Memory limits come from the user's spec; engines size host memory by model.",
    "CKV_K8S_14": "The image tag is the user's choice (examples use :latest of the engine "
                  "projects).",
    "CKV_K8S_15": "imagePullPolicy is the user's choice (engine images are tens of GB: "
                  "IfNotPresent by default).",
    "CKV_K8S_22": "Engines write Triton/torch-compile caches and model downloads into the root "
                  "filesystem; a read-only root breaks the vLLM and SGLang images.",
    "CKV_K8S_23": "The engine images (vLLM, SGLang, CUDA bases) run as root; runAsNonRoot "
                  "would stop them. All capabilities but IPC_LOCK are dropped instead.",
    "CKV_K8S_25": "IPC_LOCK is added: RDMA registers (pins) KV memory with the NIC.",
    "CKV_K8S_35": "llama-70b reads HF_TOKEN from a Secret through env, as the engines expect "
                  "it; that is the user's spec.",
    "CKV_K8S_38": "The token is mounted only where it is used: by pd_transfer's agent in "
                  "engine pods of the PDTransfer backend (it writes TransferAgents), by a "
                  "router that watches the engine pods, and by the operator.",
    "CKV_K8S_40": "Same as CKV_K8S_23: the engine images choose their user (root).",
    "CKV_K8S_43": "Image digests are the user's choice; examples and chart defaults use tags.",
}

ENGINE_IMAGE = {"CKV_K8S_14", "CKV_K8S_15", "CKV_K8S_43"}
ENGINE_ROOT = {"CKV_K8S_22", "CKV_K8S_23", "CKV_K8S_25", "CKV_K8S_40"}
NO_RESOURCES = {"CKV_K8S_10", "CKV_K8S_11", "CKV_K8S_12", "CKV_K8S_13"}
# Hand-derived from each example: local-reference sets CPU/memory requests, a pinned tag and
# runs the reporting agent (token); llama-70b's HF_TOKEN comes from a Secret; the vLLM
# examples run PDTransfer (the agent's token), llama-70b a router that watches pods (token)
# and pins its image tag, as qwen3-8b-vllm.
EXPECTED_FAILED: dict[str, set[str]] = {
    "deepseek-v3-mla.yaml": ENGINE_IMAGE | ENGINE_ROOT | NO_RESOURCES,
    "llama-70b.yaml": (ENGINE_IMAGE - {"CKV_K8S_14"}) | ENGINE_ROOT | NO_RESOURCES
    | {"CKV_K8S_35", "CKV_K8S_38"},
    "local-reference.yaml": (ENGINE_IMAGE - {"CKV_K8S_14"}) | ENGINE_ROOT
    | {"CKV_K8S_11", "CKV_K8S_13", "CKV_K8S_38"},
    # Engines set requests but no limits; the router sets none; PDTransfer and the router
    # use their tokens.
    "local-vllm.yaml": (ENGINE_IMAGE - {"CKV_K8S_14"}) | ENGINE_ROOT | NO_RESOURCES
    | {"CKV_K8S_38"},
    "qwen3-8b-vllm.yaml": (ENGINE_IMAGE - {"CKV_K8S_14"}) | ENGINE_ROOT | NO_RESOURCES
    | {"CKV_K8S_38"},
    # The operator: non-root, read-only root, seccomp, no capabilities, a NetworkPolicy;
    # it needs its token, has no CPU limit, and its default image is a tag pulled IfNotPresent.
    "chart.yaml": {"CKV_K8S_11", "CKV_K8S_15", "CKV_K8S_38", "CKV_K8S_43"},
}


def render_example(example: Path) -> str:
    """The example's children and one engine instance's pod per role (`<role>-0`)."""
    pdd = parse_pdd(example_pdd(example))
    pdd.metadata.namespace = "serving"  # "default" would add CKV_K8S_21 to every child
    pdd.metadata.uid = "uid-1"
    pods = [build_instance_pod(pdd, role, build_pod_template(pdd, role),
                               f"{pdd.metadata.name}-{role.value}-0")
            for role in (Role.PREFILL, Role.DECODE)]
    return yaml.safe_dump_all([*build_children(pdd, Capabilities()), *pods], sort_keys=False)


def render_chart() -> str:
    try:
        helm = helm_path()
    except ToolchainMissingError as exc:
        pytest.fail(str(exc))
    return subprocess.run(
        [str(helm), "template", CHART_RELEASE, str(CHART_DIR), "--namespace",
         CHART_RELEASE_NAMESPACE],
        check=True, capture_output=True, text=True,
    ).stdout


@pytest.fixture(scope="module")
def scan(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, set[str]]]:
    """file name -> failed check id -> resources failing it; one checkov run for all files."""
    try:
        checkov = checkov_path()
    except ToolchainMissingError as exc:
        pytest.fail(str(exc))
    directory = tmp_path_factory.mktemp("scan")
    for example in EXAMPLES:
        (directory / example.name).write_text(render_example(example))
    (directory / "chart.yaml").write_text(render_chart())
    done = subprocess.run(
        [str(checkov), "--directory", str(directory), "--framework", "kubernetes",
         "--output", "json", "--skip-download", "--compact"],
        check=False, capture_output=True, text=True, timeout=300,
    )
    # checkov exits 1 when any check fails; anything else is a crash.
    assert done.returncode in (0, 1), done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["summary"]["parsing_errors"] == 0
    found: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for result in report["results"]["failed_checks"]:
        found[Path(result["file_path"]).name][result["check_id"]].add(result["resource"])
    return found


def test_every_expected_finding_has_a_reason() -> None:
    """Guards against a finding waved through without saying why it stays."""
    listed = set().union(*EXPECTED_FAILED.values())
    assert listed == set(ACCEPTED)
    assert set(EXPECTED_FAILED) == {p.name for p in EXAMPLES} | {"chart.yaml"}


@pytest.mark.parametrize("name", sorted(EXPECTED_FAILED))
def test_remaining_findings_are_exactly_the_accepted_ones(
        scan: dict[str, dict[str, set[str]]], name: str) -> None:
    """Guards against engine pods open to every pod and over-privileged (no seccomp profile,
    capabilities kept, a token mounted where unused, no NetworkPolicy) coming back."""
    assert set(scan.get(name, {})) == EXPECTED_FAILED[name]


def test_llama_70b_fixed_findings_stay_fixed(scan: dict[str, dict[str, set[str]]]) -> None:
    """The engine pods' lock-down, per resource: seccomp (CKV_K8S_31), capabilities dropped
    (CKV_K8S_28/37), a NetworkPolicy per pod (CKV2_K8S_6), and no unused token (CKV_K8S_38:
    only the pods whose agent or router uses it mount it)."""
    failed = scan["llama-70b.yaml"]
    for check in ("CKV_K8S_31", "CKV_K8S_28", "CKV_K8S_37", "CKV_K8S_29", "CKV2_K8S_6"):
        assert check not in failed
    assert failed["CKV_K8S_38"] == {"Pod.serving.llama-70b-prefill-0",
                                    "Pod.serving.llama-70b-decode-0",
                                    "Deployment.serving.llama-70b-router"}
    assert failed["CKV_K8S_25"] == {"Pod.serving.llama-70b-prefill-0",
                                    "Pod.serving.llama-70b-decode-0"}
