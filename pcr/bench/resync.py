"""The fleet view while it loads: stale decisions over a run with resyncs, and the cold
start (issue 45, "never stale while healthy").

**Workload.** W workers (256 and 1,024; 64 with ``--quick``), each holding 16
conversations on 16 system prompts of 128 blocks (Zipf popularity, s = 1.1), each
conversation its system prompt and 200 blocks of its own: about 4,100 distinct blocks
per worker. A writer process of its own claims and fills every worker through the
registry (one ``register_kv`` per conversation), then, during the run, keeps writing as
the owners would: ``WRITES_PER_S`` writes a second, each a ``register_kv`` of 4 blocks
at the end of a conversation or an ``evict_kv`` of its last 4 (never into its system
prompt, so every namespace stays chain-shaped and exact scoring is the reference).

**Cold start.** ``FleetView(...).start()`` on a client of its own until ``ready`` (every
live namespace loaded), three times, the median.

**Run.** A view with ``resync_interval`` (15 s here; 60 s in production, so the run
holds several resyncs) follows the fleet for ``duration`` seconds while one thread of
this process makes routing decisions back to back (``PrefixRouter(view=view).best`` of
a 512-block prompt with random loads, ``PAUSE_S`` between them): a decision made while
``view.fresh()`` is False is stale (the router scores it through Redis, exactly, one
``score.lua`` per namespace). Reported: decisions, stale ones and their latency, the
longest stale span (from the first stale decision to the next fresh one), decision
p50 / p99, the resyncs and loads the view made. At the end the writer stops, the view
``sync``s, and every prompt's scores from the view must equal exact scoring through
Redis, or the run fails.

Run it as ``python -m pcr.bench.resync`` (``--quick``: one small fleet, 20 s), or
``make bench-resync``; it starts its own redis-server.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

SYSTEM_PROMPTS = 16
SYSTEM_BLOCKS = 128
CONVERSATIONS = 16
OWN_BLOCKS = 200
ZIPF_S = 1.1
PROMPTS = 64
PROMPT_BLOCKS = 512
WRITE_BLOCKS = 4
WRITES_PER_S = 100
PAUSE_S = 0.005
"""Between two decisions: the decision thread leaves the follower some of the GIL."""
COLD_STARTS = 3
FILL_THREADS = 4
SIZES = (256, 1024)
QUICK_SIZES = (64,)


def fleet(workers: int, seed: int = 45) -> tuple[dict[str, list[list[int]]], list[list[int]]]:
    """Per worker its conversations (lists of hashes), and the prompts routed."""
    rng = random.Random(seed)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(1, 2**63) for _ in range(n)]

    systems = [fresh(SYSTEM_BLOCKS) for _ in range(SYSTEM_PROMPTS)]
    weights = [1 / (k + 1) ** ZIPF_S for k in range(SYSTEM_PROMPTS)]
    held = {
        f"worker-{w:04d}": [
            rng.choices(systems, weights)[0] + fresh(OWN_BLOCKS) for _ in range(CONVERSATIONS)
        ]
        for w in range(workers)
    }
    chains = [chain for chains in held.values() for chain in chains]
    prompts = []
    for i in range(PROMPTS):
        # A conversation going on, or a one-off prompt on a system prompt.
        base = rng.choice(chains) if i % 2 == 0 else rng.choices(systems, weights)[0]
        prompts.append((base + fresh(PROMPT_BLOCKS))[:PROMPT_BLOCKS])
    return held, prompts


# -- the writer (a process of its own) ---------------------------------------------------


def _writer(url: str, workers: int, conn: Connection) -> None:
    """Claim and fill the fleet, say so (with the prompts and pairs), then write as the
    owners would from "go" until "stop"; answer with the number of writes."""
    from registry import PrefixCacheRegistry
    from registry.transport.client import client_from_url

    client = client_from_url(url)
    held, prompts = fleet(workers)
    owners: dict[str, Any] = {}

    def fill(name: str) -> None:
        owner = PrefixCacheRegistry(client, name)
        owner.claim(lease_ttl=3600)
        for chain in held[name]:
            owner.register_kv(range(len(chain)), chain)
        owners[name] = owner

    with ThreadPoolExecutor(FILL_THREADS) as pool:
        list(pool.map(fill, held))
    pairs = sum(len({h for chain in chains for h in chain}) for chains in held.values())
    conn.send(("filled", prompts, pairs))
    assert conn.recv() == "go"
    rng = random.Random(7)
    names = sorted(held)
    writes = 0
    start = time.monotonic()
    while not conn.poll():
        name = rng.choice(names)
        chain = rng.choice(held[name])
        if rng.random() < 0.5 or len(chain) < SYSTEM_BLOCKS + 2 * WRITE_BLOCKS:
            new = [rng.randrange(1, 2**63) for _ in range(WRITE_BLOCKS)]
            owners[name].register_kv(range(len(chain), len(chain) + WRITE_BLOCKS), new)
            chain.extend(new)
        else:
            owners[name].evict_kv(chain[-WRITE_BLOCKS:])
            del chain[-WRITE_BLOCKS:]
        writes += 1
        pause = start + writes / WRITES_PER_S - time.monotonic()
        if pause > 0:
            time.sleep(pause)
    conn.recv()
    conn.send(("stopped", writes))


# -- the measurements --------------------------------------------------------------------


def cold_start(url: str) -> dict[str, Any]:
    """The median of ``COLD_STARTS`` views started until ready, and one's size."""
    from registry.fleet.view import FleetView
    from registry.transport.client import client_from_url

    times = []
    memory: dict[str, int] = {}
    for _ in range(COLD_STARTS):
        client = client_from_url(url)
        started = time.perf_counter()
        view = FleetView(client).start(timeout=600)
        times.append(time.perf_counter() - started)
        memory = view.memory()
        view.close()
        client.close()
        del view
        gc.collect()
    return {
        "cold_start_s": round(statistics.median(times), 3),
        "cold_starts_s": [round(t, 3) for t in times],
        "pairs": memory.get("pairs", 0),
        "hashes": memory.get("hashes", 0),
    }


def run(
    url: str, prompts: list[list[int]], duration: float, resync_interval: float, conn: Connection
) -> dict[str, Any]:
    """Decisions for ``duration`` seconds while the writer writes and the view resyncs;
    then the view's scores checked against exact ones."""
    from registry import PrefixRouter
    from registry.fleet.view import FleetView
    from registry.transport.client import client_from_url

    client = client_from_url(url)
    view = FleetView(client, resync_interval=resync_interval).start(timeout=600)
    router = PrefixRouter(client, view=view)
    rng = random.Random(3)
    names = view.live_nodes()
    conn.send("go")
    decisions: list[tuple[float, bool, float]] = []  # (at, fresh, ms)
    loads_before = view.counts.loads
    started = time.monotonic()
    turn = 0
    try:
        while (now := time.monotonic()) - started < duration:
            prompt = prompts[turn % len(prompts)]
            turn += 1
            load = {n: rng.random() for n in names}
            fresh = view.fresh()
            begun = time.perf_counter()
            router.best(prompt, load)
            decisions.append((now - started, fresh, (time.perf_counter() - begun) * 1000))
            time.sleep(PAUSE_S)
        conn.send("stop")
        _, writes = conn.recv()
        figures = {
            "duration_s": duration,
            "resync_interval_s": resync_interval,
            "writes": writes,
            "resyncs": getattr(view.counts, "resyncs", None),
            "loads": view.counts.loads - loads_before,
            "records": view.counts.records,
            "reconnects": view.counts.reconnects,
            "errors": view.counts.errors,
        }
        figures |= _decisions(decisions)
        view.sync(timeout=300)
        exact = PrefixRouter(client, exact=True)
        agree = all(router.score(p) == exact.score(p) for p in prompts[:16])
        if not agree:
            raise RuntimeError("the view's scores after the run differ from exact scoring")
        figures["agree"] = agree
        return figures
    finally:
        view.close()
        client.close()


def _decisions(decisions: list[tuple[float, bool, float]]) -> dict[str, Any]:
    """Counts, latencies and stale spans of the decisions made."""
    stale = [ms for _, fresh, ms in decisions if not fresh]
    spans: list[float] = []
    opened: float | None = None
    for at, fresh, _ in decisions:
        if not fresh and opened is None:
            opened = at
        elif fresh and opened is not None:
            spans.append(at - opened)
            opened = None
    if opened is not None:
        spans.append(decisions[-1][0] - opened)
    every = sorted(ms for _, _, ms in decisions)
    return {
        "decisions": len(decisions),
        "stale_decisions": len(stale),
        "stale_p50_ms": round(statistics.median(stale), 3) if stale else None,
        "stale_max_ms": round(max(stale), 3) if stale else None,
        "stale_spans": len(spans),
        "longest_stale_span_s": round(max(spans), 3) if spans else 0.0,
        "decision_p50_ms": round(statistics.median(every), 4),
        "decision_p99_ms": round(every[int(0.99 * (len(every) - 1))], 4),
        "decision_max_ms": round(every[-1], 3),
    }


def measure(sizes: Sequence[int], duration: float, resync_interval: float) -> dict[str, Any]:
    """One row per fleet size, each on a redis-server of its own."""
    from pcr.bench.servers import RedisServer

    rows = []
    for workers in sizes:
        with RedisServer() as server:
            context = multiprocessing.get_context("spawn")
            ours, theirs = context.Pipe()
            writer = context.Process(target=_writer, args=(server.url, workers, theirs))
            writer.start()
            try:
                started = time.perf_counter()
                _, prompts, pairs = ours.recv()
                row: dict[str, Any] = {
                    "workers": workers,
                    "fleet_pairs": pairs,
                    "fill_s": round(time.perf_counter() - started, 1),
                }
                row |= cold_start(server.url)
                row |= run(server.url, prompts, duration, resync_interval, ours)
                rows.append(row)
            finally:
                writer.join(60)
                if writer.is_alive():
                    writer.kill()
    return {
        "cpu_count": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "writes_per_s": WRITES_PER_S,
        "rows": rows,
    }


def format_report(report: dict[str, Any]) -> list[str]:
    from pcr.tables import format_table

    headers = [
        "workers",
        "pairs",
        "cold start s",
        "run s",
        "resyncs",
        "decisions",
        "stale",
        "longest stale s",
        "stale p50 ms",
        "p50 ms",
        "p99 ms",
        "max ms",
        "equal",
    ]
    body = [
        [
            r["workers"],
            f"{r['pairs']:,}",
            r["cold_start_s"],
            r["duration_s"],
            r["resyncs"],
            r["decisions"],
            r["stale_decisions"],
            r["longest_stale_span_s"],
            r["stale_p50_ms"] if r["stale_p50_ms"] is not None else "-",
            r["decision_p50_ms"],
            r["decision_p99_ms"],
            r["decision_max_ms"],
            "yes" if r["agree"] else "NO",
        ]
        for r in report["rows"]
    ]
    load = ", ".join(f"{x:.2f}" for x in report["load_average"])
    return [
        "fleet view under resyncs: decisions made while it is not fresh (stale: scored "
        f"through Redis), {report['writes_per_s']} owner writes/s meanwhile; cold start "
        f"the median of {COLD_STARTS}; {report['cpu_count']} CPUs, load average {load}",
        format_table(headers, body),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pcr.bench.resync", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="64 workers for 20 s")
    parser.add_argument("--workers", type=int, nargs="+", help="fleet sizes (256 1024)")
    parser.add_argument("--duration", type=float, help="seconds of decisions per size (120)")
    parser.add_argument("--resync-interval", type=float, default=15.0, help="seconds (15)")
    parser.add_argument("--json", metavar="FILE", help="also write the figures to FILE")
    args = parser.parse_args(argv)
    sizes = args.workers or (QUICK_SIZES if args.quick else SIZES)
    duration = args.duration or (20.0 if args.quick else 120.0)
    report = measure(sizes, duration, args.resync_interval)
    print("\n".join(format_report(report)))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(report, out, indent=2)
            out.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
