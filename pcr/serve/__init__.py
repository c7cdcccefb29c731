"""``pcr serve``, the HTTP scoring service: FastAPI over the registry's routing (``app``).
It uses the registry and ``pcr.web``, never the command line."""
