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

import asyncio
import contextlib
import decimal
import functools
import gc
import importlib
import json
import logging
import math
import sys
import threading
import unicodedata
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, MutableMapping, Sequence
from http import HTTPStatus
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from starlette.exceptions import HTTPException

from pcr.web.errors import ERROR_KINDS, error_body, error_content
from pcr.web.server import DEFAULT_MAX_CONNECTIONS, DEFAULT_POOL_TIMEOUT
from registry.core import observe
from registry.core.errors import REDIS_ERRORS, RegistryError, RegistryUnavailable, translate
from registry.core.hashing import block_hashes
from registry.core.keys import DEFAULT_KEY_PREFIX, MAX_NAME_LENGTH, validate_namespace
from registry.core.types import MAX_HASH, NO_HASH
from registry.core.validation import is_number, prefix_hashes
from registry.fleet.membership import NodeIndex
from registry.fleet.view import FleetView
from registry.namespace.admin import namespace_infos
from registry.routing.aio_routing import AsyncPrefixRouter
from registry.transport.client import (
    CLUSTER_SCHEMES,
    async_client_from_url,
    bounded_async_options,
    bounded_options,
    client_from_url,
)

if sys.version_info >= (3, 11):
    from asyncio import timeout as _deadline
else:  # pragma: no cover - redis-py depends on async-timeout there
    from async_timeout import timeout as _deadline

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
WHOLE_DIGITS = 30
"""A whole number written with a fraction or an exponent becomes an int up to 10^30 (every
bound here is below 2^63); larger ones stay floats, refused where an integer belongs."""
HASH_IN_LOOP = 16_384
"""Token lists longer than this are hashed in a worker thread, not on the event loop."""
INT64 = 2**63

Hash = Annotated[int, Field(ge=NO_HASH, le=MAX_HASH)]
Token = Annotated[int, Field(ge=-INT64, le=INT64 - 1)]
Namespace = Annotated[str, Field(min_length=1, max_length=MAX_NAME_LENGTH)]

NAMESPACE_RULE = (
    f"1 to {MAX_NAME_LENGTH} characters, none of them whitespace, a control or other "
    "non-printing character, '{' or '}'"
)


def _refused_by_namespace_rule(char: str) -> bool:
    """What ``registry.core.keys.validate_namespace`` refuses in a namespace."""
    return char in "{}" or char.isspace() or unicodedata.category(char)[0] == "C"


@functools.cache
def namespace_pattern() -> str:
    """``validate_namespace``'s character rule as a JSON Schema (ECMA-262) pattern: only
    characters it accepts, from start to end (computed from this Python's Unicode
    database, as the rule is). A class of what is accepted, not a negated class of what
    is refused: generators such as Hypothesis' expand a class character by character, and
    the refused ones are seven times as many. No range touches a surrogate."""
    ranges: list[list[int]] = []
    for code in range(sys.maxunicode + 1):
        if _refused_by_namespace_rule(chr(code)):
            continue
        if ranges and ranges[-1][1] == code - 1:
            ranges[-1][1] = code
        else:
            ranges.append([code, code])

    def spelled(code: int) -> str:  # BMP as \uXXXX; above it the character itself
        return f"\\u{code:04X}" if code <= 0xFFFF else chr(code)

    accepted = "".join(
        spelled(low) if low == high else f"{spelled(low)}-{spelled(high)}" for low, high in ranges
    )
    return f"^[{accepted}]*$"


def namespace_schema() -> dict[str, Any]:
    """The JSON schema of one namespace (an item of ``namespaces``, a key of ``load``)."""
    return {
        "type": "string",
        "minLength": 1,
        "maxLength": MAX_NAME_LENGTH,
        "pattern": namespace_pattern(),
        "description": f"a namespace: {NAMESPACE_RULE}",
    }


def _score_request_schema(schema: dict[str, Any]) -> None:
    """The rules the validators check, stated in ``ScoreRequest``'s JSON schema."""
    fields = schema["properties"]
    fields["namespaces"]["anyOf"][0]["items"] = namespace_schema()
    fields["load"]["anyOf"][0] = {
        "type": "object",
        "maxProperties": MAX_NAMESPACES,
        "propertyNames": namespace_schema(),
        "additionalProperties": {
            "type": "number",
            "minimum": -sys.float_info.max,
            "maximum": sys.float_info.max,
        },
    }
    absent = {"type": "null"}  # missing or null
    schema["oneOf"] = [
        {
            "title": "block_hashes",
            "required": ["block_hashes"],
            "properties": {
                "block_hashes": {"type": "array"},
                "token_ids": absent,
                "block_size": absent,
                "salt": absent,
            },
        },
        {
            "title": "token_ids with block_size",
            "required": ["token_ids", "block_size"],
            "properties": {
                "token_ids": {"type": "array"},
                "block_size": {"type": "integer"},
                "block_hashes": absent,
            },
        },
    ]


def _check_namespace(name: str) -> None:
    try:
        validate_namespace(name)
    except (TypeError, ValueError):
        raise ValueError(f"a namespace is {NAMESPACE_RULE}") from None  # not the name itself


class ScoreRequest(BaseModel):
    """A prompt as block hashes, or as token ids to hash; optionally the namespaces to
    score (default: every live node) and each node's load (ties go to the lowest)."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_score_request_schema)

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
    namespaces: Annotated[list[Namespace], Field(max_length=MAX_NAMESPACES)] | None = Field(
        default=None, description="score only these namespaces (default: every live node)"
    )
    load: Annotated[dict[Namespace, float], Field(max_length=MAX_NAMESPACES)] | None = Field(
        default=None, description="namespace -> load; among equal prefixes the lowest wins"
    )

    @field_validator("namespaces")
    @classmethod
    def _namespaces(cls, value: list[str] | None) -> list[str] | None:
        for name in value or ():
            _check_namespace(name)
        return value

    @field_validator("load")
    @classmethod
    def _load(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for name, figure in (value or {}).items():
            _check_namespace(name)
            if not math.isfinite(figure):
                raise ValueError("a load is a finite number")
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


class HealthReply(BaseModel):
    status: str
    redis: str
    scripts: str


class LiveReply(BaseModel):
    status: str


class ErrorReply(BaseModel):
    error: str = Field(description="the kind of error")
    detail: Any = Field(default=None, description="what was wrong; never the request's data")


ERROR_MEANINGS = {
    400: "a malformed HTTP request",
    404: "no endpoint at this path",
    405: "the endpoint does not take this method (see the Allow header)",
    408: "the request did not arrive in time",
    413: f"a body over {MAX_BODY_BYTES:,} bytes",
    422: "a body that is not JSON, or breaks the schema or the limits",
    431: "request headers over 16 KiB",
    500: "a registry fault an operator must fix",
    503: "Redis is unavailable, or no connection was free in time (retry)",
}


def _documented(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": ErrorReply, "description": ERROR_MEANINGS[code]} for code in codes}


SCORE_ERRORS = _documented(400, 408, 413, 422, 500, 503)
READ_ERRORS = _documented(500, 503)


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


def _error(
    status: int,
    kind: str,
    detail: Any,
    headers: dict[str, str] | None = None,
    *,
    openai: bool = False,
) -> JSONResponse:
    return JSONResponse(
        error_content(status, kind, detail, openai), status_code=status, headers=headers
    )


def _openai(request: Request) -> bool:
    """Whether the app is ``pcr gateway`` (OpenAI-shaped errors)."""
    return getattr(request.app.state, "gateway", None) is not None


def _registry_error(exc: RegistryError, openai: bool = False) -> JSONResponse:
    message = str(exc).split("\n")[0]
    if isinstance(exc, RegistryUnavailable):
        return _error(503, "unavailable", message, openai=openai)
    return _error(500, "registry fault", message, openai=openai)


class Gate:
    """At most ``limit`` requests use Redis at once, each holding at most one connection
    per Redis node, so pools of ``limit`` connections (per node) never run out; the others
    wait their turn up to ``timeout`` seconds, then get ``RegistryUnavailable`` (503)."""

    def __init__(self, limit: int, timeout: float) -> None:
        self.limit = limit
        self.timeout = timeout
        self._turns = asyncio.Semaphore(limit)

    @contextlib.asynccontextmanager
    async def turn(self, operation: str | None = None) -> AsyncIterator[None]:
        """Hold a turn; ``operation`` names what a refused turn counts as in the metrics."""
        try:
            if self._turns.locked():  # no timer (one per request) while turns are free
                async with _deadline(self.timeout):
                    await self._turns.acquire()
            else:
                await self._turns.acquire()
        except (TimeoutError, asyncio.TimeoutError):
            observer = observe.current
            if observer is not None and operation is not None:
                observer.record(operation, "unavailable", None)
            raise RegistryUnavailable(
                f"no free Redis connection within {self.timeout:g} s: all {self.limit} "
                "are busy (retry)"
            ) from None
        try:
            yield
        finally:
            self._turns.release()


class State:
    """What the application holds: the clients, the router and the gate, made in its loop."""

    def __init__(
        self,
        url: str,
        key_prefix: str,
        hybrid: bool | None,
        max_connections: int,
        pool_timeout: float,
        view: bool = False,
    ) -> None:
        self.url = url
        self.follow = view  # score from a fleet view (registry.fleet.view)
        self.view: FleetView | None = None
        self.key_prefix = key_prefix
        self.hybrid = hybrid
        self.max_connections = max_connections
        self.pool_timeout = pool_timeout
        self.cluster = url.partition("://")[0].lower() in CLUSTER_SCHEMES
        self.client: Any = None
        self.router: AsyncPrefixRouter | None = None
        self.gate: Gate | None = None
        self.sync_client: Any = None
        self._sync_lock = threading.Lock()

    @contextlib.asynccontextmanager
    async def lifespan(self, _app: FastAPI) -> AsyncIterator[None]:
        """The application's lifespan: open at start, close at the end."""
        await self.open()
        settle_heap()
        try:
            yield
        finally:
            await self.close()

    async def open(self) -> None:
        options = bounded_async_options(self.cluster, max_connections=self.max_connections)
        self.client = async_client_from_url(self.url, **options)
        if self.follow:
            try:
                client = await asyncio.to_thread(self.sync)
            except RegistryError as exc:  # a cluster not there yet: scored from Redis
                log.warning("the fleet view could not start: %s", exc)
            else:
                self.view = FleetView(client, self.key_prefix).start(timeout=None)
        self.router = AsyncPrefixRouter(
            self.client, self.key_prefix, hybrid=self.hybrid, view=self.view
        )
        self.gate = Gate(self.max_connections, self.pool_timeout)
        try:
            async with self.gate.turn():
                await self.router.load()
        except RegistryError as exc:  # not there yet: /health says so, calls reload
            log.warning("Redis not ready at start: %s", exc)

    def ready(self) -> tuple[AsyncPrefixRouter, Gate]:
        """The router and the gate (made when the application started)."""
        assert self.router is not None, "the app has not started"
        assert self.gate is not None, "the app has not started"
        return self.router, self.gate

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
        if self.view is not None:
            await asyncio.to_thread(self.view.close)
        if self.client is not None:
            with contextlib.suppress(Exception):
                await self.client.aclose()
        if self.sync_client is not None:
            with contextlib.suppress(Exception):
                self.sync_client.close()


class _BodyLimit:
    """Refuses request bodies over ``limit`` bytes with 413 (by Content-Length, and by
    counting a body sent without one)."""

    def __init__(self, app: Any, limit: int, openai: bool = False) -> None:
        self.app = app
        self.limit = limit
        self.openai = openai

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
        body = error_body(
            ERROR_KINDS[413], f"bodies are limited to {self.limit:,} bytes", 413, openai=self.openai
        )
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})


# -- errors: one shape for every status -------------------------------------------------

_SHOWN_LOC = frozenset({"body", "[key]", *ScoreRequest.model_fields})
"""Parts of an error's ``loc`` that are the schema's own words; any other text (a
``load`` key, an unknown field's name) came from the request and is shown as ``*``."""


def _shown_loc(loc: Sequence[Any]) -> list[Any]:
    return [part if isinstance(part, int) or part in _SHOWN_LOC else "*" for part in loc][:5]


async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    shown: list[dict[str, Any]] = [
        {
            "loc": _shown_loc(e.get("loc", ())),
            "msg": str(e.get("msg", ""))[:300],
            "type": e.get("type"),
        }
        for e in errors[:MAX_ERRORS_SHOWN]
    ]
    if len(errors) > MAX_ERRORS_SHOWN:
        shown.append({"msg": f"and {len(errors) - MAX_ERRORS_SHOWN} more errors"})
    return _error(422, ERROR_KINDS[422], shown, openai=_openai(request))


def _not_json(cause: BaseException, openai: bool = False) -> JSONResponse:
    """422 for a body json.loads could not read (FastAPI answers these with a bare 400)."""
    if isinstance(cause, RecursionError):
        why = "the body nests too deeply"
    elif isinstance(cause, UnicodeDecodeError):
        why = "the body is not UTF-8"
    elif "digits" in str(cause):
        why = "an integer in the body has too many digits"
    else:
        why = "the body is not JSON"
    detail = [{"loc": ["body"], "msg": why, "type": "json_invalid"}]
    return _error(422, ERROR_KINDS[422], detail, openai=openai)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's and FastAPI's HTTP errors (404, 405, a body that did not parse) in the
    one shape; the detail is the status' own meaning, never the request."""
    if exc.status_code == 400 and isinstance(exc.__cause__, (RecursionError, ValueError)):
        return _not_json(exc.__cause__, _openai(request))
    try:
        phrase = HTTPStatus(exc.status_code).phrase.lower()
    except ValueError:
        phrase = "error"
    kind = ERROR_KINDS.get(exc.status_code, phrase)
    detail = ERROR_MEANINGS.get(exc.status_code, phrase)
    return _error(exc.status_code, kind, detail, dict(exc.headers or {}), openai=_openai(request))


async def _registry_fault(request: Request, exc: RegistryError) -> JSONResponse:
    return _registry_error(exc, _openai(request))


HANDLERS: dict[int | type[Exception], Callable[[Request, Any], Coroutine[Any, Any, Response]]] = {
    RequestValidationError: _invalid,
    HTTPException: _http_error,
    RegistryError: _registry_fault,
}
"""The errors with a handler of their own; any other exception is ``_Faults``'."""


class _Faults:
    """The app's outermost middleware: an exception of the service's own code (a bug)
    before the response started is answered 500 ``internal error`` naming only its type,
    logged with its traceback, and goes no further. Starlette's own outermost layer would
    answer it too, but then raise it on, and uvicorn closes the connection of a request
    whose app raised: a keep-alive client's next request on it would fail unanswered.
    After the response started there is no answer to give: it is raised on, and the
    connection closed."""

    def __init__(self, app: Any, openai: bool = False) -> None:
        self.app = app
        self.openai = openai

    async def __call__(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[MutableMapping[str, Any]]],
        send: Callable[[MutableMapping[str, Any]], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message: MutableMapping[str, Any]) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as exc:
            if started:
                raise
            log.error("internal error on %s %s", scope["method"], scope["path"], exc_info=exc)
            body = error_body("internal error", type(exc).__name__, 500, openai=self.openai)
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ]
            await send({"type": "http.response.start", "status": 500, "headers": headers})
            await send({"type": "http.response.body", "body": body})


# -- the endpoints -----------------------------------------------------------------------


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
            scores, best = await router.decide(wanted, body.load, body.namespaces)
    except (TypeError, ValueError):  # the schema checks these first: not reached
        return _error(
            422, ERROR_KINDS[422], "the prompt breaks the registry's rules", openai=_openai(request)
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
    live = NodeIndex(client, state.key_prefix).live()
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
        return _error(503, "unhealthy", str(exc).split("\n")[0])
    except REDIS_ERRORS as exc:
        error = translate(exc, "health check: PING")
        return _error(503, "unhealthy", str(error or exc).split("\n")[0])
    return HealthReply(status="ok", redis="reachable", scripts="loaded")


async def live() -> LiveReply:
    """200 while the process runs."""
    return LiveReply(status="alive")


def metrics(request: Request) -> Response:
    """Prometheus metrics (needs prometheus-client)."""
    try:
        prometheus = importlib.import_module("prometheus_client")
    except ImportError:
        return _error(
            404, "not available", "metrics need prometheus-client", openai=_openai(request)
        )
    return Response(prometheus.generate_latest(), media_type=prometheus.CONTENT_TYPE_LATEST)


def _add_routes(app: FastAPI, *, health_check: bool = True) -> None:
    """The endpoints, on the application's own router (an included ``APIRouter`` would
    be matched again on every request)."""
    app.add_api_route(
        "/v1/score", score, methods=["POST"], response_model=ScoreReply, responses=SCORE_ERRORS
    )
    app.add_api_route("/v1/nodes", nodes, response_model=NodesReply, responses=READ_ERRORS)
    if health_check:  # the gateway has its own
        app.add_api_route("/health", health, response_model=HealthReply, responses=_documented(503))
    app.add_api_route("/live", live, response_model=LiveReply)
    app.add_api_route(
        "/metrics",
        metrics,
        response_class=PlainTextResponse,
        responses={404: {"model": ErrorReply, "description": "prometheus-client is not installed"}},
    )


class ScoringApp(FastAPI):
    """FastAPI, with the request schema published as pydantic writes it: FastAPI's
    OpenAPI models read every bound as a float (2^63-1 would read 9.223372036854776e18);
    and, for the gateway, its proxied requests taken before FastAPI's own layers."""

    proxied: Any = None
    """The gateway's ``POST`` routes in plain ASGI (``pcr.gateway.app.Proxy`` inside
    ``_Faults``), or None: they skip routing and every middleware but ``_Faults`` (the
    proxy applies the body limit itself); every other request goes through the app,
    whose router has the same endpoint and answers 405 for other methods on its paths."""

    async def __call__(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[MutableMapping[str, Any]]],
        send: Callable[[MutableMapping[str, Any]], Awaitable[None]],
    ) -> None:
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
) -> FastAPI:
    """The scoring service for the registry at ``url``: at most ``max_connections``
    requests use Redis at once, the others wait up to ``pool_timeout`` seconds. With
    ``view`` (``pcr serve``'s default), ``/v1/score`` scores from a fleet view the app
    follows while it follows Redis, and exactly from Redis otherwise. (``pcr gateway``
    builds on the same pieces: ``pcr.gateway.service.create_gateway_app``.)"""
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
    return finish(app, openai=False)


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
    _add_routes(app, health_check=not openai)
    app.add_middleware(_BodyLimit, limit=MAX_BODY_BYTES, openai=openai)
    return app


def finish(app: FastAPI, *, openai: bool) -> FastAPI:
    """The outermost layer of all ours: no fault of the app leaves as a traceback."""
    app.add_middleware(_Faults, openai=openai)
    return app


def too_large_body(*, openai: bool) -> bytes:
    """The 413 a body over ``MAX_BODY_BYTES`` gets, encoded."""
    return error_body(
        ERROR_KINDS[413], f"bodies are limited to {MAX_BODY_BYTES:,} bytes", 413, openai=openai
    )


def guarded(app: Any, *, openai: bool) -> Any:
    """``app`` (an ASGI callable) behind the layer that turns its faults into the one
    error shape."""
    return _Faults(app, openai=openai)


def settle_heap() -> None:
    """Everything made while starting (the imports: FastAPI, pydantic, and for the
    gateway transformers and torch, hundreds of thousands of objects) moved out of the
    garbage collector's reach: a full collection over them is a pause of a large part of
    a second, which a request now and then had to wait out. What requests make is still
    collected."""
    gc.collect()
    gc.freeze()
