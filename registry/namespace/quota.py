"""Per-namespace entry quotas, the admin side (``pcr quota``): ``set_quota``,
``clear_quota`` and ``entry_quotas``.

A namespace's quota is the most KV plus Mamba entries it may hold, kept as a decimal
STRING at ``pcr:quota:{NS}`` (``NamespaceKeys.quota``): the namespace's hash tag, so the
scripts that add entries read it in their own slot (``lua/_prelude.lua``,
``entry_limit``), and outside the node users' key pattern ``pcr:{NS}:*``, so the ACL
recipes (``docs/acl``) let a node's scripts read it and no command of the node's write it.
A write that would pass the limit is refused whole (``RegistryQuotaExceeded``); removals
never are. No key: no limit. Only an admin (or any user granted ``SET`` on the key) sets
one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from registry.core.errors import REDIS_ERRORS, translate
from registry.core.keys import DEFAULT_KEY_PREFIX, NamespaceKeys
from registry.core.validation import checked_number, text
from registry.transport.scripts import run_batched

MAX_QUOTA = 2**53
"""The largest limit: the scripts compare counts as Lua numbers (doubles), exact to 2^53."""


@dataclass(frozen=True)
class EntryQuota:
    """One namespace's limit beside what it holds (``entry_quotas``)."""

    namespace: str
    limit: int | None  # None: no limit set (or ``unreadable``)
    entries: int  # KV plus Mamba entries
    engine_blocks: int  # a bridged namespace's engine-blocks entries (0 for others)
    unreadable: str | None = None  # the key's value when it is not a whole number

    @property
    def over(self) -> bool:
        """Whether the namespace holds more than its limit (the limit was lowered under
        it, or a user wrote the maps with raw commands, past the scripts)."""
        limit = self.limit
        return limit is not None and max(self.entries, self.engine_blocks) > limit


def set_quota(
    client: Any, namespace: str, limit: int, *, key_prefix: str = DEFAULT_KEY_PREFIX
) -> None:
    """Cap ``namespace`` at ``limit`` KV plus Mamba entries (0 to ``MAX_QUOTA``; 0 refuses
    every new entry). It binds the next write: a namespace already over it keeps its
    entries and may only shrink. Bad input raises before anything is sent."""
    keys = NamespaceKeys(namespace, key_prefix)
    checked_number(limit, "limit", 0, MAX_QUOTA, integer=True)
    try:
        client.set(keys.quota, str(int(limit)))
    except REDIS_ERRORS as exc:
        raise (translate(exc, f"namespace {namespace!r}: set_quota", write=True) or exc) from exc


def clear_quota(client: Any, namespace: str, *, key_prefix: str = DEFAULT_KEY_PREFIX) -> bool:
    """Remove ``namespace``'s limit; whether it had one."""
    keys = NamespaceKeys(namespace, key_prefix)
    try:
        return bool(client.delete(keys.quota))
    except REDIS_ERRORS as exc:
        raise (translate(exc, f"namespace {namespace!r}: clear_quota", write=True) or exc) from exc


def entry_quotas(
    client: Any, namespaces: list[str], *, key_prefix: str = DEFAULT_KEY_PREFIX
) -> list[EntryQuota]:
    """Each namespace's limit and what it holds, in one round trip per Redis node (a
    pipeline on a standalone server, one batch per primary on a cluster)."""
    routed: list[tuple[str, tuple[Any, ...]]] = []
    for namespace in namespaces:
        keys = NamespaceKeys(namespace, key_prefix)
        routed += [
            (keys.meta, command)
            for command in (
                ("GET", keys.quota),
                ("HLEN", keys.kv),
                ("HLEN", keys.mamba),
                ("HLEN", keys.engine_blocks),
            )
        ]
    if not routed:
        return []
    try:
        replies = run_batched(client, routed)
    except REDIS_ERRORS as exc:
        raise (translate(exc, f"reading {len(namespaces)} quotas") or exc) from exc
    found = []
    for i, namespace in enumerate(namespaces):
        value, kv, mamba, blocks = replies[4 * i : 4 * i + 4]
        for reply in (value, kv, mamba, blocks):
            if isinstance(reply, Exception):
                raise (translate(reply, f"namespace {namespace!r}: quota") or reply) from reply
        limit, unreadable = _limit(value)
        found.append(EntryQuota(namespace, limit, int(kv) + int(mamba), int(blocks), unreadable))
    return found


def _limit(value: Any) -> tuple[int | None, str | None]:
    """A quota key's value as (limit, None); (None, its text) when it is not a whole
    number the scripts take (they refuse every write until it is set again)."""
    if value is None:
        return None, None
    shown = text(value)
    if shown.isascii() and shown.isdigit() and len(shown) <= 16:
        return int(shown), None
    return None, shown
