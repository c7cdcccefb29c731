"""``pcr gateway``: the OpenAI-compatible router in front of the engines
(``pcr.gateway``), on uvicorn with ``pcr serve``'s deadlines.

FastAPI, uvicorn, httptools, aiohttp (and transformers for ``--tokenizer``) are imported
only when the command runs, and torch never (``without_torch``). Backends come from
``--backend NAMESPACE=URL``, from ``--backends FILE`` (a JSON object
``{"backends": {"NAMESPACE": "URL", ...}}``) and from the engine table in Redis
(``pcr bridge --engine-url``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from pcr.cli.common import UsageError, block_size_arg, int_in, number_in, shown_url
from pcr.cli.service_options import (
    access_options,
    access_policy,
    bind,
    check_url,
    limit_options,
    listen_options,
    require,
    tls_settings,
    transport_options,
)
from pcr.gateway.balance import POLICIES, REPLICA_ID
from pcr.web.server import enable_metrics, listen_url, run_app, serve_workers
from registry.core.keys import validate_namespace
from registry.fleet.membership import validate_engine_url

NEEDED = {
    "fastapi": "fastapi",
    "uvicorn": "uvicorn",
    "httptools": "httptools",
    "aiohttp": "aiohttp",
}  # module: package
MAX_BACKENDS = 4_096
MAX_WORKERS = 256
MAX_CONFIG_BYTES = 1 << 20


def _backend(text: str) -> tuple[str, str]:
    """An argparse type: ``NAMESPACE=URL``."""
    namespace, sep, url = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(
            "a backend is NAMESPACE=URL, e.g. node-0=http://10.0.0.7:8000"
        )
    try:
        return validate_namespace(namespace), validate_engine_url(url)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _replica_id(text: str) -> str:
    """An argparse type: a replica id (``REPLICA_ID``)."""
    if not REPLICA_ID.fullmatch(text):
        raise argparse.ArgumentTypeError(
            "a replica id is 1 to 200 printable ASCII characters, no spaces"
        )
    return text


MAX_MODEL_LEN = 1 << 30
"""The largest ``--max-model-len``."""


def _model_len(text: str) -> int:
    """An argparse type: a prompt length in tokens, 1 to ``MAX_MODEL_LEN``."""
    if not text.isdigit() or not 1 <= int(text) <= MAX_MODEL_LEN:
        raise argparse.ArgumentTypeError(
            f"--max-model-len must be a whole number of tokens from 1 to {MAX_MODEL_LEN:,}, "
            f"not {text[:40]!r}"
        )
    return int(text)


MAX_NUMBER = 1e6
"""The largest value of the balance rule's numbers and the gateway's seconds."""


def _number(low: float, what: str, *, zero: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number above ``low`` (at least ``low`` with ``zero``),
    of at most ``MAX_NUMBER``."""
    bound = f"at least {low:g}" if zero else f"above {low:g}"
    return number_in(
        low,
        MAX_NUMBER,
        above=not zero,
        invalid=lambda text: f"{what} must be a number, not {text[:40]!r}",
        out_of_range=lambda text: f"{what} must be a finite number {bound}",
    )


def add_parser(commands: Any, redis_options: Any, url_default: str) -> None:
    """The ``pcr gateway`` subcommand."""
    gateway = commands.add_parser(
        "gateway",
        help="OpenAI-compatible router: sends each request to the engine holding its prefix",
        description="Route /v1/completions and /v1/chat/completions to the engine that "
        "already caches the prompt's prefix, against load (needs the gateway extra). Redis "
        "away: routed by load alone. Also serves /v1/score, /v1/nodes, /v1/models, /health "
        "and /metrics.",
    )
    redis_options(gateway, url_default)
    listen_options(gateway, 8080)
    _backend_options(gateway)
    _balance_options(gateway)
    _pending_options(gateway)
    _wait_options(gateway)
    limit_options(gateway)
    transport_options(gateway)
    access_options(gateway)
    gateway.set_defaults(handler=command_gateway, command_parser=gateway)


def _backend_options(gateway: argparse.ArgumentParser) -> None:
    """Where the engines are, and how to read their prompts."""
    gateway.add_argument(
        "--backend",
        type=_backend,
        action="append",
        default=[],
        metavar="NAMESPACE=URL",
        help="an engine and the namespace its cache state is in (repeatable)",
    )
    gateway.add_argument(
        "--backends",
        type=Path,
        metavar="FILE",
        help='a JSON file {"backends": {"NAMESPACE": "URL", ...}}',
    )
    _backend_tls_options(gateway)
    gateway.add_argument(
        "--backend-api-key-file",
        type=Path,
        metavar="FILE",
        help="a file holding the key the engines were started with (vLLM's --api-key): "
        "sent to them as 'Authorization: Bearer KEY' in place of any the client sent "
        "(default: $PCR_BACKEND_API_KEY if set, else none)",
    )
    gateway.add_argument(
        "--no-tenant-salts",
        action="store_true",
        help="with --api-keys naming tenants: let tenants share the engines' caches; by "
        "default each tenant's requests carry a cache_salt of its own, so no tenant is "
        "served from, or can time, another tenant's cached prompts",
    )
    gateway.add_argument(
        "--no-announced",
        action="store_true",
        help="route only to the backends given here, not to engines announced in Redis "
        "(pcr bridge --engine-url)",
    )
    gateway.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="the model's tokenizer directory (tokenizer.json, tokenizer_config.json with "
        "its chat template), to tokenize text and chat prompts as the engine does; without "
        "it only token-id prompts are routed by prefix",
    )
    gateway.add_argument(
        "--max-model-len",
        type=_model_len,
        default=None,
        metavar="TOKENS",
        help="the longest prompt the engines take, as their --max-model-len: longer ones are "
        "refused (400) before they are tokenized, a text judged by its bytes (default: the "
        "model's config.json in the --tokenizer directory; without either, none)",
    )
    gateway.add_argument(
        "--block-size",
        type=block_size_arg,
        default=16,
        help="tokens per block, as the engines and the bridge use (default 16)",
    )


def _backend_tls_options(gateway: argparse.ArgumentParser) -> None:
    """How the gateway verifies https:// engines, and the certificate it shows them."""
    gateway.add_argument(
        "--backend-ca-certs",
        metavar="FILE",
        help="PEM CA certificates that https:// engines' certificates must be signed by "
        "(default: the system's CAs)",
    )
    gateway.add_argument(
        "--backend-certfile",
        metavar="FILE",
        help="a PEM client certificate (chain) to present to https:// engines that ask for "
        "one, its private key in --backend-keyfile or in the same file",
    )
    gateway.add_argument(
        "--backend-keyfile",
        metavar="FILE",
        help="the unencrypted PEM private key of --backend-certfile",
    )


def backend_tls(args: argparse.Namespace) -> None:
    """Check the ``--backend-*`` TLS files by loading them (one-line usage errors)."""
    from pcr.web.tls import TlsError, client_context

    try:
        client_context(args.backend_ca_certs, args.backend_certfile, args.backend_keyfile)
    except TlsError as exc:
        raise UsageError(f"argument --backend-{exc.field.replace('_', '-')}: {exc}") from None


def backend_key(args: argparse.Namespace) -> str | None:
    """The engines' key: ``--backend-api-key-file``, else ``$PCR_BACKEND_API_KEY``."""
    from pcr.gateway.config import check_backend_key

    what = "argument --backend-api-key-file"
    if args.backend_api_key_file is None:
        key = os.environ.get("PCR_BACKEND_API_KEY")
        what = "PCR_BACKEND_API_KEY"
    else:
        try:
            with open(args.backend_api_key_file, "rb") as handle:
                raw = handle.read(8192)
        except OSError as exc:
            raise UsageError(
                f"{what}: cannot read {str(args.backend_api_key_file)!r}: {exc.strerror}"
            ) from None
        key = raw.decode("ascii", "replace").strip()
    if key is None:
        return None
    try:
        return check_backend_key(key)
    except ValueError:
        raise UsageError(
            f"{what}: the key must be 1 to 4,096 printable ASCII characters without spaces"
        ) from None


def _balance_options(gateway: argparse.ArgumentParser) -> None:
    """The balance rule: the policy, its weights, and the load shared among replicas."""
    gateway.add_argument(
        "--policy", choices=POLICIES, default="prefix", help="default: prefix (against load)"
    )
    gateway.add_argument(
        "--queue-weight",
        type=_number(0, "--queue-weight", zero=True),
        default=0.1,
        help="tokens of cost per token of work queued ahead on a backend (default 0.1)",
    )
    gateway.add_argument(
        "--spread-weight",
        type=_number(0, "--spread-weight", zero=True),
        default=1.0,
        help="cost, in prompts, of a backend's excess share of the recent work (default 1)",
    )
    gateway.add_argument(
        "--affinity-weight",
        type=_number(0, "--affinity-weight", zero=True),
        default=0.5,
        help="pull, in prompts, towards the backend serving the prompt's kin (requests "
        "that start with the same block: a shared system prompt), so engines specialize "
        "(default 0.5; 0: none)",
    )
    gateway.add_argument(
        "--affinity-bound",
        type=_number(1, "--affinity-bound", zero=True),
        default=1.3,
        help="the affinity pulls only towards a backend serving at most this many times "
        "the mean share of the recent requests (default 1.3)",
    )
    gateway.add_argument(
        "--checkpoint-weight",
        type=_number(0, "--checkpoint-weight", zero=True),
        default=0.5,
        help="on a hybrid model's node, the part of its KV prefix beyond the usable one "
        "counted as cached: the request leaves a Mamba state there that its siblings "
        "reuse (default 0.5; 0: rank by the usable prefix alone)",
    )
    gateway.add_argument(
        "--half-life",
        type=_number(0, "--half-life"),
        default=30.0,
        help="seconds over which recent work counts half (default 30)",
    )
    gateway.add_argument(
        "--replica-id",
        type=_replica_id,
        default=None,
        help="this replica's name in the shared load table (default: host-pid)",
    )
    gateway.add_argument(
        "--workers",
        type=int_in(1, MAX_WORKERS, "--workers"),
        default=1,
        help="processes serving the one port (SO_REUSEPORT, the kernel spreads the "
        "connections), each a replica of its own sharing its load with the others through "
        "Redis, so a gateway uses every core (default 1)",
    )
    gateway.add_argument(
        "--scrape-interval",
        type=_number(0, "--scrape-interval", zero=True),
        default=1.0,
        help="seconds between reads of each engine's /metrics (queue, KV usage; 0: never)",
    )


def _pending_options(gateway: argparse.ArgumentParser) -> None:
    """How long and how much requests in flight count as cached where they were sent."""
    gateway.add_argument(
        "--pending-ttl",
        type=_number(0, "--pending-ttl", zero=True),
        default=30.0,
        metavar="SECONDS",
        help="a prompt sent to a backend counts as cached there for the next requests "
        "until the engine's events list its blocks, the request fails, or this many "
        "seconds pass (default 30; 0: requests in flight count nowhere)",
    )
    gateway.add_argument(
        "--pending-grace",
        type=_number(0, "--pending-grace", zero=True),
        default=2.0,
        metavar="SECONDS",
        help="after a request succeeded, seconds its blocks still count for the engine's "
        "events to arrive (default 2)",
    )
    gateway.add_argument(
        "--pending-blocks",
        type=int_in(1, 1 << 30, "--pending-blocks"),
        default=32_768,
        metavar="N",
        help="blocks counted as arriving at one backend at most; past it the oldest "
        "requests' stop counting (default 32768)",
    )


def _wait_options(gateway: argparse.ArgumentParser) -> None:
    """How a routing decision asks Redis, and how long a backend may take."""
    gateway.add_argument(
        "--registry-timeout",
        type=_number(0, "--registry-timeout"),
        default=0.25,
        help="with --no-view: seconds a routing decision waits for Redis before routing by "
        "load (default 0.25)",
    )
    gateway.add_argument(
        "--no-view",
        action="store_true",
        help="ask Redis on every request (waiting at most --registry-timeout) instead of "
        "scoring from the fleet view this process follows",
    )
    gateway.add_argument(
        "--upstream-timeout",
        type=_number(0, "--upstream-timeout"),
        default=600.0,
        help="seconds a backend may take to answer (default 600)",
    )


def backends_file(path: Path) -> dict[str, str]:
    """The backends of a ``--backends`` file (usage errors in one line)."""
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise UsageError(
            f"argument --backends: cannot read {str(path)!r}: {exc.strerror}"
        ) from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise UsageError(f"argument --backends: {str(path)!r} is over {MAX_CONFIG_BYTES:,} bytes")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        raise UsageError(f"argument --backends: {str(path)!r} is not JSON") from None
    table = data.get("backends") if isinstance(data, dict) else None
    if not isinstance(table, dict):
        raise UsageError(
            'argument --backends: the file must hold {"backends": {"NAMESPACE": "URL"}}'
        )
    out = {}
    for namespace, url in table.items():
        try:
            out[validate_namespace(namespace)] = validate_engine_url(url)
        except (TypeError, ValueError) as exc:
            raise UsageError(f"argument --backends: {exc}") from None
    return out


def _backends(args: argparse.Namespace) -> dict[str, str]:
    """The backends of ``--backend`` and ``--backends`` (the former first)."""
    backends = dict(args.backend)
    if len(backends) != len(args.backend):
        raise UsageError("argument --backend: each namespace may be given once")
    if args.backends is not None:
        for namespace, url in backends_file(args.backends).items():
            backends.setdefault(namespace, url)
    if len(backends) > MAX_BACKENDS:
        raise UsageError(f"at most {MAX_BACKENDS} backends")
    return backends


def _gateway_config(args: argparse.Namespace, backends: dict[str, str]) -> Any:
    """The ``pcr.gateway.config.GatewayConfig`` of the command line."""
    from pcr.gateway.balance import BalanceRule
    from pcr.gateway.config import GatewayConfig
    from pcr.gateway.pending import PendingBounds

    rule = BalanceRule(
        queue_weight=args.queue_weight,
        spread_weight=args.spread_weight,
        affinity_weight=args.affinity_weight,
        affinity_bound=args.affinity_bound,
        checkpoint_weight=args.checkpoint_weight,
        half_life=args.half_life,
    )
    return GatewayConfig(
        backends=backends,
        tokenizer=args.tokenizer,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        policy=args.policy,
        rule=rule,
        pending=PendingBounds(args.pending_ttl, args.pending_grace, args.pending_blocks),
        replica_id=args.replica_id or "",
        scrape_interval=args.scrape_interval,
        registry_timeout=args.registry_timeout,
        upstream_timeout=args.upstream_timeout,
        view=not args.no_view,
        announced=not args.no_announced,
        backend_ca_certs=args.backend_ca_certs,
        backend_certfile=args.backend_certfile,
        backend_keyfile=args.backend_keyfile,
        backend_api_key=backend_key(args),
        tenant_salts=not args.no_tenant_salts,
    )


def without_torch() -> None:
    """Keep torch out of this process: the gateway tokenizes and never runs a model, but
    ``transformers`` imports torch whenever it finds it installed (for ``AutoTokenizer``
    too), most of a start with ``--tokenizer``. A ``None`` in ``sys.modules`` makes it
    absent, as on an install of the gateway extra alone: ``importlib.util.find_spec``
    answers None and an import raises ``ImportError``. The tokenizer class chosen and its
    tokens are the same; transformers' advice that torch is missing is not printed."""
    if "torch" not in sys.modules:
        sys.modules["torch"] = None  # type: ignore[assignment]
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def command_gateway(args: argparse.Namespace) -> int:
    """``pcr gateway``: check, build the app, bind, then route until a signal."""
    check_url("gateway", args.redis_url)
    backends = _backends(args)
    without_torch()
    require("gateway", NEEDED, "gateway")
    tls = tls_settings(args)
    access = access_policy("gateway", args)
    backend_tls(args)
    config = _gateway_config(args, backends)
    enable_metrics()
    workers = args.workers
    if workers == 1:  # the app (its tokenizer checked) before the port is taken
        app = _gateway_app(args, config, access)
        sock = bind(args.host, args.port)
        _say_routing(args, backends, sock, bool(tls), workers)
        return run_app(app, sock, args, "gateway", openai_errors=True, **tls)
    sock = bind(args.host, args.port, reuse_port=True)
    port = sock.getsockname()[1]
    _say_routing(args, backends, sock, bool(tls), workers)

    def worker(index: int) -> int:
        """One of the processes: its own app, its own replica id, its own socket on the
        port (the first worker the one bound here, which the parent then closes: a
        worker's socket leaves the port with it, so no connection waits on a socket
        nobody accepts from while a new worker starts)."""
        if index == 0 and sock.fileno() != -1:
            mine = sock
        else:
            sock.close()
            mine = bind(args.host, port, reuse_port=True)
        rid = f"{args.replica_id}-w{index}" if args.replica_id else ""
        try:
            app = _gateway_app(args, replace(config, replica_id=rid), access)
        except BaseException:
            mine.close()
            raise
        return run_app(app, mine, args, "gateway", openai_errors=True, **tls)

    code = serve_workers(workers, worker, started=sock.close)
    sock.close()
    return 0 if code is None else code


def _say_routing(
    args: argparse.Namespace, backends: dict[str, str], sock: Any, tls: bool, workers: int
) -> None:
    host, port = sock.getsockname()[:2]
    where_from = listen_url(host, port, "https" if tls else "http")
    known = ", ".join(f"{n}={u}" for n, u in sorted(backends.items())) or "none configured"
    where = "registry in" if args.no_announced else "and engines announced in"
    processes = f", {workers} worker processes" if workers > 1 else ""
    print(
        f"pcr gateway: routing on {where_from} to {known} ({where} Redis at "
        f"{shown_url(args.redis_url)}), policy {args.policy}{processes}",
        flush=True,
    )


def _gateway_app(args: argparse.Namespace, config: Any, access: Any) -> Any:
    """The gateway's app of ``config`` (its tokenizer loaded: a bad one is a usage error)."""
    from pcr.gateway.service import create_gateway_app
    from pcr.gateway.tokens import TokenizerError
    from pcr.serve.cors import allow_origins

    try:
        app = create_gateway_app(
            config,
            args.redis_url,
            key_prefix=args.key_prefix,
            hybrid=args.hybrid,
            max_connections=args.max_connections,
            pool_timeout=args.pool_timeout,
            access=access,
        )
    except TokenizerError as exc:
        raise UsageError(f"argument --tokenizer: {exc}") from None
    return allow_origins(app, args.allowed_origins, openai=True)
