"""The fleet view's loads, read apart from its following: the reads that give one
namespace's maps and the number of the last change record they include
(``SnapshotReader``), and the thread that makes them in the background in batches
(``SnapshotLoader``), so that a cold start or a resync never stops the follower reading
the channel and the live namespaces.

A small namespace is read by one read-only script (``lua/fleet_snapshot.lua``: both
maps' hashes and meta's numbers in one step), ``LOAD_BATCH`` namespaces a round trip; a
large one in pages (``HSCAN``), its record number read first. The loader only reads: it
hands each batch, still as the replies' bytes, to the follower (``landed``), which holds
it and applies the records it heard for the namespace meanwhile (``registry.fleet.
follower``). A failed read is handed over the same way, as the fault it was.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from registry.core.errors import REDIS_ERRORS, translate
from registry.core.keys import NamespaceKeys
from registry.fleet.holders import ViewCounts, as_bytes
from registry.transport.scripts import ScriptRunner

LOAD_BATCH = 16
"""Namespaces read per round trip (``fleet_snapshot``). Small enough that the follower
holds one batch while the server reads the next (the two overlap: about 0.1 s of server
time per 64 namespaces of 4,096 blocks), and that a batch is held in tens of ms."""
AHEAD = 4
"""Batches the loader reads ahead of the follower holding them: a bound on the replies
in memory at a cold start."""
PAGED_ABOVE = 20_000
"""Entries (both maps) above which a namespace is loaded in pages (``HSCAN``) instead of
one ``fleet_snapshot`` call: one script reading a million entries holds the server for
seconds, and outlasts the client's read timeout, so the load failed and started again
for good (issue 43)."""
PAGE = 1_000
"""Entries asked for per ``HSCAN`` call of a paged load."""

Reply = list[Any]
"""One namespace as ``lua/fleet_snapshot.lua`` returns it: (incarnation, last record
number, Mamba state seen, the KV hashes, the Mamba hashes; the hashes as bytes joined by
spaces)."""


@dataclass(frozen=True)
class Landed:
    """A batch the loader read: each namespace with its reply, or the fault that stopped
    the read; ``round`` is the follower's round of requests it belongs to."""

    round: int
    replies: tuple[tuple[str, Reply], ...] = ()
    fault: BaseException | None = None


class SnapshotReader:
    """The reads of a load; no thread of its own (a redis-py client may be shared)."""

    def __init__(self, client: Any, key_prefix: str, counts: ViewCounts) -> None:
        self.client = client
        self.key_prefix = key_prefix
        self.counts = counts
        self._runner = ScriptRunner(client)
        self._keys: dict[str, NamespaceKeys] = {}

    def large(self, names: Sequence[str]) -> set[str]:
        """Those of ``names`` whose maps hold more than ``PAGED_ABOVE`` entries."""
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            keys = self.keys_of(name)
            pipe.hlen(keys.kv)
            pipe.hlen(keys.mamba)
        sizes = _read(pipe.execute, "fleet view: the sizes of the namespaces to load")
        return {
            name
            for i, name in enumerate(names)
            if int(sizes[2 * i]) + int(sizes[2 * i + 1]) > PAGED_ABOVE
        }

    def snapshots(self, names: Sequence[str]) -> list[Reply]:
        """``names`` read by ``fleet_snapshot``, one round trip per Redis node."""
        calls = []
        for name in names:
            keys = self.keys_of(name)
            calls.append(((keys.kv, keys.mamba, keys.meta), ()))
        replies: list[Reply] = self._runner.run_many(
            "fleet_snapshot", calls, context="loading the fleet view", write=False
        )
        return replies

    def paged(self, name: str) -> Reply:
        """A large namespace read as ``fleet_snapshot`` reads it (its reply's shape), in
        pages: the record number first, then each map with ``HSCAN``. A scan sees every
        entry that stays put while it runs; an entry added or removed meanwhile is named
        in a record numbered after the one read first, which the follower applies after
        holding this (a record gives each hash's state after its write), so the view
        converges on the maps as a snapshot would. Each call is short: nothing holds the
        server."""
        keys = self.keys_of(name)
        what = f"fleet view: loading {name!r} in pages"
        meta = _read(
            lambda: self.client.hmget(keys.meta, "incarnation", "change_seq", "mamba_seen"), what
        )
        if not meta[0]:
            return [b"", b"0", b"", b"", b""]
        self.counts.paged_loads += 1
        maps = [b" ".join(self._fields(key, what)) for key in (keys.kv, keys.mamba)]
        return [as_bytes(meta[0]), as_bytes(meta[1]) or b"0", as_bytes(meta[2]), *maps]

    def _fields(self, key: str, what: str) -> list[bytes]:
        """Every field of the hash ``key``, ``PAGE`` a ``HSCAN`` call."""
        pairs = _read(lambda: list(self.client.hscan_iter(key, count=PAGE)), what)
        return [as_bytes(field) for field, _ in pairs]

    def keys_of(self, name: str) -> NamespaceKeys:
        keys = self._keys.get(name)
        if keys is None:
            keys = self._keys[name] = NamespaceKeys(name, self.key_prefix)
        return keys


class SnapshotLoader:
    """Reads the namespaces asked for (``request``) in a daemon thread of its own,
    ``LOAD_BATCH`` at a time in the order asked, into ``landed`` (at most ``AHEAD``
    batches waiting). ``restart`` forgets what was asked and starts a new round: what a
    batch of an older round brings is the follower's to drop."""

    def __init__(self, reader: SnapshotReader) -> None:
        self.reader = reader
        self.landed: queue.Queue[Landed] = queue.Queue(maxsize=AHEAD)
        self._wanted: dict[str, None] = {}  # asked for, not read yet, in order
        self._round = 0
        self._lock = threading.Lock()
        self._asked = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.on_landed: Callable[[], None] | None = None
        """Called (in the loader's thread) after each batch handed over."""

    def start(self) -> None:
        """Read in a daemon thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fleet-view-loads", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop reading (a read under way ends first, or fails with the client)."""
        self._stop.set()
        self._asked.set()
        if self._thread is not None:
            self._thread.join(10)

    def request(self, names: Sequence[str]) -> None:
        """Read ``names`` (each once, however often asked before it is read)."""
        with self._lock:
            self._wanted.update(dict.fromkeys(names))
        self._asked.set()

    def restart(self, round_: int) -> None:
        """Forget every name asked for; what is read from now on belongs to ``round_``."""
        with self._lock:
            self._wanted.clear()
            self._round = round_

    def _take(self) -> tuple[int, list[str]]:
        with self._lock:
            names = list(self._wanted)[:LOAD_BATCH]
            for name in names:
                del self._wanted[name]
            if not self._wanted:
                self._asked.clear()
            return self._round, names

    def _run(self) -> None:
        while not self._stop.is_set():
            self._asked.wait()  # request and close set it: no wake-up while idle
            round_, names = self._take()
            if not names:
                continue
            try:
                self._read(round_, names)
            except Exception as exc:  # handed over: the follower raises it as its own
                with self._lock:
                    if round_ == self._round:
                        self._wanted.clear()  # the follower starts a new round anyway
                self._put(Landed(round_, fault=exc))

    def _read(self, round_: int, names: list[str]) -> None:
        """One batch: the small namespaces in one round trip, each large one in pages."""
        reader = self.reader
        large = reader.large(names)
        small = [n for n in names if n not in large]
        if small:
            self._put(Landed(round_, tuple(zip(small, reader.snapshots(small), strict=True))))
        for name in names:
            if name in large:
                self._put(Landed(round_, ((name, reader.paged(name)),)))

    def _put(self, item: Landed) -> None:
        """Hand ``item`` over, waiting while ``AHEAD`` batches wait already, and say so
        (``on_landed``)."""
        while not self._stop.is_set():
            try:
                self.landed.put(item, timeout=0.5)
                if self.on_landed is not None:
                    self.on_landed()
                return
            except queue.Full:
                continue


def _read(call: Callable[[], Any], what: str) -> Any:
    """``call()``, its Redis faults as the registry's errors."""
    try:
        return call()
    except REDIS_ERRORS as exc:
        error = translate(exc, what)
        raise (error or exc) from exc
