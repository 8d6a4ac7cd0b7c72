//! What the test servers (the recording [`Subscriber`](super::Subscriber) and the misbehaving
//! [`FaultServer`](super::faults::FaultServer)) share: a listener on loopback with a thread per
//! connection, every connection and thread tracked so that stopping the server closes and joins
//! them all, and the reader of one HTTP/1.x request.
//!
//! Plain std::net: the servers must be able to do what no HTTP library lets a server do
//! (reset a connection, hang, answer bytes that are not HTTP).

use std::collections::HashMap;
use std::io::{self, BufRead};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::Recorded;

/// A mutex's guard, also when a thread panicked holding it: a panicking connection thread
/// must not hide what was recorded.
pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The open connections of a [`Server`] and the threads serving them.
pub(super) struct Connections {
    stop: AtomicBool,
    /// Clones of the open connections, so that stopping can shut them down.
    open: Mutex<HashMap<u64, TcpStream>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    next: AtomicU64,
}

impl Connections {
    /// True once the server is being stopped: a connection thread that waits checks it.
    pub(super) fn stopping(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    /// Stop tracking connection `id` (its thread is about to close it in its own way).
    pub(super) fn forget(&self, id: u64) {
        lock(&self.open).remove(&id);
    }

    fn shut_down_all(&self) {
        for conn in lock(&self.open).values() {
            let _ = conn.shutdown(Shutdown::Both);
        }
    }
}

/// A listener whose every connection is served by `serve(stream, id, connections)` on a
/// thread of its own. Stopped (listener closed, connections shut down, threads joined) by
/// [`stop`](Server::stop) or on drop.
pub(super) struct Server {
    addr: SocketAddr,
    connections: Arc<Connections>,
    acceptor: Option<JoinHandle<()>>,
}

impl Server {
    /// Serve `listener`; threads are named `<name>` (the acceptor) and `<name>-conn-<id>`.
    pub(super) fn start(
        listener: TcpListener,
        name: &str,
        serve: impl Fn(TcpStream, u64, &Connections) + Send + Sync + 'static,
    ) -> Server {
        let addr = listener.local_addr().expect("the server's address");
        let connections = Arc::new(Connections {
            stop: AtomicBool::new(false),
            open: Mutex::new(HashMap::new()),
            threads: Mutex::new(Vec::new()),
            next: AtomicU64::new(0),
        });
        let c = Arc::clone(&connections);
        let thread_name = name.to_owned();
        let acceptor = std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || accept_loop(&listener, &thread_name, &c, Arc::new(serve)))
            .expect("spawn the server's accept thread");
        Server {
            addr,
            connections,
            acceptor: Some(acceptor),
        }
    }

    pub(super) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stop listening (the port refuses connections from then on), shut down every open
    /// connection and join every thread. Only the first call does anything.
    pub(super) fn stop(&mut self) {
        let Some(acceptor) = self.acceptor.take() else {
            return;
        };
        self.connections.stop.store(true, Ordering::SeqCst);
        self.connections.shut_down_all();
        // Wake the accept loop, which then drops the listener.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        let _ = acceptor.join();
        // Connections accepted before the stop flag was seen.
        self.connections.shut_down_all();
        let threads = std::mem::take(&mut *lock(&self.connections.threads));
        for t in threads {
            let _ = t.join();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

fn accept_loop(
    listener: &TcpListener,
    name: &str,
    connections: &Arc<Connections>,
    serve: Arc<impl Fn(TcpStream, u64, &Connections) + Send + Sync + 'static>,
) {
    for stream in listener.incoming() {
        if connections.stopping() {
            break;
        }
        let Ok(stream) = stream else { continue };
        let id = connections.next.fetch_add(1, Ordering::Relaxed);
        if let Ok(clone) = stream.try_clone() {
            lock(&connections.open).insert(id, clone);
        }
        let (c, serve) = (Arc::clone(connections), Arc::clone(&serve));
        let spawned = std::thread::Builder::new()
            .name(format!("{name}-conn-{id}"))
            .spawn(move || {
                serve(stream, id, &c);
                c.forget(id);
            });
        match spawned {
            Ok(handle) => lock(&connections.threads).push(handle),
            Err(_) => connections.forget(id),
        }
    }
}

/// Make closing `stream` send an RST instead of a FIN (SO_LINGER with a zero timeout). The
/// RST goes out when the last handle to the socket is closed.
pub fn set_linger_zero(stream: &TcpStream) -> io::Result<()> {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: a valid socket fd and a correctly sized, initialised option value.
    let rc = unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            std::ptr::addr_of!(linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
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

/// One HTTP/1.x request (head, then a content-length or chunked body); None at a clean end of
/// the connection.
pub(super) fn read_request(r: &mut impl BufRead) -> io::Result<Option<Recorded>> {
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
