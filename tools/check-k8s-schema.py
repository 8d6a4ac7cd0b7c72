#!/usr/bin/env python3
"""Checks Kubernetes objects against their CRDs' OpenAPI schemas, strictly.

    tools/check-k8s-schema.py SCHEMA_DIR < objects.json

stdin: a JSON list of {"what": <name for messages>, "schema": <file in SCHEMA_DIR>,
"object": <the object>}. Each object is validated with the `jsonschema` package against its
schema (tools/crd-schema.py wrote them), made strict the way `kubectl apply
--validate=strict` is: an object schema that lists its properties and does not say
`x-kubernetes-preserve-unknown-fields` refuses any other field, so a misspelt field fails
instead of being pruned. `metadata` is left to Kubernetes (the CRD schemas do not describe
it). CEL rules (`x-kubernetes-validations`) are not evaluated. Prints every error with its
path; exits 1 if there was one.
"""
import json
import os
import sys

import jsonschema


def strict(node):
    if isinstance(node, dict):
        out = {k: strict(v) if k != "properties" else {n: strict(f) for n, f in v.items()} for k, v in node.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [strict(v) for v in node]
    return node


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    errors = 0
    for item in json.load(sys.stdin):
        with open(os.path.join(sys.argv[1], item["schema"]), encoding="utf-8") as f:
            schema = strict(json.load(f))
        schema.setdefault("properties", {})["metadata"] = {"type": "object"}
        for key in ("apiVersion", "kind"):
            schema["properties"].setdefault(key, {"type": "string"})
        validator = jsonschema.Draft4Validator(schema)
        for error in sorted(validator.iter_errors(item["object"]), key=lambda e: list(e.path)):
            path = ".".join(str(p) for p in error.absolute_path) or "(root)"
            print(f"{item['what']}: {path}: {error.message}")
            errors += 1
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
