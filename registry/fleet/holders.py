"""The fleet view's table without I/O: block hash -> the namespaces holding it, changed
by change records and snapshots, walked to match and score a prompt.

Two maps, KV and Mamba, each hash -> an int whose bit ``slot`` is set where the
namespace in ``slot`` holds the entry. A hash one namespace alone holds (a
conversation's own blocks, the most of them) points at that slot's one shared int
(``1 << slot``), so it costs the map's entry and nothing more, whatever the slot.

Scoring is memory work proportional to the prompt's matched part
(``registry.fleet.matches``): the prompt's hashes are looked up and their holder sets
ANDed, in C, until no namespace still holds every block so far; the answer is that
running list, read as names on demand. The namespaces that match are answered, the
other live ones (with 0) only when asked for (``everyone=True``).

``HolderTable`` reads nothing and starts nothing: what a record or a snapshot cannot
settle (a gap, a new incarnation, a namespace not held yet, ``L``) it answers with the
namespace to load, and its caller (``registry.fleet.follower``) loads it. Scoring may
run on any thread while one thread changes it (each lookup is one atomic dict
operation; a decision may see a record half applied, as a router may see the fleet
between two writes).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from registry.core.scores import NodeScore, checked_hybrid
from registry.core.validation import prefix_hashes
from registry.fleet.matches import NATIVE, Matches, Naming, farthest, walk

log = logging.getLogger(__name__)


class Part:
    """The operation codes of a change record's parts, as ``lua/_prelude.lua``
    ``record_changes`` writes them."""

    KV_ADDED = b"k+"
    KV_REMOVED = b"k-"
    MAMBA_ADDED = b"m+"
    MAMBA_REMOVED = b"m-"
    KV_CLEARED = b"K"
    MAMBA_CLEARED = b"M"
    CLAIMED = b"C"  # a new claim: both maps cleared, no Mamba state seen yet
    COLLECTED = b"G"  # the namespace is gone (``gc``)
    LOAD = b"L"  # too much changed to say: read the namespace again


@dataclass(frozen=True)
class Position:
    """Where a namespace's change records stand: its incarnation and the number of its
    last record (``b""`` and 0: the namespace does not exist)."""

    incarnation: bytes
    seq: int


@dataclass(frozen=True)
class HeldChange:
    """What a record or a load changed of one namespace's entries, told to the table's
    observers (``HolderTable.observers``): a gateway drops the blocks it counted as
    arriving at an engine once the view lists them, or sees them go."""

    namespace: str
    added: Collection[int] = ()
    removed: Collection[int] = ()
    mamba: bool = False
    """The Mamba map's entries; else the KV map's."""
    cleared: bool = False
    """Every entry of that map went (a claim or a clear: the engine restarted or reset its
    cache; the namespace collected); with ``mamba`` False, the KV map's and so every
    Mamba state's use too."""


Observer = Callable[[HeldChange], None]
"""Called on the thread that changes the table (the view's follower), once per change;
it must be quick and must not raise (what it raises is logged and dropped)."""


@dataclass
class ViewCounts:
    """What a view did since it started."""

    records: int = 0  # records applied
    loads: int = 0  # namespaces loaded from their maps
    paged_loads: int = 0  # of them, loaded in pages (HSCAN): large namespaces
    gaps: int = 0  # records out of order, or of a new incarnation: the namespace loaded
    reconnects: int = 0  # subscriptions (re)made, each followed by loading everything
    errors: int = 0  # Redis faults the follower waited out
    skipped: int = 0  # records that were not records, or named another namespace
    resyncs: int = 0  # rounds of loading every namespace again (the timer, ``resync``)


@dataclass
class _Source:
    """One namespace as the table holds it."""

    slot: int
    incarnation: bytes = b""
    seq: int = 0
    hybrid: bool = False  # it held Mamba state since its owner's claim (meta's mamba_seen)
    kv: set[int] = field(default_factory=set)
    mamba: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class _Live:
    """The live namespaces as the scorer reads them, replaced whole."""

    mask: int  # the bit of every live namespace's slot
    names: tuple[str, ...]
    slots: dict[str, int]


class HolderTable:
    """Block hash -> holder bits for every namespace held, the live ones among them, and
    the walk that matches and scores a prompt against them."""

    def __init__(self, counts: ViewCounts) -> None:
        self.counts = counts
        self.kv: dict[int, int] = {}
        self.mamba: dict[int, int] = {}
        # The same maps as native indexes (one probe a lookup), kept equal to the dicts
        # by ``_change``, where the C extension is built.
        self._indexes: tuple[Any, Any] | None = (
            None if NATIVE is None else (NATIVE.Index(), NATIVE.Index())
        )
        self._sources: dict[str, _Source] = {}
        self._free: list[int] = []
        self._bits: list[int] = []  # slot -> 1 << slot, the one int its lone blocks share
        self._live = _Live(0, (), {})
        self._naming = Naming(())
        self._hybrid = 0  # the bit of every hybrid model's namespace
        self.observers: list[Observer] = []
        """Told of every change to a namespace's entries (``HeldChange``)."""

    # -- what it holds -----------------------------------------------------------------

    def held_names(self) -> list[str]:
        """Every namespace held (sorted)."""
        return sorted(self._sources)

    def holds(self, name: str) -> bool:
        """Whether ``name`` is held."""
        return name in self._sources

    def is_live(self, name: str) -> bool:
        """Whether ``name`` was among the live namespaces last set."""
        return name in self._live.slots

    def live_nodes(self) -> list[str]:
        """The live namespaces as last set (sorted)."""
        return list(self._live.names)

    def held(self, namespace: str) -> tuple[frozenset[int], frozenset[int]] | None:
        """(KV hashes, Mamba hashes) held for ``namespace``, or None."""
        source = self._sources.get(namespace)
        if source is None:
            return None
        return frozenset(source.kv), frozenset(source.mamba)

    def entries(self, namespace: str) -> tuple[int, int] | None:
        """How many (KV, Mamba) hashes are held for ``namespace``, or None: no copies."""
        source = self._sources.get(namespace)
        if source is None:
            return None
        return len(source.kv), len(source.mamba)

    def reached(self, name: str, at: Position) -> bool:
        """Whether what is held of ``name`` includes every record up to ``at``."""
        source = self._sources.get(name)
        if not at.incarnation:
            return source is None
        return source is not None and source.incarnation == at.incarnation and source.seq >= at.seq

    def memory(self) -> dict[str, int]:
        """Rough sizes: distinct hashes, (namespace, hash) pairs held."""
        pairs = sum(len(s.kv) + len(s.mamba) for s in self._sources.values())
        kv = self.kv
        hashes = len(kv) + sum(1 for h in self.mamba if h not in kv)
        return {"hashes": hashes, "pairs": pairs, "namespaces": len(self._sources)}

    def slot_bit(self, name: str) -> int | None:
        """The int ``name``'s lone blocks point at (its bit), or None when not held."""
        source = self._sources.get(name)
        return None if source is None else self._bits[source.slot]

    # -- scoring -----------------------------------------------------------------------

    def match(
        self,
        hashes: Sequence[int],
        namespaces: Iterable[str] | None = None,
        *,
        hybrid: bool | None = None,
    ) -> Matches:
        """The live namespaces (all, or those given) holding a prefix of ``hashes``,
        each with its usable prefix in blocks (``FleetView.match``)."""
        hybrid = checked_hybrid(hybrid)
        # The bits of the nodes ranked by their Mamba checkpoints (-1: every node, for
        # hybrid=True); with none, the walk leaves the checkpoints out.
        reuses = 0 if hybrid is False else self._hybrid if hybrid is None else -1
        naming = self._naming
        steps, marks = self._walk(hashes, namespaces, bool(reuses))
        return Matches(steps, marks, reuses, naming)

    def steps(
        self, hashes: Sequence[int], namespaces: Iterable[str]
    ) -> tuple[list[tuple[int, int]], dict[str, int]]:
        """``match``'s KV prefixes unresolved (``FleetView.steps``): the walk's steps
        over the live namespaces of ``namespaces``, and the slots they were read with."""
        live = self._live
        steps, _marks = self._walk(hashes, namespaces, False, live)
        return steps, live.slots

    def score(
        self,
        hashes: Sequence[int],
        namespaces: Iterable[str] | None = None,
        *,
        hybrid: bool | None = None,
        everyone: bool = False,
    ) -> dict[str, NodeScore]:
        """The live namespaces (all, or those given) holding a prefix of ``hashes``,
        scored as ``PrefixRouter`` scores them (``FleetView.score``)."""
        hybrid = checked_hybrid(hybrid)
        naming = self._naming
        steps, marks = self._walk(hashes, namespaces, hybrid is not False)
        kv: dict[str, int] = {}
        for position, bits in steps:
            kv.update(naming.named_at(bits, position))
        mamba: dict[str, int] = {}
        for position, bits in farthest(marks, -1):
            mamba.update(dict.fromkeys(naming.named(bits), position))
        sources = self._sources
        scores: dict[str, NodeScore] = {}
        for name, end in kv.items():
            found = mamba.get(name, 0)
            if hybrid is None:
                source = sources.get(name)
                usable = found if source is not None and source.hybrid else end
            else:
                usable = found if hybrid else end
            scores[name] = NodeScore.of(name, end, found, usable)
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
        self,
        hashes: Sequence[int],
        namespaces: Iterable[str] | None,
        checkpoints: bool,
        live: _Live | None = None,
    ) -> tuple[list[tuple[int, int]], list[int]]:
        """``walk`` over the prompt (which checks the hashes it read); ``live``: the live
        namespaces to mask with (those read last, by default)."""
        items = hashes if type(hashes) is list else list(_iterable(hashes))
        try:
            steps, marks, _read = walk(
                self.kv, self.mamba, items, self._mask(namespaces, live), checkpoints,
                self._indexes,
            )  # fmt: skip
        except TypeError:  # an unhashable "hash": the clear error
            prefix_hashes(items)
            raise
        return steps, marks

    def _mask(self, namespaces: Iterable[str] | None, live: _Live | None = None) -> int:
        """The bits of the live namespaces (all, or those of ``namespaces``)."""
        if live is None:
            live = self._live
        if namespaces is None:
            return live.mask
        chosen = 0
        for name in namespaces:
            slot = live.slots.get(name)
            if slot is not None:
                chosen |= 1 << slot
        return live.mask & chosen

    # -- changing it -------------------------------------------------------------------

    def add_empty(self, name: str) -> None:
        """Hold ``name`` empty, at incarnation ``0`` and no record yet (a detached view's
        namespaces)."""
        self._source(name).incarnation = b"0"

    def set_live(self, names: Iterable[str]) -> None:
        """The live namespaces (those of ``names`` that are held)."""
        slots = {n: self._sources[n].slot for n in names if n in self._sources}
        mask = 0
        for slot in slots.values():
            mask |= 1 << slot
        self._live = _Live(mask, tuple(sorted(slots)), slots)

    def hold(self, name: str, reply: Sequence[Any]) -> None:
        """Hold exactly what ``lua/fleet_snapshot.lua`` read of ``name``: (incarnation,
        last record number, Mamba state seen, KV hashes, Mamba hashes)."""
        incarnation = as_bytes(reply[0])
        self.counts.loads += 1
        if not incarnation:
            self._drop(name)
            return
        source = self._source(name)
        kv = set(map(int, as_bytes(reply[3]).split()))
        mamba = set(map(int, as_bytes(reply[4]).split()))
        if self.observers:
            self._tell(HeldChange(name, kv - source.kv, source.kv - kv))
            self._tell(HeldChange(name, mamba - source.mamba, source.mamba - mamba, mamba=True))
        self._set(source, kv, mamba)
        source.incarnation = incarnation
        source.seq = int(reply[1])
        self._set_hybrid(source, bool(reply[2]))

    def apply(self, data: Any) -> str | None:
        """Apply one change record; the namespace to load again where the record cannot
        be applied (a gap, a new incarnation, a namespace not held, ``L``), else None."""
        tokens = as_bytes(data).split()
        if len(tokens) < 4:
            log.warning("fleet view: a change record without parts, skipped")
            self.counts.skipped += 1
            return None
        name = tokens[0].decode("utf-8", "replace")
        incarnation = tokens[1]
        try:
            seq = int(tokens[2])
        except ValueError:
            log.warning("fleet view: a change record with a bad number, skipped")
            self.counts.skipped += 1
            return None
        source = self._sources.get(name)
        if source is None:
            return None if tokens[3] == Part.COLLECTED else name
        if source.incarnation == incarnation and seq <= source.seq:
            return None  # included in what was loaded
        if source.incarnation != incarnation or seq != source.seq + 1:
            self.counts.gaps += 1
            return name
        source.seq = seq
        self.counts.records += 1
        for op, hashes in _parts(tokens[3:]):
            if op == Part.COLLECTED:
                self._drop(name)
                return None
            if not self._part(name, source, op, hashes):
                return name
        return None

    def _part(self, name: str, source: _Source, op: bytes, hashes: list[int]) -> bool:
        """Apply one part but ``G``; False for a part that asks for a load (``L``, or
        one this table does not know)."""
        change: HeldChange
        if op == Part.KV_ADDED:
            fresh = set(hashes) - source.kv
            self._change(source, fresh, (), mamba=False)
            source.kv |= fresh
            change = HeldChange(name, added=fresh)
        elif op == Part.KV_REMOVED:
            gone = source.kv.intersection(hashes)
            self._change(source, (), gone, mamba=False)
            source.kv -= gone
            change = HeldChange(name, removed=gone)
        elif op == Part.MAMBA_ADDED:
            fresh = set(hashes) - source.mamba
            self._change(source, fresh, (), mamba=True)
            source.mamba |= fresh
            self._set_hybrid(source, True)
            change = HeldChange(name, added=fresh, mamba=True)
        elif op == Part.MAMBA_REMOVED:
            gone = source.mamba.intersection(hashes)
            self._change(source, (), gone, mamba=True)
            source.mamba -= gone
            change = HeldChange(name, removed=gone, mamba=True)
        elif op == Part.KV_CLEARED:
            self._set(source, set(), source.mamba)
            change = HeldChange(name, cleared=True)
        elif op == Part.MAMBA_CLEARED:
            self._set(source, source.kv, set())
            change = HeldChange(name, mamba=True, cleared=True)
        elif op == Part.CLAIMED:
            self._set(source, set(), set())
            self._set_hybrid(source, False)
            change = HeldChange(name, cleared=True)
        else:
            return False
        if self.observers:
            self._tell(change)
        return True

    def _tell(self, change: HeldChange) -> None:
        """Every observer, told of ``change`` (one that raises is logged, not stopped)."""
        for observer in self.observers:
            try:
                observer(change)
            except Exception:  # an observer's fault never stops the view following
                log.exception("fleet view: an observer failed")

    def _source(self, name: str) -> _Source:
        source = self._sources.get(name)
        if source is None:
            names = list(self._naming.names)
            if self._free:
                slot = self._free.pop()
                carried = None  # a slot changes hands: names decoded before are stale
            else:
                slot = len(self._bits)
                self._bits.append(1 << slot)
                names.append(None)
                carried = self._naming
            names[slot] = name
            source = _Source(slot)
            self._sources[name] = source
            self._naming = Naming(tuple(names), carried)
        return source

    def any_hybrid(self) -> bool:
        """Whether any namespace the table holds is a hybrid model's (held Mamba state)."""
        return self._hybrid != 0

    def hybrid_names(self) -> frozenset[str]:
        """The namespaces held that are a hybrid model's (held Mamba state since their
        owner's claim)."""
        return frozenset(self._naming.named(self._hybrid)) if self._hybrid else frozenset()

    def _set_hybrid(self, source: _Source, hybrid: bool) -> None:
        source.hybrid = hybrid
        bit = self._bits[source.slot]
        self._hybrid = self._hybrid | bit if hybrid else self._hybrid & ~bit

    def _drop(self, name: str) -> None:
        source = self._sources.pop(name, None)
        if source is None:
            return
        self._set(source, set(), set())
        if self.observers:
            self._tell(HeldChange(name, cleared=True))
        names = list(self._naming.names)
        names[source.slot] = None
        self._naming = Naming(tuple(names))
        self._set_hybrid(source, False)
        self._free.append(source.slot)
        live = self._live
        if name in live.slots:
            slots = {n: s for n, s in live.slots.items() if n != name}
            self._live = _Live(live.mask & ~(1 << source.slot), tuple(sorted(slots)), slots)

    def _set(self, source: _Source, kv: set[int], mamba: set[int]) -> None:
        """Hold exactly ``kv`` and ``mamba`` for ``source``."""
        self._change(source, kv - source.kv, source.kv - kv, mamba=False)
        self._change(source, mamba - source.mamba, source.mamba - mamba, mamba=True)
        source.kv = kv
        source.mamba = mamba

    def _change(
        self,
        source: _Source,
        added: Collection[int],
        removed: Collection[int],
        *,
        mamba: bool,
    ) -> None:
        """Set ``source``'s bit in the KV or the Mamba map for ``added``, clear it for
        ``removed`` (the source's own sets are the caller's); the native index of that
        map alike, in one C call, where it is built."""
        blocks = self.mamba if mamba else self.kv
        shared = self._bits
        bit = shared[source.slot]
        if self._indexes is not None and NATIVE is not None:
            NATIVE.change(blocks, self._indexes[mamba], added, removed, bit, shared)
            return
        get = blocks.get
        for h in added:
            value = get(h)
            blocks[h] = bit if value is None else value | bit
        for h in removed:
            value = get(h)
            if value is None:
                continue
            value &= ~bit
            if not value:
                del blocks[h]
            elif value & (value - 1):
                blocks[h] = value
            else:  # one holder left: its shared int
                blocks[h] = shared[value.bit_length() - 1]


def as_bytes(value: Any) -> bytes:
    """A Redis reply value (or a pubsub message's field) as bytes; None as ``b""``."""
    if value is None:
        return b""
    if isinstance(value, bytes):
        return value
    return str(value).encode()


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
