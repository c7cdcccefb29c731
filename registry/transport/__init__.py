"""How the registry reaches Redis: clients built from URLs and the bounds of a call
(``client``), the Sentinel-managed master (``sentinel``), and the one way a script runs
and commands are batched on the wire, with the Lua folder (``scripts``). Imports only
``registry.core``.
"""
