"""A serving node's KV block allocator, as an engine keeps it."""

from __future__ import annotations

from collections import OrderedDict


class KVBlockPool:
    """A node's KV block allocator: reference counts, parent links, and leaf-first LRU.

    Only blocks nobody uses and no cached block descends from are evictable, oldest
    use first; evicting a leaf may make its parent one.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.free = list(range(capacity - 1, -1, -1))
        self.hash_of: dict[int, int] = {}
        self.parent: dict[int, int | None] = {}
        self.children: dict[int, int] = {}
        self.refs: dict[int, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()

    def allocate(self, h: int, parent: int | None) -> int:
        block = self.free.pop()
        self.hash_of[block] = h
        self.parent[block] = parent
        self.children[block] = 0
        self.refs[block] = 1
        if parent is not None:
            self.children[parent] += 1
            self.evictable.pop(parent, None)
        return block

    def acquire(self, block: int) -> None:
        self.refs[block] += 1
        self.evictable.pop(block, None)

    def release(self, block: int) -> None:
        self.refs[block] -= 1
        self._maybe_evictable(block)

    def victims(self, count: int) -> list[int]:
        """Up to ``count`` evictable blocks, least recently used first (leaves only)."""
        return list(self.evictable)[:count]

    def drop(self, block: int) -> None:
        """Forget an evicted block (it must be a leaf nobody uses)."""
        assert self.refs[block] == 0, f"block {block} is in use"
        assert self.children[block] == 0, f"block {block} has cached descendants"
        self.evictable.pop(block, None)
        parent = self.parent.pop(block)
        del self.hash_of[block], self.children[block], self.refs[block]
        self.free.append(block)
        if parent is not None:
            self.children[parent] -= 1
            self._maybe_evictable(parent)

    def with_descendants(self, blocks: set[int]) -> set[int]:
        """``blocks`` and every cached block that descends from one of them."""
        result = set(blocks)
        for block in list(self.hash_of):
            chain = []
            current: int | None = block
            while current is not None and current not in result:
                chain.append(current)
                current = self.parent[current]
            if current is not None:
                result.update(chain)
        return result

    def drop_all(self, blocks: set[int]) -> None:
        """Forget ``blocks`` (none in use; closed under descendants), leaves first."""
        remaining = set(blocks)
        while remaining:
            leaves = [b for b in remaining if self.children[b] == 0]
            assert leaves, "drop_all needs a set closed under descendants"
            for block in leaves:
                self.drop(block)
                remaining.discard(block)

    def _maybe_evictable(self, block: int) -> None:
        if self.refs[block] == 0 and self.children[block] == 0:
            self.evictable[block] = None
            self.evictable.move_to_end(block)
