#!/usr/bin/env bash
# 7B-class models trained for real on ONE GPU (an H200: 141 GB GPU, 128 GB host): 20 steps at seq 2048 with
# FSDP2 CPU offload (states in host memory), bf16 weights with fp32 AdamW moments (12 bytes / parameter: ~88 GB of
# host memory for 7.3B parameters) and activation checkpointing per block. Each run prints tokens/s, peak GPU
# memory (mem) and peak host memory (host) per step, and the loss falling; metrics.jsonl under $OUT/7b/<preset>/.
# Nothing is saved at the end (--no-save-final: a 7B checkpoint would not fit the disk).
#
#   bash tools/one_gpu_7b.sh [presets...]        default: mamba-codestral-7b nemotron-h-8b falcon-mamba-7b
#   MODE=gpu bash tools/one_gpu_7b.sh            the same without offload (the 12-byte states on the GPU)
#
# Expected on one H200 with 16 host cores, per preset: ~2.5 min to build in host memory (first run: + stdlib
# tokenization ~20 s), then 20 steps of ~13-14 s with offload (6 s of them the AdamW step over ~90 GB of host
# state, logged as optimizer_s) or ~1.3 s on the GPU: about 8 min each with offload, 2-3 min without.
set -euo pipefail
OUT=${OUT:-runs}
MODE=${MODE:-offload}
PRESETS=("$@")
[ ${#PRESETS[@]} -gt 0 ] || PRESETS=(mamba-codestral-7b nemotron-h-8b falcon-mamba-7b)
PY=${PYTHON:-python3}
DATA=$OUT/7b/data
[ -f "$DATA/header.json" ] || $PY -m mamba_parallel.cli prepare-data stdlib --out "$DATA"
for preset in "${PRESETS[@]}"; do
    if ! $PY -c "import sys; from mamba_parallel.config import PRESETS; sys.exit(sys.argv[1] not in PRESETS)" "$preset"; then
        echo "== $preset: not a preset at this commit, skipped"; continue
    fi
    extra=(--cpu-offload)
    [ "$MODE" = gpu ] && extra=()
    echo "== $preset ($MODE)"
    rm -rf "$OUT/7b/$preset-$MODE"
    $PY -m mamba_parallel.cli train --preset "$preset" --data "$DATA" --out "$OUT/7b/$preset-$MODE" \
        "${extra[@]}" --param-dtype bf16 --activation-checkpointing --dtype bf16 --seq-len 2048 --batch-size 4 \
        --steps 20 --warmup 2 --lr 3e-4 --log-every 1 --eval-every 0 --save-every 0 --no-save-final \
        --sample-tokens 0 --no-progress 2>&1 | grep -E "^(model|global|step|--|pp |Traceback|[A-Za-z]*Error)" || true
done
