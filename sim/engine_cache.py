"""A vLLM engine's prefix cache and its KV events, without I/O: what a simulated engine
holds, hits and publishes (the benchmark fleet ``pcr.bench.sim_engines`` and the
trace replay ``sim.trace_replay`` both serve requests through it).

It keeps vLLM 0.32's block pool rules (``vllm/v1/core/block_pool.py``,
``kv_cache_manager.py``):

* ``capacity`` blocks; a block is free (on the free queue, oldest first) or held by
  running requests (a reference count). A free block may still be cached: it keeps its
  hash until it is taken for new work, and that taking evicts it (``BlockRemoved``);
* a request's hit is the longest run of its leading complete blocks found in the cache,
  at most ``(prompt_tokens - 1) // block_size`` blocks (the last token is computed again
  for its logits); the hit blocks are held again (off the free queue);
* it then takes fresh blocks for the rest of its prompt and the tokens it will generate,
  from the head of the free queue, and caches its newly computed complete prompt blocks
  at once (a later request on the same engine hits them), announced by one
  ``BlockStored`` with their tokens and the parent's hash. A block computed again under
  a hash already cached (a fully cached prompt whose length is a multiple of the block
  size) is a second copy, announced again; each copy is removed on its own;
* a finished request frees its blocks last first onto the tail of the free queue, so a
  prompt's last blocks are evicted before its first ones;
* ``clear`` empties the cache (``AllBlocksCleared``) only when no request runs, as
  ``POST /reset_prefix_cache`` does.

Generated tokens are not cached (their blocks are held while the request runs and freed
uncached): a trace's next turn names its own blocks. Events queue in order until
:meth:`EngineCache.take_events`; the caller publishes them when the engine's step ends.
Counters are vLLM's ``prefix_cache_queries`` and ``prefix_cache_hits`` (tokens).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias


@dataclass(frozen=True)
class Stored:
    """``BlockStored``: newly cached complete blocks, chained from ``parent``."""

    hashes: tuple[int, ...]
    parent: int | None
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class Removed:
    """``BlockRemoved``: one evicted copy of a block."""

    hashes: tuple[int, ...]


@dataclass(frozen=True)
class Cleared:
    """``AllBlocksCleared``."""


CacheEvent: TypeAlias = "Stored | Removed | Cleared"


@dataclass(frozen=True)
class Admission:
    """A running request's share of the cache."""

    blocks: tuple[int, ...]
    """The block ids it holds, in prompt order."""
    hit_blocks: int
    computed_blocks: int
    """Blocks its prefill computes (the prompt's blocks past the hit, a partial one too)."""
    prompt_tokens: int


class CacheFull(RuntimeError):
    """Not enough free blocks for a request right now."""


class EngineCache:
    """One engine's block pool and prefix cache (``capacity`` blocks of ``block_size``)."""

    def __init__(self, capacity: int, block_size: int) -> None:
        if capacity < 1 or block_size < 1:
            raise ValueError(f"capacity and block_size must be >= 1, not {capacity}, {block_size}")
        self.capacity = capacity
        self.block_size = block_size
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(capacity))
        self.refs = [0] * capacity
        self.hash_of: dict[int, int] = {}
        self.copies: dict[int, list[int]] = {}
        self.events: list[CacheEvent] = []
        self.queries = 0
        self.hits = 0

    # -- reading ---------------------------------------------------------------------------

    def hit(self, hashes: Sequence[int], prompt_tokens: int) -> int:
        """How many leading blocks of a prompt (``hashes``: its complete blocks' hashes)
        the cache would give it now."""
        limit = min(len(hashes), (prompt_tokens - 1) // self.block_size)
        count = 0
        while count < limit and hashes[count] in self.copies:
            count += 1
        return count

    def blocks_needed(self, prompt_tokens: int, generated: int) -> int:
        return math.ceil((prompt_tokens + generated) / self.block_size)

    def fits(self, hashes: Sequence[int], prompt_tokens: int, generated: int) -> bool:
        """Whether :meth:`admit` would find room now."""
        hit = self.hit(hashes, prompt_tokens)
        held_free = sum(1 for h in hashes[:hit] if self.refs[self.copies[h][0]] == 0)
        fresh = self.blocks_needed(prompt_tokens, generated) - hit
        return fresh + held_free <= len(self.free)

    def cached(self) -> set[int]:
        """The hashes the cache holds (at least one copy)."""
        return set(self.copies)

    def in_use(self) -> int:
        return self.capacity - len(self.free)

    # -- serving ---------------------------------------------------------------------------

    def admit(self, hashes: Sequence[int], tokens: Sequence[int], generated: int) -> Admission:
        """Start a request: count its hit, hold its blocks, cache its new complete prompt
        blocks. ``hashes`` are the engine's hashes of ``tokens``' complete blocks;
        ``generated`` the tokens it may produce. ``CacheFull`` (nothing changed) when the
        free blocks are too few."""
        prompt_tokens = len(tokens)
        if len(hashes) != prompt_tokens // self.block_size:
            raise ValueError(
                f"{len(hashes)} hashes for {prompt_tokens} tokens of {self.block_size} a block"
            )
        if not self.fits(hashes, prompt_tokens, generated):
            raise CacheFull(
                f"{self.blocks_needed(prompt_tokens, generated)} blocks wanted, "
                f"{len(self.free)} free"
            )
        hit = self.hit(hashes, prompt_tokens)
        held = [self.copies[h][0] for h in hashes[:hit]]
        for block in held:
            if self.refs[block] == 0:
                del self.free[block]
            self.refs[block] += 1
        fresh = [self._take() for _ in range(self.blocks_needed(prompt_tokens, generated) - hit)]
        complete = len(hashes)
        for i, block in enumerate(fresh[: complete - hit], start=hit):
            self.hash_of[block] = hashes[i]
            self.copies.setdefault(hashes[i], []).append(block)
        if complete > hit:
            size = self.block_size
            self.events.append(
                Stored(
                    tuple(hashes[hit:complete]),
                    hashes[hit - 1] if hit else None,
                    tuple(tokens[hit * size : complete * size]),
                )
            )
        self.queries += prompt_tokens
        self.hits += hit * self.block_size
        computed = math.ceil(prompt_tokens / self.block_size) - hit
        return Admission(tuple(held + fresh), hit, computed, prompt_tokens)

    def release(self, admission: Admission) -> None:
        """A request ended: its blocks go back, last first, to the free queue's tail."""
        for block in reversed(admission.blocks):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free[block] = None

    def clear(self) -> bool:
        """Drop every cached block (``AllBlocksCleared``); False, changing nothing, while
        a request holds blocks."""
        if len(self.free) != self.capacity:
            return False
        self.hash_of.clear()
        self.copies.clear()
        self.events.append(Cleared())
        return True

    def take_events(self) -> list[CacheEvent]:
        """The events since the last call, in the order they happened."""
        events, self.events = self.events, []
        return events

    def _take(self) -> int:
        """The free queue's oldest block, evicted from the cache if it was cached."""
        block, _ = self.free.popitem(last=False)
        self.refs[block] = 1
        old = self.hash_of.pop(block, None)
        if old is not None:
            copies = self.copies[old]
            copies.remove(block)
            if not copies:
                del self.copies[old]
            self.events.append(Removed((old,)))
        return block
