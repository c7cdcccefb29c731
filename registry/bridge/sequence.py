"""Where one engine's stream stands (:class:`EngineSequence`): the last seq applied and
its payload's fingerprint, the replayed seqs the subscription may deliver again, and
what tells a gap, a copy and a restarted engine apart. No I/O."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

Frames = list[bytes]
"""One published message: [topic, seq (8 bytes, big-endian), payload]."""
Replayed = list[tuple[int, bytes]]
"""A replay's answer: (seq, payload) pairs, oldest first."""
Replayer = Callable[[int], "Replayed | None"]
"""Asks an engine's replay socket for its batches from a seq on (None: no answer)."""

SEQ_LIMIT = 2**64
WINDOW_LIMIT = 100_000
"""Replayed seqs remembered to recognise the subscription's copies of them."""


def fingerprint(payload: bytes) -> bytes:
    """What tells two payloads of one seq apart (a replayed batch from a new one)."""
    return hashlib.blake2b(payload, digest_size=16).digest()


def contiguous(batches: Replayed) -> Replayed:
    """The leading run of consecutive seqs of a replay."""
    run: Replayed = []
    for seq, payload in batches:
        if run and seq != run[-1][0] + 1:
            break
        run.append((seq, payload))
    return run


def as_messages(topic: str, run: Replayed) -> list[Frames]:
    """Replayed batches as the messages the subscription would have delivered."""
    prefix = topic.encode()
    return [[prefix, seq.to_bytes(8, "big"), payload] for seq, payload in run]


class EngineSequence:
    """One engine's sequence numbers as the bridge has applied them.

    ``last`` is the last engine seq applied (or skipped as bad; None before the first),
    ``last_fingerprint`` its payload's fingerprint (None after a resume): a probe checks
    the engine's replay still holds that very batch, else the engine restarted.
    ``window`` holds the seqs applied from a replay that the subscription may deliver
    again, with their payloads' fingerprints; it is emptied once the subscription
    passes the last of them (``window_end``).
    """

    def __init__(self) -> None:
        self.last: int | None = None
        self.last_fingerprint: bytes | None = None
        self.window: dict[int, bytes] = {}
        self.window_end = -1

    def next_seq(self) -> int:
        """The seq to ask a replay for: the one after the last applied (0 at first)."""
        return 0 if self.last is None else min(self.last + 1, SEQ_LIMIT - 1)

    def follows(self, seq: int) -> bool:
        """Whether ``seq`` is the one expected next (any seq is, before the first)."""
        return self.last is None or seq == self.last + 1

    def is_copy(self, seq: int, payload: bytes) -> bool:
        """Whether an out-of-sequence message is one a replay brought already: the same
        seq with the same payload (another payload comes from a restarted engine)."""
        return not self.follows(seq) and self.window.get(seq) == fingerprint(payload)

    def advance(self, seq: int, payload: bytes) -> None:
        """``seq`` is applied (or skipped as bad)."""
        self.last = seq
        self.last_fingerprint = fingerprint(payload)

    def passed(self, seq: int) -> None:
        """The subscription delivered ``seq``: past the replay, no copies are to come."""
        if self.window and seq > self.window_end:
            self.window = {}

    def remember(self, run: Replayed) -> None:
        """Replayed batches, so that the subscription's copies of them are recognised."""
        self.window.update((seq, fingerprint(payload)) for seq, payload in run)
        self.window_end = max(self.window_end, run[-1][0])
        if len(self.window) > WINDOW_LIMIT:  # a subscription that never catches up
            for seq in sorted(self.window)[: len(self.window) - WINDOW_LIMIT]:
                del self.window[seq]

    def forget_engine(self) -> None:
        """The engine restarted: the old process's messages are no copies of anything."""
        self.window, self.window_end = {}, -1

    def replay_shows_restart(self, run: Replayed) -> bool:
        """Whether a probe's replay ``run`` comes from a restarted engine: it no longer
        holds the batch applied last, or holds another payload under its seq."""
        last, known = self.last, self.last_fingerprint
        if last is None:
            return False
        return not run or (
            run[0][0] == last and known is not None and fingerprint(run[0][1]) != known
        )
