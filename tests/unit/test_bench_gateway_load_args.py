"""``python -m pcr.bench.gateway_load``'s core lists and connection counts: core lists
read as taskset reads them, connection counts as positive whole numbers, and a bad one
(a core this machine does not have included) refused in one line before anything starts."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from pcr.bench.gateway_load import (
    LONG_TOKENS,
    SYSTEM_PROMPTS,
    Workload,
    build_workload,
    connection_counts,
    cores,
    paced_rates,
    positive_count,
    positive_seconds,
    router_names,
    shape_names,
)
from tests.support import REPO_ROOT


def test_core_lists_read_as_taskset_reads_them() -> None:
    assert cores("0") == {0}
    here = os.sched_getaffinity(0)
    if {0, 1} <= here:
        assert cores("0,1") == {0, 1}
        assert cores("0-1") == {0, 1}
        assert cores(" 1 , 0 ") == {0, 1}


@pytest.mark.parametrize("text", ["", "a", "1-", "-1", "0,,1", "1.5"])
def test_a_list_that_is_not_cores_is_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="cores as 0,1 or 2-15"):
        cores(text)


def test_a_core_the_machine_lacks_is_refused_in_one_line() -> None:
    missing = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(argparse.ArgumentTypeError, match=f"no core {missing} on this machine"):
        cores(f"0,{missing}")
    ran = subprocess.run(
        [sys.executable, "-m", "pcr.bench.gateway_load", "--router-cores", str(missing)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )
    assert ran.returncode == 2
    assert ran.stdout == ""
    assert "Traceback" not in ran.stderr
    assert f"no core {missing} on this machine" in ran.stderr.splitlines()[-1]


def test_connection_counts_are_positive_whole_numbers() -> None:
    assert connection_counts("16,64, 256") == [16, 64, 256]
    for text in ("abc", "", "0", "16,-1", "1.5", "16,,64"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive whole numbers"):
            connection_counts(text)
    assert "connection counts are positive whole numbers" in _refused("--connections", "abc")


def test_counts_and_seconds_are_positive() -> None:
    """``--rounds 0`` once ended in a traceback (no turn to take the median of)."""
    assert positive_count("3") == 3
    assert positive_seconds("0.5") == 0.5
    for text in ("0", "-1", "abc", "", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError, match="whole number of at least 1"):
            positive_count(text)
    for text in ("0", "-2", "abc", "nan", "inf", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="seconds above 0"):
            positive_seconds(text)
    for flag, value in (("--rounds", "0"), ("--seconds", "nan"), ("--engines", "x")):
        assert flag in _refused(flag, value)


def _refused(*args: str) -> str:
    """The bench run with ``args``: refused by argparse (status 2, no traceback); the
    last line of its stderr."""
    ran = subprocess.run(
        [sys.executable, "-m", "pcr.bench.gateway_load", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )
    assert ran.returncode == 2
    assert "Traceback" not in ran.stderr
    return ran.stderr.splitlines()[-1]


def test_router_names_are_the_benchs_own() -> None:
    assert router_names("gateway, floor-direct") == {"gateway", "floor-direct"}
    for text in ("nope", "gateway,nope", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="not a router here"):
            router_names(text)
    assert "not a router here" in _refused("--routers", "floor-direct,nope")


def test_shape_names_are_the_benchs_own_each_once() -> None:
    """An unknown shape once ended in a KeyError traceback after the routers started."""
    assert shape_names("ids,long") == "ids,long"
    for text in ("nope", "ids,nope", "", "ids,ids"):
        with pytest.raises(argparse.ArgumentTypeError, match="shapes are chat, ids, long"):
            shape_names(text)
    assert "shapes are chat, ids, long" in _refused("--shapes", "ids,chats")


class _Words:
    """A stand-in tokenizer for the workload's chat part (not under test here)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [len(word) for word in text.split()]

    def decode(self, tokens: list[int]) -> str:
        return " ".join("w" * t for t in tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], tokenize: bool) -> str:
        return "".join(m["content"] for m in messages)


def test_the_long_shape_is_long_prompts_on_popular_system_prompts() -> None:
    workload: Workload = build_workload(_Words())
    bodies = [json.loads(b) for b in workload.bodies("long")]
    assert len(workload.long_systems) == SYSTEM_PROMPTS
    assert all(len(b["prompt"]) == LONG_TOKENS for b in bodies)
    first = workload.long_systems[0]
    shared = [b for b in bodies if b["prompt"][: len(first)] == first]
    systems = {tuple(b["prompt"][: len(first)]) for b in bodies}
    assert len(shared) > len(bodies) / SYSTEM_PROMPTS  # the first is the most popular
    assert len(systems) > 2
    assert max(t for b in bodies for t in b["prompt"]) > 100_000  # a large vocabulary
    assert workload.bodies("ids") == workload.ids


def test_paced_rates_read_as_positive_numbers_each_once() -> None:
    assert paced_rates("200") == [200.0]
    assert paced_rates("50, 200,1000.5") == [50.0, 200.0, 1000.5]


@pytest.mark.parametrize("text", ["", "0", "-5", "fast", "200,,400", "inf", "nan", "200,200"])
def test_a_rate_list_that_is_not_positive_numbers_each_once_is_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="rates are numbers"):
        paced_rates(text)


def test_a_bad_rate_list_is_one_line_on_stderr() -> None:
    assert "--paced-rates" in _refused("--paced-rates", "0,200")
