//! A demo subscriber for `fanout`: an HTTP server that prints every event it receives.
//!
//! ```text
//! cargo run --example subscriber -- --name billing --port 18081 [--status 200] [--delay-ms 0]
//! ```
//!
//! Each request is printed as one block: the subscriber's name, the method, path and authority,
//! the headers that matter for events (`ce-*`, `content-type`, `x-request-id`, `traceparent`,
//! any `x-*`), and the body (pretty-printed when it is JSON, truncated when it is long). The
//! subscriber then answers `--status` after `--delay-ms`.
//!
//! For the demo it also obeys one request header: `x-demo-fail: billing,shipping` (or `*`)
//! makes the named subscribers answer 500 instead (`x-demo-fail: billing=503` picks the
//! status). The demo channel forwards `x-demo-*` headers, so this shows fanout's 500 answer.
//!
//! It exits on SIGINT or SIGTERM.

use std::fmt::Write as _;
use std::io::{IsTerminal, Read, Write};
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const USAGE: &str = "\
usage: subscriber --name NAME --port PORT [options]

  --name NAME       the name printed with every event (required)
  --port PORT       TCP port to listen on (required; 0 picks a free one)
  --bind ADDR       address to listen on (default 127.0.0.1)
  --status CODE     HTTP status to answer (default 200)
  --delay-ms MS     wait this long before answering (default 0)
  --color WHEN      auto, always or never (default auto: colours when stdout is a terminal
                    and NO_COLOR is not set)
  --max-body N      print at most N bytes of a body (default 2048)

A request header `x-demo-fail: NAME[=STATUS][,NAME...]` (or `*`) makes the named
subscribers answer STATUS (default 500) instead.";

/// Bodies are read up to this size; the rest is drained and only counted.
const BODY_READ_LIMIT: usize = 8 * 1024 * 1024;

#[derive(Debug, Clone)]
struct Options {
    name: String,
    bind: String,
    port: u16,
    status: u16,
    delay: Duration,
    color: bool,
    max_body: usize,
}

fn parse_args(args: impl IntoIterator<Item = String>) -> Result<Options, String> {
    let mut name = None;
    let mut port = None;
    let mut bind = "127.0.0.1".to_string();
    let mut status = 200u16;
    let mut delay_ms = 0u64;
    let mut color = "auto".to_string();
    let mut max_body = 2048usize;

    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        // Accept both `--flag value` and `--flag=value`.
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (arg.clone(), None),
        };
        if flag == "-h" || flag == "--help" {
            return Err(String::new());
        }
        let mut value = || -> Result<String, String> {
            match inline.clone() {
                Some(v) => Ok(v),
                None => args.next().ok_or_else(|| format!("{flag} needs a value")),
            }
        };
        match flag.as_str() {
            "--name" => name = Some(value()?),
            "--port" => port = Some(number(&flag, &value()?)?),
            "--bind" => bind = value()?,
            "--status" => status = number(&flag, &value()?)?,
            "--delay-ms" => delay_ms = number(&flag, &value()?)?,
            "--color" | "--colour" => color = value()?,
            "--max-body" => max_body = number(&flag, &value()?)?,
            other => return Err(format!("unknown argument `{other}`")),
        }
    }

    let name = name.ok_or("--name is required")?;
    if name.trim().is_empty() {
        return Err("--name must not be empty".into());
    }
    let port = port.ok_or("--port is required")?;
    if !(100..=999).contains(&status) {
        return Err(format!("--status {status}: not an HTTP status code"));
    }
    let color = match color.as_str() {
        "always" => true,
        "never" => false,
        "auto" => std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none(),
        other => return Err(format!("--color {other}: expected auto, always or never")),
    };
    Ok(Options {
        name,
        bind,
        port,
        status,
        delay: Duration::from_millis(delay_ms),
        color,
        max_body,
    })
}

fn number<T: std::str::FromStr>(flag: &str, text: &str) -> Result<T, String> {
    text.trim()
        .parse()
        .map_err(|_| format!("{flag} {text}: not a valid number"))
}

/// ANSI styling that disappears when colours are off.
#[derive(Clone, Copy)]
struct Style {
    on: bool,
}

impl Style {
    fn paint(self, code: &str, text: &str) -> String {
        if self.on {
            format!("\x1b[{code}m{text}\x1b[0m")
        } else {
            text.to_string()
        }
    }
    fn bold(self, t: &str) -> String {
        self.paint("1", t)
    }
    fn dim(self, t: &str) -> String {
        self.paint("2", t)
    }
    fn green(self, t: &str) -> String {
        self.paint("32", t)
    }
    fn red(self, t: &str) -> String {
        self.paint("31", t)
    }
}

/// A stable colour per subscriber name, so three subscribers are easy to tell apart.
fn name_colour(name: &str) -> &'static str {
    // No red: red means "failed" in this output.
    const COLOURS: [&str; 5] = ["1;36", "1;35", "1;33", "1;34", "1;32"];
    let sum = name
        .bytes()
        .fold(0usize, |acc, b| acc.wrapping_mul(31).wrapping_add(b.into()));
    COLOURS.get(sum % COLOURS.len()).copied().unwrap_or("1")
}

fn clock() -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let secs = now.as_secs();
    format!(
        "{:02}:{:02}:{:02}.{:03} UTC",
        (secs / 3600) % 24,
        (secs / 60) % 60,
        secs % 60,
        now.subsec_millis()
    )
}

/// What one request looked like, independent of tiny_http (so it is easy to format).
struct Received {
    method: String,
    url: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    body_len: usize,
}

/// The status this subscriber answers to this request, and why if it is not the default.
fn decide_status(opts: &Options, headers: &[(String, String)]) -> (u16, Option<String>) {
    for (k, v) in headers {
        if k != "x-demo-fail" {
            continue;
        }
        for item in v.split(',').map(str::trim) {
            let (who, code) = match item.split_once('=') {
                Some((who, code)) => (who.trim(), code.trim().parse::<u16>().ok()),
                None => (item, None),
            };
            if who == "*" || who.eq_ignore_ascii_case(&opts.name) {
                let code = code.filter(|c| (100..=999).contains(c)).unwrap_or(500);
                return (code, Some(format!("x-demo-fail: {v}")));
            }
        }
    }
    (opts.status, None)
}

/// Headers shown first, in this order; then other `ce-*`, then other `x-*`.
const IMPORTANT: [&str; 7] = [
    "ce-type",
    "ce-id",
    "ce-source",
    "ce-specversion",
    "content-type",
    "x-request-id",
    "traceparent",
];

fn format_event(
    opts: &Options,
    seq: u64,
    ev: &Received,
    status: u16,
    reason: Option<&str>,
) -> String {
    let st = Style { on: opts.color };
    let tag = |t: &str| st.paint(name_colour(&opts.name), t);
    let bar = tag("│");
    let mut out = String::new();

    let title = format!("{} · event #{seq} · {}", opts.name, clock());
    let _ = writeln!(out, "{} {}", tag("┌─"), tag(&title));
    let authority = header(&ev.headers, "host").unwrap_or("-");
    let _ = writeln!(
        out,
        "{bar} {} {}   {} {}",
        st.bold(&ev.method),
        st.bold(&ev.url),
        st.dim("authority"),
        authority
    );

    let mut shown: Vec<(&str, &str)> = Vec::new();
    for key in IMPORTANT {
        if let Some(v) = header(&ev.headers, key) {
            shown.push((key, v));
        }
    }
    let mut rest: Vec<(&str, &str)> = ev
        .headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .filter(|(k, _)| {
            (k.starts_with("ce-") || k.starts_with("x-") || *k == "tracestate")
                && !IMPORTANT.contains(k)
        })
        .collect();
    // ce-* first, then x-* with Envoy's own x-envoy-* / x-forwarded-* last.
    rest.sort_by_key(|(k, _)| {
        let rank = if k.starts_with("ce-") {
            0
        } else if k.starts_with("x-envoy-") || k.starts_with("x-forwarded-") {
            2
        } else {
            1
        };
        (rank, k.to_string())
    });
    shown.extend(rest);
    let added_by_envoy = |k: &str| k.starts_with("x-envoy-") || k.starts_with("x-forwarded-");
    // Align on the headers that matter; Envoy's own long x-envoy-* names may stick out.
    let width = shown
        .iter()
        .filter(|(k, _)| !added_by_envoy(k))
        .map(|(k, _)| k.len())
        .max()
        .unwrap_or(0);
    for (k, v) in shown {
        let key = format!("{k:<width$}");
        let envoys = added_by_envoy(k);
        let key = if envoys { st.dim(&key) } else { key };
        let val = if envoys { st.dim(v) } else { v.to_string() };
        let _ = writeln!(out, "{bar} {key}  {val}");
    }

    let ct = header(&ev.headers, "content-type").unwrap_or("");
    let _ = writeln!(out, "{bar} {}", st.dim(&body_summary(ev, ct)));
    for line in render_body(&ev.body, ev.body_len, ct, opts.max_body) {
        let _ = writeln!(out, "{bar}   {line}");
    }

    let answer = format!("answered {status} {}", reason_phrase(status));
    let answer = if (200..300).contains(&status) {
        st.green(&answer)
    } else {
        st.red(&answer)
    };
    let why = match reason {
        Some(r) => format!(" {}", st.dim(&format!("({r})"))),
        None if opts.delay.is_zero() => String::new(),
        None => format!(" {}", st.dim(&format!("(after {:?})", opts.delay))),
    };
    let _ = writeln!(out, "{} {answer}{why}", tag("└─"));
    out
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

fn body_summary(ev: &Received, content_type: &str) -> String {
    if ev.body_len == 0 {
        return "(no body)".into();
    }
    let kind = if is_json(content_type, &ev.body) {
        ", JSON"
    } else if std::str::from_utf8(&ev.body).is_err() {
        ", binary"
    } else {
        ""
    };
    format!("body ({} bytes{kind})", ev.body_len)
}

fn is_json(content_type: &str, body: &[u8]) -> bool {
    let ct = content_type.to_ascii_lowercase();
    (ct.contains("json") || ct.is_empty())
        && serde_json::from_slice::<serde_json::Value>(body).is_ok()
}

/// The body as display lines: pretty JSON, text, or a hex preview; cut at `max` bytes.
fn render_body(body: &[u8], total: usize, content_type: &str, max: usize) -> Vec<String> {
    if body.is_empty() {
        return Vec::new();
    }
    let text = if is_json(content_type, body) {
        std::str::from_utf8(body)
            .map(pretty_json)
            .unwrap_or_default()
    } else if let Ok(s) = std::str::from_utf8(body) {
        s.to_string()
    } else {
        let preview: Vec<String> = body
            .iter()
            .take(max.min(64))
            .map(|b| format!("{b:02x}"))
            .collect();
        let more = if total > 64 { " …" } else { "" };
        return vec![format!("{}{more}", preview.join(" "))];
    };

    let mut lines = Vec::new();
    let mut used = 0usize;
    for line in text.lines() {
        if used + line.len() > max {
            let keep: String = line.chars().take(max.saturating_sub(used)).collect();
            lines.push(format!("{keep}…"));
            lines.push(format!("… truncated, {total} bytes in all"));
            return lines;
        }
        used += line.len() + 1;
        lines.push(line.to_string());
    }
    lines
}

/// Pretty-prints JSON that is already known to be valid, keeping the order of its keys and the
/// spelling of its numbers; a short array or object of plain values stays on one line.
fn pretty_json(text: &str) -> String {
    enum Node<'a> {
        Scalar(&'a str),
        Array(Vec<Node<'a>>),
        Object(Vec<(&'a str, Node<'a>)>),
    }

    struct Parser<'a> {
        text: &'a str,
        pos: usize,
    }

    impl<'a> Parser<'a> {
        fn skip_ws(&mut self) {
            while self.text[self.pos..].starts_with(|c: char| c.is_ascii_whitespace()) {
                self.pos += 1;
            }
        }
        fn peek(&self) -> Option<u8> {
            self.text.as_bytes().get(self.pos).copied()
        }
        fn string(&mut self) -> &'a str {
            let start = self.pos;
            self.pos += 1;
            while let Some(b) = self.peek() {
                self.pos += 1;
                match b {
                    b'\\' => self.pos += 1,
                    b'"' => break,
                    _ => {}
                }
            }
            &self.text[start..self.pos.min(self.text.len())]
        }
        fn node(&mut self) -> Node<'a> {
            self.skip_ws();
            match self.peek() {
                Some(b'{') => {
                    self.pos += 1;
                    let mut members = Vec::new();
                    loop {
                        self.skip_ws();
                        match self.peek() {
                            Some(b'"') => {
                                let key = self.string();
                                self.skip_ws();
                                self.pos += 1; // ':'
                                members.push((key, self.node()));
                            }
                            Some(b',') => self.pos += 1,
                            Some(_) => {
                                self.pos += 1; // '}'
                                break;
                            }
                            None => break,
                        }
                    }
                    Node::Object(members)
                }
                Some(b'[') => {
                    self.pos += 1;
                    let mut items = Vec::new();
                    loop {
                        self.skip_ws();
                        match self.peek() {
                            Some(b']') => {
                                self.pos += 1;
                                break;
                            }
                            Some(b',') => self.pos += 1,
                            Some(_) => items.push(self.node()),
                            None => break,
                        }
                    }
                    Node::Array(items)
                }
                Some(b'"') => Node::Scalar(self.string()),
                _ => {
                    let start = self.pos;
                    while self.peek().is_some_and(|b| {
                        !matches!(b, b',' | b']' | b'}') && !b.is_ascii_whitespace()
                    }) {
                        self.pos += 1;
                    }
                    Node::Scalar(&self.text[start..self.pos])
                }
            }
        }
    }

    fn flat(node: &Node<'_>) -> Option<String> {
        match node {
            Node::Scalar(s) => Some((*s).to_string()),
            Node::Array(items) if items.iter().all(|i| matches!(i, Node::Scalar(_))) => {
                let parts: Vec<String> = items.iter().filter_map(flat).collect();
                Some(format!("[{}]", parts.join(", ")))
            }
            Node::Object(m) if m.is_empty() => Some("{}".into()),
            Node::Object(m) if m.iter().all(|(_, v)| matches!(v, Node::Scalar(_))) => {
                let parts: Vec<String> = m
                    .iter()
                    .filter_map(|(k, v)| flat(v).map(|v| format!("{k}: {v}")))
                    .collect();
                Some(format!("{{ {} }}", parts.join(", ")))
            }
            _ => None,
        }
    }

    fn write(node: &Node<'_>, depth: usize, out: &mut String) {
        if let Some(f) = flat(node).filter(|f| f.len() <= 60 || matches!(node, Node::Scalar(_))) {
            out.push_str(&f);
            return;
        }
        let pad = "  ".repeat(depth + 1);
        let (open, close) = match node {
            Node::Array(_) => ('[', ']'),
            _ => ('{', '}'),
        };
        out.push(open);
        let mut first = true;
        let mut item = |out: &mut String| {
            out.push_str(if first { "\n" } else { ",\n" });
            out.push_str(&pad);
            first = false;
        };
        match node {
            Node::Array(items) => {
                for i in items {
                    item(out);
                    write(i, depth + 1, out);
                }
            }
            Node::Object(members) => {
                for (k, v) in members {
                    item(out);
                    out.push_str(k);
                    out.push_str(": ");
                    write(v, depth + 1, out);
                }
            }
            Node::Scalar(_) => {}
        }
        out.push('\n');
        out.push_str(&"  ".repeat(depth));
        out.push(close);
    }

    let mut parser = Parser { text, pos: 0 };
    let root = parser.node();
    let mut out = String::new();
    write(&root, 0, &mut out);
    out
}

fn reason_phrase(status: u16) -> &'static str {
    match status {
        200 => "OK",
        201 => "Created",
        202 => "Accepted",
        204 => "No Content",
        400 => "Bad Request",
        404 => "Not Found",
        409 => "Conflict",
        429 => "Too Many Requests",
        500 => "Internal Server Error",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "",
    }
}

fn print_block(text: &str) {
    // One write per block, so blocks of concurrent requests do not interleave.
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(text.as_bytes());
    let _ = out.flush();
}

fn handle(opts: &Options, seq: u64, mut request: tiny_http::Request) {
    let headers: Vec<(String, String)> = request
        .headers()
        .iter()
        .map(|h| {
            (
                h.field.as_str().as_str().to_ascii_lowercase(),
                h.value.as_str().to_string(),
            )
        })
        .collect();

    let mut body = Vec::new();
    let reader = request.as_reader();
    let body_len = match reader.take(BODY_READ_LIMIT as u64).read_to_end(&mut body) {
        Ok(n) => n + std::io::copy(reader, &mut std::io::sink()).map_or(0, |m| m as usize),
        Err(e) => {
            eprintln!("{}: reading the body failed: {e}", opts.name);
            body.len()
        }
    };

    let ev = Received {
        method: request.method().as_str().to_string(),
        url: request.url().to_string(),
        headers,
        body,
        body_len,
    };
    let (status, reason) = decide_status(opts, &ev.headers);
    print_block(&format_event(opts, seq, &ev, status, reason.as_deref()));

    if !opts.delay.is_zero() {
        thread::sleep(opts.delay);
    }
    let response = tiny_http::Response::empty(tiny_http::StatusCode(status));
    if let Err(e) = request.respond(response) {
        eprintln!("{}: answering event #{seq} failed: {e}", opts.name);
    }
}

fn main() -> ExitCode {
    let opts = match parse_args(std::env::args().skip(1)) {
        Ok(o) => o,
        Err(msg) if msg.is_empty() => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(msg) => {
            eprintln!("subscriber: {msg}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };

    let addr = format!("{}:{}", opts.bind, opts.port);
    let server = match tiny_http::Server::http(&addr) {
        Ok(s) => Arc::new(s),
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

    let st = Style { on: opts.color };
    let listening = server
        .server_addr()
        .to_ip()
        .map_or_else(|| addr.clone(), |a| a.to_string());
    let delay = if opts.delay.is_zero() {
        String::new()
    } else {
        format!(" after {:?}", opts.delay)
    };
    print_block(&format!(
        "{} listening on http://{listening} {}\n",
        st.paint(name_colour(&opts.name), &opts.name),
        st.dim(&format!("(answers {}{delay})", opts.status)),
    ));

    let counter = Arc::new(AtomicU64::new(0));
    for request in server.incoming_requests() {
        let seq = counter.fetch_add(1, Ordering::Relaxed) + 1;
        let opts = opts.clone();
        // One thread per request: a delayed answer does not hold up the next event.
        thread::spawn(move || handle(&opts, seq, request));
    }

    print_block(&format!(
        "{} stopped after {} event(s)\n",
        opts.name,
        counter.load(Ordering::Relaxed)
    ));
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn parses_flags() {
        let o = parse_args(args(&[
            "--name",
            "billing",
            "--port=18081",
            "--status",
            "503",
            "--delay-ms",
            "20",
            "--color",
            "never",
        ]))
        .unwrap();
        assert_eq!(o.name, "billing");
        assert_eq!(o.port, 18081);
        assert_eq!(o.status, 503);
        assert_eq!(o.delay, Duration::from_millis(20));
        assert!(!o.color);
    }

    #[test]
    fn rejects_bad_input() {
        assert!(parse_args(args(&["--port", "1"])).is_err());
        assert!(parse_args(args(&["--name", "a", "--port", "x"])).is_err());
        assert!(parse_args(args(&["--name", "a", "--port", "1", "--status", "42"])).is_err());
        assert!(parse_args(args(&["--name", "a", "--port"])).is_err());
        assert!(parse_args(args(&["--bogus"])).is_err());
    }

    #[test]
    fn demo_fail_header() {
        let o = parse_args(args(&[
            "--name",
            "shipping",
            "--port",
            "1",
            "--color=never",
        ]))
        .unwrap();
        let h = |v: &str| vec![("x-demo-fail".to_string(), v.to_string())];
        assert_eq!(decide_status(&o, &h("shipping")).0, 500);
        assert_eq!(decide_status(&o, &h("billing, shipping=503")).0, 503);
        assert_eq!(decide_status(&o, &h("*")).0, 500);
        assert_eq!(decide_status(&o, &h("billing")).0, 200);
        assert_eq!(decide_status(&o, &[]).0, 200);
    }

    #[test]
    fn formats_a_json_event() {
        let o = parse_args(args(&["--name", "billing", "--port", "1", "--color=never"])).unwrap();
        let ev = Received {
            method: "POST".into(),
            url: "/events".into(),
            headers: vec![
                ("host".into(), "billing.demo".into()),
                ("content-type".into(), "application/json".into()),
                ("ce-type".into(), "com.example.order.created".into()),
                ("x-tenant".into(), "acme".into()),
                ("authorization".into(), "secret".into()),
            ],
            body: br#"{"order":"A-1"}"#.to_vec(),
            body_len: 15,
        };
        let text = format_event(&o, 1, &ev, 200, None);
        assert!(text.contains("POST /events"), "{text}");
        assert!(text.contains("authority billing.demo"), "{text}");
        assert!(
            text.contains("ce-type       com.example.order.created"),
            "{text}"
        );
        assert!(text.contains("x-tenant      acme"), "{text}");
        assert!(!text.contains("secret"), "{text}");
        assert!(text.contains("\"order\": \"A-1\""), "{text}");
        assert!(text.contains("answered 200 OK"), "{text}");
    }

    #[test]
    fn pretty_json_keeps_order() {
        let text = r#"{"order":"A-1","items":[{"sku":"T","qty":2},{"sku":"MUG","qty":1}],"tags":["a","b"],"total":1.50,"note":"a \"q\" }"}"#;
        let expected = r#"{
  "order": "A-1",
  "items": [
    { "sku": "T", "qty": 2 },
    { "sku": "MUG", "qty": 1 }
  ],
  "tags": ["a", "b"],
  "total": 1.50,
  "note": "a \"q\" }"
}"#;
        assert_eq!(pretty_json(text), expected);
        assert_eq!(pretty_json("[]"), "[]");
        assert_eq!(pretty_json("{}"), "{}");
        assert_eq!(pretty_json(" 42 "), "42");
    }

    #[test]
    fn truncates_long_bodies() {
        let body = "x".repeat(5000);
        let lines = render_body(body.as_bytes(), 5000, "text/plain", 100);
        assert_eq!(lines.len(), 2);
        assert!(lines[1].contains("5000 bytes"));
    }
}
