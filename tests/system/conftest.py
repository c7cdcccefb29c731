"""Fixtures the system tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.tiny_tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny test tokenizer in a directory of its own (``pcr gateway --tokenizer``)."""
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(path)
    return path
