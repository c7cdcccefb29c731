"""Where CI runs with a C compiler, every optional C extension was built, so their tests
run the C paths and are not skipped (a build that silently fell back to Python would hide
a broken extension)."""

from __future__ import annotations

import importlib
import os
import shutil

import pytest


@pytest.mark.skipif(
    not os.environ.get("CI") or shutil.which("cc") is None,
    reason="CI with a C compiler builds the extensions",
)
@pytest.mark.parametrize(
    ("module", "name", "source"),
    [
        ("registry.core.hashing", "_blockhash", "registry/core/_blockhash.c"),
        ("registry.fleet.holders", "NATIVE", "registry/fleet/_holders.c"),
        ("registry.routing.balance", "NATIVE", "registry/routing/_weigh.c"),
    ],
)
def test_ci_built_the_extension(module: str, name: str, source: str) -> None:
    imported = getattr(importlib.import_module(module), name)
    assert imported is not None, f"{source} was not built"
