"""Mooncake-format traces (``sim.trace``) and generated ones (``sim.trace_gen``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from registry.core.hashing import block_hashes
from sim.trace import (
    PromptMaker,
    TraceError,
    TraceRequest,
    arrivals,
    ideal,
    load_trace,
    parse_trace,
    scale_for_rate,
    write_trace,
)
from sim.trace_gen import TraceShape, generate, shape_from_text

# The two requests of the Mooncake README: they share their first 12 blocks.
README = [
    '{"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": '
    "[46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 2353, 2354]}",
    '{"timestamp": 30535, "input_length": 6472, "output_length": 26, "hash_ids": '
    "[46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 2366]}",
]


def line(**fields: object) -> str:
    record: dict[str, object] = {
        "timestamp": 0,
        "input_length": 600,
        "output_length": 8,
        "hash_ids": [1, 2],
    }
    record.update(fields)
    return json.dumps({k: v for k, v in record.items() if v is not None})


def test_the_readme_requests_parse_and_share_twelve_blocks() -> None:
    first, second = parse_trace(README)
    assert (first.line, first.timestamp_ms, first.input_length, first.output_length) == (
        1,
        27482.0,
        6955,
        52,
    )
    assert second.hash_ids[:12] == first.hash_ids[:12]
    maker = PromptMaker(16)
    a, b = maker.prompt(first), maker.prompt(second)
    # 13 full blocks and 299/512 of a block (10 tokens); 12 and 328/512 (11 tokens).
    assert (len(a), len(b)) == (13 * 16 + 10, 12 * 16 + 11)
    ha, hb = block_hashes(a, 16), block_hashes(b, 16)
    assert ha[:12] == hb[:12]
    assert ha[12] not in hb
    # One infinite cache: the second prompt hits the 12 shared blocks.
    best = ideal([first, second], 16)
    assert (best.prompt_tokens, best.hit_tokens) == (len(a) + len(b), 12 * 16)
    assert best.distinct_blocks == 13


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("{not json", "line 1: not JSON"),
        ("[1, 2]", "line 1: a request is a JSON object, not list"),
        (line(hash_ids=None), "line 1: missing field 'hash_ids'"),
        (line(timestamp=None), "line 1: missing field 'timestamp'"),
        (line(timestamp=-1), "timestamp must be a finite number of ms >= 0"),
        (line(timestamp="5"), "timestamp must be a finite number"),
        (line(input_length=True), "input_length must be an integer, not bool"),
        (line(input_length=600.0), "input_length must be an integer, not float"),
        (line(output_length=-1), "output_length must be at least 0, not -1"),
        (line(hash_ids=[]), "hash_ids must be a non-empty list of integers"),
        (line(hash_ids=[1, "2"]), "hash_ids[1] = '2' is not an integer in [0, 2**63-1]"),
        (line(hash_ids=[1, False]), "hash_ids[1] = False is not an integer"),
        (line(hash_ids=[-3, 1]), "hash_ids[0] = -3 is not an integer"),
        (line(hash_ids=[2**63, 1]), "hash_ids[0] = 9223372036854775808 is not an integer"),
        (line(input_length=512), "input_length 512 does not fit 2 hash_ids of 512 tokens"),
        (line(input_length=1025), "input_length 1025 does not fit 2 hash_ids"),
    ],
)
def test_a_malformed_line_is_refused_naming_it(text: str, says: str) -> None:
    with pytest.raises(TraceError) as caught:
        parse_trace([text])
    assert says in str(caught.value)


def test_requests_out_of_arrival_order_are_refused() -> None:
    with pytest.raises(TraceError, match=r"line 3: timestamp 5 is before the previous request's 9"):
        parse_trace([line(timestamp=1), line(timestamp=9), line(timestamp=5)])


def test_the_window_skips_blank_lines_and_stops_reading_past_its_end() -> None:
    lines = [line(timestamp=t, hash_ids=[t, t + 100]) for t in range(10)]
    lines.insert(3, "   ")
    lines.append("{broken")  # never read: the window ends before it
    requests = parse_trace(lines, offset=2, window=3)
    assert [r.timestamp_ms for r in requests] == [2, 3, 4]
    assert [r.line for r in requests] == [3, 5, 6]
    with pytest.raises(TraceError, match="the trace has 10 requests, none past an offset of 10"):
        parse_trace(lines[:-1], offset=10)
    with pytest.raises(TraceError, match="the trace lists no requests"):
        parse_trace(["", "  "])
    with pytest.raises(TraceError, match="window must be at least 1"):
        parse_trace(lines, window=0)


def test_a_file_that_cannot_be_read_is_named(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"missing\.jsonl: No such file"):
        load_trace(tmp_path / "missing.jsonl")
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(TraceError, match=r"binary\.jsonl: not UTF-8 text"):
        load_trace(binary)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(line() + "\n" + line(output_length="x") + "\n")
    with pytest.raises(TraceError, match=r"bad.jsonl: line 2: output_length must be an integer"):
        load_trace(bad)


def test_arrivals_scale_the_gaps_from_the_first_request() -> None:
    requests = parse_trace([line(timestamp=t) for t in (1000, 1000, 3000, 11000)])
    assert arrivals(requests) == [0.0, 0.0, 2.0, 10.0]
    assert arrivals(requests, 0.5) == [0.0, 0.0, 1.0, 5.0]
    assert arrivals(requests, 0) == [0.0] * 4
    # 3 gaps over 10 s: 0.3 per second; at 3 per second the gaps shrink tenfold.
    assert scale_for_rate(requests, 3.0) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="time_scale must be a finite number >= 0"):
        arrivals(requests, -1)
    with pytest.raises(ValueError, match="rate must be a finite number > 0"):
        scale_for_rate(requests, 0)


def test_prompts_are_derived_from_the_ids_alone() -> None:
    maker = PromptMaker(8, vocabulary=100)
    a = TraceRequest(1, 0, 2 * 512 + 512, 1, (7, 8, 9))  # last block full
    b = TraceRequest(2, 0, 1 * 512 + 1, 1, (7, 5))  # last block: 1 token
    pa, pb = maker.prompt(a), maker.prompt(b)
    assert (len(pa), len(pb)) == (24, 9)
    assert pa[:8] == pb[:8] == list(PromptMaker(8, vocabulary=100).block(7))
    assert pb[8:] == list(maker.block(5)[:1])
    assert all(4 <= t < 100 for t in pa + pb)
    assert len({maker.block(i) for i in range(200)}) == 200
    # Half a 512-token block is half a block at any block size.
    half = TraceRequest(3, 0, 256, 1, (1,))
    assert [PromptMaker(size).prompt_length(half) for size in (1, 16, 32, 33)] == [1, 8, 16, 17]


def test_the_ideal_counts_as_an_engine_does() -> None:
    # A prompt of exactly two blocks sent twice hits one block: the last token is
    # computed again. Its partial-block sibling shares the first block only.
    two = TraceRequest(1, 0, 1024, 1, (1, 2))
    partial = TraceRequest(2, 0, 600, 1, (1, 3))
    best = ideal([two, two, partial], 16)
    assert best.prompt_tokens == 32 + 32 + 16 + 3
    assert best.hit_tokens == 16 + 16
    assert best.distinct_blocks == 2  # the partial block is never cached
    # The same id after another prefix is another block.
    moved = TraceRequest(3, 0, 1024, 1, (9, 2))
    assert ideal([two, moved], 16).hit_tokens == 0


def test_a_generated_trace_is_reproducible_and_reads_back(tmp_path: Path) -> None:
    shape = TraceShape(requests=300, seed=5)
    made = list(generate(shape))
    assert made == list(generate(shape))
    assert made != list(generate(TraceShape(requests=300, seed=6)))
    path = tmp_path / "made.jsonl"
    assert write_trace(made, path) == 300
    read = load_trace(path)
    assert [(r.timestamp_ms, r.input_length, r.output_length, r.hash_ids) for r in read] == [
        (r.timestamp_ms, r.input_length, r.output_length, r.hash_ids) for r in made
    ]
    # Poisson arrivals at the rate asked for, within sampling noise over 300 gaps.
    assert 30 < 299 / (read[-1].timestamp_ms / 1000) < 50


def test_the_shape_sets_the_sharing() -> None:
    lonely = list(generate(TraceShape(requests=200, one_off=1.0, new=0.0, one_off_system=0.0)))
    assert ideal(lonely, 16).hit_tokens == 0
    chatty = list(generate(TraceShape(requests=400, seed=1, system_prompts=8)))
    assert ideal(chatty, 16).hit_rate > 0.5
    # Every turn of a conversation extends an earlier prompt's complete blocks.
    seen: set[tuple[int, ...]] = set()
    extended = 0
    for request in chatty:
        ids = request.hash_ids
        extended += any(ids[:k] in seen for k in range(len(ids) - 1, 0, -1))
        seen.update(ids[:k] for k in range(1, len(ids)))
    assert extended > 200
    # Zipf: the most popular system prompt opens more conversations than the least.
    shape = TraceShape(requests=2000, one_off=0.0, system_prompts=8, zipf=1.1)
    firsts = [r.hash_ids[0] for r in generate(shape)]
    counts = sorted((firsts.count(f) for f in set(firsts)), reverse=True)
    assert len(counts) == 8
    assert counts[0] > 3 * counts[-1]


def test_a_shape_is_read_from_text_and_checked() -> None:
    shape = shape_from_text("requests=50, zipf=0.8, system-blocks=3-5, output_tokens=4")
    assert (shape.requests, shape.zipf, shape.system_blocks, shape.output_tokens) == (
        50,
        0.8,
        (3, 5),
        (4, 4),
    )
    assert shape_from_text("") == TraceShape()
    for text, says in [
        ("colour=3", "'colour=3' is not KEY=VALUE with KEY one of"),
        ("requests", "is not KEY=VALUE"),
        ("requests=many", "requests='many': not a number"),
        ("requests=0", "requests must be an integer >= 1"),
        ("new=0.8,one_off=0.5", "new + one_off must be at most 1"),
        ("turn_blocks=5-2", "turn_blocks must be two integers 1 <= low <= high"),
        ("rate=0", "rate must be a finite number > 0"),
    ]:
        with pytest.raises(ValueError, match=re.escape(says)):
            shape_from_text(text)
