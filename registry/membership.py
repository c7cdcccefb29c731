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
from typing import Any

from registry.errors import StaleEpochError, unavailable_as_registry_error
from registry.keys import DEFAULT_KEY_PREFIX, NamespaceKeys, node_index_key
from registry.scripts import register_scripts

log = logging.getLogger(__name__)

DEFAULT_LEASE_TTL = 10.0
"""Seconds a claim or a renewal keeps a namespace alive."""


class NodeIndex:
    """The ZSET of announced namespaces and their lease ends."""

    def __init__(self, client: Any, key_prefix: str = DEFAULT_KEY_PREFIX) -> None:
        self.client = client
        self.key_prefix = key_prefix
        self.key = node_index_key(key_prefix)
        self._scripts = register_scripts(
            client, ("announce", "live_nodes", "forget_node", "gc_namespace")
        )

    def _run(self, operation: str, keys: tuple[str, ...], args: tuple[Any, ...]) -> Any:
        with unavailable_as_registry_error(f"node index {self.key!r}: {operation}"):
            return self._scripts[operation](keys=keys, args=args)

    def announce(self, namespace: str, lease_until_ms: int) -> None:
        """Record a lease end for ``namespace`` (never moving it back)."""
        self._run("announce", (self.key,), (namespace, lease_until_ms))

    def live(self) -> list[str]:
        """Namespaces whose lease has not run out (server clock), in index order."""
        return [_text(n) for n in self._run("live_nodes", (self.key,), ("live",))]

    def dead(self) -> list[str]:
        """Namespaces whose lease has run out."""
        return [_text(n) for n in self._run("live_nodes", (self.key,), ("dead",))]

    def gc(self) -> list[str]:
        """Delete the keys and index entries of every dead namespace; return them.

        Each namespace's lease is checked again, atomically with its delete, so one that
        renewed meanwhile keeps everything. Costs one call per dead namespace.
        """
        removed = []
        for namespace in self.dead():
            try:
                keys = NamespaceKeys(namespace, self.key_prefix)
            except (TypeError, ValueError):
                log.warning("node index holds an invalid namespace %r; skipped", namespace)
                continue
            if self._run("gc_namespace", keys.all_keys(), ()) == 0:
                continue  # renewed after it was listed
            self._run("forget_node", (self.key,), (namespace,))
            removed.append(namespace)
        return removed


def live_nodes(client: Any, key_prefix: str = DEFAULT_KEY_PREFIX) -> list[str]:
    """Namespaces with an unexpired lease."""
    return NodeIndex(client, key_prefix).live()


def gc(client: Any, key_prefix: str = DEFAULT_KEY_PREFIX) -> list[str]:
    """Remove every namespace whose lease has expired; return the namespaces removed."""
    return NodeIndex(client, key_prefix).gc()


class Heartbeat:
    """A daemon thread renewing an owner's lease every ``interval`` seconds.

    It stops by itself when the owner turns out to be superseded (``lost`` is set);
    connection errors are logged and retried at the next beat.
    """

    def __init__(self, renew: Any, interval: float, name: str) -> None:
        self._renew = renew
        self.interval = interval
        self.lost = threading.Event()
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._renew()
            except StaleEpochError:
                log.error("lease lost: this owner was superseded; heartbeat stops")
                self.lost.set()
                return
            except Exception:
                self.failures += 1
                log.warning("lease renewal failed; retrying", exc_info=True)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop renewing (the lease then runs out unless renewed otherwise)."""
        self._stop.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
