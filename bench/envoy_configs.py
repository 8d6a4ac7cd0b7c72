"""Envoy configurations for `make bench`, as Python data (written out as JSON, which Envoy
reads as YAML). Every system under test is one Envoy with one listener; the subscribers are
one more Envoy with one listener per behaviour.

Systems (all with `--concurrency 1`, the same request, the same subscriber clusters):
  fanout     the fanout wasm filter with N subscriber clusters (answers 202 itself)
  mirror     Envoy's router to cluster 0 plus N-1 request_mirror_policies (answers with
             cluster 0's answer; does not wait for the shadows)
  proxy      Envoy's router to cluster 0
  lua        Envoy's Lua filter: request_handle:httpCall once per subscriber, one after the
             other, then a local 202 (or 500 if any failed)
  baseline   buffer filter + direct_response 202 (no wasm)
  noop       a do-nothing wasm filter (bench/noop-filter) + buffer + direct_response 202
  floor      the floor of a wasm fan-out (bench/floor-filter): pause, read the body, N calls,
             each answer's :status, a local 202 (or 500); nothing else
Subscriber listeners (each reads the whole body before answering, so connections are kept):
  fast       buffer + direct_response 200
  slow       fault filter (fixed delay) + buffer + direct_response 200
  hold       the same with a long delay: holds requests open for the memory measurement
"""

import json

LOOPBACK = "127.0.0.1"


def _addr(port):
    return {"socket_address": {"address": LOOPBACK, "port_value": port}}


ROUTER = {
    "name": "envoy.filters.http.router",
    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
}


def buffer_filter(max_bytes=1 << 20):
    return {
        "name": "envoy.filters.http.buffer",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer",
            "max_request_bytes": max_bytes,
        },
    }


def fault_delay(delay_ms):
    return {
        "name": "envoy.filters.http.fault",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault",
            "delay": {
                "fixed_delay": f"{delay_ms / 1000:.3f}s",
                "percentage": {"numerator": 100, "denominator": "HUNDRED"},
            },
        },
    }


def wasm_filter(name, path, configuration, allow_stop=True):
    config = {
        "name": name,
        "root_id": name,
        "configuration": {
            "@type": "type.googleapis.com/google.protobuf.StringValue",
            "value": configuration,
        },
        "vm_config": {
            "vm_id": name,
            "runtime": "envoy.wasm.runtime.v8",
            "code": {"local": {"filename": path}},
        },
    }
    if allow_stop:
        config["allow_on_headers_stop_iteration"] = True
    return {
        "name": "envoy.filters.http.wasm",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
            "config": config,
        },
    }


def native_filter(path, configuration):
    """fanout's native build (libfanout.so) as Envoy's dynamic-module HTTP filter, with the
    same JSON configuration as the wasm module's, loaded from `path`."""
    return {
        "name": "envoy.filters.http.dynamic_modules",
        "typed_config": {
            "@type": "type.googleapis.com/"
                     "envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter",
            "dynamic_module_config": {
                "module": {"local": {"filename": path}},
                "do_not_close": True,
            },
            "filter_name": "fanout",
            "filter_config": {
                "@type": "type.googleapis.com/google.protobuf.StringValue",
                "value": configuration,
            },
        },
    }


LUA_TEMPLATE = """
-- What a user might write instead of fanout: one httpCall per subscriber, in turn.
local clusters = { %(clusters)s }
function envoy_on_request(handle)
  local body = handle:body()
  local payload = ""
  if body ~= nil then payload = body:getBytes(0, body:length()) end
  local headers = { [":method"] = "POST", [":path"] = "/" }
  for key, value in pairs(handle:headers()) do
    if key == "content-type" or key:sub(1, 3) == "ce-" then headers[key] = value end
  end
  local failed = 0
  for _, cluster in ipairs(clusters) do
    headers[":authority"] = cluster
    local answer, _ = handle:httpCall(cluster, headers, payload, %(timeout_ms)d)
    local status = tonumber(answer[":status"]) or 0
    if status < 200 or status > 299 then failed = failed + 1 end
  end
  if failed == 0 then
    handle:respond({ [":status"] = "202" }, "")
  else
    handle:respond({ [":status"] = "500", ["x-fanout-failed"] = tostring(failed) }, "failed")
  end
end
"""


def lua_filter(clusters, timeout_ms):
    code = LUA_TEMPLATE % {
        "clusters": ", ".join(json.dumps(c) for c in clusters),
        "timeout_ms": timeout_ms,
    }
    return {
        "name": "envoy.filters.http.lua",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
            "default_source_code": {"inline_string": code},
        },
    }


def direct(status):
    return [{"match": {"prefix": "/"}, "direct_response": {"status": status}}]


# fanout and Lua answer every request themselves: a request that reaches this route is a bug
# in the benchmark, and shows as a 500 (counted by wrk as a non-2xx answer).
TRIPWIRE = [
    {
        "match": {"prefix": "/"},
        "direct_response": {"status": 500, "body": {"inline_string": "reached the router"}},
    }
]


def to_cluster(cluster, mirrors=(), timeout_s=60):
    route = {"cluster": cluster, "timeout": f"{timeout_s}s"}
    if mirrors:
        # No runtime_fraction: every request is mirrored.
        route["request_mirror_policies"] = [{"cluster": m} for m in mirrors]
    return [{"match": {"prefix": "/"}, "route": route}]


def listener(name, port, filters, routes):
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network."
        "http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": name,
        "codec_type": "AUTO",
        "route_config": {
            "name": name,
            "virtual_hosts": [{"name": name, "domains": ["*"], "routes": routes}],
        },
        "http_filters": list(filters) + [ROUTER],
    }
    return {
        "name": name,
        "address": _addr(port),
        "filter_chains": [
            {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}
        ],
    }


def cluster(name, port):
    """An HTTP/1.1 cluster (keep-alive) with circuit breakers out of the way."""
    limit = 1_000_000
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "2s",
        "circuit_breakers": {
            "thresholds": [
                {
                    "max_connections": limit,
                    "max_pending_requests": limit,
                    "max_requests": limit,
                    "max_retries": limit,
                }
            ]
        },
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _addr(port)}}]}],
        },
    }


def bootstrap(admin_port, listeners, clusters=()):
    return {
        "admin": {"address": _addr(admin_port)},
        "static_resources": {"listeners": list(listeners), "clusters": list(clusters)},
    }


def subscriber(admin_port, fast_port, slow_port, hold_port, slow_ms, hold_ms):
    return bootstrap(
        admin_port,
        [
            listener("sub_fast", fast_port, [buffer_filter()], direct(200)),
            listener("sub_slow", slow_port, [fault_delay(slow_ms), buffer_filter()], direct(200)),
            listener("sub_hold", hold_port, [fault_delay(hold_ms), buffer_filter()], direct(200)),
        ],
    )


def sub_clusters(n, sub_port):
    """N distinct clusters (each its own connection pool), all reaching the subscriber."""
    return [cluster(f"sub_{i}", sub_port) for i in range(max(n, 1))]


def fanout_json(n, metrics=True, timeout_ms=30000, dedupe=False, call_cap=None, format=None,
                etcd_port=None, tracing=False):
    conf = {
        "timeout_ms": timeout_ms,
        "metrics": metrics,
        "subscribers": [{"cluster": f"sub_{i}"} for i in range(n)],
    }
    if dedupe:
        conf["dedupe"] = {"key": "ce-id", "ttl_ms": 600000, "max_entries": 100000}
    if etcd_port is not None:
        # The same dedupe, its records in etcd (cluster `etcd`, see etcd_cluster).
        conf["dedupe"] = {"key": "ce-id", "ttl_ms": 600000,
                          "store": {"etcd": {"cluster": "etcd", "prefix": "/fanout-bench/",
                                             # Above the claim waits of a loaded 2-core
                                             # machine: a timeout is a store error, an
                                             # event delivered without dedupe.
                                             "timeout_ms": 2000}}}
    if call_cap is not None:
        # Per worker: a cap above the load's connections never binds; it measures the
        # bookkeeping of every call taking and giving back a slot.
        conf["max_concurrent_calls"] = call_cap
    if format is not None and n > 0:
        # One subscriber (the last) takes the event in the other content mode: the
        # conversion, once per request (the bench sends binary mode).
        conf["subscribers"][-1]["delivery"] = {"format": format}
    if tracing:
        # Every request traced (the bench sends no traceparent): the spans of each request,
        # delivery and attempt, exported to the subscriber Envoy, which answers 202.
        conf["tracing"] = {"collector": {"cluster": "otel"}, "sampling_ratio": 1.0}
    return json.dumps(conf)


def etcd_cluster(port):
    """The etcd store's cluster: one etcd member on loopback (bench/run.py starts it), its
    gRPC API on the client port: HTTP/2 without TLS."""
    c = cluster("etcd", port)
    c["typed_extension_protocol_options"] = HTTP2_OPTIONS
    return c


# What an etcd cluster needs: fanout speaks etcd's gRPC API (docs/dedupe.md).
HTTP2_OPTIONS = {
    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {}},
    }
}


def floor_conf(n, extras=()):
    """The floor filter's plugin configuration: its clusters, then `+clock` / `+headers`
    (the host calls fanout makes at N = 0 that the floor does not need; see its lib.rs)."""
    return " ".join([f"sub_{i}" for i in range(n)] + [f"+{e}" for e in extras])


def system(kind, n, port, admin_port, sub_port, wasm, metrics=True, timeout_ms=30000,
           dedupe=False, build=None, extras=(), call_cap=None, format=None, etcd_port=None,
           tracing=False):
    """The Envoy configuration of one system under test. `wasm`: the modules by name
    ("fanout", "noop", "floor", "fanout-<build>" for each other build of fanout, and
    "native", fanout's native build, and "native-<build>" for another build of it)."""
    name = "bench"
    clusters = sub_clusters(n, sub_port)
    names = [c["name"] for c in clusters]
    if kind == "fanout":
        conf = fanout_json(n, metrics, timeout_ms, dedupe, call_cap, format, etcd_port, tracing)
        if tracing:
            clusters.append(cluster("otel", sub_port))
        path = wasm[f"fanout-{build}"] if build else wasm["fanout"]
        filters, routes = [wasm_filter("fanout", path, conf)], TRIPWIRE
    elif kind == "native":
        conf = fanout_json(n, metrics, timeout_ms, dedupe, call_cap, format, etcd_port, tracing)
        if tracing:
            clusters.append(cluster("otel", sub_port))
        path = wasm[f"native-{build}"] if build else wasm["native"]
        filters, routes = [native_filter(path, conf)], TRIPWIRE
    elif kind == "floor":
        filters, routes = [wasm_filter("floor", wasm["floor"], floor_conf(n, extras))], TRIPWIRE
    elif kind == "mirror":
        filters, routes = [], to_cluster(names[0], names[1:n])
    elif kind == "proxy":
        filters, routes = [], to_cluster(names[0])
    elif kind == "lua":
        filters, routes = [lua_filter(names[:n], timeout_ms)], TRIPWIRE
    elif kind == "baseline":
        filters, routes = [buffer_filter()], direct(202)
    elif kind == "noop":
        filters = [wasm_filter("noop", wasm["noop"], "", allow_stop=False), buffer_filter()]
        routes = direct(202)
    else:
        raise ValueError(kind)
    if etcd_port is not None:
        clusters.append(etcd_cluster(etcd_port))
    return bootstrap(admin_port, [listener(name, port, filters, routes)], clusters)
