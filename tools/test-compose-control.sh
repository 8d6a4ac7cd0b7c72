#!/usr/bin/env bash
# `make test-compose-control`: the control-plane compose demo
# (examples/docker-compose/docker-compose.control.yml), for real: fanout-control's image from
# `make image-control`, loaded into Docker with skopeo; `up --build -d`; the demo's curl
# answers 202 and every subscriber printed the event; removing a subscriber from
# channels/orders.yaml (a copy) takes it out of the next event; `down -v` leaves nothing.
# Needs Docker with compose v2 and skopeo (not part of `make test`). Uses the demo's fixed
# ports, 127.0.0.1:10000, :9901 and :18001. Whatever happens, ends with `down -v`.
set -euo pipefail
cd "$(dirname "$0")/.."
FILE=examples/docker-compose/docker-compose.control.yml
PROJECT=fanout-control-demo
LAYOUT=${CONTROL_IMAGE_LAYOUT:-target/oci/fanout-control}
TAG=${CONTROL_IMAGE_TAG:-0.1.0}
CHANNELS=examples/docker-compose/channels/orders.yaml
compose() { docker compose -f "$FILE" "$@"; }
fail() { echo "test-compose-control: FAILED: $*" >&2; compose logs --no-color --tail 40 >&2 || true; exit 1; }
docker info >/dev/null 2>&1 || { echo "test-compose-control: docker info fails: Docker is needed (and compose v2)" >&2; exit 1; }
docker compose version >/dev/null 2>&1 || { echo "test-compose-control: docker compose (v2) is missing" >&2; exit 1; }
cp "$CHANNELS" "$CHANNELS.orig"
trap 'mv "$CHANNELS.orig" "$CHANNELS"; compose down -v --remove-orphans >/dev/null 2>&1 || true' EXIT

skopeo copy --quiet "oci:$LAYOUT:$TAG" docker-daemon:fanout-control:local

send() { # the demo's event; prints the status
  curl -sS -o /dev/null -w '%{http_code}' http://127.0.0.1:10000/ -H 'host: orders.example' \
    -H 'ce-specversion: 1.0' -H 'ce-type: com.example.order.created' \
    -H 'ce-source: /demo/shop' -H "ce-id: $1" \
    -H 'content-type: application/json' -d '{"order":"A-1001"}' || echo 000
}

start=$SECONDS
compose up --build -d --quiet-pull 2>&1 | tail -n 5
until=$((SECONDS + 180))
until curl -sf http://127.0.0.1:9901/ready >/dev/null 2>&1; do
  ((SECONDS < until)) || fail "Envoy not ready within 180 s"
  sleep 1
done
echo "== compose up --build: $((SECONDS - start)) s"

status=$(send 1)
[[ $status == 202 ]] || fail "the demo's curl answered $status (want 202)"
echo "ok: the demo's curl -> 202"
for name in billing shipping analytics; do
  compose logs --no-color "$name" | grep -q "$name · event #1" || fail "$name did not print the event"
  echo "ok: $name printed the event"
done
state=$(curl -sf http://127.0.0.1:18001/state) || fail "fanout-control's /state"
grep -q '"compose-envoy"' <<<"$state" || fail "/state does not name the Envoy: $state"
echo "ok: /state names the Envoy"

# analytics leaves the channel: the next event does not reach it.
grep -v analytics "$CHANNELS.orig" >"$CHANNELS.tmp" && mv "$CHANNELS.tmp" "$CHANNELS"
until=$((SECONDS + 30))
until [[ $(curl -sf http://127.0.0.1:18001/state | grep -o 'analytics' | head -n 1) == "" ]]; do
  ((SECONDS < until)) || fail "fanout-control did not take the edit within 30 s"
  sleep 1
done
sleep 2
status=$(send 2)
[[ $status == 202 ]] || fail "after the edit: $status (want 202)"
sleep 1
compose logs --no-color analytics | grep -q "analytics · event #2" && fail "analytics got the event after leaving"
compose logs --no-color billing | grep -q "billing · event #2" || fail "billing did not get the second event"
echo "ok: a subscriber removed from the channel's file gets no more events"

compose down -v --remove-orphans >/dev/null 2>&1
left=$(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT")
[[ -z $left ]] || fail "containers left after down -v: $left"
echo "== test-compose-control passed in $((SECONDS - start)) s"
