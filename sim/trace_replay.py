"""A trace replayed through simulated vLLM engines in simulated time (``pcr simulate
--trace``): deterministic, in seconds, with no process, socket or Redis.

Each engine is a ``sim.engine_cache.EngineCache`` (vLLM's block pool) with at most
``max_running`` requests running and the rest waiting in arrival order; a prefill takes
``prefill_ms`` per block it computes, and ends no sooner than the prefills computing the
blocks it hits (a request that hits a prompt still being prefilled waits for it); each
token after the first takes ``decode_ms``; the engine publishes its events when a
prefill ends (the step that computed the blocks).
A block's hash is its prefix key (``sim.trace.prefix_keys``), the same for every
engine, so a router's view needs no hashing.

The routers see what a registry fed by the engines' events would list (the
*published* view: a block counts from the end of the prefill that cached it until its
eviction is published), never the engines' caches themselves:

* ``round-robin``;
* ``least-load``: the fewest requests running and waiting;
* ``prefix``: the least estimated time to first token, the prompt's uncached blocks by
  the published view priced at ``prefill_ms`` plus the work queued ahead on the engine;
* ``prefix+pending``: the same, also counting as cached the blocks of requests sent to
  the engine whose prefill has not been published yet (what issue 44 proposes: the
  registry hears of a prompt's blocks only after the engine has prefilled them).

These are the simulation's own rules, not ``pcr gateway``'s (that is measured on the
simulated engines over HTTP by ``make bench-trace``). Figures: the hit rate as the
engines count it (hit tokens over prompt tokens), its fraction of one infinite cache's
(``sim.trace.ideal``), the balance (most requests on one engine over the mean) and the
simulated TTFT.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sim.engine_cache import Admission, Cleared, EngineCache, Removed, Stored
from sim.trace import PromptMaker, TraceRequest, full_blocks, hit_limit, ideal, prefix_keys

POLICIES = ("round-robin", "least-load", "prefix", "prefix+pending")


@dataclass(frozen=True)
class ReplayConfig:
    """The simulated fleet and its service times."""

    engines: int = 8
    kv_blocks: int | None = None
    """Blocks per engine; None: ``cache_fraction`` of the window's distinct complete
    blocks, divided among the engines (at least what its largest request needs)."""
    cache_fraction: float = 0.25
    block_size: int = 16
    max_running: int = 2
    prefill_ms: float = 6.0
    decode_ms: float = 4.0
    max_output_tokens: int = 16

    def blocks_per_engine(self, distinct_blocks: int, largest: int = 1) -> int:
        """``kv_blocks``, or the share of ``distinct_blocks`` but at least ``largest``
        (the blocks the largest request holds while it runs)."""
        if self.kv_blocks is not None:
            return self.kv_blocks
        share = math.ceil(distinct_blocks * self.cache_fraction / self.engines)
        return max(1, largest, share)


def check_replay_config(config: ReplayConfig) -> None:
    """``ValueError`` naming the first field out of range."""
    for name in ("engines", "block_size", "max_running", "max_output_tokens"):
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, not {value!r}")
    if config.kv_blocks is not None and (
        not isinstance(config.kv_blocks, int) or config.kv_blocks < 1
    ):
        raise ValueError(f"kv_blocks must be an integer >= 1, not {config.kv_blocks!r}")
    for name in ("prefill_ms", "decode_ms"):
        value = getattr(config, name)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a number >= 0, not {value!r}")
    if not 0 < config.cache_fraction <= 1e6:
        raise ValueError(f"cache_fraction must be > 0, not {config.cache_fraction!r}")


@dataclass
class _Job:
    number: int
    arrival: float
    keys: list[int]
    """Its complete blocks' hashes (prefix keys)."""
    prompt: int
    generated: int
    admission: Admission | None = None
    first: float = 0.0


@dataclass
class _Engine:
    cache: EngineCache
    waiting: deque[_Job] = field(default_factory=deque)
    running: list[_Job] = field(default_factory=list)
    published: Counter[int] = field(default_factory=Counter)
    pending: Counter[int] = field(default_factory=Counter)
    ready: dict[int, float] = field(default_factory=dict)
    """Block id -> when the prefill computing it ends."""
    served: int = 0
    assigned: int = 0

    def outstanding(self) -> int:
        return len(self.waiting) + len(self.running)


class _Replay:
    """One policy's run."""

    def __init__(self, config: ReplayConfig, blocks: int, policy: str) -> None:
        self.config = config
        self.policy = policy
        self.engines = [
            _Engine(EngineCache(blocks, config.block_size)) for _ in range(config.engines)
        ]
        self.clock = 0.0
        self.events: list[tuple[float, int, str, Any]] = []
        self.order = itertools.count()
        self.sent = 0
        self.ttfts: list[float] = []

    def at(self, when: float, kind: str, what: Any) -> None:
        heapq.heappush(self.events, (when, next(self.order), kind, what))

    def run(self, jobs: list[_Job]) -> None:
        for job in jobs:
            self.at(job.arrival, "arrive", job)
        while self.events:
            self.clock, _, kind, what = heapq.heappop(self.events)
            if kind == "arrive":
                engine = self.engines[self.route(what)]
                engine.waiting.append(what)
                if self.policy == "prefix+pending":
                    engine.pending.update(what.keys)
                self.start(engine)
            elif kind == "prefilled":
                engine, job = what
                self.publish(engine)
                if self.policy == "prefix+pending":
                    engine.pending.subtract(job.keys)
                job.first = self.clock
                self.ttfts.append(self.clock - job.arrival)
                self.at(
                    self.clock + (job.generated - 1) * self.config.decode_ms / 1000, "done", what
                )
            else:
                engine, job = what
                assert job.admission is not None
                engine.cache.release(job.admission)
                engine.running.remove(job)
                engine.served += 1
                self.start(engine)

    def start(self, engine: _Engine) -> None:
        config = self.config
        while engine.waiting and len(engine.running) < config.max_running:
            job = engine.waiting[0]
            if not engine.cache.fits(job.keys, job.prompt, job.generated):
                return
            engine.waiting.popleft()
            admission = job.admission = engine.cache.admit(
                job.keys, range(job.prompt), job.generated
            )
            engine.running.append(job)
            hits = admission.blocks[: admission.hit_blocks]
            end = max(
                self.clock + admission.computed_blocks * config.prefill_ms / 1000,
                max((engine.ready.get(b, 0.0) for b in hits), default=0.0),
            )
            for block in admission.blocks[admission.hit_blocks :]:
                engine.ready[block] = end
            self.at(end, "prefilled", (engine, job))

    def publish(self, engine: _Engine) -> None:
        """The step ended: the registry learns the engine's events."""
        for event in engine.cache.take_events():
            if isinstance(event, Stored):
                engine.published.update(event.hashes)
            elif isinstance(event, Removed):
                engine.published.subtract(event.hashes)
            elif isinstance(event, Cleared):
                engine.published.clear()

    def route(self, job: _Job) -> int:
        """The engine for ``job``; ties go to the engine sent the fewest requests."""
        self.sent += 1
        engines = self.engines
        if self.policy == "round-robin":
            chosen = (self.sent - 1) % len(engines)
        elif self.policy == "least-load":
            chosen = min(
                range(len(engines)),
                key=lambda i: (engines[i].outstanding(), engines[i].assigned, i),
            )
        else:
            chosen = min(range(len(engines)), key=lambda i: (*self.cost(i, job), i))
        engines[chosen].assigned += 1
        return chosen

    def cost(self, index: int, job: _Job) -> tuple[float, int, int]:
        """Estimated seconds to the first token on engine ``index``, then its load."""
        config, engine = self.config, self.engines[index]
        limit = min(len(job.keys), hit_limit(job.prompt, config.block_size))
        cached = 0
        pending = self.policy == "prefix+pending"
        while cached < limit and (
            engine.published[job.keys[cached]] > 0
            or (pending and engine.pending[job.keys[cached]] > 0)
        ):
            cached += 1
        blocks = math.ceil(job.prompt / config.block_size) - cached
        ahead = 0.0
        for other in engine.waiting:
            other_blocks = math.ceil(other.prompt / config.block_size)
            ahead += other_blocks * config.prefill_ms + other.generated * config.decode_ms
        if len(engine.running) >= config.max_running:
            ahead += min((o.generated * config.decode_ms for o in engine.running), default=0.0)
        estimate = blocks * config.prefill_ms + ahead / config.max_running
        return estimate, engine.outstanding(), engine.assigned


def _quantile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def replay(
    requests: Sequence[TraceRequest],
    arrivals: Sequence[float],
    config: ReplayConfig,
    policies: Sequence[str] = POLICIES,
) -> dict[str, Any]:
    """Replay ``requests`` arriving at ``arrivals`` (seconds) under each policy; the
    figures, the ideal and the fleet's sizes."""
    check_replay_config(config)
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}: choose from {', '.join(POLICIES)}")
    if len(arrivals) != len(requests):
        raise ValueError(f"{len(arrivals)} arrivals for {len(requests)} requests")
    best = ideal(requests, config.block_size)
    maker = PromptMaker(config.block_size)
    cap = config.max_output_tokens
    largest = max(
        math.ceil((maker.prompt_length(r) + max(1, min(r.output_length, cap))) / config.block_size)
        for r in requests
    )
    blocks = config.blocks_per_engine(best.distinct_blocks, largest)
    chains = list(prefix_keys(requests))
    runs = []
    for policy in policies:
        jobs = [
            _Job(
                n,
                at,
                chain[: full_blocks(request, maker)],
                maker.prompt_length(request),
                max(1, min(request.output_length, config.max_output_tokens)),
            )
            for n, (request, at, chain) in enumerate(zip(requests, arrivals, chains, strict=True))
        ]
        too_big = [
            j for j in jobs if math.ceil((j.prompt + j.generated) / config.block_size) > blocks
        ]
        if too_big:
            raise ValueError(
                f"request {requests[too_big[0].number].line} needs more than the {blocks} "
                "blocks of an engine's cache: give more KV blocks"
            )
        run = _Replay(config, blocks, policy)
        run.run(jobs)
        queries = sum(e.cache.queries for e in run.engines)
        hits = sum(e.cache.hits for e in run.engines)
        served = [e.served for e in run.engines]
        rate = hits / queries if queries else 0.0
        runs.append(
            {
                "policy": policy,
                "hit_rate": round(rate, 4),
                "ideal_fraction": round(rate / best.hit_rate, 3) if best.hit_rate else None,
                "requests_per_engine": served,
                "balance": round(max(served) * len(served) / sum(served), 2),
                "ttft_p50_ms": _ms(_quantile(run.ttfts, 0.5)),
                "ttft_p99_ms": _ms(_quantile(run.ttfts, 0.99)),
                "seconds": round(run.clock, 2),
            }
        )
    return {
        "requests": len(requests),
        "engines": config.engines,
        "kv_blocks_per_engine": blocks,
        "distinct_blocks": best.distinct_blocks,
        "ideal_hit_rate": round(best.hit_rate, 4),
        "runs": runs,
    }


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 1)
