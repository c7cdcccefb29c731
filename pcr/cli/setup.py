"""``pcr setup``: the admin step that loads the registry's scripts as a Redis Functions
library (``registry.transport.functions.load_library``), so that the registry's users
need ``+fcall`` only and no ``EVAL``, ``EVALSHA`` or ``SCRIPT``.

Run it as an admin user once per Redis deployment and again for each client version
(the library is named by a hash of its scripts: each version has its own, and older ones
stay loaded for the clients still on them). Clients pick the library up by themselves;
without it they run the same scripts by EVALSHA.
"""

from __future__ import annotations

import argparse
from typing import Any

from pcr.cli import common
from pcr.cli.common import shown_url, url_scheme
from registry.transport.client import CLUSTER_SCHEMES
from registry.transport.functions import Loaded, load_library


def add_parser(commands: Any, url_default: str) -> None:
    """The ``pcr setup`` subcommand."""
    setup = commands.add_parser(
        "setup",
        help="load the registry's scripts as a Redis Functions library (an admin's step)",
        description="Load the registry's scripts into Redis as a Functions library "
        "(Redis 7 or newer; FUNCTION LOAD, so run it as an admin user), on every primary "
        "of a Redis Cluster. Registry users then need +fcall (+fcall_ro for routers) "
        "instead of +evalsha and +script|load. Run it again after an upgrade: each client "
        "version calls its own library.",
    )
    setup.add_argument(
        "--redis-url",
        type=common.url_arg,
        default=url_default,
        help="redis://, rediss://, unix://, redis+cluster://, redis+sentinel:// URL of an "
        f"admin user (default: $REDIS_URL, else {common.DEFAULT_URL})",
    )
    setup.add_argument(
        "--replace",
        action="store_true",
        help="load it again where it is already loaded (FUNCTION LOAD REPLACE)",
    )
    setup.set_defaults(handler=command_setup, command_parser=setup)


def command_setup(args: argparse.Namespace) -> int:
    where = f"Redis at {shown_url(args.redis_url)}"
    with common.connect(args) as client:
        loaded = load_library(client, replace=args.replace, where=where)
    print(summary(loaded, cluster=url_scheme(args.redis_url) in CLUSTER_SCHEMES, where=where))
    return 0


def summary(loaded: Loaded, *, cluster: bool, where: str) -> str:
    """The one line ``pcr setup`` prints."""
    if cluster:
        servers = len(loaded.loaded) + len(loaded.present)
        place = f"on {servers} primaries of the cluster at {where.removeprefix('Redis at ')}"
        if loaded.present and loaded.loaded:
            place += f" ({len(loaded.present)} held it already)"
        place += " (their replicas receive it by replication)"
    else:
        place = f"on {where}"
    if loaded.loaded:
        line = f"loaded Redis Functions library {loaded.name} {place}"
    else:
        line = f"Redis Functions library {loaded.name} already loaded {place}"
    if loaded.others:
        line += f"; other versions kept: {', '.join(loaded.others)}"
    return line
