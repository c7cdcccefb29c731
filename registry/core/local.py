"""``LocalPrefixCacheRegistry``: the same API and meaning, in process memory.

It is the reference model the differential tests compare the Redis registry with,
and a drop-in for a single process that needs no sharing. It numbers its eviction
notices like the Redis registry (hooks receive them) but publishes nowhere. Not
thread-safe: guard it with a lock if several threads use one instance.
"""

from __future__ import annotations

from collections.abc import Iterator

from registry.core.base import RegistryBase
from registry.core.notices import EvictionNotice
from registry.core.types import BlockHash, BlockId, BlockPair, NoticeKind


class LocalPrefixCacheRegistry(RegistryBase):
    """Two dicts, ``kv`` and ``mamba``, each ``hash -> block_id``."""

    def __init__(self) -> None:
        super().__init__()
        self.kv: dict[int, int] = {}
        self.mamba: dict[int, int] = {}
        self.notice_seq = 0

    def _notice(self, kind: NoticeKind, pairs: list[tuple[int, int]]) -> EvictionNotice | None:
        if not pairs and kind != NoticeKind.CLEAR:
            return None
        self.notice_seq += 1
        listed = tuple(BlockPair(BlockId(b), BlockHash(h)) for b, h in pairs)
        return EvictionNotice(self.notice_seq, kind, listed)

    def _match_kv_prefix(self, hashes: list[int]) -> list[int]:
        block_ids = []
        for h in hashes:
            block_id = self.kv.get(h)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def _register_kv(self, entries: dict[int, int]) -> None:
        self.kv.update(entries)

    def _evict_kv(self, hashes: list[int]) -> tuple[set[int], EvictionNotice | None]:
        removed = {h for h in hashes if self.kv.pop(h, None) is not None}
        pairs = [(self.mamba.pop(h), h) for h in hashes if h in removed and h in self.mamba]
        return removed, self._notice(NoticeKind.CASCADE, pairs)

    def _match_mamba_farthest(self, hashes: list[int]) -> int:
        for i in range(len(hashes) - 1, -1, -1):
            if hashes[i] in self.mamba:
                return i + 1
        return 0

    def _register_mamba(self, entries: dict[int, int]) -> tuple[EvictionNotice | None, int]:
        replaced = [
            (old, h) for h, new in entries.items() if (old := self.mamba.get(h, new)) != new
        ]
        self.mamba.update(entries)
        notice = self._notice(NoticeKind.REPLACE, replaced)
        return notice, self.notice_seq

    def _evict_mamba(self, hashes: list[int]) -> tuple[set[int], EvictionNotice | None]:
        pairs = [(self.mamba.pop(h), h) for h in hashes if h in self.mamba]
        return {h for _, h in pairs}, self._notice(NoticeKind.EVICT, pairs)

    def _mamba_block_ids(self, hashes: list[int]) -> list[int | None]:
        return [self.mamba.get(h) for h in hashes]

    def _notice_sequence(self) -> int:
        return self.notice_seq

    def _clear(self, *, kv: bool, mamba: bool) -> EvictionNotice | None:
        if kv:
            self.kv.clear()
        if mamba and self.mamba:
            self.mamba.clear()
            return self._notice(NoticeKind.CLEAR, [])
        return None

    def _view_get(self, kind: str, h: int) -> int | None:
        return (self.kv if kind == "kv" else self.mamba).get(h)

    def _view_contains(self, kind: str, h: int) -> bool:
        return h in (self.kv if kind == "kv" else self.mamba)

    def _view_len(self, kind: str) -> int:
        return len(self.kv if kind == "kv" else self.mamba)

    def _view_items(self, kind: str) -> Iterator[tuple[int, int]]:
        return iter(list((self.kv if kind == "kv" else self.mamba).items()))
