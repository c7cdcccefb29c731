"""What every scorer answers: ``NodeScore``, and the rule of which prefix ranks a node.

A fleet view (``registry.fleet.view``) and the routers (``registry.routing``) score the
same way, so the score and the ``hybrid`` rule live below both.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NodeScore:
    """How much of a prompt one live node has cached, in blocks."""

    namespace: str
    kv_prefix: int  # leading blocks with KV cached
    mamba_prefix: int  # leading blocks usable with Mamba state (farthest checkpoint <= kv_prefix);
    # 0 from a router built with hybrid=False, which skips the Mamba lookup
    usable: int  # what routing ranks by: what this node's engine can reuse (see Hybrid)

    @classmethod
    def of(cls, namespace: str, kv_prefix: int, mamba_prefix: int, usable: int) -> NodeScore:
        """A score built without the frozen dataclass's per-field checks: a router
        builds one per live member on every decision (hundreds), from checked values."""
        score = object.__new__(cls)
        fields = score.__dict__
        fields["namespace"] = namespace
        fields["kv_prefix"] = kv_prefix
        fields["mamba_prefix"] = mamba_prefix
        fields["usable"] = usable
        return score


def checked_hybrid(hybrid: object) -> bool | None:
    """``hybrid`` as a router takes it: None (the default) ranks each namespace by what
    its engine can reuse: the Mamba-aware prefix where the namespace holds Mamba state
    (a hybrid model's node: meta's ``mamba_seen``, set by its first Mamba entry since
    its owner's claim), the KV prefix where it never held any (an attention-only node).
    True ranks every namespace by the Mamba-aware prefix, False by the KV prefix (and
    skips the Mamba lookup)."""
    if hybrid is not None and not isinstance(hybrid, bool):
        raise TypeError(f"hybrid must be True, False or None, not {type(hybrid).__name__}")
    return hybrid
