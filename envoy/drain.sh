#!/bin/sh
# envoy/drain.sh ADMIN_URL [DEADLINE_S]
#
# Stops one fanout replica without losing what it accepted: drains Envoy's listeners, then
# waits until fanout owes nothing (no fan-out in flight: async deliveries, retries waiting
# for their backoff, dead letters, replies, best-effort calls; no request in progress), or
# until DEADLINE_S seconds (default 60) have passed since it started.
#
# Exit status: 0 when nothing is owed (stop Envoy now: SIGTERM loses nothing), 1 when the
# deadline passed first or Envoy's admin could not be read (the message names what is still
# owed), 2 on a usage error. Meant as a Kubernetes preStop hook; POSIX sh and curl only.
#
#   1. POST ADMIN_URL/drain_listeners?graceful: every response from now on carries
#      `connection: close` (HTTP/1.1) or a GOAWAY (HTTP/2), with Envoy's
#      `--drain-strategy immediate` at once, with `gradual` (the default) more and more often;
#      new connections are still accepted until `--drain-time-s` has passed (default 600 s:
#      set it to a few seconds), then the listeners stop and new connections are refused.
#      Envoy keeps running and its admin keeps answering.
#   2. Every POLL_S (default 1) it reads `wasmcustom.fanout.in_flight` (what fanout owes) and
#      every `http.<prefix>.downstream_rq_active` but the admin's (requests still being
#      received or answered); it is done after QUIET (default 3) readings in a row of all
#      zeros. fanout hands its gauge to Envoy once a second, so three readings a second
#      apart see any fan-out that started before the first of them.
#
# Environment: FANOUT_DRAIN_PARAMS (the drain_listeners query, default `graceful`; in an
# Istio sidecar use `inboundonly&graceful`, which leaves the outbound listeners of the
# application alone), FANOUT_DRAIN_POLL_S, FANOUT_DRAIN_QUIET. Needs fanout's metrics on
# (the default): without the gauge nothing says what is owed, and it exits 1 at once.

set -u

if [ $# -lt 1 ] || [ $# -gt 2 ]; then
    echo "usage: $0 ADMIN_URL [DEADLINE_S]   (e.g. $0 http://127.0.0.1:9901 120)" >&2
    exit 2
fi
admin=${1%/}
deadline_s=${2:-60}
case $deadline_s in
    '' | *[!0-9]*)
        echo "drain.sh: DEADLINE_S must be a whole number of seconds, not '$deadline_s'" >&2
        exit 2
        ;;
esac
params=${FANOUT_DRAIN_PARAMS:-graceful}
poll_s=${FANOUT_DRAIN_POLL_S:-1}
quiet_needed=${FANOUT_DRAIN_QUIET:-3}
gauge=wasmcustom.fanout.in_flight

started=$(date +%s)
log() {
    echo "drain.sh: [$(($(date +%s) - started))s] $*" >&2
}

if ! curl -fsS -m 5 -X POST "$admin/drain_listeners?$params" >/dev/null; then
    log "POST $admin/drain_listeners?$params failed: nothing was drained"
    exit 1
fi
log "listeners draining ($params); waiting for fanout to owe nothing (deadline ${deadline_s}s)"

quiet=0
while :; do
    # One read of both: `name: value` lines.
    if stats=$(curl -fsS -m 5 -G "$admin/stats" \
        --data-urlencode "filter=^($gauge|http\\.[^.]+\\.downstream_rq_active)\$"); then
        owed=$(printf '%s\n' "$stats" | awk -v g="$gauge" -F': ' '$1 == g { print $2 }')
        active=$(printf '%s\n' "$stats" | awk -F': ' '
            $1 ~ /^http\./ && $1 != "http.admin.downstream_rq_active" { n += $2 }
            END { print n + 0 }')
        if [ -z "$owed" ]; then
            log "Envoy has no $gauge: fanout is not loaded or its metrics are off, so \
nothing says what it owes"
            exit 1
        fi
        if [ "$owed" = 0 ] && [ "$active" = 0 ]; then
            quiet=$((quiet + 1))
            if [ "$quiet" -ge "$quiet_needed" ]; then
                log "fanout owes nothing; safe to stop Envoy"
                exit 0
            fi
        else
            quiet=0
        fi
        what="$owed fan-out(s) owed ($gauge: async deliveries, retries waiting, dead \
letters, replies, best-effort calls) and $active request(s) in progress"
    else
        quiet=0
        what="unknown (GET $admin/stats failed)"
    fi
    if [ $(($(date +%s) - started)) -ge "$deadline_s" ]; then
        log "deadline of ${deadline_s}s passed; still owed: $what"
        exit 1
    fi
    sleep "$poll_s"
done
