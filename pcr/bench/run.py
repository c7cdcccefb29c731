"""``pcr bench``: every registry operation measured against the raw Redis commands.

For each operation and size it reports, from one run on one connection: the client's
p50 and p99, the server's time per call (``INFO commandstats``, after ``CONFIG
RESETSTAT``), and the ratios to the raw command that does the same storage work (HMGET,
HSET, HDEL) and to ``LocalPrefixCacheRegistry``. Operations are measured in interleaved
rounds and p50 is the median of the per-round medians, so a noisy moment hits every
operation alike. Then the throughput of 4 client processes, and the latency from an
eviction to the listener freeing the slot, the bridge's rows (``pcr.bench.bridge``:
engine KV events into Redis, and publish to visible in routing) and the serve rows
(``pcr.bench.serve``: ``POST /v1/score`` of ``pcr serve`` at a fixed offered load, and the
asyncio router against the sync one) and the mirror's (``pcr.bench.mirror``: the engine
cycle per admitted request in process, mirrored and on Redis; publish to visible; flush
throughput). Each target is printed next to its ratio.
"""

from __future__ import annotations

import multiprocessing
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from pcr.bench import bridge as bridge_bench
from pcr.bench import mirror as mirror_bench
from pcr.bench import serve as serve_bench
from pcr.tables import format_table
from registry import LocalPrefixCacheRegistry, PrefixCacheRegistry, PrefixRouter
from registry.core.validation import flatten

SIZES = (16, 64, 512, 8192)
SCORE_NAMESPACES = 16
FILLER = 4096
"""Other prompts' blocks in every measured hash: a serving node holds thousands, and
Redis keeps a hash of up to 512 small entries as a listpack (each lookup O(entries)),
which would make small benchmark hashes unrealistically slow."""


FLOOR_SCRIPT = """local n, done = #ARGV, 0
for first = 1, n, 4000 do
  done = done + redis.call('{command}', KEYS[1], unpack(ARGV, first, math.min(first + 3999, n)))
end
return done"""


UNRECORDED_REGISTER = """local current = redis.call('HGET', KEYS[2], 'epoch')
local n, done = #ARGV, 0
for first = 2, n, 4000 do
  done = done + redis.call('HSET', KEYS[1], unpack(ARGV, first, math.min(first + 3999, n)))
end
return done"""
"""register_kv as it was before request ids: fencing and HSET, no reply record (GET at
the start, SET with an expiry at the end). The ratio to it is what the exactly-once
bookkeeping costs a write."""


def _filler(base: int) -> list[int]:
    return flatten({2**59 + base * 10_000 + i: i for i in range(FILLER)})


@dataclass(frozen=True)
class Effort:
    """How hard to measure: ``quick`` for a smoke run under a minute."""

    rounds: int
    calls: int  # per operation per round (a tenth of it at n=8192, at least 3)
    server_calls: int
    throughput_seconds: float
    listener_evictions: int

    def calls_at(self, n: int) -> int:
        return max(3, self.calls // 10) if n >= 8192 else self.calls


QUICK = Effort(rounds=3, calls=20, server_calls=5, throughput_seconds=0.5, listener_evictions=50)
FULL = Effort(rounds=7, calls=100, server_calls=30, throughput_seconds=3.0, listener_evictions=300)


@dataclass
class Operation:
    """One measured call: ``run`` is timed; ``setup`` (untimed) runs before each call."""

    name: str
    n: int
    run: Callable[[], object]
    command: str  # what INFO commandstats counts it under
    setup: Callable[[], object] | None = None
    samples: list[float] = field(default_factory=list)  # ms
    round_medians: list[float] = field(default_factory=list)
    server_us: float | None = None

    @property
    def p50(self) -> float:
        return statistics.median(self.round_medians)

    @property
    def p99(self) -> float:
        ordered = sorted(self.samples)
        return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


Row = tuple[str, Operation, Operation, "Operation | None"]
"""One table row: its label, the registry's operation, the raw baseline, the local one."""


@dataclass
class _Fixture:
    """The namespaces, keys and hashes the rows of size ``n`` measure on, filled."""

    client: Any
    n: int
    chain: list[int]
    missing: list[int]
    ids: list[int]
    full: PrefixCacheRegistry
    half: PrefixCacheRegistry
    write: PrefixCacheRegistry
    local: LocalPrefixCacheRegistry
    local_half: LocalPrefixCacheRegistry
    raw_key: str
    floor_key: str
    flat: list[Any]

    @property
    def mamba_ids(self) -> list[int]:
        return self.ids[::8]

    @property
    def mamba_hashes(self) -> list[int]:
        return self.chain[::8]

    def refill(self) -> None:
        self.write.register_kv(self.ids, self.chain)
        self.write.register_mamba(self.mamba_ids, self.mamba_hashes)

    def refill_local(self) -> None:
        self.local.register_kv(self.ids, self.chain)
        self.local.register_mamba(self.mamba_ids, self.mamba_hashes)

    def refill_raw(self) -> None:
        self.client.hset(self.raw_key, items=self.flat)

    def refill_floor(self) -> None:
        self.client.hset(self.floor_key, items=self.flat)


def _fixture(client: Any, n: int) -> _Fixture:
    """Fresh namespaces for size ``n``, each beside filler entries (a realistic hash)."""
    chain = [2**62 + n * 100_000 + i for i in range(n)]
    ids = list(range(n))
    mamba_ids, mamba_hashes = ids[::8], chain[::8]
    full = PrefixCacheRegistry(client, f"bench-full-{n}")
    half = PrefixCacheRegistry(client, f"bench-half-{n}")
    write = PrefixCacheRegistry(client, f"bench-write-{n}")
    raw_key = f"bench-raw-{n}"
    for number, reg in enumerate((full, half, write)):
        reg.reset()
        reg.load_scripts()
        client.hset(reg.keys.kv, items=_filler(n * 10 + number))
    client.delete(raw_key)
    client.hset(raw_key, items=_filler(n * 10 + 9))
    full.register_kv(ids, chain)
    full.register_mamba(mamba_ids, mamba_hashes)
    half.register_kv(ids[: n // 2], chain[: n // 2])
    local = LocalPrefixCacheRegistry()
    local.register_kv(ids, chain)
    local.register_mamba(mamba_ids, mamba_hashes)
    local_half = LocalPrefixCacheRegistry()
    local_half.register_kv(ids[: n // 2], chain[: n // 2])
    return _Fixture(
        client=client,
        n=n,
        chain=chain,
        missing=[2**61 + n * 100_000 + i for i in range(n)],
        ids=ids,
        full=full,
        half=half,
        write=write,
        local=local,
        local_half=local_half,
        raw_key=raw_key,
        floor_key=f"bench-floor-{n}",
        flat=flatten(dict(zip(chain, ids, strict=True))),
    )


def _operations(client: Any, n: int, local_too: bool = True) -> list[Row]:
    """(label, registry op, raw baseline, local op) for size ``n``."""
    f = _fixture(client, n)
    rows = [*_kv_match_rows(f), *_write_rows(f), *_mamba_rows(f)]
    return [(label, ours, raw, lo if local_too else None) for label, ours, raw, lo in rows]


def _kv_match_rows(f: _Fixture) -> list[Row]:
    """``match_kv_prefix`` on a full hit, a half hit and a miss, against HMGET."""
    client, n, chain, kv = f.client, f.n, f.chain, f.full.keys.kv
    return [
        (
            "match_kv_prefix, full hit",
            Operation("match full", n, lambda: f.full.match_kv_prefix(chain), "hmget"),
            Operation("HMGET", n, lambda: client.hmget(kv, chain), "hmget"),
            Operation("local", n, lambda: f.local.match_kv_prefix(chain), ""),
        ),
        (
            "match_kv_prefix, half hit",
            Operation("match half", n, lambda: f.half.match_kv_prefix(chain), "hmget"),
            Operation("HMGET", n, lambda: client.hmget(f.half.keys.kv, chain), "hmget"),
            Operation("local", n, lambda: f.local_half.match_kv_prefix(chain), ""),
        ),
        (
            "match_kv_prefix, miss",
            Operation("match miss", n, lambda: f.full.match_kv_prefix(f.missing), "hmget"),
            Operation("HMGET", n, lambda: client.hmget(kv, f.missing), "hmget"),
            Operation("local", n, lambda: f.local.match_kv_prefix(f.missing), ""),
        ),
    ]


def _write_rows(f: _Fixture) -> list[Row]:
    """Registering and evicting against HSET / HDEL, and the floors of any script: the
    same HSET / HDEL inside a minimal (chunked) script, a register without reply record."""
    client, n, ids, chain, flat, write = f.client, f.n, f.ids, f.chain, f.flat, f.write
    hset_floor = client.register_script(FLOOR_SCRIPT.format(command="HSET"))
    hdel_floor = client.register_script(FLOOR_SCRIPT.format(command="HDEL"))
    unrecorded = client.register_script(UNRECORDED_REGISTER)
    client.hset(f.floor_key, items=_filler(n * 10 + 8))
    return [
        (
            "register_kv",
            Operation("register", n, lambda: write.register_kv(ids, chain), "evalsha"),
            Operation("HSET", n, lambda: client.hset(f.raw_key, items=flat), "hset"),
            Operation("local", n, lambda: f.local.register_kv(ids, chain), ""),
        ),
        (
            "request ids: register_kv / same without reply record",
            Operation("register", n, lambda: write.register_kv(ids, chain), "evalsha"),
            Operation(
                "no record",
                n,
                lambda: unrecorded(keys=[write.keys.kv, write.keys.meta], args=["", *flat]),
                "evalsha",
            ),
            None,
        ),
        (
            "floor: HSET in a minimal script",
            Operation(
                "script HSET", n, lambda: hset_floor(keys=[f.floor_key], args=flat), "evalsha"
            ),
            Operation("HSET", n, lambda: client.hset(f.raw_key, items=flat), "hset"),
            None,
        ),
        (
            "floor: HDEL in a minimal script",
            Operation(
                "script HDEL",
                n,
                lambda: hdel_floor(keys=[f.floor_key], args=chain),
                "evalsha",
                f.refill_floor,
            ),
            Operation("HDEL", n, lambda: client.hdel(f.raw_key, *chain), "hdel", f.refill_raw),
            None,
        ),
        (
            "evict_kv with Mamba cascade (1 in 8)",
            Operation("evict", n, lambda: write.evict_kv(chain), "evalsha", f.refill),
            Operation("HDEL", n, lambda: client.hdel(f.raw_key, *chain), "hdel", f.refill_raw),
            Operation("local", n, lambda: f.local.evict_kv(chain), "", f.refill_local),
        ),
    ]


def _mamba_rows(f: _Fixture) -> list[Row]:
    """The Mamba reads (farthest match, backoff to half) against HMGET."""
    client, n, chain, full, local = f.client, f.n, f.chain, f.full, f.local
    mamba, backoff = full.keys.mamba, max(1, n // 2)
    return [
        (
            "match_mamba_farthest",
            Operation("mamba match", n, lambda: full.match_mamba_farthest(chain), "hmget"),
            Operation("HMGET", n, lambda: client.hmget(mamba, chain), "hmget"),
            Operation("local", n, lambda: local.match_mamba_farthest(chain), ""),
        ),
        (
            "find_mamba_backoff (half)",
            Operation("backoff", n, lambda: full.find_mamba_backoff(chain, backoff), "hmget"),
            Operation("HMGET", n, lambda: client.hmget(mamba, chain[:backoff]), "hmget"),
            Operation("local", n, lambda: local.find_mamba_backoff(chain, backoff), ""),
        ),
    ]


def _score_rows(client: Any, n: int) -> tuple[Operation, Operation, Operation]:
    """Routing from Redis over 16 namespaces at size n (a router without a fleet view:
    one ``score.lua`` per namespace), against one match_kv_prefix and one PING."""
    chain = [2**60 + n * 100_000 + i for i in range(n)]
    names = []
    for i in range(SCORE_NAMESPACES):
        reg = PrefixCacheRegistry(client, f"bench-route-{n}-{i}", key_prefix="pcr-bench")
        reg.claim(lease_ttl=3600)
        client.hset(reg.keys.kv, items=_filler(n * 100 + i))
        cached = n * (i + 1) // SCORE_NAMESPACES
        reg.register_kv(range(cached), chain[:cached])
        reg.register_mamba(range(0, cached, 8), chain[:cached:8])  # a checkpoint every 8 blocks
        names.append(reg.namespace)
    one = PrefixCacheRegistry(client, names[-1], key_prefix="pcr-bench")
    router = PrefixRouter(client, "pcr-bench")
    router.score(chain, names)  # loads the script
    return (
        Operation("score 16", n, lambda: router.score(chain, names), "evalsha"),
        Operation("match", n, lambda: one.match_kv_prefix(chain), "hmget"),
        Operation("PING", n, client.ping, "ping"),
    )


def _measure(ops: list[Operation], effort: Effort) -> None:
    """Client latency, interleaved by rounds."""
    for _ in range(effort.rounds):
        for op in ops:
            round_samples = []
            for _ in range(effort.calls_at(op.n)):
                if op.setup is not None:
                    op.setup()
                start = time.perf_counter()
                op.run()
                round_samples.append((time.perf_counter() - start) * 1000)
            op.samples.extend(round_samples)
            op.round_medians.append(statistics.median(round_samples))


def _measure_server(client: Any, ops: list[Operation], effort: Effort) -> None:
    """Server microseconds per call, from INFO commandstats.

    An operation without setup runs ``server_calls`` times between one CONFIG RESETSTAT
    and one INFO (an INFO between calls would disturb the caches it measures); one with
    a setup (whose own commands would be counted) is read around each call. Operations
    are interleaved over three rounds, and the rounds averaged.
    """
    measured = [op for op in ops if op.command]
    totals = dict.fromkeys(range(len(measured)), 0.0)
    rounds = 3
    for _ in range(rounds):
        for index, op in enumerate(measured):
            usec = 0.0
            if op.setup is None:
                op.run()  # warm up: the first call after other work runs on cold caches
                client.config_resetstat()
                for _ in range(effort.server_calls):
                    op.run()
                usec = float(
                    client.info("commandstats").get(f"cmdstat_{op.command}", {}).get("usec", 0)
                )
            else:
                for _ in range(effort.server_calls):
                    op.setup()
                    client.config_resetstat()
                    op.run()
                    stats = client.info("commandstats").get(f"cmdstat_{op.command}", {})
                    usec += float(stats.get("usec", 0))
            totals[index] += usec / effort.server_calls
    for index, op in enumerate(measured):
        op.server_us = totals[index] / rounds


def _throughput_worker(
    url: str, key: str, hashes: list[int], use_registry: bool, seconds: float, out: Any
) -> None:
    client = redis.Redis.from_url(url)
    registry = PrefixCacheRegistry(client, key)
    kv = registry.keys.kv
    done = 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for _ in range(20):
            if use_registry:
                registry.match_kv_prefix(hashes)
            else:
                client.hmget(kv, hashes)
        done += 20
    out.put(done / seconds)
    client.close()


def _throughput(url: str, effort: Effort, processes: int = 4) -> dict[str, float]:
    """Calls per second of match_kv_prefix and raw HMGET (n=64) from 4 processes."""
    n = 64
    hashes = [2**62 + 64 * 100_000 + i for i in range(n)]  # bench-full-64's chain
    context = multiprocessing.get_context("fork")
    results: dict[str, list[float]] = {"match_kv_prefix": [], "HMGET": []}
    for _ in range(2):  # alternate, twice
        for label, use_registry in (("match_kv_prefix", True), ("HMGET", False)):
            queue = context.Queue()
            workers = [
                context.Process(
                    target=_throughput_worker,
                    args=(
                        url,
                        f"bench-full-{n}",
                        hashes,
                        use_registry,
                        effort.throughput_seconds,
                        queue,
                    ),
                )
                for _ in range(processes)
            ]
            for worker in workers:
                worker.start()
            total = sum(queue.get(timeout=60) for _ in workers)
            for worker in workers:
                worker.join(10)
            results[label].append(total)
    return {label: statistics.median(values) for label, values in results.items()}


def _listener_latency(url: str, effort: Effort) -> dict[str, float] | None:
    """Eviction (from another registry object) to slot freed by the listener, in ms."""
    try:
        from gpu import EvictionListener, MambaSlotPool  # torch: the gpu extra
    except ImportError:
        return None
    client = redis.Redis.from_url(url)
    registry = PrefixCacheRegistry(client, "bench-listener")
    registry.reset()
    count = effort.listener_evictions
    freed_at: dict[int, float] = {}
    pool = MambaSlotPool(
        registry,
        count,
        1,
        (4,),
        (4,),
        on_free=lambda pairs: freed_at.update(
            dict.fromkeys((h for _, h in pairs), time.perf_counter())
        ),
    )
    hashes = [3 * 10**15 + i for i in range(count)]
    zeros = pool.conv_states.new_zeros((1, count, 4))  # the pool's dtype and device
    pool.store(list(range(count)), hashes, zeros, zeros.clone())
    evictor_client = redis.Redis.from_url(url)
    evictor = PrefixCacheRegistry(evictor_client, "bench-listener")
    sent: dict[int, float] = {}
    with EvictionListener(client, "bench-listener", pool):
        for h in hashes:
            sent[h] = time.perf_counter()
            evictor.evict_mamba([h])
            time.sleep(0.001)
        deadline = time.monotonic() + 10
        while len(freed_at) < count and time.monotonic() < deadline:
            time.sleep(0.005)
    latencies = sorted((freed_at[h] - sent[h]) * 1000 for h in hashes if h in freed_at)
    evictor_client.close()
    client.close()
    if len(latencies) < count:
        return {"p50_ms": float("nan"), "p99_ms": float("nan"), "missing": count - len(latencies)}
    return {
        "p50_ms": statistics.median(latencies),
        "p99_ms": latencies[min(count - 1, int(count * 0.99))],
        "missing": 0,
    }


def run(url: str, *, quick: bool = False, sizes: tuple[int, ...] = SIZES) -> dict[str, Any]:
    """Measure everything against the (standalone) server at ``url``."""
    effort = QUICK if quick else FULL
    client = redis.Redis.from_url(url)
    client.flushdb()
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    scores: dict[int, tuple[Operation, Operation, Operation]] = {}
    for n in sizes:
        table = _operations(client, n)
        ops = [op for _, ours, raw, local in table for op in (ours, raw, local) if op is not None]
        if n in (64, 512):
            scores[n] = _score_rows(client, n)
            ops.extend(scores[n])
        _measure(ops, effort)
        _measure_server(client, ops, effort)
        for label, ours, raw, local in table:
            rows.append(_row(label, n, ours, raw, local))
        if n in scores:
            score, match, ping = scores[n]
            rows.append(
                _row(
                    f"score over {SCORE_NAMESPACES} namespaces (vs 1 match)", n, score, match, None
                )
            )
            rows.append(_row("PING", n, ping, ping, None))
    throughput = _throughput(url, effort)
    listener = _listener_latency(url, effort)
    bridge = bridge_bench.measure(url, quick=quick)
    serve = serve_bench.measure(url, quick=quick)
    mirror = mirror_bench.measure(url, quick=quick)
    client.flushdb()
    client.close()
    report = {
        "quick": quick,
        "rows": rows,
        "throughput_4_processes_n64": throughput,
        "listener_notice_to_free_ms": listener,
        "bridge": bridge,
        "serve": serve,
        "mirror": mirror,
        "seconds": round(time.perf_counter() - started, 1),
    }
    report["targets"] = _targets(report)
    return report


def _row(
    label: str, n: int, ours: Operation, raw: Operation, local: Operation | None
) -> dict[str, Any]:
    return {
        "operation": label,
        "n": n,
        "p50_ms": round(ours.p50, 4),
        "p99_ms": round(ours.p99, 4),
        "server_us": None if ours.server_us is None else round(ours.server_us, 1),
        "baseline": raw.name,
        "baseline_p50_ms": round(raw.p50, 4),
        "baseline_server_us": None if raw.server_us is None else round(raw.server_us, 1),
        "client_ratio": round(ours.p50 / raw.p50, 3),
        "server_ratio": (
            round(ours.server_us / raw.server_us, 3) if ours.server_us and raw.server_us else None
        ),
        "local_p50_ms": None if local is None else round(local.p50, 5),
        "local_ratio": None if local is None else round(ours.p50 / local.p50, 1),
    }


def _find(report: dict[str, Any], operation: str, n: int) -> dict[str, Any]:
    return next(r for r in report["rows"] if r["operation"].startswith(operation) and r["n"] == n)


# (target, row name prefix, n, ratio column, upper limit): the project's ratio targets.
RATIO_TARGETS = [
    *[
        (f"match_kv_prefix full hit, client p50 / HMGET, n={n}", "match_kv_prefix, full", n,
         "client_ratio", limit)
        for n, limit in ((64, 1.15), (512, 1.3), (8192, 1.5))
    ],
    *[
        (f"match_kv_prefix full hit, server time / HMGET, n={n}", "match_kv_prefix, full", n,
         "server_ratio", 1.5)
        for n in (512, 8192)
    ],
    ("register_kv, client p50 / HSET, n=64", "register_kv", 64, "client_ratio", 1.2),
    ("request ids: register_kv server time / without, n=64", "request ids", 64,
     "server_ratio", 1.5),
    ("evict_kv with cascade, client p50 / HDEL, n=64", "evict_kv", 64, "client_ratio", 1.2),
    ("score over 16 namespaces / one match_kv_prefix, n=512", "score", 512, "client_ratio", 2.0),
]  # fmt: skip


BRIDGE_BLOCKS_PER_S = 50_000
"""The bridge's target: stored blocks per second from an engine into Redis."""
ASYNC_ROUTER_RATIO = 1.2
"""The asyncio router's target: its score at most this times the sync router's."""


def _targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target of the project with the measured value and whether it is met."""
    sizes = {r["n"] for r in report["rows"]}
    checks: list[tuple[str, float | None, str, float]] = [
        (name, _find(report, row, n)[column], "≤", limit)
        for name, row, n, column, limit in RATIO_TARGETS
        if n in sizes
    ]
    listener = report["listener_notice_to_free_ms"]
    if listener is not None:
        checks.append(("listener notice-to-free p99 (ms)", listener["p99_ms"], "≤", 5.0))
    throughput = report["throughput_4_processes_n64"]
    ratio = round(throughput["match_kv_prefix"] / throughput["HMGET"], 3)
    checks.append(("4-process throughput, match_kv_prefix / HMGET, n=64", ratio, "≥", 0.8))
    bridge = report.get("bridge")
    if bridge is not None and "skipped" not in bridge:  # a failed run shows as not met
        checks.append(
            (
                "bridge stored blocks/s (16-block events, 8 per batch)",
                bridge.get("stored_blocks_per_s"),
                "≥",
                BRIDGE_BLOCKS_PER_S,
            )
        )
    serve = report.get("serve")
    if serve is not None and "skipped" not in serve:
        checks.append(
            (
                "AsyncPrefixRouter / PrefixRouter score p50, n=512, 16 namespaces",
                serve.get("async_over_sync"),
                "≤",
                ASYNC_ROUTER_RATIO,
            )
        )
    checks.extend(mirror_bench.targets(report.get("mirror")))
    return [
        {
            "target": name,
            "measured": value,
            "limit": f"{sign} {limit}",
            "met": value is not None and (value <= limit if sign == "≤" else value >= limit),
        }
        for name, value, sign, limit in checks
    ]


OPERATION_HEADERS = [
    "operation",
    "n",
    "p50 ms",
    "p99 ms",
    "server µs",
    "baseline",
    "base p50",
    "base µs",
    "client x",
    "server x",
    "local x",
]
"""The columns of the operations' table."""


def _operation_row(r: dict[str, Any]) -> list[Any]:
    """One row of the operations' table."""
    return [
        r["operation"],
        r["n"],
        f"{r['p50_ms']:.3f}",
        f"{r['p99_ms']:.3f}",
        r["server_us"],
        r["baseline"],
        f"{r['baseline_p50_ms']:.3f}",
        r["baseline_server_us"],
        f"{r['client_ratio']:.2f}",
        "-" if r["server_ratio"] is None else f"{r['server_ratio']:.2f}",
        "-" if r["local_ratio"] is None else f"{r['local_ratio']:.0f}",
    ]


def format_report(report: dict[str, Any]) -> str:
    """The report as text tables."""

    lines = [format_table(OPERATION_HEADERS, [_operation_row(r) for r in report["rows"]])]
    throughput = report["throughput_4_processes_n64"]
    lines.append("")
    lines.append(
        f"4 processes, n=64: match_kv_prefix {throughput['match_kv_prefix']:,.0f} calls/s, "
        f"HMGET {throughput['HMGET']:,.0f} calls/s"
    )
    listener = report["listener_notice_to_free_ms"]
    if listener is None:
        lines.append("listener notice-to-free: skipped (needs the gpu extra: torch)")
    else:
        p50, p99 = listener["p50_ms"], listener["p99_ms"]
        lines.append(f"listener notice-to-free: p50 {p50:.3f} ms, p99 {p99:.3f} ms")
    lines.extend(bridge_bench.format_rows(report.get("bridge")))
    lines.extend(serve_bench.format_rows(report.get("serve")))
    lines.extend(mirror_bench.format_rows(report.get("mirror")))
    lines.append("")
    lines.append(
        format_table(
            ["target", "measured", "limit", "met"],
            [
                [t["target"], t["measured"], t["limit"], "yes" if t["met"] else "NO"]
                for t in report["targets"]
            ],
        )
    )
    lines.append(f"\n{'quick' if report['quick'] else 'full'} run, {report['seconds']} s")
    return "\n".join(lines)
