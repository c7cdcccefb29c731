"""The scoring service's endpoints: ``POST /v1/score``, ``GET /v1/nodes``, ``GET /health``,
``GET /live`` and ``GET /metrics`` (``add_routes``), on routes that read a JSON body as
JSON Schema does (``ExactRoute``)."""

from __future__ import annotations

import asyncio
import decimal
import importlib
import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.routing import APIRoute

from pcr.serve.errors import error_response, openai_shaped
from pcr.serve.schema import (
    READ_ERRORS,
    SCORE_ERRORS,
    ErrorReply,
    HealthReply,
    LiveReply,
    NodeOut,
    NodeScoreOut,
    NodesReply,
    ScoreReply,
    ScoreRequest,
    documented,
)
from pcr.serve.state import State
from pcr.web.auth import visible
from pcr.web.errors import ERROR_KINDS
from registry.core.errors import REDIS_ERRORS, RegistryError, translate
from registry.core.hashing import block_hashes
from registry.core.validation import prefix_hashes
from registry.fleet.membership import NodeIndex
from registry.namespace.admin import namespace_infos

WHOLE_DIGITS = 30
"""A whole number written with a fraction or an exponent becomes an int up to 10^30 (every
bound of the schema is below 2^63); larger ones stay floats, refused where an integer belongs."""
HASH_IN_LOOP = 16_384
"""Token lists longer than this are hashed in a worker thread, not on the event loop."""


def exact_json(body: bytes) -> Any:
    """A request body read as JSON Schema reads JSON: a number whose value is whole
    (``2.0``, ``1e3``, ``9007199254740993.0``) is that integer, exactly (not through a
    float, which would round it past 2^53); other numbers are floats. ``NaN`` and
    ``Infinity``, which are not JSON, are refused."""

    def number(text: str) -> int | float:
        value = decimal.Decimal(text)
        if value.adjusted() <= WHOLE_DIGITS and value == value.to_integral_value():
            return int(value)
        return float(text)  # a fraction, or too large for any bound here

    def constant(text: str) -> Any:
        raise ValueError(f"{text} is not JSON")

    return json.loads(body, parse_float=number, parse_constant=constant)


class ExactRequest(Request):
    """A request whose ``json()`` is ``exact_json``."""

    async def json(self) -> Any:
        if not hasattr(self, "_exact"):
            self._exact = exact_json(await self.body())
        return self._exact


class ExactRoute(APIRoute):
    """A route that reads its JSON body with ``exact_json``: the schema's ``integer``
    admits ``2.0``, so the server must too (FastAPI's ``json.loads`` gives a float)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def read_exactly(request: Request) -> Response:
            return await handler(ExactRequest(request.scope, request.receive))

        return read_exactly


def _state(request: Request) -> State:
    """The application's ``State``."""
    state: State = request.app.state.registry
    return state


async def _prompt(body: ScoreRequest) -> list[int]:
    """The request's block hashes (its tokens hashed, off the loop when there are many)."""
    if body.token_ids is None:
        return body.block_hashes or []
    assert body.block_size is not None
    tokens, size, salt = body.token_ids, body.block_size, body.salt
    if len(tokens) > HASH_IN_LOOP:  # keep the loop serving meanwhile
        return await asyncio.to_thread(lambda: block_hashes(tokens, size, salt=salt))
    return block_hashes(tokens, size, salt=salt)


async def score(body: ScoreRequest, request: Request) -> ScoreReply | JSONResponse:
    """Score the live nodes (or ``namespaces``) for a prompt and pick the best."""
    router, gate = _state(request).ready()
    try:
        wanted = prefix_hashes(await _prompt(body))
        async with gate.turn("score"):
            asked = visible(request.scope, body.namespaces)  # a tenant: its own alone
            scores, best = await router.decide(wanted, body.load, asked)
    except (TypeError, ValueError):  # the schema checks these first: not reached
        return error_response(
            422,
            ERROR_KINDS[422],
            "the prompt breaks the registry's rules",
            openai=openai_shaped(request),
        )
    return ScoreReply(
        blocks=len(wanted),
        best=best,
        nodes={
            n: NodeScoreOut(kv_prefix=s.kv_prefix, mamba_prefix=s.mamba_prefix, usable=s.usable)
            for n, s in sorted(scores.items())
        },
    )


def nodes(request: Request) -> NodesReply:
    """Live namespaces: lease left and entries (one round trip per Redis node)."""
    state = _state(request)
    client = state.sync()
    live = visible(request.scope, NodeIndex(client, state.key_prefix).live()) or []
    infos = namespace_infos(client, live, key_prefix=state.key_prefix, memory=False)
    out = []
    for info, _memory in infos:
        left = None
        if info.lease_until_ms is not None:
            left = max(0.0, (info.lease_until_ms - info.server_ms) / 1000)
        out.append(
            NodeOut(
                namespace=info.namespace,
                lease_left_s=left,
                kv_entries=info.kv_entries,
                mamba_entries=info.mamba_entries,
                bridge_engine=info.bridge_engine,
            )
        )
    return NodesReply(nodes=out)


async def health(request: Request) -> HealthReply | JSONResponse:
    """200 when Redis answers and holds the router's scripts (loaded when missing); the
    check waits its turn for a connection like every call."""
    state = _state(request)
    router, gate = state.ready()
    try:
        async with gate.turn():
            await state.client.ping()
            if not await router.scripts_loaded():
                await router.load()
    except RegistryError as exc:
        return error_response(503, "unhealthy", str(exc).split("\n")[0])
    except REDIS_ERRORS as exc:
        error = translate(exc, "health check: PING")
        return error_response(503, "unhealthy", str(error or exc).split("\n")[0])
    return HealthReply(status="ok", redis="reachable", scripts="loaded")


async def live() -> LiveReply:
    """200 while the process runs."""
    return LiveReply(status="alive")


def metrics(request: Request) -> Response:
    """Prometheus metrics (needs prometheus-client)."""
    try:
        prometheus = importlib.import_module("prometheus_client")
    except ImportError:
        return error_response(
            404, "not available", "metrics need prometheus-client", openai=openai_shaped(request)
        )
    return Response(prometheus.generate_latest(), media_type=prometheus.CONTENT_TYPE_LATEST)


def add_routes(app: FastAPI, *, health_check: bool = True) -> None:
    """The endpoints, on the application's own router (an included ``APIRouter`` would
    be matched again on every request)."""
    app.add_api_route(
        "/v1/score", score, methods=["POST"], response_model=ScoreReply, responses=SCORE_ERRORS
    )
    app.add_api_route("/v1/nodes", nodes, response_model=NodesReply, responses=READ_ERRORS)
    if health_check:  # the gateway has its own
        app.add_api_route("/health", health, response_model=HealthReply, responses=documented(503))
    app.add_api_route("/live", live, response_model=LiveReply)
    app.add_api_route(
        "/metrics",
        metrics,
        response_class=PlainTextResponse,
        responses={404: {"model": ErrorReply, "description": "prometheus-client is not installed"}},
    )
