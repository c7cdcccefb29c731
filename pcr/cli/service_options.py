"""Command-line options and checks that ``pcr serve`` and ``pcr gateway`` share: where to
listen, how to rank, their limits and deadlines, the bound socket, the Redis URL schemes
they take and the extras they need."""

from __future__ import annotations

import argparse
import importlib
import socket

from pcr.cli.common import CommandError, UsageError, int_in, port_arg, seconds_in, url_scheme
from pcr.web.server import (
    BODY_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_POOL_TIMEOUT,
    HEADER_TIMEOUT,
    KEEP_ALIVE_TIMEOUT,
)
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


def bind(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as exc:
        raise UsageError(f"argument --host: cannot use {host!r:.80}: {exc}") from None
    family, kind, proto, _name, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
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
