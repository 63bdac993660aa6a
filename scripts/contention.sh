#!/usr/bin/env bash
# The tests that read the real clock (pytest -m timing), on a loaded core: pinned to core 0 beside three CPU hogs
# pinned there too, so pytest gets about a quarter of one core. Their verdicts must not change: every run passes.
#
#     scripts/contention.sh        # 3 runs
#     scripts/contention.sh 5      # 5 runs
#
# Only the test files that hold a `timing` mark are collected (collecting all of tests/ costs a minute of its own).
# Each run's output goes to $TMPDIR/contention-<n>.log; the last line says how many runs passed.
set -u
cd "$(dirname "$0")/.."
runs=${1:-3}
py=.venv/bin/python
[ -x "$py" ] || py=python
files=$(grep -l "pytest.mark.timing" tests/test_*.py)
logs=${TMPDIR:-/tmp}

hogs=()
stop_hogs() {
    for pid in "${hogs[@]}"; do kill "$pid" 2>/dev/null; done
    hogs=()
}
trap stop_hogs EXIT
trap 'stop_hogs; exit 130' INT TERM
for _ in 1 2 3; do
    taskset -c 0 yes >/dev/null &
    hogs+=("$!")
done

export OMP_NUM_THREADS=1 PJRT_DEVICE=CPU LABKIT_FAST=1 LABKIT_SOLUTIONS=1 MPLBACKEND=Agg LABKIT_CONSOLE=1
passed=0
for n in $(seq 1 "$runs"); do
    start=$(date +%s)
    # shellcheck disable=SC2086  # the file list is split on purpose
    if taskset -c 0 "$py" -m pytest -q -m timing $files >"$logs/contention-$n.log" 2>&1; then
        passed=$((passed + 1))
        verdict=passed
    else
        verdict="FAILED (see $logs/contention-$n.log)"
    fi
    echo "run $n/$runs: $verdict in $(($(date +%s) - start)) s, $(grep -E '^[0-9]+ (passed|failed)' "$logs/contention-$n.log" | tail -1)"
done
stop_hogs
echo "contention: $passed/$runs runs passed (pytest -m timing on core 0 beside 3 CPU hogs on core 0)"
[ "$passed" -eq "$runs" ]
