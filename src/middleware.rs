//! The layer around every request, routed or not (the router's 404 and 405 answers pass through it too,
//! and the hot routes' shortcut past the router calls it as [`RequestLayer::serve`]). In one place it:
//! - gives the request an id, taken from `X-Request-Id` or generated, and echoes it back;
//! - runs the request in a `request` span;
//! - times it into `hydrant_request_duration_seconds{route,model,status}`;
//! - answers 503 `deadline_exceeded` when the request outlives the backstop timeout, or 408
//!   `body_timeout` when it was still waiting for its body then;
//! - answers 500 `internal` when a handler panics, so the connection and the process live on.
//!
//! This is one hand-written [`tower::Layer`] rather than `axum::middleware::from_fn` layers plus
//! `CatchPanicLayer`. Each `from_fn` layer boxes the request's future and clones the route service on every
//! request. On the hot path the three layers cost about 10 µs of CPU per request, as much as the whole
//! HTTP stack, by `scripts/bench-cpu.sh`.

use std::convert::Infallible;
use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::Pin;
use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed};
use std::sync::atomic::{AtomicU8, AtomicU64};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::extract::{MatchedPath, Request};
use axum::http::header::{CONNECTION, CONTENT_LENGTH, HOST, TRANSFER_ENCODING};
use axum::http::{HeaderMap, HeaderName, HeaderValue};
use axum::response::Response;
use tokio::time::Sleep;
use tracing::Instrument as _;
use tracing::instrument::Instrumented;

use crate::error::{ApiError, Shape};
use crate::gateway::Catalogs;
use crate::telemetry::{Telemetry, us_since};

/// How much longer than `limits.request_timeout` the backstop waits. The gateway's own deadlines (the
/// same limit, counted from when the request was taken, as the backstop is) answer first with what they can (degraded features,
/// a shed request); the backstop is for whatever does not.
pub const TIMEOUT_GRACE: Duration = Duration::from_millis(250);

/// The request-id header, read and echoed.
pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Where the handler is with the request's body (set by `api::split`): not started, being read, or read.
/// Being read when the backstop fires, the client stopped sending, so the answer is 408, not the 503 of a
/// slow gateway. Not read when the answer goes out (a refusal the headers settled), the rest of the body
/// would follow on the connection, so hyper closes it and the answer says `Connection: close`. One flag
/// shared with the request costs far less than a second timer per request (about 1.5 µs of CPU, measured).
///
/// It also settles a race between the backstop and a handler that makes a change it must answer for (a
/// schema registration, on the blocking pool): the handler [`commit`](BodyRead::commit)s before its
/// first write, and the backstop answers only a request that has not; one that has is let finish, so a
/// caller answered 503 finds nothing changed, and one whose change was made is told so.
///
/// And it carries when the request layer took the request, which the handlers time their stages and
/// deadlines from: so a request's `total` in its answer and in `/v1/stats` covers reading its body and
/// waiting for a worker, as `hydrant_request_duration_seconds` does, and its deadline is counted from
/// the same instant as the backstop's.
#[derive(Clone)]
pub struct BodyRead(Arc<RequestState>);

struct RequestState {
    /// Where the body is: plain stores, as nothing else depends on it.
    body: AtomicU8,
    /// Whether the handler committed its change or the backstop answered: one excludes the other.
    commit: AtomicU8,
    started: Instant,
}

const BODY_UNREAD: u8 = 0;
const BODY_READING: u8 = 1;
const BODY_READ: u8 = 2;
/// The handler has begun its change: the backstop lets it finish.
const COMMITTED: u8 = 1;
/// The backstop has answered: the handler must not begin its change.
const EXPIRED: u8 = 2;

impl BodyRead {
    fn new(started: Instant, body: u8) -> BodyRead {
        BodyRead(Arc::new(RequestState {
            body: AtomicU8::new(body),
            commit: AtomicU8::new(0),
            started,
        }))
    }

    /// When the request layer took the request.
    pub fn started(&self) -> Instant {
        self.0.started
    }

    /// Marks the body as being read.
    pub fn start(&self) {
        self.0.body.store(BODY_READING, Relaxed);
    }

    /// Marks the read as over: the body read when `complete`, else unread (what was not taken, the
    /// rest of a body over the limit, is still on the connection).
    pub fn end(&self, complete: bool) {
        let state = if complete { BODY_READ } else { BODY_UNREAD };
        self.0.body.store(state, Relaxed);
    }

    fn is(&self, state: u8) -> bool {
        self.0.body.load(Relaxed) == state
    }

    /// The handler is about to make its change: true when the backstop has not answered the request
    /// (and now will not), false when it has (the change must not be made: its caller was told it
    /// timed out).
    pub fn commit(&self) -> bool {
        self.settle(COMMITTED)
    }

    /// The backstop is about to answer: true when the handler has not begun a change (and now will
    /// not), false when it has (the handler's own answer is waited for).
    fn expire(&self) -> bool {
        self.settle(EXPIRED)
    }

    /// Takes `outcome` unless the other one was taken first; taking the same one again succeeds.
    fn settle(&self, outcome: u8) -> bool {
        match self.0.commit.compare_exchange(0, outcome, AcqRel, Acquire) {
            Ok(_) => true,
            Err(was) => was == outcome,
        }
    }
}

/// Wraps each route (use it with `Router::route_layer`, so the matched route is known).
#[derive(Clone)]
pub struct RequestLayer {
    shared: Arc<Shared>,
}

struct Shared {
    telemetry: Arc<Telemetry>,
    /// Bearer tokens, when `[auth]` names a token file.
    auth: Option<crate::auth::Tokens>,
    /// The running catalog: the `model` label is one of its model names, or empty for an unknown name.
    catalog: Catalogs,
    /// The backstop: `limits.request_timeout` + [`TIMEOUT_GRACE`].
    backstop: Duration,
    /// `limits.request_timeout`, for the error message.
    limit: Duration,
}

impl RequestLayer {
    pub fn new(
        telemetry: Arc<Telemetry>,
        catalog: Catalogs,
        request_timeout: Duration,
        auth: Option<crate::auth::Tokens>,
    ) -> Self {
        Self {
            shared: Arc::new(Shared {
                telemetry,
                auth,
                catalog,
                backstop: request_timeout + TIMEOUT_GRACE,
                limit: request_timeout,
            }),
        }
    }
}

impl<S> tower::Layer<S> for RequestLayer {
    type Service = RequestService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RequestService {
            inner,
            shared: self.shared.clone(),
        }
    }
}

#[derive(Clone)]
pub struct RequestService<S> {
    inner: S,
    shared: Arc<Shared>,
}

impl<S> tower::Service<Request> for RequestService<S>
where
    S: tower::Service<Request, Response = Response, Error = Infallible>,
{
    type Response = Response;
    type Error = Infallible;
    type Future = RequestFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request) -> Self::Future {
        let started = Instant::now();
        let route = route_label(&req);
        let body_read = body_read_for(&req, started);
        req.extensions_mut().insert(body_read.clone());
        let inner = &mut self.inner;
        self.shared
            .wrap(started, route, req, body_read, |req| inner.call(req))
    }
}

impl RequestLayer {
    /// Serves a request outside the router ([`crate::serve::Shortcut`]): as [`RequestService`] does for a
    /// routed one, with the route given rather than matched. `handler` gets the request and its
    /// [`BodyRead`] (not put in the request's extensions, which would cost an allocation).
    pub fn serve<F>(
        &self,
        route: &'static str,
        req: Request,
        handler: impl FnOnce(Request, Option<BodyRead>) -> F,
    ) -> RequestFuture<F>
    where
        F: Future<Output = Result<Response, Infallible>>,
    {
        let started = Instant::now();
        let body_read = body_read_for(&req, started);
        self.shared
            .wrap(started, route, req, body_read.clone(), |req| {
                handler(req, Some(body_read))
            })
    }
}

/// The request's state: a body it declares starts unread, so that a route that takes no body (a `GET`,
/// a 404, a 405) leaves it unread and its answer closes the connection and says so (hyper closes it
/// whenever a body it could not skip is left on it); a request without one has nothing to read. Every
/// request gets one, so that any handler can time from its start and commit a change (a `DELETE` that
/// registers one has no body).
fn body_read_for(req: &Request, started: Instant) -> BodyRead {
    let body = if declares_body(req.headers()) {
        BODY_UNREAD
    } else {
        BODY_READ
    };
    BodyRead::new(started, body)
}

impl Shared {
    /// The request's future: `call`'s, wrapped in the layer, with what the layer needs read from the
    /// request before `call` takes it.
    fn wrap<F>(
        self: &Arc<Self>,
        started: Instant,
        route: &'static str,
        req: Request,
        body_read: BodyRead,
        call: impl FnOnce(Request) -> F,
    ) -> RequestFuture<F> {
        // The model label is a registered name, or empty for unknown names.
        let model = if route.contains("{model}") {
            // As the handler reads it: `c%74r` is served as `ctr`, so it is counted as `ctr`.
            let segment = crate::api::path_segment(req.uri(), 3);
            let catalog = self.catalog.load();
            catalog.names.iter().find(|m| ***m == *segment).cloned()
        } else {
            None
        };
        let id = request_id(req.headers());
        // At the info level: at `log_level = "warn"` it is off, and so are its costs (about 6,600
        // instructions per request, measured at the error level with `bench-instructions.sh`: 11% of a
        // hot-path request); its lines are then tagged with the id instead (`tag` below).
        let span = tracing::info_span!(
            "request",
            id = id.as_ref().and_then(|v| v.to_str().ok()).unwrap_or(""),
            method = %req.method(),
            route
        );
        let tag = span.is_disabled();
        let deadline = tokio::time::Instant::from_std(started + self.backstop);
        let shape = Shape::of_path(req.uri().path());
        // A request whose Host header is missing (in HTTP/1.1), given twice or not a host is malformed
        // (RFC 9112, section 3.2: a server must answer it with 400), and one without the credentials its
        // route needs goes no further: no handler, no body read.
        let refused = host_problem(&req).or_else(|| {
            self.auth.as_ref().and_then(|auth| {
                let need = crate::auth::need(route, req.uri().path(), req.method());
                auth.load().check(need, req.headers()).err()
            })
        });
        let inner = match refused {
            Some(_) => None,
            None => Some(call(req).instrument(span)),
        };
        RequestFuture {
            inner,
            refused,
            backstop: tokio::time::sleep_until(deadline),
            started,
            route,
            model,
            id,
            tag,
            body_read,
            shape,
            shared: self.clone(),
        }
    }
}

/// Bytes a Host header may hold: letters, digits and `-._~!$&'()*+,;=%:[]`. A table, since every request
/// is checked.
const HOST_CHARS: [bool; 256] = {
    let mut t = [false; 256];
    let mut b = 0;
    while b < 256 {
        t[b] = (b as u8).is_ascii_alphanumeric();
        b += 1;
    }
    let extra = b"-._~!$&'()*+,;=%:[]";
    let mut i = 0;
    while i < extra.len() {
        t[extra[i] as usize] = true;
        i += 1;
    }
    t
};

/// What is wrong with a request's `Host` header, if anything: RFC 9112 (section 3.2) has a server answer
/// 400 to an HTTP/1.1 request without one, and to any request with more than one or with a value that is
/// no host (and port).
fn host_problem<B>(req: &Request<B>) -> Option<ApiError> {
    const RFC: &str = "(RFC 9112, section 3.2)";
    let mut hosts = req.headers().get_all(HOST).iter();
    let Some(host) = hosts.next() else {
        return (req.version() == axum::http::Version::HTTP_11).then(|| {
            ApiError::invalid(
                "missing_host",
                "Host",
                format!("an HTTP/1.1 request must carry a Host header {RFC}"),
            )
        });
    };
    if hosts.next().is_some() {
        return Some(ApiError::invalid(
            "invalid_host",
            "Host",
            format!("a request carries one Host header, not more {RFC}"),
        ));
    }
    // A host name, an IPv4 address or a bracketed IPv6 one, and an optional port: the characters of
    // RFC 3986's `host` and `port`. An empty value is allowed (a target with no authority).
    let host = host.as_bytes();
    if !host.iter().all(|&b| HOST_CHARS[usize::from(b)]) {
        return Some(ApiError::invalid(
            "invalid_host",
            "Host",
            format!(
                "the Host header is not a host and optional port: it holds a character neither can (a space, `/`, `@`, a control or non-ASCII byte) {RFC}"
            ),
        ));
    }
    host_shape_problem(host).map(|why| {
        ApiError::invalid(
            "invalid_host",
            "Host",
            format!("the Host header is not a host and optional port: {why} {RFC}"),
        )
    })
}

/// What is wrong with the shape of a `Host` value made of host characters: `host[:port]`, where the host
/// is a name or IPv4 address (no `:`, `[` or `]`) or a bracketed IPv6 address, and the port is at most
/// 65535. An empty value is none of these and is allowed (a target with no authority).
fn host_shape_problem(value: &[u8]) -> Option<&'static str> {
    let (host, port) = if let Some(rest) = value.strip_prefix(b"[") {
        let Some(end) = rest.iter().position(|&b| b == b']') else {
            return Some("`[` opens an IPv6 address that no `]` closes");
        };
        let (inside, after) = (&rest[..end], &rest[end + 1..]);
        if inside.is_empty() || inside.contains(&b'[') {
            return Some("the brackets hold no IPv6 address");
        }
        match after {
            [] => return None,
            [b':', port @ ..] => (inside, port),
            _ => return Some("only `:` and a port may follow the `]` of an IPv6 address"),
        }
    } else {
        if value.iter().any(|&b| b == b'[' || b == b']') {
            return Some("brackets may only enclose an IPv6 address at the start");
        }
        match value.iter().position(|&b| b == b':') {
            None => return None,
            Some(i) => (&value[..i], &value[i + 1..]),
        }
    };
    if host.is_empty() {
        return Some("a port with no host");
    }
    // RFC 3986 allows an empty port (`host:`); any other is digits naming a TCP port.
    let number = port.iter().try_fold(0u32, |n, &b| {
        b.is_ascii_digit()
            .then(|| n * 10 + u32::from(b - b'0'))
            .filter(|&n| n <= 65_535)
    });
    number
        .is_none()
        .then_some("the port is not a number from 0 to 65535")
}

pin_project_lite::pin_project! {
    /// The routed request's future, with the backstop beside it.
    pub struct RequestFuture<F> {
        // `None` when the request was refused for its credentials (`refused`).
        #[pin]
        inner: Option<Instrumented<F>>,
        refused: Option<ApiError>,
        #[pin]
        backstop: Sleep,
        started: Instant,
        route: &'static str,
        model: Option<Arc<str>>,
        id: Option<HeaderValue>,
        // Whether the request span is off (`log_level = "warn"`), so that lines logged while the request
        // is polled carry its id by `telemetry::tag_request` instead.
        tag: bool,
        body_read: BodyRead,
        // The error body's shape: on `/v2` the backstop and a panic answer as the Open Inference
        // Protocol does.
        shape: Shape,
        shared: Arc<Shared>,
    }
}

impl<F> Future for RequestFuture<F>
where
    F: Future<Output = Result<Response, Infallible>>,
{
    type Output = Result<Response, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let _tag = this
            .id
            .as_ref()
            .filter(|_| *this.tag)
            .map(|id| crate::telemetry::tag_request(id.as_bytes()));
        // Answers the handler gave have been counted in the model's stats by the handler; those made here
        // (a refusal for credentials, the backstop, a panic) and the router's 405 are counted below.
        let refusal = this.refused.take();
        let was_refused = refusal.is_some();
        let polled = match (refusal, this.inner.as_pin_mut()) {
            (Some(err), _) => Ok(Poll::Ready(Ok(err.respond(*this.shape)))),
            (None, Some(inner)) => catch_unwind(AssertUnwindSafe(|| inner.poll(cx))),
            (None, None) => {
                let err = ApiError::Internal("a refused request was polled again".to_owned());
                Ok(Poll::Ready(Ok(err.respond(*this.shape))))
            }
        };
        let (mut resp, counted) = match polled {
            Ok(Poll::Ready(Ok(r))) => {
                let counted =
                    !was_refused && r.status() != axum::http::StatusCode::METHOD_NOT_ALLOWED;
                (r, counted)
            }
            Ok(Poll::Ready(Err(never))) => match never {},
            Ok(Poll::Pending) => match this.backstop.poll(cx) {
                Poll::Pending => return Poll::Pending,
                // The handler has begun a change it answers for: its answer is waited for (it wakes
                // this future when it is ready).
                Poll::Ready(()) if !this.body_read.expire() => {
                    return Poll::Pending;
                }
                Poll::Ready(()) if this.body_read.is(BODY_READING) => {
                    let err = ApiError::BodyTimeout(format!(
                        "the request body did not arrive within the gateway's limit of {:?} (limits.request_timeout)",
                        this.shared.limit
                    ));
                    (err.respond(*this.shape), false)
                }
                Poll::Ready(()) => {
                    let err = ApiError::Timeout(format!(
                        "the request took longer than the gateway's limit of {:?}",
                        this.shared.limit
                    ));
                    (err.respond(*this.shape), false)
                }
            },
            // The panic hook has already logged the message and where; the caller gets a plain 500.
            Err(_) => {
                let err = ApiError::Internal("a request handler panicked".to_owned());
                (err.respond(*this.shape), false)
            }
        };
        let model = this.model.as_deref().unwrap_or("");
        // Only the routes whose answers the handlers count: the model's metadata routes never count.
        let counts = matches!(
            *this.route,
            "/v1/models/{model}/predict" | "/v2/models/{model}/infer" | crate::api::VERSIONED_INFER
        );
        if !counted && counts && !model.is_empty() {
            this.shared.telemetry.model(model).failed(resp.status());
        }
        this.shared
            .telemetry
            .request(this.route, model, resp.status().as_u16())
            .observe_us(us_since(*this.started));
        if let Some(id) = this.id.take() {
            resp.headers_mut().insert(REQUEST_ID, id);
        }
        // An answer given before the whole body came in (a refusal the headers settled, a body over the
        // limit, one that stopped coming): the rest would follow on the connection and cannot be told
        // from a next request, so hyper closes it, and the answer says so.
        if !this.body_read.is(BODY_READ) {
            resp.headers_mut()
                .insert(CONNECTION, HeaderValue::from_static("close"));
        }
        Poll::Ready(Ok(resp))
    }
}

/// Whether the request says a body follows (a non-zero `Content-Length`, or `Transfer-Encoding`).
fn declares_body(headers: &HeaderMap) -> bool {
    headers.contains_key(TRANSFER_ENCODING)
        || headers
            .get(CONTENT_LENGTH)
            .is_some_and(|v| v.as_bytes() != b"0")
}

/// Whether `route` (a [`route_label`]) reads a request body: the `POST` and `PUT` routes, every one of them.
pub(crate) fn reads_body(route: &str) -> bool {
    matches!(
        route,
        "/v1/models/{model}/predict"
            | "/v1/features"
            | "/v2/models/{model}/infer"
            | crate::api::VERSIONED_INFER
            | "/v1/prefetch"
            | "/v1/views/{view}/rows"
            | "/get-online-features"
            | "/v1/schemas:validate"
            | "/v1/schemas"
            | "/v1/schemas/{kind}/{name}"
            | "/v1/schemas/{kind}/{name}/rollback"
    )
}

/// The methods `route` takes, as a 405's `Allow` says them.
pub(crate) fn allowed_methods(route: &str) -> &'static str {
    match route {
        "/v1/schemas" => "GET, POST",
        "/v1/schemas/{kind}/{name}" => "GET, PUT, DELETE",
        r if reads_body(r) => "POST",
        _ => "GET",
    }
}

/// The matched route as a static label (bounded cardinality).
fn route_label(req: &Request) -> &'static str {
    match req
        .extensions()
        .get::<MatchedPath>()
        .map(MatchedPath::as_str)
    {
        Some("/v1/models/{model}/predict") => "/v1/models/{model}/predict",
        Some("/v1/features") => "/v1/features",
        Some("/v2/models/{model}/infer") => "/v2/models/{model}/infer",
        Some("/v2/models/{model}") => "/v2/models/{model}",
        Some("/v2/models/{model}/ready") => "/v2/models/{model}/ready",
        Some(crate::api::VERSIONED_MODEL) => crate::api::VERSIONED_MODEL,
        Some(crate::api::VERSIONED_READY) => crate::api::VERSIONED_READY,
        Some(crate::api::VERSIONED_INFER) => crate::api::VERSIONED_INFER,
        Some("/metrics") => "/metrics",
        Some("/v1/stats") => "/v1/stats",
        Some("/v1/prefetch") => "/v1/prefetch",
        Some("/v1/views/{view}/rows") => "/v1/views/{view}/rows",
        Some("/get-online-features") => "/get-online-features",
        Some("/v1/schemas") => "/v1/schemas",
        Some("/v1/schemas/{kind}/{name}") => "/v1/schemas/{kind}/{name}",
        Some("/v1/schemas/{kind}/{name}/versions") => "/v1/schemas/{kind}/{name}/versions",
        Some("/v1/schemas/{kind}/{name}/versions/{version}") => {
            "/v1/schemas/{kind}/{name}/versions/{version}"
        }
        Some("/v1/schemas/{kind}/{name}/rollback") => "/v1/schemas/{kind}/{name}/rollback",
        Some("/v1/schemas:validate") => "/v1/schemas:validate",
        Some(_) => "other",
        None => "unmatched",
    }
}

static REQUEST_SEQ: AtomicU64 = AtomicU64::new(0);

/// The caller's `X-Request-Id` when it is sane (1 to 128 visible ASCII characters), else a generated
/// `hy-<pid>-<sequence>` in hex.
fn request_id(headers: &HeaderMap) -> Option<HeaderValue> {
    if let Some(id) = headers.get(REQUEST_ID)
        && !id.is_empty()
        && id.len() <= crate::telemetry::MAX_REQUEST_ID
        && id.as_bytes().iter().all(u8::is_ascii_graphic)
    {
        return Some(id.clone());
    }
    // The prefix is made once: `std::process::id()` is a system call each time.
    static PREFIX: OnceLock<String> = OnceLock::new();
    let prefix = PREFIX.get_or_init(|| format!("hy-{:x}-", std::process::id()));
    let n = REQUEST_SEQ.fetch_add(1, Relaxed);
    // Exactly the id's length, so that making it `Bytes` does not move it.
    let mut id = Vec::with_capacity(prefix.len() + hex_digits(n));
    id.extend_from_slice(prefix.as_bytes());
    push_hex(&mut id, n);
    // Visible ASCII by construction, so this cannot fail; the header is left off if it ever did.
    HeaderValue::from_maybe_shared(crate::encode::into_bytes(id)).ok()
}

/// How many hexadecimal digits `n` has.
fn hex_digits(n: u64) -> usize {
    (u64::BITS - n.leading_zeros()).div_ceil(4).max(1) as usize
}

/// Appends `n` in lowercase hexadecimal, as `{n:x}` writes it. By hand: `write!` of the number showed
/// in hot-path profiles.
fn push_hex(out: &mut Vec<u8>, n: u64) {
    for k in (0..hex_digits(n)).rev() {
        out.push(b"0123456789abcdef"[(n >> (4 * k) & 0xf) as usize]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::BUCKETS_S;
    use axum::Router;
    use axum::body::Body;
    use axum::http::StatusCode;
    use axum::routing::get;
    use tower::ServiceExt as _;

    fn text(v: &Option<HeaderValue>) -> String {
        v.as_ref()
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned()
    }

    #[test]
    fn hex_is_what_the_formatter_writes() {
        for n in [
            0u64,
            1,
            9,
            10,
            15,
            16,
            255,
            256,
            0xdead_beef,
            u64::MAX >> 4,
            u64::MAX,
        ] {
            let mut out = Vec::new();
            push_hex(&mut out, n);
            assert_eq!(String::from_utf8_lossy(&out), format!("{n:x}"));
            assert_eq!(hex_digits(n), out.len());
        }
    }

    #[test]
    fn host_values_are_a_host_and_an_optional_port() {
        for fine in [
            "",
            "h",
            "h:",
            "h:0",
            "h:8080",
            "h:65535",
            "127.0.0.1:80",
            "[::1]",
            "[::1]:8080",
            "[v1.x]",
            "a.b-c_d~e",
        ] {
            assert_eq!(host_shape_problem(fine.as_bytes()), None, "{fine:?}");
        }
        for bad in [
            "a:abc", "a:1:2", "a:99999", "a:65536", "a:-1", ":80", "[::1", "[]", "[]:80", "[::1]x",
            "[::1]:x", "a]", "a[b]", "[[::1]]",
        ] {
            assert!(host_shape_problem(bad.as_bytes()).is_some(), "{bad:?}");
        }
    }

    #[test]
    fn the_host_table_holds_the_host_characters() {
        for b in 0..=255u8 {
            assert_eq!(
                HOST_CHARS[usize::from(b)],
                b.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=%:[]".contains(&b),
                "byte {b}"
            );
        }
    }

    #[test]
    fn generated_request_ids_are_pid_and_sequence_in_hex_and_differ() {
        let empty = HeaderMap::new();
        let a = text(&request_id(&empty));
        let b = text(&request_id(&empty));
        let prefix = format!("hy-{:x}-", std::process::id());
        for id in [&a, &b] {
            let seq = id.strip_prefix(&prefix).unwrap_or_else(|| panic!("{id}"));
            assert!(u64::from_str_radix(seq, 16).is_ok(), "{id}");
            assert!(!seq.starts_with('0') || seq == "0", "{id}");
        }
        assert_ne!(a, b);

        let mut sent = HeaderMap::new();
        sent.insert(REQUEST_ID, HeaderValue::from_static("caller-7"));
        assert_eq!(text(&request_id(&sent)), "caller-7");
        sent.insert(REQUEST_ID, HeaderValue::from_static("has space"));
        assert!(text(&request_id(&sent)).starts_with(&prefix));
    }

    fn app(telemetry: Arc<Telemetry>, timeout: Duration) -> Router {
        Router::new()
            .route("/v1/features", get(|| async { "ok" }))
            .route(
                "/v1/stats",
                get(|| async {
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                    "late"
                }),
            )
            .route(
                "/v1/prefetch",
                get(|| async {
                    let v: Vec<u8> = Vec::new();
                    // A handler bug: indexing past the end panics.
                    format!("{}", v[usize::from(v.is_empty())])
                }),
            )
            .route(
                "/v2/models/{model}",
                get(|| async { StatusCode::NO_CONTENT }),
            )
            .route_layer(RequestLayer::new(
                telemetry,
                Arc::new(arc_swap::ArcSwap::from_pointee(crate::gateway::Catalog {
                    registry: Arc::default(),
                    engines: Default::default(),
                    names: vec![Arc::from("ctr")],
                })),
                timeout,
                None,
            ))
    }

    async fn send(app: &Router, path: &str, id: Option<&str>) -> (StatusCode, HeaderMap, String) {
        let mut req = Request::get(path).header(HOST, "h");
        if let Some(id) = id {
            req = req.header(REQUEST_ID, id);
        }
        let resp = app
            .clone()
            .oneshot(req.body(Body::empty()).unwrap_or_default())
            .await
            .unwrap_or_else(|never| match never {});
        let (parts, body) = resp.into_parts();
        let bytes = axum::body::to_bytes(body, 1 << 20)
            .await
            .unwrap_or_default();
        (
            parts.status,
            parts.headers,
            String::from_utf8_lossy(&bytes).into_owned(),
        )
    }

    fn count(t: &Telemetry, route: &'static str, model: &str, status: u16) -> u64 {
        t.request(route, model, status).snapshot().0[BUCKETS_S.len()]
    }

    #[tokio::test]
    async fn answers_echo_the_id_and_are_counted_by_route_model_and_status() {
        let t = Arc::new(Telemetry::default());
        let app = app(t.clone(), Duration::from_secs(5));
        let (status, headers, body) = send(&app, "/v1/features", Some("caller-1")).await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "ok"));
        assert_eq!(headers[REQUEST_ID], "caller-1");
        let (_, headers, _) = send(&app, "/v1/features", None).await;
        assert!(
            headers[REQUEST_ID]
                .to_str()
                .is_ok_and(|id| id.starts_with("hy-"))
        );
        assert_eq!(count(&t, "/v1/features", "", 200), 2);

        send(&app, "/v2/models/ctr", None).await;
        send(&app, "/v2/models/nope", None).await;
        assert_eq!(count(&t, "/v2/models/{model}", "ctr", 204), 1);
        assert_eq!(count(&t, "/v2/models/{model}", "", 204), 1);
    }

    #[tokio::test]
    async fn a_request_past_the_backstop_gets_503_with_its_id() {
        let t = Arc::new(Telemetry::default());
        let app = app(t.clone(), Duration::from_millis(50));
        let started = Instant::now();
        let (status, headers, body) = tokio::time::timeout(
            Duration::from_secs(30),
            send(&app, "/v1/stats", Some("slow-1")),
        )
        .await
        .expect("the backstop answers long before the handler's hour");
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(body.contains("deadline_exceeded"), "{body}");
        assert!(body.contains("50ms"), "{body}");
        assert_eq!(headers[REQUEST_ID], "slow-1");
        // The limit plus the grace.
        assert!(started.elapsed() >= Duration::from_millis(300));
        assert_eq!(count(&t, "/v1/stats", "", 503), 1);
    }

    /// A handler that makes a change it answers for (a schema registration) and the backstop: whichever
    /// comes first wins. Committed before the backstop, the handler's answer is waited for; after it,
    /// the commit is refused, so the caller answered 503 finds nothing changed.
    #[tokio::test]
    async fn the_backstop_waits_for_a_committed_change_and_refuses_a_late_one() {
        let late_commit = Arc::new(std::sync::Mutex::new(None::<bool>));
        let seen = late_commit.clone();
        // Rung once the caller has its 503, so the late commit comes after it however slow the host.
        let answered = Arc::new(tokio::sync::Notify::new());
        let answered_here = answered.clone();
        let app = Router::new()
            .route(
                "/v1/schemas",
                axum::routing::post(|req: Request| async move {
                    let commit = req.extensions().get::<BodyRead>().cloned();
                    let ok = commit.as_ref().is_some_and(BodyRead::commit);
                    tokio::time::sleep(Duration::from_millis(600)).await;
                    if ok { "changed" } else { "no flag" }
                }),
            )
            .route(
                "/v1/schemas/{kind}/{name}",
                axum::routing::delete(move |req: Request| {
                    let (seen, answered) = (seen.clone(), answered.clone());
                    async move {
                        let commit = req.extensions().get::<BodyRead>().cloned();
                        // The change runs on past the request, as a registration on the blocking pool
                        // does, and reaches its commit after the backstop answered.
                        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
                        tokio::spawn(async move {
                            answered.notified().await;
                            let ok = commit.as_ref().map(BodyRead::commit);
                            *seen
                                .lock()
                                .unwrap_or_else(std::sync::PoisonError::into_inner) = ok;
                            let _ = tx.send(());
                        });
                        let _ = rx.await;
                        "changed"
                    }
                }),
            )
            .route_layer(RequestLayer::new(
                Arc::new(Telemetry::default()),
                Arc::new(arc_swap::ArcSwap::from_pointee(crate::gateway::Catalog {
                    registry: Arc::default(),
                    engines: Default::default(),
                    names: Vec::new(),
                })),
                Duration::from_millis(50),
                None,
            ));
        let call = |method: &str, path: &str| {
            let req = Request::builder()
                .method(method)
                .uri(path)
                .header(HOST, "h");
            let req = if method == "POST" {
                req.header(CONTENT_LENGTH, "2").body(Body::from("{}"))
            } else {
                req.body(Body::empty())
            }
            .unwrap_or_default();
            let app = app.clone();
            async move {
                let resp = app
                    .oneshot(req)
                    .await
                    .unwrap_or_else(|never| match never {});
                let status = resp.status();
                let body = axum::body::to_bytes(resp.into_body(), 1 << 20)
                    .await
                    .unwrap_or_default();
                (status, String::from_utf8_lossy(&body).into_owned())
            }
        };
        // Committed at once, done at 600 ms: past the backstop (300 ms), and answered with its result.
        assert_eq!(
            call("POST", "/v1/schemas").await,
            (StatusCode::OK, "changed".to_owned())
        );
        // A DELETE has no body, and still gets the flag. Its commit comes after the 503: refused.
        let (status, body) = call("DELETE", "/v1/schemas/views/v").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        answered_here.notify_one();
        let until = Instant::now() + Duration::from_secs(10);
        while late_commit
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_none()
            && Instant::now() < until
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(
            *late_commit
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
            Some(false),
            "the change must not be made after its caller was told it timed out"
        );
    }

    #[tokio::test]
    async fn a_panicking_handler_gets_500_and_the_server_keeps_answering() {
        let t = Arc::new(Telemetry::default());
        let app = app(t.clone(), Duration::from_secs(5));
        let (status, headers, body) = send(&app, "/v1/prefetch", Some("boom-1")).await;
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
        assert!(body.contains("\"internal\""), "{body}");
        assert_eq!(headers[REQUEST_ID], "boom-1");
        assert_eq!(count(&t, "/v1/prefetch", "", 500), 1);
        assert_eq!(send(&app, "/v1/features", None).await.0, StatusCode::OK);
    }
}
