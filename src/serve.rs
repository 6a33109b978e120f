//! The HTTP/1.1 accept loop. It drives each connection with hyper, the same way `axum::serve` does, and adds
//! the two limits a public endpoint needs and `axum::serve` does not set:
//!
//! - **An idle timeout** ([`ConnLimits::idle_timeout`]). A connection that starts no request for that
//!   long is closed: a keep-alive connection left idle, and a slowloris connection that sends a request's
//!   head a byte at a time and never completes it. A watchdog per connection checks its request counters
//!   once per timeout, so requests pay no timer of their own (hyper's `header_read_timeout` would arm one
//!   per request). A connection is closed between one and two timeouts after its last request finished.
//! - **A cap on open connections** ([`ConnLimits::max_connections`]). Past it, new connections wait in the
//!   kernel's accept queue until one closes, so a flood of connections never exhausts the process's file
//!   descriptors, which the store's connections and the cache file need too.
//!
//! And it closes connections gracefully. A connection closed while the client is still sending (an
//! answer given before its request's body was read) first lingers: it reads and discards for a moment, so
//! the client gets the answer instead of a reset (see [`Socket`]).
//!
//! A [`Shortcut`] serves the hot routes before the router: the router's per-request work (matching the
//! path, the matched-path and parameter extensions, cloning the boxed route service, boxing the handler's
//! future) cost 1.6 µs of CPU per hot-path request, more than any one stage of hydrant's own.
//!
//! The load tester's floor serves through the same loop, with a shortcut for its predict route, so the
//! comparison with it stays like for like.

use std::convert::Infallible;
use std::future::Future;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::sync::atomic::{
    AtomicBool, AtomicU64, Ordering::AcqRel, Ordering::Relaxed, Ordering::Release,
};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use axum::Router;
use axum::extract::Request;
use axum::response::Response;
use futures::future::Either;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};

/// An answer on its way, boxed: what a [`Shortcut`] returns.
pub type ResponseFuture = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

/// Routes served before the router.
pub trait Shortcut: Send + Sync + 'static {
    /// Whether the shortcut serves `req` (else the router does).
    fn takes(&self, req: &Request) -> bool;

    /// The answer to a request it [takes](Shortcut::takes).
    fn serve(&self, req: Request) -> ResponseFuture;
}

/// What [`serve`] answers with: the router, and the shortcut in front of it, if any.
#[derive(Clone)]
pub struct Routes {
    pub router: Router,
    pub shortcut: Option<Arc<dyn Shortcut>>,
}

impl From<Router> for Routes {
    fn from(router: Router) -> Self {
        Self {
            router,
            shortcut: None,
        }
    }
}

/// The limits on client connections.
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    /// How long a connection may go without starting a request before it is closed.
    pub idle_timeout: Duration,
    /// Connections open at once.
    pub max_connections: usize,
}

impl From<&crate::config::ServerConfig> for ConnLimits {
    fn from(c: &crate::config::ServerConfig) -> Self {
        Self {
            idle_timeout: c.idle_timeout,
            max_connections: c.max_connections,
        }
    }
}

/// The `server.idle_timeout` and `server.max_connections` defaults.
impl Default for ConnLimits {
    fn default() -> Self {
        Self::from(&crate::config::ServerConfig::default())
    }
}

/// `max_connections`, lowered to leave file descriptors for the store's connections, the cache file and
/// the logs when the process's open-files limit is lower.
fn within_open_files(max_connections: usize) -> usize {
    let Some(open_files) = open_files_limit() else {
        return max_connections;
    };
    // 128 descriptors kept back; under a small limit, half of it (`ulimit -n 100` still serves 50).
    let usable = if open_files > 256 {
        open_files - 128
    } else {
        (open_files / 2).max(1)
    };
    if max_connections > usable {
        tracing::warn!(
            max_connections,
            open_files,
            "server.max_connections is above what the open-files limit (ulimit -n {open_files}) leaves: at most {usable} connections are served at once; raise `ulimit -n` to serve more"
        );
        return usable;
    }
    max_connections
}

/// The soft limit on open file descriptors (`ulimit -n`), where the platform says.
fn open_files_limit() -> Option<usize> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

/// Listens on `addr` with an accept queue of up to 4096 connections (the kernel caps it at
/// `net.core.somaxconn`). The 128 of `TcpListener::bind` overflows when thousands of clients connect at
/// once, and each connection dropped from the queue waits a second for the client's SYN retry.
pub async fn listen(addr: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(ACCEPT_QUEUE)
}

/// The accept queue asked of the kernel.
const ACCEPT_QUEUE: u32 = 4096;

/// Serves `routes` on `listener` until `shutdown` resolves. Then it stops accepting, lets each open
/// connection finish the request it is serving (an idle one gets [`IDLE_GRACE`] to start one already
/// sent, a half-sent head [`HEAD_GRACE`]), serves the connections already waiting in the listener's
/// queue the same way, and returns when all have closed; bound that wait from outside.
pub async fn serve(
    listener: TcpListener,
    routes: impl Into<Routes>,
    limits: ConnLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let routes: Routes = routes.into();
    let max_connections = within_open_files(limits.max_connections);
    let permits = Arc::new(Semaphore::new(
        max_connections.clamp(1, Semaphore::MAX_PERMITS),
    ));
    let mut http = hyper::server::conn::http1::Builder::new();
    // `half_close`: a client that shuts its write side once the request is sent (HTTP/1.0-style tools,
    // `nc -N`, a proxy passing on its client's FIN) is still answered. Without it hyper drops the request
    // on that end-of-stream, and a write the handler goes on to apply is never acknowledged. A client that
    // is really gone is found when the answer is written; `limits.request_timeout` bounds the work meanwhile.
    http.keep_alive(true)
        .half_close(true)
        .max_buf_size(MAX_HEAD_BYTES);
    // `stop` tells the connections to finish; each holds a clone of `open` until it closes.
    let (stop_tx, stop_rx) = watch::channel(false);
    let (open_tx, open_rx) = watch::channel(());
    let stopping = Arc::new(AtomicBool::new(false));
    // One connection: served until it ends, the idle timeout, or the shutdown. `permit` is its place
    // under max_connections (none for the connections taken from the queue at shutdown).
    let spawn_connection = |stream: TcpStream, permit: Option<OwnedSemaphorePermit>| {
        let activity = Arc::new(Activity::new(stopping.clone()));
        let socket = Socket {
            stream: Some(stream),
            activity: activity.clone(),
            held: Some(Held {
                _permit: permit,
                _open: open_rx.clone(),
            }),
        };
        let conn = http.serve_connection(
            TokioIo::new(socket),
            TowerToHyperService::new(Counted {
                inner: routes.clone(),
                activity: activity.clone(),
            }),
        );
        let mut stop = stop_rx.clone();
        let idle_timeout = limits.idle_timeout;
        tokio::spawn(async move {
            let mut conn = pin!(conn);
            // The shutdown watch and the idle timer, polled only when one of them has woken the task.
            let watch = pin!(async {
                tokio::select! {
                    r = stop.wait_for(|s| *s) => r.is_ok(),
                    () = activity.idle(idle_timeout) => false, // dropping `conn` closes the socket
                }
            });
            let stopping = match Watched::new(conn.as_mut(), watch).await {
                Either::Left(r) => {
                    if r.is_err_and(|e| e.is_parse_version_h2()) {
                        activity.http2.store(true, Relaxed);
                    }
                    false
                }
                Either::Right(stopping) => stopping,
            };
            if stopping {
                // hyper closes an idle connection at once, and with it a request the client has already
                // sent that is still in the socket, unread: the client cannot tell that from a request
                // refused. So an idle connection first gets a moment to start one.
                let ended = activity.quiet() && {
                    let before = activity.started.load(Relaxed);
                    let started = || activity.started.load(Relaxed) != before;
                    let waited = drive_until(conn.as_mut(), IDLE_GRACE / 10, started);
                    tokio::time::timeout(IDLE_GRACE, waited).await == Ok(true)
                };
                if !ended {
                    conn.as_mut().graceful_shutdown();
                    // hyper waits for a request head that is still arriving as for a request; nothing
                    // of it has reached the service, so after a moment to complete it is dropped rather
                    // than waited for until shutdown_grace.
                    drive_until(conn.as_mut(), HEAD_GRACE, || activity.quiet()).await;
                }
            }
            // Dropping `conn` drops the socket, which releases what the connection holds (its permit,
            // its place in the count a shutdown waits for), at once or after lingering (see `Socket`).
        });
    };
    let mut shutdown = pin!(shutdown);
    let mut warned_full = false;
    loop {
        let permit = tokio::select! {
            biased;
            _ = &mut shutdown => break,
            p = permits.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break, // never closed
            },
        };
        if permits.available_permits() == 0 && !warned_full {
            warned_full = true;
            tracing::warn!(
                max_connections,
                "{max_connections} connections are open, the most served at once (server.max_connections, or the open-files limit): new ones wait until one closes"
            );
        }
        let stream = tokio::select! {
            biased;
            _ = &mut shutdown => break,
            r = listener.accept() => match r {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors or memory: wait for connections to close rather than spin.
                    // Errors about a single connection (reset before accept) need no pause.
                    if !matches!(
                        e.kind(),
                        std::io::ErrorKind::ConnectionAborted | std::io::ErrorKind::ConnectionReset
                    ) {
                        tracing::warn!("cannot accept a connection: {e}");
                        tokio::select! {
                            _ = &mut shutdown => break,
                            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                        }
                    }
                    continue;
                }
            },
        };
        if permits.available_permits() > 0 {
            warned_full = false;
        }
        spawn_connection(stream, Some(permit));
    }
    // Connections the kernel completed before the shutdown, still in the listener's queue: dropping the
    // listener would reset them, and their clients could not tell that from a request refused. They are
    // taken and served as idle connections at shutdown are: a moment to start a request already sent.
    stopping.store(true, Relaxed);
    let queued = take_queued(listener);
    let _ = stop_tx.send(true);
    if !queued.is_empty() {
        tracing::info!(
            connections = queued.len(),
            "shutting down: serving the connections already queued"
        );
    }
    for stream in queued {
        spawn_connection(stream, None);
    }
    drop(open_rx);
    open_tx.closed().await;
    Ok(())
}

/// The most connections taken from the listener's queue at shutdown: the kernel's queue holds at most
/// `net.core.somaxconn` of them (4096 by default), which this covers.
const MAX_QUEUED_AT_SHUTDOWN: usize = 8192;

/// Takes the connections waiting in `listener`'s accept queue, without waiting for more, and closes it.
fn take_queued(listener: TcpListener) -> Vec<TcpStream> {
    let mut out = Vec::new();
    // Asked of the socket itself: tokio's own `accept` knows only what its reactor has seen so far.
    let Ok(listener) = listener.into_std() else {
        return out;
    };
    if listener.set_nonblocking(true).is_err() {
        return out;
    }
    while out.len() < MAX_QUEUED_AT_SHUTDOWN {
        match listener.accept() {
            Ok((stream, _)) => {
                if let Ok(stream) = stream
                    .set_nonblocking(true)
                    .and_then(|()| TcpStream::from_std(stream))
                {
                    out.push(stream);
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::Interrupted
                        | std::io::ErrorKind::ConnectionAborted
                        | std::io::ErrorKind::ConnectionReset
                ) => {}
            Err(_) => break, // WouldBlock: the queue is empty
        }
    }
    out
}

/// A connection raced against what may end it early (the shutdown, the idle timeout): `conn` is polled
/// at every wake-up of the task, `watch` only after one of its own wakers rang. A `select!` polls every
/// branch at every wake-up, and a connection's task wakes two or three times per request: the watch and
/// the timer behind it cost about 1,400 instructions a request that way (`bench-instructions.sh`).
/// It answers `Left` with the connection's output, `Right` with the watch's.
struct Watched<C, W> {
    conn: C,
    watch: W,
    bell: Arc<Bell>,
}

impl<C, W> Watched<C, W> {
    fn new(conn: C, watch: W) -> Self {
        Self {
            conn,
            watch,
            bell: Arc::default(),
        }
    }
}

/// The waker handed to the watch: it notes that the watch has something to look at, then wakes the task.
#[derive(Default)]
struct Bell {
    /// The watch has not been woken since it was last polled (false at first: the first poll looks).
    quiet: AtomicBool,
    task: futures::task::AtomicWaker,
}

impl std::task::Wake for Bell {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.quiet.store(false, Release);
        self.task.wake();
    }
}

impl<C: Future + Unpin, W: Future + Unpin> Future for Watched<C, W> {
    type Output = Either<C::Output, W::Output>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        // Registered before the bell is read: a watch waking after the read wakes this task again.
        self.bell.task.register(cx.waker());
        if let Poll::Ready(out) = Pin::new(&mut self.conn).poll(cx) {
            return Poll::Ready(Either::Left(out));
        }
        if !self.bell.quiet.swap(true, AcqRel) {
            let waker = std::task::Waker::from(self.bell.clone());
            if let Poll::Ready(out) =
                Pin::new(&mut self.watch).poll(&mut Context::from_waker(&waker))
            {
                return Poll::Ready(Either::Right(out));
            }
        }
        Poll::Pending
    }
}

/// Drives `conn` until it ends (`true`), or until `done`, checked every `period`, says to stop waiting
/// for it (`false`).
async fn drive_until<F: Future>(
    mut conn: Pin<&mut F>,
    period: Duration,
    done: impl Fn() -> bool,
) -> bool {
    loop {
        tokio::select! {
            _ = conn.as_mut() => return true,
            _ = tokio::time::sleep(period) => {
                if done() {
                    return false;
                }
            }
        }
    }
}

/// The shortest idle check period (a zero timeout would make `tokio::time::interval` panic).
const MIN_IDLE_CHECK: Duration = Duration::from_millis(10);

/// At shutdown, how long a connection with no request in the service (a head still arriving) may take
/// to deliver one before it is closed.
const HEAD_GRACE: Duration = Duration::from_millis(500);

/// At shutdown, how long an idle connection may take to start a request already sent (read from the socket
/// once the executor gets to it) before it is closed.
const IDLE_GRACE: Duration = Duration::from_millis(100);

/// The most a connection buffers of a request head (hyper's default is about 400 KiB): 10,000 connections
/// each holding an unfinished head would otherwise pin gigabytes. hyper checks it between reads, and one
/// read fills what the buffer has room for, so a head that arrives whole in one read may be up to about
/// twice this. Bodies are read in chunks of at most this.
const MAX_HEAD_BYTES: usize = 64 * 1024;

/// Idle checks per `idle_timeout`: a connection is closed after between 1 and 1 + 1/CHECKS of it.
const IDLE_CHECKS: u32 = 4;

/// Requests started and finished on one connection.
struct Activity {
    started: AtomicU64,
    finished: AtomicU64,
    /// The last answer refused a request that had a body: it may have gone out before the body was
    /// read, whose rest the client may still be sending.
    linger: AtomicBool,
    /// The client opened with the HTTP/2 preface (prior knowledge, as gRPC clients and
    /// `curl --http2-prior-knowledge` do): the socket answers in HTTP/2 that it takes HTTP/1.1 only.
    http2: AtomicBool,
    /// The server's: set when it stops accepting. Every answer from then on says `Connection: close`, so
    /// that a client does not send another request on a connection about to be closed (one answered
    /// between two of the shutdown's looks at an idle connection would otherwise go out keep-alive).
    stopping: Arc<AtomicBool>,
}

impl Activity {
    fn new(stopping: Arc<AtomicBool>) -> Self {
        Self {
            started: AtomicU64::new(0),
            finished: AtomicU64::new(0),
            linger: AtomicBool::new(false),
            http2: AtomicBool::new(false),
            stopping,
        }
    }

    /// No request is in the service now.
    fn quiet(&self) -> bool {
        self.started.load(Relaxed) == self.finished.load(Relaxed)
    }

    /// Resolves once a whole `timeout` passes in which no request was started, running or finished
    /// (checked [`IDLE_CHECKS`] times per `timeout`, so it resolves at most a quarter of it late).
    async fn idle(&self, timeout: Duration) {
        let period = (timeout / IDLE_CHECKS).max(MIN_IDLE_CHECK);
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await; // the first tick is immediate
        let mut seen = None;
        let mut quiet_checks = 0;
        loop {
            tick.tick().await;
            let now = (self.started.load(Relaxed), self.finished.load(Relaxed));
            // Unchanged since the last check and nothing running: idle for one more period. A
            // request that finished since the last check (its answer may still be being written)
            // starts the count again.
            if seen == Some(now) && now.0 == now.1 {
                quiet_checks += 1;
                if period * quiet_checks >= timeout {
                    return;
                }
            } else {
                quiet_checks = 0;
            }
            seen = Some(now);
        }
    }
}

/// The routes, counting the requests they start and finish in the connection's [`Activity`].
#[derive(Clone)]
struct Counted {
    inner: Routes,
    activity: Arc<Activity>,
}

impl tower::Service<hyper::Request<hyper::body::Incoming>> for Counted {
    type Response = Response;
    type Error = Infallible;
    type Future = CountedFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: hyper::Request<hyper::body::Incoming>) -> Self::Future {
        self.activity.started.fetch_add(1, Relaxed);
        // Whether a body may follow the head: a refusal of such a request may go out before the body is
        // read (a field check; no header lookup).
        let body = !hyper::body::Body::is_end_stream(req.body());
        let req = req.map(axum::body::Body::new);
        let inner = match &self.inner.shortcut {
            Some(shortcut) if shortcut.takes(&req) => Answer::Shortcut {
                fut: shortcut.serve(req),
            },
            _ => Answer::Router {
                fut: tower::Service::call(&mut self.inner.router, req),
            },
        };
        CountedFuture {
            inner,
            body,
            done: Finished(self.activity.clone()),
        }
    }
}

/// Counts the request finished when dropped: answered, or abandoned with its connection.
struct Finished(Arc<Activity>);

impl Drop for Finished {
    fn drop(&mut self) {
        self.0.finished.fetch_add(1, Relaxed);
    }
}

pin_project_lite::pin_project! {
    #[project = AnswerProj]
    enum Answer {
        Router { #[pin] fut: <Router as tower::Service<Request>>::Future },
        Shortcut { fut: ResponseFuture },
    }
}

pin_project_lite::pin_project! {
    struct CountedFuture {
        #[pin]
        inner: Answer,
        body: bool,
        done: Finished,
    }
}

impl Future for CountedFuture {
    type Output = Result<Response, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let mut answer = match this.inner.project() {
            AnswerProj::Router { fut } => ready!(fut.poll(cx)),
            AnswerProj::Shortcut { fut } => ready!(fut.as_mut().poll(cx)),
        };
        if this.done.0.stopping.load(Relaxed)
            && let Ok(r) = answer.as_mut()
        {
            // hyper closes the connection after an answer that says so.
            r.headers_mut().insert(
                axum::http::header::CONNECTION,
                axum::http::HeaderValue::from_static("close"),
            );
        }
        // Only a refusal goes out before its request's body is read (a route that takes none, a body
        // refused by its headers, cut at the size limit or stopped arriving), so only one of a request
        // with a body can leave the client still sending. The flag follows the connection's last answer,
        // the one that decides that when the socket closes.
        let linger = *this.body && answer.as_ref().is_ok_and(|r| r.status().as_u16() >= 400);
        this.done.0.linger.store(linger, Relaxed);
        Poll::Ready(answer)
    }
}

/// A connection's socket. It holds the connection's permit, and when hyper lets go of it while the client
/// may still be sending (an answer given before the request's body was read, such as a 413 for a declared
/// length, or request bytes left unread), it lingers: it ends its side of the stream and reads and discards
/// what still arrives, for at most [`LINGER`], before it closes. Closing a socket with unread bytes makes
/// the kernel reset the connection, and a client still writing its body (Python's `http.client` and
/// `requests`, hyper's client, reqwest) then sees a broken pipe or a reset instead of the answer.
struct Socket {
    /// `None` only once dropped.
    stream: Option<TcpStream>,
    activity: Arc<Activity>,
    /// `None` only once dropped.
    held: Option<Held>,
}

/// What a connection holds until its socket is closed, lingering included.
struct Held {
    /// Its place under max_connections (none for a connection taken from the queue at shutdown).
    _permit: Option<OwnedSemaphorePermit>,
    /// A place in [`serve`]'s count of open connections, which a shutdown waits for, rather than ending
    /// the process and resetting the connection under a client that has yet to read its answer.
    _open: watch::Receiver<()>,
}

/// What a client that opened with the HTTP/2 preface is sent: the server's side of the preface (an empty
/// SETTINGS frame) and a GOAWAY frame (RFC 9113 §6.8) for stream 0 with the error code
/// HTTP_1_1_REQUIRED (0xd) and a reason, so that it reports "use HTTP/1.1" rather than a dropped
/// connection.
const HTTP2_REFUSAL: [u8; 9 + 9 + 8 + HTTP2_REASON.len()] = {
    let mut f = [0u8; 9 + 9 + 8 + HTTP2_REASON.len()];
    // SETTINGS: length 0, type 0x4, no flags, stream 0.
    f[3] = 0x4;
    // GOAWAY: length, type 0x7, no flags, stream 0; then the last stream id (0) and the error code.
    let len = 8 + HTTP2_REASON.len();
    f[9] = (len >> 16) as u8;
    f[10] = (len >> 8) as u8;
    f[11] = len as u8;
    f[12] = 0x7;
    f[18 + 7] = 0xd;
    let mut i = 0;
    while i < HTTP2_REASON.len() {
        f[26 + i] = HTTP2_REASON[i];
        i += 1;
    }
    f
};

const HTTP2_REASON: &[u8] = b"hydrant serves HTTP/1.1 only";

/// The longest a closing connection keeps reading what its client still sends.
const LINGER: Duration = Duration::from_secs(5);

/// A lingering connection whose client sends nothing for this long is closed.
const LINGER_QUIET: Duration = Duration::from_secs(1);

/// The most a lingering connection reads before it closes.
const LINGER_BYTES: usize = 64 << 20;

impl Socket {
    /// Runs `io` on the stream, which is only gone once the socket is dropped.
    fn with_stream<T>(
        self: Pin<&mut Self>,
        io: impl FnOnce(Pin<&mut TcpStream>) -> Poll<std::io::Result<T>>,
    ) -> Poll<std::io::Result<T>> {
        match self.get_mut().stream.as_mut() {
            Some(s) => io(Pin::new(s)),
            None => Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::NotConnected,
                "the socket was dropped",
            ))),
        }
    }
}

impl tokio::io::AsyncRead for Socket {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        self.with_stream(|s| s.poll_read(cx, buf))
    }
}

impl tokio::io::AsyncWrite for Socket {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.with_stream(|s| s.poll_write(cx, buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        self.with_stream(|s| s.poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.as_ref().is_some_and(|s| s.is_write_vectored())
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.with_stream(|s| s.poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.with_stream(|s| s.poll_shutdown(cx))
    }
}

impl Drop for Socket {
    fn drop(&mut self) {
        let (Some(stream), held) = (self.stream.take(), self.held.take()) else {
            return;
        };
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.activity.http2.load(Relaxed) {
            rt.spawn(async move {
                use tokio::io::AsyncWriteExt;
                let mut stream = stream;
                // Bounded like the linger after it: a client that reads nothing cannot hold it open.
                let wrote =
                    tokio::time::timeout(LINGER_QUIET, stream.write_all(&HTTP2_REFUSAL)).await;
                if matches!(wrote, Ok(Ok(()))) {
                    linger(stream, held).await;
                }
            });
            return;
        }
        if self.activity.linger.load(Relaxed) {
            rt.spawn(linger(stream, held));
            return;
        }
        // Bytes waiting unread (a head hyper refused, a pipelined request at shutdown) would turn the
        // close into a reset. The kernel is asked, with a peek: tokio's own readiness flag is cleared by
        // any short read, so a `try_read` would often not look. A peek of 0 is the client's own end.
        let Ok(std) = stream.into_std() else {
            return;
        };
        let unread = matches!(std.peek(&mut [0u8; 1]), Ok(n) if n > 0);
        if unread && let Ok(stream) = TcpStream::from_std(std) {
            rt.spawn(linger(stream, held));
        }
    }
}

/// Ends the write side (the client sees the answer end), then reads and discards what the client still
/// sends until it ends its side, pauses for [`LINGER_QUIET`], or [`LINGER`] or [`LINGER_BYTES`] is
/// reached. `held` is released once the socket is closed.
async fn linger(mut stream: TcpStream, held: Option<Held>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let until = tokio::time::Instant::now() + LINGER;
    let _ = stream.shutdown().await;
    let mut buf = vec![0u8; 16 * 1024];
    let mut read = 0;
    while read < LINGER_BYTES {
        let quiet = (tokio::time::Instant::now() + LINGER_QUIET).min(until);
        match tokio::time::timeout_at(quiet, stream.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => read += n,
            _ => break,
        }
    }
    drop(stream);
    drop(held);
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use axum::http::header::CONNECTION;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// Pending `wakes` times, waking its task each time, then ready with `"conn"`.
    struct Restless {
        wakes: usize,
    }

    impl Future for Restless {
        type Output = &'static str;

        fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<&'static str> {
            if self.wakes == 0 {
                return Poll::Ready("conn");
            }
            self.wakes -= 1;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    }

    /// The watch is polled once, not at each of the connection's 100 wake-ups, and its own waker still
    /// ends the race while the connection stays pending.
    #[tokio::test]
    async fn a_watched_connection_polls_the_watch_only_when_the_watch_woke() {
        let polls = std::sync::atomic::AtomicUsize::new(0);
        let watch = std::future::poll_fn(|_| {
            polls.fetch_add(1, Relaxed);
            Poll::<()>::Pending
        });
        let ended = Watched::new(Restless { wakes: 100 }, pin!(watch)).await;
        assert!(matches!(ended, Either::Left("conn")));
        assert_eq!(polls.load(Relaxed), 1);

        let started = Instant::now();
        let (conn, watch) = (
            pin!(std::future::pending::<()>()),
            pin!(tokio::time::sleep(Duration::from_millis(20))),
        );
        let ended = tokio::time::timeout(Duration::from_secs(5), Watched::new(conn, watch)).await;
        assert!(matches!(ended, Ok(Either::Right(()))));
        // Ended by the watch's own wake-up, not found at the next poll the timeout's timer brought.
        let took = started.elapsed();
        assert!(
            (Duration::from_millis(20)..Duration::from_secs(2)).contains(&took),
            "the watch's wake-up was lost: ended after {took:?}"
        );
    }

    async fn start(limits: ConnLimits) -> (std::net::SocketAddr, tokio::sync::oneshot::Sender<()>) {
        let server = spawn_server(limits).await;
        (server.addr, server.stop)
    }

    /// A test server: its address, the switch that shuts it down, and `serve`'s task.
    struct Server {
        addr: std::net::SocketAddr,
        stop: tokio::sync::oneshot::Sender<()>,
        task: tokio::task::JoinHandle<std::io::Result<()>>,
    }

    /// Serves `/` (`ok`), `POST /refuse` (a 413 given before the body is read) and `/slow` (a second).
    async fn spawn_server(limits: ConnLimits) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let router = Router::new()
            .route("/", axum::routing::get(|| async { "ok" }))
            .route(
                "/refuse",
                // A refusal given before the body is read, as hydrant's request layer marks it.
                axum::routing::post(|| async {
                    (
                        axum::http::StatusCode::PAYLOAD_TOO_LARGE,
                        [(CONNECTION, "close")],
                        "too large",
                    )
                }),
            )
            .route(
                "/slow",
                axum::routing::get(|| async {
                    tokio::time::sleep(Duration::from_millis(1000)).await;
                    "done"
                }),
            );
        let (stop, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(serve(listener, router, limits, async {
            let _ = rx.await;
        }));
        Server { addr, stop, task }
    }

    /// Sends one GET on `s` and reads the answer's status line.
    async fn get(s: &mut TcpStream) -> String {
        s.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .expect("write");
        let mut buf = vec![0u8; 1024];
        let n = s.read(&mut buf).await.expect("read");
        String::from_utf8_lossy(&buf[..n])
            .lines()
            .next()
            .unwrap_or("")
            .to_owned()
    }

    /// Waits (5 s at most, else panics with `what`) for `serve`'s task to return `Ok`.
    async fn returns(task: tokio::task::JoinHandle<std::io::Result<()>>, what: &str) {
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .unwrap_or_else(|_| panic!("{what}"))
            .expect("join")
            .expect("serve");
    }

    /// Reads `s` until the server closes it (5 s at most): the whole answer.
    async fn answer(s: &mut TcpStream, what: &str) -> String {
        let mut answer = String::new();
        tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut answer))
            .await
            .expect("closed in time")
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        answer
    }

    /// Reads until the server closes the connection; how long that took.
    async fn closed_after(s: &mut TcpStream) -> Duration {
        let t = Instant::now();
        let mut buf = [0u8; 1024];
        loop {
            match tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf)).await {
                Ok(Ok(0) | Err(_)) => return t.elapsed(),
                Ok(Ok(_)) => continue,
                Err(_) => panic!("the connection is still open after 10 s"),
            }
        }
    }

    #[tokio::test]
    async fn idle_and_slowloris_connections_are_closed_after_the_idle_timeout() {
        let timeout = Duration::from_millis(400);
        let (addr, _stop) = start(ConnLimits {
            idle_timeout: timeout,
            max_connections: 100,
        })
        .await;
        // Idle after one request on a keep-alive connection.
        let mut idle = TcpStream::connect(addr).await.expect("connect");
        assert_eq!(get(&mut idle).await, "HTTP/1.1 200 OK");
        let waited = closed_after(&mut idle).await;
        // Closed after the timeout and not much later (checks run four times per timeout).
        assert!(
            waited >= timeout * 9 / 10 && waited < timeout * 13 / 8,
            "{waited:?}"
        );
        // A head sent a little at a time never completes.
        let mut slow = TcpStream::connect(addr).await.expect("connect");
        let t = Instant::now();
        for b in b"GET / HTTP/1.1\r\nhost: x\r\n".chunks(2) {
            if slow.write_all(b).await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            if t.elapsed() > Duration::from_secs(5) {
                break;
            }
        }
        let waited = t.elapsed() + closed_after(&mut slow).await;
        assert!(waited < Duration::from_secs(5), "{waited:?}");
        // A request running for longer than the timeout is not idleness.
        let mut slow = TcpStream::connect(addr).await.expect("connect");
        slow.write_all(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .expect("write");
        let mut buf = vec![0u8; 1024];
        let n = tokio::time::timeout(Duration::from_secs(5), slow.read(&mut buf))
            .await
            .expect("answered")
            .expect("read");
        assert!(
            buf[..n].starts_with(b"HTTP/1.1 200 OK"),
            "{}",
            String::from_utf8_lossy(&buf[..n])
        );
        // A connection that keeps sending requests in time is served throughout.
        let mut busy = TcpStream::connect(addr).await.expect("connect");
        for _ in 0..4 {
            assert_eq!(get(&mut busy).await, "HTTP/1.1 200 OK");
            tokio::time::sleep(timeout / 2).await;
        }
    }

    #[tokio::test]
    async fn past_max_connections_a_new_connection_waits_for_one_to_close() {
        let (addr, _stop) = start(ConnLimits {
            idle_timeout: Duration::from_secs(30),
            max_connections: 2,
        })
        .await;
        let mut a = TcpStream::connect(addr).await.expect("connect");
        let mut b = TcpStream::connect(addr).await.expect("connect");
        assert_eq!(get(&mut a).await, "HTTP/1.1 200 OK");
        assert_eq!(get(&mut b).await, "HTTP/1.1 200 OK");
        // The kernel completes the third handshake, but the server does not take the connection yet.
        let mut c = TcpStream::connect(addr).await.expect("connect");
        c.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .expect("write");
        let mut buf = [0u8; 64];
        assert!(
            tokio::time::timeout(Duration::from_millis(300), c.read(&mut buf))
                .await
                .is_err(),
            "served past the cap"
        );
        drop(a);
        let n = tokio::time::timeout(Duration::from_secs(5), c.read(&mut buf))
            .await
            .expect("served once a connection closed")
            .expect("read");
        assert!(buf[..n].starts_with(b"HTTP/1.1 200 OK"));
        assert_eq!(get(&mut b).await, "HTTP/1.1 200 OK");
    }

    /// A connection that announced a 100 MB body and got its 413, still open to send the body, with a
    /// 64 KiB buffer to send it from.
    async fn refused_upload(addr: std::net::SocketAddr) -> (TcpStream, Vec<u8>) {
        let mut a = TcpStream::connect(addr).await.expect("connect");
        a.write_all(b"POST /refuse HTTP/1.1\r\nhost: x\r\ncontent-length: 100000000\r\n\r\n")
            .await
            .expect("write");
        let mut buf = vec![0u8; 64 * 1024];
        let n = a.read(&mut buf).await.expect("read");
        assert!(buf[..n].starts_with(b"HTTP/1.1 413 "));
        (a, buf)
    }

    #[tokio::test]
    async fn a_refused_body_is_read_and_discarded_then_the_connection_closes() {
        let (addr, _stop) = start(ConnLimits {
            idle_timeout: Duration::from_secs(30),
            max_connections: 1,
        })
        .await;
        let (mut a, mut buf) = refused_upload(addr).await;
        // The answer ends (the server's side of the stream is shut), but what the client still sends is
        // read, not answered with a reset: far more than the kernel's buffers would hold.
        for _ in 0..200 {
            a.write_all(&buf)
                .await
                .expect("the rest of the body is taken");
        }
        assert_eq!(a.read(&mut buf).await.expect("read"), 0);
        // The lingering connection holds its place under max_connections until its client falls quiet
        // for LINGER_QUIET; then a waiting connection is served.
        let t = Instant::now();
        let mut b = TcpStream::connect(addr).await.expect("connect");
        assert_eq!(get(&mut b).await, "HTTP/1.1 200 OK");
        let waited = t.elapsed();
        assert!(
            waited >= LINGER_QUIET / 2 && waited < LINGER,
            "served after {waited:?}"
        );
    }

    #[tokio::test]
    async fn shutdown_finishes_the_request_in_flight_and_closes_idle_connections() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let router = Router::new().route(
            "/slow",
            axum::routing::get(|| async {
                tokio::time::sleep(Duration::from_millis(300)).await;
                "done"
            }),
        );
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(listener, router, ConnLimits::default(), async {
            let _ = rx.await;
        }));
        let mut idle = TcpStream::connect(addr).await.expect("connect");
        let mut busy = TcpStream::connect(addr).await.expect("connect");
        busy.write_all(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .expect("write");
        // Half a request head: nothing in flight, so it does not hold the shutdown up.
        let mut partial = TcpStream::connect(addr).await.expect("connect");
        partial
            .write_all(b"GET /slow HTTP/1.1\r\nhost")
            .await
            .expect("write");
        tokio::time::sleep(Duration::from_millis(100)).await;
        let _ = tx.send(());
        let mut answer = String::new();
        busy.read_to_string(&mut answer).await.expect("read");
        assert!(
            answer.starts_with("HTTP/1.1 200 OK") && answer.ends_with("done"),
            "{answer}"
        );
        assert!(closed_after(&mut idle).await < Duration::from_secs(5));
        assert!(closed_after(&mut partial).await < Duration::from_secs(2));
        returns(server, "serve returns once every connection closed").await;
        assert!(
            TcpStream::connect(addr).await.is_err(),
            "no longer accepting"
        );
    }

    /// Requests already sent on idle keep-alive connections when the shutdown starts are answered, not
    /// dropped with the connection.
    #[tokio::test]
    async fn shutdown_answers_requests_already_sent_on_idle_connections() {
        let listener = listen("127.0.0.1:0".parse().expect("addr"))
            .await
            .expect("listen");
        let addr = listener.local_addr().expect("addr");
        let router = Router::new().route("/", axum::routing::get(|| async { "ok" }));
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(listener, router, ConnLimits::default(), async {
            let _ = rx.await;
        }));
        let mut conns = Vec::new();
        for _ in 0..32 {
            let mut s = TcpStream::connect(addr).await.expect("connect");
            assert_eq!(get(&mut s).await, "HTTP/1.1 200 OK");
            conns.push(s);
        }
        // Each sends its next request, and the shutdown starts before the server has read any of them.
        for s in &mut conns {
            s.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
                .await
                .expect("write");
        }
        let _ = tx.send(());
        for (i, s) in conns.iter_mut().enumerate() {
            let answer = answer(s, "read").await;
            assert!(
                answer.starts_with("HTTP/1.1 200 OK") && answer.ends_with("ok"),
                "connection {i}: {answer:?}"
            );
            // Answered once the shutdown began: it says the connection closes, so that the client sends
            // its next request on a new connection (refused, plainly) rather than on this one, closed
            // under it (a request lost in a closing socket cannot be told from one never answered).
            assert!(
                answer
                    .to_ascii_lowercase()
                    .contains("\r\nconnection: close\r\n"),
                "connection {i}: {answer:?}"
            );
        }
        returns(server, "serve returns").await;
    }

    /// A shutdown waits for a connection that is still reading and discarding a refused body: ending the
    /// process under it would reset the connection, and the client, still writing, would lose the answer.
    #[tokio::test]
    async fn shutdown_waits_for_a_lingering_connection() {
        let Server {
            addr,
            stop: tx,
            task: server,
        } = spawn_server(ConnLimits::default()).await;
        let (mut a, mut buf) = refused_upload(addr).await;
        let _ = tx.send(());
        // The client goes on sending its body for a while after the shutdown began.
        for _ in 0..6 {
            for _ in 0..8 {
                a.write_all(&buf).await.expect("the body is still taken");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            assert!(
                !server.is_finished(),
                "serve returned under a lingering connection"
            );
        }
        assert_eq!(a.read(&mut buf).await.expect("read"), 0);
        drop(a);
        returns(server, "serve returns once the lingering connection closed").await;
    }

    /// A connection the kernel had queued when the shutdown began (here: waiting for a place under
    /// max_connections) gets its request answered, not a reset.
    #[tokio::test]
    async fn shutdown_answers_connections_still_in_the_accept_queue() {
        let Server {
            addr,
            stop: tx,
            task: server,
        } = spawn_server(ConnLimits {
            idle_timeout: Duration::from_secs(30),
            max_connections: 1,
        })
        .await;
        let mut held = TcpStream::connect(addr).await.expect("connect");
        assert_eq!(get(&mut held).await, "HTTP/1.1 200 OK");
        let mut queued = Vec::new();
        for _ in 0..3 {
            let mut s = TcpStream::connect(addr).await.expect("connect");
            s.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
                .await
                .expect("write");
            queued.push(s);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let _ = tx.send(());
        for (i, s) in queued.iter_mut().enumerate() {
            let answer = answer(s, &format!("queued connection {i}")).await;
            assert!(
                answer.starts_with("HTTP/1.1 200 OK") && answer.ends_with("ok"),
                "queued connection {i}: {answer:?}"
            );
        }
        assert!(closed_after(&mut held).await < Duration::from_secs(5));
        returns(server, "serve returns").await;
    }

    /// A request head is buffered up to MAX_HEAD_BYTES; past it the answer is 431, not more memory.
    #[tokio::test]
    async fn a_request_head_past_the_limit_gets_431() {
        let (addr, _stop) = start(ConnLimits::default()).await;
        for (size, status) in [
            (MAX_HEAD_BYTES / 2, "HTTP/1.1 200 OK"),
            (
                MAX_HEAD_BYTES * 2,
                "HTTP/1.1 431 Request Header Fields Too Large",
            ),
        ] {
            let mut s = TcpStream::connect(addr).await.expect("connect");
            let head = format!(
                "GET / HTTP/1.1\r\nhost: x\r\nx-big: {}\r\n\r\n",
                "a".repeat(size)
            );
            // The server may answer and close before it has read all of an oversized head.
            let _ = s.write_all(head.as_bytes()).await;
            let mut buf = vec![0u8; 1024];
            let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
                .await
                .expect("answered")
                .expect("read");
            let answer = String::from_utf8_lossy(&buf[..n]);
            assert!(answer.starts_with(status), "{size} bytes: {answer}");
        }
    }

    /// A client that opens with the HTTP/2 preface is told, in HTTP/2, to use HTTP/1.1: a SETTINGS
    /// frame, then GOAWAY with HTTP_1_1_REQUIRED, then the end of the stream (not a reset).
    #[tokio::test]
    async fn an_http2_client_is_told_to_use_http1() {
        let (addr, _stop) = start(ConnLimits::default()).await;
        let mut s = TcpStream::connect(addr).await.expect("connect");
        // The client preface: the magic string and an empty SETTINGS frame.
        let mut preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        preface.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]);
        s.write_all(&preface).await.expect("write");
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut got))
            .await
            .expect("the server ends the stream")
            .expect("ended, not reset");
        // Frames: a 9-byte header (24-bit length, type, flags, stream id), then the payload.
        let mut frames = Vec::new();
        let mut rest = &got[..];
        while rest.len() >= 9 {
            let len = usize::from(rest[0]) << 16 | usize::from(rest[1]) << 8 | usize::from(rest[2]);
            let stream = u32::from_be_bytes([rest[5], rest[6], rest[7], rest[8]]);
            assert!(rest.len() >= 9 + len, "a whole frame: {got:?}");
            frames.push((rest[3], stream, rest[9..9 + len].to_vec()));
            rest = &rest[9 + len..];
        }
        assert!(rest.is_empty(), "only whole frames: {got:?}");
        assert_eq!(frames.len(), 2, "{frames:?}");
        assert_eq!(
            (frames[0].0, frames[0].1, frames[0].2.len()),
            (0x4, 0, 0),
            "SETTINGS"
        );
        let (kind, stream, goaway) = &frames[1];
        assert_eq!((*kind, *stream), (0x7, 0), "GOAWAY");
        assert_eq!(&goaway[..4], &[0, 0, 0, 0], "no stream was processed");
        assert_eq!(&goaway[4..8], &[0, 0, 0, 0xd], "HTTP_1_1_REQUIRED");
        assert_eq!(&goaway[8..], b"hydrant serves HTTP/1.1 only");
    }

    #[test]
    fn the_open_files_limit_is_read_on_linux() {
        if cfg!(target_os = "linux") {
            assert!(open_files_limit().is_some_and(|n| n > 0));
        }
    }
}
