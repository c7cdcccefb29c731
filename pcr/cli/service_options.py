"""Command-line options and checks that ``pcr serve`` and ``pcr gateway`` share: where to
listen, how to rank, their limits and deadlines, the bound socket, the Redis URL schemes
they take and the extras they need."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import socket
import stat
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pcr.cli.common import (
    CommandError,
    UsageError,
    int_in,
    number_in,
    one_line,
    port_arg,
    seconds_in,
    url_scheme,
    warn_user,
)
from pcr.web.auth import MAX_RATE, AccessPolicy, check_key, key_file_grants
from pcr.web.server import (
    BODY_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_POOL_TIMEOUT,
    HEADER_TIMEOUT,
    KEEP_ALIVE_TIMEOUT,
)
from pcr.web.tls import CERT_REQS, TlsError, server_tls
from registry.transport.client import CLUSTER_SCHEMES, PLAIN_SCHEMES

SERVE_SCHEMES = (*PLAIN_SCHEMES, *CLUSTER_SCHEMES)
MAX_TIMEOUT = 3600.0
MAX_CONNECTIONS = 10_000
"""The largest ``--max-connections`` (Redis' own default ``maxclients``)."""

_connections = int_in(1, MAX_CONNECTIONS, "connection count")
_keep_alive = int_in(1, int(MAX_TIMEOUT), "keep-alive timeout")


_timeout = seconds_in(0, MAX_TIMEOUT, above=True)
"""An argparse type: a finite number of seconds in (0, MAX_TIMEOUT]."""


def listen_options(parser: argparse.ArgumentParser, port: int) -> None:
    """What ``pcr serve`` and ``pcr gateway`` share first: where to listen and how to
    rank (their limits, ``limit_options``, come last)."""
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)"
    )
    parser.add_argument("--port", type=port_arg, default=port, help=f"TCP port (default {port})")
    parser.add_argument(
        "--hybrid",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="rank every node by the Mamba-usable prefix (--hybrid) or by the KV prefix "
        "(--no-hybrid); default: each by what its engine reuses (the Mamba-usable prefix "
        "where the namespace held Mamba state, else the KV prefix)",
    )


def limit_options(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "--max-connections",
        type=_connections,
        default=DEFAULT_MAX_CONNECTIONS,
        help="requests using Redis at once, and Redis connections (per node of a cluster); "
        f"the others wait their turn (default {DEFAULT_MAX_CONNECTIONS})",
    )
    serve.add_argument(
        "--pool-timeout",
        type=_timeout,
        default=DEFAULT_POOL_TIMEOUT,
        help="seconds a request waits for a free connection before 503 "
        f"(default {DEFAULT_POOL_TIMEOUT:g})",
    )
    serve.add_argument(
        "--header-timeout",
        type=_timeout,
        default=HEADER_TIMEOUT,
        help="seconds for a request's headers to arrive; then 408 and the connection "
        f"closes (default {HEADER_TIMEOUT:g})",
    )
    serve.add_argument(
        "--body-timeout",
        type=_timeout,
        default=BODY_TIMEOUT,
        help="seconds for a request's body to arrive after its headers; then 408 and the "
        f"connection closes (default {BODY_TIMEOUT:g})",
    )
    serve.add_argument(
        "--keep-alive-timeout",
        type=_keep_alive,
        default=KEEP_ALIVE_TIMEOUT,
        help="seconds an idle keep-alive connection stays open; keep it longer than the "
        "clients' pools keep idle connections, or a request sent as it closes fails "
        f"(default {KEEP_ALIVE_TIMEOUT})",
    )


def transport_options(parser: argparse.ArgumentParser) -> None:
    """HTTPS (the server's certificate, and its clients' when asked) and the browser
    origins allowed to call: what ``pcr serve`` and ``pcr gateway`` share
    (``tls_settings`` checks the files; ``pcr.serve.cors`` applies the origins)."""
    parser.add_argument(
        "--ssl-certfile",
        metavar="FILE",
        help="serve HTTPS with this PEM certificate (chain), its private key in "
        "--ssl-keyfile or in the same file (default: plain HTTP)",
    )
    parser.add_argument(
        "--ssl-keyfile", metavar="FILE", help="the unencrypted PEM private key of --ssl-certfile"
    )
    parser.add_argument(
        "--ssl-ca-certs",
        metavar="FILE",
        help="PEM CA certificates that clients' certificates must be signed by",
    )
    parser.add_argument(
        "--ssl-cert-reqs",
        choices=tuple(CERT_REQS),
        default=None,
        help="whether a client must present a certificate signed by --ssl-ca-certs "
        "(required), may (optional: verified when presented) or is not asked (none); "
        "default: required with --ssl-ca-certs, else none",
    )
    parser.add_argument(
        "--allowed-origins",
        type=_origin,
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a browser origin (https://app.example.com; * for any) whose pages may call "
        "the service: CORS answers for it alone (repeatable; default none, no CORS)",
    )


def _origin(text: str) -> str:
    """An argparse type: a browser origin as browsers send it (``SCHEME://HOST[:PORT]``,
    lower case, no path), or ``*``."""
    if text == "*":
        return text
    wrong = argparse.ArgumentTypeError(
        f"an origin is http(s)://HOST[:PORT] with no path, e.g. https://app.example.com, "
        f"not {text[:80]!r}"
    )
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 (a bad port raises)
    except ValueError:
        raise wrong from None
    if (
        parts.scheme.lower() not in ("http", "https")
        or not parts.hostname
        or "@" in parts.netloc
        or parts.path
        or parts.query
        or parts.fragment
        or text.endswith(("?", "#"))
        or not text.isprintable()
        or any(c.isspace() for c in text)
    ):
        raise wrong
    return text.lower()


def tls_settings(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn's TLS options of ``args`` (``transport_options``), every file loaded to
    check it: a missing or bad one is a one-line usage error before the port is bound."""
    try:
        return server_tls(
            args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs, args.ssl_cert_reqs
        )
    except TlsError as exc:
        raise UsageError(f"argument --ssl-{exc.field.replace('_', '-')}: {exc}") from None


def access_options(parser: argparse.ArgumentParser) -> None:
    """API keys, tenants and rate limits (``pcr.web.auth``): what ``pcr serve`` and
    ``pcr gateway`` share (``access_policy`` reads and checks them)."""
    parser.add_argument(
        "--api-key",
        type=_api_key,
        action="append",
        default=[],
        metavar="KEY",
        help="an operator's key (repeatable): with any key set, every path but /health and "
        "/live needs Authorization: Bearer KEY. A command line shows in ps: prefer "
        '--api-keys with "operator": true',
    )
    parser.add_argument(
        "--api-keys",
        type=Path,
        metavar="FILE",
        help='a JSON file {"keys": {"KEY": {"tenant": NAME, "namespaces": [...], "models": '
        '[...], "rate": RPS, "burst": N}}} (a key may be given as "sha256:HEX"; '
        '"operator": true for an operator\'s key): a tenant sees and is routed to its '
        "namespaces alone",
    )
    parser.add_argument(
        "--rate-limit",
        type=_rate,
        default=None,
        metavar="RPS",
        help="requests per second a key may make, for keys without a rate of their own "
        "(default: no limit); past it, 429 with Retry-After",
    )
    parser.add_argument(
        "--rate-burst",
        type=int_in(1, int(MAX_RATE), "burst"),
        default=None,
        metavar="N",
        help="requests a key may make at once before --rate-limit paces it (default: the "
        "rate rounded up)",
    )
    parser.add_argument(
        "--docs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="serve /docs, /redoc and /openapi.json, open to anyone (default: only when no "
        "key is set)",
    )


_rate = number_in(
    0,
    MAX_RATE,
    above=True,
    invalid=lambda text: f"--rate-limit must be a number, not {text[:40]!r}",
    out_of_range=lambda _text: f"--rate-limit must be above 0 and at most {MAX_RATE:g}",
)


def _api_key(text: str) -> str:
    """An argparse type: an API key (``pcr.web.auth.check_key``)."""
    try:
        return check_key(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def access_policy(command: str, args: argparse.Namespace) -> AccessPolicy | None:
    """The ``AccessPolicy`` of ``args`` (``access_options``), None when none was asked
    for; a bad key file or combination is a one-line usage error, a key file others
    may read a warning."""
    grants: list[Any] = []
    if args.api_keys is not None:
        grants = _key_file(command, args.api_keys)
    if not (args.api_key or grants or args.docs is not None):
        if args.rate_limit is not None or args.rate_burst is not None:
            raise UsageError("argument --rate-limit: --rate-limit needs --api-key or --api-keys")
        return None
    try:
        return AccessPolicy.build(
            args.api_key, grants, docs=args.docs, rate=args.rate_limit, burst=args.rate_burst
        )
    except ValueError as exc:
        raise UsageError(f"argument --api-key: {exc}") from None


MAX_KEY_FILE_BYTES = 4 << 20


def _key_file(command: str, path: Path) -> list[Any]:
    """The (digest, grant) pairs of an ``--api-keys`` file."""
    shown = one_line(str(path))[:200]
    try:
        with path.open("rb") as handle:
            mode = os.fstat(handle.fileno()).st_mode
            raw = handle.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        raise UsageError(f"argument --api-keys: cannot read {shown!r}: {exc.strerror}") from None
    if len(raw) > MAX_KEY_FILE_BYTES:
        raise UsageError(f"argument --api-keys: {shown!r} is over {MAX_KEY_FILE_BYTES:,} bytes")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        raise UsageError(f"argument --api-keys: {shown!r} is not JSON") from None
    try:
        grants = key_file_grants(data)
    except ValueError as exc:
        raise UsageError(f"argument --api-keys: {exc}") from None
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        warn_user(
            command,
            f"--api-keys {shown!r} is readable by other users (mode {stat.S_IMODE(mode):o}): "
            "chmod 600 it",
        )
    return grants


def bind(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A socket bound to ``host:port`` (not yet listening); ``reuse_port``: with
    ``SO_REUSEPORT``, so that several processes listen on one port, the kernel spreading
    the connections between them."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as exc:
        raise UsageError(f"argument --host: cannot use {host!r:.80}: {exc}") from None
    family, kind, proto, _name, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise CommandError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def check_url(command: str, url: str) -> None:
    """Refuse (usage error) a ``--redis-url`` that ``pcr serve`` and ``pcr gateway``
    cannot use: Sentinel's, or another scheme."""
    if url_scheme(url) not in SERVE_SCHEMES:
        raise UsageError(
            f"argument --redis-url: pcr {command} takes redis://, rediss://, unix://, "
            "redis+cluster:// or rediss+cluster:// URLs"
        )


def require(command: str, needed: dict[str, str], extra: str) -> None:
    """Fail in one line unless every module of ``needed`` (module: package) imports."""
    missing = []
    for module, package in needed.items():
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(package)
    if missing:
        raise CommandError(
            f"pcr {command} needs {' and '.join(missing)}: "
            f"pip install 'prefix-cache-registry[{extra}]'"
        )
