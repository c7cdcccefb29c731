"""``bench_gateway --trace``'s workload (issue 44): a Mooncake-format window scaled down
to the engine tier's two engines, each request cut to its first ids, its blocks derived
from the ids alone, so requests share exactly the leading blocks their ids share."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sim.trace import TraceError
from tests.engines.bench_gateway import BLOCK_SIZE, build_trace_workload


def write(path: Path, rows: list[dict[str, object]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_requests_are_cut_and_share_what_their_ids_share(tmp_path: Path) -> None:
    trace = write(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 0, "input_length": 2000, "output_length": 5, "hash_ids": [1, 2, 3, 4]},
            {"timestamp": 5, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 9]},
            {"timestamp": 9, "input_length": 300, "output_length": 5, "hash_ids": [7]},
            {"timestamp": 12, "input_length": 1536, "output_length": 5, "hash_ids": [1, 2, 3]},
        ],
    )
    requests, info = build_trace_workload(trace, window=3, blocks=3, offset=0)
    assert len(requests) == 3
    assert info["window"] == 3
    assert info["blocks_per_request"] == 3
    first, second, third = (r.tokens for r in requests)
    assert len(first) == 3 * BLOCK_SIZE  # cut to 3 of its 4 blocks, each complete
    assert first[: 2 * BLOCK_SIZE] == second[: 2 * BLOCK_SIZE]  # ids 1, 2 shared
    assert first[2 * BLOCK_SIZE :] != second[2 * BLOCK_SIZE : 3 * BLOCK_SIZE]
    # 1,100 tokens of 512 a block: the last block keeps its share of 32 (76 of 512 -> 5)
    assert len(second) == 2 * BLOCK_SIZE + 5
    assert len(third) == 19  # 300 of 512 -> 19 of 32
    assert all(4 <= t < 512 for r in requests for t in r.tokens)  # the tiny vocabulary
    assert [r.conversation for r in requests] == [0, 1, 2]
    assert 0 < info["ideal_hit_rate"] < 1
    later, _ = build_trace_workload(trace, window=2, blocks=3, offset=2)
    assert later[1].tokens == first  # the fourth request, cut alike, is the first's prompt


def test_a_window_past_the_trace_is_refused(tmp_path: Path) -> None:
    trace = write(
        tmp_path / "t.jsonl",
        [{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}],
    )
    with pytest.raises(TraceError, match="offset"):
        build_trace_workload(trace, window=5, blocks=2, offset=3)
