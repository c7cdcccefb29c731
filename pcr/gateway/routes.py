"""The gateway's routes on the app: the proxied ones (``pcr.gateway.proxy``), and
``GET /v1/models`` and ``/health`` answered by FastAPI."""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.routing import Route

from pcr.gateway.backends import kept_backends
from pcr.gateway.proxy import PROXIED, Proxy
from pcr.gateway.replies import openai_error
from pcr.gateway.state import GatewayState
from pcr.web.auth import model_allowed, routable


def gateway_state(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    return state


async def models(request: Request) -> Response:
    """Every model the backends serve (``pcr.gateway.models``), each once, read from
    them now; to a tenant's key, its backends' and only the models its key lists."""
    state = gateway_state(request)
    assert state.http is not None
    allowed = routable(request.scope)
    backends = [b for b in state.backends.values() if allowed is None or b.namespace in allowed]
    await state.models.read(state.http, backends)
    listing = state.models.listing(b.namespace for b in backends)
    if not listing:
        return openai_error(503, "no backend answered")
    listing = [m for m in listing if model_allowed(request.scope, m.get("id"))]
    content = json.dumps({"object": "list", "data": listing}, separators=(",", ":")).encode()
    return Response(content, media_type="application/json")


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
        "replica": state.replica,
        "registry": "reachable" if up else "away",
        "routing": state.config.policy if up else "load",
        "backends": backends,
        "kept": kept_backends(state.backends.values()),
        "in_flight": {
            b.namespace: {"here": b.load.in_flight, "other_replicas": b.load.remote_in_flight}
            for b in state.backends.values()
        },
    }
    if state.pending.on:  # blocks counted as arriving; chains the other replicas told of
        pending = state.pending
        body["pending"] = {
            b.namespace: {
                "blocks": pending.blocks(b.namespace),
                "other_replicas_chains": pending.told_chains(b.namespace),
            }
            for b in state.backends.values()
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
