//! Subscriber servers on loopback: plain HTTP/1.1 over std::net, one thread per connection,
//! keep-alive, content-length and chunked request bodies. Each records every request it
//! receives and then behaves as its test set it: answer a status, answer after a delay, or
//! reset the connection. Dropping a subscriber stops its threads.

use std::io::{BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::server::{lock, read_request, set_linger_zero, Connections, Server};

/// What a subscriber does with each request (after recording it).
#[derive(Clone, Debug)]
pub enum Behavior {
    /// Answer at once with this status.
    Status(u16),
    /// Answer with this status after this delay.
    Delay(Duration, u16),
    /// Read the request, then reset the connection (RST, via SO_LINGER 0).
    Reset,
    /// Answer with this status, these extra headers and this body.
    Respond {
        status: u16,
        headers: Vec<(String, String)>,
        body: String,
    },
    /// The n-th request (counting from 0, over the subscriber's life) gets the n-th
    /// behaviour; the last one repeats.
    Sequence(Vec<Behavior>),
    /// The first request with each value of the header (e.g. `ce-id`: each event's first
    /// delivery) gets this status; the later ones 200.
    FirstOfEach(&'static str, u16),
}

impl Behavior {
    /// [`Behavior::Respond`] from borrowed parts.
    pub fn respond(status: u16, headers: &[(&str, &str)], body: &str) -> Behavior {
        Behavior::Respond {
            status,
            headers: headers
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect(),
            body: body.to_string(),
        }
    }

    /// The behaviour for the request with this index.
    fn for_request(self, index: usize) -> Behavior {
        match self {
            Behavior::Sequence(steps) => steps
                .get(index)
                .or(steps.last())
                .cloned()
                .map_or(Behavior::Status(200), |step| step.for_request(index)),
            other => other,
        }
    }
}

/// One request as the subscriber received it.
#[derive(Clone, Debug)]
pub struct Recorded {
    pub method: String,
    pub path: String,
    pub version: String,
    /// Lower-cased names, in the order received; a repeated header appears repeatedly.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub at: Instant,
}

impl Recorded {
    /// The first value of a header (name case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }

    /// Every value of a header.
    pub fn header_all(&self, name: &str) -> Vec<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .filter(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
            .collect()
    }

    /// HTTP/1.1 carries the authority in `host`.
    pub fn authority(&self) -> Option<&str> {
        self.header("host")
    }
}

struct Shared {
    name: String,
    behavior: Mutex<Behavior>,
    requests: Mutex<Vec<Recorded>>,
    received: Condvar,
    /// Requests received and not yet answered (or reset), and the most there were at once.
    active: AtomicUsize,
    max_active: AtomicUsize,
}

/// Counts one request as active from when it is read until its answer is written or the
/// connection ends, whichever way `serve` leaves.
struct ActiveRequest<'a>(&'a Shared);

impl<'a> ActiveRequest<'a> {
    fn new(shared: &'a Shared) -> Self {
        let now = shared.active.fetch_add(1, Ordering::SeqCst) + 1;
        shared.max_active.fetch_max(now, Ordering::SeqCst);
        ActiveRequest(shared)
    }
}

impl Drop for ActiveRequest<'_> {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A subscriber server on 127.0.0.1:<its own free port>.
pub struct Subscriber {
    shared: Arc<Shared>,
    server: Server,
}

impl Subscriber {
    /// Start a subscriber (`name` only labels its answers and messages).
    pub fn start(name: &str, behavior: Behavior) -> Subscriber {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind a subscriber port");
        let shared = Arc::new(Shared {
            name: name.to_owned(),
            behavior: Mutex::new(behavior),
            requests: Mutex::new(Vec::new()),
            received: Condvar::new(),
            active: AtomicUsize::new(0),
            max_active: AtomicUsize::new(0),
        });
        let s = Arc::clone(&shared);
        let server = Server::start(
            listener,
            &format!("subscriber-{name}"),
            move |stream, id, connections| serve(stream, id, &s, connections),
        );
        Subscriber { shared, server }
    }

    /// Answer 200 to everything.
    pub fn ok(name: &str) -> Subscriber {
        Subscriber::start(name, Behavior::Status(200))
    }

    pub fn name(&self) -> &str {
        &self.shared.name
    }

    pub fn port(&self) -> u16 {
        self.server.addr().port()
    }

    pub fn addr(&self) -> SocketAddr {
        self.server.addr()
    }

    /// Change the behaviour for requests from now on.
    pub fn set_behavior(&self, behavior: Behavior) {
        *lock(&self.shared.behavior) = behavior;
    }

    /// Every request received so far, in order of arrival.
    pub fn requests(&self) -> Vec<Recorded> {
        lock(&self.shared.requests).clone()
    }

    /// How many requests were received so far.
    pub fn count(&self) -> usize {
        lock(&self.shared.requests).len()
    }

    /// The most requests this subscriber was handling at once (received, not yet answered),
    /// over its life: the concurrency it saw.
    pub fn max_concurrent(&self) -> usize {
        self.shared.max_active.load(Ordering::SeqCst)
    }

    /// Requests received and not yet answered now.
    pub fn active(&self) -> usize {
        self.shared.active.load(Ordering::SeqCst)
    }

    /// The only request received; panics unless there was exactly one.
    pub fn only_request(&self) -> Recorded {
        let requests = self.requests();
        assert_eq!(
            requests.len(),
            1,
            "subscriber {} should have received exactly one request, got {}: {requests:#?}",
            self.name(),
            requests.len()
        );
        requests.into_iter().next().expect("one request")
    }

    /// Asserts that no more than `n` requests arrive within `wait`. (A fixed wait: it looks
    /// for something that must not happen; a loaded machine can only make it miss, never
    /// fail.)
    pub fn stays_at(&self, n: usize, wait: Duration) {
        std::thread::sleep(wait);
        assert_eq!(self.count(), n, "{}: {:#?}", self.name(), self.requests());
    }

    /// Wait (bounded) until at least `n` requests arrived; returns the count then.
    pub fn wait_for(&self, n: usize, timeout: Duration) -> usize {
        let deadline = Instant::now() + timeout;
        let mut requests = lock(&self.shared.requests);
        while requests.len() < n {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            requests = self
                .shared
                .received
                .wait_timeout(requests, deadline - now)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
        requests.len()
    }
}

fn serve(stream: TcpStream, id: u64, shared: &Shared, connections: &Connections) {
    let Ok(reader) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(reader);
    let mut writer = stream;
    loop {
        let request = match read_request(&mut reader) {
            Ok(Some(r)) => r,
            Ok(None) | Err(_) => return,
        };
        let keep_alive = !request
            .header("connection")
            .is_some_and(|v| v.eq_ignore_ascii_case("close"));
        // Active before it is visible as received, so a test that saw the request also sees
        // it counted.
        let active = ActiveRequest::new(shared);
        let index = {
            let mut requests = lock(&shared.requests);
            requests.push(request);
            shared.received.notify_all();
            requests.len() - 1
        };
        let behavior = lock(&shared.behavior).clone().for_request(index);
        let mut custom: Option<(Vec<(String, String)>, String)> = None;
        let status = match behavior {
            Behavior::Status(status) => status,
            Behavior::FirstOfEach(header, first) => {
                let requests = lock(&shared.requests);
                let value = |i: usize| requests.get(i).and_then(|r| r.header(header));
                let seen = (0..index).any(|i| value(i).is_some() && value(i) == value(index));
                if seen {
                    200
                } else {
                    first
                }
            }
            Behavior::Sequence(_) => 200,
            Behavior::Respond {
                status,
                headers,
                body,
            } => {
                custom = Some((headers, body));
                status
            }
            Behavior::Delay(delay, status) => {
                if !sleep_unless_stopped(delay, connections) {
                    return;
                }
                status
            }
            Behavior::Reset => {
                // Drop every other handle to the socket, then close with SO_LINGER 0: RST.
                connections.forget(id);
                drop(reader);
                // Dropping the stream then sends RST.
                let _ = set_linger_zero(&writer);
                return;
            }
        };
        // 204 and 304 have no body, not even a content-length.
        let (body, framing) = if let Some((headers, body)) = custom {
            let mut framing: String = headers
                .iter()
                .map(|(n, v)| format!("{n}: {v}\r\n"))
                .collect();
            framing.push_str(&format!("content-length: {}\r\n", body.len()));
            (body, framing)
        } else if status == 204 || status == 304 {
            (String::new(), String::new())
        } else {
            let body = format!("subscriber {} answers {status}\n", shared.name);
            let framing = format!(
                "content-type: text/plain\r\ncontent-length: {}\r\n",
                body.len()
            );
            (body, framing)
        };
        let close = if keep_alive {
            ""
        } else {
            "connection: close\r\n"
        };
        let head = format!(
            "HTTP/1.1 {status} {}\r\n{framing}{close}\r\n",
            reason(status)
        );
        if writer
            .write_all(head.as_bytes())
            .and_then(|()| writer.write_all(body.as_bytes()))
            .and_then(|()| writer.flush())
            .is_err()
            || !keep_alive
        {
            return;
        }
        drop(active);
    }
}

/// Sleep in small steps; false if the subscriber is being dropped.
fn sleep_unless_stopped(delay: Duration, connections: &Connections) -> bool {
    let deadline = Instant::now() + delay;
    while Instant::now() < deadline {
        if connections.stopping() {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5).min(deadline - Instant::now()));
    }
    true
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        201 => "Created",
        202 => "Accepted",
        204 => "No Content",
        400 => "Bad Request",
        404 => "Not Found",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Whatever",
    }
}
