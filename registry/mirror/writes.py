"""The mirror's queued writes as typed records, and their encoding into script calls.

A write is queued as it was given (an ``Op`` and its values: the engine's thread does no
more); the flusher takes a run of them and ``BatchEncoder`` turns it into
``lua/mirror_apply.lua`` calls, once: a ``Batch`` sent again after a lost reply carries
the same request ids, so each call in it applies at most once.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, NamedTuple

from registry.namespace.redis_registry import PrefixCacheRegistry
from registry.transport.lua import script_sha

CALL_WRITES = 100
CALL_VALUES = 2_000
"""Bounds of one ``lua/mirror_apply.lua`` call, so that it holds the server briefly: at
most ``CALL_WRITES`` writes, and no write starts in a call that already carries
``CALL_VALUES`` values (hashes and block ids; a single larger write gets a call of its
own, as one script it always was). A batch is sent as several such calls in one round
trip (BENCHMARKS.md has what a call holds the server)."""


class Op(StrEnum):
    """A queued write's operation, named; its value is the code ``lua/mirror_apply.lua``
    reads (the script's header lists the same codes: this is the one place in Python
    that must match them)."""

    REGISTER_KV = "k"
    EVICT_KV = "e"
    REGISTER_MAMBA = "m"
    EVICT_MAMBA = "x"
    CLEAR_KV = "K"
    CLEAR_MAMBA = "M"
    RESET = "R"


Routed = tuple[str, tuple[Any, ...]]
"""A command and the key that routes it to its Redis node (``run_batched``'s pairs)."""


class QueuedWrite(NamedTuple):
    """One write waiting for Redis, as the engine gave it."""

    op: Op
    values: Any
    """The registrations: the hash -> block id dict (sent as hash, id pairs); the
    evictions: the hashes removed (a list); the clears and the reset: nothing (an
    empty tuple)."""
    queued_at: float
    """``time.monotonic()`` when it was queued (what the lag is measured from)."""
    seq: int
    """The mirror's notice number after it: what Redis must answer after applying it."""


class Call(NamedTuple):
    """One ``mirror_apply`` call of a batch."""

    position: int
    """Its place in the batch's commands (and replies)."""
    last: int
    """The index in the batch's writes of the last write it carries."""


class Batch:
    """Writes taken from the queue, with their commands built once: a batch sent again
    after a lost reply re-sends the same commands, request ids included, so each
    ``mirror_apply`` call in it applies at most once."""

    __slots__ = ("calls", "commands", "first_sent", "writes")

    def __init__(
        self, writes: list[QueuedWrite], commands: list[Routed], calls: list[Call]
    ) -> None:
        self.writes = writes
        self.commands = commands
        self.calls = calls
        self.first_sent: float | None = None
        """``time.monotonic()`` of its first send (None before it)."""


class BatchEncoder:
    """Builds the commands of one namespace's mirror: runs of queued writes as
    ``mirror_apply`` calls, and the whole mirror as one ``mirror_resync`` call, each
    under a fresh request id of the wrapped registry."""

    def __init__(self, inner: PrefixCacheRegistry) -> None:
        self.inner = inner

    def batch(self, writes: list[QueuedWrite]) -> Batch:
        """``writes`` as ``mirror_apply`` calls of at most ``CALL_WRITES`` writes and about
        ``CALL_VALUES`` values each (one request id per call), sent in one round trip."""
        commands: list[Routed] = []
        calls: list[Call] = []
        # Compared by identity (an Enum's hash is a Python call): the flusher's loop.
        register_kv, register_mamba = Op.REGISTER_KV, Op.REGISTER_MAMBA
        start = 0
        while start < len(writes):
            values: list[Any] = []
            append = values.append
            stop = start
            while stop < len(writes) and stop - start < CALL_WRITES and len(values) < CALL_VALUES:
                op, data, _queued, _seq = writes[stop]
                append(op)
                append(len(data))
                if op is register_kv or op is register_mamba:
                    for item in data.items():
                        values += item
                elif data:
                    values += data
                stop += 1
            calls.append(Call(len(commands), stop - 1))
            commands.append(self._command("mirror_apply", values))
            start = stop
        return Batch(writes, commands, calls)

    def resync(self, continue_from: int, kv: list[Any], mamba: list[Any]) -> Routed:
        """The ``mirror_resync`` call that rewrites the namespace: ``kv`` and ``mamba``
        flattened (hash, id, ...), its notices numbered on from ``continue_from``."""
        return self._command("mirror_resync", (str(continue_from), len(kv) // 2, *kv, *mamba))

    def _command(self, operation: str, values: Any) -> Routed:
        inner = self.inner
        all_keys, args = inner.write_args(operation, inner.all_write_keys, True, values)
        command = ("EVALSHA", script_sha(operation), len(all_keys), *all_keys, *args)
        return all_keys[0], command
