#!/usr/bin/env python3
"""A small OTLP/HTTP trace receiver: POST /v1/traces with an ExportTraceServiceRequest
(application/x-protobuf), decoded with the official protos (PyPI `opentelemetry-proto`).

Each span it decodes is written as one JSON line to --out (ids in lowercase hex, attributes
as a flat object, the resource's attributes too), and each export as a line of kind
"export" (path, content-type, authority, the request's headers, span count), so a test or a
person can read what a filter sent. It answers 200 with an empty ExportTraceServiceResponse; 415 to another content type,
400 to a body that does not decode. Listens on 127.0.0.1; --port 0 picks a free port, which
it prints as "listening on PORT" once it accepts connections.

    python3 tools/otlp-receiver.py --port 4318 --out spans.jsonl
"""

import argparse
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from threading import Lock

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

LOCK = Lock()


def value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "string_value":
        return any_value.string_value
    if kind == "bool_value":
        return any_value.bool_value
    if kind == "int_value":
        return any_value.int_value
    if kind == "double_value":
        return any_value.double_value
    return None if kind is None else str(getattr(any_value, kind))


def attributes(key_values):
    return {kv.key: value(kv.value) for kv in key_values}


def span_line(resource, scope, span):
    return {
        "kind": "span",
        "trace_id": span.trace_id.hex(),
        "span_id": span.span_id.hex(),
        "parent_span_id": span.parent_span_id.hex(),
        "trace_state": span.trace_state,
        "flags": span.flags,
        "name": span.name,
        "span_kind": Span.SpanKind.Name(span.kind),
        "start_ns": span.start_time_unix_nano,
        "end_ns": span.end_time_unix_nano,
        "attributes": attributes(span.attributes),
        "status": {"code": Status.StatusCode.Name(span.status.code), "message": span.status.message},
        "resource": resource,
        "scope": {"name": scope.name, "version": scope.version},
    }


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        content_type = self.headers.get("content-type", "")
        if content_type != "application/x-protobuf":
            return self.answer(415, b"only application/x-protobuf", "text/plain")
        request = ExportTraceServiceRequest()
        try:
            request.ParseFromString(body)
        except DecodeError as e:
            return self.answer(400, str(e).encode(), "text/plain")
        lines = []
        for resource_spans in request.resource_spans:
            resource = attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    lines.append(span_line(resource, scope_spans.scope, span))
        export = {"kind": "export", "path": self.path, "content_type": content_type,
                  "authority": self.headers.get("host", ""), "spans": len(lines),
                  "headers": {name.lower(): value for name, value in self.headers.items()}}
        with LOCK, open(self.server.out, "a", encoding="utf-8") as out:
            for line in [export] + lines:
                out.write(json.dumps(line, sort_keys=True) + "\n")
        self.answer(200, ExportTraceServiceResponse().SerializeToString(), "application/x-protobuf")

    def answer(self, status, body, content_type):
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=4318)
    parser.add_argument("--out", required=True, help="the JSON lines file to append to")
    args = parser.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.out = args.out
    print(f"listening on {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
