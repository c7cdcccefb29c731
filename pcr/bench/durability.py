"""``pcr bench --durability``: what ``wait_replicas=1`` costs a write, side by side on the
same servers: a primary with one replica, and a 3-master cluster with one replica each
(servers of its own on loopback). One owner registers a prompt's blocks and evicts them
again, alternating with and without the option, so both see the same server state."""

from __future__ import annotations

import statistics
import time
from typing import Any

from pcr.servers import RedisClusterServers, RedisServer
from registry import PrefixCacheRegistry
from registry.transport.client import client_from_url

BLOCKS = 64
"""Hashes per write: a 1,024-token prompt at 16 tokens per block."""


def _timed_writes(registry: PrefixCacheRegistry, rounds: int, first_hash: int) -> list[float]:
    """Microseconds per ``register_kv`` of ``BLOCKS`` hashes, each followed (untimed) by
    its eviction, so every timed write adds the same entries."""
    hashes = list(range(first_hash, first_hash + BLOCKS))
    ids = list(range(BLOCKS))
    took: list[float] = []
    for _ in range(rounds):
        started = time.perf_counter_ns()
        registry.register_kv(ids, hashes)
        took.append((time.perf_counter_ns() - started) / 1e3)
        registry.evict_kv(hashes)
    return took


def _side_by_side(url: str, cluster: bool, rounds: int) -> dict[str, Any]:
    """Median and p99 write time without and with ``wait_replicas=1``, same servers."""
    client = client_from_url(url, cluster=cluster, socket_timeout=5)
    plain = PrefixCacheRegistry(client, "bench-durability")
    durable = PrefixCacheRegistry(client, "bench-durability", wait_replicas=1, wait_timeout=1.0)
    plain.claim()
    durable.adopt_epoch(plain.epoch)
    results: dict[str, list[float]] = {"plain": [], "durable": []}
    try:
        _timed_writes(plain, 50, 10**9)  # warm-up
        _timed_writes(durable, 50, 10**9)
        for _ in range(10):  # alternate in blocks, so drift hits both alike
            results["plain"] += _timed_writes(plain, rounds // 10, 10**9)
            results["durable"] += _timed_writes(durable, rounds // 10, 10**9)
    finally:
        client.close()
    row: dict[str, Any] = {"blocks": BLOCKS, "writes": len(results["plain"])}
    for name, took in results.items():
        ordered = sorted(took)
        row[f"{name}_median_us"] = round(statistics.median(ordered), 1)
        row[f"{name}_p99_us"] = round(ordered[int(len(ordered) * 0.99) - 1], 1)
    row["median_ratio"] = round(row["durable_median_us"] / row["plain_median_us"], 2)
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
        f"register_kv of {BLOCKS} hashes, {report['rounds']} writes each way, "
        "without and with wait_replicas=1 (same servers, alternating):",
        f"{'deployment':<36}{'plain median':>14}{'durable median':>16}{'ratio':>7}"
        f"{'plain p99':>11}{'durable p99':>13}",
    ]
    for name, row in report.items():
        if not isinstance(row, dict):
            continue
        lines.append(
            f"{name:<36}{row['plain_median_us']:>11.1f} us{row['durable_median_us']:>13.1f} us"
            f"{row['median_ratio']:>6.2f}x{row['plain_p99_us']:>8.1f} us"
            f"{row['durable_p99_us']:>10.1f} us"
        )
    return "\n".join(lines)
