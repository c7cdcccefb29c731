"""The truth routing is checked against: a prompt's prefixes computed straight from a
namespace's own maps (what ``lua/score.lua`` and a fleet view must both answer)."""

from __future__ import annotations

from collections.abc import Sequence


def direct(
    maps: tuple[dict[int, int], dict[int, int]], prompt: Sequence[int], *, hybrid: bool
) -> tuple[int, int]:
    """(KV prefix, Mamba-aware prefix) of ``prompt`` computed from a namespace's maps:
    the KV prefix ends at the first hash without a KV entry; the Mamba prefix is one past
    the farthest position inside it with a Mamba entry (0 with ``hybrid`` off)."""
    kv, mamba = maps
    end = 0
    while end < len(prompt) and prompt[end] in kv:
        end += 1
    farthest = 0
    if hybrid:
        for position in range(end):
            if prompt[position] in mamba:
                farthest = position + 1
    return end, farthest


def chain_shaped(kv: dict[int, int], prompt: Sequence[int]) -> bool:
    """Whether the prompt's hashes held in ``kv`` are a prefix of it: what the exact
    router's binary search assumes (the parent chain)."""
    held = [h in kv for h in prompt]
    return held == sorted(held, reverse=True)
