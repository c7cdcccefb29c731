"""Node membership: leases in a node index, a heartbeat, and garbage collection.

An owning registry ``claim()``s its namespace: a new epoch, an empty namespace and a
lease whose end (by the Redis server's clock) is kept in two places: ``lease_until`` in
the namespace's meta hash (checked atomically by the scripts that score or delete it)
and the node index ``pcr:nodes`` (a ZSET, so routers and ``gc`` find namespaces without
scanning the keyspace). A namespace whose lease ran out is garbage: ``gc`` deletes its
keys and its index entry; its old owner's next write fails with ``StaleEpochError``.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Protocol

from registry.errors import REDIS_ERRORS, StaleEpochError, translate
from registry.keys import DEFAULT_KEY_PREFIX, NamespaceKeys, node_index_key, validate_namespace
from registry.scripts import ScriptRunner

log = logging.getLogger(__name__)

DEFAULT_LEASE_TTL = 10.0
"""Seconds a claim or a renewal keeps a namespace alive."""


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
        self._run("announce", (self.key,), (namespace, lease_until_ms))

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
        found = [_text(n) for n in shown]
        # Well-formed text that breaks the namespace rules (Unicode spaces, controls).
        members = [_text(n) for n in self._run("live_nodes", (self.key,), ("live",))[0]]
        members += [_text(n) for n in self._run("live_nodes", (self.key,), ("dead",))[0]]
        return found + [n for n in members if not _is_namespace(n)]

    def remove_invalid(self) -> list[str]:
        """Remove every invalid member from the index; return them as ``invalid()``."""
        shown, _count = self._run("live_nodes", (self.key,), ("purge",))
        removed = [_text(n) for n in shown]
        members = [_text(n) for n in self._run("live_nodes", (self.key,), ("live",))[0]]
        members += [_text(n) for n in self._run("live_nodes", (self.key,), ("dead",))[0]]
        for name in members:
            if not _is_namespace(name):
                try:
                    self.client.zrem(self.key, name)
                except REDIS_ERRORS as exc:
                    raise (translate(exc, f"node index {self.key!r}: remove") or exc) from exc
                removed.append(name)
        return removed

    def _members(self, mode: str) -> list[str]:
        names, skipped = self._run("live_nodes", (self.key,), (mode,))
        valid = []
        for raw in names:
            name = _text(raw)
            if _is_namespace(name):
                valid.append(name)
            else:
                skipped += 1
                self._warn(name)
        if skipped:
            with self._lock:
                self.skipped += int(skipped)
            self._warn(f"{int(skipped)} invalid members")
        return valid

    def _warn(self, what: str) -> None:
        with self._lock:
            if what in self._warned:
                return
            self._warned.add(what)
        log.warning(
            "node index %r holds %s that are not namespaces; skipped "
            "(`pcr stats` lists them, `pcr gc` removes them)",
            self.key,
            what if what.endswith("members") else repr(what),
        )

    def gc(self) -> list[str]:
        """Delete the keys and index entries of every dead namespace; return them.

        Each namespace's lease is checked again, atomically with its delete, so one that
        renewed meanwhile keeps everything. Costs one call per dead namespace.
        """
        removed = []
        for namespace in self.dead():
            keys = NamespaceKeys(namespace, self.key_prefix)
            if self._run("gc_namespace", keys.all_keys(), ()) == 0:
                continue  # renewed after it was listed
            self._run("forget_node", (self.key,), (namespace,))
            removed.append(namespace)
        return removed


def _is_namespace(name: str) -> bool:
    try:
        validate_namespace(name)
    except (TypeError, ValueError):
        return False
    return True


def live_nodes(client: Any, key_prefix: str = DEFAULT_KEY_PREFIX) -> list[str]:
    """Namespaces with an unexpired lease."""
    return NodeIndex(client, key_prefix).live()


def gc(client: Any, key_prefix: str = DEFAULT_KEY_PREFIX) -> list[str]:
    """Remove every namespace whose lease has expired; return the namespaces removed."""
    return NodeIndex(client, key_prefix).gc()


class Renewable(Protocol):
    """What a heartbeat renews: an owning registry."""

    def renew(self) -> float: ...


class Heartbeat:
    """A daemon thread renewing an owner's lease every ``interval`` seconds.

    It holds its owner weakly, so it stops by itself once the owner is garbage; it
    also stops when the owner turns out to be superseded (``lost`` is set). Connection
    errors are logged and retried at the next beat.
    """

    def __init__(self, owner: Renewable, interval: float, name: str) -> None:
        self._owner = weakref.ref(owner)
        self.interval = interval
        self.lost = threading.Event()
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            owner = self._owner()
            if owner is None:
                return  # the registry is gone: nothing left to keep alive
            try:
                owner.renew()
            except StaleEpochError:
                log.error("lease lost: this owner was superseded; heartbeat stops")
                self.lost.set()
                return
            except Exception:
                self.failures += 1
                log.warning("lease renewal failed; retrying", exc_info=True)
            finally:
                del owner

    def stop(self, timeout: float = 5.0) -> None:
        """Stop renewing (the lease then runs out unless renewed otherwise)."""
        self._stop.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    return str(value)
