"""The AMX tile hook of the dev cluster's vLLM env (devcluster/amx_tiles.py, vllm_env.py).

On a host with AMX, vLLM 0.32's CPU attention runs tile instructions without asking Linux
for the tile state, and its decode worker dies with SIGILL on the first P/D request (the
vLLM end-to-end tests fail so on such a host without the hook). Here: the hook's files land
in the env's site-packages once, and a fresh interpreter that processes that site directory
may use AMX tiles at once, where one that does not may not.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pd_devcluster import amx_tiles
from pd_devcluster.vllm_env import AMX_HOOK, VllmEnv, install_amx_hook


def _env(root: Path) -> VllmEnv:
    return VllmEnv(root=root, python=root / "bin" / "python")


def _site(root: Path) -> Path:
    return root / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / \
        "site-packages"


def test_the_hook_is_written_once_and_rewritten_when_it_differs(tmp_path: Path) -> None:
    env = _env(tmp_path)
    assert install_amx_hook(env)
    module, pth = _site(tmp_path) / f"{AMX_HOOK}.py", _site(tmp_path) / f"{AMX_HOOK}.pth"
    assert module.read_text() == Path(amx_tiles.__file__).read_text()
    assert pth.read_text() == "import pd_amx_tiles; pd_amx_tiles.request_amx_tiles()\n"
    assert not install_amx_hook(env)  # as it is now: nothing written
    module.write_text("# an older hook\n")
    assert install_amx_hook(env)
    assert module.read_text() == Path(amx_tiles.__file__).read_text()


def _has_amx() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " amx_tile" in flags


def _permitted_in_fresh_interpreter(site: Path, *, add_site: bool) -> str:
    """A new interpreter (-S: no site-packages of its own), with or without ``site`` processed
    as a site directory (its .pth lines run), reports whether it may use AMX tiles."""
    code = ("import site, sys\n"
            f"sys.path.insert(0, {str(site)!r})\n"
            + (f"site.addsitedir({str(site)!r})\n" if add_site else "")
            + "import pd_amx_tiles\nprint(pd_amx_tiles.amx_tiles_permitted())\n")
    return subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                          check=True, timeout=60).stdout.strip()


@pytest.mark.skipif(sys.platform != "linux" or not _has_amx(),
                    reason="needs Linux on a CPU with AMX tiles")
def test_an_interpreter_of_the_env_may_use_amx_tiles_from_its_start(tmp_path: Path) -> None:
    install_amx_hook(_env(tmp_path))
    site = _site(tmp_path)
    assert _permitted_in_fresh_interpreter(site, add_site=False) == "False"
    assert _permitted_in_fresh_interpreter(site, add_site=True) == "True"


def test_without_amx_or_linux_nothing_is_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(amx_tiles.platform, "machine", lambda: "aarch64")
    assert amx_tiles.request_amx_tiles() is False
    assert amx_tiles.amx_tiles_permitted() is False
