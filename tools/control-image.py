#!/usr/bin/env python3
"""Writes the fanout-control container image (an OCI image layout directory) from a static
binary, without a container engine.

    tools/control-image.py --binary target/x86_64-unknown-linux-gnu/release/fanout-control \
        --out target/oci/fanout-control --tag 0.1.0 --version 0.1.0 --revision REV \
        --licenses Apache-2.0 [--source https://...]

The image has no base: one layer with the binary at /usr/local/bin/fanout-control and the
/etc/passwd and /etc/group that name its user, `fanout` (65532:65532), which the image runs
as. Nothing else: no shell, no package manager, no CA bundle (fanout-control makes no outgoing
TLS call but to the Kubernetes API, whose CA the service account's mount brings). The binary
must be static (`make image-control` links it with `-C target-feature=+crt-static`).
`skopeo copy oci:DIR:TAG docker://...` pushes it; `docker-daemon:NAME` loads it into Docker.

Reproducible as tools/oci-image.py's image is (its layout writer is the one used here).
"""
import argparse
import importlib.util
import io
import os
import sys
import tarfile

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("oci_image", os.path.join(HERE, "oci-image.py"))
oci = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(oci)

BINARY_PATH = "usr/local/bin/fanout-control"
USER = 65532
PASSWD = f"root:x:0:0:root:/root:/sbin/nologin\nfanout:x:{USER}:{USER}:fanout-control:/nonexistent:/sbin/nologin\n"
GROUP = f"root:x:0:\nfanout:x:{USER}:\n"
PORTS = ("18000/tcp", "18001/tcp")


def layer_tar(binary: bytes) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for d in ("etc", "usr", "usr/local", "usr/local/bin"):
            oci.add_dir(tar, d)
        oci.add_file(tar, "etc/group", GROUP.encode(), 0o644)
        oci.add_file(tar, "etc/passwd", PASSWD.encode(), 0o644)
        oci.add_file(tar, BINARY_PATH, binary, 0o755)
    return out.getvalue()


def is_static_elf(binary: bytes) -> bool:
    """An ELF executable with no program interpreter (PT_INTERP): nothing to load it."""
    if binary[:4] != b"\x7fELF" or binary[4] != 2:  # 64-bit
        return False
    phoff = int.from_bytes(binary[0x20:0x28], "little")
    phentsize = int.from_bytes(binary[0x36:0x38], "little")
    phnum = int.from_bytes(binary[0x38:0x3A], "little")
    for i in range(phnum):
        at = phoff + i * phentsize
        if int.from_bytes(binary[at : at + 4], "little") == 3:  # PT_INTERP
            return False
    return True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--binary", required=True, help="the static fanout-control (x86_64 Linux)")
    oci.image_arguments(p)
    args = p.parse_args()

    with open(args.binary, "rb") as f:
        binary = f.read()
    if not is_static_elf(binary):
        print(f"{args.binary}: not a static 64-bit ELF executable (it names a loader)", file=sys.stderr)
        return 1

    manifest, _ = oci.write_image(
        args.out,
        args.tag,
        layer_tar(binary),
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {
                "User": f"{USER}:{USER}",
                "Entrypoint": ["/" + BINARY_PATH],
                "ExposedPorts": {port: {} for port in PORTS},
                "WorkingDir": "/",
            },
        },
        oci.annotations(
            args,
            "fanout-control",
            "fanout-control: serves fanout's configuration to Envoys over xDS",
        ),
    )
    print(f"image {args.out}:{args.tag} {manifest['digest']} (fanout-control {len(binary)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
