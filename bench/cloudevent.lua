-- wrk script for `make bench`: POSTs one binary-mode CloudEvent whose body is the file named
-- by $BENCH_BODY (1 KiB or 64 KiB of JSON), and prints the run's figures as one JSON line
-- (latencies in microseconds) for bench/run.py.
wrk.method = "POST"
local file = assert(io.open(assert(os.getenv("BENCH_BODY"), "BENCH_BODY not set"), "rb"))
wrk.body = file:read("*a")
file:close()
wrk.headers["Content-Type"] = "application/json"
wrk.headers["ce-specversion"] = "1.0"
wrk.headers["ce-type"] = "dev.fanout.bench"
wrk.headers["ce-source"] = "/bench/wrk"
wrk.headers["ce-id"] = "bench-event"

-- BENCH_UNIQUE_ID: a new ce-id for every request (for fanout's dedupe, which would otherwise
-- find every repeat already delivered).
if os.getenv("BENCH_UNIQUE_ID") then
  local sent = 0
  local run = tostring(os.time())
  request = function()
    sent = sent + 1
    wrk.headers["ce-id"] = "bench-" .. run .. "-" .. sent
    return wrk.format()
  end
end

-- BENCH_RATE: requests per second over all connections, paced on one schedule: each request
-- waits for the next free slot (slots 1/BENCH_RATE s apart), so that two systems are compared
-- at the same load rather than each at its own saturation. A connection still waits for its
-- answer first, so a system slower than BENCH_RATE runs at its own pace.
local rate = tonumber(os.getenv("BENCH_RATE") or "")
if rate then
  local ffi = require("ffi")
  ffi.cdef [[
    typedef struct { long tv_sec; long tv_nsec; } bench_timespec;
    int clock_gettime(int clock, bench_timespec *tp);
  ]]
  local ts = ffi.new("bench_timespec")
  local function now()
    ffi.C.clock_gettime(1, ts) -- CLOCK_MONOTONIC
    return tonumber(ts.tv_sec) + tonumber(ts.tv_nsec) / 1e9
  end
  local next_slot = 0
  delay = function()
    local t = now()
    local slot = math.max(next_slot, t)
    next_slot = slot + 1 / rate
    return (slot - t) * 1000
  end
end

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCH_JSON {"requests": %d, "duration_us": %d, "p50_us": %d, "p90_us": %d, ' ..
    '"p99_us": %d, "mean_us": %.1f, "max_us": %d, "err_connect": %d, "err_read": %d, ' ..
    '"err_write": %d, "err_status": %d, "err_timeout": %d}\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency.mean, latency.max, e.connect, e.read, e.write, e.status,
    e.timeout))
end
