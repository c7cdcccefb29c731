"""What the gateway holds while it runs (``GatewayState``): its backends and their load,
the HTTP client to the engines, the fleet view, the load exchange with other replicas and
the background loops; and how it chooses a backend for a request. ``EngineScraper`` reads
the engines' own queue and KV-cache usage from their ``/metrics`` in the background."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import aiohttp

from pcr.gateway.backends import Backend, engine_load
from pcr.gateway.balance import Choice, Kin, Reach, Weighed, cached_tokens
from pcr.gateway.config import GatewayConfig
from pcr.gateway.exchange import LoadExchange, RegistryHealth, discover
from pcr.gateway.metrics import GatewayMetrics
from pcr.gateway.models import REFRESH_S, ModelCatalog
from pcr.gateway.pending import Listed, PendingPrefixes, Sent, checkpoints
from pcr.gateway.replies import backend_auth
from pcr.gateway.tokens import BodyParser, PromptIds, PromptTokenizer
from pcr.gateway.upstream import Upstream
from pcr.web.tls import client_context
from registry.core.errors import RegistryError
from registry.core.validation import prefix_hashes
from registry.fleet.view import FleetView
from registry.routing.balance import NATIVE, BackendLoad, Decayed

DECIDE = getattr(NATIVE, "decide", None)
"""The C extension's decision in one call (``registry/routing/_weigh.c``), or None where
it was not built: ``GatewayState.choose`` then always takes its general path."""
NOTHING_PENDING: dict[str, Any] = {}


@dataclass(frozen=True)
class Scored:
    """One decision's prefixes: each backend's cached prefix in tokens and each hybrid
    node's longer KV prefix (``balance.ranked``'s ``cached`` and ``kv``), counting the
    blocks pending there (``pcr.gateway.pending``); the same in blocks (``listed``) and
    as the registry alone lists them (``registry``); ``alone``: ``cached`` and ``kv``
    without the pending blocks, where those changed them."""

    cached: dict[str, int]
    kv: dict[str, int]
    listed: Listed
    registry: Listed
    alone: tuple[dict[str, int], dict[str, int]] | None = None


log = logging.getLogger(__name__)

VIEW_START_S = 5.0
"""Seconds the gateway waits at start for its fleet view's first load."""
IDLE_TICK_S = 5.0
"""Seconds between the gateway's ticks while nothing is in flight or pending (else
``share_interval``), or sooner where the load exchange's keep-alive is due: the
registry's health and the gauges need no more while no request comes."""
IDLE_SCRAPE_S = 5.0
"""Seconds between two reads of the engines' ``/metrics`` while nothing is in flight or
pending (else ``scrape_interval``, where that is shorter)."""
IDLE_DISCOVER_S = 10.0
"""Seconds between two reads of the engines announced in Redis while nothing is in
flight or pending (else ``discover_interval``, where that is shorter)."""
SCRAPE_TIMEOUT = aiohttp.ClientTimeout(total=2.0)
UPSTREAM_KEEP_ALIVE_S = 4.0
"""Seconds the gateway keeps an idle connection to an engine: below the 5 s after which
vLLM's and SGLang's servers (uvicorn's default) close one, so the gateway closes first and
never sends a request into a connection the engine is closing."""


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
        self.registry = registry  # pcr.serve.state.State: the Redis client, router and gate
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
        self.models = ModelCatalog()  # what each backend serves (pcr.gateway.models)
        self.metrics = GatewayMetrics.get()
        self.http: aiohttp.ClientSession | None = None  # the gateway's own small reads
        self.upstream: Upstream | None = None  # proxied requests (pcr.gateway.upstream)
        self.health = RegistryHealth(self.metrics)
        # Requests in flight counted as cached where they were sent (prefix policy only)
        bounds = config.pending if config.policy == "prefix" else replace(config.pending, ttl=0)
        self.pending = PendingPrefixes(bounds)
        if self.pending.on:
            self.metrics.follow_pending(self.pending.blocks, lambda: list(self.backends))
        self.exchange = LoadExchange(
            self.replica,
            self.backends,
            registry,
            self.health,
            share_interval=config.share_interval,
            batch=config.share_batch,
            registry_timeout=config.registry_timeout,
            half_life=config.rule.half_life,
            pending=self.pending,
        )
        self.turn = 0  # round-robin position
        self.kin = Kin()  # per prompt root, the requests sent to each backend lately
        self.mean_prefill = 0.0
        self._tasks: list[asyncio.Task[None]] = []
        self._woken: asyncio.Future[None] | None = None  # set by the next request (arrived)
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
        config = self.config
        # https:// engines: verified against these CAs, this certificate shown
        tls = client_context(
            config.backend_ca_certs, config.backend_certfile, config.backend_keyfile
        )
        self.upstream = Upstream(
            connect_timeout=config.connect_timeout,
            read_timeout=config.upstream_timeout,
            keep_alive=UPSTREAM_KEEP_ALIVE_S,
            ssl_context=tls,
        )
        connector = aiohttp.TCPConnector(
            limit=0, keepalive_timeout=UPSTREAM_KEEP_ALIVE_S, ttl_dns_cache=60, ssl=tls
        )
        self.http = aiohttp.ClientSession(
            connector=connector,
            timeout=timeout,
            trust_env=False,
            auto_decompress=False,  # bytes pass through as the engine sent them
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
            headers=backend_auth(config.backend_api_key),  # /v1/models, /metrics
        )
        if self.config.view and self.config.policy == "prefix":
            client = await asyncio.to_thread(self.registry.sync)
            self.view = FleetView(client, self.registry.key_prefix)
            if self.pending.on:  # confirmations, evictions and restarts seen
                self.view.observe(self.pending.heard)
            self.metrics.follow_view(self.view, lambda: list(self.backends))
            self.view.start(timeout=None)
            # Its first load before the first request (at most VIEW_START_S: with Redis
            # away the gateway starts anyway, routing by load until the view follows).
            await asyncio.to_thread(self.view.ready.wait, VIEW_START_S)
        if self.config.announced:
            with contextlib.suppress(RegistryError, TimeoutError):
                await self._discover()
        # Announce this replica at once: the others learn of it from the push, it of
        # them from the reply (a replica tells its peers of its requests' starts and ends,
        # in batches, only once it knows of some).
        await self.exchange.share_quietly()
        await self.models.refresh(self.http, self.backends)
        # While no request is in flight or pending, the tick, the engines' scrape and the
        # discovery slow down (each wake-up of an idle process costs CPU), and the first
        # request after that wakes them at once (``arrived``).
        config = self.config
        loops = [self._every(config.share_interval, self._tick, idle=self._tick_idle)]
        loops.append(self._every(REFRESH_S, self._read_models))
        if config.announced:
            interval = config.discover_interval
            loops.append(self._every(interval, self._discover, idle=IDLE_DISCOVER_S))
        loops.append(self.exchange.listen())
        if config.scrape_interval > 0:
            scraper = EngineScraper(self.http, self.metrics)
            loops.append(
                self._every(
                    config.scrape_interval,
                    lambda: scraper.scrape(self.backends),
                    idle=IDLE_SCRAPE_S,
                    first=True,
                )
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
        if self.upstream is not None:
            await self.upstream.close()
        if self.http is not None:
            await self.http.close()

    async def _every(
        self,
        interval: float | Callable[[], float],
        step: Callable[[], Awaitable[None]],
        *,
        idle: float | Callable[[], float] | None = None,
        first: bool = False,
    ) -> None:
        """``step`` every ``interval`` seconds (a callable: asked before each wait); with
        ``idle`` (the same), every ``idle`` seconds (or ``interval``, where longer) while
        nothing is in flight or pending, a wait the next request cuts short
        (``arrived``); with ``first``, once at the start too."""
        waited = not first
        while not self._stopping:
            if waited:
                seconds = _seconds(interval)
                if idle is not None and not self._busy():
                    await self._idle_wait(max(seconds, _seconds(idle)))
                else:
                    await asyncio.sleep(seconds)
            waited = True
            try:
                await step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a background step never ends the loop
                log.debug("gateway background step failed: %s", type(exc).__name__)

    async def _idle_wait(self, seconds: float) -> None:
        """Up to ``seconds``, or until a request arrives."""
        woken = self._woken
        if woken is None or woken.done():
            woken = self._woken = asyncio.get_running_loop().create_future()
        await asyncio.wait((woken,), timeout=seconds)

    def arrived(self) -> None:
        """A request arrived: the loops waiting out an idle interval run their step now
        (the engines' queues read, the announced engines, the tick), so the decisions
        after a pause do not go on figures as old as that interval."""
        woken = self._woken
        if woken is not None:
            self._woken = None
            if not woken.done():
                woken.set_result(None)

    def _tick_idle(self) -> float:
        """The tick's wait while idle: ``IDLE_TICK_S``, or less where the load exchange's
        keep-alive is due sooner."""
        return min(IDLE_TICK_S, self.exchange.keep_alive_in())

    def _busy(self) -> bool:
        """Whether this replica has requests in flight, blocks pending or a change not
        told to the others yet."""
        if self.exchange.changed or any(b.load.in_flight for b in self.backends.values()):
            return True
        return self.pending.on and self.pending.busy()

    async def _discover(self) -> None:
        """Backends announced in Redis (``pcr bridge --engine-url``); one no longer
        announced is kept until its lease has run out (``pcr.gateway.exchange``)."""
        router, gate = self.registry.ready()
        async with asyncio.timeout(max(1.0, self.config.registry_timeout)), gate.turn():
            await discover(router, self.registry.client, self.registry.key_prefix, self.backends)

    async def _read_models(self) -> None:
        assert self.http is not None
        await self.models.refresh(self.http, self.backends)

    async def _tick(self) -> None:
        """The periodic exchange (``LoadExchange.tick``), after asking the fleet view
        whether it still follows Redis."""
        self.registry_reachable()
        if self.pending.on:
            self.pending.expire(time.monotonic())
        await self.exchange.tick()

    # -- choosing ------------------------------------------------------------------------

    def candidates(self, allowed: frozenset[str] | None = None) -> list[Backend]:
        """Backends not known to refuse connections; all of them when every one is.
        ``allowed``: only the backends of these namespaces (those serving the request's
        model, of a tenant's own)."""
        now = time.monotonic()
        backends = list(self.backends.values())
        if allowed is not None:
            backends = [b for b in backends if b.namespace in allowed]
        ready = [b for b in backends if b.refused_until <= now]
        return ready or backends

    async def cached(self, names: list[str], ids: PromptIds) -> Scored | None:
        """Each backend's cached prefix of the prompt, from the registry, with the
        blocks of requests in flight counted where they were sent (``Scored``); None
        when Redis is away (or slower than ``registry_timeout``)."""
        now = time.monotonic()
        if self._held_off(now):
            return None
        assert ids.hashes is not None
        if self.view is not None:
            listed = self._viewed(names, ids.hashes)
        else:
            listed = await self._asked(names, ids.hashes)
        if listed is None:
            return None
        cached, kv = self._tokens(listed, ids.count)
        if not self.pending.on:
            return Scored(cached, kv, listed, listed)
        self.pending.expire(now)
        extended = self.pending.extend(names, ids.hashes, listed)
        if extended is None:
            return Scored(cached, kv, listed, listed)
        more, more_kv = self._tokens(extended, ids.count)
        return Scored(more, more_kv, extended, listed, (cached, kv))

    def _tokens(self, listed: Listed, count: int) -> tuple[dict[str, int], dict[str, int]]:
        """``listed``'s prefixes in tokens: whole blocks, never the prompt's last token;
        the KV prefixes only where longer than the usable ones."""
        size = self.config.block_size
        if count <= 0:
            return dict.fromkeys(listed.usable, 0), {}
        # ``cached_tokens`` inline (a call per backend per request costs more than it)
        whole = (count - 1) // size
        usable = {
            n: (b if b < whole else whole) * size if b > 0 else 0 for n, b in listed.usable.items()
        }
        if not listed.kv:
            return usable, {}
        kv = {
            n: tokens
            for n, blocks in listed.kv.items()
            if (tokens := cached_tokens(blocks, size, count)) > usable.get(n, 0)
        }
        return usable, kv

    async def _asked(self, names: list[str], hashes: list[int]) -> Listed | None:
        """``cached`` from Redis (``--no-view``): one round trip. A node counts as a
        hybrid model's where the registry ranks it below its KV prefix or found Mamba
        state in it."""
        try:
            wanted = prefix_hashes(hashes)
            router, gate = self.registry.ready()
            async with asyncio.timeout(self.config.registry_timeout), gate.turn():
                scores = await router.score(wanted, namespaces=names)
        except (RegistryError, TimeoutError) as exc:
            self.health.mark(False, exc)
            return None
        self.health.mark(True)
        hybrid = self.registry.hybrid
        return Listed(
            {n: s.usable for n, s in scores.items()},
            {n: s.kv_prefix for n, s in scores.items() if s.kv_prefix > s.usable},
            frozenset(
                n
                for n, s in scores.items()
                if hybrid is True
                or (hybrid is None and (s.mamba_prefix > 0 or s.kv_prefix > s.usable))
            ),
        )

    def _viewed(self, names: list[str], hashes: list[int]) -> Listed | None:
        """``cached`` from the fleet view: memory work, no Redis round trip. None while
        the view is not ``fresh`` (it has not heard from Redis for ``STALE_S`` seconds and
        may hold what the engines no longer do). The KV prefixes are matched only where
        a namespace of the view is a hybrid model's."""
        view = self.view
        assert view is not None
        if not self.registry_reachable():
            return None
        hybrid = self.registry.hybrid
        matched = view.match(hashes, names, hybrid=hybrid)
        # registry_reachable left health up: marking it again would only set its gauge
        listed = Listed(matched.usable)  # resolved for this call alone: nothing shares it
        if hybrid is not False and view.any_hybrid():
            usable = listed.usable
            for n, blocks in view.match(hashes, names, hybrid=False).items():
                if blocks > usable.get(n, 0):
                    listed.kv[n] = blocks
            listed.hybrid = frozenset(names) if hybrid else view.hybrid_nodes()
        return listed

    def _held_off(self, now: float) -> bool:
        """Whether routing leaves the registry alone now: found away, not yet due for
        another try (``RegistryHealth.retry_at``)."""
        return not self.health.up and now < self.health.retry_at

    def registry_reachable(self) -> bool:
        """Whether routing can use the registry now (with the fleet view: whether it is
        following Redis; else: whether the last routing call reached it)."""
        if self.view is not None:
            fresh = self.view.fresh()
            if fresh != self.health.up:
                self.health.mark(fresh, RegistryError("the fleet view is not following Redis"))
        return self.health.up

    async def choose(
        self, ids: PromptIds | None, allowed: frozenset[str] | None = None
    ) -> tuple[list[Choice], str]:
        """The backends in the order to try them (of ``allowed``' namespaces alone, when
        given: no other backend is scored), and the routing outcome."""
        backends = self.candidates(allowed)
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
        kv: dict[str, int] = {}
        outcome = "load"
        found = None
        if self.config.policy == "prefix" and ids:
            decided = self._decided(backends, names, ids)
            if decided is not None:
                return decided
            found = await self.cached(names, ids)
            if found is None:
                outcome = "registry_away"
            else:
                cached, kv = found.cached, found.kv
                if any(cached.values()) or kv:
                    outcome = "prefix"
        loads = {b.namespace: b.load for b in backends}
        now = time.monotonic()
        rule = self.config.rule
        kin = self.kin.sums(root)  # decayed as the weighing reads them
        weighed = Weighed(names, prompt, loads, rule, now, kin)  # the loads read once
        order = weighed.ranked(cached, kv)
        if found is None:
            return order, outcome
        alone = found.alone  # what the pending blocks changed
        if alone is not None and self.metrics.on and weighed.leader(*alone) != order[0].namespace:
            self.metrics.pending_changed.inc()
        listed, registry = found.listed, found.registry
        for choice in order[:2]:  # what a request sent there leaves pending
            choice.reach = listed.reach(choice.namespace, registry)
        return order, outcome

    def _decided(
        self, backends: list[Backend], names: list[str], ids: PromptIds
    ) -> tuple[list[Choice], str] | None:
        """``choose``'s usual case in one C call (``DECIDE``): the fleet view following
        Redis, no hybrid model's node in it (this replica's pending blocks and the other
        replicas' chains counted as ``PendingPrefixes.extend`` counts them). The same
        order, costs, prefixes, ``reach`` and ``pending_changed`` count as the general
        path, which runs instead (None) wherever one of those does not hold."""
        view = self.view
        if view is None or DECIDE is None or ids.hashes is None:
            return None
        now = time.monotonic()
        if self._held_off(now):
            return None
        hybrid = self.registry.hybrid
        if hybrid is True or (hybrid is None and view.any_hybrid()):
            return None
        if not self.registry_reachable():
            return None
        pending = self.pending
        local: Mapping[str, Any] = NOTHING_PENDING
        far: Mapping[str, Any] = NOTHING_PENDING
        if pending.on:
            pending.expire(now)
            local, far = pending.tables()
        steps, slots = view.steps(ids.hashes, names)
        kinned, sent = self.kin.sums(ids.root) or (None, None)
        rule = self.config.rule
        made = DECIDE(
            backends, steps, slots, local, far, ids.hashes, now, ids.count,
            self.config.block_size, time.monotonic(), rule, kinned, sent, self.metrics.on,
            BackendLoad, Decayed, Choice, Reach,
        )  # fmt: skip
        if made is NotImplemented:
            return None
        order, prefix, moved = made
        if moved:
            self.metrics.pending_changed.inc()
        return order, "prefix" if prefix else "load"

    def sent(self, backend: Backend, choice: Choice, ids: PromptIds | None) -> Sent | None:
        """The prompt's blocks counted as arriving at ``backend`` (``pcr.gateway.pending``),
        with the Mamba states it leaves there on a hybrid model's node; None: nothing
        counts (pending off, no prompt hashed, nothing new)."""
        reach = choice.reach
        if not self.pending.on or reach is None or ids is None or not ids.hashes:
            return None
        size = self.config.block_size
        marks = checkpoints(True, ids.count, size, reach.kv, reach.usable) if reach.hybrid else ()
        name = backend.namespace
        # its pending_blocks gauge is read when /metrics is (``GatewayMetrics.follow_pending``)
        return self.pending.sent(name, ids.hashes, reach.held, marks, time.monotonic())

    def unsent(self, backend: Backend, record: Sent | None, ok: bool) -> None:
        """``record``'s request ended (``ok``: a success; its blocks count ``grace``
        seconds more, for the engine's events to arrive)."""
        if record is not None:
            self.pending.ended(record, ok, time.monotonic())


def _seconds(value: float | Callable[[], float]) -> float:
    """A number of seconds, or what a callable says now."""
    return value() if callable(value) else value
