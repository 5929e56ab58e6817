"""The devstack's own certificate authority and broker certificate, made with the ``openssl`` CLI.

A secure devstack (``sluice kafka start --secure``) serves TLS on every listener. The CA and one
certificate for ``127.0.0.1``/``localhost`` (subject alternative names, so clients verify the host) are
made once under ``<state_dir>/kafka/tls/`` and reused; Kafka reads them as PEM (``ssl.keystore.type=PEM``),
so no Java keystore tooling is needed. Clients trust ``ca.pem`` (setting ``kafka_ssl_ca_file``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

DAYS = 825  # the longest server-certificate lifetime common clients accept


class TlsError(RuntimeError):
    """openssl is missing or refused to make the certificates."""


@dataclass(frozen=True)
class TlsFiles:
    ca: Path          # the CA certificate clients and brokers trust
    keystore: Path    # the broker's private key (PKCS#8) followed by its certificate chain

    @classmethod
    def under(cls, directory: Path) -> "TlsFiles":
        return cls(ca=directory / "ca.pem", keystore=directory / "broker.pem")

    def exist(self) -> bool:
        return self.ca.exists() and self.keystore.exists()


def _openssl(*args: str, cwd: Path) -> None:
    tool = shutil.which("openssl")
    if not tool:
        raise TlsError("`openssl` is not on PATH; the secure devstack makes its certificates with it")
    proc = subprocess.run([tool, *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise TlsError(f"openssl {args[0]} failed:\n{proc.stderr[-2000:]}")


def ensure_certificates(directory: Path) -> TlsFiles:
    """Make the CA and the broker certificate unless they exist; private keys are 0600."""
    files = TlsFiles.under(directory)
    if files.exist():
        return files
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    (directory / "broker.ext").write_text(
        "basicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth,clientAuth\n"
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
             "-days", str(DAYS), "-subj", "/CN=sluice devstack CA",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             cwd=directory)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "broker.key", "-out", "broker.csr",
             "-subj", "/CN=localhost", cwd=directory)
    _openssl("x509", "-req", "-in", "broker.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "broker.crt", "-days", str(DAYS), "-extfile", "broker.ext", cwd=directory)
    key = (directory / "broker.key").read_text()
    if "BEGIN PRIVATE KEY" not in key:
        raise TlsError("openssl wrote the broker key in a format Kafka's PEM keystore cannot read (not PKCS#8)")
    staging = directory / "broker.pem.partial"
    staging.write_text(key + (directory / "broker.crt").read_text() + files.ca.read_text())
    os.chmod(staging, 0o600)
    staging.rename(files.keystore)
    for name in ("ca.key", "broker.key"):
        os.chmod(directory / name, 0o600)
    for name in ("broker.csr", "broker.ext"):
        (directory / name).unlink(missing_ok=True)
    return files
