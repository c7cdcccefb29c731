"""The simulated engine's block pool (``sim.engine_cache``): vLLM's hit, eviction and
copy rules, and events that the project's bridge turns into exactly the engine's cache."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import fakeredis
import pytest

from registry import PrefixCacheRegistry
from registry.core.hashing import block_hashes
from sim.engine_cache import CacheFull, Cleared, EngineCache, Removed, Stored

pytest.importorskip("msgpack")
pytest.importorskip("zmq")  # sim.engine_events

from pcr.bench.sim_engines import encode_batch
from registry.bridge.bridge import EngineSource, Follower
from sim.engine_events import engine_chain

BS = 4


def tokens(seed: int, count: int) -> list[int]:
    return [(seed * 1009 + i * 7) % 5000 + 10 for i in range(count)]


def serve(cache: EngineCache, prompt: list[int], generated: int = 1, seed: bytes = b"e") -> Any:
    admission = cache.admit(engine_chain(prompt, BS, seed=seed), prompt, generated)
    cache.release(admission)
    return admission


def test_a_resent_prompt_hits_all_but_the_block_of_its_last_token() -> None:
    cache = EngineCache(16, BS)
    prompt = tokens(1, 3 * BS)
    hashes = engine_chain(prompt, BS, seed=b"e")
    first = serve(cache, prompt)
    assert (first.hit_blocks, first.computed_blocks) == (0, 3)
    assert cache.take_events() == [Stored(tuple(hashes), None, tuple(prompt))]
    # The last token is computed again: its block is a second copy, announced again.
    again = serve(cache, prompt)
    assert (again.hit_blocks, again.computed_blocks) == (2, 1)
    assert cache.take_events() == [Stored((hashes[2],), hashes[1], tuple(prompt[2 * BS :]))]
    assert len(cache.copies[hashes[2]]) == 2
    # One token more: every block hits, the partial one is computed and not cached.
    longer = serve(cache, [*prompt, 99])
    assert (longer.hit_blocks, longer.computed_blocks) == (3, 1)
    assert cache.take_events() == []
    assert (cache.queries, cache.hits) == (12 + 12 + 13, 0 + 8 + 12)


def test_the_oldest_free_block_is_evicted_and_each_copy_announced() -> None:
    cache = EngineCache(4, BS)
    a, b = tokens(1, 2 * BS), tokens(2, 2 * BS)
    ha, hb = engine_chain(a, BS, seed=b"e"), engine_chain(b, BS, seed=b"e")
    serve(cache, a, generated=0)  # blocks 0, 1; freed last first: 1, then 0
    serve(cache, b, generated=0)  # blocks 2, 3
    cache.take_events()
    # A's last block was freed first: it goes first, and a fresh prompt's third block
    # takes A's first block next.
    c = tokens(3, 3 * BS)
    serve(cache, c, generated=0)
    events = cache.take_events()
    assert events[:3] == [Removed((ha[1],)), Removed((ha[0],)), Removed((hb[1],))]
    assert isinstance(events[3], Stored)
    assert cache.cached() == {hb[0], *engine_chain(c, BS, seed=b"e")}


def test_blocks_in_use_are_never_evicted() -> None:
    cache = EngineCache(4, BS)
    a = tokens(1, 2 * BS)
    running = cache.admit(engine_chain(a, BS, seed=b"e"), a, 4)  # 3 blocks held
    big = tokens(2, 2 * BS)
    assert not cache.fits(engine_chain(big, BS, seed=b"e"), len(big), 0)
    with pytest.raises(CacheFull, match="2 blocks wanted, 1 free"):
        cache.admit(engine_chain(big, BS, seed=b"e"), big, 0)
    assert cache.take_events() == [Stored(tuple(engine_chain(a, BS, seed=b"e")), None, tuple(a))]
    assert not cache.clear()  # a request runs
    cache.release(running)
    assert cache.clear()
    assert cache.take_events() == [Cleared()]
    assert cache.cached() == set()


class Publisher:
    """Numbered batches, as an engine's publisher frames them."""

    def __init__(self) -> None:
        self.seq = 0

    def frames(self, events: list[Any]) -> list[bytes]:
        payload = encode_batch(events, BS)
        self.seq += 1
        return [b"", (self.seq - 1).to_bytes(8, "big"), payload]


@pytest.fixture
def client() -> Iterator[fakeredis.FakeRedis]:
    c = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    yield c
    c.close()


def test_the_bridge_lists_exactly_what_the_engine_caches(client: Any) -> None:
    """Conversations sharing system prompts through a small cache (evictions, second
    copies, a clear): after each step the bridged namespace lists every cached block
    under the registry's hash of its prefix, and nothing else."""
    rng = random.Random(7)
    systems = [tokens(s, rng.randint(1, 3) * BS + rng.randint(0, 3)) for s in range(3)]
    talks: list[list[int]] = []
    cache = EngineCache(24, BS)
    follower = Follower(
        PrefixCacheRegistry(client, "ns-e"),
        EngineSource("ns-e", "tcp://127.0.0.1:5557", None, block_size=BS, media=("GPU",)),
        replay=None,
        clock=lambda: 1000.0,
    )
    follower.start()
    publisher = Publisher()
    registry_hash: dict[int, tuple[int, int]] = {}  # engine hash -> (registry hash, position)
    running: list[Any] = []
    removals = copies = 0
    for step in range(300):
        if step == 150:
            for admission in running:
                cache.release(admission)
            running.clear()
            assert cache.clear()
        if talks and rng.random() < 0.6:
            talk = rng.choice(talks)
            talk.extend(tokens(1000 + step, rng.randint(1, 2 * BS)))
        else:
            talk = list(rng.choice(systems)) + tokens(2000 + step, rng.randint(1, 3 * BS))
            talks.append(talk)
        prompt = list(talk) if rng.random() < 0.9 else list(talk[: len(talk) // BS * BS])
        engine = engine_chain(prompt, BS, seed=b"engine")
        for position, (e, r) in enumerate(zip(engine, block_hashes(prompt, BS), strict=True)):
            registry_hash[e] = (r, position)
        if not cache.fits(engine, len(prompt), 2):
            for admission in running:
                cache.release(admission)
            running.clear()
        running.append(cache.admit(engine, prompt, 2))
        if len(running) > 2:
            cache.release(running.pop(0))
        events = cache.take_events()
        removals += sum(isinstance(e, Removed) for e in events)
        copies += sum(len(v) > 1 for v in cache.copies.values())
        follower.offer([publisher.frames(events)])
        expected = {registry_hash[e][0]: registry_hash[e][1] for e in cache.cached()}
        assert PrefixCacheRegistry(client, "ns-e").entries()[0] == expected, step
    assert removals > 100
    assert copies > 0
    counts = follower.counts
    assert (counts.gaps, counts.bad_messages, counts.unknown_removals) == (0, 0, 0)
