#!/bin/sh
# Generates examples/docker-compose/envoy.yaml from envoy/envoy.yaml, so the two cannot drift:
#   - listener and admin bind 0.0.0.0 inside the container (compose publishes them on the
#     host's 127.0.0.1 only),
#   - each subscriber cluster becomes STRICT_DNS and points at the compose service of the same
#     name, port 8080,
#   - the wasm is read from the volume the fanout-wasm service fills.
#
#   examples/docker-compose/gen-envoy-config.sh            rewrite envoy.yaml beside this script
#   examples/docker-compose/gen-envoy-config.sh --stdout   print it instead
#
# `cargo test --test configs` fails when the checked-in file differs from what this prints.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
src=$here/../../envoy/envoy.yaml
wasm=/var/local/fanout/fanout.wasm

generate() {
  awk -v wasm="$wasm" '
    BEGIN {
      print "# GENERATED from envoy/envoy.yaml by examples/docker-compose/gen-envoy-config.sh."
      print "# Do not edit: edit envoy/envoy.yaml and run that script."
      print "#"
      print "# The demo config for docker-compose.yml: Envoy listens on 0.0.0.0:10000 and 0.0.0.0:9901"
      print "# inside its container (published on the host as 127.0.0.1:10000 and 127.0.0.1:9901), the"
      print "# subscriber clusters point at the compose services of the same names, and the wasm comes"
      print "# from the volume that the fanout-wasm service fills."
      header = 1
    }
    # Drop the source file leading comment block; the header above replaces it.
    header && /^#/ { next }
    header && /^[[:space:]]*$/ { next }
    { header = 0 }

    /^  clusters:/ { in_clusters = 1 }
    in_clusters && /cluster_name:/ {
      name = $0; sub(/.*cluster_name:[[:space:]]*/, "", name); sub(/[[:space:]]*$/, "", name)
    }
    in_clusters && /^      type: STATIC[[:space:]]*$/ {
      sub(/STATIC/, "STRICT_DNS"); print
      print "      dns_lookup_family: V4_ONLY"
      dns++
      next
    }
    in_clusters && /address: 127\.0\.0\.1, port_value: [0-9]+/ {
      if (name == "") { print "gen-envoy-config: endpoint before cluster_name" > "/dev/stderr"; exit 2 }
      sub(/address: 127\.0\.0\.1, port_value: [0-9]+/, "address: " name ", port_value: 8080")
      endpoints++
      name = ""
    }
    !in_clusters && /address: 127\.0\.0\.1,/ { sub(/127\.0\.0\.1/, "0.0.0.0"); binds++ }
    /filename: target\/wasm32-wasip1\/release\/fanout\.wasm/ {
      sub(/target\/wasm32-wasip1\/release\/fanout\.wasm/, wasm); wasms++
    }
    /127\.0\.0\.1/ && !/^[[:space:]]*#/ {
      print "gen-envoy-config: unhandled loopback address: " $0 > "/dev/stderr"; exit 2
    }
    { print }
    END {
      if (binds != 2 || wasms != 1 || endpoints < 1 || endpoints != dns) {
        printf "gen-envoy-config: envoy/envoy.yaml changed shape (binds=%d wasm=%d endpoints=%d STATIC clusters=%d); update this script\n", binds, wasms, endpoints, dns > "/dev/stderr"
        exit 2
      }
    }
  ' "$src"
}

case "${1:-}" in
  --stdout) generate ;;
  "")
    generate >"$here/envoy.yaml.tmp"
    mv "$here/envoy.yaml.tmp" "$here/envoy.yaml"
    echo "wrote $here/envoy.yaml"
    ;;
  *) echo "usage: $0 [--stdout]" >&2; exit 2 ;;
esac
