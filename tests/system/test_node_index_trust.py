"""The shared node index ``pcr:nodes`` is only a hint: no node user can take another node
out of routing, or put a namespace of its own making into it (issue 43).

Any node user may ``ZADD`` any member of the index (ACLs control keys, not members). So
readers (``NodeIndex.live``, the routers, the fleet view, ``pcr gc``) call a member live
only while the lease in its own ``meta`` runs, which only its owner writes; and the node
recipe grants the index through an ACL selector, ``(~pcr:nodes +evalsha +zadd)``, so no
node user's delete command covers it. Checked on a real redis-server with the users of
``docs/acl`` (node-a, node-b, the router, gc and the bridge):

* node-a pushing node-b's score to 0 and adding forged members moves no routing decision
  of ``PrefixRouter``, ``AsyncPrefixRouter`` or a fleet view's router; forged members are
  never listed live; ``pcr gc`` removes them and keeps node-b;
* every command that could remove a member or the index is refused to node and bridge
  users, directly and inside a script of their own;
* a node still claims, renews and announces with only its recipe, and under ``maxmemory``
  (where the index refuses the new score) stays live;
* on every Redis backend (a Cluster's metas in other slots than the index), a flood of
  forged members costs a reader a bounded number of meta reads per listing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import fakeredis
import pytest
import redis
from redis.exceptions import ResponseError

from registry import (
    NodeIndex,
    PrefixCacheRegistry,
    PrefixRouter,
    RegistryPermissionError,
    collect_dead,
    live_nodes,
)
from registry.core.keys import node_index_key
from registry.core.validation import text
from registry.fleet.view import FleetView
from registry.routing.aio_routing import AsyncPrefixRouter
from registry.transport.client import async_client_from_url
from registry.transport.scripts import is_cluster
from tests.support import REPO_ROOT
from tests.support.backends import REDIS_BACKEND_PARAMS, Backend, new_namespace
from tests.support.servers import HOST, RedisServer, require_redis_server
from tests.support.waiting import wait_until

INDEX = node_index_key()  # "pcr:nodes"
PASSWORDS = {
    "node-a": "node-a-Pw-1Nx",
    "node-b": "node-b-Pw-6Qe",
    "router": "router-Pw-9Hs",
    "gc": "gc-Pw-4Tb",
    "bridge": "bridge-Pw-2Jc",
}
RECIPES = REPO_ROOT / "docs" / "acl"
INDEX_COMMANDS = ("+zadd",)
"""All a node or bridge user is granted on the index besides running the scripts:
announcing. Nothing that removes a member or the key."""
INDEX_ONLY = {"+zscore", "+zadd", "+zrem", "+zrangebyscore"}
"""Commands the recipes granted only for the index before it was a selector's."""

CHAINS = 24
DEPTH = 8
# Who holds what: chains 0-11 are node-b's deepest (6 blocks), node-a holds 3 blocks of
# chains 0-5, node-c 2 of chains 6-17, node-d 4 of chains 12-17; chains 18-23 nobody
# (chosen by load, then name). Ghost names sort before every real one.
HOLDINGS = {
    "node-a": (range(0, 6), 3),
    "node-b": (range(0, 12), 6),
    "node-c": (range(6, 18), 2),
    "node-d": (range(12, 18), 4),
}
GHOSTS = [f"a-ghost-{i:02d}" for i in range(40)]


def chain(j: int) -> list[int]:
    return [1_000 * (j + 1) + k for k in range(1, DEPTH + 1)]


def recipe_tokens(role: str) -> tuple[str, list[str]]:
    """The user and rules of ``docs/acl/<role>.acl``: one ``user`` line in aclfile form,
    a selector ``(...)`` as one rule."""
    (line,) = (RECIPES / f"{role}.acl").read_text().splitlines()
    _keyword, name, *tokens = line.split()
    rules: list[str] = []
    for token in tokens:
        if rules and rules[-1].startswith("(") and not rules[-1].endswith(")"):
            rules[-1] += " " + token
        else:
            rules.append(token)
    return name, rules


def index_selector(rules: list[str]) -> str:
    """The selector granting the index, running the scripts the way the recipe does
    (``+evalsha`` for scripts, ``+fcall`` for the Functions library, or both)."""
    runs = [r for r in ("+evalsha", "+fcall") if r in rules]
    return f"(~{INDEX} {' '.join([*runs, *INDEX_COMMANDS])})"


def recipe(role: str, user: str | None = None) -> list[str]:
    """``ACL SETUSER`` rules of ``docs/acl/<role>.acl`` for ``user`` (node.acl is written
    for node-a), with the test's password. A node's or the bridge's index grant is the
    one this module tests (``index_selector``), whatever the file says of the index."""
    name, rules = recipe_tokens(role)
    user = user or name
    rules = [
        f">{PASSWORDS[user]}" if rule == ">PASSWORD" else rule.replace("node-a", user)
        for rule in rules
    ]
    if role in ("node", "bridge"):
        rules = [
            r
            for r in rules
            if r != f"~{INDEX}" and r not in INDEX_ONLY and not r.startswith(f"(~{INDEX} ")
        ]
        rules.append(index_selector(rules))
    return rules


def test_the_node_and_bridge_recipes_grant_the_index_by_this_selector_alone() -> None:
    """docs/acl says what this module tests: the index in no root key pattern of a node
    or bridge user (so their UNLINK, DEL, HSET never reach it), and on it the scripts
    and ZADD alone."""
    for role in ("node", "bridge"):
        _name, rules = recipe_tokens(role)
        root = [r for r in rules if not r.startswith("(")]
        assert f"~{INDEX}" not in root, role
        assert not INDEX_ONLY & set(root), role
        assert [r for r in rules if INDEX in r] == [index_selector(root)], role


def url_for(server: RedisServer, user: str) -> str:
    return f"redis://{user}:{PASSWORDS[user]}@{HOST}:{server.port}/0"


def command(client: Any, *args: Any) -> Any:
    return client.execute_command(*args)


def refused(exc: BaseException) -> bool:
    """Refused by the ACL: NOPERM at the top level (redis-py's NoPermissionError), or
    Redis 7.0's "The user executing the script can't" inside a script."""
    if isinstance(exc, RegistryPermissionError):
        exc = exc.__cause__ or exc
    text = str(exc)
    return (
        isinstance(exc, redis.exceptions.NoPermissionError)
        or "NOPERM" in text
        or "no permissions" in text
        or "The user executing the script can't" in text
    )


def refusals(admin: redis.Redis, user: str) -> list[dict[str, str]]:
    """The ACL LOG's refusals of ``user`` (less redis-py's ignored handshake extras)."""
    entries = []
    for entry in command(admin, "ACL", "LOG", 128):
        fields = {k.decode(): v.decode() if isinstance(v, bytes) else v for k, v in entry.items()}
        if fields["username"] == user and not fields["object"].startswith("client|"):
            entries.append(fields)
    return entries


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    """A redis-server of this module's own with the users of docs/acl: node-a and node-b
    (node.acl), router, gc and bridge."""
    require_redis_server()
    with RedisServer() as started:
        admin = started.client()
        try:
            for user in ("node-a", "node-b"):
                command(admin, "ACL", "SETUSER", user, *recipe("node", user))
            for role in ("router", "gc", "bridge"):
                command(admin, "ACL", "SETUSER", role, *recipe(role))
            if any("+fcall" in recipe(role) for role in ("node", "router", "gc", "bridge")):
                from registry.transport import functions  # type: ignore[attr-defined]

                functions.load_library(admin)  # what `pcr setup` does
        finally:
            admin.close()
        yield started


@pytest.fixture
def admin(server: RedisServer) -> Iterator[redis.Redis]:
    """The unrestricted user, on an empty keyspace and an empty ACL LOG."""
    client = server.client()
    client.flushall()
    command(client, "ACL", "LOG", "RESET")
    yield client
    client.close()


@pytest.fixture
def login(server: RedisServer) -> Iterator[Callable[[str], redis.Redis]]:
    """``login(user)``: a client logged in as ``user``, closed after the test."""
    made: list[redis.Redis] = []

    def make(user: str) -> redis.Redis:
        client = redis.Redis.from_url(url_for(server, user))
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


def fleet(admin: redis.Redis, login: Callable[[str], redis.Redis]) -> dict[str, Any]:
    """node-a and node-b claimed by their own users, node-c and node-d by the admin,
    each holding its part of ``HOLDINGS`` (written by the admin, as an operator: what
    the entries are matters here, not who wrote them)."""
    owners = {}
    for name, (chains, depth) in HOLDINGS.items():
        client = login(name) if name in ("node-a", "node-b") else admin
        owner = PrefixCacheRegistry(client, name)
        owner.claim(lease_ttl=120.0)
        operator = PrefixCacheRegistry(admin, name)
        for j in chains:
            operator.register_kv(range(100 * j, 100 * j + depth), chain(j)[:depth])
        owners[name] = owner
    return owners


def decisions(router: PrefixRouter) -> list[str | None]:
    return [router.best(chain(j)) for j in range(CHAINS)]


async def async_decisions(url: str) -> tuple[list[str | None], list[str]]:
    client = async_client_from_url(url)
    try:
        router = AsyncPrefixRouter(client, live_cache_ttl=0.0)
        chosen = [await router.best(chain(j)) for j in range(CHAINS)]
        return chosen, await router.live_nodes()
    finally:
        await client.aclose()


def attack(node_a: redis.Redis) -> None:
    """What node-a's recipe lets it do to the index: push node-b's score to 0 and add
    members nobody claimed, far in the future and at 0."""
    assert command(node_a, "ZADD", INDEX, 0, "node-b") == 0  # moved, not added
    far = int(time.time() * 1000) + 10**9
    node_a.zadd(INDEX, {ghost: far for ghost in GHOSTS[:30]})
    node_a.zadd(INDEX, {ghost: 0 for ghost in GHOSTS[30:]})


def test_a_node_cannot_take_another_out_of_routing_or_forge_a_live_one(
    server: RedisServer, admin: redis.Redis, login: Callable[[str], redis.Redis]
) -> None:
    fleet(admin, login)
    router_client = login("router")
    exact = PrefixRouter(router_client, live_cache_ttl=0.0)
    view = FleetView(router_client).start()
    try:
        viewed = PrefixRouter(router_client, view=view)
        view.sync()
        before = decisions(exact)
        assert before[0] == "node-b"
        assert before[18] == "node-a"
        assert decisions(viewed) == before
        async_before, _live = asyncio.run(async_decisions(url_for(server, "router")))
        assert async_before == before

        attack(login("node-a"))
        view.sync()
        assert decisions(exact) == before
        assert decisions(viewed) == before
        async_after, async_live = asyncio.run(async_decisions(url_for(server, "router")))
        assert async_after == before
        expected = sorted(HOLDINGS)
        assert sorted(live_nodes(router_client)) == expected
        assert sorted(async_live) == expected
        assert view.live_nodes() == expected
        index = NodeIndex(router_client)
        assert sorted(index.dead()) == sorted(GHOSTS)
        assert index.leases.not_live == len(GHOSTS)  # what `pcr stats` lists as "no lease"
    finally:
        view.close()

    # gc (its own user) removes the members without a live lease, and keeps node-b's.
    assert sorted(collect_dead(login("gc"))) == sorted(GHOSTS)
    assert sorted(map(text, admin.zrange(INDEX, 0, -1))) == sorted(HOLDINGS)
    assert admin.zscore(INDEX, "node-b") == 0
    assert admin.exists(PrefixCacheRegistry(admin, "node-b").keys.kv) == 1
    assert refusals(admin, "router") == []
    assert refusals(admin, "gc") == []


EVIL_LIBRARY = """#!lua name=evil
redis.register_function('drop', function(keys) return redis.call('DEL', keys[1]) end)
"""


def test_node_and_bridge_users_cannot_remove_a_member_or_the_index(
    admin: redis.Redis, login: Callable[[str], redis.Redis]
) -> None:
    owners = fleet(admin, login)
    admin.set("elsewhere", "x")
    before = admin.dump(INDEX)
    for user in ("node-a", "bridge"):
        client = login(user)
        own = "pcr:{node-a}:scratch" if user == "node-a" else "pcr:{engine-0}:scratch"
        attempts: list[tuple[Any, ...]] = [
            ("ZREM", INDEX, "node-b"),
            ("UNLINK", INDEX),
            ("DEL", INDEX),
            ("ZREMRANGEBYSCORE", INDEX, "-inf", "+inf"),
            ("ZREMRANGEBYRANK", INDEX, 0, -1),
            ("ZREMRANGEBYLEX", INDEX, "-", "+"),
            ("ZPOPMIN", INDEX, 100),
            ("ZPOPMAX", INDEX, 100),
            ("BZPOPMIN", INDEX, 0.01),
            ("RENAME", INDEX, own),
            ("EXPIRE", INDEX, 1),
            ("PEXPIREAT", INDEX, 1),
            ("ZUNIONSTORE", INDEX, 1, own),
            ("ZINTERSTORE", INDEX, 1, own),
            ("ZDIFFSTORE", INDEX, 1, own),
            ("ZRANGESTORE", INDEX, own, 0, 0),
            ("COPY", own, INDEX, "REPLACE"),
            ("SET", INDEX, "x"),
            ("GETDEL", INDEX),
            ("RESTORE", INDEX, 0, before, "REPLACE"),
            ("MOVE", INDEX, 1),
            ("EVAL", "return redis.call('DEL', KEYS[1])", 1, INDEX),
            ("FUNCTION", "LOAD", EVIL_LIBRARY),
        ]
        for args in attempts:
            with pytest.raises(ResponseError) as caught:
                command(client, *args)
            assert refused(caught.value), f"{user} {args}: {caught.value!r}"
        if "+script|load" not in recipe("node" if user == "node-a" else "bridge"):
            continue
        # A script of its own, loaded and run with the index among its keys: what it
        # calls is checked against the same rules.
        for body in (
            "return redis.call('ZREM', KEYS[1], 'node-b')",
            "return redis.call('UNLINK', KEYS[1])",
            "return redis.call('ZPOPMIN', KEYS[1], 100)",
        ):
            sha = client.script_load(body)
            with pytest.raises(ResponseError) as caught:
                client.evalsha(sha, 1, INDEX)
            assert refused(caught.value), f"{user} {body}: {caught.value!r}"
    assert admin.dump(INDEX) == before
    assert admin.get("elsewhere") == b"x"
    assert owners["node-b"].match_kv_prefix(chain(0)) == (list(range(6)), chain(0)[5])


def test_a_node_claims_renews_and_announces_with_its_recipe_alone(
    admin: redis.Redis, login: Callable[[str], redis.Redis]
) -> None:
    node_a = PrefixCacheRegistry(login("node-a"), "node-a")
    epoch = node_a.claim(lease_ttl=30.0)
    first = admin.zscore(INDEX, "node-a")
    assert first == int(admin.hget(node_a.keys.meta, "lease_until") or 0)
    admin.zadd(INDEX, {"node-a": 0})  # pushed back by someone: the next renewal restores it
    lease_end = node_a.renew()
    assert admin.zscore(INDEX, "node-a") == round(lease_end * 1000) >= first
    node_a.announce(1)  # an older lease end moves nothing
    assert admin.zscore(INDEX, "node-a") == round(lease_end * 1000)
    with node_a.start_heartbeat(0.01):
        wait_until(
            lambda: (admin.zscore(INDEX, "node-a") or 0) > round(lease_end * 1000),
            what="a heartbeat's renewal announced",
        )
    assert node_a.epoch == epoch
    assert live_nodes(login("router")) == ["node-a"]
    assert refusals(admin, "node-a") == []
    bridge = PrefixCacheRegistry(login("bridge"), "engine-0")
    bridge.claim(lease_ttl=30.0)
    bridge.renew()
    assert sorted(live_nodes(login("router"))) == ["engine-0", "node-a"]
    assert refusals(admin, "bridge") == []


@pytest.mark.redis_server
def test_a_node_pushed_back_stays_live_under_maxmemory() -> None:
    """Over ``maxmemory`` the index refuses a renewal's new score (ZADD is its first
    write); the lease in meta still moves (HDEL first), and readers go by it: a node
    pushed to 0 there stays live, before and after its renewal."""
    require_redis_server()
    with RedisServer(["--maxmemory-policy", "noeviction"]) as server:
        admin = server.client()
        try:
            node_b = PrefixCacheRegistry(server.client(), "node-b")
            node_b.claim(lease_ttl=60.0)
            reader = NodeIndex(server.client())
            assert reader.live() == ["node-b"]
            admin.zadd(INDEX, {"node-b": 0})
            admin.set("filler", "x" * 1_000_000)
            admin.config_set("maxmemory", int(admin.info("memory")["used_memory"]) - 100_000)
            with pytest.raises(redis.exceptions.OutOfMemoryError):
                admin.set("more", "x")
            assert reader.live() == ["node-b"]
            assert NodeIndex(server.client()).live() == ["node-b"]
            lease_end = node_b.renew()
            assert lease_end > time.time()
            assert int(admin.hget(node_b.keys.meta, "lease_until") or 0) == round(lease_end * 1000)
            assert NodeIndex(server.client()).live() == ["node-b"]
        finally:
            admin.config_set("maxmemory", 0)
            admin.close()


@pytest.mark.parametrize("redis_backend", REDIS_BACKEND_PARAMS, indirect=True)
def test_a_flood_of_forged_members_costs_a_reader_bounded_reads_and_gc_removes_it(
    redis_backend: Backend,
) -> None:
    """2,500 members nobody claimed, far in the future, beside two live namespaces, one
    of them pushed to 0 (on a Cluster each meta in another slot than the index): a fresh
    reader reads at most ``max_checks`` metas per listing, nearest the server's clock
    first (node-a at once, node-b, at 0, last), never lists a forged one, and once it has
    read every member reads none again while no score moves; gc removes the flood."""
    prefix = f"fl{new_namespace()[2:10]}"
    admin = redis_backend.client()
    owners = [redis_backend.registry(n, key_prefix=prefix) for n in ("node-a", "node-b")]
    for owner in owners:
        assert isinstance(owner, PrefixCacheRegistry)
        owner.claim(lease_ttl=120.0)
    key = node_index_key(prefix)
    admin.zadd(key, {"node-b": 0})
    far = int(time.time() * 1000) + 10**9
    flood = [f"forged-{i:04d}" for i in range(2_500)]
    for first in range(0, len(flood), 500):
        admin.zadd(key, {name: far + i for i, name in enumerate(flood[first : first + 500])})
    index = NodeIndex(redis_backend.client(), prefix)
    index.leases.max_checks = 1_000
    reads, listed = [], []
    for _ in range(4):
        before = index.leases.checks
        listed.append(sorted(index.live()))
        reads.append(index.leases.checks - before)
    assert reads == [1_000, 1_000, 502, 0]
    assert listed == [["node-a"], ["node-a"], ["node-a", "node-b"], ["node-a", "node-b"]]
    assert index.leases.not_live == len(flood)

    assert asyncio.run(async_live(redis_backend, prefix)) == ["node-a", "node-b"]
    assert sorted(collect_dead(admin, prefix)) == flood
    assert sorted(live_nodes(admin, prefix)) == ["node-a", "node-b"]
    assert admin.zcard(key) == 2


async def async_live(backend: Backend, prefix: str) -> list[str]:
    """``AsyncPrefixRouter.live_nodes`` on the backend's server (fakeredis: its asyncio
    twin on the same server; a cluster: redis.asyncio's cluster client)."""
    client = backend.client()
    kwargs = client.connection_pool.connection_kwargs if hasattr(client, "connection_pool") else {}
    aclient: Any
    if "server" in kwargs:
        aclient = fakeredis.FakeAsyncRedis(server=kwargs["server"])
    elif is_cluster(client):
        node = client.get_default_node()
        aclient = async_client_from_url(f"redis+cluster://{node.host}:{node.port}/0")
    else:
        aclient = async_client_from_url(f"redis://{kwargs['host']}:{kwargs['port']}/0")
    try:
        return sorted(await AsyncPrefixRouter(aclient, prefix, live_cache_ttl=0.0).live_nodes())
    finally:
        await aclient.aclose()
