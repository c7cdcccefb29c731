"""Node membership: the node index, and collecting dead namespaces.

A claimed namespace's lease end (by the Redis server's clock) is ``lease_until`` in its
meta hash, which only its owner writes (checked atomically by the scripts that score or
delete it). Its owner also announces it in the node index ``pcr:nodes`` (a ZSET), so
routers and ``collect_dead`` find namespaces without scanning the keyspace; any node
user may write any member there, so the index is only a hint and every reader checks a
member against its own meta (``registry.fleet.leases``). A namespace whose lease ran
out is garbage: ``collect_dead`` deletes its keys and its index entry; its old owner's
next write fails with ``StaleEpochError``. Claiming and renewing live in
``registry.namespace.ownership``.
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
from registry.fleet.leases import (
    CHECK_BATCH,
    LeaseBook,
    Listing,
    lease_command,
)
from registry.namespace.ownership import announce_lease
from registry.transport.scripts import ScriptRunner, run_batched

log = logging.getLogger(__name__)


class NodeIndex:
    """The ZSET of announced namespaces and their announced lease ends.

    Any node user may write the shared index, so it is a hint: a member is live only
    while the lease in its own meta runs (``registry.fleet.leases``; what was read is
    kept in ``leases``, so a listing reads the metas of few members). Readers skip
    members that are not valid namespaces (logged once per index object, counted in
    ``skipped``); ``invalid()`` lists them and ``remove_invalid()`` (run by ``pcr gc``)
    drops them. Thread-safe.
    """

    def __init__(self, client: Any, key_prefix: str = DEFAULT_KEY_PREFIX) -> None:
        self.client = client
        self.key_prefix = key_prefix
        self.key = node_index_key(key_prefix)
        self.engines_key = engines_key(key_prefix)
        self.skipped = 0  # invalid members skipped by live()/dead() so far
        self.leases = LeaseBook(key_prefix)
        self._runner = ScriptRunner(client)
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def _run(self, operation: str, keys: tuple[str, ...], args: tuple[Any, ...]) -> Any:
        return self._runner.run(
            operation, keys, args, context=f"node index {self.key!r}", write=False
        )

    def announce(self, namespace: str, lease_until_ms: int) -> None:
        """Announce ``namespace`` with a lease end (never moving it back): a hint for
        readers, which call it live only while the lease in its own meta runs."""
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
        """Namespaces whose own lease (in their meta) has not run out (server clock), in
        index order."""
        listing = self._listing()
        self._check(listing, self.leases.due(listing))
        return self.leases.split(listing)[0]

    def dead(self) -> list[str]:
        """Namespaces of the index without a live lease of their own: run out, or never
        claimed (a member someone else wrote)."""
        return [name for name, _score in self._dead()]

    def invalid(self) -> list[str]:
        """Members of the index that are not valid namespaces (bytes that are not
        printable text shown as ``\\xNN``)."""
        shown, _count = self._run("live_nodes", (self.key,), ("invalid",))
        return [text(n) for n in shown] + self._listing().refused

    def remove_invalid(self) -> list[str]:
        """Remove every invalid member from the index; return them as ``invalid()``."""
        shown, _count = self._run("live_nodes", (self.key,), ("purge",))
        rest = self._listing().refused
        if rest:
            try:
                self.client.zrem(self.key, *rest)
            except REDIS_ERRORS as exc:
                raise (translate(exc, f"node index {self.key!r}: remove") or exc) from exc
        return [text(n) for n in shown] + rest

    def _dead(self) -> list[tuple[str, bytes]]:
        """(namespace, its score as read) of every member without a live lease, each
        checked now (no cap: for gc and stats)."""
        listing = self._listing()
        self._check(listing, self.leases.due(listing, every=True))
        return [(name, listing.scores[name]) for name in self.leases.split(listing)[1]]

    def _listing(self) -> Listing:
        """The index's members and scores with the server's clock (one call); members
        that are not namespaces are counted and logged once."""
        listing = self.leases.parse(self._run("live_nodes", (self.key,), ("list",)))
        for name in listing.refused:
            self._warn(name)
        bad = listing.skipped + len(listing.refused)
        if bad:
            with self._lock:
                self.skipped += bad
            self._warn(f"{bad} invalid members")
        return listing

    def _check(self, listing: Listing, names: list[str]) -> None:
        """Read ``names``' own leases (``CHECK_BATCH`` per round trip per Redis node) into
        ``leases``."""
        for first in range(0, len(names), CHECK_BATCH):
            part = names[first : first + CHECK_BATCH]
            metas = [self.leases.meta_key(name) for name in part]
            routed = [(meta, lease_command(meta)) for meta in metas]
            what = f"node index {self.key!r}: reading {len(part)} leases"
            try:
                replies = run_batched(self.client, routed)
            except REDIS_ERRORS as exc:
                raise (translate(exc, what, write=False) or exc) from exc
            for reply in replies:
                if isinstance(reply, Exception):
                    raise (translate(reply, what, write=False) or reply) from reply
            self.leases.learn(listing, part, replies)

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
        """Delete the keys and index entries of every namespace without a live lease of
        its own; return them.

        Each namespace's lease is checked again atomically with its delete
        (``gc_namespace``), so one that renewed meanwhile keeps everything; its index
        entry goes only if its score is still the one read (``forget_node``), so one
        claimed again meanwhile stays listed. ``GC_BATCH`` namespaces per round trip.
        """
        removed: list[str] = []
        dead = self._dead()
        for first in range(0, len(dead), GC_BATCH):
            part = dead[first : first + GC_BATCH]
            calls = [(NamespaceKeys(name, self.key_prefix).all_keys(), ()) for name, _ in part]
            deleted = self._runner.run_many(
                "gc_namespace", calls, context=f"collecting {len(part)} namespaces"
            )
            gone = [pair for pair, reply in zip(part, deleted, strict=True) if int(reply) == 1]
            if gone:
                pairs = [value for name, score in gone for value in (name, score)]
                self._run("forget_node", (self.key,), tuple(pairs))
            removed += [name for name, _score in gone]
        return removed


GC_BATCH = 256
"""Namespaces ``collect_dead`` deletes per round trip (and forgets per script call)."""


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


def warn_invalid(key: str, what: str) -> None:
    """Log, once per caller's choosing, that the index ``key`` holds ``what`` (a member,
    or "N invalid members") that is not a namespace."""
    log.warning(
        "node index %r holds %s that are not namespaces; skipped "
        "(`pcr stats` lists them, `pcr gc` removes them)",
        key,
        what if what.endswith("members") else repr(what),
    )


def live_nodes(client: Any, key_prefix: str = DEFAULT_KEY_PREFIX) -> list[str]:
    """Namespaces with an unexpired lease."""
    return NodeIndex(client, key_prefix).live()


def collect_dead(client: Any, key_prefix: str = DEFAULT_KEY_PREFIX) -> list[str]:
    """Remove every namespace whose lease has expired; return the namespaces removed."""
    return NodeIndex(client, key_prefix).collect_dead()
