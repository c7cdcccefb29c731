"""The server's ticks (``pcr.web.server.server_class``): one every ``TICK_S`` instead of
uvicorn's ten a second (an idle gateway's wake-ups are most of its idle CPU), each
updating the date header as uvicorn's every tenth does, and a stopping signal ending
the wait at once rather than at the next tick."""

from __future__ import annotations

import signal
import threading
from typing import Any

import pytest

uvicorn = pytest.importorskip("uvicorn")

from pcr.web import server as web  # noqa: E402


async def _app(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})


def _server() -> Any:
    config = uvicorn.Config(_app, host="127.0.0.1", port=0, log_level="error")
    return web.server_class()(config)


def test_each_tick_counts_a_second_of_uvicorns_and_updates_the_date(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(web, "TICK_S", 0.01)
    server = _server()
    counters: list[int] = []
    dates: list[bytes] = []
    tick = server.on_tick

    async def counted(counter: int) -> bool:
        stop = await tick(counter)
        counters.append(counter)
        dates.append(dict(server.server_state.default_headers)[b"date"])
        if len(counters) == 4:
            server.should_exit = True  # a stop asked for without a signal: the next tick
        return stop

    server.on_tick = counted
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive()
    assert counters == [0, 10, 20, 30, 40]  # each a multiple of ten: the date refreshed
    assert all(date.endswith(b" GMT") for date in dates)


def test_a_stopping_signal_ends_the_wait_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ticks an hour apart, the server still stops when told: the signal's handler
    wakes the loop (the join's 60 s are far below the hour it would otherwise wait)."""
    monkeypatch.setattr(web, "TICK_S", 3_600.0)
    server = _server()
    ticked = threading.Event()
    tick = server.on_tick

    async def counted(counter: int) -> bool:
        ticked.set()
        return bool(await tick(counter))

    server.on_tick = counted
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    assert ticked.wait(60)  # started, in its loop of ticks
    server.handle_exit(signal.SIGTERM, None)  # as the signal's handler calls it
    thread.join(60)
    assert not thread.is_alive()
    assert server.should_exit
