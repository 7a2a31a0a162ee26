#!/usr/bin/env bash
# The side-by-side table on one GPU: ours beside mamba_ssm (+ causal-conv1d; fla for the SSD), every benchmark in
# one process, then the report. Usage, from the repository root:
#   OUT=results tools/side_by_side.sh [--only kernels,train,generate,long_context] [more `bench all` flags]
# The peer comes from .peer/ (a copy of the peer folder: its install.sh makes it importable) or from what is
# installed already; without it the run times ours alone. Writes $OUT/<date>-<device>/<bench>.json,
# $OUT/performance.md, $OUT/plots.tar (the ratio PNGs) and $OUT/log.txt: eight files at most. Merge several runs
# into the repository's report with: mamba-parallel bench report --results benchmarks/results
# On a fresh machine compiling is most of the time (minutes for the SSD section alone on an H200: three
# implementations' autotune candidates), so every kernel is first compiled in warm-up processes, one per CPU core
# (--precompile-workers auto; their timings are thrown away; of the shapes or presets that share kernels, one
# compiles first and the rest start from its cache), and the timed run that follows compiles nothing. What
# does not start before --budget-s is listed as skipped; the table can also run in parts, e.g.
#   --only ssd | --only selective_scan,generate | --only train --train-presets mamba-1.4b mamba-2.8b ...
# each part's files land beside the others' and the report combines the rows of runs with the same settings.
set -u -o pipefail
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
# NVLink multicast stays off (a program using it can take a shared host's GPUs down).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if [ -f .peer/install.sh ]; then
  eval "$(bash .peer/install.sh "$PWD/.peer")" || echo "side_by_side: the peer did not install; timing ours alone"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# Triton's compile cache in the checkout's build/ folder: it stays between commands while the machine is held, and
# tools/gpu_tests.sh shares it.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/build/triton-cache}
python3 -c "import mamba_ssm, causal_conv1d; print('peer: mamba_ssm', mamba_ssm.__version__, 'causal_conv1d', causal_conv1d.__version__)" \
  || echo "side_by_side: mamba_ssm does not import here"
# Budget: one device command may run 10 minutes; what has not started after --budget-s is listed as skipped.
python3 -m mamba_parallel.cli bench all --out "$OUT" --report "$OUT/performance.md" --plots "$OUT/plots" \
  --budget-s 540 --precompile-workers auto --precompile-s 200 --generate-repeats 1 "$@" 2>&1 | tee "$OUT/log.txt"
status=$?
if [ -d "$OUT/plots" ]; then tar cf "$OUT/plots.tar" -C "$OUT" plots && rm -rf "$OUT/plots"; fi
exit $status
