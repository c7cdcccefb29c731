"""The bridge's ``Follower`` driven directly: messages handed in by the test, a fake
replay function, a fake clock, on fakeredis (Lua included). No sockets, no threads:
every interleaving of subscription, replay and probe is exact here."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator
from typing import Any

import fakeredis
import pytest

from registry import PrefixCacheRegistry
from registry.core.errors import RegistryError
from registry.core.hashing import block_hashes
from registry.fleet.membership import NodeIndex

pytest.importorskip("msgpack")
pytest.importorskip("zmq")  # sim.engine_events

import registry.bridge.bridge as bridge_module
import registry.bridge.chain as chain_module
import registry.bridge.writes as writes_module
from registry.bridge.bridge import EngineSource, Follower
from sim.engine_events import batch, cleared, engine_chain, prompt, removed, stored

BS = 4
Frames = list[bytes]


class FakeEngine:
    """Sequence numbers and a replay buffer, as an engine's publisher keeps them."""

    def __init__(self, buffer_steps: int = 10_000) -> None:
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.requests: list[int] = []
        self.answer = True

    def publish(self, events: list[Any], layout: str = "map") -> Frames:
        """One batch; returns the message the subscription would deliver."""
        payload = batch(events, layout)
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        return [b"", seq.to_bytes(8, "big"), payload]

    def replay(self, start: int) -> list[tuple[int, bytes]] | None:
        assert 0 <= start < 2**64  # it must fit the 8-byte request frame
        self.requests.append(start)
        if not self.answer:
            return None
        return [(s, p) for s, p in self.buffer if s >= start]

    def restart(self) -> None:
        self.seq = 0
        self.buffer.clear()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def server() -> fakeredis.FakeServer:
    return fakeredis.FakeServer()


@pytest.fixture
def client(server: fakeredis.FakeServer) -> Iterator[fakeredis.FakeRedis]:
    c = fakeredis.FakeRedis(server=server)
    yield c
    c.close()


def follower(
    client: Any,
    engine: FakeEngine | None,
    clock: Clock | None = None,
    *,
    namespace: str = "ns-f",
    media: tuple[str, ...] = ("GPU",),
    **options: Any,
) -> Follower:
    source = EngineSource(
        namespace,
        "tcp://127.0.0.1:5557",
        None if engine is None else "tcp://127.0.0.1:5558",
        block_size=BS,
        media=media,
    )
    return Follower(
        PrefixCacheRegistry(client, namespace),
        source,
        replay=None if engine is None else engine.replay,
        clock=clock or Clock(),
        **options,
    )


def kv(client: Any, namespace: str = "ns-f") -> dict[int, int]:
    return PrefixCacheRegistry(client, namespace).entries()[0]


def listed(*chains: tuple[list[int], int]) -> dict[int, int]:
    expected: dict[int, int] = {}
    for tokens, blocks in chains:
        for position, h in enumerate(block_hashes(tokens, BS)[:blocks]):
            expected[h] = position
    return expected


def chain(seed: int, blocks: int, engine_seed: bytes = b"engine-1") -> tuple[list[int], list[int]]:
    tokens = prompt(seed, blocks, BS)
    return tokens, engine_chain(tokens, BS, seed=engine_seed)


# -- sequence: replays, duplicates, engine restarts -----------------------------------------


def test_an_engine_restart_after_a_replayed_history_is_seen(client: Any) -> None:
    """The bridge learnt seqs 0-1 from the replay at its start; the engine restarts and
    sends seq 0 again, with another payload: a restart, not a duplicate."""
    engine = FakeEngine()
    old, ho = chain(1, 3)
    engine.publish([stored(ho[:2], None, old[: 2 * BS], BS)])
    engine.publish([stored(ho[2:], ho[1], old[2 * BS :], BS)])
    f = follower(client, engine)
    f.start()
    assert kv(client) == listed((old, 3))
    engine.restart()
    new, hn = chain(2, 2, b"engine-2")
    f.offer([engine.publish([stored(hn, None, new, BS)])])
    assert kv(client) == listed((new, 2))
    c = f.counts
    assert (c.engine_restarts, c.restarts, c.duplicates) == (1, 1, 0)


def test_subscription_copies_of_replayed_messages_are_duplicates(client: Any) -> None:
    engine = FakeEngine()
    tokens, hashes = chain(3, 4)
    f = follower(client, engine)
    f.start()
    first = engine.publish([stored(hashes[:1], None, tokens[:BS], BS)])
    f.offer([first])
    lost = []
    for i in (1, 2):
        block = tokens[i * BS : (i + 1) * BS]
        lost.append(engine.publish([stored(hashes[i : i + 1], hashes[i - 1], block, BS)]))
    last = engine.publish([removed(hashes[:1])])
    f.offer([last])  # a gap: the replay gives 1-3
    assert kv(client) == {h: i for i, h in enumerate(block_hashes(tokens, BS)[:3]) if i}
    # The subscription delivers its late copies: duplicates, nothing changes.
    f.offer([*lost, last])
    assert f.counts.duplicates == 1 + 3
    assert (f.counts.gaps, f.counts.restarts, f.counts.engine_restarts) == (1, 0, 0)
    # The next message goes past the replay: the remembered copies are dropped.
    f.offer([engine.publish([stored(hashes[3:], hashes[2], tokens[3 * BS :], BS)])])
    assert f.sequence.window == {}
    assert kv(client) == {h: i for i, h in enumerate(block_hashes(tokens, BS)) if i}


def test_a_probe_and_the_subscription_both_deliver_a_message(client: Any) -> None:
    """The engine publishes just as a probe asks: the probe applies it, then the
    subscription's copy arrives. A duplicate, not an engine restart."""
    engine, clock = FakeEngine(), Clock()
    tokens, hashes = chain(4, 2)
    f = follower(client, engine, clock, lease_ttl=3.0, silence_timeout=30.0)
    f.start()
    f.offer([engine.publish([stored(hashes[:1], None, tokens[:BS], BS)])])
    late = engine.publish([stored(hashes[1:], hashes[0], tokens[BS:], BS)])
    clock.now += 1.5
    f.tick()  # the probe finds seq 1
    assert f.counts.probes == 1
    assert kv(client) == listed((tokens, 2))
    f.offer([late])
    assert kv(client) == listed((tokens, 2))
    c = f.counts
    assert (c.duplicates, c.engine_restarts, c.restarts, c.gaps) == (1, 0, 0, 0)


def test_a_probe_that_does_not_reach_back_is_a_gap(client: Any) -> None:
    """Seqs the probe's replay no longer has: never taken as duplicates, the namespace
    restarts and keeps what the replay still has."""
    engine, clock = FakeEngine(buffer_steps=1), Clock()
    a, ha = chain(5, 2)
    b, hb = chain(6, 2)
    f = follower(client, engine, clock, lease_ttl=3.0, silence_timeout=30.0)
    f.start()
    f.offer([engine.publish([stored(ha, None, a, BS)])])
    engine.publish([removed(ha)])  # lost for good
    engine.publish([stored(hb, None, b, BS)])  # lost, still replayable
    clock.now += 1.5
    f.tick()
    assert kv(client) == listed((b, 2))
    c = f.counts
    assert (c.gaps, c.restarts, c.duplicates) == (1, 1, 1)


def test_an_engine_restart_whose_first_message_is_the_next_seq_is_not_seen(
    client: Any,
) -> None:
    """The limit of sequence numbers: a new engine whose first message delivered has
    exactly the next seq looks like the old one. Documented here, not hidden."""
    engine = FakeEngine()
    old, ho = chain(7, 1)
    f = follower(client, None)
    f.start()
    f.offer([engine.publish([stored(ho, None, old, BS)])])
    engine.restart()
    engine.publish([])  # seq 0, lost
    new, hn = chain(8, 1, b"engine-2")
    f.offer([engine.publish([stored(hn, None, new, BS)])])  # seq 1
    assert kv(client) == listed((old, 1), (new, 1))
    assert f.counts.engine_restarts == 0


# -- garbage ------------------------------------------------------------------------------


def test_an_undecodable_message_moves_the_sequence_only_in_order(client: Any) -> None:
    engine = FakeEngine()
    tokens, hashes = chain(9, 3)
    f = follower(client, None)
    f.start()
    f.offer([engine.publish([stored(hashes[:1], None, tokens[:BS], BS)])])
    # Out of sequence: counted, moves nothing (no gap, no restart).
    f.offer([[b"", (2**64 - 1).to_bytes(8, "big"), b"\xc1"], [b"", (77).to_bytes(8, "big"), b""]])
    assert f.sequence.last == 0
    # In sequence: counted, and its seq is seen (no gap after it).
    bad = engine.publish([])
    bad[2] = b"\xc1"
    f.offer([bad, engine.publish([stored(hashes[1:], hashes[0], tokens[BS:], BS)])])
    assert f.sequence.last == 2
    assert kv(client) == listed((tokens, 3))
    c = f.counts
    assert (c.bad_messages, c.gaps, c.restarts, c.engine_restarts) == (3, 0, 0, 0)
    assert c.bad_kinds == {"payload": 3}


def test_the_largest_seq_never_overflows_a_replay_request(client: Any) -> None:
    """An engine seq of 2**64-1 (well-formed, if absurd): probes and a restarted
    follower still ask the replay for seqs that fit 8 bytes."""
    engine, clock = FakeEngine(), Clock()
    tokens, hashes = chain(10, 1)
    f = follower(client, engine, clock, lease_ttl=3.0, silence_timeout=30.0)
    f.start()
    f.offer([[b"", (2**64 - 1).to_bytes(8, "big"), batch([stored(hashes, None, tokens, BS)])]])
    assert f.sequence.last == 2**64 - 1
    clock.now += 1.5
    f.tick()
    assert f.counts.probes == 1
    again = follower(client, engine, clock, lease_ttl=3.0, silence_timeout=30.0)
    again.start()  # resumes after seq 2**64-1
    assert again.counts.resumed == 1
    assert max(engine.requests) == 2**64 - 1


# -- media, cache ----------------------------------------------------------------------------


def test_an_event_without_a_medium_is_gpu(client: Any) -> None:
    tokens, hashes = chain(11, 2)
    f = follower(client, None, media=("CPU",))
    f.start()
    f.offer([FakeEngine().publish([stored(hashes, None, tokens, BS, medium=None)])])
    assert kv(client) == {}
    assert f.counts.other_medium == 2
    engine = FakeEngine()
    engine.seq = 1
    f.offer([engine.publish([stored(hashes, None, tokens, BS, medium="CPU")])])
    f.offer([engine.publish([removed(hashes[1:], medium=None)])])
    assert kv(client) == listed((tokens, 2))
    assert f.counts.other_medium == 3


def test_the_digest_cache_is_emptied_only_between_writes(
    client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chain longer than the in-memory cache, within one batch and across batches
    applied in one write: no block becomes an orphan."""
    monkeypatch.setattr(chain_module, "CACHE_BLOCKS", 2)
    engine = FakeEngine()
    tokens, hashes = chain(12, 8)

    def part(first: int, last: int) -> Any:
        parent = None if first == 0 else hashes[first - 1]
        return stored(hashes[first:last], parent, tokens[first * BS : last * BS], BS)

    q = tokens[: 2 * BS] + prompt(99, 1, BS)  # a branch off block 1
    hq = engine_chain(q, BS)
    branch = stored(hq[2:], hashes[1], q[2 * BS :], BS)
    f = follower(client, None)
    f.start()
    f.offer([engine.publish([part(0, 2), part(2, 3), branch, part(3, 4)])])
    assert kv(client) == listed((tokens, 4), (q, 3))
    f.offer([engine.publish([part(4, 5)]), engine.publish([part(5, 7)])])  # one write
    assert kv(client) == listed((tokens, 7), (q, 3))
    f.offer([engine.publish([part(7, 8)])])  # its parent's digest comes from Redis
    assert kv(client) == listed((tokens, 8), (q, 3))
    assert f.counts.orphans == 0


# -- Redis faults -----------------------------------------------------------------------------


def test_redis_failing_during_the_start_replay_blocks_then_restarts(
    client: Any, server: fakeredis.FakeServer
) -> None:
    """A resumed follower whose replay does not reach back must restart the namespace;
    Redis fails right then: start() does not raise, tick() retries the restart."""
    engine, clock = FakeEngine(buffer_steps=1), Clock()
    a, ha = chain(13, 2)
    first = follower(client, engine, clock)
    first.start()
    first.offer([engine.publish([stored(ha, None, a, BS)])])
    engine.publish([])  # seqs 1 and 2, never seen by the first follower; 1 not replayable
    engine.publish([])
    replay = engine.replay

    calls: list[int] = []

    def failing_replay(start: int) -> list[tuple[int, bytes]] | None:
        if not calls:  # Redis goes away during the first replay only
            server.connected = False
        calls.append(start)
        return replay(start)

    second = follower(client, engine, clock)
    second.replay = failing_replay
    second.start()  # resumed after seq 0; the replay starts at 2; Redis is gone
    assert second.started
    assert second.blocked
    assert second.counts.resumed == 1
    server.connected = True
    clock.now += 1.0
    second.tick()
    assert second.blocked_until == 0.0
    assert second.counts.restarts == 1
    assert kv(client) == {}
    assert calls == [1, 0]  # after the restart: what the replay still has, from seq 0


def test_redis_failing_after_the_claim_at_start_raises_a_registry_error(
    client: Any, server: fakeredis.FakeServer
) -> None:
    f = follower(client, None)
    claim = f.registry.claim

    def claim_then_fail(lease_ttl: float = 10.0) -> int:
        epoch = claim(lease_ttl)
        server.connected = False
        return epoch

    f.registry.claim = claim_then_fail  # type: ignore[method-assign]
    with pytest.raises(RegistryError):
        f.start()
    assert not f.started
    server.connected = True
    f.registry.claim = claim  # type: ignore[method-assign]
    f.start()
    assert f.started


def test_a_lost_namespace_is_claimed_again_and_a_superseded_follower_stops(
    client: Any,
) -> None:
    engine = FakeEngine()
    a, ha = chain(14, 3)
    f = follower(client, None)
    f.start()
    f.offer([engine.publish([stored(ha[:2], None, a[: 2 * BS], BS)])])
    client.flushall()  # the server lost everything
    f.offer([engine.publish([stored(ha[2:], ha[1], a[2 * BS :], BS)])])
    assert (f.counts.restarts, f.counts.superseded, f.counts.rewrites) == (1, 0, 1)
    assert f.sequence.last == 1
    assert kv(client) == listed((a, 3))  # its parents written again from the picture
    PrefixCacheRegistry(client, "ns-f").claim()  # another owner
    f.offer([engine.publish([removed(ha)])])
    assert (f.counts.superseded, f.stopped) == (1, True)
    f.offer([engine.publish([stored(ha, None, a, BS)])])  # ignored from now on
    assert kv(client) == {}


# -- liveness (fake clock) ------------------------------------------------------------------


def test_without_replay_the_lease_is_renewed_only_while_the_engine_talks(client: Any) -> None:
    engine, clock = FakeEngine(), Clock()
    f = follower(client, None, clock, lease_ttl=3.0, silence_timeout=6.0)
    f.start()
    for _ in range(5):
        clock.now += 1.0
        f.tick()
    assert (f.counts.renewals, f.counts.silent) == (5, 0)
    clock.now += 2.0
    f.tick()  # 7 s quiet
    clock.now += 2.0
    f.tick()
    assert (f.counts.renewals, f.counts.silent, f.counts.probes) == (5, 1, 0)
    f.offer([engine.publish([])])
    f.tick()
    assert (f.counts.renewals, f.counts.silent) == (6, 1)


def test_probes_come_before_the_silence_timeout(client: Any) -> None:
    """A silence timeout shorter than a third of the lease: probes come that often, so
    an engine that answers is never silent; one that does not answer falls silent."""
    engine, clock = FakeEngine(), Clock()
    f = follower(client, engine, clock, lease_ttl=30.0, silence_timeout=3.0)
    f.start()
    for _ in range(30):
        clock.now += 0.5
        f.tick()
    assert f.counts.silent == 0
    assert f.counts.probes >= 10
    assert f.counts.renewals >= 1
    engine.answer = False
    for _ in range(10):
        clock.now += 0.5
        f.tick()
    assert f.counts.silent == 1


def test_copies_of_replayed_messages_after_the_namespace_was_lost(client: Any) -> None:
    """Redis lost the namespace while a replay was being applied: the follower claims
    again; the subscription's copies of the replayed messages are still duplicates."""
    engine = FakeEngine()
    tokens, hashes = chain(15, 3)
    f = follower(client, engine)
    f.start()
    f.offer([engine.publish([stored(hashes[:1], None, tokens[:BS], BS)])])
    lost = engine.publish([stored(hashes[1:2], hashes[0], tokens[BS : 2 * BS], BS)])
    last = engine.publish([stored(hashes[2:], hashes[1], tokens[2 * BS :], BS)])
    client.flushall()
    f.offer([last])  # a gap: replayed, then written to a namespace that is gone
    assert (f.counts.gaps, f.counts.restarts) == (1, 1)
    assert kv(client) == listed((tokens, 3))  # block 0 from the picture
    f.offer([lost, last])
    c = f.counts
    assert (c.duplicates, c.restarts, c.engine_restarts) == (3, 1, 0)
    assert kv(client) == listed((tokens, 3))


def test_applied_seq_says_what_redis_holds(client: Any) -> None:
    engine = FakeEngine()
    f = follower(client, engine)
    f.start()
    assert f.counts.as_dict()["applied_seq"] == -1
    tokens, hashes = chain(1, 3)
    f.offer([engine.publish([stored(hashes, None, tokens, BS)])])
    f.offer([engine.publish([removed(hashes[2:])])])
    assert f.counts.as_dict()["applied_seq"] == 1
    assert PrefixCacheRegistry(client, "ns-f").info().bridge_seq == 1
    assert kv(client) == listed((tokens, 2))


def test_events_of_thousands_of_blocks_apply_whole(client: Any) -> None:
    """One event larger than Lua's unpack limit: the script works in chunks."""
    engine = FakeEngine()
    f = follower(client, engine)
    f.start()
    tokens, hashes = chain(2, 9000)
    f.offer([engine.publish([stored(hashes, None, tokens, BS)])])
    assert len(kv(client)) == 9000
    f.offer([engine.publish([removed(hashes[4500:] + hashes[4500:4510])])])
    assert kv(client) == listed((tokens, 4500))
    assert f.counts.unknown_removals == 10
    assert f.counts.blocks_removed == 4500


def test_wait_ready_returns_once_the_bridge_thread_died() -> None:
    class Broken:
        """A client whose every call fails with an error the bridge does not expect."""

        def evalsha(self, *args: Any) -> Any:
            raise RuntimeError("broken client")

        def script_load(self, *args: Any) -> Any:
            raise RuntimeError("broken client")

    source = EngineSource("ns-x", "tcp://127.0.0.1:5557")
    bridge = bridge_module.Bridge(Broken(), [source], poll_interval=0.01)
    with bridge:
        assert bridge.wait_ready(timeout=120) is False
    assert isinstance(bridge.error, RuntimeError)


def test_a_bridge_with_another_block_size_does_not_resume(client: Any) -> None:
    engine = FakeEngine()
    first = follower(client, engine)
    first.start()
    tokens, hashes = chain(3, 2)
    first.offer([engine.publish([stored(hashes, None, tokens, BS)])])
    assert len(kv(client)) == 2
    source = EngineSource("ns-f", "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", block_size=8)
    second = Follower(
        PrefixCacheRegistry(client, "ns-f"), source, replay=engine.replay, clock=Clock()
    )
    second.start()
    assert (second.counts.resumed, second.counts.restarts) == (0, 0)
    assert PrefixCacheRegistry(client, "ns-f").info().bridge_block_size == 8
    assert kv(client) == {}  # hashed with block size 4: claimed afresh, emptied
    again = follower(client, engine)  # block size 4 against a namespace of size 8
    again.start()
    assert again.counts.resumed == 0


def test_unanswered_probes_back_off_and_answered_ones_reset(client: Any) -> None:
    """A dead engine's probes (each may block the bridge's loop for the probe timeout)
    come less and less often, up to once per silence_timeout; an answer resets them."""
    engine, clock = FakeEngine(), Clock()
    probes: list[float] = []

    def probe(start: int) -> list[tuple[int, bytes]] | None:
        probes.append(clock.now)
        return engine.replay(start)

    f = follower(client, engine, clock, lease_ttl=3.0, silence_timeout=30.0, probe=probe)
    f.start()
    engine.answer = False
    for _ in range(600):  # 60 s
        clock.now += 0.1
        f.tick()
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    for gap, expected in zip(gaps, [2.0, 4.0, 8.0, 16.0], strict=False):
        assert expected <= gap <= expected + 0.15  # the interval (1 s) doubling; 0.1 s ticks
    assert max(gaps) <= 30.0
    assert f.counts.silent == 1
    engine.answer = True
    clock.now += 30.0
    f.tick()  # answered: heard again, probes back to every second
    before = len(probes)
    for _ in range(50):
        clock.now += 0.1
        f.tick()
    assert len(probes) - before >= 4
    assert engine.requests[: len(engine.requests) - len(probes)] == [0]  # only the start replay


def test_a_probe_finds_an_engine_that_restarted_without_a_word(client: Any) -> None:
    """The engine restarted and has published nothing since (or its first batches were
    lost): the probe, asking from the batch applied last, gets nothing back, so the
    namespace restarts empty at once instead of listing the old process's blocks."""
    engine, clock = FakeEngine(), Clock()
    a, ha = chain(31, 3)
    f = follower(client, engine, clock, lease_ttl=3.0, silence_timeout=30.0)
    f.start()
    f.offer([engine.publish([stored(ha, None, a, BS)])])
    assert kv(client) == listed((a, 3))
    engine.restart()
    clock.now += 1.5
    f.tick()
    assert kv(client) == {}
    assert (f.counts.engine_restarts, f.counts.restarts) == (1, 1)
    assert engine.requests[-2:] == [0, 0]  # the probe from seq 0, then the replay from 0
    b, hb = chain(32, 2, b"engine-2")
    f.offer([engine.publish([stored(hb, None, b, BS)])])  # the new engine's seq 0
    assert kv(client) == listed((b, 2))
    assert f.counts.engine_restarts == 1


def test_a_probe_tells_a_new_engines_batch_from_the_old_one_under_one_seq(client: Any) -> None:
    """A restarted engine whose lost batches already reach past the old seq: its batch
    under that seq is another payload, so the namespace restarts and takes the new
    engine's batches from 0."""
    engine, clock = FakeEngine(), Clock()
    a, ha = chain(33, 2)
    f = follower(client, engine, clock, lease_ttl=3.0, silence_timeout=30.0)
    f.start()
    f.offer([engine.publish([stored(ha, None, a, BS)])])  # seq 0
    engine.restart()
    b, hb = chain(34, 2, b"engine-2")
    engine.publish([stored(hb, None, b, BS)])  # seq 0 again, lost
    engine.publish([removed(hb[1:])])  # seq 1, lost
    clock.now += 1.5
    f.tick()
    assert kv(client) == listed((b, 1))
    assert (f.counts.engine_restarts, f.counts.restarts) == (1, 1)


def test_a_probe_of_the_same_quiet_engine_changes_nothing(client: Any) -> None:
    engine, clock = FakeEngine(), Clock()
    a, ha = chain(35, 2)
    f = follower(client, engine, clock, lease_ttl=3.0, silence_timeout=30.0)
    f.start()
    f.offer([engine.publish([stored(ha, None, a, BS)])])
    for _ in range(3):
        clock.now += 1.5
        f.tick()
    assert kv(client) == listed((a, 2))
    assert (f.counts.probes, f.counts.engine_restarts, f.counts.restarts) == (3, 0, 0)
    assert engine.requests[1:] == [0, 0, 0]


# -- Redis lost the namespace: written again from the engine's picture ----------------------


def engine_blocks(client: Any, namespace: str = "ns-f") -> dict[bytes, tuple[bytes, ...]]:
    """``engine-blocks`` with each entry's holders without trailing empty slots (a slot
    freed last leaves a '0' behind in Redis, not in a rewrite)."""
    key = PrefixCacheRegistry(client, namespace).keys.engine_blocks
    entries = {}
    for field, value in client.hgetall(key).items():
        parts = value.split(b" ")
        parts[3] = parts[3].rstrip(b"0")
        entries[field] = tuple(parts)
    return entries


def maps(client: Any, namespace: str = "ns-f") -> tuple[dict[int, int], dict[int, int]]:
    kv_map, mamba_map = PrefixCacheRegistry(client, namespace).entries()
    return kv_map, mamba_map


def test_a_namespace_redis_lost_is_written_again_as_it_was(
    client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stores, copies, a second (Mamba) group, removals and a clear; then Redis loses
    everything: the next write finds the namespace gone and writes the picture again, in
    writes of at most MAX_BLOCKS_PER_WRITE blocks: engine-blocks and both maps come back
    exactly as they were, and the engine's URL is announced again."""
    monkeypatch.setattr(writes_module, "MAX_BLOCKS_PER_WRITE", 3)
    engine = FakeEngine()
    source = EngineSource(
        "ns-f", "tcp://127.0.0.1:5557", block_size=BS, engine_url="http://127.0.0.1:8001"
    )
    f = Follower(PrefixCacheRegistry(client, "ns-f"), source, clock=Clock())
    f.start()
    a, ha = chain(40, 4)
    b, hb = chain(41, 3)
    c, hc = chain(42, 2)
    q = a[: 2 * BS] + prompt(43, 2, BS)  # a branch off a's block 1
    hq = engine_chain(q, BS)
    f.offer([engine.publish([stored(ha, None, a, BS), stored(hb, None, b, BS)])])
    f.offer([engine.publish([stored(ha[3:], ha[2], a[3 * BS :], BS)])])  # a copy
    f.offer([engine.publish([stored(hq[2:], ha[1], q[2 * BS :], BS)])])
    f.offer([engine.publish([stored(ha[:2], None, a[: 2 * BS], BS, group_idx=1, kind="mamba")])])
    f.offer([engine.publish([removed(hb[1:]), removed(ha[3:])])])  # one copy of a[3] left
    f.offer([engine.publish([removed(ha[1:2], group_idx=1)])])
    f.offer([engine.publish([cleared()]), engine.publish([stored(hc, None, c, BS)])])
    f.offer([engine.publish([stored(ha, None, a, BS), stored(hb[:1], None, b[:BS], BS)])])
    f.offer([engine.publish([stored(ha[:3], None, a[: 3 * BS], BS, group_idx=1, kind="mamba")])])
    f.offer([engine.publish([stored(ha[:1], None, a[:BS], BS)])])  # a second copy of a[0]
    before = (engine_blocks(client), maps(client))
    assert before[1][1]  # the Mamba map holds something
    assert any(len(parts) == 5 for parts in before[0].values())  # copies kept
    writes = f.counts.writes
    client.flushall()
    f.offer([engine.publish([])])
    assert (engine_blocks(client), maps(client)) == before
    assert f.counts.rewrites == 1
    assert f.counts.rewritten_blocks == 4 + 1 + 2 + 1 + 3  # a, b[0], c; a[0]'s copy; Mamba
    assert f.counts.writes - writes == 1 + 4 + 1  # the claim, 11 blocks by 3, the seq
    assert NodeIndex(client).engines() == {"ns-f": "http://127.0.0.1:8001"}
    assert PrefixCacheRegistry(client, "ns-f").info().bridge_seq == engine.seq - 1
    # and it goes on from there: a removal of the copy applies to the rewritten entries
    f.offer([engine.publish([removed(ha[:1]), removed(ha[:1])])])
    assert block_hashes(a, BS)[0] not in kv(client)
    assert f.counts.unknown_removals == 0


def test_an_idle_engine_s_namespace_is_written_again_at_the_renewal(client: Any) -> None:
    """No message after Redis lost everything: the lease renewal finds the namespace
    gone, and the namespace and the announcement are written again there."""
    engine, clock = FakeEngine(), Clock()
    source = EngineSource(
        "ns-f", "tcp://127.0.0.1:5557", block_size=BS, engine_url="http://127.0.0.1:8001"
    )
    f = Follower(
        PrefixCacheRegistry(client, "ns-f"), source, clock=clock, lease_ttl=3.0,
        silence_timeout=30.0,
    )  # fmt: skip
    f.start()
    a, ha = chain(44, 3)
    f.offer([engine.publish([stored(ha, None, a, BS)])])
    client.flushall()
    clock.now += 1.5
    f.offer([])  # nothing new to write
    f.tick()
    assert kv(client) == listed((a, 3))
    assert NodeIndex(client).engines() == {"ns-f": "http://127.0.0.1:8001"}
    assert NodeIndex(client).live() == ["ns-f"]
    assert (f.counts.rewrites, f.counts.restarts) == (1, 1)


def test_a_restarted_engine_s_old_blocks_are_never_written_again(client: Any) -> None:
    """An engine restart drops the engine's cache: its old blocks leave the picture
    too, and a later loss of the namespace writes only what the new process stored."""
    engine = FakeEngine()
    f = follower(client, None)
    f.start()
    old, ho = chain(45, 3)
    f.offer([engine.publish([stored(ho, None, old, BS)]), engine.publish([])])
    engine.restart()
    new, hn = chain(46, 2, b"engine-2")
    f.offer([engine.publish([stored(hn, None, new, BS)])])
    assert f.counts.engine_restarts == 1
    client.flushall()
    f.offer([engine.publish([])])
    assert kv(client) == listed((new, 2))
    assert f.counts.rewrites == 1


def test_children_of_blocks_stored_before_the_loss_are_not_orphans(
    client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A system prompt stored before Redis lost everything, and never stored again; the
    in-memory digest cache emptied: new blocks continuing it still hash (their parents'
    digests come from the picture, then from the rewritten engine-blocks)."""
    monkeypatch.setattr(chain_module, "CACHE_BLOCKS", 0)
    engine = FakeEngine()
    system = prompt(47, 2, BS)
    f = follower(client, None)
    f.start()
    hs = engine_chain(system, BS)
    f.offer([engine.publish([stored(hs, None, system, BS)])])
    client.flushall()
    for seed in (48, 49):
        tokens = system + prompt(seed, 1, BS)
        hashes = engine_chain(tokens, BS)
        f.offer([engine.publish([stored(hashes[2:], hs[1], tokens[2 * BS :], BS)])])
        assert block_hashes(tokens, BS)[2] in kv(client)
    assert f.counts.orphans == 0
    assert len(kv(client)) == 4


def test_a_resumed_follower_pictures_what_its_predecessor_wrote(client: Any) -> None:
    engine = FakeEngine()
    a, ha = chain(50, 3)
    first = follower(client, engine)
    first.start()
    first.offer([engine.publish([stored(ha, None, a, BS), stored(ha[2:], ha[1], a[2 * BS :], BS)])])
    second = follower(client, engine)  # a new bridge process
    second.start()
    assert second.counts.resumed == 1
    before = (engine_blocks(client), maps(client))
    client.flushall()
    second.offer([engine.publish([])])
    assert (engine_blocks(client), maps(client)) == before
    assert second.counts.rewrites == 1


def test_an_older_copy_of_the_namespace_is_written_over(client: Any) -> None:
    """Redis came back from a snapshot taken before the follower's claim (an older
    epoch in meta, stale maps): the follower claims again and writes its picture; a
    newer epoch (another owner) still stops it (the superseded test above)."""
    engine = FakeEngine()
    f = follower(client, None)
    f.start()
    stale, hs = chain(51, 2)
    f.offer([engine.publish([stored(hs, None, stale, BS)])])
    registry = PrefixCacheRegistry(client, "ns-f")
    older = registry.info().epoch
    f.offer([engine.publish([removed(hs)]), engine.publish([])])
    a, ha = chain(52, 2)
    f.offer([engine.publish([stored(ha, None, a, BS)])])
    f.registry.claim()  # the follower's epoch moves on (as after a restart) ...
    f.registry.adopt_epoch(int(f.registry.epoch or 0))
    meta = registry.keys.meta
    client.hset(meta, "epoch", str(older))  # ... and Redis holds the older one again
    f.offer([engine.publish([])])
    assert (f.counts.superseded, f.counts.rewrites, f.stopped) == (0, 1, False)
    assert kv(client) == listed((a, 2))


def test_the_picture_is_bounded(client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past PICTURE_BLOCKS new blocks are not pictured (counted): a rewrite lists a
    subset of what the engine holds, shallowest first, never a block it dropped."""
    import registry.bridge.picture as picture_module

    monkeypatch.setattr(picture_module, "PICTURE_BLOCKS", 3)
    engine = FakeEngine()
    f = follower(client, None)
    f.start()
    a, ha = chain(53, 5)
    f.offer([engine.publish([stored(ha, None, a, BS)])])
    assert f.counts.unpictured == 2
    f.offer([engine.publish([removed(ha[2:3])])])
    client.flushall()
    f.offer([engine.publish([])])
    hashes = block_hashes(a, BS)
    assert kv(client) == {hashes[0]: 0, hashes[1]: 1}


def test_the_picture_rewrites_parents_first_in_bounded_writes() -> None:
    from registry.bridge.picture import EnginePicture

    picture = EnginePicture()
    for h in range(1, 11):  # depth h - 1; stored deepest first
        picture.stored(100 - h, bytes([h]) * 32, h - 1, 1, "k")
    picture.stored(99, bytes([1]) * 32, 0, 1, "k")  # a copy
    writes = list(picture.rewrite(limit=4))
    assert [n for _, n in writes] == [4, 4, 3]
    depths = [ops[i + 3] for ops, _ in writes for i in range(0, len(ops), 8)]
    assert depths == sorted(depths)
    assert depths[:2] == [0, 0]
