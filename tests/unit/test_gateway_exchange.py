"""``pcr.gateway.exchange.LoadExchange`` without Redis: what a replica publishes (its
entry's TTL: short while it carries load, ``IDLE_TTL_MS`` while idle, said in the
payload), what it keeps of the others (their own TTL, their recent tokens decayed to
now, a reply not parsed again for an entry the push brought already) and when it
exchanges at all (a keep-alive at a third of the published TTL)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from pcr.gateway.backends import Backend
from pcr.gateway.exchange import IDLE_TTL_MS, LoadExchange, RegistryHealth, _seq_of
from pcr.gateway.pending import PendingPrefixes

HALF_LIFE = 2.0
_NO_METRICS: Any = type("NoMetrics", (), {"on": False})()


class _Router:
    """``exchange_load`` as the script answers: the others' entries; each call kept."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, dict[str, Any]]] = []
        self.others: dict[str, str] = {}

    async def exchange_load(self, replica: str, ttl_ms: int, payload: str) -> dict[str, str]:
        self.calls.append((replica, ttl_ms, json.loads(payload)))
        return dict(self.others)


class _AsyncGate:
    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *_exc: object) -> None:
        return None


class _Registry:
    def __init__(self, router: _Router) -> None:
        self.router = router
        self.key_prefix = "pcr"

    def ready(self) -> tuple[_Router, Any]:
        gate = type("Gate", (), {"turn": lambda _self: _AsyncGate()})()
        return self.router, gate


def exchange(pending: PendingPrefixes | None = None) -> tuple[LoadExchange, _Router]:
    router = _Router()
    backends = {ns: Backend(ns, f"http://{ns}", "config") for ns in ("a", "b")}
    made = LoadExchange(
        "me", backends, _Registry(router), RegistryHealth(_NO_METRICS),
        share_interval=0.1, registry_timeout=1.0, half_life=HALF_LIFE, pending=pending,
    )  # fmt: skip
    return made, router


def payload(seq: int, load: dict[str, list[float]], **more: Any) -> str:
    return json.dumps({"seq": seq, "load": load, **more}, separators=(",", ":"))


def test_an_idle_replica_publishes_a_long_ttl_and_a_busy_one_the_short() -> None:
    async def run() -> None:
        ex, router = exchange()
        await ex.share()
        _replica, ttl, sent = router.calls[-1]
        assert ttl == IDLE_TTL_MS == sent["ttl"]
        assert _seq_of(json.dumps(sent, separators=(",", ":"))) == sent["seq"]
        ex.backends["a"].load.in_flight = 1
        await ex.share()
        _replica, ttl, sent = router.calls[-1]
        assert ttl == ex.ttl_ms() == sent["ttl"] == 1000
        assert sent["load"]["a"][0] == 1

    asyncio.run(run())


def test_the_keep_alive_goes_at_a_third_of_the_published_ttl() -> None:
    """Idle: nothing for 20 s after the last exchange; busy: at a third of a second."""

    async def run() -> None:
        ex, router = exchange()
        await ex.share()
        ex._shared_at = time.monotonic() - 5.0  # five seconds ago, idle entry
        await ex.tick()
        assert len(router.calls) == 1
        ex._shared_at = time.monotonic() - 21.0
        await ex.tick()
        assert len(router.calls) == 2
        ex.backends["b"].load.in_flight = 2
        ex.nudge()  # a start: told at the next tick past the batch
        ex._shared_at = time.monotonic() - 1.0
        await ex.tick()
        assert len(router.calls) == 3
        assert router.calls[-1][1] == 1000
        ex._shared_at = time.monotonic() - 0.5  # busy entry: its keep-alive is due
        await ex.tick()
        assert len(router.calls) == 4

    asyncio.run(run())


def test_a_change_waits_for_the_batch_with_peers_and_the_keep_alive_without() -> None:
    """Alone, a start is told at the busy keep-alive's cadence (nobody reads it sooner);
    once another replica is heard, within the batch; a new one heard is told at once."""

    async def run() -> None:
        ex, router = exchange()
        ex.backends["a"].load.in_flight = 1
        await ex.share()  # a busy entry: 1 s TTL
        assert ex.batch < 0.2 < ex.ttl_ms() / 3000
        ex.nudge()
        ex._shared_at = time.monotonic() - 0.2  # past the batch, before the keep-alive
        await ex.tick()
        assert len(router.calls) == 1  # alone: not yet
        ex._shared_at = time.monotonic() - 0.4
        await ex.tick()
        assert len(router.calls) == 2  # the keep-alive's cadence reached
        ex._pushed("peer " + payload(1, {"a": [1, 0, 0]}))  # another replica starts
        assert ex._flush is not None  # told within the batch, by the timer
        ex._flush.cancel()
        ex._flush = None
        ex.nudge()
        ex._shared_at = time.monotonic() - 0.2
        await ex.tick()
        assert len(router.calls) == 3  # with a peer: past the batch is enough

    asyncio.run(run())


def test_a_failed_exchange_is_tried_again_at_the_busy_cadence() -> None:
    async def run() -> None:
        from registry.core.errors import RegistryUnavailable

        ex, router = exchange()
        await ex.share()  # an idle entry: 60 s TTL

        async def away(*_args: Any) -> dict[str, str]:
            raise RegistryUnavailable("down")

        router.exchange_load = away  # type: ignore[method-assign]
        ex._shared_at = time.monotonic() - 21.0
        await ex.tick()
        assert not ex.health.up
        ex._shared_at = time.monotonic() - 0.5
        calls = []

        async def back(*args: Any) -> dict[str, str]:
            calls.append(args)
            return {}

        router.exchange_load = back  # type: ignore[method-assign]
        ex.health.retry_at = 0.0
        await ex.tick()
        assert calls
        assert ex.health.up

    asyncio.run(run())


def test_peers_live_as_long_as_they_said_and_their_recent_tokens_decay() -> None:
    async def run() -> None:
        ex, _router = exchange()
        now = time.monotonic()
        ex._pushed(f"idle {payload(5, {'a': [0, 0.0, 800.0]}, ttl=IDLE_TTL_MS)}")
        ex._pushed(f"old {payload(7, {'a': [1, 10.0, 100.0]})}")  # no ttl: this replica's (1 s)
        ex.peers["idle"] = ex.peers["idle"].__class__(
            5, {"a": [0, 0.0, 800.0]}, now - 2 * HALF_LIFE, {}, IDLE_TTL_MS / 1000
        )  # heard two half-lives ago
        ex.peers["old"] = ex.peers["old"].__class__(7, {"a": [1, 10.0, 100.0]}, now - 5.0, {})
        ex._apply_peers()
        late = time.monotonic() - now  # however long this took: it decayed that much more
        assert set(ex.peers) == {"idle"}
        load = ex.backends["a"].load
        assert load.remote_in_flight == 0
        assert 200.0 * 0.5 ** (late / HALF_LIFE) - 1e-9 <= load.remote_recent <= 200.0 + 1e-9

    asyncio.run(run())


@pytest.mark.parametrize("ttl", [0, 60_001, 1.5, "60", True])
def test_a_payload_with_a_bad_ttl_is_not_a_peer(ttl: Any) -> None:
    ex, _router = exchange()
    ex._pushed(f"x {payload(3, {'a': [0, 0.0, 0.0]}, ttl=ttl)}")
    assert "x" not in ex.peers


@pytest.mark.parametrize(
    ("text", "seq"),
    [
        ('{"seq":12,"ttl":1000}', 12),
        ('{"seq":12}', None),  # no comma after the number: not the shape replicas write
        ('{"ttl":1,"seq":12,', None),
        ('{"seq":-1,', None),
        ('{"seq":1e5,', None),
        ('{"seq":' + "9" * 25 + ",", None),
        ("", None),
    ],
)
def test_the_number_is_read_from_the_head_of_a_payload(text: str, seq: int | None) -> None:
    assert _seq_of(text) == seq


def test_a_reply_is_not_parsed_again_for_an_entry_the_push_brought() -> None:
    """The exchange's reply holds the others' entries; one whose number this replica
    heard pushed already keeps the object it holds (not parsed again: even a body after
    the number that is not JSON changes nothing), a newer one is taken."""

    async def run() -> None:
        ex, router = exchange()
        ex._pushed(f"r1 {payload(9, {'a': [2, 5.0, 1.0]})}")
        held = ex.peers["r1"]
        router.others = {"r1": '{"seq":9,"load":not json'}
        await ex.share()
        assert ex.peers["r1"] is held
        router.others = {"r1": payload(10, {"a": [4, 5.0, 1.0]})}
        await ex.share()
        assert ex.peers["r1"].seq == 10
        assert ex.backends["a"].load.remote_in_flight == 4

    asyncio.run(run())


def test_the_others_chains_are_indexed_again_only_when_they_change() -> None:
    async def run() -> None:
        pending = PendingPrefixes()
        ex, router = exchange(pending)
        chain = [[0, 3, [11, 12, 13], []]]
        ex._pushed(f"r1 {payload(1, {'a': [1, 9.0, 0.0]}, pending={'a': chain})}")
        assert pending.told_chains("a") == 1
        index = pending._remote()
        router.others = {"r1": payload(1, {"a": [1, 9.0, 0.0]}, pending={"a": chain})}
        await ex.share()
        ex._apply_peers()
        assert pending._remote() is index  # the same peer, the same chains: not rebuilt
        ex._pushed(f"r1 {payload(2, {'a': [0, 0.0, 0.0]})}")
        assert pending.told_chains("a") == 0
        assert pending._remote() is not index

    asyncio.run(run())
