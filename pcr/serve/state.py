"""What the scoring service holds while it runs: ``State`` (the Redis clients, the
router, the fleet view it scores from, made in the app's loop by its lifespan) and
``Gate``, which bounds how many requests use Redis at once."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import sys
import threading
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI

from registry import metrics
from registry.core import observe
from registry.core.errors import REDIS_ERRORS, RegistryError, RegistryUnavailable, translate
from registry.fleet.view import FleetView
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
                metrics.register_view(self.view)  # where the metrics are on
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
            metrics.unregister(self.view)
            await asyncio.to_thread(self.view.close)
        if self.client is not None:
            with contextlib.suppress(Exception):
                await self.client.aclose()
        if self.sync_client is not None:
            with contextlib.suppress(Exception):
                self.sync_client.close()


YOUNG_COLLECTION = 10_000
"""Allocations (less frees) between two young collections; CPython's default is 700.
Measured on the gateway at 64 connections: ~700 young collections per 5 s, 0.3 ms each,
walking the requests in flight: ~8% of its CPU."""


def settle_heap() -> None:
    """Everything made while starting (the imports: FastAPI, pydantic, and for the
    gateway transformers and torch, hundreds of thousands of objects) moved out of the
    garbage collector's reach: a full collection over them is a pause of a large part of
    a second, which a request now and then had to wait out. What requests make is still
    collected, less often (``YOUNG_COLLECTION``): a young collection walks what the
    requests in flight hold, whatever its size, so its cost is per collection more than
    per object."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_COLLECTION, *gc.get_threshold()[1:])
