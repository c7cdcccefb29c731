"""Typed exceptions the scripts' status replies and Redis faults turn into."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    BusyLoadingError,
    ClusterDownError,
    ReadOnlyError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError


class RegistryError(Exception):
    """Base class of the registry's own errors (bad input raises TypeError/ValueError)."""


class StaleEpochError(RegistryError):
    """A write from an owner whose epoch was superseded: another process claimed the
    namespace, or its lease ran out and the namespace was garbage-collected. Nothing
    was changed; the process must stop writing (or claim again and start empty)."""

    def __init__(self, namespace: str, epoch: int | None, detail: str) -> None:
        super().__init__(f"namespace {namespace!r}: {detail}")
        self.namespace = namespace
        self.epoch = epoch


class RegistryUnavailable(RegistryError):
    """Redis could not be reached in time (refused, timed out, failing over, loading).

    Whether the call took effect is unknown, and every registry operation is safe to
    call again: reads change nothing; ``register_*`` write the same values again;
    ``evict_*`` and the clears remove what is still there (a repeat removes nothing
    more and publishes no second notice); ``claim`` takes yet another epoch, which is
    as good as the first; ``renew`` extends the same lease.
    """


UNAVAILABLE = (
    RedisConnectionError,  # refused, reset, pool exhausted, authentication failed...
    RedisTimeoutError,
    BusyLoadingError,  # a restarted server still loading its data
    ClusterDownError,  # includes MasterDownError: a failover in progress
    TryAgainError,  # a slot being migrated
    ReadOnlyError,  # a write that reached a replica during a failover
)
"""Errors that mean "Redis is not there right now"."""


def registry_unavailable(what: str, exc: BaseException) -> RegistryUnavailable:
    """The ``RegistryUnavailable`` for a Redis fault (one clear type, no password in it)."""
    reason = str(exc).split("\n")[0] or type(exc).__name__
    if isinstance(exc, (AuthenticationError, AuthorizationError)):
        return RegistryUnavailable(f"{what}: Redis refused the login: {reason}")
    return RegistryUnavailable(f"{what}: Redis unavailable: {reason}")


@contextmanager
def unavailable_as_registry_error(what: str) -> Iterator[None]:
    """Raise ``RegistryUnavailable`` for Redis faults inside the block."""
    try:
        yield
    except UNAVAILABLE as exc:
        raise registry_unavailable(what, exc) from exc
