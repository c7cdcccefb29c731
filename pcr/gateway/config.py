"""What ``pcr gateway`` is told: ``GatewayConfig``, checked when it is made, so a bad
value fails before the gateway opens anything."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from pcr.gateway.balance import POLICIES, REPLICA_ID, BalanceRule
from pcr.gateway.pending import PendingBounds
from registry.core.validation import checked_number, is_number
from registry.fleet.membership import validate_engine_url


@dataclass(frozen=True)
class GatewayConfig:
    """What ``pcr gateway`` is told (``pcr gateway --help`` says each in words)."""

    backends: Mapping[str, str] = field(default_factory=dict)
    """Namespace -> engine base URL, from the command line or a config file; the engine
    table in Redis (``pcr bridge --engine-url``) adds more."""
    tokenizer: str | None = None
    max_model_len: int | None = None
    """The longest prompt in tokens the engines take (else the model's ``config.json``
    beside the tokenizer, else none): longer ones are refused (400) before they are
    tokenized (``pcr.gateway.tokens``)."""
    block_size: int = 16
    policy: str = "prefix"
    rule: BalanceRule = field(default_factory=BalanceRule)
    pending: PendingBounds = field(default_factory=PendingBounds)
    """How long and how much the blocks of requests in flight count as cached where they
    were sent (``pcr.gateway.pending``; ``ttl`` 0: not at all)."""
    replica_id: str = ""
    scrape_interval: float = 1.0
    share_interval: float = 0.1
    share_batch: float = 0.05
    """Seconds a request's start or end waits to be told to the other replicas, with every
    other change of that window in one exchange (``pcr.gateway.exchange``)."""
    discover_interval: float = 2.0
    registry_timeout: float = 0.25
    connect_timeout: float = 2.0
    upstream_timeout: float = 600.0
    announced: bool = True
    """Also route to the engines announced in Redis (``pcr bridge --engine-url``); False:
    only to ``backends``."""
    view: bool = True
    """Score from the fleet's view in this process (``registry.fleet.view``, fed by the
    change records the writes publish): no Redis round trip per request. False: ask
    Redis on every request (the async router)."""
    backend_ca_certs: str | None = None
    """PEM CA certificates that ``https://`` engines' certificates are verified against
    (None: the system's CAs)."""
    backend_certfile: str | None = None
    """A PEM client certificate for engines that ask for one (mutual TLS), its key in
    ``backend_keyfile`` or in the same file."""
    backend_keyfile: str | None = None
    backend_api_key: str | None = field(default=None, repr=False)
    """The key engines started with ``--api-key`` want: sent to them as
    ``Authorization: Bearer KEY`` on every request (proxied, ``/v1/models``,
    ``/metrics``), in place of any the client sent (None: the client's passes through
    when the gateway has no keys of its own)."""
    tenant_salts: bool = True
    """With API keys that name tenants (``pcr.web.auth``): each tenant's requests go to
    the engines with a ``cache_salt`` of that tenant's own (``tokens.tenant_salt``), so no
    tenant's prompt is ever served from, or timed against, another tenant's cache. False:
    tenants share the engines' caches (a common system prompt hits for all)."""

    def __post_init__(self) -> None:
        if not isinstance(self.view, bool):
            raise TypeError("view must be True or False")
        if not isinstance(self.announced, bool):
            raise TypeError("announced must be True or False")
        if not isinstance(self.pending, PendingBounds):
            raise TypeError("pending must be a PendingBounds")
        if not isinstance(self.tenant_salts, bool):
            raise TypeError("tenant_salts must be True or False")
        if self.backend_api_key is not None:
            check_backend_key(self.backend_api_key)
        for namespace, url in self.backends.items():
            validate_engine_url(url)
            if not namespace:
                raise ValueError("a backend needs a namespace")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}")
        if self.replica_id and not REPLICA_ID.fullmatch(self.replica_id):
            raise ValueError("a replica id is 1 to 200 printable ASCII characters, no spaces")
        checked_number(self.block_size, "block_size", 1, 1 << 20, integer=True)
        if self.max_model_len is not None:
            checked_number(self.max_model_len, "max_model_len", 1, 1 << 40, integer=True)
        for name in (
            "share_interval",
            "share_batch",
            "discover_interval",
            "registry_timeout",
            "connect_timeout",
            "upstream_timeout",
        ):
            value = getattr(self, name)
            if not is_number(value) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a positive finite number of seconds")
        if not is_number(self.scrape_interval) or not 0 <= self.scrape_interval < math.inf:
            raise ValueError("scrape_interval must be a finite number of seconds >= 0")


def check_backend_key(key: object) -> str:
    """A key for engines: printable ASCII without spaces (it travels in a header)."""
    if not isinstance(key, str):
        raise TypeError("backend_api_key must be a string")
    if not key or len(key) > 4096 or not all("!" <= c <= "~" for c in key):
        raise ValueError(
            "backend_api_key must be 1 to 4,096 printable ASCII characters without spaces"
        )
    return key
