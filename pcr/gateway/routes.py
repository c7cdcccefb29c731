"""The gateway's routes on the app: the proxied ones (``pcr.gateway.proxy``), and
``GET /v1/models`` and ``/health`` answered by FastAPI."""

from __future__ import annotations

import time
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.routing import Route

from pcr.gateway.backends import kept_backends
from pcr.gateway.proxy import PROXIED, Proxy
from pcr.gateway.replies import openai_error, reply_headers
from pcr.gateway.state import SCRAPE_TIMEOUT, GatewayState


def gateway_state(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    return state


async def models(request: Request) -> Response:
    """The first reachable backend's ``/v1/models`` (they serve the same model)."""
    state = gateway_state(request)
    assert state.http is not None
    for backend in state.candidates():
        try:
            async with state.http.get(f"{backend.url}/v1/models", timeout=SCRAPE_TIMEOUT) as reply:
                content = await reply.read()
                return Response(content, status_code=reply.status, headers=reply_headers(reply))
        except (aiohttp.ClientError, TimeoutError):
            backend.mark(state.metrics, up=False)
    return openai_error(503, "no backend answered")


async def health(request: Request) -> JSONResponse:
    """200 while some backend is up; says whether the registry answers (when it does
    not, requests are routed by load alone). Answered from state on the event loop,
    which no request's parsing or tokenizing holds (``pcr.gateway.tokens``)."""
    state = gateway_state(request)
    now = time.monotonic()
    backends = {
        b.namespace: "up" if b.refused_until <= now else "refusing" for b in state.backends.values()
    }
    status = 200 if any(v == "up" for v in backends.values()) else 503
    up = state.registry_reachable()
    body: dict[str, Any] = {
        "status": "ok" if status == 200 else "unavailable",
        "registry": "reachable" if up else "away",
        "routing": state.config.policy if up else "load",
        "backends": backends,
        "kept": kept_backends(state.backends.values()),
        "in_flight": {
            b.namespace: {"here": b.load.in_flight, "other_replicas": b.load.remote_in_flight}
            for b in state.backends.values()
        },
    }
    if state.tokenizer is not None:  # prompts in each lane, tokenizing or queued
        body["tokenizing"] = {
            "short": state.tokenizer.short.held,
            "long": state.tokenizer.long.held,
        }
    return JSONResponse(body, status_code=status)


def add_gateway_routes(app: FastAPI, limit: int, too_large: bytes) -> Proxy:
    """The gateway's routes: the proxied ones as a plain ASGI endpoint (the body passes
    through as bytes: no FastAPI parsing or validation on the way), returned for the app
    to call before its own layers (``pcr.serve.app.ScoringApp.proxied``); ``too_large``
    is the 413 answer to a body over ``limit`` bytes."""
    endpoint = Proxy(app.state.gateway, limit, too_large)
    for path in PROXIED:
        app.router.routes.append(Route(path, endpoint, methods=["POST"]))
    app.add_route("/v1/models", models, methods=["GET"])
    app.add_route("/health", health, methods=["GET"])
    return endpoint
