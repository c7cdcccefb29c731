"""The ready line (``pcr.web.server.server_class``): the workers of one gateway share
their stdout, so each says it is ready in one write of the whole line; ``print`` made
two where output is unbuffered (``PYTHONUNBUFFERED=1``), and two workers starting
together wrote ``ready...ready...`` and an empty line, which a supervisor (and the
tests' ``ServeProcess``) waiting for the line never saw."""

from __future__ import annotations

import signal
import threading

import pytest

uvicorn = pytest.importorskip("uvicorn")

from pcr.web import server as web  # noqa: E402
from tests.support.asgi import lifespan_only  # noqa: E402
from tests.support.waiting import wait_until  # noqa: E402


class _Writes:
    """A text stream that keeps each ``write`` apart, as an unbuffered pipe sees them."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def test_the_ready_line_is_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    config = web.uvicorn_config(lifespan_only, host="127.0.0.1", port=0, log_level="error")
    server = web.server_class("pcr test: ready on http://127.0.0.1:1")(config)
    out = _Writes()
    monkeypatch.setattr("sys.stdout", out)  # once uvicorn's logging is set up
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: out.writes, 60, "the ready line")
    finally:
        server.handle_exit(signal.SIGTERM, None)
        thread.join(60)
    assert not thread.is_alive()
    assert out.writes == ["pcr test: ready on http://127.0.0.1:1\n"]


def test_say_line_writes_the_line_and_its_newline_together() -> None:
    err = _Writes()
    web.say_line("worker 1 (pid 7) ended with signal 9; starting another", err)
    assert err.writes == ["worker 1 (pid 7) ended with signal 9; starting another\n"]
