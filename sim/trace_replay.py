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

* ``gateway``: ``pcr gateway``'s own rule (``registry.routing.balance.ranked``, the code
  the gateway runs, with ``ReplayConfig.rule``'s weights) from what the gateway would
  know: the published view with the pending blocks, its requests in flight and their
  uncached tokens, each engine's waiting queue, the recent work and the prompts' kin;
* ``cache-aware``: vllm-router ``cache_aware`` at its defaults on a trace: the longest
  match in each engine's tree of sent blocks, over ``CACHE_THRESHOLD`` of the prompt
  there, else the engine with the smallest tree.

``prefix`` and ``prefix+pending`` are the simulation's own rules; ``make bench-trace``
measures the real gateway and routers over HTTP. Each run also says where hits went
against the infinite cache (``lost``, tokens): ``evicted`` (no engine held them),
``away`` (another engine listed a longer prefix than the chosen one; ``requests_away``,
and for ``gateway`` ``away_queue`` / ``away_spread`` / ``away_kin``, the term that
decided), and ``copies``, the mean engines holding each cached block at the end.
Figures: the hit rate as the engines count it (hit tokens over prompt tokens), its
fraction of one infinite cache's
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

from registry.routing.balance import BackendLoad, BalanceRule, Choice, Kin, cached_tokens, ranked
from sim.engine_cache import Admission, Cleared, EngineCache, Removed, Stored
from sim.trace import PromptMaker, TraceRequest, full_blocks, hit_limit, ideal, prefix_keys

POLICIES = ("round-robin", "least-load", "prefix", "prefix+pending", "gateway", "cache-aware")
CACHE_THRESHOLD = 0.3
"""vllm-router ``cache_aware``'s default: a prompt whose best match in a worker's tree of
sent text is over this share of it goes to that worker, else to the smallest tree."""


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
    rule: BalanceRule = field(default_factory=BalanceRule)
    """The ``gateway`` policy's weights (``pcr gateway``'s options)."""

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
    prefill: int = 0
    """Its uncached prompt tokens as the router predicted them (the gateway's load)."""


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
    load: BackendLoad = field(default_factory=BackendLoad)
    """What the gateway knows of its load (the ``gateway`` policy)."""
    sent: set[int] = field(default_factory=set)
    """The blocks sent to it (the ``cache-aware`` policy's tree of sent text)."""
    tree: int = 0
    """Tokens in that tree."""

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
        self.kin = Kin()
        self.seen: set[int] = set()
        self.counts: Counter[str] = Counter()
        """Where hits were lost (``diagnose``)."""

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
                if self.policy in ("prefix+pending", "gateway"):
                    engine.pending.update(what.keys)
                self.start(engine)
            elif kind == "prefilled":
                engine, job = what
                self.publish(engine)
                if self.policy in ("prefix+pending", "gateway"):
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
                engine.load.in_flight -= 1
                engine.load.pending = max(0.0, engine.load.pending - job.prefill)
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
        views = [self.viewed(e, job) for e in engines]
        if self.policy == "gateway":
            chosen = self.balance(job, views)
        elif self.policy == "cache-aware":
            chosen = self.cache_aware(job)
        elif self.policy == "round-robin":
            chosen = (self.sent - 1) % len(engines)
        elif self.policy == "least-load":
            chosen = min(
                range(len(engines)),
                key=lambda i: (engines[i].outstanding(), engines[i].assigned, i),
            )
        else:
            chosen = min(range(len(engines)), key=lambda i: (*self.cost(i, job), i))
        engines[chosen].assigned += 1
        self.diagnose(job, views, chosen)
        return chosen

    def viewed(self, engine: _Engine, job: _Job) -> int:
        """The prompt's leading blocks the published view lists on ``engine``, continued
        through those of requests sent there and not yet published."""
        limit = min(len(job.keys), hit_limit(job.prompt, self.config.block_size))
        cached = 0
        while cached < limit and (
            engine.published[job.keys[cached]] > 0 or engine.pending[job.keys[cached]] > 0
        ):
            cached += 1
        return cached

    def balance(self, job: _Job, views: list[int]) -> int:
        """``pcr gateway``'s choice (``registry.routing.balance.ranked``) from what it
        would know: the view, the requests it has in flight and their uncached tokens,
        each engine's waiting queue, the recent work and the prompts' kin."""
        config, rule, now = self.config, self.config.rule, self.clock
        names = [f"{i:03d}" for i in range(len(self.engines))]
        cached = {
            n: cached_tokens(v, config.block_size, job.prompt)
            for n, v in zip(names, views, strict=True)
        }
        loads = {}
        for name, engine in zip(names, self.engines, strict=True):
            engine.load.engine_requests = float(len(engine.waiting))
            loads[name] = engine.load
        root = job.keys[0] if job.keys else None
        order = ranked(
            names, job.prompt, cached, loads, rule, now, self.kin.counts(root, now, rule.half_life)
        )
        best = order[0]
        chosen = int(best.namespace)
        load = self.engines[chosen].load
        job.prefill = job.prompt - best.cached
        load.in_flight += 1
        load.pending += job.prefill
        load.recent.add(float(job.prefill or 1), now, rule.half_life)
        self.kin.record(root, best.namespace, now, rule.half_life)
        if best.cached < max(cached.values()):
            runner = next(c for c in order if c.cached == max(cached.values()))
            self.counts["away_" + self.why(job, best, runner)] += 1
        return chosen

    def why(self, job: _Job, chosen: Choice, runner: Choice) -> str:
        """The term of the cost that most favoured ``chosen`` over ``runner`` (the
        engine listing the longest prefix): ``queue``, ``spread`` or ``kin``."""
        rule = self.config.rule
        fresh = job.prompt - runner.cached
        terms = {
            "queue": rule.queue_weight * (runner.queued - chosen.queued),
            "spread": rule.spread_weight
            * fresh
            * len(self.engines)
            * (runner.share - chosen.share),
        }
        gap = runner.cost - chosen.cost - (runner.cached - chosen.cached) * -1
        terms["kin"] = gap - terms["queue"] - terms["spread"]
        return max(terms, key=lambda k: terms[k])

    def cache_aware(self, job: _Job) -> int:
        """vllm-router ``cache_aware`` as it works on a trace: the longest match in each
        engine's tree of sent blocks; over ``CACHE_THRESHOLD`` of the prompt, that engine,
        else the engine with the smallest tree; the prompt joins the chosen tree."""
        size = self.config.block_size
        best, best_match = 0, -1
        for i, engine in enumerate(self.engines):
            match = 0
            while match < len(job.keys) and job.keys[match] in engine.sent:
                match += 1
            if match > best_match:
                best, best_match = i, match
        if best_match * size <= CACHE_THRESHOLD * job.prompt:
            best = min(range(len(self.engines)), key=lambda i: (self.engines[i].tree, i))
        engine = self.engines[best]
        engine.tree += sum(size for k in job.keys if k not in engine.sent)
        engine.sent.update(job.keys)
        return best

    def diagnose(self, job: _Job, views: list[int], chosen: int) -> None:
        """Tokens lost against one infinite cache, by where: ``evicted`` (cached nowhere
        the view lists, though seen before), ``away`` (another engine listed more),
        ``predicted`` (the view's prefix there, to be set against the engine's hit)."""
        size = self.config.block_size
        limit = min(len(job.keys), hit_limit(job.prompt, size))
        ideal_hit = 0
        while ideal_hit < limit and job.keys[ideal_hit] in self.seen:
            ideal_hit += 1
        self.seen.update(job.keys)
        top = max(views)
        held = max(e.cache.hit(job.keys, job.prompt) for e in self.engines)
        self.counts["ideal"] += ideal_hit * size
        self.counts["evicted"] += max(0, ideal_hit - held) * size
        self.counts["away"] += max(0, top - views[chosen]) * size
        self.counts["requests_away"] += top > views[chosen]
        self.counts["predicted"] += views[chosen] * size

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
                "lost": {k: v for k, v in sorted(run.counts.items())},
                "copies": round(
                    sum(len(e.cache.copies) for e in run.engines)
                    / max(1, len(set().union(*(e.cache.copies for e in run.engines)))),
                    2,
                ),
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
