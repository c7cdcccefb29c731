"""``pcr bench --fleet``: what one routing decision costs as the fleet grows.

For N live namespaces (16, 64, 256; 16 and 64 with ``--quick``), each holding the same
chain of 4,096 KV blocks (Mamba state on every 8th) plus 512 filler entries of its own,
and a prompt of the chain's first 512 block hashes, it measures on one connection:

- the client p50 of ``PrefixRouter.score`` over every live namespace, with
  ``hybrid=True`` and ``hybrid=False``, and of one ``match_kv_prefix`` of the same prompt
  on one namespace (interleaved rounds; p50 is the median of the per-round medians), and
  their ratio;
- the server CPU per routing decision: ``CONFIG RESETSTAT`` on every server (every
  primary of a cluster), K decisions, then the ``usec`` of ``INFO commandstats`` summed
  over the servers, divided by K (the median of three such batches). Redis also counts
  the commands a script calls, inside the script's own time: for a routing decision only
  the top-level commands are summed (the script's calls are left out), for a match all.

The namespaces are claimed with an hour's lease, then filled with pipelined ``HSET``s of
many fields each (the router reads the hashes only), and grown from one size to the next. The
router's list of live namespaces is fetched once and kept (a serving router refreshes it
once a second), so a decision is one ``score`` script per namespace.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pcr.tables import format_table
from registry import PrefixCacheRegistry, PrefixRouter
from registry.keys import NamespaceKeys

NAMESPACES = (16, 64, 256)
QUICK_NAMESPACES = (16, 64)
CHAIN = 4096
PROMPT = 512
MAMBA_EVERY = 8
FILLER = 512
KEY_PREFIX = "pcr-fleet"
CHAIN_BASE = 2**58
FILLER_BASE = 2**57
FILL_BATCH = 16  # namespaces per pipeline
SCORE_CALLS = frozenset({"time", "hget", "hexists", "hlen", "hkeys", "hmget"})
"""What ``lua/score.lua`` calls: Redis counts these inside EVALSHA's time as well."""
MEASURING = ("config", "info")
"""The measurement's own commands (``config|resetstat``), never summed."""


@dataclass(frozen=True)
class Effort:
    """How hard to measure: ``quick`` for a smoke run."""

    rounds: int
    calls: int  # per operation per round
    decisions: int  # K: routing decisions per server-CPU batch


QUICK = Effort(rounds=3, calls=5, decisions=5)
FULL = Effort(rounds=7, calls=25, decisions=30)


def namespace(index: int) -> str:
    return f"fleet-{index:04d}"


def primaries(client: Any) -> list[Any]:
    """A plain client per server: the client itself, or one per primary of a cluster."""
    get_primaries = getattr(client, "get_primaries", None)
    if get_primaries is None:
        return [client]
    return [client.get_redis_connection(node) for node in get_primaries()]


def fill(client: Any, first: int, last: int) -> None:
    """Claim namespaces ``first..last-1`` (an hour's lease), then fill their hashes."""
    chain = [CHAIN_BASE + i for i in range(CHAIN)]
    kv = {h: i for i, h in enumerate(chain)}
    mamba = {h: i for i, h in enumerate(chain) if i % MAMBA_EVERY == 0}
    for index in range(first, last):  # before the filling: a claim clears the namespace
        PrefixCacheRegistry(client, namespace(index), key_prefix=KEY_PREFIX).claim(lease_ttl=3600)
    for start in range(first, last, FILL_BATCH):
        pipe = client.pipeline(transaction=False)
        for index in range(start, min(last, start + FILL_BATCH)):
            keys = NamespaceKeys(namespace(index), KEY_PREFIX)
            filler = {FILLER_BASE + index * 10_000 + j: CHAIN + j for j in range(FILLER)}
            pipe.hset(keys.kv, mapping={**kv, **filler})
            pipe.hset(keys.mamba, mapping=mamba)
        pipe.execute()


def _p50(run: Callable[[], object], effort: Effort, medians: list[float]) -> None:
    samples = []
    for _ in range(effort.calls):
        start = time.perf_counter()
        run()
        samples.append((time.perf_counter() - start) * 1000)
    medians.append(statistics.median(samples))


def server_usec(
    servers: Sequence[Any], run: Callable[[], object], effort: Effort, inner: frozenset[str]
) -> float:
    """Server µs per call of ``run``: the median of three batches of K calls."""
    batches = []
    for _ in range(3):
        run()  # warm up
        for server in servers:
            server.config_resetstat()
        for _ in range(effort.decisions):
            run()
        total = 0.0
        for server in servers:
            for name, stats in server.info("commandstats").items():
                command = name.removeprefix("cmdstat_")
                if command in inner or command.split("|")[0] in MEASURING:
                    continue
                total += float(stats.get("usec", 0))
        batches.append(total / effort.decisions)
    return statistics.median(batches)


def measure(client: Any, deployment: str, *, quick: bool = False) -> list[dict[str, Any]]:
    """The rows of one deployment (``client`` reaches it; its database is FLUSHed)."""
    effort = QUICK if quick else FULL
    servers = primaries(client)
    for server in servers:
        server.flushdb()
    rows = []
    filled = 0
    try:
        for n in QUICK_NAMESPACES if quick else NAMESPACES:
            started = time.perf_counter()
            fill(client, filled, n)
            filled = n
            row: dict[str, Any] = {"deployment": deployment, "servers": len(servers)}
            row["namespaces"] = n
            row |= _measure_one(client, servers, effort)
            row["setup_s"] = round(time.perf_counter() - started - row.pop("measured_s"), 2)
            rows.append(row)
    finally:
        for server in servers:
            server.flushdb()
    return rows


def _measure_one(client: Any, servers: list[Any], effort: Effort) -> dict[str, Any]:
    """The figures over every live namespace, as they are now."""
    started = time.perf_counter()
    prompt = [CHAIN_BASE + i for i in range(PROMPT)]
    hybrid = PrefixRouter(client, KEY_PREFIX, hybrid=True, live_cache_ttl=3600)
    plain = PrefixRouter(client, KEY_PREFIX, hybrid=False, live_cache_ttl=3600)
    one = PrefixCacheRegistry(client, namespace(0), key_prefix=KEY_PREFIX)
    scores = hybrid.score(prompt)  # loads the script, fetches the live namespaces
    plain.score(prompt)
    matched, _ = one.match_kv_prefix(prompt)
    wanted = (len(scores), min(s.kv_prefix for s in scores.values()), len(matched))
    if wanted != (len(hybrid.live_nodes()), PROMPT, PROMPT):
        raise RuntimeError(
            f"pcr bench --fleet: the fleet is not as filled: {wanted[0]} namespaces scored, "
            f"the shortest KV prefix {wanted[1]} and one match {wanted[2]} of {PROMPT} blocks"
        )
    calls: dict[str, Callable[[], object]] = {
        "hybrid": lambda: hybrid.score(prompt),
        "plain": lambda: plain.score(prompt),
        "match": lambda: one.match_kv_prefix(prompt),
    }
    medians: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(effort.rounds):
        for name, run in calls.items():
            _p50(run, effort, medians[name])
    p50 = {name: statistics.median(values) for name, values in medians.items()}
    usec = {
        name: server_usec(servers, run, effort, frozenset() if name == "match" else SCORE_CALLS)
        for name, run in calls.items()
    }
    return {
        "scored": len(scores),
        "kv_prefix": min((s.kv_prefix for s in scores.values()), default=0),
        "mamba_prefix": min((s.mamba_prefix for s in scores.values()), default=0),
        "matched": len(matched),
        "score_hybrid_p50_ms": round(p50["hybrid"], 4),
        "score_plain_p50_ms": round(p50["plain"], 4),
        "match_p50_ms": round(p50["match"], 4),
        "hybrid_ratio": round(p50["hybrid"] / p50["match"], 2),
        "plain_ratio": round(p50["plain"] / p50["match"], 2),
        "server_us_hybrid": round(usec["hybrid"], 1),
        "server_us_plain": round(usec["plain"], 1),
        "server_us_match": round(usec["match"], 1),
        "measured_s": time.perf_counter() - started,
    }


def report(rows: list[dict[str, Any]], quick: bool) -> dict[str, Any]:
    """The ``fleet`` part of the JSON report."""
    return {
        "chain_blocks": CHAIN,
        "filler_per_namespace": FILLER,
        "prompt_blocks": PROMPT,
        "mamba_every": MAMBA_EVERY,
        "decisions_per_batch": (QUICK if quick else FULL).decisions,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "rows": rows,
    }


def format_rows(fleet: dict[str, Any]) -> list[str]:
    """The fleet rows as a text table and a line on how they were made."""
    headers = [
        "deployment",
        "N",
        "score hybrid ms",
        "score plain ms",
        "match ms",
        "hybrid x",
        "plain x",
        "server µs hybrid",
        "server µs plain",
        "server µs match",
    ]
    body = [
        [
            r["deployment"],
            r["namespaces"],
            f"{r['score_hybrid_p50_ms']:.3f}",
            f"{r['score_plain_p50_ms']:.3f}",
            f"{r['match_p50_ms']:.3f}",
            f"{r['hybrid_ratio']:.1f}",
            f"{r['plain_ratio']:.1f}",
            f"{r['server_us_hybrid']:.0f}",
            f"{r['server_us_plain']:.0f}",
            f"{r['server_us_match']:.0f}",
        ]
        for r in fleet["rows"]
    ]
    load = ", ".join(f"{x:.2f}" for x in fleet["load_average"])
    return [
        format_table(headers, body),
        "",
        f"routing at fleet scale: N live namespaces of {fleet['chain_blocks']:,} chain blocks "
        f"(+{fleet['filler_per_namespace']} filler, Mamba every {fleet['mamba_every']}th), "
        f"a {fleet['prompt_blocks']}-block prompt; p50 of PrefixRouter.score over all N vs "
        f"one match_kv_prefix; server µs per decision from INFO commandstats summed over "
        f"every primary ({fleet['decisions_per_batch']} decisions a batch); load average {load}",
    ]
