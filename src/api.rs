//! The HTTP API: routes, and handlers that decode the HTTP envelope, call one [`Gateway`] method, and answer.
//! No cache, store or tensor logic lives here.

use std::fmt::Write as _;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, MatchedPath, Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;
use tower_http::catch_panic::CatchPanicLayer;
use tracing::Instrument;

use crate::error::ApiError;
use crate::gateway::Gateway;

/// Builds the router over `gw`.
pub fn router(gw: Arc<Gateway>) -> Router {
    let limits = gw.config.limits.clone();
    Router::new()
        .route("/v1/models/{model}/predict", post(predict))
        .route("/v1/features", post(features))
        .route("/metrics", get(metrics))
        .route("/v1/stats", get(stats))
        .route("/v2", get(server_metadata))
        .route("/v1/prefetch", post(prefetch))
        .route("/v1/views/{view}/rows", post(write_rows))
        .route("/v2/health/live", get(live))
        .route("/v2/health/ready", get(ready))
        .route("/v2/models/{model}", get(model_metadata))
        .route("/v2/models/{model}/ready", get(model_ready))
        .route("/v2/models/{model}/infer", post(v2_infer))
        // Inside the observing layer, so a timed-out request is still counted, logged and given its id.
        .route_layer(middleware::from_fn_with_state(
            limits.request_timeout,
            timeout,
        ))
        .route_layer(middleware::from_fn_with_state(gw.clone(), observe_request))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(limits.max_body_bytes))
        .layer(CatchPanicLayer::custom(|_| {
            ApiError::Internal("a request handler panicked".to_owned()).into_response()
        }))
        .with_state(gw)
}

/// Answers 503 `deadline_exceeded` when a request outlives `limits.request_timeout`.
///
/// It is a backstop: the gateway's own deadlines (the same limit, counted from when the body was read)
/// answer first with what they can (degraded features, a shed request), so this layer waits a little longer.
async fn timeout(State(limit): State<Duration>, req: Request, next: Next) -> Response {
    match tokio::time::timeout(limit + TIMEOUT_GRACE, next.run(req)).await {
        Ok(r) => r,
        Err(_) => ApiError::Timeout(format!(
            "the request took longer than the gateway's limit of {limit:?}"
        ))
        .into_response(),
    }
}

/// How much longer than `limits.request_timeout` the backstop waits.
const TIMEOUT_GRACE: Duration = Duration::from_millis(250);

/// Request ids: taken from `X-Request-Id` when it is sane, else generated; echoed back either way.
static REQUEST_SEQ: AtomicU64 = AtomicU64::new(0);

fn request_id(headers: &HeaderMap) -> String {
    if let Some(id) = headers.get(REQUEST_ID).and_then(|v| v.to_str().ok())
        && !id.is_empty()
        && id.len() <= 128
        && id.bytes().all(|b| b.is_ascii_graphic())
    {
        return id.to_owned();
    }
    // `hy-<pid>-<sequence>` in hex. The prefix is made once: `std::process::id()` is a system call each time.
    static PREFIX: OnceLock<String> = OnceLock::new();
    let prefix = PREFIX.get_or_init(|| format!("hy-{:x}-", std::process::id()));
    let n = REQUEST_SEQ.fetch_add(1, Relaxed);
    let mut id = String::with_capacity(prefix.len() + 16);
    id.push_str(prefix);
    let _ = write!(id, "{n:x}");
    id
}

const REQUEST_ID: &str = "x-request-id";

/// Times every routed request into `hydrant_request_duration_seconds{route,model,status}` and runs it inside a
/// `request` span carrying the request id.
async fn observe_request(State(gw): State<Arc<Gateway>>, req: Request, next: Next) -> Response {
    let started = std::time::Instant::now();
    let route: &'static str = match req
        .extensions()
        .get::<MatchedPath>()
        .map(MatchedPath::as_str)
    {
        Some("/v1/models/{model}/predict") => "/v1/models/{model}/predict",
        Some("/v1/features") => "/v1/features",
        Some("/v2/models/{model}/infer") => "/v2/models/{model}/infer",
        Some("/v2/models/{model}") => "/v2/models/{model}",
        Some("/v2/models/{model}/ready") => "/v2/models/{model}/ready",
        Some("/metrics") => "/metrics",
        Some("/v1/stats") => "/v1/stats",
        Some("/v1/prefetch") => "/v1/prefetch",
        Some("/v1/views/{view}/rows") => "/v1/views/{view}/rows",
        Some(_) => "other",
        None => "unmatched",
    };
    // The model label is the registered name (borrowed from the gateway), or empty for unknown names.
    let model: &str = if route.contains("{model}") {
        let segment = req.uri().path().split('/').nth(3).unwrap_or("");
        gw.engines
            .get_key_value(segment)
            .map_or("", |(name, _)| name.as_str())
    } else {
        ""
    };
    let id = request_id(req.headers());
    let span = tracing::info_span!("request", id = %id, method = %req.method(), route);
    let mut resp = next.run(req).instrument(span).await;
    let status = resp.status().as_u16();
    gw.telemetry
        .request(route, model, status)
        .observe_us(crate::telemetry::us_since(started));
    if let Ok(v) = HeaderValue::from_str(&id) {
        resp.headers_mut().insert(REQUEST_ID, v);
    }
    resp
}

/// Runs the cache's pending maintenance (expiry, eviction listeners) so the entries and bytes gauges are
/// current; on the blocking pool, since on a large cache it can take a while.
async fn settle_cache(gw: &Gateway) {
    let cache = gw.hydrator.cache().clone();
    let _ = tokio::task::spawn_blocking(move || cache.run_pending_tasks()).await;
}

async fn metrics(State(gw): State<Arc<Gateway>>) -> Response {
    settle_cache(&gw).await;
    let body = crate::observe::prometheus(&gw);
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        body,
    )
        .into_response()
}

async fn stats(State(gw): State<Arc<Gateway>>) -> Json<serde_json::Value> {
    settle_cache(&gw).await;
    Json(crate::observe::stats(&gw))
}

fn body_bytes(body: Result<Bytes, BytesRejection>, limit: usize) -> Result<Bytes, ApiError> {
    body.map_err(|r| {
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::TooLarge {
                code: "body_too_large",
                message: format!("the request body is larger than the limit of {limit} bytes"),
                field: None,
            }
        } else {
            ApiError::Malformed {
                code: "invalid_body",
                message: format!("cannot read the request body: {r}"),
                field: None,
            }
        }
    })
}

async fn predict(
    State(gw): State<Arc<Gateway>>,
    Path(model): Path<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body_bytes(body, gw.config.limits.max_body_bytes)?;
    gw.predict(&model, &headers, &body).await
}

async fn features(
    State(gw): State<Arc<Gateway>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body_bytes(body, gw.config.limits.max_body_bytes)?;
    gw.features(&headers, &body).await
}

async fn v2_infer(
    State(gw): State<Arc<Gateway>>,
    Path(model): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, crate::oip::OipError> {
    let body = body.map_err(|r| crate::oip::OipError(r.status(), r.body_text()))?;
    crate::oip::infer(&gw, &model, &body).await
}

/// Open Inference Protocol server metadata.
async fn server_metadata() -> Json<serde_json::Value> {
    Json(json!({"name": "hydrant", "version": env!("CARGO_PKG_VERSION"), "extensions": []}))
}

async fn prefetch(
    State(gw): State<Arc<Gateway>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body_bytes(body, gw.config.limits.max_body_bytes)?;
    gw.prefetch(&headers, &body).await
}

async fn write_rows(
    State(gw): State<Arc<Gateway>>,
    Path(view): Path<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body_bytes(body, gw.config.limits.max_body_bytes)?;
    gw.write_rows(&view, &headers, &body).await
}

async fn live() -> StatusCode {
    StatusCode::OK
}

async fn ready(State(gw): State<Arc<Gateway>>) -> Response {
    if gw.is_ready() {
        (StatusCode::OK, Json(json!({"ready": true}))).into_response()
    } else {
        ApiError::NotReady("the gateway is starting".to_owned()).into_response()
    }
}

async fn model_metadata(State(gw): State<Arc<Gateway>>, Path(model): Path<String>) -> Response {
    let Some(engine) = gw.engines.get(&model) else {
        return (
            StatusCode::NOT_FOUND,
            Json(json!({"error": format!("model `{model}` is not registered")})),
        )
            .into_response();
    };
    let info = engine.info();
    let m = engine.model();
    Json(json!({
        "name": m.name,
        "versions": [m.version.to_string()],
        "platform": "onnxruntime_onnx",
        "inputs": [{"name": info.input_name, "datatype": "FP32", "shape": info.input_shape}],
        "outputs": info.outputs.iter().map(|o| json!({"name": o.name, "datatype": "FP32", "shape": o.shape})).collect::<Vec<_>>(),
        "parameters": {"device": info.device, "sessions": info.sessions, "binding_width": m.width},
    }))
    .into_response()
}

async fn model_ready(State(gw): State<Arc<Gateway>>, Path(model): Path<String>) -> Response {
    if gw.engines.contains_key(&model) && gw.is_ready() {
        (StatusCode::OK, Json(json!({"name": model, "ready": true}))).into_response()
    } else if gw.engines.contains_key(&model) {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"name": model, "ready": false})),
        )
            .into_response()
    } else {
        (
            StatusCode::NOT_FOUND,
            Json(json!({"error": format!("model `{model}` is not registered")})),
        )
            .into_response()
    }
}

async fn not_found(req: Request) -> ApiError {
    ApiError::NotFound {
        code: "unknown_route",
        message: format!("no route {} {}", req.method(), req.uri().path()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_request_ids_are_pid_and_sequence_in_hex_and_differ() {
        let empty = HeaderMap::new();
        let a = request_id(&empty);
        let b = request_id(&empty);
        let prefix = format!("hy-{:x}-", std::process::id());
        for id in [&a, &b] {
            let seq = id.strip_prefix(&prefix).unwrap_or_else(|| panic!("{id}"));
            assert!(u64::from_str_radix(seq, 16).is_ok(), "{id}");
            assert!(!seq.starts_with('0') || seq == "0", "{id}");
        }
        assert_ne!(a, b);

        let mut sent = HeaderMap::new();
        sent.insert(REQUEST_ID, HeaderValue::from_static("caller-7"));
        assert_eq!(request_id(&sent), "caller-7");
        sent.insert(REQUEST_ID, HeaderValue::from_static("has space"));
        assert!(request_id(&sent).starts_with(&prefix));
    }
}
