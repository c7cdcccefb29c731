"""The engine tier's fixtures: the tiny model, running vLLM engines and ``pcr bridge``
processes, each stopped by PID in ``finally``. Collected only under ``make
test-engines`` (``.ci/engine-tier`` sets ``PCR_ENGINE_TIER``); the plain suite skips the
directory without a word, since it has no engine."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.engines import VllmEngine, engine_python, own_core
from tests.support.process_groups import kill_group, stop_group

collect_ignore_glob = [] if os.environ.get("PCR_ENGINE_TIER") else ["test_*.py"]


@pytest.fixture(scope="session")
def model() -> Path:
    path = os.environ.get("PCR_ENGINE_MODEL")
    if not path or not (Path(path) / "config.json").is_file():
        pytest.fail("PCR_ENGINE_MODEL names no model: run the tier with make test-engines")
    return Path(path)


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(os.environ.get("PCR_ENGINE_LOGS") or tmp_path_factory.mktemp("engines"))


@pytest.fixture(scope="session")
def python() -> str:
    found = engine_python()
    if found is None:
        pytest.fail("PCR_ENGINE_PYTHON names no python: run the tier with make test-engines")
    return found


class BridgeProcess:
    """``pcr bridge`` following engines, as a process of its own (to kill and restart)."""

    def __init__(self, redis_url: str, log_dir: Path) -> None:
        self.redis_url = redis_url
        self.log_dir = log_dir
        self.process: subprocess.Popen[bytes] | None = None
        self.runs = 0

    def start(self, engines: list[tuple[VllmEngine, str]], *extra: str) -> BridgeProcess:
        command = [sys.executable, "-m", "pcr", "bridge", "--redis-url", self.redis_url]
        for engine, namespace in engines:
            command += ["--endpoint", engine.endpoint, "--namespace", namespace]
            command += ["--replay-endpoint", engine.replay_endpoint]
        self.runs += 1
        log = (self.log_dir / f"bridge-{self.runs}.log").open("wb")
        self.process = subprocess.Popen(
            [*command, "--block-size", "32", *extra],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        return self

    def kill(self) -> None:
        kill_group(self.process)
        self.process = None

    def stop(self) -> None:
        stop_group(self.process, 20)
        self.process = None


@pytest.fixture(scope="session")
def engines(python: str, model: Path, log_dir: Path) -> Iterator[list[VllmEngine]]:
    """Two engines for the whole tier, started side by side (each takes a minute)."""
    made = [
        VllmEngine(python, model, log_dir, name=f"engine-{n}", core=own_core(i))
        for i, n in enumerate(("p", "q"))
    ]
    try:
        for engine in made:
            engine.launch()
        for engine in made:
            engine.wait_ready()
        yield made
    finally:
        for engine in made:
            engine.stop()


@pytest.fixture
def engine(engines: list[VllmEngine]) -> VllmEngine:
    """The first of them (the bridge tests: one engine at a time)."""
    return engines[0]


@pytest.fixture(scope="session")
def hybrid_models(python: str, log_dir: Path) -> Path:
    """The tiny hybrid models (``make_tiny_hybrid.py``: one directory per architecture),
    built with the engine venv's python once per run (``PCR_ENGINE_HYBRID_MODELS`` names
    ready ones)."""
    given = os.environ.get("PCR_ENGINE_HYBRID_MODELS")
    if given:
        return Path(given)
    out = log_dir / "hybrid-models"
    built = subprocess.run(
        [python, str(Path(__file__).with_name("make_tiny_hybrid.py")), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if built.returncode != 0:
        pytest.fail(f"building the hybrid models failed:\n{built.stderr[-3000:]}")
    return out
