#!/usr/bin/env python3
"""Draws one trace as a waterfall PNG from the JSON lines tools/otlp-receiver.py writes: one
row per span, indented under its parent, a bar from its start to its end (red when its
status is an error), its duration and the attributes that say what happened.

    python3 tools/trace-waterfall.py spans.jsonl -o trace.png [--trace TRACE_ID]

Needs matplotlib (`make trace-picture` installs it into the test venv).
"""

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

ERROR = "#d9534f"
# Bars by span kind: the request and the deliveries (server, producer), the HTTP attempts.
COLOURS = {"SPAN_KIND_CLIENT": "#7fbf7f"}
DELIVERY = "#5b8def"

# What a row says after its duration, in this order, when the span has it.
NOTES = [
    ("http.response.status_code", "{}"),
    ("http.request.resend_count", "retry {}"),
    ("fanout.backoff_ms", "after {} ms backoff"),
    ("fanout.retry_after_ms", "Retry-After asked {} ms"),
    ("fanout.attempts", "attempts: {}"),
    ("fanout.dead_lettered", None),
]


def rows(spans):
    """Depth-first from the root(s), children by start time: (depth, span)."""
    ids = {s["span_id"] for s in spans}
    children = {}
    for s in spans:
        children.setdefault(s["parent_span_id"], []).append(s)
    for kids in children.values():
        kids.sort(key=lambda s: (s["start_ns"], s["name"]))
    out = []

    def walk(span, depth):
        out.append((depth, span))
        for child in children.get(span["span_id"], []):
            walk(child, depth + 1)

    roots = [s for s in spans if s["parent_span_id"] not in ids]
    for root in sorted(roots, key=lambda s: (s["start_ns"], s["name"])):
        walk(root, 0)
    return out


def note(span):
    attrs = span["attributes"]
    words = []
    for key, fmt in NOTES:
        if key == "http.response.status_code" and span["span_kind"] == "SPAN_KIND_SERVER":
            fmt = "answered {}"
        if key in attrs:
            if key == "fanout.dead_lettered":
                if attrs[key]:
                    words.append("dead-lettered")
            else:
                words.append(fmt.format(attrs[key]))
    message = span["status"]["message"]
    if span["status"]["code"] == "STATUS_CODE_ERROR" and message and not message.startswith("status "):
        words.append(message)
    return ", ".join(dict.fromkeys(words))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spans")
    parser.add_argument("-o", "--out", required=True)
    parser.add_argument("--trace", help="the trace id (default: the first span's)")
    args = parser.parse_args()
    with open(args.spans, encoding="utf-8") as f:
        spans = [json.loads(line) for line in f if line.strip()]
    spans = [s for s in spans if s.get("kind") == "span"]
    trace = args.trace or spans[0]["trace_id"]
    spans = [s for s in spans if s["trace_id"] == trace]
    table = rows(spans)
    t0 = min(s["start_ns"] for s in spans)
    end = max(s["end_ns"] for s in spans)
    total_ms = (end - t0) / 1e6

    fig, ax = plt.subplots(figsize=(12, 0.42 * len(table) + 1.2))
    for i, (depth, span) in enumerate(table):
        start = (span["start_ns"] - t0) / 1e6
        width = max((span["end_ns"] - span["start_ns"]) / 1e6, total_ms / 250)
        error = span["status"]["code"] == "STATUS_CODE_ERROR"
        colour = ERROR if error else COLOURS.get(span["span_kind"], DELIVERY)
        ax.barh(i, width, left=start, height=0.6, color=colour)
        label = f"{(span['end_ns'] - span['start_ns']) / 1e6:.1f} ms"
        extra = note(span)
        ax.text(start + width + total_ms / 150, i, f"{label}  {extra}".rstrip(), va="center", fontsize=8)
        ax.text(-0.3 + 0.025 * depth, i, span["name"], va="center", ha="left", fontsize=9,
                family="monospace", transform=ax.get_yaxis_transform())
    ax.set_ylim(len(table) - 0.4, -0.6)
    ax.set_xlim(0, total_ms * 1.45)
    ax.set_yticks([])
    ax.set_xlabel("ms since the request arrived")
    resource = spans[0].get("resource", {}).get("service.name", "")
    ax.set_title(f"trace {trace}  ({resource}, {len(spans)} spans)", fontsize=10)
    legend = [Patch(color=DELIVERY, label="request, delivery, reply, dead letter"),
              Patch(color=COLOURS["SPAN_KIND_CLIENT"], label="HTTP attempt"),
              Patch(color=ERROR, label="error")]
    ax.legend(handles=legend, loc="lower right", fontsize=8, frameon=False)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    fig.subplots_adjust(left=0.3, right=0.98)
    fig.savefig(args.out, dpi=110, bbox_inches="tight")


if __name__ == "__main__":
    main()
