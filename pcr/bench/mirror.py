"""``pcr bench``'s mirror rows: an owner's registry answered locally, written behind.

- **Engine cycle.** Per admitted request, what an engine's scheduler calls: match the KV
  prefix of a 16-block prompt (8 blocks shared with every other prompt, 8 new), match
  Mamba, register the 8 new blocks and one Mamba checkpoint, evict the two oldest blocks.
  ``REQUESTS`` requests in a row on ``LocalPrefixCacheRegistry``, a ``MirroredRegistry``
  (its flusher live, writing behind to the server) and a claimed ``PrefixCacheRegistry``,
  in interleaved rounds; each figure is the median over rounds of the mean time per
  request. The mirror's writes are flushed between rounds (not timed).
- **Publish to visible.** The mirrored owner registers a fresh prompt's blocks; this
  process then polls ``PrefixRouter.score`` (a router reading Redis) until the whole
  prompt is visible. Samples ``SAMPLE_GAP`` apart, at the mirror's default settings.
- **Flush throughput.** ``FLUSH_WRITES`` single-block ``register_kv`` writes queued with
  the flusher stopped, then ``flush()``: registry writes per second into one Redis, in
  batches of the default size, one round trip each.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import redis

from registry import (
    LocalPrefixCacheRegistry,
    MirroredRegistry,
    PrefixCacheRegistry,
    PrefixRouter,
    RegistryBase,
)

KEY_PREFIX = "pcr-bench-mirror"
REQUESTS = 300
SHARED_BLOCKS = 8
NEW_BLOCKS = 8
EVICTED = 2
SAMPLE_GAP = 0.002
PHASE_TIMEOUT = 10.0

CYCLE_RATIO = 2.0
"""Target: the mirrored engine cycle at most this times the in-process registry's."""
LAG_P99_MS = 5.0
"""Target: publish-to-visible p99 for a router reading Redis, at the default settings."""
FLUSH_WRITES_PER_S = 100_000
"""Target: registry writes per second one owner flushes into one Redis."""


class _Prompts:
    """Prompts of ``SHARED_BLOCKS`` common blocks and ``NEW_BLOCKS`` fresh ones."""

    def __init__(self, base: int) -> None:
        self.next = base
        self.shared = self.fresh(SHARED_BLOCKS)

    def fresh(self, n: int) -> list[int]:
        first = self.next
        self.next += n
        return list(range(first, first + n))

    def prompt(self) -> list[int]:
        return self.shared + self.fresh(NEW_BLOCKS)


def _cycles(registry: RegistryBase, prompts: list[list[int]]) -> float:
    """Run the engine cycle once per prompt; seconds per request."""
    resident: list[int] = []
    next_block = 0
    started = time.perf_counter()
    for hashes in prompts:
        block_ids, _last = registry.match_kv_prefix(hashes)
        registry.match_mamba_farthest(hashes)
        new = hashes[len(block_ids) :]
        ids = list(range(next_block, next_block + len(new)))
        next_block += len(new)
        registry.register_kv(ids, new)
        registry.register_mamba([ids[-1]], [new[-1]])
        resident.extend(new[-NEW_BLOCKS:])  # the shared blocks stay
        registry.evict_kv(resident[:EVICTED])
        del resident[:EVICTED]
    return (time.perf_counter() - started) / len(prompts)


def _engine_cycle(url: str, rounds: int) -> dict[str, Any]:
    local = LocalPrefixCacheRegistry()
    mirrored = MirroredRegistry.from_url(url, "bench-mirror", key_prefix=KEY_PREFIX)
    remote = PrefixCacheRegistry.from_url(url, "bench-remote", key_prefix=KEY_PREFIX)
    mirrored.claim()
    remote.claim()
    remote.load_scripts()
    times: dict[str, list[float]] = {"local": [], "mirrored": [], "redis": []}
    try:
        for round_ in range(rounds):
            prompts_source = _Prompts(1 + round_ * 10**7)
            prompts = [prompts_source.prompt() for _ in range(REQUESTS)]
            for name, registry in (("local", local), ("mirrored", mirrored), ("redis", remote)):
                registry.reset()
                if name == "mirrored":
                    mirrored.flush()
                times[name].append(_cycles(registry, prompts))
            mirrored.flush()
        counts = mirrored.counts()
    finally:
        mirrored.close()
    local_us = statistics.median(times["local"]) * 1e6
    mirrored_us = statistics.median(times["mirrored"]) * 1e6
    redis_us = statistics.median(times["redis"]) * 1e6
    return {
        "requests": REQUESTS,
        "rounds": rounds,
        "local_us": round(local_us, 1),
        "mirrored_us": round(mirrored_us, 1),
        "redis_us": round(redis_us, 1),
        "mirrored_over_local": round(mirrored_us / local_us, 2),
        "redis_over_local": round(redis_us / local_us, 1),
        "batches": counts.batches,
        "flushed": counts.flushed,
    }


def _visibility(url: str, samples: int) -> dict[str, Any]:
    client = redis.Redis.from_url(url)
    mirrored = MirroredRegistry(client, "bench-visible", key_prefix=KEY_PREFIX)
    router = PrefixRouter(client, key_prefix=KEY_PREFIX)
    mirrored.claim()
    prompts = _Prompts(5 * 10**9)
    latencies: list[float] = []
    polls = 0
    next_id = 0
    try:
        for _ in range(samples):
            hashes = prompts.prompt()
            router.score(hashes, [mirrored.namespace])  # warm
            time.sleep(SAMPLE_GAP)
            started = time.perf_counter()
            mirrored.register_kv(list(range(next_id, next_id + len(hashes))), hashes)
            next_id += len(hashes)
            while True:
                polls += 1
                score = router.score(hashes, [mirrored.namespace]).get(mirrored.namespace)
                if score is not None and score.kv_prefix >= len(hashes):
                    break
                if time.perf_counter() - started > PHASE_TIMEOUT:
                    raise RuntimeError("a mirrored write never became visible to the router")
            latencies.append((time.perf_counter() - started) * 1000)
            mirrored.evict_kv(hashes[SHARED_BLOCKS:])
    finally:
        mirrored.close()
        client.close()
    latencies.sort()
    return {
        "p50_ms": round(statistics.median(latencies), 3),
        "p99_ms": round(latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))], 3),
        "max_ms": round(latencies[-1], 3),
        "samples": len(latencies),
        "polls_per_sample": round(polls / len(latencies), 1),
    }


def _flush_throughput(url: str, writes: int) -> dict[str, Any]:
    client = redis.Redis.from_url(url)
    mirrored = MirroredRegistry(client, "bench-flush", key_prefix=KEY_PREFIX, max_queue=writes + 1)
    mirrored.claim()
    mirrored.load_scripts()
    mirrored.stop_flusher()
    try:
        for i in range(writes):
            mirrored.register_kv([i], [i + 1])
        before = mirrored.counts()
        started = time.perf_counter()
        mirrored.flush()
        elapsed = time.perf_counter() - started
        after = mirrored.counts()
        assert after.flushed - before.flushed == writes
    finally:
        mirrored.close()
        client.close()
    return {
        "writes": writes,
        "batch": mirrored.max_batch,
        "batches": after.batches - before.batches,
        "writes_per_s": round(writes / elapsed),
    }


def measure(url: str, *, quick: bool = False) -> dict[str, Any]:
    """The mirror rows against the standalone server at ``url`` (``{"error": what}`` when
    a phase failed)."""
    try:
        return {
            "engine_cycle": _engine_cycle(url, 2 if quick else 7),
            "publish_to_visible": _visibility(url, 50 if quick else 1000),
            "flush": _flush_throughput(url, 5_000 if quick else 200_000),
        }
    except Exception as exc:  # a report row, never a traceback
        return {"error": f"{type(exc).__name__}: {exc}"}


def targets(rows: dict[str, Any] | None) -> list[tuple[str, float | None, str, float]]:
    """The mirror's targets: (name, measured, sign, limit)."""
    if rows is None:
        return []
    cycle = rows.get("engine_cycle", {})
    visible = rows.get("publish_to_visible", {})
    flush = rows.get("flush", {})
    return [
        ("mirrored engine cycle / in-process registry", cycle.get("mirrored_over_local"), "≤",
         CYCLE_RATIO),
        ("mirror publish to visible in score p99 (ms)", visible.get("p99_ms"), "≤", LAG_P99_MS),
        ("mirror flush, registry writes/s into one Redis", flush.get("writes_per_s"), "≥",
         FLUSH_WRITES_PER_S),
    ]  # fmt: skip


def format_rows(rows: dict[str, Any] | None) -> list[str]:
    if rows is None:
        return []
    if "error" in rows:
        return [f"mirror: failed ({rows['error']})"]
    cycle, visible, flush = rows["engine_cycle"], rows["publish_to_visible"], rows["flush"]
    return [
        f"engine cycle per admitted request ({cycle['requests']} requests, median of "
        f"{cycle['rounds']} rounds): in-process {cycle['local_us']:.1f} µs, mirrored "
        f"{cycle['mirrored_us']:.1f} µs ({cycle['mirrored_over_local']:.2f}x), Redis "
        f"{cycle['redis_us']:.1f} µs ({cycle['redis_over_local']:.1f}x)",
        f"mirror publish to visible in score: p50 {visible['p50_ms']:.3f} ms, "
        f"p99 {visible['p99_ms']:.3f} ms ({visible['samples']} samples)",
        f"mirror flush: {flush['writes_per_s']:,} registry writes/s ({flush['writes']:,} "
        f"writes, {flush['batches']} batches of up to {flush['batch']})",
    ]
