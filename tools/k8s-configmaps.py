#!/usr/bin/env python3
"""Writes the two ConfigMaps of deploy/kubernetes/ from the files they carry.

    tools/k8s-configmaps.py RENDERED [--jwks FILE] [--source NAME] [-o DIR]

  DIR/fanout-envoy.yaml   ConfigMap fanout-envoy: envoy.yaml (envoy/configmap/envoy.yaml, the
                          bootstrap) and drain.sh (envoy/drain.sh, the preStop hook), as shipped
  DIR/fanout-config.yaml  ConfigMap fanout-config: what `fanout-control render` wrote into the
                          directory RENDERED, whole and as written: fanout.yaml (ECDS: the
                          filter), clusters.yaml (CDS: the clusters, https ones with their TLS),
                          senders-jwt.yaml and senders-rbac.yaml when render ran with
                          --oidc-issuer; and with --jwks, that file as jwks.json (the issuer's
                          keys, where render's default --jwks expects them)

`make k8s-configmaps` runs render on deploy/kubernetes/channels/ and then this. Python 3, no
packages.
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What render writes for Envoy, in the order the ConfigMap lists them (fanout.json is for
# people to review; Envoy does not read it).
RENDERED = ("fanout.yaml", "clusters.yaml", "senders-jwt.yaml", "senders-rbac.yaml")


def configmap(name, comment, files):
    lines = [f"# {line}".rstrip() for line in comment.strip().splitlines()]
    lines += ["apiVersion: v1", "kind: ConfigMap", "metadata:", f"  name: {name}",
              "  labels: { app: fanout }", "data:"]
    for key, text in files:
        lines.append(f"  {key}: |")
        lines += [f"    {line}".rstrip() for line in text.rstrip("\n").split("\n")]
    return "\n".join(lines) + "\n"


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rendered", help="the directory `fanout-control render --out` wrote")
    parser.add_argument("--jwks", metavar="FILE", help="the OIDC issuer's JWKS, carried as jwks.json")
    parser.add_argument("--source", default="the Knative objects",
                        help="what render read, named in the ConfigMap's comment")
    parser.add_argument("-o", "--out", default=os.path.join(ROOT, "deploy", "kubernetes"))
    args = parser.parse_args()
    files = [(name, read(os.path.join(args.rendered, name)))
             for name in RENDERED if os.path.exists(os.path.join(args.rendered, name))]
    if [name for name, _ in files][:2] != ["fanout.yaml", "clusters.yaml"]:
        print(f"k8s-configmaps: {args.rendered} lacks fanout.yaml or clusters.yaml: run "
              "`fanout-control render --out` into it first", file=sys.stderr)
        return 2
    if args.jwks:
        files.append(("jwks.json", read(args.jwks)))
    envoy = configmap(
        "fanout-envoy",
        """Written by tools/k8s-configmaps.py (make k8s-configmaps): envoy/configmap/envoy.yaml and
envoy/drain.sh as shipped. Edit those, not this.""",
        [("envoy.yaml", read(os.path.join(ROOT, "envoy/configmap/envoy.yaml"))),
         ("drain.sh", read(os.path.join(ROOT, "envoy/drain.sh")))],
    )
    config = configmap(
        "fanout-config",
        f"""Written by tools/k8s-configmaps.py (make k8s-configmaps): what `fanout-control render`
wrote for {args.source}. Replace it (kubectl apply) and every replica takes
the new configuration within the kubelet's sync period, without a restart.""",
        files,
    )
    os.makedirs(args.out, exist_ok=True)
    for name, text in (("fanout-envoy.yaml", envoy), ("fanout-config.yaml", config)):
        with open(os.path.join(args.out, name), "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {os.path.join(args.out, name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
