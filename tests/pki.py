"""A throwaway certificate authority for TLS tests, made with the ``openssl`` CLI, and a one-shot TLS server."""

from __future__ import annotations

import socket
import ssl
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Pki:
    ca: Path             # CA certificate
    other_ca: Path       # a CA that signed nothing here
    server_cert: Path    # for 127.0.0.1 / localhost, signed by ``ca``
    server_key: Path
    client_cert: Path    # signed by ``ca``
    client_key: Path
    client_pem: Path     # client key and certificate in one file
    encrypted_key: Path  # ``client_key`` under a passphrase


def _openssl(cwd: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _ca(cwd: Path, name: str) -> None:
    _openssl(cwd, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.pem",
             "-days", "2", "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")


def _leaf(cwd: Path, name: str, ext: str) -> None:
    (cwd / f"{name}.ext").write_text(ext)
    _openssl(cwd, "req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
             "-subj", f"/CN={name}")
    _openssl(cwd, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext")


def make_pki(directory: Path) -> Pki:
    _ca(directory, "ca")
    _ca(directory, "other")
    _leaf(directory, "server", "basicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n"
                               "subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _leaf(directory, "client", "basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n")
    (directory / "client-both.pem").write_bytes((directory / "client.key").read_bytes()
                                                + (directory / "client.pem").read_bytes())
    _openssl(directory, "pkey", "-in", "client.key", "-aes256", "-passout", "pass:secret", "-out", "encrypted.key")
    return Pki(ca=directory / "ca.pem", other_ca=directory / "other.pem", server_cert=directory / "server.pem",
               server_key=directory / "server.key", client_cert=directory / "client.pem",
               client_key=directory / "client.key", client_pem=directory / "client-both.pem",
               encrypted_key=directory / "encrypted.key")


class OneShotTlsServer:
    """Accepts one connection on 127.0.0.1 and records how its TLS handshake went: ``handshake`` is "ok",
    "no tls" (the first byte was not a TLS record) or the server-side error; ``first_bytes`` what followed."""

    def __init__(self, pki: Pki, require_client_cert: bool = False) -> None:
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(pki.server_cert, pki.server_key)
        if require_client_cert:
            self.context.verify_mode = ssl.CERT_REQUIRED
            self.context.load_verify_locations(pki.ca)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.handshake = ""
        self.first_bytes = b""
        self.done = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        try:
            conn, _ = self.sock.accept()
            conn.settimeout(5)
            with conn:
                if conn.recv(1, socket.MSG_PEEK) != b"\x16":
                    self.handshake, self.first_bytes = "no tls", conn.recv(64)
                    return
                try:
                    with self.context.wrap_socket(conn, server_side=True) as tls:
                        self.handshake = "ok"
                        self.first_bytes = tls.recv(64)
                except (ssl.SSLError, OSError) as exc:
                    self.handshake = self.handshake or f"failed: {exc}"
        finally:
            self.sock.close()
            self.done.set()
