//! Subscriber servers on loopback: plain HTTP/1.1 over std::net, one thread per connection,
//! keep-alive, content-length and chunked request bodies. Each records every request it
//! receives and then behaves as its test set it: answer a status, answer after a delay, or
//! reset the connection. Dropping a subscriber stops its threads.

use std::collections::HashMap;
use std::io::{self, BufRead, BufReader, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

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
}

impl Behavior {
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
    stop: AtomicBool,
    /// Open connections (clones), so that drop can shut them down.
    conns: Mutex<HashMap<u64, TcpStream>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    next_conn: AtomicU64,
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

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panicking connection thread must not hide what was recorded.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A subscriber server on 127.0.0.1:<its own free port>.
pub struct Subscriber {
    addr: SocketAddr,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

impl Subscriber {
    /// Start a subscriber (`name` only labels its answers and messages).
    pub fn start(name: &str, behavior: Behavior) -> Subscriber {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind a subscriber port");
        let addr = listener.local_addr().expect("subscriber address");
        let shared = Arc::new(Shared {
            name: name.to_owned(),
            behavior: Mutex::new(behavior),
            requests: Mutex::new(Vec::new()),
            received: Condvar::new(),
            stop: AtomicBool::new(false),
            conns: Mutex::new(HashMap::new()),
            threads: Mutex::new(Vec::new()),
            next_conn: AtomicU64::new(0),
            active: AtomicUsize::new(0),
            max_active: AtomicUsize::new(0),
        });
        let s = Arc::clone(&shared);
        let acceptor = std::thread::Builder::new()
            .name(format!("subscriber-{name}"))
            .spawn(move || accept_loop(&listener, &s))
            .expect("spawn the subscriber's accept thread");
        Subscriber {
            addr,
            shared,
            acceptor: Some(acceptor),
        }
    }

    /// Answer 200 to everything.
    pub fn ok(name: &str) -> Subscriber {
        Subscriber::start(name, Behavior::Status(200))
    }

    pub fn name(&self) -> &str {
        &self.shared.name
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
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

impl Drop for Subscriber {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        for conn in lock(&self.shared.conns).values() {
            let _ = conn.shutdown(Shutdown::Both);
        }
        // Wake the accept loop.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(acceptor) = self.acceptor.take() {
            let _ = acceptor.join();
        }
        // Connections accepted before the stop flag was seen.
        for conn in lock(&self.shared.conns).values() {
            let _ = conn.shutdown(Shutdown::Both);
        }
        let threads = std::mem::take(&mut *lock(&self.shared.threads));
        for t in threads {
            let _ = t.join();
        }
    }
}

fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
    for stream in listener.incoming() {
        if shared.stop.load(Ordering::SeqCst) {
            break;
        }
        let Ok(stream) = stream else { continue };
        let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
        if let Ok(clone) = stream.try_clone() {
            lock(&shared.conns).insert(id, clone);
        }
        let s = Arc::clone(shared);
        let spawned = std::thread::Builder::new()
            .name(format!("subscriber-{}-conn-{id}", shared.name))
            .spawn(move || {
                serve(stream, id, &s);
                lock(&s.conns).remove(&id);
            });
        match spawned {
            Ok(handle) => lock(&shared.threads).push(handle),
            Err(_) => {
                lock(&shared.conns).remove(&id);
            }
        }
    }
}

fn serve(stream: TcpStream, id: u64, shared: &Shared) {
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
                if !sleep_unless_stopped(delay, shared) {
                    return;
                }
                status
            }
            Behavior::Reset => {
                // Drop every other handle to the socket, then close with SO_LINGER 0: RST.
                lock(&shared.conns).remove(&id);
                drop(reader);
                reset(&writer);
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
fn sleep_unless_stopped(delay: Duration, shared: &Shared) -> bool {
    let deadline = Instant::now() + delay;
    while Instant::now() < deadline {
        if shared.stop.load(Ordering::SeqCst) {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5).min(deadline - Instant::now()));
    }
    true
}

fn reset(stream: &TcpStream) {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: a valid socket fd and a correctly sized, initialised option value.
    unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            std::ptr::addr_of!(linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
    // The caller drops the stream: close() with linger 0 sends RST.
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

fn read_line(r: &mut impl BufRead) -> io::Result<Option<String>> {
    let mut buf = Vec::new();
    if r.read_until(b'\n', &mut buf)? == 0 {
        return Ok(None);
    }
    while buf.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
        buf.pop();
    }
    Ok(Some(String::from_utf8_lossy(&buf).into_owned()))
}

fn bad(msg: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.to_owned())
}

/// One HTTP/1.x request; None at a clean end of the connection.
fn read_request(r: &mut impl BufRead) -> io::Result<Option<Recorded>> {
    let line = loop {
        match read_line(r)? {
            None => return Ok(None),
            Some(l) if l.is_empty() => continue,
            Some(l) => break l,
        }
    };
    let at = Instant::now();
    let mut parts = line.splitn(3, ' ');
    let method = parts.next().unwrap_or_default().to_owned();
    let path = parts
        .next()
        .ok_or_else(|| bad("no request target"))?
        .to_owned();
    let version = parts.next().unwrap_or_default().to_owned();
    let mut headers = Vec::new();
    loop {
        let line = read_line(r)?.ok_or_else(|| bad("connection closed in the headers"))?;
        if line.is_empty() {
            break;
        }
        let (name, value) = line.split_once(':').ok_or_else(|| bad("bad header line"))?;
        headers.push((name.trim().to_ascii_lowercase(), value.trim().to_owned()));
    }
    let mut request = Recorded {
        method,
        path,
        version,
        headers,
        body: Vec::new(),
        at,
    };
    let chunked = request
        .header_all("transfer-encoding")
        .iter()
        .any(|v| v.to_ascii_lowercase().contains("chunked"));
    if chunked {
        loop {
            let size_line = read_line(r)?.ok_or_else(|| bad("connection closed in a chunk"))?;
            let size = size_line.split(';').next().unwrap_or_default().trim();
            let size = usize::from_str_radix(size, 16).map_err(|_| bad("bad chunk size"))?;
            if size == 0 {
                // Trailers, up to the empty line.
                while read_line(r)?.is_some_and(|l| !l.is_empty()) {}
                break;
            }
            let start = request.body.len();
            request.body.resize(start + size, 0);
            r.read_exact(&mut request.body[start..])?;
            read_line(r)?;
        }
    } else if let Some(len) = request.header("content-length") {
        let len: usize = len.parse().map_err(|_| bad("bad content-length"))?;
        request.body.resize(len, 0);
        r.read_exact(&mut request.body)?;
    }
    Ok(Some(request))
}
