//! Subscribers that misbehave at the transport level, for the fault tests: one that
//! accepts and never answers, one that answers with bytes of the test's choosing (a huge
//! body, malformed HTTP, a response cut short), and one that can be killed and restarted on
//! the same port. (What the fault tests read about Envoy itself, its RSS and its stats, is
//! `Envoy`'s, in `stats.rs`.)
//!
//! Plain std::net and one thread per connection, like `Subscriber`; dropping a server stops
//! its threads and closes its connections.

use std::io::{self, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::server::{lock, read_request, Connections, Server};

/// What a [`FaultServer`] does with each request it has read.
#[derive(Clone, Debug)]
pub enum Fault {
    /// Answer `200` with a small body, keep the connection.
    Ok,
    /// Never answer; keep the connection open until the server is dropped.
    Silent,
    /// Write these bytes, then close the connection.
    Raw(Vec<u8>),
    /// Answer with this status and a body of this many bytes (`x` repeated), keep the
    /// connection.
    Sized(u16, usize),
}

impl Fault {
    /// A response that is not HTTP at all.
    pub fn garbage() -> Fault {
        Fault::Raw(b"HELLO THIS IS NOT HTTP\r\n\r\n".to_vec())
    }
}

struct Shared {
    name: String,
    fault: Mutex<Fault>,
    requests: AtomicUsize,
}

/// A subscriber on a port of its own that misbehaves as told, and that can be killed (its
/// port then refuses connections) and restarted on the same port.
pub struct FaultServer {
    shared: Arc<Shared>,
    server: Server,
}

impl FaultServer {
    /// A server on a free port of 127.0.0.1.
    pub fn start(name: &str, fault: Fault) -> FaultServer {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind a fault server port");
        FaultServer::serve(name, fault, listener, 0)
    }

    fn serve(name: &str, fault: Fault, listener: TcpListener, requests: usize) -> FaultServer {
        let shared = Arc::new(Shared {
            name: name.to_owned(),
            fault: Mutex::new(fault),
            requests: AtomicUsize::new(requests),
        });
        let s = Arc::clone(&shared);
        let server = Server::start(listener, &format!("fault-{name}"), move |stream, _, c| {
            serve(stream, &s, c)
        });
        FaultServer { shared, server }
    }

    pub fn name(&self) -> &str {
        &self.shared.name
    }

    pub fn port(&self) -> u16 {
        self.server.addr().port()
    }

    /// Requests read so far (over every life of the server).
    pub fn count(&self) -> usize {
        self.shared.requests.load(Ordering::SeqCst)
    }

    pub fn set_fault(&self, fault: Fault) {
        *lock(&self.shared.fault) = fault;
    }

    /// Kill it: stop listening (the port refuses connections from now on) and close every
    /// open connection, as a crashed process would. Returns what `restart` needs.
    pub fn kill(mut self) -> Killed {
        let killed = Killed {
            name: self.shared.name.clone(),
            addr: self.server.addr(),
            fault: lock(&self.shared.fault).clone(),
            requests: self.count(),
        };
        self.server.stop();
        killed
    }
}

/// A killed [`FaultServer`]: its port, free again, and its count.
pub struct Killed {
    name: String,
    addr: SocketAddr,
    fault: Fault,
    requests: usize,
}

impl Killed {
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Start it again on the same port (retrying briefly: the old socket may linger).
    pub fn restart(self) -> FaultServer {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match TcpListener::bind(self.addr) {
                Ok(listener) => {
                    return FaultServer::serve(&self.name, self.fault, listener, self.requests)
                }
                Err(e) if Instant::now() > deadline => {
                    panic!("cannot restart {} on {}: {e}", self.name, self.addr)
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
}

fn serve(stream: TcpStream, shared: &Shared, connections: &Connections) {
    let Ok(reader) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(reader);
    let mut writer = stream;
    loop {
        match read_request(&mut reader) {
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => return,
        }
        if connections.stopping() {
            return;
        }
        shared.requests.fetch_add(1, Ordering::SeqCst);
        let fault = lock(&shared.fault).clone();
        let written = match fault {
            Fault::Ok => respond(&mut writer, 200, 3),
            Fault::Sized(status, size) => respond(&mut writer, status, size),
            Fault::Silent => {
                // Hold the connection until the server stops (or the peer goes away).
                while !connections.stopping() {
                    std::thread::sleep(Duration::from_millis(10));
                }
                return;
            }
            Fault::Raw(bytes) => {
                let _ = writer.write_all(&bytes).and_then(|()| writer.flush());
                let _ = writer.shutdown(Shutdown::Both);
                return;
            }
        };
        if written.is_err() {
            return;
        }
    }
}

fn respond(writer: &mut TcpStream, status: u16, size: usize) -> io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status} Whatever\r\ncontent-type: text/plain\r\ncontent-length: {size}\r\n\r\n"
    );
    writer.write_all(head.as_bytes())?;
    let chunk = vec![b'x'; 64 * 1024];
    let mut left = size;
    while left > 0 {
        let n = left.min(chunk.len());
        writer.write_all(&chunk[..n])?;
        left -= n;
    }
    writer.flush()
}

/// Sends one raw HTTP/1.1 request on a new connection and reads the answer until the server
/// closes or `timeout` passes: (status line's code or 0, the whole answer as text).
pub fn raw_request(addr: SocketAddr, request: &[u8], timeout: Duration) -> (u16, String) {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))
        .unwrap_or_else(|e| panic!("connect to {addr}: {e}"));
    stream
        .set_read_timeout(Some(timeout))
        .expect("set a read timeout");
    stream.write_all(request).expect("send the raw request");
    let mut answer = Vec::new();
    let mut buf = [0u8; 8192];
    let deadline = Instant::now() + timeout;
    // Read until the answer is complete (its content-length), the peer closes, or time runs out.
    while Instant::now() < deadline {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                answer.extend_from_slice(&buf[..n]);
                if response_complete(&answer) {
                    break;
                }
            }
            Err(_) => break,
        }
    }
    let text = String::from_utf8_lossy(&answer).into_owned();
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (code, text)
}

fn response_complete(answer: &[u8]) -> bool {
    let text = String::from_utf8_lossy(answer);
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        return false;
    };
    let length = head.lines().find_map(|l| {
        let (name, value) = l.split_once(':')?;
        name.trim()
            .eq_ignore_ascii_case("content-length")
            .then(|| value.trim().parse::<usize>().ok())?
    });
    match length {
        Some(n) => body.len() >= n,
        None => false,
    }
}
