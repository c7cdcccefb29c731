"""``MirroredRegistry``: an owner's registry at memory speed, written behind to Redis.

The owner of a namespace (the serving node whose GPU holds its blocks) is the only
process that reuses them, so its own view can be authoritative and Redis the shared
copy. A ``MirroredRegistry`` wraps a ``PrefixCacheRegistry`` (which keeps the client,
the keys, the epoch and the write path):

* reads (``match_kv_prefix``, ``match_mamba_farthest``, ``find_mamba_backoff``,
  ``mamba_block_ids``, the dict views) answer from two local dicts;
* writes apply to them at once with the seed's meaning: return values, the Mamba
  callback and the eviction hooks fire in the call, as ``LocalPrefixCacheRegistry`` does;
  each write is then queued as it was given (an operation code and its values: the
  engine's thread does no more), for the flusher to encode;
* a flusher thread sends the queue in order, in batches of at most ``max_batch`` writes,
  one round trip per batch (per Redis node), at most ``max_delay`` after a write was
  queued when Redis answers. A batch is a few calls of ``lua/mirror_apply.lua`` (at most
  ``CALL_WRITES`` writes each), which applies a run of writes in order with exactly the
  effects of the one-per-write scripts (entries, numbered notices, stream, change
  records), fenced once per call. A batch is built once: sent again after a lost reply,
  it carries the same request ids, one per call, so each call applies at most once.

Notice numbers are Redis's own: the claim's 'clear' notice gives the namespace's number
and history, and since no one else may write the namespace (``claim(mirror=...)``, see
``NamespaceMirrored``), Redis publishes exactly the notices the mirror numbers locally,
in the same order. So a stamp from ``register_mamba_stamped`` and the notices the hooks
get carry the numbers Redis will publish, and a slot pool stays correct whether it
hears them through the hook or through a listener.

Faults. Redis away: reads and writes go on locally; the queue holds at most
``max_queue`` writes, past that it is dropped and, once Redis answers, the namespace is
rewritten from the mirror in one fenced script (``lua/mirror_resync.lua``: one resync,
counted). Fenced (another claim, ``gc``, a lost ``meta``): the next flush gets
``StaleEpochError``, the mirror marks itself lost and every later call raises it, so a
zombie cannot go on serving. Thread-safe: one lock guards the local state and the queue.

The package, one module per part: ``mirrored`` (``MirroredRegistry``: the local model,
ownership, reads and writes), ``state`` (``OwnerState``: the local maps and numbering),
``writes`` (``QueuedWrite`` records with named operations ``Op``, and ``BatchEncoder``,
which builds the ``mirror_apply`` calls), ``write_queue`` (``WriteQueue``: the bounded
queue and the counters, ``MirrorCounts``), ``write_behind`` (``WriteBehind``: sending in
order and accounting for replies), ``resync`` (``Resync``), ``wire`` (``MirrorWire``:
one round trip per batch, NOSCRIPT through ``ScriptRunner``) and ``flusher``
(``Flusher``: the thread).
"""

from registry.mirror.mirrored import (
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_DELAY,
    DEFAULT_MAX_QUEUE,
    MIRROR_OPTIONS,
    MirroredRegistry,
    default_owner_label,
)
from registry.mirror.write_queue import MirrorCounts
from registry.mirror.writes import CALL_VALUES, CALL_WRITES

__all__ = [
    "CALL_VALUES",
    "CALL_WRITES",
    "DEFAULT_MAX_BATCH",
    "DEFAULT_MAX_DELAY",
    "DEFAULT_MAX_QUEUE",
    "MIRROR_OPTIONS",
    "MirrorCounts",
    "MirroredRegistry",
    "default_owner_label",
]
