"""The tests' one wait helper: poll a condition until a deadline (no sleeps as
synchronisation, no timing margin a busy machine can break: the deadline only matters
when the condition never comes)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(condition: Callable[[], bool], timeout: float = 30.0, what: str = "") -> None:
    """Poll ``condition`` until it holds or the deadline passes (then fail)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.002)
    raise AssertionError(f"timed out waiting for {what or condition}")


async def wait_until_async(
    condition: Callable[[], bool], timeout: float = 30.0, what: str = ""
) -> None:
    """``wait_until`` on an event loop: polls between turns of the loop, which runs on."""
    import asyncio

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        await asyncio.sleep(0.002)
    raise AssertionError(f"timed out waiting for {what or condition}")
