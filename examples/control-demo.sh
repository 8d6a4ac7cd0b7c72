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
#   FANOUT_DEMO_PORT, FANOUT_DEMO_ADMIN_PORT      Envoy's listener and admin ports (10000, 9901)
#   FANOUT_CONTROL_XDS_PORT, FANOUT_CONTROL_HTTP_PORT   the server's xDS and /state ports
#                                                (18000, 18001)
#   FANOUT_DEMO_BILLING_PORT, FANOUT_DEMO_SHIPPING_PORT  the subscribers (18081, 18082)
# All on loopback. With other ports than the defaults, Envoy runs on a copy of
# envoy/xds/envoy.yaml with them.

set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ENVOY_BIN=${ENVOY_BIN:-$ROOT/.tools/envoy-1.40.0}
FANOUT_WASM=${FANOUT_WASM:-$ROOT/target/wasm32-wasip1/release/fanout.wasm}
CONTROL_BIN=${FANOUT_CONTROL_BIN:-$ROOT/target/release/fanout-control}
ONESHOT=${DEMO_ONESHOT:-0}
LISTEN_PORT=${FANOUT_DEMO_PORT:-10000}
ADMIN_PORT=${FANOUT_DEMO_ADMIN_PORT:-9901}
XDS_PORT=${FANOUT_CONTROL_XDS_PORT:-18000}
STATE_PORT=${FANOUT_CONTROL_HTTP_PORT:-18001}
BILLING_PORT=${FANOUT_DEMO_BILLING_PORT:-18081}
SHIPPING_PORT=${FANOUT_DEMO_SHIPPING_PORT:-18082}
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
  curl -sS -o /dev/null -w '%{http_code}\n' "http://127.0.0.1:$LISTEN_PORT/" \
    -H 'host: orders-kn-channel.demo.svc.cluster.local' -H 'content-type: application/json' \
    -H 'ce-specversion: 1.0' -H "ce-id: demo-$1" -H 'ce-source: /demo' -H 'ce-type: demo.order' \
    -d "{\"order\": $1}"
}

# The shipped bootstrap, with this run's ports (each needle must be there exactly once).
BOOTSTRAP=$TMP/envoy.yaml
for needle in 'port_value: 10000 }' 'port_value: 9901 }' 'port_value: 18000 }'; do
  [[ $(grep -cF "$needle" "$ROOT/envoy/xds/envoy.yaml") == 1 ]] || {
    echo "envoy/xds/envoy.yaml no longer has exactly one '$needle'; update $0 to match it" >&2
    exit 1
  }
done
sed -e "s|port_value: 10000 }|port_value: $LISTEN_PORT }|;t" \
  -e "s|port_value: 9901 }|port_value: $ADMIN_PORT }|;t" \
  -e "s|port_value: 18000 }|port_value: $XDS_PORT }|" \
  "$ROOT/envoy/xds/envoy.yaml" >"$BOOTSTRAP"

BILLING=http://127.0.0.1:$BILLING_PORT/events
SHIPPING=http://127.0.0.1:$SHIPPING_PORT/hooks
STATE=http://127.0.0.1:$STATE_PORT
start "$TMP/billing.log" "$SUBSCRIBER_BIN" --name billing --port "$BILLING_PORT"
start "$TMP/shipping.log" "$SUBSCRIBER_BIN" --name shipping --port "$SHIPPING_PORT"
channel "$BILLING"
start "$TMP/control.log" "$CONTROL_BIN" --source "dir:$CHANNELS" --wasm "$FANOUT_WASM" \
  --xds-address "127.0.0.1:$XDS_PORT" --http-address "127.0.0.1:$STATE_PORT"
start "$TMP/envoy.log" "$ENVOY_BIN" -c "$BOOTSTRAP" --service-node demo-envoy \
  --disable-hot-restart --concurrency 2
wait_for "fanout-control" curl -sf "$STATE/ready"
wait_for "Envoy" curl -sf "http://127.0.0.1:$ADMIN_PORT/ready"
echo "fanout-control serves $CHANNELS; Envoy (node demo-envoy) listens on 127.0.0.1:$LISTEN_PORT"

echo "event 1 -> $(send 1) (billing only)"
echo "adding shipping to $CHANNELS/orders.yaml"
channel "$BILLING" "$SHIPPING"
live() { curl -sf "$STATE/state" | grep -q "\"live_on\":\[\"demo-envoy\"\][^]]*\"uri\":\"$SHIPPING\"\|\"uri\":\"$SHIPPING\"[^}]*\"live_on\":\[\"demo-envoy\"\]"; }
wait_for "shipping live on Envoy" live
echo "event 2 -> $(send 2) (billing and shipping)"
wait_for "shipping got event 2" grep -q 'demo-2' "$TMP/shipping.log"
echo "shipping got event 2; billing has $(grep -c 'demo-' "$TMP/billing.log") event(s)"
if ((ONESHOT)); then exit 0; fi
echo "edit $CHANNELS/orders.yaml to change the subscribers; state: curl $STATE/state"
echo "Ctrl-C stops everything"
tail -f "$TMP/billing.log" "$TMP/shipping.log"
