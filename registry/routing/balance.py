"""How ``pcr gateway`` chooses a backend: the balance rule, without I/O (shared with
``pcr simulate --trace``'s ``gateway`` policy, so the simulation weighs exactly what the
gateway does).

Every candidate backend ``b`` (known, not refusing connections) gets a cost in tokens,
an estimate of the prefill work the engine does before this request's first token, plus a
term that keeps the fleet's caches from collapsing onto one engine; the lowest cost wins
(ties: fewer requests in flight, then the namespace's sort order)::

    cost(b) = prefill(b)                                  # the prompt's uncached tokens
            + queue_weight  * queued(b)                   # work ahead of it on b
            + spread_weight * fresh * (N * share(b) - 1)  # b's share of recent work
            - affinity_weight * fresh * N * (kin(b) - sent(b))  # b's kin, beyond its share
              (only where N * sent(b) <= affinity_bound)
            - checkpoint_weight * (kv(b) - cached(b))       # a hybrid checkpoint it would make
            + prompt * [kv_usage(b) >= kv_usage_limit]

- ``prefill(b) = prompt - cached(b)``; ``cached(b)`` is the prefix the registry says b's
  engine can reuse (``AsyncPrefixRouter.score``: the Mamba-usable prefix on a hybrid
  model's node, the KV prefix otherwise), in whole blocks, never the prompt's last token
  (the engine computes at least one), continued through the blocks of the requests in
  flight sent to b that the registry does not list yet (``pcr.gateway.pending``). A
  backend the registry does not score (its lease lapsed, or Redis is away) has
  ``cached = 0``: it is still chosen by load.
- ``queued(b) = pending(b) + request_tokens * max(in_flight(b), engine_requests(b))``:
  the uncached prompt tokens of the requests every gateway replica has in flight at b,
  plus a fixed cost per request (decoding, scheduling); ``engine_requests`` is what the
  engine itself reports waiting (``vllm:num_requests_waiting``, scraped), which also
  counts requests that did not come through a gateway (not its running requests:
  scraped a moment ago, those are often this gateway's own, already finished).
- ``share(b)`` is b's part of the prefill tokens sent lately by all replicas, decayed with
  a half-life of ``half_life`` seconds, each backend counted as if it had done one more
  prompt's worth (so that a little work, or none, is no imbalance: a fully cached prompt
  adds almost nothing). Without it a greedy choice sends everything to the
  engine that first cached a shared system prompt whenever requests come one at a time
  (nothing is ever in flight), and that engine's cache must then hold every conversation
  while the other's sits idle. With two engines and the default weight 1, a backend
  doing all the recent work costs twice the ``fresh`` tokens more than an idle one.
- ``fresh = prompt - max over b of cached(b)``: the tokens no backend caches, the work
  that may go anywhere. The spread moves only that: a turn of a conversation cached on
  one engine stays there however the recent work is shared (after an engine restarted
  empty, the other holds every conversation and has done all the recent work: spreading
  whole prompts would move even fully cached turns to the empty engine), while a new
  conversation, cached nowhere but for a shared system prompt, goes where the work is
  lighter.
- ``kin(b)`` is b's part of the recent requests whose prompt starts with the same block
  as this one (a shared system prompt, a template's preamble), ``sent(b)`` its part of
  all recent requests, both decayed by the same half-life, each backend counted as if it
  had one more. Where b serves more of this prompt's kin than of the traffic at large,
  new work is pulled there, so engines specialize by shared prefix: each keeps its own
  system prompts hot instead of both keeping every one half as hot, and their caches
  hold conversations that share more. With one prefix shared by everything, ``kin`` is
  ``sent`` and the term is 0. The pull stops at a backend already serving more than
  ``affinity_bound`` (1.3) times the mean share of the recent requests (``N * sent(b)``),
  so one popular prompt root cannot pile its family onto one engine (bounded loads).
- ``kv(b)`` is b's KV prefix of the prompt in tokens (as ``cached``, whole blocks, never
  the last token), given only for a hybrid model's nodes, where it can exceed ``cached``
  (KV blocks with no Mamba state at their end: the engine reuses none of them). Sent
  there, the request costs as much prefill as anywhere, but vLLM keeps a Mamba state
  where a request's prompt leaves a prefix it shares with the cache (its shared-prefix
  checkpoint), so the request's siblings then hit ``kv(b)`` tokens there; sent to an
  engine without that KV, no checkpoint is made. Measured on running vLLM hybrid
  engines, ranking by the usable prefix alone then lost to ranking by the KV prefix
  (BENCHMARKS.md, "Hybrid engines"); at the default weight 0.5 the future hit counts
  half, so a real hit now still wins over a checkpoint of up to twice its length.
- ``kv_usage(b)`` (``vllm:kv_cache_usage_perc``, scraped): an engine whose KV cache is
  full queues or preempts, so it costs one more prompt.

Compared with vllm-router's ``cache_aware`` (a match ratio over ``cache_threshold`` goes
to the best match, else to the least loaded; ``balance_abs_threshold`` and
``balance_rel_threshold`` switch to shortest-queue when the queues differ by both): the
trade is made in tokens, continuously, and from what the engines really hold.

With ``queue_weight = spread_weight = 0`` the rule is the greedy prefix choice; with
every ``cached = 0`` it is least-load.
"""

from __future__ import annotations

import math
import operator
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from registry.core.validation import is_number

NATIVE: ModuleType | None
"""The C extension ``registry.routing._weigh`` (``Weighed``'s arithmetic: every cost
bit-identical to the Python here), or None where it was not built."""
try:
    from registry.routing import _weigh as NATIVE
except ImportError:  # installed without its C extension
    NATIVE = None


@dataclass(frozen=True)
class BalanceRule:
    """The weights of the cost (module docstring)."""

    queue_weight: float = 0.1
    """An engine batches the requests it runs: work queued ahead delays a request's first
    token by a part of it, not all; a heavier weight moves turns off the engine that caches
    their conversation (BENCHMARKS.md, "What moved the figures", compares weights)."""
    spread_weight: float = 1.0
    affinity_weight: float = 0.5
    checkpoint_weight: float = 0.5
    """Of the KV tokens beyond the usable prefix on a hybrid model's node, the part that
    counts as cached (the siblings' future hit at the checkpoint the request makes)."""
    half_life: float = 30.0
    """Seconds over which a backend's recent work counts half."""
    request_tokens: float = 32.0
    """The cost of one request in flight beyond its prompt (decoding, scheduling)."""
    kv_usage_limit: float = 0.95
    affinity_bound: float = 1.3
    """The affinity term pulls only towards a backend whose part of the recent requests
    is at most this many times the mean (``sent * N``): unbounded, a popular prompt root
    piled 22% of a generated trace's requests onto one of 8 engines (balance 1.78; 1.29
    with this bound, the hit rate level; BENCHMARKS.md, "Where the hits go")."""

    def __post_init__(self) -> None:
        for name in (
            "queue_weight",
            "spread_weight",
            "affinity_weight",
            "checkpoint_weight",
            "request_tokens",
        ):
            value = getattr(self, name)
            if not is_number(value):
                raise TypeError(f"{name} must be a number")
            if not 0 <= value < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0")
        if not 0 < self.half_life < math.inf:
            raise ValueError("half_life must be a positive finite number of seconds")
        if not (is_number(self.affinity_bound) and self.affinity_bound >= 1):
            raise ValueError("affinity_bound must be a number >= 1")
        if not 0 < self.kv_usage_limit <= 1:
            raise ValueError("kv_usage_limit must be in (0, 1]")


@dataclass
class Decayed:
    """A sum that halves every ``half_life`` seconds (``value`` as of ``at``)."""

    value: float = 0.0
    at: float = 0.0

    def now(self, now: float, half_life: float) -> float:
        if self.value == 0.0 or now <= self.at:
            return self.value
        return self.value * math.pow(0.5, (now - self.at) / half_life)

    def add(self, amount: float, now: float, half_life: float) -> None:
        value, at = self.value, self.at  # ``now``'s arithmetic inlined: two per request
        if not (value == 0.0 or now <= at):
            value *= math.pow(0.5, (now - at) / half_life)
        self.value = value + amount
        self.at = max(now, at)


KinCounts = tuple[Mapping[str, "float | Decayed"], Mapping[str, "float | Decayed"]]
"""Per backend, its recent requests sharing the prompt's root and of any root: numbers,
or ``Decayed`` sums (``Kin.sums``) read as of the decision."""


def decayed(
    counts: Mapping[str, float | Decayed], now: float, half_life: float
) -> Mapping[str, float]:
    """``counts`` with each ``Decayed`` as of ``now`` (``counts`` itself where it holds
    none): the arithmetic of ``_weigh.c``'s kin, to the bit."""
    if not any(isinstance(v, Decayed) for v in counts.values()):
        return counts  # type: ignore[return-value]
    return {
        name: (v.value * 0.5 ** ((now - v.at) / half_life) if v.value and now > v.at else v.value)
        if isinstance(v, Decayed)
        else v
        for name, v in counts.items()
    }


@dataclass
class BackendLoad:
    """What one backend carries, as this replica knows it."""

    in_flight: int = 0
    """Requests this replica has in flight there."""
    pending: float = 0.0
    """Their uncached prompt tokens."""
    recent: Decayed = field(default_factory=Decayed)
    """Prefill tokens this replica sent there lately."""
    remote_in_flight: int = 0
    remote_pending: float = 0.0
    remote_recent: float = 0.0
    """The other replicas' share (as last exchanged), decayed to ``remote_at``."""
    remote_at: float = 0.0
    engine_requests: float = 0.0
    """Requests waiting in the engine's queue, as it last reported (scraped)."""
    engine_running: float = 0.0
    """Requests it was running then (shown, not weighed)."""
    kv_usage: float = 0.0


def cached_tokens(usable_blocks: int, block_size: int, prompt_tokens: int) -> int:
    """Tokens an engine serves from its cache for a prompt whose first ``usable_blocks``
    blocks it holds: whole blocks, never the prompt's last token."""
    if prompt_tokens <= 0:
        return 0
    return max(0, min(usable_blocks, (prompt_tokens - 1) // block_size)) * block_size


@dataclass(slots=True)
class Reach:
    """A chosen backend's prefix of the prompt in blocks, for the blocks its request
    leaves pending there: ``held`` listed by the registry, ``kv`` with the pending ones,
    ``usable`` what its engine reuses, ``hybrid`` a hybrid model's node. Not frozen (as
    ``Choice``): made twice per request, and a frozen dataclass's constructor costs
    several times as much; nothing changes one once made."""

    held: int = 0
    kv: int = 0
    usable: int = 0
    hybrid: bool = False


@dataclass(slots=True)
class Choice:
    """One candidate's cost and its parts (for metrics and tests). Not frozen: made
    several times per request, and a frozen dataclass's constructor costs four times
    as much; the gateway sets ``reach`` on the two best, nothing else changes one."""

    namespace: str
    cost: float
    cached: int
    queued: float
    share: float
    reach: Reach | None = None
    """Its prefix in blocks, for what a request sent there leaves pending
    (``pcr.gateway.pending``); None where no prefix was scored."""


def ranked(
    candidates: Iterable[str],
    prompt_tokens: int,
    cached: Mapping[str, int],
    loads: Mapping[str, BackendLoad],
    rule: BalanceRule,
    now: float,
    kin: KinCounts | None = None,
    kv: Mapping[str, int] | None = None,
) -> list[Choice]:
    """The candidates from best to worst by the rule (module docstring); ``kin``: each
    backend's recent requests that share this prompt's first block, and its recent
    requests of any kind (``Kin.counts``, or ``Kin.sums`` decayed as they are read);
    ``kv``: each hybrid node's KV prefix in tokens, where it exceeds ``cached``."""
    return Weighed(candidates, prompt_tokens, loads, rule, now, kin).ranked(cached, kv)


def leader(
    candidates: Iterable[str],
    prompt_tokens: int,
    cached: Mapping[str, int],
    loads: Mapping[str, BackendLoad],
    rule: BalanceRule,
    now: float,
    kin: KinCounts | None = None,
    kv: Mapping[str, int] | None = None,
) -> str | None:
    """The first of ``ranked``'s order alone (its name; None for no candidates)."""
    return Weighed(candidates, prompt_tokens, loads, rule, now, kin).leader(cached, kv)


class Weighed:
    """One decision's candidates with what the rule weighs apart from their prefixes
    (their loads, recent work and kin, read once), then ranked for any ``cached``: the
    gateway ranks one prompt twice, with and without the blocks of requests in flight,
    and the loads are most of the work."""

    __slots__ = ("count", "kin_terms", "prompt", "rows", "rule")

    def __init__(
        self,
        candidates: Iterable[str],
        prompt_tokens: int,
        loads: Mapping[str, BackendLoad],
        rule: BalanceRule,
        now: float,
        kin: KinCounts | None = None,
    ) -> None:
        self.rule = rule
        self.prompt = prompt_tokens
        names = dict.fromkeys(candidates)  # each once (the order breaks ties by name)
        if NATIVE is not None:  # the same arithmetic in C, where the inputs are plain
            kinned, sent = kin or (None, None)
            made = NATIVE.rows(
                names, prompt_tokens, loads, now, rule.half_life, rule.request_tokens,
                rule.kv_usage_limit, rule.queue_weight, kinned, sent, rule.affinity_bound,
                BackendLoad, Decayed,
            )  # fmt: skip
            if made is not NotImplemented:
                self.rows: list[tuple[str, int, float, float, float, bool]]
                self.kin_terms: list[float | None] | None
                self.rows, self.kin_terms = made
                self.count = len(names)
                return
        half_life = rule.half_life
        request_tokens = rule.request_tokens
        # per candidate: name, requests in flight, queued tokens, recent tokens, full
        loaded: list[tuple[str, int, float, float, bool]] = []
        total = 0.0
        for name in names:  # one pass: each one's load and recent tokens
            load = loads.get(name)
            if load is None:
                loaded.append((name, 0, 0.0, 0.0, False))
                continue
            recent = load.recent.now(now, half_life)
            remote = load.remote_recent
            if remote and now > load.remote_at:
                remote *= 0.5 ** ((now - load.remote_at) / half_life)
            recent += remote
            total += recent
            in_flight = load.in_flight + load.remote_in_flight
            queued = load.pending + load.remote_pending
            queued += request_tokens * max(float(in_flight), load.engine_requests)
            loaded.append((name, in_flight, queued, recent, load.kv_usage >= rule.kv_usage_limit))
        self.count = count = len(loaded)
        # what no prefix changes: each one's share of the recent work (this prompt's
        # counted everywhere) and its queue's cost
        shares_of = (total + count * prompt_tokens) or float(count)  # an empty prompt
        queue_weight = rule.queue_weight
        self.rows = [
            (
                name,
                in_flight,
                queued,
                (recent + prompt_tokens) / shares_of,
                queue_weight * queued,
                full,
            )
            for name, in_flight, queued, recent, full in loaded
        ]
        rows = self.rows
        # per candidate, its kin share less its share of all requests (None: no pull,
        # its share is past the bound), before the fresh tokens weigh it
        self.kin_terms = None
        kinned, sent = kin or ({}, {})
        if kinned and count:
            kinned, sent = decayed(kinned, now, half_life), decayed(sent, now, half_life)
            kin_total = sent_total = 0.0
            for name, *_rest in rows:
                kin_total += kinned.get(name, 0.0)
                sent_total += sent.get(name, 0.0)
            if kin_total:
                terms: list[float | None] = []
                for name, *_rest in rows:
                    kin_share = (kinned.get(name, 0.0) + 1.0) / (kin_total + count)
                    sent_share = (sent.get(name, 0.0) + 1.0) / (sent_total + count)
                    bounded = sent_share * count <= rule.affinity_bound
                    terms.append(kin_share - sent_share if bounded else None)
                self.kin_terms = terms

    def _costed(
        self, cached: Mapping[str, int], kv: Mapping[str, int] | None
    ) -> list[tuple[float, int, str, int, float, float]]:
        """Each candidate's cost by the rule, its requests in flight (the tie breaker),
        its name, hit, queued tokens and share of recent work: ``ranked``'s rows
        unsorted."""
        rows = self.rows
        if not rows:
            return []
        prompt_tokens = self.prompt
        prompt = max(0, prompt_tokens)
        hits = []
        best_hit = 0
        for row in rows:
            hit = cached.get(row[0], 0)
            hit = 0 if hit < 0 else prompt if hit > prompt else hit
            if hit > best_hit:
                best_hit = hit
            hits.append(hit)
        rule, count = self.rule, self.count
        fresh = float(prompt - best_hit)
        spread = rule.spread_weight * fresh
        pull = rule.affinity_weight * fresh * count
        kin_terms = self.kin_terms
        keyed: list[tuple[float, int, str, int, float, float]] = []
        for i, (name, in_flight, queued, share, queue_cost, full) in enumerate(rows):
            hit = hits[i]
            cost = float(prompt_tokens - hit) + queue_cost + spread * (count * share - 1.0)
            if kin_terms is not None and (term := kin_terms[i]) is not None:
                cost -= pull * term
            if kv:
                cost -= rule.checkpoint_weight * max(0, min(kv.get(name, 0), prompt_tokens) - hit)
            if full:
                cost += prompt_tokens
            keyed.append((cost, in_flight, name, hit, queued, share))
        return keyed

    def ranked(
        self, cached: Mapping[str, int], kv: Mapping[str, int] | None = None
    ) -> list[Choice]:
        """The candidates from best to worst with these prefixes (``ranked``)."""
        made = self._native(cached, kv, False)
        if made is not NotImplemented:
            return made  # type: ignore[no-any-return]
        keyed = self._costed(cached, kv)
        keyed.sort(key=_first_three)
        return [
            Choice(name, cost, hit, queued, share) for cost, _f, name, hit, queued, share in keyed
        ]

    def leader(self, cached: Mapping[str, int], kv: Mapping[str, int] | None = None) -> str | None:
        """The first of ``ranked``'s order alone (its name; None for no candidates),
        with no list sorted or choices built."""
        name = self._native(cached, kv, True)
        if name is not NotImplemented:
            return name  # type: ignore[no-any-return]
        keyed = self._costed(cached, kv)
        return min(keyed, key=_first_three)[2] if keyed else None

    def _native(self, cached: Mapping[str, int], kv: Mapping[str, int] | None, first: bool) -> Any:
        """``ranked`` in C (``first``: the leader's name alone); NotImplemented where the
        extension is not built or an input is not of the plain types it reads."""
        if NATIVE is None or not self.rows:
            return NotImplemented
        rule = self.rule
        return NATIVE.costed(
            self.rows, self.kin_terms, self.prompt, cached, kv or None, rule.spread_weight,
            rule.affinity_weight, rule.checkpoint_weight, first, Choice,
        )  # fmt: skip


_first_three = operator.itemgetter(0, 1, 2)
"""A row's cost, requests in flight and name: the order (ties to fewer in flight, then
by name)."""


class Kin:
    """Per prompt root (its first block), the requests sent to each backend lately, and
    all requests sent to each, decayed: what ``ranked``'s ``kin`` reads. Remembers the
    ``limit`` roots used last."""

    def __init__(self, limit: int = 4_096) -> None:
        self.limit = limit
        self._roots: OrderedDict[Hashable, dict[str, Decayed]] = OrderedDict()
        self._all: dict[str, Decayed] = {}

    def counts(
        self, root: Hashable | None, now: float, half_life: float
    ) -> tuple[Mapping[str, float], Mapping[str, float]] | None:
        """Per backend, the requests sent there lately with ``root`` and of any root,
        decayed to ``now``; None where no request with ``root`` was sent lately."""
        sums = self.sums(root)
        if sums is None:
            return None
        return decayed(sums[0], now, half_life), decayed(sums[1], now, half_life)

    def sums(self, root: Hashable | None) -> KinCounts | None:
        """``counts`` as the sums themselves, decayed by whoever reads them: ``Weighed``
        decays only its candidates' (in C where built), no dict made per decision. The
        sums are live: read them before the next ``record``."""
        kinned = self._roots.get(root) if root is not None else None
        if not kinned:
            return None
        return kinned, self._all

    def record(self, root: Hashable | None, backend: str, now: float, half_life: float) -> None:
        every = self._all.get(backend)
        if every is None:
            every = self._all[backend] = Decayed()
        every.add(1.0, now, half_life)
        if root is None:
            return
        sent = self._roots.get(root)
        if sent is None:
            sent = self._roots[root] = {}
            if len(self._roots) > self.limit:
                self._roots.popitem(last=False)
        else:
            self._roots.move_to_end(root)
        mine = sent.get(backend)
        if mine is None:
            mine = sent[backend] = Decayed()
        mine.add(1.0, now, half_life)

    def __len__(self) -> int:
        return len(self._roots)


def prompt_root(tokens: Sequence[int] | None, block_size: int) -> Hashable | None:
    """What a prompt's kin share: its first block of tokens (None for a prompt shorter
    than a block, or none known)."""
    if not tokens or len(tokens) <= block_size:
        return None
    return tuple(tokens[:block_size])
