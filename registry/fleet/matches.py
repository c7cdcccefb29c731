"""A decision's answer from the fleet view, and the walk that finds it (no I/O).

The walk looks the prompt's hashes up in the table's KV map one after another, each
holder set ANDed into the running one, until no namespace of the mask still holds every
block so far; in the C extension (``registry/fleet/_holders.c``, ``NATIVE``) over the
map's native index where it is built, else in Python (``walk_python``: ``map``,
``accumulate``, ``takewhile``), with the same answers. What it keeps are the running
set's change points: each prefix length at which some namespaces' prefix ends, with
those namespaces, the longest last. Nothing in it grows with the fleet but the width of
the ints; the namespaces' prefixes are all in it, read on demand.

``Matches`` is the answer: a read-only mapping namespace -> usable prefix, resolved to
names only when read as a mapping, and ``top()``, the longest usable prefix and who holds
it, which is what choosing a node needs. Names are resolved through the ``Naming`` the
table had when the walk began, so an answer read later still names the namespaces that
held the slots then.
"""

from __future__ import annotations

from collections.abc import ItemsView, Iterator, KeysView, Mapping, Sequence, ValuesView
from itertools import accumulate, compress, count, repeat, takewhile
from operator import and_
from types import ModuleType
from typing import Any

from registry.core.validation import prefix_hashes

NATIVE: ModuleType | None
"""The C extension ``registry.fleet._holders`` (the maps' native indexes and the walk
over them) as imported, or None where it was not built: the same walk in Python."""
try:
    from registry.fleet import _holders as NATIVE
except ImportError:  # installed without its C extension
    NATIVE = None

MEMO_NAMES = 1 << 18
"""How many names a ``Naming`` remembers across the holder sets it decoded (a few MB),
before it forgets them all and starts again."""


class Naming:
    """Slot -> namespace at one moment, and the holder sets decoded into names
    (remembered: the same sets come back decision after decision while the fleet holds
    still). The table replaces it whole when a slot changes hands."""

    __slots__ = ("_at", "_sets", "_size", "names")

    def __init__(self, names: tuple[str | None, ...], carried: Naming | None = None) -> None:
        self.names = names
        # Sets decoded before stay true when a slot was only added.
        self._sets: dict[int, dict[str, None]] = {} if carried is None else carried._sets
        self._at: dict[tuple[int, int], dict[str, int]] = {} if carried is None else carried._at
        self._size: int = 0 if carried is None else carried._size

    def named(self, bits: int) -> dict[str, None]:
        """The namespaces whose bit is set in ``bits``, as dict keys (a dict, because
        ``dict.fromkeys`` of a dict is the quickest way to an answer)."""
        found = self._sets.get(bits)
        if found is None:
            names = self.names
            out = []
            members = bits
            while members:
                lowest = members & -members
                slot = lowest.bit_length() - 1
                name = names[slot] if slot < len(names) else None
                if name is not None:  # dropped (or added) since this naming was made
                    out.append(name)
                members ^= lowest
            found = dict.fromkeys(out)
            self._remember(len(out))
            self._sets[bits] = found
        return found

    def named_at(self, bits: int, position: int) -> dict[str, int]:
        """``dict.fromkeys(self.named(bits), position)``, remembered: an answer is a few
        of these merged, the same ones decision after decision."""
        key = (bits, position)
        found = self._at.get(key)
        if found is None:
            found = dict.fromkeys(self.named(bits), position)
            self._remember(len(found))
            self._at[key] = found
        return found

    def _remember(self, size: int) -> None:
        self._size += size + 1
        if self._size > MEMO_NAMES:
            self._sets.clear()
            self._at.clear()
            self._size = size + 1


def walk(
    kv: dict[int, int],
    mamba: dict[int, int],
    hashes: list[int],
    mask: int,
    checkpoints: bool,
    indexes: tuple[Any, Any] | None = None,
) -> tuple[list[tuple[int, int]], list[int], int]:
    """(``steps``; the Mamba checkpoints; how many hashes were read). ``steps``: [(a KV
    prefix length, the slots of ``mask`` whose KV prefix it is)], longest last (the
    longest prefix held), for the prefixes of at least one block: the running holder
    sets' change points. With ``checkpoints``, entry ``i``
    of the third: the slots holding blocks ``0 .. i`` that hold a Mamba entry for block
    ``i``; else it is empty. The hashes it read are checked (``prefix_hashes``: a bad
    one raises), or all of them where it read none; the rest can change no answer (no
    prefix runs past a block no one holds). ``indexes``: the ``NATIVE`` ``Index`` of
    ``kv`` and of ``mamba``, where the extension is built: the native walk, which checks
    as it reads, over a prompt of plain ints; else ``walk_python``, the same answers."""
    if indexes is not None and NATIVE is not None:
        found: tuple[list[tuple[int, int]], list[int], int] | None = NATIVE.walk(
            indexes[0], hashes, mask, indexes[1] if checkpoints else None
        )
        if found is not None and (found[2] or not hashes):
            return found
    found = walk_python(kv, mamba, hashes, mask, checkpoints)
    read = found[2]
    prefix_hashes(hashes[:read] if read else hashes)  # raises on a bad hash
    return found


def walk_python(
    kv: dict[int, int],
    mamba: dict[int, int],
    hashes: Sequence[int],
    mask: int,
    checkpoints: bool,
) -> tuple[list[tuple[int, int]], list[int], int]:
    """``walk`` in Python: the specification, and the walk of a prompt the native one
    hands back (a hash that is not a plain int, to be refused with the clear error)."""
    running = list(takewhile(bool, accumulate(map(kv.get, hashes, repeat(0)), and_, initial=mask)))
    read = min(len(running), len(hashes))
    marks: list[int] = []
    if checkpoints and len(running) > 1:
        marks = list(map(and_, map(mamba.get, hashes, repeat(0)), running[1:]))
    return ends(running), marks, read


def ends(running: Sequence[int]) -> list[tuple[int, int]]:
    """[(a KV prefix length, the slots whose KV prefix it is)], longest last, for the
    prefixes of at least one block, from the running holder sets."""
    last = dict(zip(running, count()))  # each holder set -> the last position it holds to
    out: list[tuple[int, int]] = []
    entries = iter(last.items())
    before, at = next(entries, (0, 0))
    for bits, position in entries:
        if at:
            out.append((at, before ^ bits))  # the sets shrink: a XOR is what left
        before, at = bits, position
    if at:
        out.append((at, before))
    return out


def farthest(marks: Sequence[int], among: int) -> list[tuple[int, int]]:
    """[(one past a slot's farthest Mamba checkpoint, the slots of ``among`` whose
    farthest it is)], farthest first."""
    out: list[tuple[int, int]] = []
    found = 0
    for position in reversed(list(compress(count(1), marks))):
        fresh = marks[position - 1] & among & ~found
        if fresh:
            found |= fresh
            out.append((position, fresh))
    return out


class Matches(Mapping[str, int]):
    """The live namespaces (all, or those asked for) holding a prefix of a prompt, each
    with its usable prefix in blocks: a read-only mapping, resolved to names the first
    time it is read as one. ``top()`` reads only the longest prefix. ``reuses``: the
    slots whose usable prefix is their farthest Mamba checkpoint (hybrid models'
    nodes; -1 all of them), the others' is their KV prefix."""

    __slots__ = ("_marks", "_naming", "_resolved", "_reuses", "_steps")

    def __init__(
        self, steps: list[tuple[int, int]], marks: list[int], reuses: int, naming: Naming
    ) -> None:
        self._steps = steps
        self._marks = marks
        self._reuses = reuses
        self._naming = naming
        self._resolved: dict[str, int] | None = None

    def top(self) -> tuple[int, list[str]]:
        """The longest usable prefix, and the namespaces whose prefix it is; (0, [])
        when no namespace can reuse a block."""
        steps, reuses = self._steps, self._reuses
        if not steps:
            return 0, []
        if not reuses:
            longest, holders = steps[-1]
            return longest, list(self._naming.named(holders))
        plain_at, plain = 0, 0
        if ~reuses:
            for position, bits in reversed(steps):
                plain = bits & ~reuses
                if plain:
                    plain_at = position
                    break
        marks = self._marks
        mamba_at, mamba = 0, 0
        for position in range(len(marks), 0, -1):
            mamba = marks[position - 1] & reuses
            if mamba:
                mamba_at = position
                break
        best = max(plain_at, mamba_at)
        if not best:
            return 0, []
        bits = (plain if plain_at == best else 0) | (mamba if mamba_at == best else 0)
        return best, list(self._naming.named(bits))

    @property
    def usable(self) -> dict[str, int]:
        """The answer as a plain dict (resolved once; ``dict(matches)`` builds another
        key by key)."""
        return self._mapping()

    def __bool__(self) -> bool:
        return bool(self._steps)

    def __getitem__(self, name: str) -> int:
        return self._mapping()[name]

    def __contains__(self, name: object) -> bool:
        return name in self._mapping()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Matches):
            return self._mapping() == other._mapping()
        if isinstance(other, Mapping):
            return self._mapping() == dict(other.items())
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def keys(self) -> KeysView[str]:
        return self._mapping().keys()

    def items(self) -> ItemsView[str, int]:
        return self._mapping().items()

    def values(self) -> ValuesView[int]:
        return self._mapping().values()

    def get(self, name: str, default: Any = None) -> Any:
        return self._mapping().get(name, default)

    def __iter__(self) -> Iterator[str]:
        return iter(self._mapping())

    def __len__(self) -> int:
        return len(self._mapping())

    def __repr__(self) -> str:
        return f"Matches({self._mapping()!r})"

    def _mapping(self) -> dict[str, int]:
        resolved = self._resolved
        if resolved is None:
            resolved = self._resolved = self._resolve()
        return resolved

    def _resolve(self) -> dict[str, int]:
        naming, reuses = self._naming, self._reuses
        usable: dict[str, int] = {}
        if not reuses:
            for position, bits in self._steps:
                usable.update(naming.named_at(bits, position))
            return usable
        for position, bits in self._steps:
            plain = bits & ~reuses
            if plain:
                usable.update(naming.named_at(plain, position))
            if bits != plain:  # hybrid nodes: 0 unless a checkpoint is found below
                usable.update(dict.fromkeys(naming.named(bits & reuses), 0))
        for position, bits in farthest(self._marks, reuses):
            usable.update(dict.fromkeys(naming.named(bits), position))
        return usable
