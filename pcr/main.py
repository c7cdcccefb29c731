"""Deprecated: the command line's entry point moved to ``pcr.cli.main`` (the ``pcr``
command and ``python -m pcr`` use it). This alias stays for one minor release."""

from __future__ import annotations

import warnings

from pcr.cli.main import build_parser, main

__all__ = ["build_parser", "main"]

warnings.warn(
    "pcr.main is deprecated: use pcr.cli.main (main, build_parser)",
    DeprecationWarning,
    stacklevel=2,
)
