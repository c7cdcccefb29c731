"""``pcr bridge`` end to end: real ZeroMQ sockets on loopback (``sim.engine_events``'
stand-in for a vLLM / SGLang engine) into a real redis-server.

Every test checks exact results through what a router sees: ``match_kv_prefix`` of the
router-side hashes (``block_hashes``), ``entries()``, ``PrefixRouter.score`` and the
bridge's ``counts()``. Nothing sleeps to synchronise: each step waits for the bridge to
have applied an engine sequence number (``bridge_seq`` in the namespace's meta, written
atomically with the batch) or for a count, with generous deadlines.
"""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from registry import NodeIndex, NodeScore, PrefixCacheRegistry, PrefixRouter
from registry.core.hashing import block_hashes
from registry.fleet.view import FleetView
from tests.support.servers import RedisServer
from tests.support.waiting import wait_until

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")

from registry.bridge.bridge import Bridge, EngineSource  # noqa: E402  (needs the bridge extra)
from registry.bridge.bridge_events import decode_batch  # noqa: E402
from sim.engine_events import (  # noqa: E402
    EnginePublisher,
    batch,
    cleared,
    engine_chain,
    prompt,
    removed,
    stored,
)

BS = 4
NO_SIZE: Any = None  # a BlockStored without block_size
WAIT = 30.0
U64 = 2**64


# -- the rig: engines and bridges that are always closed -----------------------------------


def fresh_namespace(tag: str = "br") -> str:
    return f"{tag}-{uuid.uuid4().hex[:10]}"


class Rig:
    """Engines and bridges of one test; ``close()`` stops and closes every one."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.engines: list[EnginePublisher] = []
        self.bridges: list[Bridge] = []
        self._view: FleetView | None = None

    def engine(self, **options: Any) -> EnginePublisher:
        engine = EnginePublisher(**options)
        self.engines.append(engine)
        # Every subscription is passed up (not only a topic's first), so that a second
        # bridge's subscription is seen even while the first one's is still there.
        engine.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        return engine

    def source(
        self, publisher: EnginePublisher, namespace: str | None = None, **options: Any
    ) -> EngineSource:
        options.setdefault("block_size", BS)
        options.setdefault("replay_endpoint", publisher.replay_endpoint)
        return EngineSource(namespace or fresh_namespace(), publisher.endpoint, **options)

    def bridge(
        self,
        sources: Sequence[EngineSource],
        engines: Sequence[EnginePublisher],
        *,
        client: Any = None,
        ready: bool = True,
        **options: Any,
    ) -> Bridge:
        bridge = Bridge(self.client if client is None else client, sources, **options)
        self.bridges.append(bridge)
        bridge.start()
        if ready:
            assert bridge.wait_ready(WAIT), (bridge.error, bridge.counts())
            for engine in engines:
                subscribed(engine)
        return bridge

    def view_agrees(self, namespace: str) -> None:
        """A fleet view following the change records (started at the first call) holds
        exactly the namespace's two maps once it has applied every write so far."""
        if self._view is None:
            self._view = FleetView(self.client).start()
        self._view.sync([namespace])
        held = self._view.held(namespace)
        kv_map, mamba_map = kv(self.client, namespace), mamba(self.client, namespace)
        if not kv_map and not mamba_map and held is None:
            return
        assert held == (frozenset(kv_map), frozenset(mamba_map))

    def close(self) -> None:
        for bridge in self.bridges:
            bridge.stop()
        for engine in self.engines:
            engine.close()
        if self._view is not None:
            self._view.close()


def subscribed(engine: EnginePublisher, timeout: float = WAIT) -> None:
    """Wait until a (new) subscription reached the engine's XPUB socket."""
    deadline_ms = round(timeout * 1000)
    while True:
        if not engine.pub.poll(deadline_ms, zmq.POLLIN):
            raise TimeoutError("no subscriber connected")
        if engine.pub.recv()[:1] == b"\x01":
            return


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    c = redis_server.client()
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def rig(client: redis.Redis) -> Iterator[Rig]:
    made = Rig(client)
    try:
        yield made
    finally:
        made.close()


# -- what a router sees --------------------------------------------------------------------


def meta(client: Any, namespace: str) -> dict[str, str]:
    raw = client.hgetall(PrefixCacheRegistry(client, namespace).keys.meta)
    return {k.decode(): v.decode() for k, v in raw.items()}


def applied(client: Any, namespace: str, seq: int) -> bool:
    return meta(client, namespace).get("bridge_seq") == str(seq)


def wait_applied(client: Any, namespace: str, seq: int, bridge: Bridge | None = None) -> None:
    """Until Redis records ``seq`` applied and the bridge has counted that write (its
    counts follow the write's reply, so they lag Redis by a moment)."""

    def done() -> bool:
        if bridge is None:
            return applied(client, namespace, seq)
        if bridge.error is not None:
            raise AssertionError(f"the bridge stopped: {bridge.error!r}")
        follower = next(f for f in bridge.followers if f.source.namespace == namespace)
        return applied(client, namespace, seq) and follower.pending.seq is None

    wait_until(done, WAIT, f"{namespace} applied through engine seq {seq}")


def counts(bridge: Bridge, namespace: str) -> dict[str, int]:
    return bridge.counts()[namespace]


def wait_count(bridge: Bridge, namespace: str, name: str, at_least: int) -> None:
    wait_until(
        lambda: counts(bridge, namespace).get(name, 0) >= at_least,
        WAIT,
        f"{namespace}: {name} >= {at_least} ({counts(bridge, namespace)})",
    )


def own(tokens: list[int]) -> list[int]:
    return block_hashes(tokens, BS)


def listed(*chains: tuple[list[int], int]) -> dict[int, int]:
    """The KV map of fully listed prompts: (tokens, how many leading blocks) each."""
    expected: dict[int, int] = {}
    for tokens, blocks in chains:
        for position, h in enumerate(own(tokens)[:blocks]):
            expected[h] = position
    return expected


def match(client: Any, namespace: str, tokens: list[int]) -> list[int]:
    ids, last = PrefixCacheRegistry(client, namespace).match_kv_prefix(own(tokens))
    assert last == (own(tokens)[len(ids) - 1] if ids else 0)
    return ids


def kv(client: Any, namespace: str) -> dict[int, int]:
    return PrefixCacheRegistry(client, namespace).entries()[0]


def mamba(client: Any, namespace: str) -> dict[int, int]:
    return PrefixCacheRegistry(client, namespace).entries()[1]


def score(client: Any, namespace: str, tokens: list[int], *, hybrid: bool = False) -> Any:
    router = PrefixRouter(client, hybrid=hybrid, live_cache_ttl=0)
    return router.score(own(tokens), [namespace]).get(namespace)


def alive(bridge: Bridge) -> None:
    assert bridge.error is None, bridge.error
    assert bridge._thread is not None
    assert bridge._thread.is_alive()


def to_signed(h: int) -> int:
    return h - U64 if h >= 2**63 else h


def as_digest(h: int, salt: bytes = b"") -> bytes:
    """A 32-byte digest whose last 8 bytes (big-endian) are ``h``."""
    return hashlib.sha256(salt + h.to_bytes(8, "big")).digest()[:24] + h.to_bytes(8, "big")


ZERO_COUNTS = ("bad_messages", "orphans", "restarts", "gaps", "engine_restarts", "superseded")


def assert_quiet(bridge: Bridge, namespace: str, *except_: str) -> None:
    c = counts(bridge, namespace)
    for name in ZERO_COUNTS:
        if name not in except_:
            assert c[name] == 0, (name, c)


# == 1. layouts and hash forms =============================================================

HASH_FORMS: dict[str, Callable[[list[int]], list[Any]]] = {
    "unsigned": lambda hs: list(hs),
    # SGLang: signed 64-bit; -1 and the smallest int64 are ordinary hashes there.
    "signed": lambda hs: [-1, -(2**63), *(to_signed(h) for h in hs[2:])],
    "bytes": lambda hs: [as_digest(h) for h in hs],
}


@pytest.mark.parametrize(
    ("layout", "form"),
    [
        ("map", "unsigned"),
        ("array", "unsigned"),
        ("map", "bytes"),
        ("array", "bytes"),
        ("sglang", "signed"),
        ("map", "signed"),
    ],
)
def test_layouts_and_hash_forms(rig: Rig, client: Any, layout: str, form: str) -> None:
    """Chains within a batch and across batches, in each payload layout and hash form;
    removals given in another form of the same hash remove the same block."""
    engine = rig.engine()
    source = rig.source(engine, block_size=None if layout != "sglang" else BS)
    ns = source.namespace
    bridge = rig.bridge([source], [engine])
    tokens = prompt(1, 8, BS)
    hashes = HASH_FORMS[form](engine_chain(tokens, BS))
    if form == "unsigned":
        assert any(h >= 2**63 for h in hashes)  # the full unsigned range travels
    if form == "signed":
        assert sum(h < 0 for h in hashes) >= 3
    # One batch, two events: blocks 0-2 (a root), then 3-4 chained to block 2.
    seq = engine.publish(
        [
            stored(hashes[:3], None, tokens[:12], BS, layout=layout),
            stored(hashes[3:5], hashes[2], tokens[12:20], BS, layout=layout),
        ],
        layout,
    )
    wait_applied(client, ns, seq, bridge)
    assert match(client, ns, tokens) == [0, 1, 2, 3, 4]
    # Another batch: blocks 5-7, their parent (block 4) in the batch before.
    seq = engine.publish([stored(hashes[5:], hashes[4], tokens[20:], BS, layout=layout)], layout)
    wait_applied(client, ns, seq, bridge)
    assert match(client, ns, tokens) == list(range(8))
    assert kv(client, ns) == listed((tokens, 8))
    assert mamba(client, ns) == {}
    assert score(client, ns, tokens) == NodeScore(ns, 8, 0, 8)
    # Remove blocks 6 and 7, the first given in another form of the same hash.
    other: dict[str, Callable[[Any], Any]] = {
        "unsigned": to_signed,
        "signed": lambda h: h + U64 if h < 0 else h,
        "bytes": lambda d: as_digest(int.from_bytes(d[-8:], "big"), salt=b"other"),
    }
    gone = [other[form](hashes[6]), hashes[7]]
    if form == "bytes":
        assert gone[0] != hashes[6]  # another digest, the same last 8 bytes
    seq = engine.publish([removed(gone, layout=layout)], layout)
    wait_applied(client, ns, seq, bridge)
    assert match(client, ns, tokens) == list(range(6))
    assert kv(client, ns) == listed((tokens, 6))
    assert score(client, ns, tokens) == NodeScore(ns, 6, 0, 6)
    # -1 (signed) is a block like any other: removing it cuts the prefix at the root.
    seq = engine.publish([removed([hashes[0]], layout=layout)], layout)
    wait_applied(client, ns, seq, bridge)
    assert match(client, ns, tokens) == []
    assert kv(client, ns) == {h: i for i, h in enumerate(own(tokens)[1:6], 1)}
    c = counts(bridge, ns)
    assert (c["messages"], c["batches"], c["writes"] >= 4) == (4, 4, True)
    assert (c["blocks_stored"], c["blocks_removed"], c["unknown_removals"]) == (8, 3, 0)
    assert meta(client, ns)["bridge_block_size"] == str(BS)
    assert_quiet(bridge, ns)
    alive(bridge)


def test_block_size_learnt_from_events_and_other_sizes_skipped(rig: Rig, client: Any) -> None:
    """Without a configured block size the first event's sets it; blocks of another size
    and tokens that do not fill the blocks are skipped and counted, never guessed."""
    engine = rig.engine()
    source = rig.source(engine, block_size=None)
    ns = source.namespace
    bridge = rig.bridge([source], [engine])
    tokens = prompt(2, 4, BS)
    hashes = engine_chain(tokens, BS)
    seq = engine.publish([stored(hashes[:2], None, tokens[:8], BS)])
    wait_applied(client, ns, seq, bridge)
    wrong = engine_chain(tokens, 2, seed=b"other-size")
    seq = engine.publish(
        [
            stored(wrong[:2], None, tokens[:4], 2),  # another block size
            stored(
                hashes[2:3], hashes[1], [*tokens[8:11], 0, 0, 0, 0], NO_SIZE
            ),  # 2 blocks' tokens
        ]
    )
    wait_applied(client, ns, seq, bridge)
    assert kv(client, ns) == listed((tokens, 2))
    assert counts(bridge, ns)["block_size_mismatch"] == 3
    seq = engine.publish([stored(hashes[2:], hashes[1], tokens[8:], NO_SIZE)])
    wait_applied(client, ns, seq, bridge)
    assert match(client, ns, tokens) == [0, 1, 2, 3]
    assert_quiet(bridge, ns)


# == 2. removals and clears ================================================================


def test_removed_removes_exactly_those_prefixes_and_cleared_empties(rig: Rig, client: Any) -> None:
    engine = rig.engine()
    source = rig.source(engine)
    ns = source.namespace
    bridge = rig.bridge([source], [engine])
    p = prompt(3, 5, BS)
    q = p[: 2 * BS] + prompt(4, 3, BS)  # shares p's first two blocks
    hp, hq = engine_chain(p, BS), engine_chain(q, BS)
    assert hp[:2] == hq[:2]
    assert hp[2] != hq[2]
    engine.publish([stored(hp, None, p, BS)])
    seq = engine.publish([stored(hq[2:], hq[1], q[2 * BS :], BS)])
    wait_applied(client, ns, seq, bridge)
    assert kv(client, ns) == listed((p, 5), (q, 5))
    assert len(kv(client, ns)) == 8
    # p's tail goes; q keeps all of its blocks, including the shared ones.
    seq = engine.publish([removed(hp[3:])])
    wait_applied(client, ns, seq, bridge)
    assert match(client, ns, p) == [0, 1, 2]
    assert match(client, ns, q) == [0, 1, 2, 3, 4]
    assert kv(client, ns) == listed((p, 3), (q, 5))
    # Removing a block twice, or one never stored, changes nothing (counted).
    seq = engine.publish([removed([hp[4], 12345])])
    wait_applied(client, ns, seq, bridge)
    assert kv(client, ns) == listed((p, 3), (q, 5))
    assert counts(bridge, ns)["unknown_removals"] == 2
    # A shared block goes: both prompts stop there (the children stay listed as ids).
    seq = engine.publish([removed([hp[1]])])
    wait_applied(client, ns, seq, bridge)
    assert match(client, ns, p) == [0]
    assert match(client, ns, q) == [0]
    # AllBlocksCleared empties the namespace, KV map and engine-block map alike.
    seq = engine.publish([cleared()])
    wait_applied(client, ns, seq, bridge)
    assert kv(client, ns) == {}
    assert mamba(client, ns) == {}
    keys = PrefixCacheRegistry(client, ns).keys
    assert client.exists(keys.engine_blocks) == 0
    # Storing again after the clear: roots work; a child of a cleared block is an orphan.
    seq = engine.publish(
        [stored(hq[3:], hq[2], q[3 * BS :], BS), stored(hp[:2], None, p[: 2 * BS], BS)]
    )
    wait_applied(client, ns, seq, bridge)
    assert kv(client, ns) == listed((p, 2))
    c = counts(bridge, ns)
    assert (c["clears"], c["orphans"]) == (1, 2)
    # A clear and stores in one batch: in order.
    seq = engine.publish(
        [stored(hq[:3], None, q[: 3 * BS], BS), cleared(), stored(hp[:1], None, p[:BS], BS)]
    )
    wait_applied(client, ns, seq, bridge)
    assert kv(client, ns) == listed((p, 1))
    assert_quiet(bridge, ns, "orphans")
    alive(bridge)
    rig.view_agrees(ns)


def test_a_block_held_twice_stays_listed_until_its_last_copy_goes(rig: Rig, client: Any) -> None:
    """vLLM stores a second copy of a block under the same hash (a fully cached prompt
    sent again recomputes its last block) and removes each copy on its own: the block is
    listed until the last removal; a removal beyond the copies is an unknown removal."""
    engine = rig.engine()
    source = rig.source(engine)
    ns = source.namespace
    bridge = rig.bridge([source], [engine])
    tokens = prompt(11, 3, BS)
    hashes = engine_chain(tokens, BS)
    engine.publish([stored(hashes, None, tokens, BS)])
    again = [stored(hashes[2:], hashes[1], tokens[2 * BS :], BS)]
    engine.publish(again)  # the last block's second copy
    seq = engine.publish(again)  # and a third
    wait_applied(client, ns, seq, bridge)
    assert kv(client, ns) == listed((tokens, 3))
    for left in (2, 1):
        seq = engine.publish([removed(hashes[2:])])
        wait_applied(client, ns, seq, bridge)
        assert kv(client, ns) == listed((tokens, 3)), f"{left} copies left"
    seq = engine.publish([removed(hashes[2:])])  # the last copy
    wait_applied(client, ns, seq, bridge)
    assert kv(client, ns) == listed((tokens, 2))
    seq = engine.publish([removed(hashes[2:])])  # no copy is left
    wait_applied(client, ns, seq, bridge)
    c = counts(bridge, ns)
    assert (c["blocks_stored"], c["blocks_removed"], c["unknown_removals"]) == (3, 1, 1)


def test_copies_in_one_event_and_across_slots(rig: Rig, client: Any) -> None:
    """A hash twice in one event counts twice; copies count per slot (a CPU copy is not
    a GPU copy); a clear forgets every copy."""
    engine = rig.engine()
    source = rig.source(engine, media=("GPU", "CPU"))
    ns = source.namespace
    bridge = rig.bridge([source], [engine])
    tokens = prompt(12, 1, BS)
    hashes = engine_chain(tokens, BS)
    engine.publish([stored(hashes, None, tokens, BS), stored(hashes, None, tokens, BS)])
    seq = engine.publish([stored(hashes, None, tokens, BS, medium="CPU")])
    wait_applied(client, ns, seq, bridge)
    seq = engine.publish([removed(hashes + hashes)])  # both GPU copies, in one event
    wait_applied(client, ns, seq, bridge)
    assert kv(client, ns) == listed((tokens, 1))  # the CPU copy holds it
    seq = engine.publish([removed(hashes, medium="CPU")])
    wait_applied(client, ns, seq, bridge)
    assert kv(client, ns) == {}
    engine.publish([stored(hashes, None, tokens, BS), stored(hashes, None, tokens, BS)])
    engine.publish([cleared()])
    engine.publish([stored(hashes, None, tokens, BS)])
    seq = engine.publish([removed(hashes)])
    wait_applied(client, ns, seq, bridge)
    assert kv(client, ns) == {}  # the clear forgot the copies before it
    assert counts(bridge, ns)["unknown_removals"] == 0


def test_a_resent_call_applies_once(rig: Rig, client: Any) -> None:
    """A ``bridge_apply`` call sent again after its reply was lost (its last engine seq
    is not above ``bridge_seq``) changes nothing: copies are not counted twice."""
    engine = rig.engine()
    source = rig.source(engine)
    ns = source.namespace
    bridge = rig.bridge([source], [engine])
    tokens = prompt(13, 2, BS)
    hashes = engine_chain(tokens, BS)
    seq = engine.publish([stored(hashes, None, tokens, BS)])
    wait_applied(client, ns, seq, bridge)
    follower = next(f for f in bridge.followers if f.source.namespace == ns)
    registry = PrefixCacheRegistry(client, ns)
    data = [k for k in registry.keys.all_keys() if k != registry.keys.meta]  # renewals move meta
    before = {k: client.dump(k) for k in data}
    ops, _ = follower._operations(decode_batch(batch([stored(hashes, None, tokens, BS)])))
    args = (str(seq), "vllm", source.endpoint, str(BS), "", *ops)
    reply = follower.registry.run_write("bridge_apply", follower.pending.keys, False, args)
    assert [int(x) for x in reply[:4]] == [0, 0, 0, 0]
    assert {k: client.dump(k) for k in data} == before
    assert applied(client, ns, seq)
    seq = engine.publish([removed(hashes)])
    wait_applied(client, ns, seq, bridge)
    assert kv(client, ns) == {}


# == 3. Mamba and other groups ==============================================================


def test_hybrid_groups_feed_the_mamba_map(rig: Rig, client: Any) -> None:
    """vLLM hybrid events: group 0 (full attention) -> KV, group 1 (mamba) -> Mamba,
    listed only while the KV map lists the block; scores' ``usable`` follows."""
    engine = rig.engine()
    source = rig.source(engine)
    ns = source.namespace
    bridge = rig.bridge([source], [engine])
    tokens = prompt(5, 6, BS)
    hashes = engine_chain(tokens, BS)
    mine = own(tokens)

    def attention(first: int, last: int) -> Any:
        parent = None if first == 0 else hashes[first - 1]
        return stored(
            hashes[first:last], parent, tokens[first * BS : last * BS], BS,
            group_idx=0, kind="full_attention",
        )  # fmt: skip

    def state(first: int, last: int) -> Any:
        parent = None if first == 0 else hashes[first - 1]
        return stored(
            hashes[first:last], parent, tokens[first * BS : last * BS], BS,
            group_idx=1, kind="mamba",
        )  # fmt: skip

    # Mamba state of block 2 first: not listed until its KV block is.
    seq = engine.publish([state(0, 3)])
    wait_applied(client, ns, seq, bridge)
    assert kv(client, ns) == {}
    assert mamba(client, ns) == {}
    seq = engine.publish([attention(0, 6), state(3, 6)], "array")
    wait_applied(client, ns, seq, bridge)
    assert kv(client, ns) == listed((tokens, 6))
    assert mamba(client, ns) == {mine[i]: i for i in range(6)}
    # The Mamba group drops its state of blocks 0, 1, 3 and 4: checkpoints at 2 and 5.
    seq = engine.publish([removed([hashes[0], hashes[1], hashes[3], hashes[4]], group_idx=1)])
    wait_applied(client, ns, seq, bridge)
    assert mamba(client, ns) == {mine[2]: 2, mine[5]: 5}
    assert kv(client, ns) == listed((tokens, 6))  # the KV group still holds them all
    assert score(client, ns, tokens, hybrid=True) == NodeScore(ns, 6, 6, 6)
    assert score(client, ns, tokens[: 5 * BS], hybrid=True) == NodeScore(ns, 5, 3, 3)
    # The KV group evicts block 5: its Mamba entry goes with it.
    seq = engine.publish([removed([hashes[5]], group_idx=0)])
    wait_applied(client, ns, seq, bridge)
    assert kv(client, ns) == listed((tokens, 5))
    assert mamba(client, ns) == {mine[2]: 2}
    assert score(client, ns, tokens, hybrid=True) == NodeScore(ns, 5, 3, 3)
    assert score(client, ns, tokens, hybrid=False) == NodeScore(ns, 5, 0, 5)
    # KV back for block 5: the Mamba group still holds its state, listed again.
    seq = engine.publish([attention(5, 6)])
    wait_applied(client, ns, seq, bridge)
    assert mamba(client, ns) == {mine[2]: 2, mine[5]: 5}
    assert score(client, ns, tokens, hybrid=True) == NodeScore(ns, 6, 6, 6)
    # The Mamba group drops the states of 2 and 5: nothing usable, the KV prefix stays.
    seq = engine.publish([removed([hashes[2], hashes[5]], group_idx=1)])
    wait_applied(client, ns, seq, bridge)
    assert mamba(client, ns) == {}
    assert score(client, ns, tokens, hybrid=True) == NodeScore(ns, 6, 0, 0)
    c = counts(bridge, ns)
    assert (c["blocks_stored"], c["blocks_removed"], c["unknown_removals"]) == (7, 1, 0)
    assert_quiet(bridge, ns)
    rig.view_agrees(ns)


def test_sliding_window_and_unknown_groups_are_skipped(rig: Rig, client: Any) -> None:
    engine = rig.engine()
    source = rig.source(engine)
    ns = source.namespace
    bridge = rig.bridge([source], [engine])
    tokens = prompt(6, 3, BS)
    hashes = engine_chain(tokens, BS)
    seq = engine.publish(
        [
            stored(hashes, None, tokens, BS, group_idx=1, kind="sliding_window"),
            stored(hashes, None, tokens, BS, group_idx=2, kind="some_future_kind"),
            stored(hashes[:2], None, tokens[: 2 * BS], BS, group_idx=0, kind="mla_attention"),
        ]
    )
    wait_applied(client, ns, seq, bridge)
    assert kv(client, ns) == listed((tokens, 2))
    assert mamba(client, ns) == {}
    assert counts(bridge, ns)["other_groups"] == 6
    # A removal of the sliding-window group touches nothing the bridge listed.
    seq = engine.publish([removed(hashes[:2], group_idx=1)])
    wait_applied(client, ns, seq, bridge)
    assert kv(client, ns) == listed((tokens, 2))
    # A group beyond the holder slots is skipped and counted.
    seq = engine.publish([stored(hashes[2:], hashes[1], tokens[2 * BS :], BS, group_idx=64)])
    wait_applied(client, ns, seq, bridge)
    assert kv(client, ns) == listed((tokens, 2))
    assert counts(bridge, ns)["other_groups"] == 7
    assert_quiet(bridge, ns)


# == 4. media ================================================================================


def test_other_media_are_ignored_by_default(rig: Rig, client: Any) -> None:
    engine = rig.engine()
    source = rig.source(engine)
    ns = source.namespace
    bridge = rig.bridge([source], [engine])
    tokens = prompt(7, 3, BS)
    hashes = engine_chain(tokens, BS)
    seq = engine.publish(
        [
            stored(hashes, None, tokens, BS, medium="CPU"),
            stored(hashes[:2], None, tokens[: 2 * BS], BS, medium=None),  # no medium: GPU
        ]
    )
    wait_applied(client, ns, seq, bridge)
    assert kv(client, ns) == listed((tokens, 2))
    seq = engine.publish([removed(hashes[:2], medium="CPU")])  # not followed: nothing
    wait_applied(client, ns, seq, bridge)
    assert kv(client, ns) == listed((tokens, 2))
    assert counts(bridge, ns)["other_medium"] == 5
    seq = engine.publish([removed(hashes[1:2], medium=None)], "array")
    wait_applied(client, ns, seq, bridge)
    assert kv(client, ns) == listed((tokens, 1))
    assert_quiet(bridge, ns)


def test_a_block_on_gpu_and_cpu_stays_until_both_removed(rig: Rig, client: Any) -> None:
    engine = rig.engine()
    source = rig.source(engine, media=("GPU", "CPU"))
    ns = source.namespace
    bridge = rig.bridge([source], [engine])
    tokens = prompt(8, 4, BS)
    hashes = engine_chain(tokens, BS)
    seq = engine.publish(
        [
            stored(hashes, None, tokens, BS, medium="GPU"),
            stored(hashes[:3], None, tokens[: 3 * BS], BS, medium="CPU"),  # offloaded copies
            stored(hashes[:1], None, tokens[:BS], BS, medium="DISK"),  # not followed
        ]
    )
    wait_applied(client, ns, seq, bridge)
    assert kv(client, ns) == listed((tokens, 4))
    assert counts(bridge, ns)["blocks_stored"] == 4  # listed once however many copies
    assert counts(bridge, ns)["other_medium"] == 1
    seq = engine.publish([removed(hashes, medium="GPU")])
    wait_applied(client, ns, seq, bridge)
    assert kv(client, ns) == listed((tokens, 3))  # the CPU still holds blocks 0-2
    seq = engine.publish([removed(hashes[1:3], medium="CPU")])
    wait_applied(client, ns, seq, bridge)
    assert kv(client, ns) == listed((tokens, 1))
    # Block 1 comes back on the CPU; then the CPU drops blocks 0 and 1.
    seq = engine.publish([stored(hashes[1:2], hashes[0], tokens[BS : 2 * BS], BS, medium="CPU")])
    wait_applied(client, ns, seq, bridge)
    assert kv(client, ns) == listed((tokens, 2))
    seq = engine.publish([removed(hashes[:2], medium="CPU")])
    wait_applied(client, ns, seq, bridge)
    assert kv(client, ns) == {}
    c = counts(bridge, ns)
    assert (c["blocks_stored"], c["blocks_removed"], c["unknown_removals"]) == (5, 5, 0)
    assert_quiet(bridge, ns)


# == 5. blocks the chain cannot hash ========================================================


def test_keyed_blocks_and_orphans_are_skipped_never_rerooted(rig: Rig, client: Any) -> None:
    engine = rig.engine()
    source = rig.source(engine)
    ns = source.namespace
    bridge = rig.bridge([source], [engine])
    a, b, c_, d = (prompt(s, 3, BS) for s in (10, 11, 12, 13))
    ha, hb, hc = engine_chain(a, BS), engine_chain(b, BS), engine_chain(c_, BS)
    hd = engine_chain(d, BS)
    seq = engine.publish(
        [
            # A multimodal block in the middle: the whole event is keyed.
            stored(ha[:2], None, a[: 2 * BS], BS, extra_keys=[None, ["mm-hash", 0]]),
            stored(ha[2:], ha[1], a[2 * BS :], BS),  # its child: an orphan
            stored(hb, None, b, BS, lora_name="adapter-1"),  # a LoRA: its own chain
            stored(hc, None, c_, BS, extra_keys=[None, None, None]),  # no keys at all
            # An unknown parent: never re-rooted at position 0.
            stored(hd[1:], 987654321, d[BS:], BS),
        ]
    )
    wait_applied(client, ns, seq, bridge)
    adapter = block_hashes(b, BS, lora="adapter-1")
    assert kv(client, ns) == listed((c_, 3)) | {h: i for i, h in enumerate(adapter)}
    for tokens in (a, b, d, d[BS:]):
        assert match(client, ns, tokens) == []
    got = counts(bridge, ns)
    assert (got["keyed_blocks"], got["orphans"], got["blocks_stored"]) == (2, 3, 6)
    # A LoRA id without a name keys the block: no router can name its chain.
    payload = msgpack.packb({"ts": 1.0, "events": [["BlockStored", hd[:1], None, d[:BS], BS, 7]]})
    seq = engine.publish_raw(payload)
    wait_applied(client, ns, seq, bridge)
    assert match(client, ns, d) == []
    assert counts(bridge, ns)["keyed_blocks"] == 3
    assert_quiet(bridge, ns, "orphans")


# == 6. gaps ================================================================================


@pytest.mark.parametrize("frames", [3, 4], ids=["vllm<=0.25", "vllm>=0.26"])
def test_a_gap_is_replayed(rig: Rig, client: Any, frames: int) -> None:
    engine = rig.engine(replay_frames=frames)
    source = rig.source(engine)
    ns = source.namespace
    bridge = rig.bridge([source], [engine])
    tokens = prompt(20, 6, BS)
    hashes = engine_chain(tokens, BS)
    seq = engine.publish([stored(hashes[:2], None, tokens[: 2 * BS], BS)])
    wait_applied(client, ns, seq, bridge)
    # Two batches lost on the way (the replay buffer has them), then one arrives.
    engine.publish([stored(hashes[2:4], hashes[1], tokens[2 * BS : 4 * BS], BS)], send=False)
    engine.publish([removed(hashes[:1])], send=False)
    seq = engine.publish([stored(hashes[4:], hashes[3], tokens[4 * BS :], BS)])
    wait_applied(client, ns, seq, bridge)
    assert kv(client, ns) == {h: i for i, h in enumerate(own(tokens)) if i != 0}
    assert match(client, ns, tokens) == []
    c = counts(bridge, ns)
    assert (c["gaps"], c["replays"], c["replay_failures"], c["restarts"]) == (1, 2, 0, 0)
    assert engine.replay_requests == [0, 1]
    # The same again, and the next message in sequence after it.
    engine.publish([stored(hashes[:1], None, tokens[:BS], BS)], send=False)
    engine.publish([cleared()], send=False)
    engine.publish([stored(hashes[:3], None, tokens[: 3 * BS], BS)])
    seq = engine.publish([stored(hashes[3:4], hashes[2], tokens[3 * BS : 4 * BS], BS)])
    wait_applied(client, ns, seq, bridge)
    assert kv(client, ns) == listed((tokens, 4))
    c = counts(bridge, ns)
    assert (c["gaps"], c["replays"], c["restarts"], c["messages"]) == (2, 3, 0, 8)
    assert_quiet(bridge, ns, "gaps")


def test_a_gap_without_replay_restarts_the_namespace(rig: Rig, client: Any) -> None:
    engine = rig.engine(replay=False)
    source = rig.source(engine)
    ns = source.namespace
    bridge = rig.bridge([source], [engine])
    stale, fresh = prompt(21, 3, BS), prompt(22, 2, BS)
    hs, hf = engine_chain(stale, BS), engine_chain(fresh, BS)
    seq = engine.publish([stored(hs, None, stale, BS)])
    wait_applied(client, ns, seq, bridge)
    epoch = meta(client, ns)["epoch"]
    engine.publish([removed(hs)], send=False)  # lost: stale would stay listed forever
    seq = engine.publish([stored(hf, None, fresh, BS)])
    wait_applied(client, ns, seq, bridge)
    assert kv(client, ns) == listed((fresh, 2))
    assert meta(client, ns)["epoch"] != epoch
    assert meta(client, ns)["bridge_endpoint"] == engine.endpoint
    c = counts(bridge, ns)
    assert (c["gaps"], c["restarts"], c["replays"]) == (1, 1, 0)
    assert score(client, ns, fresh) == NodeScore(ns, 2, 0, 2)
    # The stream goes on after the restart: chains continue from what came since.
    seq = engine.publish([stored(hs[1:], hf[1], stale[BS:], BS)])
    wait_applied(client, ns, seq, bridge)
    assert kv(client, ns) == listed((fresh, 2)) | {
        h: i for i, h in enumerate(block_hashes(fresh + stale[BS:], BS)) if i >= 2
    }
    assert_quiet(bridge, ns, "gaps", "restarts")


def test_a_gap_beyond_the_replay_buffer_restarts_the_namespace(rig: Rig, client: Any) -> None:
    engine = rig.engine(buffer_steps=2)
    source = rig.source(engine)
    ns = source.namespace
    bridge = rig.bridge([source], [engine])
    a, b, d, e = (prompt(s, 2, BS) for s in (23, 24, 25, 26))
    ha, hb, hd, he = (engine_chain(t, BS) for t in (a, b, d, e))
    seq = engine.publish([stored(ha, None, a, BS)])
    wait_applied(client, ns, seq, bridge)
    engine.publish([removed(ha)], send=False)  # seq 1: lost and out of the buffer
    engine.publish([stored(hb, None, b, BS)], send=False)  # seq 2: lost, out of the buffer
    engine.publish([stored(hd, None, d, BS)], send=False)  # seq 3: lost, replayable
    seq = engine.publish([stored(he, None, e, BS)])  # seq 4
    wait_applied(client, ns, seq, bridge)
    # a is stale (its removal is lost for good), b was never seen: neither is listed.
    assert kv(client, ns) == listed((d, 2), (e, 2))
    c = counts(bridge, ns)
    assert (c["gaps"], c["restarts"], c["replays"], c["duplicates"]) == (1, 1, 2, 1)
    assert engine.replay_requests == [0, 1]
    assert_quiet(bridge, ns, "gaps", "restarts")


def test_a_gap_the_replay_socket_does_not_answer_restarts(rig: Rig, client: Any) -> None:
    engine = rig.engine()
    source = rig.source(engine)
    ns = source.namespace
    bridge = rig.bridge([source], [engine], replay_timeout=0.3)
    a, b = prompt(27, 2, BS), prompt(28, 2, BS)
    ha, hb = engine_chain(a, BS), engine_chain(b, BS)
    seq = engine.publish([stored(ha, None, a, BS)])
    wait_applied(client, ns, seq, bridge)
    engine.answer_replays = False
    engine.publish([removed(ha)], send=False)
    seq = engine.publish([stored(hb, None, b, BS)])
    wait_applied(client, ns, seq, bridge)
    assert kv(client, ns) == listed((b, 2))
    c = counts(bridge, ns)
    assert (c["gaps"], c["restarts"], c["replay_failures"]) == (1, 1, 1)
    alive(bridge)


# == 7. engine restarts =====================================================================


@pytest.mark.parametrize("history", ["live", "replayed"])
def test_an_engine_restart_restarts_the_namespace(rig: Rig, client: Any, history: str) -> None:
    """The engine restarts (seq back to 0, new hash seed): old entries go, new ones come.
    ``replayed``: the bridge learnt the old history from the replay socket at its start."""
    engine = rig.engine()
    source = rig.source(engine)
    ns = source.namespace
    old, new = prompt(30, 3, BS), prompt(31, 3, BS)
    ho = engine_chain(old, BS)
    hn = engine_chain(new, BS, seed=b"engine-2")
    if history == "replayed":
        engine.publish([stored(ho[:2], None, old[: 2 * BS], BS)])
        engine.publish([stored(ho[2:], ho[1], old[2 * BS :], BS)])
        bridge = rig.bridge([source], [engine])
    else:
        bridge = rig.bridge([source], [engine])
        engine.publish([stored(ho[:2], None, old[: 2 * BS], BS)])
        engine.publish([stored(ho[2:], ho[1], old[2 * BS :], BS)])
    wait_applied(client, ns, 1, bridge)
    assert kv(client, ns) == listed((old, 3))
    engine.restart()
    seq = engine.publish([stored(hn[:1], None, new[:BS], BS)])
    assert seq == 0
    wait_count(bridge, ns, "engine_restarts", 1)
    wait_applied(client, ns, 0, bridge)
    assert kv(client, ns) == listed((new, 1))
    seq = engine.publish([stored(hn[1:], hn[0], new[BS:], BS)])
    wait_applied(client, ns, seq, bridge)
    assert kv(client, ns) == listed((new, 3))
    assert match(client, ns, old) == []
    c = counts(bridge, ns)
    assert (c["engine_restarts"], c["restarts"], c["gaps"], c["orphans"]) == (1, 1, 0, 0)
    alive(bridge)
    rig.view_agrees(ns)


def test_an_engine_restart_whose_first_batches_were_lost(rig: Rig, client: Any) -> None:
    engine = rig.engine()
    source = rig.source(engine)
    ns = source.namespace
    bridge = rig.bridge([source], [engine])
    old, new = prompt(32, 2, BS), prompt(33, 3, BS)
    ho, hn = engine_chain(old, BS), engine_chain(new, BS, seed=b"engine-2")
    for i in range(4):  # seqs 0-3
        engine.publish([stored(ho[:1], None, old[:BS], BS)] if i == 0 else [])
    engine.publish([stored(ho[1:], ho[0], old[BS:], BS)])
    wait_applied(client, ns, 4, bridge)
    engine.restart()
    engine.publish([stored(hn[:2], None, new[: 2 * BS], BS)], send=False)  # seq 0, lost
    seq = engine.publish([stored(hn[2:], hn[1], new[2 * BS :], BS)])  # seq 1 < 5
    wait_count(bridge, ns, "engine_restarts", 1)
    wait_applied(client, ns, seq, bridge)
    assert kv(client, ns) == listed((new, 3))
    c = counts(bridge, ns)
    assert (c["engine_restarts"], c["restarts"], c["orphans"]) == (1, 1, 0)
    assert engine.replay_requests[-1] == 0


# == 8. garbage =============================================================================


def test_garbage_is_counted_and_skipped(rig: Rig, client: Any) -> None:
    engine = rig.engine()
    source = rig.source(engine)
    ns = source.namespace
    bridge = rig.bridge([source], [engine])
    tokens = prompt(40, 4, BS)
    hashes = engine_chain(tokens, BS)
    seq = engine.publish([stored(hashes[:1], None, tokens[:BS], BS)])
    wait_applied(client, ns, seq, bridge)
    good_seq = (seq + 1).to_bytes(8, "big")
    rng = os.urandom
    bad_frames = [
        [b"only one frame"],
        [b"", good_seq],
        [b"", good_seq, batch([]), b"a fourth frame"],
        [b"", good_seq[1:], batch([])],  # a 7-byte seq
        [b"", good_seq + b"\0", batch([])],  # a 9-byte seq
        [rng(1 << 20)],  # a huge frame of random bytes
        [b"", rng(8), rng(1 << 20)],  # random seq and payload
        [b"", (U64 - 1).to_bytes(8, "big"), b"\xc1"],  # the largest seq, no msgpack
    ]
    for frames in bad_frames:
        engine.send_frames(frames)
    bad_payloads: list[bytes] = [
        b"",
        b"\xc1",  # never used in msgpack
        b"not msgpack at all \xff\xfe",
        rng(1 << 16),
        msgpack.packb([1.0]),  # a batch without events
        msgpack.packb({"events": []}),  # no ts
        msgpack.packb([float("nan"), []]),
        msgpack.packb([1.0, "events"]),
        msgpack.packb([1.0, [["BlockStored", "not a list", None, [1, 2, 3, 4], 4]]]),
        msgpack.packb([1.0, [["BlockStored", [1.5], None, [1, 2, 3, 4], 4]]]),  # float hash
        msgpack.packb([1.0, [["BlockStored", [b"short"], None, [1, 2, 3, 4], 4]]]),
        msgpack.packb([1.0, [["BlockStored", [True], None, [1, 2, 3, 4], 4]]]),
        msgpack.packb([1.0, [["BlockStored", [1], None, [1, 2, 3], 4]]]),  # 3 tokens
        msgpack.packb([1.0, [["BlockStored", [1], None, [1, 2, 3, 4], 0]]]),
        msgpack.packb([1.0, [["BlockStored", [1], None, ["a", 2, 3, 4], 4]]]),
        msgpack.packb([1.0, [["BlockRemoved", [1], "GPU", -1]]]),  # negative group
        msgpack.packb([1.0, [["BlockRemoved", [1], 5]]]),  # medium not text
        msgpack.packb([1.0, [["BlockStored"]]]),
        msgpack.packb([1.0, [[]]]),
        msgpack.packb([1.0, [{"block_hashes": [1]}]]),  # a map without type
        msgpack.packb([1.0, [7]]),
        msgpack.packb({"ts": 1.0, "events": [{"type": 5}]}),
        msgpack.packb({"ts": 1.0, "events": [], "data_parallel_rank": -3}),
        msgpack.packb({(1, 2): 3}),
    ]
    for payload in bad_payloads:
        engine.publish_raw(payload)
    # Unknown event types are skipped and counted; the batch itself is good.
    engine.publish_raw(msgpack.packb([1.0, [["BlockUpdated", 1], {"type": "Foo"}]]))
    seq = engine.publish([stored(hashes[1:], hashes[0], tokens[BS:], BS)], "array")
    wait_applied(client, ns, seq, bridge)
    assert kv(client, ns) == listed((tokens, 4))
    c = counts(bridge, ns)
    # The out-of-sequence garbage moves nothing: no gap, no restart, no replay.
    assert c["bad_messages"] == len(bad_frames) + len(bad_payloads), c
    assert c["bad:payload"] == len(bad_payloads) + 2, c
    assert c["bad:frames"] == len(bad_frames) - 2, c
    assert c["unknown_events"] == 2
    assert (c["gaps"], c["restarts"], c["engine_restarts"], c["replays"]) == (0, 0, 0, 1), c
    assert match(client, ns, tokens) == [0, 1, 2, 3]
    alive(bridge)


def test_a_batch_with_one_bad_event_is_skipped_whole(rig: Rig, client: Any) -> None:
    engine = rig.engine()
    source = rig.source(engine)
    ns = source.namespace
    bridge = rig.bridge([source], [engine])
    tokens = prompt(41, 4, BS)
    hashes = engine_chain(tokens, BS)
    seq = engine.publish([stored(hashes[:2], None, tokens[: 2 * BS], BS)])
    wait_applied(client, ns, seq, bridge)
    seq = engine.publish(
        [
            removed(hashes[:1]),
            stored(hashes[2:], hashes[1], tokens[2 * BS :], BS),
            cleared(),
            ["BlockStored", [1], None, [1, 2, 3], BS],  # 3 tokens for a 4-token block
        ],
        "array",
    )
    wait_applied(client, ns, seq, bridge)
    assert kv(client, ns) == listed((tokens, 2))  # none of it applied
    assert counts(bridge, ns)["bad:payload"] == 1
    # Its children are orphans (their parent was never applied); the stream goes on.
    seq = engine.publish([stored(hashes[3:], hashes[2], tokens[3 * BS :], BS)])
    wait_applied(client, ns, seq, bridge)
    assert kv(client, ns) == listed((tokens, 2))
    assert counts(bridge, ns)["orphans"] == 1
    seq = engine.publish([stored(hashes[2:], hashes[1], tokens[2 * BS :], BS)])
    wait_applied(client, ns, seq, bridge)
    assert kv(client, ns) == listed((tokens, 4))
    assert_quiet(bridge, ns, "bad_messages", "orphans")


# == 9. Redis outages =======================================================================


def quick_client(server: RedisServer) -> redis.Redis:
    return redis.Redis(
        host=server.host,
        port=server.port,
        socket_connect_timeout=0.5,
        socket_timeout=0.5,
        retry=Retry(NoBackoff(), 0),
    )


@pytest.fixture
def own_client(own_server: RedisServer) -> Iterator[redis.Redis]:
    c = quick_client(own_server)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def own_rig(own_client: redis.Redis) -> Iterator[Rig]:
    made = Rig(own_client)
    try:
        yield made
    finally:
        made.close()


def blocked(bridge: Bridge) -> bool:
    return bridge.followers[0].blocked_until > 0


def test_a_paused_redis_holds_the_batches_until_it_is_back(
    own_rig: Rig, own_server: RedisServer, own_client: Any
) -> None:
    """Redis stops answering (SIGSTOP) with its data: the bridge keeps what it has,
    reads nothing more, and applies all of it, and what the socket lost, once back."""
    client = own_client
    engine = own_rig.engine()
    source = own_rig.source(engine)
    ns = source.namespace
    bridge = own_rig.bridge([source], [engine])
    tokens = prompt(50, 6, BS)
    hashes = engine_chain(tokens, BS)
    seq = engine.publish([stored(hashes[:2], None, tokens[: 2 * BS], BS)])
    wait_applied(client, ns, seq, bridge)
    assert own_server.process is not None
    pid = own_server.process.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        engine.publish([stored(hashes[2:3], hashes[1], tokens[2 * BS : 3 * BS], BS)])
        wait_until(lambda: blocked(bridge), WAIT, "the bridge finds Redis away")
        engine.publish([stored(hashes[3:4], hashes[2], tokens[3 * BS : 4 * BS], BS)])
        engine.publish([removed(hashes[:1])], send=False)  # dropped by the socket
        engine.publish([stored(hashes[4:], hashes[3], tokens[4 * BS :], BS)])
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_applied(client, ns, 4, bridge)
    assert kv(client, ns) == {h: i for i, h in enumerate(own(tokens)) if i != 0}
    c = counts(bridge, ns)
    assert c["redis_errors"] >= 1
    assert c["gaps"] == 1
    assert (c["restarts"], c["superseded"], c["bad_messages"]) == (0, 0, 0)
    assert NodeIndex(client).live() == [ns]
    alive(bridge)


def test_redis_restarted_empty_is_claimed_again(
    own_rig: Rig, own_server: RedisServer, own_client: Any
) -> None:
    """Redis comes back empty: the bridge claims the namespace again, writes what the
    engine holds from its picture and goes on with what came since (children of blocks
    stored before the restart are no orphans)."""
    client = own_client
    engine = own_rig.engine()
    source = own_rig.source(engine)
    ns = source.namespace
    bridge = own_rig.bridge([source], [engine])
    a, b = prompt(51, 4, BS), prompt(52, 2, BS)
    ha, hb = engine_chain(a, BS), engine_chain(b, BS)
    seq = engine.publish([stored(ha[:3], None, a[: 3 * BS], BS)])
    wait_applied(client, ns, seq, bridge)
    own_server.kill()
    engine.publish([stored(hb, None, b, BS)])
    wait_until(lambda: blocked(bridge), WAIT, "the bridge finds Redis away")
    engine.publish([stored(ha[3:], ha[2], a[3 * BS :], BS)])
    own_server.restart()
    wait_applied(client, ns, 2, bridge)
    assert kv(client, ns) == listed((b, 2), (a, 4))
    c = counts(bridge, ns)
    assert (c["restarts"], c["rewrites"], c["superseded"], c["orphans"]) == (1, 1, 0, 0), c
    assert c["redis_errors"] >= 1
    assert NodeIndex(client).live() == [ns]
    assert meta(client, ns)["bridge_endpoint"] == engine.endpoint
    seq = engine.publish([removed(ha[1:])])
    wait_applied(client, ns, seq, bridge)
    assert kv(client, ns) == listed((b, 2), (a, 1))
    assert counts(bridge, ns)["unknown_removals"] == 0
    alive(bridge)


def test_redis_restarted_empty_while_the_bridge_is_idle(
    own_rig: Rig, own_server: RedisServer, own_client: Any
) -> None:
    """Only the lease renewal finds the empty server: the bridge claims again and
    writes the engine's blocks again."""
    client = own_client
    engine = own_rig.engine(replay=False)
    source = own_rig.source(engine)
    ns = source.namespace
    bridge = own_rig.bridge([source], [engine], lease_ttl=0.6, silence_timeout=60)
    a = prompt(53, 2, BS)
    ha = engine_chain(a, BS)
    seq = engine.publish([stored(ha, None, a, BS)])
    wait_applied(client, ns, seq, bridge)
    own_server.restart()
    wait_until(lambda: counts(bridge, ns)["restarts"] == 1, WAIT, "a new claim")
    wait_until(lambda: NodeIndex(client).live() == [ns], WAIT, "the lease back")
    assert kv(client, ns) == listed((a, 2))
    b = a + prompt(55, 1, BS)
    hb = engine_chain(b, BS)
    seq = engine.publish([stored(hb[2:], ha[1], b[2 * BS :], BS)])
    wait_applied(client, ns, seq, bridge)
    assert kv(client, ns) == listed((b, 3))
    assert counts(bridge, ns)["orphans"] == 0
    alive(bridge)


def test_redis_down_when_the_bridge_starts(
    own_rig: Rig, own_server: RedisServer, own_client: Any
) -> None:
    client = own_client
    engine = own_rig.engine()
    source = own_rig.source(engine)
    ns = source.namespace
    a = prompt(54, 2, BS)
    ha = engine_chain(a, BS)
    engine.publish([stored(ha, None, a, BS)])
    own_server.kill()
    bridge = own_rig.bridge([source], [engine], ready=False)
    wait_count(bridge, ns, "redis_errors", 1)
    assert not bridge.ready.is_set()
    own_server.restart()
    assert bridge.wait_ready(WAIT)
    wait_applied(client, ns, 0, bridge)
    assert kv(client, ns) == listed((a, 2))
    alive(bridge)


# == 10. two engines ========================================================================


def test_two_engines_two_namespaces_no_cross_talk(rig: Rig, client: Any) -> None:
    e1, e2 = rig.engine(), rig.engine(replay=False)
    s1, s2 = rig.source(e1), rig.source(e2, engine="sglang")
    bridge = rig.bridge([s1, s2], [e1, e2])
    tokens = prompt(60, 4, BS)
    h1 = engine_chain(tokens, BS, seed=b"one")
    h2 = [to_signed(h) for h in engine_chain(tokens, BS, seed=b"two")]
    q1 = e1.publish([stored(h1, None, tokens, BS)])
    q2 = e2.publish([stored(h2[:2], None, tokens[: 2 * BS], BS, layout="sglang")], "sglang")
    wait_applied(client, s1.namespace, q1, bridge)
    wait_applied(client, s2.namespace, q2, bridge)
    assert kv(client, s1.namespace) == listed((tokens, 4))
    assert kv(client, s2.namespace) == listed((tokens, 2))
    scores = PrefixRouter(client, live_cache_ttl=0, hybrid=False).score(
        own(tokens), [s1.namespace, s2.namespace]
    )
    assert scores == {
        s1.namespace: NodeScore(s1.namespace, 4, 0, 4),
        s2.namespace: NodeScore(s2.namespace, 2, 0, 2),
    }
    # Engine 1 removes (with engine 2's hashes too: unknown there), garbage, restarts.
    q1 = e1.publish([removed(h1[2:] + h2[:2])])
    e2.send_frames([b"junk"])
    wait_applied(client, s1.namespace, q1, bridge)
    wait_count(bridge, s2.namespace, "bad_messages", 1)
    assert kv(client, s1.namespace) == listed((tokens, 2))
    assert kv(client, s2.namespace) == listed((tokens, 2))
    e2.publish([], "sglang", send=False)
    q2 = e2.publish([stored(h2[2:], h2[1], tokens[2 * BS :], BS, layout="sglang")], "sglang")
    wait_applied(client, s2.namespace, q2, bridge)  # engine 2 restarted its namespace
    assert kv(client, s2.namespace) == {}
    assert kv(client, s1.namespace) == listed((tokens, 2))
    c1, c2 = counts(bridge, s1.namespace), counts(bridge, s2.namespace)
    assert (c1["unknown_removals"], c1["bad_messages"], c1["restarts"]) == (2, 0, 0)
    assert (c2["orphans"], c2["bad_messages"], c2["restarts"]) == (2, 1, 1)
    assert meta(client, s2.namespace)["bridge_engine"] == "sglang"
    assert meta(client, s1.namespace)["bridge_engine"] == "vllm"
    alive(bridge)


def test_a_topic_is_followed_and_other_topics_are_not_seen(rig: Rig, client: Any) -> None:
    engine = rig.engine(topic=b"kv-events")
    source = rig.source(engine, topic="kv-events")
    ns = source.namespace
    bridge = rig.bridge([source], [engine])
    tokens = prompt(61, 3, BS)
    hashes = engine_chain(tokens, BS)
    seq = engine.publish([stored(hashes[:1], None, tokens[:BS], BS)])
    wait_applied(client, ns, seq, bridge)
    # Another topic on the same socket: filtered out by the subscription.
    engine.send_frames([b"other", (seq + 1).to_bytes(8, "big"), batch([cleared()])])
    engine.send_frames([b"", b"junk"])
    engine.publish([stored(hashes[1:2], hashes[0], tokens[BS : 2 * BS], BS)], send=False)
    seq = engine.publish([stored(hashes[2:], hashes[1], tokens[2 * BS :], BS)])
    wait_applied(client, ns, seq, bridge)
    assert kv(client, ns) == listed((tokens, 3))
    c = counts(bridge, ns)
    assert (c["bad_messages"], c["clears"], c["gaps"], c["restarts"]) == (0, 0, 1, 0), c


def test_a_replay_out_of_protocol_is_reported_naming_the_engine(
    rig: Rig, client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A replay socket that answers neither form (here five frames) is a replay failure,
    logged with the engine's namespace and what came; the bridge goes on without it."""
    engine = rig.engine(replay=False)
    context = zmq.Context.instance()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def answer_garbage() -> None:
        while not stop.is_set():
            if router.poll(50, zmq.POLLIN):
                client_id, *_request = router.recv_multipart()
                router.send_multipart([client_id, b"", b"t", b"x", (0).to_bytes(8, "big"), b""])

    server = threading.Thread(target=answer_garbage, daemon=True)
    server.start()
    try:
        source = rig.source(engine, replay_endpoint=f"tcp://127.0.0.1:{port}")
        with caplog.at_level("WARNING", logger="registry.bridge.bridge"):
            bridge = rig.bridge([source], [engine], replay_timeout=2.0)
            wait_count(bridge, source.namespace, "replay_failures", 1)
        tokens = prompt(30, 2, BS)
        seq = engine.publish([stored(engine_chain(tokens, BS), None, tokens, BS)])
        wait_applied(client, source.namespace, seq, bridge)
    finally:
        stop.set()
        server.join(10)
        router.close(0)
    said = [r.getMessage() for r in caplog.records if "out of protocol" in r.getMessage()]
    assert said, caplog.text
    assert source.namespace in said[0]
    assert "5 frames" in said[0]


# == 11. a restarted bridge =================================================================


@pytest.mark.parametrize("frames", [3, 4], ids=["vllm<=0.25", "vllm>=0.26"])
def test_a_restarted_bridge_resumes_and_replays_what_it_missed(
    rig: Rig, client: Any, frames: int
) -> None:
    engine = rig.engine(replay_frames=frames)
    source = rig.source(engine)
    ns = source.namespace
    first = rig.bridge([source], [engine])
    tokens = prompt(70, 6, BS)
    hashes = engine_chain(tokens, BS)
    engine.publish([stored(hashes[:2], None, tokens[: 2 * BS], BS)])
    seq = engine.publish([stored(hashes[2:3], hashes[1], tokens[2 * BS : 3 * BS], BS)])
    wait_applied(client, ns, seq, first)
    epoch = meta(client, ns)["epoch"]
    first.stop()
    # Published while no bridge listens: only the replay buffer has them.
    engine.publish([stored(hashes[3:5], hashes[2], tokens[3 * BS : 5 * BS], BS)])
    engine.publish([removed(hashes[1:2])])
    second = rig.bridge([source], [engine])
    wait_applied(client, ns, 3, second)
    assert kv(client, ns) == {h: i for i, h in enumerate(own(tokens)[:5]) if i != 1}
    c = counts(second, ns)
    assert (c["resumed"], c["restarts"], c["orphans"], c["gaps"]) == (1, 0, 0, 0)
    assert meta(client, ns)["epoch"] != epoch
    # The chain continues from blocks the first bridge stored (digests read from Redis).
    seq = engine.publish([stored(hashes[5:], hashes[4], tokens[5 * BS :], BS)])
    wait_applied(client, ns, seq, second)
    seq = engine.publish([stored(hashes[1:2], hashes[0], tokens[BS : 2 * BS], BS)])
    wait_applied(client, ns, seq, second)
    assert kv(client, ns) == listed((tokens, 6))
    assert score(client, ns, tokens) == NodeScore(ns, 6, 0, 6)
    assert counts(second, ns)["orphans"] == 0
    alive(second)


def test_a_second_bridge_on_the_namespace_supersedes_the_first(rig: Rig, client: Any) -> None:
    engine = rig.engine()
    source = rig.source(engine)
    ns = source.namespace
    first = rig.bridge([source], [engine])
    tokens = prompt(71, 3, BS)
    hashes = engine_chain(tokens, BS)
    seq = engine.publish([stored(hashes[:1], None, tokens[:BS], BS)])
    wait_applied(client, ns, seq, first)
    second = rig.bridge([source], [engine])
    assert counts(second, ns)["resumed"] == 1
    seq = engine.publish([stored(hashes[1:], hashes[0], tokens[BS:], BS)])
    wait_applied(client, ns, seq, second)
    wait_count(first, ns, "superseded", 1)  # its write was fenced: it stops
    assert first.followers[0].stopped
    assert kv(client, ns) == listed((tokens, 3))
    seq = engine.publish([removed(hashes[2:])])
    wait_applied(client, ns, seq, second)
    assert kv(client, ns) == listed((tokens, 2))
    assert counts(second, ns)["superseded"] == 0
    alive(first)
    alive(second)


@pytest.mark.parametrize("replay", [True, False])
def test_a_bridge_after_the_lease_ran_out_claims_afresh(
    rig: Rig, client: Any, replay: bool
) -> None:
    engine = rig.engine(replay=replay)
    source = rig.source(engine)
    ns = source.namespace
    first = rig.bridge([source], [engine], lease_ttl=0.3)
    tokens = prompt(72, 3, BS)
    hashes = engine_chain(tokens, BS)
    seq = engine.publish([stored(hashes, None, tokens, BS)])
    wait_applied(client, ns, seq, first)
    epoch = meta(client, ns)["epoch"]
    first.stop()
    registry = PrefixCacheRegistry(client, ns)
    wait_until(lambda: registry.info().state == "dead", WAIT, "the lease runs out")
    second = rig.bridge([source], [engine])
    c = counts(second, ns)
    assert (c["resumed"], c["restarts"]) == (0, 0)
    assert meta(client, ns)["epoch"] != epoch
    if replay:  # the claim empties it, then the replay buffer fills it again
        wait_applied(client, ns, seq, second)
        assert kv(client, ns) == listed((tokens, 3))
        assert engine.replay_requests[-1] == 0
    else:
        assert kv(client, ns) == {}
        assert "bridge_seq" not in meta(client, ns)
    assert registry.info().state == "live"


def test_a_bridge_for_another_endpoint_claims_afresh(rig: Rig, client: Any) -> None:
    e1, e2 = rig.engine(replay=False), rig.engine(replay=False)
    s1 = rig.source(e1)
    ns = s1.namespace
    first = rig.bridge([s1], [e1])
    tokens = prompt(73, 2, BS)
    hashes = engine_chain(tokens, BS)
    seq = e1.publish([stored(hashes, None, tokens, BS)])
    wait_applied(client, ns, seq, first)
    first.stop()
    second = rig.bridge([rig.source(e2, ns)], [e2])
    assert counts(second, ns)["resumed"] == 0
    assert kv(client, ns) == {}
    assert meta(client, ns)["bridge_endpoint"] == e2.endpoint


# == 12. liveness ===========================================================================


def test_the_lease_lapses_while_the_engine_is_silent(rig: Rig, client: Any) -> None:
    """Without a replay socket only messages keep the lease: it lapses while the engine
    is silent, and comes back when it speaks."""
    engine = rig.engine(replay=False)
    source = rig.source(engine)
    ns = source.namespace
    bridge = rig.bridge([source], [engine], lease_ttl=0.5, silence_timeout=0.5)
    registry = PrefixCacheRegistry(client, ns)
    index = NodeIndex(client)
    tokens = prompt(80, 2, BS)
    hashes = engine_chain(tokens, BS)
    seq = engine.publish([stored(hashes, None, tokens, BS)])
    wait_applied(client, ns, seq, bridge)
    wait_until(lambda: ns not in index.live(), WAIT, "the lease lapses")
    assert registry.info().state == "dead"
    assert ns in index.dead()
    assert counts(bridge, ns)["silent"] == 1
    assert score(client, ns, tokens) is None  # dead nodes are never scored
    seq = engine.publish([removed(hashes[1:])])
    wait_applied(client, ns, seq, bridge)

    def speaking_and_live() -> bool:
        engine.publish([])  # the engine keeps talking: the lease must come back and stay
        return ns in index.live()

    wait_until(speaking_and_live, WAIT, "the lease back")
    assert registry.info().state == "live"
    assert score(client, ns, tokens) == NodeScore(ns, 1, 0, 1)
    # And it lapses again once the engine falls silent again.
    wait_until(lambda: ns not in index.live(), WAIT, "the lease lapses again")
    c = counts(bridge, ns)
    assert (c["silent"], c["probes"], c["gaps"], c["restarts"]) == (2, 0, 0, 0)
    alive(bridge)


@pytest.mark.parametrize("frames", [3, 4], ids=["vllm<=0.25", "vllm>=0.26"])
def test_probes_keep_an_idle_engine_live(rig: Rig, client: Any, frames: int) -> None:
    """With a replay socket, an idle engine that answers probes keeps its lease, also
    with a silence timeout shorter than a third of the lease (probes come sooner); in
    either reply form."""
    engine = rig.engine(replay_frames=frames)
    source = rig.source(engine)
    ns = source.namespace
    bridge = rig.bridge([source], [engine], lease_ttl=3.6, silence_timeout=1.0)
    registry = PrefixCacheRegistry(client, ns)
    tokens = prompt(81, 2, BS)
    hashes = engine_chain(tokens, BS)
    seq = engine.publish([stored(hashes, None, tokens, BS)])
    wait_applied(client, ns, seq, bridge)
    renewals = counts(bridge, ns)["renewals"]
    wait_count(bridge, ns, "probes", 5)  # past the silence timeout
    wait_count(bridge, ns, "renewals", renewals + 1)
    c = counts(bridge, ns)
    assert (c["silent"], c["gaps"], c["restarts"], c["replay_failures"]) == (0, 0, 0, 0), c
    assert registry.info().state == "live"
    assert engine.replay_requests[0] == 0
    # Probes ask from the batch applied last: its being there proves the same engine.
    assert engine.replay_requests[1:] == [seq] * (len(engine.replay_requests) - 1)
    # A probe finds what the subscription lost, and applies it.
    seq = engine.publish([removed(hashes[1:])], send=False)
    wait_applied(client, ns, seq, bridge)
    assert kv(client, ns) == listed((tokens, 1))
    # An engine that stops answering probes falls silent (no renewals) ...
    engine.answer_replays = False
    wait_count(bridge, ns, "silent", 1)
    # ... and is heard again once it answers: renewals go on, nothing restarts.
    renewals = counts(bridge, ns)["renewals"]
    engine.answer_replays = True
    wait_count(bridge, ns, "renewals", renewals + 1)
    assert registry.info().state == "live"
    c = counts(bridge, ns)
    assert (c["silent"], c["gaps"], c["restarts"], c["replay_failures"]) == (1, 0, 0, 0), c
    alive(bridge)


# == 13. bad arguments ======================================================================


def test_engine_source_refuses_bad_arguments() -> None:
    ok = "tcp://127.0.0.1:5557"
    cases: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({"namespace": 5}, TypeError, "namespace must be a str"),
        ({"namespace": ""}, ValueError, "namespace must not be empty"),
        ({"namespace": "a{b}"}, ValueError, "hash-tag"),
        ({"endpoint": None}, TypeError, "endpoint must be a str"),
        ({"endpoint": b"tcp://h:1"}, TypeError, "endpoint must be a str"),
        ({"endpoint": "http://h:1"}, ValueError, "ZeroMQ endpoint"),
        ({"endpoint": "tcp://h :1"}, ValueError, "ZeroMQ endpoint"),
        ({"endpoint": "tcp://"}, ValueError, "ZeroMQ endpoint"),
        ({"endpoint": "tcp://127.0.0.1"}, ValueError, "ZeroMQ endpoint"),
        ({"endpoint": "tcp://127.0.0.1:port"}, ValueError, "ZeroMQ endpoint"),
        ({"endpoint": "tcp://127.0.0.1:70000"}, ValueError, "ZeroMQ endpoint"),
        ({"endpoint": "ipc://"}, ValueError, "ZeroMQ endpoint"),
        ({"endpoint": "tcp://h:1" + "1" * 600}, ValueError, "ZeroMQ endpoint"),
        ({"replay_endpoint": 5558}, TypeError, "replay endpoint must be a str"),
        ({"replay_endpoint": "udp://h:1"}, ValueError, "replay endpoint"),
        ({"engine": "tgi"}, ValueError, "engine must be one of vllm, sglang"),
        ({"engine": None}, ValueError, "engine must be one of"),
        ({"topic": 5}, TypeError, "topic must be a str"),
        ({"topic": "t" * 501}, ValueError, "topic"),
        ({"block_size": 0}, ValueError, "block_size must be an int"),
        ({"block_size": True}, ValueError, "block_size must be an int"),
        ({"block_size": 16.0}, ValueError, "block_size must be an int"),
        ({"block_size": 2**21}, ValueError, "block_size must be an int"),
        ({"media": "GPU"}, ValueError, "media must be a tuple"),
        ({"media": ["GPU"]}, ValueError, "media must be a tuple"),
        ({"media": ()}, ValueError, "media must be a tuple"),
        ({"media": ("GPU", "GPU")}, ValueError, "distinct"),
        ({"media": ("GPU", "")}, ValueError, "media must be a tuple"),
        ({"media": ("GPU", 1)}, ValueError, "media must be a tuple"),
        ({"media": tuple(f"M{i}" for i in range(9))}, ValueError, "1 to 8"),
    ]
    for change, error, text in cases:
        arguments: dict[str, Any] = {"namespace": "ns", "endpoint": ok, **change}
        with pytest.raises(error, match=text):
            EngineSource(**arguments)
    for endpoint in ("tcp://127.0.0.1:5557", "tcp://[::1]:5557", "tcp://engine-0:1",
                     "ipc:///tmp/kv-events", "inproc://events"):  # fmt: skip
        assert EngineSource("ns", endpoint, endpoint).endpoint == endpoint


def test_bridge_refuses_bad_arguments() -> None:
    client = redis.Redis(port=1)  # never connected
    source = EngineSource("ns-a", "tcp://127.0.0.1:5557")
    other = EngineSource("ns-a", "tcp://127.0.0.1:5558")
    cases: list[tuple[Any, dict[str, Any], type[Exception], str]] = [
        (source, {}, TypeError, "sources must be a non-empty list of EngineSource"),
        ([], {}, TypeError, "non-empty list"),
        (None, {}, TypeError, "non-empty list"),
        ("ns-a", {}, TypeError, "sources must hold EngineSource, not str"),
        ([source, "ns-b"], {}, TypeError, "sources must hold EngineSource, not str"),
        ([source, other], {}, ValueError, "namespace of its own"),
        ([source], {"lease_ttl": 0}, ValueError, "lease_ttl"),
        ([source], {"lease_ttl": "10"}, TypeError, "lease_ttl"),
        ([source], {"silence_timeout": -1}, ValueError, "silence_timeout"),
        ([source], {"silence_timeout": float("nan")}, ValueError, "silence_timeout"),
        ([source], {"replay_timeout": 0}, ValueError, "replay_timeout"),
        ([source], {"replay_timeout": None}, TypeError, "replay_timeout"),
        ([source], {"poll_interval": 0}, ValueError, "poll_interval"),
        ([source], {"poll_interval": True}, TypeError, "poll_interval"),
        ([source], {"receive_hwm": 0}, ValueError, "receive_hwm must be a positive int"),
        ([source], {"receive_hwm": 1.5}, ValueError, "receive_hwm must be a positive int"),
        ([source], {"key_prefix": "a b"}, ValueError, "key_prefix"),
    ]
    for sources, options, error, text in cases:
        with pytest.raises(error, match=text):
            Bridge(client, sources, **options)
    with pytest.raises(TypeError, match="redis-py style client"):
        Bridge(object(), [source])
    bridge = Bridge(client, [source], lease_ttl=1, silence_timeout=2.5, poll_interval=0.01)
    assert bridge.followers[0].lease_ttl == 1.0
    assert bridge.counts() == {"ns-a": bridge.followers[0].counts.as_dict()}
    client.close()


# == 14. Redis Cluster ======================================================================


def test_a_bridged_namespace_on_a_real_cluster(redis_cluster: Any) -> None:
    cluster = redis_cluster.client()
    rig = Rig(cluster)
    try:
        e1, e2 = rig.engine(), rig.engine()
        s1, s2 = rig.source(e1), rig.source(e2)
        bridge = rig.bridge([s1, s2], [e1, e2])
        tokens = prompt(90, 5, BS)
        h1, h2 = engine_chain(tokens, BS, seed=b"c1"), engine_chain(tokens, BS, seed=b"c2")
        e1.publish([stored(h1[:2], None, tokens[: 2 * BS], BS)])
        e1.publish([stored(h1[2:], h1[1], tokens[2 * BS :], BS)], send=False)  # replayed
        q1 = e1.publish([removed(h1[4:])])
        q2 = e2.publish(
            [
                stored(h2, None, tokens, BS, group_idx=0, kind="full_attention"),
                stored(h2[2:3], h2[1], tokens[2 * BS : 3 * BS], BS, group_idx=1, kind="mamba"),
            ]
        )
        wait_applied(cluster, s1.namespace, q1, bridge)
        wait_applied(cluster, s2.namespace, q2, bridge)
        assert kv(cluster, s1.namespace) == listed((tokens, 4))
        assert kv(cluster, s2.namespace) == listed((tokens, 5))
        assert mamba(cluster, s2.namespace) == {own(tokens)[2]: 2}
        scores = PrefixRouter(cluster, live_cache_ttl=0).score(own(tokens))
        # The default router ranks each by what its engine reuses: the attention-only
        # engine by its KV prefix, the hybrid one by its Mamba-aware prefix.
        assert scores[s1.namespace] == NodeScore(s1.namespace, 4, 0, 4)
        assert scores[s2.namespace] == NodeScore(s2.namespace, 5, 3, 3)
        assert counts(bridge, s1.namespace)["gaps"] == 1
        for ns in (s1.namespace, s2.namespace):
            assert_quiet(bridge, ns, "gaps")
        alive(bridge)
    finally:
        rig.close()
        cluster.close()


def test_a_bug_in_one_follower_restarts_its_namespace_not_the_bridge(
    rig: Rig, client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unexpected error inside one engine's follower (a bug, not bad input) is logged
    and counted; that namespace restarts, the other engines never notice."""
    e1, e2 = rig.engine(), rig.engine()
    s1, s2 = rig.source(e1), rig.source(e2)
    bridge = rig.bridge([s1, s2], [e1, e2])
    broken = next(f for f in bridge.followers if f.source.namespace == s1.namespace)
    tokens = prompt(61, 3, BS)
    hashes = engine_chain(tokens, BS)
    original = broken._operations

    def failing(batch: Any) -> Any:
        raise KeyError("a bug")

    monkeypatch.setattr(broken, "_operations", failing)
    e1.publish([stored(hashes, None, tokens, BS)])
    q2 = e2.publish([stored(hashes, None, tokens, BS)])
    wait_count(bridge, s1.namespace, "internal_errors", 1)
    wait_applied(client, s2.namespace, q2, bridge)
    assert kv(client, s2.namespace) == listed((tokens, 3))
    monkeypatch.setattr(broken, "_operations", original)
    wait_count(bridge, s1.namespace, "restarts", 1)
    q1 = e1.publish([stored(hashes[:2], None, tokens[: 2 * BS], BS)])
    wait_applied(client, s1.namespace, q1, bridge)
    assert kv(client, s1.namespace) == listed((tokens, 3))  # the replay brought seq 0 back
    alive(bridge)
