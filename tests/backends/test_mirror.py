"""The mirrored owner (``registry.mirror``): the same answers as the in-process reference,
and, once flushed, the same Redis state, notices and numbers as the mirror, on fakeredis,
a real server and a real cluster; exclusive ownership; fencing; threads; the pool."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from registry import (
    EvictionNotice,
    LocalPrefixCacheRegistry,
    MirroredRegistry,
    NamespaceMirrored,
    PrefixCacheRegistry,
    StaleEpochError,
)
from registry.core.types import NoticeKind
from registry.mirror import CALL_VALUES, CALL_WRITES, DEFAULT_MAX_DELAY, MirrorCounts
from registry.transport.scripts import script_sha
from tests.support.backends import (
    REDIS_BACKEND_PARAMS,
    Backend,
    expire_lease,
    make_backend,
    new_namespace,
    registry_state,
)
from tests.support.waiting import wait_until

POOL = [1, 2, 3, 4, 5, 6, 7, 2**53, 2**53 + 1, 2**62 + 3, 2**63 - 2, 2**63 - 1]
real_hashes = st.sampled_from(POOL)
any_hashes = st.one_of(real_hashes, st.sampled_from([-1, 0]))
block_ids = st.integers(min_value=0, max_value=12)


def mirrored(backend: Backend, namespace: str | None = None, **options: Any) -> MirroredRegistry:
    """A claimed mirrored owner on a fresh namespace of ``backend``."""
    mirror = MirroredRegistry(backend.client(), namespace or new_namespace(), **options)
    mirror.claim()
    return mirror


def redis_view(mirror: MirroredRegistry) -> tuple[dict[int, int], dict[int, int]]:
    """The namespace's maps as Redis holds them (after ``flush()``)."""
    return registry_state(mirror.inner)


def assert_redis_matches(mirror: MirroredRegistry) -> None:
    mirror.flush()
    assert redis_view(mirror) == mirror.entries()
    assert mirror.inner.notice_position() == mirror.notice_position()


@pytest.fixture
def mirrors() -> Iterator[list[MirroredRegistry]]:
    """Mirrors made by a test, closed after it (no flusher thread outlives a test)."""
    made: list[MirroredRegistry] = []
    yield made
    for mirror in made:
        mirror.close()
    for mirror in made:
        assert mirror._flusher.thread is None or not mirror._flusher.thread.is_alive()


def machine_for(backend: Backend, *, held: bool = False) -> type[RuleBasedStateMachine]:
    """The differential machine; ``held``: the flusher stopped, so every write between two
    ``flush()`` rules reaches Redis in one batch (runs of writes in one script call)."""

    class MirrorComparison(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.model = LocalPrefixCacheRegistry()
            self.real = MirroredRegistry(backend.client(), new_namespace())
            claimed: list[EvictionNotice] = []
            self.real.add_eviction_hook(claimed.append)
            self.real.claim()
            self.real.remove_eviction_hook(claimed.append)
            if held:
                self.real.stop_flusher()
            self.base = claimed[0].seq  # the claim's clear: the mirror counts on from it
            self.model_fired: list[list[int]] = []
            self.real_fired: list[list[int]] = []
            self.model.set_mamba_evict_callback(self.model_fired.append)
            self.real.set_mamba_evict_callback(self.real_fired.append)
            self.model_notices: list[EvictionNotice] = []
            self.real_notices: list[EvictionNotice] = []
            self.model.add_eviction_hook(self.model_notices.append)
            self.real.add_eviction_hook(self.real_notices.append)

        def teardown(self) -> None:
            try:
                self.flushed_redis_matches()
            finally:
                self.real.close()

        @rule(hashes=st.lists(any_hashes, max_size=8))
        def match_kv_prefix(self, hashes: list[int]) -> None:
            assert self.real.match_kv_prefix(hashes) == self.model.match_kv_prefix(hashes)

        @rule(pairs=st.lists(st.tuples(block_ids, real_hashes), max_size=6))
        def register_kv(self, pairs: list[tuple[int, int]]) -> None:
            ids, hashes = [p[0] for p in pairs], [p[1] for p in pairs]
            self.real.register_kv(ids, hashes)
            self.model.register_kv(ids, hashes)

        @rule(hashes=st.lists(any_hashes, max_size=6))
        def evict_kv(self, hashes: list[int]) -> None:
            assert self.real.evict_kv(hashes) == self.model.evict_kv(hashes)

        @rule(hashes=st.lists(any_hashes, max_size=8))
        def match_mamba_farthest(self, hashes: list[int]) -> None:
            assert self.real.match_mamba_farthest(hashes) == self.model.match_mamba_farthest(hashes)

        @rule(hashes=st.lists(any_hashes, max_size=8), search_len=st.integers(-2, 10))
        def find_mamba_backoff(self, hashes: list[int], search_len: int) -> None:
            assert self.real.find_mamba_backoff(hashes, search_len) == (
                self.model.find_mamba_backoff(hashes, search_len)
            )

        @rule(pairs=st.lists(st.tuples(block_ids, any_hashes), max_size=6))
        def register_mamba(self, pairs: list[tuple[int, int]]) -> None:
            ids, hashes = [p[0] for p in pairs], [p[1] for p in pairs]
            real_stamp = self.real.register_mamba_stamped(ids, hashes)
            model_stamp = self.model.register_mamba_stamped(ids, hashes)
            assert (real_stamp and real_stamp - self.base) == model_stamp

        @rule(hashes=st.lists(any_hashes, max_size=8))
        def mamba_block_ids(self, hashes: list[int]) -> None:
            assert self.real.mamba_block_ids(hashes) == self.model.mamba_block_ids(hashes)

        @rule(hashes=st.lists(any_hashes, max_size=6))
        def evict_mamba(self, hashes: list[int]) -> None:
            assert self.real.evict_mamba(hashes) == self.model.evict_mamba(hashes)

        @rule()
        def clear_kv(self) -> None:
            self.real.clear_kv()
            self.model.clear_kv()

        @rule()
        def clear_mamba(self) -> None:
            self.real.clear_mamba()
            self.model.clear_mamba()

        @rule()
        def reset(self) -> None:
            self.real.reset()
            self.model.reset()

        @rule()
        def views(self) -> None:
            assert dict(self.real.kv_hash_to_block_id) == self.model.kv
            assert dict(self.real.mamba_hash_to_block_id) == self.model.mamba
            assert len(self.real.kv_hash_to_block_id) == len(self.model.kv)

        @rule()
        def flushed_redis_matches(self) -> None:
            """Redis after ``flush()``: the mirror's maps, its notice number, and in the
            stream exactly the notices the hooks got, numbered alike."""
            self.real.flush()
            assert redis_view(self.real) == registry_state(self.model)
            assert self.real.inner.notice_position() == self.real.notice_position()
            published = self.real.inner.notices_after(self.base)
            assert published is not None
            assert [(n.seq, n.kind, n.pairs) for n in published] == [
                (n.seq, n.kind, n.pairs) for n in self.real_notices
            ]

        @invariant()
        def same_answers_callbacks_and_notices(self) -> None:
            assert self.real.entries() == registry_state(self.model)
            assert self.real_fired == self.model_fired
            assert [(n.seq - self.base, n.kind, n.pairs) for n in self.real_notices] == [
                (n.seq, n.kind, n.pairs) for n in self.model_notices
            ]
            assert self.real.notice_sequence() - self.base == self.model.notice_sequence()

    return MirrorComparison


@pytest.mark.parametrize("backend_name", REDIS_BACKEND_PARAMS)
def test_the_mirror_matches_the_reference_and_redis_matches_the_mirror(
    backend_name: str, request: pytest.FixtureRequest
) -> None:
    backend = make_backend(backend_name, request)
    try:
        run_state_machine_as_test(
            machine_for(backend),
            settings=settings(
                max_examples=25 if backend_name == "fakeredis" else 12,
                stateful_step_count=30,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )
    finally:
        backend.close()


@pytest.mark.parametrize("backend_name", REDIS_BACKEND_PARAMS)
def test_writes_batched_into_one_call_match_the_reference_and_its_notices(
    backend_name: str, request: pytest.FixtureRequest
) -> None:
    """The same machine with the flusher held: each flush sends every write since the
    last as ``mirror_apply`` runs, so Redis's maps and notices (numbers, kinds, pairs)
    must equal those of the writes applied one by one."""
    backend = make_backend(backend_name, request)
    try:
        run_state_machine_as_test(
            machine_for(backend, held=True),
            settings=settings(
                max_examples=25 if backend_name == "fakeredis" else 10,
                stateful_step_count=40,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )
    finally:
        backend.close()


# -- the API ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", REDIS_BACKEND_PARAMS[1:])
def test_from_url_returns_the_mirrored_owner(
    kind: str, mirrors: list[MirroredRegistry], request: pytest.FixtureRequest
) -> None:
    servers = request.getfixturevalue("redis_cluster" if kind == "cluster" else "redis_server")
    url = servers.url
    mirror = MirroredRegistry.from_url(
        url, new_namespace(), max_batch=7, owner="node-x", cluster=kind == "cluster"
    )
    mirrors.append(mirror)
    assert isinstance(mirror, MirroredRegistry)
    assert (mirror.max_batch, mirror.owner, mirror.max_delay) == (7, "node-x", DEFAULT_MAX_DELAY)
    mirror.claim()
    mirror.register_kv([1, 2], [11, 12])
    assert mirror.kv_hash_to_block_id[12] == 2
    assert_redis_matches(mirror)


def test_writes_need_a_claim_and_reads_answer_before(redis_backend: Backend) -> None:
    mirror = MirroredRegistry(redis_backend.client(), new_namespace())
    try:
        assert mirror.match_kv_prefix([1, 2]) == ([], 0)
        with pytest.raises(RuntimeError, match="claim"):
            mirror.register_kv([1], [1])
        assert mirror.counts() == MirrorCounts(0, 0, 0, 0, 0, 0, 0, 0.0, 0.0, False)
    finally:
        mirror.close()


def test_bad_options_fail_before_anything(redis_backend: Backend) -> None:
    client = redis_backend.client()
    with pytest.raises(ValueError, match="max_queue"):
        MirroredRegistry(client, new_namespace(), max_queue=0)
    with pytest.raises(TypeError, match="max_delay"):
        MirroredRegistry(client, new_namespace(), max_delay="1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="owner label"):
        MirroredRegistry(client, new_namespace(), owner="two\nlines")


def test_the_flusher_sends_without_being_asked(
    redis_backend: Backend, mirrors: list[MirroredRegistry]
) -> None:
    mirror = mirrored(redis_backend)
    mirrors.append(mirror)
    mirror.register_kv([1, 2, 3], [11, 12, 13])
    wait_until(lambda: mirror.counts().flushed >= 1, what="the write-behind")
    assert redis_view(mirror)[0] == {11: 1, 12: 2, 13: 3}
    counts = mirror.counts()
    assert (counts.flushed >= 1, counts.batches >= 1, counts.queued) == (True, True, 0)


def test_batches_are_bounded_and_in_order(
    redis_backend: Backend, mirrors: list[MirroredRegistry]
) -> None:
    mirror = mirrored(redis_backend, max_batch=4)
    mirrors.append(mirror)
    mirror.stop_flusher()
    for i in range(10):  # the same hash moves on: only the order gives the last id
        mirror.register_kv([i], [5])
        mirror.register_mamba([i], [5])
    assert mirror.counts().queued == 20
    mirror.flush()
    counts = mirror.counts()
    assert (counts.flushed, counts.batches, counts.queued) == (20, 5, 0)
    assert redis_view(mirror) == ({5: 9}, {5: 9})
    assert_redis_matches(mirror)


def reply_records(mirror: MirroredRegistry) -> int:
    """How many reply records (one per script call) the namespace holds now."""
    pattern = f"{mirror.inner.keys.base}:reply:*"
    return len(list(mirror.inner.client.scan_iter(match=pattern, count=1000)))


def test_a_batch_is_a_few_bounded_script_calls_in_one_round_trip(
    redis_backend: Backend, mirrors: list[MirroredRegistry]
) -> None:
    mirror = mirrored(redis_backend)
    mirrors.append(mirror)
    mirror.stop_flusher()
    before = reply_records(mirror)
    for i in range(CALL_WRITES * 2 + 10):  # two full calls by the write bound, then 10
        mirror.register_kv([i], [i + 1])
    big = list(range(10**6, 10**6 + CALL_VALUES))  # joins the third, filling its values
    mirror.register_kv(list(range(len(big))), big)
    mirror.register_mamba([1], [1])  # so this one starts a fourth call
    mirror.flush()
    counts = mirror.counts()
    assert (counts.flushed, counts.batches) == (CALL_WRITES * 2 + 12, 1)
    assert reply_records(mirror) - before == 4
    assert_redis_matches(mirror)


def test_a_batch_whose_reply_was_lost_is_sent_again_and_applies_once(
    redis_backend: Backend, mirrors: list[MirroredRegistry], monkeypatch: pytest.MonkeyPatch
) -> None:
    mirror = mirrored(redis_backend)
    mirrors.append(mirror)
    mirror.register_kv([1, 2], [11, 12])
    mirror.register_mamba([1, 2], [11, 12])
    mirror.flush()
    base = mirror.notice_sequence()
    heard: list[EvictionNotice] = []
    mirror.add_eviction_hook(heard.append)
    mirror.stop_flusher()
    mirror.register_mamba([5], [11])  # a replace notice
    mirror.register_mamba([6], [11])  # another: applied twice, both would repeat
    mirror.evict_kv([12])  # a cascade notice
    mirror.register_kv([3], [13])
    wire = mirror._behind.wire
    sent = wire.send
    lost: list[bool] = []

    def reply_lost(commands: Any) -> list[Any]:
        replies = sent(commands)  # applied by Redis ...
        if not lost:
            lost.append(True)
            raise redis.ConnectionError("connection reset")  # ... but the reply never came
        return replies

    monkeypatch.setattr(wire, "send", reply_lost)
    mirror.flush()
    counts = mirror.counts()
    assert lost == [True]
    assert (counts.retries, counts.resyncs, counts.dropped, counts.queued) == (1, 0, 0, 0)
    assert_redis_matches(mirror)
    published = mirror.inner.notices_after(base)
    assert published is not None
    assert [(n.seq, n.kind, n.pairs) for n in published] == [
        (n.seq, n.kind, n.pairs) for n in heard
    ]
    assert [n.kind for n in heard] == [NoticeKind.REPLACE, NoticeKind.REPLACE, NoticeKind.CASCADE]


def test_a_malformed_run_changes_nothing(
    redis_backend: Backend, mirrors: list[MirroredRegistry]
) -> None:
    mirror = mirrored(redis_backend)
    mirrors.append(mirror)
    mirror.register_kv([1, 2], [11, 12])
    mirror.flush()
    inner = mirror.inner
    for run in (
        ["k", 1, 13, 3, "k", 2, 14, 4],  # cut short
        ["k", 1, 13, 3, "q", 0],  # an unknown write
        ["k", 1, 13, 3, "e", -1],  # a bad count
        ["K", 1, 13],  # a clear carries no values
    ):
        keys, args = inner.write_args("mirror_apply", inner.all_write_keys, True, run)
        with pytest.raises(redis.ResponseError, match="BAD_WRITE"):
            inner.client.evalsha(script_sha("mirror_apply"), len(keys), *keys, *args)
    assert redis_view(mirror) == mirror.entries() == ({11: 1, 12: 2}, {})
    assert_redis_matches(mirror)


# -- exclusive ownership ---------------------------------------------------------------


def test_a_foreign_writer_is_refused_with_the_owner_named(
    redis_backend: Backend, mirrors: list[MirroredRegistry]
) -> None:
    ns = new_namespace()
    mirror = mirrored(redis_backend, ns, owner="node-7 (gpu-host:4242)")
    mirrors.append(mirror)
    mirror.register_kv([1, 2], [11, 12])
    mirror.register_mamba([2], [12])
    mirror.flush()
    operator = PrefixCacheRegistry(redis_backend.client(), ns)
    for write in (
        lambda: operator.evict_kv([11]),
        lambda: operator.register_kv([5], [15]),
        lambda: operator.evict_mamba([12]),
        lambda: operator.register_mamba([3], [13]),
        operator.clear_kv,
        operator.clear_mamba,
        operator.reset,
    ):
        with pytest.raises(NamespaceMirrored, match="node-7") as refused:
            write()
        assert refused.value.owner == "node-7 (gpu-host:4242)"
        assert refused.value.namespace == ns
    assert redis_view(mirror) == mirror.entries() == ({11: 1, 12: 2}, {12: 2})
    assert_redis_matches(mirror)


def test_a_superseded_owner_stays_stale_and_the_lease_bounds_the_refusal(
    redis_backend: Backend, mirrors: list[MirroredRegistry]
) -> None:
    ns = new_namespace()
    earlier = PrefixCacheRegistry(redis_backend.client(), ns)
    earlier.claim()
    mirror = mirrored(redis_backend, ns)
    mirrors.append(mirror)
    with pytest.raises(StaleEpochError):
        earlier.register_kv([1], [1])
    expire_lease(mirror.inner)  # the mirrored owner's lease ran out: anyone may write
    operator = PrefixCacheRegistry(redis_backend.client(), ns)
    operator.register_kv([4], [44])
    assert redis_view(mirror)[0] == {44: 4}


def test_an_ordinary_claim_ends_the_exclusivity_and_fences_the_mirror(
    redis_backend: Backend, mirrors: list[MirroredRegistry]
) -> None:
    ns = new_namespace()
    mirror = mirrored(redis_backend, ns)
    mirrors.append(mirror)
    mirror.register_kv([1], [11])
    mirror.flush()
    taker = PrefixCacheRegistry(redis_backend.client(), ns)
    taker.claim()  # a claim is always allowed: the new owner fences the mirror
    PrefixCacheRegistry(redis_backend.client(), ns).register_kv([2], [22])  # not exclusive
    mirror.register_kv([3], [33])  # still served locally until the flush finds out
    with pytest.raises(StaleEpochError):
        mirror.flush()
    assert mirror.lost
    assert mirror.counts().lost
    for call in (
        lambda: mirror.match_kv_prefix([11]),
        lambda: mirror.register_kv([4], [44]),
        lambda: mirror.mamba_block_ids([11]),
        lambda: mirror.evict_kv([11]),
        mirror.notice_sequence,
        mirror.renew,
        lambda: len(mirror.kv_hash_to_block_id),
    ):
        with pytest.raises(StaleEpochError, match="fenced"):
            call()
    assert redis_view(mirror)[0] == {22: 2}


def test_the_flusher_finds_the_fencing_by_itself(
    redis_backend: Backend, mirrors: list[MirroredRegistry]
) -> None:
    ns = new_namespace()
    mirror = mirrored(redis_backend, ns)
    mirrors.append(mirror)
    PrefixCacheRegistry(redis_backend.client(), ns).claim()
    mirror.register_kv([3], [33])
    wait_until(lambda: mirror.lost, what="the flusher marks the fenced mirror lost")
    thread = mirror._flusher.thread
    assert thread is not None
    wait_until(lambda: not thread.is_alive(), what="the flusher of a lost mirror ends")
    with pytest.raises(StaleEpochError):
        mirror.match_kv_prefix([33])


def test_a_mirror_claims_again_after_being_fenced(
    redis_backend: Backend, mirrors: list[MirroredRegistry]
) -> None:
    ns = new_namespace()
    mirror = mirrored(redis_backend, ns)
    mirrors.append(mirror)
    PrefixCacheRegistry(redis_backend.client(), ns).claim()
    mirror.register_kv([3], [33])
    with pytest.raises(StaleEpochError):
        mirror.flush()
    heard: list[EvictionNotice] = []
    mirror.add_eviction_hook(heard.append)
    mirror.claim()
    assert not mirror.lost
    assert heard[0].cleared
    assert mirror.match_kv_prefix([33]) == ([], 0)
    mirror.register_kv([1], [11])
    assert_redis_matches(mirror)


# -- faults ------------------------------------------------------------------------------


def test_a_full_queue_is_dropped_and_the_namespace_rewritten_once(
    redis_backend: Backend, mirrors: list[MirroredRegistry]
) -> None:
    mirror = mirrored(redis_backend, max_queue=5)
    mirrors.append(mirror)
    mirror.register_kv([1], [11])
    mirror.register_mamba([1], [11])
    mirror.flush()
    mirror.stop_flusher()  # Redis "away": nothing leaves the queue
    notices: list[EvictionNotice] = []
    mirror.add_eviction_hook(notices.append)
    for i in range(2, 12):
        mirror.register_kv([i], [i * 11])
    mirror.register_mamba([7], [11])  # replaces: a notice numbered locally
    mirror.evict_kv([22, 33])
    counts = mirror.counts()
    assert (counts.queued, counts.dropped, counts.resyncs) == (0, 12, 0)
    assert len(notices) == 1
    mirror.flush()
    counts = mirror.counts()
    assert (counts.resyncs, counts.queued) == (1, 0)
    assert redis_view(mirror) == mirror.entries()
    # The resync's clear follows a skipped number, and the mirror counts on past it.
    published = mirror.inner.notices_after(notices[0].seq - 1)
    assert published is None  # a gap: a listener reconciles instead of applying
    _incarnation, seq = mirror.inner.notice_position()
    assert seq == notices[0].seq + 2 == mirror.notice_sequence()
    mirror.register_mamba([8], [11])
    assert_redis_matches(mirror)


def test_concurrent_engine_threads(redis_backend: Backend, mirrors: list[MirroredRegistry]) -> None:
    mirror = mirrored(redis_backend, max_batch=16)
    mirrors.append(mirror)
    notices: list[EvictionNotice] = []
    mirror.add_eviction_hook(notices.append)
    base = mirror.notice_sequence()
    errors: list[BaseException] = []

    def engine(worker: int) -> None:
        try:
            for i in range(60):
                h = worker * 1000 + i + 1
                mirror.register_kv([h], [h])
                mirror.register_mamba([h], [h])
                assert mirror.match_kv_prefix([h]) == ([h], h)
                if i % 3 == 2:
                    assert mirror.evict_kv([h - 1, h - 2]) == {h - 1, h - 2}
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=engine, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert_redis_matches(mirror)
    numbers = sorted(n.seq for n in notices)  # one cascade notice per eviction, numbered
    assert numbers == list(range(base + 1, base + 1 + 4 * 20))


def test_close_flushes_and_stops_and_a_dropped_mirror_stops_its_flusher(
    redis_backend: Backend,
) -> None:
    mirror = mirrored(redis_backend)
    inner = mirror.inner
    mirror.stop_flusher()
    mirror.start_flusher()
    mirror.register_kv([1], [11])
    mirror.close()
    assert registry_state(inner)[0] == {11: 1}
    assert mirror._flusher.thread is not None
    assert not mirror._flusher.thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        mirror.register_kv([2], [22])
    assert mirror.match_kv_prefix([11]) == ([1], 11)  # reads still answer

    dropped = mirrored(redis_backend)
    thread = dropped._flusher.thread
    assert thread is not None
    assert thread.is_alive()
    del dropped
    wait_until(lambda: not thread.is_alive(), what="the flusher of a collected mirror ends")


def test_the_counters_are_prometheus_metrics(redis_backend: Backend) -> None:
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry, generate_latest

    from registry import metrics

    target = CollectorRegistry()
    metrics.enable_metrics(target, namespace_labels=True)
    mirror = mirrored(redis_backend, max_batch=2)
    try:
        assert metrics.register_mirror(mirror)
        mirror.stop_flusher()
        for i in range(5):
            mirror.register_kv([i], [i + 1])
        mirror.flush()
        text = generate_latest(target).decode()
        ns = mirror.namespace
        assert f'pcr_mirror_flushed_total{{namespace="{ns}"}} 5.0' in text
        assert f'pcr_mirror_batches_total{{namespace="{ns}"}} 3.0' in text
        assert f'pcr_mirror_queued{{namespace="{ns}"}} 0.0' in text
        assert f'pcr_mirror_lag_seconds{{namespace="{ns}"}} 0.0' in text
        assert f'pcr_lease_remaining_seconds{{namespace="{ns}"}}' in text
        metrics.unregister(mirror)
    finally:
        metrics.disable_metrics()
        mirror.close()
