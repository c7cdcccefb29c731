"""TLS for both services: the server's own certificate and, optionally, its clients'
(``server_tls``: options for uvicorn), and the context the gateway speaks to its engines
with (``client_context``). Every file is loaded here once, so a missing, unreadable or
mismatched file is a one-line error (``TlsError``) before the port is bound, not a
traceback from uvicorn's start. Only the standard library's ``ssl``."""

from __future__ import annotations

import ssl
from typing import Any

CERT_REQS = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}
"""``--ssl-cert-reqs``: whether a client must present a certificate signed by
``--ssl-ca-certs`` (``required``), may (``optional``: one it presents is verified), or is
not asked (``none``)."""


class TlsError(ValueError):
    """A TLS setting that cannot be used; ``field`` names it (``certfile``, ``keyfile``,
    ``ca_certs``, ``cert_reqs``), so the command line can name its option."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _no_password() -> bytes:
    """The password callback: an encrypted key fails to load instead of OpenSSL asking
    for its pass phrase on the terminal."""
    raise TlsError("keyfile", "encrypted private keys are not supported")


def _readable(field: str, path: str) -> None:
    try:
        with open(path, "rb") as handle:
            handle.read(1)
    except OSError as exc:
        raise TlsError(field, f"cannot read {path!r}: {exc.strerror or exc}") from None


def _load_chain(context: ssl.SSLContext, certfile: str, keyfile: str | None) -> None:
    """The certificate (chain) and its private key into ``context``."""
    _readable("certfile", certfile)
    if keyfile is not None:
        _readable("keyfile", keyfile)
    try:
        context.load_cert_chain(certfile, keyfile, _no_password)
    except TlsError:
        raise
    except (ssl.SSLError, OSError, ValueError) as exc:
        what = f"{certfile!r} and {keyfile!r}" if keyfile else repr(certfile)
        raise TlsError(
            "certfile",
            f"cannot use {what} as a PEM certificate and its private key: {_reason(exc)}",
        ) from None


def _load_ca(context: ssl.SSLContext, ca_certs: str) -> None:
    _readable("ca_certs", ca_certs)
    try:
        context.load_verify_locations(cafile=ca_certs)
    except (ssl.SSLError, OSError, ValueError) as exc:
        raise TlsError(
            "ca_certs", f"cannot use {ca_certs!r} as PEM CA certificates: {_reason(exc)}"
        ) from None


_REASONS = {
    "PEM_LIB": "no PEM certificate and private key found",
    "KEY_VALUES_MISMATCH": "the private key is not the certificate's",
    "NO_CERTIFICATE_OR_CRL_FOUND": "no PEM certificate found in it",
}


def _reason(exc: BaseException) -> str:
    """OpenSSL's reason in words (``PEM_LIB`` says little)."""
    reason = getattr(exc, "reason", None)
    if isinstance(reason, str) and reason:
        return _REASONS.get(reason, reason.replace("_", " ").lower())
    text = getattr(exc, "strerror", None) or str(exc)
    if "PEM lib" in text:  # no reason given: a file without the PEM blocks expected
        return _REASONS["PEM_LIB"]
    return " ".join(text.split())[:200] or type(exc).__name__


def server_tls(
    certfile: str | None,
    keyfile: str | None = None,
    ca_certs: str | None = None,
    cert_reqs: str | None = None,
) -> dict[str, Any]:
    """uvicorn's ``ssl_*`` options for serving HTTPS with ``certfile`` (its key in
    ``keyfile`` or in the same file), clients' certificates verified against
    ``ca_certs`` as ``cert_reqs`` says (default: ``required`` with ``ca_certs``, else
    ``none``); ``{}`` without ``certfile`` (plain HTTP). Every file is loaded to check it."""
    if certfile is None:
        given = {"keyfile": keyfile, "ca_certs": ca_certs, "cert_reqs": cert_reqs}
        for field, value in given.items():
            if value is not None:
                raise TlsError(field, "needs --ssl-certfile (the server's certificate)")
        return {}
    if cert_reqs is None:
        cert_reqs = "required" if ca_certs is not None else "none"
    if cert_reqs not in CERT_REQS:
        raise TlsError("cert_reqs", f"must be one of {', '.join(CERT_REQS)}")
    if cert_reqs != "none" and ca_certs is None:
        raise TlsError("cert_reqs", f"{cert_reqs} needs --ssl-ca-certs (the clients' CA)")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _load_chain(context, certfile, keyfile)
    if ca_certs is not None:
        _load_ca(context, ca_certs)
    return {
        "ssl_certfile": certfile,
        "ssl_keyfile": keyfile,
        "ssl_ca_certs": ca_certs,
        "ssl_cert_reqs": CERT_REQS[cert_reqs],
    }


def client_context(
    ca_certs: str | None = None, certfile: str | None = None, keyfile: str | None = None
) -> ssl.SSLContext:
    """A client's context that verifies servers' certificates and names: against
    ``ca_certs`` alone when given (else the system's CAs), presenting ``certfile`` (its
    key in ``keyfile`` or in the same file) to servers that ask for a client certificate."""
    if keyfile is not None and certfile is None:
        raise TlsError("keyfile", "needs a certificate file too")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies, checks names
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if ca_certs is not None:
        _load_ca(context, ca_certs)
    else:
        context.load_default_certs()
    if certfile is not None:
        _load_chain(context, certfile, keyfile)
    return context
