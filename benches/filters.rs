//! The cost of subscription filtering for one structured CloudEvent: parsing the body for its
//! attributes (the payload in `data` is scanned, not copied) and matching every subscriber's
//! filter. Body sizes from 1 KiB to 1 MiB; binary mode (attributes in headers) for comparison.
//!
//! `cargo bench --bench filters` (or `make bench-filters`). A plain binary, no harness: each
//! case runs for about `FANOUT_BENCH_MS` milliseconds (default 300) and prints ns/op and MB/s
//! of body.

use std::hint::black_box;
use std::time::{Duration, Instant};

use fanout::cloudevents::{self, ContentMode};
use fanout::config::{Channel, Config};
use fanout::headers::HeaderMap;
use fanout::request::PendingEvent;

const CONFIG: &str = r#"{"subscribers": [
  {"cluster": "created", "filters": [{"exact": {"type": "com.example.order.created"}}]},
  {"cluster": "eu", "filters": [{"prefix": {"source": "/orders/eu/"}}, {"suffix": {"subject": ".pdf"}}]},
  {"cluster": "not-test", "filters": [{"not": {"any": [{"exact": {"type": "test"}}, {"exact": {"env": "dev"}}]}}]},
  {"cluster": "legacy", "filter": {"attributes": {"type": "com.example.order.shipped", "source": ""}}},
  {"cluster": "everything"}
]}"#;

/// Which subscribers the benchmark event must reach.
const EXPECTED: [bool; 5] = [true, true, true, false, true];

fn main() {
    let budget = Duration::from_millis(
        std::env::var("FANOUT_BENCH_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(300),
    );
    let config = match Config::from_json(CONFIG.as_bytes()) {
        Ok(config) => config,
        Err(e) => fail(&format!("bench config: {e}")),
    };
    let Some(channel) = config.channel(0) else {
        fail("bench config has no channel")
    };

    println!(
        "{:<22} {:>10} {:>12} {:>10}",
        "case", "iterations", "ns/op", "MB/s"
    );
    for size in [1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20] {
        let body = structured_event(size);
        let name = format!("structured {}", human(size));
        run(&name, body.len(), budget, || {
            filter_structured(channel, black_box(&body))
        });
    }
    let headers = binary_headers();
    run("binary (headers)", 0, budget, || {
        filter_binary(channel, black_box(&headers))
    });
}

/// What the filter does at end of stream for a structured event of a filtered channel.
fn filter_structured(channel: &Channel, body: &[u8]) -> usize {
    let pending = PendingEvent {
        mode: Some(ContentMode::Structured),
        strict: true,
        ..PendingEvent::default()
    };
    match pending.complete(body) {
        Ok(event) => wanted(channel, event.attributes.as_ref()),
        Err(_) => fail("the benchmark body did not parse"),
    }
}

/// Binary mode: the attributes come from the headers at admission; the body is not read.
fn filter_binary(channel: &Channel, headers: &HeaderMap) -> usize {
    match cloudevents::read_headers(headers).map(|mode| mode.attributes(&[])) {
        Ok(Ok(event)) => wanted(channel, event.as_ref()),
        _ => fail("the benchmark headers did not read"),
    }
}

fn wanted(channel: &Channel, event: Option<&cloudevents::Attributes>) -> usize {
    let mut count = 0;
    for (subscriber, expected) in channel.subscribers.iter().zip(EXPECTED) {
        let accepts = subscriber.accepts(event);
        if accepts != expected {
            fail(&format!(
                "subscriber {} matched {accepts}",
                subscriber.cluster
            ));
        }
        count += usize::from(accepts);
    }
    count
}

fn run(name: &str, bytes: usize, budget: Duration, mut op: impl FnMut() -> usize) {
    // Warm up, and size a batch so that the clock is read rarely.
    let start = Instant::now();
    let mut batch = 1u64;
    while start.elapsed() < budget / 10 {
        for _ in 0..batch {
            black_box(op());
        }
        batch *= 2;
    }
    let batch = (batch / 8).max(1);
    let mut iterations = 0u64;
    let start = Instant::now();
    while start.elapsed() < budget {
        for _ in 0..batch {
            black_box(op());
        }
        iterations += batch;
    }
    let elapsed = start.elapsed();
    let ns_per_op = elapsed.as_nanos() as f64 / iterations as f64;
    let throughput = if bytes > 0 {
        format!("{:.0}", bytes as f64 / ns_per_op * 1e9 / 1e6)
    } else {
        "-".to_string()
    };
    println!("{name:<22} {iterations:>10} {ns_per_op:>12.0} {throughput:>10}");
}

/// A structured event of about `size` bytes: the attributes, then a `data` payload of
/// nested objects with text (some of it non-ASCII and escaped) and numbers.
fn structured_event(size: usize) -> Vec<u8> {
    let mut body = String::from(
        r#"{"specversion": "1.0", "type": "com.example.order.created",
 "source": "/orders/eu/shop-7", "subject": "invoice-2024-0001.pdf", "id": "A234-1234-1234",
 "time": "2024-04-05T17:31:00Z", "datacontenttype": "application/json", "sequence": 42,
 "data": {"items": ["#,
    );
    let mut i = 0;
    while body.len() + 200 < size {
        if i > 0 {
            body.push(',');
        }
        body.push_str(&format!(
            r#"{{"sku": "SKU-{i:06}", "name": "Bücher für \"Café\" № {i}", "qty": {q},
 "price": {p}.{c:02}, "tags": ["a", "b\u00e9"], "gift": {g}}}"#,
            q = i % 7 + 1,
            p = i % 100,
            c = i % 100,
            g = i % 2 == 0,
        ));
        i += 1;
    }
    body.push_str(r#"], "note": "end"}}"#);
    body.into_bytes()
}

fn binary_headers() -> HeaderMap {
    HeaderMap::from_pairs(&[
        (":method", "POST"),
        (":authority", "orders.default"),
        ("content-type", "application/json"),
        ("ce-specversion", "1.0"),
        ("ce-type", "com.example.order.created"),
        ("ce-source", "%2Forders%2Feu%2Fshop-7"),
        ("ce-subject", "invoice-2024-0001.pdf"),
        ("ce-id", "A234-1234-1234"),
        ("ce-time", "2024-04-05T17:31:00Z"),
    ])
}

fn human(size: usize) -> String {
    if size >= 1 << 20 {
        format!("{} MiB", size >> 20)
    } else {
        format!("{} KiB", size >> 10)
    }
}

fn fail(message: &str) -> ! {
    eprintln!("bench filters: {message}");
    std::process::exit(1)
}
