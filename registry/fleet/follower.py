"""The fleet view's follower: the thread that keeps a ``HolderTable`` equal to the maps
in Redis, and the reads it makes.

It subscribes to every namespace's channel (one pattern, ``pcr:{*}:changes``; a record
that names another namespace than its channel's is skipped), has each namespace it
follows loaded (``registry.fleet.snapshots``: the maps' hashes and the number of the
last record they include, read by a loader thread of its own in batches), and applies
the records after it. A number skipped, a new incarnation, a reconnect or the periodic
resync have the namespace (or every namespace) loaded again.

Loads never stop the following. While a namespace's load is under way the follower
goes on applying its records to what it holds (a resync: the view stays as exact as it
was) and keeps each of them; the snapshot, once it lands, is held and those records
numbered after it applied again, in order, so a namespace that changed during its own
load ends equal to its maps (a number missing among them: loaded again). The live
namespaces come from the node index, read every ``live_cache_ttl`` seconds (or at once
when ``sync`` asks), each member checked against its own lease as the routers do
(``NodeIndex.live``: a member someone else wrote or pushed back changes nothing), and
each read is followed by a ``PING`` on the subscription, answered in order after every
record published before it: ``followed_at`` is the older of the last live read and the
last ping answered, the clock of ``FleetView.fresh``. It is not fresh before the first
load of every live namespace has landed (``ready``), nor after a reconnect until what
it held is loaded again: records may have been missed meanwhile.

A follower built without a client (a detached view's) reads nothing: a record that
needs the server raises ``RegistryError``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import select
import socket
import ssl
import threading
import time
from collections.abc import Sequence
from typing import Any

from registry.core.errors import REDIS_ERRORS, RegistryError, RegistryUnavailable, translate
from registry.core.keys import NamespaceKeys, fleet_changes_pattern
from registry.fleet.holders import HolderTable, Position, ViewCounts, as_bytes
from registry.fleet.membership import NodeIndex
from registry.fleet.snapshots import Landed, SnapshotLoader, SnapshotReader

log = logging.getLogger(__name__)

HOLD_ROUND_S = 0.05
"""Seconds of holding landed snapshots after which the follower reads the channel again
(a batch is held whole; a batch of ``LOAD_BATCH`` namespaces of 4,096 blocks takes tens
of ms)."""
POLL_LOADING_S = 0.005
"""How long the follower waits on the channel while loads are under way (a landed batch
also wakes it, where the subscription's socket can be waited on)."""
IDLE_WAIT_S = 1.0
"""The longest the follower waits on the channel with nothing due: a message, a landed
load, ``sync`` or ``resync`` wake it (its socket and a wake pipe waited on together), so
an idle view wakes about twice a second (the live read, whose reply comes with the
answer to the ping sent just before it)."""
POLL_S = 0.1
"""How long it waits where the socket cannot be waited on directly (TLS data buffered,
a client without one): then ``sync`` and the loads wait up to this."""
SILENT_S = 30.0
"""Seconds a ping on the subscription may go unanswered before the follower subscribes
again (records wait behind nothing that long on a live connection)."""
PING = b"pcr-view "
"""The heartbeat's prefix, followed by its number (a ``PING`` on the subscription)."""


class RecordFollower:
    """Follows the change records of every namespace into ``table`` in a daemon thread
    (``start``), loading namespaces where records do not suffice in a loader thread;
    says how far it got (``ready``, ``live_read_at``, ``followed_at``, ``changed``) for
    the view's ``fresh`` and ``sync``."""

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
        self.ready = threading.Event()  # every live namespace loaded, a ping answered
        self.changed = threading.Condition()  # notified after each round of work
        self.read_live = threading.Event()  # sync() asks for the live namespaces now
        self.resync = threading.Event()  # load every namespace again now (as the timer does)
        self.live_read_at = float("-inf")  # when the live namespaces were last read
        self.pinged_at = float("-inf")  # when the last ping answered was sent
        self._channel_start = f"{key_prefix}:{{".encode()
        self._index: NodeIndex | None = None
        self._loader: SnapshotLoader | None = None
        if client is not None:
            self._index = NodeIndex(client, key_prefix)
            self._loader = SnapshotLoader(SnapshotReader(client, key_prefix, counts))
        self._keys: dict[str, NamespaceKeys] = {}
        self._round = 0  # one per subscription: loads of an older one are dropped
        self._loading: dict[str, list[bytes]] = {}  # asked for: the records heard since
        self._awaited: set[str] = set()  # to land before the view is fresh (again)
        self._subscribed_at = float("-inf")  # a ping sent since must be answered, too
        self._live_names: list[str] = []  # the live namespaces as last read
        self._pings: dict[bytes, float] = {}  # heartbeats sent, not answered yet
        self._pinged = 0
        self._following = False  # subscribed: the live reads and pings go on
        self._away = False  # said that it stopped following Redis
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pubsub: Any = None
        self._wake_fds: tuple[int, int] | None = None  # (read, write) of the wake pipe
        self._wake_lock = threading.Lock()

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Follow in a daemon thread (once)."""
        if self._thread is None:
            read, write = os.pipe()
            os.set_blocking(read, False)
            os.set_blocking(write, False)
            self._wake_fds = (read, write)
            if self._loader is not None:
                self._loader.on_landed = self.wake
                self._loader.start()
            self._thread = threading.Thread(target=self._follow, name="fleet-view", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop following (the table keeps what it holds)."""
        self._stop.set()
        self.wake()
        if self._loader is not None:
            self._loader.close()
        if self._thread is not None:
            self._thread.join(10)
        if self._pubsub is not None:
            with contextlib.suppress(*REDIS_ERRORS):
                self._pubsub.close()
        if self._thread is None or not self._thread.is_alive():
            with self._wake_lock:  # never written to once closed (its number reused)
                fds, self._wake_fds = self._wake_fds, None
                for fd in fds or ():
                    os.close(fd)

    def wake(self) -> None:
        """Have the follower look at once at what was asked of it (``read_live``,
        ``resync``, a landed load, ``close``) rather than at its next message or due
        time. Any thread."""
        with self._wake_lock:
            fds = self._wake_fds
            if fds is not None:
                with contextlib.suppress(OSError):  # full: a wake is pending already
                    os.write(fds[1], b"w")

    def followed_at(self) -> float:
        """Since when the view is known to follow Redis: the older of the last live read
        and the last ping answered on the subscription; -inf while a load it must have
        (the first, or after a reconnect) is under way or the first ping since the
        subscription was made is not answered yet."""
        if self._awaited or self.pinged_at < self._subscribed_at:
            return float("-inf")
        return min(self.live_read_at, self.pinged_at)

    # -- the reads ---------------------------------------------------------------------

    def apply(self, record: Any) -> None:
        """Apply one change record, having its namespace loaded where the record says
        too little (a gap, a new incarnation, a namespace not held yet, ``L``). A record
        of a namespace being loaded is also kept, to be applied again after the
        snapshot."""
        record = as_bytes(record)
        heard = self._loading.get(record.partition(b" ")[0].decode("utf-8", "replace"))
        if heard is not None:
            heard.append(record)
            self.table.apply(record)  # a resync: what it holds follows meanwhile
            return
        again = self.table.apply(record)
        if again is not None:
            self.request([again])

    def request(self, names: Sequence[str]) -> None:
        """Have ``names`` loaded in the background (those not asked for already); their
        records are kept from now until the load lands."""
        loader = self._server()[1]
        wanted = [name for name in names if name not in self._loading]
        for name in wanted:
            self._loading[name] = []
        loader.request(wanted)

    def live(self) -> list[str]:
        """The live namespaces in the node index, read now."""
        return self._server()[0].live()

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
        """Read the live namespaces; have those not followed yet (and ``again``) loaded.
        A live namespace is answered for once its load has landed."""
        names = self.live()
        table = self.table
        unknown = sorted({n for n in names if not table.holds(n)}.union(again))
        if unknown:
            self.request(unknown)
        with self.changed:  # sync() sees a namespace held and live at once
            self._live_names = names
            table.set_live(names)
        self.live_read_at = time.monotonic()
        self._notify()

    def _server(self) -> tuple[NodeIndex, SnapshotLoader]:
        if self._index is None or self._loader is None:
            raise RegistryError("a detached fleet view has no server to read")
        return self._index, self._loader

    def _keys_of(self, name: str) -> NamespaceKeys:
        keys = self._keys.get(name)
        if keys is None:
            keys = self._keys[name] = NamespaceKeys(name, self.key_prefix)
        return keys

    def _notify(self) -> None:
        with self.changed:
            self.changed.notify_all()

    # -- the loads landing (the follower's thread) -------------------------------------

    def _land(self) -> None:
        """Hold the batches the loader read (for ``HOLD_ROUND_S`` at most), each
        namespace with the records heard since it was asked for applied after it."""
        loader = self._server()[1]
        until = time.monotonic() + HOLD_ROUND_S
        while time.monotonic() < until:
            try:
                landed = loader.landed.get_nowait()
            except queue.Empty:
                return
            self._hold(landed)

    def _hold(self, landed: Landed) -> None:
        if landed.round != self._round:
            return  # asked for before a reconnect: asked for again since
        if landed.fault is not None:
            raise landed.fault
        again = []
        with self.changed:  # sync() sees a namespace held and live at once
            for name, reply in landed.replies:
                heard = self._loading.pop(name, [])
                self.table.hold(name, reply)
                for record in heard:  # those the snapshot includes change nothing
                    if self.table.apply(record) is not None:
                        again.append(name)  # a number missing after the snapshot
                        break
            self.table.set_live(self._live_names)
        if again:
            self.request(again)
        self._awaited.difference_update(name for name, _ in landed.replies)
        self._settle()
        self._notify()

    def _settle(self) -> None:
        """Ready once the loads the first subscription asked for have landed and its
        first ping was answered: from then on, ``fresh``."""
        if not self.ready.is_set() and self.followed_at() > float("-inf"):
            self.ready.set()

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
        self._following = False
        try:
            pubsub.psubscribe(self.pattern)
            resync_at = time.monotonic() + self.resync_interval
            while not self._stop.is_set():
                self._drain(pubsub, self._wait(resync_at))
                self._land()
                now = time.monotonic()
                if self._following and (
                    now - self.live_read_at >= self.live_cache_ttl or self.read_live.is_set()
                ):
                    self.read_live.clear()
                    # the ping first: its answer arrives while the live read is under way
                    # and is read with it, one wake-up less a second for an idle view
                    self._ping(pubsub)
                    self.refresh_live()
                if now >= resync_at or self.resync.is_set():
                    self.resync.clear()
                    self.counts.resyncs += 1
                    self.request(self.table.held_names())
                    resync_at = now + self.resync_interval
                self._notify()
        finally:
            self._pubsub = None
            with contextlib.suppress(*REDIS_ERRORS):
                pubsub.close()

    def _wait(self, resync_at: float) -> float:
        """How long to wait for the next message: briefly while loads are under way,
        else until the next live read or resync is due (``IDLE_WAIT_S`` at most)."""
        if self._loading:
            return POLL_LOADING_S
        now = time.monotonic()
        due = resync_at
        if self._following:
            due = min(due, self.live_read_at + self.live_cache_ttl)
        if self.resync.is_set() or (self._following and self.read_live.is_set()):
            return 0.0  # asked for now (a live read only once subscribed: never a spin)
        return min(max(due - now, 0.0), IDLE_WAIT_S)

    def _drain(self, pubsub: Any, wait: float) -> None:
        """Handle what arrived, waiting up to ``wait`` seconds for the first message
        (or a wake)."""
        message = pubsub.get_message(timeout=0)
        if message is None and wait > 0:
            message = self._next(pubsub, wait)
        while message is not None:
            kind = as_bytes(message.get("type"))
            if kind == b"pmessage":
                self._received(message.get("channel"), message["data"])
            elif kind == b"pong":
                self._answered(as_bytes(message.get("data")))
            elif kind == b"psubscribe":
                self._subscribed(pubsub)
            message = pubsub.get_message(timeout=0)

    def _next(self, pubsub: Any, wait: float) -> Any:
        """The next message within ``wait`` seconds, or None (also when woken): the
        subscription's socket and the wake pipe waited on together. Nothing complete
        is buffered in the client here (``get_message(timeout=0)`` returned None), so
        the socket says when one arrives; where it cannot be waited on, a short poll."""
        sock = getattr(getattr(pubsub, "connection", None), "_sock", None)
        fds = self._wake_fds
        if (
            fds is None
            or not isinstance(sock, socket.socket)  # none yet, or a stand-in (fakeredis)
            or (isinstance(sock, ssl.SSLSocket) and sock.pending())
        ):
            return pubsub.get_message(timeout=min(wait, POLL_S))
        try:
            readable, _, _ = select.select([sock.fileno(), fds[0]], [], [], wait)
        except (OSError, ValueError):  # closed under it: the read says why
            return pubsub.get_message(timeout=min(wait, POLL_S))
        if fds[0] in readable:
            with contextlib.suppress(OSError):
                os.read(fds[0], 4096)
        return pubsub.get_message(timeout=0)

    def _ping(self, pubsub: Any) -> None:
        """A heartbeat on the subscription: its answer comes after every record
        published before it. One unanswered for ``SILENT_S`` seconds (a connection
        that died without a word) has it subscribe again."""
        oldest = min(self._pings.values(), default=None)
        if oldest is not None and time.monotonic() - oldest > SILENT_S:
            raise RegistryUnavailable(
                f"fleet view: the subscription answered no ping for {SILENT_S:.0f} s"
            )
        self._pinged += 1
        token = PING + str(self._pinged).encode()
        self._pings[token] = time.monotonic()
        pubsub.ping(token)

    def _answered(self, token: bytes) -> None:
        sent = self._pings.pop(token, None)
        if sent is None:
            return  # not ours (or of a subscription before)
        self.pinged_at = max(self.pinged_at, sent)
        for older in [t for t, at in self._pings.items() if at <= sent]:
            del self._pings[older]  # answered in order: one lost with its connection
        self._settle()

    def _subscribed(self, pubsub: Any) -> None:
        """The subscription is (again) in place: the first time, or after redis-py
        reconnected by itself. Records may have been missed while it was not: everything
        held is loaded again, with the live namespaces, and the view is not fresh until
        those loads have landed and a ping sent now is answered. A record written
        meanwhile is kept and applied after its namespace's snapshot, or skipped by its
        number."""
        self.counts.reconnects += 1
        self._round += 1
        self._server()[1].restart(self._round)
        self._loading.clear()
        self._pings.clear()
        self._following = True
        self._subscribed_at = time.monotonic()
        held = self.table.held_names()
        self.refresh_live(again=held)
        self._awaited = set(self._loading)
        self._ping(pubsub)
        if self._away:
            log.warning("fleet view: following Redis again")
            self._away = False

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
