"""Admin reads of whole namespaces (``pcr stats``, ``pcr inspect``, the lease metric):
``NamespaceInfo``, what ``PrefixCacheRegistry.info()`` reads, and ``namespace_infos``,
the same for many namespaces in one round trip per Redis node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from registry.core.errors import REDIS_ERRORS, translate
from registry.core.keys import DEFAULT_KEY_PREFIX, NamespaceKeys
from registry.core.validation import text
from registry.transport.scripts import run_batched


@dataclass(frozen=True)
class NamespaceInfo:
    """What ``PrefixCacheRegistry.info()`` reads about a namespace."""

    namespace: str
    kv_entries: int
    mamba_entries: int
    epoch: int | None  # the owner's epoch; None if never claimed (or not a number)
    incarnation: str  # its history ("" before the first write)
    notice_seq: int | None  # the last notice number (None: meta holds something else)
    lease_until_ms: int | None  # the owner's lease end (server clock); None if never claimed
    server_ms: int  # the server's clock when read
    # Set on namespaces fed by ``pcr bridge`` (registry.bridge): which engine, where,
    # its block size and the last engine sequence number applied.
    bridge_engine: str | None = None
    bridge_endpoint: str | None = None
    bridge_block_size: int | None = None
    bridge_seq: int | None = None

    @property
    def state(self) -> str:
        """ "live", "dead" (lease over) or "no lease"."""
        if self.lease_until_ms is None:
            return "no lease"
        return "live" if self.lease_until_ms > self.server_ms else "dead"

    @property
    def lease_left_s(self) -> float | None:
        """Seconds of lease left (negative: ran out that long ago); None if no lease."""
        if self.lease_until_ms is None:
            return None
        return (self.lease_until_ms - self.server_ms) / 1000


def info_commands(keys: NamespaceKeys) -> list[tuple[Any, ...]]:
    return [("HLEN", keys.kv), ("HLEN", keys.mamba), ("HGETALL", keys.meta), ("TIME",)]


def memory_commands(keys: NamespaceKeys) -> list[tuple[Any, ...]]:
    return [("MEMORY", "USAGE", key) for key in keys.all_keys()]


def info_from(namespace: str, replies: list[Any]) -> NamespaceInfo:
    kv, mamba, meta, now = replies
    fields = {text(k): text(v) for k, v in meta.items()}
    seconds, micros = now
    return NamespaceInfo(
        namespace=namespace,
        kv_entries=int(kv),
        mamba_entries=int(mamba),
        epoch=_whole(fields.get("epoch")),
        incarnation=fields.get("incarnation", ""),
        notice_seq=_whole(fields.get("notice_seq", "0")),
        lease_until_ms=_whole(fields.get("lease_until")),
        server_ms=int(seconds) * 1000 + int(micros) // 1000,
        bridge_engine=fields.get("bridge_engine"),
        bridge_endpoint=fields.get("bridge_endpoint"),
        bridge_block_size=_whole(fields.get("bridge_block_size")),
        bridge_seq=_whole(fields.get("bridge_seq")),
    )


def namespace_infos(
    client: Any,
    namespaces: list[str],
    *,
    key_prefix: str = DEFAULT_KEY_PREFIX,
    memory: bool = True,
) -> list[tuple[NamespaceInfo, int | None]]:
    """``info()`` and ``memory_bytes()`` of many namespaces in one round trip per Redis
    node (for ``pcr stats``): a pipeline on a standalone server, one batch per primary on
    a cluster. Memory is None where the server has no ``MEMORY USAGE`` or refuses it."""
    routed: list[tuple[str, tuple[Any, ...]]] = []
    for namespace in namespaces:
        keys = NamespaceKeys(namespace, key_prefix)
        commands = info_commands(keys) + (memory_commands(keys) if memory else [])
        routed += [(keys.meta, command) for command in commands]
    if not routed:
        return []
    try:
        replies = run_batched(client, routed)
    except REDIS_ERRORS as exc:
        raise (translate(exc, f"reading {len(namespaces)} namespaces") or exc) from exc
    per = len(routed) // len(namespaces)
    result = []
    for i, namespace in enumerate(namespaces):
        mine = replies[i * per : (i + 1) * per]
        for reply in mine[:4]:
            if isinstance(reply, Exception):
                raise (translate(reply, f"namespace {namespace!r}: info") or reply) from reply
        used = None
        if memory and not any(isinstance(r, Exception) for r in mine[4:]):
            used = sum(int(r or 0) for r in mine[4:])
        result.append((info_from(namespace, mine[:4]), used))
    return result


def _whole(text: str | None) -> int | None:
    """A meta field as an int; None when absent or written as something else."""
    try:
        return None if text is None else int(text)
    except ValueError:
        return None
