#!/bin/sh
# Generates examples/docker-compose/envoy-xds.yaml from envoy/xds/envoy.yaml, so the two cannot
# drift: the listener and admin bind 0.0.0.0 inside the container (compose publishes them on
# the host's 127.0.0.1 only), and the xDS server is the compose service `control`, by DNS.
#
#   examples/docker-compose/gen-envoy-xds-config.sh            rewrite envoy-xds.yaml beside this script
#   examples/docker-compose/gen-envoy-xds-config.sh --stdout   print it instead
set -eu

here=$(cd "$(dirname "$0")" && pwd)
src=$here/../../envoy/xds/envoy.yaml

# Each needle must be in the source exactly once.
for needle in 'type: STATIC' 'address: 127.0.0.1, port_value: 18000 }' \
  'address: 127.0.0.1, port_value: 10000 }' 'address: 127.0.0.1, port_value: 9901 }'; do
  if [ "$(grep -cF "$needle" "$src")" != 1 ]; then
    echo "gen-envoy-xds-config: envoy/xds/envoy.yaml no longer has exactly one '$needle'; update $0" >&2
    exit 2
  fi
done

generate() {
  echo "# GENERATED from envoy/xds/envoy.yaml by examples/docker-compose/gen-envoy-xds-config.sh."
  echo "# Do not edit: edit envoy/xds/envoy.yaml and run that script."
  echo "#"
  echo "# The Envoy of docker-compose.control.yml: it listens on 0.0.0.0:10000 and 0.0.0.0:9901"
  echo "# inside its container and takes everything from the compose service \`control\`"
  echo "# (fanout-control) over xDS."
  sed -e '/^#/d' \
    -e 's|type: STATIC|type: STRICT_DNS\n      dns_lookup_family: V4_ONLY|' \
    -e 's|address: 127.0.0.1, port_value: 18000 }|address: control, port_value: 18000 }|' \
    -e 's|address: 127.0.0.1, port_value: 10000 }|address: 0.0.0.0, port_value: 10000 }|' \
    -e 's|address: 127.0.0.1, port_value: 9901 }|address: 0.0.0.0, port_value: 9901 }|' \
    "$src" | sed -e '/./,$!d'
}

case "${1:-}" in
  --stdout) generate ;;
  "")
    generate >"$here/envoy-xds.yaml.tmp"
    mv "$here/envoy-xds.yaml.tmp" "$here/envoy-xds.yaml"
    echo "wrote $here/envoy-xds.yaml"
    ;;
  *) echo "usage: $0 [--stdout]" >&2; exit 2 ;;
esac
