# kvcached: `make run` starts a daemon, `make test` runs the tests. Both set everything up first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
PROTO_SRC := $(wildcard proto/kvcached/v1/*.proto)
PROTO_OUT := kvcached/v1/kvcache_pb2.py

.PHONY: install run test test-unit test-integration bench proto clean system-deps certs

install: $(STAMP) $(PROTO_OUT)

# torch first, at the version whose CPU build these machines' pip finds (a plain `pip install
# torch` from PyPI would take the CUDA build); the agent's range admits it, so nothing more comes.
$(STAMP): pyproject.toml agent/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e ./agent -e '.[dev]'
	touch $@

proto $(PROTO_OUT): $(PROTO_SRC) | $(STAMP)
	$(PY) -m grpc_tools.protoc -I proto --python_out=. --pyi_out=. --grpc_python_out=. $(PROTO_SRC)

run: install
	mkdir -p var
	$(VENV)/bin/kvcached serve --config config/kvcached.toml

test: install system-deps
	$(PY) -m pytest -q tests

test-unit: install
	$(PY) -m pytest -q tests/unit

test-integration: install system-deps
	$(PY) -m pytest -q tests/integration

# System packages (Debian): redis-server (bench_core.py's Redis baseline), fio (bench_ssd.py's
# disk baseline), prometheus for promtool (tests check /metrics and deploy/*.yml with it) and
# systemd for systemd-analyze (tests verify deploy/kvcached.service). One apt-get update, then
# only the missing ones are installed.
system-deps:
	@missing=""; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	command -v fio >/dev/null || missing="$$missing fio"; \
	command -v promtool >/dev/null || missing="$$missing prometheus"; \
	command -v systemd-analyze >/dev/null || missing="$$missing systemd"; \
	if [ -n "$$missing" ]; then \
		echo "installing:$$missing"; \
		apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $$missing; \
	fi

# BENCH_ARGS go to bench_core.py; SSD_BENCH_ARGS to bench_ssd.py (default: --quick if BENCH_ARGS has it).
# bench_agent.py and gpu_copy.py (which only says it skipped where CUDA is missing) get --quick if BENCH_ARGS has it.
SSD_BENCH_ARGS ?= $(filter --quick,$(BENCH_ARGS))

bench: install system-deps
	$(PY) bench/bench_core.py $(BENCH_ARGS)
	$(PY) bench/bench_ssd.py $(SSD_BENCH_ARGS)
	$(PY) bench/bench_agent.py $(filter --quick,$(BENCH_ARGS))
	$(PY) bench/gpu_copy.py $(filter --quick,$(BENCH_ARGS))
	$(PY) bench/bench_peers.py $(filter --quick,$(BENCH_ARGS))
	$(PY) bench/bench_metrics.py $(filter --quick,$(BENCH_ARGS))
	$(PY) bench/bench_policies.py $(filter --quick,$(BENCH_ARGS))

# A cluster CA and certificates for three nodes on this machine (docs/peers.md); CERT_NODES to change.
CERT_NODES ?= node-a node-b node-c
certs: install
	$(VENV)/bin/kvcached certs --dir var/certs $(CERT_NODES)

clean:
	rm -rf $(VENV) kvcached/v1 var .pytest_cache
