#!/usr/bin/env python3
"""The OpenAPI schema of one version of a CustomResourceDefinition, as JSON.

    tools/crd-schema.py CRD.yaml KIND VERSION > schema.json

Reads every document of CRD.yaml (a generated CRD bundle is fine), picks the CRD whose
spec.names.kind is KIND and its version VERSION, and prints that version's
openAPIV3Schema without its "description" texts (they do not validate anything and make up
most of the bytes). tests/fixtures/schemas/README.md says which files were pinned this way.
"""
import json
import sys

import yaml


def without_descriptions(node):
    if isinstance(node, dict):
        # Under "properties" the keys are field names: a field may be called "description".
        return {
            k: without_descriptions(v) if k != "properties" else {n: without_descriptions(f) for n, f in v.items()}
            for k, v in node.items()
            if k != "description" or not isinstance(v, str)
        }
    if isinstance(node, list):
        return [without_descriptions(v) for v in node]
    return node


def main() -> int:
    if len(sys.argv) != 4:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    path, kind, version = sys.argv[1:]
    with open(path, encoding="utf-8") as f:
        for doc in yaml.safe_load_all(f):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            if doc["spec"]["names"]["kind"] != kind:
                continue
            for v in doc["spec"]["versions"]:
                if v["name"] == version:
                    schema = without_descriptions(v["schema"]["openAPIV3Schema"])
                    json.dump(schema, sys.stdout, sort_keys=True, separators=(",", ":"))
                    sys.stdout.write("\n")
                    return 0
    print(f"{path}: no CRD for kind {kind}, version {version}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
