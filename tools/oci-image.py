#!/usr/bin/env python3
"""Writes the fanout OCI image (an OCI image layout directory) from the shipped module.

    tools/oci-image.py --wasm target/wasm32-wasip1/release/fanout.wasm --out target/oci \
        --tag 0.1.0 --version 0.1.0 --revision $(git rev-parse HEAD) --licenses Apache-2.0 \
        [--source https://...]

The image is the "compat" Wasm image variant that Istio's and Envoy Gateway's image fetchers
accept (pkg/wasm/imagefetcher.go in both; spec: solo-io/wasm spec/spec-compat.md): an OCI
manifest whose one layer, application/vnd.oci.image.layer.v1.tar+gzip, is a tar holding one
file, plugin.wasm. `skopeo copy oci:DIR:TAG docker://...` pushes it (`make push`).

Reproducible: the same module and the same annotations give the same bytes, so the same
digests: the tar entry has a fixed mode, owner, name and mtime (0), the gzip header has no
file name and mtime 0, and every JSON document is written with sorted keys and no spaces.
"""
import argparse
import gzip
import hashlib
import io
import json
import os
import sys
import tarfile

LAYER_MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar+gzip"
CONFIG_MEDIA_TYPE = "application/vnd.oci.image.config.v1+json"
MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
# The name Istio and Envoy Gateway look for (by basename) in the image's last layer.
PLUGIN_FILE = "plugin.wasm"


def entry(name: str, mode: int) -> tarfile.TarInfo:
    """A tar entry with nothing of this machine or this moment: owner 0, no names, mtime 0."""
    info = tarfile.TarInfo(name)
    info.mode = mode
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def add_file(tar, name: str, data: bytes, mode: int) -> None:
    info = entry(name, mode)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def add_dir(tar, name: str) -> None:
    info = entry(name, 0o755)
    info.type = tarfile.DIRTYPE
    tar.addfile(info)


def one_file_tar(name: str, data: bytes, mode: int) -> bytes:
    """A layer's tar holding one file, `name`, at its root."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        add_file(tar, name, data, mode)
    return out.getvalue()


def gzipped(data: bytes) -> bytes:
    out = io.BytesIO()
    # filename="" and mtime=0: nothing of this machine or this moment in the header.
    with gzip.GzipFile(filename="", mode="wb", fileobj=out, compresslevel=9, mtime=0) as gz:
        gz.write(data)
    return out.getvalue()


def canonical(doc) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


class Layout:
    def __init__(self, root: str):
        self.root = root
        self.blobs = os.path.join(root, "blobs", "sha256")

    def blob(self, media_type: str, data: bytes, annotations=None) -> dict:
        digest = hashlib.sha256(data).hexdigest()
        os.makedirs(self.blobs, exist_ok=True)
        path = os.path.join(self.blobs, digest)
        with open(path + ".tmp", "wb") as f:
            f.write(data)
        os.replace(path + ".tmp", path)
        desc = {"mediaType": media_type, "digest": "sha256:" + digest, "size": len(data)}
        if annotations:
            desc["annotations"] = annotations
        return desc

    def write(self, name: str, doc) -> None:
        with open(os.path.join(self.root, name), "wb") as f:
            f.write(canonical(doc))


def write_image(out: str, tag: str, tar: bytes, platform: dict, annotations: dict) -> tuple:
    """Replace the OCI layout `out` with one image: the layer `tar` (gzipped), a config of
    `platform` (architecture, os, config) and the manifest's `annotations`; also `out`.digest.
    Returns the manifest's and the layer's descriptors."""
    if os.path.isdir(out):
        for dirpath, _, files in os.walk(out, topdown=False):
            for name in files:
                os.remove(os.path.join(dirpath, name))
            os.rmdir(dirpath)
    os.makedirs(out)
    layout = Layout(out)
    layer = layout.blob(LAYER_MEDIA_TYPE, gzipped(tar))
    # No "created" or "history": they would only be dates.
    config = layout.blob(
        CONFIG_MEDIA_TYPE,
        canonical({**platform, "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(tar).hexdigest()]}}),
    )
    manifest = layout.blob(
        MANIFEST_MEDIA_TYPE,
        canonical(
            {
                "schemaVersion": 2,
                "mediaType": MANIFEST_MEDIA_TYPE,
                "config": config,
                "layers": [layer],
                "annotations": annotations,
            }
        ),
        annotations={"org.opencontainers.image.ref.name": tag},
    )
    layout.write("oci-layout", {"imageLayoutVersion": "1.0.0"})
    layout.write("index.json", {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": [manifest]})
    # Beside the layout (not in it): what `make push` and the tests compare with.
    with open(out.rstrip("/") + ".digest", "w") as f:
        f.write(manifest["digest"] + "\n")
    return manifest, layer


def annotations(args, title: str, description: str) -> dict:
    """The manifest's annotations from the command line's --version, --revision, --licenses
    and --source (left out when empty)."""
    out = {
        "org.opencontainers.image.title": title,
        "org.opencontainers.image.description": description,
        "org.opencontainers.image.version": args.version,
        "org.opencontainers.image.revision": args.revision,
        "org.opencontainers.image.licenses": args.licenses,
    }
    if args.source:
        out["org.opencontainers.image.source"] = args.source
    return out


def image_arguments(p) -> None:
    """The command-line arguments every image tool takes besides its input."""
    p.add_argument("--out", required=True, help="the OCI layout directory (replaced)")
    p.add_argument("--tag", required=True, help="the reference name inside the layout")
    p.add_argument("--version", required=True)
    p.add_argument("--revision", required=True)
    p.add_argument("--licenses", required=True)
    p.add_argument("--source", default="", help="the repository URL (left out when empty)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wasm", required=True, help="the module to ship")
    image_arguments(p)
    args = p.parse_args()

    with open(args.wasm, "rb") as f:
        module = f.read()
    if module[:4] != b"\0asm":
        print(f"{args.wasm}: not a WebAssembly module", file=sys.stderr)
        return 1

    # The OCI platform names for WebAssembly System Interface modules (what `docker build
    # --platform wasip1/wasm` writes).
    manifest, layer = write_image(
        args.out,
        args.tag,
        one_file_tar(PLUGIN_FILE, module, 0o644),
        {"architecture": "wasm", "os": "wasip1", "config": {}},
        annotations(
            args,
            "fanout",
            "fanout: a proxy-wasm HTTP filter for Envoy that fans one event out to every subscriber of a channel",
        ),
    )
    print(f"image {args.out}:{args.tag} {manifest['digest']} (layer {layer['digest']}, plugin.wasm {len(module)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
