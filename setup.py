"""The optional C extensions of registry.core.hashing, of the fleet view's walk
(registry.fleet.matches) and of the balance rule's arithmetic (registry.routing.balance;
everything else is in pyproject.toml). Where they cannot be
compiled (no compiler, an unknown platform), the install goes on without them and both
all run in pure Python, with equal results.
PCR_PURE_PYTHON=1 leaves it out on purpose: a wheel for every platform (py3-none-any)."""

from __future__ import annotations

import os

from setuptools import Extension, setup

pure = os.environ.get("PCR_PURE_PYTHON", "") not in ("", "0")
# the balance rule's costs must round as Python's do: no multiply-add fused into one
exact = ["-ffp-contract=off"]
extensions = [
    Extension(
        name,
        sources=[source],
        optional=True,
        extra_compile_args=["-O3", *flags] if os.name == "posix" else [],
    )
    for name, source, flags in (
        ("registry.core._blockhash", "registry/core/_blockhash.c", []),
        ("registry.fleet._holders", "registry/fleet/_holders.c", []),
        ("registry.routing._weigh", "registry/routing/_weigh.c", exact),
    )
]
setup(ext_modules=[] if pure else extensions)
