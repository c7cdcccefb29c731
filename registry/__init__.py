"""A Redis-backed, cluster-shared prefix-cache registry (``hash -> block_id``).

``PrefixCacheRegistry`` keeps the mappings of one namespace in Redis (standalone or
Cluster); ``LocalPrefixCacheRegistry`` is the same API in process memory. This
package never imports torch.
"""

from __future__ import annotations

from registry.base import MambaEvictCallback, RegistryBase
from registry.hashing import block_hashes
from registry.keys import NamespaceKeys
from registry.local import LocalPrefixCacheRegistry
from registry.notices import EvictionNotice, parse_notice, parse_stream_entry
from registry.redis_registry import PrefixCacheRegistry

__all__ = [
    "EvictionNotice",
    "LocalPrefixCacheRegistry",
    "MambaEvictCallback",
    "NamespaceKeys",
    "PrefixCacheRegistry",
    "RegistryBase",
    "block_hashes",
    "parse_notice",
    "parse_stream_entry",
]
__version__ = "0.1.0"
