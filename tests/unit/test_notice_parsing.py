"""Parsing notices: the channel's text lines and the stream's entries."""

from __future__ import annotations

import pytest

from registry import EvictionNotice, parse_notice, parse_stream_entry
from registry.core.types import BlockPair, NoticeKind


@pytest.mark.parametrize(
    "message",
    [
        b"",
        b"7",
        b"x evict 1:2",
        b"7 nope 1:2",
        b"7 evict 1-2",
        b"7 evict a:2",
        b"7 clear 1:2",
        b"\xff\xfe",
        b"-3 evict 1:2",
    ],
)
def test_malformed_notices_are_rejected(message: bytes) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - each case has its own message
        parse_notice(message)


def test_notice_parsing_accepts_str_and_bytes() -> None:
    expected = EvictionNotice(12, "cascade", ((5, 2**63 - 1), (6, 7)), "1796024288853101482")
    text = "12@1796024288853101482 cascade 5:9223372036854775807 6:7"
    assert parse_notice(text) == expected
    assert parse_notice(text.encode()) == expected
    assert parse_notice("13 clear").cleared  # a notice without incarnation (first release)
    with pytest.raises(ValueError, match="incarnation"):
        parse_notice("13@x1 clear")
    with pytest.raises(ValueError, match="lacks field"):
        parse_stream_entry({b"seq": b"1", b"kind": b"evict"})


def test_kinds_and_pairs_are_typed() -> None:
    notice = parse_notice("5@1796024288853101482 replace 3:9 4:10")
    assert notice.kind is NoticeKind.REPLACE
    assert notice.kind == "replace"
    assert notice.pairs == (BlockPair(3, 9), BlockPair(4, 10))  # type: ignore[arg-type]
    assert notice.pairs[0].block_id == 3
    assert notice.pairs[0].hash == 9


def test_stream_entries_carry_incarnation_and_truncation() -> None:
    fields = {b"seq": b"7", b"inc": b"123456", b"kind": b"evict", b"pairs": b"", b"truncated": b"1"}
    notice = parse_stream_entry(fields)
    assert (notice.seq, notice.incarnation, notice.truncated, notice.pairs) == (
        7,
        "123456",
        True,
        (),
    )


def test_notices_carry_their_publish_time() -> None:
    text = "12@1796024288853101482 cascade @1796024288861 5:9223372036854775807 6:7"
    notice = parse_notice(text)
    assert notice.published_ms == 1796024288861
    assert notice.pairs == ((5, 2**63 - 1), (6, 7))
    # The same notice without a time (older scripts) compares equal.
    assert notice == parse_notice("12@1796024288853101482 cascade 5:9223372036854775807 6:7")
    assert parse_notice("13@1796024288853101482 clear @1796024288870").published_ms == (
        1796024288870
    )
    assert parse_notice("13 clear").published_ms is None
    with pytest.raises(ValueError, match="publish time"):
        parse_notice("13@1796024288853101482 evict @x 1:2")
    entry = {b"seq": b"7", b"inc": b"12", b"kind": b"evict", b"pairs": b"1:2", b"t": b"99"}
    assert parse_stream_entry(entry).published_ms == 99
