"""A linearizability checker for one namespace's operations, and the recorder of the
concurrent histories it checks.

The model is the namespace as a sequential object: the KV map and the Mamba map (each
``hash -> block id``) and the owner epoch stored in its ``meta``. ``step`` reproduces
``RegistryBase``'s sequential meaning exactly (the unit tests compare it with
``LocalPrefixCacheRegistry``), plus the fencing of the Lua scripts: a write carrying an
epoch that is not the namespace's current one changes nothing and raises
``StaleEpochError``; a claim takes a new epoch and empties both maps.

The checker is Wing and Gong's search with Lowe's memoisation (as Knossos and Porcupine
do): the history is a linked list of call and return entries in time order; the search
linearizes ("lifts") any call that is minimal (no return comes before it) and whose
result the model reproduces, backtracks ("unlifts") when it reaches a return entry, and
never revisits a (set of linearized operations, model state) pair. It runs under a step
budget: a search that runs out says so, it never passes.

What a history holds, and why that is sound:

- Each call's invoke time is taken before it is sent and its return time after it
  returned (``time.monotonic_ns``: CLOCK_MONOTONIC, shared by every process on Linux).
- A write whose outcome is unknown (``RegistryUnavailable`` with ``outcome_unknown``, a
  timeout, a client killed mid-call) may have happened at any time after its invoke, or
  never: its return time is infinity. The model then accepts whatever it does at the
  point it is placed; placed last, it is the same as "never" (nothing observes it).
- A read that raised, or a write that raised ``RegistryUnavailable`` without
  ``outcome_unknown`` (it never reached the server, as the error's contract says),
  had no effect and is dropped.
- A write refused with ``StaleEpochError`` stays in the history with that outcome: the
  model accepts it only where the namespace's epoch differs from the one it carried, and
  it changes nothing there. So fencing is checked, not assumed.
- A claim that raised may have happened: its epoch is unknown, so where it is placed
  the namespace gets an epoch no write carries (the registry object that tried it is
  thrown away, never written through).
- An empty restart of the server (no persistence) loses both maps and ``meta``: that is
  not linearizable against a durable map, so the harness records the restart itself as
  an operation, ``restart``, spanning from before the kill to after the new server
  answers, and the model empties both maps and forgets the epoch there. The loss does
  happen at one instant inside that span (the process dies between two commands: a
  script is atomic), and no call is served while the server is down, so one atomic step
  inside the span is exactly what happened. After it, the old owner's writes must be
  fenced (``StaleEpochError``, checked as above) until it claims again: the registry's
  contract. One history with the restart as a step is stronger than checking the
  epochs before and after separately, since it also checks the calls that straddle it.

The recorder of such histories, and a client process of its own, are in
``tests.support.histories``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

# -- the operations -------------------------------------------------------------------------


class OpName(str, Enum):
    """The operations a history may hold: the registry's, a claim, and the harness's
    empty restart of the server."""

    REGISTER_KV = "register_kv"
    EVICT_KV = "evict_kv"
    MATCH_KV_PREFIX = "match_kv_prefix"
    REGISTER_MAMBA = "register_mamba"
    EVICT_MAMBA = "evict_mamba"
    MAMBA_BLOCK_IDS = "mamba_block_ids"
    MATCH_MAMBA_FARTHEST = "match_mamba_farthest"
    FIND_MAMBA_BACKOFF = "find_mamba_backoff"
    CLEAR_KV = "clear_kv"
    CLEAR_MAMBA = "clear_mamba"
    RESET = "reset"
    CLAIM = "claim"
    RESTART = "restart"


READS = frozenset(
    {
        OpName.MATCH_KV_PREFIX,
        OpName.MAMBA_BLOCK_IDS,
        OpName.MATCH_MAMBA_FARTHEST,
        OpName.FIND_MAMBA_BACKOFF,
    }
)
"""Operations that change nothing: dropped from a history when they raise."""

FENCED = frozenset(
    {
        OpName.REGISTER_KV,
        OpName.EVICT_KV,
        OpName.REGISTER_MAMBA,
        OpName.EVICT_MAMBA,
        OpName.CLEAR_KV,
        OpName.CLEAR_MAMBA,
        OpName.RESET,
    }
)
"""Writes that carry the owner's epoch and are refused once it is not the current one."""

_CLEARS = frozenset({OpName.CLEAR_KV, OpName.CLEAR_MAMBA, OpName.RESET})

Epoch = int | str | None
"""A namespace's owner epoch: an int from ``claim``, a str naming a claim whose epoch
nobody learned, None when unset (never claimed, or lost in an empty restart)."""


@dataclass(frozen=True)
class Call:
    """One operation's arguments; ``epoch`` is the owner epoch a write carries (None:
    a writer that owns nothing)."""

    name: OpName
    hashes: tuple[int, ...] = ()
    block_ids: tuple[int, ...] = ()
    search_len: int = 0
    epoch: int | None = None

    def describe(self) -> str:
        """The call as text, only with the arguments it uses."""
        parts = []
        if self.block_ids:
            parts.append(f"ids={list(self.block_ids)}")
        if self.hashes:
            parts.append(f"hashes={list(self.hashes)}")
        if self.name is OpName.FIND_MAMBA_BACKOFF:
            parts.append(f"search_len={self.search_len}")
        if self.epoch is not None:
            parts.append(f"epoch={self.epoch}")
        return f"{self.name.value}({', '.join(parts)})"


@dataclass(frozen=True)
class PrefixMatch:
    """What ``match_kv_prefix`` returns: the prefix's block ids and its last hash."""

    block_ids: tuple[int, ...]
    last_hash: int


Value = int | tuple[int | None, ...] | PrefixMatch | None
"""A result as the history keeps it: evictions as sorted tuples of hashes, the Mamba
read as a tuple, a prefix match as ``PrefixMatch``, a claim as its epoch."""


class Status(str, Enum):
    """How an operation ended."""

    OK = "ok"
    STALE = "stale"  # refused with StaleEpochError: changed nothing
    UNKNOWN = "unknown"  # may have happened, at any time after its invoke, or never


@dataclass(frozen=True)
class Operation:
    """One call of a history: who, what, how it ended and when (``returned_ns`` None:
    infinity, the outcome is unknown)."""

    process: str
    call: Call
    status: Status
    value: Value
    invoked_ns: int
    returned_ns: int | None

    def describe(self, origin_ns: int = 0) -> str:
        """The operation as one line, times in ms from ``origin_ns``."""
        start = (self.invoked_ns - origin_ns) / 1e6
        end = "inf"
        if self.returned_ns is not None:
            end = f"{(self.returned_ns - origin_ns) / 1e6:.3f}"
        shown = f" {self.value}" if self.status is Status.OK else ""
        outcome = f"{self.status.value}{shown}"
        return f"[{start:.3f}..{end} ms] {self.process}: {self.call.describe()} -> {outcome}"


History = Sequence[Operation]

# -- the sequential model ---------------------------------------------------------------------


@dataclass(frozen=True)
class ModelState:
    """The namespace as the model sees it; hashable, so the checker can remember it."""

    kv: frozenset[tuple[int, int]] = frozenset()
    mamba: frozenset[tuple[int, int]] = frozenset()
    epoch: Epoch = None


@dataclass(frozen=True)
class Transition:
    """What one operation does from a state: the next state and what the caller sees."""

    state: ModelState
    status: Status
    value: Value


@dataclass
class _Maps:
    """Working copies of the two maps for one step."""

    kv: dict[int, int]
    mamba: dict[int, int]


def _kv_entries(call: Call) -> dict[int, int]:
    if len(call.hashes) != len(call.block_ids) or any(h < 1 for h in call.hashes):
        raise ValueError(f"not a valid register_kv: {call.describe()}")
    return dict(zip(call.hashes, call.block_ids, strict=True))  # the last value wins


def _mamba_entries(call: Call) -> dict[int, int]:
    if len(call.hashes) != len(call.block_ids):
        raise ValueError(f"not a valid register_mamba: {call.describe()}")
    entries = dict(zip(call.hashes, call.block_ids, strict=True))
    return {h: b for h, b in entries.items() if h > 0}  # -1 and 0 are skipped


def _eviction(hashes: Sequence[int]) -> list[int]:
    return [h for h in dict.fromkeys(hashes) if h > 0]  # distinct, sentinels dropped


def _prefix(hashes: Sequence[int]) -> Sequence[int]:
    cut = next((i for i, h in enumerate(hashes) if h <= 0), len(hashes))
    return hashes[:cut]


def _farthest(mamba: dict[int, int], hashes: Sequence[int]) -> int:
    return next((i + 1 for i in range(len(hashes) - 1, -1, -1) if hashes[i] in mamba), 0)


def _register_kv(maps: _Maps, call: Call) -> Value:
    maps.kv.update(_kv_entries(call))
    return None


def _evict_kv(maps: _Maps, call: Call) -> Value:
    removed = [h for h in _eviction(call.hashes) if maps.kv.pop(h, None) is not None]
    for h in removed:
        maps.mamba.pop(h, None)  # the cascade: a KV entry's Mamba state goes with it
    return tuple(sorted(removed))


def _match_kv_prefix(maps: _Maps, call: Call) -> Value:
    wanted = _prefix(call.hashes)
    block_ids: list[int] = []
    for h in wanted:
        if h not in maps.kv:
            break
        block_ids.append(maps.kv[h])
    return PrefixMatch(tuple(block_ids), wanted[len(block_ids) - 1] if block_ids else 0)


def _register_mamba(maps: _Maps, call: Call) -> Value:
    maps.mamba.update(_mamba_entries(call))
    return None


def _evict_mamba(maps: _Maps, call: Call) -> Value:
    return tuple(sorted(h for h in _eviction(call.hashes) if maps.mamba.pop(h, None) is not None))


def _mamba_block_ids(maps: _Maps, call: Call) -> Value:
    return tuple(maps.mamba.get(h) for h in call.hashes)


def _match_mamba_farthest(maps: _Maps, call: Call) -> Value:
    return _farthest(maps.mamba, call.hashes)


def _find_mamba_backoff(maps: _Maps, call: Call) -> Value:
    return 0 if call.search_len <= 0 else _farthest(maps.mamba, call.hashes[: call.search_len])


def _clear_kv(maps: _Maps, call: Call) -> Value:
    maps.kv.clear()
    return None


def _clear_mamba(maps: _Maps, call: Call) -> Value:
    maps.mamba.clear()
    return None


def _reset(maps: _Maps, call: Call) -> Value:
    maps.kv.clear()
    maps.mamba.clear()
    return None


_STEPS: dict[OpName, Callable[[_Maps, Call], Value]] = {
    OpName.REGISTER_KV: _register_kv,
    OpName.EVICT_KV: _evict_kv,
    OpName.MATCH_KV_PREFIX: _match_kv_prefix,
    OpName.REGISTER_MAMBA: _register_mamba,
    OpName.EVICT_MAMBA: _evict_mamba,
    OpName.MAMBA_BLOCK_IDS: _mamba_block_ids,
    OpName.MATCH_MAMBA_FARTHEST: _match_mamba_farthest,
    OpName.FIND_MAMBA_BACKOFF: _find_mamba_backoff,
    OpName.CLEAR_KV: _clear_kv,
    OpName.CLEAR_MAMBA: _clear_mamba,
    OpName.RESET: _reset,
}


def reaches_storage(call: Call) -> bool:
    """Whether the registry sends ``call`` at all: a write with nothing to write (empty,
    or only sentinels) returns at once, so it is never fenced."""
    if call.name is OpName.REGISTER_KV:
        return bool(_kv_entries(call))
    if call.name is OpName.REGISTER_MAMBA:
        return bool(_mamba_entries(call))
    if call.name in (OpName.EVICT_KV, OpName.EVICT_MAMBA):
        return bool(_eviction(call.hashes))
    return True


def step(state: ModelState, call: Call) -> Transition:
    """What ``call`` does to the namespace in ``state``, done alone (claims are applied
    by ``linearize``: their epoch is an output)."""
    if call.name is OpName.CLAIM:
        raise ValueError("a claim's step needs the epoch it returned: use linearize()")
    if call.name is OpName.RESTART:
        return Transition(ModelState(), Status.OK, None)  # both maps and meta are gone
    fenced = call.name in FENCED and call.epoch is not None and call.epoch != state.epoch
    if fenced and reaches_storage(call):
        return Transition(state, Status.STALE, None)
    maps = _Maps(dict(state.kv), dict(state.mamba))
    value = _STEPS[call.name](maps, call)
    if call.name in READS:
        return Transition(state, Status.OK, value)
    after = ModelState(frozenset(maps.kv.items()), frozenset(maps.mamba.items()), state.epoch)
    return Transition(after, Status.OK, value)


def linearize(state: ModelState, op: Operation, position: int) -> ModelState | None:
    """The state after ``op`` (the ``position``-th of its history) takes effect in
    ``state``, or None when the model cannot give the outcome that was recorded."""
    if op.call.name is OpName.CLAIM:
        epoch: Epoch = f"unlearned claim #{position}"
        if op.status is Status.OK:
            if not isinstance(op.value, int):
                return None
            epoch = op.value
        if epoch == state.epoch:
            return None  # epochs never repeat
        return ModelState(epoch=epoch)  # a claim empties the namespace
    if op.status is Status.OK and op.call.name in READS:
        # The hot path of a search: a read changes nothing, so only its value is compared.
        expected = _STEPS[op.call.name](_Maps(dict(state.kv), dict(state.mamba)), op.call)
        return state if expected == op.value else None
    moved = step(state, op.call)
    if op.status is Status.UNKNOWN:
        return moved.state
    if moved.status is not op.status or moved.value != op.value:
        return None
    return moved.state


# -- the checker (Wing and Gong's search, Lowe's memoisation) -----------------------------------

DEFAULT_STEP_BUDGET = 1_000_000
"""Search steps a check may take before it gives up (and says so)."""


class Verdict(str, Enum):
    """What a check found."""

    LINEARIZABLE = "linearizable"
    NOT_LINEARIZABLE = "not linearizable"
    BUDGET_EXHAUSTED = "step budget exhausted"


@dataclass(frozen=True)
class CheckResult:
    """The verdict, the steps it took and the longest order found (history positions)."""

    verdict: Verdict
    steps: int
    budget: int
    longest: tuple[int, ...]


@dataclass(eq=False)
class _Entry:
    """One call or return entry of the doubly linked list the search walks."""

    position: int  # the operation's place in the history; -1 for the head
    is_call: bool
    match: _Entry | None = None  # a call's return entry
    prev: _Entry | None = None
    next: _Entry | None = None


@dataclass(frozen=True)
class _Frame:
    """A linearized call, and the state before it: what backtracking restores."""

    entry: _Entry
    state: ModelState


def _entry_list(history: History) -> _Entry:
    """The head of the list of call and return entries in time order. At equal times
    calls come first: the two operations then overlap, which can only allow more orders."""
    events: list[tuple[float, int, int]] = []
    for position, op in enumerate(history):
        returned = math.inf if op.returned_ns is None else float(op.returned_ns)
        if returned < op.invoked_ns:
            raise ValueError(f"operation {position} returns before its invoke")
        events.append((float(op.invoked_ns), 0, position))
        events.append((returned, 1, position))
    events.sort()
    head = _Entry(-1, is_call=False)
    last = head
    calls: dict[int, _Entry] = {}
    for _, kind, position in events:
        entry = _Entry(position, is_call=kind == 0, prev=last)
        if kind == 0:
            calls[position] = entry
        else:
            calls[position].match = entry
        last.next = entry
        last = entry
    return head


def _lift(call: _Entry) -> None:
    """Take a call and its return out of the list (the call is linearized)."""
    assert call.prev is not None
    assert call.next is not None
    assert call.match is not None
    call.prev.next = call.next
    call.next.prev = call.prev
    ret = call.match
    assert ret.prev is not None
    ret.prev.next = ret.next
    if ret.next is not None:
        ret.next.prev = ret.prev


def _unlift(call: _Entry) -> None:
    """Put a lifted call and its return back where they were (``_lift`` undone)."""
    ret = call.match
    assert ret is not None
    assert ret.prev is not None
    assert call.prev is not None
    assert call.next is not None
    ret.prev.next = ret
    if ret.next is not None:
        ret.next.prev = ret
    call.prev.next = call
    call.next.prev = call


def check(
    history: History, *, budget: int = DEFAULT_STEP_BUDGET, initial: ModelState | None = None
) -> CheckResult:
    """Whether ``history`` has a linearization the model accepts, from ``initial`` (an
    empty, never claimed namespace by default), within ``budget`` search steps."""
    ops = list(history)
    head = _entry_list(ops)
    state = ModelState() if initial is None else initial
    stack: list[_Frame] = []
    linearized = 0
    seen: set[tuple[int, ModelState]] = set()
    longest: tuple[int, ...] = ()
    entry = head.next
    steps = 0
    while head.next is not None:
        steps += 1
        if steps > budget:
            return CheckResult(Verdict.BUDGET_EXHAUSTED, steps - 1, budget, longest)
        assert entry is not None  # the list always ends with a return entry
        if entry.is_call:
            after = linearize(state, ops[entry.position], entry.position)
            marked = linearized | (1 << entry.position)
            if after is not None and (marked, after) not in seen:
                seen.add((marked, after))
                stack.append(_Frame(entry, state))
                state, linearized = after, marked
                _lift(entry)
                if len(stack) > len(longest):
                    longest = tuple(frame.entry.position for frame in stack)
                entry = head.next
                continue
            entry = entry.next
            continue
        if not stack:  # a return whose call could not be placed before it, in any order
            return CheckResult(Verdict.NOT_LINEARIZABLE, steps, budget, longest)
        frame = stack.pop()
        state = frame.state
        linearized &= ~(1 << frame.entry.position)
        _unlift(frame.entry)
        entry = frame.entry.next
    return CheckResult(Verdict.LINEARIZABLE, steps, budget, tuple(f.entry.position for f in stack))


def explain(history: History, result: CheckResult, *, limit: int = 25) -> str:
    """A failed check in words: the longest order found, the state it reaches, and the
    first operation (by return time) it could not place, with the calls around it."""
    ops = list(history)
    origin = min((op.invoked_ns for op in ops), default=0)
    lines = [
        f"{result.verdict.value}: {len(ops)} operations, {result.steps} steps "
        f"(budget {result.budget}); the longest order found places {len(result.longest)}"
    ]
    state = ModelState()
    for position in result.longest:
        state = linearize(state, ops[position], position) or state
    kv, mamba = dict(sorted(state.kv)), dict(sorted(state.mamba))
    lines.append(f"state after it: kv={kv} mamba={mamba} epoch={state.epoch}")
    placed = set(result.longest)
    unplaced = [p for p in range(len(ops)) if p not in placed]
    if unplaced:
        stuck = min(unplaced, key=lambda p: (ops[p].returned_ns or math.inf, p))
        start, end = ops[stuck].invoked_ns, ops[stuck].returned_ns or math.inf
        around = [
            p
            for p in unplaced
            if ops[p].invoked_ns <= end and (ops[p].returned_ns or math.inf) >= start
        ]
        lines.append(f"cannot place #{stuck}: {ops[stuck].describe(origin)}")
        lines.append("unplaced operations overlapping it:")
        lines += [f"  #{p}: {ops[p].describe(origin)}" for p in around[:limit]]
    return "\n".join(lines)


def assert_linearizable(history: History, *, budget: int = DEFAULT_STEP_BUDGET) -> CheckResult:
    """``check``, failing loudly both when no order exists and when the budget ran out."""
    result = check(history, budget=budget)
    if result.verdict is not Verdict.LINEARIZABLE:
        raise AssertionError(explain(history, result))
    return result
