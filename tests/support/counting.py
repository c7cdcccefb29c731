"""Counting what a client sends: socket writes (round trips) per Redis node."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from redis.connection import Connection


@contextlib.contextmanager
def counted_sends() -> Iterator[list[str]]:
    """Every socket write of redis-py connections in the block, as "host:port": one per
    round trip (a pipeline or a batch is written at once)."""
    sends: list[str] = []
    original = Connection.send_packed_command

    def counting(self: Connection, *args: Any, **kwargs: Any) -> Any:
        sends.append(f"{self.host}:{self.port}")
        return original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Connection, "send_packed_command", counting)
        yield sends
