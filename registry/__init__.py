"""A Redis-backed, cluster-shared prefix-cache registry (``hash -> block_id``).

``PrefixCacheRegistry`` keeps the mappings of one namespace in Redis (standalone or
Cluster); ``LocalPrefixCacheRegistry`` is the same API in process memory. This
package never imports torch.

Its sub-packages, from the ground up (each imports only those below it):
``registry.core`` (types, keys, checks, hashing, notices, errors, observers, the API
base and the in-process registry), ``registry.transport`` (clients, the script runner),
``registry.namespace`` (the Redis registry of one namespace, ownership, replay, admin
reads), ``registry.fleet`` (membership, the fleet view), ``registry.routing`` (the
routers); on top ``registry.mirror``, ``registry.bridge`` and ``registry.metrics``.
This module re-exports the public names; nothing in the library imports it.
"""

from __future__ import annotations

import warnings
from typing import Any

from registry.core.base import EvictionHook, MambaEvictCallback, RegistryBase
from registry.core.errors import (
    NamespaceMirrored,
    RegistryError,
    RegistryFault,
    RegistryMisconfigured,
    RegistryOutOfMemory,
    RegistryPermissionError,
    RegistryQuotaExceeded,
    RegistryUnavailable,
    RegistryWrongType,
    StaleEpochError,
)
from registry.core.hashing import (
    ChainKeys,
    block_hashes,
    chain_root,
    remember_digests,
    request_chain_keys,
)
from registry.core.keys import NamespaceKeys
from registry.core.local import LocalPrefixCacheRegistry
from registry.core.notices import EvictionNotice, parse_notice, parse_stream_entry
from registry.core.scores import NodeScore
from registry.fleet.matches import Matches
from registry.fleet.membership import NodeIndex, collect_dead, live_nodes
from registry.fleet.view import FleetView
from registry.mirror import MirrorCounts, MirroredRegistry
from registry.namespace.ownership import Heartbeat
from registry.namespace.redis_registry import PrefixCacheRegistry
from registry.routing.aio_routing import AsyncPrefixRouter
from registry.routing.routing import PrefixRouter

__all__ = [
    "AsyncPrefixRouter",
    "ChainKeys",
    "EvictionHook",
    "EvictionNotice",
    "FleetView",
    "Heartbeat",
    "LocalPrefixCacheRegistry",
    "MambaEvictCallback",
    "Matches",
    "MirrorCounts",
    "MirroredRegistry",
    "NamespaceKeys",
    "NamespaceMirrored",
    "NodeIndex",
    "NodeScore",
    "PrefixCacheRegistry",
    "PrefixRouter",
    "RegistryBase",
    "RegistryError",
    "RegistryFault",
    "RegistryMisconfigured",
    "RegistryOutOfMemory",
    "RegistryPermissionError",
    "RegistryQuotaExceeded",
    "RegistryUnavailable",
    "RegistryWrongType",
    "StaleEpochError",
    "block_hashes",
    "chain_root",
    "collect_dead",
    "live_nodes",
    "parse_notice",
    "parse_stream_entry",
    "remember_digests",
    "request_chain_keys",
]
__version__ = "0.1.0"

_DEPRECATED = {"gc": ("collect_dead", collect_dead)}
"""Public names that were renamed: old name -> (new name, object). Each still works,
with a ``DeprecationWarning`` naming the new spelling, until 0.3.0 (CHANGELOG.md)."""


def __getattr__(name: str) -> Any:
    if name in _DEPRECATED:
        new_name, value = _DEPRECATED[name]
        warnings.warn(
            f"registry.{name} is deprecated and goes in 0.3.0; use registry.{new_name}",
            DeprecationWarning,
            stacklevel=2,
        )
        return value
    raise AttributeError(f"module 'registry' has no attribute {name!r}")
