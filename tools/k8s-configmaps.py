#!/usr/bin/env python3
"""Writes the two ConfigMaps of deploy/kubernetes/ from the files they carry.

    tools/k8s-configmaps.py FANOUT.json NAME=HOST:PORT ... [-o DIR]

  DIR/fanout-envoy.yaml   ConfigMap fanout-envoy: envoy.yaml (envoy/configmap/envoy.yaml, the
                          bootstrap) and drain.sh (envoy/drain.sh, the preStop hook), as shipped
  DIR/fanout-config.yaml  ConfigMap fanout-config: fanout.yaml (ECDS: the filter with
                          FANOUT.json) and clusters.yaml (CDS: the clusters NAME=HOST:PORT), as
                          envoy/render-ecds.py writes them

  XDS/fanout-envoy.yaml   with --xds-out XDS: the same ConfigMap for the Envoys on xDS (a
                          patch of the first, deploy/kubernetes-xds/): envoy.yaml is
                          envoy/xds/envoy-cluster.yaml, with the SDS files of envoy/xds/sds/

`make k8s-configmaps` runs it on deploy/kubernetes/fanout.json. Python 3, no packages.
"""
import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RENDER = os.path.join(ROOT, "envoy", "render-ecds.py")


def configmap(name, comment, files):
    lines = [f"# {line}".rstrip() for line in comment.strip().splitlines()]
    lines += ["apiVersion: v1", "kind: ConfigMap", "metadata:", f"  name: {name}",
              "  labels: { app: fanout }", "data:"]
    for key, text in files:
        lines.append(f"  {key}: |")
        lines += [f"    {line}".rstrip() for line in text.rstrip("\n").split("\n")]
    return "\n".join(lines) + "\n"


def read(rel):
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def render(args):
    out = subprocess.run([sys.executable, RENDER, *args], check=True, capture_output=True, text=True)
    return out.stdout


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("fanout", help="the plain fan-out JSON")
    parser.add_argument("clusters", nargs="*", metavar="NAME=HOST:PORT")
    parser.add_argument("-o", "--out", default=os.path.join(ROOT, "deploy", "kubernetes"))
    parser.add_argument("--xds-out", help="where to write the xDS overlay's ConfigMap")
    args = parser.parse_args()
    envoy = configmap(
        "fanout-envoy",
        """Written by tools/k8s-configmaps.py (make k8s-configmaps): envoy/configmap/envoy.yaml and
envoy/drain.sh as shipped. Edit those, not this.""",
        [("envoy.yaml", read("envoy/configmap/envoy.yaml")), ("drain.sh", read("envoy/drain.sh"))],
    )
    config = configmap(
        "fanout-config",
        f"""Written by tools/k8s-configmaps.py (make k8s-configmaps) from {os.path.basename(args.fanout)}
and the subscriber clusters: what fanout runs. Replace it (kubectl apply) and every replica
takes the new configuration within the kubelet's sync period, without a restart.""",
        [("fanout.yaml", render(["filter", args.fanout])), ("clusters.yaml", render(["clusters", *args.clusters]))],
    )
    xds = configmap(
        "fanout-envoy",
        """Written by tools/k8s-configmaps.py (make k8s-configmaps): envoy/xds/envoy-cluster.yaml,
envoy/xds/sds/*.yaml and envoy/drain.sh as shipped. Edit those, not this. A patch of
deploy/kubernetes/fanout-envoy.yaml (kustomization.yaml beside it).""",
        [
            ("envoy.yaml", read("envoy/xds/envoy-cluster.yaml")),
            ("xds-client.yaml", read("envoy/xds/sds/xds-client.yaml")),
            ("xds-server-ca.yaml", read("envoy/xds/sds/xds-server-ca.yaml")),
            ("drain.sh", read("envoy/drain.sh")),
        ],
    )
    outputs = [
        (os.path.join(args.out, "fanout-envoy.yaml"), envoy),
        (os.path.join(args.out, "fanout-config.yaml"), config),
    ]
    if args.xds_out:
        os.makedirs(args.xds_out, exist_ok=True)
        outputs.append((os.path.join(args.xds_out, "fanout-envoy.yaml"), xds))
    os.makedirs(args.out, exist_ok=True)
    for path, text in outputs:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
