#!/usr/bin/env bash
# `make test-e2e-native`: the e2e suite with FANOUT_BUILD=native (the harness loads the native
# build where the wasm filter goes; docs/native.md), and a summary that tells apart what
# failed from what the native build cannot run:
#   e2e on the native build: 120 passed, 0 failed, 14 SKIPPED (not run on the native build)
# A test the native build cannot run (its bootstrap loads the wasm module, or it reads the
# wasm VMs' own stats) ends before Envoy starts with a panic saying
# "SKIPPED on the native build: <why>"; cargo counts it failed, never passed, and this
# script lists it as skipped, with its reason. Exit status 1 if any other test failed.
# Arguments go to cargo test after `--` (e.g. `contract::`, `--test-threads=1`).
set -uo pipefail
cd "$(dirname "$0")/.."
CARGO=${CARGO:-cargo}
mkdir -p target
log=target/test-e2e-native.log

# Into a file, followed: not through a pipe, which a child process (Node) may make
# non-blocking, and cargo's long list of failures would then be cut short. Emptied first, so
# that `tail` finds it and never shows the last run's.
: >"$log"
FANOUT_BUILD=native $CARGO test --test e2e -- "$@" >"$log" 2>&1 &
cargo_pid=$!
tail -n +1 -f --pid="$cargo_pid" "$log"
wait "$cargo_pid"
cargo_status=$?

skip_mark="SKIPPED on the native build:"
# The failed tests, by name, from cargo's closing list; and each one's panic (its captured
# output, "---- <name> stdout ----" to the next such line).
failed=$(sed -n '/^failures:$/,/^test result:/p' "$log" | sed -n 's/^    \([^ ]*\)$/\1/p' | sort -u)
reason_of() {
  awk -v name="$1" -v mark="$skip_mark" '
    $0 == "---- " name " stdout ----" { inside = 1; next }
    /^---- .* stdout ----$/ { inside = 0 }
    inside && index($0, mark) { print substr($0, index($0, mark) + length(mark) + 1); exit }
  ' "$log"
}
passed=$(sed -n 's/^test result: [A-Za-z]*\. \([0-9]*\) passed.*/\1/p' "$log" | tail -1)
if [ -z "$passed" ]; then
  # No summary: the test binary did not build, or did not finish (killed, aborted).
  echo
  echo "== e2e on the native build: cargo test ended with status $cargo_status and no summary (see $log)"
  exit "$(( cargo_status == 0 ? 1 : cargo_status ))"
fi
skipped=() real=()
for name in $failed; do
  why=$(reason_of "$name")
  if [ -n "$why" ]; then skipped+=("$name: $why"); else real+=("$name"); fi
done

echo
echo "== e2e on the native build: ${passed:-0} passed, ${#real[@]} failed, ${#skipped[@]} SKIPPED (not run on the native build)"
if [ ${#skipped[@]} -gt 0 ]; then
  echo "-- SKIPPED on the native build:"
  printf '   %s\n' "${skipped[@]}"
fi
if [ ${#real[@]} -gt 0 ]; then
  echo "-- FAILED:"
  printf '   %s\n' "${real[@]}"
fi
echo "(cargo's own output: $log)"
if [ ${#real[@]} -gt 0 ]; then exit 1; fi
# cargo failed for another reason (it did not build, or a test binary crashed).
if [ "$cargo_status" -ne 0 ] && [ -z "$failed" ]; then exit "$cargo_status"; fi
exit 0
