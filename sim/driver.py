"""The routing loop both kinds of fleet share (``sim.fleet``'s nodes that write the
registry themselves, ``sim.bridged``'s engines that ``pcr bridge`` follows): route and
serve the workload, round-robin or by prefix (``PrefixRouter.best`` from a fleet view
kept in lockstep with the writes), and the figures every run reports.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any, Protocol

from registry import PrefixRouter, RegistryUnavailable, block_hashes
from registry.fleet.view import FleetView
from sim.config import FleetConfig
from sim.node import Totals
from sim.timings import Timings
from sim.workload import Request, Workload


class Servable(Protocol):
    """What the routing loop needs of a node."""

    @property
    def namespace(self) -> str: ...

    def heal(self, totals: Totals) -> None: ...

    def serve(self, request: Request, totals: Totals) -> None: ...


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


def _ratio(part: int, whole: int) -> float:
    return round(part / whole, 4) if whole else 0.0
