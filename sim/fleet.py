"""A simulated fleet of serving nodes sharing prefix-cache state through Redis.

Each node owns a namespace (``claim``), a bounded KV block pool with reference counts
and leaf-first LRU eviction (a block whose descendants are cached is never evicted),
and a Mamba slot pool (small CPU tensors) with its eviction listener. Every request is
served the way a hybrid engine would: match the KV prefix, find the farthest Mamba
checkpoint inside it and restore it, evict to make room, register the new blocks, and
checkpoint the Mamba state of the prompt's last block. A router sends each request to a
node, round-robin or by prefix (``PrefixRouter.best`` from a fleet view kept in
lockstep with the writes). At the end the run checks that
the pools and the registry agree (``sim.audit``).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any, Protocol

from registry import MirroredRegistry, PrefixRouter, RegistryUnavailable, block_hashes
from registry.fleet.view import FleetView
from sim.config import ROUTERS, BridgeConfig, FleetConfig, check_bridge_config, check_fleet_config
from sim.node import Node, Totals
from sim.timings import Timings
from sim.workload import Request, Workload


class Servable(Protocol):
    """What the routing loop needs of a node."""

    @property
    def namespace(self) -> str: ...

    def heal(self, totals: Totals) -> None: ...

    def serve(self, request: Request, totals: Totals) -> None: ...


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


def drive(
    client: Any,
    config: FleetConfig,
    router: str,
    nodes: Sequence[Servable],
    timings: Timings,
    totals: Totals,
    progress: Callable[[int, int], None] | None,
) -> tuple[dict[str, int], int, float]:
    """Route and serve the whole workload: requests per node, route fallbacks (Redis
    away: round-robin) and the seconds it took."""
    names = [n.namespace for n in nodes]
    by_name = dict(zip(names, nodes, strict=True))
    with contextlib.ExitStack() as stack:
        view = None
        if router == "prefix":
            # The router's fleet view, in lockstep: before each decision it has applied
            # the last request's writes (sync), as a router of a real fleet has within
            # about a millisecond.
            view = stack.enter_context(FleetView(client, config.key_prefix))
        prefix_router = PrefixRouter(client, config.key_prefix, view=view)
        assigned: dict[str, int] = dict.fromkeys(names, 0)
        route_fallbacks = 0
        served: str | None = None
        started = time.perf_counter()
        for request in Workload(config.workload):
            for node in nodes:
                node.heal(totals)
            target = names[request.number % len(names)]
            if view is not None:
                hashes = block_hashes(request.tokens, config.block_size)
                try:
                    with timings.timed("route (score all nodes)"):
                        if served is not None:
                            view.sync([served], live=False)
                        best = prefix_router.best(hashes, load=assigned, namespaces=names)
                    target = best or target
                except RegistryUnavailable:
                    route_fallbacks += 1  # round-robin while Redis is away
            assigned[target] += 1
            by_name[target].serve(request, totals)
            served = target
            if progress is not None:
                progress(request.number + 1, config.workload.requests)
        return assigned, route_fallbacks, time.perf_counter() - started


def figures(
    router: str,
    config: FleetConfig,
    totals: Totals,
    assigned: dict[str, int],
    route_fallbacks: int,
    timings: Timings,
) -> dict[str, Any]:
    """The figures every run reports."""
    return {
        "router": router,
        "nodes": config.nodes,
        "requests": totals.requests,
        "seed": config.workload.seed,
        "hit_rate_blocks": _ratio(totals.kv_hit_blocks, totals.prompt_blocks),
        "usable_hit_rate_blocks": _ratio(totals.usable_hit_blocks, totals.prompt_blocks),
        "hit_rate_tokens": _ratio(totals.prefill_tokens_saved, totals.prompt_tokens),
        "totals": asdict(totals),
        "requests_per_node": assigned,
        "route_fallbacks": route_fallbacks,
        "latency_ms": timings.summary(),
        "registry_us_per_request": _registry_us(timings, totals.requests),
    }


def _registry_us(timings: Timings, requests: int) -> float:
    """The time a node spent in its own registry calls (routing excluded), per request."""
    spent_ms = sum(sum(s) for op, s in timings.samples.items() if not op.startswith("route"))
    return round(spent_ms * 1000 / requests, 1) if requests else 0.0


def router_tag(router: str) -> str:
    """The router's part of its nodes' namespaces."""
    return "rr" if router == "round-robin" else router


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


def _ratio(part: int, whole: int) -> float:
    return round(part / whole, 4) if whole else 0.0
