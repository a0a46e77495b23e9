"""`pd-dev` argument wiring (no cluster started), and the operator's command without it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pd_devcluster.cli import build_parser, main
from pd_devcluster.demo import kubelet_argv
from pd_operator.cli import build_parser as build_operator_parser


@pytest.mark.parametrize("command", ["build", "tools", "up", "down", "env", "status", "kubelet"])
def test_every_subcommand_has_a_handler(command: str) -> None:
    args = build_parser().parse_args(["cluster", command])
    assert callable(args.handler)


def test_up_defaults_and_flags() -> None:
    parser = build_parser()
    defaults = parser.parse_args(["cluster", "up"])
    assert defaults.controller_manager is True
    assert (defaults.apiserver_port, defaults.etcd_port, defaults.etcd_peer_port) == (
        16443, 12379, 12380)
    assert defaults.crds is None
    custom = parser.parse_args(["cluster", "up", "--no-controller-manager", "--crds", "crds",
                                "--apiserver-port", "7443"])
    assert custom.controller_manager is False
    assert custom.crds == Path("crds")
    assert custom.apiserver_port == 7443


def test_demo_defaults() -> None:
    args = build_parser().parse_args(["demo"])
    assert (args.examples, args.namespace, args.timeout) == (Path("examples"), "pd-demo", 120.0)
    assert callable(args.handler)


def test_the_demo_starts_the_kubelet_through_pd_dev(tmp_path: Path) -> None:
    """Guards against the demo's fake kubelet daemon naming a command that no longer exists
    (it once ran `python -m pd_operator dev-cluster kubelet`)."""
    argv = kubelet_argv(tmp_path)
    assert argv[:3] == [sys.executable, "-m", "pd_devcluster"]
    args = build_parser().parse_args(argv[3:])
    assert (args.command, args.cluster_command, args.state_dir) == (
        "cluster", "kubelet", tmp_path)
    assert "fake kubelet" in (args.handler.__doc__ or "")


def test_python_m_pd_devcluster_is_pd_dev() -> None:
    done = subprocess.run([sys.executable, "-m", "pd_devcluster", "cluster", "--help"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    for command in ("build", "tools", "up", "down", "env", "status", "kubelet"):
        assert command in done.stdout


@pytest.mark.parametrize("command", ["dev-cluster", "demo"])
def test_the_operator_command_has_no_dev_tooling(
        command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Guards against the product's command reaching the development tooling again."""
    with pytest.raises(SystemExit) as refused:
        build_operator_parser().parse_args([command])
    assert refused.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_status_and_env_fail_cleanly_without_a_cluster(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cluster", "status", "--state-dir", str(tmp_path)]) == 1
    assert main(["cluster", "env", "--state-dir", str(tmp_path)]) == 1
    assert main(["cluster", "down", "--state-dir", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert "not running" in captured.out
    assert "error: no dev cluster running" in captured.err
    assert "nothing to stop" in captured.err
