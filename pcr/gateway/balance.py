"""How ``pcr gateway`` chooses a backend: the balance rule lives in
``registry.routing.balance`` (no I/O; ``pcr simulate --trace`` replays it too); here, what
only the gateway's command line and load exchange need beside it."""

from __future__ import annotations

import re

from registry.routing.balance import (
    BackendLoad,
    BalanceRule,
    Choice,
    Decayed,
    Kin,
    Reach,
    Weighed,
    cached_tokens,
    leader,
    prompt_root,
    ranked,
)

__all__ = [
    "POLICIES",
    "REPLICA_ID",
    "BackendLoad",
    "BalanceRule",
    "Choice",
    "Decayed",
    "Kin",
    "Reach",
    "Weighed",
    "cached_tokens",
    "leader",
    "prompt_root",
    "ranked",
]

REPLICA_ID = re.compile(r"[!-~]{1,200}")
"""A gateway replica's id: its field in ``pcr:gateway:load`` and the first word of what
it publishes on the load channel."""
POLICIES = ("prefix", "least-load", "round-robin")
"""``prefix``: the balance rule; ``least-load``: the rule without cached prefixes;
``round-robin``: each backend in turn (a baseline)."""
