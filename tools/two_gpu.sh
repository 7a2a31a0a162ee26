#!/usr/bin/env bash
# The two-GPU figures (needs a machine with 2 GPUs, e.g. two H200s): every command the figures come from, in parts
# that each fit a 10-minute device call. Results (JSON / Markdown) land under $OUT (default runs/two_gpu).
#
#   bash tools/two_gpu.sh dp          DP=2 vs 1 GPU, mamba2-1.3b and mamba2-370m, seq 2048 x 8 per GPU, FSDP2 and DDP
#                                     (~8 min: 8 bench_train runs of ~1 min)                         goal >= 1.97x
#   bash tools/two_gpu.sh peer        the same step beside the peer (mamba_ssm) wrapped in DDP on the same 2 GPUs
#                                     (~4 min; needs the peer installed: shared/peer)                 goal >= 1.3x
#   bash tools/two_gpu.sh tp          TP=2 vs 1 GPU, mamba2-2.7b and mamba-2.8b, same global batch, then a profile
#                                     of each TP=2 step: time per collective kind and its share (~8 min) goal >= 1.6x
#   bash tools/two_gpu.sh pp          PP=2 mamba2-2.7b: 1F1B / GPipe / interleaved / zbv, bubble fraction measured,
#                                     against the same global batch on one GPU (~6 min)               goal >= 1.6x
#   bash tools/two_gpu.sh 7b          falcon-mamba-7b / mamba-codestral-7b on 2 GPUs with FSDP2, TP=2, PP=2: 20 steps,
#                                     tokens/s, peak memory, losses (compare with tools/one_gpu_7b.sh) (~8 min each
#                                     preset; 7b-fsdp / 7b-tp / 7b-pp run one layout)
#   bash tools/two_gpu.sh cp          CP=2: the longest mamba2-1.3b sequence at batch 1 (doubling from 262,144)
#                                     (~5 min)                                                       goal >= 524,288
#   bash tools/two_gpu.sh tests       every NCCL GPU test (TP, CP, DP, PP parity) (~5 min)
set -euo pipefail
OUT=${OUT:-runs/two_gpu}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
part=${1:-}

run_train_7b() {  # preset layout-name flags...
    local preset=$1 name=$2; shift 2
    if ! $PY -c "import sys; from mamba_parallel.config import PRESETS; sys.exit(sys.argv[1] not in PRESETS)" "$preset"; then
        echo "== $preset: not a preset at this commit, skipped"; return 0
    fi
    local data=$OUT/data
    [ -f "$data/header.json" ] || $PY -m mamba_parallel.cli prepare-data stdlib --out "$data"
    echo "== $preset $name"
    rm -rf "$OUT/7b/$preset-$name"
    $PY -m torch.distributed.run --standalone --nproc_per_node 2 -m mamba_parallel.cli train --preset "$preset" \
        --data "$data" --out "$OUT/7b/$preset-$name" --dtype bf16 --seq-len 2048 --batch-size 4 --param-dtype bf16 \
        --activation-checkpointing --steps 20 --warmup 2 --lr 3e-4 --log-every 1 --eval-every 0 --save-every 0 \
        --no-save-final --sample-tokens 0 --no-progress "$@" 2>&1 | grep -E "^(model|global|step|--|pp |Traceback|[A-Za-z]*Error)" || true
}

case "$part" in
dp)
    for mode in fsdp ddp; do
        $PY -m mamba_parallel.bench.bench_scaling --models mamba2-1.3b mamba2-370m --layouts 1gpu dp2 \
            --seq-len 2048 --batch-per-dp-rank 8 --dp-mode "$mode" --out "$OUT/dp-$mode"
    done ;;
peer)
    # The peer's step in DDP: the side-by-side train benchmark's two-GPU mode where this commit has it.
    if $PY -m mamba_parallel.bench.train_side_by_side --help 2>/dev/null | grep -q -- "--nproc"; then
        $PY -m mamba_parallel.bench.train_side_by_side --preset mamba2-1.3b --seq-len 2048 --batch-size 8 \
            --nproc 2 --dp-mode ddp --out "$OUT/peer"
    else
        echo "peer: this commit has no two-GPU side-by-side train benchmark (mamba_parallel.bench.train_side_by_side --nproc)"
        exit 2
    fi ;;
tp)
    $PY -m mamba_parallel.bench.bench_scaling --models mamba2-2.7b mamba-2.8b --layouts 1gpu tp2 --seq-len 2048 \
        --global-batch 8 --out "$OUT/tp"
    for m in mamba2-2.7b mamba-2.8b; do  # per-collective time: the nccl rows of the kernel table
        $PY -m torch.distributed.run --standalone --nproc_per_node 2 -m mamba_parallel.bench.profile_train \
            --preset "$m" --tp 2 --batch-size 8 --seq-len 2048 --out "$OUT/tp-profile-$m"
    done ;;
pp)
    $PY -m torch.distributed.run --standalone --nproc_per_node 1 -m mamba_parallel.bench.bench_pipeline \
        --preset mamba2-2.7b --pp 1 --microbatches 8 --batch-size 2 --seq-len 2048 --json "$OUT/pp-1gpu.json"
    for sched in 1f1b gpipe interleaved-1f1b zbv; do
        $PY -m torch.distributed.run --standalone --nproc_per_node 2 -m mamba_parallel.bench.bench_pipeline \
            --preset mamba2-2.7b --pp 2 --schedule "$sched" --microbatches 8 --batch-size 2 --seq-len 2048 \
            --json "$OUT/pp2-$sched.json"
    done ;;
7b|7b-fsdp|7b-tp|7b-pp)
    for preset in falcon-mamba-7b mamba-codestral-7b; do
        [ "$part" = 7b ] || [ "$part" = 7b-fsdp ] && run_train_7b "$preset" fsdp2
        [ "$part" = 7b ] || [ "$part" = 7b-tp ] && run_train_7b "$preset" tp2 --tp 2
        [ "$part" = 7b ] || [ "$part" = 7b-pp ] && run_train_7b "$preset" pp2 --pp 2 --microbatches 4 --batch-size 1
    done ;;
cp)
    L=262144
    while :; do
        if ! $PY -m torch.distributed.run --standalone --nproc_per_node 2 -m mamba_parallel.bench.bench_long_context \
            --preset mamba2-1.3b --seq-len "$L" --cp 2 --activation-checkpointing --json "$OUT/cp.jsonl"; then
            echo "cp=2: $L tokens failed; the longest that ran is the last record of $OUT/cp.jsonl"; break
        fi
        L=$((L * 2))
        [ "$L" -gt 4194304 ] && break
    done ;;
tests)
    $PY -m pytest -q -m gpu -p no:cacheprovider tests/distributed ;;
*)
    sed -n '2,21p' "$0"; exit 1 ;;
esac
