"""The read API tools use instead of raw keys: entries, info, memory, scan pages."""

from __future__ import annotations

from registry import PrefixCacheRegistry
from tests.support.backends import Backend, expire_lease


def test_entries_info_and_scan_describe_the_namespace(redis_backend: Backend) -> None:
    reg = redis_backend.registry()
    assert isinstance(reg, PrefixCacheRegistry)
    before = reg.info()
    assert (before.kv_entries, before.mamba_entries, before.epoch) == (0, 0, None)
    assert (before.state, before.lease_left_s, before.notice_seq) == ("no lease", None, 0)
    epoch = reg.claim(lease_ttl=60)
    reg.register_kv(range(600), range(1, 601))
    reg.register_mamba([5, 6], [6, 7])
    assert reg.entries() == ({h: h - 1 for h in range(1, 601)}, {6: 5, 7: 6})
    info = reg.info()
    assert (info.kv_entries, info.mamba_entries, info.epoch) == (600, 2, epoch)
    assert info.state == "live"
    assert info.lease_left_s is not None
    assert 0 < info.lease_left_s <= 60
    assert (info.incarnation, info.notice_seq) == reg.notice_position()
    expire_lease(reg)
    assert reg.info().state == "dead"
    memory = reg.memory_bytes()
    if redis_backend.name == "fakeredis":
        assert memory is None
    else:
        assert memory is not None
        assert memory > 0
    seen: list[tuple[int, int]] = []
    cursor = 0
    while True:
        cursor, page = reg.scan_entries("kv", cursor, count=100)
        seen.extend(page)
        if cursor == 0:
            break
    assert sorted(set(seen)) == [(h, h - 1) for h in range(1, 601)]
    assert reg.scan_entries("mamba") == (0, [(6, 5), (7, 6)])
