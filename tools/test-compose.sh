#!/usr/bin/env bash
# `make test-compose`: the docker-compose demo (examples/docker-compose/), for real.
#   up --build -d; the README's curl answers 202 and each subscriber printed the event (its
#   container log); `x-demo-fail: shipping` gives 500 naming shipping; after a restart of
#   shipping the event gives 202 again; `down -v` leaves no container and no volume.
# Needs Docker with compose v2 and the images' registries (not part of `make test`). Uses
# the demo's fixed ports, 127.0.0.1:10000 and :9901. Whatever happens, ends with `down -v`.
set -euo pipefail
cd "$(dirname "$0")/.."
FILE=examples/docker-compose/docker-compose.yml
PROJECT=fanout-demo
compose() { docker compose -f "$FILE" "$@"; }
fail() { echo "test-compose: FAILED: $*" >&2; compose logs --no-color --tail 40 >&2 || true; exit 1; }
docker info >/dev/null 2>&1 || { echo "test-compose: docker info fails: Docker is needed (and compose v2)" >&2; exit 1; }
docker compose version >/dev/null 2>&1 || { echo "test-compose: docker compose (v2) is missing" >&2; exit 1; }
trap 'compose down -v --remove-orphans >/dev/null 2>&1 || true' EXIT

send() { # send [HEADER...]: the README's event; prints "STATUS BODY"
  local args=()
  for h in "$@"; do args+=(-H "$h"); done
  curl -sS -o /tmp/fanout-compose-body.$$ -w '%{http_code}' http://127.0.0.1:10000/orders \
    -H 'ce-specversion: 1.0' -H 'ce-type: com.example.order.created' \
    -H 'ce-source: /demo/shop' -H "ce-id: $RANDOM" \
    -H 'content-type: application/json' "${args[@]}" -d '{"order":"A-1001"}' || echo 000
  printf ' %s\n' "$(cat /tmp/fanout-compose-body.$$ 2>/dev/null; rm -f /tmp/fanout-compose-body.$$)"
}
wait_ready() { # wait_ready SECONDS: until Envoy's admin says ready
  local until=$((SECONDS + $1))
  until curl -sf http://127.0.0.1:9901/ready >/dev/null 2>&1; do
    ((SECONDS < until)) || fail "Envoy not ready within $1 s"
    sleep 1
  done
}

start=$SECONDS
compose up --build -d --quiet-pull 2>&1 | tail -n 5
wait_ready 120
echo "== compose up --build: $((SECONDS - start)) s"

reply=$(send)
[[ $reply == 202* ]] || fail "the README's curl answered: $reply (want 202)"
echo "ok: the README's curl -> 202"
for name in billing shipping analytics; do
  logs=$(compose logs --no-color "$name")
  grep -q "$name · event #1" <<<"$logs" && grep -q '"order": "A-1001"' <<<"$logs" \
    || fail "$name did not print the event: $logs"
  echo "ok: $name printed the event"
done

reply=$(send 'x-demo-fail: shipping')
[[ $reply == 500* && $reply == *'"shipping"'* ]] || fail "x-demo-fail: shipping answered: $reply (want 500 naming shipping)"
[[ $reply != *'"billing"'* ]] || fail "the report names billing too: $reply"
echo "ok: x-demo-fail: shipping -> 500 naming shipping"

compose restart shipping >/dev/null
until=$((SECONDS + 60))
while reply=$(send); [[ $reply != 202* ]]; do
  ((SECONDS < until)) || fail "after restarting shipping: $reply (want 202 within 60 s)"
  sleep 1
done
echo "ok: after a restart of shipping -> 202"

compose down -v --remove-orphans >/dev/null 2>&1
left=$(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT")
[[ -z $left ]] || fail "containers left after down -v: $left"
vols=$(docker volume ls -q --filter "label=com.docker.compose.project=$PROJECT")
[[ -z $vols ]] || fail "volumes left after down -v: $vols"
echo "ok: down -v left no container and no volume"
echo "== test-compose passed in $((SECONDS - start)) s"
