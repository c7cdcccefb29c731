"""The compatibility policy (CHANGELOG.md): a renamed public name keeps working for one
minor release with a ``DeprecationWarning`` that names the new spelling, and a keyword
``from_url`` does not know fails with a ``TypeError`` naming the registry's parameters
before anything reaches redis-py."""

from __future__ import annotations

import subprocess
import sys
import time
import warnings

import pytest

import registry
from pcr.bench.servers import RedisServer
from registry import MirroredRegistry, NodeIndex, PrefixCacheRegistry, collect_dead
from registry.transport.options import redis_client_options


def test_registry_gc_is_collect_dead_with_a_warning_naming_it() -> None:
    with pytest.warns(DeprecationWarning, match=r"registry\.collect_dead"):
        gc = registry.gc
    assert gc is collect_dead


def test_from_registry_import_gc_still_works_in_a_fresh_interpreter() -> None:
    code = (
        "import warnings; warnings.simplefilter('error')\n"
        "try:\n    from registry import gc\n"
        "except DeprecationWarning as e:\n    print('warned:', e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert "warned: registry.gc is deprecated" in out
    assert "collect_dead" in out


def test_an_unknown_module_attribute_is_still_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'garbage'"):
        registry.garbage  # noqa: B018


def test_node_index_gc_warns_and_collects(redis_server: RedisServer) -> None:
    client = redis_server.client()
    prefix = "compat-gc"
    owner = PrefixCacheRegistry(client, "dead-ns", key_prefix=prefix)
    owner.claim(0.05)
    owner.register_kv([1], [11])
    index = NodeIndex(client, prefix)
    deadline = 30.0
    start = time.monotonic()
    while "dead-ns" in index.live() and time.monotonic() - start < deadline:
        time.sleep(0.05)
    with pytest.warns(DeprecationWarning, match=r"NodeIndex\.collect_dead"):
        removed = index.gc()
    assert removed == ["dead-ns"]
    assert not client.exists(owner.keys.kv)


def test_from_url_mirror_true_builds_the_mirror_with_a_warning(redis_server: RedisServer) -> None:
    with pytest.warns(DeprecationWarning, match=r"MirroredRegistry\.from_url"):
        reg = PrefixCacheRegistry.from_url(
            redis_server.url, "compat-mirror", mirror=True, max_delay=0.01, key_prefix="compat"
        )
    try:
        assert isinstance(reg, MirroredRegistry)
        assert reg.inner.keys.key_prefix == "compat"
        reg.claim()
        reg.register_kv([1, 2], [21, 22])
        reg.flush()
        assert redis_server.client().hlen(reg.inner.keys.kv) == 2
    finally:
        reg.close()


def test_from_url_mirror_false_warns_and_builds_the_plain_registry(
    redis_server: RedisServer,
) -> None:
    with pytest.warns(DeprecationWarning, match="mirror"):
        reg = PrefixCacheRegistry.from_url(redis_server.url, "compat-plain", mirror=False)
    assert type(reg) is PrefixCacheRegistry


@pytest.mark.parametrize("caller", [PrefixCacheRegistry, MirroredRegistry])
def test_an_unknown_keyword_names_the_registry_before_connecting(caller: type) -> None:
    # Port 1 never answers: a TypeError here proves nothing was attempted.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(TypeError) as raised:
            caller.from_url("redis://127.0.0.1:1", "ns", key_prefx="typo")
    message = str(raised.value)
    assert f"{caller.__name__}.from_url()" in message
    assert "'key_prefx'" in message
    assert "key_prefix" in message  # the registry's own parameter, named
    assert "AbstractConnection" not in message


def test_redis_py_options_still_pass(redis_server: RedisServer) -> None:
    reg = PrefixCacheRegistry.from_url(
        redis_server.url,
        "compat-opts",
        decode_responses=True,
        socket_keepalive=True,
        client_name="compat",
        health_check_interval=5,
    )
    reg.register_kv([3], [31])
    assert reg.match_kv_prefix([31]) == ([3], 31)


def test_the_accepted_options_come_from_redis_py_itself() -> None:
    names = redis_client_options()
    for known in ("password", "decode_responses", "ssl_certfile", "read_from_replicas", "path"):
        assert known in names
    for unknown in ("mirror", "key_prefx", "self", "kwargs"):
        assert unknown not in names


def test_pcr_main_is_pcr_cli_main_with_a_warning_naming_it() -> None:
    """The command line's entry point moved to ``pcr.cli.main`` (issue 40); code that
    imports ``pcr.main`` keeps working for one minor release, warned."""
    code = (
        "import warnings; warnings.simplefilter('error')\n"
        "try:\n    import pcr.main\n"
        "except DeprecationWarning as e:\n    print('warned:', e)\n"
        "warnings.simplefilter('ignore')\n"
        "import pcr.main, pcr.cli.main\n"
        "print('same:', pcr.main.main is pcr.cli.main.main)\n"
        "print('parser:', pcr.main.build_parser().prog)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert "warned: pcr.main is deprecated: use pcr.cli.main" in out
    assert "same: True" in out
    assert "parser: pcr" in out
