//! A demo subscriber for fanout: an HTTP server that prints every event it receives.
//!
//! ```text
//! cargo run -p fanout-demo-subscriber -- --name billing --port 18081 [--status 200] [--delay-ms 0]
//! ```
//!
//! Each request is printed as one block: the method, path and authority, the headers that
//! matter for events (`ce-*`, `content-type`, `traceparent`, `x-*`) and the body (JSON
//! pretty-printed). Then it answers `--status` after `--delay-ms`.
//!
//! For the demo it obeys one request header: `x-demo-fail: billing,shipping` (or `*`) makes
//! the named subscribers answer 500 instead (`x-demo-fail: billing=503` picks the status). The
//! demo channel forwards `x-demo-*` headers, so this shows fanout's 500 answer.
//!
//! It exits on SIGINT or SIGTERM.

use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

const USAGE: &str = "\
usage: subscriber --name NAME --port PORT [--bind ADDR] [--status CODE] [--delay-ms MS]
                  [--color auto|always|never] [--max-body BYTES]";

#[derive(Clone, Debug)]
struct Options {
    name: String,
    bind: String,
    port: u16,
    status: u16,
    delay: Duration,
    color: bool,
    max_body: usize,
}

fn parse_args(args: impl IntoIterator<Item = String>) -> Result<Options, lexopt::Error> {
    use lexopt::prelude::*;
    let (mut name, mut port, mut bind) = (None, None, "127.0.0.1".to_string());
    let (mut status, mut delay_ms, mut color, mut max_body) = (200, 0, "auto".to_string(), 2048);
    let mut parser = lexopt::Parser::from_args(args);
    while let Some(arg) = parser.next()? {
        match arg {
            Long("name") => name = Some(parser.value()?.string()?),
            Long("port") => port = Some(parser.value()?.parse()?),
            Long("bind") => bind = parser.value()?.string()?,
            Long("status") => status = parser.value()?.parse()?,
            Long("delay-ms") => delay_ms = parser.value()?.parse()?,
            Long("color") => color = parser.value()?.string()?,
            Long("max-body") => max_body = parser.value()?.parse()?,
            Short('h') | Long("help") => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            _ => return Err(arg.unexpected()),
        }
    }
    let name = name
        .filter(|n| !n.trim().is_empty())
        .ok_or("--name is required")?;
    if !(100..=999).contains(&status) {
        return Err(format!("--status {status}: not an HTTP status code").into());
    }
    let color = match color.as_str() {
        "always" => true,
        "never" => false,
        "auto" => std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none(),
        other => return Err(format!("--color {other}: expected auto, always or never").into()),
    };
    Ok(Options {
        name,
        bind,
        port: port.ok_or("--port is required")?,
        status,
        delay: Duration::from_millis(delay_ms),
        color,
        max_body,
    })
}

/// The status to answer, and why when it is not `--status` (an `x-demo-fail` naming us).
fn decide_status(opts: &Options, headers: &[(String, String)]) -> (u16, Option<String>) {
    for (_, value) in headers.iter().filter(|(k, _)| k == "x-demo-fail") {
        for item in value.split(',').map(str::trim) {
            let (who, code) = item.split_once('=').unwrap_or((item, ""));
            if who.trim() == "*" || who.trim().eq_ignore_ascii_case(&opts.name) {
                let code = code.trim().parse().ok().filter(|c| (100..=999).contains(c));
                return (code.unwrap_or(500), Some(format!("x-demo-fail: {value}")));
            }
        }
    }
    (opts.status, None)
}

/// One request, as printed.
struct Received {
    method: String,
    url: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

/// The block printed for one event.
fn format_event(opts: &Options, seq: u64, ev: &Received, status: u16, why: Option<&str>) -> String {
    let paint = |code: &str, text: &str| match opts.color {
        true => format!("\x1b[{code}m{text}\x1b[0m"),
        false => text.to_string(),
    };
    let bar = paint("1;36", "│");
    let mut lines = vec![
        paint("1;36", &format!("┌─ {} · event #{seq}", opts.name)),
        format!(
            "{bar} {} {}   authority {}",
            ev.method,
            ev.url,
            header(&ev.headers, "host").unwrap_or("-")
        ),
    ];
    // The headers an event carries; Envoy's own (x-envoy-*, x-forwarded-*) are left out.
    let shown = |k: &str| {
        k.starts_with("ce-") || k.starts_with("x-") || ["content-type", "traceparent"].contains(&k)
    };
    let envoys = |k: &str| k.starts_with("x-envoy-") || k.starts_with("x-forwarded-");
    let mut headers: Vec<_> = ev
        .headers
        .iter()
        .filter(|(k, _)| shown(k) && !envoys(k))
        .collect();
    headers.sort_by_key(|(k, _)| (!k.starts_with("ce-"), k.clone()));
    let width = headers.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    lines.extend(
        headers
            .iter()
            .map(|(k, v)| format!("{bar} {k:<width$}  {v}")),
    );
    lines.extend(
        render_body(&ev.body, opts.max_body)
            .into_iter()
            .map(|l| format!("{bar}   {l}")),
    );
    let answer = format!(
        "answered {status}{}",
        why.map(|w| format!(" ({w})")).unwrap_or_default()
    );
    let colour = if (200..300).contains(&status) {
        "32"
    } else {
        "31"
    };
    lines.push(format!(
        "{} {}",
        paint("1;36", "└─"),
        paint(colour, &answer)
    ));
    lines.join("\n") + "\n"
}

/// The body as lines: pretty-printed JSON (in its own key order), else text, else a count
/// of bytes; cut after `max` bytes.
fn render_body(body: &[u8], max: usize) -> Vec<String> {
    if body.is_empty() {
        return vec!["(no body)".into()];
    }
    let text = match serde_json::from_slice::<serde_json::Value>(body) {
        Ok(json) => serde_json::to_string_pretty(&json).unwrap_or_default(),
        Err(_) => match std::str::from_utf8(body) {
            Ok(text) => text.to_string(),
            Err(_) => return vec![format!("({} bytes of binary)", body.len())],
        },
    };
    if text.len() <= max {
        return text.lines().map(str::to_string).collect();
    }
    let cut = (0..=max)
        .rev()
        .find(|&i| text.is_char_boundary(i))
        .unwrap_or(0);
    let mut lines: Vec<String> = text[..cut].lines().map(str::to_string).collect();
    lines.push(format!("… truncated, {} bytes in all", body.len()));
    lines
}

fn handle(opts: &Options, seq: u64, mut request: tiny_http::Request) {
    let headers = request
        .headers()
        .iter()
        .map(|h| {
            (
                h.field.as_str().as_str().to_ascii_lowercase(),
                h.value.to_string(),
            )
        })
        .collect();
    let mut body = Vec::new();
    if let Err(e) = request.as_reader().read_to_end(&mut body) {
        eprintln!("{}: reading the body failed: {e}", opts.name);
    }
    let ev = Received {
        method: request.method().to_string(),
        url: request.url().to_string(),
        headers,
        body,
    };
    let (status, why) = decide_status(opts, &ev.headers);
    // One write per block, so that concurrent events do not interleave.
    let _ = std::io::stdout()
        .lock()
        .write_all(format_event(opts, seq, &ev, status, why.as_deref()).as_bytes());
    std::thread::sleep(opts.delay);
    if let Err(e) = request.respond(tiny_http::Response::empty(status)) {
        eprintln!("{}: answering event #{seq} failed: {e}", opts.name);
    }
}

fn main() -> ExitCode {
    let opts = match parse_args(std::env::args().skip(1)) {
        Ok(opts) => opts,
        Err(e) => {
            eprintln!("subscriber: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let addr = format!("{}:{}", opts.bind, opts.port);
    let server = match tiny_http::Server::http(&addr) {
        Ok(server) => Arc::new(server),
        Err(e) => {
            eprintln!("{}: cannot listen on {addr}: {e}", opts.name);
            return ExitCode::FAILURE;
        }
    };
    let stopper = Arc::clone(&server);
    if let Err(e) = ctrlc::set_handler(move || stopper.unblock()) {
        eprintln!("{}: cannot install the signal handler: {e}", opts.name);
        return ExitCode::FAILURE;
    }
    let listening = server.server_addr().to_ip().map_or(addr, |a| a.to_string());
    println!(
        "{} listening on http://{listening} (answers {})",
        opts.name, opts.status
    );

    let events = AtomicU64::new(0);
    for request in server.incoming_requests() {
        let seq = events.fetch_add(1, Ordering::Relaxed) + 1;
        let opts = opts.clone();
        // One thread per request: a delayed answer does not hold up the next event.
        std::thread::spawn(move || handle(&opts, seq, request));
    }
    println!(
        "{} stopped after {} event(s)",
        opts.name,
        events.load(Ordering::Relaxed)
    );
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn options(list: &[&str]) -> Result<Options, lexopt::Error> {
        parse_args(list.iter().map(|s| s.to_string()))
    }

    #[test]
    fn parses_flags() {
        let o = options(&[
            "--name",
            "billing",
            "--port=18081",
            "--status",
            "503",
            "--delay-ms",
            "20",
            "--color",
            "never",
        ])
        .unwrap();
        assert_eq!((o.name.as_str(), o.port, o.status), ("billing", 18081, 503));
        assert_eq!(o.delay, Duration::from_millis(20));
        assert!(!o.color);
    }

    #[test]
    fn rejects_bad_input() {
        for bad in [
            &["--port", "1"][..],
            &["--name", "a", "--port", "x"],
            &["--name", "a", "--port", "1", "--status", "42"],
            &["--name", "a", "--port"],
            &["--bogus"],
        ] {
            assert!(options(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn demo_fail_header() {
        let o = options(&["--name", "shipping", "--port", "1", "--color=never"]).unwrap();
        let h = |v: &str| vec![("x-demo-fail".to_string(), v.to_string())];
        assert_eq!(decide_status(&o, &h("shipping")).0, 500);
        assert_eq!(decide_status(&o, &h("billing, shipping=503")).0, 503);
        assert_eq!(decide_status(&o, &h("*")).0, 500);
        assert_eq!(decide_status(&o, &h("billing")).0, 200);
        assert_eq!(decide_status(&o, &[]).0, 200);
    }

    #[test]
    fn formats_a_json_event() {
        let o = options(&["--name", "billing", "--port", "1", "--color=never"]).unwrap();
        let ev = Received {
            method: "POST".into(),
            url: "/events".into(),
            headers: [
                ("host", "billing.demo"),
                ("content-type", "application/json"),
                ("ce-type", "com.example.order.created"),
                ("x-tenant", "acme"),
                ("authorization", "secret"),
                ("x-envoy-expected-rq-timeout-ms", "2000"),
            ]
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .to_vec(),
            body: br#"{"order":"A-1","items":[{"sku":"T","qty":2}],"total":1.50}"#.to_vec(),
        };
        let text = format_event(&o, 1, &ev, 200, None);
        for want in [
            "billing · event #1",
            "POST /events   authority billing.demo",
            "ce-type       com.example.order.created",
            "x-tenant      acme",
            "\"order\": \"A-1\",\n│     \"items\": [",
            "answered 200",
        ] {
            assert!(text.contains(want), "{want:?} in:\n{text}");
        }
        assert!(
            !text.contains("secret") && !text.contains("x-envoy"),
            "{text}"
        );
    }

    #[test]
    fn pretty_json_keeps_order() {
        let lines = render_body(br#"{"z":1,"a":[true,null]}"#, 2048);
        assert_eq!(
            lines,
            [
                "{",
                "  \"z\": 1,",
                "  \"a\": [",
                "    true,",
                "    null",
                "  ]",
                "}"
            ]
        );
    }

    #[test]
    fn truncates_long_bodies() {
        let lines = render_body("x".repeat(5000).as_bytes(), 100);
        assert_eq!(lines.len(), 2);
        assert!(lines[1].contains("5000 bytes"), "{lines:?}");
    }
}
