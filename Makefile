# kvcached: `make run` starts a daemon, `make test` runs the tests. Both set everything up first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
PROTO_SRC := $(wildcard proto/kvcached/v1/*.proto)
PROTO_OUT := kvcached/v1/kvcache_pb2.py
COMPILED := $(VENV)/.compiled

.PHONY: install nixl gpu-wheels setup run lint test test-unit test-integration test-reliability soak test-engines engines-venv test-e2e e2e-venv bench proto clean system-deps certs

install: $(STAMP) $(PROTO_OUT) $(COMPILED)

# The environments build side by side (make setup), but their editable installs of this tree
# write its *.egg-info folders: one at a time.
EDITABLE := flock .editable.lock

# torch first, at the version whose CPU build these machines' pip finds (a plain `pip install
# torch` from PyPI would take the CUDA build); the agent's range admits it, so nothing more comes.
$(STAMP): pyproject.toml agent/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(EDITABLE) $(PIP) install --quiet -e ./agent -e '.[dev]'
	touch $@ $(COMPILED)

# The daemon's C extensions (setup.py: kvcached/host/_short_hash.c, kvcached/codecs/_planes.c) are built in place by the
# editable install above, with the system's gcc and Python's headers; again when their sources change.
$(COMPILED): setup.py kvcached/host/_short_hash.c kvcached/codecs/_planes.c | $(STAMP)
	$(EDITABLE) $(PIP) install --quiet --no-deps -e .
	touch $@

# NIXL for the peer tier's NIXL lane ([quic] lane = "nixl"; requirements-nixl.txt says why --no-deps).
NIXL_STAMP := $(VENV)/.nixl
nixl: $(NIXL_STAMP)
$(NIXL_STAMP): requirements-nixl.txt | $(STAMP)
	$(PIP) install --quiet --no-deps -r requirements-nixl.txt
	touch $@

proto $(PROTO_OUT): $(PROTO_SRC) | $(STAMP)
	$(PY) -m grpc_tools.protoc -I proto --python_out=. --pyi_out=. --grpc_python_out=. $(PROTO_SRC)

run: install
	mkdir -p var
	$(VENV)/bin/kvcached serve --config config/kvcached.toml

# Everything the tests need, the three environments and the system packages built side by side:
# pip spends much of its time waiting on the disk, so two cores build them in less time together.
setup:
	$(MAKE) --no-print-directory -j4 install engines-venv e2e-venv system-deps

# Style, types and the import contracts of docs/architecture.md (pyproject.toml holds their settings).
lint: install
	$(VENV)/bin/ruff check kvcached agent tests bench
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# The lint runs beside the engines' environments as they build (it needs only .venv). The tree is
# compiled to bytecode first: the tests start some 600 daemons and CLI processes, and where the
# environment sets PYTHONDONTWRITEBYTECODE (these machines do) each would otherwise compile every
# module of kvcached from source as it starts (0.2 s a start here).
#
# The main suite runs in TEST_WORKERS processes (pytest-xdist; worksteal keeps the long tests from
# leaving one worker alone at the end): alone it keeps less than one core busy (its tests wait on
# daemons, disks and timers). Its temporary folders lie under a short fresh path (the tests'
# Unix sockets must fit AF_UNIX's 108 bytes with xdist's per-worker folder added), removed when
# every test passed and kept for a reader when one failed.
TEST_WORKERS ?= 2
test:
	$(MAKE) --no-print-directory -j4 lint engines-venv e2e-venv system-deps nixl
	$(PY) -m compileall -q kvcached agent/kvcached_agent tests > /dev/null
	tmp=$$(mktemp -d /tmp/kvt.XXXXXX) && $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal \
		--basetemp=$$tmp --durations=15 tests && rm -rf $$tmp
	$(ENGINES_PY) -m pytest -q tests/engines
	$(E2E_PY) -m pytest -q tests/e2e

# The engine plug-ins' tests need vLLM and SGLang: their own environment (about 8 GB), built
# once and kept: the engines at the pins of agent/kvcached_agent/engines/versions.py and the small
# packages their plug-in modules import, all --no-deps (no second torch), then the agent and the
# daemon (the tests start real daemons). Its torch is 2.14.1 with torchvision 0.29.1 (a CUDA
# build that runs on the CPU, both on this kind of machine's local disk): SGLang's host pool,
# which the zero-copy path copies to and from, imports torchvision, and no torchvision matches
# the CPU build 2.13.0.
ENGINES_TORCH := torch==2.14.1 torchvision==0.29.1
ENGINES_VENV  := .venv-engines
ENGINES_PY    := $(ENGINES_VENV)/bin/python
ENGINES_STAMP := $(ENGINES_VENV)/.installed
ENGINE_PINS    = $(shell $(PYTHON) agent/kvcached_agent/engines/versions.py)

engines-venv: $(ENGINES_STAMP) $(PROTO_OUT)

# $(call engine_venv,DIR,PINS,REQUIREMENTS,TORCH): torch first (TORCH, the CPU build 2.13.0
# unless given), then the engine and what it imports --no-deps, then the agent and the daemon;
# the stamp last.
define engine_venv
	$(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install --quiet --upgrade pip
	$(1)/bin/python -m pip install --quiet $(or $(4),torch==2.13.0)
	$(1)/bin/python -m pip install --quiet --no-deps $(2) -r $(3)
	$(EDITABLE) $(1)/bin/python -m pip install --quiet -e ./agent -e '.[dev]'
	touch $(1)/.installed
endef

$(ENGINES_STAMP): pyproject.toml agent/pyproject.toml tests/engines/requirements.txt agent/kvcached_agent/engines/versions.py Makefile
	$(call engine_venv,$(ENGINES_VENV),$(ENGINE_PINS),tests/engines/requirements.txt,$(ENGINES_TORCH))

# The end-to-end tests run a real engine on a real (small, locally built) model: vLLM's CPU
# build, which runs without a GPU, at the pin of versions.py END_TO_END. It installs the module
# `vllm` too, at another release than the interface tests', so it has an environment of its own
# (about 1.8 GB), built once and kept the same way: --no-deps, no second torch.
E2E_VENV  := .venv-e2e
E2E_PY    := $(E2E_VENV)/bin/python
E2E_STAMP := $(E2E_VENV)/.installed
E2E_PINS   = $(shell $(PYTHON) agent/kvcached_agent/engines/versions.py e2e)

e2e-venv: $(E2E_STAMP) $(PROTO_OUT)

$(E2E_STAMP): pyproject.toml agent/pyproject.toml tests/e2e/requirements.txt agent/kvcached_agent/engines/versions.py
	$(call engine_venv,$(E2E_VENV),$(E2E_PINS),tests/e2e/requirements.txt)

test-e2e: install e2e-venv system-deps
	$(E2E_PY) -m pytest -q tests/e2e

test-engines: install engines-venv system-deps
	$(ENGINES_PY) -m pytest -q tests/engines

test-unit: install
	$(PY) -m pytest -q tests/unit

test-integration: install system-deps
	$(PY) -m pytest -q tests/integration

# The reliability suite's short versions run in `make test`; `make soak` runs the long ones
# (marked soak: the QUIC flood at full size, crash loops, soaks) and prints their counts.
test-reliability: install system-deps
	$(PY) -m pytest -q -s tests/reliability

# SOAK_KILLS: SIGKILLs of the write-through crash loop's main case (its other cases get a third each).
SOAK_KILLS ?= 200
soak: install system-deps
	$(PY) -m pytest -q -s -m soak --timeout=1800 tests/reliability
	KVCACHED_CRASH_ITERATIONS=$(SOAK_KILLS) $(PY) -m pytest -q -s tests/integration/test_ssd_crash.py

# System packages (Debian): redis-server (bench_core.py's Redis baseline), fio (bench_ssd.py's
# disk baseline), prometheus for promtool (tests check /metrics and deploy/*.yml with it) and
# systemd for systemd-analyze (tests verify deploy/kvcached.service), iproute2 and util-linux for
# the tests' network namespaces and pods (ip, unshare, nsenter). One apt-get update, then
# only the missing ones are installed.
system-deps:
	@missing=""; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	command -v fio >/dev/null || missing="$$missing fio"; \
	command -v promtool >/dev/null || missing="$$missing prometheus"; \
	command -v systemd-analyze >/dev/null || missing="$$missing systemd"; \
	command -v etcd >/dev/null || missing="$$missing etcd-server"; \
	command -v ip >/dev/null || missing="$$missing iproute2"; \
	command -v nsenter >/dev/null || missing="$$missing util-linux"; \
	if [ -n "$$missing" ]; then \
		echo "installing:$$missing"; \
		apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $$missing; \
	fi

# The GPU check's packages (bench/gpu_check.sh): wheels of the daemon's dependencies that the
# device image lacks, for its Python (GPU_PYTHON), at this venv's versions, in .whl/ (ignored;
# the device tool carries it, 64 MiB at most). kvcached/v1 (make install) travels beside it.
GPU_PYTHON ?= 3.12
GPU_WHEELS := grpcio-reflection grpcio-health-checking rocksdict blake3 aioquic pylsqpack pyopenssl \
	service-identity pyasn1 pyasn1-modules cryptography etcd3aio pyzmq msgspec
gpu-wheels: install
	rm -rf .whl && mkdir -p .whl
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl \
		$$($(PY) -m pip freeze | grep -i -E '^($(shell echo $(GPU_WHEELS) | tr ' ' '|'))==')
	du -sh .whl

# BENCH_ARGS go to bench_core.py; SSD_BENCH_ARGS to bench_ssd.py (default: --quick if BENCH_ARGS has it).
# bench_agent.py and gpu_copy.py (which only says it skipped where CUDA is missing) get --quick if BENCH_ARGS has it.
SSD_BENCH_ARGS ?= $(filter --quick,$(BENCH_ARGS))

bench: install engines-venv e2e-venv system-deps
	$(PY) bench/bench_core.py $(BENCH_ARGS)
	$(PY) bench/bench_ssd.py $(SSD_BENCH_ARGS)
	$(PY) bench/bench_agent.py $(filter --quick,$(BENCH_ARGS))
	$(PY) bench/gpu_copy.py $(filter --quick,$(BENCH_ARGS))
	$(PY) bench/bench_peers.py $(filter --quick,$(BENCH_ARGS))
	$(PY) bench/bench_loads.py $(filter --quick,$(BENCH_ARGS))
	$(PY) bench/bench_lane.py $(filter --quick,$(BENCH_ARGS))
	$(PY) bench/bench_cluster.py $(filter --quick,$(BENCH_ARGS))
	$(PY) bench/bench_cluster_daemons.py $(filter --quick,$(BENCH_ARGS))
	$(PY) bench/bench_metrics.py $(filter --quick,$(BENCH_ARGS))
	$(PY) bench/bench_policies.py $(filter --quick,$(BENCH_ARGS))
	$(PY) bench/trace_reuse.py
	$(PY) bench/bench_hostile.py $(filter --quick,$(BENCH_ARGS))
	$(PY) bench/bench_upgrade.py $(filter --quick,$(BENCH_ARGS))
	$(PY) bench/bench_loop.py $(filter --quick,$(BENCH_ARGS))
	$(PY) bench/bench_events.py $(filter --quick,$(BENCH_ARGS))
	$(PY) bench/bench_tenants.py $(filter --quick,$(BENCH_ARGS))
	$(ENGINES_PY) bench/bench_engines.py $(filter --quick,$(BENCH_ARGS))
	$(E2E_PY) bench/bench_e2e.py $(filter --quick,$(BENCH_ARGS))

# A cluster CA and certificates for three nodes on this machine (docs/peers.md); CERT_NODES to change.
CERT_NODES ?= node-a node-b node-c
certs: install
	$(VENV)/bin/kvcached certs --dir var/certs $(CERT_NODES)

clean:
	rm -rf $(VENV) $(ENGINES_VENV) $(E2E_VENV) kvcached/v1 var .pytest_cache
