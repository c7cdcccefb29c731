"""``AsyncPrefixRouter``: ``PrefixRouter`` on ``redis.asyncio``, for asyncio services.

The same rules as the thread-safe router (``registry.routing.routing``), through the
plan both share (``registry.routing.plan``): a started fleet view scored from while it
follows Redis, else the same checks of the prompt and the namespaces, the same
``lua/score.lua`` (by the same SHA, reloaded on NOSCRIPT), the same live-node listing
(``lua/live_nodes.lua``), the same ``NodeScore`` and the same tie-breaking in ``best``;
only the round trips are awaited. One ``score`` from Redis
is one pipeline: one round trip on a standalone server; on Redis Cluster
(``redis.asyncio.cluster.RedisCluster``) redis-py's async cluster pipeline sends each
primary its share at the same time. Every Redis fault is translated by
``registry.core.errors.translate``, as on the sync side.

Each script round (``score``, ``live_nodes``) is counted and timed by its outcome when
an observer listens (``registry.core.observe``; ``registry.metrics`` is one), with the
operation names and outcomes of the sync router's ``ScriptRunner``.

A router never writes and never claims an epoch. Use it from one event loop (the loop
its client belongs to). One call holds at most one connection per Redis node at a time,
so at most ``max_connections`` calls at once never exhaust a pool of that size.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError, NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from registry.core import observe
from registry.core.errors import REDIS_ERRORS, RegistryError, translate
from registry.core.keys import (
    DEFAULT_KEY_PREFIX,
    NamespaceKeys,
    engines_key,
    gateway_load_channel,
    gateway_load_key,
    node_index_key,
)
from registry.core.scores import NodeScore, checked_hybrid
from registry.fleet.membership import engine_table, split_members, warn_invalid
from registry.routing.plan import (
    best_of,
    chosen_namespaces,
    pack_hashes,
    routing_context,
    score_calls,
    scores_from_replies,
)
from registry.transport.scripts import direct_pool, packed_commands, script_sha, script_source

if TYPE_CHECKING:
    from registry.fleet.view import FleetView

T = TypeVar("T")

ROUTER_SCRIPTS = ("score", "live_nodes")
"""The scripts a router runs (``load`` sends them ahead of the first call)."""


class AsyncPrefixRouter:
    """Scores live nodes for a prompt's block hashes and picks the best one (asyncio)."""

    def __init__(
        self,
        client: Any,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        *,
        hybrid: bool | None = None,
        live_cache_ttl: float = 1.0,
        exact: bool = False,
        view: FleetView | None = None,
    ) -> None:
        if not isinstance(exact, bool):
            raise TypeError("exact must be True or False")
        if view is not None and exact:
            raise ValueError("a router scores exactly or from a fleet view, not both")
        self.exact = exact
        """As ``PrefixRouter.exact``: always per namespace, never from a view."""
        self.view = view
        """As ``PrefixRouter.view``: scored from in memory while it follows Redis."""
        self.client = client
        self.key_prefix = key_prefix
        self.hybrid = checked_hybrid(hybrid)
        self.live_cache_ttl = live_cache_ttl
        self.index_key = node_index_key(key_prefix)
        self.skipped = 0  # invalid node-index members skipped so far
        self._live: tuple[float, list[str]] = (float("-inf"), [])
        self._keys: dict[str, NamespaceKeys] = {}
        self._warned: set[str] = set()

    async def load(self) -> None:
        """SCRIPT LOAD the router's scripts now, so the first calls need no reload."""
        try:
            for operation in ROUTER_SCRIPTS:
                await self.client.script_load(script_source(operation))
        except REDIS_ERRORS as exc:
            raise _translated(exc, "loading the router's scripts") from exc

    async def scripts_loaded(self) -> bool:
        """Whether the server holds the router's scripts (SCRIPT EXISTS)."""
        try:
            found = await self.client.script_exists(*map(script_sha, ROUTER_SCRIPTS))
        except REDIS_ERRORS as exc:
            raise _translated(exc, "checking the router's scripts") from exc
        return all(bool(f) for f in found)

    async def live_nodes(self) -> list[str]:
        """Namespaces with a live lease (cached for ``live_cache_ttl`` seconds; a node
        that died within that time is still never scored: each score checks its lease)."""
        fetched_at, names = self._live
        if time.monotonic() - fetched_at < self.live_cache_ttl:
            return names
        names = await self._members("live")
        self._live = (time.monotonic(), names)
        return names

    async def score(
        self, hashes: Sequence[int], namespaces: Iterable[str] | None = None
    ) -> dict[str, NodeScore]:
        """Per live namespace (all, or those given), the cached prefix of ``hashes``."""
        observer = observe.current
        if observer is None:
            return await self._score(hashes, namespaces)
        started = time.perf_counter()
        try:
            return await self._score(hashes, namespaces)
        finally:
            observer.score_took(time.perf_counter() - started)

    async def _score(
        self, hashes: Sequence[int], namespaces: Iterable[str] | None
    ) -> dict[str, NodeScore]:
        view = self.view
        if view is not None and view.fresh():
            return view.score(hashes, namespaces, hybrid=self.hybrid, everyone=True)
        packed = pack_hashes(hashes)
        names = await self.live_nodes() if namespaces is None else chosen_namespaces(namespaces)
        if not names:
            return {}
        return await self._score_exactly(names, packed)

    async def _score_exactly(self, names: list[str], packed: bytes) -> dict[str, NodeScore]:
        calls = score_calls(names, packed, self.key_prefix, self._keys, hybrid=self.hybrid)
        replies = await self._run_many("score", calls, routing_context(names))
        return scores_from_replies(names, replies, hybrid=self.hybrid)

    async def best(
        self,
        hashes: Sequence[int],
        load: Mapping[str, float] | None = None,
        namespaces: Iterable[str] | None = None,
    ) -> str | None:
        """The live node with the longest usable prefix; ties go to the lowest ``load``
        (missing = 0), then to the first namespace in sort order. None if none is live."""
        return (await self.decide(hashes, load, namespaces))[1]

    async def decide(
        self,
        hashes: Sequence[int],
        load: Mapping[str, float] | None = None,
        namespaces: Iterable[str] | None = None,
    ) -> tuple[dict[str, NodeScore], str | None]:
        """``score`` and ``best`` from one round of scripts: the scores and the choice."""
        scores = await self.score(hashes, namespaces)
        choice = best_of(scores, load)
        observer = observe.current
        if observer is not None:
            observer.routed(scores, choice, hashes)
        return scores, choice

    # -- what gateways share (pcr gateway) ----------------------------------------------

    async def engines(self) -> dict[str, str]:
        """Namespace -> engine URL, as announced (``NodeIndex.announce_engine``)."""
        key = engines_key(self.key_prefix)
        try:
            table = await self.client.hgetall(key)
        except REDIS_ERRORS as exc:
            raise _translated(exc, f"engine table {key!r}: HGETALL") from exc
        return engine_table(table)

    async def exchange_load(self, replica: str, ttl_ms: int, payload: str) -> dict[str, str]:
        """Publish one gateway replica's load (expiring after ``ttl_ms``, and on the
        channel ``gateway_load_channel``) and read the other live replicas' (``lua/
        gateway_load.lua``): replica id -> payload, one round trip."""
        key = gateway_load_key(self.key_prefix)
        channel = gateway_load_channel(self.key_prefix)
        replies = await self._run(
            "gateway_load", (key,), (replica, ttl_ms, payload, channel), f"gateway load {key!r}"
        )
        texts = [r.decode("utf-8", "replace") if isinstance(r, bytes) else str(r) for r in replies]
        return dict(zip(texts[0::2], texts[1::2], strict=False))

    # -- running the scripts ----------------------------------------------------------

    async def _members(self, mode: str) -> list[str]:
        what = f"node index {self.index_key!r}"
        names, skipped = await self._run("live_nodes", (self.index_key,), (mode,), what)
        valid, refused = split_members(names, skipped)
        for name in refused:
            self._warn(name)
        if skipped or refused:
            self.skipped += int(skipped) + len(refused)
            self._warn(f"{int(skipped) + len(refused)} invalid members")
        return valid

    def _warn(self, what: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            warn_invalid(self.index_key, what)

    async def _run(
        self, operation: str, keys: Sequence[Any], args: Sequence[Any], what: str
    ) -> Any:
        return await _counted(operation, self._run_once, operation, keys, args, what)

    async def _run_once(
        self, operation: str, keys: Sequence[Any], args: Sequence[Any], what: str
    ) -> Any:
        sha = script_sha(operation)
        try:
            try:
                return await self.client.evalsha(sha, len(keys), *keys, *args)
            except NoScriptError:
                await self.client.script_load(script_source(operation))
                return await self.client.evalsha(sha, len(keys), *keys, *args)
        except REDIS_ERRORS as exc:
            raise _translated(exc, f"{what}: {operation}") from exc

    async def _run_many(
        self, operation: str, calls: Sequence[tuple[Sequence[Any], Sequence[Any]]], what: str
    ) -> list[Any]:
        """One pipeline of ``operation`` calls; a NOSCRIPT reloads and runs it again."""
        return await _counted(operation, self._run_many_once, operation, calls, what)

    async def _run_many_once(
        self, operation: str, calls: Sequence[tuple[Sequence[Any], Sequence[Any]]], what: str
    ) -> list[Any]:
        try:
            replies = await self._pipeline(operation, calls)
            if any(isinstance(r, NoScriptError) for r in replies):
                await self.client.script_load(script_source(operation))
                replies = await self._pipeline(operation, calls)
        except REDIS_ERRORS as exc:
            raise _translated(exc, f"{what}: {operation}") from exc
        for reply in replies:
            if isinstance(reply, Exception):
                raise _translated(reply, f"{what}: {operation}") from reply
        return replies

    async def _pipeline(
        self, operation: str, calls: Sequence[tuple[Sequence[Any], Sequence[Any]]]
    ) -> list[Any]:
        sha = script_sha(operation)
        routed = [(keys[0], ("EVALSHA", sha, len(keys), *keys, *args)) for keys, args in calls]
        direct = await run_on_one_connection(self.client, routed)
        if direct is not None:
            return direct
        pipe = self.client.pipeline(transaction=False)
        for _key, command in routed:
            pipe.execute_command(*command)
        replies: list[Any] = await pipe.execute(raise_on_error=False)
        return replies


async def run_on_one_connection(
    client: Any, routed: Sequence[tuple[Any, tuple[Any, ...]]]
) -> list[Any] | None:
    """``registry.transport.scripts.run_on_one_connection`` for ``redis.asyncio``: the commands
    in one write and one read of one pooled connection of a standalone server, packed by
    hiredis (redis-py's pipeline looks at every argument in Python, which for a prompt's
    hundreds of hashes costs more than the server's work). Error replies come back as
    exception objects, in order. None on a lost connection or a timeout, or for a client
    without a plain connection pool (a cluster): the caller then runs redis-py's
    pipeline, which retries (every command sent this way tolerates a re-sent copy). A
    pool with no free connection (``MaxConnectionsError``) raises: it is not a lost
    connection, and the pipeline would be refused as well."""
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


def _translated(exc: BaseException, what: str) -> RegistryError:
    error = translate(exc, what, write=False)
    if error is None:  # not reachable for REDIS_ERRORS; kept as a guard
        raise exc
    return error


async def _counted(operation: str, call: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``await call(*args)``, published as ``operation`` with its outcome and time when an
    observer listens."""
    observer = observe.current
    if observer is None:
        return await call(*args)
    return await observe.timed_async(observer, operation, call, *args)
