"""Which members of the node index are live: each checked against its own lease.

The node index ``pcr:nodes`` is a hint. Any node user may ``ZADD`` any member there
(ACLs control keys, not members), so a score says only what someone wrote: a node
pushed to 0 is not dead, a forged member with a far score is not live. The truth is
``lease_until`` in each namespace's own ``meta``, which only its owner writes (its
epoch-fenced ``claim``/``renew``; a node user's keys are its own namespace's only).

So a reader lists the index (``lua/live_nodes.lua``: members, scores and the server's
clock in one call) and calls a member live only while the lease it read from that
member's ``meta`` runs. ``LeaseBook`` remembers what it read, so a listing reads few
metas: a member is checked when it is new, when the lease read last has run out (its
owner has renewed since, or it is dead), and, once found without a live lease, again
only when its score moves (a claim announces) or ``RECHECK_S`` after the last check.
At most ``MAX_CHECKS`` metas are read per listing, those that keep the fleet first,
so a flood of forged members costs a reader a bounded amount per listing; ``pcr gc``
removes them. No I/O here: ``NodeIndex`` (sync) and ``AsyncPrefixRouter`` read the
index and the metas, each its own way.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from registry.core.keys import DEFAULT_KEY_PREFIX, NamespaceKeys
from registry.core.validation import text

MAX_CHECKS = 4096
"""Metas read per listing at most (``LeaseBook.due``); the rest wait for the next. A
reader's first listing of a larger fleet takes a listing per 4,096 namespaces."""
CHECK_BATCH = 1024
"""Metas read per round trip."""
RECHECK_S = 30.0
"""Seconds before a member found without a live lease is checked again when its score
has not moved. A namespace claimed again announces a higher score, read at once; only
one whose score someone pinned higher is seen this late."""


@dataclass(frozen=True, slots=True)
class Listing:
    """The node index as read at one moment: each valid member's score as Redis wrote it
    (in index order), the server's clock, and the members that are not namespaces
    (``skipped`` by the script, ``refused`` by the namespace rules here)."""

    scores: dict[str, bytes]
    now_ms: int
    skipped: int
    refused: list[str]


def as_bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def lease_command(meta_key: str) -> tuple[str, str, str]:
    """The read of one member's lease: ``HMGET meta lease_until`` (one reply shape on
    every client, HGET's is not a list on all of them)."""
    return ("HMGET", meta_key, "lease_until")


def lease_of(reply: Any) -> int:
    """A lease read by ``lease_command`` as ms (0: none, or not a number)."""
    value = reply[0] if isinstance(reply, list | tuple) else reply
    try:
        return int(value) if value is not None else 0
    except (TypeError, ValueError):
        return 0


@dataclass(frozen=True, slots=True)
class _Read:
    """What one check of a member found: its score then, its meta's lease end, and the
    server's clock at the listing the check was made for."""

    score: bytes
    lease_until: int
    at_ms: int


class LeaseBook:
    """What a reader read of each member's own lease, and which members to check next.
    Thread-safe: routers share it between threads."""

    def __init__(
        self,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        *,
        max_checks: int = MAX_CHECKS,
        recheck_s: float = RECHECK_S,
    ) -> None:
        self.key_prefix = key_prefix
        self.max_checks = max_checks
        self.recheck_ms = round(recheck_s * 1000)
        self.checks = 0
        """Metas read so far."""
        self.deferred = 0
        """Members the last listing left unchecked (over ``max_checks``): not live yet."""
        self.not_live = 0
        """Members of the last listing without a live lease of their own (dead, or
        written by someone who is not their owner): ``pcr gc`` removes them."""
        self._read: dict[str, _Read] = {}
        self._metas: dict[str, str] = {}  # listed namespace -> its meta key
        self._lock = threading.Lock()

    def parse(self, reply: Sequence[Any]) -> Listing:
        """``live_nodes`` ``list``'s reply as a ``Listing``; each name is checked against
        the namespace rules once while it stays listed."""
        flat, skipped, now = reply
        scores: dict[str, bytes] = {}
        refused: list[str] = []
        metas = self._metas
        for i in range(0, len(flat), 2):
            name = text(flat[i])
            if name not in metas:
                try:
                    key = NamespaceKeys(name, self.key_prefix).meta
                except (TypeError, ValueError):
                    refused.append(name)
                    continue
                with self._lock:
                    metas[name] = key
            scores[name] = as_bytes(flat[i + 1])
        return Listing(scores, int(now), int(skipped), refused)

    def meta_key(self, name: str) -> str:
        """The meta key of ``name``, a namespace of the last listing parsed."""
        return self._metas.get(name) or NamespaceKeys(name, self.key_prefix).meta

    def due(self, listing: Listing, *, every: bool = False) -> list[str]:
        """The members to check now, at most ``max_checks`` (``every``: all those not
        known live, no cap, for gc): first those whose lease read last has run out
        (renewed since, or just dead: the fleet stays whole), then new members, then
        those found without a live lease whose score moved, then those due again after
        ``RECHECK_S``; within each, the score nearest the server's clock first (an
        owner announces its lease end, a few seconds ahead; a flood far from it waits)."""
        now = listing.now_ms
        ranked: list[tuple[int, float, str]] = []
        with self._lock:
            read = self._read
            for name, score in listing.scores.items():
                seen = read.get(name)
                if seen is None:
                    rank = 1
                elif seen.lease_until > now:
                    continue  # live by the lease read last
                elif seen.lease_until > seen.at_ms:
                    rank = 0  # was live when read: renewed, or just ended
                elif every or seen.score != score:
                    rank = 2  # gc checks them all; else a claim since announced
                elif now - seen.at_ms >= self.recheck_ms:
                    rank = 3
                else:
                    continue
                ranked.append((rank, abs(_number(score) - now), name))
        ranked.sort()
        chosen = ranked if every else ranked[: self.max_checks]
        self.deferred = len(ranked) - len(chosen)
        return [name for _rank, _score, name in chosen]

    def learn(self, listing: Listing, names: Iterable[str], replies: Sequence[Any]) -> None:
        """Record the leases read (``lease_command`` replies, in ``names`` order) for
        ``listing``."""
        now = listing.now_ms
        with self._lock:
            for name, reply in zip(names, replies, strict=True):
                self._read[name] = _Read(listing.scores[name], lease_of(reply), now)
                self.checks += 1

    def split(self, listing: Listing) -> tuple[list[str], list[str]]:
        """(live, not live) members of ``listing``, in index order: live while the lease
        read from its own meta runs. Members no longer listed are forgotten."""
        now = listing.now_ms
        live: list[str] = []
        rest: list[str] = []
        with self._lock:
            read = self._read
            for name in [n for n in read if n not in listing.scores]:
                del read[name]
            metas = self._metas
            if len(metas) > len(listing.scores):
                for name in [n for n in metas if n not in listing.scores]:
                    del metas[name]
            not_live = 0
            for name in listing.scores:
                seen = read.get(name)
                if seen is not None and seen.lease_until > now:
                    live.append(name)
                else:
                    rest.append(name)
                    not_live += seen is not None
            self.not_live = not_live
        return live, rest


def _number(score: bytes) -> float:
    try:
        return float(score)
    except ValueError:
        return 0.0
