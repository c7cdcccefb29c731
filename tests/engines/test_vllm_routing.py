"""Routing two bridged vLLM engines (attention-only: a Llama) by the registry, against
round-robin, on the engines' own hit counters; and how soon a published batch is
visible in Redis.

Workload: 12 conversations of 5 turns, sent one request at a time in a random order
(each conversation's turns in order), each turn extending the previous prompt by an
answer and a new message; each engine caches 64 blocks of 32
tokens (2,048 tokens), less than the conversations need, so engines evict. Both
policies run on the same engines with their caches reset in between. The default
``PrefixRouter`` ranks these attention-only namespaces by their KV prefixes (they never
held Mamba state) and breaks ties by the requests each engine was sent so far.

The hit rates and the lag are printed (``-s``); the test asserts only that the default
router beats round-robin, as it must when the engines hold different conversations.
"""

from __future__ import annotations

import random
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from registry import NodeIndex, PrefixCacheRegistry, PrefixRouter, block_hashes
from tests.engines.conftest import BridgeProcess
from tests.support.engines import BLOCK_SIZE, VllmEngine
from tests.support.servers import RedisServer
from tests.support.waiting import wait_until

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")

WAIT = 120.0
CONVERSATIONS, TURNS = 12, 5


def tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(4, 512) for _ in range(count)]


def workload(seed: int = 3) -> list[list[int]]:
    """The prompts in the order they are sent: each step a random conversation's next
    turn (its turns stay in order)."""
    rng = random.Random(seed)
    talks = [tokens(rng, rng.randrange(64, 160)) for _ in range(CONVERSATIONS)]
    order = [c for c in range(CONVERSATIONS) for _turn in range(TURNS)]
    rng.shuffle(order)
    prompts = []
    for c in order:
        prompts.append(list(talks[c]))
        talks[c] = talks[c] + tokens(rng, rng.randrange(24, 64))
    return prompts


@pytest.fixture
def bridged(
    engines: list[VllmEngine], redis_server: RedisServer, log_dir: Path
) -> Iterator[tuple[redis.Redis, list[str]]]:
    client = redis_server.client()
    names = [f"route-{e.name}-{uuid.uuid4().hex[:6]}" for e in engines]
    bridge = BridgeProcess(redis_server.url, log_dir)
    try:
        bridge.start(list(zip(engines, names, strict=True)))
        wait_until(lambda: set(names) <= set(NodeIndex(client).live()), WAIT, "bridged")
        yield client, names
    finally:
        bridge.stop()
        client.close()


def run(
    engines: list[VllmEngine],
    client: redis.Redis,
    names: list[str],
    choose: Callable[[list[int], list[int]], int],
) -> tuple[float, list[int]]:
    """Send the workload, each prompt to ``choose(prompt, sent so far)``; the engines'
    hit rate (their counters) and the requests each got. Each request waits until its
    engine's namespace lists its blocks, so the next choice sees it."""
    for engine in engines:
        engine.reset_prefix_cache()
    before = [e.counters() for e in engines]
    sent = [0] * len(engines)
    for prompt in workload():
        i = choose(prompt, sent)
        engines[i].complete(prompt)
        sent[i] += 1
        registry = PrefixCacheRegistry(client, names[i])
        full = len(prompt) // BLOCK_SIZE
        hashes = block_hashes(prompt, BLOCK_SIZE)
        wait_until(
            lambda r=registry, h=hashes, f=full: len(r.match_kv_prefix(h)[0]) == f,
            WAIT,
            "the request's blocks listed",
        )
    after = [e.counters() for e in engines]
    queries = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    hits = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    return hits / queries, sent


def test_the_default_router_beats_round_robin_on_two_engines(
    engines: list[VllmEngine], bridged: tuple[redis.Redis, list[str]]
) -> None:
    client, names = bridged
    router = PrefixRouter(client, live_cache_ttl=0)
    turn = iter(range(10**6))

    def round_robin(_prompt: list[int], _sent: list[int]) -> int:
        return next(turn) % len(engines)

    def default_router(prompt: list[int], sent: list[int]) -> int:
        load = {n: float(s) for n, s in zip(names, sent, strict=True)}
        best = router.best(block_hashes(prompt, BLOCK_SIZE), load=load, namespaces=names)
        assert best is not None
        return names.index(best)

    rr_rate, rr_sent = run(engines, client, names, round_robin)
    prefix_rate, prefix_sent = run(engines, client, names, default_router)
    print(
        f"\n{CONVERSATIONS} conversations x {TURNS} turns, one at a time, 2 engines x "
        f"{64 * BLOCK_SIZE} tokens: round-robin {rr_rate:.1%} {rr_sent}, "
        f"default PrefixRouter {prefix_rate:.1%} {prefix_sent}"
    )
    assert prefix_rate > rr_rate


def test_publish_to_visible_lag(
    engines: list[VllmEngine], bridged: tuple[redis.Redis, list[str]]
) -> None:
    """From the engine's publish time (the batch's ``ts``) to the batch applied in Redis
    (``bridge_seq``), for 30 requests: printed, not asserted (a busy machine stretches it)."""
    client, names = bridged
    engine, namespace = engines[0], names[0]
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(engine.endpoint)
    meta = PrefixCacheRegistry(client, namespace).keys.meta
    rng = random.Random(5)
    lags: list[float] = []
    try:  # a batch sent before the SUB socket connected is not measured
        for i in range(30):
            engine.complete(tokens(rng, 96 + i))
            while sub.poll(2000, zmq.POLLIN):
                _topic, seq_raw, payload = sub.recv_multipart()
                seq = int.from_bytes(seq_raw, "big")
                published = msgpack.unpackb(payload, raw=False, strict_map_key=False)
                ts = published["ts"] if isinstance(published, dict) else published[0]
                while int(client.hget(meta, "bridge_seq") or -1) < seq:
                    time.sleep(0.0005)  # measuring: poll Redis as fast as it is useful
                lags.append(time.time() - ts)
                if not sub.poll(50, zmq.POLLIN):
                    break
    finally:
        sub.close(0)
    assert lags
    print(
        f"\npublish -> visible in Redis over {len(lags)} batches: p50 "
        f"{statistics.median(lags) * 1000:.1f} ms, max {max(lags) * 1000:.1f} ms"
    )
