//! The HTTP/1 client: one keep-alive connection per in-flight slot, and outcome classification.
//!
//! Built on hyper's connection-level API rather than a pooled client so the connection count is
//! exactly what the driver allows in flight: a request takes an idle connection (or opens one),
//! and gives it back only after its whole response body was read. A connection that timed out or
//! failed is dropped, never reused, because its state is unknown.

use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::Duration;

use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Bytes;
use hyper::client::conn::http1::{self, SendRequest};
use hyper::header::{self, HeaderValue};
use hyper::{Method, Request, StatusCode, Uri};
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use tokio::net::TcpStream;

use crate::scenario::{Format, TargetUrl};

/// Largest response body read; a larger one is an error, not an allocation.
const MAX_RESPONSE_BYTES: usize = 16 << 20;

/// Why an exchange produced no response.
#[derive(Debug, thiserror::Error)]
pub enum ExchangeError {
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("HTTP handshake failed: {0}")]
    Handshake(#[source] hyper::Error),
    #[error("HTTP exchange failed: {0}")]
    Http(#[source] hyper::Error),
    #[error("reading the response body failed: {0}")]
    Body(String),
    #[error("the connection closed before the request was sent")]
    Closed,
    #[error("no complete answer within {} ms", .0.as_millis())]
    Timeout(Duration),
    #[error("cannot build the request: {0}")]
    Build(String),
}

/// A complete response.
#[derive(Debug)]
pub struct Response {
    pub status: StatusCode,
    pub msgpack: bool,
    pub body: Bytes,
}

/// Idle keep-alive connections to one endpoint. The mutex guards only the idle stack; it is never
/// held across an await.
pub struct Pool {
    target: TargetUrl,
    host: HeaderValue,
    /// `Bearer <token>`, sent with every request when the gateway has `[auth]` on.
    authorization: Option<HeaderValue>,
    idle: Mutex<Vec<SendRequest<Full<Bytes>>>>,
}

impl Pool {
    pub fn new(target: &TargetUrl) -> Result<Pool, ExchangeError> {
        let host = HeaderValue::from_str(&target.authority)
            .map_err(|e| ExchangeError::Build(format!("host header: {e}")))?;
        Ok(Pool {
            target: target.clone(),
            host,
            authorization: None,
            idle: Mutex::new(Vec::new()),
        })
    }

    /// The pool, sending `authorization` (`Bearer <token>`) with every request.
    pub fn with_authorization(mut self, authorization: Option<HeaderValue>) -> Pool {
        self.authorization = authorization;
        self
    }

    pub fn target(&self) -> &TargetUrl {
        &self.target
    }

    /// Whether requests carry a token (`--token-file`).
    pub fn sends_token(&self) -> bool {
        self.authorization.is_some()
    }

    /// The origin-form URI of `path` under the target's base path.
    pub fn uri(&self, path: &str) -> Result<Uri, ExchangeError> {
        format!("{}{}", self.target.base_path, path)
            .parse()
            .map_err(|e| ExchangeError::Build(format!("path {path:?}: {e}")))
    }

    /// Sends one request and reads the whole answer, all within `timeout`.
    pub async fn send(
        &self,
        method: Method,
        uri: Uri,
        format: Option<Format>,
        body: Bytes,
        timeout: Duration,
    ) -> Result<Response, ExchangeError> {
        match tokio::time::timeout(timeout, self.exchange(method, uri, format, body)).await {
            Ok(r) => r,
            Err(_) => Err(ExchangeError::Timeout(timeout)),
        }
    }

    /// `GET path` with no body.
    pub async fn get(&self, path: &str, timeout: Duration) -> Result<Response, ExchangeError> {
        let uri = self.uri(path)?;
        self.send(Method::GET, uri, None, Bytes::new(), timeout)
            .await
    }

    async fn exchange(
        &self,
        method: Method,
        uri: Uri,
        format: Option<Format>,
        body: Bytes,
    ) -> Result<Response, ExchangeError> {
        let (mut sender, reused) = match self.take_idle() {
            Some(s) => (s, true),
            None => (self.connect().await?, false),
        };
        if sender.ready().await.is_err() {
            // The server closed an idle connection; nothing was sent, so a fresh one is safe.
            if !reused {
                return Err(ExchangeError::Closed);
            }
            sender = self.connect().await?;
            sender.ready().await.map_err(ExchangeError::Http)?;
        }
        let mut req = Request::builder()
            .method(method)
            .uri(uri)
            .header(header::HOST, self.host.clone());
        if let Some(a) = &self.authorization {
            req = req.header(header::AUTHORIZATION, a.clone());
        }
        if let Some(f) = format {
            let ct = match f {
                Format::Json => "application/json",
                Format::Msgpack => "application/msgpack",
            };
            req = req
                .header(header::CONTENT_TYPE, ct)
                .header(header::ACCEPT, ct);
        }
        let req = req
            .body(Full::new(body))
            .map_err(|e| ExchangeError::Build(e.to_string()))?;
        let resp = sender
            .send_request(req)
            .await
            .map_err(ExchangeError::Http)?;
        let status = resp.status();
        let msgpack = resp
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.contains("msgpack"));
        let body = Limited::new(resp.into_body(), MAX_RESPONSE_BYTES)
            .collect()
            .await
            .map_err(|e| ExchangeError::Body(e.to_string()))?
            .to_bytes();
        self.put_idle(sender);
        Ok(Response {
            status,
            msgpack,
            body,
        })
    }

    fn take_idle(&self) -> Option<SendRequest<Full<Bytes>>> {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        while let Some(s) = idle.pop() {
            if !s.is_closed() {
                return Some(s);
            }
        }
        None
    }

    fn put_idle(&self, s: SendRequest<Full<Bytes>>) {
        if !s.is_closed() {
            self.idle.lock().unwrap_or_else(|e| e.into_inner()).push(s);
        }
    }

    async fn connect(&self) -> Result<SendRequest<Full<Bytes>>, ExchangeError> {
        let addr = self.target.addr;
        let stream = TcpStream::connect(addr)
            .await
            .map_err(|source| ExchangeError::Connect { addr, source })?;
        // Requests are small and latency-bound: never wait for Nagle.
        let _ = stream.set_nodelay(true);
        let (sender, conn) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(ExchangeError::Handshake)?;
        // Best-effort: the task drives the connection and ends when the sender is dropped or the
        // peer closes; its error, if any, already surfaced through the request that saw it.
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(sender)
    }

    /// Drops every idle connection (so a server being shut down sees them close).
    pub fn close_idle(&self) {
        self.idle.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }
}

/// What one predict call came to.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Ok(Reply),
    Failed {
        kind: ErrorKind,
        code: Option<String>,
    },
}

/// Error classes, as counted in the report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// A non-2xx status.
    Status(u16),
    Timeout,
    Connect,
    Io,
    /// A 2xx whose body was not a predict answer.
    BadBody,
    /// Open loop only: the send would have exceeded `max_in_flight`, so it was not sent.
    Overload,
    /// Still open when the run was stopped (Ctrl-C) and the grace for open requests ran out.
    Abandoned,
}

impl ErrorKind {
    pub fn label(self) -> String {
        match self {
            ErrorKind::Status(s) => s.to_string(),
            ErrorKind::Timeout => "timeout".to_string(),
            ErrorKind::Connect => "connect".to_string(),
            ErrorKind::Io => "io".to_string(),
            ErrorKind::BadBody => "bad_body".to_string(),
            ErrorKind::Overload => "overload".to_string(),
            ErrorKind::Abandoned => "abandoned".to_string(),
        }
    }

    /// Whether a request that failed this way still has a latency: one given up at the timeout, or
    /// abandoned at Ctrl-C, took at least the time it was open. Left out, a stall's requests would
    /// vanish from the percentiles, which could then read below what many requests took.
    pub fn has_latency(self) -> bool {
        matches!(self, ErrorKind::Timeout | ErrorKind::Abandoned)
    }
}

/// The parts of a predict answer the report uses.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Reply {
    pub degraded: bool,
    /// `[hits, stale, misses]` when the answer carried `cache`.
    pub cache: Option<[u64; 3]>,
    /// Per stage of [`crate::record::STAGES`], in microseconds.
    pub timings: [Option<u64>; 8],
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct ReplyBody {
    /// Only whether it is there: a 2xx without it is not a predict answer (a wrong service, a proxy's
    /// page), and counts as `bad_body` rather than as a success.
    outputs: Option<serde::de::IgnoredAny>,
    degraded: bool,
    cache: Option<CacheBody>,
    timings_us: Option<TimingsBody>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct CacheBody {
    hits: f64,
    stale: f64,
    misses: f64,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct TimingsBody {
    decode: Option<f64>,
    hydrate: Option<f64>,
    assemble: Option<f64>,
    queue: Option<f64>,
    infer: Option<f64>,
    postprocess: Option<f64>,
    encode: Option<f64>,
    total: Option<f64>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct ErrorEnvelope {
    error: Option<ErrorBody>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct ErrorBody {
    code: Option<String>,
}

fn us(v: Option<f64>) -> Option<u64> {
    v.filter(|x| x.is_finite() && *x >= 0.0).map(|x| x as u64)
}

/// Classifies a predict exchange.
pub fn classify(result: Result<Response, ExchangeError>) -> Outcome {
    let resp = match result {
        Ok(r) => r,
        Err(e) => {
            let kind = match e {
                ExchangeError::Timeout(_) => ErrorKind::Timeout,
                ExchangeError::Connect { .. } => ErrorKind::Connect,
                _ => ErrorKind::Io,
            };
            return Outcome::Failed { kind, code: None };
        }
    };
    if !resp.status.is_success() {
        let env: Option<ErrorEnvelope> = if resp.msgpack {
            rmp_serde::from_slice(&resp.body).ok()
        } else {
            serde_json::from_slice(&resp.body).ok()
        };
        return Outcome::Failed {
            kind: ErrorKind::Status(resp.status.as_u16()),
            code: env.and_then(|e| e.error).and_then(|e| e.code),
        };
    }
    let parsed: Result<ReplyBody, String> = if resp.msgpack {
        rmp_serde::from_slice(&resp.body).map_err(|e| e.to_string())
    } else {
        serde_json::from_slice(&resp.body).map_err(|e| e.to_string())
    };
    match parsed {
        Ok(b) if b.outputs.is_some() => Outcome::Ok(Reply {
            degraded: b.degraded,
            cache: b.cache.map(|c| {
                [
                    us(Some(c.hits)).unwrap_or(0),
                    us(Some(c.stale)).unwrap_or(0),
                    us(Some(c.misses)).unwrap_or(0),
                ]
            }),
            timings: b.timings_us.map_or([None; 8], |t| {
                [
                    us(t.decode),
                    us(t.hydrate),
                    us(t.assemble),
                    us(t.queue),
                    us(t.infer),
                    us(t.postprocess),
                    us(t.encode),
                    us(t.total),
                ]
            }),
        }),
        _ => Outcome::Failed {
            kind: ErrorKind::BadBody,
            code: None,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resp(status: u16, body: &str) -> Result<Response, ExchangeError> {
        Ok(Response {
            status: StatusCode::from_u16(status).expect("status"),
            msgpack: false,
            body: Bytes::from(body.to_string()),
        })
    }

    #[test]
    fn classifies_answers() {
        let ok = classify(resp(
            200,
            r#"{"model":"ctr","outputs":{"score":[0.1]},"degraded":true,"cache":{"hits":2,"stale":0,"misses":1},"timings_us":{"decode":9,"total":80}}"#,
        ));
        let Outcome::Ok(r) = ok else {
            panic!("expected ok, got {ok:?}")
        };
        assert!(r.degraded);
        assert_eq!(r.cache, Some([2, 0, 1]));
        assert_eq!(r.timings[0], Some(9));
        assert_eq!(r.timings[7], Some(80));
        assert_eq!(r.timings[1], None);

        let bare = classify(resp(200, r#"{"outputs":{}}"#));
        assert_eq!(bare, Outcome::Ok(Reply::default()));
        // JSON, but not a predict answer.
        for body in ["{}", r#"{"status":"ok"}"#] {
            assert_eq!(
                classify(resp(200, body)),
                Outcome::Failed {
                    kind: ErrorKind::BadBody,
                    code: None
                },
                "{body}"
            );
        }

        assert_eq!(
            classify(resp(
                503,
                r#"{"error":{"code":"queue_timeout","message":"x"}}"#
            )),
            Outcome::Failed {
                kind: ErrorKind::Status(503),
                code: Some("queue_timeout".into())
            }
        );
        assert_eq!(
            classify(resp(200, "not json")),
            Outcome::Failed {
                kind: ErrorKind::BadBody,
                code: None
            }
        );
        assert_eq!(
            classify(Err(ExchangeError::Timeout(Duration::from_millis(5)))),
            Outcome::Failed {
                kind: ErrorKind::Timeout,
                code: None
            }
        );
    }
}
