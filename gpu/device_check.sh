#!/usr/bin/env bash
# One-shot GPU run for a machine with torch and triton but no vLLM and no
# network (the lent H200): the whole test suite on CUDA, then the GPU check,
# then a one-screen summary (failures by test id, the check's table).
#   device run:  bash gpu/device_check.sh        (results under $OUT)
#
# A lent GPU gives ~15 minutes in all, machine start included, so the run must
# report everything the first time and fit in ~8 minutes, compiles included:
#   * the suite runs to the end (no -x) under a time budget
#     (KVFILL_TEST_BUDGET_S, default 210 s), GPU-relevant files first and the
#     compile-heavy ones last: tests past it are skipped and named in the
#     summary; a hard limit 60 s past it kills a hung suite;
#   * gpu_check.py runs whatever the suite did, under its own budget
#     (KVFILL_CHECK_BUDGET_S, default 170 s; sections past it are named; a hard
#     limit 90 s past it);
#   * the exit status is non-zero if either failed.
# PY names the python to run (default python3); kvfill is put on the path
# through a namespace shim (gpu/device_env.sh), so nothing is installed.
#
#   bash gpu/device_check.sh --suite-only   the machine and suite phases alone: CI runs the GPU run's own
#     selection so (tests/test_device_image.py), in a stand-in for the image with KVFILL_TEST_DEVICE=cpu:0
#     (the device stood in by tests/device_rule.py, which refuses Triton over host memory as CUDA does) and
#     KVFILL_TEST_BUDGET_S=0 (no budget, no hard limit), so that no test the GPU run selects can fail there
#     for a reason CI cannot see.
set -uo pipefail
cd "$(dirname "$0")/.."
suite_only=0
case "${1:-}" in
  "") ;;
  --suite-only) suite_only=1 ;;
  *) echo "device_check.sh: unknown argument '$1' (expected none or --suite-only)" >&2; exit 2 ;;
esac
out=${OUT:-bench/results}
mkdir -p "$out"
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
# shellcheck source=gpu/device_env.sh
source gpu/device_env.sh
kvfill_device_env "$site" || exit 1
PY=${PY:-python3}
TEST_BUDGET=${KVFILL_TEST_BUDGET_S:-210}
CHECK_BUDGET=${KVFILL_CHECK_BUDGET_S:-170}
# Fewer fuzz examples than CI's 200: every example may compile new variants.
export KVFILL_FUZZ_EXAMPLES=${KVFILL_FUZZ_EXAMPLES:-60}

phases=()
run_start=$SECONDS
phase_start=$SECONDS
end_phase() {  # name status
  phases+=("$(printf '%-22s %4d s  (exit %s)' "$1" $((SECONDS - phase_start)) "$2")")
  phase_start=$SECONDS
}

echo "== machine"
nvidia-smi -L || true
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')"
end_phase "machine" $?

# The suite's files in the order a short budget should reach them: what only a GPU's compiled kernels can
# show first (packed rows, replay, values, page images, state pages), every other file, then the
# compile-heavy ones (each layout or example a new constexpr set: minutes with a cold Triton cache).
first=(tests/test_packed_rows.py tests/test_replay.py tests/test_values.py tests/test_page_images.py
       tests/test_bank_states.py)
last=(tests/test_canonical_rows.py tests/test_fill_layouts.py tests/test_fuzz.py)
for f in "${first[@]}" "${last[@]}"; do
  [ -f "$f" ] || { echo "device_check.sh: $f is gone; update the suite order here"; exit 2; }
done
suite=("${first[@]}")
for f in tests/test_*.py; do
  case " ${first[*]} ${last[*]} " in *" $f "*) ;; *) suite+=("$f") ;; esac
done
suite+=("${last[@]}")

# The tests' device: CUDA; CI's run of this selection stands it in (KVFILL_TEST_DEVICE=cpu:0, --suite-only).
test_device=${KVFILL_TEST_DEVICE:-cuda}
hard_limit=$((TEST_BUDGET > 0 ? TEST_BUDGET + 60 : 0))  # timeout 0: none (no budget)
echo "== test suite on $test_device (budget ${TEST_BUDGET} s; ${#suite[@]} files, ${first[0]} first, ${last[-1]} last)"
KVFILL_TEST_DEVICE=$test_device KVFILL_TEST_BUDGET_S=$TEST_BUDGET \
  timeout -k 10 $hard_limit \
  "$PY" -m pytest -q -p no:cacheprovider -rfEs --junitxml="$out/gpu-tests.xml" "${suite[@]}" \
  >"$out/gpu-tests.log" 2>&1
tests_rc=$?
tail -5 "$out/gpu-tests.log"
end_phase "test suite" $tests_rc

check_rc=0
if [ $suite_only -eq 0 ]; then
  echo "== gpu_check (budget ${CHECK_BUDGET} s)"
  timeout -k 10 $((CHECK_BUDGET + 90)) \
    "$PY" gpu/gpu_check.py --out "$out" --budget-s "$CHECK_BUDGET" >"$out/gpu-check.log" 2>&1
  check_rc=$?
  grep '^\[' "$out/gpu-check.log" | tail -30
  end_phase "gpu_check" $check_rc
fi

{
  echo
  echo "================ device check summary ================"
  printf '%s\n' "${phases[@]}"
  echo "total                  $((SECONDS - run_start)) s"
  echo "-- tests (log: $out/gpu-tests.log)"
  case $tests_rc in
    0) echo "suite passed" ;;
    124|137) echo "suite KILLED at the hard limit ($hard_limit s): the log shows how far it got" ;;
    *) echo "suite FAILED (pytest exit $tests_rc)" ;;
  esac
  grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed|error).* =+$|^[0-9]+ (skipped|error)' "$out/gpu-tests.log" | tail -1
  grep -E '^(FAILED|ERROR) ' "$out/gpu-tests.log" | cut -c1-160
  budget_skips=$(grep -E "^BUDGET-SKIPPED " "$out/gpu-tests.log")
  if [ -n "$budget_skips" ]; then
    echo "skipped for the time budget (${TEST_BUDGET} s), in suite order:"
    echo "$budget_skips" | cut -c1-160
  else
    echo "skipped for the time budget (${TEST_BUDGET} s): none"
  fi
  [ $suite_only -eq 1 ] && exit 0  # --suite-only: no gpu_check
  echo "-- gpu_check (log: $out/gpu-check.log)"
  case $check_rc in
    0) ;;
    124|137) echo "gpu_check KILLED at the hard limit ($((CHECK_BUDGET + 90)) s)" ;;
    *) echo "gpu_check FAILED (exit $check_rc)" ;;
  esac
  if [ -s "$out/gpu-check-summary.txt" ]; then
    cat "$out/gpu-check-summary.txt"
  else
    echo "no summary written; the log's last lines:"
    tail -15 "$out/gpu-check.log"
  fi
} | tee "$out/device-check-summary.txt"

[ $tests_rc -eq 0 ] && [ $check_rc -eq 0 ]
