#!/usr/bin/env bash
# The fanout demo, as run by `make run`.
#
# Starts three demo subscribers (examples/subscriber/) and Envoy with envoy/envoy.yaml and the
# fanout filter, sends one CloudEvent, shows what each subscriber got and fanout's answer, then
# stays up (printing every further event) until Ctrl-C, which stops everything it started.
#
# Environment (all optional; `make run` sets the first two):
#   ENVOY_BIN                   Envoy binary         (default .tools/envoy-1.40.0, from `make envoy`)
#   FANOUT_WASM                 the built filter     (default target/wasm32-wasip1/release/fanout.wasm)
#   FANOUT_DEMO_PORT            Envoy listener port  (default 10000)
#   FANOUT_DEMO_ADMIN_PORT      Envoy admin port     (default 9901)
#   FANOUT_DEMO_BILLING_PORT    subscriber ports     (default 18081, 18082, 18083)
#   FANOUT_DEMO_SHIPPING_PORT
#   FANOUT_DEMO_ANALYTICS_PORT
#   DEMO_ONESHOT=1              send the sample event, then stop; exit 0 only if the answer was
#                               202 and every subscriber got the event (used by tests/configs.rs)
#   NO_COLOR=1                  no colours (they are also off when stdout is not a terminal)
#
# Only loopback addresses are used.

set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ENVOY_BIN=${ENVOY_BIN:-$ROOT/.tools/envoy-1.40.0}
FANOUT_WASM=${FANOUT_WASM:-$ROOT/target/wasm32-wasip1/release/fanout.wasm}
LISTEN_PORT=${FANOUT_DEMO_PORT:-10000}
ADMIN_PORT=${FANOUT_DEMO_ADMIN_PORT:-9901}
ONESHOT=${DEMO_ONESHOT:-0}
CARGO=${CARGO:-cargo}

# The demo channel, as configured in envoy/envoy.yaml: name, port, path, extra headers.
SUBSCRIBERS=(billing shipping analytics)
declare -A PORT=(
  [billing]=${FANOUT_DEMO_BILLING_PORT:-18081}
  [shipping]=${FANOUT_DEMO_SHIPPING_PORT:-18082}
  [analytics]=${FANOUT_DEMO_ANALYTICS_PORT:-18083}
)
declare -A ROUTE=(
  [billing]="/events/billing  + x-tenant: acme"
  [shipping]="/hooks/orders"
  [analytics]="/ingest"
)

# ---------------------------------------------------------------------------------------------
# Output

if [[ -t 1 && -z ${NO_COLOR:-} ]]; then COLOR=1; else COLOR=0; fi
paint() { if ((COLOR)); then printf '\033[%sm%s\033[0m' "$1" "$2"; else printf '%s' "$2"; fi; }
section() {
  local title=" $1 " rule
  rule=$(printf '%*s' $((72 - ${#title})) '' | tr ' ' '-')
  printf '\n%s%s\n' "$(paint '1;36' "==$title")" "$(paint 2 "$rule")"
}
say() { printf '  %s\n' "$*"; }
ok() { printf '  %s %s\n' "$(paint '1;32' '✓')" "$*"; }
bad() { printf '  %s %s\n' "$(paint '1;31' '✗')" "$*"; }
dim() { paint 2 "$*"; }
die() {
  bad "$*"
  exit 1
}
if [[ -n ${EPOCHREALTIME:-} ]]; then
  now_ms() { local t=${EPOCHREALTIME/[.,]/}; printf '%s' $((t / 1000)); }
else
  now_ms() { date +%s%3N; }
fi
indent() { sed 's/^/    /'; }

# ---------------------------------------------------------------------------------------------
# Processes: each runs in its own session (so Ctrl-C reaches only this script), and cleanup
# stops every one of them, whatever way the script ends.

TMP=""
PIDS=()
TAIL_PID=""

start() { # start LOGFILE CMD...: run CMD in the background in its own process group
  local log=$1
  shift
  if command -v setsid >/dev/null; then
    setsid "$@" >"$log" 2>&1 </dev/null &
  else
    "$@" >"$log" 2>&1 </dev/null &
  fi
  PIDS+=("$!")
}

cleanup() {
  local status=$?
  set +e
  trap - EXIT INT TERM
  [[ -n $TAIL_PID ]] && { kill -TERM -- "-$TAIL_PID" 2>/dev/null || kill -TERM "$TAIL_PID" 2>/dev/null; }
  if ((${#PIDS[@]})); then
    ((ONESHOT)) || printf '\n'
    local pid
    for pid in "${PIDS[@]}"; do
      kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    done
    # Give them a moment to exit, then make sure.
    local deadline=$(($(now_ms) + 3000)) alive=1
    while ((alive)) && (($(now_ms) < deadline)); do
      alive=0
      for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
      ((alive)) && sleep 0.05
    done
    for pid in "${PIDS[@]}"; do
      kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
      wait "$pid" 2>/dev/null || true
    done
    printf '  %s\n' "$(dim "stopped envoy and ${#SUBSCRIBERS[@]} subscribers")"
  fi
  [[ -n $TMP ]] && rm -rf "$TMP"
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

port_in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

show_log_tail() { # show_log_tail FILE LABEL
  [[ -s $1 ]] || return 0
  say "$(dim "last lines of $2:")"
  tail -n 15 "$1" | indent
}
show_envoy_log() {
  show_log_tail "$TMP/envoy.log" "the Envoy log"
  show_log_tail "$TMP/access.log" "Envoy's stdout"
}

# ---------------------------------------------------------------------------------------------

section "fanout demo"
[[ -x $ENVOY_BIN ]] || die "Envoy not found at $ENVOY_BIN: run \`make envoy\` (or \`make run\`), or set ENVOY_BIN"
[[ -f $FANOUT_WASM ]] || die "the filter is not built ($FANOUT_WASM): run \`make build\` (or \`make run\`), or set FANOUT_WASM"
command -v curl >/dev/null || die "curl is needed to send the sample event"

envoy_version=$("$ENVOY_BIN" --version 2>/dev/null | sed -n 's#.*/\([0-9][0-9.]*\)/.*#\1#p' | head -n1)
say "$(printf '%-10s' envoy)${envoy_version:-?}  $(dim "$ENVOY_BIN")"
say "$(printf '%-10s' filter)$(($(wc -c <"$FANOUT_WASM") / 1024)) KiB  $(dim "$FANOUT_WASM")"
say "$(printf '%-10s' listener)http://127.0.0.1:$LISTEN_PORT  $(dim "admin http://127.0.0.1:$ADMIN_PORT")"
say "$(printf '%-10s' channel)demo/orders (any host)"
for name in "${SUBSCRIBERS[@]}"; do
  say "$(printf '%-10s' '')→ $(printf '%-10s' "$name") 127.0.0.1:${PORT[$name]}  ${ROUTE[$name]}"
done

for port in "$LISTEN_PORT" "$ADMIN_PORT" "${PORT[@]}"; do
  port_in_use "$port" && die "port $port on 127.0.0.1 is already in use (another demo still running?). Choose other ports with FANOUT_DEMO_PORT, FANOUT_DEMO_ADMIN_PORT, FANOUT_DEMO_{BILLING,SHIPPING,ANALYTICS}_PORT"
done

TMP=$(mktemp -d "${TMPDIR:-/tmp}/fanout-demo.XXXXXX")

# ---------------------------------------------------------------------------------------------
section "1. starting"

t0=$(now_ms)
(cd "$ROOT" && "$CARGO" build --quiet -p fanout-demo-subscriber) || die "building the demo subscriber failed"
SUBSCRIBER_BIN=${CARGO_TARGET_DIR:-$ROOT/target}/debug/subscriber
[[ -x $SUBSCRIBER_BIN ]] || die "built the subscriber, but $SUBSCRIBER_BIN is missing"
ok "built the demo subscriber $(dim "($(($(now_ms) - t0)) ms)")"

if ((COLOR)); then sub_color=always; else sub_color=never; fi
for name in "${SUBSCRIBERS[@]}"; do
  start "$TMP/$name.log" "$SUBSCRIBER_BIN" --name "$name" --port "${PORT[$name]}" --color "$sub_color"
done

# The demo config with this run's ports and the absolute wasm path. `t` ends the script for a
# line once one substitution was made, so a new port never gets substituted again.
CONFIG=$TMP/envoy.yaml
esc() { printf '%s' "$1" | sed 's/[\\|&]/\\&/g'; }
for needle in 'port_value: 10000 }' 'port_value: 9901 }' 'port_value: 18081 }' \
  'port_value: 18082 }' 'port_value: 18083 }' 'filename: target/wasm32-wasip1/release/fanout.wasm'; do
  [[ $(grep -cF "$needle" "$ROOT/envoy/envoy.yaml") == 1 ]] ||
    die "envoy/envoy.yaml no longer has exactly one '$needle'; update examples/demo.sh to match it"
done
sed -e "s|port_value: 10000 }|port_value: $LISTEN_PORT }|;t" \
  -e "s|port_value: 9901 }|port_value: $ADMIN_PORT }|;t" \
  -e "s|port_value: 18081 }|port_value: ${PORT[billing]} }|;t" \
  -e "s|port_value: 18082 }|port_value: ${PORT[shipping]} }|;t" \
  -e "s|port_value: 18083 }|port_value: ${PORT[analytics]} }|;t" \
  -e "s|filename: target/wasm32-wasip1/release/fanout.wasm|filename: $(esc "$FANOUT_WASM")|" \
  "$ROOT/envoy/envoy.yaml" >"$CONFIG"

# Envoy's own log goes to envoy.log, its stdout (the access log: one line per answer) to
# access.log.
t_envoy=$(now_ms)
start "$TMP/access.log" "$ENVOY_BIN" -c "$CONFIG" --disable-hot-restart --concurrency 2 \
  --log-level info --log-format '[%Y-%m-%d %T.%e][%l][%n] %v' --log-path "$TMP/envoy.log" \
  --file-flush-interval-msec 100
ENVOY_PID=${PIDS[-1]}

# Wait, bounded, until every subscriber listens and Envoy says it is ready.
deadline=$(($(now_ms) + 10000))
for i in "${!SUBSCRIBERS[@]}"; do
  name=${SUBSCRIBERS[$i]}
  until grep -q "listening on" "$TMP/$name.log" 2>/dev/null; do
    if ! kill -0 "${PIDS[$i]}" 2>/dev/null; then
      show_log_tail "$TMP/$name.log" "$name"
      die "subscriber $name exited at start"
    fi
    (($(now_ms) < deadline)) || die "subscriber $name did not start listening within 10 s"
    sleep 0.05
  done
  ok "subscriber $(printf '%-10s' "$name") listening on 127.0.0.1:${PORT[$name]}"
done

deadline=$(($(now_ms) + 30000))
until [[ $(curl -s --max-time 1 "http://127.0.0.1:$ADMIN_PORT/ready" 2>/dev/null) == LIVE ]]; do
  if ! kill -0 "$ENVOY_PID" 2>/dev/null; then
    show_envoy_log
    die "Envoy exited at start (a config error shows in the log above)"
  fi
  if (($(now_ms) >= deadline)); then
    show_envoy_log
    die "Envoy was not ready within 30 s"
  fi
  sleep 0.1
done
ok "envoy ready on 127.0.0.1:$LISTEN_PORT $(dim "($(($(now_ms) - t_envoy)) ms; log: $TMP/envoy.log)")"

# ---------------------------------------------------------------------------------------------
section "2. sending one CloudEvent"

event_id=$(cat /proc/sys/kernel/random/uuid 2>/dev/null || printf 'demo-%s' "$(now_ms)")
request_id="demo-$(now_ms)"
body='{"order":"A-1001","customer":"c-42","items":[{"sku":"TSHIRT-M","qty":2},{"sku":"MUG","qty":1}],"total":39.5,"currency":"EUR"}'
url="http://127.0.0.1:$LISTEN_PORT/orders"

printf '%s\n' \
  "curl $url \\" \
  "  -H 'ce-specversion: 1.0' -H 'ce-type: com.example.order.created' \\" \
  "  -H 'ce-source: /demo/shop' -H 'ce-id: $event_id' \\" \
  "  -H 'x-request-id: $request_id' \\" \
  "  -H 'traceparent: 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01' \\" \
  "  -H 'content-type: application/json' \\" \
  "  -d '$body'" | indent

t1=$(now_ms)
status=$(curl -sS --max-time 20 -o "$TMP/answer.body" -D "$TMP/answer.headers" -w '%{http_code}' \
  -H 'ce-specversion: 1.0' -H 'ce-type: com.example.order.created' \
  -H 'ce-source: /demo/shop' -H "ce-id: $event_id" \
  -H "x-request-id: $request_id" \
  -H 'traceparent: 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01' \
  -H 'content-type: application/json' \
  --data-binary "$body" "$url" 2>"$TMP/curl.err") || status="000"
elapsed=$(($(now_ms) - t1))

# ---------------------------------------------------------------------------------------------
section "3. what the subscribers got"

# fanout answers only after every subscriber has answered, and a subscriber prints an event
# before answering it, so the logs are complete by now.
missing=()
for name in "${SUBSCRIBERS[@]}"; do
  if grep -q "event #" "$TMP/$name.log"; then
    sed -n '/event #/,$p' "$TMP/$name.log" | indent
  else
    missing+=("$name")
    printf '    %s\n' "$(paint '1;31' "$name: nothing received")"
  fi
done

# ---------------------------------------------------------------------------------------------
section "4. fanout's answer"

case $status in
  202)
    ok "$(paint '1;32' "HTTP 202 Accepted")  every subscriber answered 2xx $(dim "(${elapsed} ms)")"
    ;;
  000)
    bad "no HTTP answer: $(cat "$TMP/curl.err")"
    ;;
  *)
    bad "$(paint '1;31' "HTTP $status")  $(dim "(${elapsed} ms)")"
    if [[ -s $TMP/answer.body ]]; then
      if command -v python3 >/dev/null && python3 -m json.tool <"$TMP/answer.body" >"$TMP/answer.pretty" 2>/dev/null; then
        indent <"$TMP/answer.pretty"
      else
        indent <"$TMP/answer.body"
        printf '\n'
      fi
    fi
    ;;
esac
((${#missing[@]} == 0)) || bad "no event reached: ${missing[*]}"

if ((ONESHOT)); then
  if [[ $status == 202 && ${#missing[@]} == 0 ]]; then
    ok "demo passed: 202 and the event reached all ${#SUBSCRIBERS[@]} subscribers"
    exit 0
  fi
  show_envoy_log
  die "demo failed"
fi

# ---------------------------------------------------------------------------------------------
section "5. try it yourself (in another terminal)"

say "$(paint 1 'Send another event')"
cat <<EOF | indent
curl -i http://127.0.0.1:$LISTEN_PORT/orders \\
  -H 'ce-specversion: 1.0' -H 'ce-type: com.example.order.shipped' \\
  -H 'ce-source: /demo/shop' -H "ce-id: \$(date +%s%N)" \\
  -H 'content-type: application/json' -d '{"order":"A-1002","carrier":"DHL"}'
EOF
printf '\n'
say "$(paint 1 'Make one subscriber fail') $(dim '(x-demo-fail makes the named demo subscribers answer 500; fanout still')"
say "$(dim 'delivers to the others and answers 500 with a JSON body naming the failed one)')"
cat <<EOF | indent
curl -i http://127.0.0.1:$LISTEN_PORT/orders -H 'x-demo-fail: shipping' \\
  -H 'ce-specversion: 1.0' -H 'ce-type: com.example.order.created' \\
  -H 'ce-source: /demo/shop' -H 'ce-id: 42' \\
  -H 'content-type: application/json' -d '{"order":"A-1003"}'
EOF
printf '\n'
say "$(paint 1 'Other answers') $(dim '(fanout answers every request itself)')"
say "curl -i http://127.0.0.1:$LISTEN_PORT/orders                   $(dim '# GET: 405, allow: POST, OPTIONS')"
say "curl -s http://127.0.0.1:$ADMIN_PORT/stats | grep -i wasm       $(dim "# Envoy's wasm stats")"

section "watching: events and answers show below. Ctrl-C stops it all"
tail_args=(-q -n 0 -F)
# GNU tail can stop by itself when Envoy exits.
tail --pid=$$ -n 0 /dev/null 2>/dev/null && tail_args+=(--pid="$ENVOY_PID")
for name in "${SUBSCRIBERS[@]}"; do tail_args+=("$TMP/$name.log"); done
tail_args+=("$TMP/access.log")
# The follower runs in its own process group too; cleanup stops the whole pipeline.
if command -v setsid >/dev/null; then setsid=(setsid); else setsid=(); fi
# Envoy's access log lines (fanout's answers) get a marker, green for 2xx and red otherwise.
if ((COLOR)); then g=$'\033[1;32m' r=$'\033[1;31m' n=$'\033[0m'; else g="" r="" n=""; fi
script="s/^fanout answered (2[0-9][0-9])/$g◀ fanout answered \\1$n/;t end
s/^fanout answered ([0-9]+)/$r◀ fanout answered \\1$n/
:end
s/^/    /"
# shellcheck disable=SC2016 # $1 and $@ belong to the inner bash
"${setsid[@]}" bash -c 'script=$1; shift; tail "$@" 2>/dev/null | sed -u -E "$script"' tail "$script" "${tail_args[@]}" &
TAIL_PID=$!
# `wait` returns when the tail ends (Envoy exited) or a signal arrives (the trap then runs).
wait "$TAIL_PID" || true
TAIL_PID=""
if ! kill -0 "$ENVOY_PID" 2>/dev/null; then
  show_envoy_log
  die "Envoy exited"
fi
