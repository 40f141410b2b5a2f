#!/bin/sh
# The GPU check: on a machine with CUDA, the agent's CUDA path (the whole arena registered with
# cudaHostRegister, each block one DMA between GPU memory and the arena, bytes checked on the
# GPU) through a real daemon: bench/gpu_copy.py, after the agent's copier tests.
#
# Prepare here, once per change of the dependencies:  make gpu-wheels
#   (.whl/: wheels, for the device's Python, of the daemon's packages its image lacks, pinned to
#   this venv's versions; and kvcached/v1, the generated gRPC code, by make install)
# Run there (the device tool), carrying the two ignored paths:
#   carry [".whl", "kvcached/v1"], command "sh bench/gpu_check.sh"
# What it measured lands in $OUT (the device tool brings it back), or /tmp/gpu-check.
set -eu
PYTHON=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu-check}
SITE=${SITE:-/tmp/kvcached-site}
mkdir -p "$OUT"
say() { printf '\n== %s\n' "$*"; }

say "the machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
"$PYTHON" -c 'import sys, torch; print("python", sys.version.split()[0], "| torch", torch.__version__, "| CUDA", torch.cuda.is_available(), "|", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")'

say "the daemon's packages, from .whl"
ls .whl/*.whl > /dev/null 2>&1 || { echo "no .whl/: run make gpu-wheels here first and carry .whl"; exit 2; }
[ -f kvcached/v1/kvcache_pb2.py ] || { echo "no kvcached/v1: run make install here first and carry kvcached/v1"; exit 2; }
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
PYTHONPATH="$SITE:$PWD:$PWD/agent${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
"$PYTHON" -c 'import kvcached.cli, kvcached.lifecycle.daemon, kvcached_agent.agent, kvcached_agent.slab_pins; print("kvcached and its agent import")'

say "the agent's copier and slab pins (tests)"
"$PYTHON" -m pytest -q -p no:cacheprovider tests/unit/test_agent_copy.py tests/unit/test_slab_pins.py 2>&1 | tee "$OUT/tests.txt"

say "bench/gpu_copy.py --quick: save and load through the arena against a pinned copy_, same run"
"$PYTHON" bench/gpu_copy.py --quick --json "$OUT/gpu_copy.json" 2>&1 | tee "$OUT/gpu_copy.txt"
