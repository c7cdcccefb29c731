"""The server's ticks (``pcr.web.server.server_class``): one every ``TICK_S`` instead of
uvicorn's ten a second while a connection is open, one every ``IDLE_TICK_S`` while none
is (an idle gateway's wake-ups are most of its idle CPU), each updating the date header
as uvicorn's every tenth does; a stopping signal ends the wait at once rather than at
the next tick, and a connection opened on an idle server has its tick at once."""

from __future__ import annotations

import email.utils
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

uvicorn = pytest.importorskip("uvicorn")

from pcr.web import server as web  # noqa: E402
from tests.support.asgi import lifespan_only  # noqa: E402
from tests.support.waiting import wait_until  # noqa: E402


def _server(port: int = 0) -> Any:
    config = web.uvicorn_config(lifespan_only, host="127.0.0.1", port=port, log_level="error")
    return web.server_class()(config)


def _after_each_tick(server: Any, seen: Callable[[int], None]) -> None:
    """``seen(counter)`` after each of ``server``'s ticks."""
    tick = server.on_tick

    async def counted(counter: int) -> bool:
        stop = await tick(counter)
        seen(counter)
        return bool(stop)

    server.on_tick = counted


def test_each_tick_counts_a_second_of_uvicorns_and_updates_the_date(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(web, "TICK_S", 0.01)
    monkeypatch.setattr(web, "IDLE_TICK_S", 0.01)
    server = _server()
    counters: list[int] = []
    dates: list[bytes] = []

    def seen(counter: int) -> None:
        counters.append(counter)
        dates.append(dict(server.server_state.default_headers)[b"date"])
        if len(counters) == 4:
            server.should_exit = True  # a stop asked for without a signal: the next tick

    _after_each_tick(server, seen)
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
    monkeypatch.setattr(web, "IDLE_TICK_S", 3_600.0)
    server = _server()
    ticked = threading.Event()
    _after_each_tick(server, lambda _counter: ticked.set())
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    assert ticked.wait(60)  # started, in its loop of ticks
    server.handle_exit(signal.SIGTERM, None)  # as the signal's handler calls it
    thread.join(60)
    assert not thread.is_alive()
    assert server.should_exit


def test_an_idle_server_ticks_when_a_connection_opens(monkeypatch: pytest.MonkeyPatch) -> None:
    """No connection: no tick for an hour (a busy machine only makes ticks fewer). A
    connection opened: a tick at once, its date the date of now, and one every
    ``TICK_S`` while it stays open; closed: idle again."""
    monkeypatch.setattr(web, "TICK_S", 0.01)
    monkeypatch.setattr(web, "IDLE_TICK_S", 3_600.0)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = _server(port)
    counters: list[int] = []
    dates: list[float] = []

    def seen(counter: int) -> None:
        counters.append(counter)
        date = dict(server.server_state.default_headers)[b"date"].decode()
        dates.append(email.utils.parsedate_to_datetime(date).timestamp())

    _after_each_tick(server, seen)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started and len(counters) == 1, 60, "the first tick")
        time.sleep(2.1)  # 210 of TICK_S, and the start's date two seconds old
        assert len(counters) == 1
        opened = time.time()
        with socket.create_connection(("127.0.0.1", port), timeout=30):
            wait_until(lambda: len(counters) >= 2, 60, "a tick woken by the connection")
            assert dates[1] >= int(opened) - 1 > dates[0]  # the date of now, not the start's
            wait_until(lambda: len(counters) >= 6, 60, "ticks while it is open")
        wait_until(lambda: not server.server_state.connections, 60, "the connection closed")
        settled = len(counters)
        time.sleep(0.3)
        assert len(counters) <= settled + 1  # the wait under way ends: then idle
    finally:
        server.handle_exit(signal.SIGTERM, None)
        thread.join(60)
    assert not thread.is_alive()
