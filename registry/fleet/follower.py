"""The fleet view's follower: the thread that keeps a ``HolderTable`` equal to the maps
in Redis, and the reads it makes.

It subscribes to every namespace's channel (one pattern, ``pcr:{*}:changes``; a record
that names another namespace than its channel's is skipped), loads each namespace it
follows in one read-only script (``lua/fleet_snapshot.lua``: both maps' hashes and the
number of the last record they include, ``LOAD_BATCH`` namespaces a round trip), and
applies the records after it. A number skipped, a new incarnation, a reconnect or the
periodic resync make it load the namespace (or every namespace) again. The live
namespaces come from the node index, read every ``live_cache_ttl`` seconds (or at once
when ``sync`` asks), each member checked against its own lease as the routers do
(``NodeIndex.live``: a member someone else wrote or pushed back changes nothing).

A follower built without a client (a detached view's) reads nothing: a record that
needs the server raises ``RegistryError``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from registry.core.errors import REDIS_ERRORS, RegistryError, translate
from registry.core.keys import NamespaceKeys, fleet_changes_pattern
from registry.fleet.holders import HolderTable, Position, ViewCounts, as_bytes
from registry.fleet.membership import NodeIndex
from registry.transport.scripts import ScriptRunner

log = logging.getLogger(__name__)

LOAD_BATCH = 64
"""Namespaces loaded per round trip (``fleet_snapshot``), at a cold start or a resync."""
PAGED_ABOVE = 20_000
"""Entries (both maps) above which a namespace is loaded in pages (``HSCAN``) instead of
one ``fleet_snapshot`` call: one script reading a million entries holds the server for
seconds, and outlasts the client's read timeout, so the load failed and started again
for good (issue 43)."""
PAGE = 1_000
"""Entries asked for per ``HSCAN`` call of a paged load."""


class RecordFollower:
    """Follows the change records of every namespace into ``table`` in a daemon thread
    (``start``), loading namespaces where records do not suffice; says how far it got
    (``ready``, ``live_read_at``, ``changed``) for the view's ``fresh`` and ``sync``."""

    def __init__(
        self,
        client: Any,
        key_prefix: str,
        table: HolderTable,
        counts: ViewCounts,
        *,
        live_cache_ttl: float,
        resync_interval: float,
    ) -> None:
        self.client = client
        self.key_prefix = key_prefix
        self.pattern = fleet_changes_pattern(key_prefix)
        self.table = table
        self.counts = counts
        self.live_cache_ttl = live_cache_ttl
        self.resync_interval = resync_interval
        self.ready = threading.Event()  # set once subscribed and loaded
        self.changed = threading.Condition()  # notified after each round of work
        self.read_live = threading.Event()  # sync() asks for the live namespaces now
        self.live_read_at = float("-inf")  # when the live namespaces were last read
        self._channel_start = f"{key_prefix}:{{".encode()
        self._runner: ScriptRunner | None = None
        self._index: NodeIndex | None = None
        if client is not None:
            self._runner = ScriptRunner(client)
            self._index = NodeIndex(client, key_prefix)
        self._keys: dict[str, NamespaceKeys] = {}
        self._away = False  # said that it stopped following Redis
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pubsub: Any = None

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Follow in a daemon thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._follow, name="fleet-view", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop following (the table keeps what it holds)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        if self._pubsub is not None:
            with contextlib.suppress(*REDIS_ERRORS):
                self._pubsub.close()

    # -- the reads ---------------------------------------------------------------------

    def apply(self, record: Any) -> None:
        """Apply one change record, loading its namespace where the record says too
        little (a gap, a new incarnation, a namespace not held yet, ``L``)."""
        again = self.table.apply(record)
        if again is not None:
            self.load([again])

    def load(self, names: Sequence[str]) -> None:
        """Read ``names`` from their maps (``LOAD_BATCH`` per round trip) and hold
        exactly that, at the record number it includes."""
        for first in range(0, len(names), LOAD_BATCH):
            part = names[first : first + LOAD_BATCH]
            large = self._large(part)
            for name in large:
                self.table.hold(name, self._paged(name))
            part = [n for n in part if n not in large]
            if not part:
                continue
            calls = []
            for name in part:
                keys = self._keys_of(name)
                calls.append(((keys.kv, keys.mamba, keys.meta), ()))
            replies = self._server()[0].run_many(
                "fleet_snapshot", calls, context="loading the fleet view", write=False
            )
            for name, reply in zip(part, replies, strict=True):
                self.table.hold(name, reply)
        self._notify()

    def _large(self, names: Sequence[str]) -> set[str]:
        """Those of ``names`` whose maps hold more than ``PAGED_ABOVE`` entries."""
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            keys = self._keys_of(name)
            pipe.hlen(keys.kv)
            pipe.hlen(keys.mamba)
        sizes = self._read(pipe.execute, "fleet view: the sizes of the namespaces to load")
        return {
            name
            for i, name in enumerate(names)
            if int(sizes[2 * i]) + int(sizes[2 * i + 1]) > PAGED_ABOVE
        }

    def _paged(self, name: str) -> list[Any]:
        """A large namespace read as ``fleet_snapshot`` reads it (its reply's shape), in
        pages: the record number first, then each map with ``HSCAN``. A scan sees every
        entry that stays put while it runs; an entry added or removed meanwhile is named
        in a record numbered after the one read first, which the view applies next (a
        record gives each hash's state after its write), so the view converges on the
        maps as a snapshot would. Each call is short: nothing holds the server."""
        keys = self._keys_of(name)
        what = f"fleet view: loading {name!r} in pages"
        meta = self._read(
            lambda: self.client.hmget(keys.meta, "incarnation", "change_seq", "mamba_seen"), what
        )
        if not meta[0]:
            return [b"", b"0", b"", b"", b""]
        self.counts.paged_loads += 1
        maps = [
            b" ".join(
                as_bytes(field)
                for field, _ in self._read(
                    lambda key=key: list(self.client.hscan_iter(key, count=PAGE)), what
                )
            )
            for key in (keys.kv, keys.mamba)
        ]
        return [as_bytes(meta[0]), as_bytes(meta[1]) or b"0", as_bytes(meta[2]), *maps]

    @staticmethod
    def _read(call: Any, what: str) -> Any:
        """``call()``, its Redis faults as the registry's errors."""
        try:
            return call()
        except REDIS_ERRORS as exc:
            error = translate(exc, what)
            raise (error or exc) from exc

    def live(self) -> list[str]:
        """The live namespaces in the node index, read now."""
        return self._server()[1].live()

    def positions(self, names: list[str]) -> dict[str, Position]:
        """Each namespace's incarnation and last record number as Redis holds it now."""
        self._server()
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.hmget(self._keys_of(name).meta, "incarnation", "change_seq")
        try:
            replies = pipe.execute()
        except REDIS_ERRORS as exc:
            error = translate(exc, "fleet view: reading the change records' numbers")
            raise (error or exc) from exc
        pairs = zip(names, replies, strict=True)
        return {name: Position(as_bytes(inc), int(seq or 0)) for name, (inc, seq) in pairs}

    def refresh_live(self, again: Sequence[str] = ()) -> None:
        """Read the live namespaces; load those not followed yet (and ``again``)."""
        names = self.live()
        table = self.table
        unknown = sorted({n for n in names if not table.holds(n)}.union(again))
        if unknown:
            self.load(unknown)
        table.set_live(names)
        self.live_read_at = time.monotonic()
        self._notify()

    def _server(self) -> tuple[ScriptRunner, NodeIndex]:
        if self._runner is None or self._index is None:
            raise RegistryError("a detached fleet view has no server to read")
        return self._runner, self._index

    def _keys_of(self, name: str) -> NamespaceKeys:
        keys = self._keys.get(name)
        if keys is None:
            keys = self._keys[name] = NamespaceKeys(name, self.key_prefix)
        return keys

    def _notify(self) -> None:
        with self.changed:
            self.changed.notify_all()

    # -- following (its own thread) ----------------------------------------------------

    def _follow(self) -> None:
        delay = 0.05
        while not self._stop.is_set():
            try:
                self._subscribe_and_follow()
                return
            except (*REDIS_ERRORS, RegistryError) as exc:
                self.counts.errors += 1
                self.live_read_at = float("-inf")  # not following: not fresh
                # One warning when it stops following, not one per retry.
                say = log.debug if self._away else log.warning
                say("fleet view: %s; following again in %.2f s", exc, delay)
                self._away = True
            except Exception:  # a bug here must not leave the view stale for good
                self.counts.errors += 1
                self.live_read_at = float("-inf")
                log.exception("fleet view: unexpected error; following again in %.2f s", delay)
            self._stop.wait(delay)
            delay = min(delay * 2, 2.0)

    def _subscribe_and_follow(self) -> None:
        pubsub = self.client.pubsub()
        self._pubsub = pubsub
        try:
            pubsub.psubscribe(self.pattern)
            resync_at = time.monotonic() + self.resync_interval
            while not self._stop.is_set():
                self._drain(pubsub)
                now = time.monotonic()
                if self.ready.is_set() and (
                    now - self.live_read_at >= self.live_cache_ttl or self.read_live.is_set()
                ):
                    self.read_live.clear()
                    self.refresh_live()
                if now >= resync_at:
                    self.load(self.table.held_names())
                    resync_at = now + self.resync_interval
                self._notify()
        finally:
            self._pubsub = None
            with contextlib.suppress(*REDIS_ERRORS):
                pubsub.close()

    def _drain(self, pubsub: Any) -> None:
        """Handle what arrived (waiting a little for the first message)."""
        message = pubsub.get_message(timeout=0.1)
        while message is not None:
            kind = as_bytes(message.get("type"))
            if kind == b"pmessage":
                self._received(message.get("channel"), message["data"])
            elif kind == b"psubscribe":
                self._subscribed()
            message = pubsub.get_message(timeout=0)

    def _subscribed(self) -> None:
        """The subscription is (again) in place: the first time, or after redis-py
        reconnected by itself. Records may have been missed while it was not: everything
        held is read again, with the live namespaces. A record written meanwhile waits
        in the socket and is applied or skipped by its number."""
        self.counts.reconnects += 1
        self.refresh_live(again=self.table.held_names())
        if self._away:
            log.warning("fleet view: following Redis again")
            self._away = False
        self.ready.set()

    def _received(self, channel: Any, data: Any) -> None:
        """A record from the channel: applied only when the namespace it names is the
        channel's (a node user may publish on its own namespace's channel, never on
        another's: a record naming another is skipped)."""
        name = as_bytes(channel)
        start = self._channel_start
        if not (name.startswith(start) and name.endswith(b"}:changes")):
            return
        record = as_bytes(data)
        if record.partition(b" ")[0] != name[len(start) : -len(b"}:changes")]:
            self.counts.skipped += 1
            return
        self.apply(record)
