"""Wall-clock latency of each registry operation a simulated node makes."""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager


class Timings:
    """Wall-clock latency of each registry operation, in milliseconds."""

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = defaultdict(list)

    @contextmanager
    def timed(self, operation: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.samples[operation].append((time.perf_counter() - start) * 1000)

    def summary(self) -> dict[str, dict[str, float]]:
        result = {}
        for operation, samples in sorted(self.samples.items()):
            ordered = sorted(samples)
            result[operation] = {
                "calls": len(ordered),
                "p50_ms": round(statistics.median(ordered), 4),
                "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], 4),
            }
        return result
