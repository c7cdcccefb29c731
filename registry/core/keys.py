"""Every Redis key and channel name of the registry, built in one place.

Hash-tag rule: all keys of one namespace put the namespace between ``{`` and ``}``
(``pcr:{node-0}:kv``). Redis Cluster hashes only that part, so every key a script
touches for one namespace lives in one slot and one Lua call never crosses slots.
That is why a namespace may not contain braces and the key prefix may not contain
``{`` (Redis uses the first ``{`` of a key).
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass

DEFAULT_KEY_PREFIX = "pcr"
MAX_NAME_LENGTH = 200


def _check_name(kind: str, value: object) -> str:
    """Return ``value`` if it is a usable namespace or key prefix, else raise."""
    if not isinstance(value, str):
        raise TypeError(f"{kind} must be a str, not {type(value).__name__}")
    if not value:
        raise ValueError(f"{kind} must not be empty")
    if len(value) > MAX_NAME_LENGTH:
        raise ValueError(f"{kind} is {len(value)} characters long; the limit is {MAX_NAME_LENGTH}")
    for char in value:
        if char in "{}":
            raise ValueError(
                f"{kind} {value!r} must not contain '{{' or '}}' (hash-tag delimiters)"
            )
        if char.isspace() or unicodedata.category(char)[0] == "C":
            raise ValueError(f"{kind} {value!r} must not contain whitespace or control characters")
    return value


def validate_namespace(namespace: object) -> str:
    """Check a namespace: a non-empty printable string without braces or whitespace."""
    return _check_name("namespace", namespace)


def validate_key_prefix(key_prefix: object) -> str:
    """Check a key prefix: the same rules as a namespace."""
    return _check_name("key_prefix", key_prefix)


def node_index_key(key_prefix: str = DEFAULT_KEY_PREFIX) -> str:
    """ZSET of every namespace that announced a lease: member namespace, score lease end
    (server clock, ms). Not tagged: it lives on one shard of its own."""
    return f"{validate_key_prefix(key_prefix)}:nodes"


def engines_key(key_prefix: str = DEFAULT_KEY_PREFIX) -> str:
    """HASH namespace -> the URL of the engine that serves it (``http://10.0.0.7:8000``),
    announced by ``pcr bridge --engine-url`` or by an owner (``NodeIndex.announce_engine``)
    and read by ``pcr gateway``. Not tagged."""
    return f"{validate_key_prefix(key_prefix)}:engines"


def fleet_changes_pattern(key_prefix: str = DEFAULT_KEY_PREFIX) -> str:
    """The pub/sub pattern of every namespace's change-record channel
    (``NamespaceKeys.changes_channel``), which each router's in-process fleet view
    follows (``registry/fleet/view.py``); glob characters of the prefix escaped."""
    escaped = "".join("\\" + c if c in "*?[]\\" else c for c in validate_key_prefix(key_prefix))
    return f"{escaped}:{{*}}:changes"


def gateway_load_key(key_prefix: str = DEFAULT_KEY_PREFIX) -> str:
    """HASH gateway replica id -> ``"<expires ms> <payload>"``: what each ``pcr gateway``
    replica has in flight per backend (``lua/gateway_load.lua``). Not tagged."""
    return f"{validate_key_prefix(key_prefix)}:gateway:load"


def gateway_load_channel(key_prefix: str = DEFAULT_KEY_PREFIX) -> str:
    """Pub/sub channel: ``"<replica id> <payload>"`` each time a ``pcr gateway`` replica
    writes its entry of ``gateway_load_key`` (``lua/gateway_load.lua``), so the others
    see a request start or end as it happens."""
    return f"{validate_key_prefix(key_prefix)}:gateway:load-changes"


@dataclass(frozen=True)
class NamespaceKeys:
    """The keys and the channel of one namespace (one block pool)."""

    namespace: str
    key_prefix: str = DEFAULT_KEY_PREFIX

    def __post_init__(self) -> None:
        validate_namespace(self.namespace)
        validate_key_prefix(self.key_prefix)

    @property
    def base(self) -> str:
        """The common start of every name: ``pcr:{NS}``."""
        return f"{self.key_prefix}:{{{self.namespace}}}"

    @property
    def kv(self) -> str:
        """HASH: block hash (decimal) -> KV block id (decimal)."""
        return f"{self.base}:kv"

    @property
    def mamba(self) -> str:
        """HASH: block hash (decimal) -> block id that holds a Mamba state checkpoint."""
        return f"{self.base}:mamba"

    @property
    def meta(self) -> str:
        """HASH: ``schema``, ``epoch`` (owner fencing), ``notice_seq`` (last eviction
        notice), ``lease_until`` (owner lease end, server clock in ms)."""
        return f"{self.base}:meta"

    @property
    def mamba_evictions(self) -> str:
        """STREAM (capped): a durable copy of every eviction notice, for replay."""
        return f"{self.base}:mamba-evictions"

    @property
    def mamba_evicted_channel(self) -> str:
        """Pub/sub channel on which eviction notices are published."""
        return f"{self.base}:mamba-evicted"

    @property
    def changes_channel(self) -> str:
        """Pub/sub channel of the namespace's change records, ``"<namespace>
        <incarnation> <seq> <parts>"`` (``lua/_prelude.lua`` ``record_changes``)."""
        return f"{self.base}:changes"

    @property
    def engine_blocks(self) -> str:
        """HASH, bridged namespaces only (``pcr bridge``): the engine's block hash
        (unsigned, decimal) -> ``"<own hash> <block id> <digest hex> <holders>"``: the
        registry's own hash of that block, its position in its prefix (the block id a
        bridged namespace stores), the chain digest its children continue from, and which
        (group, medium) slots of the engine hold it (``lua/bridge_apply.lua``)."""
        return f"{self.base}:engine-blocks"

    @property
    def quota(self) -> str:
        """STRING, set by an admin (``pcr quota set``): the most KV plus Mamba entries
        the namespace may hold; absent: no limit. ``pcr:quota:{NS}``: the namespace's hash
        tag (its slot), outside the node users' key pattern ``pcr:{NS}:*``, so the
        scripts that add entries read it and a node user cannot write it (``docs/acl``).
        Not one of ``all_keys``: gc leaves it, and a namespace that comes back keeps it."""
        return f"{self.key_prefix}:quota:{{{self.namespace}}}"

    @property
    def reply_prefix(self) -> str:
        """Start of the STRING keys ``pcr:{NS}:reply:<request id>``: each write's reply,
        kept for ``reply_ttl`` seconds (then expired by Redis) so that a re-sent copy of
        the request returns it instead of running again."""
        return f"{self.base}:reply:"

    def all_keys(self) -> tuple[str, ...]:
        """Every long-lived key (not the channel, nor the expiring reply records)."""
        return (self.kv, self.mamba, self.meta, self.mamba_evictions, self.engine_blocks)

    def owns(self, key: str) -> bool:
        """Whether ``key`` is one of this namespace's keys, reply records included."""
        return key in self.all_keys() or key.startswith(self.reply_prefix)
