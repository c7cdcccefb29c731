"""``pcr serve``: the HTTP scoring service (``pcr.serve_app``) on uvicorn.

FastAPI and uvicorn (the ``serve`` extra) are imported only when the command runs, so
the rest of ``pcr`` works without them. The port is bound here, before uvicorn starts,
so a port in use is the usual one-line error.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import signal
import socket
from collections.abc import Iterator
from typing import Any

from pcr.common import CommandError, UsageError, _port, _scheme, _where
from registry.client import CLUSTER_SCHEMES, PLAIN_SCHEMES

SERVE_SCHEMES = (*PLAIN_SCHEMES, *CLUSTER_SCHEMES)
NEEDED = {"fastapi": "fastapi", "uvicorn": "uvicorn"}  # module: package


def add_parser(commands: Any, redis_options: Any, url_default: str) -> None:
    """The ``pcr serve`` subcommand."""
    serve = commands.add_parser(
        "serve",
        help="HTTP scoring service: POST /v1/score, GET /v1/nodes, /health, /docs",
        description="Serve prefix-aware routing over HTTP (FastAPI on uvicorn; needs the "
        "serve extra). The OpenAPI page is at /docs.",
    )
    redis_options(serve, url_default)
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)"
    )
    serve.add_argument("--port", type=_port, default=8000, help="TCP port (default 8000)")
    serve.add_argument(
        "--hybrid",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="rank by the Mamba-usable prefix (default); --no-hybrid ranks by the KV prefix",
    )
    serve.set_defaults(handler=command_serve, command_parser=serve)


def _bind(host: str, port: int) -> socket.socket:
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


def _server_class() -> Any:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, but SIGTERM, SIGHUP and Ctrl-C end it cleanly (exit 0), as
        they end ``pcr bridge``: uvicorn itself raises the signal again once stopped."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            previous = {}
            for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                with contextlib.suppress(ValueError, OSError):  # not the main thread
                    previous[number] = signal.signal(number, self.handle_exit)
            try:
                yield
            finally:
                for number, handler in previous.items():
                    signal.signal(number, handler)

    return Server


def _enable_metrics() -> None:
    """The registry's Prometheus metrics on ``/metrics`` (routing decisions, score
    times), when prometheus-client is installed."""
    from registry import metrics

    with contextlib.suppress(ImportError, RuntimeError):  # not installed; already on
        metrics.enable_metrics()


def command_serve(args: argparse.Namespace) -> int:
    if _scheme(args.redis_url) not in SERVE_SCHEMES:
        raise UsageError(
            "argument --redis-url: pcr serve takes redis://, rediss://, unix://, "
            "redis+cluster:// or rediss+cluster:// URLs"
        )
    missing = []
    for module, package in NEEDED.items():
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(package)
    if missing:
        raise CommandError(
            f"pcr serve needs {' and '.join(missing)}: pip install 'prefix-cache-registry[serve]'"
        )
    import uvicorn

    from pcr.serve_app import create_app

    server_class = _server_class()
    _enable_metrics()
    app = create_app(args.redis_url, key_prefix=args.key_prefix, hybrid=args.hybrid)
    sock = _bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    print(
        f"pcr serve: scoring on http://{host}:{port} (docs at /docs) for Redis at "
        f"{_where(args.redis_url)}",
        flush=True,
    )
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
    server = server_class(config)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0
