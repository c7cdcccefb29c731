"""Bad input at scale: every public method fed random arguments (wrong types, ranges,
lengths, huge lists, unicode) raises only ValueError or TypeError, and when it raises,
the Redis data is byte-for-byte unchanged (DUMP)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from registry import PrefixCacheRegistry, PrefixRouter
from tests.support.backends import Backend, dump_keys, make_backend

GOOD_HASHES = [1, 2, 3, 2**63 - 1]
scalar = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([-1, 0, 1, 2, 3, 2**63 - 1, 2**63, -2]),
    st.none(),
    st.booleans(),
    st.floats(allow_nan=True),
    st.text(max_size=5),
    st.binary(max_size=5),
    st.builds(object),
)
int_lists = st.lists(scalar, max_size=8)
argument = st.one_of(
    int_lists,
    scalar,
    st.text(max_size=10),
    st.dictionaries(st.integers(), st.integers(), max_size=3),
)
namespaces = st.text(min_size=0, max_size=12)

CALLS: dict[str, tuple[int, Callable[..., Any]]] = {
    "match_kv_prefix": (1, lambda r, a: r.match_kv_prefix(a[0])),
    "register_kv": (2, lambda r, a: r.register_kv(a[0], a[1])),
    "evict_kv": (1, lambda r, a: r.evict_kv(a[0])),
    "match_mamba_farthest": (1, lambda r, a: r.match_mamba_farthest(a[0])),
    "find_mamba_backoff": (2, lambda r, a: r.find_mamba_backoff(a[0], a[1])),
    "register_mamba": (2, lambda r, a: r.register_mamba(a[0], a[1])),
    "evict_mamba": (1, lambda r, a: r.evict_mamba(a[0])),
    "set_mamba_evict_callback": (1, lambda r, a: r.set_mamba_evict_callback(a[0])),
    "mamba_block_ids": (1, lambda r, a: r.mamba_block_ids(a[0])),
    "claim": (1, lambda r, a: r.claim(a[0])),
    "score": (2, lambda r, a: PrefixRouter(r.client).score(a[0], a[1])),
}


def fuzz(backend: Backend, method: str, examples: int) -> None:
    arity, call = CALLS[method]
    reg = backend.registry()
    assert isinstance(reg, PrefixCacheRegistry)
    reg.register_kv([1, 2, 3, 4], GOOD_HASHES)
    reg.register_mamba([2], GOOD_HASHES[1:2])

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck))
    @given(args=st.tuples(*[argument] * arity))
    def check(args: tuple[Any, ...]) -> None:
        before = dump_keys(reg)
        try:
            call(reg, args)
        except (ValueError, TypeError) as exc:
            assert str(exc)  # noqa: PT017 - a message that says what was wrong
            assert dump_keys(reg) == before, f"{method}{args!r} changed data and raised"

    check()


@pytest.mark.parametrize("method", sorted(CALLS))
@pytest.mark.parametrize(("backend_name", "examples"), [("fakeredis", 80), ("redis", 60)])
def test_random_arguments_fail_cleanly(
    method: str, backend_name: str, examples: int, request: pytest.FixtureRequest
) -> None:
    backend = make_backend(backend_name, request)
    try:
        fuzz(backend, method, examples)
    finally:
        backend.close()


@pytest.mark.parametrize(
    "call",
    [
        lambda r, big: r.register_kv(list(range(len(big))), big),
        lambda r, big: r.match_kv_prefix(big),
        lambda r, big: r.evict_kv(big),
        lambda r, big: r.register_mamba(list(range(len(big))), big),
        lambda r, big: r.find_mamba_backoff(big, 10),
    ],
)
@pytest.mark.parametrize("bad", [2**63, -5, 1.5, "7", None, True])
def test_one_bad_item_at_the_end_of_a_huge_list(
    redis_backend: Backend, call: Any, bad: Any
) -> None:
    reg = redis_backend.registry()
    assert isinstance(reg, PrefixCacheRegistry)
    reg.register_kv([1, 2], GOOD_HASHES[:2])
    before = dump_keys(reg)
    big: list[Any] = list(range(1, 100_000))
    big.append(bad)
    with pytest.raises((ValueError, TypeError), match=r"\[99999\]"):
        call(reg, big)
    assert dump_keys(reg) == before


@given(namespace=namespaces)
@settings(max_examples=300, deadline=None)
def test_any_namespace_is_accepted_or_refused_cleanly(namespace: str) -> None:
    import fakeredis

    client = fakeredis.FakeRedis()
    try:
        reg = PrefixCacheRegistry(client, namespace)
    except ValueError as exc:
        assert "namespace" in str(exc)  # noqa: PT017 - accepted or refused, both fine
        return
    reg.register_kv([1], [5])
    assert reg.match_kv_prefix([5]) == ([1], 5)
    keys = {k.decode() for k in client.keys("*")}
    assert all(reg.keys.owns(key) for key in keys), keys
    assert reg.keys.kv.encode("utf-8").count(b"{") == 1
