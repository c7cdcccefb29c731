"""``pcr simulate --trace FILE``: a Mooncake-format trace through simulated engines in
simulated time, each policy's hit rate beside the infinite cache's; and its usage
errors, one line each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pcr.cli.main import main
from sim.trace import load_trace, write_trace
from sim.trace_gen import TraceShape, generate

SHAPE = "requests=300,seed=4,system_prompts=16"


def test_a_generated_trace_is_written_then_replayed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace, out = tmp_path / "made.jsonl", tmp_path / "figures.json"
    args = ["simulate", "--generate-trace", str(trace), "--trace-shape", SHAPE, "--nodes", "4"]
    assert main([*args, "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert f"pcr simulate --trace {trace}: 300 requests (lines 1-300)" in table
    assert "4 engines x" in table
    assert "one infinite cache (ideal):" in table
    figures = json.loads(out.read_text())
    assert [r["policy"] for r in figures["runs"]] == [
        "round-robin",
        "least-load",
        "prefix",
        "prefix+pending",
        "gateway",
        "cache-aware",
    ]
    runs = {r["policy"]: r for r in figures["runs"]}
    assert runs["gateway"]["hit_rate"] > runs["round-robin"]["hit_rate"]
    assert set(runs["gateway"]["lost"]) >= {"ideal", "evicted", "away"}
    assert runs["prefix"]["hit_rate"] > runs["round-robin"]["hit_rate"]
    assert all(r["hit_rate"] <= figures["ideal_hit_rate"] for r in figures["runs"])
    assert len(load_trace(trace)) == 300
    # The same file replayed again gives the same figures; a window of it, fewer requests.
    again = tmp_path / "again.json"
    assert main(["simulate", "--trace", str(trace), "--nodes", "4", "--json", str(again)]) == 0
    assert json.loads(again.read_text())["runs"] == figures["runs"]
    windowed = tmp_path / "windowed.json"
    args = ["simulate", "--trace", str(trace), "--offset", "100", "--window", "50"]
    assert main([*args, "--policies", "prefix", "--json", str(windowed)]) == 0
    cut = json.loads(windowed.read_text())
    assert cut["requests"] == 50
    assert [r["policy"] for r in cut["runs"]] == ["prefix"]


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "t.jsonl"
    write_trace(generate(TraceShape(requests=20)), path)
    return path


@pytest.mark.parametrize(
    ("args", "says", "code"),
    [
        (["--window", "5"], "argument --window: only with --trace or --generate-trace", 2),
        (["--rate", "3"], "argument --rate: only with --trace", 2),
        (["--trace-shape", "seed=2"], "argument --trace-shape: only with --trace", 2),
        (["--trace", "T", "--trace-shape", "seed=2"], "only with --generate-trace", 2),
        (["--trace", "T", "--bridge"], "argument --bridge: not with a trace", 2),
        (["--trace", "T", "--mirror"], "argument --mirror: not with a trace", 2),
        (["--trace", "T", "--policies", "greedy"], "argument --policies: unknown greedy", 2),
        (["--trace", "T", "--rate", "0"], "argument --rate: must be a number > 0", 2),
        (["--trace", "T", "--rate", "2", "--time-scale", "1"], "not allowed with", 2),
        (["--trace", "T", "--offset", "-1"], "argument --offset: must be 0 or more", 2),
        (["--trace", "T", "--offset", "20"], "none past an offset of 20", 1),
        (["--trace", "T", "--kv-blocks", "2"], "needs more than the 2 blocks", 1),
        (["--trace", "MISSING"], "cannot replay the trace: MISSING: No such file", 1),
        (
            ["--generate-trace", "G", "--trace-shape", "zipf=-1"],
            "argument --trace-shape: zipf must be a finite number > 0",
            2,
        ),
    ],
)
def test_mistakes_are_one_line(
    capsys: pytest.CaptureFixture[str],
    trace: Path,
    tmp_path: Path,
    args: list[str],
    says: str,
    code: int,
) -> None:
    named = {"T": str(trace), "G": str(tmp_path / "g.jsonl"), "MISSING": "MISSING"}
    assert main(["simulate", *[named.get(a, a) for a in args]]) == code
    err = capsys.readouterr().err
    assert says in err.replace(str(trace), "T")
    assert len(err.strip().splitlines()) == 1


def test_a_malformed_trace_names_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
        '{"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": [true]}\n'
    )
    assert main(["simulate", "--trace", str(path)]) == 1
    err = capsys.readouterr().err
    assert "line 2: hash_ids[0] = True is not an integer" in err
    assert len(err.strip().splitlines()) == 1
