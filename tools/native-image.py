#!/usr/bin/env python3
"""Writes the image of fanout's native build (an OCI image layout directory) from the library,
without a container engine.

    tools/native-image.py --library target/native/libfanout.so --out target/oci/fanout-native \
        --tag 0.2.0 --version 0.2.0 --revision REV --licenses Apache-2.0 [--source https://...]

The image is not run: a pod mounts it (a Kubernetes image volume), and the Envoy container
finds the library there by its name (`ENVOY_DYNAMIC_MODULES_SEARCH_PATH` set to the mount,
`dynamic_module_config.name: fanout`). So it has no base and no entrypoint: one layer holding
one file at its root, `libfanout.so`, and a linux/amd64 config. `skopeo copy oci:DIR:TAG
docker://...` pushes it (`make push-native`).

Reproducible as tools/oci-image.py's image is (its layout writer is the one used here).
"""
import argparse
import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("oci_image", os.path.join(HERE, "oci-image.py"))
oci = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(oci)

# The name Envoy looks for in its search path for `dynamic_module_config.name: fanout`.
LIBRARY_FILE = "libfanout.so"


def is_x86_64_shared_object(library: bytes) -> bool:
    """A 64-bit little-endian ELF shared object (e_type ET_DYN) for x86-64 (e_machine 62)."""
    return (
        library[:4] == b"\x7fELF"
        and library[4:6] == b"\x02\x01"
        and int.from_bytes(library[0x10:0x12], "little") == 3
        and int.from_bytes(library[0x12:0x14], "little") == 62
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--library", required=True, help="the native build (x86-64 Linux)")
    oci.image_arguments(p)
    args = p.parse_args()

    with open(args.library, "rb") as f:
        library = f.read()
    if not is_x86_64_shared_object(library):
        print(f"{args.library}: not an x86-64 ELF shared object", file=sys.stderr)
        return 1

    manifest, layer = oci.write_image(
        args.out,
        args.tag,
        oci.one_file_tar(LIBRARY_FILE, library, 0o755),
        {"architecture": "amd64", "os": "linux", "config": {}},
        oci.annotations(
            args,
            "fanout-native",
            "fanout's native build: an Envoy dynamic module that fans one event out to every "
            "subscriber of a channel, for a pod to mount",
        ),
    )
    print(
        f"image {args.out}:{args.tag} {manifest['digest']} "
        f"(layer {layer['digest']}, {LIBRARY_FILE} {len(library)} bytes)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
