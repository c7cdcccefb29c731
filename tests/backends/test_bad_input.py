"""Bad input fails with a clear TypeError/ValueError before anything reaches Redis."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from registry import LocalPrefixCacheRegistry, PrefixCacheRegistry, RegistryBase
from tests.support.backends import Backend, dump_keys, registry_state

H = [1111, 2222, 3333]
TOO_BIG = 2**63

# (description, call, expected exception)
BAD_CALLS: list[tuple[str, Callable[[RegistryBase], Any], type[Exception]]] = [
    ("register_kv lengths differ", lambda r: r.register_kv([1, 2], [H[0]]), ValueError),
    ("register_kv ids missing", lambda r: r.register_kv([], H), ValueError),
    ("register_kv hash 0", lambda r: r.register_kv([1], [0]), ValueError),
    ("register_kv hash -1", lambda r: r.register_kv([1], [-1]), ValueError),
    ("register_kv hash 2^63", lambda r: r.register_kv([1], [TOO_BIG]), ValueError),
    ("register_kv negative id", lambda r: r.register_kv([-1], [H[0]]), ValueError),
    ("register_kv bool id", lambda r: r.register_kv([True], [H[0]]), TypeError),
    ("register_kv bool hash", lambda r: r.register_kv([1], [True]), TypeError),
    ("register_kv float hash", lambda r: r.register_kv([1], [1.0]), TypeError),
    ("register_kv str hash", lambda r: r.register_kv([1], ["1"]), TypeError),
    ("register_kv None hash", lambda r: r.register_kv([1], [None]), TypeError),
    ("register_kv hashes None", lambda r: r.register_kv([1], None), TypeError),
    ("register_kv hashes str", lambda r: r.register_kv([1], "1"), TypeError),
    ("register_kv late bad item", lambda r: r.register_kv([1, 2, 3], [*H[:2], 1.5]), TypeError),
    ("register_mamba lengths", lambda r: r.register_mamba([1], H), ValueError),
    ("register_mamba hash -2", lambda r: r.register_mamba([1], [-2]), ValueError),
    ("register_mamba huge id", lambda r: r.register_mamba([TOO_BIG], [H[0]]), ValueError),
    ("register_mamba float id", lambda r: r.register_mamba([1.0], [H[0]]), TypeError),
    ("match_kv_prefix str item", lambda r: r.match_kv_prefix([H[0], "x"]), TypeError),
    ("match_kv_prefix -2", lambda r: r.match_kv_prefix([H[0], -2]), ValueError),
    ("match_kv_prefix None", lambda r: r.match_kv_prefix(None), TypeError),
    ("match_kv_prefix int", lambda r: r.match_kv_prefix(5), TypeError),
    ("evict_kv 2^63", lambda r: r.evict_kv([H[0], TOO_BIG]), ValueError),
    ("evict_kv bytes", lambda r: r.evict_kv(b"\x01"), TypeError),
    ("evict_kv bool", lambda r: r.evict_kv([False]), TypeError),
    ("evict_mamba float", lambda r: r.evict_mamba([H[0], 2.5]), TypeError),
    ("evict_mamba -7", lambda r: r.evict_mamba([-7]), ValueError),
    ("match_mamba_farthest None item", lambda r: r.match_mamba_farthest([None]), TypeError),
    ("find_mamba_backoff float len", lambda r: r.find_mamba_backoff(H, 1.0), TypeError),
    ("find_mamba_backoff bool len", lambda r: r.find_mamba_backoff(H, True), TypeError),
    ("find_mamba_backoff bad hash", lambda r: r.find_mamba_backoff([TOO_BIG], 1), ValueError),
    ("callback not callable", lambda r: r.set_mamba_evict_callback(5), TypeError),  # type: ignore[arg-type]
]


@pytest.mark.parametrize(
    ("call", "error"), [(c, e) for _, c, e in BAD_CALLS], ids=[d for d, _, _ in BAD_CALLS]
)
def test_bad_arguments_raise_and_change_nothing(
    backend: Backend,
    call: Callable[[RegistryBase], Any],
    error: type[Exception],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reg = backend.registry()
    reg.register_kv([1, 2], H[:2])
    reg.register_mamba([2], H[1:2])
    before_state = registry_state(reg)
    if isinstance(reg, PrefixCacheRegistry):
        before_dump = dump_keys(reg)

        def no_round_trip(*args: object, **kwargs: object) -> None:
            raise AssertionError("bad input reached Redis")

        monkeypatch.setattr(reg, "run_write", no_round_trip)
        monkeypatch.setattr(reg, "_read", no_round_trip)
    with pytest.raises(error) as info:
        call(reg)
    assert str(info.value)  # the message says what was wrong
    monkeypatch.undo()
    assert registry_state(reg) == before_state
    if isinstance(reg, PrefixCacheRegistry):
        assert dump_keys(reg) == before_dump


def test_numpy_integers_are_accepted(backend: Backend) -> None:
    np = pytest.importorskip("numpy")
    reg = backend.registry()
    hashes = np.array(H, dtype=np.int64)
    reg.register_kv(np.arange(3, dtype=np.int32), hashes)
    assert reg.match_kv_prefix(hashes) == ([0, 1, 2], H[2])
    assert reg.evict_kv(hashes[:1]) == {H[0]}
    assert reg.find_mamba_backoff(list(hashes), np.int64(2)) == 0


@pytest.mark.parametrize(
    "namespace",
    ["", "a{b", "a}b", "a b", "tab\there", "new\nline", "x" * 201, "nul\x00"],
)
def test_bad_namespace(namespace: str) -> None:
    import fakeredis

    with pytest.raises(ValueError, match="namespace"):
        PrefixCacheRegistry(fakeredis.FakeRedis(), namespace)


@pytest.mark.parametrize("namespace", [None, 5, b"node"])
def test_namespace_must_be_str(namespace: object) -> None:
    import fakeredis

    with pytest.raises(TypeError, match="namespace"):
        PrefixCacheRegistry(fakeredis.FakeRedis(), namespace)  # type: ignore[arg-type]


def test_unicode_namespace_is_fine() -> None:
    import fakeredis

    client = fakeredis.FakeRedis()
    reg = PrefixCacheRegistry(client, "nœud-ü-节点")
    reg.register_kv([1], H[:1])
    assert reg.match_kv_prefix(H) == ([1], H[0])
    assert client.hgetall("pcr:{nœud-ü-节点}:kv") == {b"1111": b"1"}


def test_bad_key_prefix_and_options() -> None:
    import fakeredis

    client = fakeredis.FakeRedis()
    with pytest.raises(ValueError, match="key_prefix"):
        PrefixCacheRegistry(client, "n", key_prefix="a{")
    with pytest.raises(ValueError, match="notice_stream_maxlen"):
        PrefixCacheRegistry(client, "n", notice_stream_maxlen=0)
    with pytest.raises(TypeError, match="client"):
        PrefixCacheRegistry(object(), "n")  # type: ignore[arg-type]


def test_local_registry_validates_the_same_way() -> None:
    reg = LocalPrefixCacheRegistry()
    with pytest.raises(ValueError, match="differ in length"):
        reg.register_kv([1, 2], [H[0]])
    assert reg.kv == {}
