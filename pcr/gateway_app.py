"""``pcr gateway``: an OpenAI-compatible router in front of the engines (FastAPI, aiohttp).

``create_app(url, gateway=GatewayConfig(...))`` (``pcr.serve_app``) builds it: the
scoring service's ``/v1/score``, ``/v1/nodes``, ``/live`` and ``/metrics``, plus
``POST /v1/completions`` and ``POST /v1/chat/completions`` (server-sent events passed
through chunk by chunk when ``stream`` is true), ``GET /v1/models`` and a ``/health`` that
says what the gateway can reach. Every error the gateway itself answers has the OpenAI
shape ``{"error": {"message", "type", "param", "code"}}``; a backend's own answer
(its 4xx, its errors) is passed through as it is.

Per request: the prompt's tokens as the engine will compute them
(``pcr.gateway_tokens``), their block hashes, ``AsyncPrefixRouter.score`` for the
backends' cached prefixes, and the balance rule (``pcr.gateway_balance``) against the
load every replica has in flight (exchanged through Redis, ``lua/gateway_load.lua``)
and the engines' own queue and KV-cache usage (their ``/metrics``, scraped in the
background). Redis away, or slower than ``registry_timeout``: the choice is by load
alone, said by ``pcr_gateway_registry_up`` and ``/health``; no request fails for it.
A failure before the backend's first byte (refused, reset, timed out connecting) is
retried once on the next best backend; a client that disconnects cancels the upstream
request (the engine aborts it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import socket
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from pcr.gateway_balance import (
    POLICIES,
    BackendLoad,
    BalanceRule,
    Choice,
    cached_tokens,
    ranked,
)
from pcr.gateway_metrics import GatewayMetrics
from pcr.gateway_tokens import PromptTokenizer, prompt_tokens
from pcr.http_errors import error_content
from registry.errors import RegistryError
from registry.hashing import block_hashes
from registry.membership import validate_engine_url
from registry.validation import prefix_hashes

log = logging.getLogger(__name__)

ERROR_KIND = {
    400: "bad request",
    499: "client closed request",
    502: "bad gateway",
    503: "unavailable",
}
HASH_IN_LOOP = 4_096
"""Token lists longer than this are hashed in a worker thread."""
SCRAPE_TIMEOUT = aiohttp.ClientTimeout(total=2.0)
REFUSED_FOR = 2.0
"""Seconds a backend that refused a connection is passed over (then tried again)."""
HOP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)


@dataclass(frozen=True)
class GatewayConfig:
    """What ``pcr gateway`` is told (``pcr gateway --help`` says each in words)."""

    backends: Mapping[str, str] = field(default_factory=dict)
    """Namespace -> engine base URL, from the command line or a config file; the engine
    table in Redis (``pcr bridge --engine-url``) adds more."""
    tokenizer: str | None = None
    block_size: int = 16
    policy: str = "prefix"
    rule: BalanceRule = field(default_factory=BalanceRule)
    replica_id: str = ""
    scrape_interval: float = 1.0
    share_interval: float = 0.1
    discover_interval: float = 2.0
    registry_timeout: float = 0.25
    connect_timeout: float = 2.0
    upstream_timeout: float = 600.0

    def __post_init__(self) -> None:
        for namespace, url in self.backends.items():
            validate_engine_url(url)
            if not namespace:
                raise ValueError("a backend needs a namespace")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int):
            raise TypeError("block_size must be an int")
        if not 1 <= self.block_size <= 1 << 20:
            raise ValueError("block_size must be in [1, 1048576]")
        for name in (
            "share_interval",
            "discover_interval",
            "registry_timeout",
            "connect_timeout",
            "upstream_timeout",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a positive finite number of seconds")
        if not isinstance(self.scrape_interval, (int, float)) or not (
            0 <= self.scrape_interval < math.inf
        ):
            raise ValueError("scrape_interval must be a finite number of seconds >= 0")


@dataclass
class Backend:
    """One engine the gateway sends requests to."""

    namespace: str
    url: str
    source: str  # "config" or "announced"
    load: BackendLoad = field(default_factory=BackendLoad)
    refused_until: float = 0.0
    up: bool = True


class GatewayState:
    """What the gateway holds: backends, their load, the HTTP client, background tasks."""

    def __init__(self, config: GatewayConfig, registry: Any) -> None:
        self.config = config
        self.registry = registry  # pcr.serve_app.State: the Redis client, router and gate
        self.replica = config.replica_id or f"{socket.gethostname()}-{os.getpid()}"
        self.backends: dict[str, Backend] = {
            ns: Backend(ns, url.rstrip("/"), "config") for ns, url in config.backends.items()
        }
        self.tokenizer = PromptTokenizer(config.tokenizer) if config.tokenizer else None
        self.metrics = GatewayMetrics.get()
        self.http: aiohttp.ClientSession | None = None
        self.registry_up = True
        self.registry_retry_at = 0.0
        self.turn = 0  # round-robin position
        self.mean_prefill = 0.0
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False

    # -- lifetime ------------------------------------------------------------------------

    async def open(self) -> None:
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=self.config.upstream_timeout,  # waiting for a pooled connection too
            sock_connect=self.config.connect_timeout,
            sock_read=self.config.upstream_timeout,
        )
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30, ttl_dns_cache=60)
        self.http = aiohttp.ClientSession(
            connector=connector,
            timeout=timeout,
            trust_env=False,
            auto_decompress=False,  # bytes pass through as the engine sent them
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )
        with contextlib.suppress(RegistryError, TimeoutError):
            await self._discover()
        loops = [self._every(self.config.discover_interval, self._discover)]
        loops.append(self._every(self.config.share_interval, self._share))
        if self.config.scrape_interval > 0:
            loops.append(self._every(self.config.scrape_interval, self._scrape))
        self._tasks = [asyncio.ensure_future(loop) for loop in loops]

    async def close(self) -> None:
        """Stop the background tasks (a cancellation can be lost inside redis-py's
        ``asyncio.wait_for`` on Python 3.11, so each is cancelled again until it ends, and
        the loops also stop at their flag), then the HTTP client."""
        self._stopping = True
        pending = {t for t in self._tasks if not t.done()}
        for _ in range(20):
            if not pending:
                break
            for task in pending:
                task.cancel()
            _done, pending = await asyncio.wait(pending, timeout=0.25)
        for task in pending:
            log.warning("a background task did not stop: %s", task.get_coro())
        if self.http is not None:
            await self.http.close()

    async def _every(self, interval: float, step: Any) -> None:
        while not self._stopping:
            await asyncio.sleep(interval)
            try:
                await step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a background step never ends the loop
                log.debug("gateway background step failed: %s", type(exc).__name__)

    # -- what the gateway learns in the background --------------------------------------

    async def _discover(self) -> None:
        """Backends announced in Redis (``pcr bridge --engine-url``)."""
        router, gate = self.registry.ready()
        async with asyncio.timeout(max(1.0, self.config.registry_timeout)), gate.turn():
            table = await router.engines()
        for namespace, url in table.items():
            known = self.backends.get(namespace)
            if known is None:
                self.backends[namespace] = Backend(namespace, url, "announced")
            elif known.source == "announced":
                known.url = url
        for namespace in [n for n, b in self.backends.items() if b.source == "announced"]:
            if namespace not in table:
                del self.backends[namespace]

    async def _share(self) -> None:
        """Publish this replica's load and take the others' (one round trip)."""
        now = time.monotonic()
        half_life = self.config.rule.half_life
        mine = {
            ns: [
                b.load.in_flight,
                round(b.load.pending, 1),
                round(b.load.recent.now(now, half_life), 1),
            ]
            for ns, b in self.backends.items()
        }
        ttl_ms = max(1000, round(self.config.share_interval * 10_000))
        router, gate = self.registry.ready()
        try:
            async with asyncio.timeout(max(1.0, self.config.registry_timeout)), gate.turn():
                others = await router.exchange_load(
                    self.replica, ttl_ms, json.dumps(mine, separators=(",", ":"))
                )
        except (RegistryError, TimeoutError) as exc:
            others = []  # Redis away: balance on what this replica knows
            self._registry(False, exc)
        else:
            if not self.registry_up and time.monotonic() >= self.registry_retry_at:
                self._registry(True)
        totals: dict[str, list[float]] = {}
        for payload in others:
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                for ns, values in json.loads(payload).items():
                    total = totals.setdefault(ns, [0.0, 0.0, 0.0])
                    for i in range(3):
                        total[i] += max(0.0, float(values[i]))
        for ns, backend in self.backends.items():
            in_flight, pending, recent = totals.get(ns, (0.0, 0.0, 0.0))
            backend.load.remote_in_flight = int(in_flight)
            backend.load.remote_pending = pending
            backend.load.remote_recent = recent
            backend.load.remote_at = now

    async def _scrape(self) -> None:
        """Each engine's own queue and KV-cache usage; also its health."""
        await asyncio.gather(*(self._scrape_one(b) for b in list(self.backends.values())))

    async def _scrape_one(self, backend: Backend) -> None:
        assert self.http is not None
        try:
            async with self.http.get(f"{backend.url}/metrics", timeout=SCRAPE_TIMEOUT) as reply:
                status = reply.status
                text = await reply.text(errors="replace") if status == 200 else ""
        except (aiohttp.ClientError, TimeoutError):
            self._mark(backend, up=False)
            return
        self._mark(backend, up=True)
        running = waiting = usage = 0.0
        for line in text.splitlines():
            if not line.startswith("vllm:"):
                continue
            name = line.split("{", 1)[0].split(" ", 1)[0]
            with contextlib.suppress(ValueError, IndexError):
                value = float(line.rsplit(" ", 1)[1])
                if name == "vllm:num_requests_running":
                    running += value
                elif name == "vllm:num_requests_waiting":
                    waiting += value
                elif name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
                    usage = max(usage, value)
        # Only its queue: a running request seen a moment ago is often this gateway's own,
        # just finished (requests one at a time would then look like load).
        backend.load.engine_requests = waiting
        backend.load.engine_running = running
        backend.load.kv_usage = usage

    def _mark(self, backend: Backend, *, up: bool) -> None:
        backend.up = up
        if not up:
            backend.refused_until = time.monotonic() + REFUSED_FOR
        if self.metrics.on:
            self.metrics.backend_up.labels(backend.namespace).set(1 if up else 0)

    # -- choosing ------------------------------------------------------------------------

    def candidates(self) -> list[Backend]:
        """Backends not known to refuse connections; all of them when every one is."""
        now = time.monotonic()
        ready = [b for b in self.backends.values() if b.refused_until <= now]
        return ready or list(self.backends.values())

    async def cached(self, names: list[str], tokens: list[int]) -> dict[str, int] | None:
        """Each backend's cached prefix of ``tokens`` in tokens, from the registry; None
        when Redis is away (or slower than ``registry_timeout``)."""
        now = time.monotonic()
        if not self.registry_up and now < self.registry_retry_at:
            return None
        size = self.config.block_size
        try:
            if len(tokens) > HASH_IN_LOOP:
                hashes = await asyncio.to_thread(block_hashes, tokens, size)
            else:
                hashes = block_hashes(tokens, size)
            wanted = prefix_hashes(hashes)
            router, gate = self.registry.ready()
            async with asyncio.timeout(self.config.registry_timeout), gate.turn():
                scores = await router.score(wanted, namespaces=names)
        except (RegistryError, TimeoutError) as exc:
            self._registry(False, exc)
            return None
        self._registry(True)
        return {n: cached_tokens(s.usable, size, len(tokens)) for n, s in scores.items()}

    def _registry(self, up: bool, exc: BaseException | None = None) -> None:
        if up != self.registry_up:
            if up:
                log.warning("registry reachable again: routing by cached prefix")
            else:
                log.warning("registry away (%s): routing by load alone", type(exc).__name__)
        self.registry_up = up
        if not up:
            self.registry_retry_at = time.monotonic() + 1.0
        if self.metrics.on:
            self.metrics.registry_up.set(1 if up else 0)

    async def choose(self, tokens: list[int] | None) -> tuple[list[Choice], str]:
        """The backends in the order to try them, and the routing outcome."""
        backends = self.candidates()
        names = [b.namespace for b in backends]
        if not names:
            return [], "load"
        if self.config.policy == "round-robin":
            self.turn += 1
            start = self.turn % len(names)
            turns = sorted(names)
            turns = turns[start:] + turns[:start]
            return [Choice(n, 0.0, 0, 0.0, 0.0) for n in turns], "load"
        prompt = len(tokens) if tokens else max(1, round(self.mean_prefill))
        cached: dict[str, int] = {}
        outcome = "load"
        if self.config.policy == "prefix" and tokens:
            found = await self.cached(names, tokens)
            if found is None:
                outcome = "registry_away"
            else:
                cached = found
                if any(cached.values()):
                    outcome = "prefix"
        loads = {b.namespace: b.load for b in backends}
        order = ranked(names, prompt, cached, loads, self.config.rule, time.monotonic())
        return order, outcome


# -- the endpoints -----------------------------------------------------------------------


def gateway_state(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    return state


def openai_error(status: int, message: str) -> JSONResponse:
    """The OpenAI error shape, for what the gateway itself answers."""
    return JSONResponse(error_content(status, ERROR_KIND[status], message, True), status)


async def completions(request: Request) -> Response:
    return await _proxy(request, chat=False)


async def chat_completions(request: Request) -> Response:
    return await _proxy(request, chat=True)


async def _proxy(request: Request, *, chat: bool) -> Response:
    arrived = time.perf_counter()
    state = gateway_state(request)
    try:
        raw = await request.body()
    except ClientDisconnect:  # gone mid-body, or refused by the body limit or deadline
        return Response(status_code=499)
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return openai_error(400, "the body is not JSON")
    if not isinstance(body, dict):
        return openai_error(400, "the body must be a JSON object")
    if not state.backends:
        return openai_error(503, "no backend is configured or announced")
    tokens = (
        await prompt_tokens(state.tokenizer, body, chat)
        if state.config.policy != "round-robin"
        else None
    )
    order, outcome = await state.choose(tokens)
    if state.metrics.on:
        state.metrics.routed.labels(outcome).inc()
    watch = _ClientWatch(request)
    try:
        return await _forward(state, request, body, raw, order, tokens, arrived, watch)
    except asyncio.CancelledError:
        if not watch.left:
            raise  # the server is stopping
        watch.uncancel()
        return Response(status_code=499)
    finally:
        watch.stop()


class _ClientWatch:
    """Cancels the request's task when its client disconnects (until ``stop``): while
    the gateway waits for a backend's reply, nothing else would notice, and vLLM sends
    nothing, not even headers, until a non-streamed completion is done."""

    def __init__(self, request: Request) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        self.left = False
        self.gone = asyncio.ensure_future(_disconnected(request))
        self.gone.add_done_callback(self._left)

    def _left(self, gone: asyncio.Future[None]) -> None:
        if not gone.cancelled() and gone.exception() is None:
            self.left = True
            self.task.cancel()

    def uncancel(self) -> None:
        self.task.uncancel()

    def stop(self) -> None:
        self.gone.remove_done_callback(self._left)
        self.gone.cancel()


async def _forward(
    state: GatewayState,
    request: Request,
    body: dict[str, Any],
    raw: bytes,
    order: list[Choice],
    tokens: list[int] | None,
    arrived: float,
    watch: _ClientWatch,
) -> Response:
    """Send to the best backend, once more to the next best on a failure before its
    first byte; the reply, or the error."""
    stream = body.get("stream") is True
    prompt = len(tokens) if tokens else 0
    headers = _forwarded(request.scope["headers"])
    query = request.scope.get("query_string", b"")
    path = request.scope["path"] + (f"?{query.decode('latin-1')}" if query else "")
    tried = 0
    for choice in order[:2]:  # the best, and once more on the next best
        backend = state.backends.get(choice.namespace)
        if backend is None:
            continue
        tried += 1
        prefill = max(0, prompt - choice.cached)
        _started(state, backend, prefill, choice, prompt)
        finished = True
        try:
            if state.metrics.on:
                state.metrics.overhead.observe(time.perf_counter() - arrived)
            upstream = await _send(state, request, backend, path, raw, headers)
        except _Failed as failed:
            _ended(state, backend, prefill)
            _count_error(state, backend, failed.kind)
            if failed.kind == "connect":
                state._mark(backend, up=False)
            if tried == 1 and len(order) > 1:
                if state.metrics.on:
                    state.metrics.retries.labels(backend.namespace).inc()
                continue
            return openai_error(502, f"backend {backend.namespace!r} failed: {failed.kind}")
        except asyncio.CancelledError:
            _ended(state, backend, prefill)
            if watch.left:
                _count_error(state, backend, "cancelled")
            raise
        try:
            if stream:
                watch.stop()  # the streamed response watches the client itself
                finished = False  # the stream's own end does the accounting
                return _streamed(state, backend, upstream, prefill, arrived)
            return await _whole(state, backend, upstream, arrived, watch)
        finally:
            if finished:
                _ended(state, backend, prefill)
    return openai_error(503, "no backend could take the request")


class _Failed(Exception):
    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


def _forwarded(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """The request's headers for the backend (ASGI gives names in lower case)."""
    out = {}
    for name, value in raw:
        key = name.decode("latin-1")
        if key not in HOP_HEADERS:
            out[key] = value.decode("latin-1")
    return out


def _started(
    state: GatewayState, backend: Backend, prefill: int, choice: Choice, prompt: int
) -> None:
    load = backend.load
    load.in_flight += 1
    load.pending += prefill
    rule = state.config.rule
    load.recent.add(float(prefill or 1), time.monotonic(), rule.half_life)
    if prompt:
        state.mean_prefill += (prefill - state.mean_prefill) * 0.05
    if state.metrics.on:
        state.metrics.in_flight.labels(backend.namespace).inc()
        if prompt:
            state.metrics.prompt_tokens.labels(backend.namespace).inc(prompt)
            state.metrics.predicted.labels(backend.namespace).inc(choice.cached)


def _ended(state: GatewayState, backend: Backend, prefill: int) -> None:
    load = backend.load
    load.in_flight = max(0, load.in_flight - 1)
    load.pending = max(0.0, load.pending - prefill)
    if state.metrics.on:
        state.metrics.in_flight.labels(backend.namespace).dec()


def _count_error(state: GatewayState, backend: Backend, kind: str) -> None:
    if state.metrics.on:
        state.metrics.errors.labels(backend.namespace, kind).inc()
        state.metrics.requests.labels(backend.namespace, "error").inc()


async def _send(
    state: GatewayState,
    request: Request,
    backend: Backend,
    path: str,
    raw: bytes,
    headers: dict[str, str],
) -> aiohttp.ClientResponse:
    """The backend's reply, its headers read (the body not yet); ``_Failed`` before."""
    assert state.http is not None
    try:
        return await state.http.request(
            request.method, backend.url + path, data=raw, headers=headers, allow_redirects=False
        )
    except aiohttp.ClientConnectorError:
        raise _Failed("connect") from None
    except TimeoutError:
        raise _Failed("timeout") from None
    except aiohttp.ClientError:
        raise _Failed("protocol") from None


def _reply_headers(upstream: aiohttp.ClientResponse) -> dict[str, str]:
    return {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS}


async def _whole(
    state: GatewayState,
    backend: Backend,
    upstream: aiohttp.ClientResponse,
    arrived: float,
    watch: _ClientWatch,
) -> Response:
    """A reply read whole; a client that leaves meanwhile cancels it (``_ClientWatch``)."""
    try:
        content = await upstream.read()
    except asyncio.CancelledError:
        upstream.close()  # drops the connection: the engine aborts the request
        if watch.left:
            _count_error(state, backend, "cancelled")
        raise
    except (aiohttp.ClientError, TimeoutError):
        upstream.close()
        _count_error(state, backend, "protocol")
        return openai_error(502, f"backend {backend.namespace!r} broke off its reply")
    upstream.release()
    _answered(state, backend, upstream.status, arrived, first_byte=True)
    return Response(content, status_code=upstream.status, headers=_reply_headers(upstream))


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _answered(
    state: GatewayState, backend: Backend, status: int, arrived: float, *, first_byte: bool
) -> None:
    if not state.metrics.on:
        return
    took = time.perf_counter() - arrived
    if first_byte:
        state.metrics.first_byte.labels(backend.namespace).observe(took)
    state.metrics.latency.labels(backend.namespace).observe(took)
    if status >= 500:
        state.metrics.errors.labels(backend.namespace, "status").inc()
    state.metrics.requests.labels(backend.namespace, "error" if status >= 500 else "ok").inc()


def _streamed(
    state: GatewayState,
    backend: Backend,
    upstream: aiohttp.ClientResponse,
    prefill: int,
    arrived: float,
) -> StreamingResponse:
    """The backend's chunks as they come; a client that leaves closes the upstream."""
    events = upstream.headers.get("content-type", "").startswith("text/event-stream")

    async def chunks() -> AsyncIterator[bytes]:
        first = True
        complete = broken = False
        try:
            async for chunk in upstream.content.iter_any():
                if first and chunk:
                    first = False
                    if state.metrics.on:
                        state.metrics.first_byte.labels(backend.namespace).observe(
                            time.perf_counter() - arrived
                        )
                yield chunk
            complete = True
        except (aiohttp.ClientError, TimeoutError):
            broken = True
            _count_error(state, backend, "protocol")
            if events:  # say so in the stream, as the engines do, not with a clean end
                yield _stream_error(backend)
        finally:
            if complete:
                upstream.release()
            else:
                upstream.close()
            _ended(state, backend, prefill)
            if complete:
                _answered(state, backend, upstream.status, arrived, first_byte=False)
            elif not broken and state.metrics.on:
                state.metrics.errors.labels(backend.namespace, "cancelled").inc()

    return StreamingResponse(
        chunks(), status_code=upstream.status, headers=_reply_headers(upstream)
    )


def _stream_error(backend: Backend) -> bytes:
    """A server-sent event saying the backend broke off (OpenAI's error shape)."""
    error = error_content(502, ERROR_KIND[502], f"backend {backend.namespace!r} broke off", True)
    return b"data: " + json.dumps(error, separators=(",", ":")).encode() + b"\n\n"


async def models(request: Request) -> Response:
    """The first reachable backend's ``/v1/models`` (they serve the same model)."""
    state = gateway_state(request)
    assert state.http is not None
    for backend in state.candidates():
        try:
            async with state.http.get(f"{backend.url}/v1/models", timeout=SCRAPE_TIMEOUT) as reply:
                content = await reply.read()
                return Response(content, status_code=reply.status, headers=_reply_headers(reply))
        except (aiohttp.ClientError, TimeoutError):
            state._mark(backend, up=False)
    return openai_error(503, "no backend answered")


async def health(request: Request) -> JSONResponse:
    """200 while some backend is up; says whether the registry answers (when it does
    not, requests are routed by load alone)."""
    state = gateway_state(request)
    now = time.monotonic()
    backends = {
        b.namespace: "up" if b.refused_until <= now else "refusing" for b in state.backends.values()
    }
    status = 200 if any(v == "up" for v in backends.values()) else 503
    body = {
        "status": "ok" if status == 200 else "unavailable",
        "registry": "reachable" if state.registry_up else "away",
        "routing": state.config.policy if state.registry_up else "load",
        "backends": backends,
        "in_flight": {
            b.namespace: {"here": b.load.in_flight, "other_replicas": b.load.remote_in_flight}
            for b in state.backends.values()
        },
    }
    return JSONResponse(body, status_code=status)


def add_gateway_routes(app: FastAPI) -> None:
    """The proxy's routes, as plain Starlette routes (the body passes through as bytes:
    no FastAPI parsing or validation on the way)."""
    app.add_route("/v1/completions", completions, methods=["POST"])
    app.add_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_route("/v1/models", models, methods=["GET"])
    app.add_route("/health", health, methods=["GET"])
