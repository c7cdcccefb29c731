"""A Sentinel-managed master that reads never reach once it is no longer the master.

redis-py's Sentinel pool takes the master's address from ``SENTINEL MASTERS``, which
keeps naming the old primary until the failover is over (while
``SENTINEL GET-MASTER-ADDR-BY-NAME`` already names the promoted replica), and it never
asks a server its role after connecting: an old primary that came back empty at its old
address answered reads with an empty namespace and no error. Here:

* the master is the address ``SENTINEL GET-MASTER-ADDR-BY-NAME`` gives, every sentinel
  that answers must give the same one, and none may see it objectively down or failing
  over (``SENTINEL MASTER``'s flags): until then there is no master to use, and calls
  raise ``RegistryUnavailable``;
* every connection, new or reconnecting (redis-py's retry reconnects a connection to the
  host and port it had, skipping the sentinels), asks the sentinels for the master first,
  then asks the server its role (``HELLO``, which needs no ACL grant) and is refused
  unless it says ``master``, then asks the sentinels once more (the server may have been
  stalled and failed over between the first question and its answer);
* a call asks the sentinels again when nobody asked for ``MASTER_RECHECK_S`` seconds or
  its pooled connection sat idle that long, so a connection to a primary that was failed
  over while it sat idle (a stalled server that resumed, still saying it is a master) is
  dropped instead of used. Only an answer counts as a check: while a failover is under
  way, or when no sentinel answers, every call asks again, raises
  ``RegistryUnavailable``, and drops the connection it was handed. A failover takes at
  least Sentinel's ``down-after-milliseconds``, and a connection used meanwhile fails
  and reconnects through the sentinels, so keep that setting at or above
  ``MASTER_RECHECK_S``.

So a read is answered by the server the sentinels currently name, and that server says it
is a master, or the call raises. (A server the sentinels still name that restarted empty
before any failover began has lost the data for everyone: that is an empty restart.) A
write that the old primary acknowledged before it was failed over and had not yet sent
to its replica is lost with it (replication is asynchronous): ``wait_replicas`` of
``PrefixCacheRegistry`` confirms each write on replicas before it counts.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from redis.connection import SSLConnection
from redis.exceptions import ConnectionError, ResponseError, TimeoutError
from redis.sentinel import (
    MasterNotFoundError,
    Sentinel,
    SentinelConnectionPool,
    SentinelManagedConnection,
)

from registry.core.validation import text

log = logging.getLogger(__name__)

MASTER_RECHECK_S = 0.5
"""A call asks the sentinels whether the master moved when nobody has for this long, or
when its connection sat idle this long."""


def hello_role(reply: Any) -> str:
    """The ``role`` field of a ``HELLO`` reply (a RESP2 flat list or a RESP3 map)."""
    if isinstance(reply, dict):
        fields = {text(k): v for k, v in reply.items()}
    elif isinstance(reply, (list, tuple)):
        fields = {text(reply[i]): reply[i + 1] for i in range(0, len(reply) - 1, 2)}
    else:
        raise ConnectionError(f"HELLO answered a {type(reply).__name__}, not the server's info")
    if "role" not in fields:
        raise ConnectionError("HELLO's answer does not say the server's role")
    return text(fields["role"])


class VerifiedMasterConnection(SentinelManagedConnection):
    """A connection to the master Sentinel names that checks, once connected, that the
    server says it is a master and that the sentinels still name it; every reconnect,
    redis-py's retry included, asks the sentinels where the master is."""

    _resolved = False  # set while connecting to an address the sentinels just gave

    def connect_check_health(
        self, check_health: bool = True, retry_socket_connect: bool = True
    ) -> None:
        # redis-py reconnects a dropped connection here (``send_packed_command``, the
        # retry of a call), to the host and port it had: for a master, ask the
        # sentinels instead and check the server (``connect_to``).
        if self._sock is not None or self._resolved or not self.connection_pool.is_master:
            super().connect_check_health(check_health, retry_socket_connect)
            return
        self.connect_to(self.connection_pool.get_master_address())

    def connect_to(self, address: Any) -> None:
        self._resolved = True
        try:
            super().connect_to(address)  # type: ignore[no-untyped-call]
        finally:
            self._resolved = False
        if not self.connection_pool.is_master:
            return
        try:
            self.send_command("HELLO")  # type: ignore[no-untyped-call]
            role = hello_role(self.read_response())
            if role != "master":
                raise ConnectionError(
                    f"{self.host}:{self.port}, which Sentinel names the master of "
                    f"{self.connection_pool.service_name!r}, is a {role}: "
                    "a failover is under way"
                )
            # The server may have stalled between the sentinels' answer and its own, and
            # been failed over meanwhile: it still says master. Ask again.
            named = self.connection_pool.get_master_address()
            if tuple(named) != (self.host, self.port):
                raise ConnectionError(
                    f"{self.host}:{self.port} is no longer the master of "
                    f"{self.connection_pool.service_name!r} (the sentinels name "
                    f"{named[0]}:{named[1]}): a failover happened while connecting"
                )
        except BaseException:
            self.disconnect()  # type: ignore[no-untyped-call]
            raise


class VerifiedMasterSSLConnection(VerifiedMasterConnection, SSLConnection):
    """``VerifiedMasterConnection`` over TLS."""


class VerifiedSentinelPool(SentinelConnectionPool):
    """redis-py's Sentinel pool, asking the sentinels again before it hands out a
    connection when it has not asked for ``MASTER_RECHECK_S`` seconds or the connection
    sat idle that long: one idle through a whole failover is then dropped, not used."""

    def __init__(self, service_name: str, sentinel_manager: Any, **kwargs: Any) -> None:
        tls = bool(kwargs.pop("ssl", False))
        kwargs.setdefault(
            "connection_class", VerifiedMasterSSLConnection if tls else VerifiedMasterConnection
        )
        super().__init__(service_name, sentinel_manager, **kwargs)  # type: ignore[no-untyped-call]
        self._checked_at = time.monotonic()
        self._check_lock = threading.Lock()
        self._unasked = False  # no sentinel answered the last check (logged once)

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        connection = super().get_connection(*args, **kwargs)
        if not self.is_master:
            return connection
        now = time.monotonic()
        idle = now - getattr(connection, "_pcr_released_at", now)
        if idle < MASTER_RECHECK_S and now - self._checked_at < MASTER_RECHECK_S:
            return connection
        try:
            self._recheck()
            if (connection.host, connection.port) != self.master_address:
                connection.disconnect()  # type: ignore[no-untyped-call]  # the old master
                connection.connect()  # type: ignore[no-untyped-call]  # to the new one
        except BaseException:
            # Not confirmed: the connection may lead to a primary that was failed over.
            connection.disconnect()  # type: ignore[no-untyped-call]
            self.release(connection)
            raise
        return connection

    def release(self, connection: Any) -> None:
        connection._pcr_released_at = time.monotonic()
        super().release(connection)

    def _recheck(self) -> None:
        """Ask the sentinels for the master; a moved master drops the idle connections
        (redis-py's proxy does it) and in-use ones are dropped as they come back. Only
        an answer counts as a check: a failover under way, or sentinels that do not
        answer, raise ``MasterNotFoundError`` and leave the next call to ask again."""
        with self._check_lock:
            try:
                self.get_master_address()  # type: ignore[no-untyped-call]
            except MasterNotFoundError as exc:
                if "failover is under way" not in str(exc) and not self._unasked:
                    log.warning("cannot ask the sentinels whether the master moved: %s", exc)
                    self._unasked = True  # logged once until the sentinels answer again
                raise
            self._unasked = False
            self._checked_at = time.monotonic()


class VerifiedSentinel(Sentinel):
    """``redis.sentinel.Sentinel`` whose master is what ``GET-MASTER-ADDR-BY-NAME`` gives,
    agreed by every sentinel that answers, and never while one of them sees the master
    objectively down or a failover in progress."""

    def discover_master(self, service_name: str) -> tuple[str, int]:
        named: set[tuple[str, int]] = set()
        errors: list[str] = []
        for sentinel in self.sentinels:
            try:
                address, flags = _ask(sentinel, service_name)
            except (ConnectionError, TimeoutError, ResponseError) as exc:
                errors.append(f"{_where(sentinel)}: {exc}")
                continue
            if address is None:
                continue
            if flags & FAILING_OVER:
                shown = ",".join(sorted(flags & FAILING_OVER))
                raise MasterNotFoundError(
                    f"a sentinel sees the master of {service_name!r} {shown}: "
                    "a failover is under way"
                )
            host = address[0] if self._force_master_ip is None else self._force_master_ip
            named.add((host, address[1]))
        if len(named) == 1:
            return named.pop()
        if named:
            shown = ", ".join(f"{h}:{p}" for h, p in sorted(named))
            raise MasterNotFoundError(
                f"the sentinels disagree on the master of {service_name!r} ({shown}): "
                "a failover is under way"
            )
        why = f": {'; '.join(errors)}" if errors else ""
        raise MasterNotFoundError(f"no sentinel names a master for {service_name!r}{why}")

    def master_for(self, service_name: str, **kwargs: Any) -> Any:  # type: ignore[override]
        return super().master_for(  # type: ignore[no-untyped-call]
            service_name, connection_pool_class=VerifiedSentinelPool, **kwargs
        )


FAILING_OVER = frozenset({"o_down", "failover_in_progress"})
"""Master flags under which a sentinel's answer is not a master to use yet."""


def _ask(sentinel: Any, service_name: str) -> tuple[tuple[str, int] | None, set[str]]:
    """One sentinel's address for the master and its flags, in one round trip."""
    pipe = sentinel.pipeline(transaction=False)
    pipe.execute_command("SENTINEL GET-MASTER-ADDR-BY-NAME", service_name)
    pipe.execute_command("SENTINEL MASTER", service_name)
    address, state = pipe.execute()
    if not address:
        return None, set()
    flags = state.get("flags", "") if isinstance(state, dict) else ""
    if isinstance(flags, (bytes, bytearray, str)):
        flags = set(text(flags).split(","))
    return (text(address[0]), int(address[1])), {text(f) for f in flags}


def _where(sentinel: Any) -> str:
    options = sentinel.connection_pool.connection_kwargs
    return f"{options.get('host')}:{options.get('port')}"
