"""The import-linter contracts of pyproject.toml (``make lint``) hold, and each one bites.

For every contract, a copy of the packages and pyproject.toml in a temporary folder gets
one module that breaks it, and ``lint-imports`` run there fails naming that contract (and
no other); the untouched copy passes. The source tree itself is only read.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import REPO_ROOT

pytest.importorskip("importlinter")

PACKAGES = ("registry", "gpu", "sim", "pcr")

LAYERS = "Layers: pcr, then sim, then gpu, then registry; imports only point down"
NO_TORCH = "registry (the torch-free library) never imports torch"
NO_HTTP = "registry never imports the HTTP services' packages (pcr serve and pcr gateway hold them)"
SUB_PACKAGES = (
    "registry's sub-packages: core, transport, namespace, fleet, routing, then "
    "mirror | bridge | metrics; imports only point down"
)
ACYCLIC = (
    "No import cycles between sibling modules or packages, at any depth "
    "(deferred and TYPE_CHECKING imports included)"
)
ZMQ = "zmq and msgpack only in registry.bridge, sim's engine stand-in (sim.engine_events) and pcr"
PROMETHEUS = "prometheus_client only in registry.metrics and pcr"
HTTP_IN_PCR = (
    "The HTTP services' packages only in the services (pcr.web, pcr.serve, pcr.gateway), "
    "serve's bench, the simulated engines and the gateway's floor proxy"
)
PCR_LAYERS = (
    "pcr's packages: cli, then bench, then gateway, then serve (whose scoring app the "
    "gateway builds on), then web; services never import the command line"
)
SERVICES_PURE = (
    "The services (pcr.web, pcr.serve, pcr.gateway) never import the simulation, gpu or torch"
)
TORCH_IN_PCR = "torch only in gpu and sim (pcr reaches it only through them)"


@dataclass(frozen=True)
class Breaker:
    """One module added to the copy, and the contracts it must break."""

    path: str
    source: str
    breaks: frozenset[str]


def breaker(path: str, source: str, *breaks: str) -> Breaker:
    return Breaker(path, source, frozenset(breaks))


BREAKERS = {
    "gpu imports sim": breaker("gpu/breaker.py", "import sim\n", LAYERS),
    "registry imports torch": breaker("registry/core/breaker.py", "import torch\n", NO_TORCH),
    "registry imports fastapi": breaker("registry/core/breaker.py", "import fastapi\n", NO_HTTP),
    "the bridge imports the mirror (independent neighbours)": breaker(
        "registry/bridge/breaker.py", "import registry.mirror\n", SUB_PACKAGES
    ),
    "a registry module imports the package root": breaker(
        "registry/core/breaker.py",
        "def late() -> None:\n    import registry  # deferred: still an import\n",
        SUB_PACKAGES,
    ),
    "pcr.bench and pcr.cli import each other": breaker(
        "pcr/bench/breaker.py", "import pcr.cli.main\n", ACYCLIC, PCR_LAYERS
    ),
    "the scoring service imports the command line": breaker(
        "pcr/serve/breaker.py", "import pcr.cli.common\n", ACYCLIC, PCR_LAYERS
    ),
    "the scoring service imports the gateway built on it": breaker(
        "pcr/serve/breaker.py", "import pcr.gateway.service\n", ACYCLIC, PCR_LAYERS
    ),
    "the web server imports the benchmarks (deferred)": breaker(
        "pcr/web/breaker.py",
        "def late() -> None:\n    import pcr.bench.servers\n",
        PCR_LAYERS,
        ACYCLIC,  # a cycle too: the benches use the gateway, which stands on the web server
    ),
    "the gateway imports the simulation": breaker(
        "pcr/gateway/breaker.py", "import sim\n", SERVICES_PURE
    ),
    "the web server imports torch": breaker(
        "pcr/web/breaker.py", "import torch\n", SERVICES_PURE, TORCH_IN_PCR
    ),
    "the fleet imports zmq": breaker("registry/fleet/breaker.py", "import zmq\n", ZMQ),
    "a sim module imports msgpack, for typing only": breaker(
        "sim/breaker.py",
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    import msgpack\n",
        ZMQ,
    ),
    "gpu imports prometheus_client": breaker(
        "gpu/breaker.py", "import prometheus_client\n", PROMETHEUS
    ),
    "a pcr command imports aiohttp": breaker("pcr/cli/breaker.py", "import aiohttp\n", HTTP_IN_PCR),
    "pcr imports torch itself": breaker("pcr/breaker.py", "import torch\n", TORCH_IN_PCR),
}

VERDICT = re.compile(
    r"^(?P<name>.+?) (?P<verdict>KEPT|BROKEN)(?: \(\d+ ignored imports?\))?\s*$", re.MULTILINE
)
"""One contract's line of lint-imports' report (one line: the report is made wide)."""


@dataclass(frozen=True)
class Linted:
    returncode: int
    verdicts: dict[str, str]  # contract name -> "KEPT" or "BROKEN"
    output: str


def lint_copy(root: Path, added: Breaker | None) -> Linted:
    """Copy the packages and pyproject.toml to ``root``, add ``added``, run lint-imports
    there (only the copy on its path)."""
    for package in PACKAGES:
        shutil.copytree(
            REPO_ROOT / package, root / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    shutil.copy2(REPO_ROOT / "pyproject.toml", root / "pyproject.toml")
    if added is not None:
        (root / added.path).write_text(added.source, encoding="utf-8")
    command = "from importlinter.cli import lint_imports_command; lint_imports_command()"
    done = subprocess.run(
        [sys.executable, "-c", command, "--no-cache", "--no-logo"],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root), "NO_COLOR": "1", "COLUMNS": "1000"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    verdicts = {m["name"]: m["verdict"] for m in VERDICT.finditer(done.stdout)}
    return Linted(done.returncode, verdicts, done.stdout + done.stderr)


@pytest.fixture(scope="module")
def linted(tmp_path_factory: pytest.TempPathFactory) -> dict[str | None, Linted]:
    """lint-imports on the untouched copy (key None) and on one copy per breaker, four at
    a time (each is a process of its own)."""
    cases: list[str | None] = [None, *BREAKERS]
    # Made here, one after another: pytest's temporary folders are not thread-safe.
    roots = [tmp_path_factory.mktemp("copy") for _ in cases]

    def run(case: str | None, root: Path) -> Linted:
        return lint_copy(root, None if case is None else BREAKERS[case])

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(run, cases, roots))
    return dict(zip(cases, results, strict=True))


def test_the_untouched_copy_keeps_every_contract(linted: dict[str | None, Linted]) -> None:
    clean = linted[None]
    assert clean.returncode == 0, clean.output
    assert set(clean.verdicts.values()) == {"KEPT"}, clean.output


def test_every_contract_has_a_breaker(linted: dict[str | None, Linted]) -> None:
    """A contract added to pyproject.toml gets a module that breaks it here."""
    broken = {name for b in BREAKERS.values() for name in b.breaks}
    assert set(linted[None].verdicts) == broken


@pytest.mark.parametrize("case", BREAKERS)
def test_one_module_breaks_its_contract(case: str, linted: dict[str | None, Linted]) -> None:
    result = linted[case]
    assert result.returncode != 0, result.output
    broken = {name for name, verdict in result.verdicts.items() if verdict == "BROKEN"}
    assert broken == BREAKERS[case].breaks, result.output
    assert len(result.verdicts) == len(linted[None].verdicts), result.output
