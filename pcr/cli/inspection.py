"""``pcr stats``, ``inspect``, ``match``, ``watch`` and ``gc``: looking at and repairing a
live registry."""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from typing import Any

from redis.cluster import RedisCluster
from redis.exceptions import ResponseError

# -- inspection -----------------------------------------------------------------------
from pcr.cli import common
from pcr.cli.common import (
    EVICTING_POLICIES,
    CommandError,
    UsageError,
    one_line,
    shown_url,
    talking,
    warn_user,
)
from pcr.tables import format_table
from registry.core.hashing import block_hashes
from registry.core.keys import NamespaceKeys
from registry.core.notices import parse_notice
from registry.core.validation import text
from registry.fleet.membership import NodeIndex
from registry.namespace.admin import NamespaceInfo, namespace_infos
from registry.namespace.redis_registry import PrefixCacheRegistry
from registry.routing.routing import PrefixRouter


def _eviction_warning(client: Any) -> str | None:
    """A warning when the server's ``maxmemory-policy`` may evict registry keys; None
    when it may not, or when CONFIG is refused (ACL) or unknown (fakeredis)."""
    reply: Any
    try:
        if isinstance(client, RedisCluster):  # every primary holds registry keys
            reply = client.config_get("maxmemory-policy", target_nodes=RedisCluster.PRIMARIES)
        else:
            reply = client.config_get("maxmemory-policy")
    except ResponseError:
        return None
    policies: set[str] = set()
    if isinstance(reply, dict):
        for key, value in reply.items():
            if isinstance(value, dict):  # a cluster client: one reply per node
                policies.update(text(v) for k, v in value.items() if text(k) == "maxmemory-policy")
            elif text(key) == "maxmemory-policy":
                policies.add(text(value))
    evicting = sorted(policies & set(EVICTING_POLICIES))
    if not evicting:
        return None
    return (
        f"maxmemory-policy is {', '.join(evicting)}: Redis may evict registry keys when it "
        "is full; use noeviction (or a volatile-* policy)"
    )


def _index_members(client: Any, key_prefix: str) -> tuple[list[str], list[str]]:
    """The valid namespaces of the node index (live, then dead) and its invalid members."""
    with talking(f"node index {key_prefix}:nodes"):
        index = NodeIndex(client, key_prefix)
        return [*index.live(), *index.dead()], index.invalid()


def command_stats(args: argparse.Namespace) -> int:
    server = f"Redis at {shown_url(args.redis_url)}"
    with common.connect(args) as client:
        with talking(server):
            warning = _eviction_warning(client)
        namespaces, invalid = _index_members(client, args.key_prefix)
        names = list(dict.fromkeys([*namespaces, *(args.namespace or [])]))
        with talking(server):
            infos = namespace_infos(client, names, key_prefix=args.key_prefix)
        rows = [_stats_row(info, memory) for info, memory in infos]
    rows += [_invalid_row(member, args.json) for member in invalid]
    if args.json:
        print(json.dumps(rows, indent=2))
    elif rows:
        headers = list(rows[0])
        print(format_table(headers, [[r[h] for h in headers] for r in rows]))
    else:
        print(f"no namespaces under key prefix {args.key_prefix!r}")
    if warning is not None:  # after the figures: a failed run prints its error line only
        warn_user(args.command, warning)
    return 0


def _stats_row(info: NamespaceInfo, memory: int | None) -> dict[str, Any]:
    """One namespace's row of ``pcr stats``."""
    namespace = info.namespace
    lease_left = info.lease_left_s
    return {
        "namespace": namespace,
        "kv_entries": info.kv_entries,
        "mamba_entries": info.mamba_entries,
        "memory_bytes": memory,
        "state": info.state,
        "lease_left_s": None if lease_left is None else round(lease_left, 1),
        "epoch": info.epoch,
        "notice_seq": info.notice_seq,
        "bridged_from": _bridged_from(info),
    }


def _bridged_from(info: Any) -> str | None:
    """``vllm tcp://10.0.0.7:5557 bs=16`` for a namespace fed by ``pcr bridge``."""
    if info.bridge_endpoint is None:
        return None
    size = "" if info.bridge_block_size is None else f" bs={info.bridge_block_size}"
    return f"{info.bridge_engine} {info.bridge_endpoint}{size}"


def _invalid_row(member: str, as_json: bool) -> dict[str, Any]:
    """A stats row for a node-index member that is not a valid namespace (quoted in the
    table, where it may be empty or hold spaces)."""
    return {
        "namespace": member if as_json else f"'{one_line(member)}'",
        "kv_entries": None,
        "mamba_entries": None,
        "memory_bytes": None,
        "state": "invalid",
        "lease_left_s": None,
        "epoch": None,
        "notice_seq": None,
        "bridged_from": None,
    }


def command_inspect(args: argparse.Namespace) -> int:
    keys = NamespaceKeys(args.namespace_name, args.key_prefix)
    key = keys.kv if args.kind == "kv" else keys.mamba
    with common.connect(args) as client, talking(f"key {key!r}"):
        registry = PrefixCacheRegistry(client, args.namespace_name, key_prefix=args.key_prefix)
        try:
            cursor, entries = registry.scan_entries(args.kind, args.cursor, args.count)
        except ValueError:
            raise CommandError(
                f"key {key!r} holds an entry that is not two integers; something else wrote it"
            ) from None
        info = None if args.json else registry.info()
    if args.json:
        print(json.dumps({"key": key, "next_cursor": cursor, "entries": entries}))
        return 0
    assert info is not None
    total = info.kv_entries if args.kind == "kv" else info.mamba_entries
    print(f"{key}: {total} entries; this page {len(entries)}")
    if entries:
        print(format_table(["hash", "block_id"], entries))
    if cursor:
        print(f"more: pcr inspect {args.namespace_name} --kind {args.kind} --cursor {cursor}")
    return 0


def _hashes_of(args: argparse.Namespace) -> list[int]:
    if args.tokens and args.hashes:
        raise UsageError("give block hashes or --tokens, not both")
    if args.tokens:
        hashes = block_hashes(args.tokens, args.block_size)
        if not hashes:  # nothing to look up: a dead server would not even be asked
            raise UsageError(
                f"--tokens: {len(args.tokens)} token(s) make no complete block of "
                f"{args.block_size}; give at least {args.block_size}"
            )
        return hashes
    if not args.hashes:
        raise UsageError("give block hashes, or --tokens with --block-size")
    return list(args.hashes)


def command_match(args: argparse.Namespace) -> int:
    hashes = _hashes_of(args)
    namespace: str | None = args.namespace_name
    with common.connect(args) as client, talking(f"Redis at {shown_url(args.redis_url)}"):
        if namespace is None:
            scores = PrefixRouter(client, args.key_prefix).score(hashes)
        else:
            registry = PrefixCacheRegistry(client, namespace, key_prefix=args.key_prefix)
            block_ids, parent = registry.match_kv_prefix(hashes)
            mamba = registry.match_mamba_farthest(hashes[: len(block_ids)]) if block_ids else 0
    if namespace is None:
        return _print_scores(args, len(hashes), scores)
    result = {
        "namespace": namespace,
        "blocks": len(hashes),
        "kv_prefix": len(block_ids),
        "mamba_prefix": mamba,
        "block_ids": block_ids,
        "parent_hash": parent,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{namespace}: {len(block_ids)} of {len(hashes)} blocks cached, "
            f"Mamba state usable up to block {mamba}; block ids {block_ids}"
        )
    return 0


def _print_scores(args: argparse.Namespace, blocks: int, scores: dict[str, Any]) -> int:
    result = [
        {"namespace": s.namespace, "kv_prefix": s.kv_prefix, "mamba_prefix": s.mamba_prefix}
        for s in sorted(scores.values(), key=lambda s: (-s.usable, s.namespace))
    ]
    if args.json:
        print(json.dumps(result))
    elif result:
        print(f"{blocks} blocks; live nodes, best first:")
        print(
            format_table(
                ["namespace", "kv_prefix", "mamba_prefix"], [list(r.values()) for r in result]
            )
        )
    else:
        print("no live nodes")
    return 0


def command_watch(args: argparse.Namespace) -> int:
    channel = NamespaceKeys(args.namespace_name, args.key_prefix).mamba_evicted_channel
    with common.connect(args) as client, talking(f"channel {channel!r}"):
        pubsub = client.pubsub()
        try:
            pubsub.subscribe(channel)
            _confirmed(pubsub, channel, shown_url(args.redis_url))
            if not args.json:
                print(f"watching {channel} (Ctrl-C to stop)", flush=True)
            _follow(pubsub, args)
        finally:
            with contextlib.suppress(Exception):
                pubsub.close()
    return 0


SUBSCRIBE_SECONDS = 10.0
"""How long ``pcr watch`` waits for Redis to confirm its subscription."""


def _confirmed(pubsub: Any, channel: str, where: str) -> None:
    """Wait for Redis to confirm the subscription: a refusal (an ACL without the channel)
    is an error now, and "watching" is printed only once notices can arrive."""
    deadline = time.monotonic() + SUBSCRIBE_SECONDS
    while (left := deadline - time.monotonic()) > 0:
        message = pubsub.get_message(timeout=min(left, 1.0))
        if message is None:
            continue
        if text(message.get("type")) == "subscribe":
            return
        raise CommandError(f"Redis at {where} answered SUBSCRIBE with {message!r:.100}")
    raise CommandError(
        f"Redis at {where} did not confirm the subscription to {channel!r} within "
        f"{SUBSCRIBE_SECONDS:.0f} s"
    )


def _follow(pubsub: Any, args: argparse.Namespace) -> None:
    seen = 0
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    while args.count is None or seen < args.count:
        if deadline is not None and time.monotonic() >= deadline:
            break
        message = pubsub.get_message(timeout=0.2)
        if message is None or message["type"] not in ("message", b"message"):
            continue
        seen += 1
        try:
            notice = parse_notice(message["data"])
        except ValueError as exc:
            print(f"malformed message: {one_line(str(exc))}", flush=True)
            continue
        if args.json:
            print(
                json.dumps({"seq": notice.seq, "kind": notice.kind, "pairs": notice.pairs}),
                flush=True,
            )
        else:
            pairs = " ".join(f"{b}:{h}" for b, h in notice.pairs)
            print(f"#{notice.seq} {notice.kind} {pairs}".rstrip(), flush=True)


def command_gc(args: argparse.Namespace) -> int:
    with common.connect(args) as client, talking(f"node index {args.key_prefix}:nodes"):
        index = NodeIndex(client, args.key_prefix)
        if args.dry_run:
            invalid = index.invalid()
            names = index.dead()
        else:
            invalid = index.remove_invalid()
            names = index.collect_dead()
    verb = "would remove" if args.dry_run else "removed"
    if args.json:
        print(json.dumps([*names, *invalid]))
        return 0
    print(f"{verb} {len(names)}: {' '.join(names)}".rstrip())
    if invalid:
        shown = " ".join(f"'{one_line(m)}'" for m in invalid)
        print(f"{verb} {len(invalid)} invalid node-index members: {shown}")
    return 0
