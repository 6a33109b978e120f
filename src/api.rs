//! The HTTP API: routes, and handlers that decode the HTTP envelope, call one [`Gateway`] method, and answer.
//! No cache, store or tensor logic lives here.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::handler::HandlerWithoutStateExt as _;
use axum::http::{HeaderMap, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodFilter, MethodRouter, get, on};
use axum::{Json, Router};
use futures::FutureExt as _;
use http_body_util::BodyExt as _;
use percent_encoding::percent_decode_str;
use serde_json::json;
use tower::Layer as _;

use crate::decode::Format;
use crate::error::{ApiError, Shape};
use crate::gateway::Gateway;
use crate::middleware::{BodyRead, RequestLayer};
use crate::registrar::Action;
use crate::schema::Kind;
use crate::serve::{ResponseFuture, Routes, Shortcut};

/// The routes callers send on every request, as the router and the request layer name them.
const PREDICT: &str = "/v1/models/{model}/predict";
const INFER: &str = "/v2/models/{model}/infer";
const FEATURES: &str = "/v1/features";
/// The binary tensor extension's header: the length of the JSON part before the raw tensors.
const INFERENCE_HEADER_CONTENT_LENGTH: &str = "inference-header-content-length";
/// The Open Inference Protocol's paths that name a model version.
pub const VERSIONED_MODEL: &str = "/v2/models/{model}/versions/{version}";
pub const VERSIONED_READY: &str = "/v2/models/{model}/versions/{version}/ready";
pub const VERSIONED_INFER: &str = "/v2/models/{model}/versions/{version}/infer";

/// The routes over `gw`: the router, and in front of it a shortcut for the routes callers send on every
/// request: `POST /v1/models/{model}/predict`, `POST /v2/models/{model}/infer` and `POST /v1/features`.
pub fn routes(gw: Arc<Gateway>) -> Routes {
    let shortcut = HotShortcut {
        layer: request_layer(&gw),
        gw: gw.clone(),
    };
    Routes {
        router: router(gw),
        shortcut: Some(Arc::new(shortcut)),
    }
}

/// The hot routes, served as the router would, in the same request layer.
struct HotShortcut {
    layer: RequestLayer,
    gw: Arc<Gateway>,
}

/// Which of the hot routes a request is for.
fn hot_route(req: &Request) -> Option<&'static str> {
    if req.method() != axum::http::Method::POST {
        return None;
    }
    let path = req.uri().path();
    if is_predict_path(path) {
        Some(PREDICT)
    } else if is_infer_path(path) {
        Some(INFER)
    } else if path == FEATURES {
        Some(FEATURES)
    } else {
        None
    }
}

impl Shortcut for HotShortcut {
    fn takes(&self, req: &Request) -> bool {
        hot_route(req).is_some()
    }

    fn serve(&self, req: Request) -> ResponseFuture {
        match hot_route(&req) {
            Some(INFER) => self.answer(INFER, req, v2_infer),
            Some(FEATURES) => self.answer(FEATURES, req, features),
            Some(PREDICT) => self.answer(PREDICT, req, predict),
            // Not taken: `Routes` asks `takes` first, so this is never reached; answered as the router would.
            _ => Box::pin(self.layer.serve("unmatched", req, |req, _| async move {
                Ok(not_found(req).await)
            })),
        }
    }
}

impl HotShortcut {
    /// `handler`'s answer to `req` on `route`, in the request layer.
    fn answer<Fut, R>(
        &self,
        route: &'static str,
        req: Request,
        handler: impl FnOnce(Arc<Gateway>, Request, Option<BodyRead>) -> Fut,
    ) -> ResponseFuture
    where
        Fut: Future<Output = R> + Send + 'static,
        R: IntoResponse,
    {
        let gw = self.gw.clone();
        // `map` rather than an async block that awaits the handler's future: such a block holds the
        // future twice (as captured, and as awaited), and every move of the request's future copies both.
        Box::pin(self.layer.serve(route, req, |req, body_read| {
            handler(gw, req, body_read).map(|answer| Ok(answer.into_response()))
        }))
    }
}

/// Whether `path` is `/v1/models/{model}/predict` as the router matches it: one model segment, which
/// may be empty (an unknown model, as the router has it).
pub fn is_predict_path(path: &str) -> bool {
    one_segment_between(path, "/v1/models/", "/predict")
}

/// Whether `path` is `/v2/models/{model}/infer` as the router matches it (see [`is_predict_path`]).
fn is_infer_path(path: &str) -> bool {
    one_segment_between(path, "/v2/models/", "/infer")
}

fn one_segment_between(path: &str, prefix: &str, suffix: &str) -> bool {
    path.strip_prefix(prefix)
        .and_then(|rest| rest.strip_suffix(suffix))
        .is_some_and(|segment| !segment.contains('/'))
}

fn request_layer(gw: &Gateway) -> RequestLayer {
    RequestLayer::new(
        gw.telemetry.clone(),
        gw.catalog.clone(),
        gw.config.limits.request_timeout,
        gw.auth.clone(),
    )
}

/// Builds the router over `gw` (every route; [`routes`] puts the hot routes' shortcut in front of it).
pub fn router(gw: Arc<Gateway>) -> Router {
    let limits = gw.config.limits.clone();
    let layer = request_layer(&gw);
    Router::new()
        .route(PREDICT, routed(predict))
        .route(FEATURES, routed(features))
        .route("/get-online-features", routed(online_features))
        .route("/metrics", get(metrics))
        .route("/v1/stats", get(stats))
        .route("/v2", get(server_metadata))
        .route("/v1/prefetch", routed(prefetch))
        .route("/v1/views/{view}/rows", routed(write_rows))
        .route("/v1/schemas", get(schemas).merge(routed(post_schemas)))
        .route(
            "/v1/schemas/{kind}/{name}",
            get(schema_document)
                .merge(routed_as(MethodFilter::PUT, put_schema))
                .merge(routed_as(MethodFilter::DELETE, delete_schema)),
        )
        .route("/v1/schemas/{kind}/{name}/versions", get(schema_versions))
        .route(
            "/v1/schemas/{kind}/{name}/versions/{version}",
            get(schema_version),
        )
        .route(
            "/v1/schemas/{kind}/{name}/rollback",
            routed(rollback_schema),
        )
        .route("/v1/schemas:validate", routed(validate_schemas))
        .route("/v2/health/live", get(live))
        .route("/v2/health/ready", get(ready))
        .route("/v2/models/{model}", get(model_metadata))
        .route("/v2/models/{model}/ready", get(model_ready))
        .route(INFER, routed(v2_infer))
        // The protocol's versioned paths: the version the model serves, or a 404 naming it.
        .route(VERSIONED_MODEL, get(versioned_metadata))
        .route(VERSIONED_READY, get(versioned_ready))
        .route(VERSIONED_INFER, routed(versioned_infer))
        // Before `route_layer`, so that the request layer wraps the 405s too (request id, span, metrics).
        .method_not_allowed_fallback(method_not_allowed)
        .route_layer(layer.clone())
        .fallback_service(layer.layer(not_found.into_service()))
        .layer(DefaultBodyLimit::max(limits.max_body_bytes))
        .with_state(gw)
}

/// Runs the cache's pending maintenance (eviction, its listeners) so the entries and bytes gauges are
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

fn body_too_large(limit: usize) -> ApiError {
    ApiError::TooLarge {
        code: "body_too_large",
        message: format!("the request body is larger than the limit of {limit} bytes"),
        field: None,
    }
}

/// A `POST` route of the router whose handler reads the body: `handler` gets the request layer's
/// [`BodyRead`] from the request's extensions, where the shortcut hands it over directly.
fn routed<H, Fut, R>(handler: H) -> MethodRouter<Arc<Gateway>>
where
    H: Fn(Arc<Gateway>, Request, Option<BodyRead>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = R> + Send + 'static,
    R: IntoResponse + 'static,
{
    routed_as(MethodFilter::POST, handler)
}

/// [`routed`], for the methods of `filter`.
fn routed_as<H, Fut, R>(filter: MethodFilter, handler: H) -> MethodRouter<Arc<Gateway>>
where
    H: Fn(Arc<Gateway>, Request, Option<BodyRead>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = R> + Send + 'static,
    R: IntoResponse + 'static,
{
    on(
        filter,
        move |State(gw): State<Arc<Gateway>>, mut req: Request| {
            let body_read = req.extensions_mut().remove::<BodyRead>();
            handler(gw, req, body_read)
        },
    )
}

async fn predict(
    gw: Arc<Gateway>,
    req: Request,
    body_read: Option<BodyRead>,
) -> Result<Response, ApiError> {
    // An unknown model is known from the path: answered before waiting for the body.
    let engine = gw.engine(&path_segment(req.uri(), 3))?;
    let started = started(body_read.as_ref());
    let r = split_answered(req, body_read, &gw)
        .await
        .inspect_err(|e| engine.stats().failed(e.status()))?;
    gw.predict(&engine, r.format, r.answer, &r.body, started)
        .await
}

/// When the request layer took the request (reading the body and waiting for a worker are then part of
/// `decode`, and of `total`); now, for a request that declared no body.
fn started(body_read: Option<&BodyRead>) -> Instant {
    body_read.map_or_else(Instant::now, BodyRead::started)
}

async fn features(
    gw: Arc<Gateway>,
    req: Request,
    body_read: Option<BodyRead>,
) -> Result<Response, ApiError> {
    let started = started(body_read.as_ref());
    let r = split_answered(req, body_read, &gw).await?;
    gw.features(r.format, r.answer, &r.body, started).await
}

async fn online_features(
    gw: Arc<Gateway>,
    req: Request,
    body_read: Option<BodyRead>,
) -> Result<Response, ApiError> {
    let started = started(body_read.as_ref());
    let r = split_answered(req, body_read, &gw).await?;
    gw.online_features(r.format, r.answer, &r.body, started)
        .await
}

/// `GET /v1/schemas`: what is registered, by kind and name, and how the schemas folder is watched.
async fn schemas(State(gw): State<Arc<Gateway>>) -> Json<serde_json::Value> {
    let mut listing = crate::proposal::listing(&gw.registry());
    listing["folder"] = gw.folder.describe(gw.config.registry.reload_interval);
    Json(listing)
}

/// `GET /v1/schemas/{kind}/{name}`: one registered document as written, with where it came from.
async fn schema_document(
    State(gw): State<Arc<Gateway>>,
    uri: Uri,
) -> Result<Json<serde_json::Value>, ApiError> {
    let (kind, name) = schema_path(&uri)?;
    crate::proposal::document(&gw.registry(), kind, &name).map(Json)
}

/// The `{kind}` and `{name}` of a `/v1/schemas/{kind}/{name}...` path (404 for another kind).
fn schema_path(uri: &Uri) -> Result<(Kind, String), ApiError> {
    let kind = crate::registrar::kind_of_segment(&path_segment(uri, 3))?;
    Ok((kind, path_segment(uri, 4).into_owned()))
}

/// `POST /v1/schemas:validate`: one or more YAML documents checked against the running registry, and
/// nothing registered (see [`crate::proposal`]).
async fn validate_schemas(
    gw: Arc<Gateway>,
    req: Request,
    body_read: Option<BodyRead>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let text = schema_body(req, body_read, &gw).await?;
    let changes = crate::proposal::check_for(&gw, text).await?;
    Ok(Json(json!({"valid": true, "documents": changes})))
}

/// A schema route's body as text: YAML (or JSON, or text), within the schema size limits, UTF-8.
async fn schema_body(
    req: Request,
    body_read: Option<BodyRead>,
    gw: &Gateway,
) -> Result<String, ApiError> {
    let r = split_as(req, body_read, gw, yaml_type, false).await?;
    crate::proposal::check_size(&r.body)?;
    crate::registrar::body_text(&r.body)
}

/// `POST /v1/schemas`: one or more documents registered together (see [`crate::registrar`]).
async fn post_schemas(
    gw: Arc<Gateway>,
    req: Request,
    body_read: Option<BodyRead>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let commit = body_read.clone();
    let body = schema_body(req, body_read, &gw).await?;
    registered(&gw, Action::Post { body }, commit).await
}

/// `PUT /v1/schemas/{kind}/{name}`: one document registered, in place of the running one.
async fn put_schema(
    gw: Arc<Gateway>,
    req: Request,
    body_read: Option<BodyRead>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let (kind, name) = schema_path(req.uri())?;
    let commit = body_read.clone();
    let body = schema_body(req, body_read, &gw).await?;
    registered(&gw, Action::Put { kind, name, body }, commit).await
}

/// `DELETE /v1/schemas/{kind}/{name}`: refused while anything registered still names it.
async fn delete_schema(
    gw: Arc<Gateway>,
    req: Request,
    body_read: Option<BodyRead>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let (kind, name) = schema_path(req.uri())?;
    registered(&gw, Action::Delete { kind, name }, body_read).await
}

/// `action` registered (see [`crate::registrar`]), answered as JSON. `commit` is the request layer's
/// flag that keeps the backstop from answering 503 once the change has begun (see [`BodyRead::commit`]).
async fn registered(
    gw: &Arc<Gateway>,
    action: Action,
    commit: Option<BodyRead>,
) -> Result<Json<serde_json::Value>, ApiError> {
    crate::registrar::register(gw, action, commit)
        .await
        .map(Json)
}

/// The body of `POST /v1/schemas/{kind}/{name}/rollback`.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RollbackBody {
    #[serde(deserialize_with = "version_number")]
    version: u32,
}

/// A version number, read through `deserialize_any` so that `1.0` (an encoder writing every number as a
/// float) is 1, and a wrong type is named in these words in JSON and MessagePack alike.
fn version_number<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    use serde::de::{self, Visitor};
    struct V;
    impl Visitor<'_> for V {
        type Value = u32;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a version number (a whole number from 1)")
        }
        fn visit_u64<E: de::Error>(self, v: u64) -> Result<u32, E> {
            if v == 0 {
                return Err(E::custom(
                    "versions are numbered from 1: there is no version 0",
                ));
            }
            u32::try_from(v).map_err(|_| {
                E::custom(format!(
                    "no version {v} can be kept (the largest is {})",
                    u32::MAX
                ))
            })
        }
        fn visit_i64<E: de::Error>(self, v: i64) -> Result<u32, E> {
            u64::try_from(v)
                .map_err(|_| E::invalid_value(de::Unexpected::Signed(v), &self))
                .and_then(|v| self.visit_u64(v))
        }
        fn visit_f64<E: de::Error>(self, v: f64) -> Result<u32, E> {
            crate::value::exact_integer(v)
                .and_then(|i| u64::try_from(i).ok())
                .ok_or_else(|| E::invalid_value(de::Unexpected::Float(v), &self))
                .and_then(|v| self.visit_u64(v))
        }
    }
    d.deserialize_any(V)
}

impl crate::decode::Positional for RollbackBody {
    const FIELDS: &'static [(&'static str, &'static [&'static str])] = &[("version", &[])];
}

/// `POST /v1/schemas/{kind}/{name}/rollback` `{"version": N}`: a kept version registered again.
async fn rollback_schema(
    gw: Arc<Gateway>,
    req: Request,
    body_read: Option<BodyRead>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let (kind, name) = schema_path(req.uri())?;
    let commit = body_read.clone();
    let r = split(req, body_read, &gw).await?;
    let RollbackBody { version } = crate::decode::parse_body(r.format, &r.body)?;
    registered(
        &gw,
        Action::Rollback {
            kind,
            name,
            version,
        },
        commit,
    )
    .await
}

/// `GET /v1/schemas/{kind}/{name}/versions`.
async fn schema_versions(
    State(gw): State<Arc<Gateway>>,
    uri: Uri,
) -> Result<Json<serde_json::Value>, ApiError> {
    let (kind, name) = schema_path(&uri)?;
    // The kept versions are files: read off the async workers.
    blocking(move || crate::registrar::list_versions(&gw, kind, &name)).await
}

/// `GET /v1/schemas/{kind}/{name}/versions/{version}`.
async fn schema_version(
    State(gw): State<Arc<Gateway>>,
    uri: Uri,
) -> Result<Json<serde_json::Value>, ApiError> {
    let (kind, name) = schema_path(&uri)?;
    let version = path_segment(&uri, 6).into_owned();
    blocking(move || crate::registrar::show_version(&gw, kind, &name, &version)).await
}

/// Runs `f` (file reads) on the blocking pool.
async fn blocking(
    f: impl FnOnce() -> Result<serde_json::Value, ApiError> + Send + 'static,
) -> Result<Json<serde_json::Value>, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::Internal(format!("the file-reading task failed: {e}")))?
        .map(Json)
}

/// The schema route's `Content-Type`: YAML, or JSON or text read as YAML, or none; the answer is JSON.
fn yaml_type(headers: &HeaderMap) -> Result<Format, ApiError> {
    // A type the decoder refuses (bytes beyond ASCII) is refused in this route's words: send YAML.
    let text = match crate::decode::content_type(headers) {
        Ok(Some(text)) => text,
        Ok(None) => return Ok(Format::Json),
        Err(ApiError::UnsupportedMediaType(shown)) => {
            return Err(ApiError::UnsupportedSchemaType(shown));
        }
        Err(e) => return Err(e),
    };
    let media = crate::decode::media_essence(text);
    let yaml = [
        "application/yaml",
        "application/x-yaml",
        "text/yaml",
        "text/x-yaml",
        "application/json",
        "text/plain",
    ]
    .iter()
    .any(|t| media.eq_ignore_ascii_case(t));
    if yaml {
        crate::decode::utf8_charset(text)?;
        Ok(Format::Json)
    } else {
        Err(ApiError::UnsupportedSchemaType(text.to_owned()))
    }
}

/// A request's URI and body, owned, for the handlers to borrow from (the `Path<String>` extractor would
/// copy the path segment on every request), and the body's format and the answer's.
struct Received {
    uri: Uri,
    body: Bytes,
    /// From `Content-Type`, checked before the body was read.
    format: Format,
    /// The answer's, from `Accept` ([`split_answered`]; else the body's).
    answer: Format,
}

/// Takes the request apart into [`Received`].
///
/// The body must fit `limits.max_body_bytes` (else 413). A body still arriving when the request layer's
/// backstop fires (`limits.request_timeout` plus its grace) gets 408 rather than the 503 of a slow
/// gateway: the read is marked in `body_read` (the request layer's [`BodyRead`]), which costs far less
/// than a timer of its own.
async fn split(
    req: Request,
    body_read: Option<BodyRead>,
    gw: &Gateway,
) -> Result<Received, ApiError> {
    split_as(req, body_read, gw, Format::of_request, false).await
}

/// [`split`] for a route that answers in JSON or MessagePack as `Accept` asks: the answer's format is
/// settled with the body's, before the body is read, so that a client that sent `Expect: 100-continue`
/// gets a 406 instead of a 100.
async fn split_answered(
    req: Request,
    body_read: Option<BodyRead>,
    gw: &Gateway,
) -> Result<Received, ApiError> {
    split_as(req, body_read, gw, Format::of_request, true).await
}

/// [`split`], with the body's `Content-Type` checked by `format_of`, which answers the answer's format.
async fn split_as(
    req: Request,
    body_read: Option<BodyRead>,
    gw: &Gateway,
    format_of: fn(&HeaderMap) -> Result<Format, ApiError>,
    negotiate: bool,
) -> Result<Received, ApiError> {
    let limits = &gw.config.limits;
    // A body declared larger than the limit is refused at once, not after waiting for it.
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limits.max_body_bytes as u64) {
        return Err(body_too_large(limits.max_body_bytes));
    }
    // A compressed body would be refused as malformed JSON or MessagePack; say what is wrong with it.
    for coding in req.headers().get_all(header::CONTENT_ENCODING) {
        let refused = match coding.to_str() {
            Ok(text) => text
                .split(',')
                .map(str::trim)
                .any(|c| !c.is_empty() && !c.eq_ignore_ascii_case("identity")),
            Err(_) => true,
        };
        if refused {
            let text = String::from_utf8_lossy(coding.as_bytes()).into_owned();
            return Err(ApiError::UnsupportedEncoding(text));
        }
    }
    // hyper decodes `chunked` and passes any other coding through undecoded (`gzip, chunked` would
    // reach the decoder as gzip bytes), so anything but one `chunked` is refused, naming it.
    let codings = req.headers().get_all(header::TRANSFER_ENCODING);
    if codings.iter().next().is_some() {
        let listed = codings.iter().flat_map(|v| {
            // A value that is not visible ASCII names no coding hyper decodes.
            v.to_str()
                .unwrap_or("?")
                .split(',')
                .map(str::trim)
                .filter(|c| !c.is_empty())
        });
        let mut chunked = 0;
        let mut other = false;
        for c in listed {
            if c.eq_ignore_ascii_case("chunked") {
                chunked += 1;
            } else {
                other = true;
            }
        }
        if other || chunked != 1 {
            let all: Vec<_> = codings
                .iter()
                .map(|v| String::from_utf8_lossy(v.as_bytes()))
                .collect();
            return Err(ApiError::UnsupportedTransferCoding(all.join(", ")));
        }
    }
    // Refused before the body is read: a client that sent `Expect: 100-continue` gets the 415 instead
    // of a 100 and then the 415.
    let format = format_of(req.headers())?;
    let answer = if negotiate {
        Format::of_response(req.headers(), format)?
    } else {
        format
    };
    let (parts, body) = req.into_parts();
    if let Some(b) = &body_read {
        b.start();
    }
    let body = read_body(body, limits.max_body_bytes).await;
    if let Some(b) = &body_read {
        b.end(body.is_ok());
    }
    let body = body.map_err(|e| match e {
        BodyError::TooLarge => body_too_large(limits.max_body_bytes),
        BodyError::Broken(e) => ApiError::Malformed {
            code: "invalid_body",
            message: format!(
                "cannot read the request body ({e}): its framing is broken (a bad chunk in a chunked body, chunk extensions or trailers past hyper's limits, or fewer bytes than its Content-Length)"
            ),
            field: None,
        },
    })?;
    Ok(Received {
        uri: parts.uri,
        body,
        format,
        answer,
    })
}

/// Why a request body could not be read whole.
enum BodyError {
    /// More than the limit arrived.
    TooLarge,
    /// The connection's framing of it broke.
    Broken(axum::Error),
}

/// The whole body, refused once more than `limit` bytes arrive. The usual small body comes in one
/// frame, read with the head: its bytes are the answer as they are, with no list of frames built and
/// flattened (`http_body_util`'s `collect`, about 1,100 instructions a request). Trailers are dropped.
async fn read_body(mut body: axum::body::Body, limit: usize) -> Result<Bytes, BodyError> {
    // The first frame's bytes; `joined` takes them and every later frame's once a second one comes.
    let mut first = Bytes::new();
    let mut joined: Vec<u8> = Vec::new();
    let mut len = 0usize;
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame.map_err(BodyError::Broken)?.into_data() else {
            continue; // trailers
        };
        len = len.saturating_add(data.len());
        if len > limit {
            return Err(BodyError::TooLarge);
        }
        if first.is_empty() {
            first = data;
        } else {
            if joined.is_empty() {
                joined.extend_from_slice(&first);
            }
            joined.extend_from_slice(&data);
        }
    }
    Ok(if joined.is_empty() {
        first
    } else {
        crate::encode::into_bytes(joined)
    })
}

/// Segment `i` of the URI's path (`/v1/models/ctr/predict`: 3 is `ctr`), percent-decoded as axum's
/// `Path` would. The router has matched the route, so the segment exists; an undecodable one is left as
/// sent (it names no model, so the caller gets a 404 naming it).
pub(crate) fn path_segment(uri: &Uri, i: usize) -> Cow<'_, str> {
    let raw = nth_segment(uri.path(), i);
    if raw.contains('%') {
        percent_decode_str(raw)
            .decode_utf8()
            .unwrap_or(Cow::Borrowed(raw))
    } else {
        Cow::Borrowed(raw)
    }
}

/// `path.split('/').nth(i)`, or `""`, by one pass over the bytes: `split` sets up a character search per
/// segment, which cost more than the scan on the hot routes' short paths, read twice per request.
fn nth_segment(path: &str, i: usize) -> &str {
    let mut start = 0;
    let mut index = 0;
    for (at, b) in path.bytes().enumerate() {
        if b == b'/' {
            if index == i {
                return &path[start..at];
            }
            index += 1;
            start = at + 1;
        }
    }
    if index == i { &path[start..] } else { "" }
}

async fn v2_infer(
    gw: Arc<Gateway>,
    req: Request,
    body_read: Option<BodyRead>,
) -> Result<Response, crate::oip::OipError> {
    // Looked up once; refusals before the model's own checks count in its stats too. An unknown model
    // is known from the path: answered before waiting for the body.
    let Ok(engine) = gw.engine(&path_segment(req.uri(), 3)) else {
        return Err(crate::oip::OipError(
            StatusCode::NOT_FOUND,
            format!("model `{}` is not registered", path_segment(req.uri(), 3)),
        ));
    };
    let failed = |status: StatusCode| engine.stats().failed(status);
    let headers = req.headers();
    // The Open Inference Protocol's REST binding is JSON only.
    if let Some(ct) = headers.get(header::CONTENT_TYPE) {
        let ct = String::from_utf8_lossy(ct.as_bytes());
        if Format::parse(&ct) != Some(Format::Json) || crate::decode::utf8_charset(&ct).is_err() {
            failed(StatusCode::UNSUPPORTED_MEDIA_TYPE);
            return Err(crate::oip::OipError(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                format!(
                    "unsupported content type `{ct}`: the V2 infer endpoint takes `application/json`, in UTF-8{}",
                    crate::error::form_hint(&ct, "application/json")
                ),
            ));
        }
    }
    // A body in the binary tensor extension is a JSON header and raw bytes after it: refused before it is
    // read, since it is not JSON.
    if headers.contains_key(INFERENCE_HEADER_CONTENT_LENGTH) {
        failed(StatusCode::BAD_REQUEST);
        return Err(crate::oip::OipError(
            StatusCode::BAD_REQUEST,
            format!(
                "{INFERENCE_HEADER_CONTENT_LENGTH}: the binary tensor extension is not supported; send the data as JSON (Triton's client: binary_data=False for each input and output)"
            ),
        ));
    }
    let started = started(body_read.as_ref());
    let r = match split(req, body_read, &gw).await {
        Ok(r) => r,
        Err(e) => {
            failed(e.status());
            // In the protocol's error shape, with the headers the error calls for (`Accept-Encoding`
            // with a 415 for a content coding, `Retry-After` with a 503).
            return Ok(e.respond(crate::error::Shape::V2));
        }
    };
    crate::oip::infer(&gw, &engine, &r.body, started).await
}

/// Open Inference Protocol server metadata.
async fn server_metadata() -> Json<serde_json::Value> {
    Json(json!({"name": "hydrant", "version": env!("CARGO_PKG_VERSION"), "extensions": []}))
}

async fn prefetch(
    gw: Arc<Gateway>,
    req: Request,
    body_read: Option<BodyRead>,
) -> Result<Response, ApiError> {
    let r = split(req, body_read, &gw).await?;
    gw.prefetch(r.format, &r.body).await
}

async fn write_rows(
    gw: Arc<Gateway>,
    req: Request,
    body_read: Option<BodyRead>,
) -> Result<Response, ApiError> {
    // An unknown view is known from the path: answered before waiting for the body.
    gw.view(&path_segment(req.uri(), 3))?;
    let r = split(req, body_read, &gw).await?;
    gw.write_rows(&path_segment(&r.uri, 3), r.format, &r.body)
        .await
}

/// The Open Inference Protocol's server-live answer.
async fn live() -> Json<serde_json::Value> {
    Json(json!({"live": true}))
}

async fn ready(State(gw): State<Arc<Gateway>>) -> Response {
    if gw.is_ready() {
        (StatusCode::OK, Json(json!({"ready": true}))).into_response()
    } else {
        // The protocol's own answer (`/v2/models/{model}/ready` answers the same way), not hydrant's
        // error body: a probe reads the status, a person the body.
        let mut resp = (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"ready": false})),
        )
            .into_response();
        resp.headers_mut()
            .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        resp
    }
}

async fn model_metadata(State(gw): State<Arc<Gateway>>, uri: Uri) -> Response {
    let model = path_segment(&uri, 3);
    let Ok(engine) = gw.engine(&model) else {
        return not_registered(&model);
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

async fn model_ready(State(gw): State<Arc<Gateway>>, uri: Uri) -> Response {
    let model = path_segment(&uri, 3);
    let known = gw.catalog.load().engines.contains_key(model.as_ref());
    if known && gw.is_ready() {
        (StatusCode::OK, Json(json!({"name": model, "ready": true}))).into_response()
    } else if known {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"name": model, "ready": false})),
        )
            .into_response()
    } else {
        not_registered(&model)
    }
}

/// On a versioned V2 path, the 404 for a version other than the one the model serves (counted in the
/// model's stats when `count`); `None` when the model serves it, or is not registered (which the
/// unversioned handler answers).
fn other_version(gw: &Gateway, uri: &Uri, count: bool) -> Option<Response> {
    let model = path_segment(uri, 3);
    let engine = gw.engine(&model).ok()?;
    let version = path_segment(uri, 5);
    let serves = engine.model().version;
    if version == serves.to_string() {
        return None;
    }
    if count {
        engine.stats().failed(StatusCode::NOT_FOUND);
    }
    Some(
        crate::oip::OipError(
            StatusCode::NOT_FOUND,
            format!("model `{model}` has no version `{version}`: it serves version {serves}"),
        )
        .into_response(),
    )
}

async fn versioned_metadata(State(gw): State<Arc<Gateway>>, uri: Uri) -> Response {
    match other_version(&gw, &uri, false) {
        Some(refused) => refused,
        None => model_metadata(State(gw), uri).await,
    }
}

async fn versioned_ready(State(gw): State<Arc<Gateway>>, uri: Uri) -> Response {
    match other_version(&gw, &uri, false) {
        Some(refused) => refused,
        None => model_ready(State(gw), uri).await,
    }
}

async fn versioned_infer(gw: Arc<Gateway>, req: Request, body_read: Option<BodyRead>) -> Response {
    match other_version(&gw, req.uri(), true) {
        Some(refused) => refused,
        None => v2_infer(gw, req, body_read).await.into_response(),
    }
}

/// The V2 routes' 404 for a model name, cut as every error message is (the name comes from the path).
fn not_registered(model: &str) -> Response {
    crate::oip::OipError(
        StatusCode::NOT_FOUND,
        format!("model `{model}` is not registered"),
    )
    .into_response()
}

async fn method_not_allowed(req: Request) -> Response {
    // The router answers 405 only for a path one of its routes has, and names that route: the routes
    // that read a body are the `POST` ones, the rest are `GET`.
    let path = req.uri().path();
    let allow = req
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map_or("GET", |route| {
            crate::middleware::allowed_methods(route.as_str())
        });
    ApiError::MethodNotAllowed {
        method: req.method().to_string(),
        path: path.to_owned(),
        allow: allow.to_owned(),
    }
    .respond(Shape::of_path(path))
}

async fn not_found(req: Request) -> Response {
    let path = req.uri().path();
    // A target with no path (`CONNECT host:443`, the authority form) is named as sent.
    let target: &dyn std::fmt::Display = if path.is_empty() { req.uri() } else { &path };
    ApiError::NotFound {
        code: "unknown_route",
        message: format!("no route {} {target}", req.method()),
    }
    .respond(Shape::of_path(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_are_what_split_gives() {
        for path in [
            "",
            "/",
            "//",
            "/v1",
            "/v1/",
            "/v1/models/ctr/predict",
            "/v1/models//predict",
            "v1/models",
            "/a/b/c/d/e/f/g",
            "/é/ü/",
        ] {
            for i in 0..9 {
                assert_eq!(
                    nth_segment(path, i),
                    path.split('/').nth(i).unwrap_or(""),
                    "{path:?} {i}"
                );
            }
        }
    }

    #[test]
    fn path_segments_are_percent_decoded_like_axum_paths() {
        let uri = |s: &str| s.parse::<Uri>().unwrap_or_default();
        assert_eq!(path_segment(&uri("/v1/models/ctr/predict"), 3), "ctr");
        assert_eq!(path_segment(&uri("/v1/models/%63tr/predict"), 3), "ctr");
        assert_eq!(path_segment(&uri("/v1/models/a%20b/predict"), 3), "a b");
        // Not UTF-8 once decoded: left as sent, so the 404 names what was sent.
        assert_eq!(path_segment(&uri("/v1/models/%ff/predict"), 3), "%ff");
        assert_eq!(path_segment(&uri("/v1/models"), 3), "");
    }
}
