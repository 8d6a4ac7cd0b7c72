#!/usr/bin/env python3
"""Move Knative channels onto fanout: read what kubectl prints, write the files fanout's live
reconfiguration reads (envoy/configmap/envoy.yaml).

  knative-import.py OBJECTS.json [-o DIR] [--wasm PATH] [--resolve HOST[:PORT]=ADDRESS:PORT ...]
                    [--trusted-ca FILE] [--connect-timeout 1s]
                    [--oidc-issuer URL [--jwks FILE] [--default-authorization-mode MODE]]

OBJECTS.json is the output of

  kubectl get channels,inmemorychannels,subscriptions -A -o json

with `,eventpolicies` added where Knative's EventPolicy CRD is installed (elsewhere kubectl
fails on it: docs/knative.md shows the check) (a List), or any JSON holding such objects ("-": stdin). Into DIR (default: the current
directory) it writes

  fanout.json    the plain fan-out config, for review (`render-ecds.py filter` of it is fanout.yaml)
  fanout.yaml    ECDS: the fanout filter with that config
  clusters.yaml  CDS: one cluster per scheme, host and port that the URIs name

and, with --oidc-issuer (Knative's OIDC authentication on: who may send, by EventPolicy),

  senders-jwt.yaml   ECDS: Envoy's jwt_authn: each channel's tokens (issuer, the channel's
                     audience, signed by a key of the JWKS at --jwks)
  senders-rbac.yaml  ECDS: Envoy's rbac: per channel, the subjects its EventPolicies allow
                     (or the default authorization mode's, for a channel no policy applies to)

for envoy/configmap/envoy-senders.yaml, which runs both before fanout. EventPolicies without
--oidc-issuer are an error: dropping them would let every sender send.

Each Channel or InMemoryChannel becomes a fanout channel `<namespace>/<name>` matched by the host
of its address; its subscribers come from its spec.subscribers and from the Subscriptions in
the input; delivery specs become fanout's `delivery`, `timeout_ms`, `reply` and dead letters.
What cannot be carried over is reported by object and field: as an error when it would change
who gets an event (then nothing is written and the exit status is 1), as a warning otherwise.
The README's "Coming from Knative" has the whole mapping.

--resolve HOST[:PORT]=ADDRESS:PORT points the cluster of HOST (on PORT only, when given) at
ADDRESS:PORT instead of HOST's DNS name, e.g. to try the result against local servers. The
calls keep the URI's authority and path; https keeps its SNI and certificate check on HOST.

Python 3 standard library only; the ECDS and CDS documents are render-ecds.py's.
"""

import argparse
import importlib.util
import ipaddress
import json
import math
import os
import re
import sys
import urllib.parse
from fractions import Fraction

HERE = os.path.dirname(os.path.abspath(__file__))


def load_render_ecds():
    spec = importlib.util.spec_from_file_location("render_ecds", os.path.join(HERE, "render-ecds.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = load_render_ecds()

MESSAGING = "messaging.knative.dev"
EVENTING = "eventing.knative.dev"
CHANNEL_KINDS = ("Channel", "InMemoryChannel")
# fanout's limits (src/config.rs, src/delivery.rs): milliseconds are u32, retries at most 100.
U32_MAX = 2**32 - 1
MAX_RETRY = 100
# The CA bundle of the envoyproxy/envoy image (Ubuntu's ca-certificates): what an https cluster
# trusts when the Knative objects name no CA certificates for it.
DEFAULT_TRUSTED_CA = "/etc/ssl/certs/ca-certificates.crt"
DEFAULT_JWKS = "/etc/fanout/jwks.json"
UPSTREAM_TLS = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"
DELIVERY_FIELDS = (
    "deadLetterSink",
    "retry",
    "timeout",
    "backoffPolicy",
    "backoffDelay",
    "retryAfterMax",
    "format",
)


def fail(message):
    print(f"knative-import: {message}", file=sys.stderr)
    sys.exit(2)


class Report:
    """What the import could not carry over, each naming the object and the field."""

    def __init__(self):
        self.errors = []
        self.warnings = []

    def error(self, where, field, message):
        self._add(self.errors, f"{where}: {field}: {message}")

    def warn(self, where, field, message):
        self._add(self.warnings, f"{where}: {field}: {message}")

    @staticmethod
    def _add(lines, line):
        # A channel's delivery is mapped for each subscriber that falls back to it: say once.
        if line not in lines:
            lines.append(line)


def dig(value, *keys):
    """value[k1][k2]..., or None where a level is missing or not an object."""
    for key in keys:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


# ---------------------------------------------------------------------------------------------
# The input: Kubernetes objects, as kubectl prints them.


class KObject:
    """One Kubernetes object of the input; `label` names it in messages ("Kind ns/name")."""

    def __init__(self, doc, at):
        self.doc = doc
        self.kind = doc.get("kind") if isinstance(doc.get("kind"), str) else ""
        api_version = doc.get("apiVersion") if isinstance(doc.get("apiVersion"), str) else ""
        self.group = api_version.rpartition("/")[0]
        self.namespace = dig(doc, "metadata", "namespace") or "default"
        self.name = dig(doc, "metadata", "name") or ""
        self.uid = dig(doc, "metadata", "uid")
        self.label = (
            f"{self.kind or '?'} {self.namespace}/{self.name}" if self.name else f"{at} ({self.kind or '?'})"
        )
        self.spec = doc.get("spec") if isinstance(doc.get("spec"), dict) else {}
        self.status = doc.get("status") if isinstance(doc.get("status"), dict) else {}

    def key(self):
        return (self.kind, self.namespace, self.name)


def read_objects(path, report):
    try:
        if path == "-":
            text = sys.stdin.read()
        else:
            with open(path, encoding="utf-8") as f:
                text = f.read()
    except OSError as e:
        fail(f"cannot read {path}: {e}")
    documents = []
    decoder = json.JSONDecoder()
    at = 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            break
        try:
            document, at = decoder.raw_decode(text, at)
        except ValueError as e:
            fail(f"{path} is not JSON (kubectl get ... -o json): {e}")
        documents.append(document)
    if not documents:
        fail(f"{path} is empty")
    objects = []

    def walk(document, at):
        if isinstance(document, list):
            for i, item in enumerate(document):
                walk(item, f"{at}[{i}]")
        elif isinstance(document, dict) and isinstance(document.get("items"), list):
            for i, item in enumerate(document["items"]):
                walk(item, f"{at}.items[{i}]" if at else f"items[{i}]")
        elif isinstance(document, dict) and isinstance(document.get("kind"), str):
            objects.append(KObject(document, at or "the input"))
        else:
            report.error(at or "the input", "kind", "not a Kubernetes object (no kind), nor a List of them")

    for i, document in enumerate(documents):
        walk(document, "" if len(documents) == 1 else f"document {i + 1}")
    return objects


# ---------------------------------------------------------------------------------------------
# Values: durations and URIs.

NUMBER = r"(\d+(?:[.,]\d+)?)"
DURATION = re.compile(
    rf"^([+-]?)P(?:{NUMBER}Y)?(?:{NUMBER}M)?(?:{NUMBER}W)?(?:{NUMBER}D)?"
    rf"(?:(T)(?:{NUMBER}H)?(?:{NUMBER}M)?(?:{NUMBER}S)?)?$"
)
DAY_MS = 86_400_000
# Years and months as Knative's duration parser (rickb777/date v1) counts them.
DURATION_UNITS_MS = (
    Fraction(3652425, 10000) * DAY_MS,
    Fraction(30436875, 1000000) * DAY_MS,
    7 * DAY_MS,
    DAY_MS,
    3_600_000,
    60_000,
    1000,
)


def duration_ms(value, where, field, report, allow_zero):
    """An ISO-8601 duration (PT0.2S, PT1M, PT1H30M, P1D) in whole milliseconds, or None."""
    example = "e.g. PT0.2S, PT1M, PT1H30M or P1D"
    if not isinstance(value, str):
        report.error(where, field, f"{json.dumps(value)} is not an ISO-8601 duration string ({example})")
        return None
    match = DURATION.match(value) if value != "P0" else DURATION.match("P0D")
    if match is None:
        report.error(where, field, f"{value!r} is not an ISO-8601 duration ({example})")
        return None
    sign, *numbers = match.groups()
    has_t = numbers.pop(4) is not None
    if all(n is None for n in numbers) or (has_t and all(n is None for n in numbers[4:])):
        report.error(where, field, f"{value!r} is not an ISO-8601 duration: it names no amount ({example})")
        return None
    if sign == "-":
        report.error(where, field, f"{value!r}: must not be negative")
        return None
    exact = Fraction(0)
    as_knative = Fraction(0)
    for number, unit in zip(numbers, DURATION_UNITS_MS):
        if number is None:
            continue
        whole, _, decimals = number.replace(",", ".").partition(".")
        exact += Fraction(number.replace(",", ".")) * unit
        # Knative's parser keeps one decimal of each number (PT0.25S is 0.2 s there).
        as_knative += Fraction(int(whole + (decimals[:1] or "0")), 10) * unit
    ms = math.floor(exact + Fraction(1, 2))
    if ms > U32_MAX:
        report.error(where, field, f"{value!r} is {ms} ms: fanout takes at most {U32_MAX} ms (about 49 days)")
        return None
    if ms == 0 and not allow_zero:
        report.error(where, field, f"{value!r}: must be more than 0")
        return None
    knative_ms = math.floor(as_knative + Fraction(1, 2))
    if knative_ms != ms:
        report.warn(
            where,
            field,
            f"{value!r}: Knative's duration parser keeps one decimal of each number, so Knative "
            f"used {knative_ms} ms; fanout uses {ms} ms",
        )
    return ms


HOST_NAME = re.compile(r"^[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*\.?$")


class Uri:
    """An http(s) URI as fanout calls it: a cluster (scheme, host, port), authority and path."""

    def __init__(self, scheme, host, port, authority, path):
        self.scheme, self.host, self.port, self.authority, self.path = scheme, host, port, authority, path


def parse_uri(uri, where, field, report):
    if not isinstance(uri, str) or not uri:
        report.error(where, field, f"{json.dumps(uri)} is not a URI")
        return None
    try:
        parts = urllib.parse.urlsplit(uri)
        port = parts.port
    except ValueError as e:
        report.error(where, field, f"{uri!r} is not a URI: {e}")
        return None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        report.error(where, field, f"{uri!r}: fanout calls absolute http and https URIs only")
        return None
    if parts.username is not None or parts.password is not None:
        report.error(
            where,
            field,
            f"{uri!r}: credentials in a URI are not carried over; use a URI without them",
        )
        return None
    host = (parts.hostname or "").lower()
    is_ip = True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        is_ip = False
    if not host or not (is_ip or HOST_NAME.match(host)):
        report.error(where, field, f"{uri!r}: no valid host name")
        return None
    authority = f"[{host}]" if ":" in host else host
    if port is not None:
        authority += f":{port}"
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    if any(ord(c) <= 0x20 or ord(c) >= 0x7F for c in path):
        report.error(where, field, f"{uri!r}: the path has characters that must be percent-encoded")
        return None
    return Uri(
        scheme, host, port if port is not None else (443 if scheme == "https" else 80), authority, path
    )


def is_absolute_uri(value):
    if not isinstance(value, str):
        return False
    try:
        parts = urllib.parse.urlsplit(value)
    except ValueError:
        return False
    return bool(parts.scheme and parts.netloc)


# ---------------------------------------------------------------------------------------------
# Clusters: one per (scheme, host, port).


class Clusters:
    """The clusters the call targets name: one per (scheme, host, port) of their URIs."""

    def __init__(self):
        self.by_key = {}

    def target(self, uri, where, field, report, ca_certs=None):
        """The fanout call target for `uri` ({cluster, authority, path}), registering its cluster."""
        parsed = parse_uri(uri, where, field, report)
        if parsed is None:
            return None
        key = (parsed.scheme, parsed.host, parsed.port)
        entry = self.by_key.setdefault(
            key,
            {
                "name": f"{parsed.scheme}|{parsed.host}|{parsed.port}",
                "ca_certs": [],
                "without_ca": [],
                "with_ca": [],
            },
        )
        if parsed.scheme == "https":
            if isinstance(ca_certs, str) and ca_certs.strip():
                if ca_certs.strip() not in entry["ca_certs"]:
                    entry["ca_certs"].append(ca_certs.strip())
                entry["with_ca"].append((where, field))
            else:
                entry["without_ca"].append((where, field))
        return {"cluster": entry["name"], "authority": parsed.authority, "path": parsed.path}

    def resources(self, resolve, trusted_ca, connect_timeout, report):
        resources = []
        for (scheme, host, port), entry in sorted(self.by_key.items(), key=lambda kv: kv[1]["name"]):
            address = resolve.address(host, port)
            cluster = render.cluster(entry["name"], *address, connect_timeout)
            if scheme == "https":
                if entry["ca_certs"] and entry["without_ca"]:
                    named_where, named_field = entry["with_ca"][0]
                    report.warn(
                        *entry["without_ca"][0],
                        f"names no CA certificates, but {named_where} {named_field} does, for the "
                        f"same cluster {entry['name']}: the cluster trusts only the named ones",
                    )
                if len(entry["ca_certs"]) > 1:
                    report.warn(
                        *entry["with_ca"][0],
                        f"the URIs of cluster {entry['name']} name {len(entry['ca_certs'])} "
                        "different sets of CA certificates: the cluster trusts all of them",
                    )
                cluster["transport_socket"] = tls_socket(host, entry["ca_certs"], trusted_ca)
            resources.append(cluster)
        return resources


def tls_socket(host, ca_certs, trusted_ca):
    """TLS to `host`: SNI set to it, its certificate checked against the given CA certificates
    (as Knative's CACerts) or the trust store file, and for the host's name."""
    host = host.rstrip(".")
    try:
        ipaddress.ip_address(host)
        san, sni = {"san_type": "IP_ADDRESS", "matcher": {"exact": host}}, None
    except ValueError:
        san, sni = {"san_type": "DNS", "matcher": {"exact": host}}, host
    trusted = {"inline_string": "\n".join(ca_certs) + "\n"} if ca_certs else {"filename": trusted_ca}
    context = {
        "@type": UPSTREAM_TLS,
        "common_tls_context": {
            "validation_context": {"trusted_ca": trusted, "match_typed_subject_alt_names": [san]}
        },
    }
    if sni:
        context["sni"] = sni
    return {"name": "envoy.transport_sockets.tls", "typed_config": context}


class Resolve:
    """--resolve HOST[:PORT]=ADDRESS:PORT: where a cluster's one endpoint is instead of its host."""

    def __init__(self, specs):
        self.entries = []
        for spec in specs:
            target, sep, address = spec.partition("=")
            addr_host, colon, addr_port = address.rpartition(":")
            if target.startswith("["):  # [IPv6] or [IPv6]:PORT
                host, _, rest = target[1:].partition("]")
                port = rest[1:] if rest.startswith(":") else (None if not rest else "?")
            elif target.count(":") == 1:
                host, _, port = target.partition(":")
            else:
                host, port = target, None
            if not sep or not host or not colon or not addr_host:
                fail(f"--resolve {spec!r}: expected HOST[:PORT]=ADDRESS:PORT")
            try:
                addr_port = int(addr_port)
                port = int(port) if port is not None else None
            except ValueError:
                fail(f"--resolve {spec!r}: a port is not a number")
            if not 0 < addr_port < 65536:
                fail(f"--resolve {spec!r}: port out of range")
            self.entries.append(
                {
                    "spec": spec,
                    "host": host.lower(),
                    "port": port,
                    "address": (addr_host.strip("[]"), addr_port),
                    "used": False,
                }
            )

    def address(self, host, port):
        for entry in self.entries:
            if entry["host"] == host and entry["port"] in (None, port):
                entry["used"] = True
                return entry["address"]
        return (host, port)

    def report_unused(self, report):
        for entry in self.entries:
            if not entry["used"]:
                report.warn("--resolve", entry["spec"], "no URI in the input names this host (and port)")


# ---------------------------------------------------------------------------------------------
# Delivery: Knative's DeliverySpec into fanout's delivery.


class DeadLetter:
    """A resolved dead-letter sink: its URI, CA certificates and where it was written."""

    def __init__(self, uri, ca_certs, where, field):
        self.uri, self.ca_certs, self.where, self.field = uri, ca_certs, where, field


class Delivery:
    """A DeliverySpec as written at `where`/`field`, with its dead letter resolved."""

    def __init__(self, spec, dead_letter, where, field):
        self.spec, self.dead_letter, self.where, self.field = spec, dead_letter, where, field


def warn_audience(value, where, field, report):
    if value:
        report.warn(
            where,
            field,
            f"OIDC audience {value!r}: fanout sends no OIDC token; the receiver must accept "
            "events without one",
        )


def destination_uri(destination, resolved, namespace, where, field, resolved_field, report):
    """The URI a Knative Destination ({ref, uri, CACerts, audience}) stands for: what Knative
    resolved it to (`resolved`, from a status), else its own absolute uri. None, with an error,
    when only Knative could resolve it."""
    if isinstance(resolved, str) and resolved:
        return resolved
    if not isinstance(destination, dict):
        report.error(where, field, f"{json.dumps(destination)} is not a Destination ({{ref, uri}})")
        return None
    uri, ref = destination.get("uri"), destination.get("ref")
    if is_absolute_uri(uri):
        return uri
    if isinstance(ref, dict):
        named = f"{ref.get('kind', '?')} {ref.get('namespace') or namespace}/{ref.get('name', '?')}"
        report.error(
            where,
            f"{field}.ref",
            f"{named} is not resolved to a URI ({resolved_field} is empty): fanout cannot "
            "resolve references; let Knative resolve it first, or write an absolute uri",
        )
    elif uri:
        report.error(where, f"{field}.uri", f"{uri!r} is relative and there is no ref to resolve it against")
    else:
        report.error(where, field, "has neither a ref nor a uri")
    return None


def delivery_dead_letter(delivery, status, status_path, obj, field, report):
    """The dead letter of the DeliverySpec at `field` of `obj`: as Knative resolved it into
    `status` (the object at `status_path`, with deadLetterSinkUri, -CACerts, -Audience), else
    the sink's own absolute uri. None without a sink, or (with an error) when unresolved."""
    sink = delivery.get("deadLetterSink")
    resolved = dig(status, "deadLetterSinkUri")
    if sink is None and not resolved:
        return None
    resolved_field = f"{status_path}.deadLetterSinkUri" if status_path else f"{field}.deadLetterSink.uri"
    uri = destination_uri(
        sink, resolved, obj.namespace, obj.label, f"{field}.deadLetterSink", resolved_field, report
    )
    if uri is None:
        return None
    if resolved:
        warn_audience(
            dig(status, "deadLetterSinkAudience"), obj.label, f"{status_path}.deadLetterSinkAudience", report
        )
        return DeadLetter(uri, dig(status, "deadLetterSinkCACerts"), obj.label, resolved_field)
    warn_audience(dig(sink, "audience"), obj.label, f"{field}.deadLetterSink.audience", report)
    return DeadLetter(uri, dig(sink, "CACerts"), obj.label, f"{field}.deadLetterSink.uri")


def map_delivery(delivery, dead_letter, where, field, clusters, report):
    """Knative DeliverySpec at `field` -> (fanout delivery, the per-request timeout in ms)."""
    if not isinstance(delivery, dict):
        report.error(where, field, f"{json.dumps(delivery)} is not a DeliverySpec")
        return {}, None
    for name in delivery:
        if name not in DELIVERY_FIELDS:
            report.warn(where, f"{field}.{name}", "not a field of Knative's DeliverySpec; ignored")
    out = {}
    retry = delivery.get("retry")
    if retry is not None and (not isinstance(retry, int) or isinstance(retry, bool) or retry < 0):
        report.error(where, f"{field}.retry", f"{json.dumps(retry)}: must be a whole number, 0 or more")
        retry = None
    elif retry is not None and retry > MAX_RETRY:
        report.error(where, f"{field}.retry", f"{retry}: fanout retries at most {MAX_RETRY} times")
        retry = None
    timeout = None
    if delivery.get("timeout") is not None:
        timeout = duration_ms(delivery["timeout"], where, f"{field}.timeout", report, allow_zero=False)
    policy = delivery.get("backoffPolicy")
    if policy is not None and policy not in ("linear", "exponential"):
        report.error(where, f"{field}.backoffPolicy", f"{json.dumps(policy)}: must be linear or exponential")
        policy = None
    delay = None
    if delivery.get("backoffDelay") is not None:
        delay = duration_ms(delivery["backoffDelay"], where, f"{field}.backoffDelay", report, allow_zero=True)
    retry_after_max = None
    if delivery.get("retryAfterMax") is not None:
        retry_after_max = duration_ms(
            delivery["retryAfterMax"], where, f"{field}.retryAfterMax", report, allow_zero=True
        )
    # Knative's FormatType (pkg/apis/duck/v1/delivery_types.go): "json" (structured) or
    # "binary"; fanout takes both words as they are.
    event_format = delivery.get("format")
    if event_format is not None and event_format not in ("json", "binary"):
        report.error(
            where,
            f"{field}.format",
            f"{json.dumps(event_format)}: Knative's formats are json (structured mode) and binary",
        )
        event_format = None
    if retry:
        out["retry"] = retry
        if policy is not None and delay is not None:
            out["backoff_policy"] = policy
            # Knative waits delay * 2^(n-1) (exponential) or delay * (n-1) (linear) before retry
            # n; fanout waits delay * 2^n or delay * n. Exponential maps exactly with half the
            # delay; linear keeps the delay (each fanout wait is one delay longer).
            out["backoff_delay_ms"] = (delay + 1) // 2 if policy == "exponential" else delay
            longest = out["backoff_delay_ms"] * (2**retry if policy == "exponential" else retry)
        else:
            if policy is not None or delay is not None:
                given = "backoffPolicy" if policy is not None else "backoffDelay"
                missing = "backoffDelay" if policy is not None else "backoffPolicy"
                report.warn(
                    where,
                    f"{field}.{given}",
                    f"without {missing}, Knative's dispatcher does not wait between retries; "
                    "neither does fanout (backoff_delay_ms 0)",
                )
            out["backoff_delay_ms"] = 0
            longest = 0
        longest = min(longest, U32_MAX)
        # fanout has one cap on every wait, Retry-After included: backoff_max_ms. It must not
        # cut Knative's computed backoff (which has no cap), so it is at least the longest one.
        cap = longest
        if retry_after_max is not None:
            if retry_after_max == 0:
                report.warn(
                    where,
                    f"{field}.retryAfterMax",
                    "PT0S (ignore Retry-After) has no equivalent: fanout honours Retry-After, up "
                    f"to backoff_max_ms ({longest} ms, the longest backoff)",
                )
            elif retry_after_max < longest:
                report.warn(
                    where,
                    f"{field}.retryAfterMax",
                    f"{delivery['retryAfterMax']!r} is less than the longest backoff ({longest} ms) "
                    "and has no equivalent: fanout's one cap on every wait, backoff_max_ms, cannot "
                    f"cut Knative's backoff, so it is {longest} ms and a Retry-After can make "
                    "fanout wait up to that",
                )
            else:
                cap = retry_after_max
        out["backoff_max_ms"] = cap
    if event_format is not None:
        out["format"] = event_format
    if dead_letter is not None:
        target = clusters.target(
            dead_letter.uri, dead_letter.where, dead_letter.field, report, dead_letter.ca_certs
        )
        if target is not None:
            if timeout is not None:
                target["timeout_ms"] = timeout
            out["dead_letter"] = target
    return out, timeout


# ---------------------------------------------------------------------------------------------
# Channels and their subscribers.


class FanoutChannel:
    """One fanout channel: a Channel or InMemoryChannel, or a Channel with its backing channel."""

    def __init__(self, primary, members):
        self.primary = primary
        self.members = members  # the backing channel (the dispatcher's truth) first
        self.name = f"{primary.namespace}/{primary.name}"
        self.subscribers = []
        self.uids = {}
        self.names = set()
        self._channel_delivery = None

    def hosts(self, report, checks_senders):
        """The hosts of the channel's addresses (status.address, status.addresses)."""
        schemes = {}
        for member in self.members:
            urls = [dig(member.status, "address", "url")]
            addresses = member.status.get("addresses")
            if isinstance(addresses, list):
                urls += [dig(a, "url") for a in addresses]
            for url in urls:
                if isinstance(url, str) and url:
                    parts = urllib.parse.urlsplit(url)
                    if parts.hostname:
                        schemes.setdefault(parts.hostname.lower(), set()).add(parts.scheme.lower())
            audience = dig(member.status, "address", "audience")
            if audience and not checks_senders:
                report.warn(
                    member.label,
                    "status.address.audience",
                    f"senders' OIDC tokens (audience {audience!r}) are not checked: run the import "
                    "with --oidc-issuer to enforce who may send",
                )
        hosts = list(schemes)
        for host in (h for h, s in schemes.items() if s == {"https"}):
            report.warn(
                self.primary.label,
                "status.address.url",
                f"senders reach this channel over https ({host}); the configmap bootstrap's "
                "listener is plain HTTP: terminate TLS in front of it",
            )
        if hosts:
            return hosts
        imc = self.in_memory_name()
        if imc is not None:
            host = f"{imc}-kn-channel.{self.primary.namespace}.svc.cluster.local"
            report.warn(
                self.primary.label,
                "status.address.url",
                f"missing: matched by the InMemoryChannel's conventional host {host}",
            )
            return [host]
        report.error(
            self.primary.label,
            "status.address.url",
            "missing, and the channel is not an InMemoryChannel whose conventional host could "
            "stand in: fanout could not tell which requests are for it",
        )
        return []

    def in_memory_name(self):
        for member in self.members:
            if member.kind == "InMemoryChannel":
                return member.name
        backing = self.primary.status.get("channel") or dig(self.primary.spec, "channelTemplate")
        if self.primary.kind == "Channel" and dig(backing, "kind") in (None, "InMemoryChannel"):
            return dig(self.primary.status, "channel", "name") or self.primary.name
        return None

    def channel_delivery(self, report):
        """The channel's spec.delivery, for subscribers without a delivery of their own; None
        without one. Resolved once, when a subscriber first needs it."""
        if self._channel_delivery is None:
            self._channel_delivery = [None]
            for member in self.members:
                spec = member.spec.get("delivery")
                if spec is None:
                    continue
                dead_letter = None
                if isinstance(spec, dict):
                    dead_letter = delivery_dead_letter(
                        spec, member.status, "status", member, "spec.delivery", report
                    )
                self._channel_delivery = [Delivery(spec, dead_letter, member.label, "spec.delivery")]
                break
        return self._channel_delivery[0]


def subscriber(where, uri, uri_field, ca_certs, reply, delivery, clusters, report):
    """One fanout subscriber. `reply`: (URI, its field, CA certificates) or None; `delivery`:
    a Delivery or None."""
    target = clusters.target(uri, where, uri_field, report, ca_certs)
    if target is None:
        return None
    timeout = None
    if delivery is not None:
        mapped, timeout = map_delivery(
            delivery.spec, delivery.dead_letter, delivery.where, delivery.field, clusters, report
        )
        # Knative's dispatcher sends the event, its reply and its dead letter with the same
        # per-request timeout.
        if timeout is not None:
            target["timeout_ms"] = timeout
        if mapped:
            target["delivery"] = mapped
    if reply is not None:
        reply_target = clusters.target(reply[0], where, reply[1], report, reply[2])
        if reply_target is not None:
            if timeout is not None:
                reply_target["timeout_ms"] = timeout
            target["reply"] = reply_target
    return target


def warn_auth(auth, where, field, report):
    account = dig(auth, "serviceAccountName") or dig(auth, "serviceAccountNames")
    if account:
        report.warn(where, field, f"OIDC service account {json.dumps(account)}: fanout sends no OIDC token")


def import_channel_subscribers(channel, clusters, report):
    """The channel's spec.subscribers: what Knative's dispatcher delivers to."""
    for member in channel.members:
        entries = member.spec.get("subscribers") or []
        if not isinstance(entries, list):
            report.error(member.label, "spec.subscribers", "is not a list")
            continue
        for i, entry in enumerate(entries):
            at = f"spec.subscribers[{i}]"
            if not isinstance(entry, dict):
                report.error(member.label, at, "is not a subscriber")
                continue
            uid, name = entry.get("uid"), entry.get("name")
            if uid and uid in channel.uids:
                continue  # the same Subscription, listed by the Channel and its backing channel
            if not entry.get("subscriberUri"):
                why = (
                    "the subscriber has only a replyUri: Knative's dispatcher cannot deliver to it "
                    "either, and fanout has no reply-only subscriber"
                    if entry.get("replyUri")
                    else "no URI to deliver to"
                )
                report.error(member.label, f"{at}.subscriberUri", f"missing ({name or 'unnamed'}): {why}")
                continue
            for audience in ("subscriberAudience", "replyAudience"):
                warn_audience(entry.get(audience), member.label, f"{at}.{audience}", report)
            warn_auth(entry.get("auth"), member.label, f"{at}.auth", report)
            spec = entry.get("delivery")
            if spec is not None:
                # The subscriber's delivery replaces the channel's whole (Channelable contract);
                # Knative's reconciler has already put the resolved dead letter into it.
                dead_letter = None
                if isinstance(spec, dict):
                    dead_letter = delivery_dead_letter(spec, None, None, member, f"{at}.delivery", report)
                delivery = Delivery(spec, dead_letter, member.label, f"{at}.delivery")
            else:
                delivery = channel.channel_delivery(report)
            reply = None
            if entry.get("replyUri"):
                reply = (entry["replyUri"], f"{at}.replyUri", entry.get("replyCACerts"))
            mapped = subscriber(
                member.label,
                entry["subscriberUri"],
                f"{at}.subscriberUri",
                entry.get("subscriberCACerts"),
                reply,
                delivery,
                clusters,
                report,
            )
            if mapped is not None:
                channel.subscribers.append(mapped)
                if uid:
                    channel.uids[uid] = (mapped, member.label, at)
                if name:
                    channel.names.add((entry.get("namespace") or member.namespace, name))


def import_subscription(sub, channel, clusters, report):
    """A Subscription that the channel's spec.subscribers do not list (yet), the way Knative's
    Subscription reconciler would add it: its URIs as resolved in status.physicalSubscription,
    its own delivery replacing the channel's whole, its dead letter as resolved in its status."""
    physical = sub.status.get("physicalSubscription")
    physical = physical if isinstance(physical, dict) else {}
    physical_path = "status.physicalSubscription"
    if sub.spec.get("subscriber") is None:
        report.error(
            sub.label,
            "spec.subscriber",
            "missing: the Knative spec requires a subscriber, and fanout has no reply-only subscriber",
        )
        return
    uri = destination_uri(
        sub.spec["subscriber"],
        physical.get("subscriberUri"),
        sub.namespace,
        sub.label,
        "spec.subscriber",
        f"{physical_path}.subscriberUri",
        report,
    )
    uri_field = f"{physical_path}.subscriberUri" if physical.get("subscriberUri") else "spec.subscriber.uri"
    reply = None
    if sub.spec.get("reply") is not None or physical.get("replyUri"):
        reply_uri = destination_uri(
            sub.spec.get("reply"),
            physical.get("replyUri"),
            sub.namespace,
            sub.label,
            "spec.reply",
            f"{physical_path}.replyUri",
            report,
        )
        if reply_uri is None:
            return
        reply_ca = physical.get("replyCACerts") or dig(sub.spec, "reply", "CACerts")
        reply = (
            reply_uri,
            f"{physical_path}.replyUri" if physical.get("replyUri") else "spec.reply.uri",
            reply_ca,
        )
    if uri is None:
        return
    for role in ("subscriber", "reply"):
        if physical.get(f"{role}Audience"):
            warn_audience(physical[f"{role}Audience"], sub.label, f"{physical_path}.{role}Audience", report)
        else:
            warn_audience(dig(sub.spec, role, "audience"), sub.label, f"spec.{role}.audience", report)
    warn_auth(sub.status.get("auth"), sub.label, "status.auth", report)
    spec = sub.spec.get("delivery")
    if spec is not None:
        dead_letter = None
        if isinstance(spec, dict):
            dead_letter = delivery_dead_letter(spec, physical, physical_path, sub, "spec.delivery", report)
        delivery = Delivery(spec, dead_letter, sub.label, "spec.delivery")
    else:
        delivery = channel.channel_delivery(report)
        if delivery is not None and physical.get("deadLetterSinkUri"):
            dead_letter = DeadLetter(
                physical["deadLetterSinkUri"],
                physical.get("deadLetterSinkCACerts"),
                sub.label,
                f"{physical_path}.deadLetterSinkUri",
            )
            delivery = Delivery(delivery.spec, dead_letter, delivery.where, delivery.field)
    ca = physical.get("subscriberCACerts") or dig(sub.spec, "subscriber", "CACerts")
    mapped = subscriber(sub.label, uri, uri_field, ca, reply, delivery, clusters, report)
    if mapped is not None:
        channel.subscribers.append(mapped)


def group_channels(channel_objects):
    """Each Channel with its backing channel (what its status.channel names, or the
    InMemoryChannel of the same name that it owns) as one fanout channel."""
    by_key = {o.key(): o for o in channel_objects}
    backing_of = {}
    for channel in channel_objects:
        if channel.kind != "Channel":
            continue
        ref = channel.status.get("channel")
        key = None
        if isinstance(ref, dict) and ref.get("name"):
            key = (ref.get("kind", "InMemoryChannel"), ref.get("namespace") or channel.namespace, ref["name"])
        else:
            key = ("InMemoryChannel", channel.namespace, channel.name)
        if key in by_key and key != channel.key():
            backing_of[channel.key()] = by_key[key]
    consumed = {b.key() for b in backing_of.values()}
    groups = []
    index = {}
    for obj in sorted(channel_objects, key=lambda o: (o.namespace, o.name, o.kind)):
        if obj.key() in consumed:
            continue
        members = [backing_of[obj.key()], obj] if obj.key() in backing_of else [obj]
        group = FanoutChannel(obj, members)
        groups.append(group)
        for member in members:
            index[member.key()] = group
    return groups, index


def convert(objects, report, checks_senders=False):
    """Knative objects -> (fanout config, the Clusters its targets use, the FanoutChannels,
    the EventPolicies of the input). `checks_senders`: the senders' tokens are checked
    (--oidc-issuer)."""
    clusters = Clusters()
    channel_objects, subscriptions, policies = [], [], []
    seen = {}
    for obj in objects:
        if obj.group == EVENTING and obj.kind == "EventPolicy":
            if obj.key() in seen:
                report.warn(
                    obj.label, "metadata", f"listed twice ({seen[obj.key()]} and here); the first is used"
                )
                continue
            seen[obj.key()] = obj.label
            policies.append(obj)
        elif obj.group == MESSAGING and obj.kind in CHANNEL_KINDS + ("Subscription",):
            if not obj.name:
                report.error(obj.label, "metadata.name", "missing")
                continue
            if obj.key() in seen:
                report.warn(
                    obj.label, "metadata", f"listed twice ({seen[obj.key()]} and here); the first is used"
                )
                continue
            seen[obj.key()] = obj.label
            (subscriptions if obj.kind == "Subscription" else channel_objects).append(obj)
        elif obj.spec.get("subscribers") or obj.spec.get("subscriber"):
            field = "spec.subscribers" if obj.spec.get("subscribers") else "spec.subscriber"
            report.error(
                obj.label,
                field,
                f"{obj.kind} ({obj.group or 'core'}) is not a kind this command imports (Channel, "
                "InMemoryChannel, Subscription): its subscribers would get no events from fanout",
            )
        else:
            report.warn(obj.label, "kind", f"{obj.kind} ({obj.group or 'core'}) is not imported; ignored")
    if not channel_objects:
        report.error(
            "the input",
            "items",
            "holds no Channel or InMemoryChannel (messaging.knative.dev): nothing to move",
        )
    groups, index = group_channels(channel_objects)
    for group in groups:
        import_channel_subscribers(group, clusters, report)
    namespaces = {o.namespace for o in channel_objects}
    for sub in sorted(subscriptions, key=lambda s: (s.namespace, s.name)):
        ref = sub.spec.get("channel")
        if not isinstance(ref, dict) or not ref.get("name"):
            report.error(sub.label, "spec.channel", "missing or without a name")
            continue
        key = (ref.get("kind", "Channel"), ref.get("namespace") or sub.namespace, ref["name"])
        group = index.get(key)
        if group is None:
            named = f"{key[0]} {key[1]}/{key[2]}"
            if key[1] in namespaces and key[0] in CHANNEL_KINDS:
                report.error(
                    sub.label,
                    "spec.channel",
                    f"{named} is not in the input, though other channels of namespace {key[1]} "
                    "are: its subscriber would be left out. Add the channel, or leave the "
                    "Subscription out of the input",
                )
            else:
                report.warn(
                    sub.label,
                    "spec.channel",
                    f"{named} is not in the input; the Subscription is not imported",
                )
            continue
        listed = group.uids.get(sub.uid) if sub.uid else None
        if listed is not None or (sub.namespace, sub.name) in group.names:
            physical_uri = dig(sub.status, "physicalSubscription", "subscriberUri")
            if listed is not None and physical_uri:
                parsed = parse_uri(
                    physical_uri, sub.label, "status.physicalSubscription.subscriberUri", Report()
                )
                mapped, where, at = listed
                if parsed is not None and (parsed.authority, parsed.path) != (
                    mapped["authority"],
                    mapped["path"],
                ):
                    report.warn(
                        sub.label,
                        "status.physicalSubscription.subscriberUri",
                        f"differs from {where} {at}.subscriberUri, which Knative's dispatcher "
                        "uses and so does the import",
                    )
            continue
        import_subscription(sub, group, clusters, report)
    channels = []
    owner_of_host = {}
    for group in groups:
        hosts = group.hosts(report, checks_senders)
        for host in hosts:
            if host in owner_of_host:
                report.error(
                    group.primary.label, "status.address.url", f"host {host} is also {owner_of_host[host]}'s"
                )
            owner_of_host[host] = group.primary.label
        group.host_names = hosts
        channels.append({"name": group.name, "hosts": hosts, "subscribers": group.subscribers})
    return {"channels": channels}, clusters, groups, policies

# ---------------------------------------------------------------------------------------------
# Who may send: EventPolicies into Envoy's jwt_authn and rbac filters.
#
# Knative's rules (knative/eventing pkg/auth/verifier.go and event_policy.go): with OIDC
# authentication on, every request needs a token for the channel's audience (else 401); the
# EventPolicies that apply to the channel (spec.to empty: every resource of the policy's
# namespace; a ref: that resource by group, kind and name; a selector: by group, kind and
# labels) allow the subjects of their status.from (spec.from resolved by Knative), each exact
# or, ending in "*", a prefix, compared without case; any applying policy may allow. A channel
# no policy applies to falls back to the default authorization mode: allow-same-namespace
# (Knative's default: subjects system:serviceaccount:<the channel's namespace>:*), allow-all,
# or deny-all. Anything else gets 403.

AUTHORIZATION_MODES = ("allow-same-namespace", "allow-all", "deny-all")
JWT_TYPE = "type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication"
RBAC_TYPE = "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC"
SERVICE_ACCOUNT_PREFIX = "system:serviceaccount"


def selector_matches(selector, labels, where, field, report):
    """A Kubernetes label selector (matchLabels, matchExpressions) against `labels`."""
    labels = labels if isinstance(labels, dict) else {}
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for i, expression in enumerate(selector.get("matchExpressions") or []):
        key, operator = dig(expression, "key"), dig(expression, "operator")
        values = dig(expression, "values") or []
        if operator == "In":
            ok = labels.get(key) in values
        elif operator == "NotIn":
            ok = labels.get(key) not in values
        elif operator == "Exists":
            ok = key in labels
        elif operator == "DoesNotExist":
            ok = key not in labels
        else:
            report.error(where, f"{field}.matchExpressions[{i}].operator", f"{operator!r} is not a selector operator")
            return False
        if not ok:
            return False
    return True


def policy_applies(policy, member, report):
    """Whether EventPolicy `policy` applies to the channel object `member`."""
    if policy.namespace != member.namespace:
        return False
    to = policy.spec.get("to") or []
    if not to:
        return True
    for i, entry in enumerate(to):
        ref, selector = dig(entry, "ref"), dig(entry, "selector")
        if isinstance(ref, dict):
            group = str(ref.get("apiVersion") or "").rpartition("/")[0]
            if (
                str(ref.get("name", "")).lower() == member.name.lower()
                and group.lower() == member.group.lower()
                and str(ref.get("kind", "")).lower() == member.kind.lower()
            ):
                return True
        if isinstance(selector, dict):
            group = str(selector.get("apiVersion") or "").rpartition("/")[0]
            if (
                group.lower() == member.group.lower()
                and str(selector.get("kind", "")).lower() == member.kind.lower()
                and selector_matches(
                    selector, dig(member.doc, "metadata", "labels"), policy.label, f"spec.to[{i}].selector", report
                )
            ):
                return True
    return False


def policy_subjects(policy, report):
    """The subjects `policy` allows: status.from (what Knative resolved spec.from to), else the
    `sub`s and ServiceAccount refs of spec.from; None (with an error) when only Knative could
    resolve them."""
    resolved = policy.status.get("from")
    if isinstance(resolved, list) and resolved:
        return [str(s) for s in resolved]
    subjects = []
    for i, entry in enumerate(policy.spec.get("from") or []):
        sub, ref = dig(entry, "sub"), dig(entry, "ref")
        if isinstance(sub, str) and sub:
            subjects.append(sub)
        elif isinstance(ref, dict) and ref.get("kind") == "ServiceAccount" and ref.get("name"):
            namespace = ref.get("namespace") or policy.namespace
            subjects.append(f"{SERVICE_ACCOUNT_PREFIX}:{namespace}:{ref['name']}")
        elif isinstance(ref, dict):
            report.error(
                policy.label,
                f"spec.from[{i}].ref",
                f"{ref.get('kind')} {ref.get('namespace') or policy.namespace}/{ref.get('name')}: only "
                "Knative can tell its OIDC subject, and status.from is empty: export the policy "
                "once Knative has resolved it (status.from), or name the subject with `sub`",
            )
            return None
        else:
            report.error(policy.label, f"spec.from[{i}]", "neither a ref nor a sub")
            return None
    return subjects


def channel_senders(group, policies, default_mode, report):
    """The subject patterns allowed to send to `group`, or "any" (allow-all)."""
    applying = [p for p in policies if any(policy_applies(p, m, report) for m in group.members)]
    if not applying:
        if default_mode == "allow-all":
            return "any"
        if default_mode == "deny-all":
            return []
        return [f"{SERVICE_ACCOUNT_PREFIX}:{group.primary.namespace}:*"]
    allowed = []
    for policy in sorted(applying, key=lambda p: p.name):
        if policy.spec.get("filters"):
            report.error(
                policy.label,
                "spec.filters",
                "Envoy's rbac cannot read an event's attributes: a sender allowed only for some "
                "events would be allowed for all. Drop the filters, or keep this channel on Knative",
            )
        subjects = policy_subjects(policy, report)
        allowed += subjects or []
    return allowed


def channel_audience(group, report):
    for member in group.members:
        audience = dig(member.status, "address", "audience")
        if isinstance(audience, str) and audience:
            return audience
    report.error(
        group.primary.label,
        "status.address.audience",
        "missing: with OIDC authentication a channel's tokens are for its audience, and without "
        "one fanout's jwt_authn could not tell a token for this channel from another's",
    )
    return None


def host_regex(hosts):
    # The :authority as fanout reads it: any case, any port.
    names = "|".join(re.escape(h) for h in hosts)
    return f"(?i)^({names})(:[0-9]+)?$"


def subject_principal(subject):
    match = (
        {"prefix": subject[:-1], "ignore_case": True}
        if subject.endswith("*")
        else {"exact": subject, "ignore_case": True}
    )
    return {
        "metadata": {
            "filter": "envoy.filters.http.jwt_authn",
            "path": [{"key": "jwt_payload"}, {"key": "sub"}],
            "value": {"string_match": match},
        }
    }


def senders_filters(groups, policies, issuer, jwks, default_mode, report):
    """The jwt_authn and rbac filter resources (ECDS) that enforce `policies` on `groups`."""
    for policy in policies:
        if not any(policy_applies(policy, m, report) for g in groups for m in g.members):
            report.warn(policy.label, "spec.to", "applies to none of the imported channels; ignored")
    providers, rules, rbac_policies = {}, [], {}
    for index, group in enumerate(groups):
        hosts = getattr(group, "host_names", [])
        if not hosts:
            continue
        audience = channel_audience(group, report)
        senders = channel_senders(group, policies, default_mode, report)
        provider = f"channel-{index}"
        providers[provider] = {
            "issuer": issuer,
            "audiences": [audience] if audience else [],
            "local_jwks": {"filename": jwks},
            "payload_in_metadata": "jwt_payload",
        }
        authority = {"name": ":authority", "string_match": {"safe_regex": {"regex": host_regex(hosts)}}}
        rules.append({"match": {"prefix": "/", "headers": [authority]}, "requires": {"provider_name": provider}})
        if senders == "any":
            principals = [{"any": True}]
        else:
            principals = [subject_principal(s) for s in senders]
        if principals:
            rbac_policies[group.name] = {"permissions": [{"header": authority}], "principals": principals}
    jwt = {
        "@type": render.EXTENSION_TYPE,
        "name": "senders-jwt",
        "typed_config": {"@type": JWT_TYPE, "providers": providers, "rules": rules},
    }
    rbac = {
        "@type": render.EXTENSION_TYPE,
        "name": "senders-rbac",
        "typed_config": {"@type": RBAC_TYPE, "rules": {"action": "ALLOW", "policies": rbac_policies}},
    }
    return jwt, rbac


def main():
    parser = argparse.ArgumentParser(
        description="Write fanout's files (fanout.json, fanout.yaml, clusters.yaml) from Knative channels.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument(
        "objects",
        metavar="OBJECTS.json",
        help='kubectl get channels,inmemorychannels,subscriptions -A -o json ("-": stdin)',
    )
    parser.add_argument(
        "-o", "--output", default=".", metavar="DIR", help="where to write the three files (default: .)"
    )
    parser.add_argument(
        "--wasm",
        default=render.DEFAULT_WASM,
        help=f"fanout.wasm as Envoy sees it (default {render.DEFAULT_WASM})",
    )
    parser.add_argument(
        "--resolve",
        action="append",
        default=[],
        metavar="HOST[:PORT]=ADDRESS:PORT",
        help="reach HOST (on PORT) at ADDRESS:PORT instead of its DNS name (repeatable)",
    )
    parser.add_argument(
        "--trusted-ca",
        default=DEFAULT_TRUSTED_CA,
        metavar="FILE",
        help=f"CA bundle for https URIs without CACerts, as Envoy sees it (default {DEFAULT_TRUSTED_CA})",
    )
    parser.add_argument("--connect-timeout", default="1s", help="the clusters' connect_timeout (default 1s)")
    parser.add_argument(
        "--oidc-issuer",
        metavar="URL",
        help="check senders' OIDC tokens from this issuer and enforce the EventPolicies: writes "
        "senders-jwt.yaml and senders-rbac.yaml for envoy/configmap/envoy-senders.yaml",
    )
    parser.add_argument(
        "--jwks",
        default=DEFAULT_JWKS,
        metavar="FILE",
        help=f"the issuer's JWKS as Envoy sees it (default {DEFAULT_JWKS})",
    )
    parser.add_argument(
        "--default-authorization-mode",
        choices=AUTHORIZATION_MODES,
        default="allow-same-namespace",
        help="who may send to a channel no EventPolicy applies to (Knative's feature flag; "
        "default allow-same-namespace, as Knative's)",
    )
    args = parser.parse_args()

    report = Report()
    resolve = Resolve(args.resolve)
    objects = read_objects(args.objects, report)
    config, clusters, groups, policies = convert(objects, report, bool(args.oidc_issuer))
    senders = None
    if args.oidc_issuer:
        senders = senders_filters(groups, policies, args.oidc_issuer, args.jwks, args.default_authorization_mode, report)
    else:
        for policy in policies:
            report.error(
                policy.label,
                "kind",
                "EventPolicy: who may send is enforced only with --oidc-issuer (and --jwks); "
                "without it every sender could send",
            )
    cluster_resources = clusters.resources(resolve, args.trusted_ca, args.connect_timeout, report)
    resolve.report_unused(report)

    for warning in report.warnings:
        print(f"knative-import: warning: {warning}", file=sys.stderr)
    if report.errors:
        for error in report.errors:
            print(f"knative-import: error: {error}", file=sys.stderr)
        print(f"knative-import: {len(report.errors)} error(s); nothing written", file=sys.stderr)
        sys.exit(1)

    os.makedirs(args.output, exist_ok=True)
    # fanout.yaml carries fanout.json's text, so `render-ecds.py filter fanout.json` after an
    # edit of fanout.json writes the same kind of file.
    plugin_config = json.dumps(config, indent=2)
    render.write(config, os.path.join(args.output, "fanout.json"))
    # Clusters before the filter: an Envoy watching DIR never meets a subscriber whose cluster
    # it does not have yet.
    render.write(render.discovery_response(cluster_resources), os.path.join(args.output, "clusters.yaml"))
    filter_document = render.discovery_response([render.filter_resource(plugin_config, "fanout", args.wasm)])
    render.write(filter_document, os.path.join(args.output, "fanout.yaml"))
    if senders is not None:
        for resource in senders:
            render.write(render.discovery_response([resource]), os.path.join(args.output, f"{resource['name']}.yaml"))
    subscribers = sum(len(c["subscribers"]) for c in config["channels"])
    print(
        f"knative-import: wrote {os.path.join(args.output, 'fanout.json')}, fanout.yaml and "
        f"clusters.yaml: {len(config['channels'])} channel(s), {subscribers} subscriber(s), "
        f"{len(cluster_resources)} cluster(s)"
        + (f", {len(policies)} EventPolicy(ies) in senders-jwt.yaml and senders-rbac.yaml" if senders else "")
        + (f", {len(report.warnings)} warning(s)" if report.warnings else "")
    )


if __name__ == "__main__":
    main()
