#!/usr/bin/env bash
# The two-GPU figures on one host with two GPUs (two H200s): every command they come from, in parts that each fit
# one 10-minute device command. Run from the repository root. A part's results land in $OUT/<part>/ (at most 8
# files, none deeper than $OUT/<part>/<folder>/<file>); its scratch (run folders, per-run logs, token data) in
# $WORK (default: a temp folder), packed into $OUT/<part>/logs.tar.gz; its whole output in $OUT/<part>/log.txt.
#
#   bash tools/two_gpu.sh dp        DP=2 over 1 GPU, mamba2-1.3b and mamba2-370m, seq 2048 x 8 per GPU, our FSDP2
#                                   default and DDP: 6 bench_train runs (~5 min)                          >= 1.97x
#   bash tools/two_gpu.sh peer      the same step, the peer (mamba_ssm) in torch DDP beside ours (FSDP2, DDP) on both
#                                   GPUs, same weights, one launch (~4 min; the peer from .peer/)         >= 1.3x
#   bash tools/two_gpu.sh tp        TP=2 over 1 GPU, mamba2-2.7b and mamba-2.8b, global batch 8, then a profile of
#                                   each TP=2 step: time per collective kind and its overlap with compute
#                                   (~6 min)                                                              >= 1.6x
#   bash tools/two_gpu.sh pp        PP=2 mamba2-2.7b, 1F1B / GPipe / interleaved 1F1B / ZB-V, global batch 8 in 8
#                                   micro-batches, measured bubble, over 1 GPU at the same batch (~6 min) >= 1.6x
#   bash tools/two_gpu.sh 7b-fsdp   falcon-mamba-7b and mamba-codestral-7b (those that are presets here), 20 steps,
#   bash tools/two_gpu.sh 7b-tp     global batch 4 x 2048, bf16 weights, activation checkpointing: FSDP2 / TP=2 /
#   bash tools/two_gpu.sh 7b-pp     PP=2 (~4-5 min each); tokens/s, peak memory, losses per step. Compare the losses
#                                   with the one-GPU offload run (tools/one_gpu_7b.sh, the same batch):
#                                   python -m mamba_parallel.bench.loss_match ONE/metrics.jsonl $OUT/7b-*/<run>.jsonl
#   bash tools/two_gpu.sh cp        CP=2: the longest mamba2-1.3b sequence at batch 1, doubling from 262,144 while
#                                   the time allows (~6 min)                                           >= 524,288
#   bash tools/two_gpu.sh tests-tp  the NCCL GPU tests of tensor parallel (parity, overlapped TP, graphed TP steps)
#                                   and the CP=2 long-sequence parity (~4-6 min)
#   bash tools/two_gpu.sh tests-dp  the other GPU tests of tests/distributed: DP (FSDP2, DDP) and CP=2 training
#                                   against one GPU, PP parity, offload (~4-6 min)
#
#   SIZE=tiny bash tools/two_gpu.sh PART   the same commands on tiny presets, tiny shapes and one or two steps: on a
#                                          CPU (gloo) they check the plumbing (tests/bench/test_two_gpu_script.py)
#   DRY_RUN=1 bash tools/two_gpu.sh PART   print the commands, run nothing
set -euo pipefail
# NVLink multicast stays off (a program using it can take a shared host's GPUs down).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
OUT=${OUT:-runs/two_gpu}
part=${1:-}
case "$part" in dp|peer|tp|pp|7b-fsdp|7b-tp|7b-pp|cp|tests-tp|tests-dp) ;; *) sed -n '2,33p' "$0"; exit 1 ;; esac

if [ "${SIZE:-full}" = tiny ]; then  # plumbing only: tiny models, CPU-sized steps
    DP_MODELS=(tiny-mamba2); TP_MODELS=(tiny-mamba2); PP_MODEL=tiny-mamba2; SEVEN_B=(tiny-mamba2)
    CP_MODEL=tiny-mamba2; SEQ=32; BATCH=2; GLOBAL=4; MICRO=2; STEPS=1; WARMUP=1; SCHEDULES=(pp2-gpipe)
    SEVEN_SEQ=32; SEVEN_STEPS=2; CP_START=64; CP_MAX=64; GPUS=(--gpus 2); DATA_SOURCE=mamba_parallel/bench
    RUN_TIMEOUT=300
else
    DP_MODELS=(mamba2-1.3b mamba2-370m); TP_MODELS=(mamba2-2.7b mamba-2.8b); PP_MODEL=mamba2-2.7b
    SEVEN_B=(falcon-mamba-7b mamba-codestral-7b); CP_MODEL=mamba2-1.3b; SEQ=2048; BATCH=8; GLOBAL=8; MICRO=8
    STEPS=10; WARMUP=3; SCHEDULES=(pp2 pp2-gpipe pp2-interleaved-1f1b pp2-zbv); SEVEN_SEQ=2048; SEVEN_STEPS=20
    CP_START=262144; CP_MAX=4194304; GPUS=(); DATA_SOURCE=stdlib; RUN_TIMEOUT=240
fi
TORCHRUN=($PY -m torch.distributed.run --standalone --nproc_per_node 2)
R=$OUT/$part                                   # what comes back
if [ -n "${DRY_RUN:-}" ]; then WORK=${WORK:-${TMPDIR:-/tmp}/two_gpu.dry}; else
    WORK=${WORK:-$(mktemp -d "${TMPDIR:-/tmp}/two_gpu.XXXXXX")}; fi
W=$WORK/$part                                  # scratch of this part
mkdir -p "$R" "$W"
[ -n "${DRY_RUN:-}" ] || exec > >(tee "$R/log.txt") 2>&1

run() {  # print a command, run it unless DRY_RUN
    echo "+ $*"
    [ -n "${DRY_RUN:-}" ] || "$@"
}
keep() {  # keep SRC as DEST (under $R) when it exists
    if [ -n "${DRY_RUN:-}" ]; then echo "keep $1 -> $2"; elif [ -e "$1" ]; then cp "$1" "$2"; fi
}
pack() {  # the part's scratch (per-run JSON and logs, not token data) into $R/logs.tar.gz
    [ -n "${DRY_RUN:-}" ] || tar czf "$R/logs.tar.gz" -C "$W" --exclude='*.bin' --exclude='checkpoint*' .
}
is_preset() { $PY -c "import sys; from mamba_parallel.config import PRESETS; sys.exit(sys.argv[1] not in PRESETS)" "$1"; }

train_7b() {  # preset layout flags...: 20 steps at global batch 4 (the one-GPU offload run's batch)
    local preset=$1 name=$2; shift 2
    if ! is_preset "$preset"; then echo "== $preset: not a preset at this commit, skipped"; return 0; fi
    local data=$WORK/data
    [ -f "$data/header.json" ] || run $PY -m mamba_parallel.cli prepare-data "$DATA_SOURCE" --out "$data"
    echo "== $preset $name"
    rm -rf "$W/$preset-$name"
    run "${TORCHRUN[@]}" -m mamba_parallel.cli train --preset "$preset" --data "$data" --out "$W/$preset-$name" \
        --dtype bf16 --seq-len "$SEVEN_SEQ" --global-batch-size 4 --param-dtype bf16 --activation-checkpointing \
        --steps "$SEVEN_STEPS" --warmup 2 --lr 3e-4 --log-every 1 --eval-every 0 --save-every 0 --no-save-final \
        --sample-tokens 0 --no-progress "$@" || echo "== $preset $name: failed (exit $?)"
    keep "$W/$preset-$name/metrics.jsonl" "$R/$preset-$name.jsonl"
}

case "$part" in
dp)
    run $PY -m mamba_parallel.bench.bench_scaling --models "${DP_MODELS[@]}" --layouts 1gpu dp2 --dp-mode fsdp ddp \
        --seq-len "$SEQ" --batch-per-dp-rank "$BATCH" --steps "$STEPS" --warmup-steps "$WARMUP" "${GPUS[@]}" \
        --timeout "$RUN_TIMEOUT" --out "$W/scaling"
    for f in scaling.json scaling.md scaling.png; do keep "$W/scaling/$f" "$R/$f"; done
    pack ;;
peer)
    if [ -f .peer/install.sh ]; then
        eval "$(bash .peer/install.sh "$PWD/.peer")" || echo "peer: the peer did not install"
    fi
    peer=(--peer)
    [ "${SIZE:-full}" = tiny ] && peer=(--peer --peer-impl reference)  # the stand-in: the plumbing without mamba_ssm
    run "${TORCHRUN[@]}" -m mamba_parallel.bench.bench_train_dp "${peer[@]}" --presets "${DP_MODELS[@]}" \
        --seq-len "$SEQ" --batch-size "$BATCH" --steps "$STEPS" --warmup-steps "$WARMUP" --json "$R" ;;
tp)
    run $PY -m mamba_parallel.bench.bench_scaling --models "${TP_MODELS[@]}" --layouts 1gpu tp2 --seq-len "$SEQ" \
        --global-batch "$GLOBAL" --steps "$STEPS" --warmup-steps "$WARMUP" "${GPUS[@]}" --timeout "$RUN_TIMEOUT" \
        --out "$W/scaling"
    for f in scaling.json scaling.md; do keep "$W/scaling/$f" "$R/$f"; done
    for m in "${TP_MODELS[@]}"; do  # per collective kind: time per step and the share that overlaps compute
        run "${TORCHRUN[@]}" -m mamba_parallel.bench.profile_train --preset "$m" --tp 2 --batch-size "$GLOBAL" \
            --seq-len "$SEQ" --steps "$WARMUP" --warmup-steps "$WARMUP" --out "$W/profile-$m" \
            || echo "== profile $m: failed (exit $?)"
        keep "$W/profile-$m/profile.json" "$R/profile-$m.json"
        keep "$W/profile-$m/profile.md" "$R/profile-$m.md"
    done
    pack ;;
pp)
    run $PY -m mamba_parallel.bench.bench_scaling --models "$PP_MODEL" --layouts 1gpu "${SCHEDULES[@]}" \
        --seq-len "$SEQ" --global-batch "$GLOBAL" --microbatches "$MICRO" --steps "$STEPS" \
        --warmup-steps "$WARMUP" "${GPUS[@]}" --timeout "$RUN_TIMEOUT" --out "$W/scaling"
    for f in scaling.json scaling.md scaling.png; do keep "$W/scaling/$f" "$R/$f"; done
    pack ;;
7b-fsdp|7b-tp|7b-pp)
    for preset in "${SEVEN_B[@]}"; do
        case "$part" in
        7b-fsdp) train_7b "$preset" fsdp2 --batch-size 2 ;;
        7b-tp) train_7b "$preset" tp2 --tp 2 --batch-size 4 ;;
        7b-pp) train_7b "$preset" pp2 --pp 2 --microbatches 4 --batch-size 1 ;;
        esac
    done
    pack ;;
cp)
    L=$CP_START; last=0
    while [ "$L" -le "$CP_MAX" ]; do
        t0=$SECONDS
        if ! run "${TORCHRUN[@]}" -m mamba_parallel.bench.bench_long_context --preset "$CP_MODEL" --seq-len "$L" \
            --cp 2 --activation-checkpointing --steps 2 --warmup 1 --json "$R/cp.jsonl"; then
            echo "cp=2: $L tokens did not run; the longest that ran is the last record of $R/cp.jsonl"; break
        fi
        last=$((SECONDS - t0))
        [ -n "${DRY_RUN:-}" ] && break
        # the next length takes about twice as long: start it only if it ends inside the part's budget
        [ $((SECONDS + 2 * last + 30)) -lt 540 ] || { echo "cp=2: no time left for $((L * 2)) tokens"; break; }
        L=$((L * 2))
    done ;;
tests-tp)
    run $PY -m pytest -q -m gpu -p no:cacheprovider tests/distributed/test_tp_gpu.py \
        tests/distributed/test_tp_overlap.py tests/train/test_cuda_graph.py --junitxml "$R/junit.xml" \
        || echo "== GPU tests: failures above"
    run "${TORCHRUN[@]}" -m mamba_parallel.bench.bench_long_context --parity --preset mamba2-130m --seq-len 8192 \
        --cp 2 --json "$R/cp_parity.jsonl" || echo "== CP=2 parity: failed" ;;
tests-dp)
    run $PY -m pytest -q -m gpu -p no:cacheprovider tests/distributed --ignore tests/distributed/test_tp_gpu.py \
        --ignore tests/distributed/test_tp_overlap.py --junitxml "$R/junit.xml" || echo "== GPU tests: failures above" ;;
esac
