"""``AsyncPrefixRouter``: ``PrefixRouter`` on ``redis.asyncio``, for asyncio services.

The same rules as the thread-safe router (``registry.routing.routing``), through the
plan both share (``registry.routing.plan``): a started fleet view scored from while it
follows Redis, else the same checks of the prompt and the namespaces, the same
``lua/score.lua`` (by the same SHA, reloaded on NOSCRIPT), the same live-node listing
(``lua/live_nodes.lua``, each member checked against its own lease as
``registry.fleet.leases`` says), the same ``NodeScore`` and the same tie-breaking in ``best``;
only the round trips are awaited. One ``score`` from Redis
is one pipeline: one round trip on a standalone server; on Redis Cluster
(``redis.asyncio.cluster.RedisCluster``) redis-py's async cluster pipeline sends each
primary its share at the same time. Every Redis fault is translated by
``registry.core.errors.translate``, as on the sync side.

Its scripts run through ``registry.transport.scripts.AsyncScriptRunner``, the asyncio
twin of the sync router's ``ScriptRunner``: each script round (``score``,
``live_nodes``) is counted and timed by its outcome when an observer listens
(``registry.core.observe``; ``registry.metrics`` is one), with the same operation names
and outcomes.

A router never writes and never claims an epoch. Use it from one event loop (the loop
its client belongs to). One call holds at most one connection per Redis node at a time,
so at most ``max_connections`` calls at once never exhaust a pool of that size.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from registry.core import observe
from registry.core.errors import REDIS_ERRORS, translate
from registry.core.keys import (
    engines_key,
    gateway_load_channel,
    gateway_load_key,
    node_index_key,
)
from registry.core.scores import NodeScore
from registry.core.validation import text
from registry.fleet.leases import CHECK_BATCH, LeaseBook, Listing, lease_command
from registry.fleet.membership import engine_table, warn_invalid
from registry.routing.plan import RouterBase, chosen_namespaces, pack_hashes
from registry.transport.scripts import AsyncScriptRunner

ROUTER_SCRIPTS = ("score", "live_nodes")
"""The scripts a router runs (``load`` sends them ahead of the first call)."""


class AsyncPrefixRouter(RouterBase):
    """Scores live nodes for a prompt's block hashes and picks the best one (asyncio)."""

    def _attach(self, client: Any, key_prefix: str) -> None:
        """The script runner on the asyncio client, and the node index's key."""
        self.index_key = node_index_key(key_prefix)
        self.skipped = 0  # invalid node-index members skipped so far
        self.leases = LeaseBook(key_prefix)  # what was read of each member's own lease
        self._runner = AsyncScriptRunner(client)
        self._warned: set[str] = set()

    async def load(self) -> None:
        """SCRIPT LOAD the router's scripts now, so the first calls need no reload."""
        await self._runner.load(ROUTER_SCRIPTS, context="loading the router's scripts")

    async def scripts_loaded(self) -> bool:
        """Whether the server holds the router's scripts (SCRIPT EXISTS)."""
        return await self._runner.loaded(ROUTER_SCRIPTS, context="checking the router's scripts")

    async def live_nodes(self) -> list[str]:
        """Namespaces with a live lease (cached for ``live_cache_ttl`` seconds; a node
        that died within that time is still never scored: each score checks its lease)."""
        cached = self._cached_live()
        if cached is not None:
            return cached
        listing = await self._listing()
        await self._check(listing, self.leases.due(listing))
        names = self.leases.split(listing)[0]
        self._remember_live(names)
        return names

    async def score(
        self, hashes: Sequence[int], namespaces: Iterable[str] | None = None
    ) -> dict[str, NodeScore]:
        """Per live namespace (all, or those given), the cached prefix of ``hashes``."""
        observer = observe.current
        if observer is None:
            return await self._score(hashes, namespaces)
        started = time.perf_counter()
        try:
            return await self._score(hashes, namespaces)
        finally:
            observer.score_took(time.perf_counter() - started)

    async def _score(
        self, hashes: Sequence[int], namespaces: Iterable[str] | None
    ) -> dict[str, NodeScore]:
        viewed = self._viewed(hashes, namespaces)
        if viewed is not None:
            return viewed
        packed = pack_hashes(hashes)
        names = await self.live_nodes() if namespaces is None else chosen_namespaces(namespaces)
        if not names:
            return {}
        calls, context = self._score_round(names, packed)
        return self._scores(names, await self._runner.run_many("score", calls, context=context))

    async def best(
        self,
        hashes: Sequence[int],
        load: Mapping[str, float] | None = None,
        namespaces: Iterable[str] | None = None,
    ) -> str | None:
        """The live node with the longest usable prefix; ties go to the lowest ``load``
        (missing = 0), then to the first namespace in sort order. None if none is live.
        Raises ``TypeError`` or ``ValueError`` when a load it weighs is not a number or
        is NaN."""
        if self._choosing_from_view():
            return self._best_viewed(hashes, load, namespaces)
        return (await self.decide(hashes, load, namespaces))[1]

    async def decide(
        self,
        hashes: Sequence[int],
        load: Mapping[str, float] | None = None,
        namespaces: Iterable[str] | None = None,
    ) -> tuple[dict[str, NodeScore], str | None]:
        """``score`` and ``best`` from one round of scripts: the scores and the choice."""
        scores = await self.score(hashes, namespaces)
        return scores, self._chosen(scores, load, hashes)

    # -- what gateways share (pcr gateway) ----------------------------------------------

    async def engines(self) -> dict[str, str]:
        """Namespace -> engine URL, as announced (``NodeIndex.announce_engine``)."""
        key = engines_key(self.key_prefix)
        try:
            table = await self.client.hgetall(key)
        except REDIS_ERRORS as exc:
            raise (translate(exc, f"engine table {key!r}: HGETALL", write=False) or exc) from exc
        return engine_table(table)

    async def exchange_load(self, replica: str, ttl_ms: int, payload: str) -> dict[str, str]:
        """Publish one gateway replica's load (expiring after ``ttl_ms``, and on the
        channel ``gateway_load_channel``) and read the other live replicas' (``lua/
        gateway_load.lua``): replica id -> payload, one round trip."""
        key = gateway_load_key(self.key_prefix)
        channel = gateway_load_channel(self.key_prefix)
        replies = await self._runner.run(
            "gateway_load",
            (key,),
            (replica, ttl_ms, payload, channel),
            context=f"gateway load {key!r}",
            write=False,
        )
        texts = [text(r) for r in replies]
        return dict(zip(texts[0::2], texts[1::2], strict=False))

    # -- the node index ------------------------------------------------------------------

    async def _listing(self) -> Listing:
        listing = self.leases.parse(
            await self._runner.run(
                "live_nodes",
                (self.index_key,),
                ("list",),
                context=f"node index {self.index_key!r}",
                write=False,
            )
        )
        for name in listing.refused:
            self._warn(name)
        bad = listing.skipped + len(listing.refused)
        if bad:
            self.skipped += bad
            self._warn(f"{bad} invalid members")
        return listing

    async def _check(self, listing: Listing, names: list[str]) -> None:
        """Read ``names``' own leases (``CHECK_BATCH`` per pipeline) into ``leases``."""
        for first in range(0, len(names), CHECK_BATCH):
            part = names[first : first + CHECK_BATCH]
            what = f"node index {self.index_key!r}: reading {len(part)} leases"
            try:
                pipe = self.client.pipeline(transaction=False)
                for name in part:
                    pipe.execute_command(*lease_command(self.leases.meta_key(name)))
                replies = await pipe.execute(raise_on_error=False)
            except REDIS_ERRORS as exc:
                raise (translate(exc, what, write=False) or exc) from exc
            for reply in replies:
                if isinstance(reply, Exception):
                    raise (translate(reply, what, write=False) or reply) from reply
            self.leases.learn(listing, part, replies)

    def _warn(self, what: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            warn_invalid(self.index_key, what)
