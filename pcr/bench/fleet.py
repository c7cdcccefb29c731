"""``pcr bench --fleet``: what one routing decision costs as the fleet grows, from the fleet
index (``registry.fleet``) and, beside it, from the old exact per-namespace scoring.

**Data.** N live namespaces (16, 64, 256; 16 and 64 with ``--quick``), each claimed by its
owner (an hour's lease, ``fleet_index=True``: the owner joins the index with a member id)
and filled *through the registry*, as a serving node fills it: ``register_kv`` in batches
of 2,048 of the same chain of 4,096 KV blocks plus 512 filler blocks of its own, then one
``register_mamba`` of every 8th chain block. Each write carries its index upkeep in the same
round trip, so the index is built the real way. Owners fill on a few threads at once (the
server runs one script at a time; the threads overlap the client's packing with it). The
namespaces grow from one N to the next; ``setup_s`` is that fill's wall time. The prompt is
the chain's first 512 block hashes: every namespace must score KV 512 and Mamba 505, and
the index's scores must equal the exact ones (``agree``), or the run stops with an error.

**Client time** (one connection; rounds in which the index paths and the match take turns
call by call, so a stall weighs on them alike, and each exact path makes its calls in one
go; p50 = median of the per-round medians):
``PrefixRouter(client, prefix).score(prompt)`` over all N (the index path: one
``fleet_members`` script and one HMGET of the prompt per members' group shard, a group per
primary, in one round trip per server) with
``hybrid=True`` and ``hybrid=False``; the same with ``exact=True`` (one ``score.lua`` per
namespace; the router's live list fetched once and kept); and one ``match_kv_prefix`` of the
prompt on one namespace. Each ratio is score p50 / match p50.

**Server CPU per decision, INFO commandstats.** ``CONFIG RESETSTAT`` on every primary, K
decisions, then ``usec`` summed over the primaries, / K (median of three batches). Redis
counts the commands a script calls both on their own and inside the script's EVALSHA time,
so only top-level commands are summed. The index path sends one EVALSHA of
``fleet_members since`` (which calls TIME, HGET, ZRANGEBYSCORE and ZCOUNT inside, and ZRANGE
when the member list changed) and one HMGET per group shard: evalsha + hmget are summed,
the script's inner commands left out. The exact path
sends one EVALSHA of ``score.lua`` per namespace: evalsha only (its TIME, HGET, HEXISTS,
HLEN, HKEYS, HMGET are inside). The match is one HMGET: all of it. ``commandstats`` times
are wall clock inside the server: on a loaded machine a preempted command counts its wait.

**Server CPU per decision, INFO cpu** (cross-check): ``used_cpu_user + used_cpu_sys``
deltas summed over the primaries across a longer batch of decisions (about a second's
worth, quick: a quarter), / decisions. It includes what commandstats leaves out (reading
the request, writing the reply, the event loop, the server's own timers), so it reads
higher; it is true CPU, so load on the machine does not inflate it.

**Writes with index upkeep.** For each N, the owner of the last namespace (the highest
member id of its group, so the longest bitmaps to edit; its chain fields hold the bits of
every member of its group)
alternates ``evict_kv`` and ``register_kv`` of n = 16 and 64 chain blocks past the prompt,
and a namespace filled the same way but claimed with ``fleet_index=False`` (under another
key prefix, so routers never see it) does the same on the same server (on a cluster, a
namespace of the same primary), the two writers taking turns call by call; p50 of each,
and the ratio indexed / unindexed.

**Capacity** (standalone, at the largest N). Several client *processes* each loop
``best(prompt)`` over all N live namespaces (the per-request work a router adds; the
serving node's own match/register/evict are *not* included: they cost the same with or
without the index) for a few seconds. The decisions/s they reach and the server's CPU
(``INFO cpu`` delta / wall time) give the server µs per decision; capacity = the serving
nodes, at 50 requests/s each with ``best`` on every request, that one shard carries at
100% of one core = 1e6 / (50 x µs per decision). The index path's cost barely depends on
N (one HMGET of the prompt per group shard, the member list's changes), so the
capacity measured at N = 256 is a lower bound for any fleet up to 256 nodes: a fleet of C
nodes <= 256 routes at no more than the cost at 256, and C <= capacity is carried. The
exact path costs about N scripts, so its capacity falls as the fleet grows; its
self-consistent size (the C with capacity at N = C equal to C, about 15 before the index)
is read from the rows' INFO cpu figures. The machine has few cores: client processes and
the server share them, so the saturated decisions/s is a floor; the µs per decision is
what sizes the shard.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pcr.tables import format_table
from registry import PrefixCacheRegistry, PrefixRouter
from registry.keys import NamespaceKeys
from registry.scripts import is_cluster

NAMESPACES = (16, 64, 256)
QUICK_NAMESPACES = (16, 64)
CHAIN = 4096
PROMPT = 512
MAMBA_EVERY = 8
FILLER = 512
KEY_PREFIX = "pcr-fleet"
RAW_PREFIX = "pcr-fleet-raw"
RAW_NAMESPACE = "writer-raw"
CHAIN_BASE = 2**58
FILLER_BASE = 2**57
FILL_THREADS = 4
FILL_BATCH = 2048
"""Hashes per ``register_kv`` of the fill (an engine registers a prompt's blocks at once)."""
WRITE_SIZES = (16, 64)
REQUESTS_PER_S = 50
PATHS = ("index_hybrid", "index_plain", "exact_hybrid", "exact_plain", "match")

INNER = {
    "index": frozenset({"time", "hget", "zrange", "zrangebyscore", "zcount"}),
    "exact": frozenset({"time", "hget", "hexists", "hlen", "hkeys", "hmget"}),
    "match": frozenset(),
}
"""Per path, the commands a script calls (counted inside EVALSHA's time too): left out."""
MEASURING = ("config", "info")
"""The measurement's own commands (``config|resetstat``), never summed."""

TARGET_RATIO = {16: 1.5, 64: 2.0, 256: 3.0}
TARGET_SERVER_US = 300.0  # at N = 256
TARGET_WRITE_RATIO = 1.3
TARGET_CAPACITY = 100.0


@dataclass(frozen=True)
class Effort:
    """How hard to measure: ``quick`` for a smoke run."""

    rounds: int
    calls: int  # per operation per round
    decisions: int  # K: routing decisions per commandstats batch
    cpu_seconds: float  # about how long an INFO cpu batch runs
    write_rounds: int
    write_calls: int  # evict + register pairs per round
    processes: tuple[int, ...]  # client processes of the saturation runs (index path)
    exact_processes: tuple[int, ...]
    seconds: float  # per saturation run


QUICK = Effort(3, 5, 5, 0.25, 3, 8, (2,), (2,), 1.0)
FULL = Effort(7, 25, 30, 1.0, 7, 25, (2, 4, 8), (2, 4), 3.0)


def namespace(index: int) -> str:
    return f"fleet-{index:04d}"


def primaries(client: Any) -> list[Any]:
    """A plain client per server: the client itself, or one per primary of a cluster."""
    get_primaries = getattr(client, "get_primaries", None)
    if get_primaries is None:
        return [client]
    return [client.get_redis_connection(node) for node in get_primaries()]


CHAIN_HASHES = [CHAIN_BASE + i for i in range(CHAIN)]
PROMPT_HASHES = CHAIN_HASHES[:PROMPT]


def _filled_owner(
    client: Any, name: str, index: int, *, key_prefix: str = KEY_PREFIX, fleet_index: bool = True
) -> PrefixCacheRegistry:
    """Claim ``name`` (an hour's lease), then fill it through the registry."""
    owner = PrefixCacheRegistry(client, name, key_prefix=key_prefix, fleet_index=fleet_index)
    owner.claim(lease_ttl=3600)
    filler = [FILLER_BASE + index * 10_000 + j for j in range(FILLER)]
    hashes = CHAIN_HASHES + filler
    for first in range(0, len(hashes), FILL_BATCH):
        part = hashes[first : first + FILL_BATCH]
        owner.register_kv(list(range(first, first + len(part))), part)
    owner.register_mamba(list(range(0, CHAIN, MAMBA_EVERY)), CHAIN_HASHES[::MAMBA_EVERY])
    return owner


def _raw_beside(
    owner: PrefixCacheRegistry, raws: dict[str, PrefixCacheRegistry]
) -> PrefixCacheRegistry:
    """The unindexed writer compared with ``owner``: filled the same way, on the same
    Redis server (on a cluster, a namespace of the same primary: one server process may
    be woken faster than another on a machine of few cores, which would weigh more than
    the index), made on first use."""
    client = owner.client
    home = _server_of(client, owner.keys.kv)
    if home not in raws:
        for k in range(10_000):
            name = f"{RAW_NAMESPACE}-{k}"
            if _server_of(client, NamespaceKeys(name, RAW_PREFIX).kv) == home:
                break
        else:  # pragma: no cover - 10,000 names on one side of a 3-way split: impossible
            raise RuntimeError("pcr bench --fleet: no unindexed namespace on that server")
        raws[home] = _filled_owner(client, name, 99_999, key_prefix=RAW_PREFIX, fleet_index=False)
    return raws[home]


def _server_of(client: Any, key: str) -> str:
    """The Redis server holding ``key``: its cluster primary, or the one server."""
    return str(client.get_node_from_key(key).name) if is_cluster(client) else ""


def fill(client: Any, first: int, last: int) -> list[PrefixCacheRegistry]:
    """Namespaces ``first..last-1``, claimed and filled by their owners (a few at once)."""
    with ThreadPoolExecutor(FILL_THREADS) as pool:
        return list(pool.map(lambda i: _filled_owner(client, namespace(i), i), range(first, last)))


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


def cpu_seconds(servers: Sequence[Any]) -> float:
    """used_cpu_user + used_cpu_sys summed over ``servers``."""
    total = 0.0
    for server in servers:
        cpu = server.info("cpu")
        total += float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])
    return total


def cpu_usec(
    servers: Sequence[Any], run: Callable[[], object], p50_ms: float, seconds: float
) -> float:
    """Server µs per call of ``run`` from INFO cpu over about ``seconds`` of calls."""
    calls = max(10, round(seconds * 1000 / max(p50_ms, 0.01)))
    run()
    before = cpu_seconds(servers)
    for _ in range(calls):
        run()
    return (cpu_seconds(servers) - before) * 1e6 / calls


def measure(client: Any, deployment: str, *, quick: bool = False) -> dict[str, Any]:
    """The rows of one deployment (``client`` reaches it; its database is FLUSHed), and on
    a standalone server the capacity at the largest N."""
    effort = QUICK if quick else FULL
    servers = primaries(client)
    for server in servers:
        server.flushdb()
    rows = []
    owners: list[PrefixCacheRegistry] = []
    capacity = None
    try:
        raws: dict[str, PrefixCacheRegistry] = {}  # unindexed writers, one per server
        sizes = QUICK_NAMESPACES if quick else NAMESPACES
        for n in sizes:
            started = time.perf_counter()
            owners += fill(client, len(owners), n)
            row: dict[str, Any] = {"deployment": deployment, "servers": len(servers)}
            row["namespaces"] = n
            row["setup_s"] = round(time.perf_counter() - started, 2)
            row |= _measure_routing(client, servers, effort)
            row["writes"] = _measure_writes(owners[-1], _raw_beside(owners[-1], raws), effort)
            rows.append(row)
        if deployment == "standalone":
            capacity = _capacity(client, sizes[-1], effort, rows[-1])
    finally:
        for server in servers:
            server.flushdb()
    return {"rows": rows, "capacity": capacity}


def _measure_routing(client: Any, servers: list[Any], effort: Effort) -> dict[str, Any]:
    """The routing figures over every live namespace, as they are now."""
    prompt = PROMPT_HASHES
    routers = {
        "index_hybrid": PrefixRouter(client, KEY_PREFIX, hybrid=True, live_cache_ttl=3600),
        "index_plain": PrefixRouter(client, KEY_PREFIX, hybrid=False, live_cache_ttl=3600),
        "exact_hybrid": PrefixRouter(
            client, KEY_PREFIX, hybrid=True, live_cache_ttl=3600, exact=True
        ),
        "exact_plain": PrefixRouter(
            client, KEY_PREFIX, hybrid=False, live_cache_ttl=3600, exact=True
        ),
    }
    one = PrefixCacheRegistry(client, namespace(0), key_prefix=KEY_PREFIX)
    scores = {name: router.score(prompt) for name, router in routers.items()}
    matched, _ = one.match_kv_prefix(prompt)
    live = len(routers["exact_hybrid"].live_nodes())
    hybrid = scores["index_hybrid"]
    agree = (
        scores["index_hybrid"] == scores["exact_hybrid"]
        and scores["index_plain"] == scores["exact_plain"]
    )
    wanted = (len(hybrid), min(s.kv_prefix for s in hybrid.values()), len(matched), agree)
    if wanted != (live, PROMPT, PROMPT, True):
        raise RuntimeError(
            f"pcr bench --fleet: the fleet is not as filled: {wanted[0]} of {live} namespaces "
            f"scored, the shortest KV prefix {wanted[1]} and one match {wanted[2]} of {PROMPT} "
            f"blocks; index scores equal to exact ones: {agree}"
        )
    calls: dict[str, Callable[[], object]] = {
        name: functools.partial(router.score, prompt) for name, router in routers.items()
    }
    calls["match"] = lambda: one.match_kv_prefix(prompt)
    medians: dict[str, list[float]] = {name: [] for name in calls}
    # The index paths and the match take turns call by call; the exact paths (tens of
    # times longer, their many scripts in between would slow the next call down) run
    # their calls of a round in one go.
    quick = {name: calls[name] for name in ("index_hybrid", "index_plain", "match")}
    for _ in range(effort.rounds):
        _round_p50s(quick, effort.calls, medians)
        for name in ("exact_hybrid", "exact_plain"):
            _round_p50s({name: calls[name]}, effort.calls, medians)
    p50 = {name: statistics.median(values) for name, values in medians.items()}
    row: dict[str, Any] = {
        "scored": len(hybrid),
        "kv_prefix": min(s.kv_prefix for s in hybrid.values()),
        "mamba_prefix": min(s.mamba_prefix for s in hybrid.values()),
        "matched": len(matched),
        "agree": agree,
    }
    for name in PATHS:
        row[f"{name}_p50_ms"] = round(p50[name], 4)
    for name in PATHS[:-1]:
        row[f"{name}_ratio"] = round(p50[name] / p50["match"], 2)
    for name, run in calls.items():
        inner = INNER[name.split("_")[0]]
        row[f"server_us_{name}"] = round(server_usec(servers, run, effort.decisions, inner), 1)
    for name, run in calls.items():
        row[f"cpu_us_{name}"] = round(cpu_usec(servers, run, p50[name], effort.cpu_seconds), 1)
    return row


def _measure_writes(
    owner: PrefixCacheRegistry, raw: PrefixCacheRegistry, effort: Effort
) -> list[dict[str, Any]]:
    """p50 of evict_kv and register_kv of n chain blocks past the prompt, with the index
    kept (``owner``) and without (``raw``), interleaved call by call (the two writers
    take turns going first), so a stall of the machine weighs on both alike."""
    medians: dict[tuple[str, int, str], list[float]] = {}
    writers = (("indexed", owner), ("unindexed", raw))
    for _ in range(effort.write_rounds):
        for n in WRITE_SIZES:
            hashes = CHAIN_HASHES[CHAIN - n :]
            ids = list(range(CHAIN - n, CHAIN))
            samples: dict[tuple[str, str], list[float]] = {}
            for call in range(effort.write_calls):
                for kind, registry in writers if call % 2 == 0 else writers[::-1]:
                    start = time.perf_counter()
                    registry.evict_kv(hashes)
                    middle = time.perf_counter()
                    registry.register_kv(ids, hashes)
                    end = time.perf_counter()
                    samples.setdefault(("evict_kv", kind), []).append((middle - start) * 1000)
                    samples.setdefault(("register_kv", kind), []).append((end - middle) * 1000)
            for (operation, kind), values in samples.items():
                medians.setdefault((operation, n, kind), []).append(statistics.median(values))
    out = []
    for operation in ("register_kv", "evict_kv"):
        for n in WRITE_SIZES:
            indexed = statistics.median(medians[(operation, n, "indexed")])
            unindexed = statistics.median(medians[(operation, n, "unindexed")])
            out.append(
                {
                    "operation": operation,
                    "n": n,
                    "indexed_p50_ms": round(indexed, 4),
                    "unindexed_p50_ms": round(unindexed, 4),
                    "ratio": round(indexed / unindexed, 2),
                }
            )
    return out


# -- capacity: a saturation run on one standalone server ----------------------------------


def _saturate(
    connection: tuple[Any, dict[str, Any]],
    exact: bool,
    seconds: float,
    ready: Any,
    results: Any,
) -> None:
    """One client process: ``best`` over every live namespace, back to back."""
    import redis

    connection_class, kwargs = connection
    try:
        pool = redis.ConnectionPool(connection_class=connection_class, **kwargs)
        client = redis.Redis(connection_pool=pool)
        router = PrefixRouter(client, KEY_PREFIX, live_cache_ttl=3600, exact=exact)
        router.best(PROMPT_HASHES)  # loads the scripts, fetches the live list
    except Exception as exc:  # reported by the parent, which stops waiting
        ready.abort()
        results.put((0, 0.0, f"{type(exc).__name__}: {exc}"))
        return
    ready.wait()
    count = 0
    start = time.perf_counter()
    deadline = start + seconds
    while time.perf_counter() < deadline:
        router.best(PROMPT_HASHES)
        count += 1
    results.put((count, time.perf_counter() - start, None))
    client.close()


def saturation_run(client: Any, processes: int, *, exact: bool, seconds: float) -> dict[str, Any]:
    """``processes`` client processes looping ``best`` for ``seconds``: decisions/s, and
    the server's CPU per decision and busy share over the run."""
    pool = client.connection_pool
    # Forked, not pickled: the children inherit the connection settings as they are.
    connection = (pool.connection_class, dict(pool.connection_kwargs))
    context = multiprocessing.get_context("fork")
    ready = context.Barrier(processes + 1)
    results = context.Queue()
    workers = [
        context.Process(target=_saturate, args=(connection, exact, seconds, ready, results))
        for _ in range(processes)
    ]
    for worker in workers:
        worker.start()
    try:
        try:
            ready.wait(timeout=60)
        except threading.BrokenBarrierError:
            failed = results.get(timeout=10)
            raise RuntimeError(f"pcr bench --fleet: a client process failed: {failed[2]}") from None
        before = cpu_seconds([client])
        started = time.perf_counter()
        done = [results.get(timeout=seconds + 60) for _ in workers]
        wall = time.perf_counter() - started
        used = cpu_seconds([client]) - before
    finally:
        for worker in workers:
            worker.join(timeout=10)
            if worker.is_alive():
                worker.kill()
    decisions = sum(count for count, _, _ in done)
    per_s = sum(count / elapsed for count, elapsed, _ in done)
    usec = used * 1e6 / decisions
    return {
        "processes": processes,
        "decisions": decisions,
        "decisions_per_s": round(per_s, 1),
        "server_busy": round(used / wall, 2),
        "server_us_per_decision": round(usec, 1),
        "capacity_nodes": round(1e6 / (REQUESTS_PER_S * usec), 1),
    }


def _capacity(client: Any, n: int, effort: Effort, row: dict[str, Any]) -> dict[str, Any]:
    """The saturation runs at ``n`` namespaces, index path then exact path."""
    out: dict[str, Any] = {"namespaces": n, "requests_per_s_per_node": REQUESTS_PER_S}
    for name, exact, counts in (
        ("index", False, effort.processes),
        ("exact", True, effort.exact_processes),
    ):
        runs = [saturation_run(client, p, exact=exact, seconds=effort.seconds) for p in counts]
        best = max(runs, key=lambda r: r["decisions_per_s"])
        out[name] = {
            "runs": runs,
            "saturated_decisions_per_s": best["decisions_per_s"],
            "server_us_per_decision": statistics.median(r["server_us_per_decision"] for r in runs),
        }
        out[name]["capacity_nodes"] = round(
            1e6 / (REQUESTS_PER_S * out[name]["server_us_per_decision"]), 1
        )
    return out


def exact_self_consistent(rows: list[dict[str, Any]]) -> float | None:
    """The fleet size C the exact path carries when routing over C namespaces: C with
    1e6 / (50 x cpu µs at N=C) = C, the cpu µs interpolated linearly in N between rows."""
    points: list[tuple[int, float]] = sorted(
        (int(r["namespaces"]), float(r["cpu_us_exact_hybrid"])) for r in rows
    )
    if not points:
        return None

    def gap(c: float) -> float:
        lower = [p for p in points if p[0] <= c] or points[:1]
        upper = [p for p in points if p[0] >= c] or points[-1:]
        (n0, u0), (n1, u1) = lower[-1], upper[0]
        usec = u0 if n1 == n0 else u0 + (u1 - u0) * (c - n0) / (n1 - n0)
        return 1e6 / (REQUESTS_PER_S * usec) - c

    low, high = 1.0, float(points[-1][0])
    if gap(high) >= 0:
        return high
    if gap(low) < 0:
        return low
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (middle, high) if gap(middle) >= 0 else (low, middle)
    return round(low, 1)


def targets(rows: list[dict[str, Any]], capacity: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Each target of issue 13 with its measured value and whether it is met."""
    checks: list[tuple[str, float, str, float]] = []
    for r in rows:
        limit = TARGET_RATIO.get(r["namespaces"])
        if limit is not None:
            for mode in ("hybrid", "plain"):
                checks.append(
                    (
                        f"{r['deployment']} N={r['namespaces']}: index score {mode} / match",
                        r[f"index_{mode}_ratio"],
                        "≤",
                        limit,
                    )
                )
        if r["namespaces"] == 256:
            checks.append(
                (
                    f"{r['deployment']} N=256: server µs per decision (commandstats)",
                    r["server_us_index_hybrid"],
                    "≤",
                    TARGET_SERVER_US,
                )
            )
        for w in r["writes"]:
            checks.append(
                (
                    f"{r['deployment']} N={r['namespaces']}: {w['operation']} n={w['n']}, "
                    f"indexed / unindexed",
                    w["ratio"],
                    "≤",
                    TARGET_WRITE_RATIO,
                )
            )
    if capacity is not None:
        checks.append(
            (
                f"capacity at N={capacity['namespaces']}, index path (nodes at 50 req/s)",
                capacity["index"]["capacity_nodes"],
                "≥",
                TARGET_CAPACITY,
            )
        )
    return [
        {
            "target": name,
            "measured": value,
            "limit": f"{sign} {limit}",
            "met": value <= limit if sign == "≤" else value >= limit,
        }
        for name, value, sign, limit in checks
    ]


def report(results: list[dict[str, Any]], quick: bool) -> dict[str, Any]:
    """The ``fleet`` part of the JSON report, from each deployment's ``measure``."""
    rows = [row for result in results for row in result["rows"]]
    capacity = next((r["capacity"] for r in results if r.get("capacity")), None)
    standalone = [r for r in rows if r["deployment"] == "standalone"]
    if capacity is not None:
        capacity["exact_self_consistent_nodes"] = exact_self_consistent(standalone)
    effort = QUICK if quick else FULL
    return {
        "workload": "best case: every namespace holds the same chain",
        "chain_blocks": CHAIN,
        "filler_per_namespace": FILLER,
        "prompt_blocks": PROMPT,
        "mamba_every": MAMBA_EVERY,
        "decisions_per_batch": effort.decisions,
        "saturation_seconds": effort.seconds,
        "cpu_count": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "rows": rows,
        "capacity": capacity,
        "targets": targets(rows, capacity),
    }


def format_rows(fleet: dict[str, Any]) -> list[str]:
    """The fleet rows as text tables and lines on how they were made."""
    headers = [
        "deployment",
        "N",
        "setup s",
        "index hyb ms",
        "index plain ms",
        "exact hyb ms",
        "exact plain ms",
        "match ms",
        "index x hyb/plain",
        "exact x hyb/plain",
        "server µs index hyb/plain",
        "server µs exact hyb/plain",
        "server µs match",
        "cpu µs index/exact/match",
    ]
    body = [
        [
            r["deployment"],
            r["namespaces"],
            f"{r['setup_s']:.1f}",
            f"{r['index_hybrid_p50_ms']:.3f}",
            f"{r['index_plain_p50_ms']:.3f}",
            f"{r['exact_hybrid_p50_ms']:.3f}",
            f"{r['exact_plain_p50_ms']:.3f}",
            f"{r['match_p50_ms']:.3f}",
            f"{r['index_hybrid_ratio']:.1f} / {r['index_plain_ratio']:.1f}",
            f"{r['exact_hybrid_ratio']:.1f} / {r['exact_plain_ratio']:.1f}",
            f"{r['server_us_index_hybrid']:.0f} / {r['server_us_index_plain']:.0f}",
            f"{r['server_us_exact_hybrid']:.0f} / {r['server_us_exact_plain']:.0f}",
            f"{r['server_us_match']:.0f}",
            f"{r['cpu_us_index_hybrid']:.0f} / {r['cpu_us_exact_hybrid']:.0f} / "
            f"{r['cpu_us_match']:.0f}",
        ]
        for r in fleet["rows"]
    ]
    write_body = [
        [
            r["deployment"],
            r["namespaces"],
            w["operation"],
            w["n"],
            f"{w['indexed_p50_ms']:.3f}",
            f"{w['unindexed_p50_ms']:.3f}",
            f"{w['ratio']:.2f}",
        ]
        for r in fleet["rows"]
        for w in r["writes"]
    ]
    load = ", ".join(f"{x:.2f}" for x in fleet["load_average"])
    lines = [
        format_table(headers, body),
        "",
        "BEST CASE (every namespace holds the same chain, so each index value is one "
        "bitmap): the realistic fleet is pcr bench --view's",
        f"routing at fleet scale: N live namespaces of {fleet['chain_blocks']:,} chain blocks "
        f"(+{fleet['filler_per_namespace']} filler, Mamba every {fleet['mamba_every']}th), "
        f"filled through the registry; a {fleet['prompt_blocks']}-block prompt; p50 of "
        f"PrefixRouter.score over all N from the fleet index and exact (per namespace) vs one "
        f"match_kv_prefix; server µs per decision from INFO commandstats summed over every "
        f"primary, top-level commands only ({fleet['decisions_per_batch']} decisions a "
        f"batch), cpu µs from INFO cpu; {fleet['cpu_count']} CPUs, load average {load}",
        "",
        format_table(
            ["deployment", "N", "write", "n", "indexed ms", "unindexed ms", "ratio"], write_body
        ),
    ]
    capacity = fleet.get("capacity")
    if capacity:
        cap_body = [
            [
                path,
                run["processes"],
                run["decisions"],
                f"{run['decisions_per_s']:.0f}",
                f"{run['server_busy']:.2f}",
                f"{run['server_us_per_decision']:.0f}",
                f"{run['capacity_nodes']:.1f}",
            ]
            for path in ("index", "exact")
            for run in capacity[path]["runs"]
        ]
        lines += [
            "",
            format_table(
                [
                    f"best, N={capacity['namespaces']}",
                    "processes",
                    "decisions",
                    "decisions/s",
                    "server busy",
                    "server µs/decision",
                    "nodes at 50 req/s",
                ],
                cap_body,
            ),
            "",
            f"capacity (standalone, {fleet['saturation_seconds']} s runs, INFO cpu): index path "
            f"{capacity['index']['capacity_nodes']:.1f} nodes at 50 requests/s "
            f"(saturated {capacity['index']['saturated_decisions_per_s']:.0f} decisions/s), "
            f"exact path {capacity['exact']['capacity_nodes']:.1f} at "
            f"N={capacity['namespaces']} (self-consistent fleet: "
            f"{capacity['exact_self_consistent_nodes']} nodes)",
        ]
    lines += [
        "",
        format_table(
            ["target", "limit", "measured", "met"],
            [
                [t["target"], t["limit"], t["measured"], "yes" if t["met"] else "NO"]
                for t in fleet["targets"]
            ],
        ),
    ]
    return lines
