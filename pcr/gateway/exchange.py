"""``pcr gateway``'s replicas sharing their load through Redis, and whether Redis answers.

Every replica publishes the load it has in flight per backend and takes the others' in
one round trip (``lua/gateway_load.lua``, which also pushes each entry it writes on the
gateway load channel), in batches: the requests that start and end within ``batch``
seconds (``nudge``) are told in one exchange, never one per request; with nothing changed
only a keep-alive before the entry's TTL runs out, so an idle replica sends next to
nothing. ``LoadExchange`` sums the others' load into each backend's ``BackendLoad``;
``RegistryHealth`` is what routing and the exchange learn of Redis (away: routing by load
alone, said by ``pcr_gateway_registry_up``).
``ended_leases`` tells which backends no longer announced may go.

With the load goes what each replica's requests in flight leave pending at each backend
(``pcr.gateway.pending``: per backend its newest chains, each as a few hashes at a
ladder of positions, under ``"pending"``), so a replica counts the others' requests as
arriving where they were sent, as its own; in the same payload, so no round trip more.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pcr.gateway.backends import Backend, gone_from, merge_announced
from pcr.gateway.metrics import GatewayMetrics
from pcr.gateway.pending import PendingPrefixes, parse_wire
from pcr.gateway.tokens import loads
from registry.core.errors import REDIS_ERRORS, RegistryError, translate
from registry.core.keys import NamespaceKeys, gateway_load_channel
from registry.core.validation import is_number, text
from registry.fleet.leases import lease_command, lease_of

_fast_dumps: Callable[[Any], bytes] | None
try:  # the gateway extra: payloads of a few KB written and read 40-60 times a second
    from orjson import dumps as _fast_dumps
except ImportError:  # pragma: no cover - json does the same, slower
    _fast_dumps = None

log = logging.getLogger(__name__)

IDLE_TTL_MS = 60_000
"""The TTL of an entry that says nothing is in flight or pending (the longest the script
takes): an idle replica's keep-alive goes every 20 s, not three times a second."""
BATCH_S = 0.05
"""Seconds a start or end waits to be told to the other replicas, with every other change
of that window in the same exchange."""


class RegistryHealth:
    """Whether the registry answers the gateway: down after a call that failed (or was
    slower than ``registry_timeout``), and not asked again for a second; a change is
    logged and exported (``pcr_gateway_registry_up``)."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics
        self.up = True
        self.retry_at = 0.0
        """Until then, with ``up`` False, routing does not ask Redis."""

    def mark(self, up: bool, exc: BaseException | None = None) -> None:
        """What the last call to Redis showed (``exc``: why it failed)."""
        if up != self.up:
            if up:
                log.warning("registry reachable again: routing by cached prefix")
            else:
                log.warning("registry away (%s): routing by load alone", type(exc).__name__)
        self.up = up
        if not up:
            self.retry_at = time.monotonic() + 1.0
        if self.metrics.on:
            self.metrics.registry_up.set(1 if up else 0)


async def ended_leases(client: Any, key_prefix: str, namespaces: Sequence[str]) -> set[str]:
    """Those of ``namespaces`` whose own lease (``lease_until`` in their meta, which only
    their owner writes; never the node index, which any node may write) has run out
    (server clock); one without a lease (Redis lost it, or nobody claimed it yet) is not."""
    if not namespaces:
        return set()
    try:
        pipe = client.pipeline(transaction=False)
        for name in namespaces:
            pipe.execute_command(*lease_command(NamespaceKeys(name, key_prefix).meta))
        pipe.time()
        *leases, (seconds, micros) = await pipe.execute()
    except REDIS_ERRORS as exc:
        what = f"the leases of {len(namespaces)} namespaces"
        raise (translate(exc, what, write=False) or exc) from exc
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    ended = (0 < lease_of(lease) < now_ms for lease in leases)
    return {name for name, over in zip(namespaces, ended, strict=True) if over}


async def discover(router: Any, client: Any, key_prefix: str, backends: dict[str, Backend]) -> None:
    """Bring ``backends`` in line with the engines announced in Redis: those no longer
    announced stay until their lease has run out (``merge_announced``)."""
    table = await router.engines()
    ended = await ended_leases(client, key_prefix, gone_from(backends, table))
    merge_announced(backends, table, ended)


@dataclass(frozen=True)
class _Peer:
    """Another replica's load as last heard: its number, per backend ``[in flight,
    pending tokens, recent tokens]``, when it was heard (this clock), and the chains
    its requests leave pending (``pcr.gateway.pending.parse_wire``)."""

    seq: int
    load: dict[str, list[float]]
    received: float
    pending: Mapping[str, Any] = field(default_factory=dict)
    ttl: float | None = None
    """Seconds its entry lives, as it said (None: as this replica's own)."""


def _encode(payload: dict[str, Any]) -> str:
    if _fast_dumps is not None:
        return _fast_dumps(payload).decode()
    return json.dumps(payload, separators=(",", ":"))


SEQ_HEAD = '{"seq":'


def _seq_of(payload: str) -> int | None:
    """The number at the head of a payload as replicas write it (``_mine``), read
    without parsing the rest; None for any other shape."""
    if not payload.startswith(SEQ_HEAD):
        return None
    end = payload.find(",", len(SEQ_HEAD))
    digits = payload[len(SEQ_HEAD) : end]
    return int(digits) if end > 0 and digits.isdigit() and len(digits) < 20 else None


def _peer(payload: str, received: float) -> _Peer | None:
    """A replica's published load, or None for a payload that is not one (its pending
    chains left out where they are not well formed)."""
    try:
        data = loads(payload)
        seq = data["seq"]
        load = {
            str(ns): [max(0.0, float(values[i])) for i in range(3)]
            for ns, values in data["load"].items()
        }
    except (ValueError, TypeError, KeyError, AttributeError, IndexError, RecursionError):
        return None
    if not is_number(seq, integer=True):
        return None
    if not all(math.isfinite(v) for values in load.values() for v in values):
        return None
    ttl = data.get("ttl")
    if ttl is not None and not (is_number(ttl, integer=True) and 1 <= ttl <= IDLE_TTL_MS):
        return None
    try:
        pending = parse_wire(data.get("pending", {}))
    except ValueError:
        pending = {}
    return _Peer(seq, load, received, pending, None if ttl is None else ttl / 1000)


class LoadExchange:
    """This replica's load told to the others, and theirs summed into ``backends``.

    ``registry`` is the scoring service's state (``pcr.serve.state.State``: its Redis
    client, router and gate). One exchange at a time; ``stop`` ends them.
    """

    def __init__(
        self,
        replica: str,
        backends: Mapping[str, Backend],
        registry: Any,
        health: RegistryHealth,
        *,
        share_interval: float,
        registry_timeout: float,
        half_life: float,
        pending: PendingPrefixes | None = None,
        batch: float = BATCH_S,
    ) -> None:
        self.replica = replica
        self.batch = batch
        self.pending = pending
        self.backends = backends
        self.registry = registry
        self.health = health
        self.share_interval = share_interval
        self.registry_timeout = registry_timeout
        self.half_life = half_life
        self.stopping = False
        self.peers: dict[str, _Peer] = {}
        """The other replicas' load: from each exchange, and as it changes (pushed)."""
        self._seq = time.time_ns() // 1000  # numbers this replica's published load (a
        # replica restarted under the same id continues above its old numbers)
        self._shared_at = 0.0
        self._exchanging = asyncio.Lock()
        self._sharing: asyncio.Task[None] | None = None
        self._share_again = False
        self._changed = False  # a request started or ended since the last exchange
        self._entry_ttl_ms = 0  # the TTL of the entry last published (its keep-alive
        # goes at a third of it)
        self._flush: asyncio.TimerHandle | None = None
        self.exchanges = 0
        """Exchanges made (each one round trip to Redis)."""

    def stop(self) -> list[asyncio.Task[None]]:
        """No more exchanges; returns the one under way in the background, if any."""
        self.stopping = True
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        return [self._sharing] if self._sharing is not None else []

    async def share(self) -> None:
        """Publish this replica's load and take the others' (one round trip; the
        script also pushes it to the other replicas, ``listen``). One exchange at a
        time, each sending the load as it is when it goes: an older one never lands
        after a newer one and overwrites it; one asked for while another waited to go
        is done by that one."""
        asked = time.monotonic()
        async with self._exchanging:
            if self._shared_at > asked:
                return  # an exchange that started after this was asked for sent it
            now = self._shared_at = time.monotonic()
            self._changed = False
            self.exchanges += 1
            mine, ttl = self._mine(now)
            router, gate = self.registry.ready()
            try:
                async with asyncio.timeout(max(1.0, self.registry_timeout)), gate.turn():
                    others = await router.exchange_load(self.replica, ttl, mine)
            except (RegistryError, TimeoutError) as exc:
                self.peers.clear()  # Redis away: balance on what this replica knows
                self.health.mark(False, exc)
                self._entry_ttl_ms = self.ttl_ms()  # tried again at the busy cadence
            else:
                self._entry_ttl_ms = ttl
                health = self.health
                if not health.up and time.monotonic() >= health.retry_at:
                    health.mark(True)
                self._heard(others, now)
            self._apply_peers()

    def _mine(self, now: float) -> tuple[str, int]:
        """This replica's load, numbered, as the exchange publishes it, and the TTL of
        its entry: ``IDLE_TTL_MS`` while nothing is in flight or pending here (the
        others decay its recent tokens themselves), else ``ttl_ms``. The payload says
        its TTL, so the others keep it that long."""
        self._seq += 1
        load = {
            ns: [
                b.load.in_flight,
                round(b.load.pending, 1),
                round(b.load.recent.now(now, self.half_life), 1),
            ]
            for ns, b in self.backends.items()
        }
        chains = self.pending.wire() if self.pending is not None and self.pending.on else {}
        idle = not chains and not any(v[0] or v[1] for v in load.values())
        ttl = IDLE_TTL_MS if idle else self.ttl_ms()
        mine: dict[str, Any] = {"seq": self._seq, "ttl": ttl, "load": load}
        if chains:
            mine["pending"] = chains
        return _encode(mine), ttl

    def _heard(self, others: Mapping[str, str], now: float) -> None:
        """The peers an exchange started at ``now`` answered with, each kept newer if it
        was pushed newer meanwhile (or pushed after ``now`` and not in the reply)."""
        known = self.peers
        self.peers = {}
        for replica, payload in others.items():
            held = known.get(replica)
            if held is not None and (seq := _seq_of(payload)) is not None and seq <= held.seq:
                self.peers[replica] = held  # heard already, pushed: not parsed again
                continue
            peer = _peer(payload, now)
            if peer is None:
                continue
            self.peers[replica] = held if held is not None and held.seq > peer.seq else peer
        for replica, held in known.items():  # pushed while the exchange was under way
            if replica not in self.peers and held.received > now:
                self.peers[replica] = held

    async def tick(self) -> None:
        """The periodic exchange: what changed and was not told yet (a batch cut short
        by Redis away), else only a keep-alive a third of the TTL after the last one.
        While no other replica is known, a change waits for the busy keep-alive's
        cadence (a third of ``ttl_ms``) rather than ``batch``: nobody reads it sooner (a
        replica that starts publishes first, and its push has this one tell it its load
        within ``batch``, ``_pushed``), and a lone gateway under load spared seven round
        trips to Redis a second, each with its pending chains encoded."""
        since = time.monotonic() - self._shared_at
        due = self.batch if self.peers else self.ttl_ms() / 3000
        if (self._changed and since >= due) or since >= self._entry_ttl_ms / 3000:
            await self.share()

    def keep_alive_in(self) -> float:
        """Seconds until the periodic exchange's keep-alive is due (0: now)."""
        since = time.monotonic() - self._shared_at
        return max(0.0, self._entry_ttl_ms / 3000 - since)

    @property
    def changed(self) -> bool:
        """A request started or ended here since the last exchange."""
        return self._changed

    def ttl_ms(self) -> int:
        """Entries live ten intervals (1 to 60 s)."""
        return max(1000, min(60_000, round(self.share_interval * 10_000)))

    def nudge(self) -> None:
        """A request started or ended: told to the other replicas within ``batch``
        seconds, in one exchange with every other change of that window (never a round
        trip per request); nothing while no other replica is known."""
        self._changed = True
        if self.stopping or self._flush is not None or not self.peers:
            return
        health = self.health
        if not health.up and time.monotonic() < health.retry_at:
            return  # Redis known away: the periodic exchange finds out when it is back
        self._flush = asyncio.get_running_loop().call_later(self.batch, self._flush_now)

    def _flush_now(self) -> None:
        self._flush = None
        if self.stopping:
            return
        if self._sharing is not None and not self._sharing.done():
            self._share_again = True  # one more after it, with what changed meanwhile
            return
        self._sharing = asyncio.ensure_future(self._share_nudged())

    async def share_quietly(self) -> None:
        """``share``, its failure left for the periodic exchange to report."""
        with contextlib.suppress(Exception):  # the periodic exchange says why
            await self.share()

    async def _share_nudged(self) -> None:
        again = True
        while again and not self.stopping:
            self._share_again = False
            await self.share_quietly()
            again = self._share_again

    async def listen(self) -> None:
        """The other replicas' load as they publish it (``lua/gateway_load.lua``
        pushes every entry it writes); reconnects while Redis is away."""
        channel = gateway_load_channel(self.registry.key_prefix)
        while not self.stopping:
            pubsub = None
            try:
                pubsub = self.registry.client.pubsub(ignore_subscribe_messages=True)
                await pubsub.subscribe(channel)
                while not self.stopping:
                    message = await pubsub.get_message(timeout=1.0)
                    if message is not None:
                        self._pushed(message.get("data"))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: the exchange says so; try again
                log.debug("gateway load channel: %s", type(exc).__name__)
                await asyncio.sleep(1.0)
            finally:
                if pubsub is not None:
                    with contextlib.suppress(Exception):
                        await pubsub.aclose()

    def _pushed(self, data: Any) -> None:
        replica, _, payload = text(data).partition(" ")
        if not replica or replica == self.replica:
            return
        peer = _peer(payload, time.monotonic())
        held = self.peers.get(replica)
        if peer is not None and (held is None or peer.seq > held.seq):
            self.peers[replica] = peer
            self._apply_peers()
            if held is None:  # a replica new to this one: tell it this one's load soon
                self.nudge()

    def _apply_peers(self) -> None:
        """The other replicas' load summed per backend (entries older than the TTL, from
        a replica that stopped publishing, dropped)."""
        now = time.monotonic()
        ttl = self.ttl_ms() / 1000
        totals: dict[str, list[float]] = {}
        for replica in [r for r, p in self.peers.items() if now - p.received > (p.ttl or ttl)]:
            del self.peers[replica]
        for peer in self.peers.values():
            decay = math.pow(0.5, max(0.0, now - peer.received) / self.half_life)
            for ns, values in peer.load.items():
                total = totals.setdefault(ns, [0.0, 0.0, 0.0])
                total[0] += values[0]
                total[1] += values[1]
                total[2] += values[2] * decay  # recent tokens as of now
        for ns, backend in self.backends.items():
            in_flight, pending, recent = totals.get(ns, (0.0, 0.0, 0.0))
            backend.load.remote_in_flight = int(in_flight)
            backend.load.remote_pending = pending
            backend.load.remote_recent = recent
            backend.load.remote_at = now
        if self.pending is not None and self.pending.on:
            self.pending.set_remote([p.pending for p in self.peers.values() if p.pending])
