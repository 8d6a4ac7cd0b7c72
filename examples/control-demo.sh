#!/usr/bin/env bash
# The fanout demo with the control plane, as run by `make run-control`.
#
# Starts two demo subscribers (examples/subscriber/), fanout-control on a directory of Knative
# objects (one InMemoryChannel `demo/orders` with one subscriber, billing) and Envoy with
# envoy/xds/envoy.yaml, which takes the fanout filter and its clusters from the server. Sends
# one event, then adds the second subscriber (shipping) by editing the channel's file, and
# sends another: both get it. Stays up until Ctrl-C (edit the file yourself meanwhile: the
# server's /state shows each channel, each Envoy's versions and where each subscriber is live).
#
# Environment (all optional; `make run-control` builds everything first):
#   ENVOY_BIN, FANOUT_WASM, FANOUT_CONTROL_BIN   the binaries (defaults: as `make` builds them)
#   DEMO_ONESHOT=1                               stop after the second event; exit 0 only if
#                                                both subscribers got it
# Ports (loopback): Envoy 10000 (admin 9901), the server 18000 (xDS) and 18001 (/state),
# subscribers 18081 and 18082.

set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ENVOY_BIN=${ENVOY_BIN:-$ROOT/.tools/envoy-1.40.0}
FANOUT_WASM=${FANOUT_WASM:-$ROOT/target/wasm32-wasip1/release/fanout.wasm}
CONTROL_BIN=${FANOUT_CONTROL_BIN:-$ROOT/target/release/fanout-control}
ONESHOT=${DEMO_ONESHOT:-0}
CARGO=${CARGO:-cargo}
for bin in "$ENVOY_BIN" "$FANOUT_WASM" "$CONTROL_BIN"; do
  [[ -e $bin ]] || { echo "missing $bin: run make run-control" >&2; exit 1; }
done
(cd "$ROOT" && "$CARGO" build --quiet -p fanout-demo-subscriber)
SUBSCRIBER_BIN=${CARGO_TARGET_DIR:-$ROOT/target}/debug/subscriber

TMP=$(mktemp -d -t fanout-control-demo.XXXXXX)
CHANNELS=$TMP/channels
mkdir -p "$CHANNELS"
PIDS=()
start() { # start LOGFILE CMD...: in the background, in its own session
  local log=$1
  shift
  setsid "$@" >"$log" 2>&1 </dev/null &
  PIDS+=("$!")
}
cleanup() {
  local status=$? pid
  trap - EXIT INT TERM
  for pid in "${PIDS[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$TMP"
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

channel() { # channel SUBSCRIBER_URI...: the channel's file, written whole and renamed over
  {
    printf 'apiVersion: messaging.knative.dev/v1\nkind: InMemoryChannel\n'
    printf 'metadata: {name: orders, namespace: demo}\nspec:\n  subscribers:\n'
    local uri
    for uri in "$@"; do printf '    - subscriberUri: %s\n' "$uri"; done
    printf 'status:\n  address: {url: "http://orders-kn-channel.demo.svc.cluster.local"}\n'
  } >"$CHANNELS/.orders.yaml.tmp"
  mv "$CHANNELS/.orders.yaml.tmp" "$CHANNELS/orders.yaml"
}

wait_for() { # wait_for WHAT CMD...: until CMD succeeds, 20 s at most
  local what=$1 i
  shift
  for ((i = 0; i < 400; i++)); do "$@" >/dev/null 2>&1 && return 0; sleep 0.05; done
  echo "timed out waiting for $what" >&2
  exit 1
}

send() { # send N: one CloudEvent to the channel through Envoy; prints fanout's answer
  curl -sS -o /dev/null -w '%{http_code}\n' http://127.0.0.1:10000/ \
    -H 'host: orders-kn-channel.demo.svc.cluster.local' -H 'content-type: application/json' \
    -H 'ce-specversion: 1.0' -H "ce-id: demo-$1" -H 'ce-source: /demo' -H 'ce-type: demo.order' \
    -d "{\"order\": $1}"
}

start "$TMP/billing.log" "$SUBSCRIBER_BIN" --name billing --port 18081
start "$TMP/shipping.log" "$SUBSCRIBER_BIN" --name shipping --port 18082
channel http://127.0.0.1:18081/events
start "$TMP/control.log" "$CONTROL_BIN" --source "dir:$CHANNELS" --wasm "$FANOUT_WASM"
start "$TMP/envoy.log" "$ENVOY_BIN" -c "$ROOT/envoy/xds/envoy.yaml" --service-node demo-envoy \
  --disable-hot-restart --concurrency 2
wait_for "fanout-control" curl -sf http://127.0.0.1:18001/ready
wait_for "Envoy" curl -sf http://127.0.0.1:9901/ready
echo "fanout-control serves $CHANNELS; Envoy (node demo-envoy) listens on 127.0.0.1:10000"

echo "event 1 -> $(send 1) (billing only)"
echo "adding shipping to $CHANNELS/orders.yaml"
channel http://127.0.0.1:18081/events http://127.0.0.1:18082/hooks
live() { curl -sf http://127.0.0.1:18001/state | grep -q '"live_on":\["demo-envoy"\][^]]*"uri":"http://127.0.0.1:18082/hooks"\|"uri":"http://127.0.0.1:18082/hooks"[^}]*"live_on":\["demo-envoy"\]'; }
wait_for "shipping live on Envoy" live
echo "event 2 -> $(send 2) (billing and shipping)"
wait_for "shipping got event 2" grep -q 'demo-2' "$TMP/shipping.log"
echo "shipping got event 2; billing has $(grep -c 'demo-' "$TMP/billing.log") event(s)"
if ((ONESHOT)); then exit 0; fi
echo "edit $CHANNELS/orders.yaml to change the subscribers; state: curl http://127.0.0.1:18001/state"
echo "Ctrl-C stops everything"
tail -f "$TMP/billing.log" "$TMP/shipping.log"
