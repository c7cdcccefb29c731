"""Entry quotas on a real redis-server, as an operator runs them: node users logged in
with the documented recipe (``docs/acl/node.acl``) write under their quota, are refused
past it, and cannot raise it, by any command their recipe grants or through the
registry's own scripts; the bridge user likewise; ``pcr bridge`` keeps following an
engine whose namespace is full, writing its removals and counting the blocks it drops;
``pcr quota`` sets, shows and clears limits.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.exceptions import ResponseError

from pcr.cli.main import main
from registry import PrefixCacheRegistry, RegistryPermissionError, RegistryQuotaExceeded
from registry.core.hashing import block_hashes
from registry.core.keys import NamespaceKeys
from registry.namespace.quota import set_quota
from registry.transport.scripts import ScriptRunner
from tests.support import REPO_ROOT
from tests.support.backends import dump_keys, new_namespace
from tests.support.servers import HOST, RedisServer, require_redis_server

pytestmark = pytest.mark.redis_server

RECIPES = REPO_ROOT / "docs" / "acl"
PASSWORDS = {"node-a": "node-a-Pw-1Qa", "node-b": "node-b-Pw-2Qb", "bridge": "bridge-Pw-3Qc"}
H = [5_000_000 + i for i in range(20)]


def rules(role: str, name: str, user: str) -> list[str]:
    """``docs/acl/<role>.acl`` as ``ACL SETUSER <user>`` arguments: the example name
    ``name`` replaced by ``user``, the password filled in, a selector ``(...)`` kept as
    one argument."""
    (line,) = (RECIPES / f"{role}.acl").read_text().splitlines()
    words: list[str] = []
    for word in line.split()[2:]:
        if words and words[-1].startswith("(") and not words[-1].endswith(")"):
            words[-1] += " " + word
        else:
            words.append(word)
    return [
        f">{PASSWORDS[user]}" if word == ">PASSWORD" else word.replace(name, user) for word in words
    ]


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    """A redis-server of this module's own with node-a, node-b and the bridge (for
    engine-0 and engine-1) as the recipes make them, and the registry's scripts in the
    form the recipes run them (the Functions library, loaded as ``pcr setup`` does,
    where a recipe grants ``FCALL`` and no ``EVALSHA``)."""
    require_redis_server()
    with RedisServer() as started:
        admin = started.client()
        try:
            for user in ("node-a", "node-b"):
                admin.execute_command("ACL", "SETUSER", user, *rules("node", "node-a", user))
            admin.execute_command("ACL", "SETUSER", "bridge", *rules("bridge", "bridge", "bridge"))
            node = rules("node", "node-a", "node-a")
            if "+fcall" in node and "+evalsha" not in node:
                from registry.transport.functions import load_library

                load_library(admin)
        finally:
            admin.close()
        yield started


@pytest.fixture
def admin(server: RedisServer) -> Iterator[redis.Redis]:
    client = server.client()
    yield client
    client.close()


def login(server: RedisServer, user: str) -> redis.Redis:
    return redis.Redis.from_url(f"redis://{user}:{PASSWORDS[user]}@{HOST}:{server.port}/0")


@pytest.fixture
def node_a(server: RedisServer, admin: redis.Redis) -> Iterator[PrefixCacheRegistry]:
    """node-a's registry, logged in as node-a, claimed, with a quota of 3 entries."""
    for key in (*NamespaceKeys("node-a").all_keys(), NamespaceKeys("node-a").quota):
        admin.unlink(key)
    client = login(server, "node-a")
    registry = PrefixCacheRegistry(client, "node-a")
    registry.claim(60.0)
    set_quota(admin, "node-a", 3)
    yield registry
    client.close()


def test_a_node_writes_under_its_quota_and_is_refused_past_it(
    node_a: PrefixCacheRegistry, server: RedisServer, admin: redis.Redis
) -> None:
    node_a.register_kv([1, 2], H[:2])
    node_a.register_mamba([2], H[1:2])
    as_admin = PrefixCacheRegistry(admin, "node-a")
    before = dump_keys(as_admin)
    with pytest.raises(RegistryQuotaExceeded) as refused:
        node_a.register_kv([3], H[2:3])
    assert (refused.value.namespace, refused.value.held, refused.value.limit) == ("node-a", 3, 3)
    assert dump_keys(as_admin) == before
    # node-b, with no quota of its own, is unaffected.
    client = login(server, "node-b")
    try:
        node_b = PrefixCacheRegistry(client, "node-b")
        node_b.claim(60.0)
        node_b.register_kv(list(range(10)), H[:10])
        assert node_b.match_kv_prefix(H[:10])[1] == H[9]
    finally:
        client.close()


def test_a_node_cannot_raise_its_own_quota(
    node_a: PrefixCacheRegistry, server: RedisServer, admin: redis.Redis
) -> None:
    """Every write command node-a's recipe grants, on its quota key, is refused, and so
    is a registry script told to record its reply there (where no limit is set yet, so
    it would create one); node-a may read its limit, node-b may not."""
    client = node_a.client
    assert isinstance(client, redis.Redis)
    quota = node_a.keys.quota
    attempts: list[tuple[Any, ...]] = [
        ("SET", quota, "1000000"),
        ("UNLINK", quota),
        ("HSET", quota, "x", "1"),
        ("HDEL", quota, "x"),
        ("HINCRBY", quota, "x", "1"),
        ("XADD", quota, "*", "x", "1"),
        ("ZADD", quota, "1", "x"),
        ("ZREM", quota, "x"),
        ("DEL", quota),
        ("INCRBY", quota, "1000"),
    ]
    for command in attempts:
        with pytest.raises(ResponseError) as refused:
            client.execute_command(*command)
        assert "NOPERM" in str(refused.value) or "no permissions" in str(refused.value), command
    assert client.get(quota) == b"3"
    other = login(server, "node-b")
    try:
        with pytest.raises(ResponseError, match=r"(?i)noperm|no permissions"):
            other.get(quota)
    finally:
        other.close()

    admin.unlink(quota)
    keys, args = node_a.write_args("register_kv", node_a._register_kv_keys, False, (1, H[0]))
    with pytest.raises(RegistryPermissionError):  # its SET of the reply record, refused
        ScriptRunner(client).run("register_kv", (quota, *keys[1:]), args, namespace="node-a")
    assert admin.exists(quota) == 0


def test_the_bridge_user_cannot_raise_its_engines_quotas(
    server: RedisServer, admin: redis.Redis
) -> None:
    client = login(server, "bridge")
    try:
        for namespace in ("engine-0", "engine-1"):
            set_quota(admin, namespace, 5)
            quota = NamespaceKeys(namespace).quota
            for command in (("SET", quota, "9"), ("UNLINK", quota), ("HSET", quota, "x", "1")):
                with pytest.raises(ResponseError, match=r"(?i)noperm|no permissions"):
                    client.execute_command(*command)
            assert admin.get(quota) == b"5"
        with pytest.raises(RegistryPermissionError):  # and it sets none for itself
            set_quota(client, "engine-0", 9)
    finally:
        client.close()


# -- pcr bridge under its quota ---------------------------------------------------------------

BS = 4


class Engine:
    """An engine's sequence numbers, as its publisher keeps them."""

    def __init__(self) -> None:
        self.seq = 0

    def publish(self, events: list[Any]) -> list[bytes]:
        from sim.engine_events import batch

        self.seq += 1
        return [b"", (self.seq - 1).to_bytes(8, "big"), batch(events)]


def test_the_bridge_keeps_following_a_full_namespace(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Stores past the quota are dropped and counted, logged once with the namespace;
    the removals of the same batch are written; the follower never blocks, and stores
    are listed again once removals made room. Another engine's namespace is untouched."""
    pytest.importorskip("msgpack")
    pytest.importorskip("zmq")  # sim.engine_events
    from registry.bridge.bridge import EngineSource, Follower
    from sim.engine_events import engine_chain, prompt, removed, stored

    client = redis_server.client()
    try:
        namespace, other = new_namespace(), new_namespace()
        set_quota(client, namespace, 4)
        followers = {}
        for name in (namespace, other):
            followers[name] = Follower(
                PrefixCacheRegistry(client, name),
                EngineSource(name, "tcp://127.0.0.1:5557", block_size=BS),
            )
            followers[name].start()
        f, engine = followers[namespace], Engine()
        tokens = prompt(1, 8, BS)
        hashes = engine_chain(tokens, BS)
        own = block_hashes(tokens, BS)
        listed = PrefixCacheRegistry(client, namespace)

        f.offer([engine.publish([stored(hashes[:3], None, tokens[: 3 * BS], BS)])])
        with caplog.at_level(logging.WARNING, logger="registry.bridge.bridge"):
            f.offer([engine.publish([stored(hashes[3:6], hashes[2], tokens[3 * BS : 6 * BS], BS)])])
        assert listed.match_kv_prefix(own)[0] == [0, 1, 2]
        assert (f.counts.quota_refusals, f.counts.quota_refused_blocks) == (1, 3)
        assert not f.blocked
        warned = [r.getMessage() for r in caplog.records if "quota" in r.getMessage()]
        assert len(warned) == 1, warned
        assert namespace in warned[0]

        # One batch removing two blocks and storing two: 3 - 2 + 2 fits, all of it goes
        # in (blocks 6 and 7 chain from block 5, which the engine holds).
        f.offer([engine.publish([
            removed(hashes[1:3]), stored(hashes[6:8], hashes[5], tokens[6 * BS :], BS)
        ])])  # fmt: skip
        assert set(listed.entries()[0]) == {own[0], own[6], own[7]}
        assert f.counts.quota_refusals == 1
        # Storing two more does not fit (5): dropped, counted, logged again.
        f.offer([engine.publish([stored(hashes[1:3], hashes[0], tokens[BS : 3 * BS], BS)])])
        assert (f.counts.quota_refusals, f.counts.quota_refused_blocks) == (2, 5)
        assert set(listed.entries()[0]) == {own[0], own[6], own[7]}
        assert int(client.hget(listed.keys.meta, "bridge_seq") or 0) == engine.seq - 1

        g, other_engine = followers[other], Engine()
        g.offer([other_engine.publish([stored(hashes, None, tokens, BS)])])
        assert len(PrefixCacheRegistry(client, other).entries()[0]) == 8
        assert g.counts.quota_refusals == 0
    finally:
        client.close()


# -- pcr quota ---------------------------------------------------------------------------------


def test_pcr_quota_sets_shows_and_clears(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    client = redis_server.client()
    try:
        prefix = f"q{new_namespace()[2:10]}"
        registry = PrefixCacheRegistry(client, "node-q", key_prefix=prefix)
        registry.claim(60.0)
        registry.register_kv([1, 2, 3], H[:3])
        url = ["--redis-url", redis_server.url, "--key-prefix", prefix]

        assert main(["quota", "set", "node-q", "2", *url]) == 0
        out, err = capsys.readouterr()
        assert out == "node-q: limit 2 entries (holds 3)\n"
        assert err.count("\n") == 1
        assert "holds more than its new limit" in err
        with pytest.raises(RegistryQuotaExceeded):
            registry.register_kv([4], H[3:4])

        assert main(["quota", "show", *url, "--json"]) == 0
        (row,) = json.loads(capsys.readouterr().out)
        assert row == {
            "namespace": "node-q",
            "entries": 3,
            "engine_blocks": 0,
            "limit": 2,
            "over": True,
        }
        assert main(["quota", "show", "node-q", "node-z", *url]) == 0
        table = capsys.readouterr().out
        assert "node-q" in table
        assert "node-z" in table

        assert main(["quota", "clear", "node-q", *url]) == 0
        assert capsys.readouterr().out == "node-q: no limit\n"
        registry.register_kv([4], H[3:4])
        assert main(["quota", "clear", "node-q", *url]) == 0
        assert capsys.readouterr().out == "node-q: no limit (it had none)\n"

        for bad in (["quota", "set", "node-q", "-1"], ["quota", "set", "no{de", "5"]):
            assert main([*bad, *url]) == 2
            assert capsys.readouterr().err.count("\n") == 1
    finally:
        client.close()


def test_pcr_quota_as_a_node_user_is_one_line(
    server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"redis://node-a:{PASSWORDS['node-a']}@{HOST}:{server.port}/0"
    assert main(["quota", "set", "node-a", "999", "--redis-url", url]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("pcr quota: error: ")
    assert "lacks a command, key or channel" in err
