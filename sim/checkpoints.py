"""Where a simulated node keeps Mamba state, and how far a hit may reach.

Two rules (``FleetConfig.mamba_checkpoints``, ``pcr simulate --mamba-checkpoints``):

``vllm`` (the default), as vLLM 0.32 does with prefix caching (``mamba_cache_mode``
``"align"``, ``prefix_cache_retention_interval`` 0): a prefill keeps the Mamba state at
the prompt's replay boundary, ``floor((len - 1) / block) * block`` tokens, and at the
shared-prefix junction, where a request's KV hit reaches further than its Mamba hit (the
state there is what the next request sharing that prefix restores). States at other step
ends are transient: the engine overwrites them. A hit never covers the prompt's last
token (it is computed again for the logits), so it ends at the replay boundary at most.

``last-block``: the state at the prompt's last full block only, and hits up to every full
block (the simulation's behaviour before the ``vllm`` rule).
"""

from __future__ import annotations

from dataclasses import dataclass

MAMBA_CHECKPOINTS = ("vllm", "last-block")
"""The rules, the default first."""


@dataclass(frozen=True)
class Prefill:
    """What one prompt reuses and where it keeps Mamba state (in blocks)."""

    kv_hit: int
    """Leading blocks whose KV the engine reuses."""
    usable: int
    """Leading blocks it skips: the farthest Mamba state within ``kv_hit``."""
    checkpoints: tuple[int, ...]
    """Indexes of the blocks whose Mamba state it keeps, ascending."""


def hit_limit(rule: str, tokens: int, block_size: int) -> int:
    """How many leading blocks of a ``tokens``-token prompt a hit may cover."""
    if rule == "vllm":
        return max(tokens - 1, 0) // block_size
    return tokens // block_size


def prefill(rule: str, tokens: int, block_size: int, matched: int, usable: int) -> Prefill:
    """The rule applied to a prompt whose first ``matched`` blocks are cached (KV) and whose
    farthest Mamba state within ``min(matched, hit_limit)`` blocks ends block ``usable``."""
    limit = hit_limit(rule, tokens, block_size)
    kv_hit = min(matched, limit)
    if usable > kv_hit:
        raise ValueError(f"usable = {usable} is past the KV hit of {kv_hit} blocks")
    if rule == "last-block":
        full = tokens // block_size
        return Prefill(kv_hit, usable, (full - 1,) if full else ())
    if rule != "vllm":
        raise ValueError(f"mamba_checkpoints must be one of {', '.join(MAMBA_CHECKPOINTS)}")
    points = set()
    if limit:
        points.add(limit - 1)  # the replay boundary
    if kv_hit > usable:
        points.add(kv_hit - 1)  # the shared-prefix junction
    return Prefill(kv_hit, usable, tuple(sorted(points)))
