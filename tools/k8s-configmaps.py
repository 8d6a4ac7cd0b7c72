#!/usr/bin/env python3
"""Writes the two ConfigMaps of deploy/kubernetes/ from the files they carry.

    tools/k8s-configmaps.py FANOUT.json NAME=HOST:PORT ... [-o DIR]

  DIR/fanout-envoy.yaml   ConfigMap fanout-envoy: envoy.yaml (envoy/configmap/envoy.yaml, the
                          bootstrap) and drain.sh (envoy/drain.sh, the preStop hook), as shipped
  DIR/fanout-config.yaml  ConfigMap fanout-config: fanout.yaml (ECDS: the filter with
                          FANOUT.json) and clusters.yaml (CDS: the clusters NAME=HOST:PORT), as
                          envoy/render-ecds.py writes them

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
    os.makedirs(args.out, exist_ok=True)
    for name, text in (("fanout-envoy.yaml", envoy), ("fanout-config.yaml", config)):
        with open(os.path.join(args.out, name), "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {os.path.join(args.out, name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
