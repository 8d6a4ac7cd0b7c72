#!/usr/bin/env python3
"""Envoy instructions per request, counted by valgrind's callgrind: repeatable where CPU time
is not (a shared machine), and split by where they run (Envoy's own code, the wasm code V8
compiled, libc).

    python3 bench/callgrind.py floor/0 floor+clock+headers/0 fanout-nometrics/0 fanout/0
    python3 bench/callgrind.py --requests 300 floor/4 fanout/4
    python3 bench/callgrind.py proxy/1 native/0 native/1 native/4 fanout/1
    python3 bench/callgrind.py --before-native /tmp/before/libfanout.so native@before/4 native/4

Each key is a configuration of `make bench`'s throughput phase (bench/run.py
throughput_specs; `fanout@<build>/N` builds fanout another way first). For each: one Envoy
(`--concurrency 1`) under `valgrind --tool=callgrind --smc-check=all-non-file` (V8 writes
code), 300 warm-up requests, counters zeroed, then --requests requests one after another on
one keep-alive connection, counters dumped. Subscribers (N > 0): the bench's subscriber Envoy,
not under valgrind. About a minute per configuration. `native@before/N`: the native build with
`--before-native`'s library (e.g. built from the commit before a change) in place of
target/native/libfanout.so, measured in the same run. The raw callgrind files stay in
bench/tmp/callgrind/ (`callgrind_annotate` reads them; a library built with symbols names its
functions: `CARGO_PROFILE_RELEASE_STRIP=none`).
"""

import sys
sys.dont_write_bytecode = True  # no __pycache__ in bench/
import argparse
import atexit
import collections
import glob
import http.client
import json
import os
import re
import shutil
import subprocess
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
import envoy_configs as cfg  # noqa: E402
import run  # noqa: E402

WARMUP = 300
# `--before-native SO`: the library of the `native@before/N` configurations.
BEFORE_NATIVE = None
BODY = (b'{"specversion":"1.0","type":"dev.fanout.bench","source":"/bench","id":"1",'
        b'"data":{"order":42}}')
HEADERS = {"content-type": "application/json", "ce-specversion": "1.0",
           "ce-type": "dev.fanout.bench", "ce-source": "/bench", "ce-id": "callgrind"}


def self_costs(path):
    """Instructions by (ELF object, function) from a callgrind output file (JIT code: object
    `???`, function named by its address). Names are given once as `ob=(id) name` or
    `fn=(id) name` (also in `cob=`/`cfn=` lines) and then by id; every cost line counts for
    the current function, except the inclusive cost after `calls=`."""
    names = {"ob": {}, "fn": {}}
    costs = collections.Counter()
    obj = fn = None
    after_calls = False
    line_re = re.compile(r"^(c?)(ob|fn)=\((\d+)\)(?: (.*))?$")
    with open(path) as f:
        for line in f:
            m = line_re.match(line.rstrip("\n"))
            if m:
                called, kind, ident, name = m.groups()
                if name is not None:
                    names[kind][ident] = name
                if not called:
                    if kind == "ob":
                        obj = names["ob"].get(ident, "?")
                    else:
                        fn = names["fn"].get(ident, "?")
                continue
            if line.startswith("calls="):
                after_calls = True
                continue
            if line[:1].isdigit() or line[:1] in "+-*":
                if after_calls:
                    after_calls = False
                    continue
                parts = line.split()
                if len(parts) >= 2:
                    costs[(obj, fn)] += int(parts[1])
    return costs


def where(obj):
    if obj == "???":
        return "jit"
    if "libc.so" in obj:
        return "libc"
    if os.path.basename(obj).startswith("libfanout"):
        return "native"
    if os.path.basename(obj) == "envoy" or "envoy-" in os.path.basename(obj):
        return "envoy"
    return "other"


def measure(spec, requests, ports, sub_port, builds, workdir):
    key, kind, n, extra = spec
    port, admin = ports.take(), ports.take()
    extra = dict(extra)
    if "etcd" in extra:
        # The etcd store: its etcd (not under valgrind), started on first use.
        extra["etcd_port"] = run.etcd_for(extra.pop("etcd"), ports).client_port
    modules = run.modules(builds)
    if BEFORE_NATIVE:
        modules["native-before"] = BEFORE_NATIVE
    conf = cfg.system(kind, n, port, admin, sub_port, modules, **extra)
    name = run.file_name(key)
    e = run.Envoy(name, conf, admin, port, workdir)
    path = os.path.join(workdir, f"{name}.yaml")
    with open(path, "w") as f:
        json.dump(conf, f)
    out = os.path.join(workdir, f"{name}.callgrind")
    for old in glob.glob(out + "*"):
        os.remove(old)
    e.proc = run.spawn(["valgrind", "--tool=callgrind", "--smc-check=all-non-file",
                        f"--callgrind-out-file={out}", run.ENVOY, "-c", path, "--concurrency", "1",
                        "--disable-hot-restart", "-l", "warning"],
                       os.path.join(workdir, f"{name}.log"))
    try:
        e.wait_ready(time.monotonic() + 600, poll=0.5)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)

        sent = [0]

        def send(count):
            for _ in range(count):
                headers = HEADERS
                if key.startswith("fanout-dedupe"):
                    # A new event each time (dedupe would skip every repeat).
                    sent[0] += 1
                    headers = dict(HEADERS, **{"ce-id": f"callgrind-{time.time_ns()}-{sent[0]}"})
                conn.request("POST", "/", body=BODY, headers=headers)
                resp = conn.getresponse()
                resp.read()
                if resp.status != run.EXPECT[kind]:
                    raise RuntimeError(f"{key}: answered {resp.status}")
        send(WARMUP)
        subprocess.run(["callgrind_control", "-z", str(e.pid)], check=True, capture_output=True)
        send(requests)
        subprocess.run(["callgrind_control", "-d", str(e.pid)], check=True, capture_output=True)
        conn.close()
    finally:
        run.stop(e.proc)
    dumps = sorted(f for f in glob.glob(out + ".*") if re.search(r"\.\d+$", f))
    if not dumps:
        raise RuntimeError(f"{key}: no callgrind dump in {workdir}")
    split = collections.Counter()
    for (obj, _), c in self_costs(dumps[0]).items():
        split[where(obj or "")] += c
    return {k: v / requests for k, v in split.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("keys", nargs="+", help="configurations, e.g. floor/0 fanout/0")
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--before", metavar="WASM", help="the module of the `<dedupe key>@before` "
                   "configurations (as bench/run.py --before)")
    p.add_argument("--before-native", metavar="SO", help="the native library of the "
                   "`native@before/N` configurations")
    p.add_argument("--port-base", type=int, default=int(os.environ.get("BENCH_PORT_BASE", 24000)))
    args = p.parse_args()
    if not shutil.which("valgrind") or not shutil.which("callgrind_control"):
        sys.exit("callgrind: valgrind is needed (apt-get install valgrind)")
    builds = sorted({m.group(1) for k in args.keys for m in [re.match(r"fanout@([^/]+)/", k)] if m})
    run.BEFORE_WASM = os.path.abspath(args.before) if args.before else None
    specs = {s[0]: s for s in run.with_before(run.throughput_specs(builds))}
    if args.before_native:
        global BEFORE_NATIVE
        BEFORE_NATIVE = os.path.abspath(args.before_native)
        natives = [n for _, kind, n, _ in specs.values() if kind == "native"]
        specs.update({f"native@before/{n}": (f"native@before/{n}", "native", n, {"build": "before"})
                      for n in natives})
    unknown = [k for k in args.keys if k not in specs]
    if unknown:
        sys.exit(f"unknown configurations {unknown}; known: {', '.join(specs)}")
    atexit.register(run.stop_all)
    run.build(True, True, builds)
    workdir = os.path.join(BENCH, "tmp", "callgrind")
    os.makedirs(workdir, exist_ok=True)
    run.RUN_DIR = workdir
    ports = run.Ports(args.port_base)
    sub_admin, fast, slow, hold = ports.take(), ports.take(), ports.take(), ports.take()
    sub = run.Envoy("subscriber", cfg.subscriber(sub_admin, fast, slow, hold, 20, 4000), sub_admin,
                    fast, workdir).start()
    sub.wait_ready(time.monotonic() + 60)
    rows = []
    for key in args.keys:
        run.log(f"callgrind: {key} ({args.requests} requests)")
        split = measure(specs[key], args.requests, ports, fast, builds, workdir)
        rows.append((key, split))
    run.stop_all()
    base = sum(rows[0][1].values())
    # `???`: code valgrind finds in no ELF object: V8's compiled wasm, and (in every row)
    # some of Envoy's own.
    print(f"\n| configuration | instructions per request | Envoy | wasm (JIT) and unnamed "
          f"| native module | libc | vs {rows[0][0]} |")
    print("|---|---|---|---|---|---|---|")
    for key, split in rows:
        total = sum(split.values())
        print(f"| {key} | {total:,.0f} | {split.get('envoy', 0):,.0f} | {split.get('jit', 0):,.0f} "
              f"| {split.get('native', 0):,.0f} | {split.get('libc', 0):,.0f} "
              f"| {total / base:.3f}x |")


if __name__ == "__main__":
    main()
