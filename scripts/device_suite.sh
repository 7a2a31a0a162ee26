#!/usr/bin/env bash
# GPU suite: tests and benchmarks in one batched call on a GPU machine. Usage:
#   OUT=results scripts/device_suite.sh STAGE [STAGE ...]
# stages: tests kernels train1 profile dp tp cp long gen scaling. Each stage has its own time limit so one hang does not
# take the rest down; JSON records go to $OUT/*.json(l), the combined log to $OUT/log.txt.
set -u
OUT=${OUT:-results}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
TR="python3 -m torch.distributed.run --standalone"
log() { echo "=== $(date +%T) $*" | tee -a "$OUT/log.txt"; }
run() { local lim=$1; shift; log "$*"; timeout "$lim" "$@" 2>&1 | tail -n 40 | tee -a "$OUT/log.txt"; }

for stage in "$@"; do case $stage in
  tests)   # every GPU test (bf16/fp16/fp32 kernels vs references, NaN-poisoned allocations, NCCL parity);
           # autotuning off: its first-call sweeps cost minutes and tests check results, not speed
    export MAMBA_PARALLEL_AUTOTUNE=0
    run 300 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/ops tests/models tests/inference tests/bench
    run 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/distributed tests/train
    unset MAMBA_PARALLEL_AUTOTUNE ;;
  kernels)
    for k in ${KERNELS:-ssd selective_scan ops}; do
      run 150 python3 -m mamba_parallel.bench.bench_$k --json "$OUT/$k.json"
    done ;;
  train1)  # one GPU, the ANCHORS setting: seq 2048, batch 8, fp32 master + bf16 autocast, fused AdamW, no clipping;
           # GRAPH=1 adds the CUDA-graph step, RECOMPUTE=items the activation recompute
    for p in ${PRESETS:-mamba2-130m mamba2-370m mamba2-1.3b mamba2-2.7b mamba-130m mamba-370m mamba-1.4b mamba-2.8b}; do
      run 150 python3 -m mamba_parallel.bench.bench_train --preset "$p" --steps 5 --warmup-steps 2 --grad-clip 0 \
        ${RECOMPUTE:+--recompute "$RECOMPUTE"} --json "$OUT/train1_$p.json"
      [ -n "${GRAPH:-}" ] && run 150 python3 -m mamba_parallel.bench.bench_train --preset "$p" --steps 5 --warmup-steps 2 \
        --grad-clip 0 --cuda-graph --json "$OUT/train1_graph_$p.json"
    done ;;
  profile) # where one step's time goes: kernel table by category, host issue time (Markdown + JSON)
    for p in ${PROFILE_PRESETS:-mamba2-1.3b mamba-130m}; do
      run 150 python3 -m mamba_parallel.bench.profile_train --preset "$p" --steps 3 --warmup-steps 2 --grad-clip 0 \
        --host-python --out "$OUT/profile_$p"
    done ;;
  dp)      # data parallel over 2 GPUs (FSDP2 and DDP), 8 sequences per GPU
    for p in ${DP_PRESETS:-mamba2-370m mamba2-1.3b}; do
      run 200 $TR --nproc_per_node 2 -m mamba_parallel.bench.bench_train --preset "$p" --steps 5 --warmup-steps 2 --json "$OUT/dp2_$p.json"
      run 200 $TR --nproc_per_node 2 -m mamba_parallel.bench.bench_train --preset "$p" --dp-mode ddp --steps 5 --warmup-steps 2 --json "$OUT/ddp2_$p.json"
    done ;;
  tp)      # tensor parallel over 2 GPUs, global batch 16 (8 per GPU for dp2; 16 on the tp pair)
    for p in ${TP_PRESETS:-mamba2-2.7b mamba-2.8b}; do
      run 200 $TR --nproc_per_node 2 -m mamba_parallel.bench.bench_train --preset "$p" --tp 2 --batch-size 16 --steps 4 --warmup-steps 2 --json "$OUT/tp2_$p.json"
    done ;;
  cp)      # context parallel parity in bf16 on 2 GPUs
    for p in mamba2-130m mamba-130m; do
      run 150 $TR --nproc_per_node 2 -m mamba_parallel.bench.bench_long_context --parity --preset "$p" --seq-len 8192 --cp 2 --json "$OUT/cp_parity.jsonl"
    done ;;
  long)    # longest sequence of mamba2-1.3b at batch 1: cp=2 with activation checkpointing, vs one GPU
    for L in ${LONG_LENS:-262144}; do
      run 280 $TR --nproc_per_node 2 -m mamba_parallel.bench.bench_long_context --preset mamba2-1.3b --seq-len "$L" --cp 2 --activation-checkpointing --steps 2 --warmup 1 --json "$OUT/long.jsonl"
    done
    for L in ${LONG1_LENS:-65536}; do
      run 200 python3 -m mamba_parallel.bench.bench_long_context --preset mamba2-1.3b --seq-len "$L" --activation-checkpointing --steps 2 --warmup 1 --json "$OUT/long.jsonl"
    done ;;
  gen)
    # CUDA-graph decode (the eager mode takes seconds per setting and is not what ANCHORS compares)
    run 300 python3 -m mamba_parallel.bench.bench_generate --modes graph --repeats 2 --json "$OUT/generate.json" ;;
  scaling)
    for p in ${SCALING_PRESETS:-mamba2-1.3b}; do
      run 550 python3 -m mamba_parallel.bench.bench_scaling --models "$p" --timeout 250 --out "$OUT/scaling_$p"
    done ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac; done
log "done (GPUs: $NGPU)"
