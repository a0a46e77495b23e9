"""Build a current apiextensions-apiserver once and cache it: the CRD half of kube-apiserver,
so that tests see the CRDs' CEL rules (`x-kubernetes-validations`) enforced by a real API
server, which the v1.20 control plane cannot do (docs/testbed.md, "CEL API server").

No registry ships the binary. Debian sid packages `k8s.io/apiextensions-apiserver` as Go
source (`golang-k8s-apiextensions-apiserver-dev`, with `main.go`), and every library it imports
as another `golang-*-dev` package. The build adds sid as the only source of a private apt
configuration under the cache (the system's sources, lists and dpkg status are not touched and
nothing is installed, so no root is needed), resolves the dependency closure of that package
restricted to `golang-*-dev` packages plus the Go toolchain sid's `golang-go` points at,
`apt-get download`s them, `dpkg -x`es them into one tree, and runs `go build` in GOPATH mode
over that tree, as Debian's own packaging does. Only the binary and a JSON record of the
package versions stay in the cache; the rest (about 3.7 GB at its peak) is deleted.

`ensure_cel_apiserver()` is idempotent (one stat when cached) and serialised by a lock file.
`build_cel_apiserver_argv()` is the command line that serves CRDs from its own etcd, with
authentication, authorization and namespaces delegated to the v1.20 kube-apiserver.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from pd_devcluster.components import LOOPBACK
from pd_devcluster.errors import DevClusterError, ToolchainMissingError
from pd_devcluster.paths import bin_dir, cache_dir, logs_dir
from pd_devcluster.pki import Pki
from pd_devcluster.toolchain import (
    BuildProgress,
    _install_binary,
    build_lock,
    run_logged,
)

__all__ = [
    "CEL_APISERVER_NAME",
    "CelApiserverBuild",
    "build_cel_apiserver_argv",
    "cel_apiserver_path",
    "ensure_cel_apiserver",
    "find_cel_apiserver",
    "read_build_record",
]

CEL_APISERVER_NAME = "apiextensions-apiserver"
SOURCE_PACKAGE = "golang-k8s-apiextensions-apiserver-dev"
GO_PACKAGE = "k8s.io/apiextensions-apiserver"
# Depending on `golang-go` picks sid's default Go (1.27 when written; the source needs >= 1.26).
GO_META_PACKAGE = "golang-go"
SID_SOURCES_TEXT = (
    "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] "
    "http://deb.debian.org/debian sid main\n"
)
WORK_DIR = "cel-apiserver-build"
LOCK_FILE = "cel-apiserver.lock"

_GO_TOOLCHAIN = re.compile(r"^golang-(\d+\.\d+)-go$")
_GO_SOURCES = re.compile(r"^golang-(\d+\.\d+)-src$")


class AptPackage(BaseModel):
    """One stanza of apt's package index, reduced to what the closure needs."""

    model_config = ConfigDict(frozen=True)

    name: str
    version: str
    depends: tuple[tuple[str, ...], ...]  # AND of OR-groups, names only
    provides: tuple[str, ...]


class CelApiserverBuild(BaseModel):
    """What the cached binary was built from; written next to it as JSON."""

    model_config = ConfigDict(frozen=True)

    kubernetes_version: str
    go_version: str
    packages: dict[str, str]


def cel_apiserver_path() -> Path:
    """Where the binary lives once built (it may not exist)."""
    return bin_dir() / CEL_APISERVER_NAME


def _record_path() -> Path:
    return bin_dir() / f"{CEL_APISERVER_NAME}.json"


def _built() -> bool:
    path = cel_apiserver_path()
    return path.is_file() and os.access(path, os.X_OK) and _record_path().is_file()


def find_cel_apiserver() -> Path:
    """Path of the cached apiextensions-apiserver, or `ToolchainMissingError` saying how to
    build it."""
    if not _built():
        raise ToolchainMissingError(
            f"{CEL_APISERVER_NAME} not built yet (no {cel_apiserver_path()}). Run "
            "`pd-dev cluster build` (no root needed; 6-15 minutes on 2 cores the "
            "first time)."
        )
    return cel_apiserver_path()


def read_build_record() -> CelApiserverBuild:
    """The versions the cached binary was built from."""
    find_cel_apiserver()
    return CelApiserverBuild.model_validate_json(_record_path().read_text())


def ensure_cel_apiserver(*, quiet_if_cached: bool = True) -> Path:
    """Build the apiextensions-apiserver unless it is cached; return its path.

    Safe to call concurrently (a second caller waits on the lock, then finds the binary).
    Raises `DevClusterError` with the log path and tail if a step fails.
    """
    if _built():
        if not quiet_if_cached:
            print(f"{CEL_APISERVER_NAME} is cached in {bin_dir()}", file=sys.stderr)
        return cel_apiserver_path()
    cache_dir().mkdir(parents=True, exist_ok=True)
    with build_lock(cache_dir() / LOCK_FILE):
        if _built():
            return cel_apiserver_path()
        _build(BuildProgress())
    return cel_apiserver_path()


def _build(progress: BuildProgress) -> None:
    if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
        raise DevClusterError(
            f"apt-get/dpkg not found: {CEL_APISERVER_NAME} is built from Debian sid's Go "
            "source packages. Run the build on a Debian machine or container."
        )
    bin_dir().mkdir(parents=True, exist_ok=True)
    logs_dir().mkdir(parents=True, exist_ok=True)
    log = logs_dir() / "cel-apiserver-build.log"
    log.write_text("")
    work = cache_dir() / WORK_DIR
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        apt = _PrivateApt(work / "apt")
        progress.say(f"{CEL_APISERVER_NAME}: apt-get update (Debian sid, private apt state in "
                     f"{apt.root}; log: {log})")
        run_logged(progress, apt.argv("apt-get", "update"), log, env=_apt_env())
        index = _parse_index(apt.dumpavail(log))
        closure = _closure(index, [SOURCE_PACKAGE, GO_META_PACKAGE])
        go_version = _go_version(closure)
        source_version = closure[SOURCE_PACKAGE]
        megabytes = apt.download_size_mb(log, closure)
        progress.say(f"downloading {len(closure)} packages ({megabytes:.0f} MB): "
                     f"{SOURCE_PACKAGE} {source_version}, Go {go_version} and their golang-*-dev "
                     "dependencies")
        debs = work / "debs"
        debs.mkdir()
        started = time.monotonic()
        run_logged(progress, apt.argv("apt-get", "download",
                                       *(f"{n}={v}" for n, v in sorted(closure.items()))),
                    log, cwd=debs, env=_apt_env(), heartbeat="apt-get download")
        progress.say(f"downloaded in {time.monotonic() - started:.0f} s")
        files = sorted(debs.glob("*.deb"))
        if len(files) != len(closure):
            raise DevClusterError(f"expected {len(closure)} .deb files in {debs}, found "
                                  f"{len(files)}; see {log}")
        root = work / "root"
        progress.say(f"extracting {len(files)} packages into {root} (dpkg -x)")
        started = time.monotonic()
        for deb in files:
            run_logged(progress, ["dpkg", "-x", str(deb), str(root)], log)
        shutil.rmtree(debs)
        progress.say(f"extracted in {time.monotonic() - started:.0f} s")
        kubernetes_version = _kubernetes_version(source_version)
        progress.say(f"go build {GO_PACKAGE} ({kubernetes_version}, Go {go_version}; 4-9 "
                     f"min on 2 cores; log: {log})")
        started = time.monotonic()
        built = work / CEL_APISERVER_NAME
        run_logged(progress, _go_build_argv(root, go_version, kubernetes_version, built), log,
                    cwd=work, env=_go_env(root, go_version, work),
                    heartbeat="go build apiextensions-apiserver")
        progress.say(f"go build finished in {time.monotonic() - started:.0f} s")
        record = CelApiserverBuild(kubernetes_version=kubernetes_version, go_version=go_version,
                                   packages=dict(sorted(closure.items())))
        _install_binary(built, cel_apiserver_path())
        partial = _record_path().with_name(_record_path().name + ".partial")
        partial.write_text(record.model_dump_json(indent=2) + "\n")
        partial.replace(_record_path())
        progress.say(f"{CEL_APISERVER_NAME} {kubernetes_version} ready at "
                     f"{cel_apiserver_path()} (took {progress.elapsed_s():.0f} s)")
    finally:
        progress.say(f"removing build tree {work}")
        shutil.rmtree(work, ignore_errors=True)


def _apt_env() -> dict[str, str]:
    return {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}


class _PrivateApt:
    """apt-get/apt-cache with sid as the only source and every state dir under `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        for sub in ("sources.list.d", "preferences.d", "lists/partial", "cache", "state"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        (root / "sources.list").write_text(SID_SOURCES_TEXT)
        (root / "status").write_text("")  # nothing "installed": no system package interferes

    def argv(self, *command: str) -> list[str]:
        options = {
            "Dir::Etc::sourcelist": self.root / "sources.list",
            "Dir::Etc::sourceparts": self.root / "sources.list.d",
            "Dir::Etc::preferences": self.root / "preferences",
            "Dir::Etc::preferencesparts": self.root / "preferences.d",
            "Dir::State": self.root / "state",
            "Dir::State::Lists": self.root / "lists",
            "Dir::State::status": self.root / "status",
            "Dir::Cache": self.root / "cache",
            "Acquire::Languages": "none",
        }
        argv = [*command]
        for key, value in options.items():
            argv += ["-o", f"{key}={value}"]
        if os.geteuid() == 0:
            # apt would hand downloads to user _apt, who cannot write under root's cache.
            argv += ["-o", "APT::Sandbox::User=root"]
        return argv

    def _capture(self, log: Path, *command: str) -> str:
        result = subprocess.run(self.argv(*command), capture_output=True, text=True,
                                env=_apt_env(), check=False)
        if result.returncode != 0:
            with log.open("a") as out:
                out.write(f"\n$ {' '.join(command)}\n{result.stderr}")
            raise DevClusterError(f"`{' '.join(command)}` (private sid apt state in "
                                  f"{self.root}) failed: {result.stderr.strip()[-2000:]}")
        return result.stdout

    def dumpavail(self, log: Path) -> str:
        return self._capture(log, "apt-cache", "dumpavail")

    def download_size_mb(self, log: Path, packages: Mapping[str, str]) -> float:
        shown = self._capture(log, "apt-cache", "show", "--no-all-versions",
                              *(f"{n}={v}" for n, v in packages.items()))
        sizes = re.findall(r"^Size: (\d+)$", shown, flags=re.MULTILINE)
        return sum(int(size) for size in sizes) / 1e6


def _names(field: str) -> list[str]:
    """Package names of a Depends/Provides entry, without versions, arch qualifiers or
    build profiles."""
    cleaned = re.sub(r"\([^)]*\)|\[[^]]*\]|<[^>]*>", "", field)
    return [name.strip().split(":")[0] for name in cleaned.split("|") if name.strip()]


def _parse_index(text: str) -> dict[str, AptPackage]:
    """`apt-cache dumpavail` output -> package name -> stanza (one version per name)."""
    packages: dict[str, AptPackage] = {}
    for stanza in text.split("\n\n"):
        fields: dict[str, str] = {}
        for line in stanza.splitlines():
            if line and not line[0].isspace():
                key, _, value = line.partition(":")
                fields[key] = value.strip()
        if "Package" not in fields or "Version" not in fields:
            continue
        depends = ", ".join(f for f in (fields.get("Pre-Depends"), fields.get("Depends")) if f)
        packages[fields["Package"]] = AptPackage(
            name=fields["Package"],
            version=fields["Version"],
            depends=tuple(tuple(_names(group)) for group in depends.split(",") if group.strip()),
            provides=tuple(n for entry in fields.get("Provides", "").split(",")
                           for n in _names(entry)),
        )
    return packages


def _wanted(name: str) -> bool:
    """Go source trees and the Go toolchain; C libraries and tools (cgo, protoc) are not
    needed for a CGO_ENABLED=0 build."""
    return (name.startswith("golang-") and name.endswith("-dev")) \
        or bool(_GO_TOOLCHAIN.match(name) or _GO_SOURCES.match(name))


def _closure(index: Mapping[str, AptPackage], roots: Iterable[str]) -> dict[str, str]:
    """Name -> version of `roots` and everything they depend on that `_wanted` accepts
    (first satisfiable alternative, a virtual package by its first provider). The roots'
    meta-packages such as `golang-go` are walked through but not downloaded."""
    root_names = set(roots)
    providers: dict[str, str] = {}
    for package in index.values():
        for virtual in package.provides:
            providers.setdefault(virtual, package.name)
    seen: set[str] = set()
    pending = sorted(root_names)
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        if name not in index:
            raise DevClusterError(f"package {name} is not in Debian sid's index (any more?)")
        seen.add(name)
        for group in index[name].depends:
            chosen = next((n if n in index else providers[n] for n in group
                           if n in index or n in providers), None)
            if chosen is not None and (_wanted(chosen) or name in root_names):
                pending.append(chosen)
    return {name: index[name].version for name in sorted(seen) if _wanted(name)}


def _go_version(closure: Mapping[str, str]) -> str:
    versions = sorted({m.group(1) for name in closure if (m := _GO_TOOLCHAIN.match(name))})
    if len(versions) != 1:
        raise DevClusterError(f"expected one Go toolchain in the package set, found "
                              f"{versions or 'none'}")
    return versions[0]


def _kubernetes_version(source_version: str) -> str:
    """Debian version of k8s.io/apiextensions-apiserver (0.36.4-1) -> Kubernetes v1.36.4."""
    match = re.match(r"^(?:\d+:)?0\.(\d+)\.(\d+)", source_version)
    if match is None:
        raise DevClusterError(f"unexpected {SOURCE_PACKAGE} version {source_version}")
    return f"v1.{match.group(1)}.{match.group(2)}"


def _go_env(root: Path, go_version: str, work: Path) -> dict[str, str]:
    return {
        **os.environ,
        "GOROOT": str(root / "usr" / "lib" / f"go-{go_version}"),
        "GOPATH": str(root / "usr" / "share" / "gocode"),
        "GO111MODULE": "off",  # Debian's gocode tree is a GOPATH, not a module cache
        "GOTOOLCHAIN": "local",
        "GOPROXY": "off",
        "GOFLAGS": "",
        "GOENV": "off",
        "CGO_ENABLED": "0",
        "GOCACHE": str(work / "gocache"),
    }


def _go_build_argv(root: Path, go_version: str, kubernetes_version: str,
                   output: Path) -> list[str]:
    major, minor = kubernetes_version.lstrip("v").split(".")[:2]
    stamp = "k8s.io/component-base/version"
    ldflags = (f"-s -w -X {stamp}.gitVersion={kubernetes_version} -X {stamp}.gitMajor={major} "
               f"-X {stamp}.gitMinor={minor} -X {stamp}.gitTreeState=clean")
    go = root / "usr" / "lib" / f"go-{go_version}" / "bin" / "go"
    return [str(go), "build", "-trimpath", "-ldflags", ldflags, "-o", str(output), GO_PACKAGE]


# Admission plugins reading APIs that v1.20 does not serve (admission policies), whose
# informers would never sync.
_DISABLED_ADMISSION = ("ValidatingAdmissionPolicy", "MutatingAdmissionPolicy")


def build_cel_apiserver_argv(binary: Path, *, port: int, etcd_url: str, pki: Pki,
                             delegate_kubeconfig: Path) -> list[str]:
    """apiextensions-apiserver on 127.0.0.1:`port`, storing in its own etcd.

    Bearer tokens are checked (TokenReview) and requests authorized (SubjectAccessReview,
    except for `system:masters`) by the kube-apiserver of `delegate_kubeconfig`, which also
    serves the namespaces that the NamespaceLifecycle admission plugin looks up.
    """
    return [
        str(binary),
        f"--etcd-servers={etcd_url}",
        f"--bind-address={LOOPBACK}",
        f"--secure-port={port}",
        f"--tls-cert-file={pki.serving_cert}",
        f"--tls-private-key-file={pki.serving_key}",
        f"--kubeconfig={delegate_kubeconfig}",
        f"--authentication-kubeconfig={delegate_kubeconfig}",
        f"--authorization-kubeconfig={delegate_kubeconfig}",
        # The front-proxy settings it would read from kube-system are not used here.
        "--authentication-skip-lookup",
        # v1.20 serves flowcontrol only as v1beta1, which this server no longer reads.
        "--enable-priority-and-fairness=false",
        f"--disable-admission-plugins={','.join(_DISABLED_ADMISSION)}",
        "--profiling=false",
        "--v=1",
    ]
