"""The batches one engine's follower has decoded and not yet written, and the
``bridge_apply`` calls that write them (:class:`PendingWrite`).

No call carries more than ``MAX_BLOCKS_PER_WRITE`` blocks: a script runs alone on the
server, and every router's call waits behind it. A batch with more blocks than that (a
prompt of thousands of blocks, or a hostile engine's single event of a million) is
written in parts (:func:`split_operations`), each call marked with its batch's seq and
the blocks of that batch written by its end, so that a call sent again (a lost reply, a
restarted bridge) applies once (``lua/bridge_apply.lua``, "Exactly once").
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from registry.bridge.counts import FollowerCounts
from registry.bridge.source import EngineSource
from registry.namespace.redis_registry import PrefixCacheRegistry

MAX_BLOCKS_PER_WRITE = 256
"""The most blocks one ``bridge_apply`` call carries. Measured on a real redis-server
(SLOWLOG, a 2-core machine under load): about 6 us of script time per stored or
removed block at best, so 256 blocks take 1.5-2 ms, 1,024 blocks 6-36 ms; 256 keeps
every call well under 10 ms even on a loaded server."""

STORE_FIELDS = 8  # "S", slot, map, first block id, n, engine hashes, own hashes, digests
REMOVE_FIELDS = 4  # "R", slot, n, engine hashes
ENGINE_WIDTH, OWN_WIDTH, DIGEST_WIDTH = 20, 19, 64  # packed widths (lua/bridge_apply.lua)


@dataclass
class WriteCall:
    """One ``bridge_apply`` call waiting to be sent: its operations, their blocks, and
    the position it reaches: engine seq ``seq`` (None: none) and, when it ends inside
    that seq's batch, the blocks of the batch written by its end (``part``)."""

    ops: list[Any]
    blocks: int
    seq: int | None
    part: int | None = None


def split_operations(
    ops: Sequence[Any], limit: int, room: int | None = None
) -> Iterator[tuple[list[Any], int]]:
    """``ops`` (``bridge_apply`` operations) cut into runs of at most ``limit`` blocks
    (the first of at most ``room``), in order, each with its blocks; a store or removal
    of more blocks is cut into consecutive operations of the same kind (the packed
    values sliced at their widths). A run ends right after its last block."""
    run: list[Any] = []
    blocks = 0
    room = limit if room is None or room <= 0 else room
    i = 0
    while i < len(ops):
        op = ops[i]
        width = _width(op)
        fields = list(ops[i : i + width])
        i += width
        n = int(fields[4]) if op == "S" else int(fields[2]) if op == "R" else 0
        if n == 0:
            run.extend(fields)
            continue
        done = 0
        while done < n:
            take = min(n - done, room - blocks)
            run.extend(_slice(fields, done, take))
            blocks += take
            done += take
            if blocks >= room:
                yield run, blocks
                run, blocks, room = [], 0, limit
    if run:
        yield run, blocks


def _width(op: Any) -> int:
    """The fields of the ``bridge_apply`` operation that starts with ``op``."""
    return STORE_FIELDS if op == "S" else REMOVE_FIELDS if op == "R" else 2 if op == "G" else 1


def without_stores(ops: Sequence[Any]) -> tuple[list[Any], int]:
    """``ops`` less their stores, and the blocks those stores carried: what is left to
    write of a call the namespace's entry quota refused (removals and clears, which no
    quota refuses, so that Redis never lists a block the engine has let go)."""
    kept: list[Any] = []
    dropped = 0
    i = 0
    while i < len(ops):
        op = ops[i]
        width = _width(op)
        if op == "S":
            dropped += int(ops[i + 4])
        else:
            kept.extend(ops[i : i + width])
        i += width
    return kept, dropped


def _slice(fields: list[Any], start: int, count: int) -> list[Any]:
    """Blocks ``start`` to ``start + count`` of a store or removal, as one operation."""
    if start == 0 and count == int(fields[4 if fields[0] == "S" else 2]):
        return fields
    if fields[0] == "R":
        slot, _, engines = fields[1:4]
        return ["R", slot, count, engines[start * ENGINE_WIDTH : (start + count) * ENGINE_WIDTH]]
    slot, map_name, first, _, engines, owns, digests = fields[1:8]
    return [
        "S",
        slot,
        map_name,
        int(first) + start,
        count,
        engines[start * ENGINE_WIDTH : (start + count) * ENGINE_WIDTH],
        owns[start * OWN_WIDTH : (start + count) * OWN_WIDTH],
        digests[start * DIGEST_WIDTH : (start + count) * DIGEST_WIDTH],
    ]


def _drop_blocks(ops: Sequence[Any], count: int) -> tuple[list[Any], int]:
    """``ops`` without their first ``count`` blocks, and how many were dropped."""
    if count <= 0:
        return list(ops), 0
    runs = split_operations(ops, count)
    first = next(runs, None)
    if first is None:
        return [], 0
    return [op for run, _ in runs for op in run], first[1]


class PendingWrite:
    """The ``bridge_apply`` operations of decoded batches waiting to be written: the
    open call (``ops``, ``blocks``, ``seq``, ``part``: whole batches, or part of a batch
    written in parts) and the calls closed before it (``queued``), oldest first.

    ``apply`` sends one call and counts what it changed; it raises the registry's
    errors (the follower decides whether to retry, restart or stop).
    """

    def __init__(
        self, registry: PrefixCacheRegistry, source: EngineSource, counts: FollowerCounts
    ) -> None:
        self.registry = registry
        self.source = source
        self.counts = counts
        k = registry.keys
        self.keys = (k.kv, k.mamba, k.meta, k.engine_blocks, k.quota)
        self.ops: list[Any] = []  # operations of the open call
        self.blocks = 0  # blocks they carry
        self.seq: int | None = None  # the last engine seq they include
        self.part: int | None = None  # the open call ends inside batch seq, after this many
        self.queued: deque[WriteCall] = deque()  # closed calls, oldest first
        self.batch_seq: int | None = None  # the batch being written in parts
        self.written = 0  # its blocks queued so far
        self.skip: tuple[int, int] | None = None  # (seq, blocks) a previous bridge wrote

    @property
    def empty(self) -> bool:
        """Whether nothing waits: no operation, no seq to record."""
        return not self.ops and self.seq is None and not self.queued

    @property
    def full(self) -> bool:
        """Whether enough blocks wait that a write should go out now."""
        return bool(self.queued) or self.blocks >= MAX_BLOCKS_PER_WRITE

    def clear(self) -> None:
        """Forget the calls that wait (written, or the namespace restarted); a batch
        being written in parts keeps its count, so that its next calls go on from it."""
        self.ops = []
        self.blocks = 0
        self.seq = None
        self.part = None
        self.queued.clear()

    def end_batch(self) -> None:
        """Forget the batch being written in parts (it is abandoned)."""
        self.batch_seq, self.written, self.skip = None, 0, None

    def resume_after(self, seq: int, part: int) -> None:
        """A previous bridge wrote ``part`` blocks of batch ``seq`` and no more: when it
        comes again (from the replay), those blocks are not sent again."""
        self.skip = (seq, part)

    def add(self, ops: Sequence[Any], blocks: int, seq: int, *, whole: bool = True) -> None:
        """Queue the operations of batch ``seq``, or of a piece of it (``whole``: they
        finish it). A batch of more than ``MAX_BLOCKS_PER_WRITE`` blocks (or given in
        pieces) is written in parts: it starts a call of its own, cut every
        ``MAX_BLOCKS_PER_WRITE`` blocks, each call marked with the batch's blocks
        written by its end; smaller batches share calls."""
        limit = MAX_BLOCKS_PER_WRITE
        in_parts = self.batch_seq == seq
        if not in_parts:
            if not whole or blocks > limit:
                self.close()
                self.batch_seq, self.written, in_parts = seq, 0, True
                self.counts.split_batches += 1
            elif self.blocks + blocks > limit:
                self.close()
        if in_parts and self.skip is not None and self.skip[0] == seq:
            ops, skipped = _drop_blocks(ops, self.skip[1] - self.written)
            self.written += skipped
            if self.written >= self.skip[1]:
                self.skip = None
        for run, n in split_operations(ops, limit, limit - self.blocks):
            if self.blocks >= limit:
                self.close()
            self.ops.extend(run)
            self.blocks += n
            if in_parts:
                self.written += n
            self.seq, self.part = seq, self.written if in_parts else None
        self.seq = seq
        self.part = self.written if in_parts and not whole else None
        if in_parts and whole:
            self.end_batch()

    def close(self) -> None:
        """Close the open call (when it holds anything) into the queue."""
        if self.ops or self.seq is not None:
            self.queued.append(WriteCall(self.ops, self.blocks, self.seq, self.part))
        self.ops, self.blocks, self.seq, self.part = [], 0, None, None

    def apply(
        self,
        ops: Sequence[Any],
        seq: int | None,
        block_size: int | None,
        groups: Sequence[Any] = (),
        part: int | None = None,
    ) -> None:
        """One ``bridge_apply`` call: ``ops`` up to engine seq ``seq`` (None: none, the
        call records the engine, endpoint and block size only; ``part``: the call ends
        inside that seq's batch, that many of its blocks written by then), after
        ``groups`` (the operation naming the engine's Mamba groups, or nothing)."""
        data = (
            "" if seq is None else str(seq),
            self.source.engine,
            self.source.endpoint,
            "" if block_size is None else str(block_size),
            "" if part is None or seq is None else str(part),
            *(groups if ops else ()),
            *ops,
        )
        stored, removed, unknown, cleared = self.registry.run_write(
            "bridge_apply", self.keys, False, data
        )
        counts = self.counts
        counts.writes += 1
        if seq is not None and part is None:
            counts.applied_seq = seq
        counts.blocks_stored += int(stored)
        counts.blocks_removed += int(removed)
        counts.unknown_removals += int(unknown)
        counts.clears += int(cleared)
