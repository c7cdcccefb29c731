"""Requests in flight counted as cached where they were sent (issue 44), without I/O.

The registry hears of a prompt's blocks only once the engine has scheduled them and
``pcr bridge`` has written its events: a request sharing that prefix that arrives
meanwhile would be scored as if nothing were cached there, and balanced elsewhere. So
when the gateway sends a prompt to backend ``b``, the prompt's block hashes that the
registry does not list there yet count as *arriving* at ``b`` for the following
decisions, until:

- the fleet view lists them at ``b`` (the engine's events confirm them: each is dropped
  as its record is applied, the view is the truth from then on);
- the view sees ``b`` drop them (evicted) or clear its cache (a restart, a reset), at once;
- the request ends without them: a failure, a refusal or a client that left, at once; a
  success, ``grace`` seconds later (the bridge's events are then usually in the view);
- ``ttl`` seconds pass since it was sent, or ``b`` holds more than ``max_blocks`` pending
  blocks (the oldest requests' go first).

For a hybrid model's node, the request also leaves a Mamba state where vLLM keeps one
(``sim.checkpoints``' rule): at the prompt's replay boundary (``(tokens - 1) // block``
blocks) and at the junction where its KV hit there ends beyond its usable prefix; those
positions count as checkpoints for the prompts that share them.

Per backend the pending blocks are ``hash -> entry`` with a count of the requests whose
chain holds it (a prefix shared by several in flight is held once); a request's start
and end are O(its blocks), a decision's lookups O(the part of its prompt pending). A
prompt's hashes are parent-chained, so block ``i`` pending means the same request holds
blocks ``0 .. i`` there: a backend's prefix is the registry's KV prefix continued while
the next block is pending.

Replicas share theirs with their load (``pcr.gateway.exchange``): per backend, each of
the newest ``WIRE_CHAINS`` chains as its length and the hashes at a ladder of positions
(1, 2, 3, 4, 6, 8, 12, ... and the last), and its checkpoints. Block ``p``'s hash covers
blocks ``0 .. p - 1``, so a prompt whose hash at a shared position equals the chain's
shares the chain that far: another replica's request counts for a prompt sharing its
first ``p`` blocks, ``p`` the farthest ladder position they share (at least two thirds
of the shared prefix, all of it for a prompt that extends the chain: the next turn).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from registry.core.validation import is_number
from registry.fleet.holders import HeldChange
from registry.routing.balance import Reach

MAX_HASH = (1 << 63) - 1
WIRE_CHAINS = 8
"""Chains per backend a replica tells the others (its newest)."""
WIRE_TOTAL = 64
"""Chains a replica tells the others in all (its payload stays a few KB)."""
MAX_POSITION = 1 << 31


@dataclass(frozen=True)
class PendingBounds:
    """How long and how much the blocks of requests in flight count (``pcr gateway
    --pending-ttl``, ``--pending-grace``, ``--pending-blocks``)."""

    ttl: float = 30.0
    """Seconds after its request was sent that a block counts at most (0: pending
    prefixes off)."""
    grace: float = 2.0
    """Seconds a successful request's unconfirmed blocks still count after it ended, for
    the engine's events to reach the view."""
    max_blocks: int = 32_768
    """Pending blocks per backend at most; past it the oldest requests' go."""

    def __post_init__(self) -> None:
        for name in ("ttl", "grace"):
            value = getattr(self, name)
            if not is_number(value) or not 0 <= value < math.inf:
                raise ValueError(f"pending {name} must be a finite number of seconds >= 0")
        if not is_number(self.max_blocks, integer=True) or not 1 <= self.max_blocks <= 1 << 30:
            raise ValueError("pending max_blocks must be a whole number from 1 to 2**30")

    @property
    def on(self) -> bool:
        return self.ttl > 0


@dataclass
class Listed:
    """Each backend's prefix of one prompt, in blocks: ``usable`` what its engine can
    reuse, ``kv`` its KV prefix where that is longer (hybrid models' nodes), ``hybrid``
    the backends that are a hybrid model's."""

    usable: dict[str, int]
    kv: dict[str, int] = field(default_factory=dict)
    hybrid: frozenset[str] = frozenset()

    def held(self, name: str) -> int:
        """``name``'s KV prefix in blocks."""
        usable = self.usable.get(name, 0)
        if not self.kv:
            return usable
        kv = self.kv.get(name, 0)
        return kv if kv > usable else usable

    def reach(self, name: str, registry: Listed) -> Reach:
        """``name``'s prefixes here (with pending blocks), beside what ``registry``
        lists alone."""
        return Reach(
            registry.held(name), self.held(name), self.usable.get(name, 0), name in self.hybrid
        )


@dataclass
class PendingCounts:
    """What became of pending blocks since the gateway started (``/health``)."""

    sent: int = 0  # blocks counted as arriving
    confirmed: int = 0  # listed by the view where they were sent
    evicted: int = 0  # seen removed there (or the cache cleared) before that
    expired: int = 0  # requests whose blocks ``ttl`` ended
    truncated: int = 0  # requests cut or dropped by ``max_blocks``


class _Entry:
    """One pending block at one backend: how many requests in flight hold it, and until
    when the grace of the last successful one to end keeps it (pending while either
    holds; a dead one is dropped by the next sweep, ``PendingPrefixes.expire``)."""

    __slots__ = ("refs", "until")

    def __init__(self) -> None:
        self.refs = 0
        self.until = 0.0


class Sent:
    """One request's blocks counted as arriving at one backend: what its end gives back.
    ``chain[held:held + len(entries)]`` are its pending blocks; ``marks`` its Mamba
    checkpoints (position, entry); ``shared`` False once the backend was seen cleared
    (no longer told to other replicas); ``until`` the end of its grace, once ended;
    ``done`` once its blocks were given back (its end, a failure, ``ttl``, the bound).

    A record lives as long as its request: its end gives its blocks back at once, while
    its memory is warm, a success's blocks stamped with the end of their grace
    (``_Entry.until``) rather than walked again when the grace runs out (a walk of
    records two seconds old, their memory cold, cost ~9% of a busy gateway's event loop,
    BENCHMARKS.md "Straight from the protocol"); only the newest few ended ones stay,
    for the other replicas (``_Backend.recent``). The chain is a tuple (of ints:
    untracked by the garbage collector once a young collection has seen it), and no list
    is made for checkpoints where there are none."""

    __slots__ = (
        "backend", "chain", "done", "entries", "held", "marks", "shared", "started", "until"
    )  # fmt: skip

    def __init__(self, backend: str, chain: Sequence[int], held: int, started: float) -> None:
        self.backend = backend
        self.chain = chain
        self.held = held
        self.started = started
        self.entries: list[_Entry] = []
        self.marks: Sequence[tuple[int, _Entry]] = ()
        self.shared = True
        self.done = False
        self.until = 0.0


class _Backend:
    """One backend's pending blocks: ``kv`` hash -> entry, ``marks`` hash -> (position,
    entry), ``sent`` its live requests, oldest first, ``recent`` the newest successful
    ones that ended (told to the other replicas during their grace). An entry is pending
    while a request holds it or its grace lasts."""

    __slots__ = ("kv", "marks", "recent", "sent")

    def __init__(self) -> None:
        self.kv: dict[int, _Entry] = {}
        self.marks: dict[int, tuple[int, _Entry]] = {}
        # oldest first, keyed by the record itself (identity hash: no int made per
        # request); an OrderedDict: a plain dict's first item, after deletions at
        # the front, is found past every deleted slot (O(n) where this is O(1))
        self.sent: OrderedDict[Sent, Sent] = OrderedDict()
        self.recent: deque[Sent] = deque(maxlen=WIRE_CHAINS)

    def extend(self, hashes: Sequence[int], start: int, now: float) -> int:
        """How far ``hashes``' prefix of ``start`` blocks continues through pending ones."""
        kv, end, i = self.kv, len(hashes), start
        while i < end:
            entry = kv.get(hashes[i])
            if entry is None or not (entry.refs or entry.until > now):
                break
            i += 1
        return i

    def checkpoint(self, hashes: Sequence[int], upto: int, now: float) -> int:
        """The farthest pending checkpoint of ``hashes`` within ``upto`` blocks, or 0."""
        best = 0
        for value, (position, entry) in self.marks.items():
            live = entry.refs or entry.until > now
            if live and best < position <= upto and hashes[position - 1] == value:
                best = position
        return best

    def sweep(self, now: float) -> None:
        """Drop the entries no request holds whose grace has run out."""
        kv, marks = self.kv, self.marks
        for value in [v for v, e in kv.items() if e.refs <= 0 and e.until <= now]:
            del kv[value]
        for value in [v for v, (_p, e) in marks.items() if e.refs <= 0 and e.until <= now]:
            del marks[value]

    def live(self, now: float) -> bool:
        """Whether anything here still counts (or a record could be told)."""
        if self.sent or self.kv or self.marks:
            return True
        return any(record.until > now for record in self.recent)


SWEEP_S = 0.5
"""Seconds between sweeps of the entries whose holders ended and whose grace ran out
(``PendingPrefixes.expire``); meanwhile they are kept but count for nothing."""


class _Far:
    """One backend's chains as the other replicas told them: anchor hash -> (position,
    the chain's held offset, whether a checkpoint is there)."""

    __slots__ = ("anchors", "positions")

    def __init__(self) -> None:
        self.anchors: dict[int, tuple[int, int, bool]] = {}
        self.positions: list[int] = []

    def add(self, held: int, anchors: Iterable[tuple[int, int]], marks: set[int]) -> None:
        """One chain: ``held`` its blocks the registry listed when it was sent, its
        anchors (position, hash), the positions of its checkpoints. An anchor two chains
        share (a common prefix) keeps the smaller offset and either's checkpoint."""
        for position, value in anchors:
            known = self.anchors.get(value)
            offset, mark = held, position in marks
            if known is not None:
                offset, mark = min(offset, known[1]), mark or known[2]
            self.anchors[value] = (position, offset, mark)

    def prefix(self, hashes: Sequence[int], listed: int, marks: bool) -> tuple[int, int]:
        """(the farthest anchor ``hashes`` share, with ``marks`` the farthest checkpoint
        among them), counting only chains whose held part the registry still lists
        (``listed`` blocks)."""
        end = len(hashes)
        anchors = self.anchors
        kv = mark = 0
        for position in self.positions:  # farthest first
            if position > end:
                continue
            found = anchors.get(hashes[position - 1])
            if found is None or found[0] != position or found[1] > listed:
                continue
            kv = kv or position
            if found[2]:
                mark = position
            if mark or not marks:
                break
        return kv, mark


def ladder(length: int) -> list[int]:
    """The positions a chain of ``length`` blocks is told at: 1, 2, 3, 4, 6, 8, 12, ...
    below ``length``, then ``length``."""
    return list(_ladder(length))


@functools.lru_cache(maxsize=4_096)
def _ladder(length: int) -> tuple[int, ...]:
    """``ladder``, remembered: every exchange tells (and every replica reads) dozens of
    chains, mostly of the few lengths the prompts have."""
    out: list[int] = []
    step = 1
    while step < length:
        out.append(step)
        half = step + step // 2
        if step >= 2 and half < length:
            out.append(half)
        step *= 2
    if length > 0:
        out.append(length)
    return tuple(out)


class PendingPrefixes:
    """Per backend, the blocks of the requests this replica sent there that the registry
    does not list yet (module docstring), and those the other replicas told of.

    Changed on the event loop alone; ``heard`` (the fleet view's observer) may run on any
    thread: it only queues what the next ``expire`` applies."""

    def __init__(self, bounds: PendingBounds | None = None) -> None:
        self.bounds = bounds or PendingBounds()
        self.on = self.bounds.on  # read several times a request: not a property
        self.counts = PendingCounts()
        self._backends: dict[str, _Backend] = {}
        self._live: OrderedDict[Sent, Sent] = OrderedDict()  # every live one, oldest first
        self._swept = 0.0  # when ``expire`` last swept the dead entries
        self._now = 0.0  # the time of the decisions being made (``expire``'s)
        self._changes: deque[HeldChange] = deque()
        self._far: dict[str, _Far] = {}
        self._told: list[Mapping[str, Any]] = []
        self._far_stale = False

    # -- a request's start and end -------------------------------------------------------

    def sent(
        self,
        backend: str,
        chain: Sequence[int],
        held: int,
        marks: Iterable[int],
        now: float,
    ) -> Sent | None:
        """A request sent to ``backend``: its prompt's ``chain`` of block hashes beyond the
        ``held`` blocks the registry lists there counts as arriving; ``marks``: the
        positions (in blocks) where it leaves a Mamba state. None when nothing counts."""
        if not self.on:
            return None
        held = max(0, min(held, len(chain)))
        end = min(len(chain), held + self.bounds.max_blocks)
        wanted = [p for p in marks if 0 < p <= end] if marks else ()
        if end <= held and not wanted:
            return None
        if end < len(chain):
            self.counts.truncated += 1
        record = Sent(backend, tuple(chain[:end]), held, now)
        pending = self._backends.get(backend)
        if pending is None:
            pending = self._backends[backend] = _Backend()
        kv = pending.kv
        entries = record.entries
        for value in chain[held:end]:
            entry = kv.get(value)
            if entry is None:
                entry = kv[value] = _Entry()
            entry.refs += 1
            entries.append(entry)
        if wanted:
            marked: list[tuple[int, _Entry]] = []
            for position in wanted:
                value = chain[position - 1]
                known = pending.marks.get(value)
                if known is None:
                    known = pending.marks[value] = (position, _Entry())
                known[1].refs += 1
                marked.append(known)
            record.marks = marked
        self.counts.sent += len(entries)
        pending.sent[record] = record
        self._live[record] = record
        bound = self.bounds.max_blocks
        if len(kv) > bound:  # those no request holds go first, then the oldest requests'
            pending.sweep(now)
            if len(kv) > bound:
                pending.sweep(math.inf)
        while len(kv) > bound:
            oldest = next(iter(pending.sent.values()))
            if oldest is record:
                break
            self.counts.truncated += 1
            self._release(oldest, now)
        return record

    def ended(self, record: Sent | None, ok: bool, now: float) -> None:
        """``record``'s request ended: a success (``ok``) leaves its blocks counting
        ``grace`` seconds more (never past ``ttl`` from its start); anything else drops
        them now."""
        if record is None or record.done:
            return
        grace = self.bounds.grace
        if ok and grace > 0:
            until = min(now + grace, record.started + self.bounds.ttl)
            if until > now:
                record.until = until
                self._release(record, now, until)
                return
        self._release(record, now)

    def _release(self, record: Sent, now: float, until: float = 0.0) -> None:
        """``record``'s blocks given back; those it alone held count until ``until``
        (its grace) or, with none, go now (unless another's grace keeps them)."""
        if record.done:
            return
        record.done = True
        pending = self._backends.get(record.backend)
        self._live.pop(record, None)
        if pending is None:
            return
        pending.sent.pop(record, None)
        if until > now and record.shared:
            pending.recent.append(record)  # told to the other replicas while it counts
        kv = pending.kv
        chain, start = record.chain, record.held
        for offset, entry in enumerate(record.entries):
            entry.refs -= 1
            if until > entry.until:  # a success: each of its blocks counts for its grace
                entry.until = until
            elif entry.refs <= 0 and entry.until <= now:
                value = chain[start + offset]
                if kv.get(value) is entry:
                    del kv[value]
        for position, entry in record.marks:
            entry.refs -= 1
            if until > entry.until:
                entry.until = until
            elif entry.refs <= 0 and entry.until <= now:
                value = chain[position - 1]
                known = pending.marks.get(value)
                if known is not None and known[1] is entry:
                    del pending.marks[value]
        if not pending.live(now):
            del self._backends[record.backend]

    def busy(self) -> bool:
        """Whether blocks of this replica's requests are pending anywhere (in flight, or
        ended and in their grace, until the sweep after it)."""
        return bool(self._backends)

    def expire(self, now: float) -> None:
        """Apply what the view heard meanwhile, drop what ``ttl`` ended, and every
        ``SWEEP_S`` the entries whose grace ran out; ``now`` is the time the decisions
        until the next call are made at."""
        if self._changes:
            self._apply_heard()
        oldest = now - self.bounds.ttl
        live = self._live
        while live:
            record = next(iter(live.values()))
            if record.started > oldest:
                break
            self.counts.expired += 1
            self._release(record, now)
        self._now = now
        backends = self._backends
        if now - self._swept >= SWEEP_S or now < self._swept:
            self._swept = now
            for name, pending in list(backends.items()):
                pending.sweep(now)
                if not pending.live(now):
                    del backends[name]

    # -- what the view hears -------------------------------------------------------------

    def heard(self, change: HeldChange) -> None:
        """The fleet view's observer (any thread): a change to a namespace this replica
        or another has pending blocks at, queued for the loop."""
        if change.namespace in self._backends or change.namespace in self._far:
            self._changes.append(change)

    def _apply_heard(self) -> None:
        changes = self._changes
        while changes:
            change = changes.popleft()
            name = change.namespace
            if change.cleared and not change.mamba:
                self._far.pop(name, None)  # until the others tell theirs again
            pending = self._backends.get(name)
            if pending is None:
                continue
            if change.cleared:
                self._cleared(pending, change.mamba)
                continue
            table: dict[int, Any] = pending.marks if change.mamba else pending.kv
            if table:
                for value in change.added:
                    if table.pop(value, None) is not None and not change.mamba:
                        self.counts.confirmed += 1
            for value in change.removed:
                if pending.kv.pop(value, None) is not None:
                    self.counts.evicted += 1
                pending.marks.pop(value, None)  # a block's Mamba state goes with it

    def _cleared(self, pending: _Backend, mamba: bool) -> None:
        if not mamba:
            self.counts.evicted += len(pending.kv)
            pending.kv.clear()
            for record in pending.sent.values():
                record.shared = False
            pending.recent.clear()
        pending.marks.clear()

    # -- scoring -------------------------------------------------------------------------

    def extend(self, names: Iterable[str], hashes: Sequence[int], listed: Listed) -> Listed | None:
        """``listed`` with each backend's prefix continued through the blocks pending
        there (this replica's and the others'); None where none changes."""
        local, far = self._backends, self._remote()
        if not local and not far:
            return None
        at = self._now  # blocks pending as of the last ``expire``
        usable: dict[str, int] | None = None
        kv: dict[str, int] = {}
        listed_usable, listed_kv = listed.usable, listed.kv
        for name in dict.fromkeys(names):
            mine, theirs = local.get(name), far.get(name)
            if mine is None and theirs is None:
                continue
            held = listed_usable.get(name, 0)
            if listed_kv:
                held = max(held, listed_kv.get(name, 0))
            reach, mark = held, 0
            if mine is not None:
                reach = mine.extend(hashes, held, at)
            if theirs is not None:
                told, mark = theirs.prefix(hashes, held, name in listed.hybrid)
                if told > reach:
                    reach = mine.extend(hashes, told, at) if mine is not None else told
            before = listed_usable.get(name, 0)
            if name in listed.hybrid:
                if mine is not None:
                    mark = max(mark, mine.checkpoint(hashes, reach, at))
                now = max(before, mark if mark <= reach else 0)
            else:
                now = reach
            if reach == held and now == before:
                continue
            if usable is None:
                usable = dict(listed.usable)
            usable[name] = now
            if reach > now:
                kv[name] = reach
        if usable is None:
            return None
        merged = {n: b for n, b in listed.kv.items() if n not in usable}
        merged.update(kv)
        return Listed(usable, merged, listed.hybrid)

    def tables(self) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
        """What ``extend`` reads, for the gateway's decision in C (``GatewayState.choose``):
        per backend, this replica's pending blocks (a ``kv`` of hash -> an entry pending
        while its ``refs`` or ``until`` is past the last ``expire``), and the other
        replicas' chains (``positions``, farthest first, and ``anchors``: hash ->
        (position, held offset, checkpoint))."""
        return self._backends, self._remote()

    def blocks(self, backend: str) -> int:
        """``backend``'s pending blocks (this replica's; those whose grace ran out in the
        last ``SWEEP_S`` seconds too, until the sweep)."""
        pending = self._backends.get(backend)
        return len(pending.kv) if pending is not None else 0

    def told_chains(self, backend: str) -> int:
        """The chains pending at ``backend`` that the other replicas told of."""
        return sum(len(told.get(backend, ())) for told in self._told)

    # -- replicas ------------------------------------------------------------------------

    def wire(self) -> dict[str, list[Any]]:
        """This replica's newest chains per backend, for the others: ``[held, length,
        [hash at each ladder position], [[checkpoint position, hash], ...]]``."""
        out: dict[str, list[Any]] = {}
        total = 0
        for name, pending in self._backends.items():
            chains: list[Any] = []
            lasts: set[int] = set()
            ended = [r for r in reversed(pending.recent) if r.until > self._now]
            for record in itertools.chain(reversed(pending.sent.values()), ended):  # live first
                if total >= WIRE_TOTAL or len(chains) >= WIRE_CHAINS:
                    break
                length = record.held + len(record.entries)
                if not record.shared or not length or record.chain[length - 1] in lasts:
                    continue
                chain = record.chain
                lasts.add(chain[length - 1])
                marks = [[p, chain[p - 1]] for p, _entry in record.marks if p <= length]
                chains.append([record.held, length, [chain[p - 1] for p in _ladder(length)], marks])
                total += 1
            if chains:
                out[name] = chains
        return out

    def set_remote(self, told: Iterable[Mapping[str, Any]]) -> None:
        """What the other replicas last told (``parse_wire``'s answers), indexed at the
        next decision; the same answers as last time (the same objects: no peer told
        anything new) leave the index as it is."""
        now = list(told)
        last = self._told
        if len(now) == len(last) and all(a is b for a, b in zip(now, last, strict=True)):
            return
        self._told = now
        self._far_stale = True

    def _remote(self) -> dict[str, _Far]:
        if self._far_stale:
            self._far_stale = False
            far: dict[str, _Far] = {}
            for told in self._told:
                for name, chains in told.items():
                    index = far.get(name)
                    if index is None:
                        index = far[name] = _Far()
                    for held, length, values, marks in chains:
                        anchors = list(zip(_ladder(length), values, strict=True))
                        anchors += [(p, v) for p, v in marks]
                        index.add(held, anchors, {p for p, _v in marks})
            for index in far.values():
                index.positions = sorted({p for p, _h, _m in index.anchors.values()}, reverse=True)
            self._far = far
        return self._far


def parse_wire(data: Any) -> dict[str, list[tuple[int, int, list[int], list[tuple[int, int]]]]]:
    """Another replica's ``wire()``, checked (ValueError for anything else)."""
    if not isinstance(data, dict) or len(data) > WIRE_TOTAL:
        raise ValueError("pending: not a map of backends")
    out: dict[str, list[tuple[int, int, list[int], list[tuple[int, int]]]]] = {}
    count = 0
    for name, chains in data.items():
        if not isinstance(name, str) or not isinstance(chains, list):
            raise ValueError("pending: a backend's chains are a list")
        parsed = []
        for chain in chains:
            count += 1
            if count > WIRE_TOTAL or not isinstance(chain, list) or len(chain) != 4:
                raise ValueError("pending: a chain is [held, length, hashes, marks]")
            held, length, values, marks = chain
            if not _whole(held, 0, MAX_POSITION) or not _whole(length, 1, MAX_POSITION):
                raise ValueError("pending: bad positions")
            if not isinstance(values, list) or len(values) != len(_ladder(length)):
                raise ValueError("pending: one hash per ladder position")
            # every one an int (not a bool) in [1, MAX_HASH], checked in C loops
            if set(map(type, values)) != {int} or min(values) < 1 or max(values) > MAX_HASH:
                raise ValueError("pending: bad hash")
            if not isinstance(marks, list) or len(marks) > 4:
                raise ValueError("pending: bad checkpoints")
            points = []
            for mark in marks:
                if not isinstance(mark, list) or len(mark) != 2:
                    raise ValueError("pending: a checkpoint is [position, hash]")
                if not _whole(mark[0], 1, length) or not _whole(mark[1], 1, MAX_HASH):
                    raise ValueError("pending: bad checkpoint")
                points.append((mark[0], mark[1]))
            parsed.append((held, length, values, points))
        out[name] = parsed
    return out


def _whole(value: Any, low: int, high: int) -> bool:
    return type(value) is int and low <= value <= high


def checkpoints(
    hybrid: bool, tokens: int, block_size: int, kv_hit: int, usable: int
) -> Iterator[int]:
    """Where a request leaves Mamba state on a hybrid model's node (positions in
    blocks, ``sim.checkpoints``' ``vllm`` rule): the replay boundary, and the junction
    where its KV hit there (``kv_hit`` blocks) ends beyond its usable prefix."""
    if not hybrid:
        return
    limit = max(tokens - 1, 0) // block_size
    if limit:
        yield limit
    junction = min(kv_hit, limit)
    if junction > usable and junction != limit:
        yield junction
