"""``pcr serve``: the HTTP scoring service (``pcr.serve``) on the project's uvicorn server
(``pcr.web.server``).

FastAPI and uvicorn (the ``serve`` extra) are imported only when the command runs, so
the rest of ``pcr`` works without them. The port is bound here, before uvicorn starts,
so a port in use is the usual one-line error.
"""

from __future__ import annotations

import argparse
from typing import Any

from pcr.cli.common import shown_url
from pcr.cli.service_options import (
    access_options,
    access_policy,
    bind,
    check_url,
    limit_options,
    listen_options,
    require,
    tls_settings,
    transport_options,
)
from pcr.web.server import enable_metrics, listen_url, run_app

NEEDED = {"fastapi": "fastapi", "uvicorn": "uvicorn", "httptools": "httptools"}  # module: package


def add_parser(commands: Any, redis_options: Any, url_default: str) -> None:
    """The ``pcr serve`` subcommand."""
    serve = commands.add_parser(
        "serve",
        help="HTTP scoring service: POST /v1/score, GET /v1/nodes, /health, /docs",
        description="Serve prefix-aware routing over HTTP (FastAPI on uvicorn; needs the "
        "serve extra). The OpenAPI page is at /docs.",
    )
    redis_options(serve, url_default)
    listen_options(serve, 8000)
    serve.add_argument(
        "--view",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="score from a fleet view this process follows (the default: no Redis round "
        "trip per request; it may lag a write by the time its change record takes to "
        "arrive, and asks Redis while it does not follow it); --no-view asks Redis "
        "(exactly, per namespace) on every request",
    )
    limit_options(serve)
    transport_options(serve)
    access_options(serve)
    serve.set_defaults(handler=command_serve, command_parser=serve)


def command_serve(args: argparse.Namespace) -> int:
    """``pcr serve``: check, build the app, bind, then serve until a signal."""
    check_url("serve", args.redis_url)
    require("serve", NEEDED, "serve")
    tls = tls_settings(args)
    access = access_policy("serve", args)
    from pcr.serve.app import create_app
    from pcr.serve.cors import allow_origins

    enable_metrics()
    app = create_app(
        args.redis_url,
        key_prefix=args.key_prefix,
        hybrid=args.hybrid,
        max_connections=args.max_connections,
        pool_timeout=args.pool_timeout,
        view=args.view,
        access=access,
    )
    app = allow_origins(app, args.allowed_origins, openai=False)
    sock = bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    where = listen_url(host, port, "https" if tls else "http")
    docs = "" if access is not None and not access.docs else " (docs at /docs)"
    print(
        f"pcr serve: scoring on {where}{docs} for Redis at {shown_url(args.redis_url)}",
        flush=True,
    )
    return run_app(app, sock, args, "serve", **tls)
