"""Node membership: the node index of leases, and collecting dead namespaces.

A claimed namespace's lease end (by the Redis server's clock) is kept in two places:
``lease_until`` in its meta hash (checked atomically by the scripts that score or delete
it) and the node index ``pcr:nodes`` (a ZSET, so routers and ``collect_dead`` find
namespaces without scanning the keyspace). A namespace whose lease ran out is garbage:
``collect_dead`` deletes its keys and its index entry; its old owner's next write fails
with ``StaleEpochError``. Claiming and renewing live in ``registry.ownership``.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from registry.errors import REDIS_ERRORS, translate
from registry.fleet import FleetMembers
from registry.keys import DEFAULT_KEY_PREFIX, NamespaceKeys, node_index_key, validate_namespace
from registry.scripts import ScriptRunner

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
        self.skipped = 0  # invalid members skipped by live()/dead() so far
        self.scrubbed = 0  # member ids the last collect_dead scrubbed from the fleet index
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
        return [_text(n) for n in shown] + self._breaking_the_rules()

    def remove_invalid(self) -> list[str]:
        """Remove every invalid member from the index; return them as ``invalid()``."""
        shown, _count = self._run("live_nodes", (self.key,), ("purge",))
        rest = self._breaking_the_rules()
        if rest:
            try:
                self.client.zrem(self.key, *rest)
            except REDIS_ERRORS as exc:
                raise (translate(exc, f"node index {self.key!r}: remove") or exc) from exc
        return [_text(n) for n in shown] + rest

    def _breaking_the_rules(self) -> list[str]:
        """Well-formed text members that the Lua check lets through but the namespace
        rules refuse (Unicode spaces, controls, over 200 characters)."""
        members = [*self._run("live_nodes", (self.key,), ("live",))[0]]
        members += self._run("live_nodes", (self.key,), ("dead",))[0]
        return [name for name in map(_text, members) if not _is_namespace(name)]

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

    def collect_dead(self) -> list[str]:
        """Delete the keys and index entries of every dead namespace; return them.

        Each namespace's lease is checked again, atomically with its delete, so one that
        renewed meanwhile keeps everything. Costs one call per dead namespace. Then the
        fleet index is scrubbed of retired member ids (``registry.fleet``; O(index)
        when any id was retired since the last scrub); ``scrubbed`` says how many.
        """
        removed = []
        members = FleetMembers(self.client, self.key_prefix)
        for namespace in self.dead():
            keys = NamespaceKeys(namespace, self.key_prefix)
            if self._run("gc_namespace", keys.all_keys(), ()) == 0:
                continue  # renewed after it was listed
            members.forget(namespace)  # leaves the node index, retires its index id
            removed.append(namespace)
        self.scrubbed = members.scrub()
        return removed

    gc = collect_dead  # the first release's name


def split_members(names: list[Any], skipped: int) -> tuple[list[str], list[str]]:
    """The ``live_nodes`` script's members as (namespaces, text members the namespace
    rules refuse); ``skipped`` (what the script itself skipped) is only passed along by
    callers. Shared by ``NodeIndex`` and the asyncio router."""
    valid: list[str] = []
    refused: list[str] = []
    for name in map(_text, names):
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


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    return str(value)
