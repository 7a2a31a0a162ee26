#!/usr/bin/env bash
# What each `--recompute` choice costs and saves in one training step on one GPU: bench train (ours alone, b8 x
# 2048, bf16 autocast, fused AdamW, no clipping) for every preset x choice, then one table of tokens/s, peak memory
# and final loss (the losses must agree: recompute rebuilds the same values). JSON per run under $OUT/recompute/.
#
#   OUT=results bash tools/recompute_trade.sh [presets...]     default: mamba2-1.3b mamba2-2.7b mamba-1.4b mamba-2.8b
#   CHOICES="none states conv,states" (the default) picks the choices; "none" keeps everything.
# Expected on an H200: ~40-70 s per run at 2.7B (model build + 2 warm-up + 4 timed steps).
set -uo pipefail
OUT=${OUT:-results}
CHOICES=${CHOICES:-"none states conv,states"}
PRESETS=("$@")
[ ${#PRESETS[@]} -gt 0 ] || PRESETS=(mamba2-1.3b mamba2-2.7b mamba-1.4b mamba-2.8b)
PY=${PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/build/triton-cache}
mkdir -p "$OUT/recompute"
for preset in "${PRESETS[@]}"; do
  for choice in $CHOICES; do
    items=$choice; [ "$choice" = none ] && items=""
    echo "== $preset --recompute '${items}'"
    $PY -m mamba_parallel.bench.bench_train --no-peer --preset "$preset" --recompute "$items" --steps 4 \
      --warmup-steps 2 --grad-clip 0 --json "$OUT/recompute/$preset-${choice//,/+}.json" 2>&1 | tail -2
  done
done
$PY - "$OUT/recompute" <<'PYEOF'
import glob, json, os, sys
print("| preset | recompute | tokens/s | vs none | peak GiB | final loss |")
print("|---|---|---|---|---|---|")
runs = {}
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    preset, choice = os.path.basename(path)[:-5].rsplit("-", 1)
    runs[(preset, choice)] = json.load(open(path))
for (preset, choice), r in sorted(runs.items()):
    base = runs.get((preset, "none"))
    rel = f"{r['tokens_per_s'] / base['tokens_per_s']:.3f}" if base else "-"
    print(f"| {preset} | {choice.replace('+', ',')} | {r['tokens_per_s']:,.0f} | {rel} | {r['peak_mem_gib']:.1f} | "
          f"{r['final_loss']} |")
PYEOF
