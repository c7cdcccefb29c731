"""A tour of the registry on an embedded Redis (fakeredis): no server needed.

Run with ``make demo`` or ``python examples/quickstart.py [--redis-url URL]``.
"""

from __future__ import annotations

import argparse
import sys

from registry import PrefixCacheRegistry, block_hashes, parse_notice

BLOCK_SIZE = 16


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--redis-url", help="use this Redis instead of the embedded one")
    options = parser.parse_args()
    if options.redis_url:
        import redis

        client = redis.Redis.from_url(options.redis_url)
        where = "Redis at the given URL"
    else:
        import fakeredis

        client = fakeredis.FakeRedis()
        where = "embedded fakeredis"
    print(f"registry on {where}; block size {BLOCK_SIZE} tokens")

    engine = PrefixCacheRegistry(client, "node-0")
    router_view = PrefixCacheRegistry(client, "node-0")  # another process, same namespace
    freed: list[list[int]] = []
    engine.set_mamba_evict_callback(freed.append)
    listener = client.pubsub()
    listener.subscribe(engine.keys.mamba_evicted_channel)
    listener.get_message(timeout=1)  # the subscribe confirmation

    system_prompt = list(range(1000, 1064))  # 4 blocks shared by every chat
    chat_a = system_prompt + list(range(5000, 5032))  # + 2 blocks of its own
    chat_b = system_prompt + list(range(7000, 7016))  # + 1 block of its own
    hashes_a, hashes_b = block_hashes(chat_a, BLOCK_SIZE), block_hashes(chat_b, BLOCK_SIZE)

    engine.register_kv(list(range(6)), hashes_a)
    engine.register_mamba([3, 5], [hashes_a[3], hashes_a[5]])  # Mamba state checkpoints
    print("chat A: registered 6 KV blocks, Mamba state at blocks 3 and 5")

    block_ids, parent = router_view.match_kv_prefix(hashes_b)
    mamba_len = router_view.match_mamba_farthest(hashes_b[: len(block_ids)])
    print(
        f"chat B: {len(block_ids)} of {len(hashes_b)} blocks cached (ids {block_ids}, "
        f"last hash {parent}), "
        f"Mamba state usable up to block {mamba_len}"
    )

    removed = engine.evict_kv(hashes_a[3:])
    print(f"evicted {len(removed)} KV blocks of chat A; Mamba cascade fired callback {freed}")
    message = listener.get_message(ignore_subscribe_messages=True, timeout=1)
    if message is None:
        print("no eviction notice arrived", file=sys.stderr)
        return 1
    notice = parse_notice(message["data"])
    print(
        f"notice #{notice.seq} on {engine.keys.mamba_evicted_channel}: {notice.kind} {notice.pairs}"
    )

    print("what redis-cli would show:")
    for key in engine.keys.all_keys():
        kind = client.type(key).decode()
        size = {"hash": client.hlen, "stream": client.xlen}.get(kind, lambda _k: 0)(key)
        print(f"  {key:28} {kind:7} {size} entries")
    listener.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
