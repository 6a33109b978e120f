//! hydrant: a feature-hydration and caching gateway in front of ONNX models.
//!
//! A product service asks "score this user (and these candidate items) in this context"; hydrant resolves
//! the entities' features from an in-process cache backed by a store, builds the model's input through the
//! transforms the data team registered, runs ONNX Runtime, and answers with the scores, the cache outcome and
//! the time spent in each stage.
//!
//! # Layout
//!
//! A predict request flows through these stages, each timed, each in the module of the same name:
//!
//! | stage | module | what it owns |
//! | --- | --- | --- |
//! | decode | [`decode`] | JSON/MessagePack bodies, checking them against the model binding |
//! | hydrate | [`hydrate`] | cache lookups, one batched store round trip for the misses, single-flight, degraded answers |
//! | assemble | [`assemble`] | transforms features and context into the model's row-major input buffer |
//! | queue, infer | [`infer`], [`dispatch`] | per-model micro-batching queue (which wakes a session only when it pays) and ONNX Runtime session pool on dedicated threads |
//! | postprocess | [`postprocess`] | shapes outputs and statuses for the response |
//! | encode | [`encode`] | writes the body in the negotiated format, `Server-Timing` |
//!
//! Around them:
//!
//! - [`gateway`]: runs the stages in order for one request; [`api`]: HTTP routes and thin handlers;
//!   [`middleware`]: the layer around every request (request id, span, timing, timeout backstop, panics);
//!   [`error`]: the one error type and its status mapping; [`serve`]: the accept loop (idle timeout,
//!   connection cap, graceful shutdown), shared with the load tester's floor.
//! - [`cache`]: the moka feature cache and its per-view policies; [`clock`]: the time it measures ages by.
//! - [`prefetch`]: warming the cache ahead of requests: the prefetch API, hot-key sampling, warm start.
//! - [`store`]: the storage backends (Redis, embedded redb file) behind the `Store` trait, and the
//!   invalidations replicas send each other through it; [`value`]: feature values and the stored record
//!   format; [`packed`]: a cached record's values, packed in one allocation.
//! - [`schema`]: the schema registry: parsing, validation and compilation of entities, views and models;
//!   [`proposal`]: a proposed change checked against the running registry (`POST /v1/schemas:validate`);
//!   [`registrar`]: registering changes while serving, with kept versions and rollback; [`yaml`]: the
//!   bound on what a YAML text's aliases expand to, checked before any is read.
//! - [`oip`]: the Open Inference Protocol (KServe V2) infer endpoint, raw tensors without hydration.
//! - [`feast`]: Feast's feature-server read (`POST /get-online-features`), for clients switching from Feast.
//! - [`loader`]: writing feature rows: the bulk loader (JSON Lines, CSV) and the rows API, write-through.
//! - [`config`]: typed configuration, file plus `HYDRANT_*` environment overrides.
//! - [`observe`]: `/metrics` (Prometheus) and `/v1/stats` (JSON) rendering.
//! - [`telemetry`]: stage timings, counters and histograms, logging set-up.
//! - [`app`]: start-up (build) and graceful shutdown.

pub mod api;
pub mod app;
pub mod assemble;
pub mod auth;
pub mod cache;
pub mod clock;
pub mod config;
pub mod decode;
pub mod dispatch;
pub mod encode;
pub mod error;
pub mod feast;
pub mod gateway;
pub mod hydrate;
pub mod infer;
pub mod journal;
pub mod loader;
pub mod middleware;
pub mod observe;
pub mod oip;
pub mod oip_data;
pub mod packed;
pub mod postprocess;
pub mod predict_json;
pub mod prefetch;
pub mod proposal;
pub mod registrar;
pub mod schema;
pub mod serve;
pub mod store;
pub mod telemetry;
pub mod value;
pub mod yaml;
