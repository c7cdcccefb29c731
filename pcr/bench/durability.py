"""``pcr bench --durability``: what ``wait_replicas=1`` costs a write and a confirmed
read, side by side on the same servers: a primary with one replica, and a 3-master
cluster with one replica each (servers of its own on loopback). One owner registers a
prompt's blocks, matches the prompt and evicts the blocks again, alternating with and
without the option, so both see the same server state."""

from __future__ import annotations

import statistics
import time
from typing import Any

from pcr.bench.servers import RedisClusterServers, RedisServer
from registry import PrefixCacheRegistry
from registry.transport.client import client_from_url

BLOCKS = 64
"""Hashes per write: a 1,024-token prompt at 16 tokens per block."""


def _timed(registry: PrefixCacheRegistry, rounds: int, first_hash: int) -> dict[str, list[float]]:
    """Microseconds per ``register_kv`` of ``BLOCKS`` hashes and per ``match_kv_prefix``
    of them, each round ending (untimed) with their eviction, so every round starts from
    the same entries."""
    hashes = list(range(first_hash, first_hash + BLOCKS))
    ids = list(range(BLOCKS))
    took: dict[str, list[float]] = {"write": [], "read": []}
    for _ in range(rounds):
        started = time.perf_counter_ns()
        registry.register_kv(ids, hashes)
        written = time.perf_counter_ns()
        registry.match_kv_prefix(hashes)
        took["write"].append((written - started) / 1e3)
        took["read"].append((time.perf_counter_ns() - written) / 1e3)
        registry.evict_kv(hashes)
    return took


def _streamed(client: Any, key: str) -> None:
    """Wait until the primary of ``key`` streams to its replica (``WAIT`` after a write
    answers 1): a replica that says its link is up may not be acknowledged yet."""
    deadline = time.monotonic() + 30
    node = client.get_node_from_key(key) if hasattr(client, "get_node_from_key") else None
    target = client.get_redis_connection(node) if node is not None else client
    while True:
        pipe = target.pipeline(transaction=False)  # one connection: WAIT counts its write
        pipe.set(key, "1")
        pipe.execute_command("WAIT", 1, 100)
        if int(pipe.execute()[1]) >= 1:
            target.delete(key)
            return
        if time.monotonic() > deadline:
            raise RuntimeError("the bench's replica was not streamed to within 30 s")


def _side_by_side(url: str, cluster: bool, rounds: int) -> dict[str, Any]:
    """Median and p99 write and read times without and with ``wait_replicas=1``."""
    client = client_from_url(url, cluster=cluster, socket_timeout=5)
    plain = PrefixCacheRegistry(client, "bench-durability")
    durable = PrefixCacheRegistry(client, "bench-durability", wait_replicas=1, wait_timeout=1.0)
    _streamed(client, "bench-durability-probe:{bench-durability}")
    plain.claim()
    durable.adopt_epoch(plain.epoch)
    results: dict[str, dict[str, list[float]]] = {
        "plain": {"write": [], "read": []},
        "durable": {"write": [], "read": []},
    }
    try:
        _timed(plain, 50, 10**9)  # warm-up
        _timed(durable, 50, 10**9)
        for _ in range(10):  # alternate in blocks, so drift hits both alike
            for name, registry in (("plain", plain), ("durable", durable)):
                for kind, took in _timed(registry, rounds // 10, 10**9).items():
                    results[name][kind] += took
    finally:
        client.close()
    row: dict[str, Any] = {"blocks": BLOCKS, "rounds": len(results["plain"]["write"])}
    for kind in ("write", "read"):
        for name in ("plain", "durable"):
            ordered = sorted(results[name][kind])
            row[f"{kind}_{name}_median_us"] = round(statistics.median(ordered), 1)
            row[f"{kind}_{name}_p99_us"] = round(ordered[int(len(ordered) * 0.99) - 1], 1)
        row[f"{kind}_median_ratio"] = round(
            row[f"{kind}_durable_median_us"] / row[f"{kind}_plain_median_us"], 2
        )
    return row


def run(quick: bool = False) -> dict[str, Any]:
    """Both deployments' rows."""
    rounds = 200 if quick else 2_000
    report: dict[str, Any] = {"rounds": rounds}
    with (
        RedisServer() as primary,
        RedisServer(["--replicaof", "127.0.0.1", str(primary.port)]) as replica,
    ):
        probe = replica.client()
        deadline = time.monotonic() + 30
        while probe.info("replication").get("master_link_status") != "up":
            if time.monotonic() > deadline:
                raise RuntimeError("the bench's replica did not link to its primary in 30 s")
            time.sleep(0.01)
        probe.close()
        report["standalone, 1 replica"] = _side_by_side(primary.url, False, rounds)
    with RedisClusterServers(masters=3, replicas=1) as cluster:
        first = cluster.nodes[0]
        report["cluster 3 masters, 1 replica each"] = _side_by_side(
            f"redis://{first.host}:{first.port}", True, rounds
        )
    return report


def format_report(report: dict[str, Any]) -> str:
    """The figures as a table."""
    lines = [
        f"register_kv and match_kv_prefix of {BLOCKS} hashes, {report['rounds']} rounds "
        "each way, without and with wait_replicas=1 (same servers, alternating):",
        f"{'deployment':<36}{'call':<7}{'plain median':>14}{'durable median':>16}"
        f"{'ratio':>7}{'plain p99':>11}{'durable p99':>13}",
    ]
    for name, row in report.items():
        if not isinstance(row, dict):
            continue
        for kind in ("write", "read"):
            lines.append(
                f"{name:<36}{kind:<7}{row[f'{kind}_plain_median_us']:>11.1f} us"
                f"{row[f'{kind}_durable_median_us']:>13.1f} us"
                f"{row[f'{kind}_median_ratio']:>6.2f}x{row[f'{kind}_plain_p99_us']:>8.1f} us"
                f"{row[f'{kind}_durable_p99_us']:>10.1f} us"
            )
    return "\n".join(lines)
