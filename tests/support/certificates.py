"""Throwaway certificates for the TLS tests, made with the ``openssl`` command line: a CA,
a server certificate for 127.0.0.1 and localhost (``make_tls_files``), and client
certificates signed by the same CA (``make_client_cert``), all valid 2 days. A machine
without ``openssl`` skips the test that asks."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

EC_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@dataclass(frozen=True)
class TlsFiles:
    ca_cert: Path
    server_cert: Path
    server_key: Path


@dataclass(frozen=True)
class ClientCert:
    cert: Path
    key: Path


def _openssl_path() -> str:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl not found on PATH: cannot make test certificates")
    return openssl


def _openssl(openssl: str, *args: str, cwd: Path) -> None:
    result = subprocess.run(
        [openssl, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed:\n{result.stdout}{result.stderr}")


def _signed(openssl: str, directory: Path, name: str, subject: str, extensions: str) -> None:
    """``NAME.key`` and ``NAME.crt`` in ``directory``, signed by its ``ca.crt``/``ca.key``."""
    _openssl(
        openssl, "req", "-new", *EC_KEY, "-keyout", f"{name}.key", "-out", f"{name}.csr",
        "-subj", subject,
        cwd=directory,
    )  # fmt: skip
    (directory / f"{name}.ext").write_text(extensions)
    _openssl(
        openssl, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-CAserial", "ca.srl", "-out", f"{name}.crt", "-days", "2",
        "-extfile", f"{name}.ext",
        cwd=directory,
    )  # fmt: skip


def make_tls_files(directory: Path) -> TlsFiles:
    """A throwaway CA and a server certificate for 127.0.0.1 and localhost, valid 2 days."""
    openssl = _openssl_path()
    _openssl(
        openssl, "req", "-x509", *EC_KEY, "-keyout", "ca.key", "-out", "ca.crt",
        "-days", "2", "-subj", "/CN=pcr test CA",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=directory,
    )  # fmt: skip
    _signed(
        openssl,
        directory,
        "server",
        "/CN=localhost",
        "subjectAltName = IP:127.0.0.1, DNS:localhost\n"
        "basicConstraints = critical, CA:FALSE\n"
        "keyUsage = critical, digitalSignature, keyEncipherment\n"
        "extendedKeyUsage = serverAuth\n"
        "subjectKeyIdentifier = hash\n"
        "authorityKeyIdentifier = keyid, issuer\n",
    )
    return TlsFiles(directory / "ca.crt", directory / "server.crt", directory / "server.key")


def make_client_cert(files: TlsFiles, name: str = "client") -> ClientCert:
    """A client certificate (``CN=NAME``) signed by the CA of ``files``, beside them."""
    directory = files.ca_cert.parent
    _signed(
        _openssl_path(),
        directory,
        name,
        f"/CN={name}",
        "basicConstraints = critical, CA:FALSE\n"
        "keyUsage = critical, digitalSignature\n"
        "extendedKeyUsage = clientAuth\n"
        "subjectKeyIdentifier = hash\n"
        "authorityKeyIdentifier = keyid, issuer\n",
    )
    return ClientCert(directory / f"{name}.crt", directory / f"{name}.key")
