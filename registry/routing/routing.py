"""``PrefixRouter``: which live node already holds the longest prefix of a prompt.

Given a started fleet view (``registry.fleet.view.FleetView``), the router scores from
it: memory work, no round trip, the view following every namespace's change records
(it may lag a write by the time its record takes to arrive). Without one, or while the
view has not heard from Redis for ``registry.fleet.view.STALE_S`` seconds, it asks
Redis, the truth: one ``score`` costs one round trip per Redis node, a pipeline on a
standalone server; on Redis Cluster ``ScriptRunner.run_many`` groups the calls by the
primary serving their slot, writes to every primary, then reads every reply, so the
shards work at the same time (redis-py's cluster pipeline would first send a blocking
``COMMAND GETKEYS`` per call; it is used only when the slot map moved, to follow the
redirections). Each namespace's score is one script (``lua/score.lua``): a binary search
over the parent chain for the KV prefix, then (``hybrid`` routers only) the farthest
Mamba checkpoint inside it, at a cost bounded by the smaller of the namespace's Mamba
entries and the prefix, and -1 for a namespace without a live lease. The prompt's hashes
travel packed in one argument, encoded once for all namespaces.

A router never writes and never claims an epoch. It is thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from registry.core import observe
from registry.core.scores import NodeScore
from registry.fleet.membership import NodeIndex
from registry.routing.plan import RouterBase, chosen_namespaces, pack_hashes
from registry.transport.scripts import ScriptRunner


class PrefixRouter(RouterBase):
    """Scores live nodes for a prompt's block hashes and picks the best one."""

    def _attach(self, client: Any, key_prefix: str) -> None:
        """The node index listing live nodes, the script runner scoring them, and the
        lock over the live-node cache (the router is shared by threads)."""
        self._index = NodeIndex(client, key_prefix)
        self._runner = ScriptRunner(client)
        self._lock = threading.Lock()

    def live_nodes(self) -> list[str]:
        """Namespaces with a live lease (cached for ``live_cache_ttl`` seconds; a node
        that died within that time is still never scored: each score checks its lease)."""
        with self._lock:
            cached = self._cached_live()
        if cached is not None:
            return cached
        names = self._index.live()
        with self._lock:
            self._remember_live(names)
        return names

    def score(
        self, hashes: Sequence[int], namespaces: Iterable[str] | None = None
    ) -> dict[str, NodeScore]:
        """Per live namespace (all, or those given), the cached prefix of ``hashes``."""
        observer = observe.current
        if observer is not None:
            return observe.timed_score(observer, self._score, hashes, namespaces)
        return self._score(hashes, namespaces)

    def _score(
        self, hashes: Sequence[int], namespaces: Iterable[str] | None
    ) -> dict[str, NodeScore]:
        viewed = self._viewed(hashes, namespaces)
        if viewed is not None:
            return viewed
        packed = pack_hashes(hashes)
        names = self.live_nodes() if namespaces is None else chosen_namespaces(namespaces)
        if not names:
            return {}
        calls, context = self._score_round(names, packed)
        return self._scores(names, self._runner.run_many("score", calls, context=context))

    def best(
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
        return self._chosen(self.score(hashes, namespaces), load, hashes)
