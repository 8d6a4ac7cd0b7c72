#!/usr/bin/env python3
"""The module's own instructions per request, per subscriber and by function, in wasm32: the
core's probe (`tests::delivery::callgrind_probe_sync_fan_outs_to_four`: sync fan-outs on the
fake host, every call answered 200) built for wasm32-wasip1, compiled by wasmtime (Cranelift),
run under valgrind's callgrind, and the JIT code's instructions named by wasmtime's perf map.
Deterministic (one thread, no clock, no Envoy), so a change of a few dozen instructions per
call shows; what Envoy adds around each call does not (bench/callgrind.py, bench/hostcalls).

    make bench-wasm                              # this checkout
    make bench-wasm BEFORE=../fanout-before      # and the difference with another checkout
    .venv/<envoy>/bin/python bench/wasm_probe.py --subscribers 1,16 --top 30 --before DIR

Each subscriber count runs twice, at --requests and three times as many, and the difference
over the extra requests is one request (the start-up cancels out). Per subscriber: the slope
between the smallest and the largest count. Figures include the fake host's own work (the same
in both checkouts). Needs valgrind and the `wasmtime` Python package (`make bench-wasm`
installs it). --before needs the probe in that checkout's tree (it is in every commit since
the pipeline's; for an older one, copy the test into its src/tests/delivery.rs).
"""
import sys
sys.dont_write_bytecode = True  # no __pycache__ in bench/

import argparse
import bisect
import collections
import json
import os
import re
import shutil
import subprocess
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from callgrind import self_costs  # noqa: E402  (the one reader of callgrind files)

PROBE = "tests::delivery::callgrind_probe_sync_fan_outs_to_four"
TARGET_DIR = "target/wasm-probe"


def build(tree):
    """The wasm32 test binary of `tree`'s core, with its function names."""
    env = dict(os.environ, CARGO_PROFILE_RELEASE_STRIP="false")
    out = subprocess.run(
        ["cargo", "test", "--release", "--lib", "--no-default-features",
         "--target", "wasm32-wasip1", "--target-dir", TARGET_DIR, "--no-run",
         "--message-format=json"],
        cwd=tree, env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
    for line in out.splitlines():
        msg = json.loads(line)
        if msg.get("reason") == "compiler-artifact" and msg.get("executable") \
                and msg["target"]["name"] == "fanout":
            return msg["executable"]
    sys.exit(f"wasm_probe: no test binary built in {tree}")


def engine():
    import wasmtime
    config = wasmtime.Config()
    config.profiler = "perfmap"
    # The code is compiled for x86-64 with the features valgrind runs (up to AVX2), not for
    # the host's own: code using a host's AVX-512 would not load inside valgrind, and the
    # figures are the same on every machine.
    config.target = "x86_64-unknown-linux-gnu"
    for flag in X86_FLAGS:
        config.cranelift_flag_enable(flag)
    return wasmtime.Engine(config)


X86_FLAGS = ("has_sse3", "has_ssse3", "has_sse41", "has_sse42", "has_popcnt", "has_avx",
             "has_avx2", "has_bmi1", "has_bmi2", "has_lzcnt", "has_fma")


def precompile(wasm):
    import wasmtime
    from importlib.metadata import version
    cwasm = f"{wasm}.wasmtime-{version('wasmtime')}.cwasm"
    if os.path.exists(cwasm) and os.path.getmtime(cwasm) > os.path.getmtime(wasm):
        return cwasm
    with open(cwasm, "wb") as f:
        f.write(wasmtime.Module.from_file(engine(), wasm).serialize())
    return cwasm


def run_probe(cwasm, requests, subscribers):
    """Inside valgrind: the probe, from the precompiled module (nothing compiled here)."""
    import wasmtime
    eng = engine()
    store = wasmtime.Store(eng)
    wasi = wasmtime.WasiConfig()
    wasi.argv = ["probe", "--ignored", "--exact", PROBE]
    wasi.env = [("FANOUT_PROBE_N", str(requests)),
                ("FANOUT_PROBE_SUBSCRIBERS", str(subscribers))]
    wasi.inherit_stdout()
    wasi.inherit_stderr()
    store.set_wasi(wasi)
    linker = wasmtime.Linker(eng)
    linker.define_wasi()
    instance = linker.instantiate(store, wasmtime.Module.deserialize_file(eng, cwasm))
    try:
        instance.exports(store)["_start"](store)
    except wasmtime.ExitTrap as e:
        sys.exit(e.code)


def callgrind(cwasm, requests, subscribers, workdir):
    """Self instructions by (object, function) of one run, and the run's perf map."""
    out = subprocess.run(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={workdir}/cg.%p",
         sys.executable, os.path.abspath(__file__), "--run", cwasm, str(requests),
         str(subscribers)],
        env=dict(os.environ, PYTHONHASHSEED="0"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if out.returncode != 0 or "1 passed" not in out.stdout:
        sys.exit(f"wasm_probe: the probe failed:\n{out.stdout[-3000:]}")
    [name] = [n for n in os.listdir(workdir) if n.startswith("cg.")]
    path = os.path.join(workdir, name)
    pid = name.split(".")[1]
    costs = self_costs(path)
    os.remove(path)
    perf_map = f"/tmp/perf-{pid}.map"
    named = by_function(costs, read_map(perf_map))
    os.remove(perf_map)
    return named


def read_map(path):
    entries = []
    with open(path) as f:
        for line in f:
            start, size, name = line.rstrip("\n").split(" ", 2)
            entries.append((int(start, 16), int(size, 16), name))
    entries.sort()
    return entries


def by_function(costs, entries):
    """JIT code (callgrind's `???` object, named by address) named from the perf map; the
    rest by its symbol and library (libc's memcpy, wasmtime's libcalls)."""
    starts = [e[0] for e in entries]
    named = collections.Counter()
    for (obj, fn), cost in costs.items():
        if obj == "???" and fn.startswith("0x"):
            address = int(fn.split("'")[0], 16)
            i = bisect.bisect_right(starts, address) - 1
            if i >= 0 and address < entries[i][0] + entries[i][1]:
                name = entries[i][2]
            else:
                name = "(JIT code not in the map)"
        elif "python" in os.path.basename(obj or ""):
            # The interpreter's own start-up: not the probe's.
            continue
        else:
            name = f"{fn} [{os.path.basename(obj or '?')}]"
        named[short(name)] += cost
    return named


def short(name):
    name = re.sub(r"::h[0-9a-f]{16}$", "", name)
    return re.sub(r"\[[0-9a-f]{16}\]", "", name)


def measure(tree, counts, requests, workdir):
    """Per subscriber count: instructions per request, by function."""
    print(f"building {tree} ...", file=sys.stderr)
    cwasm = precompile(build(tree))
    result = {}
    for n in counts:
        print(f"  {n} subscriber(s) ...", file=sys.stderr)
        low = callgrind(cwasm, requests, n, workdir)
        high = callgrind(cwasm, 3 * requests, n, workdir)
        result[n] = {k: (high[k] - low[k]) / (2 * requests) for k in set(low) | set(high)}
    return result


def report(label, result):
    counts = sorted(result)
    totals = {n: sum(result[n].values()) for n in counts}
    print(f"\n{label}: instructions per request")
    for n in counts:
        print(f"  {n:>3} subscriber(s): {totals[n]:>10,.0f}")
    if len(counts) > 1:
        lo, hi = counts[0], counts[-1]
        print(f"  per subscriber: {(totals[hi] - totals[lo]) / (hi - lo):,.0f}")
    return totals


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--subscribers", default="1,4,16", help="counts, comma-separated")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--top", type=int, default=25, help="functions listed")
    p.add_argument("--before", metavar="DIR", help="another checkout to compare with")
    p.add_argument("--run", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.run:
        cwasm, requests, subscribers = args.run
        return run_probe(cwasm, int(requests), int(subscribers))
    if not shutil.which("valgrind"):
        sys.exit("wasm_probe: valgrind is needed (apt-get install valgrind)")
    try:
        import wasmtime  # noqa: F401
    except ImportError:
        sys.exit("wasm_probe: the wasmtime Python package is needed (make bench-wasm)")
    counts = sorted({int(c) for c in args.subscribers.split(",")})
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as workdir:
        after = measure(here, counts, args.requests, workdir)
        before = measure(os.path.abspath(args.before), counts, args.requests, workdir) \
            if args.before else None
    top = max(counts)
    if before is None:
        report("this checkout", after)
        print(f"\nby function, {top} subscriber(s), instructions per request:")
        for name, cost in sorted(after[top].items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"  {cost:>9,.0f}  {name[:110]}")
        return
    old = report(f"before ({args.before})", before)
    new = report("this checkout", after)
    print("\nchange: " + ", ".join(
        f"{n} subscriber(s) {new[n] - old[n]:+,.0f} ({(new[n] - old[n]) / old[n]:+.1%})"
        for n in counts))
    print(f"\nby function, {top} subscriber(s), instructions per request "
          "(before, after, change; largest changes first):")
    names = set(before[top]) | set(after[top])
    changes = [k for k in names if abs(after[top].get(k, 0) - before[top].get(k, 0)) >= 1]
    changes.sort(key=lambda k: -abs(after[top].get(k, 0) - before[top].get(k, 0)))
    for name in changes[:args.top]:
        b, a = before[top].get(name, 0), after[top].get(name, 0)
        print(f"  {b:>9,.0f} {a:>9,.0f} {a - b:>+8,.0f}  {name[:100]}")


if __name__ == "__main__":
    main()
