"""The shared checks of numbers and the one reply-to-text decoding."""

from __future__ import annotations

import math

import pytest

from registry.core.validation import checked_number, is_number, text


@pytest.mark.parametrize("value", [True, False, "1", None, b"1", [1]])
def test_a_bool_or_non_number_is_never_a_number(value: object) -> None:
    assert not is_number(value)
    assert not is_number(value, integer=True)
    with pytest.raises(TypeError, match="limit must be a number, not"):
        checked_number(value, "limit", 0, 10)


def test_a_float_is_a_number_but_not_an_int() -> None:
    assert is_number(1.5)
    assert not is_number(1.5, integer=True)
    with pytest.raises(TypeError, match="count must be an int, not float"):
        checked_number(1.5, "count", 0, 10, integer=True)


@pytest.mark.parametrize("value", [-1, 11, math.nan, math.inf, -math.inf])
def test_a_number_outside_the_range_is_a_value_error(value: float) -> None:
    with pytest.raises(ValueError, match=r"delay must lie between 0 and 10 s, not"):
        checked_number(value, "delay", 0, 10, unit=" s")


@pytest.mark.parametrize("value", [0, 10, 5, 0.5])
def test_a_number_inside_comes_back_as_it_is(value: float) -> None:
    assert checked_number(value, "delay", 0, 10) is value


def test_text_decodes_bytes_and_escapes_what_is_not_utf8() -> None:
    assert text(b"node-0") == "node-0"
    assert text(bytearray(b"x")) == "x"
    assert text(b"a\xffb") == "a\\xffb"
    assert text(42) == "42"
    assert text("already") == "already"
