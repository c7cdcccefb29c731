"""Helpers shared by the tests (backends, servers, waiting, gpu)."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
"""The repository's root folder (README.md, Dockerfile, lua/, examples/)."""
