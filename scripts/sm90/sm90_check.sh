#!/usr/bin/env bash
# One call on a Hopper GPU (H100, H200) for the sm_90a forward: its variants compiled, its
# tests, compute-sanitizer's memcheck / racecheck / synccheck, the forward grid beside cuDNN
# and SDPA-flash in bf16 and fp16 (and beside another build of cuflash where BASELINE names
# its folder), ncu's view of four calls and their phases tile by tile (sm90_timeline.py).
# Logs and CSVs go to $OUT (as logs.tar.gz too, refreshed after each step); a short summary
# is printed last. SUITES=1 adds the GPU suites of the forward and of the torch and JAX front
# ends (test_gpu_forward.py, test_gpu_variants.py, test_torch.py, test_jax.py); TAIL=1 times
# the unmasked last wave cut along the keys against the same kernel with it whole
# (sm90_bench.py --whole, each head dim, and calls of few query rows and many keys).
# SKIP lists steps to leave out (names or shell patterns: SKIP="ncu_* timeline grid_float16"),
# to keep a call within the device's ten minutes. Its tests fail, not skip, where CuPy reaches
# no GPU or one that is not compute capability 9.0 (CUFLASH_REQUIRE_GPU=hopper).
#   usage: [BASELINE=build/ab/cuflash_prev] [SUITES=1] [TAIL=1] [SKIP="..."] bash scripts/sm90/sm90_check.sh
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUFLASH_CACHE_DIR=${CUFLASH_CACHE_DIR:-/tmp/cuflash-cache} CUFLASH_REQUIRE_GPU=hopper
OUT=${OUT:-/tmp/cuflash-out}; LOG=$(mktemp -d); mkdir -p "$OUT"
step() {  # name, seconds, command...: its output to $LOG/name.txt, its status and time printed
  local name=$1 limit=$2; shift 2; local start=$SECONDS skip
  for skip in ${SKIP:-}; do [[ $name == $skip ]] && { echo "== $name skipped"; return; }; done
  timeout "$limit" "$@" > "$LOG/$name.txt" 2>&1; local rc=$?
  echo "== $name rc=$rc $((SECONDS - start)) s"; tar -czf "$OUT/logs.tar.gz" -C "$LOG" .
}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
step compile 120 python3 -m cuflash compile --arch sm_90a --only attention_forward_sm90
tail -n 1 "$LOG/compile.txt"
baseline=()
if [[ -n ${BASELINE:-} ]]; then  # the other build's kernels compiled before the grid times them
  PYTHONPATH=$(dirname "$BASELINE") step compile_baseline 120 \
    python3 -m "$(basename "$BASELINE")" compile --arch sm_90a --only attention_forward_sm90
  baseline=(--baseline "$BASELINE")
fi
step test_sm90 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_sm90.py
for tool in memcheck racecheck synccheck; do
  step "sanitize_$tool" 300 compute-sanitizer --tool "$tool" python3 scripts/sm90/sanitize_sm90.py
done
for dtype in bfloat16 float16; do
  step "grid_$dtype" 300 python3 -m cuflash bench --compare --mode fwd --dtype "$dtype" ${baseline[@]+"${baseline[@]}"} \
    --csv "$LOG/grid-$dtype.csv"
done
# The tensor pipe (wgmma counts as hmma), issue slots, the XU pipe (exp2), stall reasons per
# issued instruction.
metrics="sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
metrics+=",smsp__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active"
metrics+=",regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
for call in "128" "128 causal" "128 causal 2048" "64 causal 2048"; do
  step "ncu_${call// /_}" 300 ncu --clock-control none -k regex:attention_forward --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis --section Occupancy \
    --metrics "$metrics" python3 scripts/sm90/ncu_forward.py $call
done
step timeline 300 python3 scripts/sm90/sm90_timeline.py
if [[ -n ${TAIL:-} ]]; then  # the cut tail against the whole one (causal rows: not cut, the same kernel twice)
  for d in 64 128 256; do step "tail_$d" 300 python3 scripts/sm90/sm90_bench.py --whole --head-dim "$d"; done
  step tail_shapes 300 python3 scripts/sm90/sm90_bench.py --whole --head-dim 128 \
    --shapes 128x8192,128x32768,512x16384,1024x65536,2048x8192
fi
if [[ -n ${SUITES:-} ]]; then  # the forward's GPU suites and the front ends' (6-7 minutes on an H200)
  step suite_forward 420 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_forward.py tests/test_gpu_variants.py
  step suite_frontends 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_torch.py tests/test_jax.py
fi
cp "$LOG"/*.csv "$OUT"/ 2>/dev/null
echo "-- summary"
for f in "$LOG"/test_sm90.txt "$LOG"/suite_*.txt; do [[ -f $f ]] && echo "$(basename "$f" .txt): $(tail -n 1 "$f")"; done
grep -hE "ERROR SUMMARY|RACECHECK SUMMARY" "$LOG"/sanitize_*.txt
for dtype in bfloat16 float16; do [[ -f $LOG/grid_$dtype.txt ]] && tail -n 38 "$LOG/grid_$dtype.txt"; done
[[ -f $LOG/timeline.txt ]] && cat "$LOG/timeline.txt"
for f in "$LOG"/tail_*.txt; do [[ -f $f ]] && { echo "-- $(basename "$f" .txt)"; cat "$f"; }; done
for f in "$LOG"/ncu_*.txt; do
  [[ -f $f ]] || continue
  echo "-- $(basename "$f" .txt)"
  grep -E "Duration|Issue Slots Busy|Warp Cycles Per Issued|hmma_cycles|pipe_xu|stalled_(wait|barrier|long_scoreboard)_" "$f" \
    | awk '{print $1, $NF}'
done
