"""What a bridge follows: one engine, its sockets and the namespace it feeds
(:class:`EngineSource`), and the checks of the bridge's arguments."""

from __future__ import annotations

from dataclasses import dataclass

from registry.core.keys import validate_namespace
from registry.core.validation import checked_number, is_number
from registry.fleet.membership import validate_engine_url

ENGINES = ("vllm", "sglang")
MAX_BLOCK_SIZE = 1 << 20
ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")


def checked_endpoint(value: object, what: str) -> str:
    """``value`` if it is a ZeroMQ endpoint (tcp://HOST:PORT, ipc://PATH, inproc://NAME),
    else ``TypeError`` or ``ValueError`` naming ``what``."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, not {type(value).__name__}")
    scheme, _, address = value.partition("://")
    host, _, port = address.rpartition(":")
    if (
        not value.startswith(ENDPOINT_SCHEMES)
        or len(value) > 500
        or any(c.isspace() for c in value)
        or not address
        or (
            scheme == "tcp"
            and not (host and port.isdigit() and port.isascii() and 1 <= int(port) <= 65535)
        )
    ):
        raise ValueError(
            f"{what} {value!r} must be a ZeroMQ endpoint such as tcp://HOST:PORT "
            "(tcp://, ipc:// or inproc://, no spaces)"
        )
    return value


def checked_seconds(value: object, what: str) -> float:
    """A duration argument, checked: a number of seconds, 1 ms to a year."""
    return float(checked_number(value, what, 0.001, 86_400 * 365, unit=" s"))


@dataclass(frozen=True)
class EngineSource:
    """One engine the bridge follows, and the namespace it feeds."""

    namespace: str
    endpoint: str
    replay_endpoint: str | None = None
    engine: str = "vllm"
    topic: str = ""
    block_size: int | None = None
    media: tuple[str, ...] = ("GPU",)
    engine_url: str | None = None
    """The engine's HTTP base URL, announced beside its lease for gateways (``pcr gateway``)."""

    def __post_init__(self) -> None:
        validate_namespace(self.namespace)
        if self.engine_url is not None:
            validate_engine_url(self.engine_url)
        checked_endpoint(self.endpoint, "endpoint")
        if self.replay_endpoint is not None:
            checked_endpoint(self.replay_endpoint, "replay endpoint")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, not {self.engine!r}")
        if not isinstance(self.topic, str):
            raise TypeError(f"topic must be a str, not {type(self.topic).__name__}")
        if len(self.topic) > 500:
            raise ValueError("topic must be a str of at most 500 characters")
        if self.block_size is not None and (
            not is_number(self.block_size, integer=True)
            or not 1 <= self.block_size <= MAX_BLOCK_SIZE
        ):
            raise ValueError(
                f"block_size must be an int in [1, {MAX_BLOCK_SIZE}], not {self.block_size!r}"
            )
        media: object = self.media  # checked at run time
        if (
            not isinstance(media, tuple)
            or not media
            or len(media) > 8
            or not all(isinstance(m, str) and m and m.isprintable() for m in media)
            or len(set(media)) != len(media)
        ):
            raise ValueError(
                f"media must be a tuple of 1 to 8 distinct medium names such as ('GPU',), "
                f"not {media!r}"
            )
