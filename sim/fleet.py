"""A simulated fleet of serving nodes sharing prefix-cache state through Redis.

Each node owns a namespace (``claim``), a bounded KV block pool with reference counts
and leaf-first LRU eviction (a block whose descendants are cached is never evicted),
and a Mamba slot pool (small CPU tensors) with its eviction listener. Every request is
served the way a hybrid engine would: match the KV prefix, find the farthest Mamba
checkpoint inside it and restore it, evict to make room, register the new blocks, and
keep the Mamba state where the engine would (``sim.checkpoints``: as vLLM, at the
prompt's replay boundary and shared-prefix junctions, or at its last block). A router
sends each request to a node, round-robin or by prefix (``PrefixRouter.best`` from a
fleet view kept in lockstep with the writes). At the end the run checks that the pools
and the registry agree (``sim.audit``).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from registry import MirroredRegistry
from sim.config import ROUTERS, BridgeConfig, FleetConfig, check_bridge_config, check_fleet_config
from sim.driver import drive, figures, router_tag
from sim.node import Node, Totals
from sim.timings import Timings


def simulate(
    client: Any,
    config: FleetConfig,
    router: str,
    *,
    progress: Callable[[int, int], None] | None = None,
    bridge: BridgeConfig | None = None,
) -> dict[str, Any]:
    """Run the workload through a fleet routed by ``router``; return the figures.

    With ``bridge`` the nodes write nothing to Redis: each publishes engine KV events and
    one ``pcr bridge`` follows them into their namespaces (``sim.bridged``; needs the
    ``bridge`` extra)."""
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {', '.join(ROUTERS)}, not {router!r}")
    check_fleet_config(config)
    if bridge is not None:
        check_bridge_config(bridge)
        from sim.bridged import simulate_bridged  # pyzmq and msgpack: the bridge extra

        return simulate_bridged(client, config, router, bridge, progress=progress)
    timings = Timings()
    tag = router_tag(router) + ("-mirror" if config.mirror else "")
    nodes = [Node(client, f"sim-{tag}-node-{i}", config, timings) for i in range(config.nodes)]
    totals = Totals()
    try:
        assigned, route_fallbacks, elapsed = drive(
            client, config, router, nodes, timings, totals, progress
        )
        consistency = _settle(nodes)
    finally:
        for node in nodes:
            node.close()
    listener_counts = [asdict(n.listener.counts()) for n in nodes if n.listener is not None]
    pool_counts = [asdict(n.mamba.counts()) for n in nodes]
    result = {
        **figures(router, config, totals, assigned, route_fallbacks, timings),
        "consistency": consistency,
        "mamba": {key: sum(c[key] for c in pool_counts) for key in pool_counts[0]},
        "listener": {
            key: sum(c[key] for c in listener_counts)
            for key in (listener_counts[0] if listener_counts else ())
        },
        "seconds": round(elapsed, 3),
    }
    if config.mirror:
        mirror_counts = [
            asdict(n.registry.counts()) for n in nodes if isinstance(n.registry, MirroredRegistry)
        ]
        keys = ("flushed", "batches", "retries", "dropped", "resyncs", "errors")
        result["mirrored"] = True
        result["mirror"] = {key: sum(c[key] for c in mirror_counts) for key in keys}
    return result


def _settle(nodes: list[Node], timeout: float = 10.0) -> dict[str, int]:
    """Let every listener catch up, then sum the disagreements (they must be 0)."""
    deadline = time.monotonic() + timeout
    while True:
        caught_up = all(
            n.listener is None or n.listener.counts().last_seq >= n.registry.notice_sequence()
            for n in nodes
        )
        if caught_up or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    total: dict[str, int] = defaultdict(int)
    for node in nodes:
        for key, value in node.consistency().items():
            total[key] += value
    return dict(total)
