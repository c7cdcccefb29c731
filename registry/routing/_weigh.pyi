"""Types of the optional C extension ``registry/routing/_weigh.c`` (``Weighed``'s
arithmetic; ``registry.routing.balance`` is its specification and fallback). Each
function answers ``NotImplemented`` for an input not of the plain types it reads."""

from typing import Any

def rows(
    names: dict[str, None],
    prompt_tokens: int,
    loads: Any,
    now: float,
    half_life: float,
    request_tokens: float,
    kv_usage_limit: float,
    queue_weight: float,
    kinned: Any,
    sent: Any,
    affinity_bound: float,
    load_type: type,
    decayed_type: type,
    /,
) -> Any: ...
def costed(
    rows: list[tuple[str, int, float, float, float, bool]],
    kin_terms: list[float | None] | None,
    prompt_tokens: int,
    cached: Any,
    kv: Any,
    spread_weight: float,
    affinity_weight: float,
    checkpoint_weight: float,
    leader: bool,
    choice: Any,
    /,
) -> Any: ...
def decide(
    backends: list[Any],
    steps: list[tuple[int, int]],
    slots: dict[str, int],
    pending: Any,
    far: Any,
    hashes: list[int],
    at: float,
    prompt_tokens: int,
    block_size: int,
    now: float,
    rule: Any,
    kinned: Any,
    sent: Any,
    tell: bool,
    load_type: type,
    decayed_type: type,
    choice: Any,
    reach: Any,
    /,
) -> Any: ...
