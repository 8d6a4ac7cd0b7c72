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
# owed), 2 on a usage error. Meant as a Kubernetes preStop hook.
#
# Needs a POSIX sh and one way to Envoy's admin, the first found of: curl, wget, Istio's
# `pilot-agent request` (the sidecar's admin, 127.0.0.1:15000), or bash's /dev/tcp (the
# envoyproxy/envoy images have bash but neither curl nor wget). FANOUT_DRAIN_CLIENT=curl |
# wget | pilot-agent | bash picks one. A distroless image has no shell: see docs/replicas.md.
#
#   1. POST ADMIN_URL/drain_listeners?graceful: every response from now on carries
#      `connection: close` (HTTP/1.1) or a GOAWAY (HTTP/2), with Envoy's
#      `--drain-strategy immediate` at once, with `gradual` (the default) more and more often;
#      new connections are still accepted until `--drain-time-s` has passed (default 600 s:
#      set it to a few seconds), then the listeners stop and new connections are refused.
#      Envoy keeps running and its admin keeps answering.
#   2. Every POLL_S (default 1) it reads `wasmcustom.fanout.in_flight` (what fanout owes;
#      `dynamicmodulescustom.fanout.in_flight` from the native build) and
#      every `http.<stat prefix>.downstream_rq_active` but those whose prefix starts with
#      `admin` (the admin's own, the probes' listener): requests still being received or
#      answered. The stat prefix may have dots (Istio's inbound one is
#      `inbound_0.0.0.0_8080`). It is done after QUIET (default 3) readings in a row of all
#      zeros. fanout hands its gauge to Envoy once a second, so three readings a second
#      apart see any fan-out that started before the first of them.
#
# Environment: FANOUT_DRAIN_PARAMS (the drain_listeners query, default `graceful`; in an
# Istio sidecar use `inboundonly&graceful`, which leaves the outbound listeners of the
# application alone), FANOUT_DRAIN_POLL_S, FANOUT_DRAIN_QUIET, FANOUT_DRAIN_CLIENT. Needs
# fanout's metrics on (the default) and Envoy's downstream_rq_active stats (Istio keeps them
# only with a proxyStatsMatcher that includes them): when either is missing nothing says
# what is owed, and it exits 1 (at once for the second, after QUIET readings for fanout's
# gauge, which fanout defines within a second of Envoy's start).

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
native_gauge=dynamicmodulescustom.fanout.in_flight

started=$(date +%s)
log() {
    echo "drain.sh: [$(($(date +%s) - started))s] $*" >&2
}

client=${FANOUT_DRAIN_CLIENT:-}
if [ -z "$client" ]; then
    for candidate in curl wget pilot-agent bash; do
        if command -v "$candidate" >/dev/null 2>&1; then
            client=$candidate
            break
        fi
    done
fi

# admin METHOD PATH_AND_QUERY: the body on stdout; fails unless Envoy answered 200.
admin() {
    case $client in
        curl) curl -fsS -m 5 -X "$1" "$admin$2" ;;
        wget)
            if [ "$1" = POST ]; then
                wget -q -T 5 -O - --post-data= "$admin$2"
            else
                wget -q -T 5 -O - "$admin$2"
            fi
            ;;
        # Istio's agent talks to its own Envoy's admin; ADMIN_URL is not used.
        pilot-agent) pilot-agent request "$1" "${2#/}" ;;
        # HTTP/1.1 by hand (Envoy refuses HTTP/1.0), a chunked body de-chunked.
        bash) bash -c '
            export LC_ALL=C
            hostport=${1#http://}; hostport=${hostport%%/*}
            exec 3<>"/dev/tcp/${hostport%:*}/${hostport##*:}" || exit 1
            printf "%s %s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\nContent-Length: 0\r\n\r\n" \
                "$2" "$3" "$hostport" >&3
            IFS= read -r status <&3
            case $status in "HTTP/1."?" 200"*) ;; *) exit 1 ;; esac
            chunked=
            while IFS= read -r line <&3; do
                line=${line%$'"'"'\r'"'"'}
                [ -z "$line" ] && break
                case ${line,,} in "transfer-encoding: chunked") chunked=1 ;; esac
            done
            if [ -z "$chunked" ]; then cat <&3; exit 0; fi
            while IFS= read -r size <&3; do
                size=$((16#${size%$'"'"'\r'"'"'}))
                [ "$size" = 0 ] && break
                IFS= read -r -N "$size" data <&3
                printf "%s" "$data"
                IFS= read -r _ <&3
            done' drain "$admin" "$1" "$2" ;;
        *)
            log "no way to Envoy's admin: none of curl, wget, pilot-agent, bash (FANOUT_DRAIN_CLIENT='$client')"
            return 1
            ;;
    esac
}

if ! admin POST "/drain_listeners?$params" >/dev/null; then
    log "POST $admin/drain_listeners?$params failed ($client): nothing was drained"
    exit 1
fi
log "listeners draining ($params); waiting for fanout to owe nothing (deadline ${deadline_s}s)"

quiet=0
missing=0
while :; do
    # One read of both: `name: value` lines. The filter is a regex, percent-encoded.
    if stats=$(admin GET "/stats?filter=%5E((wasmcustom%7Cdynamicmodulescustom)%5C.fanout%5C.in_flight%7Chttp%5C..%2B%5C.downstream_rq_active)%24"); then
        owed=$(printf '%s\n' "$stats" | awk -v g="$gauge" -v n="$native_gauge" -F': ' '
            $1 == g || $1 == n { owed += $2; seen = 1 } END { if (seen) print owed }')
        listeners=$(printf '%s\n' "$stats" | awk -F': ' '
            $1 ~ /^http\./ && $1 !~ /^http\.admin/ { n++ } END { print n + 0 }')
        active=$(printf '%s\n' "$stats" | awk -F': ' '
            $1 ~ /^http\./ && $1 !~ /^http\.admin/ { n += $2 }
            END { print n + 0 }')
        if [ "$listeners" = 0 ]; then
            log "Envoy has no http.<prefix>.downstream_rq_active stats (in Istio: add them to \
proxyStatsMatcher), so nothing says which requests are in progress"
            exit 1
        fi
        # fanout defines its gauge at its first flush, within a second of Envoy's start: only
        # missing at QUIET readings in a row means it will not come.
        if [ -z "$owed" ]; then
            missing=$((missing + 1))
            if [ "$missing" -ge "$quiet_needed" ]; then
                log "Envoy has no $gauge (nor $native_gauge): fanout is not loaded or its \
metrics are off, so nothing says what it owes"
                exit 1
            fi
            owed=unknown
        else
            missing=0
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
        what="unknown (GET $admin/stats failed, $client)"
    fi
    if [ $(($(date +%s) - started)) -ge "$deadline_s" ]; then
        log "deadline of ${deadline_s}s passed; still owed: $what"
        exit 1
    fi
    sleep "$poll_s"
done
