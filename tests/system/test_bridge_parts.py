"""A batch too large for one ``bridge_apply`` call is written in parts (issue 43), and
the parts keep the bridge's exactly-once rule on a real redis-server: a part sent again
changes nothing, and a bridge that stopped in the middle of a batch, given the batch
again, writes only the blocks that were missing, so that copies are never counted twice.
"""

from __future__ import annotations

import hashlib
import random
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from registry import PrefixCacheRegistry
from registry.bridge.counts import FollowerCounts
from registry.bridge.source import EngineSource
from registry.bridge.writes import MAX_BLOCKS_PER_WRITE, PendingWrite, split_operations
from registry.core.hashing import digest_hash
from tests.support.servers import RedisServer

BLOCKS = 2 * MAX_BLOCKS_PER_WRITE + 100


def store(n: int, seed: int = 1) -> list[Any]:
    """One STORE operation of ``n`` blocks, as ``registry.bridge.chain`` builds it."""
    rng = random.Random(seed)
    engines = [rng.getrandbits(63) for _ in range(n)]
    digests = [hashlib.sha256(b"%d" % h).digest() for h in engines]
    return [
        "S", 1, "k", 0, n,
        b"".join(b"%020d" % h for h in engines),
        b"".join(b"%019d" % digest_hash(d) for d in digests),
        b"".join(digests).hex(),
    ]  # fmt: skip


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    c = redis_server.client()
    try:
        yield c
    finally:
        c.close()


def writer(client: Any, name: str) -> PendingWrite:
    registry = PrefixCacheRegistry(client, name)
    registry.claim(60.0)
    return PendingWrite(registry, EngineSource(name, "tcp://127.0.0.1:5557"), FollowerCounts())


def flush(pending: PendingWrite) -> list[tuple[int | None, int | None, int]]:
    """Write every waiting call; (seq, part, blocks) of each."""
    sent = []
    calls = [*pending.queued]
    if pending.ops or pending.seq is not None:
        calls.append(type(calls[0])(pending.ops, pending.blocks, pending.seq, pending.part))
    for call in calls:
        pending.apply(call.ops, call.seq, 4, (), call.part)
        sent.append((call.seq, call.part, call.blocks))
    pending.clear()
    return sent


def state(client: Any, name: str) -> tuple[dict[bytes, bytes], dict[bytes, bytes]]:
    return client.hgetall(f"pcr:{{{name}}}:kv"), client.hgetall(f"pcr:{{{name}}}:engine-blocks")


def test_split_operations_cut_stores_at_the_limit() -> None:
    op = store(BLOCKS)
    runs = list(split_operations(["C", *op, "R", 1, 1, b"%020d" % 5], MAX_BLOCKS_PER_WRITE))
    assert [n for _, n in runs] == [MAX_BLOCKS_PER_WRITE, MAX_BLOCKS_PER_WRITE, 101]
    assert runs[0][0][0] == "C"
    assert runs[1][0][3] == MAX_BLOCKS_PER_WRITE
    stores = [run[run.index("S") :] for run, _ in runs]
    assert b"".join(s[5] for s in stores) == op[5]  # the hashes, in order
    assert runs[2][0][-4:] == ["R", 1, 1, b"%020d" % 5]


def test_parts_apply_once_and_a_resumed_batch_writes_only_what_is_missing(client: Any) -> None:
    whole, split, resumed = (f"parts-{uuid.uuid4().hex[:8]}" for _ in range(3))
    op = store(BLOCKS)

    reference = writer(client, whole)  # the batch in one call, as before (no limit)
    reference.apply(op, 0, 4)

    pending = writer(client, split)
    pending.add(op, BLOCKS, 0)
    sent = flush(pending)
    assert [(s, p) for s, p, _ in sent] == [
        (0, MAX_BLOCKS_PER_WRITE),
        (0, 2 * MAX_BLOCKS_PER_WRITE),
        (0, None),
    ]
    assert max(n for _, _, n in sent) <= MAX_BLOCKS_PER_WRITE
    assert state(client, split) == state(client, whole)
    before = state(client, split)
    pending.add(op, BLOCKS, 0)  # every part sent again: nothing changes
    flush(pending)
    assert state(client, split) == before

    # A bridge stops after the first part; the next one is given the batch again.
    first = writer(client, resumed)
    first.add(op, BLOCKS, 0)
    call = first.queued[0]
    first.apply(call.ops, call.seq, 4, (), call.part)
    assert client.hget(f"pcr:{{{resumed}}}:meta", "bridge_part") == b"%d" % MAX_BLOCKS_PER_WRITE
    again = PendingWrite(first.registry, first.source, FollowerCounts())
    again.resume_after(0, MAX_BLOCKS_PER_WRITE)
    again.add(op, BLOCKS, 0)
    assert sum(n for _, _, n in flush(again)) == BLOCKS - MAX_BLOCKS_PER_WRITE
    assert state(client, resumed) == state(client, whole)  # no block stored twice
    assert client.hget(f"pcr:{{{resumed}}}:meta", "bridge_part") is None
