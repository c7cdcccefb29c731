"""The optional C extensions of registry.core.hashing and of the fleet view's walk
(registry.fleet.matches; everything else is in pyproject.toml). Where they cannot be
compiled (no compiler, an unknown platform), the install goes on without them and both
run in pure Python, with equal results.
PCR_PURE_PYTHON=1 leaves it out on purpose: a wheel for every platform (py3-none-any)."""

from __future__ import annotations

import os

from setuptools import Extension, setup

pure = os.environ.get("PCR_PURE_PYTHON", "") not in ("", "0")
extensions = [
    Extension(
        name,
        sources=[source],
        optional=True,
        extra_compile_args=["-O3"] if os.name == "posix" else [],
    )
    for name, source in (
        ("registry.core._blockhash", "registry/core/_blockhash.c"),
        ("registry.fleet._holders", "registry/fleet/_holders.c"),
    )
]
setup(ext_modules=[] if pure else extensions)
