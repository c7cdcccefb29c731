"""The ground floor of the registry: what every other part stands on, and no I/O.

Types of hashes, block ids and notices (``types``), key and channel names (``keys``),
argument checks (``validation``), Megatron-Core's block hashes (``hashing``), eviction
notices (``notices``), the one error vocabulary (``errors``), the events components
publish and who listens (``observe``), what a scorer answers (``scores``), Megatron-Core's
API written once (``base``) with its dict views (``views``), and the same API in process
memory (``local``). Imports nothing else of ``registry``.
"""
