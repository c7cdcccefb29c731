"""Soak: several processes run the engine cycle against one real redis-server for a
bounded time, each on its own namespace and then all on one namespace. Every result is
checked against an in-memory mirror as it happens; at the end Redis holds exactly the
union of the mirrors, nothing failed, and the server's memory did not keep growing."""

from __future__ import annotations

import multiprocessing
import os
import random
import time
from collections import OrderedDict
from typing import Any

import pytest

from registry import LocalPrefixCacheRegistry, PrefixCacheRegistry
from tests.support.backends import new_namespace, registry_state
from tests.support.servers import RedisServer

PROCESSES = 4
SECONDS = float(os.environ.get("SOAK_SECONDS", "3"))  # per mode; SOAK_SECONDS=60 for longer
CAPACITY = 2_000  # KV entries each process keeps at most
MIN_OPERATIONS = 100  # engine cycles each process runs at least


def engine(url: str, namespace: str, worker: int, seconds: float, out: Any) -> None:
    """One serving process: match, evict to stay under capacity, register KV and Mamba,
    sometimes evict Mamba; every reply must equal the mirror's."""
    rng = random.Random(worker)
    # Reply records live reply_ttl (30 s by default, longer than a soak): with the
    # shortest TTL their memory levels off within a second, so growth would show.
    reg = PrefixCacheRegistry.from_url(url, namespace, notice_stream_maxlen=500, reply_ttl=1)
    mirror = LocalPrefixCacheRegistry()
    lru: OrderedDict[int, None] = OrderedDict()
    base = (worker + 1) * 10**15  # this process's own hash and block-id ranges
    prefixes = [[base + p * 10_000 + i for i in range(rng.randint(4, 40))] for p in range(50)]
    operations = mismatches = 0
    deadline = time.monotonic() + seconds
    next_id = base
    # At least MIN_OPERATIONS whatever the machine's load: a busy machine runs longer.
    while time.monotonic() < deadline or operations < MIN_OPERATIONS:
        prefix = rng.choice(prefixes)
        tail = [base + 5 * 10**8 + rng.randrange(10**8) for _ in range(rng.randint(0, 8))]
        chain = prefix + tail
        got, want = reg.match_kv_prefix(chain), mirror.match_kv_prefix(chain)
        mismatches += got != want
        matched = len(got[0])
        for h in chain[:matched]:
            lru.move_to_end(h)
        new = chain[matched:]
        if len(lru) + len(new) > CAPACITY:
            victims = [lru.popitem(last=False)[0] for _ in range(len(lru) + len(new) - CAPACITY)]
            mismatches += reg.evict_kv(victims) != mirror.evict_kv(victims)
        if new:
            ids = list(range(next_id, next_id + len(new)))
            next_id += len(new)
            reg.register_kv(ids, new)
            mirror.register_kv(ids, new)
            lru.update(dict.fromkeys(new))
            reg.register_mamba(ids[-1:], new[-1:])
            mirror.register_mamba(ids[-1:], new[-1:])
        if rng.random() < 0.1:
            mamba = rng.sample(chain, min(3, len(chain)))
            mismatches += reg.evict_mamba(mamba) != mirror.evict_mamba(mamba)
        operations += 1
    out.put((worker, operations, mismatches, mirror.kv, mirror.mamba))
    reg.client.close()


def run_processes(server: RedisServer, namespaces: list[str]) -> list[tuple[Any, ...]]:
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    workers = [
        context.Process(target=engine, args=(server.url, ns, i, SECONDS, queue))
        for i, ns in enumerate(namespaces)
    ]
    for worker in workers:
        worker.start()
    results = [queue.get(timeout=SECONDS + 300) for _ in workers]
    for worker in workers:
        worker.join(30)
        assert worker.exitcode == 0
    return sorted(results)


def used_memory(server: RedisServer) -> int:
    client = server.client()
    try:
        return int(client.info("memory")["used_memory"])
    finally:
        client.close()


@pytest.mark.parametrize("shared", [False, True], ids=["namespace-each", "one-namespace"])
def test_soak(redis_server: RedisServer, shared: bool) -> None:
    one = new_namespace()
    namespaces = [one if shared else new_namespace() for _ in range(PROCESSES)]
    memory = [used_memory(redis_server)]
    sampler_stop = time.monotonic() + SECONDS
    results: list[tuple[Any, ...]] = []
    import threading

    def sample() -> None:
        while time.monotonic() < sampler_stop:
            time.sleep(SECONDS / 10)
            memory.append(used_memory(redis_server))

    sampler = threading.Thread(target=sample)
    sampler.start()
    results = run_processes(redis_server, namespaces)
    sampler.join()
    assert all(r[1] >= MIN_OPERATIONS for r in results)  # it really ran
    assert [r[2] for r in results] == [0] * PROCESSES  # every reply matched the mirror
    client = redis_server.client()
    try:
        expected_kv: dict[int, int] = {}
        expected_mamba: dict[int, int] = {}
        for _, _, _, kv, mamba in results:
            expected_kv.update(kv)
            expected_mamba.update(mamba)
        actual_kv: dict[int, int] = {}
        actual_mamba: dict[int, int] = {}
        for namespace in set(namespaces):
            kv, mamba = registry_state(PrefixCacheRegistry(client, namespace))
            actual_kv.update(kv)
            actual_mamba.update(mamba)
        assert actual_kv == expected_kv
        assert actual_mamba == expected_mamba
    finally:
        client.close()
    # Bounded state: once the caches are full, memory stays flat (the stream is capped).
    warm = memory[len(memory) // 2]
    assert max(memory[len(memory) // 2 :]) < warm * 1.25 + 2_000_000, memory
    print(
        f"\nsoak ({'one namespace' if shared else 'a namespace each'}): "
        f"{sum(r[1] for r in results)} engine cycles by {PROCESSES} processes in {SECONDS:.0f} s; "
        f"used_memory {memory[0] // 1024} KiB -> {warm // 1024} KiB (half-way) -> "
        f"{memory[-1] // 1024} KiB"
    )
