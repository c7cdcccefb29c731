"""The HTTP scoring service behind ``pcr serve`` (FastAPI; needs the ``serve`` extra).

``create_app`` builds the application: ``POST /v1/score`` (an ``AsyncPrefixRouter`` on
``redis.asyncio``), ``GET /v1/nodes``, ``GET /metrics``, ``GET /health``, ``GET /live``,
and FastAPI's own ``/docs`` and ``/openapi.json``. Every error is a JSON object
``{"error": KIND, "detail": ...}``, never a traceback: 422 for a body that breaks the
schema or the limits (``MAX_HASHES``, ``MAX_TOKENS``, ...), 413 for a body over
``MAX_BODY_BYTES``, 503 when Redis is unavailable, 500 for other registry faults.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import math
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from registry.aio_routing import AsyncPrefixRouter, async_client_from_url, bounded_async_options
from registry.client import CLUSTER_SCHEMES, client_from_url
from registry.errors import REDIS_ERRORS, RegistryError, RegistryUnavailable, translate
from registry.hashing import block_hashes
from registry.keys import DEFAULT_KEY_PREFIX, validate_namespace
from registry.membership import NodeIndex
from registry.redis_registry import bounded_options, namespace_infos
from registry.types import MAX_HASH, NO_HASH
from registry.validation import prefix_hashes

log = logging.getLogger(__name__)

MAX_HASHES = 65_536
"""Most block hashes one ``/v1/score`` request may carry."""
MAX_TOKENS = 1_048_576
"""Most token ids one ``/v1/score`` request may carry."""
MAX_BLOCK_SIZE = 1 << 20
MAX_NAMESPACES = 4_096
"""Most entries in ``namespaces`` and in ``load``."""
MAX_SALT = 1_024
MAX_BODY_BYTES = 32 << 20
"""Larger request bodies are refused with 413 before they are parsed."""
MAX_ERRORS_SHOWN = 10
HASH_IN_LOOP = 16_384
"""Token lists longer than this are hashed in a worker thread, not on the event loop."""
INT64 = 2**63

Hash = Annotated[int, Field(ge=NO_HASH, le=MAX_HASH)]
Token = Annotated[int, Field(ge=-INT64, le=INT64 - 1)]


class ScoreRequest(BaseModel):
    """A prompt as block hashes, or as token ids to hash; optionally the namespaces to
    score (default: every live node) and each node's load (ties go to the lowest)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    block_hashes: Annotated[list[Hash], Field(max_length=MAX_HASHES)] | None = Field(
        default=None,
        description=f"the prompt's block hashes, in [-1, 2^63-1] (at most {MAX_HASHES:,}); "
        "a sentinel (-1, 0) ends the prefix",
    )
    token_ids: Annotated[list[Token], Field(max_length=MAX_TOKENS)] | None = Field(
        default=None,
        description=f"token ids to hash instead (int64; at most {MAX_TOKENS:,}); needs block_size",
    )
    block_size: Annotated[int, Field(ge=1, le=MAX_BLOCK_SIZE)] | None = Field(
        default=None, description="tokens per block, with token_ids"
    )
    salt: Annotated[str, Field(max_length=MAX_SALT)] | None = Field(
        default=None, description="the engines' cache salt, with token_ids"
    )
    namespaces: Annotated[list[str], Field(max_length=MAX_NAMESPACES)] | None = Field(
        default=None, description="score only these namespaces (default: every live node)"
    )
    load: Annotated[dict[str, float], Field(max_length=MAX_NAMESPACES)] | None = Field(
        default=None, description="namespace -> load; among equal prefixes the lowest wins"
    )

    @field_validator("namespaces")
    @classmethod
    def _namespaces(cls, value: list[str] | None) -> list[str] | None:
        for name in value or ():
            validate_namespace(name)
        return value

    @field_validator("load")
    @classmethod
    def _load(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for name, figure in (value or {}).items():
            validate_namespace(name)
            if not math.isfinite(figure):
                raise ValueError(f"load of {name!r} is not a finite number")
        return value

    @model_validator(mode="after")
    def _one_prompt(self) -> ScoreRequest:
        if (self.block_hashes is None) == (self.token_ids is None):
            raise ValueError("give either block_hashes or token_ids (with block_size)")
        if self.token_ids is not None and self.block_size is None:
            raise ValueError("token_ids need block_size")
        if self.block_hashes is not None and (self.block_size or self.salt) is not None:
            raise ValueError("block_size and salt go with token_ids, not block_hashes")
        return self


class NodeScoreOut(BaseModel):
    kv_prefix: int = Field(description="leading blocks with KV cached")
    mamba_prefix: int = Field(description="leading blocks usable with Mamba state")
    usable: int = Field(description="what routing ranks by")


class ScoreReply(BaseModel):
    blocks: int = Field(description="the prompt's blocks scored (up to the first sentinel)")
    best: str | None = Field(description="the node to send the prompt to; null if none is live")
    nodes: dict[str, NodeScoreOut] = Field(description="per live namespace")


class NodeOut(BaseModel):
    namespace: str
    lease_left_s: float | None = Field(description="seconds until the lease runs out")
    kv_entries: int
    mamba_entries: int
    bridge_engine: str | None = Field(description="the engine feeding it, for pcr bridge")


class NodesReply(BaseModel):
    nodes: list[NodeOut]


class ErrorReply(BaseModel):
    error: str
    detail: Any = None


ERRORS: dict[int | str, dict[str, Any]] = {
    413: {"model": ErrorReply, "description": "request body too large"},
    422: {"model": ErrorReply, "description": "the body breaks the schema or the limits"},
    500: {"model": ErrorReply, "description": "a registry fault an operator must fix"},
    503: {"model": ErrorReply, "description": "Redis is unavailable (retry)"},
}


def _error(status: int, kind: str, detail: Any) -> JSONResponse:
    return JSONResponse({"error": kind, "detail": detail}, status_code=status)


def _registry_error(exc: RegistryError) -> JSONResponse:
    message = str(exc).split("\n")[0]
    if isinstance(exc, RegistryUnavailable):
        return _error(503, "unavailable", message)
    return _error(500, "registry fault", message)


class State:
    """What the application holds: the clients and the router, made in its loop."""

    def __init__(self, url: str, key_prefix: str, hybrid: bool) -> None:
        self.url = url
        self.key_prefix = key_prefix
        self.hybrid = hybrid
        self.cluster = url.partition("://")[0].lower() in CLUSTER_SCHEMES
        self.client: Any = None
        self.router: AsyncPrefixRouter | None = None
        self.sync_client: Any = None
        self._sync_lock = threading.Lock()

    async def open(self) -> None:
        self.client = async_client_from_url(self.url, **bounded_async_options(self.cluster))
        self.router = AsyncPrefixRouter(self.client, self.key_prefix, hybrid=self.hybrid)
        try:
            await self.router.load()
        except RegistryError as exc:  # not there yet: /health says so, calls reload
            log.warning("Redis not ready at start: %s", exc)

    def sync(self) -> Any:
        """A sync client for the reads written once for tools (``namespace_infos``)."""
        with self._sync_lock:  # called from the thread pool
            if self.sync_client is None:
                try:  # a cluster client connects here already
                    self.sync_client = client_from_url(self.url, **bounded_options({}))
                except REDIS_ERRORS as exc:
                    raise (translate(exc, "connecting to Redis") or exc) from exc
            return self.sync_client

    async def close(self) -> None:
        if self.client is not None:
            with contextlib.suppress(Exception):
                await self.client.aclose()
        if self.sync_client is not None:
            with contextlib.suppress(Exception):
                self.sync_client.close()


class _BodyLimit:
    """Refuses request bodies over ``limit`` bytes with 413 (by Content-Length, and by
    counting a body sent without one)."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[MutableMapping[str, Any]]],
        send: Callable[[MutableMapping[str, Any]], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            await self._refuse(send)
            return
        received = 0
        started = refused = False

        async def counted() -> MutableMapping[str, Any]:
            nonlocal received, refused
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    if not started and not refused:
                        refused = True
                        await self._refuse(send)
                    return {"type": "http.disconnect"}  # the app stops reading
            return message

        async def watched(message: MutableMapping[str, Any]) -> None:
            nonlocal started
            if refused:
                return  # the 413 went out instead
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, counted, watched)

    async def _refuse(self, send: Callable[[MutableMapping[str, Any]], Awaitable[None]]) -> None:
        response = _error(413, "request too large", f"bodies are limited to {self.limit:,} bytes")
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": response.body})


def create_app(url: str, *, key_prefix: str = DEFAULT_KEY_PREFIX, hybrid: bool = True) -> FastAPI:
    """The scoring service for the registry at ``url``."""
    state = State(url, key_prefix, hybrid)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await state.open()
        try:
            yield
        finally:
            await state.close()

    app = FastAPI(
        title="prefix-cache-registry scoring",
        description="Which live serving node holds the longest cached prefix of a prompt.",
        lifespan=lifespan,
    )
    app.state.registry = state

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        shown = [
            {
                "loc": list(e.get("loc", ()))[:4],
                "msg": str(e.get("msg", ""))[:300],
                "type": e.get("type"),
            }
            for e in errors[:MAX_ERRORS_SHOWN]
        ]
        if len(errors) > MAX_ERRORS_SHOWN:
            shown.append({"msg": f"and {len(errors) - MAX_ERRORS_SHOWN} more errors"})
        return _error(422, "invalid request", shown)

    @app.exception_handler(RegistryError)
    async def registry_fault(_request: Request, exc: RegistryError) -> JSONResponse:
        return _registry_error(exc)

    @app.exception_handler(Exception)
    async def internal(_request: Request, exc: Exception) -> JSONResponse:
        return _error(500, "internal error", type(exc).__name__)

    @app.post("/v1/score", response_model=ScoreReply, responses=ERRORS)
    async def score(body: ScoreRequest) -> ScoreReply | JSONResponse:
        """Score the live nodes (or ``namespaces``) for a prompt and pick the best."""
        assert state.router is not None
        try:
            if body.token_ids is not None:
                assert body.block_size is not None
                tokens, size, salt = body.token_ids, body.block_size, body.salt
                if len(tokens) > HASH_IN_LOOP:  # keep the loop serving meanwhile
                    hashes = await asyncio.to_thread(lambda: block_hashes(tokens, size, salt=salt))
                else:
                    hashes = block_hashes(tokens, size, salt=salt)
            else:
                hashes = body.block_hashes or []
            wanted = prefix_hashes(hashes)
            scores, best = await state.router.decide(wanted, body.load, body.namespaces)
        except (TypeError, ValueError) as exc:
            return _error(422, "invalid request", str(exc).split("\n")[0])
        return ScoreReply(
            blocks=len(wanted),
            best=best,
            nodes={
                n: NodeScoreOut(kv_prefix=s.kv_prefix, mamba_prefix=s.mamba_prefix, usable=s.usable)
                for n, s in sorted(scores.items())
            },
        )

    @app.get("/v1/nodes", response_model=NodesReply, responses=ERRORS)
    def nodes() -> NodesReply:
        """Live namespaces: lease left and entries (one round trip per Redis node)."""
        client = state.sync()
        live = NodeIndex(client, key_prefix).live()
        infos = namespace_infos(client, live, key_prefix=key_prefix, memory=False)
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

    @app.get("/health", responses={503: {"model": ErrorReply}})
    async def health() -> JSONResponse:
        """200 when Redis answers and holds the router's scripts (loaded when missing)."""
        assert state.router is not None
        try:
            await state.client.ping()
            if not await state.router.scripts_loaded():
                await state.router.load()
        except RegistryError as exc:
            return _error(503, "unhealthy", str(exc).split("\n")[0])
        except REDIS_ERRORS as exc:
            error = translate(exc, "health check: PING")
            return _error(503, "unhealthy", str(error or exc).split("\n")[0])
        return JSONResponse({"status": "ok", "redis": "reachable", "scripts": "loaded"})

    @app.get("/live")
    async def live() -> dict[str, str]:
        """200 while the process runs."""
        return {"status": "alive"}

    @app.get("/metrics", responses={404: {"model": ErrorReply}})
    def metrics() -> Response:
        """Prometheus metrics (needs prometheus-client)."""
        try:
            prometheus = importlib.import_module("prometheus_client")
        except ImportError:
            return _error(404, "not available", "metrics need prometheus-client")
        return Response(prometheus.generate_latest(), media_type=prometheus.CONTENT_TYPE_LATEST)

    app.add_middleware(_BodyLimit, limit=MAX_BODY_BYTES)
    return app
