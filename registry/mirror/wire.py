"""Sending the mirror's built commands: one round trip per batch (per Redis node).

On a standalone redis-py client the batch goes on one pooled connection, packed by
hiredis, written at once and its replies read: several times less client time per
write than a redis-py pipeline, and one write and one read keep the flusher from taking
the engine's interpreter lock more often than it must. Anything else (a cluster,
fakeredis) goes through ``run_batched``. A NOSCRIPT, or a Functions library gone
missing, goes through the one runner's rule (``ScriptRunner.reloading``): the whole batch
is sent again, its request ids making the re-sent copies no-ops.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from registry.core.errors import REDIS_ERRORS, RegistryError, translate
from registry.mirror.writes import Routed
from registry.transport.client import RedisClient
from registry.transport.scripts import (
    ScriptRunner,
    direct_pool,
    packed_commands,
    read_replies,
    run_batched,
    script_error,
)


class MirrorWire:
    """The way one mirror's batches reach Redis (the flusher's only I/O)."""

    def __init__(self, client: RedisClient, namespace: str) -> None:
        self.client = client
        self.namespace = namespace
        self.runner = ScriptRunner(client)
        self._plain: Any = None  # the pool of a plain redis-py client, or False

    def send(self, commands: Sequence[Routed]) -> list[Any]:
        """One round trip of ``commands`` (per Redis node); error replies come back as
        exception objects, in order; a lost connection raises (the flusher retries)."""
        client = self.client
        if self._plain is None:
            self._plain = plain_connection_pool(client)
        pool = self._plain
        if not pool:
            return run_batched(client, commands)
        connection = pool.get_connection()
        healthy = False
        try:
            connection.send_packed_command(
                packed_commands(connection, [command for _, command in commands])
            )
            replies = read_replies(connection, len(commands))
            healthy = True
            return replies
        finally:
            if not healthy:
                connection.disconnect()  # a half-read connection must not be reused
            pool.release(connection)

    def run(self, commands: Sequence[Routed]) -> list[Any]:
        """``send(commands)`` (as the FCALLs of the same functions while Redis holds the
        registry's Functions library), sent again after loading the scripts on a
        NOSCRIPT; a Redis fault raised as the registry error it maps to."""
        try:
            return self.runner.reloading(commands, self.send)
        except REDIS_ERRORS as exc:
            error = translate(exc, f"namespace {self.namespace!r}: mirror flush", write=True)
            raise (error or exc) from exc

    def refusal(self, reply: Exception, operation: str, epoch: int | None) -> RegistryError:
        """The registry error an error reply of ``operation`` means (``StaleEpochError``
        when this owner was fenced)."""
        return script_error(reply, operation, "", True, self.namespace, epoch)


def plain_connection_pool(client: Any) -> Any:
    """The connection pool of a standalone redis-py client whose connections speak RESP
    on a socket (not a cluster, not fakeredis), or False."""
    pool = direct_pool(client)
    if pool is None:
        return False
    connection_class = getattr(pool, "connection_class", None)
    module = getattr(connection_class, "__module__", "")
    return pool if module == "redis.connection" else False
