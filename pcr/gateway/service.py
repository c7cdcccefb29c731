"""The gateway service assembled: the scoring app of ``pcr.serve`` (``/v1/score``,
``/v1/nodes``, ``/live``, ``/metrics``) with the gateway's routes and state on top, its
errors in the OpenAI shape, and one lifespan that opens Redis first, then the backends."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI

from pcr.gateway.config import GatewayConfig
from pcr.gateway.routes import add_gateway_routes
from pcr.gateway.state import GatewayState
from pcr.serve.app import assemble, finish, guarded, keyed, scoring_state
from pcr.serve.errors import too_large_body
from pcr.serve.schema import MAX_BODY_BYTES
from pcr.serve.state import State, settle_heap
from pcr.web.auth import AccessPolicy
from pcr.web.server import DEFAULT_MAX_CONNECTIONS, DEFAULT_POOL_TIMEOUT
from registry.core.keys import DEFAULT_KEY_PREFIX


def create_gateway_app(
    config: GatewayConfig,
    url: str,
    *,
    key_prefix: str = DEFAULT_KEY_PREFIX,
    hybrid: bool | None = None,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    pool_timeout: float = DEFAULT_POOL_TIMEOUT,
    access: AccessPolicy | None = None,
) -> FastAPI:
    """``pcr gateway``'s app: the OpenAI-compatible router of ``config`` in front of the
    engines, scoring through the registry at ``url`` (at most ``max_connections``
    requests use Redis at once, the others wait up to ``pool_timeout`` seconds);
    ``access``: its keys, tenants and rate limits (``pcr.web.auth``), None: open."""
    state = scoring_state(
        url,
        key_prefix=key_prefix,
        hybrid=hybrid,
        max_connections=max_connections,
        pool_timeout=pool_timeout,
    )
    routing = GatewayState(config, state)
    app = assemble(
        state,
        title="prefix-cache-registry gateway",
        description="Which live serving node holds the longest cached prefix of a prompt; "
        "and an OpenAI-compatible router sending each request there.",
        lifespan=functools.partial(_both, state, routing),
        openai=True,
    )
    app.state.gateway = routing
    proxy = add_gateway_routes(app, MAX_BODY_BYTES, too_large_body(openai=True))
    app.proxied = guarded(proxy, openai=True)
    return keyed(finish(app, openai=True), access, openai=True)


@contextlib.asynccontextmanager
async def _both(state: State, routing: Any, _app: FastAPI) -> AsyncIterator[None]:
    """The gateway's lifespan: Redis first, then the backends and background tasks."""
    await state.open()
    try:
        await routing.open()
        settle_heap()
        try:
            yield
        finally:
            await routing.close()
    finally:
        await state.close()
