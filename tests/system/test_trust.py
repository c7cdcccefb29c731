"""Trust under faults: fencing that survives a lost ``meta``, writes that tell the truth
after a timeout (request ids), one error vocabulary, a node index that tolerates garbage.

Every fault is produced deterministically: a lost ``meta`` is a DEL, an expired lease is
written through the server's own clock, a stalled server is SIGSTOPped and resumed by the
client's own retry backoff, so no test depends on how busy the machine is.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from redis.backoff import AbstractBackoff
from redis.retry import Retry

from registry import (
    EvictionNotice,
    NodeIndex,
    PrefixCacheRegistry,
    PrefixRouter,
    RegistryMisconfigured,
    RegistryOutOfMemory,
    RegistryPermissionError,
    RegistryUnavailable,
    RegistryWrongType,
    StaleEpochError,
    block_hashes,
    collect_dead,
    live_nodes,
)
from registry.fleet.view import FleetView
from registry.transport.client import CALL_BOUND
from registry.transport.functions import Route, load_library
from tests.support.backends import Backend, dump_keys, expire_lease, new_namespace, registry_state
from tests.support.servers import RedisServer, refused_port, require_redis_server

H = block_hashes(list(range(5000, 5160)), 16)  # 10 chained hashes


def owner_writes(reg: PrefixCacheRegistry) -> list[tuple[str, Callable[[], object]]]:
    """Every call of an owner that writes."""
    return [
        ("register_kv", lambda: reg.register_kv([9], H[:1])),
        ("evict_kv", lambda: reg.evict_kv(H[:2])),
        ("register_mamba", lambda: reg.register_mamba([9], H[:1])),
        ("evict_mamba", lambda: reg.evict_mamba(H[:2])),
        ("clear_kv", reg.clear_kv),
        ("clear_mamba", reg.clear_mamba),
        ("reset", reg.reset),
        ("renew", reg.renew),
    ]


# -- 1. epochs that never repeat ---------------------------------------------------------


def test_an_owner_whose_meta_was_lost_is_fenced_forever(redis_backend: Backend) -> None:
    """meta gone (eviction, an empty restart, a stray DEL): the old owner's writes and
    renewals fail, before and after a new owner claims; nothing of theirs lands."""
    namespace = new_namespace()
    zombie = redis_backend.registry(namespace)
    assert isinstance(zombie, PrefixCacheRegistry)
    zombie_epoch = zombie.claim()
    zombie.register_kv([1, 2], H[:2])
    zombie.register_mamba([2], H[1:2])
    zombie.client.delete(zombie.keys.meta)
    for name, call in owner_writes(zombie):
        with pytest.raises(StaleEpochError, match="unset"):
            call()
        assert zombie.client.exists(zombie.keys.meta) == 0, name  # nothing recreated it
    replacement = redis_backend.registry(namespace)
    assert isinstance(replacement, PrefixCacheRegistry)
    assert replacement.claim() != zombie_epoch
    replacement.register_kv([7], H[:1])
    replacement.register_mamba([7], H[:1])
    before = dump_keys(replacement)
    for name, call in owner_writes(zombie):
        with pytest.raises(StaleEpochError):
            call()
        assert dump_keys(replacement) == before, name
    assert registry_state(replacement) == ({H[0]: 7}, {H[0]: 7})
    replacement.renew()  # the replacement is unaffected


def test_an_owner_collected_by_gc_stays_fenced_after_a_new_claim(
    redis_backend: Backend,
) -> None:
    prefix = f"tr{new_namespace()[2:10]}"
    namespace = new_namespace()
    zombie = redis_backend.registry(namespace, key_prefix=prefix)
    assert isinstance(zombie, PrefixCacheRegistry)
    zombie.claim(lease_ttl=60)
    zombie.register_kv([1], H[:1])
    expire_lease(zombie)
    client = redis_backend.client()
    assert collect_dead(client, prefix) == [namespace]
    with pytest.raises(StaleEpochError):
        zombie.renew()
    fresh = redis_backend.registry(namespace, key_prefix=prefix)
    assert isinstance(fresh, PrefixCacheRegistry)
    fresh.claim(lease_ttl=60)
    for _name, call in owner_writes(zombie):
        with pytest.raises(StaleEpochError):
            call()
    assert registry_state(fresh) == ({}, {})
    assert live_nodes(client, prefix) == [namespace]


def test_epochs_are_unique_even_when_meta_keeps_vanishing(redis_backend: Backend) -> None:
    reg = redis_backend.registry()
    assert isinstance(reg, PrefixCacheRegistry)
    epochs = []
    for _ in range(200):
        reg.client.delete(reg.keys.meta)
        epochs.append(reg.claim(lease_ttl=60))
    assert len(set(epochs)) == len(epochs)
    assert all(0 < e < 2**63 for e in epochs)


def test_a_zombie_heartbeat_stops_once_meta_is_lost(redis_backend: Backend) -> None:
    reg = redis_backend.registry()
    assert isinstance(reg, PrefixCacheRegistry)
    reg.claim(lease_ttl=60)
    beat = reg.start_heartbeat(interval=0.01)
    try:
        reg.client.delete(reg.keys.meta)
        assert beat.lost.wait(30), "the heartbeat did not notice its namespace was lost"
    finally:
        beat.stop()
    assert not beat.alive


# -- 3. notices that never go back: claim delivers its clear in-process ------------------


def test_claim_after_a_lost_meta_frees_the_pool_at_once(redis_backend: Backend) -> None:
    pytest.importorskip("torch")
    from tests.support.gpu import make_pool, states

    reg = redis_backend.registry()
    assert isinstance(reg, PrefixCacheRegistry)
    reg.claim(lease_ttl=60)
    pool = make_pool(reg)
    pool.store([1, 2, 3], H[:3], *states(3))
    assert pool.counts().in_use == 3
    reg.client.delete(reg.keys.meta)  # the server lost the namespace's history
    with pytest.raises(StaleEpochError):
        reg.register_kv([4], H[3:4])
    reg.claim(lease_ttl=60)  # the node starts over: its clear reaches the pool in-process
    assert pool.counts().in_use == 0
    pool.store([5], H[4:5], *states(1))  # and the new history's notices still apply
    reg.evict_mamba(H[4:5])
    assert pool.counts().in_use == 0


# -- 4. a node index that tolerates garbage ----------------------------------------------

GARBAGE = ["", "{x}", "a b", "tab\there", "x" * 1000, "line\u2028sep", "nul\x00", "}"]


@pytest.mark.parametrize("decode", [False, True], ids=["bytes", "decoded"])
def test_garbage_in_the_node_index_breaks_nothing(redis_backend: Backend, decode: bool) -> None:
    prefix = f"gi{new_namespace()[2:10]}"
    nodes = {}
    for name in ("node-a", "node-b"):
        reg = redis_backend.registry(name, key_prefix=prefix)
        assert isinstance(reg, PrefixCacheRegistry)
        reg.claim(lease_ttl=60)
        nodes[name] = reg
    nodes["node-a"].register_kv(range(10), H)
    nodes["node-b"].register_kv(range(4), H[:4])
    admin = redis_backend.client()
    index_key = NodeIndex(admin, prefix).key
    far = int(time.time() * 1000) + 600_000
    admin.zadd(index_key, {g.encode("utf-8"): far for g in GARBAGE})
    admin.zadd(index_key, {b"\xff\xfe": far, b"dead{": 1})
    client = redis_backend.client(decode_responses=decode)
    router = PrefixRouter(client, prefix)
    assert sorted(router.score(H)) == ["node-a", "node-b"]
    assert router.best(H) == "node-a"
    assert sorted(live_nodes(client, prefix)) == ["node-a", "node-b"]
    index = NodeIndex(client, prefix)
    assert index.dead() == []
    assert index.skipped > 0
    invalid = index.invalid()
    assert len(invalid) == len(GARBAGE) + 2
    assert "\\xff\\xfe" in invalid
    assert collect_dead(client, prefix) == []
    assert sorted(index.remove_invalid()) == sorted(invalid)
    assert index.invalid() == []
    members = {m.decode() if isinstance(m, bytes) else m for m in admin.zrange(index_key, 0, -1)}
    assert members == {"node-a", "node-b"}


# -- 2. writes that tell the truth after a timeout --------------------------------------


class ResumeServer(AbstractBackoff):
    """A retry backoff that resumes a SIGSTOPped server before the retry: so the first
    copy of a request is stuck in the stopped server's socket when the client times out
    and sends it again, every time, however busy the machine is."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.resumed = 0

    def __deepcopy__(self, memo: dict[int, object]) -> ResumeServer:
        return self  # redis-py deep-copies its retry policy; keep counting here

    def compute(self, failures: int) -> float:
        os.kill(self.pid, signal.SIGCONT)
        self.resumed += 1
        return 0.0


@pytest.fixture
def stopped(own_server: RedisServer) -> Iterator[Callable[[], None]]:
    """``stop()`` SIGSTOPs the server; the fixture always resumes it."""
    assert own_server.process is not None
    pid = own_server.process.pid

    def stop() -> None:
        os.kill(pid, signal.SIGSTOP)

    try:
        yield stop
    finally:
        os.kill(pid, signal.SIGCONT)


def evalsha_calls(admin: redis.Redis) -> int:
    stats = admin.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


def retrying_registry(server: RedisServer, namespace: str) -> tuple[PrefixCacheRegistry, Any]:
    """A registry whose client times out fast and retries once, resuming the server."""
    assert server.process is not None
    backoff = ResumeServer(server.process.pid)
    retry = Retry(backoff, 1, (redis.ConnectionError, redis.TimeoutError, socket.timeout))
    client = redis.Redis(host=server.host, port=server.port, socket_timeout=0.5, retry=retry)
    reg = PrefixCacheRegistry(client, namespace)
    reg.load_scripts()
    return reg, backoff


Write = Callable[[PrefixCacheRegistry], object]
RETRIED_WRITES: list[tuple[str, Write, object, list[int], int]] = [
    # (name, call, what the caller must be told, the callback's block ids, notices)
    ("evict_mamba", lambda r: r.evict_mamba(H[:3]), set(H[:2]), [1, 2], 1),
    ("evict_kv", lambda r: r.evict_kv(H[1:4]), set(H[1:4]), [2], 1),
    ("register_mamba", lambda r: r.register_mamba([8], H[:1]), None, [1], 1),
    ("clear_mamba", lambda r: r.clear_mamba(), None, [], 1),
    ("reset", lambda r: r.reset(), None, [], 1),
    ("register_kv", lambda r: r.register_kv([9, 9], H[4:6]), None, [], 0),
]


@pytest.mark.parametrize(
    ("call", "told", "fired", "notices"),
    [case[1:] for case in RETRIED_WRITES],
    ids=[case[0] for case in RETRIED_WRITES],
)
def test_a_write_resent_after_a_timeout_runs_once_and_tells_the_truth(
    own_server: RedisServer,
    stopped: Callable[[], None],
    call: Callable[[PrefixCacheRegistry], object],
    told: object,
    fired: list[int],
    notices: int,
) -> None:
    namespace = new_namespace()
    setup = PrefixCacheRegistry(own_server.client(), namespace)
    setup.register_kv([1, 2, 3, 4], H[:4])
    setup.register_mamba([1, 2], H[:2])
    reg, backoff = retrying_registry(own_server, namespace)
    callbacks: list[list[int]] = []
    heard: list[EvictionNotice] = []
    reg.set_mamba_evict_callback(callbacks.append)
    reg.add_eviction_hook(heard.append)
    reg.evict_kv([H[-1]])  # absent: changes nothing; the script is loaded, the pool warm
    admin = own_server.client()
    admin.config_resetstat()
    stopped()  # the request reaches a frozen server; the client gives up and re-sends
    result = call(reg)
    assert backoff.resumed == 1  # it really was sent twice
    assert evalsha_calls(admin) >= 2
    assert result == told  # the truth, not "nothing happened"
    assert callbacks == ([fired] if fired else [])  # exactly once
    assert len(heard) == notices
    assert setup.client.xlen(setup.keys.mamba_evictions) == notices  # one effect
    assert heard == [
        n for n in setup.notices_after(setup.notice_sequence() - notices) or [] if notices
    ]
    replies = list(setup.client.scan_iter(match=setup.keys.reply_prefix + "*"))
    assert replies  # the recorded reply, expiring
    assert all(0 < setup.client.pttl(key) <= 30_000 for key in replies)
    admin.close()
    reg.client.close()
    setup.client.close()


@pytest.mark.parametrize(
    ("call", "told", "fired", "notices"),
    [case[1:] for case in RETRIED_WRITES],
    ids=[case[0] for case in RETRIED_WRITES],
)
def test_an_owners_write_resent_after_a_timeout_runs_once_and_records_its_change_once(
    own_server: RedisServer,
    stopped: Callable[[], None],
    call: Callable[[PrefixCacheRegistry], object],
    told: object,
    fired: list[int],
    notices: int,
) -> None:
    """An owner's write publishes its change record in its own script; re-sent after a
    timeout, the write runs once and its record is counted once: a fleet view following
    the namespace ends equal to the maps, numbered without a gap."""
    namespace = new_namespace()
    reg, backoff = retrying_registry(own_server, namespace)
    reg.claim(lease_ttl=60)
    reg.register_kv([1, 2, 3, 4], H[:4])
    reg.register_mamba([1, 2], H[:2])
    callbacks: list[list[int]] = []
    reg.set_mamba_evict_callback(callbacks.append)
    admin = own_server.client()
    before = admin.xlen(reg.keys.mamba_evictions)
    with FleetView(own_server.client()) as view:
        view.sync()
        gaps = view.counts.gaps
        stopped()
        result = call(reg)
        assert backoff.resumed == 1
        assert result == told
        assert callbacks == ([fired] if fired else [])
        assert admin.xlen(reg.keys.mamba_evictions) == before + notices
        view.sync()
        assert view.counts.gaps == gaps  # one record per write: no number skipped
        scored = PrefixRouter(admin, view=view).score(H, [namespace])
        assert scored == PrefixRouter(admin, exact=True).score(H, [namespace])
    admin.close()
    reg.client.close()


def test_a_resent_eviction_is_applied_once_even_when_others_write_between(
    own_server: RedisServer, stopped: Callable[[], None]
) -> None:
    """The first copy evicts; another writer registers the hash again; the re-sent copy
    must not evict the new entry (it returns the first copy's reply)."""
    namespace = new_namespace()
    other = PrefixCacheRegistry(own_server.client(), namespace)
    other.register_mamba([1], H[:1])
    reg, backoff = retrying_registry(own_server, namespace)
    original_compute = backoff.compute

    def resume_then_reregister(failures: int) -> float:
        delay = original_compute(failures)
        # The first copy has run by the time another client is answered (one thread).
        other.register_mamba([5], H[:1])
        return delay

    backoff.compute = resume_then_reregister  # type: ignore[method-assign]
    reg.evict_kv([H[-1]])  # absent: looks up the namespace's index id before the freeze
    stopped()
    assert reg.evict_mamba(H[:1]) == {H[0]}
    assert other.mamba_block_ids(H[:1]) == [5]  # the new entry survived the re-send
    reg.client.close()
    other.client.close()


def test_an_unanswered_write_says_its_outcome_is_unknown_within_the_bound(
    own_server: RedisServer, stopped: Callable[[], None]
) -> None:
    """With from_url's retry policy, a frozen server costs (retries + 1) x (connect + two
    reads) at most: CALL_BOUND with the default timeouts (measured in the README); here
    with timeouts a quarter of the defaults, so the test takes two seconds, not eight."""
    namespace = new_namespace()
    reg = PrefixCacheRegistry.from_url(
        own_server.url, namespace, socket_timeout=0.5, socket_connect_timeout=0.25
    )
    reg.register_mamba([1], H[:1])
    stopped()
    started = time.monotonic()
    with pytest.raises(RegistryUnavailable) as info:
        reg.evict_mamba(H[:1])
    took = time.monotonic() - started
    assert info.value.outcome_unknown
    assert "may or may not have run" in str(info.value)
    assert took < CALL_BOUND / 4 + 5, took
    with pytest.raises(RegistryUnavailable) as read:
        reg.match_kv_prefix(H)
    assert not read.value.outcome_unknown
    reg.client.close()


# -- 5. one error vocabulary ------------------------------------------------------------


def test_wrongtype_keys_raise_registry_wrong_type(redis_server: RedisServer) -> None:
    reg = PrefixCacheRegistry(redis_server.client(), new_namespace())
    reg.client.set(reg.keys.kv, "not a hash")
    reg.client.set(reg.keys.mamba, "not a hash")
    calls: list[Callable[[], object]] = [
        lambda: reg.register_kv([1], H[:1]),
        lambda: reg.match_kv_prefix(H),
        lambda: reg.evict_kv(H[:1]),
        lambda: reg.match_mamba_farthest(H),
        lambda: reg.register_mamba([1], H[:1]),
    ]
    for call in calls:
        with pytest.raises(RegistryWrongType, match="another Redis type"):
            call()
    reg.client.close()


@pytest.mark.redis_server
@pytest.mark.parametrize("functions", [False, True], ids=["scripts", "functions"])
def test_out_of_memory_raises_and_changes_nothing_while_evictions_still_work(
    functions: bool,
) -> None:
    """The same by EVALSHA and by FCALL (``pcr setup``): a script is refused at its
    first write that may add memory, a function without ``allow-oom`` before it runs;
    the removals and the lease's renewal run under ``maxmemory`` either way."""
    require_redis_server()
    with RedisServer(["--maxmemory-policy", "noeviction"]) as server:
        client = server.client()
        if functions:
            load_library(client)
        reg = PrefixCacheRegistry(client, new_namespace())
        reg.register_kv(range(10), H)
        reg.register_mamba([1], H[:1])
        client.set("filler", "x" * 1_000_000)
        used = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory", used - 500_000)  # over the limit from now on
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            client.set("more", "x")
        before = dump_keys(reg)
        for call in (
            lambda: reg.register_kv([11], [12345]),
            lambda: reg.register_mamba([2], H[1:2]),
            lambda: reg.claim(),
        ):
            with pytest.raises(RegistryOutOfMemory, match="maxmemory"):
                call()
            assert dump_keys(reg) == before
        assert reg.evict_kv(H[5:]) == set(H[5:])  # removing is still allowed
        assert reg.evict_mamba(H[:1]) == {H[0]}
        client.config_set("maxmemory", 0)
        reg.claim(lease_ttl=60)
        client.config_set("maxmemory", int(client.info("memory")["used_memory"]) - 100_000)
        assert reg.renew() > time.time()  # an owner keeps its lease under maxmemory
        assert reg._runner.route is (Route.FUNCTIONS if functions else Route.SCRIPTS)
        client.close()


@pytest.mark.redis_server
def test_a_busy_server_is_unavailable_not_a_crash() -> None:
    require_redis_server()
    with RedisServer(["--busy-reply-threshold", "50"]) as server:
        blocker = server.client()
        worker = threading.Thread(
            target=lambda: _ignore(lambda: blocker.eval("while true do end", 0)), daemon=True
        )
        worker.start()
        probe = server.client()
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    probe.ping()
                except redis.exceptions.ResponseError as exc:
                    if "BUSY" in str(exc):
                        break
            else:
                pytest.fail("the busy script never started")
            reg = PrefixCacheRegistry(server.client(), new_namespace())
            with pytest.raises(RegistryUnavailable, match="busy"):
                reg.register_kv([1], H[:1])
        finally:
            _ignore(lambda: probe.script_kill())
            worker.join(30)
            probe.close()
            blocker.close()


def _ignore(call: Callable[[], object]) -> None:
    with contextlib.suppress(redis.RedisError):
        call()


def test_a_user_without_a_needed_command_gets_a_permission_error(redis_server: RedisServer) -> None:
    admin = redis_server.client()
    namespace = new_namespace()
    admin.acl_setuser(
        "no-get",
        enabled=True,
        passwords=["+secret"],
        keys=["*"],
        channels=["*"],
        commands=["+@all", "-get"],
    )
    try:
        url = f"redis://no-get:secret@{redis_server.host}:{redis_server.port}/0"
        reg = PrefixCacheRegistry.from_url(url, namespace)
        with pytest.raises(RegistryPermissionError, match="grant it"):
            reg.register_kv([1], H[:1])
        assert "secret" not in str(RegistryPermissionError)
        reg.client.close()
        bad_login = PrefixCacheRegistry.from_url(
            f"redis://no-get:wrong@{redis_server.host}:{redis_server.port}/0", namespace
        )
        with pytest.raises(RegistryPermissionError, match="refused the login") as info:
            bad_login.match_kv_prefix(H)
        assert "wrong" not in str(info.value)
        bad_login.client.close()
    finally:
        admin.acl_deluser("no-get")
        admin.close()


def test_wrong_url_kinds_are_misconfigurations(
    redis_server: RedisServer, redis_cluster: Any
) -> None:
    host, port = redis_server.host, redis_server.port
    with pytest.raises(RegistryMisconfigured, match="redis://"):
        PrefixCacheRegistry.from_url(f"redis+cluster://{host}:{port}", "n")
    reg = PrefixCacheRegistry.from_url(f"redis://{host}:{port}/99999", "n")
    with pytest.raises(RegistryMisconfigured, match="database"):
        reg.match_kv_prefix(H)
    reg.client.close()
    cluster_host, cluster_port = redis_cluster.startup_nodes[0]
    on_cluster = [
        PrefixCacheRegistry.from_url(f"redis://{cluster_host}:{cluster_port}/0", f"n{i}")
        for i in range(6)
    ]
    with pytest.raises(RegistryMisconfigured, match="redis\\+cluster://"):  # noqa: PT012
        for reg in on_cluster:  # some namespace lives on another shard: MOVED
            reg.register_kv([1], H[:1])
    for reg in on_cluster:
        reg.client.close()
    with refused_port() as dead, pytest.raises(RegistryUnavailable):
        PrefixCacheRegistry.from_url(f"redis+cluster://127.0.0.1:{dead}", "n")
