"""The registry's one error vocabulary, and the one place Redis faults are mapped to it.

Every operation (registry, membership, router, listener, CLI) turns a redis-py exception
into one of these through :func:`translate`, so callers only ever catch this hierarchy::

    RegistryError
    ├── StaleEpochError          this owner was superseded, collected or lost its namespace
    ├── NamespaceMirrored        a mirrored owner holds the namespace: only it may write
    ├── RegistryUnavailable      retryable: Redis is not there right now
    └── RegistryFault            not retryable: an operator has to act
        ├── RegistryOutOfMemory      maxmemory reached under noeviction
        ├── RegistryQuotaExceeded    a write would take a namespace past its entry quota
        ├── RegistryPermissionError  login refused, or an ACL user lacks a command or key
        ├── RegistryWrongType        a registry key holds another Redis type
        └── RegistryMisconfigured    wrong URL kind, DB index, cluster settings, ...

Bad input never gets here: it raises ``TypeError``/``ValueError`` before anything is sent.
"""

from __future__ import annotations

import re
import socket

from redis.exceptions import (
    AskError,
    AuthenticationError,
    AuthorizationError,
    BusyLoadingError,
    ClusterDownError,
    NoPermissionError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError


class RegistryError(Exception):
    """Base class of the registry's own errors (bad input raises TypeError/ValueError)."""


class StaleEpochError(RegistryError):
    """A write from an owner that no longer owns its namespace: another process claimed
    it, ``gc`` collected it after its lease ran out, or its ``meta`` was lost (a server
    that restarted empty, an eviction). Nothing was changed; the process must stop
    writing, or claim again and start empty. Not retryable."""

    def __init__(self, namespace: str, epoch: int | None, detail: str) -> None:
        super().__init__(f"namespace {namespace!r}: {detail}")
        self.namespace = namespace
        self.epoch = epoch


class NamespaceMirrored(RegistryError):
    """A write to a namespace whose owner holds it through a write-behind mirror
    (``registry.mirror.MirroredRegistry``) with a live lease: only that owner may write,
    so its mirror never silently diverges from Redis. Nothing was changed. ``owner`` is
    the owner's label (as given to its ``claim``). Not retryable while the lease lives:
    ask the owner to evict, or take the namespace over with ``claim`` (README)."""

    def __init__(self, namespace: str, detail: str) -> None:
        super().__init__(f"namespace {namespace!r}: {detail}")
        self.namespace = namespace
        # "NAMESPACE_MIRRORED <owner> owns this namespace through ..."
        head = detail.removeprefix("NAMESPACE_MIRRORED ")
        self.owner = head.split(" owns this namespace", 1)[0]


class RegistryUnavailable(RegistryError):
    """Redis could not be reached in time (refused, timed out, failing over, loading,
    busy running a slow script). Retryable.

    ``outcome_unknown`` is True for a write whose command may have reached the server:
    it may have run. Calling the operation again is safe: reads change nothing;
    ``register_*`` write the same values again; ``evict_*`` and the clears remove what
    is still there; a removal that did happen was announced with a notice, which the
    slot owner's listener applies; ``claim`` takes another epoch, as good as the first;
    ``renew`` extends the same lease. Within one call, redis-py's own retries re-send
    the same request id, so the script's effect happens at most once and the reply is
    the one the first run recorded.
    """

    def __init__(self, message: str, *, outcome_unknown: bool = False) -> None:
        super().__init__(message)
        self.outcome_unknown = outcome_unknown


class RegistryFault(RegistryError):
    """Redis answered, but refused in a way retrying cannot fix: an operator must act
    (the message says what). Nothing was changed by the refused command."""


class RegistryOutOfMemory(RegistryFault):
    """Redis reached ``maxmemory`` under ``noeviction`` and refuses writes."""


class RegistryQuotaExceeded(RegistryFault):
    """A write that would take a namespace past its entry quota: more KV plus Mamba
    entries (``what`` "entries"), or on a bridged namespace more engine blocks, than the
    limit an admin set (``pcr quota set``) and than it holds now. Nothing of the write
    was applied: a batch is refused whole. Removals are never refused, so the owner can
    make room by evicting; or an admin raises the limit. ``namespace``, ``held`` (what it
    holds), ``limit`` and ``after`` (what the write would have left) come from the reply."""

    def __init__(
        self, message: str, *, namespace: str, held: int, limit: int, after: int, what: str
    ) -> None:
        super().__init__(message)
        self.namespace = namespace
        self.held = held
        self.limit = limit
        self.after = after
        self.what = what


QUOTA_REPLY = re.compile(
    r"^QUOTA namespace (?P<namespace>\S+) holds (?P<held>\d+) (?P<what>entries|engine blocks), "
    r"limit (?P<limit>\d+): this write would make it (?P<after>\d+)"
)
"""The error reply of a write refused by a namespace's quota (``lua/_prelude.lua``
``over_quota``)."""


def quota_exceeded(reason: str, what: str) -> RegistryQuotaExceeded | None:
    """The ``RegistryQuotaExceeded`` that the error reply ``reason`` of ``what`` means,
    or None when it is not a quota refusal."""
    found = QUOTA_REPLY.match(reason)
    if found is None:
        return None
    namespace, kind = found["namespace"], found["what"]
    held, limit, after = int(found["held"]), int(found["limit"]), int(found["after"])
    named = "" if repr(namespace) in what else f" of namespace {namespace!r}"
    return RegistryQuotaExceeded(
        f"{what}: refused by the entry quota{named}: it holds {held} {kind}, the limit is "
        f"{limit}, and this write would make it {after}; nothing of it was applied (evict "
        f"entries, or have an admin raise the limit: pcr quota set {namespace} N)",
        namespace=namespace,
        held=held,
        limit=limit,
        after=after,
        what=kind,
    )


class RegistryPermissionError(RegistryFault):
    """The login was refused, or the ACL user lacks a command, key or channel."""


class RegistryWrongType(RegistryFault):
    """A registry key holds another Redis type (written by something else)."""


class RegistryMisconfigured(RegistryFault):
    """The connection does not fit the server: a cluster URL for a standalone server or
    the reverse, a database index out of range, a server without scripting, ..."""


UNAVAILABLE = (
    RedisConnectionError,  # refused, reset, pool exhausted...
    RedisTimeoutError,
    socket.timeout,
    BusyLoadingError,  # a restarted server still loading its data
    ClusterDownError,  # includes MasterDownError: a failover in progress
    TryAgainError,  # a slot being migrated
    ReadOnlyError,  # a write that reached a replica during a failover
)
"""redis-py errors that mean "Redis is not there right now" (retryable)."""

REDIS_ERRORS = (RedisError, RedisClusterException, OSError)
"""Everything a redis-py call can raise for a fault of the server or the connection."""

_HINTS = {
    "oom": "Redis is out of memory (maxmemory under noeviction): raise maxmemory, or run "
    "`pcr gc` to drop dead namespaces",
    "login": "Redis refused the login: check the user name and password in the URL",
    "noperm": "the Redis user lacks a command, key or channel the registry needs: "
    "grant it (README: per-node ACL users)",
    "wrongtype": "a registry key holds another Redis type: something else wrote it; "
    "delete or rename that key (`pcr stats` names the namespace)",
    "cluster_on_standalone": "the URL asks for Redis Cluster but the server is standalone: "
    "use redis:// instead of redis+cluster://",
    "standalone_on_cluster": "the server is a Redis Cluster node: use redis+cluster://",
}


def _first_line(exc: BaseException) -> str:
    """The message's first line, without the client reprs redis-py appends (Sentinel)."""
    line = str(exc).split("\n")[0]
    line = re.sub(r"\s*:?\s*<redis\..*$", "", line).strip()
    return line or type(exc).__name__


def translate(exc: BaseException, what: str, *, write: bool = False) -> RegistryError | None:
    """The registry error for a redis-py exception raised while doing ``what``, or None
    when ``exc`` is not a Redis fault (a bug or bad input: let it propagate).

    ``write``: the command may have changed data, so an unavailability leaves its outcome
    unknown. Messages carry no passwords (redis-py never puts them in its errors).
    """
    if isinstance(exc, RegistryError):
        return exc
    reason = _first_line(exc)
    text = reason.upper()
    if isinstance(exc, (AuthenticationError, AuthorizationError)) or text.startswith(
        ("WRONGPASS", "NOAUTH", "INVALID PASSWORD", "INVALID USERNAME")
    ):
        return RegistryPermissionError(f"{what}: {_HINTS['login']} ({reason})")
    if (
        isinstance(exc, NoPermissionError)
        or "NOPERM" in text
        or "NO PERMISSIONS" in text
        or "CAN'T RUN THIS COMMAND" in text  # a refusal inside a script (Redis 7.0)
        or "THE USER EXECUTING THE SCRIPT CAN'T" in text  # ... of a key or channel
        or "NO PERMISSION" in text
    ):
        return RegistryPermissionError(f"{what}: {_HINTS['noperm']} ({reason})")
    if isinstance(exc, OutOfMemoryError) or text.startswith("OOM") or " OOM " in text:
        return RegistryOutOfMemory(f"{what}: {_HINTS['oom']} ({reason})")
    if text.startswith("BUSY ") or text.startswith("BUSY,"):
        # A slow script (someone else's) holds the server: retry after it ends.
        return RegistryUnavailable(f"{what}: Redis is busy running a script: {reason}")
    if isinstance(exc, UNAVAILABLE):
        unknown = write and isinstance(exc, (RedisConnectionError, RedisTimeoutError, OSError))
        suffix = " (the write may or may not have run)" if unknown else ""
        return RegistryUnavailable(
            f"{what}: Redis unavailable: {reason}{suffix}", outcome_unknown=unknown
        )
    if isinstance(exc, ResponseError) and (quota := quota_exceeded(reason, what)) is not None:
        return quota
    if "WRONGTYPE" in text:
        return RegistryWrongType(f"{what}: {_HINTS['wrongtype']} ({reason})")
    if isinstance(exc, RedisClusterException) or "CLUSTER SUPPORT DISABLED" in text:
        if "not enabled" in reason or "disabled" in reason.lower():
            return RegistryMisconfigured(f"{what}: {_HINTS['cluster_on_standalone']}")
        # "Redis Cluster cannot be connected": no startup node answered.
        return RegistryUnavailable(f"{what}: Redis Cluster unreachable: {reason}")
    if isinstance(exc, AskError) or text.startswith(("MOVED", "ASK ")):  # MovedError too
        return RegistryMisconfigured(f"{what}: {_HINTS['standalone_on_cluster']} ({reason})")
    if "DB INDEX IS OUT OF RANGE" in text or "SELECT IS NOT ALLOWED" in text:
        return RegistryMisconfigured(f"{what}: the URL's database index is wrong: {reason}")
    if isinstance(exc, ResponseError):
        return RegistryMisconfigured(f"{what}: Redis refused the command: {reason}")
    if isinstance(exc, RedisError):
        return RegistryUnavailable(f"{what}: Redis error: {reason}")
    if isinstance(exc, OSError):
        return RegistryUnavailable(f"{what}: Redis unavailable: {reason}", outcome_unknown=write)
    return None
