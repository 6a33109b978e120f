//! The core of a request: runs the stages in order (decode, hydrate, assemble, queue + infer, postprocess,
//! encode), timing each. HTTP handlers call [`Gateway::predict`] and [`Gateway::features`] and nothing else.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use smallvec::SmallVec;
use tracing::Instrument;

use crate::assemble::{Overflow, assemble};
use crate::config::Config;
use crate::decode::{FeaturesRequest, Format, PredictRequest, parse_body, parse_limited};
use crate::encode::{BodyWriter, TimingsBody, respond};
use crate::error::ApiError;
use crate::feast::{OnlineBody, OnlineFeaturesRequest};
use crate::hydrate::{Hydrated, Hydrator, Status};
use crate::infer::Engine;
use crate::packed::ValueRef;
use crate::postprocess::{FeatureStatus, InputRows, Outputs, defaulted};
use crate::schema::{Model, Registry, View};
use crate::telemetry::{Laps, Stage, Telemetry, Timings};

/// What is registered and running: the compiled schemas and each model's engine. Registering a change
/// builds a new catalog and swaps it in whole ([`crate::registrar`]); a request takes the catalog once
/// and keeps it, so it never sees half of a change.
pub struct Catalog {
    pub registry: Arc<Registry>,
    pub engines: HashMap<String, Arc<Engine>>,
    /// The running models' names, which the request layer gives metrics as their `model` label.
    pub names: Vec<Arc<str>>,
}

impl Catalog {
    pub fn new(registry: Arc<Registry>, engines: HashMap<String, Arc<Engine>>) -> Self {
        let mut names: Vec<Arc<str>> = engines.keys().map(|n| Arc::from(n.as_str())).collect();
        names.sort();
        Self {
            registry,
            engines,
            names,
        }
    }
}

/// The running catalog, shared by the gateway and the request layer (which labels metrics by model).
pub type Catalogs = Arc<ArcSwap<Catalog>>;

/// Everything a request needs, shared by all requests.
pub struct Gateway {
    pub config: Config,
    pub catalog: Catalogs,
    pub hydrator: Arc<Hydrator>,
    pub telemetry: Arc<Telemetry>,
    /// False until models are loaded (and, with warm start, the cache is warm).
    pub ready: AtomicBool,
    /// Bounds the background prefetches (`POST /v1/prefetch`).
    pub prefetcher: crate::prefetch::Prefetcher,
    /// What the schemas folder's watch last refused ([`crate::registrar::watch_folder`]).
    pub folder: crate::registrar::FolderState,
    /// Bearer tokens (`[auth]`); `None` when authentication is off.
    pub auth: Option<crate::auth::Tokens>,
    /// The ONNX file each model version was served from ([`crate::infer::ServedFiles`]).
    pub served: crate::infer::ServedFiles,
}

impl Gateway {
    pub fn is_ready(&self) -> bool {
        self.ready.load(Relaxed)
    }

    /// Swaps in `registry` and its models' `engines` as the running catalog (a registration, or a
    /// change found in the schemas folder). Its views are listed in the stats from now on.
    pub fn put_in_force(&self, registry: Arc<Registry>, engines: HashMap<String, Arc<Engine>>) {
        self.telemetry
            .retain_views(|v| registry.views.contains_key(v));
        self.telemetry.know_views(registry.views.values());
        self.served.record(engines.values());
        self.catalog
            .store(Arc::new(Catalog::new(registry, engines)));
    }

    fn deadline(&self, started: Instant, deadline_ms: Option<u64>) -> Instant {
        let limit = self.config.limits.request_timeout;
        let d = deadline_ms.map_or(limit, |ms| Duration::from_millis(ms).min(limit));
        started + d
    }

    /// Stage `hydrate`: the views' keys from the cache or the store, in the request's `hydrate` span.
    async fn hydrate<K: AsRef<str>>(
        &self,
        lookups: &[(&Arc<View>, &[K])],
        deadline: Instant,
    ) -> Hydrated {
        self.hydrator
            .hydrate(lookups, deadline)
            .instrument(tracing::debug_span!("hydrate"))
            .await
    }

    /// The registered schemas as they are now.
    pub fn registry(&self) -> Arc<Registry> {
        self.catalog.load().registry.clone()
    }

    /// The running model `model`'s engine.
    pub fn engine(&self, model: &str) -> Result<Arc<Engine>, ApiError> {
        let catalog = self.catalog.load();
        catalog.engines.get(model).cloned().ok_or_else(|| {
            let known = crate::schema::known_names(catalog.engines.keys().map(String::as_str));
            ApiError::NotFound {
                code: "unknown_model",
                message: format!("no model `{model}` is registered (models: {})", known),
            }
        })
    }

    /// The registered view `name` (404 `unknown_view` when there is none).
    pub fn view(&self, name: &str) -> Result<Arc<crate::schema::View>, ApiError> {
        let registry = self.registry();
        registry.views.get(name).cloned().ok_or_else(|| {
            let known = crate::schema::known_names(registry.views.keys().map(String::as_str));
            ApiError::NotFound {
                code: "unknown_view",
                message: format!("no view `{name}` is registered (views: {})", known),
            }
        })
    }

    /// `POST /v1/models/{model}/predict`, on the model's engine ([`Gateway::engine`], looked up from the
    /// path before the body is read).
    pub async fn predict(
        &self,
        engine: &Arc<Engine>,
        format: Format,
        answer: Format,
        body: &[u8],
        started: Instant,
    ) -> Result<Response, ApiError> {
        let stats = engine.stats();
        let result = self
            .run_predict(engine, format, answer, body, started)
            .await;
        if let Err(e) = &result {
            stats.failed(e.status());
        }
        result
    }

    async fn run_predict(
        &self,
        engine: &Arc<Engine>,
        format: Format,
        answer: Format,
        body: &[u8],
        started: Instant,
    ) -> Result<Response, ApiError> {
        let model: &Arc<Model> = engine.model();
        let mut t = Timings::default();
        let mut laps = Laps::from(started);

        // decode
        // The usual body read by hand; anything else (and every error) by serde. Neither holds more
        // candidates than the limit: past it they are counted for the 413, not kept.
        let fast = match format {
            Format::Json => crate::predict_json::parse(body, self.config.limits.max_candidates),
            Format::Msgpack => None,
        };
        let mut req: PredictRequest = match fast {
            Some(req) => req,
            None => parse_limited(format, body, &self.config.limits)?,
        };
        let plan = req.plan(model, &self.config.limits)?;
        let deadline = self.deadline(started, req.options.deadline_ms);
        t.set(Stage::Decode, laps.lap());

        // hydrate
        let lookups: SmallVec<[_; 4]> = model
            .views
            .iter()
            .zip(&plan.keys)
            .map(|(v, k)| (v, k.as_slice()))
            .collect();
        let hydrated = self.hydrate(&lookups, deadline).await;
        t.set(Stage::Hydrate, laps.lap());

        // assemble
        let mut buf = engine.take_buffer();
        let mut flags = Vec::new();
        if let Err(o) = assemble(
            model,
            &hydrated.views,
            &plan.context,
            plan.rows,
            &mut buf,
            &mut flags,
        ) {
            engine.give_buffer(buf);
            return Err(overflow(model, o));
        }
        t.set(Stage::Assemble, laps.lap());

        // queue + infer: `infer` is the model run of the batch this request rode in; `queue` is everything
        // else spent waiting for it (for a session, for batch company, and for the executor to resume this
        // task after the reply), so the stages add up to the total.
        let out = engine
            .infer(plan.rows, buf, deadline)
            .instrument(tracing::debug_span!("infer", rows = plan.rows))
            .await?;
        t.set(Stage::Queue, laps.lap().saturating_sub(out.infer_us));
        t.set(Stage::Infer, out.infer_us);
        if let Some((o, row)) = out.outputs.first_non_finite() {
            let name = model.outputs.get(o).map_or("?", String::as_str);
            let features = out.input.chunks(model.width.max(1)).nth(row).unwrap_or(&[]);
            let err = unscorable(model, &plan, name, row);
            // The model's input is too long for an answer; the log carries it beside the answer's words.
            tracing::warn!(input = ?features, "{err}");
            engine.recycle(out);
            return Err(err);
        }

        // postprocess
        let outputs = Outputs {
            model,
            values: &out.outputs,
        };
        let status = FeatureStatus {
            model,
            views: &hydrated.views,
            per_row: &plan.per_row,
        };
        let defaulted = defaulted(model, &flags);
        t.set(Stage::Postprocess, laps.lap());

        // encode
        let fields = 6
            + u32::from(!defaulted.is_empty())
            + u32::from(req.options.return_features)
            + u32::from(req.options.timings);
        // A guess that fits most answers (one score and one status per row, plus timings), so the buffer
        // neither grows nor, when trimmed for the response, moves.
        let mut w = BodyWriter::new(answer, fields, 384 + plan.rows * 24);
        w.fast_field("model", &model.name);
        w.fast_field("model_version", &model.version);
        w.fast_field("outputs", &outputs);
        w.fast_field("degraded", &hydrated.degraded);
        w.fast_field("feature_status", &status);
        if !defaulted.is_empty() {
            w.field("defaulted", &defaulted);
        }
        w.fast_field("cache", &hydrated.cache);
        if req.options.return_features {
            w.field(
                "features",
                &InputRows {
                    width: model.width,
                    data: &out.input,
                },
            );
        }
        t.set(Stage::Encode, laps.lap());
        t.total_us = laps.total();
        if req.options.timings {
            w.fast_field("timings_us", &TimingsBody::from(&t));
        }
        let body = w.finish();
        engine.recycle(out);
        engine.stats().record(&t, plan.rows);
        Ok(respond(answer, body, &t))
    }

    /// `POST /v1/features`: features only, no model. Values are what a model would be served (defaults
    /// where missing); `statuses` say why.
    pub async fn features(
        &self,
        format: Format,
        answer: Format,
        body: &[u8],
        started: Instant,
    ) -> Result<Response, ApiError> {
        let mut t = Timings::default();
        let mut laps = Laps::from(started);
        let req: FeaturesRequest = parse_limited(format, body, &self.config.limits)?;
        let plan = req.plan(&self.catalog.load().registry, &self.config.limits)?;
        let deadline = self.deadline(started, req.options.deadline_ms);
        t.set(Stage::Decode, laps.lap());

        let lookups: Vec<_> = plan
            .views
            .iter()
            .map(|(v, k, _)| (v, k.as_slice()))
            .collect();
        let hydrated = self.hydrate(&lookups, deadline).await;
        t.set(Stage::Hydrate, laps.lap());

        let mut columns: Vec<(String, Column<'_>)> = Vec::new();
        for ((view, _, wanted), resolved) in plan.views.iter().zip(&hydrated.views) {
            for &fi in wanted {
                let feature = &view.features[fi];
                let mut col = Column {
                    values: Vec::with_capacity(resolved.len()),
                    statuses: Vec::with_capacity(resolved.len()),
                    float32: feature.dtype == crate::value::Dtype::Float32,
                };
                for r in resolved {
                    let (v, st) = match r.found().map(|f| f.values.get(fi)) {
                        Some(v) if !v.is_null() => (v, r.status.into()),
                        Some(_) => ((&feature.default).into(), FeatureStatusName::NullValue),
                        None => ((&feature.default).into(), r.status.into()),
                    };
                    col.values.push(v);
                    col.statuses.push(st);
                }
                columns.push((format!("{}:{}", view.name, feature.name), col));
            }
        }
        t.set(Stage::Postprocess, laps.lap());

        let mut w = BodyWriter::new(answer, 3 + u32::from(req.options.timings), 256);
        w.field("features", &ColumnsBody(&columns));
        w.fast_field("degraded", &hydrated.degraded);
        w.fast_field("cache", &hydrated.cache);
        t.set(Stage::Encode, laps.lap());
        t.total_us = laps.total();
        if req.options.timings {
            w.fast_field("timings_us", &TimingsBody::from(&t));
        }
        Ok(respond(answer, w.finish(), &t))
    }

    /// `POST /get-online-features`: Feast's feature-server read ([`crate::feast`]). Timed in the stages
    /// of `/v1/features`; the timings go in `Server-Timing` only, since Feast's answer has no place for them.
    pub async fn online_features(
        &self,
        format: Format,
        answer: Format,
        body: &[u8],
        started: Instant,
    ) -> Result<Response, ApiError> {
        let mut t = Timings::default();
        let mut laps = Laps::from(started);
        let req: OnlineFeaturesRequest = parse_limited(format, body, &self.config.limits)?;
        let plan = req.plan(&self.catalog.load().registry, &self.config.limits)?;
        let deadline = self.deadline(started, None);
        t.set(Stage::Decode, laps.lap());

        let lookups: Vec<_> = plan.views.iter().map(|(v, k)| (v, k.as_slice())).collect();
        let hydrated = self.hydrate(&lookups, deadline).await;
        t.set(Stage::Hydrate, laps.lap());

        // A guess that fits most answers; a very wide one (a thousand keys of a thousand features) grows
        // the buffer as it is written rather than reserving it all before.
        let guess = 128 + plan.rows * (plan.columns.len() + 1) * 48;
        let mut w = BodyWriter::new(answer, 2, guess.min(1 << 20));
        OnlineBody {
            request: &req,
            plan: &plan,
            resolved: &hydrated.views,
        }
        .write(&mut w);
        t.set(Stage::Encode, laps.lap());
        t.total_us = laps.total();
        let mut resp = respond(answer, w.finish(), &t);
        if hydrated.degraded {
            resp.headers_mut().insert(
                crate::feast::DEGRADED_HEADER,
                axum::http::HeaderValue::from_static("true"),
            );
        }
        Ok(resp)
    }
}

/// A feature-level status: the entity's, or `NULL_VALUE` for a null in a present record.
#[derive(Debug, Clone, Copy, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
enum FeatureStatusName {
    Present,
    NotFound,
    NullValue,
    OutsideMaxAge,
    Stale,
    Defaulted,
}

impl From<Status> for FeatureStatusName {
    fn from(s: Status) -> Self {
        match s {
            Status::Present => Self::Present,
            Status::NotFound => Self::NotFound,
            Status::OutsideMaxAge => Self::OutsideMaxAge,
            Status::Stale => Self::Stale,
            Status::Defaulted => Self::Defaulted,
        }
    }
}

struct Column<'a> {
    values: Vec<ValueRef<'a>>,
    statuses: Vec<FeatureStatusName>,
    /// The feature is float32: its values are written as float32 (`2.893027`, not the float64 digits
    /// of the same number, `2.8930270671844482`).
    float32: bool,
}

impl Serialize for Column<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut st = s.serialize_struct("Column", 2)?;
        if self.float32 {
            st.serialize_field("values", &Float32Values(&self.values))?;
        } else {
            st.serialize_field("values", &self.values)?;
        }
        st.serialize_field("statuses", &self.statuses)?;
        st.end()
    }
}

struct Float32Values<'a, 'b>(&'a [ValueRef<'b>]);

impl Serialize for Float32Values<'_, '_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeSeq;
        let mut seq = s.serialize_seq(Some(self.0.len()))?;
        for v in self.0 {
            match v {
                // Stored rounded to float32 already, so this loses nothing.
                ValueRef::Float(f) => seq.serialize_element(&(*f as f32))?,
                other => seq.serialize_element(other)?,
            }
        }
        seq.end()
    }
}

struct ColumnsBody<'a, 'b>(&'a [(String, Column<'b>)]);

impl Serialize for ColumnsBody<'_, '_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in self.0 {
            m.serialize_entry(k, v)?;
        }
        m.end()
    }
}

/// Warming and writing: `POST /v1/prefetch` and `POST /v1/views/{view}/rows`.
impl Gateway {
    /// `POST /v1/prefetch`: checks the entities and views, then fetches them in the background; 202
    /// `{"accepted": N}` (keys), or 429 while `prefetch.max_concurrent` prefetches are running.
    pub async fn prefetch(&self, format: Format, body: &[u8]) -> Result<Response, ApiError> {
        let req: crate::prefetch::PrefetchRequest =
            parse_limited(format, body, &self.config.limits)?;
        let plan = req.plan(&self.catalog.load().registry, &self.config.limits)?;
        let deadline = Instant::now() + self.config.limits.request_timeout;
        match self.prefetcher.start(&self.hydrator, plan, deadline) {
            Some(n) => Ok((
                axum::http::StatusCode::ACCEPTED,
                axum::Json(serde_json::json!({ "accepted": n })),
            )
                .into_response()),
            None => Err(ApiError::TooManyRequests(format!(
                "{} prefetches are running (prefetch.max_concurrent); retry later",
                self.config.prefetch.max_concurrent
            ))),
        }
    }

    /// `POST /v1/views/{view}/rows`: validates every row (one bad row refuses them all), writes them
    /// through to the store and invalidates them on every replica; 200 `{"written": N, "announced": bool}`.
    pub async fn write_rows(
        &self,
        view: &str,
        format: Format,
        body: &[u8],
    ) -> Result<Response, ApiError> {
        let v = self.view(view)?;
        // A row the decoder refuses (a name given twice, NaN) is a bad row like the ones `parse_rows`
        // refuses, and answered the same way.
        let req: crate::loader::RowsRequest = parse_body(format, body).map_err(|e| match e {
            ApiError::Malformed {
                code: "invalid_field",
                message,
                field: Some(field),
            } if field.starts_with("rows[") => ApiError::Invalid {
                code: "invalid_row",
                message: format!("{message} (nothing was written)"),
                field: Some(field),
            },
            other => other,
        })?;
        crate::loader::check_row_count(req.rows.sent)?;
        let prefix = self.config.store.prefix.clone();
        let limits = self.config.limits.clone();
        // Refused before anything is written, as it is.
        let writes =
            crate::loader::parse_rows(&v, &prefix, &req.rows, crate::value::now_ms(), &limits)?;
        // The write, its local invalidation, its announcement and any write again in a view's new shape
        // run in their own task: a request that times out or whose client goes away must not stop them
        // halfway (written but not announced, or left in a shape the view no longer reads).
        let hydrator = self.hydrator.clone();
        let catalog = self.catalog.clone();
        let view = view.to_owned();
        // In the request's span (or tagged with its id), so that what the write logs names the request.
        let task = tokio::spawn(crate::telemetry::in_request(async move {
            write_in_shape(
                &hydrator, &catalog, &view, v, &req.rows, writes, &prefix, &limits,
            )
            .await
        }));
        // The answer is due within the request's limit; the write goes on either way.
        let limit = self.config.limits.request_timeout;
        let written = tokio::time::timeout(limit, task)
            .await
            .map_err(|_| {
                ApiError::Timeout(format!(
                    "the store did not confirm the write within the gateway's limit of {limit:?}: {MAY_HAVE_LANDED}"
                ))
            })?
            .map_err(|e| ApiError::Internal(format!("the write task failed: {e}")))??;
        Ok(axum::Json(serde_json::json!({
            "written": written.rows,
            "announced": written.announced,
        }))
        .into_response())
    }
}

/// How many times a rows write is written again after its view changed under it, before 409.
const MAX_REWRITES: u32 = 3;

const MAY_HAVE_LANDED: &str = "the rows may have been written, and sending them again is safe";

/// Writes `writes` (`rows` parsed for `view` as `v`) through the store, the cache and the announcement;
/// then, where a registration on this replica changed the view's version or features meanwhile, parses
/// and writes the rows again in its new shape (up to three times): stored in the shape before, which the
/// view no longer reads, they would be served as defaults after an answer of 200.
#[allow(clippy::too_many_arguments)]
async fn write_in_shape(
    hydrator: &Arc<crate::hydrate::Hydrator>,
    catalog: &Catalogs,
    view: &str,
    mut v: Arc<crate::schema::View>,
    rows: &[serde_json::Map<String, serde_json::Value>],
    mut writes: crate::store::Writes,
    prefix: &str,
    limits: &crate::config::LimitsConfig,
) -> Result<crate::loader::Written, ApiError> {
    let mut rewrites = 0;
    loop {
        let written = crate::loader::write_through(hydrator, writes, v.policy.key_ttl)
            .await
            .map_err(|e| {
                // A write that may still land, in a shape the view no longer reads: its caller was
                // told to send it again, but may have given up by now; the log says so.
                let now = catalog.load().registry.views.get(view).map(|n| n.version);
                if matches!(
                    e,
                    crate::store::StoreError::Timeout | crate::store::StoreError::Partial(_)
                ) && now.is_some_and(|n| n != v.version)
                {
                    tracing::warn!(
                        view,
                        rows = rows.len(),
                        "a rows write did not complete ({e}) and may still land under version {} of the view, which is now at version {}: those rows are served as defaults until written again",
                        v.version,
                        now.unwrap_or_default()
                    );
                }
                let again = if rewrites == 0 {
                    ""
                } else {
                    " (written again in the view's new shape, after it changed during the write)"
                };
                ApiError::StoreUnavailable(match e {
                    crate::store::StoreError::Timeout => {
                        format!("the store did not confirm the write in time ({e}){again}: {MAY_HAVE_LANDED}")
                    }
                    crate::store::StoreError::Partial(detail) => {
                        format!("the store wrote only some of the rows ({detail}){again}; sending them all again is safe")
                    }
                    e if rewrites == 0 => format!("the rows were not written: {e}"),
                    e => format!("the rows were written, but not again in the view's new shape after it changed during the write: {e}; send them again"),
                })
            })?;
        let now = catalog.load().registry.views.get(view).cloned();
        let changed = match now {
            Some(now) if now.shape() == v.shape() => return Ok(written),
            Some(now) if rewrites < MAX_REWRITES => now,
            Some(now) => {
                return Err(ApiError::ViewChanged {
                    message: format!(
                        "view `{view}` kept changing while these rows were written (written {} times, last under version {}, and it is now at version {}); send them again",
                        rewrites + 1,
                        v.version,
                        now.version
                    ),
                    field: None,
                });
            }
            None => {
                return Err(ApiError::ViewChanged {
                    message: format!(
                        "view `{view}` was deleted while these rows were written (under version {}); they are stored, but nothing reads them",
                        v.version
                    ),
                    field: None,
                });
            }
        };
        tracing::info!(
            view,
            from = v.version,
            to = changed.version,
            "the view changed while rows were written: writing them again in its new shape"
        );
        let before = std::mem::replace(&mut v, changed);
        rewrites += 1;
        writes = crate::loader::parse_rows(&v, prefix, rows, crate::value::now_ms(), limits)
            .map_err(|e| {
                let (why, field) = match e {
                    ApiError::Invalid { message, field, .. } => {
                        (message.replace("; nothing was written)", ")"), field)
                    }
                    other => (other.to_string(), None),
                };
                ApiError::ViewChanged {
                    message: format!(
                        "view `{view}` changed from version {} to {} while these rows were written: they are stored under version {}, which it no longer reads, and do not fit version {}: {why}",
                        before.version, v.version, before.version, v.version
                    ),
                    field,
                }
            })?;
    }
}

/// The 400 for a context value the model's float32 input cannot hold once transformed.
fn overflow(model: &Model, o: Overflow) -> ApiError {
    let name = model
        .context
        .get(o.context)
        .map_or("?", |f| f.name.as_str());
    let input = model.slots.get(o.slot).map_or("?", |s| s.label.as_str());
    ApiError::invalid(
        "invalid_field",
        format!("context.{name}"),
        format!(
            "context.{name}: after the transforms of model `{}`'s input `{input}` the value is beyond float32 (about ±3.4e38), so the model would be given infinity; send a value that stays within it",
            model.name
        ),
    )
}

/// A 422 for a row the model scored as NaN or infinity: every input was finite (assemble sees to
/// that), so the stored features of the entities named, or the context sent, are what the model cannot
/// score. The answer names both, and the row's candidate when the request has candidates.
fn unscorable(model: &Model, plan: &crate::decode::Plan, output: &str, row: usize) -> ApiError {
    let mut entities = String::new();
    for ((view, keys), per_row) in model.views.iter().zip(&plan.keys).zip(&plan.per_row) {
        let key = if *per_row {
            keys.get(row)
        } else {
            keys.first()
        };
        if let Some(key) = key {
            let sep = if entities.is_empty() { "" } else { ", " };
            let _ = write!(
                entities,
                "{sep}{} `{key}` (view `{}`)",
                view.entity.name, view.name
            );
        }
    }
    let candidate = plan
        .per_row
        .iter()
        .any(|p| *p)
        .then(|| format!("candidates[{row}]"));
    // The context values sent are inputs too: a large one can carry the model's sums past float32 as
    // well as a stored feature can.
    let mut sent = String::new();
    for (field, value) in model.context.iter().zip(&plan.context) {
        if value.is_some() {
            let sep = if sent.is_empty() { "" } else { ", " };
            let _ = write!(sent, "{sep}`context.{}`", field.name);
        }
    }
    let whose = match (entities.is_empty(), sent.is_empty()) {
        (true, true) => "from the fallbacks alone".to_owned(),
        (true, false) => format!("from the context sent ({sent}) and the fallbacks"),
        (false, true) => format!("from the features hydrated for {entities}"),
        (false, false) => {
            format!("from the features hydrated for {entities} and the context sent ({sent})")
        }
    };
    let mend = if sent.is_empty() {
        "correct the rows or the model"
    } else {
        "check the context values sent, the rows and the model"
    };
    ApiError::Unscorable {
        message: format!(
            "{}model `{}` gave a non-finite `{output}` (NaN or infinity) {whose}: the model cannot score those values; {mend}",
            candidate
                .as_deref()
                .map(|c| format!("{c}: "))
                .unwrap_or_default(),
            model.name
        ),
        field: candidate,
    }
}
