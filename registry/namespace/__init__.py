"""One namespace in Redis: ``PrefixCacheRegistry`` (``redis_registry``), its owner's claim,
lease and heartbeat (``ownership``), its notices read back from the stream (``replay``),
and reading whole namespaces for tools (``admin``). Imports only ``registry.core`` and
``registry.transport``.
"""
