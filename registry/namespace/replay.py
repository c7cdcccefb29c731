"""Reading a namespace's notices back from its capped stream (for listeners' catch-up)."""

from __future__ import annotations

from typing import Any, Protocol

from registry.core.notices import EvictionNotice, parse_stream_entry
from registry.core.validation import text


class StreamReader(Protocol):
    """What replay needs of a registry: its notice position and pages of its stream."""

    def notice_position(self) -> tuple[str, int]: ...

    def notice_page(self, upper: str, count: int) -> list[Any]: ...


def notices_after(
    registry: StreamReader, seq: int, *, incarnation: str | None = None, page: int = 500
) -> list[EvictionNotice] | None:
    """Every notice numbered above ``seq``, oldest first, read back from the stream. A
    ``seq`` below the current history's first number (``0``, say) asks for all of it.

    ``None`` when the stream cannot give all of them: it was trimmed, a notice was kept
    without its pairs (too long), or the namespace's history restarted (its incarnation
    is not ``incarnation``, when given): reconcile instead.
    """
    current, newest = registry.notice_position()
    if incarnation is not None and current != incarnation:
        return None
    start = history_start(current)
    if start is not None and seq < start:
        seq = start  # below the history's first number: the whole history is asked for
    if newest <= seq:
        return [] if newest == seq else None
    found: list[EvictionNotice] = []
    upper = "+"
    reached = False
    while not reached:
        entries = registry.notice_page(upper, page)
        for _entry_id, fields in entries:
            notice = parse_stream_entry(fields)
            if notice.seq <= seq or notice.incarnation != current:  # older: all found
                reached = True
                break
            found.append(notice)
        if len(entries) < page:
            break
        upper = "(" + text(entries[-1][0])
    found.reverse()
    numbers = [n.seq for n in found]
    if not found or numbers != list(range(seq + 1, seq + 1 + len(found))):
        return None
    if any(n.truncated or n.incarnation != current for n in found):
        return None
    return found if numbers[-1] >= newest else None


def history_start(incarnation: str) -> int | None:
    """The number a history's notices count from: its incarnation is that number (the
    server's clock in microseconds) followed by three random digits. None for ""."""
    if len(incarnation) > 3 and incarnation.isdigit() and incarnation.isascii():
        return int(incarnation[:-3])
    return None
