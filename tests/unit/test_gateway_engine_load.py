"""``pcr.gateway.backends.engine_load``: what the gateway reads of an engine's
``/metrics`` every second (requests running and waiting, summed over label sets; KV-cache
usage, the highest), on the exposition vLLM writes and on what it might: labels or none,
a label value holding ``}``, timestamps, CRLF, the first and last lines, series whose
names extend the wanted ones, and garbage (NaN, Inf, words) left out."""

from __future__ import annotations

import pytest

from pcr.gateway.backends import engine_load

LABELS = 'engine="0",model_name="/models/Qwen2.5-7B-Instruct"'


def vllm_like(running: float, waiting: float, usage: float) -> str:
    """An exposition shaped as vLLM's: HELP and TYPE lines, histograms of 30 buckets
    (each line starting ``vllm:``), counters, the three gauges among them."""
    lines = ["# HELP python_gc_objects_collected_total x", "python_gc_objects_collected_total 9.0"]
    for h in range(12):
        lines += [f"# HELP vllm:hist_{h} x", f"# TYPE vllm:hist_{h} histogram"]
        lines += [f'vllm:hist_{h}_bucket{{{LABELS},le="{b / 2}"}} {b * 7}.0' for b in range(30)]
        if h == 6:
            lines += [
                "# HELP vllm:num_requests_running Number of requests in model execution.",
                "# TYPE vllm:num_requests_running gauge",
                f"vllm:num_requests_running{{{LABELS}}} {running}",
                f"vllm:num_requests_waiting{{{LABELS}}} {waiting}",
                f"vllm:kv_cache_usage_perc{{{LABELS}}} {usage}",
            ]
    lines.append(f"vllm:num_requests_running_total{{{LABELS}}} 1234.0")  # not the gauge
    return "\n".join(lines) + "\n"


def test_a_vllm_exposition() -> None:
    assert engine_load(vllm_like(3.0, 5.0, 0.25)) == (3.0, 5.0, 0.25)
    assert engine_load("") == (0.0, 0.0, 0.0)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # two engines' label sets: requests summed, usage the highest
        ('vllm:num_requests_running{engine="0"} 2\nvllm:num_requests_running{engine="1"} 3\n'
         'vllm:kv_cache_usage_perc{engine="0"} 0.5\nvllm:gpu_cache_usage_perc{engine="1"} 0.7',
         (5.0, 0.0, 0.7)),
        ("vllm:num_requests_waiting 4", (0.0, 4.0, 0.0)),  # no labels, no newline at the end
        ('vllm:num_requests_waiting{model_name="a}b"} 6\n', (0.0, 6.0, 0.0)),  # } in a label
        ("vllm:num_requests_waiting 4 1700000000000\n", (0.0, 4.0, 0.0)),  # a timestamp
        ("vllm:num_requests_running 1\r\nvllm:num_requests_waiting 2\r\n", (1.0, 2.0, 0.0)),
        ("vllm:num_requests_waiting NaN\nvllm:num_requests_waiting 2\n", (0.0, 2.0, 0.0)),
        ("vllm:num_requests_running +Inf\nvllm:kv_cache_usage_perc -Inf\n", (0.0, 0.0, 0.0)),
        ("vllm:num_requests_running lots\nvllm:num_requests_running\n", (0.0, 0.0, 0.0)),
        ("vllm:num_requests_waiting_seconds 9\nvllm:num_requests_waitingx 9\n", (0.0, 0.0, 0.0)),
        ("# vllm:num_requests_waiting 9\n  vllm:num_requests_waiting 9\n", (0.0, 0.0, 0.0)),
        ("vllm:num_requests_waiting{", (0.0, 0.0, 0.0)),
    ],
)  # fmt: skip
def test_what_is_read_and_what_is_left_out(text: str, expected: tuple[float, ...]) -> None:
    assert engine_load(text) == expected
