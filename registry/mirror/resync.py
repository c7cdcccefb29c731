"""The resync: a namespace rewritten whole from its mirror, once its backlog was dropped.

When the queue overflowed (Redis away too long), a batch's reply records may have
expired, or Redis refused a write, the writes in between are gone; the mirror still
holds the truth, so ``lua/mirror_resync.lua`` replaces the namespace's entries with it
in one fenced script and publishes one 'clear' notice. The notice numbers skip one
(see the script): the mirror numbers on from the clear, as Redis does.
"""

from __future__ import annotations

import logging

from registry.core.errors import RegistryError, StaleEpochError
from registry.core.notices import parse_notice
from registry.core.validation import flatten
from registry.mirror.state import OwnerState
from registry.mirror.wire import MirrorWire
from registry.mirror.write_queue import WriteQueue
from registry.mirror.writes import BatchEncoder, Routed
from registry.namespace.redis_registry import PrefixCacheRegistry

log = logging.getLogger(__name__)


class Resync:
    """Rewrites one mirror's namespace from the local maps (``lua/mirror_resync.lua``)."""

    def __init__(
        self,
        inner: PrefixCacheRegistry,
        state: OwnerState,
        queue: WriteQueue,
        encoder: BatchEncoder,
        wire: MirrorWire,
    ) -> None:
        self.inner = inner
        self.state = state
        self.queue = queue
        self.encoder = encoder
        self.wire = wire

    def send(self) -> None:
        """Under the write-behind's send lock and the state's lock (released while Redis
        works, held again on return): rewrite the namespace from a snapshot of the
        mirror, covering (and dropping) what is queued. Raises ``RegistryUnavailable``
        or another registry error (a resync is then due again), ``StaleEpochError``
        when this owner was fenced (the caller marks it lost)."""
        state, queue = self.state, self.queue
        kv, mamba = flatten(state.kv, ()), flatten(state.mamba, ())
        continue_from = state.seq + 1
        state.seq += 2  # the script publishes its clear as continue_from + 1
        queue.drop_for_resync()
        command = self.encoder.resync(continue_from, kv, mamba)
        state.lock.release()
        try:
            self._sent(command, continue_from)
        finally:
            state.lock.acquire()

    def _sent(self, command: Routed, continue_from: int) -> None:
        """Without the lock: ``command``'s round trip, and its reply accounted for."""
        queue, lock = self.queue, self.state.lock
        try:
            reply = self.wire.run([command])[0]
        except RegistryError:
            with lock:
                queue.resync_failed(answered=False)
            raise
        if isinstance(reply, Exception):
            error = self.wire.refusal(reply, "mirror_resync", self.inner.epoch)
            if not isinstance(error, StaleEpochError):
                with lock:
                    queue.resync_failed(answered=True)
            raise error
        notice = parse_notice(reply)
        with lock:
            queue.resynced()
            if notice.seq != continue_from + 1:
                log.warning(
                    "mirror of %r: resync notice %d, expected %d",
                    self.inner.namespace,
                    notice.seq,
                    continue_from + 1,
                )
