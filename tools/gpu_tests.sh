#!/usr/bin/env bash
# The GPU test suite on one GPU machine, in one command that leaves its evidence even when a time limit cuts it:
# every failure's traceback is appended to $OUT/failures.txt the moment it happens (the suite's --failure-log),
# the junit XML and the log land in $OUT, and the run stops itself after LIMIT seconds.
#
#   OUT=results bash tools/gpu_tests.sh [pytest selection and flags]     default selection: tests
# Triton's compile cache is the checkout's build/triton-cache (shared with tools/side_by_side.sh; it stays between
# commands while the machine is held). The suite runs alone on the GPU: anything sharing its memory turns tests
# into out-of-memory failures.
#
# A test that faults the device (an illegal address) fails, and its worker process ends after it: a fresh worker
# runs the rest, instead of every later test in that process failing on the broken CUDA context (tests/conftest.py).
#
# The peer comes from .peer/ (its install.sh makes it importable); the tests that need it skip without it.
# Expected on an H200: ~8 min for the whole suite with 8 workers (compiling the kernels is most of it).
set -u -o pipefail
OUT=${OUT:-results}
LIMIT=${LIMIT:-540}
WORKERS=${WORKERS:-8}
mkdir -p "$OUT"
# NVLink multicast stays off (a program using it can take a shared host's GPUs down).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if [ -f .peer/install.sh ]; then
  eval "$(bash .peer/install.sh "$PWD/.peer")" || echo "gpu_tests: the peer did not install; its tests skip"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/build/triton-cache}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
[ $# -gt 0 ] || set -- tests
: > "$OUT/failures.txt"
timeout "$LIMIT" python3 -m pytest -q -m gpu -p no:cacheprovider --timeout=300 -n "$WORKERS" -rfE \
  --failure-log "$OUT/failures.txt" --junitxml "$OUT/gpu.xml" --durations=20 "$@" 2>&1 | tee "$OUT/gpu.log" \
  | grep -v "^\[\|PASSED\|PytestBenchmarkWarning\|warner(" | tail -80
status=$?
echo "gpu_tests: $(grep -c '^==== ' "$OUT/failures.txt") failure reports in $OUT/failures.txt"
exit $status
