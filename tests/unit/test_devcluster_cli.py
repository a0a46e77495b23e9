"""`pd-operator dev-cluster` argument wiring (no cluster started)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pd_operator.cli import build_parser, main


@pytest.mark.parametrize("command", ["build", "tools", "up", "down", "env", "status"])
def test_every_subcommand_has_a_handler(command: str) -> None:
    args = build_parser().parse_args(["dev-cluster", command])
    assert callable(args.handler)


def test_up_defaults_and_flags() -> None:
    parser = build_parser()
    defaults = parser.parse_args(["dev-cluster", "up"])
    assert defaults.controller_manager is True
    assert (defaults.apiserver_port, defaults.etcd_port, defaults.etcd_peer_port) == (
        16443, 12379, 12380)
    assert defaults.crds is None
    custom = parser.parse_args(["dev-cluster", "up", "--no-controller-manager", "--crds", "crds",
                                "--apiserver-port", "7443"])
    assert custom.controller_manager is False
    assert custom.crds == Path("crds")
    assert custom.apiserver_port == 7443


def test_status_and_env_fail_cleanly_without_a_cluster(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dev-cluster", "status", "--state-dir", str(tmp_path)]) == 1
    assert main(["dev-cluster", "env", "--state-dir", str(tmp_path)]) == 1
    assert main(["dev-cluster", "down", "--state-dir", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert "not running" in captured.out
    assert "error: no dev cluster running" in captured.err
    assert "nothing to stop" in captured.err
