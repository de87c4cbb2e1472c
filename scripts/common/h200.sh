#!/usr/bin/env bash
# One call on the H200: compile every variant, run the GPU tests, benchmark.
# Full logs go to $OUT; a short summary is printed last. CUFLASH_PORTABLE=1 in the
# environment runs the tests and the bench on the mma.sync kernels only. A GPU that CuPy
# cannot reach fails the tests (CUFLASH_REQUIRE_GPU=1) rather than skipping them.
#   usage: [BENCH_ARGS="--mode fwd"] bash scripts/common/h200.sh [tests|bench|all] [pytest args, default: tests]
set -uo pipefail
what=${1:-all}; shift || true
OUT=${OUT:-/tmp/cuflash-out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false CUFLASH_CACHE_DIR=/tmp/cuflash-cache
export CUFLASH_REQUIRE_GPU=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import cupy, torch, jax; print('cupy', cupy.__version__, 'torch', torch.__version__, 'jax', jax.__version__)"
python3 -m cuflash compile --arch sm_90,sm_90a > "$OUT/compile.txt" 2>&1; rc_compile=$?
tail -1 "$OUT/compile.txt"
rc_tests=0; rc_bench=0
if [[ $what == tests || $what == all ]]; then
  python3 -m pytest -q -rs -m gpu --hypothesis-show-statistics -p no:cacheprovider "${@:-tests}" > "$OUT/tests.txt" 2>&1; rc_tests=$?
  grep -E "passed|failed|error" "$OUT/tests.txt" | tail -3
fi
if [[ $what == bench || $what == all ]]; then
  python3 -m cuflash bench --compare ${BENCH_ARGS:-} --csv "$OUT/bench.csv" --plot "$OUT/bench.png" > "$OUT/bench.txt" 2>&1; rc_bench=$?
fi
[[ $rc_tests == 0 ]] || grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/tests.txt" | head -40
[[ -f $OUT/bench.txt ]] && cat "$OUT/bench.txt"
echo "compile rc=$rc_compile tests rc=$rc_tests bench rc=$rc_bench"
