"""What bounds one engine's cost to the bridge and to Redis, whatever it publishes: the
largest message read (``max_message_bytes``, ZeroMQ's ``MAXMSGSIZE``), the bytes
queued between the socket and the writes (:class:`Backlog`), the largest event taken
(``max_event_blocks``), and the pieces a large batch is hashed and written in
(:func:`pieces`), so that the bridge keeps serving its other engines meanwhile.
No I/O."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from registry.bridge.bridge_events import BlockRemoved, BlockStored, Event, EventBatch
from registry.bridge.sequence import Frames

DEFAULT_MAX_EVENT_BLOCKS = 262_144
"""Blocks one event may list. An engine stores or removes at most what its cache holds,
and a GPU's prefix cache rarely holds more than 2^18 blocks (an 80 GB card with an 8B
model holds about 35,000 16-token blocks); it is also what the bridge's picture of an
engine holds (``registry.bridge.picture.PICTURE_BLOCKS``). Raise it for engines with
tiny blocks (SGLang's page size 1) and very long prompts."""

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
"""Bytes one published message may have: a 262,144-block event of 16-token blocks is
about 15-25 MiB of msgpack. A larger message is refused by ZeroMQ as it arrives
(``MAXMSGSIZE``; the publisher's connection is dropped and reconnected), before the
bridge holds it: the engine's next message shows the gap."""

DEFAULT_MAX_QUEUE_BYTES = 256 << 20
"""Bytes of messages one engine may have waiting between the socket and the writes
(while Redis is slow or away, or a large batch is being written)."""


class Backlog:
    """One engine's messages waiting to be applied, bounded in bytes: a message that
    does not fit is dropped (``put`` says so; the caller counts and logs it). The
    messages the bridge puts back (a replay's, one to apply again) always fit."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.messages: deque[Frames] = deque()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self.messages)

    def __bool__(self) -> bool:
        return bool(self.messages)

    def put(self, frames: Frames) -> bool:
        """Queue a received message; False (not queued) when it does not fit."""
        size = _size(frames)
        if self.messages and self.bytes + size > self.max_bytes:
            return False
        self.messages.append(frames)
        self.bytes += size
        return True

    def put_back(self, messages: list[Frames]) -> None:
        """Queue ``messages`` in front, in their order (a replay, a message to retry)."""
        self.messages.extendleft(reversed(messages))
        self.bytes += sum(map(_size, messages))

    def take(self) -> Frames:
        """The oldest message, removed."""
        frames = self.messages.popleft()
        self.bytes -= _size(frames)
        return frames

    def clear(self) -> None:
        self.messages.clear()
        self.bytes = 0


def _size(frames: Frames) -> int:
    return sum(len(f) for f in frames)


def pieces(batch: EventBatch, limit: int) -> list[EventBatch]:
    """``batch`` as consecutive batches of at most ``limit`` listed blocks, each hashed
    and written before the next: a store or removal of more blocks is cut into
    consecutive events (a store's piece chained from the last block of the piece
    before, its tokens sliced with its blocks). A batch within the limit, or holding a
    store that lists fewer blocks than its tokens span (a Mamba group's, placed by the
    batch's other events), stays whole."""
    if batch.blocks() <= limit or any(
        isinstance(e, BlockStored)
        and e.block_hashes
        and (e.kv_cache_spec_kind == "mamba" or len(e.token_ids) % len(e.block_hashes))
        for e in batch.events
    ):
        return [batch]
    out: list[EventBatch] = []
    run: list[Event] = []
    blocks = 0
    for event in batch.events:
        for part in _cut(event, limit):
            n = len(part.block_hashes) if isinstance(part, (BlockStored, BlockRemoved)) else 0
            if run and blocks + n > limit:
                out.append(EventBatch(batch.ts, tuple(run), batch.data_parallel_rank, 0))
                run, blocks = [], 0
            run.append(part)
            blocks += n
    out.append(EventBatch(batch.ts, tuple(run), batch.data_parallel_rank, 0))
    first = out[0]  # the batch's counts of unknown and refused events go with it once
    out[0] = EventBatch(
        first.ts,
        first.events,
        first.data_parallel_rank,
        batch.unknown,
        batch.refused,
        batch.refused_blocks,
    )
    return out


def _cut(event: Event, limit: int) -> Iterator[Event]:
    """``event`` as events of at most ``limit`` blocks (itself when it is that small)."""
    if isinstance(event, BlockRemoved) and len(event.block_hashes) > limit:
        for i in range(0, len(event.block_hashes), limit):
            yield BlockRemoved(event.block_hashes[i : i + limit], event.medium, event.group_idx)
    elif isinstance(event, BlockStored) and len(event.block_hashes) > limit:
        hashes = event.block_hashes
        size = len(event.token_ids) // len(hashes)
        parent = event.parent_block_hash
        for i in range(0, len(hashes), limit):
            part = hashes[i : i + limit]
            yield BlockStored(
                block_hashes=part,
                parent_block_hash=parent,
                token_ids=event.token_ids[i * size : (i + len(part)) * size],
                block_size=event.block_size,
                lora_id=event.lora_id,
                medium=event.medium,
                group_idx=event.group_idx,
                kv_cache_spec_kind=event.kv_cache_spec_kind,
                lora_name=event.lora_name,
                salt=event.salt if i == 0 else None,
                keyed=event.keyed,
            )
            parent = part[-1]
    else:
        yield event
