"""Turns bench/run.py's measurements into derived figures, a markdown report and an SVG
chart (written by hand: no plotting library needed)."""

import math
import statistics

NS = [1, 4, 16, 64]
FLOOR_NS = [0, 1, 4, 16, 64]
PAIRED_NS = [0, 4, 16]
# Targets of issue 18, against the floor of a wasm fan-out (bench/floor-filter).
FIXED_LIMIT = 1.10
SLOPE_LIMIT = 1.05
SIZE_LIMIT_KIB = 300
# Targets of issue 23: the etcd dedupe store at N = 4 (etcd's data on tmpfs: fanout's cost).
DEDUPE_OFF, DEDUPE_ENVOY = "fanout/4", "fanout-dedupe/4"
DEDUPE_ETCD, DEDUPE_ETCD_DISK = "fanout-dedupe-etcd/4", "fanout-dedupe-etcd-disk/4"
ETCD_RTT_LIMIT = 2.0
ETCD_P50_LIMIT_MS = 1.0
ETCD_CPU_LIMIT = 1.15


def _get(rows, key, field):
    row = (rows or {}).get(key)
    return None if row is None else row.get(field)


def _ratio(a, b):
    return None if a is None or b in (None, 0) else a / b


def _rounds(rows, key):
    """Every round's CPU per request of one configuration (older results: just the median)."""
    row = (rows or {}).get(key)
    if row is None:
        return None
    return row.get("cpu_rounds") or [row["cpu_us_per_req"]]


def _spread(values):
    """median, min, max; None when there is nothing."""
    values = [v for v in values or [] if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "rounds": len(values)}


def _paired(rows, a, b, combine):
    """combine(a_round, b_round) for each round both configurations ran: pairs measured seconds
    apart, so the machine's drift between rounds cancels."""
    ra, rb = _rounds(rows, a), _rounds(rows, b)
    if ra is None or rb is None:
        return None
    return _spread([combine(x, y) for x, y in zip(ra, rb)])


def _slopes(rows, kind, n):
    """Per round: (CPU at N - CPU at N=1) / (N - 1), the cost of each subscriber past the first."""
    hi, lo = _rounds(rows, f"{kind}/{n}"), _rounds(rows, f"{kind}/1")
    if hi is None or lo is None:
        return None
    return [(h - l) / (n - 1) for h, l in zip(hi, lo)]


def _verdict(spread, limit):
    """met / not met by the median, and whether every round agrees (the spread clears the
    limit) or the rounds straddle it (noise is as large as the gap)."""
    if spread is None:
        return None
    met = spread["median"] <= limit
    if spread["rounds"] == 1:
        how = "one round"
    elif spread["max"] <= limit or spread["min"] > limit:
        how = "every round"
    else:
        how = "rounds straddle the limit"
    return {"met": met, "how": how}


def _verdict_how(spread, limit):
    verdict = _verdict(spread, limit)
    return None if verdict is None else verdict["how"]


def floor_comparison(tp):
    """fanout against the floor at every N: CPU per request, and per extra subscriber."""
    out = {"per_n": {}, "slope": {}}
    for n in FLOOR_NS:
        f, fl = f"fanout/{n}", f"floor/{n}"
        if f not in tp or fl not in tp:
            continue
        ratio = _paired(tp, f, fl, lambda a, b: a / b if b else None)
        out["per_n"][n] = {"fanout": _spread(_rounds(tp, f)), "floor": _spread(_rounds(tp, fl)),
                           "ratio": ratio, "gap_us": _paired(tp, f, fl, lambda a, b: a - b)}
    for n in NS[1:]:
        sf, sl = _slopes(tp, "fanout", n), _slopes(tp, "floor", n)
        if sf is None or sl is None:
            continue
        out["slope"][n] = {"fanout": _spread(sf), "floor": _spread(sl),
                           "ratio": _spread([a / b if b else None for a, b in zip(sf, sl)])}
    fixed = (out["per_n"].get(0) or {}).get("ratio")
    out["fixed_verdict"] = _verdict(fixed, FIXED_LIMIT)
    out["slope_verdict"] = {n: _verdict(v["ratio"], SLOPE_LIMIT) for n, v in out["slope"].items()}
    return out


def metrics_cost(tp):
    """Metrics on minus off, paired per round: per request at N = 0, and per call (the growth
    of that difference with N)."""
    out = {"per_n": {}}
    for n in PAIRED_NS:
        on, off = f"fanout/{n}", f"fanout-nometrics/{n}"
        if on in tp and off in tp:
            out["per_n"][n] = _paired(tp, on, off, lambda a, b: a - b)
    on0, off0 = _rounds(tp, "fanout/0"), _rounds(tp, "fanout-nometrics/0")
    for n in PAIRED_NS[1:]:
        on, off = _rounds(tp, f"fanout/{n}"), _rounds(tp, f"fanout-nometrics/{n}")
        if None in (on, off, on0, off0):
            continue
        out.setdefault("per_call", {})[n] = _spread(
            [((a - b) - (c - d)) / n for a, b, c, d in zip(on, off, on0, off0)])
    return out


def builds_cost(results):
    """Each other build of fanout against the shipped one, paired per round."""
    tp = results.get("throughput") or {}
    out = {}
    for build in ((results.get("wasm") or {}).get("builds") or {}):
        out[build] = {n: _paired(tp, f"fanout@{build}/{n}", f"fanout/{n}",
                                 lambda a, b: a / b if b else None)
                      for n in PAIRED_NS if f"fanout@{build}/{n}" in tp}
    return out


def dedupe_stores(results):
    """The dedupe stores at N = 4: dedupe off, the envoy store, the etcd store (etcd on tmpfs
    and on disk). Envoy CPU per request (throughput phase), the ratio to the envoy store per
    round, etcd calls and etcd CPU per event, and the sender's p50/p99 (latency phase) with
    what each adds to the envoy store's p50, per round."""
    tp = results.get("throughput") or {}
    lat = results.get("latency") or {}
    out = {}
    keys = [DEDUPE_OFF, DEDUPE_ENVOY, DEDUPE_ETCD, DEDUPE_ETCD_DISK]
    # `run.py --before WASM`: the same rows with another build, paired with its own envoy store.
    keys += [_before(k) for k in keys[1:]]
    for key in keys:
        if key not in tp and key not in lat:
            continue
        envoy = _before(DEDUPE_ENVOY) if key.endswith("@before/4") else DEDUPE_ENVOY
        row = {"cpu": _spread(_rounds(tp, key)), "rps": _get(tp, key, "rps"),
               "etcd_rq_per_req": _get(tp, key, "etcd_rq_per_req"),
               "etcd_cpu_us_per_req": _get(tp, key, "etcd_cpu_us_per_req"),
               "store_errors": (_get(tp, key, "store_errors") or 0)
               + (_get(lat, key, "store_errors") or 0),
               "p50_ms": _get(lat, key, "p50_ms"), "p99_ms": _get(lat, key, "p99_ms"),
               "lat_etcd_rq_per_req": _get(lat, key, "etcd_rq_per_req"),
               "lat_cpu_us_per_req": _get(lat, key, "cpu_us_per_req")}
        if key != envoy:
            row["cpu_over_envoy"] = _paired(tp, key, envoy, lambda a, b: a / b if b else None)
            pa, pb = ((lat.get(key) or {}).get("p50_rounds"),
                      (lat.get(envoy) or {}).get("p50_rounds"))
            row["p50_over_envoy_ms"] = (None if not pa or not pb else
                                        _spread([a - b for a, b in zip(pa, pb)]))
        equal = (tp.get(key) or {}).get("equal_rate")
        if equal:
            # The same two at one offered load (bench/run.py equal_rate).
            rows = equal["rows"]
            row["equal_rate"] = {
                "rate": equal["rate"],
                "rps": _get(rows, key, "rps"), "envoy_rps": _get(rows, envoy, "rps"),
                "cpu": _spread(_rounds(rows, key)), "envoy_cpu": _spread(_rounds(rows, envoy)),
                "cpu_over_envoy": _paired(rows, key, envoy, lambda a, b: a / b if b else None),
                "store_errors": _get(rows, key, "store_errors") or 0}
        out[key] = row
    return out


def _before(key):
    name, _, tail = key.partition("/")
    return f"{name}@before/{tail}"


def startup_summary(startup):
    """Per system: ready time and RSS at --concurrency 1 and 4, and RSS per extra worker."""
    out = {}
    for key, row in (startup or {}).items():
        out.setdefault(row["system"], {})[f"c{row['concurrency']}"] = row
    for name, by in out.items():
        if "c1" in by and "c4" in by:
            by["rss_per_worker_mb"] = (by["c4"]["rss_mb"] - by["c1"]["rss_mb"]) / 3
    return out


def derive(results):
    tp = results.get("throughput") or {}
    lat = results.get("latency") or {}
    d = {"per_n": {}, "per_extra_subscriber": {}, "targets": [], "context_targets": []}
    d["floor"] = floor_comparison(tp)
    d["metrics_cost"] = metrics_cost(tp)
    d["builds"] = builds_cost(results)
    d["startup"] = startup_summary(results.get("startup"))
    d["dedupe_stores"] = dedupe_stores(results)
    for n in NS:
        f, m = f"fanout/{n}", f"mirror/{n}"
        d["per_n"][n] = {
            "rps_fanout_over_mirror": _ratio(_get(tp, f, "rps"), _get(tp, m, "rps")),
            "rps_fanout_over_proxy": _ratio(_get(tp, f, "rps"), _get(tp, "proxy/1", "rps")),
            "rps_fanout_over_lua": _ratio(_get(tp, f, "rps"), _get(tp, f"lua/{n}", "rps")),
            "p99_fanout_over_mirror": _ratio(_get(tp, f, "p99_ms"), _get(tp, m, "p99_ms")),
            "cpu_fanout_over_mirror": _ratio(_get(tp, f, "cpu_us_per_req"),
                                             _get(tp, m, "cpu_us_per_req")),
        }
    for n in NS[1:]:
        row = {}
        for kind in ("fanout", "mirror", "lua"):
            hi, lo = _get(tp, f"{kind}/{n}", "cpu_us_per_req"), _get(tp, f"{kind}/1", "cpu_us_per_req")
            row[kind] = None if hi is None or lo is None else (hi - lo) / (n - 1)
        row["fanout_over_mirror"] = _ratio(row["fanout"], row["mirror"])
        d["per_extra_subscriber"][n] = row
    fixed = _get(tp, "fanout/0", "cpu_us_per_req")
    noop = _get(tp, "noop/0", "cpu_us_per_req")
    d["fixed"] = {"fanout0": fixed, "fanout0_nometrics": _get(tp, "fanout-nometrics/0", "cpu_us_per_req"),
                  "noop": noop, "baseline": _get(tp, "baseline/0", "cpu_us_per_req"),
                  "fanout0_over_noop": _ratio(fixed, noop)}
    slowest = _get(lat, "proxy/1", "p50_ms")
    d["latency_excess_ms"] = {
        kind: {n: (None if _get(lat, f"{kind}/{n}", "p50_ms") is None or slowest is None
                   else _get(lat, f"{kind}/{n}", "p50_ms") - slowest) for n in NS}
        for kind in ("fanout", "mirror")}
    d["latency_64_excess_ms"] = (None if _get(lat, "fanout/64", "p50_ms") is None or slowest is None
                                 else _get(lat, "fanout/64", "p50_ms") - slowest)

    def target(name, value, limit, ok, fmt="{:.3f}", table="context_targets", how=None):
        d[table].append({"target": name, "limit": limit,
                         "value": None if value is None else fmt.format(value),
                         "met": None if value is None else bool(ok(value)), "how": how})

    def floor_target(name, spread, limit, verdict):
        value = None if spread is None else spread["median"]
        fmt = "{:.3f}" if spread is None or spread["rounds"] == 1 else \
            "{:.3f}" + f" ({spread['min']:.3f}–{spread['max']:.3f})"
        target(name, value, f"<= {limit:.2f}x", lambda v: v <= limit, fmt, "targets",
               None if verdict is None else verdict["how"])

    fl = d["floor"]
    floor_target("fixed cost: fanout / floor, CPU per request at N=0 (median of the per-round "
                 "ratios, min–max)", (fl["per_n"].get(0) or {}).get("ratio"), FIXED_LIMIT,
                 fl["fixed_verdict"])
    for n in NS[1:]:
        floor_target(f"per extra subscriber: fanout / floor at N={n}",
                     (fl["slope"].get(n) or {}).get("ratio"), SLOPE_LIMIT,
                     fl["slope_verdict"].get(n))
    etcd = d["dedupe_stores"].get(DEDUPE_ETCD) or {}
    if etcd:
        target("etcd store: etcd round trips per event (Envoy's `cluster.etcd.upstream_rq_total` "
               "over the requests, throughput phase, N=4)", etcd.get("etcd_rq_per_req"),
               f"<= {ETCD_RTT_LIMIT:.0f}", lambda v: v <= ETCD_RTT_LIMIT, "{:.2f}", "targets")
        spread = etcd.get("p50_over_envoy_ms")
        target("etcd store (etcd on tmpfs): p50 of the sender's answer minus the envoy store's, "
               "20 ms subscribers, N=4 (ms, per round)",
               None if spread is None else spread["median"], f"<= {ETCD_P50_LIMIT_MS:.0f} ms",
               lambda v: v <= ETCD_P50_LIMIT_MS, "{:+.2f} ms", "targets",
               _verdict_how(spread, ETCD_P50_LIMIT_MS))
        spread = etcd.get("cpu_over_envoy")
        target("etcd store: Envoy CPU per request / the envoy store's, N=4 (per round)",
               None if spread is None else spread["median"], f"<= {ETCD_CPU_LIMIT:.2f}x",
               lambda v: v <= ETCD_CPU_LIMIT, "{:.2f}x", "targets",
               _verdict_how(spread, ETCD_CPU_LIMIT))
    size = (results.get("wasm") or {}).get("fanout_bytes")
    target("fanout.wasm size", None if size is None else size / 1024, f"<= {SIZE_LIMIT_KIB} KiB",
           lambda v: v <= SIZE_LIMIT_KIB, "{:.1f} KiB", "targets")

    for n in NS[1:]:
        target(f"Envoy CPU per extra subscriber, fanout / mirror shadow, N={n}",
               d["per_extra_subscriber"][n]["fanout_over_mirror"], "<= 1.10x", lambda v: v <= 1.10)
    target("fixed cost: fanout with 0 subscribers / do-nothing wasm filter (CPU per request), "
           "metrics on", d["fixed"]["fanout0_over_noop"], "<= 1.10x", lambda v: v <= 1.10)
    target("fixed cost, as above, metrics off",
           _ratio(d["fixed"]["fanout0_nometrics"], noop), "<= 1.10x", lambda v: v <= 1.10)
    for n, limit in ((4, 0.90), (16, 0.95), (64, 0.95)):
        target(f"throughput fanout / mirror, N={n}", d["per_n"][n]["rps_fanout_over_mirror"],
               f">= {limit:.2f}x", lambda v, limit=limit: v >= limit)
    target("throughput fanout / proxy, N=1 (reported with the host's floor)",
           d["per_n"][1]["rps_fanout_over_proxy"], "report", lambda v: True)
    for n in NS[1:]:
        target(f"p99 fanout / mirror, N={n}", d["per_n"][n]["p99_fanout_over_mirror"], "<= 1.10x",
               lambda v: v <= 1.10)
    target("20 ms subscribers: fanout p50 at N=64 minus one-subscriber proxy p50 (ms)",
           d["latency_64_excess_ms"], "<= 2 ms", lambda v: v <= 2.0, "{:.2f} ms")
    target("fanout.wasm size, the longer-term goal (bench/README.md: what it would take)",
           None if size is None else size / 1024, "<= 150 KiB", lambda v: v <= 150, "{:.1f} KiB")
    hc = results.get("hostcalls")
    if hc:
        fit = _hostcall_fit(hc, False)
        d["hostcalls_fit"] = {"metrics_on": _hostcall_fit(hc, True), "metrics_off": fit}
    return d


def _hostcall_fit(hc, metrics):
    rows = {r["subscribers"]: r["per_request"] for r in hc if r["metrics"] == metrics}
    if 0 not in rows or 64 not in rows:
        return None
    return {"per_request": rows[0], "per_subscriber": (rows[64] - rows[0]) / 64}


# ---------------------------------------------------------------------------------------------

def _traced_per_subscriber(w, tp):
    """Tracing's price per extra subscriber (CPU at N=4 - CPU at N=1) / 3, traced against
    untraced, and the target: at most 1.10x."""
    cpu = {k: _get(tp, k, "cpu_us_per_req") for k in
           ("fanout/1", "fanout/4", "fanout-traced/1", "fanout-traced/4")}
    if any(v is None for v in cpu.values()):
        return
    off = (cpu["fanout/4"] - cpu["fanout/1"]) / 3
    on = (cpu["fanout-traced/4"] - cpu["fanout-traced/1"]) / 3
    if off <= 0:
        return
    ratio = on / off
    verdict = "within" if ratio <= 1.10 else "OVER"
    w(f"Tracing at 100 % sampling: {on:.1f} us of CPU per extra subscriber against {off:.1f} "
      f"untraced, {ratio:.2f}x ({verdict} the 1.10x target); per request at N=1 "
      f"{cpu['fanout-traced/1'] / cpu['fanout/1']:.2f}x.\n")


def _f(v, fmt="{:.0f}"):
    return "–" if v is None else fmt.format(v)


def _s(spread, fmt="{:.0f}"):
    """median (min–max) of a spread."""
    if spread is None:
        return "–"
    if spread["rounds"] == 1:
        return fmt.format(spread["median"])
    return (f"{fmt.format(spread['median'])} ({fmt.format(spread['min'])}–"
            f"{fmt.format(spread['max'])})")


def _met(verdict):
    if verdict is None:
        return "–"
    return ("met" if verdict["met"] else "**not met**") + f" ({verdict['how']})"


def _floor_sections(results, d, w):
    tp = results.get("throughput") or {}
    fl = d.get("floor") or {}
    per_n = {int(k): v for k, v in (fl.get("per_n") or {}).items()}
    slope = {int(k): v for k, v in (fl.get("slope") or {}).items()}
    if per_n:
        w("## fanout against the floor of a wasm fan-out\n")
        w("The floor (`bench/floor-filter`) is the least any proxy-wasm filter does to fan a request "
          "out: pause, read the body, one `dispatch_http_call` per subscriber with the headers "
          "fanout forwards, each answer's `:status`, a local 202. Same Envoy, same clusters, same "
          "request, measured next to fanout in every round. Envoy CPU µs per request, median "
          "(min–max) over the rounds; the ratio is taken round by round.\n")
        w(f"| N | floor | fanout | fanout − floor µs | fanout / floor | target |")
        w("|---|---|---|---|---|---|")
        for n in FLOOR_NS:
            r = per_n.get(n)
            if not r:
                continue
            tgt = (f"≤ {FIXED_LIMIT:.2f}x: {_met(fl.get('fixed_verdict'))}" if n == 0 else "")
            w(f"| {n} | {_s(r['floor'])} | {_s(r['fanout'])} | {_s(r['gap_us'], '{:+.0f}')} | "
              f"{_s(r['ratio'], '{:.2f}x')} | {tgt} |")
        if slope:
            w("\nPer extra subscriber, (CPU at N − CPU at N=1) / (N − 1), per round:\n")
            w("| N | floor µs | fanout µs | fanout / floor | target |")
            w("|---|---|---|---|---|")
            verdicts = {int(k): v for k, v in (fl.get("slope_verdict") or {}).items()}
            for n in NS[1:]:
                r = slope.get(n)
                if r:
                    w(f"| {n} | {_s(r['floor'], '{:.1f}')} | {_s(r['fanout'], '{:.1f}')} | "
                      f"{_s(r['ratio'], '{:.2f}x')} | ≤ {SLOPE_LIMIT:.2f}x: {_met(verdicts.get(n))} |")
        w("\n\"every round\": every round's ratio is on the same side of the limit as the "
          "median; \"rounds straddle the limit\": the spread is as large as the gap, more rounds "
          "(or a quieter machine) are needed to tell.\n")

    rows = [("floor/0", "the floor: pause, read the body, local 202"),
            ("floor+clock/0", "the floor + a clock read (`get_current_time`)"),
            ("floor+headers/0", "the floor + the request headers (`get_map`, decoded)"),
            ("floor+clock+headers/0", "the floor + both: the host calls fanout makes at N = 0"),
            ("fanout-nometrics/0", "fanout, metrics off"),
            ("fanout/0", "fanout, metrics on"),
            ("noop/0", "do-nothing wasm filter + buffer + `direct_response` 202"),
            ("baseline/0", "buffer + `direct_response` 202, no wasm")]
    if "floor+clock+headers/0" in tp:
        w("## The fixed cost at N = 0, taken apart\n")
        w("| configuration | CPU µs/rq | − floor µs (per round) |")
        w("|---|---|---|")
        for key, label in rows:
            if key in tp:
                gap = _paired(tp, key, "floor/0", lambda a, b: a - b)
                w(f"| {label} | {_s(_spread(_rounds(tp, key)))} | {_s(gap, '{:+.1f}')} |")
        w("\nfanout (metrics off) minus the floor with both host calls is what fanout's own code "
          "costs per request: admission (method, host, content type), the header selection, "
          "the fan-out state and its verdict, and their allocations. See bench/README.md for "
          "the profile.\n")

    mc = d.get("metrics_cost") or {}
    mpn = {int(k): v for k, v in (mc.get("per_n") or {}).items()}
    if mpn:
        w("## What metrics cost\n")
        w("fanout with `metrics: true` (the default) minus `metrics: false`, Envoy CPU µs per "
          "request, paired round by round, median (min–max):\n")
        w("| N | metrics on | metrics off | on − off |")
        w("|---|---|---|---|")
        for n in PAIRED_NS:
            if n in mpn:
                w(f"| {n} | {_s(_spread(_rounds(tp, f'fanout/{n}')))} | "
                  f"{_s(_spread(_rounds(tp, f'fanout-nometrics/{n}')))} | "
                  f"{_s(mpn[n], '{:+.1f}')} |")
        pc = {int(k): v for k, v in (mc.get("per_call") or {}).items()}
        if pc:
            w("\nPer call ((on − off at N) − (on − off at 0)) / N: " + "; ".join(
                f"N={n} {_s(v, '{:+.1f}')} µs" for n, v in sorted(pc.items())) + ". "
              "With metrics on every call adds a clock read at its answer and a histogram "
              "sample (`record_metric`) at the next flush.\n")

    builds = d.get("builds") or {}
    info = (results.get("wasm") or {}).get("builds") or {}
    if builds:
        w("## Other builds of fanout\n")
        w(f"The shipped `fanout.wasm` ({(results.get('wasm') or {}).get('fanout_bytes', 0) / 1024:.1f} "
          "KiB) against the same source built otherwise, Envoy CPU per request, other / "
          "shipped per round, median (min–max):\n")
        w("| build | size KiB | " + " | ".join(f"N={n}" for n in PAIRED_NS) + " |")
        w("|---|---|" + "---|" * len(PAIRED_NS))
        for build, by_n in builds.items():
            by_n = {int(k): v for k, v in by_n.items()}
            w(f"| {info.get(build, {}).get('label', build)} | "
              f"{info.get(build, {}).get('bytes', 0) / 1024:.1f} | "
              + " | ".join(_s(by_n.get(n), "{:.2f}x") for n in PAIRED_NS) + " |")
        w("")

    st = d.get("startup") or {}
    if st:
        sizes = {"fanout": (results.get("wasm") or {}).get("fanout_bytes"),
                 "noop": (results.get("wasm") or {}).get("noop_bytes"),
                 "floor": (results.get("wasm") or {}).get("floor_bytes"), "baseline": None}
        for build, v in info.items():
            sizes[f"fanout@{build}"] = v.get("bytes")
        labels = {"baseline": "no wasm (buffer + `direct_response`)",
                  "noop": "do-nothing wasm filter", "floor": "the floor filter (N = 4)",
                  "fanout": "fanout, shipped (N = 4)"}
        for build, v in info.items():
            labels[f"fanout@{build}"] = f"fanout, {v.get('label', build)} (N = 4)"
        w("## What the module's size costs at start-up\n")
        m = results["machine"]
        w(f"Envoy from exec to `/ready` answering 200, and its RSS a second later, with "
          f"`--concurrency 1` and `4` (one wasm VM per worker); median (min–max) over "
          f"{m.get('startup_rounds', '?')} start(s) each, interleaved:\n")
        w("| system | module KiB | ready ms, c=1 | ready ms, c=4 | RSS MB, c=1 | RSS MB, c=4 "
          "| RSS per extra worker MB |")
        w("|---|---|---|---|---|---|---|")
        for name, by in st.items():
            by1, by4 = by.get("c1"), by.get("c4")
            if not by1 or not by4:
                continue
            size = sizes.get(name)

            def sp(row, k):
                return _s({"median": row[k], "min": row[k + "_min"], "max": row[k + "_max"],
                           "rounds": row["rounds"]}, "{:.0f}" if k == "ready_ms" else "{:.1f}")
            w(f"| {labels.get(name, name)} | {_f(None if size is None else size / 1024, '{:.1f}')} | "
              f"{sp(by1, 'ready_ms')} | {sp(by4, 'ready_ms')} | {sp(by1, 'rss_mb')} | "
              f"{sp(by4, 'rss_mb')} | {_f(by.get('rss_per_worker_mb'), '{:.1f}')} |")
        w("")


def _dedupe_section(results, d, w):
    ds = d.get("dedupe_stores") or {}
    if not ds:
        return
    etcds = results.get("etcd") or {}
    w("## Dedupe stores at N = 4\n")
    w("Every request a new `ce-id` (each is claimed, called and recorded). Envoy CPU µs per "
      "request and requests/s from the throughput phase; etcd calls per event (Envoy's "
      "`cluster.etcd.upstream_rq_total` over the requests: claims, settles, lease grants) and "
      "etcd's own CPU per event (its /proc/<pid>/stat, context: not fanout's) from the same "
      "runs; p50 / p99 of the sender's answer from the latency phase (subscribers answering "
      "after 20 ms, one connection). Ratios and differences against the envoy store are taken "
      "round by round. The last column is Envoy's CPU per event at one connection (tens of "
      "events a second): there, work that runs whatever the load (a timer) shows. etcd: one "
      "member on loopback, "
      + "; ".join(f"{k}: data dir `{v.get('data_dir')}` ({v.get('filesystem')})"
                  for k, v in etcds.items()) + ".\n")
    w("| configuration | Envoy CPU µs/rq | / envoy store | rq/s | etcd calls per event | etcd CPU "
      "µs per event | p50 ms | p99 ms | p50 − envoy store ms | Envoy CPU µs/rq, latency phase |")
    w("|---|---|---|---|---|---|---|---|---|---|")
    labels = {DEDUPE_OFF: "dedupe off", DEDUPE_ENVOY: "`envoy` store",
              DEDUPE_ETCD: "`etcd` store, etcd on tmpfs",
              DEDUPE_ETCD_DISK: "`etcd` store, etcd on disk"}
    labels.update({_before(k): v + " (`--before` build)" for k, v in list(labels.items())[1:]})
    for key, label in labels.items():
        r = ds.get(key)
        if not r:
            continue
        etcd = key in (DEDUPE_ETCD, DEDUPE_ETCD_DISK, _before(DEDUPE_ETCD),
                       _before(DEDUPE_ETCD_DISK))
        w(f"| {label} | {_s(r.get('cpu'))} | {_s(r.get('cpu_over_envoy'), '{:.2f}x')} | "
          f"{_f(r.get('rps'))} | {_f(r.get('etcd_rq_per_req') if etcd else None, '{:.2f}')} | "
          f"{_f(r.get('etcd_cpu_us_per_req') if etcd else None)} | "
          f"{_f(r.get('p50_ms'), '{:.2f}')} | {_f(r.get('p99_ms'), '{:.2f}')} | "
          f"{_s(r.get('p50_over_envoy_ms'), '{:+.2f}')} | {_f(r.get('lat_cpu_us_per_req'))} |")
    paced = [(labels.get(k, k), r["equal_rate"]) for k, r in ds.items() if r.get("equal_rate")]
    if paced:
        fraction = (results.get("machine") or {}).get("equal_rate")
        w("\nThe same at one offered load: wrk paced (bench/cloudevent.lua `BENCH_RATE`) to "
          + (f"{fraction:g}x" if fraction else "a fraction of")
          + " the etcd store's full-speed rate (`--equal-rate`), the `envoy` store at the "
          "same rate, round by round. At full speed each runs at its own saturation, and the "
          "slower one has fewer requests per event-loop wakeup to share its fixed costs; "
          "here both carry the same load.\n")
        w("| configuration | rate rq/s (achieved: etcd / envoy store) | Envoy CPU µs/rq | "
          "`envoy` store's | / envoy store |")
        w("|---|---|---|---|---|")
        for label, e in paced:
            w(f"| {label} | {_f(e.get('rate'))} ({_f(e.get('rps'))} / {_f(e.get('envoy_rps'))}) "
              f"| {_s(e.get('cpu'))} | {_s(e.get('envoy_cpu'))} | "
              f"{_s(e.get('cpu_over_envoy'), '{:.2f}x')} |")
    errors = {k: r["store_errors"] + (r.get("equal_rate") or {}).get("store_errors", 0)
              for k, r in ds.items()
              if r.get("store_errors") or (r.get("equal_rate") or {}).get("store_errors")}
    w("\n" + ("No store error counted (`fanout.dedupe.store_errors`) in any measured run."
              if not errors else "Store errors counted (those events were delivered without "
              "dedupe): " + ", ".join(f"{k} {v}" for k, v in errors.items()) + ".") + "\n")


def markdown(results, chart="chart.svg"):
    m = results["machine"]
    tp = results.get("throughput") or {}
    lat = results.get("latency") or {}
    d = results.get("derived") or derive(results)
    out = []
    w = out.append
    w(f"# fanout benchmark, {m['date'][:10]} ({m['mode']} run)\n")
    w(f"Machine: {m['cpu']}, {m['cores']} cores, {m['mem_gib']} GiB, Linux {m['kernel']} "
      f"(load average at start {', '.join(f'{x:.1f}' for x in m['load_avg_at_start'])}). "
      f"Envoy {m['envoy']}; {m['wrk']}; {m['rustc']}; fanout {m['commit']}.\n")
    w(f"Each system is one Envoy with `--concurrency 1`; load: `wrk -t1 -c{m['connections']}`, "
      f"a 1 KiB binary-mode CloudEvent (64 KiB where marked), {m['duration_s']} s per "
      f"measurement, {m['rounds']} interleaved round(s) (every configuration once per round), "
      f"medians shown. Subscribers: one Envoy answering 200 after reading the body (buffer "
      f"filter + `direct_response`), one HTTP/1.1 cluster per subscriber. Latency percentiles "
      f"are wrk's over the whole run; requests/s, CPU (the system Envoy's user+system time, "
      f"from /proc/<pid>/stat, per request it completed) and subscriber counters over the "
      f"steady part of each run (20 % to 90 % of it). All on loopback; the machine was shared, so "
      f"compare ratios within this run. Reproduce: `make bench` (`make bench QUICK=1` for a "
      f"short run). Total time {m.get('elapsed_s', '?')} s.\n")
    if chart:
        w(f"![throughput and p99 against N]({chart})\n")
    _floor_sections(results, d, w)

    w("## Context: fanout against Envoy's mirroring, a plain proxy and a Lua fan-out\n")
    w("Not equivalents (mirroring does not wait for its shadows, Lua calls one subscriber after "
      "the other) but what a user might run instead.\n")
    w("| N | fanout rq/s | mirror rq/s | proxy rq/s | Lua rq/s | fanout/mirror | fanout/proxy "
      "| fanout p50 / p99 ms | mirror p50 / p99 ms | Lua p50 / p99 ms |")
    w("|---|---|---|---|---|---|---|---|---|---|")
    for n in NS:
        f, mi, lu = f"fanout/{n}", f"mirror/{n}", f"lua/{n}"
        pn = d["per_n"].get(n) or d["per_n"].get(str(n)) or {}
        w(f"| {n} | {_f(_get(tp, f, 'rps'))} | {_f(_get(tp, mi, 'rps'))} | "
          f"{_f(_get(tp, 'proxy/1', 'rps'))} | {_f(_get(tp, lu, 'rps'))} | "
          f"{_f(pn.get('rps_fanout_over_mirror'), '{:.2f}x')} | "
          f"{_f(pn.get('rps_fanout_over_proxy'), '{:.2f}x')} | "
          f"{_f(_get(tp, f, 'p50_ms'), '{:.2f}')} / {_f(_get(tp, f, 'p99_ms'), '{:.2f}')} | "
          f"{_f(_get(tp, mi, 'p50_ms'), '{:.2f}')} / {_f(_get(tp, mi, 'p99_ms'), '{:.2f}')} | "
          f"{_f(_get(tp, lu, 'p50_ms'), '{:.2f}')} / {_f(_get(tp, lu, 'p99_ms'), '{:.2f}')} |")
    w("\nThe proxy column is one request to one cluster, whatever N (the floor at N = 1). "
      "Mirroring answers as soon as cluster 0 answers and does not wait for the shadows: it is "
      "the ceiling, not an equivalent. Lua calls the subscribers one after the other.\n")

    w("## Envoy CPU per request (us) and peak RSS\n")
    w("| N | fanout | mirror | Lua | fanout/mirror | per extra subscriber: fanout | mirror | Lua "
      "| fanout/mirror | peak RSS MB fanout / mirror / Lua |")
    w("|---|---|---|---|---|---|---|---|---|---|")
    for n in NS:
        pn = d["per_n"].get(n) or d["per_n"].get(str(n)) or {}
        pe = d["per_extra_subscriber"].get(n) or d["per_extra_subscriber"].get(str(n)) or {}
        w(f"| {n} | {_f(_get(tp, f'fanout/{n}', 'cpu_us_per_req'))} | "
          f"{_f(_get(tp, f'mirror/{n}', 'cpu_us_per_req'))} | "
          f"{_f(_get(tp, f'lua/{n}', 'cpu_us_per_req'))} | "
          f"{_f(pn.get('cpu_fanout_over_mirror'), '{:.2f}x')} | "
          f"{_f(pe.get('fanout'), '{:.1f}')} | {_f(pe.get('mirror'), '{:.1f}')} | "
          f"{_f(pe.get('lua'), '{:.1f}')} | {_f(pe.get('fanout_over_mirror'), '{:.2f}x')} | "
          f"{_f(_get(tp, f'fanout/{n}', 'peak_rss_mb'))} / "
          f"{_f(_get(tp, f'mirror/{n}', 'peak_rss_mb'))} / "
          f"{_f(_get(tp, f'lua/{n}', 'peak_rss_mb'))} |")
    w("\nPer extra subscriber = (CPU at N - CPU at N=1) / (N - 1).\n")

    w("## The native build (`libfanout.so`) next to the wasm module\n")
    w("| N | fanout rq/s | native rq/s | fanout CPU us/rq | native CPU us/rq | native/fanout "
      "| native p50 / p99 ms |")
    w("|---|---|---|---|---|---|---|")
    for n in FLOOR_NS:
        f, nat = f"fanout/{n}", f"native/{n}"
        fc, nc = _get(tp, f, "cpu_us_per_req"), _get(tp, nat, "cpu_us_per_req")
        ratio = nc / fc if fc and nc is not None else None
        w(f"| {n} | {_f(_get(tp, f, 'rps'))} | {_f(_get(tp, nat, 'rps'))} | {_f(fc)} | "
          f"{_f(nc)} | {_f(ratio, '{:.2f}x')} | "
          f"{_f(_get(tp, nat, 'p50_ms'), '{:.2f}')} / {_f(_get(tp, nat, 'p99_ms'), '{:.2f}')} |")
    w(f"\nA plain Envoy route to one upstream (proxy/1, Envoy's own router: the native build's "
      f"limit) costs {_f(_get(tp, 'proxy/1', 'cpu_us_per_req'))} us/rq. `bench/callgrind.py` "
      f"gives the same comparison in instructions.\n")

    w("## Floors, metrics, large bodies\n")
    w("| configuration | rq/s | p50 / p99 ms | CPU us/rq | peak RSS MB |")
    w("|---|---|---|---|---|")
    labels = [
        ("baseline/0", "buffer filter + `direct_response` 202, no wasm"),
        ("noop/0", "do-nothing wasm filter + buffer + `direct_response` 202"),
        ("fanout/0", "fanout, 0 subscribers (local 202), metrics on"),
        ("fanout-nometrics/0", "fanout, 0 subscribers, metrics off"),
        ("proxy/1", "plain proxy to one cluster"),
        ("fanout/4", "fanout N=4, metrics on"),
        ("fanout-nometrics/4", "fanout N=4, metrics off"),
        ("fanout/16", "fanout N=16, metrics on"),
        ("fanout-nometrics/16", "fanout N=16, metrics off"),
        ("fanout-dedupe/4", "fanout N=4, dedupe on (a new `ce-id` per request)"),
        ("fanout-cap/4", "fanout N=4, `max_concurrent_calls` that never binds (vs `fanout/4`: the cap's bookkeeping)"),
        ("fanout-format/4", "fanout N=4, one subscriber `delivery.format: structured` (vs `fanout/4`: one conversion per request)"),
        ("fanout-traced/1", "fanout N=1, `tracing` at 100 % sampling (vs `fanout/1`)"),
        ("fanout-traced/4", "fanout N=4, `tracing` at 100 % sampling (vs `fanout/4`)"),
        ("fanout-64k/4", "fanout N=4, 64 KiB body"),
        ("mirror-64k/4", "mirror N=4, 64 KiB body"),
        ("proxy-64k/1", "plain proxy, 64 KiB body"),
    ]
    for key, label in labels:
        if key in tp:
            w(f"| {label} | {_f(_get(tp, key, 'rps'))} | {_f(_get(tp, key, 'p50_ms'), '{:.2f}')} / "
              f"{_f(_get(tp, key, 'p99_ms'), '{:.2f}')} | {_f(_get(tp, key, 'cpu_us_per_req'))} | "
              f"{_f(_get(tp, key, 'peak_rss_mb'))} |")
    w("")
    _traced_per_subscriber(w, tp)

    if lat:
        ex = d.get("latency_excess_ms") or {"fanout": {}, "mirror": {}}
        ex = {k: {int(n): v for n, v in x.items()} for k, x in ex.items()}
        w(f"## Latency with slow subscribers ({m['slow_ms']} ms each, one connection)\n")
        w("| N | fanout p50 / p99 ms | mirror p50 / p99 ms | Lua (sequential) p50 / p99 ms |")
        w("|---|---|---|---|")
        ns = sorted({r["n"] for k, r in lat.items() if k != "proxy/1"})
        for n in ns:
            cells = []
            for kind in ("fanout", "mirror", "lua"):
                k = f"{kind}/{n}"
                cells.append(f"{_f(_get(lat, k, 'p50_ms'), '{:.1f}')} / "
                             f"{_f(_get(lat, k, 'p99_ms'), '{:.1f}')}")
            w(f"| {n} | " + " | ".join(cells) + " |")
        w(f"\nOne slow subscriber behind a plain proxy: p50 {_f(_get(lat, 'proxy/1', 'p50_ms'), '{:.2f}')} ms"
          f" (the reference for \"the slowest subscriber\"). p50 above it, fanout / mirror: " +
          ", ".join(f"N={n} {_f(ex['fanout'].get(n), '{:+.1f}')} / {_f(ex['mirror'].get(n), '{:+.1f}')} ms"
                    for n in NS if ex["fanout"].get(n) is not None) + ".\n")

    mem = results.get("memory")
    if mem:
        w("## Memory per in-flight request\n")
        w("| N = 4, requests held open by subscribers | in flight | idle RSS MB | RSS MB with them | kB per request |")
        w("|---|---|---|---|---|")
        for key, r in mem.items():
            w(f"| {key.split('/')[0]} | {r['inflight']} ({r['held_calls']} calls held) | "
              f"{r['idle_rss_mb']:.1f} | {r['loaded_rss_mb']:.1f} | {r['kb_per_inflight']:.1f} |")
        w("\nWith HTTP/1.1 subscriber clusters every in-flight call holds its own upstream "
          "connection; most of the figure is Envoy's per-stream and per-connection state.\n")

    w("## Connection reuse at the subscriber\n")
    w("| configuration | subscriber requests | new subscriber connections | requests per new connection | subscriber requests per request |")
    w("|---|---|---|---|---|")
    for key in [f"fanout/{n}" for n in NS] + [f"mirror/{n}" for n in NS] + \
            [f"lua/{n}" for n in NS] + ["proxy/1"]:
        if key in tp:
            rq, cx = _get(tp, key, "sub_rq_total"), _get(tp, key, "sub_cx_total")
            per = f"{rq / cx:.0f}" if cx else "all reused"
            w(f"| {key} | {rq} | {cx} | {per} | {_f(_get(tp, key, 'sub_rq_per_req'), '{:.2f}')} |")
    sub = (results.get("subscriber") or {}).get("counters") or {}
    totals = []
    for lst in ("fast", "slow", "hold"):
        rq = sub.get(f"http.sub_{lst}.downstream_rq_total")
        cx = sub.get(f"http.sub_{lst}.downstream_cx_total")
        if rq:
            totals.append(f"`sub_{lst}` {rq} requests on {cx} connections")
    w("\nCounted by the subscriber Envoy (`http.sub_fast.downstream_cx_total` and "
      "`downstream_rq_total`) over the steady part of each measured run. Whole run, warm-ups and sanity checks included: " +
      ("; ".join(totals) or "–") + ".\n")

    wasm = results.get("wasm") or {}
    hc = results.get("hostcalls")
    w("## Size and host calls\n")
    w(f"`fanout.wasm`: {wasm.get('fanout_bytes', 0)} bytes ({wasm.get('fanout_bytes', 0) / 1024:.1f} KiB); "
      f"built the same way, the do-nothing filter {wasm.get('noop_bytes', 0) / 1024:.1f} KiB and "
      f"the floor filter {wasm.get('floor_bytes', 0) / 1024:.1f} KiB (the proxy-wasm SDK and "
      f"Rust's allocator and panic machinery are most of that).\n")
    if hc:
        w("Host calls for one request answered 202 (1 KiB body, every subscriber 200), counted by "
          "`bench/hostcalls` through the filter's `Host` trait, plus the SDK's "
          "`set_effective_context` before each call answer; metric flushes amortised:\n")
        w("| subscribers | metrics on | metrics off |")
        w("|---|---|---|")
        by = {(r["subscribers"], r["metrics"]): r for r in hc}
        for n in (0, 1, 4, 16, 64):
            w(f"| {n} | {_f(by.get((n, True), {}).get('per_request'), '{:.1f}')} | "
              f"{_f(by.get((n, False), {}).get('per_request'), '{:.1f}')} |")
        fit = d.get("hostcalls_fit") or {}
        on, off = fit.get("metrics_on"), fit.get("metrics_off")
        if on and off:
            w(f"\nLinear in N: {off['per_request']:.0f} + {off['per_subscriber']:.2f}·N host calls "
              f"with metrics off, {on['per_request']:.0f} + {on['per_subscriber']:.2f}·N with "
              f"metrics on; nothing depends on the number of channels (the channel is picked "
              f"by host from a map built at configure time).")
            r64 = by.get((64, False), {}).get("by_call", {})
            w("Per subscriber: " + ", ".join(
                f"`{k}` {v / 64:.0f}" for k, v in r64.items() if v >= 64) + ".\n")

    prof = results.get("profile")
    if prof:
        w("## Where the CPU goes (perf, `-e cpu-clock -g`, under load)\n")
        w("| DSO | " + " | ".join(prof) + " |")
        w("|---|" + "---|" * len(prof))
        def merged(dsos):
            # One row for V8's code space, whichever thread perf names it by.
            out = {}
            for dso, pct in dsos:
                name = "[JIT] (wasm)" if dso.startswith("[JIT]") else dso
                out[name] = out.get(name, 0.0) + pct
            return out
        by = {k: merged(v["dso"]) for k, v in prof.items()}
        names = []
        for v in by.values():
            for dso in sorted(v, key=v.get, reverse=True)[:6]:
                if dso not in names:
                    names.append(dso)
        for dso in names:
            w(f"| {dso} | " + " | ".join(_f(v.get(dso), "{:.1f} %") for v in by.values()) + " |")
        w("\nThe Envoy binary is stripped; JIT-compiled wasm is V8's code space (`[JIT] tid <n>` "
          "to perf), the kernel `[kernel.kallsyms]`. A sampling profile on a shared machine: "
          "`bench/callgrind.py` counts the same split in instructions, repeatably.\n")

    _dedupe_section(results, d, w)

    w("## Targets\n")
    w("Reported, never a failing test. Against the floor of a wasm fan-out and on size (issue 18); "
      "the etcd dedupe store (issue 23):\n")
    w("| target | limit | this run | met |")
    w("|---|---|---|---|")
    for t in d["targets"]:
        met = "–" if t["met"] is None else ("yes" if t["met"] else "**no**")
        if t.get("how") and t["met"] is not None:
            met += f" ({t['how']})"
        w(f"| {t['target']} | {t['limit']} | {_f(t['value'], '{}')} | {met} |")
    w("\nEarlier targets, against mirroring and a plain proxy (context: what a wasm filter "
      "cannot reach is the proxy-wasm ABI's and V8's cost, which the floor pays too):\n")
    w("| target | limit | this run | met |")
    w("|---|---|---|---|")
    for t in d.get("context_targets", []):
        met = "–" if t["met"] is None else ("yes" if t["met"] else "**no**")
        w(f"| {t['target']} | {t['limit']} | {_f(t['value'], '{}')} | {met} |")
    bad = [k for k, r in tp.items() if r.get("non_2xx") or r.get("errors")]
    bad += [f"latency {k}" for k, r in lat.items() if r.get("non_2xx") or r.get("errors")]
    w("\n" + ("Every measured request was answered 2xx, with no socket errors."
              if not bad else "Non-2xx answers or socket errors in: " + ", ".join(bad) + "."))
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------

COLORS = {"fanout": "#1f77b4", "mirror": "#ff7f0e", "proxy": "#7f7f7f", "lua": "#2ca02c"}
LABELS = {"fanout": "fanout (wasm)", "mirror": "Envoy mirroring (ceiling)",
          "proxy": "plain proxy, 1 cluster", "lua": "Lua httpCall (sequential)"}


def _nice_max(v):
    if v <= 0:
        return 1
    e = 10 ** math.floor(math.log10(v))
    for m in (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10):
        if m * e >= v:
            return m * e
    return 10 * e


def svg(results):
    tp = results.get("throughput") or {}
    W, H = 960, 420
    panels = [("requests/s (higher is better)", "rps", 70), ("p99 latency, ms (lower is better)", "p99_ms", 550)]
    pw, ph, top = 360, 280, 50
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
             f'viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">',
             f'<rect width="{W}" height="{H}" fill="white"/>',
             f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="15">fanout vs Envoy '
             f'mirroring vs plain proxy, against N subscribers (Envoy --concurrency 1, '
             f'wrk -c{results["machine"]["connections"]}, 1 KiB)</text>']

    def xpos(x0, i):
        return x0 + 30 + i * (pw - 60) / (len(NS) - 1)

    for title, field, x0 in panels:
        series = {}
        for kind in ("fanout", "mirror", "lua", "proxy"):
            pts = []
            for i, n in enumerate(NS):
                key = "proxy/1" if kind == "proxy" else f"{kind}/{n}"
                v = _get(tp, key, field)
                if v is not None:
                    pts.append((i, v))
            series[kind] = pts
        vmax = _nice_max(max([v for pts in series.values() for _, v in pts] or [1]))
        y = lambda v: top + ph - v / vmax * ph  # noqa: E731
        parts.append(f'<text x="{x0 + pw / 2}" y="{top - 12}" text-anchor="middle" '
                     f'font-weight="bold">{title}</text>')
        parts.append(f'<rect x="{x0}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>')
        for k in range(6):
            v = vmax * k / 5
            parts.append(f'<line x1="{x0}" x2="{x0 + pw}" y1="{y(v):.1f}" y2="{y(v):.1f}" '
                         f'stroke="#eee"/>')
            label = f"{v:.0f}" if vmax >= 10 else f"{v:.1f}"
            parts.append(f'<text x="{x0 - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{label}</text>')
        for i, n in enumerate(NS):
            parts.append(f'<text x="{xpos(x0, i):.1f}" y="{top + ph + 18}" '
                         f'text-anchor="middle">{n}</text>')
        parts.append(f'<text x="{x0 + pw / 2}" y="{top + ph + 36}" text-anchor="middle">'
                     f'N subscribers (log scale)</text>')
        for kind, pts in series.items():
            if not pts:
                continue
            c = COLORS[kind]
            dash = ' stroke-dasharray="6,4"' if kind == "proxy" else ""
            if kind == "proxy":
                pts = [(i, pts[0][1]) for i in range(len(NS))]
            path = " ".join(f"{'M' if j == 0 else 'L'}{xpos(x0, i):.1f},{y(v):.1f}"
                            for j, (i, v) in enumerate(pts))
            parts.append(f'<path d="{path}" fill="none" stroke="{c}" stroke-width="2"{dash}/>')
            for i, v in pts:
                parts.append(f'<circle cx="{xpos(x0, i):.1f}" cy="{y(v):.1f}" r="3.5" fill="{c}"/>')
    lx = 120
    for kind in ("fanout", "mirror", "proxy", "lua"):
        c = COLORS[kind]
        dash = ' stroke-dasharray="6,4"' if kind == "proxy" else ""
        parts.append(f'<line x1="{lx}" x2="{lx + 26}" y1="{H - 22}" y2="{H - 22}" stroke="{c}" '
                     f'stroke-width="2"{dash}/>')
        parts.append(f'<text x="{lx + 32}" y="{H - 18}">{LABELS[kind]}</text>')
        lx += 200
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
