"""The Docker image builds: a wheel built from exactly the files the Dockerfile copies
holds every package ``pyproject.toml`` lists (no Docker engine needed to check that)."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support import REPO_ROOT

ROOT = REPO_ROOT


def dockerfile_copies(text: str) -> list[tuple[list[str], str]]:
    """The (sources, destination) of each ``COPY`` line (continuations joined)."""
    copies = []
    for line in text.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if not words or words[0].upper() != "COPY":
            continue
        args = [w for w in words[1:] if not w.startswith("--")]
        assert not any(w.startswith("--from") for w in words), "multi-stage COPY not handled"
        copies.append((args[:-1], args[-1]))
    return copies


def test_the_dockerfile_copies_everything_the_wheel_needs(tmp_path: Path) -> None:
    pytest.importorskip("build")
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    context = tmp_path / "context"
    context.mkdir()
    copies = dockerfile_copies((ROOT / "Dockerfile").read_text())
    assert copies, "the Dockerfile copies nothing"
    for sources, destination in copies:
        for source in sources:
            origin = ROOT / source
            assert origin.exists(), f"the Dockerfile copies {source}, which does not exist"
            target = context / (source if destination.endswith("/") else destination)
            if origin.is_dir():
                shutil.copytree(origin, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(origin, target)
    dist = tmp_path / "dist"
    built = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--skip-dependency-check",
         "--outdir", str(dist), str(context)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    (wheel,) = dist.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for package in config["tool"]["setuptools"]["packages"]:
        folder = package.replace(".", "/")
        assert any(n.startswith(f"{folder}/") and n.endswith((".py", ".lua")) for n in names), (
            f"{package} is not in the wheel built from the Dockerfile's files"
        )
    assert "registry/lua/_prelude.lua" in names
