"""Megatron-Core's twelve-method registry API, written once over storage primitives.

``RegistryBase`` checks arguments, handles empty input without touching storage,
and fires the Mamba-evict callback; subclasses only store and look up. So the Redis
registry and the in-memory reference share one meaning by construction, and the
differential tests compare storage engines, not two copies of the rules.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence

from registry.core import observe
from registry.core.notices import EvictionNotice
from registry.core.validation import (
    eviction_hashes,
    lookup_hashes,
    prefix_hashes,
    registration,
    search_length,
)
from registry.core.views import HashMapView

MambaEvictCallback = Callable[[list[int]], None]
EvictionHook = Callable[[EvictionNotice], object]


class RegistryBase(ABC):
    """``hash -> block_id`` registry for KV blocks and Mamba state blocks."""

    def __init__(self) -> None:
        self._on_mamba_evicted: MambaEvictCallback | None = None
        self._eviction_hooks: tuple[EvictionHook, ...] = ()

    # -- Megatron-Core's dicts, as live read-only views ------------------------------

    @property
    def kv_hash_to_block_id(self) -> HashMapView:
        """The KV map (``hash -> block id``) as a live, read-only ``Mapping``: each lookup
        is one read of the storage, iteration a scan (``registry.core.views``)."""
        return HashMapView(self, "kv")

    @property
    def mamba_hash_to_block_id(self) -> HashMapView:
        """The Mamba map (``hash -> block id``) as a live, read-only ``Mapping``."""
        return HashMapView(self, "mamba")

    # -- callback ---------------------------------------------------------------

    def set_mamba_evict_callback(self, cb: MambaEvictCallback | None) -> None:
        """Wire ``cb(block_ids)``, fired once per call that removed Mamba entries.

        It runs in the calling thread of this process, after the removal is stored.
        ``None`` unwires it. Other processes learn of removals from the notices.
        """
        if cb is not None and not callable(cb):
            raise TypeError(f"callback must be callable or None, not {type(cb).__name__}")
        self._on_mamba_evicted = cb

    def add_eviction_hook(self, hook: EvictionHook) -> None:
        """Also pass every notice this object's calls publish to ``hook``, in-process.

        Unlike the Megatron-Core callback, a hook sees clears too, and each notice's sequence
        number and (block_id, hash) pairs, which a slot owner needs because block ids
        are reused. The Mamba slot pool attaches itself this way.
        """
        if not callable(hook):
            raise TypeError(f"hook must be callable, not {type(hook).__name__}")
        self._eviction_hooks = (*self._eviction_hooks, hook)

    def remove_eviction_hook(self, hook: EvictionHook) -> None:
        """Detach a hook added with ``add_eviction_hook`` (no error if absent)."""
        self._eviction_hooks = tuple(h for h in self._eviction_hooks if h != hook)

    def _notify(self, notice: EvictionNotice | None) -> None:
        if notice is None:
            return
        if notice.pairs and self._on_mamba_evicted is not None:
            self._on_mamba_evicted([block_id for block_id, _ in notice.pairs])
        for hook in self._eviction_hooks:
            hook(notice)

    # -- KV ---------------------------------------------------------------------

    def match_kv_prefix(self, hashes: Sequence[int]) -> tuple[list[int], int]:
        """Block ids of the longest cached prefix and its last block's hash (0 if none).

        The prefix ends at the first hash that is not cached (or is a -1/0 sentinel):
        a hole in the middle never yields block ids beyond it.
        """
        try:
            wanted = prefix_hashes(hashes)
        except (TypeError, ValueError):
            observe.bad_input("match_kv_prefix")
            raise
        if not wanted:
            return [], 0
        block_ids = self._match_kv_prefix(wanted)
        observer = observe.current
        if observer is not None:
            observer.prefix_query(len(wanted), len(block_ids))
        return block_ids, (wanted[len(block_ids) - 1] if block_ids else 0)

    def register_kv(self, block_ids: Sequence[int], hashes: Sequence[int]) -> None:
        """Add ``hash -> block_id`` entries; the last writer wins for an existing hash."""
        try:
            entries = registration(block_ids, hashes, skip_sentinels=False)
        except (TypeError, ValueError):
            observe.bad_input("register_kv")
            raise
        if entries:
            self._register_kv(entries)

    def evict_kv(self, hashes: Iterable[int]) -> set[int]:
        """Drop KV entries (ignoring -1), cascading to Mamba; return the hashes removed."""
        try:
            wanted = eviction_hashes(hashes)
        except (TypeError, ValueError):
            observe.bad_input("evict_kv")
            raise
        if not wanted:
            return set()
        removed, notice = self._evict_kv(wanted)
        self._notify(notice)
        return removed

    # -- Mamba ------------------------------------------------------------------

    def match_mamba_farthest(self, hashes: Sequence[int]) -> int:
        """One past the farthest index whose hash has Mamba state; 0 if none."""
        try:
            wanted = lookup_hashes(hashes)
        except (TypeError, ValueError):
            observe.bad_input("match_mamba_farthest")
            raise
        return self._match_mamba_farthest(wanted) if wanted else 0

    def find_mamba_backoff(self, hashes: Sequence[int], search_len: int) -> int:
        """``match_mamba_farthest`` within ``hashes[:search_len]`` (clamped; <= 0 gives 0)."""
        try:
            limit = search_length(search_len)
            wanted = lookup_hashes(hashes)
        except (TypeError, ValueError):
            observe.bad_input("find_mamba_backoff")
            raise
        if limit <= 0 or not wanted:
            return 0
        return self._match_mamba_farthest(wanted[:limit])

    def register_mamba(self, block_ids: Sequence[int], hashes: Sequence[int]) -> None:
        """Add ``hash -> block_id`` entries, skipping hashes <= 0.

        A hash that pointed at another block id loses that old entry, which counts
        as a Mamba removal (callback and 'replace' notice): its slot is stale.
        """
        self.register_mamba_stamped(block_ids, hashes)

    def register_mamba_stamped(self, block_ids: Sequence[int], hashes: Sequence[int]) -> int:
        """``register_mamba``, returning the namespace's notice number right after it.

        Only a notice numbered above this stamp can remove the entries just written: a
        slot owner uses it to ignore a late notice about an earlier registration of the
        same (block_id, hash). With nothing to register it returns 0 and sends nothing.
        """
        try:
            entries = registration(block_ids, hashes, skip_sentinels=True)
        except (TypeError, ValueError):
            observe.bad_input("register_mamba")
            raise
        if not entries:
            return 0
        notice, stamp = self._register_mamba(entries)
        self._notify(notice)
        return stamp

    def evict_mamba(self, hashes: Iterable[int]) -> set[int]:
        """Drop Mamba entries (ignoring -1); return the hashes actually removed."""
        try:
            wanted = eviction_hashes(hashes)
        except (TypeError, ValueError):
            observe.bad_input("evict_mamba")
            raise
        if not wanted:
            return set()
        removed, notice = self._evict_mamba(wanted)
        self._notify(notice)
        return removed

    def mamba_block_ids(self, hashes: Sequence[int]) -> list[int | None]:
        """The block id holding Mamba state for each hash, or None; one atomic read."""
        try:
            wanted = lookup_hashes(hashes)
        except (TypeError, ValueError):
            observe.bad_input("mamba_block_ids")
            raise
        return self._mamba_block_ids(wanted) if wanted else []

    def notice_sequence(self) -> int:
        """The number of the last eviction notice of this namespace's history.

        0 before the namespace's first write. A history's numbers start from the server's
        clock, so before its first notice this is that starting number (its notices are
        numbered above it): compare numbers only within one ``notice_position`` incarnation.
        """
        return self._notice_sequence()

    # -- reset ------------------------------------------------------------------

    def clear_kv(self) -> None:
        """Drop every KV entry (Mamba entries stay; no callback, as in Megatron-Core)."""
        self._clear(kv=True, mamba=False)

    def clear_mamba(self) -> None:
        """Drop every Mamba entry (no callback; hooks and listeners get a 'clear' notice)."""
        self._notify(self._clear(kv=False, mamba=True))

    def reset(self) -> None:
        """Drop every KV and Mamba entry; the callback stays wired."""
        self._notify(self._clear(kv=True, mamba=True))

    # -- storage primitives -----------------------------------------------------

    @abstractmethod
    def _match_kv_prefix(self, hashes: list[int]) -> list[int]:
        """Block ids of ``hashes[:k]`` for the largest k with all of them cached."""

    @abstractmethod
    def _register_kv(self, entries: dict[int, int]) -> None:
        """Store ``entries`` (hash -> block id) in the KV map."""

    @abstractmethod
    def _evict_kv(self, hashes: list[int]) -> tuple[set[int], EvictionNotice | None]:
        """Remove distinct ``hashes`` from KV and Mamba; (KV hashes removed, notice)."""

    @abstractmethod
    def _match_mamba_farthest(self, hashes: list[int]) -> int:
        """One past the last index of ``hashes`` present in the Mamba map; 0 if none."""

    @abstractmethod
    def _register_mamba(self, entries: dict[int, int]) -> tuple[EvictionNotice | None, int]:
        """Store ``entries`` in the Mamba map; (notice of replaced entries, stamp)."""

    @abstractmethod
    def _evict_mamba(self, hashes: list[int]) -> tuple[set[int], EvictionNotice | None]:
        """Remove distinct ``hashes`` from the Mamba map; (hashes removed, notice)."""

    @abstractmethod
    def _mamba_block_ids(self, hashes: list[int]) -> list[int | None]:
        """The Mamba map's value for each hash, None where absent."""

    @abstractmethod
    def _notice_sequence(self) -> int:
        """The last notice number of the namespace."""

    @abstractmethod
    def _clear(self, *, kv: bool, mamba: bool) -> EvictionNotice | None:
        """Drop every entry of the chosen maps, atomically together; a clear notice
        when Mamba entries went."""

    @abstractmethod
    def _view_get(self, kind: str, h: int) -> int | None:
        """The block id of hash ``h`` in map ``kind`` ("kv" or "mamba"), or None."""

    @abstractmethod
    def _view_contains(self, kind: str, h: int) -> bool:
        """Whether map ``kind`` holds hash ``h``."""

    @abstractmethod
    def _view_len(self, kind: str) -> int:
        """The number of entries in map ``kind``."""

    @abstractmethod
    def _view_items(self, kind: str) -> Iterator[tuple[int, int]]:
        """Every (hash, block id) of map ``kind`` (a scan: may miss concurrent changes)."""
