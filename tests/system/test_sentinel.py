"""Sentinel-managed standalone Redis through ``redis+sentinel://``: the registry follows
the master across a failover (RegistryUnavailable meanwhile, then it carries on), and a
read is never answered by a server that is not the master any more."""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from registry import PrefixCacheRegistry, RegistryUnavailable
from registry.transport import sentinel as sentinel_module
from registry.transport.client import client_from_url
from registry.transport.sentinel import MASTER_RECHECK_S, VerifiedSentinel, hello_role
from tests.support.servers import RedisServer, find_redis_server, free_port, require_redis_server
from tests.support.waiting import wait_until

H = [1111, 2222, 3333]


@pytest.fixture
def sentinel_setup() -> Iterator[tuple[RedisServer, RedisServer, int]]:
    """A master, its replica, and one Sentinel watching them as ``mymaster``."""
    require_redis_server()
    binary = find_redis_server()
    assert binary is not None
    with (
        RedisServer() as master,
        RedisServer(["--replicaof", "127.0.0.1", str(master.port)]) as replica,
    ):
        replica_client = replica.client()
        wait_until(
            lambda: replica_client.info("replication")["master_link_status"] == "up",
            what="replica linked",
        )
        replica_client.close()
        directory = Path(tempfile.mkdtemp(prefix="pcr-sentinel-"))
        port = free_port()
        (directory / "sentinel.conf").write_text(
            f"port {port}\nbind 127.0.0.1\ndir {directory}\n"
            f"sentinel monitor mymaster 127.0.0.1 {master.port} 1\n"
            "sentinel down-after-milliseconds mymaster 500\n"
            "sentinel failover-timeout mymaster 2000\n"
        )
        process = subprocess.Popen(
            [binary, str(directory / "sentinel.conf"), "--sentinel"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        sentinel = redis.Redis(port=port)
        try:
            wait_until(lambda: _answers(sentinel), what="sentinel up")
            yield master, replica, port
        finally:
            sentinel.close()
            process.terminate()
            process.wait(10)
            shutil.rmtree(directory, ignore_errors=True)


def _answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


def test_registry_follows_the_master_across_a_sentinel_failover(
    sentinel_setup: tuple[RedisServer, RedisServer, int],
) -> None:
    master, replica, sentinel_port = sentinel_setup
    reg = PrefixCacheRegistry.from_url(
        f"redis+sentinel://127.0.0.1:{sentinel_port}/mymaster", "node-s", socket_timeout=2
    )
    reg.claim()
    reg.register_kv([1, 2, 3], H)
    assert reg.match_kv_prefix(H) == ([1, 2, 3], H[2])
    replica_client = replica.client()
    wait_until(lambda: replica_client.hlen(reg.keys.kv) == 3, what="entries replicated")
    master.kill()
    unavailable = 0
    deadline = time.monotonic() + 30
    while True:
        try:
            reg.register_kv([4], [4444])
            break
        except RegistryUnavailable:
            unavailable += 1
            assert time.monotonic() < deadline, "no failover within 30 s"
            time.sleep(0.1)
    assert unavailable >= 1
    assert replica_client.execute_command("ROLE")[0] == b"master"  # the replica took over
    assert reg.match_kv_prefix(H) == ([1, 2, 3], H[2])  # and kept the replicated entries
    assert replica_client.hget(reg.keys.kv, "4444") == b"4"
    replica_client.close()


def _flags(sentinel: redis.Redis) -> set[str]:
    try:
        state = sentinel.execute_command("SENTINEL MASTER", "mymaster")
    except redis.ConnectionError:
        return set()
    flags = state["flags"]
    return set(flags.split(",")) if isinstance(flags, str) else set(flags)


def _named_port(sentinel: redis.Redis) -> int:
    return int(sentinel.execute_command("SENTINEL GET-MASTER-ADDR-BY-NAME", "mymaster")[1])


class Reads:
    """Reader threads asking for the prompt's prefixes until stopped: each answer is
    recorded as right (the full entries), unavailable (raised), or wrong."""

    def __init__(self, reg: PrefixCacheRegistry, expected: tuple[object, int]) -> None:
        self.reg = reg
        self.expected = expected
        self.right = self.unavailable = 0
        self.wrong: list[tuple[float, object]] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.run, name=f"reader-{i}") for i in range(2)]

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                answer = (self.reg.match_kv_prefix(H), self.reg.find_mamba_backoff(H, 3))
            except RegistryUnavailable:
                with self.lock:
                    self.unavailable += 1
                self.stop.wait(0.01)  # pacing only
                continue
            with self.lock:
                if answer == self.expected:
                    self.right += 1
                else:
                    self.wrong.append((time.monotonic(), answer))

    def __enter__(self) -> Reads:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(30)
        assert not any(t.is_alive() for t in self.threads)


def test_reads_never_answer_from_an_old_primary_back_empty_at_its_address(
    sentinel_setup: tuple[RedisServer, RedisServer, int],
) -> None:
    """The master is killed with reads in flight; once the failover is under way an empty
    redis-server starts at its old address (it says it is a master until Sentinel turns
    it into a replica). Every read raises ``RegistryUnavailable`` or answers the promoted
    replica's entries: never the empty server's nothing."""
    master, replica, sentinel_port = sentinel_setup
    url = f"redis+sentinel://127.0.0.1:{sentinel_port}/mymaster"
    owner = PrefixCacheRegistry.from_url(url, "node-e", socket_timeout=1)
    owner.claim()
    owner.register_kv([1, 2, 3], H)
    owner.register_mamba([2], [H[1]])
    reader = PrefixCacheRegistry.from_url(url, "node-e", socket_timeout=1)
    expected = (([1, 2, 3], H[2]), 2)
    replica_client = replica.client()
    sentinel = redis.Redis(port=sentinel_port, decode_responses=True, socket_timeout=2)
    old_port = master.port
    try:
        wait_until(lambda: replica_client.hlen(owner.keys.mamba) == 1, what="replicated")
        with Reads(reader, expected) as reads:
            wait_until(lambda: reads.right >= 20, what="reads before the kill")
            master.kill()
            wait_until(lambda: "failover_in_progress" in _flags(sentinel), what="failover started")
            with RedisServer(port=old_port) as back_empty:
                wait_until(lambda: _named_port(sentinel) == replica.port, what="switch-master")
                before = reads.right
                wait_until(lambda: reads.right >= before + 50, what="reads after the failover")
                reads_on_empty = back_empty.client()
                role = reads_on_empty.execute_command("ROLE")[0]
                reads_on_empty.close()
        assert reads.wrong == [], f"{len(reads.wrong)} wrong reads, first {reads.wrong[:3]}"
        assert reads.unavailable >= 1
        print(f"\nold primary back as a {role!r}: {reads.right} right reads, "
              f"{reads.unavailable} unavailable, 0 wrong")  # fmt: skip
    finally:
        replica_client.close()
        sentinel.close()
        owner.client.close()
        reader.client.close()


def test_an_idle_connection_to_a_primary_failed_over_while_stalled_is_not_used(
    sentinel_setup: tuple[RedisServer, RedisServer, int],
) -> None:
    """A reader's pooled connection sits idle while its primary is stopped (SIGSTOP) and
    failed over, and a write lands on the promoted replica; the old primary resumes still
    saying it is a master. The reader's next reads raise ``RegistryUnavailable`` or see
    the write: the pooled connection to the old primary is dropped, not used."""
    master, replica, sentinel_port = sentinel_setup
    url = f"redis+sentinel://127.0.0.1:{sentinel_port}/mymaster"
    owner = PrefixCacheRegistry.from_url(url, "node-p", socket_timeout=1)
    reader = PrefixCacheRegistry.from_url(url, "node-p", socket_timeout=1)
    sentinel = redis.Redis(port=sentinel_port, decode_responses=True, socket_timeout=2)
    assert master.process is not None
    try:
        owner.register_kv([1], [H[0]])
        assert reader.match_kv_prefix(H) == ([1], H[0])  # the reader's pooled connection
        # Replication is asynchronous: stopped before the replica has the entry, the
        # promoted replica would rightly answer without it.
        replica_client = replica.client()
        try:
            wait_until(lambda: replica_client.hlen(owner.keys.kv) == 1, what="replicated")
        finally:
            replica_client.close()
        master.process.send_signal(signal.SIGSTOP)
        wait_until(lambda: _named_port(sentinel) == replica.port, what="switch-master")
        wait_until(lambda: _lands(owner), what="a write on the promoted replica")
        master.process.send_signal(signal.SIGCONT)
        answers = []
        for _ in range(50):
            try:
                answers.append(reader.match_kv_prefix(H))
            except RegistryUnavailable:
                answers.append(None)
        wrong = [a for a in answers if a not in (None, ([1, 2], H[1]))]
        assert wrong == [], f"{len(wrong)} of {len(answers)} reads answered {wrong[0]}"
        assert answers[-1] == ([1, 2], H[1])
    finally:
        if master.running:
            master.process.send_signal(signal.SIGCONT)
        owner.client.close()
        reader.client.close()
        sentinel.close()


def _lands(owner: PrefixCacheRegistry) -> bool:
    try:
        owner.register_kv([2], [H[1]])
        return True
    except RegistryUnavailable:
        return False


def test_a_connection_to_a_server_that_is_not_the_master_is_refused(
    sentinel_setup: tuple[RedisServer, RedisServer, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every new connection asks the server its role: one that says replica is refused
    (``RegistryUnavailable`` naming the failover), even where the sentinels name it."""
    _master, replica, sentinel_port = sentinel_setup
    reg = PrefixCacheRegistry.from_url(
        f"redis+sentinel://127.0.0.1:{sentinel_port}/mymaster", "node-r", socket_timeout=1
    )
    monkeypatch.setattr(
        VerifiedSentinel, "discover_master", lambda _self, _name: ("127.0.0.1", replica.port)
    )
    try:
        with pytest.raises(RegistryUnavailable, match=r"is a (slave|replica)"):
            reg.match_kv_prefix(H)
    finally:
        reg.client.close()


def test_a_reconnect_asks_the_sentinels_and_the_server_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """redis-py's retry reconnects a dropped connection on its own
    (``send_packed_command``), to the host and port it had: a master connection asks the
    sentinels instead, then the server's role, and is refused by a replica."""
    require_redis_server()
    with (
        RedisServer() as first,
        RedisServer() as second,
        RedisServer(["--replicaof", "127.0.0.1", str(second.port)]) as replica,
    ):
        named = {"address": ("127.0.0.1", first.port)}
        monkeypatch.setattr(VerifiedSentinel, "discover_master", lambda _s, _n: named["address"])
        client = client_from_url("redis+sentinel://127.0.0.1:1/mymaster", socket_timeout=2)
        pool = client.connection_pool
        connection = pool.get_connection()
        try:
            assert connection.port == first.port
            named["address"] = ("127.0.0.1", second.port)  # a failover
            connection.disconnect()
            connection.send_command("PING")  # the reconnect redis-py's retry makes
            assert (connection.port, connection.read_response()) == (second.port, b"PONG")
            named["address"] = ("127.0.0.1", replica.port)
            connection.disconnect()
            with pytest.raises(redis.ConnectionError, match=r"is a (slave|replica)"):
                connection.send_command("PING")
            assert connection._sock is None
        finally:
            pool.release(connection)
            client.close()


def test_while_a_failover_is_under_way_calls_raise_and_drop_the_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sentinel flags the master ``failover_in_progress``: every call raises
    ``RegistryUnavailable`` (a refused check is no check: none rides on the last good
    one) and the pooled connection to the old primary is closed; once the sentinels
    agree again, calls carry on."""
    require_redis_server()
    with RedisServer() as server:
        flags: set[str] = {"master"}
        monkeypatch.setattr(
            sentinel_module, "_ask", lambda _s, _n: (("127.0.0.1", server.port), set(flags))
        )
        reg = PrefixCacheRegistry.from_url(
            "redis+sentinel://127.0.0.1:1/mymaster", "node-f", socket_timeout=2
        )
        watcher = server.client()
        try:
            reg.claim()
            reg.register_kv([1], [H[0]])
            flags.add("failover_in_progress")
            used = time.monotonic()
            # Idle past MASTER_RECHECK_S, the next call asks the sentinels.
            wait_until(lambda: time.monotonic() - used > MASTER_RECHECK_S, what="idle")
            for i in range(20):
                call = (
                    (lambda: reg.register_kv([2], [H[1]]))
                    if i % 2
                    else (lambda: reg.match_kv_prefix(H))
                )
                with pytest.raises(RegistryUnavailable, match="failover is under way"):
                    call()
            assert int(watcher.info("clients")["connected_clients"]) == 1  # the watcher
            flags.discard("failover_in_progress")
            assert reg.match_kv_prefix(H) == ([1], H[0])
        finally:
            watcher.close()
            reg.client.close()


def test_hello_role_reads_both_protocols() -> None:
    assert hello_role([b"server", b"redis", b"role", b"replica", b"modules", []]) == "replica"
    assert hello_role({"role": "master", "proto": 3}) == "master"
    with pytest.raises(redis.ConnectionError, match="role"):
        hello_role([b"server", b"redis"])


def test_bad_sentinel_urls() -> None:
    for url, message in [
        ("redis+sentinel://127.0.0.1:26379", "SERVICE_NAME"),
        ("redis+sentinel://127.0.0.1/mymaster", "host:port"),
        ("redis+sentinel://127.0.0.1:26379/mymaster/x", "SERVICE_NAME"),
    ]:
        with pytest.raises(ValueError, match=message):
            PrefixCacheRegistry.from_url(url, "n")
    with pytest.raises(ValueError, match="standalone master"):
        PrefixCacheRegistry.from_url("redis+sentinel://h:1/m", "n", cluster=True)


def test_a_fleet_view_follows_the_promoted_replica(
    sentinel_setup: tuple[RedisServer, RedisServer, int],
) -> None:
    """The primary is killed and the replica promoted: the fleet view (on the Sentinel
    URL) subscribes to the new primary, reads everything again and holds exactly its
    maps, the write made after the failover included."""
    from registry.fleet.view import FleetView
    from registry.transport.client import client_from_url

    master, replica, sentinel_port = sentinel_setup
    url = f"redis+sentinel://127.0.0.1:{sentinel_port}/mymaster"
    owner = PrefixCacheRegistry.from_url(url, "node-v", socket_timeout=1)
    owner.claim(lease_ttl=120)
    owner.register_kv([1, 2], H[:2])
    sentinel = redis.Redis(port=sentinel_port, decode_responses=True, socket_timeout=2)
    view = FleetView(client_from_url(url, socket_timeout=1)).start()
    replica_client = replica.client()
    try:
        view.sync(["node-v"])
        assert view.held("node-v") == (frozenset(H[:2]), frozenset())
        wait_until(lambda: replica_client.hlen(owner.keys.kv) == 2, what="replicated")
        master.kill()
        wait_until(lambda: _named_port(sentinel) == replica.port, what="switch-master")
        wait_until(lambda: _lands(owner), what="a write on the promoted replica")
        view.sync(["node-v"], timeout=30)
        kv_map, mamba_map = owner.entries()
        assert view.held("node-v") == (frozenset(kv_map), frozenset(mamba_map))
        assert set(kv_map) == set(H[:2])  # the write after the failover: H[1] again
        owner.register_kv([3], [H[2]])
        view.sync(["node-v"], timeout=30)
        assert view.match(H) == {"node-v": 3}
    finally:
        view.close()
        replica_client.close()
        sentinel.close()
        owner.client.close()
