"""The linearizability checker (``tests/support/linearizability.py``) on hand-made
histories, and its model against the in-memory reference registry.

The model must mean exactly what the registry means (Hypothesis compares its steps with
``LocalPrefixCacheRegistry``), and the search must accept every history some order
explains and reject the ones none does: stale reads, reads of half a write, a write
undone, fencing broken, data lost without a restart. No Redis here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from registry import LocalPrefixCacheRegistry, RegistryUnavailable, StaleEpochError
from tests.support.histories import (
    KEY_SPACE,
    HistoryRecorder,
    decode_call,
    decode_value,
    encode_call,
    encode_value,
    perform,
)
from tests.support.linearizability import (
    FENCED,
    Call,
    ModelState,
    Operation,
    OpName,
    PrefixMatch,
    Status,
    Value,
    Verdict,
    assert_linearizable,
    check,
    reaches_storage,
    step,
)

H1, H2, H3 = 101, 102, 103
MS = 1_000_000


def op(
    process: str,
    call: Call,
    value: Value,
    start: float,
    end: float | None,
    status: Status = Status.OK,
) -> Operation:
    """An operation of a hand-made history, its times in ms (``end`` None: unknown)."""
    returned = None if end is None else round(end * MS)
    return Operation(process, call, status, value, round(start * MS), returned)


def register_kv(ids: Sequence[int], hashes: Sequence[int], epoch: int | None = None) -> Call:
    return Call(OpName.REGISTER_KV, tuple(hashes), tuple(ids), epoch=epoch)


def match(hashes: Sequence[int]) -> Call:
    return Call(OpName.MATCH_KV_PREFIX, tuple(hashes))


def mamba_ids(hashes: Sequence[int]) -> Call:
    return Call(OpName.MAMBA_BLOCK_IDS, tuple(hashes))


NOTHING = PrefixMatch((), 0)
CLAIM = Call(OpName.CLAIM)
RESTART = Call(OpName.RESTART)


# -- the model means what the registry means ------------------------------------------------

FEW_HASHES = KEY_SPACE[:3]
"""Three hashes, so that random calls meet: a register, a Mamba entry, a cascade."""
HASH_OR_SENTINEL = st.sampled_from([-1, 0, *FEW_HASHES])
MODEL_OPS = [name for name in OpName if name not in (OpName.CLAIM, OpName.RESTART)]


@st.composite
def calls(draw: st.DrawFn) -> Call:
    """Any valid call of the registry's API on the small key space, sentinels included."""
    name = draw(st.sampled_from(MODEL_OPS))
    if name in (OpName.CLEAR_KV, OpName.CLEAR_MAMBA, OpName.RESET):
        return Call(name)
    pool = st.sampled_from(FEW_HASHES) if name is OpName.REGISTER_KV else HASH_OR_SENTINEL
    hashes = tuple(draw(st.lists(pool, max_size=4)))
    ids: tuple[int, ...] = ()
    if name in (OpName.REGISTER_KV, OpName.REGISTER_MAMBA):
        ids = tuple(draw(st.lists(st.integers(0, 3), min_size=len(hashes), max_size=len(hashes))))
    return Call(name, hashes, ids, search_len=draw(st.integers(-1, 7)))


CASCADE = [
    register_kv([1, 2], [H1, H2]),
    Call(OpName.REGISTER_MAMBA, (H2, -1), (5, 6)),
    Call(OpName.EVICT_KV, (H2, H3, -1)),
]


@settings(max_examples=200, deadline=None)
@given(st.lists(calls(), min_size=10, max_size=40))
@example(CASCADE)
def test_the_models_steps_are_the_reference_registrys(sequence: list[Call]) -> None:
    reference = LocalPrefixCacheRegistry()
    state = ModelState()
    for call in sequence:
        moved = step(state, call)
        assert moved.status is Status.OK
        assert perform(reference, call) == moved.value, call.describe()
        state = moved.state
        assert dict(state.kv) == reference.kv
        assert dict(state.mamba) == reference.mamba


@settings(max_examples=120, deadline=None)
@given(st.lists(calls(), max_size=10), calls())
def test_a_write_with_another_epoch_is_refused_and_changes_nothing(
    before: list[Call], call: Call
) -> None:
    state = ModelState(epoch=7)
    for earlier in before:
        state = step(state, earlier).state
    fenced = step(state, Call(call.name, call.hashes, call.block_ids, call.search_len, epoch=8))
    owned = step(state, Call(call.name, call.hashes, call.block_ids, call.search_len, epoch=7))
    assert owned == step(state, call)  # the owner's epoch: as if unfenced
    if call.name in FENCED and reaches_storage(call):
        assert fenced.status is Status.STALE
        assert fenced.state == state
    else:  # a read, or a write with nothing to send: never refused
        assert fenced == owned


def test_a_claim_has_no_step_of_its_own() -> None:
    with pytest.raises(ValueError, match="linearize"):
        step(ModelState(), CLAIM)


# -- hand-made histories --------------------------------------------------------------------


def test_a_sequential_history_that_follows_the_model_is_linearizable() -> None:
    history = [
        op("w", register_kv([1, 2], [H1, H2]), None, 0, 1),
        op("r", match([H1, H2, H3]), PrefixMatch((1, 2), H2), 2, 3),
        op("w", Call(OpName.REGISTER_MAMBA, (H2,), (2,)), None, 4, 5),
        op("w", Call(OpName.EVICT_KV, (H2, H3)), (H2,), 6, 7),  # cascades to Mamba
        op("r", mamba_ids([H1, H2]), (None, None), 8, 9),
        op("r", match([H1, H2]), PrefixMatch((1,), H1), 8, 9),
    ]
    result = assert_linearizable(history)
    assert sorted(result.longest) == list(range(6))


def test_a_read_after_a_write_returned_must_see_it() -> None:
    history = [
        op("w", register_kv([1], [H1]), None, 0, 1),
        op("r", match([H1]), NOTHING, 2, 3),  # stale: the write had returned
    ]
    assert check(history).verdict is Verdict.NOT_LINEARIZABLE


def test_a_read_overlapping_a_write_may_see_it_or_not() -> None:
    for seen in (NOTHING, PrefixMatch((1,), H1)):
        history = [
            op("w", register_kv([1], [H1]), None, 0, 10),
            op("r", match([H1]), seen, 2, 3),
        ]
        assert check(history).verdict is Verdict.LINEARIZABLE


def test_a_read_never_sees_half_a_write() -> None:
    """The signature of a non-atomic register_kv: a prefix that only the first of its
    HSETs explains, seen while it runs."""
    history = [
        op("w", register_kv([1, 2], [H1, H2]), None, 0, 10),
        op("r", match([H1, H2]), PrefixMatch((1,), H1), 2, 3),
    ]
    result = check(history)
    assert result.verdict is Verdict.NOT_LINEARIZABLE
    assert result.longest == (0,)  # the write alone; the read fits before or after it, never


def test_a_new_value_then_the_old_one_is_not_linearizable() -> None:
    """Two reads in a row, both during an overwrite: the second may not go back."""

    def reads(first: int, second: int) -> list[Operation]:
        return [
            op("w0", register_kv([1], [H1]), None, 0, 1),
            op("w1", register_kv([2], [H1]), None, 2, 20),
            op("r", match([H1]), PrefixMatch((first,), H1), 3, 4),
            op("r", match([H1]), PrefixMatch((second,), H1), 5, 6),
        ]

    assert check(reads(2, 1)).verdict is Verdict.NOT_LINEARIZABLE
    assert check(reads(1, 2)).verdict is Verdict.LINEARIZABLE


def test_an_eviction_reports_exactly_what_it_removed() -> None:
    setup = op("w", register_kv([1, 2], [H1, H2]), None, 0, 1)
    for told, verdict in (((H1,), Verdict.LINEARIZABLE), ((H1, H2), Verdict.NOT_LINEARIZABLE)):
        evict = op("w", Call(OpName.EVICT_KV, (H1, H3)), told, 2, 3)
        assert check([setup, evict]).verdict is verdict


def test_a_write_of_unknown_outcome_may_have_happened_late_or_never() -> None:
    write = op("w", register_kv([1], [H1]), None, 0, None, Status.UNKNOWN)
    seen = [
        op("r", match([H1]), NOTHING, 2, 3),
        op("r", match([H1]), PrefixMatch((1,), H1), 4, 5),  # it happened in between
    ]
    assert check([write, *seen]).verdict is Verdict.LINEARIZABLE
    assert check([write, seen[0]]).verdict is Verdict.LINEARIZABLE  # never
    assert check([write, seen[1]]).verdict is Verdict.LINEARIZABLE  # before


def test_a_write_of_unknown_outcome_happens_at_most_once() -> None:
    write = op("w", register_kv([1], [H1]), None, 0, None, Status.UNKNOWN)
    history = [
        write,
        op("r", match([H1]), PrefixMatch((1,), H1), 2, 3),
        op("e", Call(OpName.EVICT_KV, (H1,)), (H1,), 4, 5),
        op("r", match([H1]), PrefixMatch((1,), H1), 6, 7),  # the write again: no
    ]
    assert check(history).verdict is Verdict.NOT_LINEARIZABLE


def test_a_read_before_a_writes_invoke_cannot_see_it_even_if_its_outcome_is_unknown() -> None:
    history = [
        op("r", match([H1]), PrefixMatch((1,), H1), 0, 1),
        op("w", register_kv([1], [H1]), None, 2, None, Status.UNKNOWN),
    ]
    assert check(history).verdict is Verdict.NOT_LINEARIZABLE


def test_a_claim_empties_the_namespace_and_fences_the_previous_owner() -> None:
    history = [
        op("a", CLAIM, 10, 0, 1),
        op("a", register_kv([1], [H1], epoch=10), None, 2, 3),
        op("b", CLAIM, 20, 4, 5),
        op("r", match([H1]), NOTHING, 6, 7),  # the claim dropped the entry
        op("a", register_kv([2], [H2], epoch=10), None, 8, 9, Status.STALE),
        op("b", register_kv([3], [H2], epoch=20), None, 10, 11),
        op("r", match([H2]), PrefixMatch((3,), H2), 12, 13),
    ]
    assert check(history).verdict is Verdict.LINEARIZABLE


def test_a_superseded_owners_write_that_succeeds_is_not_linearizable() -> None:
    history = [
        op("a", CLAIM, 10, 0, 1),
        op("b", CLAIM, 20, 2, 3),
        op("a", register_kv([1], [H1], epoch=10), None, 4, 5),  # fencing broken
    ]
    assert check(history).verdict is Verdict.NOT_LINEARIZABLE


def test_a_stale_refusal_while_the_epoch_is_current_is_not_linearizable() -> None:
    history = [
        op("a", CLAIM, 10, 0, 1),
        op("a", register_kv([1], [H1], epoch=10), None, 2, 3, Status.STALE),
    ]
    assert check(history).verdict is Verdict.NOT_LINEARIZABLE


def test_a_claim_of_unknown_outcome_may_have_fenced_its_predecessor_or_not() -> None:
    for status in (Status.OK, Status.STALE):
        history = [
            op("a", CLAIM, 10, 0, 1),
            op("b", CLAIM, None, 2, None, Status.UNKNOWN),
            op("a", register_kv([1], [H1], epoch=10), None, 4, 5, status),
        ]
        assert check(history).verdict is Verdict.LINEARIZABLE, status


def test_lost_data_needs_a_restart_to_explain_it() -> None:
    """An empty restart is not linearizable against durable maps unless the history
    holds the restart: then the loss and the old owner's refusals are explained."""
    before = [
        op("a", CLAIM, 10, 0, 1),
        op("a", register_kv([1], [H1], epoch=10), None, 2, 3),
    ]
    after = [
        op("r", match([H1]), NOTHING, 9, 10),
        op("a", register_kv([2], [H2], epoch=10), None, 11, 12, Status.STALE),
    ]
    assert check(before + after).verdict is Verdict.NOT_LINEARIZABLE
    restart = op("harness", RESTART, None, 4, 8)
    assert check([*before, restart, *after]).verdict is Verdict.LINEARIZABLE
    unfenced = op("a", register_kv([2], [H2], epoch=10), None, 11, 12)  # after the loss
    assert check([*before, restart, after[0], unfenced]).verdict is Verdict.NOT_LINEARIZABLE


def test_a_write_in_flight_across_a_restart_may_be_lost_with_it() -> None:
    history = [
        op("a", CLAIM, 10, 0, 1),
        op("a", register_kv([1], [H1], epoch=10), None, 2, None, Status.UNKNOWN),
        op("harness", RESTART, None, 3, 8),
        op("r", match([H1]), NOTHING, 9, 10),
    ]
    assert check(history).verdict is Verdict.LINEARIZABLE


def test_an_exhausted_step_budget_fails_loudly() -> None:
    writes = [op(f"w{i}", register_kv([i % 3], [H1]), None, 0, 100) for i in range(9)]
    history = [*writes, op("r", match([H1]), PrefixMatch((7,), H1), 101, 102)]  # no such id
    result = check(history, budget=50)
    assert result.verdict is Verdict.BUDGET_EXHAUSTED
    assert result.steps == 50
    with pytest.raises(AssertionError, match="step budget exhausted"):
        assert_linearizable(history, budget=50)
    assert check(history).verdict is Verdict.NOT_LINEARIZABLE  # with room, the real answer


def test_the_failure_report_names_the_operation_that_cannot_be_placed() -> None:
    history = [
        op("w", register_kv([1, 2], [H1, H2]), None, 0, 10),
        op("reader", match([H1, H2]), PrefixMatch((1,), H1), 2, 3),
    ]
    with pytest.raises(AssertionError) as failure:
        assert_linearizable(history)
    text = str(failure.value)
    assert "not linearizable" in text
    assert "cannot place #1" in text
    assert "reader: match_kv_prefix" in text


def test_calls_overlapping_by_their_end_times_may_be_ordered_either_way() -> None:
    """A return and an invoke at the same instant count as overlapping."""
    history = [
        op("w", register_kv([1], [H1]), None, 0, 5),
        op("r", match([H1]), NOTHING, 5, 6),
    ]
    assert check(history).verdict is Verdict.LINEARIZABLE


# -- the recorder ----------------------------------------------------------------------------


class FlakyRegistry(LocalPrefixCacheRegistry):
    """The reference registry raising the faults a real one raises, when told to."""

    def __init__(self) -> None:
        super().__init__()
        self.fault: Exception | None = None

    def _register_kv(self, entries: dict[int, int]) -> None:
        if self.fault is not None:
            raise self.fault
        super()._register_kv(entries)

    def _match_kv_prefix(self, hashes: list[int]) -> list[int]:
        if self.fault is not None:
            raise self.fault
        return super()._match_kv_prefix(hashes)


def test_the_recorder_keeps_what_happened_and_drops_what_did_not() -> None:
    registry = FlakyRegistry()
    recorder = HistoryRecorder()
    write, read = register_kv([1], [H1]), match([H1])
    assert recorder.run("w", registry, write) is not None
    registry.fault = RegistryUnavailable("timed out", outcome_unknown=True)
    unknown = recorder.run("w", registry, write)
    assert unknown is not None
    assert unknown.status is Status.UNKNOWN
    assert unknown.returned_ns is None
    assert recorder.run("r", registry, read) is None  # a read that raised: dropped
    registry.fault = RegistryUnavailable("refused", outcome_unknown=False)
    assert recorder.run("w", registry, write) is None  # never reached the server
    registry.fault = StaleEpochError("ns", 1, "STALE_EPOCH")
    stale = recorder.run("w", registry, write)
    assert stale is not None
    assert stale.status is Status.STALE
    registry.fault = KeyError("a bug")
    with pytest.raises(KeyError):
        recorder.run("w", registry, write)
    assert recorder.in_flight() == []
    history = recorder.history()
    assert [o.status for o in history] == [Status.OK, Status.UNKNOWN, Status.STALE]
    assert recorder.dropped == 3
    assert all(o.invoked_ns <= (o.returned_ns or o.invoked_ns) for o in history)


def test_a_child_processes_events_rebuild_its_history_and_its_last_call_is_unknown() -> None:
    printed: list[str] = []
    child = HistoryRecorder(sink=lambda event: printed.append(json.dumps(event)))
    registry = LocalPrefixCacheRegistry()
    child.run("child", registry, register_kv([1, 2], [H1, H2]))
    child.run("child", registry, Call(OpName.EVICT_KV, (H2,)))
    child.run("child", registry, match([H1, H2]))
    child.run("child", registry, mamba_ids([H1]))
    child._begin("child", register_kv([3], [H3]))  # killed while this write was out
    child._begin("reader", match([H3]))  # and a read of another process, never answered
    parent = HistoryRecorder()
    for line in printed:
        parent.absorb(json.loads(line))
    assert len(parent.in_flight()) == 2
    parent.abandon("child")
    parent.abandon("reader")
    history = parent.history()
    assert [o.value for o in history] == [None, (H2,), PrefixMatch((1,), H1), (None,), None]
    assert history[-1].status is Status.UNKNOWN
    assert history[-1].returned_ns is None
    assert parent.dropped == 1
    assert check(history).verdict is Verdict.LINEARIZABLE


@pytest.mark.parametrize(
    ("call", "value"),
    [
        (match([H1, H2]), PrefixMatch((4, 5), H2)),
        (Call(OpName.EVICT_MAMBA, (H1, H2)), (H1, H2)),
        (mamba_ids([H1, -1]), (3, None)),
        (Call(OpName.FIND_MAMBA_BACKOFF, (H1,), search_len=2), 1),
        (CLAIM, 17960242888531234),
        (Call(OpName.RESET, epoch=17960242888531234), None),
    ],
)
def test_calls_and_values_survive_json(call: Call, value: Any) -> None:
    assert decode_call(json.loads(json.dumps(encode_call(call)))) == call
    assert decode_value(call.name, json.loads(json.dumps(encode_value(value)))) == value
