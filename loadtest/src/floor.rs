//! The floor: the cheapest server on hydrant's stack (hydrant's accept loop over hyper and tokio, and
//! axum) that still reads the whole request and answers a predict-sized JSON body. Driving it with the
//! same mix shows how much of hydrant's latency and throughput is the HTTP stack itself and how much is
//! hydrant. Like hydrant, it serves the predict route through a [`Shortcut`] in front of the router.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::Request;
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use http_body_util::{BodyExt as _, LengthLimitError, Limited};
use hydrant::serve::{ResponseFuture, Routes, Shortcut};
use tokio::sync::oneshot;

/// Largest request body the floor reads (the gateway's own limit is smaller).
const MAX_BODY: usize = 64 << 20;
/// Grace given to open connections when the floor shuts down.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// A fixed answer shaped like a real predict answer with `scores` scores, as JSON.
pub fn answer_body(scores: usize) -> Bytes {
    answer_bodies(scores).0
}

/// The fixed answer as JSON and as MessagePack (what hydrant answers a MessagePack request with).
pub fn answer_bodies(scores: usize) -> (Bytes, Bytes) {
    let score: Vec<f64> = (0..scores)
        .map(|i| ((i * 7919) % 1000) as f64 / 1000.0 + 0.0005)
        .collect();
    let body = serde_json::json!({
        "model": "floor",
        "model_version": 1,
        "outputs": {"score": score},
        "degraded": false,
        "feature_status": {"user_profile": "PRESENT", "item_stats": "PRESENT"},
        "cache": {"hits": 0, "stale": 0, "misses": 0},
        "timings_us": {"decode": 0, "hydrate": 0, "assemble": 0, "queue": 0, "infer": 0,
                       "postprocess": 0, "encode": 0, "total": 0}
    });
    // Plain numbers and strings: encoding cannot fail.
    (
        Bytes::from(serde_json::to_vec(&body).unwrap_or_default()),
        Bytes::from(rmp_serde::to_vec_named(&body).unwrap_or_default()),
    )
}

/// Like hydrant: a MessagePack request (or one that accepts only MessagePack) gets a MessagePack
/// answer, so a `format = "msgpack"` run compares like with like.
fn wants_msgpack(headers: &HeaderMap) -> bool {
    [header::ACCEPT, header::CONTENT_TYPE].iter().any(|h| {
        headers
            .get(h)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.contains("msgpack"))
    })
}

/// The floor's routes: the predict shortcut (any model) in front of [`router`].
pub fn routes(scores: usize) -> Routes {
    let (json, msgpack) = answer_bodies(scores);
    let predict = Arc::new(Predict { json, msgpack });
    Routes {
        router: router(predict.clone()),
        shortcut: Some(predict),
    }
}

/// The predict route, served before the router as hydrant serves it.
struct Predict {
    json: Bytes,
    msgpack: Bytes,
}

impl Predict {
    fn answer(&self, req: Request) -> ResponseFuture {
        let answer = if wants_msgpack(req.headers()) {
            ("application/msgpack", self.msgpack.clone())
        } else {
            ("application/json", self.json.clone())
        };
        Box::pin(async move {
            // The body is read in full, as hydrant reads it.
            let read = Limited::new(req.into_body(), MAX_BODY).collect().await;
            Ok(match read {
                Ok(body) => {
                    let _ = body.to_bytes().len();
                    ([(header::CONTENT_TYPE, answer.0)], answer.1).into_response()
                }
                Err(e) if e.is::<LengthLimitError>() => {
                    StatusCode::PAYLOAD_TOO_LARGE.into_response()
                }
                Err(_) => StatusCode::BAD_REQUEST.into_response(),
            })
        })
    }
}

impl Shortcut for Predict {
    fn takes(&self, req: &Request) -> bool {
        req.method() == Method::POST && hydrant::api::is_predict_path(req.uri().path())
    }

    fn serve(&self, req: Request) -> ResponseFuture {
        self.answer(req)
    }
}

/// The floor's router: predict (any model; the shortcut takes its `POST`s, the router answers the
/// other methods), readiness, and an empty stats document.
fn router(predict: Arc<Predict>) -> Router {
    Router::new()
        .route(
            "/v1/models/{model}/predict",
            post(move |req: Request| predict.answer(req)),
        )
        .route("/v2/health/ready", get(|| async { StatusCode::OK }))
        .route(
            "/v1/stats",
            get(|| async {
                (
                    [(header::CONTENT_TYPE, "application/json")],
                    r#"{"uptime_s":0,"window_s":60,"models":{},"views":{}}"#,
                )
                    .into_response()
            }),
        )
}

/// Serves the floor on `listener` until `shutdown` resolves; then gives open connections
/// [`SHUTDOWN_GRACE`] to finish.
pub async fn serve(
    listener: tokio::net::TcpListener,
    scores: usize,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let (signal_tx, signal_rx) = oneshot::channel::<()>();
    let server = hydrant::serve::serve(
        listener,
        routes(scores),
        hydrant::serve::ConnLimits::default(),
        async move {
            let _ = signal_rx.await;
        },
    );
    let server = tokio::spawn(server);
    shutdown.await;
    let _ = signal_tx.send(());
    match tokio::time::timeout(SHUTDOWN_GRACE, server).await {
        Ok(Ok(r)) => r,
        Ok(Err(join)) => Err(std::io::Error::other(join.to_string())),
        // Connections that stay open past the grace are dropped with the runtime.
        Err(_) => Ok(()),
    }
}

/// An in-process floor on its own tokio runtime and thread, stopped on drop.
pub struct FloorHandle {
    pub addr: SocketAddr,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl FloorHandle {
    /// Binds `bind` (port 0 picks a free port) and starts serving on `threads` worker threads.
    pub fn spawn(bind: SocketAddr, scores: usize, threads: usize) -> std::io::Result<FloorHandle> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads.max(1))
            .thread_name("floor")
            .enable_all()
            .build()?;
        let (tx, rx) = oneshot::channel::<()>();
        // Bound on the floor's own thread, in the runtime that serves it (the caller may be inside a
        // runtime, where another cannot be entered); a port in use comes back as the caller's error.
        let (bound_tx, bound_rx) = std::sync::mpsc::channel::<std::io::Result<SocketAddr>>();
        let thread = std::thread::Builder::new()
            .name("floor-main".into())
            .spawn(move || {
                runtime.block_on(async move {
                    let listener = match hydrant::serve::listen(bind).await {
                        Ok(l) => l,
                        Err(e) => {
                            let _ = bound_tx.send(Err(e));
                            return;
                        }
                    };
                    let addr = listener.local_addr();
                    let failed = addr.is_err();
                    let _ = bound_tx.send(addr);
                    if failed {
                        return;
                    }
                    let stop = async move {
                        let _ = rx.await;
                    };
                    if let Err(e) = serve(listener, scores, stop).await {
                        crate::errln!("floor: server error: {e}");
                    }
                });
                runtime.shutdown_timeout(SHUTDOWN_GRACE);
            })?;
        let addr = match bound_rx.recv() {
            Ok(Ok(addr)) => addr,
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(e);
            }
            Err(_) => {
                let _ = thread.join();
                return Err(std::io::Error::other(
                    "the floor's thread ended before it listened",
                ));
            }
        };
        Ok(FloorHandle {
            addr,
            shutdown: Some(tx),
            thread: Some(thread),
        })
    }
}

impl Drop for FloorHandle {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
