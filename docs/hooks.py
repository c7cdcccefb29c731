"""mkdocs hooks: reference pages generated from the code, so they cannot drift from it.

A page holding ``<!-- generated: cli -->`` gets every ``pcr`` command's ``--help`` (from
``pcr.cli.main.build_parser``); one holding ``<!-- generated: lua -->`` gets the header of
every script in ``lua/`` (KEYS, ARGV, the reply and the commands it calls).

A page that includes a file of the repository's root with the snippets extension
(``--8<-- "ARCHITECTURE.md"``) gets that file's links, written to work when reading the
repository (``docs/design/decisions/....md``, ``BENCHMARKS.md``), made relative to the page.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import posixpath
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from markdown import Extension, Markdown
from markdown.preprocessors import Preprocessor

ROOT = Path(__file__).resolve().parents[1]
CLI_MARK = "<!-- generated: cli -->"
LUA_MARK = "<!-- generated: lua -->"
WIDTH = "96"
SNIPPET_MARK = "--8<--"
# Root files the site shows as pages of its own: a link to one goes to its page.
ROOT_PAGES = {
    "README.md": "index.md",
    "ARCHITECTURE.md": "design/architecture.md",
    "BENCHMARKS.md": "benchmarks.md",
}
# A markdown link's target: a repository path (not a URL, an anchor or an absolute path).
LINK = re.compile(r"\]\((?![a-z]+:|#|/)([^)\s#]+)(#[^)\s]*)?\)")


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
    from pcr.cli.main import build_parser

    with _help_environment():
        parser = build_parser()
        parts = ["## `pcr`", "", "```text", parser.format_help().rstrip(), "```", ""]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, command in action.choices.items():
                    parts += _command_help(f"pcr {name}", command)
    return "\n".join(parts)


def _command_help(name: str, command: argparse.ArgumentParser) -> list[str]:
    """A command's ``--help`` as a section, then its actions' (``pcr quota set``)."""
    parts = [f"## `{name}`", "", "```text", command.format_help().rstrip(), "```", ""]
    for action in command._actions:
        if isinstance(action, argparse._SubParsersAction):
            for verb, sub in action.choices.items():
                parts += _command_help(f"{name} {verb}", sub)
    return parts


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


def site_link(target: str, page: str) -> str | None:
    """A link written relative to the repository's root, relative to ``page`` (a path
    in ``docs/``) instead; None for a target that is not in the site."""
    if target.startswith("docs/"):
        path = target.removeprefix("docs/")
    elif target in ROOT_PAGES:
        path = ROOT_PAGES[target]
    else:
        return None
    return posixpath.relpath(path, posixpath.dirname(page) or ".")


class RootLinks(Preprocessor):
    """Runs after the snippets extension (priority 32): on a page that includes a root
    file, that file's repository-relative links made relative to the page."""

    def __init__(self, md: Markdown, extension: RootLinksExtension) -> None:
        super().__init__(md)
        self.extension = extension

    def run(self, lines: list[str]) -> list[str]:
        page = self.extension.page
        if page is None:
            return lines

        def relink(found: re.Match[str]) -> str:
            target = site_link(found[1], page)
            return found[0] if target is None else f"]({target}{found[2] or ''})"

        return [LINK.sub(relink, line) for line in lines]


class RootLinksExtension(Extension):
    """Registers ``RootLinks``; ``page`` is the page rendered next (set by
    ``on_page_markdown``), or None when it includes no root file."""

    def __init__(self) -> None:
        super().__init__()
        self.page: str | None = None

    def extendMarkdown(self, md: Markdown) -> None:
        md.preprocessors.register(RootLinks(md, self), "pcr_root_links", 31)


ROOT_LINKS = RootLinksExtension()


def on_config(config: Any) -> Any:
    config.markdown_extensions.append(ROOT_LINKS)
    return config


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    ROOT_LINKS.page = page.file.src_uri if SNIPPET_MARK in markdown else None
    if CLI_MARK in markdown:
        markdown = markdown.replace(CLI_MARK, cli_reference())
    if LUA_MARK in markdown:
        markdown = markdown.replace(LUA_MARK, lua_reference())
    return markdown
