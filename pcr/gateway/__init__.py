"""``pcr gateway``, the OpenAI-compatible router in front of engines: the ASGI proxy and
its state (``app``), the balance rule, backends and their scraping, the load exchange
between replicas, tokenizing and metrics. It uses the registry, ``pcr.serve`` (whose
scoring app it mounts) and ``pcr.web``, never the command line."""
