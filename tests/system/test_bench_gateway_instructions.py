"""``pcr.bench.gateway_instructions``: the gateway's instructions per proxied request
under callgrind, this checkout beside another, and one line for a bad argument."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO_ROOT

pytestmark = pytest.mark.timeout(900)

MODULE = [sys.executable, "-m", "pcr.bench.gateway_instructions"]


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
def test_counts_this_checkouts_gateway_beside_a_baseline() -> None:
    """The same checkout as its own baseline: two figures of the same order (counting
    is nearly exact: the background loops add a little, not a multiple)."""
    command = [*MODULE, "--shapes", "ids", "--requests", "40", "--warmup", "10"]
    command += ["--rounds", "1", "--baseline", str(REPO_ROOT)]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=840)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith("ids ")]
    figures = {" ".join(row[1:-2]): float(row[-2]) for row in rows}
    assert set(figures) == {"gateway", f"gateway at {REPO_ROOT.name}"}
    ours, theirs = figures.values()
    assert 50 < ours < 100_000  # thousands of instructions a request
    assert 0.5 < theirs / ours < 2.0


BAD = [
    ["--shapes", "ids,pictures"],
    ["--requests", "0"],
    ["--rounds", "x"],
    ["--baseline", "/nonexistent-checkout"],
]


@pytest.mark.parametrize("bad", BAD)
def test_a_bad_argument_is_one_line(bad: list[str], tmp_path: Path) -> None:
    env = {"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [*MODULE, *bad], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("python -m pcr.bench.gateway_instructions: error: ")
