"""A Redis-backed, cluster-shared prefix-cache registry (``hash -> block_id``).

``PrefixCacheRegistry`` keeps the mappings of one namespace in Redis (standalone or
Cluster); ``LocalPrefixCacheRegistry`` is the same API in process memory. This
package never imports torch.
"""

from __future__ import annotations

from registry.base import EvictionHook, MambaEvictCallback, RegistryBase
from registry.errors import (
    NamespaceMirrored,
    RegistryError,
    RegistryFault,
    RegistryMisconfigured,
    RegistryOutOfMemory,
    RegistryPermissionError,
    RegistryUnavailable,
    RegistryWrongType,
    StaleEpochError,
)
from registry.hashing import block_hashes
from registry.keys import NamespaceKeys
from registry.local import LocalPrefixCacheRegistry
from registry.membership import NodeIndex, collect_dead, live_nodes
from registry.mirror import MirrorCounts, MirroredRegistry
from registry.notices import EvictionNotice, parse_notice, parse_stream_entry
from registry.ownership import Heartbeat
from registry.redis_registry import PrefixCacheRegistry
from registry.routing import NodeScore, PrefixRouter

__all__ = [
    "EvictionHook",
    "EvictionNotice",
    "Heartbeat",
    "LocalPrefixCacheRegistry",
    "MambaEvictCallback",
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
    "RegistryUnavailable",
    "RegistryWrongType",
    "StaleEpochError",
    "block_hashes",
    "collect_dead",
    "live_nodes",
    "parse_notice",
    "parse_stream_entry",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """``registry.gc``: the first release's name of ``collect_dead`` (which does not
    shadow the standard library's ``gc`` in ``from registry import *``)."""
    if name == "gc":
        return collect_dead
    raise AttributeError(f"module 'registry' has no attribute {name!r}")
