"""Per-node Redis ACL users on a real redis-server: each serving node's user reaches only
its own namespace (keys ``pcr:{NS}:*`` and channel ``pcr:{NS}:mamba-evicted``) plus the
shared node index ``pcr:nodes``, with exactly the commands a serving node sends.

The module's server holds the registry's Redis Functions library, loaded by ``pcr setup``
as its admin: every recipe grants ``+fcall`` (``+fcall_ro`` for reads) and no ``EVAL``,
``EVALSHA`` or ``SCRIPT``, so no user can run Lua of its own. Redis checks every command a
function calls against the ACL of the user that called it, so the grant lists the
commands the scripts call (their ``Calls:`` headers) as well as those the Python side
sends itself. What the tests establish:

* node-a's user runs everything a serving node does (claim, renew, every registry call,
  ``live_nodes``, an ``EvictionListener`` freeing a slot of its ``MambaSlotPool``), no
  command is refused on the way, and the commands it sends are exactly the ones granted;
* redis-py's connection handshake needs no grant (``HELLO``/``AUTH`` are exempt from ACL
  command checks; ``CLIENT SETINFO`` and ``CLIENT MAINT_NOTIFICATIONS`` fail harmlessly);
* ``PING`` is needed as soon as a client has ``health_check_interval`` set;
* node-a cannot read, write, evict, publish to or subscribe to node-b's data, not even
  through a function (a key or channel a function touches is checked like a direct
  command), cannot run Lua of its own (EVAL, EVALSHA, SCRIPT LOAD, FUNCTION LOAD are
  refused), and node-b's keys stay byte-for-byte the same;
* without the library (no ``pcr setup``) a user granted ``+evalsha +script|load`` runs
  the same scripts by EVALSHA, and a user granted ``+fcall`` only is told to run
  ``pcr setup`` and works once it has run;
* the shared node index is not isolated: node-a can rewrite node-b's lease entry there.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import re
import shlex
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.exceptions import NoPermissionError, ResponseError

from registry import (
    PrefixCacheRegistry,
    PrefixRouter,
    RegistryPermissionError,
    collect_dead,
    live_nodes,
)
from registry.core.keys import node_index_key
from registry.transport.lua import function_name, library_name
from tests.support import REPO_ROOT
from tests.support.servers import HOST, RedisServer, require_redis_server

pytestmark = pytest.mark.redis_server

PREFIX = "pcr"
NODE_INDEX = node_index_key(PREFIX)  # "pcr:nodes"
PASSWORDS = {"node-a": "node-a-Pw-5Qx", "node-b": "node-b-Pw-8Kd"}

# What a serving node sends. Top level, from the Python side: FCALL (every write and
# live_nodes, functions of the library `pcr setup` loaded), HMGET and HGET (reads),
# XREVRANGE (notice replay), SUBSCRIBE (the eviction listener), PING (redis-py's health
# check). Inside the functions (lua/*.lua, "Calls:"): GET and SET (request ids), TIME,
# HGET, HMGET, HSET, HDEL, HINCRBY, EXISTS, UNLINK, XADD, PUBLISH, and on the node index
# ZADD alone (announce), through a selector of its own (tests/system/test_node_index_trust.py):
# the index is only where routers look, liveness is each namespace's own meta lease. Not a
# node's: HEXISTS (score.lua, routers), FCALL_RO (score and fleet_snapshot, read-only
# functions), and listing live nodes (it reads every namespace's meta).
NODE_COMMANDS = (
    "fcall",
    "hget",
    "hmget",
    "xrevrange",
    "subscribe",
    "ping",
    "time",
    "hset",
    "hdel",
    "hincrby",
    "exists",
    "unlink",
    "xadd",
    "publish",
    "get",
    "set",
)

# Handshake commands redis-py 8 sends on every new connection and ignores the failure of.
# Redis 7.0 does not know these subcommands ("unknown subcommand", no ACL check); a server
# that knows them refuses them with NOPERM under this ACL and logs each refusal.
HANDSHAKE_EXTRAS = ("client|setinfo", "client|maint_notifications")

OK = (b"OK", "OK", True)
A1, A2, A3, A4 = 1_000_001, 1_000_002, 1_000_003, 1_000_004
B1, B2, B3 = 2_000_001, 2_000_002, 2_000_003


RECIPES = REPO_ROOT / "docs" / "acl"  # one file per role, in aclfile form (the guide shows them)
ROLES = ("node", "router", "bridge", "gc", "gateway")
ROLE_PASSWORDS = {
    "router": "router-Pw-3Tz",
    "bridge": "bridge-Pw-7Lm",
    "gc": "gc-Pw-2Vw",
    "gateway": "gateway-Pw-4Hs",
}
ALL_PASSWORDS = {**PASSWORDS, **ROLE_PASSWORDS}


def recipe(role: str) -> tuple[str, list[str]]:
    """The user name and ``ACL SETUSER`` rules of ``docs/acl/<role>.acl`` (one ``user``
    line, the password written ``>PASSWORD``; a selector ``(...)`` kept as one rule)."""
    lines = (RECIPES / f"{role}.acl").read_text().splitlines()
    assert len(lines) == 1, f"{role}.acl: one user line"
    keyword, user, *words = lines[0].split()
    assert keyword == "user"
    rules: list[str] = []
    for word in words:
        if rules and rules[-1].startswith("(") and not rules[-1].endswith(")"):
            rules[-1] += " " + word
        else:
            rules.append(word)
    assert rules.count(">PASSWORD") == 1, f"{role}.acl: the password is written >PASSWORD"
    return user, rules


def acl_rules(user: str) -> list[str]:
    """The ``ACL SETUSER <user>`` arguments for the serving node whose namespace is
    ``user``: the node recipe (written for ``node-a``) with its names and password."""
    _name, rules = recipe("node")
    return [
        f">{PASSWORDS[user]}" if rule == ">PASSWORD" else rule.replace("node-a", user)
        for rule in rules
    ]


def role_rules(role: str) -> tuple[str, list[str]]:
    """A role's user and rules, with the test's password for it."""
    user, rules = recipe(role)
    password = ALL_PASSWORDS[user]
    return user, [f">{password}" if rule == ">PASSWORD" else rule for rule in rules]


def command(client: redis.Redis, *args: Any) -> Any:
    """A raw command, as redis-cli would send it."""
    return client.execute_command(*args)  # type: ignore[no-untyped-call]


def raw(registry: PrefixCacheRegistry) -> redis.Redis:
    """The registry's redis-py client (``from_url`` builds a ``redis.Redis`` here)."""
    assert isinstance(registry.client, redis.Redis)
    return registry.client


def pubsub(client: redis.Redis) -> Any:
    """A ``PubSub`` on one of ``client``'s connections (the caller closes it)."""
    return client.pubsub()  # type: ignore[no-untyped-call]


def url_for(server: RedisServer, user: str) -> str:
    return f"redis://{user}:{ALL_PASSWORDS[user]}@{HOST}:{server.port}/0"


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def is_noperm(exc: BaseException | None) -> bool:
    """redis-py turns a ``-NOPERM`` reply into NoPermissionError (dropping the prefix);
    the registry's calls raise RegistryPermissionError with it as the cause."""
    if isinstance(exc, RegistryPermissionError):
        return is_noperm(exc.__cause__)
    return isinstance(exc, NoPermissionError) or (
        isinstance(exc, ResponseError) and "NOPERM" in str(exc)
    )


def refused_in_script(exc: BaseException) -> bool:
    """A command refused inside a script: Redis 7.0 replies ``ERR The user executing the
    script can't ...``, not NOPERM, so redis-py raises a plain ResponseError."""
    return is_noperm(exc) or "The user executing the script can't" in str(exc)


def acl_log(admin: redis.Redis, user: str) -> list[dict[str, str]]:
    """The server's ACL LOG entries (refusals) for ``user``, as text, newest first (all
    of them the server keeps: ``acllog-max-len``, 128; a plain ``ACL LOG`` lists 10)."""
    logged = command(admin, "ACL", "LOG", 128)
    entries = [{text(k): text(v) for k, v in entry.items()} for entry in logged]
    return [entry for entry in entries if entry["username"] == user]


def refusals(admin: redis.Redis, user: str) -> list[dict[str, str]]:
    """``acl_log`` less redis-py's ignored handshake extras (refused on newer servers)."""
    return [entry for entry in acl_log(admin, user) if entry["object"] not in HANDSHAKE_EXTRAS]


def server_version(admin: redis.Redis) -> tuple[int, ...]:
    return tuple(int(part) for part in text(admin.info("server")["redis_version"]).split("."))


def used_commands(admin: redis.Redis) -> dict[str, dict[str, Any]]:
    """``INFO commandstats`` since the last ``CONFIG RESETSTAT``, by command name."""
    stats = admin.info("commandstats")
    return {name.removeprefix("cmdstat_"): value for name, value in stats.items()}


def next_message(pubsub: Any, timeout: float = 5.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        message = pubsub.get_message(timeout=0.1)
        if message is not None:
            return {k: text(v) if isinstance(v, bytes) else v for k, v in message.items()}
    raise AssertionError("no pub/sub message arrived")


# -- fixtures ---------------------------------------------------------------------------


def add_users(server: RedisServer) -> None:
    """The users node-a and node-b and one user of each other role, from ``docs/acl``."""
    admin = server.client()
    try:
        for user in PASSWORDS:
            assert command(admin, "ACL", "SETUSER", user, *acl_rules(user)) in OK
        for role in ROLES[1:]:
            user, rules = role_rules(role)
            assert command(admin, "ACL", "SETUSER", user, *rules) in OK
    finally:
        admin.close()


def pcr_setup(server: RedisServer, *options: str) -> tuple[int, str, str]:
    """``pcr setup --redis-url`` (the admin's URL) in this process: status, out, err."""
    from pcr.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["setup", "--redis-url", server.url, *options])
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    """A redis-server of this module's own, with the users node-a and node-b and one
    user of each other role (router, bridge, gc, gateway), all from ``docs/acl``, and the
    registry's Functions library, loaded by ``pcr setup``."""
    require_redis_server()
    with RedisServer() as started:
        add_users(started)
        code, out, err = pcr_setup(started)
        assert (code, err) == (0, ""), err
        where = f"Redis at {HOST}:{started.port}"
        assert out == f"loaded Redis Functions library {library_name()} on {where}\n"
        yield started


@pytest.fixture
def admin(server: RedisServer) -> Iterator[redis.Redis]:
    """The default (unrestricted) user, with an empty ACL LOG at the start of each test."""
    client = server.client()
    command(client, "ACL", "LOG", "RESET")
    yield client
    client.close()


Connect = Callable[..., PrefixCacheRegistry]


@pytest.fixture
def connect(server: RedisServer) -> Iterator[Connect]:
    """``connect(user, namespace=user, **client_options)``: a registry logged in as
    ``user`` through ``from_url``; every client is closed after the test."""
    made: list[PrefixCacheRegistry] = []

    def make(user: str, namespace: str | None = None, **options: Any) -> PrefixCacheRegistry:
        registry = PrefixCacheRegistry.from_url(url_for(server, user), namespace or user, **options)
        made.append(registry)
        return registry

    yield make
    for registry in made:
        raw(registry).close()


# -- the users --------------------------------------------------------------------------


def test_the_users_hold_exactly_the_recipe(admin: redis.Redis) -> None:
    for user in PASSWORDS:
        reply = command(admin, "ACL", "GETUSER", user)
        info = {text(k): v for k, v in reply.items()}
        assert [text(f) for f in info["flags"]] == ["on", "sanitize-payload"]
        assert text(info["keys"]) == f"~{PREFIX}:{{{user}}}:*"
        assert text(info["channels"]) == f"&{PREFIX}:{{{user}}}:*"
        granted = text(info["commands"]).split()
        assert granted[0] == "-@all"
        assert sorted(granted[1:]) == sorted(f"+{c}" for c in NODE_COMMANDS)
        # The one selector: its own keys and its entry quota, for the functions that add
        # entries (they read the quota; tests/system/test_quota.py), as a whole.
        # The selectors: its own keys and its entry quota, for the functions that add
        # entries (they read the quota; tests/system/test_quota.py), as a whole; and the
        # node index, where announce adds its member and nothing can be removed.
        quota, index = ({text(k): text(v) for k, v in sel.items()} for sel in info["selectors"])
        assert quota["keys"] == f"~{PREFIX}:{{{user}}}:* ~{PREFIX}:quota:{{{user}}}"
        assert sorted(quota["commands"].split()) == ["+fcall", "+get", "+hlen", "-@all"]
        assert index["keys"] == f"~{NODE_INDEX}"
        assert sorted(index["commands"].split()) == ["+fcall", "+zadd", "-@all"]


@pytest.mark.parametrize("protocol", [2, 3])
def test_connecting_needs_no_grant(admin: redis.Redis, connect: Connect, protocol: int) -> None:
    """RESP2 logs in with AUTH, RESP3 (redis-py 8's default) with HELLO 3 AUTH: both are
    exempt from ACL command checks. redis-py's CLIENT SETINFO / MAINT_NOTIFICATIONS are
    unknown to Redis 7.0 and refused (NOPERM) by newer servers; redis-py ignores either."""
    admin.config_resetstat()
    registry = connect("node-a", protocol=protocol)
    assert registry.match_kv_prefix([A1]) == ([], 0)
    login = "auth" if protocol == 2 else "hello"
    stats = used_commands(admin)
    assert stats[login]["calls"] >= 1
    assert stats[login]["rejected_calls"] == 0
    assert refusals(admin, "node-a") == []
    with pytest.raises(ResponseError) as refused:
        command(raw(registry), "CLIENT", "SETINFO", "LIB-NAME", "probe")
    if server_version(admin) < (7, 2):
        assert "unknown subcommand" in str(refused.value).lower()
    else:
        assert is_noperm(refused.value)


# -- what node A needs ------------------------------------------------------------------


def test_node_a_can_do_everything_a_serving_node_does(admin: redis.Redis, connect: Connect) -> None:
    # Whatever ran before: claim() must add node-a to the index (ZADD). Every script runs
    # as a function of the library pcr setup loaded (FCALL), none by EVALSHA.
    admin.zrem(NODE_INDEX, "node-a")
    admin.config_resetstat()
    registry = connect("node-a")
    freed: list[list[int]] = []
    registry.set_mamba_evict_callback(freed.append)

    epoch = registry.claim(lease_ttl=30.0)
    assert epoch >= 1
    incarnation, base = registry.notice_position()  # notice numbers survive a claim
    lease_end = registry.renew()
    assert lease_end > time.time()

    # Its own channel: a subscriber logged in as node-a hears the notices.
    subscriber = pubsub(raw(registry))
    try:
        subscriber.subscribe(registry.keys.mamba_evicted_channel)
        assert next_message(subscriber)["type"] == "subscribe"

        registry.register_kv([1, 2, 3, 4], [A1, A2, A3, A4])
        assert registry.match_kv_prefix([A1, A2, A3, A4, 9]) == ([1, 2, 3, 4], A4)
        registry.register_mamba([2, 3], [A2, A3])
        assert registry.match_mamba_farthest([A1, A2, A3, A4]) == 3
        assert registry.find_mamba_backoff([A1, A2, A3, A4], 2) == 2
        assert registry.mamba_block_ids([A2, A4]) == [2, None]

        assert registry.evict_kv([A3, A4]) == {A3, A4}  # cascades to A3's Mamba entry
        assert freed == [[3]]
        assert without_time(next_message(subscriber)["data"]) == (
            f"{base + 1}@{incarnation} cascade 3:{A3}"
        )
        assert registry.match_kv_prefix([A1, A2, A3]) == ([1, 2], A2)
        assert registry.match_mamba_farthest([A1, A2, A3]) == 2

        assert registry.evict_mamba([A2]) == {A2}
        assert freed == [[3], [2]]
        assert without_time(next_message(subscriber)["data"]) == (
            f"{base + 2}@{incarnation} evict 2:{A2}"
        )
        notices = registry.notices_after(base)
        assert notices is not None
        assert [(n.seq, n.kind, n.pairs) for n in notices] == [
            (base + 1, "cascade", ((3, A3),)),
            (base + 2, "evict", ((2, A2),)),
        ]

        registry.clear_kv()
        assert registry.match_kv_prefix([A1]) == ([], 0)
        registry.register_mamba([1], [A1])
        registry.clear_mamba()
        assert without_time(next_message(subscriber)["data"]) == f"{base + 3}@{incarnation} clear"
        registry.register_kv([1], [A1])
        registry.register_mamba([1], [A1])
        registry.reset()
        assert without_time(next_message(subscriber)["data"]) == f"{base + 4}@{incarnation} clear"
        assert registry.match_kv_prefix([A1]) == ([], 0)
        assert registry.match_mamba_farthest([A1]) == 0
        assert registry.notice_sequence() == base + 4
    finally:
        subscriber.close()

    # redis-py's health check (any client with health_check_interval) sends PING.
    checked = connect("node-a", health_check_interval=0.001)
    assert checked.match_kv_prefix([A1]) == ([], 0)
    time.sleep(0.01)
    assert checked.match_kv_prefix([A1]) == ([], 0)

    assert refusals(admin, "node-a") == []
    stats = used_commands(admin)
    assert {name for name, s in stats.items() if s["rejected_calls"]} == set()
    # Besides the admin's own INFO / CONFIG RESETSTAT / ACL LOG and the login (HELLO or AUTH, no
    # grant needed), node-a used every granted command and nothing else.
    node_a_used = set(stats) - {"info", "config|resetstat", "acl|log", "hello", "auth"}
    assert node_a_used == {*NODE_COMMANDS, "zadd"}  # ZADD: the index selector's
    assert "node-a" in live_nodes(admin)  # announced: a router finds it


def test_ping_is_needed_for_redis_py_health_checks(
    server: RedisServer, admin: redis.Redis, connect: Connect
) -> None:
    """Without +ping, the first call after an idle health-check interval fails."""
    rules = [r for r in acl_rules("node-a") if r != "+ping"]
    assert len(rules) == len(acl_rules("node-a")) - 1
    command(admin, "ACL", "SETUSER", "node-a-noping", *rules)
    try:
        url = url_for(server, "node-a").replace("node-a:", "node-a-noping:", 1)
        registry = PrefixCacheRegistry.from_url(url, "node-a", health_check_interval=0.001)
        try:
            assert registry.match_kv_prefix([A1]) == ([], 0)
            time.sleep(0.01)
            with pytest.raises(RegistryPermissionError, match="'ping'") as refused:
                registry.match_kv_prefix([A1])
            assert isinstance(refused.value.__cause__, NoPermissionError)
        finally:
            raw(registry).close()
    finally:
        command(admin, "ACL", "DELUSER", "node-a-noping")
    assert [(e["reason"], e["object"]) for e in acl_log(admin, "node-a-noping")] == [
        ("command", "ping")
    ]


def test_eviction_listener_as_node_a_frees_a_slot(
    server: RedisServer, admin: redis.Redis, connect: Connect
) -> None:
    pytest.importorskip("torch")
    from gpu import EvictionListener
    from tests.support.gpu import make_pool, states
    from tests.support.waiting import wait_until

    registry = connect("node-a")
    registry.claim(lease_ttl=30.0)
    base = registry.notice_sequence()
    pool = make_pool(registry)
    try:
        pool.store([1, 2], [A1, A2], *states(2))
        elsewhere = connect("node-a")  # another process of node A: no in-process hook
        with EvictionListener(url_for(server, "node-a"), "node-a", pool) as listener:
            assert elsewhere.evict_mamba([A1]) == {A1}
            wait_until(lambda: pool.pairs() == {(2, A2)}, what="slot of A1 freed")
            elsewhere.register_kv([2], [A2])
            assert elsewhere.evict_kv([A2]) == {A2}  # cascade
            wait_until(lambda: pool.counts().in_use == 0, what="slot of A2 freed")
            counts = listener.counts()
        assert not listener.alive
    finally:
        pool.close()
    assert (counts.applied, counts.errors, counts.reconnects) == (2, 0, 0)
    assert counts.last_seq == base + 2
    assert pool.counts().freed == 2
    assert refusals(admin, "node-a") == []


# -- what node A must not reach ---------------------------------------------------------


def without_time(text: str) -> str:
    """A notice's text without its publish time (``@<ms>`` after the kind)."""
    return re.sub(r" @\d+", "", text)


def snapshot(admin: redis.Redis, registry: PrefixCacheRegistry) -> dict[str, Any]:
    """Byte-exact copy of a namespace's keys (DUMP) and its node-index entry."""
    k = registry.keys  # not engine_blocks: only bridged namespaces have it
    keys: dict[str, Any] = {
        key: admin.dump(key) for key in (k.kv, k.mamba, k.meta, k.mamba_evictions)
    }
    keys[NODE_INDEX] = admin.zscore(NODE_INDEX, registry.namespace)
    return keys


def test_node_a_cannot_reach_node_b(admin: redis.Redis, connect: Connect) -> None:
    node_b = connect("node-b")  # node-b's own user fills its namespace
    node_b.claim(lease_ttl=60.0)
    node_b.register_kv([11, 12, 13], [B1, B2, B3])
    node_b.register_mamba([12, 13], [B2, B3])
    assert node_b.evict_mamba([B3]) == {B3}  # a notice in node-b's stream
    before = snapshot(admin, node_b)
    assert all(value is not None for value in before.values())

    watcher = pubsub(raw(node_b))  # node-b's listener would hear a forged notice
    try:
        watcher.subscribe(node_b.keys.mamba_evicted_channel)
        assert next_message(watcher)["type"] == "subscribe"

        node_a = connect("node-a")
        node_a.claim(lease_ttl=30.0)
        node_a.register_mamba([7], [A1])
        client = raw(node_a)
        intruder = PrefixCacheRegistry(client, "node-b")  # node-b's names, node-a's login
        attempts: dict[str, Callable[[], object]] = {
            "match_kv_prefix": lambda: intruder.match_kv_prefix([B1, B2]),
            "match_mamba_farthest": lambda: intruder.match_mamba_farthest([B1, B2]),
            "register_kv": lambda: intruder.register_kv([99], [B3]),
            "register_mamba": lambda: intruder.register_mamba([99], [B1]),
            "evict_kv": lambda: intruder.evict_kv([B1, B2]),
            "evict_mamba": lambda: intruder.evict_mamba([B2]),
            "clear_kv": intruder.clear_kv,
            "clear_mamba": intruder.clear_mamba,
            "reset": intruder.reset,
            "claim": intruder.claim,
            "notices_after": lambda: intruder.notices_after(0),
            "HGETALL": lambda: client.hgetall(node_b.keys.kv),
            "HGET": lambda: client.hget(node_b.keys.meta, "epoch"),
            "PUBLISH": lambda: client.publish(node_b.keys.mamba_evicted_channel, "9 clear"),
        }
        for name, attempt in attempts.items():
            with pytest.raises((ResponseError, RegistryPermissionError)) as refused:
                attempt()
            assert is_noperm(refused.value), f"{name}: {refused.value!r}"

        # SUBSCRIBE to node-b's channel is refused.
        eavesdropper = pubsub(client)
        try:
            eavesdropper.subscribe(node_b.keys.mamba_evicted_channel)  # refused on reading
            with pytest.raises(ResponseError) as refused:
                next_message(eavesdropper)
            assert is_noperm(refused.value)
        finally:
            eavesdropper.close()

        # A function run on node-a's own keys but told to publish on node-b's channel:
        # the PUBLISH inside it is checked against node-a's ACL and refused. Redis does
        # not roll a function back, so node-a's own writes before it stay.
        own_keys = (
            node_a.keys.reply_prefix + "f0-1",
            node_a.keys.mamba,
            node_a.keys.meta,
            node_a.keys.mamba_evictions,
        )
        channel = node_b.keys.mamba_evicted_channel
        forged = (str(node_a.epoch), "f0-1", 30_000, channel, 100, A1)
        seq = node_a.notice_sequence()
        with pytest.raises(ResponseError) as refused:
            command(
                client, "FCALL", function_name("evict_mamba"), len(own_keys), *own_keys, *forged
            )
        assert refused_in_script(refused.value)
        assert "publish to the channel" in str(refused.value)
        assert node_a.mamba_block_ids([A1]) == [None]  # HDEL ran before the PUBLISH
        assert node_a.notice_sequence() == seq + 1  # numbered, streamed, never published

        # No Lua of node-a's own runs: scripts and libraries are an admin's to load.
        assert_admin_only_refused(client)

        time.sleep(0.1)
        assert watcher.get_message(timeout=0.1) is None  # node-b heard nothing
    finally:
        watcher.close()

    assert snapshot(admin, node_b) == before
    log = acl_log(admin, "node-a")
    seen = {(e["reason"], e["context"], e["object"]) for e in log}
    channel = node_b.keys.mamba_evicted_channel
    # A write's first key is its reply record, so that is the key refused for writes.
    assert any(
        (r, c) == ("key", "toplevel") and o.startswith(node_b.keys.reply_prefix) for r, c, o in seen
    )
    assert ("key", "toplevel", node_b.keys.meta) in seen
    assert ("key", "toplevel", node_b.keys.kv) in seen  # HMGET of node-b's map
    assert ("channel", "toplevel", channel) in seen  # PUBLISH and SUBSCRIBE
    assert ("channel", "lua", channel) in seen  # the PUBLISH inside the function
    assert {("command", "toplevel", c) for c in OWN_LUA_COMMANDS} <= seen
    assert {e["reason"] for e in log} <= {"key", "command", "channel"}
    assert refusals(admin, "node-b") == []


def test_the_node_index_no_longer_lets_one_node_hide_another(
    admin: redis.Redis, connect: Connect
) -> None:
    """``(~pcr:nodes +fcall +zadd)``: node-a may still move node-b's score in the index,
    but liveness is node-b's own meta lease, so routers keep scoring it; node-a may not
    remove members or the index (tests/system/test_node_index_trust.py has the rest)."""
    node_b = connect("node-b")
    node_b.claim(lease_ttl=60.0)
    node_b.register_kv([11, 12], [B1, B2])
    node_a = connect("node-a")
    node_a.claim(lease_ttl=60.0)
    router = PrefixRouter(admin, live_cache_ttl=0.0)
    assert router.score([B1, B2])["node-b"].kv_prefix == 2

    assert raw(node_a).zadd(NODE_INDEX, {"node-b": 1}) == 0  # lease end "moved" to 1970
    assert router.score([B1, B2])["node-b"].kv_prefix == 2
    assert "node-b" in live_nodes(admin)
    assert "node-b" not in collect_dead(admin)
    for args in (("ZREM", NODE_INDEX, "node-b"), ("UNLINK", NODE_INDEX), ("DEL", NODE_INDEX)):
        with pytest.raises(ResponseError) as refused:
            command(raw(node_a), *args)
        assert is_noperm(refused.value), args
    assert admin.zscore(NODE_INDEX, "node-b") == 1.0
    assert router.score([B1, B2])["node-b"].kv_prefix == 2


# -- the recipes of the other roles (docs/acl) --------------------------------------------

OWN_LUA = (  # running Lua of one's own, or changing the library: no role may
    ("EVAL", "while true do end", 0),
    ("EVAL_RO", "return 1", 0),
    ("EVALSHA", "e0e1f9fabfc9d4800c877a703b823ac0578ff8db", 0),  # SHA1 of "return 1"
    ("EVALSHA_RO", "e0e1f9fabfc9d4800c877a703b823ac0578ff8db", 0),
    ("SCRIPT", "LOAD", "while true do end"),
    ("FUNCTION", "LOAD", "#!lua name=mine\nredis.register_function('mine', function() end)"),
    ("FUNCTION", "DELETE", "pcr_vdeadbeef0000"),
    ("FUNCTION", "RESTORE", "x"),
)
OWN_LUA_COMMANDS = (
    "eval",
    "eval_ro",
    "evalsha",
    "evalsha_ro",
    "script|load",
    "function|load",
    "function|delete",
    "function|restore",
)
"""How ACL LOG names each refusal of ``OWN_LUA``."""

ADMIN_ONLY = (  # what no role's user may send
    ("FLUSHALL",),
    ("CONFIG", "GET", "maxmemory"),
    ("CONFIG", "SET", "maxmemory", "1"),
    *OWN_LUA,
    ("SCRIPT", "FLUSH"),
    ("SCRIPT", "KILL"),
    ("ACL", "LIST"),
    ("KEYS", "*"),
    ("FLUSHDB",),
    ("FUNCTION", "FLUSH"),
    ("FUNCTION", "KILL"),
    ("SHUTDOWN", "NOSAVE"),
)


def denied(exc: BaseException) -> bool:
    """Refused by the ACL, at the top level or inside a script (the registry's calls
    raise RegistryPermissionError with redis-py's error as the cause)."""
    cause = exc.__cause__ if isinstance(exc, RegistryPermissionError) else exc
    return cause is not None and refused_in_script(cause)


def granted(role: str) -> set[str]:
    """The commands a role's recipe grants (``+name``), lower case."""
    _user, rules = recipe(role)
    return {rule[1:] for rule in rules if rule.startswith("+")}


def login(server: RedisServer, user: str, **options: Any) -> redis.Redis:
    return redis.Redis.from_url(url_for(server, user), **options)


def role_used(admin: redis.Redis) -> set[str]:
    """Commands counted since the last ``CONFIG RESETSTAT``, less the admin's own and the
    login (which needs no grant)."""
    return set(used_commands(admin)) - {"info", "config|resetstat", "acl|log", "hello", "auth"}


def assert_admin_only_refused(client: redis.Redis) -> None:
    for args in ADMIN_ONLY:
        with pytest.raises(ResponseError) as refused:
            command(client, *args)
        assert is_noperm(refused.value), f"{args}: {refused.value!r}"


def test_the_guide_shows_each_recipe_as_written() -> None:
    """docs/guides/security.md shows every docs/acl/*.acl line verbatim, and the node
    lines of its per-node section are the node recipe, quoted for a shell."""
    guide = (REPO_ROOT / "docs" / "guides" / "security.md").read_text()
    files = sorted(path.stem for path in RECIPES.glob("*.acl"))
    assert files == sorted(ROLES)
    for role in ROLES:
        line = (RECIPES / f"{role}.acl").read_text().strip()
        assert f"\n{line}\n" in guide, f"{role}.acl is not shown in the security guide"
    shown = [
        shlex.split(found)
        for found in re.findall(r"^redis-cli ACL SETUSER (node-a .*)$", guide, re.MULTILINE)
    ]
    _user, rules = recipe("node")
    assert shown == [["node-a", *[">PASSWORD_A" if r == ">PASSWORD" else r for r in rules]]]


def test_the_recipes_load_as_an_aclfile(tmp_path: Path) -> None:
    """The four lines, passwords filled in, are a valid ``aclfile`` for redis-server; each
    user logs in and holds what its line says."""
    require_redis_server()
    lines = []
    for role in ROLES:
        user, rules = role_rules(role) if role != "node" else ("node-a", acl_rules("node-a"))
        lines.append(" ".join(["user", user, *rules]))
    aclfile = tmp_path / "users.acl"
    aclfile.write_text("\n".join(lines) + "\n")
    with RedisServer(extra_args=["--aclfile", str(aclfile)]) as loaded:
        admin = loaded.client()
        try:
            for role in ROLES:
                user = recipe(role)[0]
                client = login(loaded, user)
                try:
                    assert client.ping() is True
                    users = {text(c["user"]) for c in admin.client_list()}
                    assert user in users
                finally:
                    client.close()
                info = {text(k): v for k, v in command(admin, "ACL", "GETUSER", user).items()}
                listed = text(info["commands"]).split()
                assert listed[0] == "-@all"
                assert {c.lstrip("+") for c in listed[1:]} == granted(role)
        finally:
            admin.close()


def make_dead(admin: redis.Redis, namespace: str) -> PrefixCacheRegistry:
    """A claimed namespace with entries whose lease ended in 1970 (meta and index)."""
    dead = PrefixCacheRegistry(admin, namespace)
    dead.claim(lease_ttl=60.0)
    dead.register_kv([1], [A1])
    admin.hset(dead.keys.meta, "lease_until", 1)
    admin.zadd(NODE_INDEX, {namespace: 1})
    return dead


def scores_of(scores: Any) -> dict[str, int]:
    return {name: score.kv_prefix for name, score in scores.items()}


def test_the_router_reads_the_fleet_and_writes_nothing(
    server: RedisServer, admin: redis.Redis, connect: Connect, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``router.acl``: the per-namespace score (``PrefixRouter``, ``AsyncPrefixRouter``),
    the live namespaces, the engine table and a ``FleetView`` following the change
    records (a small namespace loaded by the snapshot script, a large one in pages with
    ``HSCAN``: the threshold lowered here so node-a's two entries count as large) all
    work, with exactly the granted commands; no write of any kind does."""
    from registry import NodeIndex
    from registry.fleet import snapshots
    from registry.fleet.view import FleetView
    from tests.support.waiting import wait_until

    monkeypatch.setattr(snapshots, "PAGED_ABOVE", 1)

    node_a = connect("node-a")
    node_a.claim(lease_ttl=60.0)
    node_a.register_kv([1, 2], [A1, A2])
    node_b = connect("node-b")
    node_b.claim(lease_ttl=60.0)
    node_b.register_kv([1], [A1])
    admin.hset("pcr:engines", "node-a", "http://10.0.0.7:8000")
    admin.config_resetstat()

    router = login(server, "router", health_check_interval=0.001)
    view: FleetView | None = None
    try:
        assert scores_of(PrefixRouter(router, live_cache_ttl=0.0).score([A1, A2, A3])) == {
            **scores_of(PrefixRouter(admin, live_cache_ttl=0.0).score([A1, A2, A3])),
            "node-a": 2,
        }
        assert "node-a" in NodeIndex(router).live()
        assert NodeIndex(router).engines()["node-a"] == "http://10.0.0.7:8000"
        asyncio.run(async_router_reads(server))
        view = FleetView(router).start()
        view.sync(["node-a", "node-b"])
        assert view.counts.paged_loads == 1  # node-a's; node-b's by the script
        assert view.score([A1, A2, A3])["node-a"].kv_prefix == 2
        assert view.score([A1, A2, A3])["node-b"].kv_prefix == 1
        time.sleep(0.01)  # past the health-check interval: the next call PINGs first
        assert "node-a" in NodeIndex(router).live()

        assert refusals(admin, "router") == []
        assert role_used(admin) == granted("router")

        # The view follows node-a's writes (PSUBSCRIBE to every namespace's changes).
        node_a.register_kv([3], [A3])
        wait_until(lambda: view.score([A1, A2, A3])["node-a"].kv_prefix == 3, what="A3 seen")
        dead = make_dead(admin, "dead-r")
        before = [snapshot(admin, node_a), snapshot(admin, dead)]
        refused_router_writes(router, node_a)
        assert [snapshot(admin, node_a), snapshot(admin, dead)] == before
        assert refusals(admin, "router")  # each refusal was logged
    finally:
        if view is not None:
            view.close()
        router.close()


async def async_router_reads(server: RedisServer) -> None:
    """``pcr serve`` and ``pcr gateway``'s router: score and the engine table."""
    import redis.asyncio as aredis

    from registry.routing.aio_routing import AsyncPrefixRouter

    client = aredis.Redis.from_url(url_for(server, "router"))
    try:
        scores = await AsyncPrefixRouter(client, live_cache_ttl=0.0).score([A1, A2])
        assert scores["node-a"].kv_prefix == 2
        assert (await AsyncPrefixRouter(client).engines())["node-a"] == "http://10.0.0.7:8000"
    finally:
        await client.aclose()


def refused_router_writes(router: redis.Redis, node_a: PrefixCacheRegistry) -> None:
    k = node_a.keys
    as_router = PrefixCacheRegistry(router, "node-a")
    attempts: dict[str, Callable[[], object]] = {
        "register_kv": lambda: as_router.register_kv([9], [A4]),
        "evict_kv": lambda: as_router.evict_kv([A1]),
        "claim": as_router.claim,
        "HSET": lambda: router.hset(k.kv, str(A4), "9"),
        "HDEL": lambda: router.hdel(k.kv, str(A1)),
        "UNLINK": lambda: router.unlink(k.kv),
        "ZADD": lambda: router.zadd(NODE_INDEX, {"node-a": 1}),
        "ZREM": lambda: router.zrem(NODE_INDEX, "node-a"),
        "PUBLISH": lambda: router.publish(k.changes_channel, "node-a x 1 forged"),
        "gc": lambda: collect_dead(router),
    }
    for name, attempt in attempts.items():
        with pytest.raises((ResponseError, RegistryPermissionError)) as refused:
            attempt()
        assert denied(refused.value), f"{name}: {refused.value!r}"
    # A writing function runs only the commands the router holds; no Lua of its own.
    keys = (k.reply_prefix + "r-1", k.kv, k.meta)
    with pytest.raises(ResponseError) as refused:
        command(router, "FCALL", function_name("clear_kv"), 3, *keys, "", "r-1", 30_000)
    assert refused_in_script(refused.value)
    assert_admin_only_refused(router)


BRIDGED = ("engine-0", "engine-1")  # the namespaces bridge.acl is written for
BS = 4


def bridge_session(client: redis.Redis, admin: redis.Redis, rounds: list[str]) -> list[int]:
    """Run ``pcr bridge``'s ``Bridge`` as ``client`` for the two engines of bridge.acl:
    each round starts a bridge, has each engine store a 4-block prompt and remove its
    last block, and stops it (a second round resumes the namespaces: ``bridge_resume``,
    the picture read back with HSCAN). Returns the namespaces' ``resumed`` counts."""
    zmq = pytest.importorskip("zmq")
    pytest.importorskip("msgpack")
    from registry.bridge.bridge import Bridge, EngineSource
    from registry.core.hashing import block_hashes
    from sim.engine_events import EnginePublisher, engine_chain, prompt, removed, stored
    from tests.support.waiting import wait_until

    resumed = []
    engines = [EnginePublisher() for _ in BRIDGED]
    try:
        for engine in engines:
            engine.pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription is passed up
        sources = [
            EngineSource(
                namespace,
                engine.endpoint,
                block_size=BS,
                replay_endpoint=engine.replay_endpoint,
                engine_url=f"http://10.0.0.{i + 1}:8000",
            )
            for i, (namespace, engine) in enumerate(zip(BRIDGED, engines, strict=True))
        ]
        for seed, _round in enumerate(rounds, 1):
            with Bridge(client, sources) as bridge:
                assert bridge.wait_ready(30.0), (bridge.error, bridge.counts())
                for engine in engines:
                    subscribed(engine)
                for namespace, engine in zip(BRIDGED, engines, strict=True):
                    tokens = prompt(seed, 4, BS)
                    chain = engine_chain(tokens, BS)
                    engine.publish([stored(chain, None, tokens, BS)])
                    seq = engine.publish([removed(chain[3:])])
                    meta = PrefixCacheRegistry(admin, namespace).keys.meta
                    wait_until(
                        lambda m=meta, s=seq: admin.hget(m, "bridge_seq") == str(s).encode(),
                        what=f"{namespace} applied through {seq}",
                    )
                    own = block_hashes(tokens, BS)
                    ids, _last = PrefixCacheRegistry(admin, namespace).match_kv_prefix(own)
                    assert ids == [0, 1, 2]
                assert bridge.error is None
                resumed = [bridge.counts()[n]["resumed"] for n in BRIDGED]
    finally:
        for engine in engines:
            engine.close()
    return resumed


def subscribed(engine: Any, timeout: float = 30.0) -> None:
    """Until a subscription reached the engine's XPUB socket."""
    zmq = pytest.importorskip("zmq")
    while True:
        if not engine.pub.poll(round(timeout * 1000), zmq.POLLIN):
            raise TimeoutError("no subscriber connected")
        if engine.pub.recv()[:1] == b"\x01":
            return


def test_the_bridge_writes_its_engines_namespaces_only(
    server: RedisServer, admin: redis.Redis, connect: Connect
) -> None:
    """``bridge.acl``: ``pcr bridge`` for engine-0 and engine-1 claims, writes, renews,
    announces the engines' URLs and resumes after a restart with exactly the granted
    commands; it reaches no other namespace and nothing of an admin's."""
    for namespace in BRIDGED:  # whatever ran before: the first round claims afresh
        admin.unlink(*PrefixCacheRegistry(admin, namespace).keys.all_keys())
    admin.config_resetstat()
    client = login(server, "bridge", health_check_interval=0.001)
    try:
        assert bridge_session(client, admin, ["claims", "resumes"]) == [1, 1]
        assert refusals(admin, "bridge") == []
        assert role_used(admin) == granted("bridge") | {"zadd"}  # the index selector's
        assert admin.hget("pcr:engines", "engine-1") == b"http://10.0.0.2:8000"
        live = live_nodes(admin)
        assert set(BRIDGED) <= set(live)

        node_a = connect("node-a")
        node_a.claim(lease_ttl=60.0)
        node_a.register_kv([1], [A1])
        before = snapshot(admin, node_a)
        others = PrefixCacheRegistry(client, "node-a")
        attempts: dict[str, Callable[[], object]] = {
            "claim node-a": others.claim,
            "register_kv node-a": lambda: others.register_kv([2], [A2]),
            "claim engine-2": PrefixCacheRegistry(client, "engine-2").claim,
            "HGET node-a": lambda: client.hget(node_a.keys.meta, "epoch"),
            "PUBLISH node-a": lambda: client.publish(node_a.keys.mamba_evicted_channel, "1 clear"),
            "XREVRANGE": lambda: client.xrevrange(node_a.keys.mamba_evictions),
        }
        for name, attempt in attempts.items():
            with pytest.raises((ResponseError, RegistryPermissionError)) as refused:
                attempt()
            assert denied(refused.value), f"{name}: {refused.value!r}"
        assert_admin_only_refused(client)
        assert snapshot(admin, node_a) == before
    finally:
        client.close()


def test_gc_deletes_dead_namespaces_and_writes_nothing(
    server: RedisServer, admin: redis.Redis, connect: Connect
) -> None:
    """``gc.acl``: ``pcr gc`` (the invalid members, then ``collect_dead``) and its dry
    run work with exactly the granted commands; gc cannot write an entry, announce a
    lease or send a node an eviction notice."""
    from registry import NodeIndex

    node_a = connect("node-a")
    node_a.claim(lease_ttl=60.0)
    node_a.register_kv([1], [A1])
    dead = make_dead(admin, "dead-gc")
    admin.zadd(NODE_INDEX, {"not a namespace": 1})
    admin.config_resetstat()
    client = login(server, "gc", health_check_interval=0.001)
    try:
        index = NodeIndex(client)
        assert "dead-gc" in index.dead()
        assert index.invalid() == ["not a namespace"]
        assert index.remove_invalid() == ["not a namespace"]
        time.sleep(0.01)  # past the health-check interval: the next call PINGs first
        assert "dead-gc" in index.collect_dead()
        assert refusals(admin, "gc") == []
        assert role_used(admin) == granted("gc")
        assert [admin.exists(key) for key in dead.keys.all_keys()] == [0] * 5
        assert admin.zscore(NODE_INDEX, "dead-gc") is None
        assert node_a.match_kv_prefix([A1]) == ([1], A1)  # the live namespace stays

        before = snapshot(admin, node_a)
        as_gc = PrefixCacheRegistry(client, "node-a")
        attempts: dict[str, Callable[[], object]] = {
            "register_kv": lambda: as_gc.register_kv([2], [A2]),
            "claim": as_gc.claim,
            "HSET": lambda: client.hset(node_a.keys.kv, str(A2), "2"),
            "ZADD": lambda: client.zadd(NODE_INDEX, {"node-a": 1}),
            "PUBLISH notice": lambda: client.publish(node_a.keys.mamba_evicted_channel, "1 clear"),
            "SUBSCRIBE": lambda: command(client, "SUBSCRIBE", node_a.keys.changes_channel),
        }
        for name, attempt in attempts.items():
            with pytest.raises((ResponseError, RegistryPermissionError)) as refused:
                attempt()
            assert denied(refused.value), f"{name}: {refused.value!r}"
        assert_admin_only_refused(client)
        assert snapshot(admin, node_a) == before
    finally:
        client.close()


GATEWAY_NAMES = ("gw-a", "gw-b")  # the backends' namespaces


def test_the_gateway_routes_and_shares_its_load_and_writes_nothing_else(
    server: RedisServer, admin: redis.Redis, connect: Connect
) -> None:
    """``gateway.acl``: ``pcr gateway`` as the gateway user, once following the fleet in
    a view (one namespace large enough to be loaded in pages, ``HSCAN``) and once
    scoring in Redis (``--no-view``: ``score.lua``), routes each prompt to the engine
    that caches it and shares its load with other replicas (``gateway_load.lua``, which
    also drops an expired replica's entry), with exactly the granted commands; its keys
    are read-only but for the load table and the node index's scripts."""
    pytest.importorskip("fastapi")
    pytest.importorskip("aiohttp")
    from registry import block_hashes
    from registry.fleet.snapshots import PAGED_ABOVE
    from tests.support.fake_engine import FakeEngine
    from tests.support.serving import ServeProcess

    prompt = list(range(10, 43))  # 8 whole blocks of 4
    for name in GATEWAY_NAMES:
        owner = PrefixCacheRegistry(admin, name)
        owner.claim(lease_ttl=120.0)
        if name == "gw-b":
            hashes = block_hashes(prompt, 4)
            owner.register_kv(list(range(len(hashes))), hashes)
    large = PrefixCacheRegistry(admin, "gw-large")
    large.claim(lease_ttl=120.0)
    large.register_kv(list(range(PAGED_ABOVE + 1)), list(range(1, PAGED_ABOVE + 2)))
    admin.hset("pcr:gateway:load", "gone-replica", "1 {}")  # expired in 1970
    admin.config_resetstat()

    engines = [FakeEngine("a").start(), FakeEngine("b").start()]
    try:
        for extra in ([], ["--no-view"]):
            args = ["--redis-url", url_for(server, "gateway"), "--block-size", "4", *extra]
            for name, engine in zip(GATEWAY_NAMES, engines, strict=True):
                args += ["--backend", f"{name}={engine.url}"]
            proc = ServeProcess(*args, path="/health", command="gateway").start()
            try:
                for _ in range(3):
                    reply = httpx_post(
                        f"{proc.base}/v1/completions", {"model": "tiny", "prompt": prompt}
                    )
                    assert reply["by"] == "b", extra
            finally:
                proc.stop()
    finally:
        for engine in engines:
            engine.stop()
    assert refusals(admin, "gateway") == []
    # PING is redis-py's health check of a connection idle for 30 s (the services'
    # pools), which a run this short does not reach (test_ping_is_needed_... shows it).
    assert role_used(admin) | {"ping"} == granted("gateway")
    assert admin.hget("pcr:gateway:load", "gone-replica") is None

    client = login(server, "gateway")
    try:
        node_a = connect("node-a")
        node_a.claim(lease_ttl=60.0)
        node_a.register_kv([1], [A1])
        before = snapshot(admin, node_a)
        k = node_a.keys
        as_gateway = PrefixCacheRegistry(client, "node-a")
        attempts: dict[str, Callable[[], object]] = {
            "register_kv": lambda: as_gateway.register_kv([2], [A2]),
            "claim": as_gateway.claim,
            "HSET": lambda: client.hset(k.kv, str(A2), "2"),
            "HDEL": lambda: client.hdel(k.kv, str(A1)),
            "ZADD": lambda: client.zadd(NODE_INDEX, {"node-a": 1}),
            "PUBLISH notice": lambda: client.publish(k.mamba_evicted_channel, "1 clear"),
        }
        for name, attempt in attempts.items():
            with pytest.raises((ResponseError, RegistryPermissionError)) as refused:
                attempt()
            assert denied(refused.value), f"{name}: {refused.value!r}"
        assert_admin_only_refused(client)
        assert snapshot(admin, node_a) == before
    finally:
        client.close()


def httpx_post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    import httpx

    reply = httpx.post(url, json=body, timeout=30)
    assert reply.status_code == 200, reply.text
    answer: dict[str, Any] = reply.json()
    return answer


# -- without pcr setup: the scripts by EVALSHA -------------------------------------------


def scripts_rules(rules: list[str], keep_fcall: bool) -> list[str]:
    """A recipe's rules with ``+evalsha +script|load`` added, ``+evalsha`` in each
    selector too (and ``+fcall`` dropped unless ``keep_fcall``: the recipe from before
    Redis Functions)."""
    out = []
    for rule in rules:
        if rule == "+fcall" and not keep_fcall:
            continue
        if rule.startswith("("):
            words = [w for w in rule[1:-1].split() if keep_fcall or w != "+fcall"]
            rule = "(" + " ".join([*words, "+evalsha"]) + ")"
        out.append(rule)
    return [*out, "+evalsha", "+script|load"]


@pytest.mark.parametrize("keep_fcall", [True, False], ids=["with-fcall", "scripts-only"])
def test_without_setup_a_user_granted_evalsha_runs_the_scripts(keep_fcall: bool) -> None:
    """A server that never ran ``pcr setup``: a node user that may also run EVALSHA and
    SCRIPT LOAD does everything a serving node does, by EVALSHA. With ``+fcall`` kept,
    the first call's FCALL is answered "Function not found" (no refusal); with the
    recipe from before Functions it is refused once, and logged, per runner."""
    require_redis_server()
    with RedisServer() as bare:
        admin = bare.client()
        try:
            rules = scripts_rules(acl_rules("node-a"), keep_fcall)
            assert command(admin, "ACL", "SETUSER", "node-a", *rules) in OK
            registry = PrefixCacheRegistry.from_url(url_for(bare, "node-a"), "node-a")
            try:
                registry.claim(lease_ttl=30.0)
                registry.register_kv([1, 2], [A1, A2])
                registry.register_mamba([2], [A2])
                assert registry.evict_kv([A2]) == {A2}
                assert registry.match_kv_prefix([A1, A2]) == ([1], A1)
                registry.renew()
            finally:
                raw(registry).close()
            assert "node-a" in live_nodes(admin)  # announced by EVALSHA too
            stats = used_commands(admin)
            assert stats["evalsha"]["calls"] >= 5
            assert stats["script|load"]["calls"] >= 1
            refused = {entry["object"] for entry in refusals(admin, "node-a")}
            assert refused == (set() if keep_fcall else {"fcall"})
        finally:
            admin.close()


def test_without_setup_an_fcall_only_user_is_told_to_run_it() -> None:
    """The node recipe (``+fcall``, no EVALSHA) on a server without the library: a write
    fails with a permission error that names ``pcr setup`` and changes nothing; once an
    admin has run ``pcr setup``, the same registry object works."""
    require_redis_server()
    with RedisServer() as bare:
        add_users(bare)
        admin = bare.client()
        registry = PrefixCacheRegistry.from_url(url_for(bare, "node-a"), "node-a")
        try:
            with pytest.raises(RegistryPermissionError, match="pcr setup") as refused:
                registry.claim(lease_ttl=30.0)
            assert library_name() in str(refused.value)
            assert admin.keys("*") == []
            assert pcr_setup(bare)[0] == 0
            registry.claim(lease_ttl=30.0)
            registry.register_kv([1], [A1])
            assert registry.match_kv_prefix([A1]) == ([1], A1)
        finally:
            raw(registry).close()
            admin.close()
