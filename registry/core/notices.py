"""Eviction notices: what a Mamba removal publishes, and how to read it back.

Each script that removes Mamba entries numbers one notice per call with
``HINCRBY meta notice_seq 1``, appends it to the capped stream
``pcr:{NS}:mamba-evictions`` (fields ``seq``, ``inc``, ``kind``, ``pairs``, ``truncated``,
``t``) and publishes it on the channel ``pcr:{NS}:mamba-evicted`` as one text line::

    1796024288853142@1796024288853101482 evict @1796024288861 17:8815920390121 18:77123
    1796024288853143@1796024288853101482 clear @1796024288874
    ^ seq            ^ incarnation         ^ kind ^ published ^ block_id:hash pairs

``@<ms>`` (``t`` in the stream) is the server's clock when the notice was published, so a
listener can tell how long a notice took to free its slot; notices of older scripts have
none and still parse.

The incarnation names the namespace's history: it changes whenever ``meta`` is created
again (first write, ``gc``, a server that restarted empty, an eviction), and each new
history numbers its notices from the server's clock in microseconds, so numbers never
go back. A listener that sees a new incarnation reconciles. The stream keeps a notice's
pairs only up to 1 KiB (``truncated`` otherwise): replaying such a notice means
reconciling instead.

Kinds: ``evict`` (evict_mamba), ``cascade`` (evict_kv), ``replace`` (register_mamba
moved a hash to another block id), ``clear`` (clear_mamba, reset; no pairs).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from registry.core.types import BlockHash, BlockId, BlockPair, NoticeKind

KINDS = tuple(kind.value for kind in NoticeKind)


@dataclass(frozen=True)
class EvictionNotice:
    """One numbered notice: which (block_id, hash) pairs left the Mamba hash."""

    seq: int
    kind: NoticeKind | str  # a NoticeKind; compares equal to its text ("evict", ...)
    pairs: tuple[BlockPair, ...] | tuple[tuple[int, int], ...] = ()
    incarnation: str = ""  # the namespace's history this number counts in
    truncated: bool = False  # read back from the stream without its pairs
    # The server's clock (ms) when it was published; None from an older server's
    # scripts. Not part of equality: the same notice read back compares equal.
    published_ms: int | None = field(default=None, compare=False)

    @property
    def cleared(self) -> bool:
        """True for a ``clear``: every entry went, listed or not."""
        return self.kind == NoticeKind.CLEAR


def _text(value: object) -> str:
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("ascii")
    if isinstance(value, str):
        return value
    raise ValueError(f"notice field is {type(value).__name__}, expected str or bytes")


def _parse(
    head: str,
    kind: str,
    pair_words: list[str],
    *,
    truncated: bool = False,
    published: str | None = None,
) -> EvictionNotice:
    if pair_words and pair_words[0].startswith("@"):
        published, pair_words = pair_words[0][1:], pair_words[1:]
    published_ms = None
    if published is not None:
        if not (published.isdigit() and published.isascii()):
            raise ValueError(f"notice publish time {published!r} is not a number")
        published_ms = int(published)
    seq_text, _, incarnation = head.partition("@")
    if not seq_text.isdigit() or not seq_text.isascii():
        raise ValueError(f"notice sequence {seq_text!r} is not a positive integer")
    if incarnation and not (incarnation.isdigit() and incarnation.isascii()):
        raise ValueError(f"notice incarnation {incarnation!r} is not a number")
    if kind not in KINDS:
        raise ValueError(f"unknown notice kind {kind!r}")
    pairs: list[BlockPair] = []
    for word in pair_words:
        block_id, sep, h = word.partition(":")
        if not (sep and block_id.isdigit() and h.isdigit() and word.isascii()):
            raise ValueError(f"malformed block_id:hash pair {word!r}")
        pairs.append(BlockPair(BlockId(int(block_id)), BlockHash(int(h))))
    if kind == "clear" and pairs:
        raise ValueError("a clear notice carries no pairs")
    return EvictionNotice(
        int(seq_text), NoticeKind(kind), tuple(pairs), incarnation, truncated, published_ms
    )


def parse_notice(message: str | bytes) -> EvictionNotice:
    """Decode a channel message; ``ValueError`` if it is not a well-formed notice."""
    try:
        words = _text(message).split(" ")
    except UnicodeDecodeError as exc:
        raise ValueError("notice is not ASCII text") from exc
    if len(words) < 2:
        raise ValueError(f"notice {message!r:.80} has no kind")
    return _parse(words[0], words[1], [w for w in words[2:] if w])


def parse_stream_entry(fields: Mapping[object, object]) -> EvictionNotice:
    """Decode the fields of one ``mamba-evictions`` stream entry."""
    by_name = {_text(k): _text(v) for k, v in fields.items()}
    try:
        seq, kind, pairs = by_name["seq"], by_name["kind"], by_name["pairs"]
    except KeyError as exc:
        raise ValueError(f"stream entry lacks field {exc.args[0]!r}") from None
    head = f"{seq}@{by_name['inc']}" if by_name.get("inc") else seq
    return _parse(
        head,
        kind,
        pairs.split(),
        truncated=by_name.get("truncated") == "1",
        published=by_name.get("t"),
    )
