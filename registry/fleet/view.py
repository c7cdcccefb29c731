"""The fleet's view in a router's own memory: which namespaces hold each block hash, fed
by the change records every write publishes in its own script.

Every script that changes a namespace's maps (the owner's writes, a mirror's batches,
``pcr bridge``'s batches, claims, clears, ``gc``) publishes one record on the
namespace's channel ``pcr:{NS}:changes`` in the same step (``lua/_prelude.lua``
``record_changes``): ``"<namespace> <incarnation> <seq> <parts>"``, numbered 1, 2, ...
within the namespace's incarnation by meta's ``change_seq``. A write refused by fencing
returns before it, so a fenced owner's writes never reach a view.

A ``FleetView`` subscribes to every namespace's channel (one pattern,
``pcr:{*}:changes``; a record that names another namespace than its channel's is
skipped), then loads each namespace it follows in one
read-only script (``lua/fleet_snapshot.lua``: both maps' hashes and the number of the
last record they include), and applies the records after it. A number skipped, a new
incarnation, a reconnect or the periodic resync make it load the namespace (or every
namespace) again: the maps in Redis stay the truth, the view a copy that may lag
(by the time a record takes to arrive) but converges. Membership comes from the node
index, refreshed every ``live_cache_ttl`` seconds, as the routers read it.

Scoring is memory work proportional to the prompt's matched part: the prompt's hashes
are looked up one after another (``dict.get`` in C, runs of equal holders grouped in C)
until no namespace still holds every block so far; the namespaces that match are
answered, the other live ones (with 0) only when asked for (``everyone=True``). A hash
maps to an int: bit ``2 * slot`` the KV entry of the namespace in ``slot``, bit
``2 * slot + 1`` its Mamba entry; a hash one bit alone holds (a conversation's own
blocks, the most of them) maps to that bit's index inverted (``~index``, negative), so
it costs a small int whatever the slot, not a bitmap as long as the slot's number.

One thread (``start``) follows the channel; scoring may run on any thread, at the same
time (each lookup is one atomic dict operation; a decision may see a record half
applied, as a router may see the fleet between two writes).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import groupby, repeat
from typing import Any

from registry.core.errors import REDIS_ERRORS, RegistryError, RegistryUnavailable, translate
from registry.core.keys import DEFAULT_KEY_PREFIX, NamespaceKeys, fleet_changes_pattern
from registry.core.scores import NodeScore, checked_hybrid
from registry.core.validation import prefix_hashes
from registry.fleet.membership import NodeIndex
from registry.transport.scripts import ScriptRunner

log = logging.getLogger(__name__)

STALE_S = 3.0
"""Seconds without a successful read of the live namespaces after which a view is not
``fresh``: routers ask Redis instead, the gateway routes by load. It reads them every
second."""
MEMO_NAMES = 1 << 18
"""How many namespaces a view remembers across the holder sets it decoded
(``FleetView._named``; a few MB), before it forgets them all and starts again."""
LOAD_BATCH = 64
"""Namespaces loaded per round trip (``fleet_snapshot``), at a cold start or a resync."""


@dataclass
class _Source:
    """One namespace as the view holds it."""

    slot: int
    incarnation: bytes = b""
    seq: int = 0
    hybrid: bool = False  # it held Mamba state since its owner's claim (meta's mamba_seen)
    kv: set[int] = field(default_factory=set)
    mamba: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class _Live:
    """The live namespaces as the scorer reads them, replaced whole."""

    mask: int  # the KV bit of every live namespace's slot
    names: tuple[str, ...]
    slots: dict[str, int]


@dataclass
class ViewCounts:
    """What a view did since it started."""

    records: int = 0  # records applied
    loads: int = 0  # namespaces loaded from their maps
    gaps: int = 0  # records out of order, or of a new incarnation: the namespace loaded
    reconnects: int = 0  # subscriptions (re)made, each followed by loading everything
    errors: int = 0  # Redis faults the follower waited out
    skipped: int = 0  # records that were not records, or named another namespace


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
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds")
        self.client = client
        self.key_prefix = key_prefix
        self.pattern = fleet_changes_pattern(key_prefix)
        self._channel_start = f"{key_prefix}:{{".encode()
        self.live_cache_ttl = float(live_cache_ttl)
        self.resync_interval = float(resync_interval)
        self.counts = ViewCounts()
        self.blocks: dict[int, int] = {}
        self._runner: ScriptRunner | None = None
        self._index: NodeIndex | None = None
        if client is not None:
            self._runner = ScriptRunner(client)
            self._index = NodeIndex(client, key_prefix)
        self._sources: dict[str, _Source] = {}
        self._free: list[int] = []
        self._next_slot = 0
        self._keys: dict[str, NamespaceKeys] = {}
        self._live = _Live(0, (), {})
        self._read_live = threading.Event()  # sync() asks for the live namespaces now
        self._away = False  # said that it stopped following Redis
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pubsub: Any = None
        self._names: list[str | None] = []  # slot -> namespace
        self._memo: dict[int, dict[str, None]] = {}  # KV bits -> their namespaces
        self._memo_names = 0
        self._hybrid = 0  # the KV bit of every hybrid model's namespace
        self._live_read_at = float("-inf")
        self.ready = threading.Event()  # set once subscribed and loaded

    # -- lifecycle ---------------------------------------------------------------------

    def start(self, timeout: float | None = 30.0) -> FleetView:
        """Follow the channel in a daemon thread; wait up to ``timeout`` seconds for the
        first load (None: do not wait). Raises ``RegistryUnavailable`` (retryable) when it
        did not finish."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._follow, name="fleet-view", daemon=True)
            self._thread.start()
        if timeout is not None and not self.ready.wait(timeout):
            raise RegistryUnavailable(f"the fleet view did not load within {timeout} s")
        return self

    def close(self) -> None:
        """Stop following (the view keeps what it holds)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        if self._pubsub is not None:
            with contextlib.suppress(*REDIS_ERRORS):
                self._pubsub.close()

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
            source = view._source(name)
            source.incarnation = b"0"
        view._set_live(list(view._sources))
        view._live_read_at = float("inf")  # nothing to follow: always as fresh as it is
        view.ready.set()
        return view

    def apply(self, record: bytes) -> None:
        """Apply one change record, as if it came from the channel."""
        self._apply(record)

    # -- scoring -----------------------------------------------------------------------

    def match(
        self,
        hashes: Sequence[int],
        namespaces: Iterable[str] | None = None,
        *,
        hybrid: bool | None = None,
    ) -> dict[str, int]:
        """The live namespaces (all, or those given) holding a prefix of ``hashes``,
        each with its usable prefix in blocks (what routing ranks by, ``hybrid`` as in
        ``PrefixRouter``): the cheap form of ``score``, one decision's answer."""
        hybrid = checked_hybrid(hybrid)
        ends, checkpoints = self._walk(hashes, namespaces, hybrid is not False)
        named = self._named
        usable: dict[str, int] = {}
        if hybrid is False:
            for position, bits in ends:
                usable.update(dict.fromkeys(named(bits), position))
            return usable
        reuses_mamba = self._hybrid if hybrid is None else -1
        if not reuses_mamba:  # no hybrid model's node: the KV prefixes
            for position, bits in ends:
                usable.update(dict.fromkeys(named(bits), position))
            return usable
        for position, bits in ends:
            plain = bits & ~reuses_mamba
            if plain:
                usable.update(dict.fromkeys(named(plain), position))
            if bits != plain:  # hybrid nodes: 0 unless a checkpoint is found below
                usable.update(dict.fromkeys(named(bits & reuses_mamba), 0))
        for position, bits in checkpoints:
            mamba = bits & reuses_mamba
            if mamba:
                usable.update(dict.fromkeys(named(mamba), position))
        return usable

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
        hybrid = checked_hybrid(hybrid)
        ends, checkpoints = self._walk(hashes, namespaces, hybrid is not False)
        named = self._named
        kv: dict[str, int] = {}
        for position, bits in ends:
            kv.update(dict.fromkeys(named(bits), position))
        mamba: dict[str, int] = {}
        for position, bits in checkpoints:
            mamba.update(dict.fromkeys(named(bits), position))
        sources = self._sources
        scores: dict[str, NodeScore] = {}
        for name, end in kv.items():
            farthest = mamba.get(name, 0)
            if hybrid is None:
                source = sources.get(name)
                usable = farthest if source is not None and source.hybrid else end
            else:
                usable = farthest if hybrid else end
            scores[name] = NodeScore.of(name, end, farthest, usable)
        if everyone:
            live = self._live
            wanted: Iterable[str] = (
                live.names
                if namespaces is None
                else (n for n in set(namespaces) if n in live.slots)
            )
            for name in wanted:
                if name not in scores:
                    scores[name] = NodeScore.of(name, 0, 0, 0)
        return scores

    def _walk(
        self, hashes: Sequence[int], namespaces: Iterable[str] | None, hybrid: bool
    ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """``walk`` over the prompt, whose hashes are checked as far as it read them
        (the rest can change no answer: no prefix runs past a block no one holds), or
        all of them where it read none."""
        items = hashes if type(hashes) is list else list(_iterable(hashes))
        try:
            ends, checkpoints, read = walk(self.blocks, items, self._mask(namespaces), hybrid)
        except TypeError:  # an unhashable "hash": the clear error
            prefix_hashes(items)
            raise
        prefix_hashes(items[:read] if read else items)  # raises on a bad hash
        return ends, checkpoints

    def _mask(self, namespaces: Iterable[str] | None) -> int:
        """The KV bits of the live namespaces (all, or those of ``namespaces``)."""
        live = self._live
        if namespaces is None:
            return live.mask
        chosen = 0
        for name in namespaces:
            slot = live.slots.get(name)
            if slot is not None:
                chosen |= 1 << (2 * slot)
        return live.mask & chosen

    def _named(self, bits: int) -> dict[str, None]:
        """The namespaces whose KV bit is set in ``bits``, as dict keys (remembered: the
        same sets come back decision after decision while the fleet holds still; a
        dict, because ``dict.fromkeys`` of a dict is the quickest way to an answer)."""
        names = self._memo.get(bits)
        if names is None:
            slots = self._names
            found = []
            members = bits
            while members:
                lowest = members & -members
                name = slots[(lowest.bit_length() - 1) >> 1]
                if name is not None:  # dropped since the live namespaces were read
                    found.append(name)
                members ^= lowest
            names = dict.fromkeys(found)
            self._memo_names += len(found) + 1
            if self._memo_names > MEMO_NAMES:
                self._memo = {}
                self._memo_names = len(found) + 1
            self._memo[bits] = names
        return names

    def fresh(self, max_age: float = STALE_S) -> bool:
        """Whether the view has loaded and read the live namespaces from Redis within
        the last ``max_age`` seconds (it does every ``live_cache_ttl``): a view that has
        not may hold what the engines no longer do. The routers and the gateway score
        from it only while it is fresh by the default ``STALE_S``."""
        return self.ready.is_set() and time.monotonic() - self._live_read_at <= max_age

    def live_nodes(self) -> list[str]:
        """The live namespaces as the view last read them (sorted)."""
        return list(self._live.names)

    def held(self, namespace: str) -> tuple[frozenset[int], frozenset[int]] | None:
        """(KV hashes, Mamba hashes) the view holds for ``namespace``, or None."""
        source = self._sources.get(namespace)
        if source is None:
            return None
        return frozenset(source.kv), frozenset(source.mamba)

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
        index = self._server()[1]
        if namespaces is None:
            names = sorted(set(self._sources) | set(index.live()))
        else:
            names = list(namespaces)
        targets = self._positions(names)
        deadline = time.monotonic() + timeout
        asked = time.monotonic()
        if live or any(n not in self._live.slots for n in names):
            self._read_live.set()
        else:
            asked = float("-inf")
        with self._changed:
            while True:
                behind = [n for n, at in targets.items() if not self._reached(n, at)]
                if not behind and self._live_read_at >= asked:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RegistryUnavailable(
                        f"the fleet view did not catch up within {timeout} s "
                        f"({len(behind)} namespaces behind)"
                    )
                self._changed.wait(min(left, 0.05))

    def _positions(self, names: list[str]) -> dict[str, tuple[bytes, int]]:
        """Each namespace's (incarnation, last record number) as Redis holds it now."""
        calls = [(self._keys_of(n).meta,) for n in names]
        pipe = self.client.pipeline(transaction=False)
        for (meta,) in calls:
            pipe.hmget(meta, "incarnation", "change_seq")
        try:
            replies = pipe.execute()
        except REDIS_ERRORS as exc:
            error = translate(exc, "fleet view: reading the change records' numbers")
            raise (error or exc) from exc
        pairs = zip(names, replies, strict=True)
        return {name: (_bytes(inc), int(seq or 0)) for name, (inc, seq) in pairs}

    def _reached(self, name: str, at: tuple[bytes, int]) -> bool:
        incarnation, seq = at
        source = self._sources.get(name)
        if not incarnation:
            return source is None
        return source is not None and source.incarnation == incarnation and source.seq >= seq

    # -- following (the view's own thread) ---------------------------------------------

    def _follow(self) -> None:
        delay = 0.05
        while not self._stop.is_set():
            try:
                self._subscribe_and_follow()
                return
            except (*REDIS_ERRORS, RegistryError) as exc:
                self.counts.errors += 1
                self._live_read_at = float("-inf")  # not following: not fresh
                # One warning when it stops following, not one per retry.
                say = log.debug if self._away else log.warning
                say("fleet view: %s; following again in %.2f s", exc, delay)
                self._away = True
            except Exception:  # a bug here must not leave the view stale for good
                self.counts.errors += 1
                self._live_read_at = float("-inf")
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
                message = pubsub.get_message(timeout=0.1)
                while message is not None:
                    kind = _bytes(message.get("type"))
                    if kind == b"pmessage":
                        self._received(message.get("channel"), message["data"])
                    elif kind == b"psubscribe":
                        self._subscribed()
                    message = pubsub.get_message(timeout=0)
                now = time.monotonic()
                if self.ready.is_set() and (
                    now - self._live_read_at >= self.live_cache_ttl or self._read_live.is_set()
                ):
                    self._read_live.clear()
                    self._refresh_live()
                if now >= resync_at:
                    self._load(sorted(self._sources))
                    resync_at = now + self.resync_interval
                with self._changed:
                    self._changed.notify_all()
        finally:
            self._pubsub = None
            with contextlib.suppress(*REDIS_ERRORS):
                pubsub.close()

    def _subscribed(self) -> None:
        """The subscription is (again) in place: the first time, or after redis-py
        reconnected by itself. Records may have been missed while it was not: everything
        held is read again, with the live namespaces. A record written meanwhile waits
        in the socket and is applied or skipped by its number."""
        self.counts.reconnects += 1
        self._refresh_live(again=sorted(self._sources))
        if self._away:
            log.warning("fleet view: following Redis again")
            self._away = False
        self.ready.set()

    def _refresh_live(self, again: Sequence[str] = ()) -> None:
        """Read the live namespaces; load those not followed yet (and ``again``)."""
        names = self._server()[1].live()
        unknown = sorted({n for n in names if n not in self._sources}.union(again))
        if unknown:
            self._load(unknown)
        self._set_live(names)
        self._live_read_at = time.monotonic()
        with self._changed:
            self._changed.notify_all()

    def _server(self) -> tuple[ScriptRunner, NodeIndex]:
        if self._runner is None or self._index is None:
            raise RegistryError("a detached fleet view has no server to read")
        return self._runner, self._index

    def _set_live(self, names: Iterable[str]) -> None:
        slots = {n: self._sources[n].slot for n in names if n in self._sources}
        mask = 0
        for slot in slots.values():
            mask |= 1 << (2 * slot)
        self._live = _Live(mask, tuple(sorted(slots)), slots)

    def _keys_of(self, name: str) -> NamespaceKeys:
        keys = self._keys.get(name)
        if keys is None:
            keys = self._keys[name] = NamespaceKeys(name, self.key_prefix)
        return keys

    def _load(self, names: Sequence[str]) -> None:
        """Read ``names`` from their maps (``LOAD_BATCH`` per round trip) and hold
        exactly that, at the record number it includes."""
        for first in range(0, len(names), LOAD_BATCH):
            part = names[first : first + LOAD_BATCH]
            calls = []
            for name in part:
                keys = self._keys_of(name)
                calls.append(((keys.kv, keys.mamba, keys.meta), ()))
            replies = self._server()[0].run_many(
                "fleet_snapshot", calls, context="loading the fleet view", write=False
            )
            for name, reply in zip(part, replies, strict=True):
                self._hold(name, reply)
        with self._changed:
            self._changed.notify_all()

    def _hold(self, name: str, reply: Sequence[Any]) -> None:
        incarnation = _bytes(reply[0])
        self.counts.loads += 1
        if not incarnation:
            self._drop(name)
            return
        source = self._source(name)
        kv = set(map(int, _bytes(reply[3]).split()))
        mamba = set(map(int, _bytes(reply[4]).split()))
        self._set(source, kv, mamba)
        source.incarnation = incarnation
        source.seq = int(reply[1])
        self._set_hybrid(source, bool(reply[2]))

    def _source(self, name: str) -> _Source:
        source = self._sources.get(name)
        if source is None:
            if self._free:
                slot = self._free.pop()
            else:
                slot = self._next_slot
                self._next_slot += 1
                self._names.append(None)
            source = _Source(slot)
            self._names[slot] = name
            self._sources[name] = source
        return source

    def _set_hybrid(self, source: _Source, hybrid: bool) -> None:
        source.hybrid = hybrid
        bit = 1 << (2 * source.slot)
        self._hybrid = self._hybrid | bit if hybrid else self._hybrid & ~bit

    def _drop(self, name: str) -> None:
        source = self._sources.pop(name, None)
        if source is None:
            return
        self._set(source, set(), set())
        self._names[source.slot] = None
        self._memo = {}
        self._memo_names = 0
        self._set_hybrid(source, False)
        self._free.append(source.slot)
        live = self._live
        if name in live.slots:
            slots = {n: s for n, s in live.slots.items() if n != name}
            self._live = _Live(live.mask & ~(1 << (2 * source.slot)), tuple(sorted(slots)), slots)

    def _set(self, source: _Source, kv: set[int], mamba: set[int]) -> None:
        """Make the view hold exactly ``kv`` and ``mamba`` for ``source``."""
        self._change(source, kv - source.kv, source.kv - kv, 0)
        self._change(source, mamba - source.mamba, source.mamba - mamba, 1)
        source.kv = kv
        source.mamba = mamba

    def _change(
        self, source: _Source, added: Iterable[int], removed: Iterable[int], kind: int
    ) -> None:
        """Set ``source``'s bit of ``kind`` (0 KV, 1 Mamba) for ``added``, clear it for
        ``removed`` (the source's own sets are the caller's)."""
        index = 2 * source.slot + kind
        bit = 1 << index
        only = ~index  # the value of a hash this bit alone holds
        blocks = self.blocks
        get = blocks.get
        for h in added:
            value = get(h)
            if value is None:
                blocks[h] = only
                continue
            if value < 0:
                value = 1 << ~value
            value |= bit
            blocks[h] = only if value == bit else value
        for h in removed:
            value = get(h)
            if value is None:
                continue
            if value < 0:
                value = 1 << ~value
            value &= ~bit
            if not value:
                del blocks[h]
            elif value & (value - 1):
                blocks[h] = value
            else:  # one holder left
                blocks[h] = ~(value.bit_length() - 1)

    def _received(self, channel: Any, data: Any) -> None:
        """A record from the channel: applied only when the namespace it names is the
        channel's (a node user may publish on its own namespace's channel, never on
        another's: a record naming another is skipped)."""
        name = _bytes(channel)
        start = self._channel_start
        if not (name.startswith(start) and name.endswith(b"}:changes")):
            return
        record = _bytes(data)
        if record.partition(b" ")[0] != name[len(start) : -len(b"}:changes")]:
            self.counts.skipped += 1
            return
        self._apply(record)

    def _apply(self, data: Any) -> None:
        """One change record."""
        tokens = _bytes(data).split()
        if len(tokens) < 4:
            log.warning("fleet view: a change record without parts, skipped")
            self.counts.skipped += 1
            return
        name = tokens[0].decode("utf-8", "replace")
        incarnation = tokens[1]
        try:
            seq = int(tokens[2])
        except ValueError:
            log.warning("fleet view: a change record with a bad number, skipped")
            self.counts.skipped += 1
            return
        source = self._sources.get(name)
        if source is None:
            if tokens[3] != b"G":
                self._load([name])
            return
        if source.incarnation == incarnation and seq <= source.seq:
            return  # included in what was loaded
        if source.incarnation != incarnation or seq != source.seq + 1:
            self.counts.gaps += 1
            self._load([name])
            return
        source.seq = seq
        self.counts.records += 1
        for op, hashes in _parts(tokens[3:]):
            if not self._op(name, source, op, hashes):
                return

    def _op(self, name: str, source: _Source, op: bytes, hashes: list[int]) -> bool:
        """Apply one part; False when the rest of the record no longer applies."""
        if op == b"k+":
            fresh = set(hashes) - source.kv
            self._change(source, fresh, (), 0)
            source.kv |= fresh
        elif op == b"k-":
            gone = source.kv.intersection(hashes)
            self._change(source, (), gone, 0)
            source.kv -= gone
        elif op == b"m+":
            fresh = set(hashes) - source.mamba
            self._change(source, fresh, (), 1)
            source.mamba |= fresh
            self._set_hybrid(source, True)
        elif op == b"m-":
            gone = source.mamba.intersection(hashes)
            self._change(source, (), gone, 1)
            source.mamba -= gone
        elif op == b"K":
            self._set(source, set(), source.mamba)
        elif op == b"M":
            self._set(source, source.kv, set())
        elif op == b"C":
            self._set(source, set(), set())
            self._set_hybrid(source, False)
        elif op == b"G":
            self._drop(name)
            return False
        else:  # 'L', or a part this view does not know: read the namespace again
            self._load([name])
            return False
        return True

    def memory(self) -> dict[str, int]:
        """Rough sizes: distinct hashes, (namespace, hash) pairs held."""
        pairs = sum(len(s.kv) + len(s.mamba) for s in self._sources.values())
        return {"hashes": len(self.blocks), "pairs": pairs, "namespaces": len(self._sources)}


def walk(
    blocks: dict[int, int], hashes: Sequence[int], mask: int, hybrid: bool
) -> tuple[list[tuple[int, int]], list[tuple[int, int]], int]:
    """For the slots whose KV bit is in ``mask`` and that hold the prompt's first block:
    ([(where their KV prefix ends, their KV bits)], [(one past their farthest Mamba
    entry inside that prefix, their KV bits)], how many hashes were read), a slot in at
    most one entry of each. Stops at the first position no slot of the mask still holds
    every block to."""
    ends: list[tuple[int, int]] = []
    if not mask or not hashes:
        return ends, [], 0
    runs = groupby(map(blocks.get, hashes, repeat(0)))
    alive = mask
    position = 0
    checkpoints: list[tuple[int, int]] = []
    first = True
    read = len(hashes)
    for value, run in runs:
        if value < 0:  # one holder: its bit's index, inverted
            value = 1 << ~value
        if first:
            alive &= value
            first = False
            if not alive:
                return ends, [], 1
        else:
            still = alive & value
            if still != alive:
                ends.append((position, alive ^ still))
                alive = still
                if not alive:
                    read = position + 1
                    break
        position += len(list(run))
        if hybrid:
            held = (value >> 1) & alive
            if held:
                checkpoints.append((position, held))
    if alive:
        ends.append((position, alive))
    farthest: list[tuple[int, int]] = []
    found = 0
    for at, held in reversed(checkpoints):
        fresh = held & ~found
        if fresh:
            found |= fresh
            farthest.append((at, fresh))
    return ends, farthest, read


def _parts(tokens: Sequence[bytes]) -> Iterator[tuple[bytes, list[int]]]:
    """A record's parts: (operation, its hashes)."""
    op: bytes | None = None
    hashes: list[int] = []
    for token in tokens:
        if token[:1].isdigit():
            hashes.append(int(token))
            continue
        if op is not None:
            yield op, hashes
        op, hashes = token, []
    if op is not None:
        yield op, hashes


def _iterable(hashes: object) -> Iterable[Any]:
    if isinstance(hashes, (str, bytes)) or not isinstance(hashes, Iterable):
        raise TypeError(f"hashes must be a sequence of ints, not {type(hashes).__name__}")
    return hashes


def _bytes(value: Any) -> bytes:
    if value is None:
        return b""
    if isinstance(value, bytes):
        return value
    return str(value).encode()
