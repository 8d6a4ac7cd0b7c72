#!/usr/bin/env python3
"""Write the files Envoy watches for fanout's live reconfiguration (envoy/configmap/envoy.yaml).

  render-ecds.py filter FANOUT.json [--wasm PATH] [--name fanout] [-o FILE]
      The filter's configuration as an ECDS file: a DiscoveryResponse with one
      TypedExtensionConfig named `fanout` holding the wasm filter with FANOUT.json as its plugin
      configuration. FANOUT.json is the plain fan-out config of the README ("-": stdin).

  render-ecds.py clusters NAME=HOST:PORT ... [--connect-timeout 1s] [-o FILE]
      The subscriber clusters as a CDS file: one cluster per argument, STATIC for an IP
      address, STRICT_DNS for a host name (e.g. billing.default.svc.cluster.local:80).

Without -o the file goes to stdout. With -o it is written next to FILE and renamed over it,
so an Envoy watching that directory never reads half a file. In Kubernetes put both files in
one ConfigMap (see the README); the kubelet's symlink flip is what Envoy reacts to.

Only JSON syntax is checked here. The filter checks everything else when Envoy loads the
file: an invalid config is refused, Envoy logs the field and keeps the previous one.
Python 3 standard library only.
"""

import argparse
import hashlib
import ipaddress
import json
import os
import sys
import tempfile

WASM_TYPE = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
EXTENSION_TYPE = "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig"
CLUSTER_TYPE = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
DEFAULT_WASM = "/etc/fanout-wasm/fanout.wasm"


def fail(message):
    print(f"render-ecds: {message}", file=sys.stderr)
    sys.exit(2)


def discovery_response(resources):
    # version_info is informative only (Envoy shows it as the `version_text` stat); a digest
    # of the content tells which file a running Envoy has loaded.
    body = json.dumps(resources, sort_keys=True, separators=(",", ":")).encode()
    return {
        "version_info": hashlib.sha256(body).hexdigest()[:16],
        "resources": resources,
    }


def filter_resource(plugin_config, name, wasm):
    return {
        "@type": EXTENSION_TYPE,
        "name": name,
        "typed_config": {
            "@type": WASM_TYPE,
            "config": {
                "name": name,
                "root_id": "fanout",
                # Envoy >= 1.35: lets the filter pause on the headers and still get the body.
                "allow_on_headers_stop_iteration": True,
                "configuration": {
                    "@type": "type.googleapis.com/google.protobuf.StringValue",
                    "value": plugin_config,
                },
                # The same vm_id and code in every version of the file: Envoy keeps the VMs and
                # only starts a new plugin (root context) in them for each new configuration.
                "vm_config": {
                    "vm_id": "fanout",
                    "runtime": "envoy.wasm.runtime.v8",
                    "code": {"local": {"filename": wasm}},
                },
            },
        },
    }


def cluster_resource(spec, connect_timeout):
    name, sep, address = spec.partition("=")
    host, colon, port = address.rpartition(":")
    if not sep or not name or not colon or not host:
        fail(f"cluster {spec!r}: expected NAME=HOST:PORT")
    try:
        port = int(port)
    except ValueError:
        fail(f"cluster {spec!r}: the port is not a number")
    if not 0 < port < 65536:
        fail(f"cluster {spec!r}: port out of range")
    return cluster(name, host.strip("[]"), port, connect_timeout)


def cluster(name, host, port, connect_timeout):
    """One cluster with one endpoint: STATIC for an IP address, STRICT_DNS for a host name.
    (envoy/knative-import.py builds its clusters with this too.)"""
    try:
        ipaddress.ip_address(host)
        kind = "STATIC"
    except ValueError:
        kind = "STRICT_DNS"
    return {
        "@type": CLUSTER_TYPE,
        "name": name,
        "type": kind,
        "connect_timeout": connect_timeout,
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}
                    ]
                }
            ],
        },
    }


def write(document, out):
    text = json.dumps(document, indent=2) + "\n"
    if out is None:
        sys.stdout.write(text)
        return
    directory = os.path.dirname(os.path.abspath(out))
    fd, tmp = tempfile.mkstemp(prefix=".render-ecds-", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def main():
    parser = argparse.ArgumentParser(
        description="Write fanout's ECDS (filter) or CDS (clusters) file for Envoy.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    sub = parser.add_subparsers(dest="what", required=True)
    f = sub.add_parser("filter", help="the filter config (ECDS) from the plain fan-out JSON")
    f.add_argument("config", help='the fan-out JSON file ("-": stdin)')
    f.add_argument("--wasm", default=DEFAULT_WASM, help=f"fanout.wasm as Envoy sees it (default {DEFAULT_WASM})")
    f.add_argument("--name", default="fanout", help="the filter's name in Envoy's config_discovery (default fanout)")
    f.add_argument("-o", "--output", help="write here (atomically) instead of stdout")
    c = sub.add_parser("clusters", help="subscriber clusters (CDS)")
    c.add_argument("clusters", nargs="*", metavar="NAME=HOST:PORT")
    c.add_argument("--connect-timeout", default="1s")
    c.add_argument("-o", "--output", help="write here (atomically) instead of stdout")
    args = parser.parse_args()

    if args.what == "filter":
        try:
            if args.config == "-":
                text = sys.stdin.read()
            else:
                with open(args.config, encoding="utf-8") as fh:
                    text = fh.read()
        except OSError as e:
            fail(f"cannot read {args.config}: {e}")
        try:
            parsed = json.loads(text)
        except ValueError as e:
            fail(f"{args.config} is not JSON: {e}")
        if not isinstance(parsed, dict):
            fail(f"{args.config}: the fan-out config is a JSON object")
        # Passed on exactly as written: the filter validates it (including what a JSON parser
        # would paper over, such as a key given twice) and refuses what is wrong.
        plugin_config = text.strip()
        document = discovery_response([filter_resource(plugin_config, args.name, args.wasm)])
    else:
        names = [spec.partition("=")[0] for spec in args.clusters]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            fail(f"cluster named twice: {', '.join(duplicates)}")
        document = discovery_response([cluster_resource(s, args.connect_timeout) for s in args.clusters])
    write(document, args.output)


if __name__ == "__main__":
    main()
