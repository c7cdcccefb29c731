"""``pcr bridge``'s library: vLLM / SGLang KV-event batches decoded into typed events
(``bridge_events``, msgpack imported there only when a batch is decoded) and followed into
bridged namespaces (``bridge``: ``EngineSource``, the transport-free ``Follower``, and
``Bridge``, which imports ZeroMQ only when built). Sits on top of the registry, beside
``registry.mirror`` and ``registry.metrics``.
"""
