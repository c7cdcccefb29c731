"""``pcr quota``: per-namespace entry quotas (``registry.namespace.quota``): ``show``,
``set`` and ``clear``, run as an admin (node users may read a quota, never write it)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from pcr.cli import common
from pcr.cli.common import Parser, int_in, namespace_arg, shown_url, talking
from pcr.tables import format_table
from registry.fleet.membership import NodeIndex
from registry.namespace.quota import (
    MAX_QUOTA,
    EntryQuota,
    clear_quota,
    entry_quotas,
    set_quota,
)

limit_arg = int_in(0, MAX_QUOTA, "entry limit")


def add_parser(commands: Any, redis_options: Any, url_default: str) -> None:
    """The ``pcr quota`` subcommand and its actions."""
    quota = commands.add_parser(
        "quota",
        help="per-namespace entry quotas: show, set, clear",
        description="The most KV plus Mamba entries each namespace may hold. A write that "
        "would pass its namespace's limit is refused whole (RegistryQuotaExceeded); "
        "removals never are. Setting or clearing one needs a Redis user allowed to write "
        "pcr:quota:{NAMESPACE} (an admin): the node recipes only read it.",
    )
    actions = quota.add_subparsers(dest="quota_action", required=True, parser_class=Parser)
    show = actions.add_parser("show", help="each namespace's limit beside the entries it holds")
    redis_options(show, url_default)
    show.add_argument(
        "namespaces",
        metavar="NAMESPACE",
        nargs="*",
        type=namespace_arg,
        help="these namespaces (default: every namespace in the node index)",
    )
    show.add_argument("--json", action="store_true", help="JSON output")
    show.set_defaults(handler=command_show, command_parser=show)

    set_limit = actions.add_parser("set", help="cap a namespace's entries")
    redis_options(set_limit, url_default)
    set_limit.add_argument("namespace_name", metavar="NAMESPACE", type=namespace_arg)
    set_limit.add_argument(
        "limit",
        metavar="LIMIT",
        type=limit_arg,
        help=f"the most KV plus Mamba entries (0 to {MAX_QUOTA:,}); on a bridged "
        "namespace its engine blocks too",
    )
    set_limit.set_defaults(handler=command_set, command_parser=set_limit)

    clear = actions.add_parser("clear", help="remove a namespace's limit")
    redis_options(clear, url_default)
    clear.add_argument("namespace_name", metavar="NAMESPACE", type=namespace_arg)
    clear.set_defaults(handler=command_clear, command_parser=clear)


def command_show(args: argparse.Namespace) -> int:
    with common.connect(args) as client:
        names = list(args.namespaces)
        if not names:
            with talking(f"node index {args.key_prefix}:nodes"):
                index = NodeIndex(client, args.key_prefix)
                names = [*index.live(), *index.dead()]
        with talking(f"Redis at {shown_url(args.redis_url)}"):
            found = entry_quotas(client, list(dict.fromkeys(names)), key_prefix=args.key_prefix)
    rows = [_row(quota) for quota in found]
    if args.json:
        print(json.dumps(rows, indent=2))
    elif rows:
        headers = list(rows[0])
        print(format_table(headers, [[_shown(r[h]) for h in headers] for r in rows]))
    else:
        print(f"no namespaces under key prefix {args.key_prefix!r}")
    return 0


def _row(quota: EntryQuota) -> dict[str, Any]:
    limit: int | str | None = quota.limit
    if quota.unreadable is not None:
        limit = f"invalid: {quota.unreadable[:40]!r}"
    return {
        "namespace": quota.namespace,
        "entries": quota.entries,
        "engine_blocks": quota.engine_blocks,
        "limit": limit,
        "over": quota.over,
    }


def _shown(value: Any) -> Any:
    return "-" if value is None else value


def command_set(args: argparse.Namespace) -> int:
    namespace = args.namespace_name
    with common.connect(args) as client:
        set_quota(client, namespace, args.limit, key_prefix=args.key_prefix)
        (quota,) = entry_quotas(client, [namespace], key_prefix=args.key_prefix)
    print(f"{namespace}: limit {args.limit:,} entries (holds {quota.entries:,})")
    if quota.over:
        common.warn_user(
            args.command,
            f"{namespace} holds more than its new limit: it keeps its entries, and writes "
            "that add entries are refused until it is under the limit",
        )
    return 0


def command_clear(args: argparse.Namespace) -> int:
    namespace = args.namespace_name
    with common.connect(args) as client:
        had = clear_quota(client, namespace, key_prefix=args.key_prefix)
    print(f"{namespace}: no limit" + ("" if had else " (it had none)"))
    return 0
