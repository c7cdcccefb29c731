"""``pcr gateway``: an OpenAI-compatible router in front of the engines (FastAPI, aiohttp).

``create_gateway_app(GatewayConfig(...), url)`` (``pcr.gateway.service``) builds it: the
scoring service's ``/v1/score``, ``/v1/nodes``, ``/live`` and ``/metrics``, plus
``POST /v1/completions`` and ``POST /v1/chat/completions`` (server-sent events passed
through chunk by chunk when ``stream`` is true), ``GET /v1/models`` and a ``/health`` that
says what the gateway can reach. Every error the gateway itself answers has the OpenAI
shape ``{"error": {"message", "type", "param", "code"}}``; a backend's own answer
(its 4xx, its errors) is passed through as it is.

Per request: the prompt's tokens as the engine will compute them
(``pcr.gateway.tokens``), their block hashes, ``AsyncPrefixRouter.score`` for the
backends' cached prefixes, and the balance rule (``pcr.gateway.balance``) against the
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
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.routing import Route

from pcr.gateway.backends import Backend, engine_load, kept_backends
from pcr.gateway.balance import (
    POLICIES,
    REPLICA_ID,
    BalanceRule,
    Choice,
    Kin,
    cached_tokens,
    ranked,
)
from pcr.gateway.exchange import LoadExchange, RegistryHealth, discover
from pcr.gateway.metrics import GatewayMetrics
from pcr.gateway.tokens import (
    BadBody,
    BodyParser,
    PromptIds,
    PromptTokenizer,
    prompt_ids,
    prompt_tokens,
)
from pcr.web.errors import error_content
from registry.core.errors import RegistryError
from registry.core.validation import checked_number, is_number, prefix_hashes
from registry.fleet.membership import validate_engine_url
from registry.fleet.view import FleetView

log = logging.getLogger(__name__)

ERROR_KIND = {
    400: "bad request",
    499: "client closed request",
    502: "bad gateway",
    503: "unavailable",
}
VIEW_START_S = 5.0
"""Seconds the gateway waits at start for its fleet view's first load."""
SCRAPE_TIMEOUT = aiohttp.ClientTimeout(total=2.0)
UPSTREAM_KEEP_ALIVE_S = 4.0
"""Seconds the gateway keeps an idle connection to an engine: below the 5 s after which
vLLM's and SGLang's servers (uvicorn's default) close one, so the gateway closes first and
never sends a request into a connection the engine is closing."""
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
    max_model_len: int | None = None
    """The longest prompt in tokens the engines take (else the model's ``config.json``
    beside the tokenizer, else none): longer ones are refused (400) before they are
    tokenized (``pcr.gateway.tokens``)."""
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
    announced: bool = True
    """Also route to the engines announced in Redis (``pcr bridge --engine-url``); False:
    only to ``backends``."""
    view: bool = True
    """Score from the fleet's view in this process (``registry.fleet.view``, fed by the
    change records the writes publish): no Redis round trip per request. False: ask
    Redis on every request (the async router)."""

    def __post_init__(self) -> None:
        if not isinstance(self.view, bool):
            raise TypeError("view must be True or False")
        if not isinstance(self.announced, bool):
            raise TypeError("announced must be True or False")
        for namespace, url in self.backends.items():
            validate_engine_url(url)
            if not namespace:
                raise ValueError("a backend needs a namespace")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}")
        if self.replica_id and not REPLICA_ID.fullmatch(self.replica_id):
            raise ValueError("a replica id is 1 to 200 printable ASCII characters, no spaces")
        checked_number(self.block_size, "block_size", 1, 1 << 20, integer=True)
        if self.max_model_len is not None:
            checked_number(self.max_model_len, "max_model_len", 1, 1 << 40, integer=True)
        for name in (
            "share_interval",
            "discover_interval",
            "registry_timeout",
            "connect_timeout",
            "upstream_timeout",
        ):
            value = getattr(self, name)
            if not is_number(value) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a positive finite number of seconds")
        if not is_number(self.scrape_interval) or not 0 <= self.scrape_interval < math.inf:
            raise ValueError("scrape_interval must be a finite number of seconds >= 0")


class EngineScraper:
    """Reads each engine's own queue and KV-cache usage from its ``/metrics``, and
    whether it answers (``Backend.mark``)."""

    def __init__(self, http: aiohttp.ClientSession, metrics: GatewayMetrics) -> None:
        self.http = http
        self.metrics = metrics

    async def scrape(self, backends: Mapping[str, Backend]) -> None:
        """Every backend at once."""
        await asyncio.gather(*(self.scrape_one(b) for b in list(backends.values())))

    async def scrape_one(self, backend: Backend) -> None:
        """One backend: its load from its /metrics; refusing while it does not answer."""
        try:
            async with self.http.get(f"{backend.url}/metrics", timeout=SCRAPE_TIMEOUT) as reply:
                status = reply.status
                text = await reply.text(errors="replace") if status == 200 else ""
        except (aiohttp.ClientError, TimeoutError):
            backend.mark(self.metrics, up=False)
            return
        backend.mark(self.metrics, up=True)
        running, waiting, usage = engine_load(text)
        # Only its queue: a running request seen a moment ago is often this gateway's own,
        # just finished (requests one at a time would then look like load).
        backend.load.engine_requests = waiting
        backend.load.engine_running = running
        backend.load.kv_usage = usage


class GatewayState:
    """What the gateway holds: backends, their load, the HTTP client, background tasks;
    and how it chooses a backend for a request."""

    def __init__(self, config: GatewayConfig, registry: Any) -> None:
        self.config = config
        self.registry = registry  # pcr.serve.app.State: the Redis client, router and gate
        self.replica = config.replica_id or f"{socket.gethostname()}-{os.getpid()}"
        self.backends: dict[str, Backend] = {
            ns: Backend(ns, url.rstrip("/"), "config") for ns, url in config.backends.items()
        }
        self.tokenizer = (
            PromptTokenizer(config.tokenizer, config.max_model_len) if config.tokenizer else None
        )
        self.max_tokens = config.max_model_len or (
            self.tokenizer.max_tokens if self.tokenizer is not None else None
        )
        self.parser = BodyParser()
        self.metrics = GatewayMetrics.get()
        self.http: aiohttp.ClientSession | None = None
        self.health = RegistryHealth(self.metrics)
        self.exchange = LoadExchange(
            self.replica,
            self.backends,
            registry,
            self.health,
            share_interval=config.share_interval,
            registry_timeout=config.registry_timeout,
            half_life=config.rule.half_life,
        )
        self.turn = 0  # round-robin position
        self.kin = Kin()  # per prompt root, the requests sent to each backend lately
        self.mean_prefill = 0.0
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self.view: FleetView | None = None

    # -- lifetime ------------------------------------------------------------------------

    async def open(self) -> None:
        """Open the HTTP client and the fleet view, learn the announced backends, tell
        the other replicas of this one, and start the background loops."""
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=self.config.upstream_timeout,  # waiting for a pooled connection too
            sock_connect=self.config.connect_timeout,
            sock_read=self.config.upstream_timeout,
        )
        connector = aiohttp.TCPConnector(
            limit=0, keepalive_timeout=UPSTREAM_KEEP_ALIVE_S, ttl_dns_cache=60
        )
        self.http = aiohttp.ClientSession(
            connector=connector,
            timeout=timeout,
            trust_env=False,
            auto_decompress=False,  # bytes pass through as the engine sent them
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )
        if self.config.view and self.config.policy == "prefix":
            client = await asyncio.to_thread(self.registry.sync)
            self.view = FleetView(client, self.registry.key_prefix).start(timeout=None)
            # Its first load before the first request (at most VIEW_START_S: with Redis
            # away the gateway starts anyway, routing by load until the view follows).
            await asyncio.to_thread(self.view.ready.wait, VIEW_START_S)
        if self.config.announced:
            with contextlib.suppress(RegistryError, TimeoutError):
                await self._discover()
        # Announce this replica at once: the others learn of it from the push, it of
        # them from the reply (a replica tells its peers of each request's start and end
        # only once it knows of some).
        await self.exchange.share_quietly()
        loops = [self._every(self.config.share_interval, self._tick)]
        if self.config.announced:
            loops.append(self._every(self.config.discover_interval, self._discover))
        loops.append(self.exchange.listen())
        if self.config.scrape_interval > 0:
            scraper = EngineScraper(self.http, self.metrics)
            loops.append(
                self._every(self.config.scrape_interval, lambda: scraper.scrape(self.backends))
            )
        self._tasks = [asyncio.ensure_future(loop) for loop in loops]

    async def close(self) -> None:
        """Stop the background tasks (a cancellation can be lost inside redis-py's
        ``asyncio.wait_for`` on Python 3.11, so each is cancelled again until it ends, and
        the loops also stop at their flag), then the HTTP client."""
        self._stopping = True
        tasks = [*self._tasks, *self.exchange.stop()]
        pending = {t for t in tasks if not t.done()}
        for _ in range(20):
            if not pending:
                break
            for task in pending:
                task.cancel()
            _done, pending = await asyncio.wait(pending, timeout=0.25)
        for task in pending:
            log.warning("a background task did not stop: %s", task.get_coro())
        if self.view is not None:
            await asyncio.to_thread(self.view.close)
        self.parser.close()
        if self.tokenizer is not None:
            self.tokenizer.close()
        if self.http is not None:
            await self.http.close()

    async def _every(self, interval: float, step: Callable[[], Awaitable[None]]) -> None:
        while not self._stopping:
            await asyncio.sleep(interval)
            try:
                await step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a background step never ends the loop
                log.debug("gateway background step failed: %s", type(exc).__name__)

    async def _discover(self) -> None:
        """Backends announced in Redis (``pcr bridge --engine-url``); one no longer
        announced is kept until its lease has run out (``pcr.gateway.exchange``)."""
        router, gate = self.registry.ready()
        async with asyncio.timeout(max(1.0, self.config.registry_timeout)), gate.turn():
            await discover(router, self.registry.client, self.registry.key_prefix, self.backends)

    async def _tick(self) -> None:
        """The periodic exchange (``LoadExchange.tick``), after asking the fleet view
        whether it still follows Redis."""
        self.registry_reachable()
        await self.exchange.tick()

    # -- choosing ------------------------------------------------------------------------

    def candidates(self) -> list[Backend]:
        """Backends not known to refuse connections; all of them when every one is."""
        now = time.monotonic()
        ready = [b for b in self.backends.values() if b.refused_until <= now]
        return ready or list(self.backends.values())

    async def cached(self, names: list[str], ids: PromptIds) -> dict[str, int] | None:
        """Each backend's cached prefix of the prompt in tokens, from the registry; None
        when Redis is away (or slower than ``registry_timeout``)."""
        now = time.monotonic()
        if not self.health.up and now < self.health.retry_at:
            return None
        size = self.config.block_size
        if self.view is not None:
            return self._viewed(names, ids)
        assert ids.hashes is not None
        try:
            wanted = prefix_hashes(ids.hashes)
            router, gate = self.registry.ready()
            async with asyncio.timeout(self.config.registry_timeout), gate.turn():
                scores = await router.score(wanted, namespaces=names)
        except (RegistryError, TimeoutError) as exc:
            self.health.mark(False, exc)
            return None
        self.health.mark(True)
        return {n: cached_tokens(s.usable, size, ids.count) for n, s in scores.items()}

    def _viewed(self, names: list[str], ids: PromptIds) -> dict[str, int] | None:
        """``cached`` from the fleet view: memory work, no Redis round trip. None while
        the view is not ``fresh`` (it has not heard from Redis for ``STALE_S`` seconds and
        may hold what the engines no longer do)."""
        view = self.view
        assert view is not None
        if not self.registry_reachable():
            return None
        size = self.config.block_size
        assert ids.hashes is not None
        usable = view.match(ids.hashes, names, hybrid=self.registry.hybrid)
        self.health.mark(True)
        return {n: cached_tokens(blocks, size, ids.count) for n, blocks in usable.items()}

    def registry_reachable(self) -> bool:
        """Whether routing can use the registry now (with the fleet view: whether it is
        following Redis; else: whether the last routing call reached it)."""
        if self.view is not None:
            fresh = self.view.fresh()
            if fresh != self.health.up:
                self.health.mark(fresh, RegistryError("the fleet view is not following Redis"))
        return self.health.up

    async def choose(self, ids: PromptIds | None) -> tuple[list[Choice], str]:
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
        prompt = ids.count if ids else max(1, round(self.mean_prefill))
        root = ids.root if ids else None
        cached: dict[str, int] = {}
        outcome = "load"
        if self.config.policy == "prefix" and ids:
            found = await self.cached(names, ids)
            if found is None:
                outcome = "registry_away"
            else:
                cached = found
                if any(cached.values()):
                    outcome = "prefix"
        loads = {b.namespace: b.load for b in backends}
        now = time.monotonic()
        kin = self.kin.counts(root, now, self.config.rule.half_life)
        order = ranked(names, prompt, cached, loads, self.config.rule, now, kin)
        return order, outcome


# -- the proxy, in plain ASGI -----------------------------------------------------------

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

PROXIED = {"/v1/completions": False, "/v1/chat/completions": True}
"""The proxied paths, and whether each takes chat messages."""
JSON_HEADERS = [(b"content-type", b"application/json")]
HOP_BYTES = frozenset(name.encode() for name in HOP_HEADERS)


class Proxy:
    """The proxied routes' ASGI endpoint: ``proxy`` with the gateway's state and body
    limit."""

    paths = PROXIED

    def __init__(self, gateway: GatewayState, limit: int, too_large: bytes) -> None:
        self.gateway = gateway
        self.limit = limit
        self.too_large = too_large

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        await proxy(self, scope, receive, send, PROXIED[scope["path"]])


async def _respond(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    """A whole response: its head (with the body's length) and its body."""
    head = list(JSON_HEADERS if headers is None else headers)
    head.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


def _error(status: int, message: str) -> bytes:
    """The OpenAI error shape, for what the gateway itself answers."""
    content = error_content(status, ERROR_KIND[status], message, True)
    return json.dumps(content, separators=(",", ":")).encode()


async def _answer_error(send: Send, status: int, message: str) -> None:
    await _respond(send, status, _error(status, message))


async def _read_body(scope: Message, receive: Receive, limit: int) -> bytes | int | None:
    """The request's body; None when the client left first; 413 when it is over
    ``limit`` bytes (by its Content-Length, or counted as it arrives)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            if value.isdigit() and int(value) > limit:
                return 413
            break
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return 413
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def proxy(front: Proxy, scope: Message, receive: Receive, send: Send, chat: bool) -> None:
    """One proxied request: read, tokenize, choose, forward, answer."""
    arrived = time.perf_counter()
    state = front.gateway
    raw = await _read_body(scope, receive, front.limit)
    if raw is None:  # gone mid-body, or stopped by the body deadline (answered 408)
        return
    if raw == 413:
        await _respond(send, 413, front.too_large)
        return
    assert isinstance(raw, bytes)
    size = state.config.block_size
    routed = state.config.policy != "round-robin"
    hashed = state.config.policy == "prefix"
    try:  # a large body in the helper process: never parsed on the loop
        body, ids = await state.parser.parse(
            raw, chat, state.max_tokens, size if routed else None, hashed
        )
        if not state.backends:
            await _answer_error(send, 503, "no backend is configured or announced")
            return
        if routed and ids is None:
            tokens = await prompt_tokens(state.tokenizer, body, chat)
            ids = None if tokens is None else await prompt_ids(tokens, size, hashed)
    except BadBody as refused:  # not JSON, or a prompt over the model's length
        await _answer_error(send, 400, str(refused))
        return
    order, outcome = await state.choose(ids)
    if state.metrics.on:
        state.metrics.routed_as[outcome].inc()
    watch = _ClientWatch(receive)
    try:
        await _forward(state, scope, send, body, raw, order, ids, arrived, watch)
    except asyncio.CancelledError:
        if not watch.left:
            raise  # the server is stopping
        watch.uncancel()  # the client left: nobody to answer
    finally:
        watch.stop()


class _ClientWatch:
    """Cancels the request's task when its client disconnects (until ``stop``): while
    the gateway waits for a backend's reply, nothing else would notice (vLLM sends
    nothing, not even headers, until a non-streamed completion is done), and while it
    streams, a chunk sent to a client that left is dropped without a word."""

    def __init__(self, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        self.left = False
        self.stopped = False
        self.gone = asyncio.ensure_future(_disconnected(receive))
        self.gone.add_done_callback(self._left)

    def _left(self, gone: asyncio.Future[None]) -> None:
        if not self.stopped and not gone.cancelled() and gone.exception() is None:
            self.left = True
            self.task.cancel()

    def uncancel(self) -> None:
        self.task.uncancel()

    def stop(self) -> None:
        """Before the response's last message (after it the server reads a disconnect)."""
        if not self.stopped:
            self.stopped = True
            self.gone.remove_done_callback(self._left)
            self.gone.cancel()


async def _disconnected(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _forward(
    state: GatewayState,
    scope: Message,
    send: Send,
    body: dict[str, Any],
    raw: bytes,
    order: list[Choice],
    ids: PromptIds | None,
    arrived: float,
    watch: _ClientWatch,
) -> None:
    """Send to the best backend, once more to the next best on a failure before its
    first byte; answer with the reply, or the error."""
    stream = body.get("stream") is True
    prompt = ids.count if ids else 0
    root = ids.root if ids else None
    headers = _forwarded(scope["headers"])
    query = scope.get("query_string", b"")
    path = scope["path"] + (f"?{query.decode('latin-1')}" if query else "")
    tried = 0
    for choice in order[:2]:  # the best, and once more on the next best
        backend = state.backends.get(choice.namespace)
        if backend is None:
            continue
        tried += 1
        prefill = max(0, prompt - choice.cached)
        _started(state, backend, prefill, choice, prompt, root)
        try:
            if state.metrics.on:
                state.metrics.overhead.observe(time.perf_counter() - arrived)
            upstream = await _send(state, scope["method"], backend, path, raw, headers)
        except _Failed as failed:
            _ended(state, backend, prefill)
            _count_error(state, backend, failed.kind)
            if failed.kind == "connect":
                backend.mark(state.metrics, up=False)
            if tried == 1 and len(order) > 1:
                if state.metrics.on:
                    backend.metrics(state.metrics).retries.inc()
                continue
            watch.stop()
            await _answer_error(send, 502, f"backend {backend.namespace!r} failed: {failed.kind}")
            return
        except asyncio.CancelledError:
            _ended(state, backend, prefill)
            if watch.left:
                _count_error(state, backend, "cancelled")
            raise
        end = _Ending(state, backend, prefill)
        try:
            if stream:
                await _streamed(state, backend, upstream, send, arrived, watch, end)
            else:
                await _whole(state, backend, upstream, send, arrived, watch, end)
        finally:
            end()
        return
    watch.stop()
    await _answer_error(send, 503, "no backend could take the request")


class _Failed(Exception):
    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


def _forwarded(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """The request's headers for the backend (ASGI gives names in lower case)."""
    return {
        name.decode("latin-1"): value.decode("latin-1")
        for name, value in raw
        if name not in HOP_BYTES
    }


def _started(
    state: GatewayState, backend: Backend, prefill: int, choice: Choice, prompt: int, root: Any
) -> None:
    load = backend.load
    load.in_flight += 1
    load.pending += prefill
    rule = state.config.rule
    now = time.monotonic()
    load.recent.add(float(prefill or 1), now, rule.half_life)
    state.kin.record(root, backend.namespace, now, rule.half_life)
    if prompt:
        state.mean_prefill += (prefill - state.mean_prefill) * 0.05
    state.exchange.nudge()
    if state.metrics.on:
        counted = backend.metrics(state.metrics)
        counted.in_flight.inc()
        if prompt:
            counted.prompt_tokens.inc(prompt)
            counted.predicted.inc(choice.cached)


def _ended(state: GatewayState, backend: Backend, prefill: int, nudge: bool = True) -> None:
    load = backend.load
    load.in_flight = max(0, load.in_flight - 1)
    load.pending = max(0.0, load.pending - prefill)
    if nudge:
        state.exchange.nudge()
    if state.metrics.on:
        backend.metrics(state.metrics).in_flight.dec()


class _Ending:
    """``_ended`` once: awaited (``told``) before a reply's last bytes go to the client,
    so the other replicas hear of the end before the client can send its next request
    to one of them; called again, as a no-op, when the exchange is over whatever
    happened (then the others are told in the background)."""

    def __init__(self, state: GatewayState, backend: Backend, prefill: int) -> None:
        self.state = state
        self.backend = backend
        self.prefill = prefill
        self.done = False

    def __call__(self) -> None:
        if not self.done:
            self.done = True
            _ended(self.state, self.backend, self.prefill)

    async def told(self) -> None:
        if not self.done:
            self.done = True
            _ended(self.state, self.backend, self.prefill, nudge=False)
            await self.state.exchange.tell_peers()


def _count_error(state: GatewayState, backend: Backend, kind: str) -> None:
    if state.metrics.on:
        counted = backend.metrics(state.metrics)
        counted.errors[kind].inc()
        counted.failed.inc()


async def _send(
    state: GatewayState,
    method: str,
    backend: Backend,
    path: str,
    raw: bytes,
    headers: dict[str, str],
) -> aiohttp.ClientResponse:
    """The backend's reply, its headers read (the body not yet); ``_Failed`` before."""
    assert state.http is not None
    try:
        return await state.http.request(
            method, backend.url + path, data=raw, headers=headers, allow_redirects=False
        )
    except aiohttp.ClientConnectorError:
        raise _Failed("connect") from None
    except TimeoutError:
        raise _Failed("timeout") from None
    except aiohttp.ClientError:
        raise _Failed("protocol") from None


def _reply_headers(upstream: aiohttp.ClientResponse) -> dict[str, str]:
    return {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS}


def _raw_reply_headers(upstream: aiohttp.ClientResponse) -> list[tuple[bytes, bytes]]:
    return [(k.lower(), v) for k, v in upstream.raw_headers if k.lower() not in HOP_BYTES]


async def _whole(
    state: GatewayState,
    backend: Backend,
    upstream: aiohttp.ClientResponse,
    send: Send,
    arrived: float,
    watch: _ClientWatch,
    end: _Ending,
) -> None:
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
        watch.stop()
        await _answer_error(send, 502, f"backend {backend.namespace!r} broke off its reply")
        return
    upstream.release()
    watch.stop()
    await end.told()
    _answered(state, backend, upstream.status, arrived, first_byte=True)
    await _respond(send, upstream.status, content, _raw_reply_headers(upstream))


def _answered(
    state: GatewayState, backend: Backend, status: int, arrived: float, *, first_byte: bool
) -> None:
    if not state.metrics.on:
        return
    took = time.perf_counter() - arrived
    counted = backend.metrics(state.metrics)
    if first_byte:
        counted.first_byte.observe(took)
    counted.latency.observe(took)
    if status >= 500:
        counted.errors["status"].inc()
        counted.failed.inc()
    else:
        counted.ok.inc()


async def _streamed(
    state: GatewayState,
    backend: Backend,
    upstream: aiohttp.ClientResponse,
    send: Send,
    arrived: float,
    watch: _ClientWatch,
    end: _Ending,
) -> None:
    """The backend's chunks as they come; a client that leaves closes the upstream
    (``_ClientWatch`` cancels this task); a reply broken off ends with an error event."""
    events = upstream.headers.get("content-type", "").startswith("text/event-stream")
    complete = broken = False
    try:
        await send(
            {
                "type": "http.response.start",
                "status": upstream.status,
                "headers": _raw_reply_headers(upstream),
            }
        )
        first = True
        try:
            async for chunk in upstream.content.iter_any():
                if first and chunk:
                    first = False
                    if state.metrics.on:
                        backend.metrics(state.metrics).first_byte.observe(
                            time.perf_counter() - arrived
                        )
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            complete = True
        except (aiohttp.ClientError, TimeoutError):
            broken = True
            _count_error(state, backend, "protocol")
        watch.stop()
        await end.told()
        last = _stream_error(backend) if broken and events else b""
        await send({"type": "http.response.body", "body": last})  # say so, as engines do
    finally:
        if complete:
            upstream.release()
        else:
            upstream.close()
        if complete:
            _answered(state, backend, upstream.status, arrived, first_byte=False)
        elif not broken and state.metrics.on:
            backend.metrics(state.metrics).errors["cancelled"].inc()


def _stream_error(backend: Backend) -> bytes:
    """A server-sent event saying the backend broke off (OpenAI's error shape)."""
    return b"data: " + _error(502, f"backend {backend.namespace!r} broke off") + b"\n\n"


def gateway_state(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    return state


def openai_error(status: int, message: str) -> JSONResponse:
    """The OpenAI error shape, for what the gateway itself answers."""
    return JSONResponse(error_content(status, ERROR_KIND[status], message, True), status)


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
