"""The scoring service's request and response models, and the limits a request must keep.

``ScoreRequest`` states every rule the server checks in its JSON schema (exact integer
bounds, the one-of rule of the prompt, the namespace rule), so ``/openapi.json`` says what
is refused before anything is sent to Redis. ``ERROR_MEANINGS`` documents each status an
endpoint answers with.
"""

from __future__ import annotations

import functools
import math
import sys
import unicodedata
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from registry.core.keys import MAX_NAME_LENGTH, validate_namespace
from registry.core.types import MAX_HASH, NO_HASH

MAX_HASHES = 65_536
"""Most block hashes one ``/v1/score`` request may carry."""
MAX_TOKENS = 1_048_576
"""Most token ids one ``/v1/score`` request may carry."""
MAX_BLOCK_SIZE = 1 << 20
MAX_NAMESPACES = 4_096
"""Most entries in ``namespaces`` and in ``load``."""
MAX_SALT = 1_024
MAX_BODY_BYTES = 32 << 20
"""Larger request bodies are refused with 413 before they are parsed."""
INT64 = 2**63

Hash = Annotated[int, Field(ge=NO_HASH, le=MAX_HASH)]
Token = Annotated[int, Field(ge=-INT64, le=INT64 - 1)]
Namespace = Annotated[str, Field(min_length=1, max_length=MAX_NAME_LENGTH)]

NAMESPACE_RULE = (
    f"1 to {MAX_NAME_LENGTH} characters, none of them whitespace, a control or other "
    "non-printing character, '{' or '}'"
)


def _refused_by_namespace_rule(char: str) -> bool:
    """What ``registry.core.keys.validate_namespace`` refuses in a namespace."""
    return char in "{}" or char.isspace() or unicodedata.category(char)[0] == "C"


@functools.cache
def namespace_pattern() -> str:
    """``validate_namespace``'s character rule as a JSON Schema (ECMA-262) pattern: only
    characters it accepts, from start to end (computed from this Python's Unicode
    database, as the rule is). A class of what is accepted, not a negated class of what
    is refused: generators such as Hypothesis' expand a class character by character, and
    the refused ones are seven times as many. No range touches a surrogate."""
    ranges: list[list[int]] = []
    for code in range(sys.maxunicode + 1):
        if _refused_by_namespace_rule(chr(code)):
            continue
        if ranges and ranges[-1][1] == code - 1:
            ranges[-1][1] = code
        else:
            ranges.append([code, code])

    def spelled(code: int) -> str:  # BMP as \uXXXX; above it the character itself
        return f"\\u{code:04X}" if code <= 0xFFFF else chr(code)

    accepted = "".join(
        spelled(low) if low == high else f"{spelled(low)}-{spelled(high)}" for low, high in ranges
    )
    return f"^[{accepted}]*$"


def namespace_schema() -> dict[str, Any]:
    """The JSON schema of one namespace (an item of ``namespaces``, a key of ``load``)."""
    return {
        "type": "string",
        "minLength": 1,
        "maxLength": MAX_NAME_LENGTH,
        "pattern": namespace_pattern(),
        "description": f"a namespace: {NAMESPACE_RULE}",
    }


def _score_request_schema(schema: dict[str, Any]) -> None:
    """The rules the validators check, stated in ``ScoreRequest``'s JSON schema."""
    fields = schema["properties"]
    fields["namespaces"]["anyOf"][0]["items"] = namespace_schema()
    fields["load"]["anyOf"][0] = {
        "type": "object",
        "maxProperties": MAX_NAMESPACES,
        "propertyNames": namespace_schema(),
        "additionalProperties": {
            "type": "number",
            "minimum": -sys.float_info.max,
            "maximum": sys.float_info.max,
        },
    }
    absent = {"type": "null"}  # missing or null
    schema["oneOf"] = [
        {
            "title": "block_hashes",
            "required": ["block_hashes"],
            "properties": {
                "block_hashes": {"type": "array"},
                "token_ids": absent,
                "block_size": absent,
                "salt": absent,
            },
        },
        {
            "title": "token_ids with block_size",
            "required": ["token_ids", "block_size"],
            "properties": {
                "token_ids": {"type": "array"},
                "block_size": {"type": "integer"},
                "block_hashes": absent,
            },
        },
    ]


def _check_namespace(name: str) -> None:
    try:
        validate_namespace(name)
    except (TypeError, ValueError):
        raise ValueError(f"a namespace is {NAMESPACE_RULE}") from None  # not the name itself


class ScoreRequest(BaseModel):
    """A prompt as block hashes, or as token ids to hash; optionally the namespaces to
    score (default: every live node) and each node's load (ties go to the lowest)."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_score_request_schema)

    block_hashes: Annotated[list[Hash], Field(max_length=MAX_HASHES)] | None = Field(
        default=None,
        description=f"the prompt's block hashes, in [-1, 2^63-1] (at most {MAX_HASHES:,}); "
        "a sentinel (-1, 0) ends the prefix",
    )
    token_ids: Annotated[list[Token], Field(max_length=MAX_TOKENS)] | None = Field(
        default=None,
        description=f"token ids to hash instead (int64; at most {MAX_TOKENS:,}); needs block_size",
    )
    block_size: Annotated[int, Field(ge=1, le=MAX_BLOCK_SIZE)] | None = Field(
        default=None, description="tokens per block, with token_ids"
    )
    salt: Annotated[str, Field(max_length=MAX_SALT)] | None = Field(
        default=None, description="the engines' cache salt, with token_ids"
    )
    namespaces: Annotated[list[Namespace], Field(max_length=MAX_NAMESPACES)] | None = Field(
        default=None, description="score only these namespaces (default: every live node)"
    )
    load: Annotated[dict[Namespace, float], Field(max_length=MAX_NAMESPACES)] | None = Field(
        default=None, description="namespace -> load; among equal prefixes the lowest wins"
    )

    @field_validator("namespaces")
    @classmethod
    def _namespaces(cls, value: list[str] | None) -> list[str] | None:
        for name in value or ():
            _check_namespace(name)
        return value

    @field_validator("load")
    @classmethod
    def _load(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for name, figure in (value or {}).items():
            _check_namespace(name)
            if not math.isfinite(figure):
                raise ValueError("a load is a finite number")
        return value

    @model_validator(mode="after")
    def _one_prompt(self) -> ScoreRequest:
        if (self.block_hashes is None) == (self.token_ids is None):
            raise ValueError("give either block_hashes or token_ids (with block_size)")
        if self.token_ids is not None and self.block_size is None:
            raise ValueError("token_ids need block_size")
        if self.block_hashes is not None and (self.block_size or self.salt) is not None:
            raise ValueError("block_size and salt go with token_ids, not block_hashes")
        return self


class NodeScoreOut(BaseModel):
    kv_prefix: int = Field(description="leading blocks with KV cached")
    mamba_prefix: int = Field(description="leading blocks usable with Mamba state")
    usable: int = Field(description="what routing ranks by")


class ScoreReply(BaseModel):
    blocks: int = Field(description="the prompt's blocks scored (up to the first sentinel)")
    best: str | None = Field(description="the node to send the prompt to; null if none is live")
    nodes: dict[str, NodeScoreOut] = Field(description="per live namespace")


class NodeOut(BaseModel):
    namespace: str
    lease_left_s: float | None = Field(description="seconds until the lease runs out")
    kv_entries: int
    mamba_entries: int
    bridge_engine: str | None = Field(description="the engine feeding it, for pcr bridge")


class NodesReply(BaseModel):
    nodes: list[NodeOut]


class HealthReply(BaseModel):
    status: str
    redis: str
    scripts: str


class LiveReply(BaseModel):
    status: str


class ErrorReply(BaseModel):
    error: str = Field(description="the kind of error")
    detail: Any = Field(default=None, description="what was wrong; never the request's data")


ERROR_MEANINGS = {
    400: "a malformed HTTP request",
    404: "no endpoint at this path",
    405: "the endpoint does not take this method (see the Allow header)",
    408: "the request did not arrive in time",
    413: f"a body over {MAX_BODY_BYTES:,} bytes",
    422: "a body that is not JSON, or breaks the schema or the limits",
    431: "request headers over 16 KiB",
    500: "a registry fault an operator must fix",
    503: "Redis is unavailable, or no connection was free in time (retry)",
}


def documented(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI ``responses`` entry of an endpoint answering with these error statuses."""
    return {code: {"model": ErrorReply, "description": ERROR_MEANINGS[code]} for code in codes}


SCORE_ERRORS = documented(400, 408, 413, 422, 500, 503)
READ_ERRORS = documented(500, 503)
