#!/usr/bin/env bash
# The memory model of --parallel auto (docs/memory-model.md) against measured peaks on one GPU: for each preset and
# micro-batch, bench_train's peak memory beside estimate_memory's prediction (bf16 autocast, fp32 states, with and
# without activation checkpointing). Prints a table; JSON per run under $OUT (default runs/memory_model).
#   bash tools/memory_model_check.sh            (~6-8 min on an H200: 10 short runs)
set -uo pipefail
OUT=${OUT:-runs/memory_model}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
runs=("mamba2-370m 8 " "mamba2-1.3b 8 " "mamba2-2.7b 4 " "mamba2-2.7b 8 " "mamba-1.4b 8 " "mamba-2.8b 4 "
      "mamba2-1.3b 16 ac" "mamba2-2.7b 16 ac" "mamba-2.8b 16 ac" "mamba2-780m 32 ac")
for r in "${runs[@]}"; do
    read -r preset b ac <<<"$r"
    flags=(); [ "$ac" = ac ] && flags=(--activation-checkpointing)
    $PY -m mamba_parallel.bench.bench_train --preset "$preset" --batch-size "$b" --seq-len 2048 --steps 2 \
        --warmup-steps 1 "${flags[@]}" --json "$OUT/$preset-b$b${ac:+-ac}.json" >/dev/null 2>"$OUT/$preset-b$b${ac:+-ac}.log" \
        || echo "$preset b$b $ac: failed (see $OUT/$preset-b$b${ac:+-ac}.log)"
done
$PY - "$OUT" <<'PY'
import glob, json, os, sys
from mamba_parallel.config import get_preset
from mamba_parallel.distributed.auto import estimate_memory
print(f"{'run':32} {'predicted GiB':>14} {'measured GiB':>13} {'ratio':>6}")
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    r = json.load(open(path))
    cfg = get_preset(r["preset"])
    ac = path.endswith("-ac.json")
    b = r.get("batch_size") or int(os.path.basename(path).split("-b")[-1].split("-")[0].split(".")[0])
    pred = estimate_memory(cfg, 1, seq_len=2048, micro_batch=b, activation_checkpointing=ac) / 2**30
    meas = r["peak_mem_gib"]
    print(f"{os.path.basename(path)[:-5]:32} {pred:14.1f} {meas:13.1f} {pred / meas if meas else float('nan'):6.2f}")
PY
