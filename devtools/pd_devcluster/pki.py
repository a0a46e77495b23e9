"""Keys, certificates and tokens of the dev cluster, made with the `openssl` command line.

One CA signs the apiserver's serving certificate (SAN IP:127.0.0.1, DNS:localhost); a separate
RSA key pair signs and verifies ServiceAccount tokens; a static token file authenticates the
admin and the controller-manager, both in `system:masters` (a dev cluster, not a secure one).
Existing material in the directory is reused, so a restarted cluster keeps its CA and tokens
and kubeconfigs written earlier stay valid.
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from pd_devcluster.errors import DevClusterError

__all__ = ["ADMIN_USER", "CONTROLLER_MANAGER_USER", "Pki", "ensure_pki", "render_token_file"]

ADMIN_USER = "pd-dev-admin"
CONTROLLER_MANAGER_USER = "system:kube-controller-manager"
_VALID_DAYS = "3650"

_CA_EXTENSIONS = """\
[v3_ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign, digitalSignature
subjectKeyIdentifier = hash
"""

_SERVING_EXTENSIONS = """\
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid, issuer
subjectAltName = IP:127.0.0.1, DNS:localhost
"""


@dataclass(frozen=True)
class Pki:
    """Paths of the generated material plus the two bearer tokens."""

    directory: Path
    ca_cert: Path
    ca_key: Path
    serving_cert: Path
    serving_key: Path
    sa_private_key: Path
    sa_public_key: Path
    token_file: Path
    admin_token: str
    controller_manager_token: str


def render_token_file(admin_token: str, controller_manager_token: str) -> str:
    """Static token file for `--token-auth-file`: `token,user,uid,"groups"` per line."""
    return (
        f'{admin_token},{ADMIN_USER},{ADMIN_USER},"system:masters"\n'
        f'{controller_manager_token},{CONTROLLER_MANAGER_USER},{CONTROLLER_MANAGER_USER},'
        '"system:masters"\n'
    )


def ensure_pki(directory: Path) -> Pki:
    """Create (or reuse) the CA, serving cert, SA key pair and token file in `directory`."""
    if shutil.which("openssl") is None:
        raise DevClusterError("openssl not found: install it (apt-get install openssl)")
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    pki = Pki(
        directory=directory,
        ca_cert=directory / "ca.crt",
        ca_key=directory / "ca.key",
        serving_cert=directory / "apiserver.crt",
        serving_key=directory / "apiserver.key",
        sa_private_key=directory / "sa.key",
        sa_public_key=directory / "sa.pub",
        token_file=directory / "tokens.csv",
        admin_token=_ensure_token(directory / "admin.token"),
        controller_manager_token=_ensure_token(directory / "controller-manager.token"),
    )
    if not (pki.ca_cert.is_file() and pki.ca_key.is_file()):
        _make_ca(pki)
        pki.serving_cert.unlink(missing_ok=True)  # signed by the old CA, if any
    if not (pki.serving_cert.is_file() and pki.serving_key.is_file()):
        _make_serving_cert(pki)
    if not (pki.sa_private_key.is_file() and pki.sa_public_key.is_file()):
        _openssl(["genrsa", "-out", str(pki.sa_private_key), "2048"])
        _openssl(["rsa", "-in", str(pki.sa_private_key), "-pubout",
                  "-out", str(pki.sa_public_key)])
    pki.token_file.write_text(render_token_file(pki.admin_token, pki.controller_manager_token))
    for secret in (pki.ca_key, pki.serving_key, pki.sa_private_key, pki.token_file):
        secret.chmod(0o600)
    return pki


def _ensure_token(path: Path) -> str:
    if path.is_file():
        token = path.read_text().strip()
        if token:
            return token
    token = secrets.token_hex(32)
    path.write_text(token + "\n")
    path.chmod(0o600)
    return token


def _make_ca(pki: Pki) -> None:
    config = pki.directory / "ca.cnf"
    config.write_text("[req]\ndistinguished_name = dn\n[dn]\n" + _CA_EXTENSIONS)
    _openssl(["genrsa", "-out", str(pki.ca_key), "2048"])
    _openssl(["req", "-x509", "-new", "-key", str(pki.ca_key), "-sha256", "-days", _VALID_DAYS,
              "-subj", "/CN=pd-operator-dev-cluster-ca", "-config", str(config),
              "-extensions", "v3_ca", "-out", str(pki.ca_cert)])


def _make_serving_cert(pki: Pki) -> None:
    csr = pki.directory / "apiserver.csr"
    extensions = pki.directory / "apiserver.ext"
    extensions.write_text(_SERVING_EXTENSIONS)
    _openssl(["genrsa", "-out", str(pki.serving_key), "2048"])
    _openssl(["req", "-new", "-key", str(pki.serving_key), "-subj", "/CN=kube-apiserver",
              "-out", str(csr)])
    _openssl(["x509", "-req", "-in", str(csr), "-CA", str(pki.ca_cert), "-CAkey", str(pki.ca_key),
              "-CAcreateserial", "-sha256", "-days", _VALID_DAYS, "-extfile", str(extensions),
              "-out", str(pki.serving_cert)])
    csr.unlink()


def _openssl(args: list[str]) -> None:
    result = subprocess.run(["openssl", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise DevClusterError(
            f"`openssl {' '.join(args)}` failed ({result.returncode}): {result.stderr.strip()}"
        )
