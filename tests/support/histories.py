"""Recording concurrent histories of one namespace's calls for the linearizability
checker (``tests.support.linearizability``): running each call on a registry with its
invoke and return times, the outcome rules (see the checker's module docstring), the
JSON events a client process of its own prints, and random calls over a small key space.

Run as ``python -m tests.support.histories URL NAMESPACE SEED``, this module is such a
client process (``child_main``): it claims the namespace and writes until it is killed,
printing each call's events as JSON lines for the parent's recorder.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from registry import PrefixCacheRegistry, RegistryBase, RegistryUnavailable, StaleEpochError
from tests.support.linearizability import (
    _CLEARS,
    FENCED,
    READS,
    Call,
    Operation,
    OpName,
    PrefixMatch,
    Status,
    Value,
)

# -- running calls on a registry, and recording them --------------------------------------------

CLAIM_LEASE_TTL = 600.0
"""Seconds of lease the histories' claims take: no lease runs out during a test."""


def _claim(registry: RegistryBase, call: Call) -> Value:
    if not isinstance(registry, PrefixCacheRegistry):
        raise TypeError(f"only a PrefixCacheRegistry claims, not {type(registry).__name__}")
    return registry.claim(CLAIM_LEASE_TTL)


_PERFORMERS: dict[OpName, Callable[[RegistryBase, Call], Value]] = {
    OpName.REGISTER_KV: lambda r, c: r.register_kv(list(c.block_ids), list(c.hashes)),
    OpName.EVICT_KV: lambda r, c: tuple(sorted(r.evict_kv(list(c.hashes)))),
    OpName.MATCH_KV_PREFIX: lambda r, c: PrefixMatch(*_listed(r.match_kv_prefix(list(c.hashes)))),
    OpName.REGISTER_MAMBA: lambda r, c: r.register_mamba(list(c.block_ids), list(c.hashes)),
    OpName.EVICT_MAMBA: lambda r, c: tuple(sorted(r.evict_mamba(list(c.hashes)))),
    OpName.MAMBA_BLOCK_IDS: lambda r, c: tuple(r.mamba_block_ids(list(c.hashes))),
    OpName.MATCH_MAMBA_FARTHEST: lambda r, c: r.match_mamba_farthest(list(c.hashes)),
    OpName.FIND_MAMBA_BACKOFF: lambda r, c: r.find_mamba_backoff(list(c.hashes), c.search_len),
    OpName.CLEAR_KV: lambda r, c: r.clear_kv(),
    OpName.CLEAR_MAMBA: lambda r, c: r.clear_mamba(),
    OpName.RESET: lambda r, c: r.reset(),
    OpName.CLAIM: _claim,
}


def _listed(match: tuple[list[int], int]) -> tuple[tuple[int, ...], int]:
    block_ids, last_hash = match
    return tuple(block_ids), last_hash


def perform(registry: RegistryBase, call: Call) -> Value:
    """Run ``call`` on ``registry``; its result as a history keeps it."""
    return _PERFORMERS[call.name](registry, call)


@dataclass(frozen=True)
class InFlight:
    """A call sent and not answered yet."""

    process: str
    call: Call
    invoked_ns: int


EventSink = Callable[[dict[str, Any]], None]


class HistoryRecorder:
    """Records calls from many threads (thread-safe), and the events of other processes'
    recorders (``absorb``): the history to check, and what is in flight meanwhile.
    ``sink`` gets every event as it happens (a child process prints them)."""

    def __init__(self, sink: EventSink | None = None) -> None:
        self.sink = sink
        self.dropped = 0
        self._operations: list[Operation] = []
        self._open: dict[tuple[str, int], InFlight] = {}
        self._tickets = itertools.count()
        self._lock = threading.Lock()

    def run(self, process: str, registry: RegistryBase, call: Call) -> Operation | None:
        """Run and record ``call``; the operation recorded, or None when it was dropped
        (it raised and had no effect). Other errors propagate: the test must see them."""
        ticket = self._begin(process, call)
        try:
            value = perform(registry, call)
        except StaleEpochError:
            if call.name not in FENCED:
                self._drop(process, ticket)
                raise
            return self._finish(process, ticket, Status.STALE, None)
        except RegistryUnavailable as exc:
            # A claim is its script and then the fleet-index join: any failure may follow
            # a claim that happened. A write knows whether it may have reached the server.
            maybe = call.name is OpName.CLAIM or (call.name in FENCED and exc.outcome_unknown)
            if maybe:
                return self._finish(process, ticket, Status.UNKNOWN, None)
            self._drop(process, ticket)
            return None
        except BaseException:
            self._drop(process, ticket)
            raise
        return self._finish(process, ticket, Status.OK, value)

    @contextlib.contextmanager
    def span(self, process: str, call: Call) -> Iterator[None]:
        """Record the block as one operation of ``call`` (a harness's fault, such as an
        empty restart): it takes effect at one instant inside; unknown if it raised."""
        ticket = self._begin(process, call)
        try:
            yield
        except BaseException:
            self._finish(process, ticket, Status.UNKNOWN, None)
            raise
        self._finish(process, ticket, Status.OK, None)

    def absorb(self, event: dict[str, Any]) -> None:
        """Take one event printed by another process's recorder (``print_event``)."""
        key = (str(event["process"]), int(event["ticket"]))
        with self._lock:
            if event["event"] == "invoke":
                call = decode_call(event["call"])
                self._open[key] = InFlight(key[0], call, int(event["ns"]))
                return
            begun = self._open.pop(key)
            if event["event"] == "drop":
                self.dropped += 1
                return
            status = Status(event["status"])
            returned = None if status is Status.UNKNOWN else int(event["ns"])
            value = decode_value(begun.call.name, event["value"])
            self._operations.append(
                Operation(key[0], begun.call, status, value, begun.invoked_ns, returned)
            )

    def abandon(self, process: str) -> None:
        """``process`` died: its writes in flight may have happened, its reads are dropped."""
        with self._lock:
            for key in [k for k in self._open if k[0] == process]:
                begun = self._open.pop(key)
                if begun.call.name in READS:
                    self.dropped += 1
                    continue
                op = Operation(process, begun.call, Status.UNKNOWN, None, begun.invoked_ns, None)
                self._operations.append(op)

    def history(self) -> list[Operation]:
        """The operations recorded so far, by invoke time (nothing may be in flight)."""
        with self._lock:
            if self._open:
                raise RuntimeError(f"calls still in flight: {list(self._open.values())}")
            return sorted(self._operations, key=lambda op: op.invoked_ns)

    def completed(self, process: str | None = None, status: Status | None = None) -> int:
        """How many operations were recorded (of ``process``, with ``status``, or all)."""
        with self._lock:
            return sum(
                1
                for op in self._operations
                if process in (None, op.process) and status in (None, op.status)
            )

    def in_flight(self) -> list[InFlight]:
        """The calls sent and not answered yet."""
        with self._lock:
            return list(self._open.values())

    def _begin(self, process: str, call: Call) -> int:
        ticket = next(self._tickets)
        with self._lock:
            invoked = time.monotonic_ns()  # taken under the lock: no event precedes its own
            self._open[(process, ticket)] = InFlight(process, call, invoked)
            call_text = encode_call(call)
            self._emit(
                {"event": "invoke", "process": process, "ticket": ticket, "call": call_text}
                | {"ns": invoked}
            )
        return ticket

    def _finish(self, process: str, ticket: int, status: Status, value: Value) -> Operation:
        with self._lock:
            returned = time.monotonic_ns()
            begun = self._open.pop((process, ticket))
            op = Operation(
                process,
                begun.call,
                status,
                value,
                begun.invoked_ns,
                None if status is Status.UNKNOWN else returned,
            )
            self._operations.append(op)
            self._emit(
                {"event": "return", "process": process, "ticket": ticket, "ns": returned}
                | {"status": status.value, "value": encode_value(value)}
            )
        return op

    def _drop(self, process: str, ticket: int) -> None:
        with self._lock:
            del self._open[(process, ticket)]
            self.dropped += 1
            self._emit({"event": "drop", "process": process, "ticket": ticket})

    def _emit(self, event: dict[str, Any]) -> None:
        if self.sink is not None:
            self.sink(event)


# -- events as JSON (a child process's history) ------------------------------------------------


def encode_call(call: Call) -> dict[str, Any]:
    """``call`` as JSON-ready values."""
    return {
        "name": call.name.value,
        "hashes": list(call.hashes),
        "block_ids": list(call.block_ids),
        "search_len": call.search_len,
        "epoch": call.epoch,
    }


def decode_call(raw: dict[str, Any]) -> Call:
    """The ``Call`` that ``encode_call`` wrote."""
    return Call(
        OpName(raw["name"]),
        tuple(raw["hashes"]),
        tuple(raw["block_ids"]),
        int(raw["search_len"]),
        raw["epoch"],
    )


def encode_value(value: Value) -> Any:
    """A result as JSON-ready values."""
    if isinstance(value, PrefixMatch):
        return {"block_ids": list(value.block_ids), "last_hash": value.last_hash}
    if isinstance(value, tuple):
        return list(value)
    return value


def decode_value(name: OpName, raw: Any) -> Value:
    """The result of a ``name`` operation that ``encode_value`` wrote."""
    if raw is None:
        return None
    if name is OpName.MATCH_KV_PREFIX:
        return PrefixMatch(tuple(raw["block_ids"]), int(raw["last_hash"]))
    if isinstance(raw, list):
        return tuple(raw)
    return int(raw)


def print_event(event: dict[str, Any]) -> None:
    """A recorder sink: one JSON line per event on stdout, flushed at once (the parent
    must have every invoke before the call goes out)."""
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


# -- the workload: a handful of hashes, so that operations interact -----------------------------

PROMPTS = ((101, 102, 103, 104), (101, 102, 105, 106))
"""Two prompts sharing two blocks: six hashes in all."""
KEY_SPACE = tuple(sorted({h for prompt in PROMPTS for h in prompt}))
BLOCK_IDS = (1, 2, 3)


WRITE_WEIGHTS = {
    OpName.REGISTER_KV: 35,
    OpName.EVICT_KV: 20,
    OpName.REGISTER_MAMBA: 20,
    OpName.EVICT_MAMBA: 15,
    OpName.CLEAR_KV: 4,
    OpName.CLEAR_MAMBA: 3,
    OpName.RESET: 3,
}
"""How often each write comes up (clears are rare: they make the rest easy to explain)."""


def random_write(rng: random.Random, epoch: int | None, *, clears: bool = True) -> Call:
    """A write on the small key space, carrying ``epoch`` (no clears unless ``clears``)."""
    names = [n for n in WRITE_WEIGHTS if clears or n not in _CLEARS]
    name = rng.choices(names, [WRITE_WEIGHTS[n] for n in names])[0]
    if name in _CLEARS:
        return Call(name, epoch=epoch)
    prompt = rng.choice(PROMPTS)
    if name is OpName.REGISTER_KV:
        first = rng.randrange(3)
        hashes = prompt[first : rng.randint(first + 1, len(prompt))]
    elif name is OpName.REGISTER_MAMBA:
        hashes = tuple(rng.sample(prompt, rng.randint(1, 2)))
    else:
        hashes = tuple(rng.sample(KEY_SPACE, rng.randint(1, 2)))
    ids: tuple[int, ...] = ()
    if name in (OpName.REGISTER_KV, OpName.REGISTER_MAMBA):
        ids = tuple(rng.choice(BLOCK_IDS) for _ in hashes)
    return Call(name, hashes, ids, epoch=epoch)


def random_read(rng: random.Random) -> Call:
    """A read on the small key space."""
    roll = rng.random()
    prompt = rng.choice(PROMPTS)
    if roll < 0.35:
        return Call(OpName.MATCH_KV_PREFIX, prompt)
    if roll < 0.65:
        return Call(OpName.MAMBA_BLOCK_IDS, KEY_SPACE)
    if roll < 0.85:
        return Call(OpName.MATCH_MAMBA_FARTHEST, prompt)
    return Call(OpName.FIND_MAMBA_BACKOFF, prompt, search_len=rng.randint(1, 4))


# -- a client process of its own -----------------------------------------------------------------

CHILD_MAX_WRITES = 20_000
"""A child writes at most this many times (it is meant to be killed long before)."""


def child_main(argv: Sequence[str] | None = None) -> None:
    """Print ``{"event": "ready"}``, wait for a line on stdin, then claim the namespace
    and write until killed, printing every event. A write of unknown outcome does not
    stop it; once fenced (or its claim failed) it waits, for the kill or for stdin to
    close, and writes no more."""
    parser = argparse.ArgumentParser(description=child_main.__doc__)
    parser.add_argument("url")
    parser.add_argument("namespace")
    parser.add_argument("seed", type=int)
    parser.add_argument("--process", default="child")
    parser.add_argument("--timeout", type=float, default=0.5, help="socket timeouts (s)")
    args = parser.parse_args(argv)
    registry = PrefixCacheRegistry.from_url(
        args.url, args.namespace, socket_timeout=args.timeout, socket_connect_timeout=args.timeout
    )
    recorder = HistoryRecorder(sink=print_event)
    rng = random.Random(args.seed)
    try:
        print_event({"event": "ready"})
        if not sys.stdin.readline():
            return  # the parent went away before saying go
        claimed = recorder.run(args.process, registry, Call(OpName.CLAIM))
        ok = claimed is not None and claimed.status is Status.OK
        for _ in range(CHILD_MAX_WRITES if ok else 0):
            op = recorder.run(args.process, registry, random_write(rng, registry.epoch))
            if op is not None and op.status is Status.STALE:
                break
        sys.stdin.read()  # parked: returns when the parent closes stdin (or dies)
    finally:
        registry.client.close()


if __name__ == "__main__":
    child_main()
