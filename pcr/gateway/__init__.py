"""``pcr gateway``: an OpenAI-compatible router in front of the engines (FastAPI, aiohttp).

``create_gateway_app(GatewayConfig(...), url)`` (``service``) builds it: the scoring
service's ``/v1/score``, ``/v1/nodes``, ``/live`` and ``/metrics``, plus
``POST /v1/completions`` and ``POST /v1/chat/completions`` (``proxy``: plain ASGI,
server-sent events passed through chunk by chunk when ``stream`` is true),
``GET /v1/models`` and a ``/health`` that says what the gateway can reach (``routes``).

Per request: the prompt's tokens as the engine will compute them (``tokens``), their
block hashes, the backends' cached prefixes from the registry, and the balance rule
(``balance``) against the load every replica has in flight (exchanged through Redis,
``exchange``, ``lua/gateway_load.lua``) and the engines' own queue and KV-cache usage
(their ``/metrics``, scraped in the background by ``state``). Redis away, or slower than
``registry_timeout``: the choice is by load alone, said by ``pcr_gateway_registry_up``
and ``/health``; no request fails for it.

The modules: ``config`` (``GatewayConfig``), ``state`` (``GatewayState``: backends, the
HTTP client, background loops, choosing; the engines' scraper), ``proxy`` (forwarding,
retry and streaming), ``outcomes`` (a request's start and end in the load and the
metrics), ``replies`` (answers in the OpenAI error shape, headers), ``routes``,
``backends``, ``balance``, ``exchange``, ``tokens``, ``metrics`` and ``service``. It
uses the registry, ``pcr.serve`` (whose scoring app it builds on) and ``pcr.web``, never
the command line.
"""
