"""The optional C extension of registry.core.hashing (everything else is in
pyproject.toml). Where it cannot be compiled (no compiler, an unknown platform), the
install goes on without it and block hashing runs in pure Python, with equal results.
PCR_PURE_PYTHON=1 leaves it out on purpose: a wheel for every platform (py3-none-any)."""

from __future__ import annotations

import os

from setuptools import Extension, setup

pure = os.environ.get("PCR_PURE_PYTHON", "") not in ("", "0")
extensions = [
    Extension(
        "registry.core._blockhash",
        sources=["registry/core/_blockhash.c"],
        optional=True,
        extra_compile_args=["-O3"] if os.name == "posix" else [],
    )
]
setup(ext_modules=[] if pure else extensions)
