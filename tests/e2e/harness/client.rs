//! The downstream client: reqwest (blocking), HTTP/1.1 or h2c (prior knowledge).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use reqwest::blocking::{Body, RequestBuilder};
use reqwest::header::HeaderMap;
use reqwest::Version;
use serde_json::Value;

use super::envoy::TRIPWIRE_BODY;

/// A reqwest client that never uses a proxy from the environment.
#[derive(Clone, Debug)]
pub struct Client {
    pub http: reqwest::blocking::Client,
}

impl Client {
    /// HTTP/1.1.
    pub fn http1() -> Client {
        Client::build(reqwest::blocking::Client::builder().http1_only())
    }

    /// HTTP/2 over cleartext, with prior knowledge.
    pub fn h2c() -> Client {
        Client::build(reqwest::blocking::Client::builder().http2_prior_knowledge())
    }

    /// HTTP/1.1, with `host` resolved to `addr` (so URLs can carry a real host name).
    pub fn http1_resolving(host: &str, addr: SocketAddr) -> Client {
        Client::build(
            reqwest::blocking::Client::builder()
                .http1_only()
                .resolve(host, addr),
        )
    }

    /// h2c, with `host` resolved to `addr`.
    pub fn h2c_resolving(host: &str, addr: SocketAddr) -> Client {
        Client::build(
            reqwest::blocking::Client::builder()
                .http2_prior_knowledge()
                .resolve(host, addr),
        )
    }

    fn build(builder: reqwest::blocking::ClientBuilder) -> Client {
        let http = builder
            .no_proxy()
            .timeout(Duration::from_secs(30))
            .pool_max_idle_per_host(256)
            .build()
            .expect("build the HTTP client");
        Client { http }
    }

    pub fn post(&self, url: &str) -> RequestBuilder {
        self.http.post(url)
    }

    pub fn get(&self, url: &str) -> RequestBuilder {
        self.http.get(url)
    }
}

/// An upload body without a length: sent with `transfer-encoding: chunked` over HTTP/1.1.
pub fn chunked_body(bytes: Vec<u8>) -> Body {
    Body::new(std::io::Cursor::new(bytes))
}

/// A response, fully read.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub version: Version,
    pub headers: HeaderMap,
    pub body: Vec<u8>,
    /// From sending the request to having read the whole response.
    pub elapsed: Duration,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body as JSON; panics, showing the body, if it is not.
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "the {} answer's body is not JSON ({e}): {:?}",
                self.status,
                self.text()
            )
        })
    }

    /// Panics if the request got past the filter to the router's tripwire route.
    pub fn assert_not_tripwire(&self) {
        assert!(
            !self.text().contains(TRIPWIRE_BODY),
            "the request got past the filter to the router: {} {:?}",
            self.status,
            self.text()
        );
    }
}

/// The answer is the filter's (not the tripwire's) and has this status.
pub fn assert_status(reply: &Reply, status: u16) {
    reply.assert_not_tripwire();
    assert_eq!(
        reply.status,
        status,
        "expected {status}, got {} with body {:?}",
        reply.status,
        reply.text()
    );
}

/// The filter answered 202 (with or without a report in the body).
pub fn assert_202(reply: &Reply) {
    assert_status(reply, 202);
}

/// The filter answered 202 with an empty body: every subscriber took the event and nobody
/// was skipped as having it already (README, "What a request gets").
pub fn assert_202_empty(reply: &Reply) {
    assert_202(reply);
    assert!(reply.body.is_empty(), "202 has a body: {:?}", reply.text());
}

/// A rejection of the request itself (400, 404, 405, 413, ...): this status, and a body
/// `{"error": "<why>"}` with a reason.
pub fn assert_rejected(reply: &Reply, status: u16) {
    assert_status(reply, status);
    let body = reply.json();
    assert!(
        body["error"].as_str().is_some_and(|m| !m.is_empty()),
        "a {status} should say why in {{\"error\": ...}}: {body}"
    );
}

/// Send a request and read the whole answer. Panics on a transport error.
pub fn send(request: RequestBuilder) -> Reply {
    let start = Instant::now();
    let response = request
        .send()
        .unwrap_or_else(|e| panic!("request failed: {e} ({e:?})"));
    let status = response.status().as_u16();
    let version = response.version();
    let headers = response.headers().clone();
    let body = response
        .bytes()
        .unwrap_or_else(|e| panic!("reading the {status} answer failed: {e}"))
        .to_vec();
    Reply {
        status,
        version,
        headers,
        body,
        elapsed: start.elapsed(),
    }
}
