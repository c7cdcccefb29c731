"""``pcr serve``, the HTTP scoring service: FastAPI over the registry's routing. The app
factory in ``app``, the request and response models with their limits in ``schema``, the
endpoints in ``routes``, the error handlers and middleware in ``errors``, what the app
holds while it runs in ``state``. It uses the registry and ``pcr.web``, never the command
line."""
