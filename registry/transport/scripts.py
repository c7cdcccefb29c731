"""The one script runner.

:class:`ScriptRunner` is the only way the project executes a script, pipelines included,
with every Redis fault translated once through ``registry.core.errors.translate``. It
sends FCALL of the operation's function when the server holds this client's Redis
Functions library (``pcr setup``; the rule, ``registry.transport.functions``), else
EVALSHA of the script's locally computed SHA1, with SCRIPT LOAD and a retry on NOSCRIPT
(a restart, a failover, ``SCRIPT FLUSH``; at most ``RELOAD_ROUNDS`` times). The scripts
themselves, and the library built from them: ``registry.transport.lua``.
:class:`AsyncScriptRunner` is its twin on ``redis.asyncio``: the route rule
(``RouteChoice``), the NOSCRIPT rule (``needs_reload``, a load and a retry per NOSCRIPT in
``with_reload`` / ``with_reload_async``), the errors and the batches are shared, only the
round trips are awaited.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

from redis.exceptions import (
    AskError,
    ClusterDownError,
    MaxConnectionsError,
    MovedError,
    NoScriptError,
    RedisClusterException,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from registry.core import observe
from registry.core.errors import (
    REDIS_ERRORS,
    NamespaceMirrored,
    RegistryError,
    RegistryMisconfigured,
    RegistryUnavailable,
    StaleEpochError,
    translate,
)
from registry.transport.functions import (
    Route,
    RouteChoice,
    as_function_call,
    function_missing,
    probe_command,
)
from registry.transport.lua import (
    OPERATIONS,
    function_name,
    function_verb,
    script_sha,
    script_source,
)
from registry.transport.lua import (  # here before registry.transport.lua held them
    lua_folder as lua_folder,
)
from registry.transport.lua import (
    read_script as read_script,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

_hiredis_pack: Callable[[tuple[Any, ...]], bytes] | None
try:
    from hiredis import pack_command as _hiredis_pack
except ImportError:  # pragma: no cover - without hiredis redis-py packs
    _hiredis_pack = None

STALE_EPOCH = "STALE_EPOCH"
NAMESPACE_MIRRORED = "NAMESPACE_MIRRORED"


Routed = tuple[Any, tuple[Any, ...]]
"""A command and the key that routes it to its Redis node (``run_batched``'s pairs)."""


class ScriptRunner:
    """Runs the project's scripts on one redis-py style client (thread-safe: it holds
    nothing that changes but what the client holds, and which way its calls go).

    Calls go by FCALL while the server holds this client's Functions library, else by
    EVALSHA (``registry.transport.functions``: decided by the first call's replies,
    without a round trip of its own).

    ``wait_replicas`` (0: off): each write (``run(write=True)``) is followed, on the same
    connection and in the same round trip, by ``WAIT wait_replicas wait_timeout``, and
    raises ``RegistryUnavailable`` (outcome unknown: it ran, but a failover may lose it)
    unless that many replicas acknowledged it. Replication is asynchronous: without it, a
    write the primary acknowledged and had not sent on is lost when a replica takes
    over. ``wait_timeout`` (seconds) must stay under the client's read timeout.
    """

    def __init__(self, client: Any, *, wait_replicas: int = 0, wait_timeout: float = 1.0) -> None:
        self.client = client
        self._direct = not is_cluster(client)  # a standalone server's pooled connection
        self.wait_replicas = wait_replicas
        self.wait_timeout = wait_timeout
        self._wait = ("WAIT", wait_replicas, max(1, round(wait_timeout * 1000)))
        self._choice = RouteChoice(client)

    @property
    def route(self) -> Route | None:
        """How calls go now: ``Route.FUNCTIONS``, ``Route.SCRIPTS``, or None before the
        first call told."""
        return self._choice.route

    def load(self, operations: Iterable[str] = OPERATIONS) -> None:
        """Make the first calls need no retry: nothing to do when the server holds the
        library (one FCALL of its version function tells), else SCRIPT LOAD the
        scripts."""
        try:
            if self._choice.route is not Route.SCRIPTS and self._offered():
                return
            for operation in operations:
                self._load_script(operation)
        except REDIS_ERRORS as exc:
            raise _translated(exc, "loading the scripts", write=False) from exc

    def _offered(self) -> bool:
        """Whether the server offers this client's library (the probe decides the route)."""
        try:
            reply = self.client.execute_command(*probe_command())
        except ResponseError as exc:
            reply = exc
        if isinstance(reply, Exception) and not function_missing(reply):
            raise reply
        return self._choice.after_functions([reply])

    def _load_script(self, operation: str) -> None:
        """SCRIPT LOAD ``operation``; a user that may not gets the library's hint."""
        try:
            self.client.script_load(script_source(operation))
        except ResponseError as exc:
            (reply,) = self._choice.after_scripts([exc])
            raise reply from exc

    def _dispatch(
        self, send: Callable[[Route], list[Any]], load: Callable[[], object]
    ) -> list[Any]:
        """``send(route)``'s replies: by FCALL first unless this runner goes by EVALSHA;
        by EVALSHA, with NOSCRIPT reloads, when a function is missing."""
        choice = self._choice
        if choice.first() is Route.FUNCTIONS:
            replies = send(Route.FUNCTIONS)
            if choice.after_functions(replies):
                return replies
        return choice.after_scripts(with_reload(lambda: send(Route.SCRIPTS), load))

    def run(
        self,
        operation: str,
        keys: Sequence[Any],
        args: Sequence[Any],
        *,
        context: str = "",
        write: bool = True,
        namespace: str | None = None,
        epoch: int | None = None,
    ) -> Any:
        """Run ``operation`` with ``keys`` and ``args``; its reply, or a registry error.

        ``context`` names what is being done in error messages (``namespace`` gives
        "namespace 'NS'"); ``epoch`` is the caller's owner epoch, named in a
        ``StaleEpochError``. Published with its outcome and time when an observer listens
        (``registry.core.observe``).
        """
        observer = observe.current
        if observer is not None:
            return observe.timed(
                observer,
                operation,
                self._run,
                operation,
                keys,
                args,
                context,
                write,
                namespace,
                epoch,
            )
        return self._run(operation, keys, args, context, write, namespace, epoch)

    def _run(
        self,
        operation: str,
        keys: Sequence[Any],
        args: Sequence[Any],
        context: str,
        write: bool,
        namespace: str | None,
        epoch: int | None,
    ) -> Any:
        durable = write and self.wait_replicas > 0
        try:  # a plain try: this is every write's path
            replies = self._dispatch(
                (lambda route: self._send_durably(route, operation, keys, args))
                if durable
                else (lambda route: [self._send(route, operation, keys, args)]),
                lambda: self._load_script(operation),
            )
            reply = replies[0]
            if isinstance(reply, Exception):
                raise reply
        except REDIS_ERRORS as exc:
            if namespace is not None:
                context = f"namespace {namespace!r}"
            raise script_error(exc, operation, context, write, namespace, epoch) from exc
        if durable:
            self._confirm(
                replies[1], operation, f"namespace {namespace!r}" if namespace else context
            )
        return reply

    def _send_durably(
        self, route: Route, operation: str, keys: Sequence[Any], args: Sequence[Any]
    ) -> list[Any]:
        """Run ``operation`` and ``WAIT`` on one connection, in one round trip (WAIT
        counts the replicas that have every write of its own connection): on a
        standalone server or Sentinel's master its pooled connection, on a cluster the
        connection to the primary serving the keys. Both replies; a lost connection
        raises (the write's outcome and replication are then unknown: a copy re-sent on
        another connection would prove nothing)."""
        command = script_command(route, operation, keys, args)
        # Every write script records its reply under its request id, so it always
        # replicates and WAIT covers everything it saw, even when it changed nothing.
        if self._direct:
            return on_one_connection(self.client, (command, self._wait))
        return on_the_keys_primary(self.client, keys[0], (command, self._wait))

    def confirmed_read(self, key: str, command: tuple[Any, ...]) -> Any:
        """``command``'s reply (a read of ``key``), returned only once ``wait_replicas``
        replicas hold everything it may have seen: on the same connection, in the same
        round trip, a write of ``key``'s mark (``mark_command``) and ``WAIT``.
        The mark's replication offset is past every write the read saw, so a replica
        that acknowledged it holds them all: a read never returns a write that a
        failover then loses (one its writer got no confirmation for). Raises
        ``RegistryUnavailable`` when fewer replicas acknowledged in time; a Redis fault
        raises as it is (the caller translates it)."""
        commands = (command, mark_command(key), self._wait)
        if self._direct:
            reply, marked, acked = on_one_connection(self.client, commands)
        else:
            reply, marked, acked = on_the_keys_primary(self.client, key, commands)
        for answer in (reply, marked, acked):
            if isinstance(answer, Exception):
                raise answer
        if int(acked) < self.wait_replicas:
            raise RegistryUnavailable(
                f"a read of {key!r}: {int(acked)} of the {self.wait_replicas} replicas asked "
                f"for held what it saw within {self.wait_timeout:g} s (a failover may lose it)"
            )
        return reply

    def _confirm(self, acked: Any, operation: str, context: str) -> None:
        """Raise unless ``WAIT`` answered at least ``wait_replicas`` replicas."""
        what = f"{context}: {operation}" if context else operation
        if isinstance(acked, Exception):
            raise _translated(acked, f"{what}: WAIT after the write", write=True) from acked
        if int(acked) < self.wait_replicas:
            raise RegistryUnavailable(
                f"{what}: the write ran, but {int(acked)} of the {self.wait_replicas} "
                f"replicas asked for acknowledged it within {self.wait_timeout:g} s: a "
                "failover may lose it (the write may or may not last)",
                outcome_unknown=True,
            )

    def _send(self, route: Route, operation: str, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """One call of ``operation``: its reply, an error reply as its exception (NOSCRIPT
        and a missing function included, for ``_dispatch``); a lost connection raises."""
        command = script_command(route, operation, keys, args)
        if keys or self._direct:
            # One write and one read of a pooled connection (on a cluster, of the
            # primary serving the keys), packed by hiredis: redis-py's own packing and
            # cluster routing cost more than the server's work for a write of a few
            # dozen pairs. None on a lost connection, a timeout or a redirection:
            # redis-py's path below then retries and follows it (writes are
            # exactly-once by their request ids).
            if self._direct:
                replies = run_on_one_connection(self.client, ((None, command),))
            else:
                replies = run_per_node(self.client, ((keys[0], command),))
            if replies is not None:
                return replies[0]
        try:
            if route is Route.SCRIPTS:
                return self.client.evalsha(*command[1:])
            return self.client.execute_command(*command)
        except ResponseError as exc:
            return exc

    def run_many(
        self,
        operation: str,
        calls: Sequence[tuple[Sequence[Any], Sequence[Any]]],
        *,
        context: str = "",
        write: bool = False,
    ) -> list[Any]:
        """Run ``operation`` once per (keys, args) in one pipeline (one round trip per
        Redis node); the replies in order. A NOSCRIPT reloads and runs the batch again,
        and so does a missing function (by EVALSHA)."""
        if not calls:
            return []
        observer = observe.current
        if observer is not None:
            return observe.timed(
                observer, operation, self._run_many, operation, calls, context, write
            )
        return self._run_many(operation, calls, context, write)

    def _run_many(
        self,
        operation: str,
        calls: Sequence[tuple[Sequence[Any], Sequence[Any]]],
        context: str,
        write: bool,
    ) -> list[Any]:
        def routed(route: Route) -> list[Routed]:
            return [(keys[0], script_command(route, operation, keys, args)) for keys, args in calls]

        try:
            replies = self._dispatch(
                lambda route: run_batched(self.client, routed(route)),
                lambda: self._load_script(operation),
            )
        except REDIS_ERRORS as exc:
            raise script_error(exc, operation, context, write, None, None) from exc
        for reply in replies:
            if isinstance(reply, Exception):
                raise script_error(reply, operation, context, write, None, None) from reply
        return replies

    def reloading(
        self, commands: Sequence[Routed], send: Callable[[Sequence[Routed]], list[Any]]
    ) -> list[Any]:
        """The replies of ``send(commands)``, a batch of EVALSHA commands its caller built
        and sends its own way (the mirror's flusher), sent as the FCALLs of the same
        functions while the server holds the library. When one meets NOSCRIPT every
        script is loaded and the whole batch sent again (``with_reload``), and when one
        meets a missing function the whole batch goes again by EVALSHA, so each command
        must tolerate a re-sent copy (a write's request id makes it a no-op). Redis
        faults propagate."""
        as_functions: list[Routed] = []

        def by(route: Route) -> list[Any]:
            if route is Route.SCRIPTS:
                return send(commands)
            if not as_functions:
                as_functions.extend((key, as_function_call(command)) for key, command in commands)
            return send(as_functions)

        return self._dispatch(by, self.load)


def script_command(
    route: Route, operation: str, keys: Sequence[Any], args: Sequence[Any]
) -> tuple[Any, ...]:
    """The command that runs ``operation`` by ``route``: ``FCALL``/``FCALL_RO`` of its
    function, or ``EVALSHA`` of its script."""
    if route is Route.FUNCTIONS:
        return (function_verb(operation), function_name(operation), len(keys), *keys, *args)
    return ("EVALSHA", script_sha(operation), len(keys), *keys, *args)


def script_error(
    exc: BaseException,
    operation: str,
    context: str,
    write: bool,
    namespace: str | None,
    epoch: int | None,
) -> RegistryError:
    """The registry error for a script call's failure (a reply or a raised fault):
    a fenced owner's ``StaleEpochError``, a mirrored namespace's ``NamespaceMirrored``,
    else ``errors.translate``'s vocabulary; what every runner and a batch sent its own
    way (the mirror's) raise."""
    what = f"{context}: {operation}" if context else operation
    if isinstance(exc, ResponseError) and str(exc).startswith(STALE_EPOCH):
        return StaleEpochError(namespace or context, epoch, str(exc))
    if isinstance(exc, ResponseError) and str(exc).startswith(NAMESPACE_MIRRORED):
        return NamespaceMirrored(namespace or context, str(exc))
    return _translated(exc, what, write=write)


def needs_reload(replies: Sequence[Any]) -> bool:
    """Whether a round's replies say the server does not hold a script (NOSCRIPT: a
    restart, a failover, ``SCRIPT FLUSH``), so it must be loaded and the round sent once
    more. The rule without I/O that ``with_reload`` and ``with_reload_async`` share."""
    return any(isinstance(reply, NoScriptError) for reply in replies)


RELOAD_ROUNDS = 2
"""Loads one call may need: a NOSCRIPT, then another when the resend went elsewhere
(a Cluster failover between the two: the slot's new primary was a replica when the
scripts were loaded on every primary, and SCRIPT LOAD does not replicate)."""


def with_reload(send: Callable[[], list[Any]], load: Callable[[], object]) -> list[Any]:
    """``send()``'s replies (error replies as exception objects); while they carry a
    NOSCRIPT, ``load()`` the scripts and ``send()`` again, at most ``RELOAD_ROUNDS``
    times (every script call here tolerates a re-sent copy). The one NOSCRIPT path of
    ``ScriptRunner``, one call or a batch."""
    replies = send()
    for _ in range(RELOAD_ROUNDS):
        if not needs_reload(replies):
            break
        load()
        replies = send()
    return replies


async def with_reload_async(
    send: Callable[[], Awaitable[list[Any]]], load: Callable[[], Awaitable[object]]
) -> list[Any]:
    """``with_reload`` for ``redis.asyncio``: the same rule, awaited."""
    replies = await send()
    for _ in range(RELOAD_ROUNDS):
        if not needs_reload(replies):
            break
        await load()
        replies = await send()
    return replies


def is_cluster(client: Any) -> bool:
    """Whether ``client`` is a redis-py ``RedisCluster`` (by what it offers)."""
    return callable(getattr(client, "get_node_from_key", None)) and hasattr(client, "nodes_manager")


REDIRECTED = (MovedError, AskError, TryAgainError, ClusterDownError)


def run_batched(client: Any, routed: Sequence[tuple[Any, tuple[Any, ...]]]) -> list[Any]:
    """Run commands in one round trip per Redis node; ``routed`` holds (routing key,
    command) pairs. A pipeline on a standalone server; on a cluster ``run_per_node``, or
    redis-py's cluster pipeline when the layout moved. Error replies come back as
    exception objects, in order; a lost connection raises."""
    if is_cluster(client):
        replies = run_per_node(client, routed)
    else:
        replies = run_on_one_connection(client, routed)
    if replies is not None:
        return replies
    pipe = client.pipeline(transaction=False)
    for _key, command in routed:
        # execute_command, not pipe.evalsha: redis-py's cluster pipeline refuses evalsha.
        pipe.execute_command(*command)
    result: list[Any] = pipe.execute(raise_on_error=False)
    return result


def run_on_one_connection(
    client: Any, routed: Sequence[tuple[Any, tuple[Any, ...]]]
) -> list[Any] | None:
    """Run commands on a standalone server (or Sentinel's master) in one write and one
    read of one pooled connection: a pipeline without redis-py's per-command
    bookkeeping, which costs a small batch as much as the server's work. Error replies
    come back as exception objects, in order. Returns None on a lost connection or a
    timeout, for a client without a plain connection pool, or for one built with
    ``single_connection_client=True`` (its commands stay on its own connection): the
    caller then runs redis-py's pipeline, which retries (every batched command tolerates
    a re-sent copy).
    """
    pool = direct_pool(client)
    if pool is None:
        return None
    try:
        connection = pool.get_connection()
    except (RedisConnectionError, RedisTimeoutError):
        return None
    healthy = False
    try:
        connection.send_packed_command(packed_commands(connection, [c for _k, c in routed]))
        replies = read_replies(connection, len(routed))
        healthy = True
    except (RedisConnectionError, RedisTimeoutError):
        return None
    finally:
        if not healthy:
            connection.disconnect()  # a half-read connection must not be reused
        pool.release(connection)
    return replies


def on_one_connection(client: Any, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
    """``commands`` on one pooled connection of a standalone server (or Sentinel's
    master), in one write and one read; error replies as exception objects. Unlike
    ``run_on_one_connection``, a lost connection or a timeout raises."""
    pool = direct_pool(client)
    if pool is None:
        raise RegistryMisconfigured(
            "wait_replicas needs a client with a connection pool of its own "
            "(not single_connection_client)"
        )
    return _on_connection(pool, commands)


def on_the_keys_primary(client: Any, key: Any, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
    """``commands`` on one connection to the primary of ``key``'s slot in a Redis
    Cluster, in one round trip; error replies as exception objects. A redirection (the
    slot moved: nothing ran) refreshes the slot map and tries again, a few times; a lost
    connection refreshes it and raises."""
    for _ in range(REDIRECTION_ROUNDS):
        pool = client.get_redis_connection(client.get_node_from_key(key)).connection_pool
        try:
            replies = _on_connection(pool, commands)
        except (RedisConnectionError, RedisTimeoutError):
            _refresh_layout(client)
            raise
        if not isinstance(replies[0], REDIRECTED):
            return replies
        _refresh_layout(client)
    raise ClusterDownError(f"the slot of {key!r} kept moving")


MARK_TTL_MS = "10000"
"""Milliseconds a confirmed call's mark key lives (``mark_command``)."""


def mark_command(key: str) -> tuple[str, ...]:
    """The write that ends a confirmed call on ``key`` before its ``WAIT``: ``SET`` of a
    short-lived mark key in ``key``'s slot (``pcr:{NS}:read-mark`` for a namespace's keys).
    It always replicates, so the call's ``WAIT`` covers every write the call may have
    seen, whether or not the call wrote anything itself."""
    if "{" in key and "}" in key[key.index("{") :]:
        mark = key[: key.index("}", key.index("{")) + 1] + ":read-mark"
    else:
        mark = "{" + key + "}:read-mark"
    return ("SET", mark, "1", "PX", MARK_TTL_MS)


REDIRECTION_ROUNDS = 3
"""Tries of a confirmed write on a cluster whose slot keeps moving."""


def _on_connection(pool: Any, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
    connection = pool.get_connection()
    healthy = False
    try:
        connection.send_packed_command(packed_commands(connection, commands))
        replies = read_replies(connection, len(commands))
        healthy = True
    finally:
        if not healthy:
            connection.disconnect()  # a half-read connection must not be reused
        pool.release(connection)
    return replies


def _refresh_layout(client: Any) -> None:
    """Ask the cluster for its slot map again (best effort: the next call tries too)."""
    try:
        client.nodes_manager.initialize()
    except REDIS_ERRORS:
        log.debug("refreshing the cluster's slot map failed", exc_info=True)


def direct_pool(client: Any) -> Any | None:
    """The connection pool a batch may take one connection from and write to directly
    (``run_on_one_connection``): a standalone client's (or Sentinel's), not a cluster's,
    and not that of a ``single_connection_client``, whose commands stay on its own
    connection. None otherwise: the caller uses redis-py's own path."""
    pool = getattr(client, "connection_pool", None)
    if pool is None or is_cluster(client) or not callable(getattr(pool, "get_connection", None)):
        return None
    if getattr(client, "connection", None) is not None:
        return None
    return pool


def read_replies(connection: Any, count: int) -> list[Any]:
    """``count`` replies read from ``connection``, an error reply as its exception."""
    replies: list[Any] = []
    for _ in range(count):
        try:
            replies.append(connection.read_response())
        except ResponseError as exc:
            replies.append(exc)
    return replies


def packed_commands(connection: Any, commands: Sequence[tuple[Any, ...]]) -> list[bytes]:
    """``commands`` in the wire format, for ``connection.send_packed_command``. With
    hiredis and the default UTF-8 encoding, packed by hiredis directly: redis-py's own
    packing looks at every argument in Python first, which for a prompt's hundreds of
    hashes costs more than the server's work."""
    encoder = getattr(connection, "encoder", None)
    if (
        _hiredis_pack is not None
        and getattr(encoder, "encoding", None) == "utf-8"
        and getattr(encoder, "encoding_errors", None) == "strict"
    ):
        pack = _hiredis_pack
        return [b"".join([pack(c) for c in commands])]
    result: list[bytes] = connection.pack_commands(commands)
    return result


def run_per_node(client: Any, routed: Sequence[tuple[Any, tuple[Any, ...]]]) -> list[Any] | None:
    """Run commands on a Redis Cluster, each on the primary serving its routing key's
    slot (``routed`` holds (routing key, command) pairs; a command without a key, such
    as TIME, goes where its key says): grouped by primary, written to every primary
    first, then every reply read, so each shard costs one round trip and the shards
    work at the same time. redis-py's cluster pipeline would first ask a node
    ``COMMAND GETKEYS`` for every script call, one blocking round trip each.

    Error replies come back as exception objects, in order. Returns None when the
    cluster's layout moved (a redirection, a lost connection): then the caller runs
    redis-py's own pipeline, which follows redirections and refreshes the layout.
    """
    groups: dict[str, tuple[Any, list[int]]] = {}
    for i, (key, _command) in enumerate(routed):
        node = client.get_node_from_key(key)
        groups.setdefault(node.name, (node, []))[1].append(i)
    replies: list[Any] = [None] * len(routed)
    taken: list[tuple[Any, Any, list[int]]] = []
    healthy = False
    try:
        for node, indexes in groups.values():
            pool = client.get_redis_connection(node).connection_pool
            connection = pool.get_connection()
            taken.append((pool, connection, indexes))
            commands = [routed[i][1] for i in indexes]
            connection.send_packed_command(packed_commands(connection, commands))
        for _pool, connection, indexes in taken:
            for i, reply in zip(indexes, read_replies(connection, len(indexes)), strict=True):
                replies[i] = reply
        healthy = True
    except (RedisConnectionError, RedisTimeoutError):
        return None
    finally:
        for pool, connection, _indexes in taken:
            if not healthy:
                connection.disconnect()  # a half-read connection must not be reused
            pool.release(connection)
    if any(isinstance(reply, REDIRECTED) for reply in replies):
        return None
    return replies


class AsyncScriptRunner:
    """``ScriptRunner`` on a ``redis.asyncio`` client (standalone or cluster), for the
    asyncio router: FCALL while the server holds the library, else EVALSHA by the same
    SHA, by the same rules (``RouteChoice``, ``needs_reload``), with the same errors and
    the same published operations; only the round trips are awaited. Use it from the
    event loop its client belongs to."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self._choice = RouteChoice(client)

    @property
    def route(self) -> Route | None:
        """How calls go now (``ScriptRunner.route``)."""
        return self._choice.route

    async def load(self, operations: Iterable[str] = OPERATIONS, *, context: str = "") -> None:
        """Make the first calls need no retry: nothing when the server holds the library,
        else SCRIPT LOAD ``operations``."""
        try:
            if self._choice.route is not Route.SCRIPTS and await self._offered():
                return
            for operation in operations:
                await self._load_one(operation)
        except REDIS_ERRORS as exc:
            raise _translated(exc, context or "loading the scripts", write=False) from exc

    async def loaded(self, operations: Iterable[str], *, context: str = "") -> bool:
        """Whether the server holds this client's library, or else every one of
        ``operations`` as a script (SCRIPT EXISTS)."""
        try:
            if self._choice.route is not Route.SCRIPTS and await self._offered():
                return True
            found = await self.client.script_exists(*map(script_sha, operations))
        except REDIS_ERRORS as exc:
            raise _translated(exc, context or "checking the scripts", write=False) from exc
        return all(bool(f) for f in found)

    async def _offered(self) -> bool:
        try:
            reply = await self.client.execute_command(*probe_command())
        except ResponseError as exc:
            reply = exc
        if isinstance(reply, Exception) and not function_missing(reply):
            raise reply
        return self._choice.after_functions([reply])

    async def _dispatch(
        self, send: Callable[[Route], Awaitable[list[Any]]], load: Callable[[], Awaitable[object]]
    ) -> list[Any]:
        """``ScriptRunner._dispatch``, awaited."""
        choice = self._choice
        if choice.first() is Route.FUNCTIONS:
            replies = await send(Route.FUNCTIONS)
            if choice.after_functions(replies):
                return replies
        return choice.after_scripts(await with_reload_async(lambda: send(Route.SCRIPTS), load))

    async def run(
        self,
        operation: str,
        keys: Sequence[Any],
        args: Sequence[Any],
        *,
        context: str = "",
        write: bool = True,
    ) -> Any:
        """``ScriptRunner.run``, awaited: ``operation``'s reply, or a registry error
        naming ``context``."""
        return await _counted(operation, self._run, operation, keys, args, context, write)

    async def _run(
        self, operation: str, keys: Sequence[Any], args: Sequence[Any], context: str, write: bool
    ) -> Any:
        async def send(route: Route) -> list[Any]:
            command = script_command(route, operation, keys, args)
            try:
                return [await execute_routed_async(self.client, keys[0] if keys else None, command)]
            except ResponseError as exc:
                return [exc]

        try:
            (reply,) = await self._dispatch(send, lambda: self._load_one(operation))
            if isinstance(reply, Exception):
                raise reply
            return reply
        except REDIS_ERRORS as exc:
            raise script_error(exc, operation, context, write, None, None) from exc

    async def run_many(
        self,
        operation: str,
        calls: Sequence[tuple[Sequence[Any], Sequence[Any]]],
        *,
        context: str = "",
        write: bool = False,
    ) -> list[Any]:
        """``ScriptRunner.run_many``, awaited: one pipeline of ``operation`` calls (one
        round trip per Redis node), the replies in order; a NOSCRIPT reloads and runs the
        batch again, and a missing function sends it again by EVALSHA."""
        if not calls:
            return []
        return await _counted(operation, self._run_many, operation, calls, context, write)

    async def _run_many(
        self,
        operation: str,
        calls: Sequence[tuple[Sequence[Any], Sequence[Any]]],
        context: str,
        write: bool,
    ) -> list[Any]:
        def routed(route: Route) -> list[Routed]:
            return [(keys[0], script_command(route, operation, keys, args)) for keys, args in calls]

        try:
            replies = await self._dispatch(
                lambda route: run_batched_async(self.client, routed(route)),
                lambda: self._load_one(operation),
            )
        except REDIS_ERRORS as exc:
            raise script_error(exc, operation, context, write, None, None) from exc
        for reply in replies:
            if isinstance(reply, Exception):
                raise script_error(reply, operation, context, write, None, None) from reply
        return replies

    async def _load_one(self, operation: str) -> None:
        try:
            await self.client.script_load(script_source(operation))
        except ResponseError as exc:
            (reply,) = self._choice.after_scripts([exc])
            raise reply from exc


async def execute_routed_async(client: Any, key: Any, command: tuple[Any, ...]) -> Any:
    """``command`` on ``client``; on a cluster an FCALL goes to the primary of ``key``'s
    slot as redis-py finds it for EVALSHA, by the slot map, without asking a node which
    of its arguments are keys (``COMMAND GETKEYS``: one round trip more per call). A
    redirection or a lost connection sends it again through redis-py's own routing,
    which follows them (every script call tolerates a re-sent copy)."""
    if key is None or not is_cluster(client) or command[0] == "EVALSHA":
        return await client.execute_command(*command)
    node = await slot_primary_async(client, key)
    if node is not None:
        try:
            return await client.execute_command(*command, target_nodes=node)
        except (*REDIRECTED, RedisConnectionError, RedisTimeoutError):
            pass
    return await client.execute_command(*command)


async def slot_primary_async(client: Any, key: Any) -> Any | None:
    """The primary serving ``key``'s slot by an asyncio cluster client's slot map (read
    first when the client has not connected yet), or None when the map does not say."""
    try:
        await client.initialize()  # at once when it already has
        return client.get_node_from_key(key)
    except (RedisClusterException, *REDIRECTED, RedisConnectionError, RedisTimeoutError):
        return None


async def run_batched_async(
    client: Any, routed: Sequence[tuple[Any, tuple[Any, ...]]]
) -> list[Any]:
    """``run_batched`` for ``redis.asyncio``: on a standalone server one write and one
    read of one pooled connection (``run_on_one_connection_async``), else (a cluster, a
    lost connection) redis-py's pipeline, whose async cluster flavour sends each primary
    its share at the same time (an FCALL to the primary of its key's slot by the slot
    map, as EVALSHA goes: ``execute_routed_async``; a redirected one is sent again by
    redis-py's routing). Error replies come back as exception objects, in order."""
    direct = await run_on_one_connection_async(client, routed)
    if direct is not None:
        return direct
    cluster = is_cluster(client)
    pipe = client.pipeline(transaction=False)
    for key, command in routed:
        node = None
        if cluster and command[0] != "EVALSHA":
            node = await slot_primary_async(client, key)
        if node is not None:
            pipe.execute_command(*command, target_nodes=node)
        else:
            pipe.execute_command(*command)
    replies: list[Any] = await pipe.execute(raise_on_error=False)
    return replies


async def run_on_one_connection_async(
    client: Any, routed: Sequence[tuple[Any, tuple[Any, ...]]]
) -> list[Any] | None:
    """``run_on_one_connection`` for ``redis.asyncio``: the commands in one write and one
    read of one pooled connection of a standalone server, packed by hiredis
    (``packed_commands``). Error replies come back as exception objects, in order. None
    on a lost connection or a timeout, or for a client without a plain connection pool
    (a cluster): the caller then runs redis-py's pipeline, which retries (every command
    sent this way tolerates a re-sent copy). A pool with no free connection
    (``MaxConnectionsError``) raises: it is not a lost connection, and the pipeline would
    be refused as well."""
    pool = direct_pool(client)
    if pool is None:
        return None
    try:
        connection = await pool.get_connection()
    except MaxConnectionsError:
        raise
    except (RedisConnectionError, RedisTimeoutError):
        return None
    healthy = False
    try:
        await connection.send_packed_command(
            packed_commands(connection, [command for _key, command in routed])
        )
        replies: list[Any] = []
        for _ in routed:
            try:
                replies.append(await connection.read_response())
            except ResponseError as exc:
                replies.append(exc)
        healthy = True
    except (RedisConnectionError, RedisTimeoutError):
        return None
    finally:
        if not healthy:
            await connection.disconnect()  # a half-read connection must not be reused
        await pool.release(connection)
    return replies


async def _counted(operation: str, call: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``await call(*args)``, published as ``operation`` with its outcome and time when an
    observer listens (``registry.core.observe``), as ``ScriptRunner`` publishes."""
    observer = observe.current
    if observer is None:
        return await call(*args)
    return await observe.timed_async(observer, operation, call, *args)


def _translated(exc: BaseException, what: str, *, write: bool) -> RegistryError:
    error = translate(exc, what, write=write)
    if error is None:  # not reachable for REDIS_ERRORS; kept as a guard
        raise exc
    return error
