"""``pcr bench --fleet``'s rows through Redis: one routing decision over a realistic fleet
of live namespaces, from the in-process fleet view and exactly (one ``lua/score.lua``
per namespace, the reference the view is checked against). The in-process rows beside
Dynamo's ``RadixTree`` are ``pcr.bench.view``'s.

**Data.** The realistic fleet of ``pcr.bench.view`` (each of N workers holds 16
conversations: one of 8 system prompts of 128 blocks by Zipf popularity, then its own
turns, cut by evictions; 64 prompts of 512 blocks continuing a conversation someone
holds or new), at N = 16, 64 and 256 live namespaces (16 and 64 with ``--quick``). Each
namespace is claimed by its owner (an hour's lease) and filled *through the registry*,
as a serving node fills it: one ``register_kv`` per conversation, block ids its
positions. The namespaces grow from one N to the next (a fleet of N is the first N
workers of the next one); ``setup_s`` is that fill's wall time. With ``--best-case``
the same rows again for the labelled best case (every namespace holding one chain of
4,096 blocks), under a key prefix of their own.

**Agreement.** A ``FleetView`` follows the fleet; once it has applied every write
(``sync``), each prompt is scored from the view and exactly over all N: the scores must
be equal (``agree``), or the run stops with an error.

**Client time** (one connection; rounds in which the view and the match take turns
call by call, so a stall weighs on them alike, and the exact path makes its calls of a
round in one go; each call takes the next prompt; p50 = median of the per-round
medians): ``PrefixRouter(client, prefix, view=view).score(prompt)`` over all N (memory
work: no round trip), ``PrefixRouter(client, prefix, exact=True).score(prompt)`` (one
``score.lua`` per namespace, one round trip per server, the live list fetched once and
kept), and one ``match_kv_prefix`` of the prompt on one namespace. Each ratio is
score p50 / match p50.

**Server CPU per decision, INFO commandstats.** ``CONFIG RESETSTAT`` on every primary,
K decisions, then ``usec`` summed over the primaries, / K (median of three batches), top
level commands only (Redis counts the commands a script calls both on their own and
inside its EVALSHA's time): the exact path's EVALSHA of ``score.lua`` per namespace, the
match's HMGET. The view sends nothing per decision (it reads the live namespaces once a
second, and follows the change records every write publishes anyway).
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pcr.bench.view import Fleet, best_case, realistic
from pcr.tables import format_table
from registry import PrefixCacheRegistry, PrefixRouter
from registry.fleet.view import FleetView

NAMESPACES = (16, 64, 256)
QUICK_NAMESPACES = (16, 64)
KEY_PREFIX = "pcr-fleet"
BEST_PREFIX = "pcr-fleet-best"
FILL_THREADS = 4
PATHS = ("view", "exact", "match")
INNER = {
    "exact": frozenset({"time", "hget", "hexists", "hlen", "hkeys", "hmget"}),
    "match": frozenset(),
}
"""Per path measured on the server, the commands its script calls (counted inside
EVALSHA's time too): left out."""
MEASURING = ("config", "info")
"""The measurement's own commands (``config|resetstat``), never summed."""
SYNC_TIMEOUT = 120.0
"""Seconds the view may take to apply a fleet's fill."""

TARGET_VIEW_RATIO = 1.0
"""The view's decision over every live namespace costs at most one match_kv_prefix."""


@dataclass(frozen=True)
class Effort:
    """How hard to measure: ``quick`` for a smoke run."""

    rounds: int
    calls: int  # per path per round
    decisions: int  # K: exact decisions per commandstats batch


QUICK = Effort(3, 16, 8)
FULL = Effort(7, 64, 32)


def primaries(client: Any) -> list[Any]:
    """A plain client per server: the client itself, or one per primary of a cluster."""
    get_primaries = getattr(client, "get_primaries", None)
    if get_primaries is None:
        return [client]
    return [client.get_redis_connection(node) for node in get_primaries()]


def _filled_owner(client: Any, name: str, chains: list[list[int]], key_prefix: str) -> Any:
    """Claim ``name`` (an hour's lease), then fill it through the registry: one
    ``register_kv`` per chain, block ids its positions."""
    owner = PrefixCacheRegistry(client, name, key_prefix=key_prefix)
    owner.claim(lease_ttl=3600)
    for chain in chains:
        owner.register_kv(range(len(chain)), chain)
    return owner


def fill(client: Any, fleet: Fleet, first: int, key_prefix: str) -> None:
    """The fleet's workers from ``first`` on, claimed and filled (a few at once)."""
    workers = list(fleet.held.items())[first:]
    with ThreadPoolExecutor(FILL_THREADS) as pool:
        list(pool.map(lambda w: _filled_owner(client, w[0], w[1], key_prefix), workers))


def _round_p50s(
    runs: dict[str, Callable[[], object]], calls: int, medians: dict[str, list[float]]
) -> None:
    """One round: ``calls`` turns, each timing one call of every one of ``runs`` (each
    turn starting one further along, so none always goes first), then each one's median
    appended to ``medians``: a stall of the machine weighs on all of them alike."""
    names = list(runs)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for turn in range(calls):
        at = turn % len(names)
        for name in names[at:] + names[:at]:
            start = time.perf_counter()
            runs[name]()
            samples[name].append((time.perf_counter() - start) * 1000)
    for name, values in samples.items():
        medians[name].append(statistics.median(values))


def server_usec(
    servers: Sequence[Any], run: Callable[[], object], decisions: int, inner: frozenset[str]
) -> float:
    """Server µs per call of ``run`` from INFO commandstats: median of three batches."""
    batches = []
    for _ in range(3):
        run()  # warm up
        for server in servers:
            server.config_resetstat()
        for _ in range(decisions):
            run()
        total = 0.0
        for server in servers:
            for name, stats in server.info("commandstats").items():
                command = name.removeprefix("cmdstat_")
                if command in inner or command.split("|")[0] in MEASURING:
                    continue
                total += float(stats.get("usec", 0))
        batches.append(total / decisions)
    return statistics.median(batches)


def _cycling(call: Callable[[list[int]], object], prompts: list[list[int]]) -> Callable[[], object]:
    """``call`` of the next prompt, round and round."""
    turn = itertools.cycle(prompts)
    return lambda: call(next(turn))


def measure(client: Any, deployment: str, *, quick: bool = False, best: bool = False) -> list[Any]:
    """The rows of one deployment (``client`` reaches it; its database is FLUSHed): the
    realistic fleet at each N, then with ``best`` the best case."""
    effort = QUICK if quick else FULL
    servers = primaries(client)
    for server in servers:
        server.flushdb()
    rows = []
    try:
        sizes = QUICK_NAMESPACES if quick else NAMESPACES
        workloads: list[tuple[str, Callable[[int], Fleet]]] = [(KEY_PREFIX, realistic)]
        if best:
            workloads.append((BEST_PREFIX, best_case))
        for key_prefix, make in workloads:
            view = FleetView(client, key_prefix).start(timeout=SYNC_TIMEOUT)
            try:
                filled = 0
                for n in sizes:
                    fleet = make(n)
                    started = time.perf_counter()
                    fill(client, fleet, filled, key_prefix)
                    filled = n
                    view.sync(timeout=SYNC_TIMEOUT)
                    row: dict[str, Any] = {
                        "deployment": deployment,
                        "servers": len(servers),
                        "workload": fleet.label,
                        "namespaces": n,
                        "pairs": fleet.pairs,
                        "setup_s": round(time.perf_counter() - started, 2),
                    }
                    row |= _measure_routing(client, servers, view, fleet, key_prefix, effort)
                    rows.append(row)
            finally:
                view.close()
    finally:
        for server in servers:
            server.flushdb()
    return rows


def _measure_routing(
    client: Any, servers: list[Any], view: FleetView, fleet: Fleet, key_prefix: str, effort: Effort
) -> dict[str, Any]:
    """The routing figures over every live namespace of ``fleet``, as they are now."""
    prompts = fleet.prompts
    viewed = PrefixRouter(client, key_prefix, live_cache_ttl=3600, view=view)
    exact = PrefixRouter(client, key_prefix, live_cache_ttl=3600, exact=True)
    one = PrefixCacheRegistry(client, next(iter(fleet.held)), key_prefix=key_prefix)
    live = len(exact.live_nodes())
    agree = True
    matched = 0
    for prompt in prompts:
        from_view, from_redis = viewed.score(prompt), exact.score(prompt)
        agree = agree and from_view == from_redis
        matched = max(matched, max((s.kv_prefix for s in from_redis.values()), default=0))
    scored = len(viewed.score(prompts[0]))
    if (live, scored, agree) != (len(fleet.held), len(fleet.held), True) or not matched:
        raise RuntimeError(
            f"pcr bench --fleet: the fleet is not as filled: {live} live namespaces of "
            f"{len(fleet.held)}, {scored} scored from the view, the longest prefix "
            f"{matched} blocks; the view's scores equal to exact ones: {agree}"
        )
    calls: dict[str, Callable[[], object]] = {
        "view": _cycling(viewed.score, prompts),
        "exact": _cycling(exact.score, prompts),
        "match": _cycling(one.match_kv_prefix, prompts),
    }
    medians: dict[str, list[float]] = {name: [] for name in calls}
    # The view and the match take turns call by call; the exact path (tens of times
    # longer: its many scripts in between would slow the next call down) runs its calls
    # of a round in one go.
    for _ in range(effort.rounds):
        _round_p50s({name: calls[name] for name in ("view", "match")}, effort.calls, medians)
        _round_p50s({"exact": calls["exact"]}, effort.calls, medians)
    p50 = {name: statistics.median(values) for name, values in medians.items()}
    row: dict[str, Any] = {"scored": scored, "longest_prefix": matched, "agree": agree}
    for name in PATHS:
        row[f"{name}_p50_ms"] = round(p50[name], 4)
    for name in PATHS[:-1]:
        row[f"{name}_ratio"] = round(p50[name] / p50["match"], 2)
    for name in ("exact", "match"):
        usec = server_usec(servers, calls[name], effort.decisions, INNER[name])
        row[f"server_us_{name}"] = round(usec, 1)
    return row


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each target with its measured value and whether it is met: a decision from the
    view over every live namespace costs at most one ``match_kv_prefix``."""
    checks = [
        (
            f"{r['deployment']} {r['workload']} N={r['namespaces']}: view score / match",
            r["view_ratio"],
        )
        for r in rows
    ]
    return [
        {
            "target": name,
            "measured": value,
            "limit": f"≤ {TARGET_VIEW_RATIO}",
            "met": value <= TARGET_VIEW_RATIO,
        }
        for name, value in checks
    ]


def report(rows: list[dict[str, Any]], quick: bool) -> dict[str, Any]:
    """The ``fleet`` part of the JSON report, from each deployment's ``measure``."""
    effort = QUICK if quick else FULL
    return {
        "decisions_per_batch": effort.decisions,
        "cpu_count": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "rows": rows,
        "targets": targets(rows),
    }


def format_rows(fleet: dict[str, Any]) -> list[str]:
    """The fleet rows as a text table and lines on how they were made."""
    headers = [
        "deployment",
        "workload",
        "N",
        "setup s",
        "view ms",
        "exact ms",
        "match ms",
        "view x",
        "exact x",
        "server µs exact",
        "server µs match",
        "equal",
    ]
    body = [
        [
            r["deployment"],
            r["workload"],
            r["namespaces"],
            f"{r['setup_s']:.1f}",
            f"{r['view_p50_ms']:.3f}",
            f"{r['exact_p50_ms']:.3f}",
            f"{r['match_p50_ms']:.3f}",
            f"{r['view_ratio']:.2f}",
            f"{r['exact_ratio']:.1f}",
            f"{r['server_us_exact']:.0f}",
            f"{r['server_us_match']:.0f}",
            "yes" if r["agree"] else "NO",
        ]
        for r in fleet["rows"]
    ]
    load = ", ".join(f"{x:.2f}" for x in fleet["load_average"])
    return [
        "",
        "one routing decision through Redis: p50 of PrefixRouter.score over all N live "
        "namespaces from the fleet view (in memory) and exactly (one score.lua per "
        "namespace) vs one match_kv_prefix (x: / match); server µs per decision from INFO "
        f"commandstats summed over every primary ({fleet['decisions_per_batch']} decisions "
        f"a batch; the view sends nothing per decision); {fleet['cpu_count']} CPUs, load "
        f"average {load}",
        format_table(headers, body),
        "",
        format_table(
            ["target", "limit", "measured", "met"],
            [
                [t["target"], t["limit"], t["measured"], "yes" if t["met"] else "NO"]
                for t in fleet["targets"]
            ],
        ),
    ]
