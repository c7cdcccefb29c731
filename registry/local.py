"""``LocalPrefixCacheRegistry``: the same API and meaning, in process memory.

It is the reference model the differential tests compare the Redis registry with,
and a drop-in for a single process that needs no sharing. Not thread-safe: guard it
with a lock if several threads use one instance.
"""

from __future__ import annotations

from registry.base import RegistryBase


class LocalPrefixCacheRegistry(RegistryBase):
    """Two dicts, ``kv`` and ``mamba``, each ``hash -> block_id``."""

    def __init__(self) -> None:
        super().__init__()
        self.kv: dict[int, int] = {}
        self.mamba: dict[int, int] = {}

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

    def _evict_kv(self, hashes: list[int]) -> tuple[set[int], list[int]]:
        removed = {h for h in hashes if self.kv.pop(h, None) is not None}
        mamba_ids = [self.mamba.pop(h) for h in hashes if h in removed and h in self.mamba]
        return removed, mamba_ids

    def _match_mamba_farthest(self, hashes: list[int]) -> int:
        for i in range(len(hashes) - 1, -1, -1):
            if hashes[i] in self.mamba:
                return i + 1
        return 0

    def _register_mamba(self, entries: dict[int, int]) -> list[int]:
        replaced = [old for h, new in entries.items() if (old := self.mamba.get(h, new)) != new]
        self.mamba.update(entries)
        return replaced

    def _evict_mamba(self, hashes: list[int]) -> tuple[set[int], list[int]]:
        removed, block_ids = set(), []
        for h in hashes:
            block_id = self.mamba.pop(h, None)
            if block_id is not None:
                removed.add(h)
                block_ids.append(block_id)
        return removed, block_ids

    def _clear(self, *, kv: bool, mamba: bool) -> None:
        if kv:
            self.kv.clear()
        if mamba:
            self.mamba.clear()
