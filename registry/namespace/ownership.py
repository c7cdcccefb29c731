"""Ownership of a namespace: claim, lease renewal, and the heartbeat thread.

An owner (the serving node whose GPU holds the blocks) ``claim()``s its namespace once
at start: a new epoch, unique for all time, an empty namespace and a lease. Its writes
carry the epoch and fail with ``StaleEpochError`` once another process claimed the
namespace, ``gc`` collected it, or its ``meta`` was lost. The lease end (server clock)
is kept in the namespace's ``meta``, the truth, and announced in the node index, where
routers and ``gc`` find the namespace (``announce_lease`` writes it there;
``registry.fleet.membership`` reads it and checks each member's ``meta``). Readers
(routers, tools) and operators never claim.
"""

from __future__ import annotations

import logging
import threading
import weakref
from abc import abstractmethod
from typing import TYPE_CHECKING, Any, Protocol

from registry.core.errors import RegistryOutOfMemory, StaleEpochError
from registry.core.keys import NamespaceKeys, node_index_key
from registry.core.notices import EvictionNotice, parse_notice
from registry.core.validation import checked_number
from registry.transport.scripts import ScriptRunner

log = logging.getLogger(__name__)

DEFAULT_LEASE_TTL = 10.0
"""Seconds a claim or a renewal keeps a namespace alive."""


class Ownership:
    """``claim``, ``renew`` and ``start_heartbeat`` of ``PrefixCacheRegistry``, over its
    write path (``run_write``) and its epoch."""

    keys: NamespaceKeys
    client: Any
    epoch: int | None
    lease_ttl: float = DEFAULT_LEASE_TTL
    _runner: ScriptRunner

    @abstractmethod
    def run_write(
        self,
        operation: str,
        keys: tuple[str, ...],
        notices: bool,
        data: Any = (),
        *,
        fence: str | None = None,
    ) -> Any:
        """Run a write script under a fresh request id."""

    @abstractmethod
    def adopt_epoch(self, epoch: int | None) -> None:
        """Carry ``epoch`` in every later write."""

    if TYPE_CHECKING:

        def _notify(self, notice: EvictionNotice | None) -> None:
            """Pass a notice to the callback and hooks (``RegistryBase`` has it)."""

    def claim(self, lease_ttl: float = DEFAULT_LEASE_TTL, *, mirror: str | None = None) -> int:
        """Become the namespace's owner: take a new epoch (unique for all time), drop the
        previous incarnation's entries, start a lease and announce it. The drop is a
        'clear' notice, delivered to this object's hooks (so its slot pool frees at once)
        and to every listener.

        From now on this object's writes carry the epoch; once another process claims
        the namespace, ``gc`` collects it or its ``meta`` is lost, they raise
        ``StaleEpochError`` and change nothing. Returns the epoch. A server out of memory
        refuses the claim before changing anything (``RegistryOutOfMemory``).

        ``mirror``: the label of a mirrored owner (``registry.mirror``): while this
        epoch's lease is live, writes carrying any other epoch are refused with
        ``NamespaceMirrored`` naming it. A later claim (mirrored or not) takes over.
        """
        lease_ttl = lease_seconds(lease_ttl)
        extra: tuple[str, ...] = () if mirror is None else (owner_label(mirror),)
        k = self.keys
        epoch, lease_until, notice = self.run_write(
            "claim",
            (k.kv, k.mamba, k.meta, k.mamba_evictions, k.engine_blocks),
            True,
            (max(1, round(lease_ttl * 1000)), *extra),
            fence="",  # claims are never fenced
        )
        self.lease_ttl = lease_ttl
        self.adopt_epoch(int(epoch))
        self._notify(parse_notice(notice) if notice else None)
        self.announce(int(lease_until))
        return int(epoch)

    def renew(self) -> float:
        """Extend the lease by ``lease_ttl``; return its end (server clock, Unix seconds).

        Raises ``StaleEpochError`` when superseded, ``RuntimeError`` before ``claim``.
        Works while Redis is at ``maxmemory``: the lease in ``meta`` adds no memory, and
        the node index, which then refuses the new score, keeps the member the claim
        announced (readers go by ``meta``).
        """
        if self.epoch is None:
            raise RuntimeError("renew() needs an owner: call claim() first")
        lease_ms = max(1, round(self.lease_ttl * 1000))
        lease_until = int(self.run_write("renew", (self.keys.meta,), False, (lease_ms,)))
        try:
            self.announce(lease_until)
        except RegistryOutOfMemory:
            log.debug("node index at maxmemory: %s keeps its announced score", self.keys.namespace)
        return lease_until / 1000

    def start_heartbeat(self, interval: float | None = None) -> Heartbeat:
        """Renew the lease from a daemon thread every ``interval`` s (default: a third of
        the lease). ``Heartbeat.stop()`` ends it; ``Heartbeat.lost`` is set if superseded.
        The thread holds this registry weakly: it stops once the registry is gone."""
        if self.epoch is None:
            raise RuntimeError("start_heartbeat() needs an owner: call claim() first")
        beat = self.lease_ttl / 3 if interval is None else lease_seconds(interval)
        return Heartbeat(self, beat, name=f"heartbeat[{self.keys.namespace}]")

    def announce(self, lease_until_ms: int) -> None:
        """Record the lease end (server clock, Unix ms) in the node index, where routers
        and ``gc`` find it: what a claim and a renewal do, and a caller resuming an
        owner's epoch with its own lease (``pcr bridge``'s ``bridge_resume``)."""
        announce_lease(self._runner, self.keys.key_prefix, self.keys.namespace, lease_until_ms)


def announce_lease(
    runner: ScriptRunner, key_prefix: str, namespace: str, lease_until_ms: int
) -> None:
    """Announce ``namespace``'s lease end in the node index (``lua/announce.lua``, never
    moving it back): what a claim and a renewal do, and ``NodeIndex.announce``
    (``registry.fleet.membership``, which reads the index and checks each member's
    own lease)."""
    key = node_index_key(key_prefix)
    runner.run(
        "announce", (key,), (namespace, lease_until_ms), context=f"node index {key!r}", write=False
    )


def lease_seconds(value: object) -> float:
    """A lease length or heartbeat interval, checked: a number of seconds, 1 ms to a year."""
    return float(checked_number(value, "a lease length", 0.001, 86_400 * 365, unit=" s"))


def owner_label(value: object) -> str:
    """A mirrored owner's label, checked: 1 to 200 printable characters."""
    if not isinstance(value, str):
        raise TypeError(f"an owner label must be a str, not {type(value).__name__}")
    if not 1 <= len(value) <= 200 or not value.isprintable():
        raise ValueError(f"an owner label must be 1 to 200 printable characters: {value!r}")
    return value


class Renewable(Protocol):
    """What a heartbeat renews: an owning registry."""

    def renew(self) -> float: ...


class Heartbeat:
    """A daemon thread renewing an owner's lease every ``interval`` seconds.

    It holds its owner weakly, so it stops by itself once the owner is garbage; it
    also stops when the owner turns out to be superseded (``lost`` is set). Other
    failures (Redis away) are logged, counted in ``failures`` and retried at the next
    beat. Usable as a context manager: leaving the block stops it.
    """

    def __init__(self, owner: Renewable, interval: float, name: str) -> None:
        self._owner = weakref.ref(owner)
        self.interval = interval
        self.lost = threading.Event()
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            owner = self._owner()
            if owner is None:
                return  # the registry is gone: nothing left to keep alive
            try:
                owner.renew()
            except StaleEpochError:
                log.error("lease lost: this owner was superseded; heartbeat stops")
                self.lost.set()
                return
            except Exception:
                self.failures += 1
                log.warning("lease renewal failed; retrying", exc_info=True)
            finally:
                del owner

    def stop(self, timeout: float = 5.0) -> None:
        """Stop renewing (the lease then runs out unless renewed otherwise)."""
        self._stop.set()
        self._thread.join(timeout)

    def __enter__(self) -> Heartbeat:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()
