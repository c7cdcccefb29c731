"""``GatewayState``'s background loops while no request is in flight or pending: the
tick, the engines' scrape and the discovery wait their idle intervals (each wake-up of
an idle process costs CPU), the next request cuts that wait short (``arrived``), and a
busy gateway goes back to its own intervals. Driven on an event loop with idle intervals
of an hour, so nothing here depends on how fast the machine is."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from pcr.gateway.config import GatewayConfig
from pcr.gateway.state import IDLE_TICK_S, GatewayState
from tests.support.waiting import wait_until_async

HOUR = 3600.0


def gateway() -> GatewayState:
    return GatewayState(GatewayConfig(backends={"a": "http://127.0.0.1:9"}), registry=None)


def counting() -> tuple[list[float], Any]:
    ran: list[float] = []

    async def step() -> None:
        ran.append(time.monotonic())

    return ran, step


def test_an_idle_loop_waits_for_a_request_and_a_busy_one_keeps_its_interval() -> None:
    async def main() -> None:
        state = gateway()
        ran, step = counting()
        task = asyncio.ensure_future(state._every(0.01, step, idle=HOUR))
        try:
            for _ in range(20):  # many turns of the loop: the idle wait holds
                await asyncio.sleep(0.01)
            assert ran == []
            state.arrived()  # a request: the step at once, then idle again
            await wait_until_async(lambda: len(ran) == 1, 60, "the step after a request")
            for _ in range(20):
                await asyncio.sleep(0.01)
            assert len(ran) == 1
            state.backends["a"].load.in_flight = 1  # busy: every 0.01 s
            state.arrived()
            await wait_until_async(lambda: len(ran) >= 5, 60, "the busy interval")
            state.backends["a"].load.in_flight = 0
            settled = len(ran)
            for _ in range(20):
                await asyncio.sleep(0.01)
            assert len(ran) <= settled + 1  # the busy wait under way ends; then idle
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())


def test_a_request_wakes_every_idle_loop_and_the_first_step_can_run_at_once() -> None:
    async def main() -> None:
        state = gateway()
        first_ran, first = counting()
        other_ran, other = counting()
        tasks = [
            asyncio.ensure_future(state._every(HOUR, first, idle=HOUR, first=True)),
            asyncio.ensure_future(state._every(HOUR, other, idle=HOUR)),
        ]
        try:
            await wait_until_async(lambda: len(first_ran) == 1, 60, "the first step at start")
            for _ in range(10):
                await asyncio.sleep(0.01)
            assert other_ran == []
            state.arrived()
            await wait_until_async(
                lambda: len(first_ran) == 2 and len(other_ran) == 1, 60, "both loops woken"
            )
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())


def test_a_request_with_no_loop_waiting_wakes_nothing_later() -> None:
    """``arrived`` while no loop waits leaves nothing armed: the next idle wait is whole."""

    async def main() -> None:
        state = gateway()
        state.arrived()
        state.arrived()
        ran, step = counting()
        task = asyncio.ensure_future(state._every(0.01, step, idle=HOUR))
        try:
            for _ in range(20):
                await asyncio.sleep(0.01)
            assert ran == []
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())


def test_the_idle_tick_comes_by_the_load_exchange_s_keep_alive() -> None:
    state = gateway()
    exchange = state.exchange
    exchange._entry_ttl_ms = 60_000  # an idle entry: a keep-alive every 20 s
    exchange._shared_at = time.monotonic()
    assert state._tick_idle() == IDLE_TICK_S
    exchange._entry_ttl_ms = 1_000  # a busy entry's TTL: its keep-alive due in 1/3 s
    assert state._tick_idle() <= 1 / 3
    exchange._shared_at = time.monotonic() - 10
    assert state._tick_idle() == 0.0
