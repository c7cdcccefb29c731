"""The one NOSCRIPT rule (``with_reload`` and its asyncio twin): a NOSCRIPT loads the
scripts and sends again, also when the resend meets NOSCRIPT once more (a Cluster
failover between the load and the resend: the slot's new primary was a replica when
every primary loaded the scripts), and never without bound."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.exceptions import NoScriptError

from registry.transport.scripts import RELOAD_ROUNDS, with_reload, with_reload_async


class Server:
    """Answers NOSCRIPT to the first ``missing`` sends, then "OK"; counts the loads."""

    def __init__(self, missing: int) -> None:
        self.missing = missing
        self.sends = 0
        self.loads = 0

    def send(self) -> list[Any]:
        self.sends += 1
        if self.sends <= self.missing:
            return [NoScriptError("No matching script. Please use EVAL.")]
        return ["OK"]

    def load(self) -> None:
        self.loads += 1

    async def send_async(self) -> list[Any]:
        return self.send()

    async def load_async(self) -> None:
        self.load()


def run(server: Server, asynchronous: bool) -> list[Any]:
    if asynchronous:
        return asyncio.run(with_reload_async(server.send_async, server.load_async))
    return with_reload(server.send, server.load)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("missing", [0, 1, 2])
def test_each_noscript_loads_and_sends_again(missing: int, asynchronous: bool) -> None:
    server = Server(missing)
    assert run(server, asynchronous) == ["OK"]
    assert (server.loads, server.sends) == (missing, missing + 1)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_server_that_never_holds_the_script_is_not_asked_forever(asynchronous: bool) -> None:
    server = Server(missing=1_000)
    (reply,) = run(server, asynchronous)
    assert isinstance(reply, NoScriptError)
    assert (server.loads, server.sends) == (RELOAD_ROUNDS, RELOAD_ROUNDS + 1)
