"""The HTTP scoring service behind ``pcr serve`` (FastAPI; needs the ``serve`` extra).

``create_app`` builds the application: ``POST /v1/score`` (an ``AsyncPrefixRouter`` on
``redis.asyncio``, scoring from a fleet view the app follows with ``view``, which ``pcr
serve`` turns on by default), ``GET /v1/nodes``, ``GET /metrics``, ``GET /health``, ``GET /live``,
and FastAPI's own ``/docs`` and ``/openapi.json``. Every error is a JSON object
``{"error": KIND, "detail": ...}`` whose detail never repeats the request: 400 for a
malformed request, 404 and 405 for a wrong path or method, 413 for a body over
``MAX_BODY_BYTES``, 422 for a body that is not JSON or breaks the schema or the limits
(``MAX_HASHES``, ``MAX_TOKENS``, ...), 503 when Redis is unavailable, 500 for other
registry faults. At most ``max_connections`` requests use Redis at once (each holds at
most one connection per Redis node, so the pools never run out); the others wait up to
``pool_timeout`` seconds for their turn. ``/openapi.json`` states every rule the server
checks: exact integer bounds, the one-of rule of the prompt, the namespace rule.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import FastAPI

from pcr.serve.errors import HANDLERS, BodyLimit, Faults
from pcr.serve.routes import ExactRoute, add_routes
from pcr.serve.schema import MAX_BODY_BYTES, ScoreRequest
from pcr.serve.state import State
from pcr.web.auth import Access, AccessPolicy
from pcr.web.server import DEFAULT_MAX_CONNECTIONS, DEFAULT_POOL_TIMEOUT, Direct
from registry.core.keys import DEFAULT_KEY_PREFIX
from registry.core.validation import is_number


class ScoringApp(FastAPI):
    """FastAPI, with the request schema published as pydantic writes it: FastAPI's
    OpenAPI models read every bound as a float (2^63-1 would read 9.223372036854776e18);
    and, for the gateway, its proxied requests taken before FastAPI's own layers."""

    proxied: Any = None
    """The gateway's ``POST`` routes in plain ASGI (``pcr.gateway.proxy.Proxy`` inside
    ``Faults``), or None: they skip routing and every middleware but ``Faults`` (the
    proxy applies the body limit itself); every other request goes through the app,
    whose router has the same endpoint and answers 405 for other methods on its paths."""

    front: Any = None
    """The access layer over all of the app, the proxied routes included
    (``pcr.web.auth.Access`` around ``inner``; ``keyed``), or None."""

    async def __call__(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[MutableMapping[str, Any]]],
        send: Callable[[MutableMapping[str, Any]], Awaitable[None]],
    ) -> None:
        front = self.front
        if front is not None:
            await front(scope, receive, send)
            return
        await self.inner(scope, receive, send)

    async def inner(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[MutableMapping[str, Any]]],
        send: Callable[[MutableMapping[str, Any]], Awaitable[None]],
    ) -> None:
        """The app behind its access layer: the proxied routes first, then FastAPI."""
        proxied = self.proxied
        if (
            proxied is not None
            and scope["type"] == "http"
            and scope["method"] == "POST"
            and scope["path"] in proxied.app.paths
        ):
            await proxied(scope, receive, send)
            return
        await super().__call__(scope, receive, send)

    @property
    def direct(self) -> Direct | None:
        """The proxied routes for the server to take straight from its protocol
        (``pcr.web.server.Direct``): to the access layer, or where there is none to
        ``proxied`` without its ``Faults`` (the server's cycle for a direct request
        answers a fault as ``Faults`` does, in the shape of the server's
        ``openai_errors``); None without proxied routes."""
        proxied = self.proxied
        if proxied is None:
            return None
        paths = frozenset(path.encode("ascii") for path in proxied.app.paths)
        if self.front is not None:
            return Direct(paths, self.front)
        return Direct(paths, proxied.app if isinstance(proxied, Faults) else proxied)

    def openapi(self) -> dict[str, Any]:
        spec = super().openapi()
        exact = ScoreRequest.model_json_schema(ref_template="#/components/schemas/{model}")
        spec["components"]["schemas"]["ScoreRequest"] = exact
        return spec


def create_app(
    url: str,
    *,
    key_prefix: str = DEFAULT_KEY_PREFIX,
    hybrid: bool | None = None,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    pool_timeout: float = DEFAULT_POOL_TIMEOUT,
    view: bool = False,
    access: AccessPolicy | None = None,
) -> FastAPI:
    """The scoring service for the registry at ``url``: at most ``max_connections``
    requests use Redis at once, the others wait up to ``pool_timeout`` seconds. With
    ``view`` (``pcr serve``'s default), ``/v1/score`` scores from a fleet view the app
    follows while it follows Redis, and exactly from Redis otherwise. ``access``: its
    keys, tenants and rate limits (``pcr.web.auth``; None: open, as without keys).
    (``pcr gateway`` builds on the same pieces: ``pcr.gateway.service.create_gateway_app``.)"""
    state = scoring_state(
        url,
        key_prefix=key_prefix,
        hybrid=hybrid,
        max_connections=max_connections,
        pool_timeout=pool_timeout,
        view=view,
    )
    app = assemble(
        state,
        title="prefix-cache-registry scoring",
        description="Which live serving node holds the longest cached prefix of a prompt.",
        lifespan=state.lifespan,
        openai=False,
    )
    return keyed(finish(app, openai=False), access, openai=False)


def scoring_state(
    url: str,
    *,
    key_prefix: str = DEFAULT_KEY_PREFIX,
    hybrid: bool | None = None,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    pool_timeout: float = DEFAULT_POOL_TIMEOUT,
    view: bool = False,
) -> State:
    """The scoring service's state (its Redis clients, opened by its lifespan), the
    arguments checked first."""
    if not isinstance(view, bool):
        raise TypeError("view must be True or False")
    if not is_number(max_connections, integer=True):
        raise TypeError("max_connections must be an int")
    if max_connections < 1:
        raise ValueError("max_connections must be at least 1")
    if not is_number(pool_timeout) or not 0 < pool_timeout < math.inf:
        raise ValueError("pool_timeout must be a positive finite number of seconds")
    return State(url, key_prefix, hybrid, max_connections, float(pool_timeout), view)


def assemble(
    state: State, *, title: str, description: str, lifespan: Any, openai: bool
) -> ScoringApp:
    """The scoring app over ``state``: its routes, error handlers and body limit. With
    ``openai`` (the gateway) its errors take the OpenAI shape and ``/health`` is left to
    the caller; ``finish`` adds the outermost layer once the caller's routes are in."""
    app = ScoringApp(
        title=title, description=description, lifespan=lifespan, exception_handlers=HANDLERS
    )
    app.state.registry = state
    app.state.gateway = None
    app.router.route_class = ExactRoute
    add_routes(app, health_check=not openai)
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES, openai=openai)
    return app


def finish(app: FastAPI, *, openai: bool) -> FastAPI:
    """The outermost layer of all ours: no fault of the app leaves as a traceback."""
    app.add_middleware(Faults, openai=openai)
    return app


def keyed(app: FastAPI, access: AccessPolicy | None, *, openai: bool) -> FastAPI:
    """``app`` behind ``access`` (``pcr.web.auth.Access``), its docs pages gone unless
    the policy serves them; ``app`` as it is for None."""
    if access is None:
        return app
    if not access.docs:
        gone = {app.openapi_url, app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url}
        app.router.routes = [r for r in app.router.routes if getattr(r, "path", None) not in gone]
        app.openapi_url = app.docs_url = app.redoc_url = None
    assert isinstance(app, ScoringApp)
    app.front = Access(app.inner, access, openai=openai)
    return app


def guarded(app: Any, *, openai: bool) -> Any:
    """``app`` (an ASGI callable) behind the layer that turns its faults into the one
    error shape."""
    return Faults(app, openai=openai)
