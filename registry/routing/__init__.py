"""Choosing a node for a prompt: ``PrefixRouter`` (``routing``, threads) and
``AsyncPrefixRouter`` (``aio_routing``, asyncio), over the plan both share (``plan``:
the prompt's checks, the score script's calls and replies, the choice; no I/O). Scores
come from a fleet view (``registry.fleet``) or exactly from Redis, per namespace.
"""
