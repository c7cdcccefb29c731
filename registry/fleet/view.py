"""The fleet's view in a router's own memory: which namespaces hold each block hash, fed
by the change records every write publishes in its own script.

Every script that changes a namespace's maps (the owner's writes, a mirror's batches,
``pcr bridge``'s batches, claims, clears, ``gc``) publishes one record on the
namespace's channel ``pcr:{NS}:changes`` in the same step (``lua/_prelude.lua``
``record_changes``): ``"<namespace> <incarnation> <seq> <parts>"``, numbered 1, 2, ...
within the namespace's incarnation by meta's ``change_seq``. A write refused by fencing
returns before it, so a fenced owner's writes never reach a view.

A ``FleetView`` composes the table of holders (``registry.fleet.holders``: block hash ->
holder bits, changed by records and snapshots, walked to match and score, no I/O) and
its follower (``registry.fleet.follower``: the subscription, gaps, resyncs and the
live namespaces read from the node index; the loads in a thread of their own,
``registry.fleet.snapshots``, so that a cold start or a resync never stops it following).
The maps in Redis stay the truth, the view a copy that may lag (by the time a record
takes to arrive) but converges.

It answers once every namespace live when it subscribed has loaded (``ready``; a
namespace that appears later is answered for once its own load lands, milliseconds
after the live read or the record that named it), and only while it is ``fresh``.

One thread (``start``) follows the channel; scoring may run on any thread, at the same
time (each lookup is one atomic dict operation; a decision may see a record half
applied, as a router may see the fleet between two writes).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

from registry.core.errors import RegistryUnavailable
from registry.core.keys import DEFAULT_KEY_PREFIX
from registry.core.scores import NodeScore
from registry.core.validation import is_number
from registry.fleet.follower import RecordFollower
from registry.fleet.holders import HolderTable, Observer, ViewCounts
from registry.fleet.matches import Matches

STALE_S = 3.0
"""Seconds without a read of the live namespaces, or without an answer to the ping it
sends on its subscription after each (which comes after every record published before
it), after which a view is not ``fresh``: routers ask Redis instead, the gateway routes
by load. It reads them every second, loads or not."""


class FleetView:
    """Block hash -> holders for the whole fleet, in this process, following the change
    records. ``start()`` it (or use it as a context manager), then ``score``."""

    def __init__(
        self,
        client: Any,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        *,
        live_cache_ttl: float = 1.0,
        resync_interval: float = 60.0,
    ) -> None:
        for name, value in (
            ("live_cache_ttl", live_cache_ttl),
            ("resync_interval", resync_interval),
        ):
            if not is_number(value) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds")
        self.client = client
        self.key_prefix = key_prefix
        self.live_cache_ttl = float(live_cache_ttl)
        self.resync_interval = float(resync_interval)
        self.counts = ViewCounts()
        self._table = HolderTable(self.counts)
        self._follower = RecordFollower(
            client,
            key_prefix,
            self._table,
            self.counts,
            live_cache_ttl=self.live_cache_ttl,
            resync_interval=self.resync_interval,
        )
        self.pattern = self._follower.pattern
        self.ready = self._follower.ready  # set once subscribed and loaded
        self.blocks = self._table.kv  # block hash -> KV holder bits (never replaced)
        self.mamba_blocks = self._table.mamba  # block hash -> Mamba holder bits

    # -- lifecycle ---------------------------------------------------------------------

    def start(self, timeout: float | None = 30.0) -> FleetView:
        """Follow the channel in a daemon thread; wait up to ``timeout`` seconds for the
        first load (None: do not wait). Raises ``RegistryUnavailable`` (retryable) when it
        did not finish."""
        self._follower.start()
        if timeout is not None and not self.ready.wait(timeout):
            raise RegistryUnavailable(f"the fleet view did not load within {timeout} s")
        return self

    def close(self) -> None:
        """Stop following (the view keeps what it holds)."""
        self._follower.close()

    def __enter__(self) -> FleetView:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.close()

    @classmethod
    def detached(cls, namespaces: Iterable[str], key_prefix: str = DEFAULT_KEY_PREFIX) -> FleetView:
        """A view that talks to no server: ``namespaces`` live and empty (incarnation
        ``0``, no record yet), changed only by ``apply``. For benchmarks and tests of the
        records themselves; a record that would need the server (a gap, ``L``) raises."""
        view = cls(None, key_prefix)
        for name in namespaces:
            view._table.add_empty(name)
        view._table.set_live(view._table.held_names())
        follower = view._follower
        follower.live_read_at = follower.pinged_at = float("inf")  # nothing to follow: fresh
        view.ready.set()
        return view

    def apply(self, record: bytes) -> None:
        """Apply one change record, as if it came from the channel."""
        self._follower.apply(record)

    def observe(self, observer: Observer) -> None:
        """Tell ``observer`` of every change to a namespace's entries from now on
        (``registry.fleet.holders.HeldChange``: entries added, removed, a map cleared),
        on the follower's thread, as each record or load is applied: a gateway drops the
        blocks it counted as arriving at an engine once the view lists them there, and
        those of an engine seen evicting them or restarting."""
        self._table.observers.append(observer)

    # -- scoring -----------------------------------------------------------------------

    def match(
        self,
        hashes: Sequence[int],
        namespaces: Iterable[str] | None = None,
        *,
        hybrid: bool | None = None,
    ) -> Matches:
        """The live namespaces (all, or those given) holding a prefix of ``hashes``,
        each with its usable prefix in blocks (what routing ranks by, ``hybrid`` as in
        ``PrefixRouter``): the cheap form of ``score``, one decision's answer. A
        read-only mapping, resolved to names when first read as one; ``top()`` gives the
        longest usable prefix and its holders without resolving the rest."""
        return self._table.match(hashes, namespaces, hybrid=hybrid)

    def steps(
        self, hashes: Sequence[int], namespaces: Iterable[str]
    ) -> tuple[list[tuple[int, int]], dict[str, int]]:
        """``match(hashes, namespaces, hybrid=False)`` unresolved, for a caller that
        resolves it itself (the gateway's decision in C, ``registry.routing.balance``):
        ``[(a KV prefix length in blocks, the bits of the slots whose prefix it is)]``,
        longest last, and ``namespace -> slot`` of the live namespaces the walk read."""
        return self._table.steps(hashes, namespaces)

    def any_hybrid(self) -> bool:
        """Whether any namespace the view holds is a hybrid model's (it held Mamba state
        since its owner's claim): where none is, a KV prefix is all a node reuses."""
        return self._table.any_hybrid()

    def hybrid_nodes(self) -> frozenset[str]:
        """The namespaces the view holds that are a hybrid model's (``any_hybrid``)."""
        return self._table.hybrid_names()

    def score(
        self,
        hashes: Sequence[int],
        namespaces: Iterable[str] | None = None,
        *,
        hybrid: bool | None = None,
        everyone: bool = False,
    ) -> dict[str, NodeScore]:
        """The live namespaces (all, or those given) holding a prefix of ``hashes``,
        scored as ``PrefixRouter`` scores them (``hybrid`` as there); with
        ``everyone`` the other live namespaces too, with 0."""
        return self._table.score(hashes, namespaces, hybrid=hybrid, everyone=everyone)

    def fresh(self, max_age: float = STALE_S) -> bool:
        """Whether the view has loaded, and within the last ``max_age`` seconds read the
        live namespaces and had its ping answered on the subscription, past every record
        published before it (it does both every ``live_cache_ttl``, a resync under way
        or not): a view that has not may hold what the engines no longer do. Not fresh
        after a reconnect until what it held has loaded again. The routers and the
        gateway score from it only while it is fresh by the default ``STALE_S``."""
        return self.ready.is_set() and self.age() <= max_age

    def resync(self) -> None:
        """Load every namespace held again, in the background, as the timer does every
        ``resync_interval``: the view keeps following and answering meanwhile."""
        self._follower.resync.set()
        self._follower.wake()

    def live_nodes(self) -> list[str]:
        """The live namespaces as the view last read them (sorted)."""
        return self._table.live_nodes()

    def held(self, namespace: str) -> tuple[frozenset[int], frozenset[int]] | None:
        """(KV hashes, Mamba hashes) the view holds for ``namespace``, or None."""
        return self._table.held(namespace)

    def entries(self, namespace: str) -> tuple[int, int] | None:
        """(KV entries, Mamba entries) the view holds for ``namespace``, or None where it
        holds none: once it has caught up, what ``PrefixCacheRegistry.info()`` counts in
        the namespace's maps (``kv_entries``, ``mamba_entries``). Counts only, no copy."""
        return self._table.entries(namespace)

    def age(self) -> float:
        """Seconds since the view last knew it followed Redis (``fresh`` compares this
        with ``STALE_S``); infinite before its first load, and after a reconnect until
        what it held has loaded again (0 for a detached view)."""
        return max(0.0, time.monotonic() - self._follower.followed_at())

    def memory(self) -> dict[str, int]:
        """Rough sizes: distinct hashes, (namespace, hash) pairs held."""
        return self._table.memory()

    # -- read your writes --------------------------------------------------------------

    def sync(
        self,
        namespaces: Iterable[str] | None = None,
        timeout: float = 10.0,
        *,
        live: bool = True,
    ) -> None:
        """Wait until the view has applied every write that returned before this call
        (to ``namespaces``, or to every namespace in the node index) and, with ``live``,
        has read the live namespaces since (``live=False``: only where one of them is not
        among the live ones it holds; for a caller in lockstep with known namespaces,
        one round trip less). Raises ``RegistryUnavailable`` when Redis did not answer,
        or the view did not catch up within ``timeout`` seconds."""
        if not isinstance(live, bool):
            raise TypeError("live must be True or False")
        follower, table = self._follower, self._table
        if namespaces is None:
            names = sorted(set(table.held_names()) | set(follower.live()))
        else:
            names = list(namespaces)
        targets = follower.positions(names)
        deadline = time.monotonic() + timeout
        asked = time.monotonic()
        if live or any(not table.is_live(n) for n in names):
            follower.read_live.set()
            follower.wake()
        else:
            asked = float("-inf")
        with follower.changed:
            while True:
                behind = [n for n, at in targets.items() if not table.reached(n, at)]
                if not behind and follower.live_read_at >= asked:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RegistryUnavailable(
                        f"the fleet view did not catch up within {timeout} s "
                        f"({len(behind)} namespaces behind)"
                    )
                follower.changed.wait(min(left, 0.05))
