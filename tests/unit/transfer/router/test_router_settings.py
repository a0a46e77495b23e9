"""The router's settings: flags over environment variables over defaults, refusals that
name the flag and the variable, engine specs; and the command line end to end (a real
`pd-transfer router` process serving, then draining on SIGTERM). Needs neither NIXL, torch
nor a GPU."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request

import pytest

from pd_contract.transferagent import Role
from pd_testbed.checkout import REPO_ROOT
from pd_transfer.cli import main
from pd_transfer.router import (
    DiscoveryKind,
    Endpoint,
    PDProtocol,
    PolicyName,
    RouterSettings,
    parse_engine,
    settings_from,
)
from pd_transfer.router.errors import SettingsError
from pd_transfer.router.settings import ENVIRONMENT

pytestmark = pytest.mark.timeout(30)

REPO = REPO_ROOT
NONE = dict.fromkeys(ENVIRONMENT)  # no flag given


def test_flags_win_over_the_environment_which_wins_over_defaults() -> None:
    environ = {"PD_ROUTER_PORT": "9000", "PD_ROUTER_POLICY": "least-load",
               "PD_PREFILL_URLS": "http://p0:8000, http://p1:8000,",
               "PD_DECODE_URLS": "http://d0:8000@d0:7000",
               "PD_ROUTER_BOOTSTRAP_PORT": "8998", "PD_PREFILL_BOOTSTRAP_PORT": "1111",
               "PD_ROUTER_LOG_LEVEL": "debug"}
    settings = settings_from({**NONE, "port": 7000}, environ)
    assert settings == RouterSettings(port=7000, policy=PolicyName.LEAST_LOAD,
                                      prefill=("http://p0:8000", "http://p1:8000"),
                                      decode=("http://d0:8000@d0:7000",), bootstrap_port=8998,
                                      log_level="DEBUG")
    assert [e.bootstrap for e in settings.static_endpoints()] == ["p0:8998", "p1:8998",
                                                                   "d0:7000"]
    # The operator's builder has set PD_PREFILL_BOOTSTRAP_PORT from the start.
    del environ["PD_ROUTER_BOOTSTRAP_PORT"]
    assert settings_from(NONE, environ).bootstrap_port == 1111
    # Defaults: the CRD's default policy, both-at-once protocol, static discovery.
    defaults = settings_from({**NONE, "prefill": ["http://p:1@p:2"], "decode": ["http://d:1@d:2"]},
                             {})
    assert (defaults.policy, defaults.protocol, defaults.discovery, defaults.port) == (
        PolicyName.CACHE_AWARE, PDProtocol.PD_TRANSFER, DiscoveryKind.STATIC, 8000)


@pytest.mark.parametrize(("flags", "environ", "message"), [
    ({}, {"PD_ROUTER_PORT": "http", "PD_PREFILL_URLS": "http://p:1@p:2",
          "PD_DECODE_URLS": "http://d:1@d:2"},
     "port (--port or $PD_ROUTER_PORT): Input should be a valid integer"),
    ({}, {"PD_ROUTER_POLICY": "random"}, "policy (--policy or $PD_ROUTER_POLICY)"),
    ({"prefill": ["http://p:1@p:2"]}, {},
     "static discovery needs at least one prefill and one decode engine"),
    ({"prefill": ["http://p:1"], "decode": ["http://d:1@d:2"]}, {},
     "prefill engine http://p:1 has no bootstrap address"),
    ({"prefill": ["p:1@p:2"], "decode": ["http://d:1@d:2"]}, {},
     "the URL must be http://host:port"),
    ({"discovery": "kubernetes"}, {},
     "kubernetes discovery needs --namespace, --deployment, --engine-port, --bootstrap-port"),
    ({"discovery": "kubernetes", "deployment": "d", "engine_port": 8000,
      "bootstrap_port": 8998}, {"POD_NAMESPACE": "ns", "PD_DECODE_URLS": "http://d:1@d:2"},
     "kubernetes discovery finds the engines by watching the PDDeployment's pods: drop "
     "--prefill and --decode (PD_PREFILL_URLS, PD_DECODE_URLS), or use --discovery static"),
    ({"discovery": "kubernetes", "deployment": "Bad_Name"}, {"POD_NAMESPACE": "ns"},
     "deployment (--deployment or $PD_ROUTER_DEPLOYMENT)"),
])
def test_bad_settings_are_refused_naming_their_source(
        flags: dict[str, object], environ: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError) as raised:
        settings_from({**NONE, **flags}, environ)
    assert message in str(raised.value)


def test_kubernetes_discovery_settings_from_the_pod_environment() -> None:
    """vllm-nixl needs no bootstrap port; the namespace falls back to the downward API's."""
    settings = settings_from(NONE, {
        "PD_ROUTER_DISCOVERY": "kubernetes", "PD_ROUTER_PROTOCOL": "vllm-nixl",
        "POD_NAMESPACE": "team", "PD_ROUTER_DEPLOYMENT": "llama",
        "PD_ROUTER_ENGINE_PORT": "8000"})
    assert (settings.namespace, settings.deployment, settings.engine_port,
            settings.bootstrap_port) == ("team", "llama", 8000, None)


@pytest.mark.parametrize(("spec", "port", "endpoint"), [
    ("http://10.0.0.7:8000@10.0.0.7:8998", None,
     Endpoint(Role.PREFILL, "10.0.0.7", 8000, "10.0.0.7:8998")),
    ("http://engine-0.svc:8000/", 8998, Endpoint(Role.PREFILL, "engine-0.svc", 8000,
                                                 "engine-0.svc:8998")),
    ("http://[fd00::7]:8000", None, Endpoint(Role.PREFILL, "fd00::7", 8000, None)),
])
def test_engine_specs(spec: str, port: int | None, endpoint: Endpoint) -> None:
    parsed = parse_engine(spec, Role.PREFILL, port)
    assert parsed == endpoint
    assert parsed.url == ("http://[fd00::7]:8000" if ":" in endpoint.host
                          else f"http://{endpoint.host}:8000")


@pytest.mark.parametrize("spec", ["https://h:1", "http://h", "http://h:1/v1", "http://h:1@h",
                                  "http://h:1@h:99999", "http://h:x"])
def test_malformed_engine_specs_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="engine"):
        parse_engine(spec, Role.DECODE, 8998)


def test_the_command_line_refuses_bad_settings_with_status_2(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["router", "--prefill", "http://p:1"]) == 2
    assert "static discovery needs" in capsys.readouterr().err
    assert main(["vllm-proxy", "--prefill", "http://p:1", "--decode", "http://d:1"]) == 2
    assert "no bootstrap address" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["router", "vllm-proxy"])
def test_the_router_process_serves_then_drains_on_sigterm(command: str) -> None:
    """The real entry point: prints its URL, answers /health, exits 0 on SIGTERM."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        str(REPO / d) for d in ("transfer", "contract"))}
    args = [sys.executable, "-m", "pd_transfer.cli", command, "--host", "127.0.0.1",
            "--port", "0", "--prefill", "http://127.0.0.1:1@127.0.0.1:2", "--decode",
            "http://127.0.0.1:3@127.0.0.1:4"]
    if command == "router":
        args += ["--drain-seconds", "1"]
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                               text=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert "pd-transfer router on http://127.0.0.1:" in line, process.stderr
        served = re.search(r" on (http://127\.0\.0\.1:\d+):", line)
        assert served is not None, line
        base = served.group(1)
        with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
            assert json.loads(response.read())["status"] == "ok"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(5)
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                stream.close()
