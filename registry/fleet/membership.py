"""Node membership: the node index of leases, and collecting dead namespaces.

A claimed namespace's lease end (by the Redis server's clock) is kept in two places:
``lease_until`` in its meta hash (checked atomically by the scripts that score or delete
it) and the node index ``pcr:nodes`` (a ZSET, so routers and ``collect_dead`` find
namespaces without scanning the keyspace). A namespace whose lease ran out is garbage:
``collect_dead`` deletes its keys and its index entry; its old owner's next write fails
with ``StaleEpochError``. Claiming and renewing live in ``registry.namespace.ownership``.
"""

from __future__ import annotations

import logging
import threading
import warnings
from typing import Any

from registry.core.errors import REDIS_ERRORS, translate
from registry.core.keys import (
    DEFAULT_KEY_PREFIX,
    NamespaceKeys,
    engines_key,
    node_index_key,
    validate_namespace,
)
from registry.core.validation import text
from registry.namespace.ownership import announce_lease
from registry.transport.scripts import ScriptRunner

log = logging.getLogger(__name__)


class NodeIndex:
    """The ZSET of announced namespaces and their lease ends.

    Any node user may write the shared index, so every reader skips members that are
    not valid namespaces (logged once per index object, counted in ``skipped``);
    ``invalid()`` lists them and ``remove_invalid()`` (run by ``pcr gc``) drops them.
    """

    def __init__(self, client: Any, key_prefix: str = DEFAULT_KEY_PREFIX) -> None:
        self.client = client
        self.key_prefix = key_prefix
        self.key = node_index_key(key_prefix)
        self.engines_key = engines_key(key_prefix)
        self.skipped = 0  # invalid members skipped by live()/dead() so far
        self._runner = ScriptRunner(client)
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def _run(self, operation: str, keys: tuple[str, ...], args: tuple[Any, ...]) -> Any:
        return self._runner.run(
            operation, keys, args, context=f"node index {self.key!r}", write=False
        )

    def announce(self, namespace: str, lease_until_ms: int) -> None:
        """Record a lease end for ``namespace`` (never moving it back)."""
        announce_lease(self._runner, self.key_prefix, namespace, lease_until_ms)

    def announce_engine(self, namespace: str, url: str) -> None:
        """Say which engine serves ``namespace`` (its base URL, ``http://host:port``), for
        gateways (``pcr gateway``) to send requests to. Overwrites an earlier URL."""
        validate_namespace(namespace)
        validate_engine_url(url)
        try:
            self.client.hset(self.engines_key, namespace, url)
        except REDIS_ERRORS as exc:
            raise (translate(exc, f"engine table {self.engines_key!r}") or exc) from exc

    def forget_engine(self, namespace: str) -> None:
        """Drop ``namespace``'s engine URL (``announce_engine``)."""
        validate_namespace(namespace)
        try:
            self.client.hdel(self.engines_key, namespace)
        except REDIS_ERRORS as exc:
            raise (translate(exc, f"engine table {self.engines_key!r}") or exc) from exc

    def engines(self) -> dict[str, str]:
        """Every announced namespace -> engine URL; entries that break the rules (anyone
        allowed to write the table can add garbage) are skipped."""
        try:
            table = self.client.hgetall(self.engines_key)
        except REDIS_ERRORS as exc:
            raise (translate(exc, f"engine table {self.engines_key!r}") or exc) from exc
        return engine_table(table)

    def live(self) -> list[str]:
        """Namespaces whose lease has not run out (server clock), in index order."""
        return self._members("live")

    def dead(self) -> list[str]:
        """Namespaces whose lease has run out."""
        return self._members("dead")

    def invalid(self) -> list[str]:
        """Members of the index that are not valid namespaces (bytes that are not
        printable text shown as ``\\xNN``)."""
        shown, _count = self._run("live_nodes", (self.key,), ("invalid",))
        return [text(n) for n in shown] + self._breaking_the_rules()

    def remove_invalid(self) -> list[str]:
        """Remove every invalid member from the index; return them as ``invalid()``."""
        shown, _count = self._run("live_nodes", (self.key,), ("purge",))
        rest = self._breaking_the_rules()
        if rest:
            try:
                self.client.zrem(self.key, *rest)
            except REDIS_ERRORS as exc:
                raise (translate(exc, f"node index {self.key!r}: remove") or exc) from exc
        return [text(n) for n in shown] + rest

    def _breaking_the_rules(self) -> list[str]:
        """Well-formed text members that the Lua check lets through but the namespace
        rules refuse (Unicode spaces, controls, over 200 characters)."""
        members = [*self._run("live_nodes", (self.key,), ("live",))[0]]
        members += self._run("live_nodes", (self.key,), ("dead",))[0]
        return [name for name in map(text, members) if not _is_namespace(name)]

    def _members(self, mode: str) -> list[str]:
        names, skipped = self._run("live_nodes", (self.key,), (mode,))
        valid, refused = split_members(names, skipped)
        for name in refused:
            self._warn(name)
        if skipped or refused:
            with self._lock:
                self.skipped += int(skipped) + len(refused)
            self._warn(f"{int(skipped) + len(refused)} invalid members")
        return valid

    def _warn(self, what: str) -> None:
        with self._lock:
            if what in self._warned:
                return
            self._warned.add(what)
        warn_invalid(self.key, what)

    def gc(self) -> list[str]:
        """Deprecated spelling of :meth:`collect_dead` (goes in 0.3.0)."""
        warnings.warn(
            "NodeIndex.gc() is deprecated and goes in 0.3.0; use NodeIndex.collect_dead()",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.collect_dead()

    def collect_dead(self) -> list[str]:
        """Delete the keys and index entries of every dead namespace; return them.

        Each namespace's lease is checked again, atomically with its delete and again
        with its removal from the index, so one that renewed meanwhile keeps everything.
        Costs two calls per dead namespace.
        """
        removed = []
        for namespace in self.dead():
            keys = NamespaceKeys(namespace, self.key_prefix)
            if self._run("gc_namespace", keys.all_keys(), ()) == 0:
                continue  # renewed after it was listed
            self._run("forget_node", (self.key,), (namespace,))
            removed.append(namespace)
        return removed


MAX_URL_LENGTH = 500


def validate_engine_url(url: object) -> str:
    """Check an engine's base URL: ``http://`` or ``https://``, a host, printable, no
    whitespace, at most ``MAX_URL_LENGTH`` characters."""
    if not isinstance(url, str):
        raise TypeError(f"engine URL must be a str, not {type(url).__name__}")
    if not url or len(url) > MAX_URL_LENGTH:
        raise ValueError(f"engine URL must be 1 to {MAX_URL_LENGTH} characters")
    if not url.isprintable() or any(c.isspace() for c in url):
        raise ValueError("engine URL must not contain whitespace or control characters")
    scheme, sep, rest = url.partition("://")
    host = rest.split("/", 1)[0]
    if not sep or scheme.lower() not in ("http", "https") or not host or "@" in host:
        raise ValueError(f"engine URL must look like http://host:port, not {url[:80]!r}")
    return url


def engine_table(table: dict[Any, Any]) -> dict[str, str]:
    """An engine table read from Redis (bytes or text), without entries that break the
    namespace or URL rules."""
    engines = {}
    for raw_name, raw_url in table.items():
        name, url = text(raw_name), text(raw_url)
        try:
            validate_namespace(name)
            validate_engine_url(url)
        except (TypeError, ValueError):
            continue
        engines[name] = url.rstrip("/")
    return engines


def split_members(names: list[Any], skipped: int) -> tuple[list[str], list[str]]:
    """The ``live_nodes`` script's members as (namespaces, text members the namespace
    rules refuse); ``skipped`` (what the script itself skipped) is only passed along by
    callers. Shared by ``NodeIndex`` and the asyncio router."""
    valid: list[str] = []
    refused: list[str] = []
    for name in map(text, names):
        (valid if _is_namespace(name) else refused).append(name)
    return valid, refused


def warn_invalid(key: str, what: str) -> None:
    """Log, once per caller's choosing, that the index ``key`` holds ``what`` (a member,
    or "N invalid members") that is not a namespace."""
    log.warning(
        "node index %r holds %s that are not namespaces; skipped "
        "(`pcr stats` lists them, `pcr gc` removes them)",
        key,
        what if what.endswith("members") else repr(what),
    )


def _is_namespace(name: str) -> bool:
    try:
        validate_namespace(name)
    except (TypeError, ValueError):
        return False
    return True


def live_nodes(client: Any, key_prefix: str = DEFAULT_KEY_PREFIX) -> list[str]:
    """Namespaces with an unexpired lease."""
    return NodeIndex(client, key_prefix).live()


def collect_dead(client: Any, key_prefix: str = DEFAULT_KEY_PREFIX) -> list[str]:
    """Remove every namespace whose lease has expired; return the namespaces removed."""
    return NodeIndex(client, key_prefix).collect_dead()
