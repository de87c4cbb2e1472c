#!/usr/bin/env bash
# The KV-cache path in one call on the H200: compile its kernels, run its GPU tests, the
# decode and merge kernels under compute-sanitizer (memcheck, racecheck, synccheck), then the decode
# bench. Full logs go to $OUT; a short summary is printed last. A GPU that CuPy cannot reach
# fails the tests (CUFLASH_REQUIRE_GPU=1) rather than skipping them.
#   usage: bash scripts/decode/h200_decode.sh [tests|sanitize|bench|all ...] (default: all)
set -uo pipefail
steps=${*:-all}
OUT=${OUT:-/tmp/cuflash-out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false CUFLASH_CACHE_DIR=${CUFLASH_CACHE_DIR:-/tmp/cuflash-cache}
export CUFLASH_REQUIRE_GPU=1
want() { [[ " $steps " == *" $1 "* || " $steps " == *" all "* ]]; }
summary=()
for only in attention_decode merge; do
  python3 -m cuflash compile --arch sm_90 --only $only > "$OUT/compile-$only.txt" 2>&1
  summary+=("compile $only: rc=$? $(tail -1 "$OUT/compile-$only.txt")")
done
if want tests; then
  timeout ${TEST_TIMEOUT:-480} python3 -m pytest -q -x -m gpu -p no:cacheprovider --durations=10 \
    tests/test_gpu_kvcache.py tests/test_torch_kvcache.py tests/test_jax_kvcache.py > "$OUT/tests.txt" 2>&1
  summary+=("tests: rc=$? $(grep -E 'passed|failed|error' "$OUT/tests.txt" | tail -1)")
fi
if want sanitize; then
  for tool in memcheck racecheck synccheck; do
    compute-sanitizer --tool $tool python3 scripts/decode/sanitize_decode.py > "$OUT/$tool.txt" 2>&1
    summary+=("$tool: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/$tool.txt" | tail -1)")
  done
fi
if want bench; then
  python3 -m cuflash bench --decode --csv "$OUT/decode.csv" --plot "$OUT/decode.png" > "$OUT/decode.txt" 2>&1
  summary+=("bench: rc=$?")
  cat "$OUT/decode.txt"
fi
grep -E "^(FAILED|ERROR)|Error" "$OUT/tests.txt" 2>/dev/null | head -20
printf '%s\n' "${summary[@]}"
