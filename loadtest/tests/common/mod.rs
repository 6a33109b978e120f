//! A fake gateway for the tests: the predict contract with a known delay, an optional one-off
//! stall, per-key cache accounting (first lookup of a key misses, later ones hit), `/v1/stats`
//! counters and readiness.

#![allow(dead_code)]

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use loadtest::scenario::Scenario;
use tokio::sync::oneshot;

#[derive(Clone, Default)]
pub struct FakeConfig {
    /// Time every predict takes.
    pub delay: Duration,
    /// (start after server start, length): every predict arriving inside waits until its end.
    pub stall: Option<(Duration, Duration)>,
    /// Answer one predict at a time (the others wait their turn), so throughput is 1 / `delay`.
    pub serial: bool,
    /// Serve `/v1/stats` (404 otherwise).
    pub stats: bool,
    /// The async workers `/v1/stats` says the gateway runs (left out when `None`).
    pub workers: Option<u64>,
    /// The scheduling group `/v1/stats` says the gateway runs in (left out when `None`).
    pub sched_group: Option<String>,
    /// The models served (predict for any other answers 404 `unknown_model`, as hydrant does);
    /// `None` serves every model.
    pub models: Option<Vec<String>>,
    /// A predict that finds more than this many predicts open (itself included) is answered 503
    /// `overloaded` after the same delay, as a backend that takes one caller at a time would.
    pub overloaded_above: Option<u64>,
}

struct Fake {
    cfg: FakeConfig,
    started: Instant,
    requests: AtomicU64,
    /// Predict calls received, whatever their answer.
    predicts: Arc<AtomicU64>,
    /// Predicts being answered right now.
    open: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    seen: Mutex<HashSet<String>>,
    one_at_a_time: tokio::sync::Mutex<()>,
}

pub struct FakeGateway {
    pub addr: SocketAddr,
    predicts: Arc<AtomicU64>,
    shutdown: Option<oneshot::Sender<()>>,
}

impl FakeGateway {
    pub async fn start(cfg: FakeConfig) -> FakeGateway {
        let predicts = Arc::new(AtomicU64::new(0));
        let state = Arc::new(Fake {
            cfg,
            started: Instant::now(),
            requests: AtomicU64::new(0),
            predicts: predicts.clone(),
            open: AtomicU64::new(0),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            seen: Mutex::new(HashSet::new()),
            one_at_a_time: tokio::sync::Mutex::new(()),
        });
        let app = Router::new()
            .route("/v1/models/{model}/predict", post(predict))
            .route("/v1/stats", get(stats))
            .route("/v2/health/ready", get(|| async { StatusCode::OK }))
            .with_state(state);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind fake gateway");
        let addr = listener.local_addr().expect("local addr");
        let (tx, rx) = oneshot::channel::<()>();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    let _ = rx.await;
                })
                .await;
        });
        FakeGateway {
            addr,
            predicts,
            shutdown: Some(tx),
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Predict calls received so far (any model, any answer).
    pub fn predicts(&self) -> u64 {
        self.predicts.load(Ordering::Relaxed)
    }
}

impl Drop for FakeGateway {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

async fn predict(
    State(st): State<Arc<Fake>>,
    Path(model): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    st.predicts.fetch_add(1, Ordering::Relaxed);
    let _open = Open::enter(&st.open);
    if let Some(limit) = st.cfg.overloaded_above
        && _open.count > limit
    {
        tokio::time::sleep(st.cfg.delay).await;
        let body = serde_json::json!({"error": {"code": "overloaded",
            "message": "too many requests open", "field": ""}});
        return (StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response();
    }
    if let Some(models) = &st.cfg.models
        && !models.contains(&model)
    {
        let body = serde_json::json!({"error": {"code": "unknown_model",
            "message": format!("no model `{model}` is registered (models: {})", models.join(", ")),
            "field": ""}});
        return (StatusCode::NOT_FOUND, axum::Json(body)).into_response();
    }
    let msgpack = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("msgpack"));
    let parsed: Result<serde_json::Value, String> = if msgpack {
        rmp_serde::from_slice(&body).map_err(|e| e.to_string())
    } else {
        serde_json::from_slice(&body).map_err(|e| e.to_string())
    };
    let Ok(req) = parsed else {
        return (
            StatusCode::BAD_REQUEST,
            [(header::CONTENT_TYPE, "application/json")],
            r#"{"error":{"code":"bad_body","message":"cannot decode","field":""}}"#,
        )
            .into_response();
    };
    let mut keys = vec![
        req["entities"]["user_id"]
            .as_str()
            .unwrap_or("?")
            .to_string(),
    ];
    let cands = req["candidates"].as_array().cloned().unwrap_or_default();
    for c in &cands {
        keys.push(c["item_id"].as_str().unwrap_or("?").to_string());
    }
    let (mut hits, mut misses) = (0u64, 0u64);
    {
        let mut seen = st.seen.lock().expect("seen lock");
        for k in keys {
            if seen.insert(k) {
                misses += 1;
            } else {
                hits += 1;
            }
        }
    }
    let turn = if st.cfg.serial {
        Some(st.one_at_a_time.lock().await)
    } else {
        None
    };
    tokio::time::sleep(st.cfg.delay).await;
    drop(turn);
    if let Some((at, len)) = st.cfg.stall {
        let (start, end) = (st.started + at, st.started + at + len);
        let now = Instant::now();
        if now >= start && now < end {
            tokio::time::sleep_until(end.into()).await;
        }
    }
    st.requests.fetch_add(1, Ordering::Relaxed);
    st.hits.fetch_add(hits, Ordering::Relaxed);
    st.misses.fetch_add(misses, Ordering::Relaxed);
    let answer = serde_json::json!({
        "model": "ctr", "model_version": 1,
        "outputs": {"score": vec![0.5; cands.len()]},
        "degraded": false,
        "feature_status": {},
        "cache": {"hits": hits, "stale": 0, "misses": misses},
        "timings_us": {"decode": 9, "hydrate": 41, "assemble": 3, "queue": 12, "infer": 8,
                       "postprocess": 1, "encode": 4, "total": 80}
    });
    if msgpack {
        let bytes = rmp_serde::to_vec_named(&answer).expect("encode msgpack");
        ([(header::CONTENT_TYPE, "application/msgpack")], bytes).into_response()
    } else {
        axum::Json(answer).into_response()
    }
}

/// Counts a predict as open from its arrival until its answer is built (or the client goes away).
struct Open<'a> {
    open: &'a AtomicU64,
    /// Open predicts when this one arrived, itself included.
    count: u64,
}

impl<'a> Open<'a> {
    fn enter(open: &'a AtomicU64) -> Open<'a> {
        let count = open.fetch_add(1, Ordering::SeqCst) + 1;
        Open { open, count }
    }
}

impl Drop for Open<'_> {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn stats(State(st): State<Arc<Fake>>) -> Response {
    if !st.cfg.stats {
        return StatusCode::NOT_FOUND.into_response();
    }
    let hits = st.hits.load(Ordering::Relaxed);
    let misses = st.misses.load(Ordering::Relaxed);
    let stage = serde_json::json!({"p50_us": 5, "p95_us": 9, "p99_us": 12});
    let mut doc = serde_json::json!({
        "uptime_s": st.started.elapsed().as_secs_f64(),
        "window_s": 60,
        "models": {"ctr": {"requests": st.requests.load(Ordering::Relaxed), "errors": 0,
            "stages": {"decode": stage, "hydrate": stage, "total": stage}}},
        "views": {"user_profile": {"hits": hits, "stale": 0, "misses": misses, "negative": 0}}
    });
    if let Some(w) = st.cfg.workers {
        doc["workers"] = w.into();
    }
    if let Some(g) = &st.cfg.sched_group {
        doc["sched_group"] = g.as_str().into();
    }
    axum::Json(doc).into_response()
}

/// A fresh, empty directory for one test's files, under Cargo's scratch folder for integration tests
/// (`target/tmp`): named by the test alone, so each run replaces the last one's files rather than leaving
/// another folder behind in the system's temp dir.
pub fn temp_dir(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("loadtest-test-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// A scenario against `target`; `load` is the body of the `[load]` table, `extra` goes at the end.
pub fn scenario(target: &str, load: &str, extra: &str) -> Scenario {
    let text = format!(
        r#"
target = "{target}"
model = "ctr"
candidates = [1, 3]
ready_timeout_s = 2

[load]
{load}

[users]
keys = 50
zipf = 1.1

[items]
keys = 100

[context]
hour_of_day = {{ int_range = [0, 23] }}
device = {{ one_of = ["ios", "android", "web"] }}
{extra}
"#
    );
    Scenario::from_toml_str(&text, "test", "test").expect("test scenario")
}
