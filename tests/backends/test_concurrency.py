"""Threads race register, evict and match on one namespace of a real Redis.

Redis runs one script at a time, so the races must be equivalent to some serial
order. MONITOR records the order in which the server ran the scripts; replaying the
recorded calls in that order on the in-memory reference must give every thread's
results and callbacks, and the final state."""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field
from typing import Any

import redis

from registry import LocalPrefixCacheRegistry, PrefixCacheRegistry
from tests.support.backends import new_namespace, registry_state
from tests.support.servers import RedisServer

THREADS = 4
OPS_PER_THREAD = 250
STOP_WORD = "concurrency-test-done"


@dataclass
class Call:
    method: str
    args: tuple[Any, ...]
    result: Any
    fired: list[list[int]]


@dataclass
class Worker:
    registry: PrefixCacheRegistry
    address: str
    calls: list[Call] = field(default_factory=list)
    fired: list[list[int]] = field(default_factory=list)

    def run(self, seed: int, chains: list[list[int]]) -> None:
        rng = random.Random(seed)
        self.registry.set_mamba_evict_callback(self.fired.append)
        for _ in range(OPS_PER_THREAD):
            chain = rng.choice(chains)
            cut = rng.randint(1, len(chain))
            method = rng.choice(
                [
                    "register_kv",
                    "register_kv",
                    "match_kv_prefix",
                    "match_kv_prefix",
                    "evict_kv",
                    "register_mamba",
                    "evict_mamba",
                    "match_mamba_farthest",
                ]
            )
            if method in ("register_kv", "register_mamba"):
                ids = [rng.randint(0, 50) for _ in chain[:cut]]
                args: tuple[Any, ...] = (ids, chain[:cut])
            elif method in ("evict_kv", "evict_mamba"):
                args = (rng.sample(chain, rng.randint(1, 3)),)
            else:
                args = (chain,)
            before = len(self.fired)
            result = getattr(self.registry, method)(*args)
            self.calls.append(Call(method, args, result, self.fired[before:]))


def test_racing_threads_equal_a_serial_replay(redis_server: RedisServer) -> None:
    namespace = new_namespace()
    rng = random.Random(1234)
    chains = [[rng.randint(1, 2**63 - 1) for _ in range(8)] for _ in range(6)]
    workers: list[Worker] = []
    clients: list[redis.Redis] = []
    for _ in range(THREADS):
        client = redis.Redis(port=redis_server.port, single_connection_client=True)
        clients.append(client)
        registry = PrefixCacheRegistry(client, namespace)
        registry.load_scripts()  # no NOSCRIPT retry may blur the MONITOR log
        workers.append(Worker(registry, client.client_info()["addr"]))

    monitor_client = redis_server.client()
    try:
        log = record_race(workers, chains, clients[0], monitor_client)
    finally:
        for client in [*clients, monitor_client]:
            client.close()
    check_against_serial_replay(workers, log)


def record_race(
    workers: list[Worker],
    chains: list[list[int]],
    any_client: redis.Redis,
    monitor_client: redis.Redis,
) -> list[dict[str, Any]]:
    """Run the workers at once; return the server's log of their calls, in order."""
    log: list[dict[str, Any]] = []
    with monitor_client.monitor() as monitor:
        threads = [
            threading.Thread(target=w.run, args=(seed, chains)) for seed, w in enumerate(workers)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads)
        any_client.echo(STOP_WORD)
        for entry in monitor.listen():
            if STOP_WORD in entry["command"]:
                break
            command = entry["command"]
            if entry.get("client_type") != "lua" and command.startswith(("EVALSHA", "HMGET")):
                log.append(entry)  # writes are scripts; reads are one HMGET
    return log


def check_against_serial_replay(workers: list[Worker], log: list[dict[str, Any]]) -> None:
    """Replay ``log`` on the in-memory reference; every result must be the recorded one."""
    # Replay on the reference in the server's order, checking each recorded result.
    model = LocalPrefixCacheRegistry()
    model_fired: list[list[int]] = []
    model.set_mamba_evict_callback(model_fired.append)
    pending = {w.address: iter(w.calls) for w in workers}
    matches = 0
    for entry in log:
        call = next(pending[f"{entry['client_address']}:{entry['client_port']}"])
        before = len(model_fired)
        expected = getattr(model, call.method)(*call.args)
        assert call.result == expected, f"{call.method}{call.args}"
        assert call.fired == model_fired[before:], f"callback of {call.method}{call.args}"
        if call.method == "match_kv_prefix":
            matches += 1
            block_ids, parent = call.result
            # No hole: the returned ids are exactly those of the leading hashes.
            assert parent == (call.args[0][len(block_ids) - 1] if block_ids else 0)
    assert all(next(calls, None) is None for calls in pending.values()), "unlogged calls"
    assert len(log) == THREADS * OPS_PER_THREAD
    assert matches > 100
    assert registry_state(workers[0].registry) == registry_state(model)
    assert model.kv  # the race left something behind to compare
