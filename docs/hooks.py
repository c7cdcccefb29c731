"""mkdocs hooks: reference pages generated from the code, so they cannot drift from it.

A page holding ``<!-- generated: cli -->`` gets every ``pcr`` command's ``--help`` (from
``pcr.main.build_parser``); one holding ``<!-- generated: lua -->`` gets the header of
every script in ``lua/`` (KEYS, ARGV, the reply and the commands it calls).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CLI_MARK = "<!-- generated: cli -->"
LUA_MARK = "<!-- generated: lua -->"
WIDTH = "96"


@contextlib.contextmanager
def _help_environment() -> Iterator[None]:
    """The same help text wherever the site is built: a fixed width, no $REDIS_URL."""
    saved = {k: os.environ.get(k) for k in ("COLUMNS", "REDIS_URL")}
    os.environ["COLUMNS"] = WIDTH
    os.environ.pop("REDIS_URL", None)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def cli_reference() -> str:
    """``pcr --help`` and each command's ``--help``, as sections."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from pcr.main import build_parser

    with _help_environment():
        parser = build_parser()
        parts = ["## `pcr`", "", "```text", parser.format_help().rstrip(), "```", ""]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, command in action.choices.items():
                    parts += [f"## `pcr {name}`", "", "```text"]
                    parts += [command.format_help().rstrip(), "```", ""]
    return "\n".join(parts)


def lua_reference() -> str:
    """Each script's leading comment block (its header), the prelude last."""
    scripts = sorted((ROOT / "lua").glob("*.lua"), key=lambda p: (p.name == "_prelude.lua", p.name))
    parts = []
    for path in scripts:
        header = []
        for line in path.read_text().splitlines():
            if not line.startswith("--"):
                break
            header.append(line[2:].removeprefix(" "))
        parts += [f"## `{path.name}`", "", "```text", "\n".join(header).rstrip(), "```", ""]
    return "\n".join(parts)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if CLI_MARK in markdown:
        markdown = markdown.replace(CLI_MARK, cli_reference())
    if LUA_MARK in markdown:
        markdown = markdown.replace(LUA_MARK, lua_reference())
    return markdown
