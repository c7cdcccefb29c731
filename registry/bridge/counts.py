"""What one engine's follower did since it started (:class:`FollowerCounts`), read by
``Bridge.counts()``, ``pcr bridge`` and the metrics, and what it said once
(:class:`OnceLog`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field


@dataclass
class FollowerCounts:
    """What one engine's follower did since it started."""

    messages: int = 0
    batches: int = 0
    writes: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    clears: int = 0
    bad_messages: int = 0
    unknown_events: int = 0
    orphans: int = 0
    keyed_blocks: int = 0
    other_medium: int = 0
    other_groups: int = 0
    block_size_mismatch: int = 0
    empty_mamba_events: int = 0  # Mamba stores of a step without a checkpoint (no hash)
    unplaced_mamba_blocks: int = 0  # Mamba states whose position no known block gives
    unknown_removals: int = 0
    duplicates: int = 0
    gaps: int = 0
    replays: int = 0
    replay_failures: int = 0
    restarts: int = 0
    engine_restarts: int = 0
    resumed: int = 0
    redis_errors: int = 0
    renewals: int = 0
    probes: int = 0
    silent: int = 0
    superseded: int = 0
    internal_errors: int = 0
    rewrites: int = 0  # lost namespaces written again from the engine's picture
    rewritten_blocks: int = 0  # blocks those writes stored
    unpictured: int = 0  # stored blocks the picture had no room for
    refused_events: int = 0  # events over max_event_blocks, left undecoded
    refused_blocks: int = 0  # the blocks they listed
    dropped_messages: int = 0  # messages the byte-bounded queue had no room for
    dropped_bytes: int = 0  # their size
    split_batches: int = 0  # batches too large for one call, written in parts
    quota_refusals: int = 0  # calls the namespace's entry quota refused (stores then dropped)
    quota_refused_blocks: int = 0  # the blocks those calls would have stored
    disconnects: int = 0  # connections to the engine dropped (an oversize message, ...)
    applied_seq: int = -1  # the last engine seq written to Redis (-1: none yet)
    bad_kinds: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, int]:
        """Every count by name, each bad message kind as ``bad:KIND``."""
        values = {k: v for k, v in vars(self).items() if k != "bad_kinds"}
        values.update({f"bad:{kind}": n for kind, n in sorted(self.bad_kinds.items())})
        return values


class OnceLog:
    """One follower's messages, each logged once per key and named after the follower
    (``name``): an engine that keeps sending the same fault cannot flood the log."""

    def __init__(self, logger: logging.Logger, name: str) -> None:
        self.logger = logger
        self.name = name
        self.keys: set[str] = set()

    def __contains__(self, key: object) -> bool:
        return key in self.keys

    def once(self, key: str, message: str, *, warning: bool = False) -> None:
        """Log ``message`` (info, or a warning) unless ``key`` was logged already."""
        if key in self.keys:
            return
        self.keys.add(key)
        (self.logger.warning if warning else self.logger.info)(
            "%s: %s (logged once)", self.name, message
        )

    def exception(self, key: str, message: str) -> None:
        """Log ``message`` with the exception being handled, once per ``key``."""
        if key not in self.keys:
            self.keys.add(key)
            self.logger.exception("%s: %s", self.name, message)

    def again(self, key: str) -> None:
        """Let ``key`` be logged again (the condition it named has passed)."""
        self.keys.discard(key)
