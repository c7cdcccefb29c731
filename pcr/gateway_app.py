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
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.routing import Route

from pcr.gateway_balance import (
    POLICIES,
    REPLICA_ID,
    BackendLoad,
    BalanceRule,
    Choice,
    Kin,
    cached_tokens,
    prompt_root,
    ranked,
)
from pcr.gateway_metrics import BackendMetrics, GatewayMetrics
from pcr.gateway_tokens import PromptTokenizer, prompt_tokens
from pcr.http_errors import error_content
from registry.core.errors import RegistryError
from registry.core.hashing import block_hashes
from registry.core.keys import gateway_load_channel
from registry.core.validation import prefix_hashes
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
    _metrics: BackendMetrics | None = None

    def metrics(self, metrics: GatewayMetrics) -> BackendMetrics:
        """This backend's labelled collectors (looked up once, not per request)."""
        if self._metrics is None:
            self._metrics = metrics.backend(self.namespace)
        return self._metrics


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
        self.kin = Kin()  # per prompt root, the requests sent to each backend lately
        self.mean_prefill = 0.0
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self._peers: dict[str, _Peer] = {}
        """The other replicas' load: from each exchange, and as it changes (pushed)."""
        self._seq = time.time_ns() // 1000  # numbers this replica's published load (a
        # replica restarted under the same id continues above its old numbers)
        self._shared_at = 0.0
        self._exchanging = asyncio.Lock()
        self._sharing: asyncio.Task[None] | None = None
        self._share_again = False
        self._untold_until = 0.0  # replies wait for no exchange until then (Redis slow)
        self.view: FleetView | None = None

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
        await self._share_quietly()
        loops = [self._every(self.config.share_interval, self._tick)]
        if self.config.announced:
            loops.append(self._every(self.config.discover_interval, self._discover))
        loops.append(self._listen())
        if self.config.scrape_interval > 0:
            loops.append(self._every(self.config.scrape_interval, self._scrape))
        self._tasks = [asyncio.ensure_future(loop) for loop in loops]

    async def close(self) -> None:
        """Stop the background tasks (a cancellation can be lost inside redis-py's
        ``asyncio.wait_for`` on Python 3.11, so each is cancelled again until it ends, and
        the loops also stop at their flag), then the HTTP client."""
        self._stopping = True
        tasks = [*self._tasks, *([self._sharing] if self._sharing is not None else [])]
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
        """Publish this replica's load and take the others' (one round trip; the
        script also pushes it to the other replicas, ``_listen``). One exchange at a
        time, each sending the load as it is when it goes: an older one never lands
        after a newer one and overwrites it; one asked for while another waited to go
        is done by that one."""
        asked = time.monotonic()
        async with self._exchanging:
            if self._shared_at > asked:
                return  # an exchange that started after this was asked for sent it
            now = self._shared_at = time.monotonic()
            half_life = self.config.rule.half_life
            self._seq += 1
            mine = {
                "seq": self._seq,
                "load": {
                    ns: [
                        b.load.in_flight,
                        round(b.load.pending, 1),
                        round(b.load.recent.now(now, half_life), 1),
                    ]
                    for ns, b in self.backends.items()
                },
            }
            router, gate = self.registry.ready()
            try:
                async with asyncio.timeout(max(1.0, self.config.registry_timeout)), gate.turn():
                    others = await router.exchange_load(
                        self.replica, self._ttl_ms(), json.dumps(mine, separators=(",", ":"))
                    )
            except (RegistryError, TimeoutError) as exc:
                self._peers.clear()  # Redis away: balance on what this replica knows
                self._registry(False, exc)
            else:
                if not self.registry_up and time.monotonic() >= self.registry_retry_at:
                    self._registry(True)
                known = self._peers
                self._peers = {}
                for replica, payload in others.items():
                    peer = _peer(payload, now)
                    if peer is None:
                        continue
                    held = known.get(replica)
                    self._peers[replica] = (
                        held if held is not None and held.seq > peer.seq else peer
                    )
                for replica, held in known.items():  # pushed while the exchange was under way
                    if replica not in self._peers and held.received > now:
                        self._peers[replica] = held
            self._apply_peers()

    async def _tick(self) -> None:
        """The periodic exchange, unless a nudged one ran within half an interval."""
        self.registry_reachable()
        if time.monotonic() - self._shared_at >= self.config.share_interval / 2:
            await self._share()

    def _ttl_ms(self) -> int:
        """Entries live ten intervals (1 to 60 s)."""
        return max(1000, min(60_000, round(self.config.share_interval * 10_000)))

    def nudge(self) -> None:
        """Share now, in the background (a request started or ended): the other replicas
        see it as it happens, not at the next 100 ms tick. One exchange at a time; a
        nudge during one makes one more after it."""
        if self._stopping or (not self.registry_up and time.monotonic() < self.registry_retry_at):
            return  # Redis known away: the periodic exchange finds out when it is back
        if not self._peers:
            return  # nobody to tell; a replica that starts learns it at the next exchange
        if self._sharing is not None and not self._sharing.done():
            self._share_again = True
            return
        self._sharing = asyncio.ensure_future(self._share_nudged())

    async def tell_peers(self) -> None:
        """Share this replica's load now, when other replicas are known, and wait until
        Redis has it (at most ``registry_timeout``; the exchange goes on behind): a
        reply's end is then known to them before its client can send the next request to
        one of them, so two replicas choose as one would. Redis away or slower than that:
        not waited for again for a second."""
        if self._stopping or not self._peers or time.monotonic() < self._untold_until:
            return
        told = asyncio.ensure_future(self._share_quietly())
        done, _ = await asyncio.wait({told}, timeout=self.config.registry_timeout)
        if not done or not self.registry_up:
            self._untold_until = time.monotonic() + 1.0

    async def _share_quietly(self) -> None:
        with contextlib.suppress(Exception):  # the periodic exchange says why
            await self._share()

    async def _share_nudged(self) -> None:
        again = True
        while again and not self._stopping:
            self._share_again = False
            await self._share_quietly()
            again = self._share_again

    async def _listen(self) -> None:
        """The other replicas' load as they publish it (``lua/gateway_load.lua``
        pushes every entry it writes); reconnects while Redis is away."""
        channel = gateway_load_channel(self.registry.key_prefix)
        while not self._stopping:
            pubsub = None
            try:
                pubsub = self.registry.client.pubsub(ignore_subscribe_messages=True)
                await pubsub.subscribe(channel)
                while not self._stopping:
                    message = await pubsub.get_message(timeout=1.0)
                    if message is not None:
                        self._pushed(message.get("data"))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: the exchange says so; try again
                log.debug("gateway load channel: %s", type(exc).__name__)
                await asyncio.sleep(1.0)
            finally:
                if pubsub is not None:
                    with contextlib.suppress(Exception):
                        await pubsub.aclose()

    def _pushed(self, data: Any) -> None:
        text = data.decode("utf-8", "replace") if isinstance(data, bytes) else str(data)
        replica, _, payload = text.partition(" ")
        if not replica or replica == self.replica:
            return
        peer = _peer(payload, time.monotonic())
        held = self._peers.get(replica)
        if peer is not None and (held is None or peer.seq > held.seq):
            self._peers[replica] = peer
            self._apply_peers()

    def _apply_peers(self) -> None:
        """The other replicas' load summed per backend (entries older than the TTL, from
        a replica that stopped publishing, dropped)."""
        now = time.monotonic()
        ttl = self._ttl_ms() / 1000
        totals: dict[str, list[float]] = {}
        for replica in [r for r, p in self._peers.items() if now - p.received > ttl]:
            del self._peers[replica]
        for peer in self._peers.values():
            for ns, values in peer.load.items():
                total = totals.setdefault(ns, [0.0, 0.0, 0.0])
                for i in range(3):
                    total[i] += values[i]
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
        """Whether ``backend`` took a connection just now: one that refused is passed
        over for ``REFUSED_FOR`` seconds, one that answered (its /metrics) is a candidate
        again at once (an engine back from a restart gets requests from its next scrape)."""
        backend.up = up
        backend.refused_until = 0.0 if up else time.monotonic() + REFUSED_FOR
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
        if self.view is not None:
            return await self._viewed(names, tokens)
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

    async def _viewed(self, names: list[str], tokens: list[int]) -> dict[str, int] | None:
        """``cached`` from the fleet view: memory work, no Redis round trip. None while
        the view is not ``fresh`` (it has not heard from Redis for ``STALE_S`` seconds and
        may hold what the engines no longer do)."""
        view = self.view
        assert view is not None
        if not self.registry_reachable():
            return None
        size = self.config.block_size
        if len(tokens) > HASH_IN_LOOP:
            hashes = await asyncio.to_thread(block_hashes, tokens, size)
        else:
            hashes = block_hashes(tokens, size)
        usable = view.match(hashes, names, hybrid=self.registry.hybrid)
        self._registry(True)
        return {n: cached_tokens(blocks, size, len(tokens)) for n, blocks in usable.items()}

    def registry_reachable(self) -> bool:
        """Whether routing can use the registry now (with the fleet view: whether it is
        following Redis; else: whether the last routing call reached it)."""
        if self.view is not None:
            fresh = self.view.fresh()
            if fresh != self.registry_up:
                self._registry(fresh, RegistryError("the fleet view is not following Redis"))
        return self.registry_up

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

    async def choose(self, tokens: list[int] | None, root: Any = None) -> tuple[list[Choice], str]:
        """The backends in the order to try them, and the routing outcome (``root``: the
        prompt's ``prompt_root``)."""
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
        now = time.monotonic()
        kin = self.kin.counts(root, now, self.config.rule.half_life)
        order = ranked(names, prompt, cached, loads, self.config.rule, now, kin)
        return order, outcome


@dataclass(frozen=True)
class _Peer:
    """Another replica's load as last heard: its number, per backend ``[in flight,
    pending tokens, recent tokens]``, and when it was heard (this clock)."""

    seq: int
    load: dict[str, list[float]]
    received: float


def _peer(payload: str, received: float) -> _Peer | None:
    """A replica's published load, or None for a payload that is not one."""
    try:
        data = json.loads(payload)
        seq = data["seq"]
        load = {
            str(ns): [max(0.0, float(values[i])) for i in range(3)]
            for ns, values in data["load"].items()
        }
    except (ValueError, TypeError, KeyError, AttributeError, IndexError, RecursionError):
        return None
    if isinstance(seq, bool) or not isinstance(seq, int):
        return None
    if not all(math.isfinite(v) for values in load.values() for v in values):
        return None
    return _Peer(seq, load, received)


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
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        await _answer_error(send, 400, "the body is not JSON")
        return
    if not isinstance(body, dict):
        await _answer_error(send, 400, "the body must be a JSON object")
        return
    if not state.backends:
        await _answer_error(send, 503, "no backend is configured or announced")
        return
    tokens = (
        await prompt_tokens(state.tokenizer, body, chat)
        if state.config.policy != "round-robin"
        else None
    )
    root = prompt_root(tokens, state.config.block_size)
    order, outcome = await state.choose(tokens, root)
    if state.metrics.on:
        state.metrics.routed_as[outcome].inc()
    watch = _ClientWatch(receive)
    try:
        await _forward(state, scope, send, body, raw, order, tokens, root, arrived, watch)
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
    tokens: list[int] | None,
    root: Any,
    arrived: float,
    watch: _ClientWatch,
) -> None:
    """Send to the best backend, once more to the next best on a failure before its
    first byte; answer with the reply, or the error."""
    stream = body.get("stream") is True
    prompt = len(tokens) if tokens else 0
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
                state._mark(backend, up=False)
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
    state.nudge()
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
        state.nudge()
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
            await self.state.tell_peers()


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
    up = state.registry_reachable()
    body = {
        "status": "ok" if status == 200 else "unavailable",
        "registry": "reachable" if up else "away",
        "routing": state.config.policy if up else "load",
        "backends": backends,
        "in_flight": {
            b.namespace: {"here": b.load.in_flight, "other_replicas": b.load.remote_in_flight}
            for b in state.backends.values()
        },
    }
    return JSONResponse(body, status_code=status)


def add_gateway_routes(app: FastAPI, limit: int, too_large: bytes) -> Proxy:
    """The gateway's routes: the proxied ones as a plain ASGI endpoint (the body passes
    through as bytes: no FastAPI parsing or validation on the way), returned for the app
    to call before its own layers (``pcr.serve_app.ScoringApp.proxied``); ``too_large``
    is the 413 answer to a body over ``limit`` bytes."""
    endpoint = Proxy(app.state.gateway, limit, too_large)
    for path in PROXIED:
        app.router.routes.append(Route(path, endpoint, methods=["POST"]))
    app.add_route("/v1/models", models, methods=["GET"])
    app.add_route("/health", health, methods=["GET"])
    return endpoint
