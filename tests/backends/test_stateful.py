"""Differential test: random sequences of all twelve operations (and the read helpers)
on a Redis registry give the same results, callbacks, notices and final state as the
in-memory reference."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from registry import EvictionNotice, LocalPrefixCacheRegistry, RegistryBase
from tests.support.backends import Backend, notice_base, registry_state, relative

# A small pool so that operations collide; it includes hashes that a double would round.
POOL = [1, 2, 3, 4, 5, 6, 7, 2**53, 2**53 + 1, 2**62 + 3, 2**63 - 2, 2**63 - 1]
real_hashes = st.sampled_from(POOL)
any_hashes = st.one_of(real_hashes, st.sampled_from([-1, 0]))
block_ids = st.integers(min_value=0, max_value=12)


def machine_for(make_registry: Callable[[], RegistryBase]) -> type[RuleBasedStateMachine]:
    class RegistryComparison(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.model = LocalPrefixCacheRegistry()
            self.real = make_registry()
            self.model_fired: list[list[int]] = []
            self.real_fired: list[list[int]] = []
            self.model.set_mamba_evict_callback(self.model_fired.append)
            self.real.set_mamba_evict_callback(self.real_fired.append)
            self.model_notices: list[EvictionNotice] = []
            self.real_notices: list[EvictionNotice] = []
            self.model.add_eviction_hook(self.model_notices.append)
            self.real.add_eviction_hook(self.real_notices.append)

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
            assert self.real.find_mamba_backoff(
                hashes, search_len
            ) == self.model.find_mamba_backoff(hashes, search_len)

        @rule(pairs=st.lists(st.tuples(block_ids, any_hashes), max_size=6))
        def register_mamba(self, pairs: list[tuple[int, int]]) -> None:
            ids, hashes = [p[0] for p in pairs], [p[1] for p in pairs]
            real_stamp = self.real.register_mamba_stamped(ids, hashes)
            model_stamp = self.model.register_mamba_stamped(ids, hashes)
            # 0 means "nothing registered"; else the stamp counts in the history's numbers.
            assert (real_stamp and real_stamp - notice_base(self.real)) == model_stamp

        @rule(hashes=st.lists(any_hashes, max_size=8))
        def mamba_block_ids(self, hashes: list[int]) -> None:
            assert self.real.mamba_block_ids(hashes) == self.model.mamba_block_ids(hashes)

        @rule(hashes=st.lists(any_hashes, max_size=6))
        def evict_mamba(self, hashes: list[int]) -> None:
            assert self.real.evict_mamba(hashes) == self.model.evict_mamba(hashes)

        @rule(wired=st.booleans())
        def set_mamba_evict_callback(self, wired: bool) -> None:
            self.real.set_mamba_evict_callback(self.real_fired.append if wired else None)
            self.model.set_mamba_evict_callback(self.model_fired.append if wired else None)

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

        @invariant()
        def same_state_and_callbacks(self) -> None:
            assert registry_state(self.real) == registry_state(self.model)
            assert self.real_fired == self.model_fired
            assert [relative(self.real, n) for n in self.real_notices] == [
                relative(self.model, n) for n in self.model_notices
            ]
            base = notice_base(self.real)
            assert self.real.notice_sequence() - base == self.model.notice_sequence()

    return RegistryComparison


@pytest.mark.parametrize("backend_name", ["fakeredis", "redis"])
def test_redis_registry_matches_the_reference(
    backend_name: str, request: pytest.FixtureRequest
) -> None:
    from tests.support.backends import make_backend

    backend: Backend = make_backend(backend_name, request)
    try:
        run_state_machine_as_test(
            machine_for(backend.registry),
            settings=settings(
                max_examples=40,
                stateful_step_count=30,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )
    finally:
        backend.close()
