//! Telemetry: per-request stage timings, per-view cache counters, per-model stage histograms, store round
//! trips per backend, prefetch and invalidation counters, the `Server-Timing` header and logging set-up.
//!
//! Counters are plain atomics owned by the app (not a process-global recorder), so several gateways in one
//! process, as in the integration tests, never mix their numbers.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering::Relaxed};
use std::time::Instant;

use parking_lot::RwLock;

use crate::config::{LogFormat, TelemetryConfig};

/// The stages of a request, in order. Each has the module of the same name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    Decode = 0,
    Hydrate = 1,
    Assemble = 2,
    Queue = 3,
    Infer = 4,
    Postprocess = 5,
    Encode = 6,
}

impl Stage {
    /// The stages of a V2 infer request, which sends raw tensors: no hydrate, assemble or postprocess.
    pub const RAW: [Stage; 4] = [Stage::Decode, Stage::Queue, Stage::Infer, Stage::Encode];

    pub const ALL: [Stage; 7] = [
        Stage::Decode,
        Stage::Hydrate,
        Stage::Assemble,
        Stage::Queue,
        Stage::Infer,
        Stage::Postprocess,
        Stage::Encode,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Stage::Decode => "decode",
            Stage::Hydrate => "hydrate",
            Stage::Assemble => "assemble",
            Stage::Queue => "queue",
            Stage::Infer => "infer",
            Stage::Postprocess => "postprocess",
            Stage::Encode => "encode",
        }
    }
}

/// Microseconds spent in each stage of one request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Timings {
    pub us: [u64; 7],
    pub total_us: u64,
}

impl Timings {
    pub fn set(&mut self, stage: Stage, us: u64) {
        self.us[stage as usize] = us;
    }

    pub fn get(&self, stage: Stage) -> u64 {
        self.us[stage as usize]
    }

    /// The `Server-Timing` header value (durations in milliseconds, as the header specifies).
    pub fn server_timing(&self) -> Vec<u8> {
        let mut s = Vec::with_capacity(176);
        // Whole tokens as literals, and numbers written by hand: `write!` of the 16 numbers of a header,
        // and later a push per character, showed in hot-path profiles.
        for (token, us) in [
            (&b"decode;dur="[..], self.get(Stage::Decode)),
            (b", hydrate;dur=", self.get(Stage::Hydrate)),
            (b", assemble;dur=", self.get(Stage::Assemble)),
            (b", queue;dur=", self.get(Stage::Queue)),
            (b", infer;dur=", self.get(Stage::Infer)),
            (b", postprocess;dur=", self.get(Stage::Postprocess)),
            (b", encode;dur=", self.get(Stage::Encode)),
            (b", total;dur=", self.total_us),
        ] {
            s.extend_from_slice(token);
            push_ms(&mut s, us);
        }
        s
    }

    /// The `Server-Timing` header value for a request that has only `stages` (V2 infer's), and `total`.
    pub fn server_timing_of(&self, stages: &[Stage]) -> Vec<u8> {
        let mut s = Vec::with_capacity(24 * (stages.len() + 1));
        for &stage in stages {
            s.extend_from_slice(stage.name().as_bytes());
            s.extend_from_slice(b";dur=");
            push_ms(&mut s, self.get(stage));
            s.extend_from_slice(b", ");
        }
        s.extend_from_slice(b"total;dur=");
        push_ms(&mut s, self.total_us);
        s
    }
}

/// Appends `<ms>.<µs>`: microseconds as milliseconds with three decimals.
fn push_ms(s: &mut Vec<u8>, us: u64) {
    crate::encode::push_json_uint(s, us / 1000);
    let frac = us % 1000;
    let digit = |d: u64| b'0' + d as u8;
    s.extend_from_slice(&[
        b'.',
        digit(frac / 100),
        digit(frac / 10 % 10),
        digit(frac % 10),
    ]);
}

/// Stage times by laps: each stage boundary reads the clock once, ending one stage and starting the next
/// (a clock read is tens of nanoseconds on a virtual machine, and a request has a dozen boundaries).
#[derive(Debug, Clone, Copy)]
pub struct Laps {
    started: Instant,
    last: Instant,
}

impl Laps {
    pub fn from(started: Instant) -> Self {
        Self {
            started,
            last: started,
        }
    }

    /// Microseconds since the previous lap (or the start); the next lap counts from now.
    pub fn lap(&mut self) -> u64 {
        let now = Instant::now();
        let us = micros(now.saturating_duration_since(self.last));
        self.last = now;
        us
    }

    /// Microseconds from the start to the latest lap.
    pub fn total(&self) -> u64 {
        micros(self.last.saturating_duration_since(self.started))
    }
}

fn micros(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// Microseconds since `t`, saturating.
pub fn us_since(t: Instant) -> u64 {
    micros(t.elapsed())
}

/// Cache and store counters of one view.
#[derive(Debug, Default)]
pub struct ViewStats {
    pub hits: AtomicU64,
    pub stale: AtomicU64,
    pub misses: AtomicU64,
    pub negative: AtomicU64,
    pub entries: AtomicI64,
    pub bytes: AtomicI64,
    /// Records in the store that could not be decoded (bad MessagePack, version or length).
    pub bad_records: AtomicU64,
    pub degraded_timeout: AtomicU64,
    pub degraded_error: AtomicU64,
    /// Entries the cache evicted to stay within `cache.max_bytes` (not those expired or invalidated).
    pub evicted: AtomicU64,
    /// How long the view's policy keeps a found entry and a not-found one now, in milliseconds (0 until
    /// the view is registered): see [`crate::cache::note_policy`].
    keep_found_ms: AtomicU64,
    keep_missing_ms: AtomicU64,
    /// The view's shape those keeps are for: entries of another shape are never served again.
    keep_shape: AtomicU64,
    /// Background refreshes (refresh-ahead) by outcome: `hydrant_refresh_total{view,outcome}`. A key counts
    /// once per refresh round trip it was part of.
    pub refresh: Outcomes,
    /// The view was deleted: its counters are no longer reported, and the cache's upkeep removes the
    /// entries that account themselves here.
    retired: AtomicBool,
}

impl ViewStats {
    pub fn set_keep_ms(&self, shape: u64, found: u64, missing: u64) {
        self.keep_shape.store(shape, Relaxed);
        self.keep_found_ms.store(found, Relaxed);
        self.keep_missing_ms.store(missing, Relaxed);
    }

    /// Whether `shape` is not the view's shape now (false until the view is registered): an entry of it
    /// is never served again.
    pub fn of_another_shape(&self, shape: u64) -> bool {
        let now = self.keep_shape.load(Relaxed);
        now != 0 && now != shape
    }

    /// How long the view's policy keeps a found (or a not-found) entry of its shape now, in milliseconds
    /// (0 until the view is registered); entries of another shape are [`of_another_shape`](Self::of_another_shape).
    pub fn keep_ms(&self, found: bool) -> u64 {
        if found {
            self.keep_found_ms.load(Relaxed)
        } else {
            self.keep_missing_ms.load(Relaxed)
        }
    }

    pub fn inserted(&self, weight: u32) {
        self.entries.fetch_add(1, Relaxed);
        self.bytes.fetch_add(i64::from(weight), Relaxed);
    }

    pub fn removed(&self, weight: u32) {
        self.entries.fetch_sub(1, Relaxed);
        self.bytes.fetch_sub(i64::from(weight), Relaxed);
    }

    /// Whether the view these counters belong to was deleted.
    pub fn is_retired(&self) -> bool {
        self.retired.load(Relaxed)
    }
}

/// Upper bounds (seconds) of the latency histogram buckets: 5 µs to 10 s.
pub const BUCKETS_S: [f64; 20] = [
    0.000_005, 0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005,
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// A Prometheus-style histogram over [`BUCKETS_S`], lock-free.
#[derive(Debug, Default)]
pub struct Histogram {
    counts: [AtomicU64; 21],
    sum_us: AtomicU64,
}

impl Histogram {
    pub fn observe_us(&self, us: u64) {
        let s = us as f64 / 1e6;
        let i = BUCKETS_S
            .iter()
            .position(|b| s <= *b)
            .unwrap_or(BUCKETS_S.len());
        self.counts[i].fetch_add(1, Relaxed);
        self.sum_us.fetch_add(us, Relaxed);
    }

    /// Cumulative counts per bucket (the last is +Inf), and the sum in seconds.
    pub fn snapshot(&self) -> ([u64; 21], f64) {
        let mut out = [0; 21];
        let mut acc = 0;
        for (i, c) in self.counts.iter().enumerate() {
            acc += c.load(Relaxed);
            out[i] = acc;
        }
        (out, self.sum_us.load(Relaxed) as f64 / 1e6)
    }
}

/// Buckets of [`FineHistogram`]: exact below 64 µs, then 32 per power of two (about 3% wide).
const FINE_BUCKETS: usize = 64 + 32 * 32;

fn fine_index(us: u64) -> usize {
    if us < 64 {
        return us as usize;
    }
    let exp = 63 - us.leading_zeros() as usize; // >= 6
    let mantissa = ((us >> (exp - 5)) & 31) as usize;
    (64 + (exp - 6) * 32 + mantissa).min(FINE_BUCKETS - 1)
}

fn fine_upper(i: usize) -> u64 {
    if i < 64 {
        return i as u64;
    }
    let exp = (i - 64) / 32 + 6;
    let mantissa = ((i - 64) % 32) as u64;
    ((32 + mantissa + 1) << (exp - 5)) - 1
}

/// A log-linear latency histogram for percentiles (microseconds), lock-free.
#[derive(Debug)]
pub struct FineHistogram {
    counts: Box<[AtomicU64]>,
}

impl Default for FineHistogram {
    fn default() -> Self {
        Self {
            counts: (0..FINE_BUCKETS).map(|_| AtomicU64::new(0)).collect(),
        }
    }
}

impl FineHistogram {
    fn observe(&self, us: u64) {
        self.counts[fine_index(us)].fetch_add(1, Relaxed);
    }

    fn clear(&self) {
        for c in self.counts.iter() {
            c.store(0, Relaxed);
        }
    }
}

/// Percentiles of a set of fine histograms, in microseconds.
pub fn percentiles(hs: &[&FineHistogram], qs: &[f64]) -> Vec<u64> {
    let mut merged = vec![0u64; FINE_BUCKETS];
    for h in hs {
        for (m, c) in merged.iter_mut().zip(h.counts.iter()) {
            *m += c.load(Relaxed);
        }
    }
    let total: u64 = merged.iter().sum();
    qs.iter()
        .map(|q| {
            if total == 0 {
                return 0;
            }
            let rank = ((q * total as f64).ceil() as u64).clamp(1, total);
            let mut acc = 0;
            for (i, c) in merged.iter().enumerate() {
                acc += c;
                if acc >= rank {
                    return fine_upper(i);
                }
            }
            fine_upper(FINE_BUCKETS - 1)
        })
        .collect()
}

/// Seconds each window slot covers, and slots kept: the current slot and the six before it, so the
/// window always holds at least the last minute (60 to 70 s of it; the rate divides by the span held).
pub const SLOT_S: u64 = 10;
pub const SLOTS: usize = 7;
/// The seconds a window started at `start` holds now ([`span_after`]). `/v1/stats` reports it as
/// `window_s`.
pub fn window_span_s(start: std::time::Instant) -> f64 {
    span_after(start.elapsed())
}

/// The seconds a window holds `elapsed` after it started: from the start of its oldest live slot (or
/// from its start, in its first minute) to now.
fn span_after(elapsed: std::time::Duration) -> f64 {
    // The live slots are the current one and the six before it, so the oldest starts SLOTS slots before
    // the current number.
    let oldest = epoch_after(elapsed).saturating_sub(SLOTS as u64);
    (elapsed.as_secs_f64() - (oldest * SLOT_S) as f64).max(1e-3)
}

/// The number of the slot that is current `elapsed` after a window started: from 1, so no live slot's
/// number is 0, the value of a never-used slot.
fn epoch_after(elapsed: std::time::Duration) -> u64 {
    elapsed.as_secs() / SLOT_S + 1
}

/// One slot of the window: stage and total latencies, request and row counts.
#[derive(Debug, Default)]
struct Slot {
    /// Which 10-second period this slot holds (seconds since start / SLOT_S).
    epoch: AtomicU64,
    stages: [FineHistogram; 8],
    requests: AtomicU64,
}

/// Stage latencies over the last minute, in rotating 10-second slots.
#[derive(Debug)]
pub struct Window {
    start: std::time::Instant,
    slots: [Slot; SLOTS],
}

impl Default for Window {
    fn default() -> Self {
        Self {
            start: std::time::Instant::now(),
            slots: Default::default(),
        }
    }
}

impl Window {
    fn epoch(&self) -> u64 {
        epoch_after(self.start.elapsed())
    }

    fn slot(&self) -> &Slot {
        let e = self.epoch();
        let slot = &self.slots[(e as usize) % SLOTS];
        let seen = slot.epoch.load(Relaxed);
        if seen != e
            && slot
                .epoch
                .compare_exchange(seen, e, Relaxed, Relaxed)
                .is_ok()
        {
            // This thread won the rotation: clear what the slot held a minute ago. Records racing with the
            // clear may be lost; the window is a recent estimate, the Prometheus histograms are exact.
            for h in &slot.stages {
                h.clear();
            }
            slot.requests.store(0, Relaxed);
        }
        slot
    }

    pub fn record(&self, t: &Timings, stages: &[Stage]) {
        let slot = self.slot();
        for &stage in stages {
            slot.stages[stage as usize].observe(t.get(stage));
        }
        slot.stages[7].observe(t.total_us);
        slot.requests.fetch_add(1, Relaxed);
    }

    fn live(&self) -> impl Iterator<Item = &Slot> {
        let now = self.epoch();
        self.slots.iter().filter(move |s| {
            let e = s.epoch.load(Relaxed);
            e != 0 && e + SLOTS as u64 > now
        })
    }

    /// p50, p95, p99 (µs) of each stage and (last) of the total, over the window.
    pub fn stage_percentiles(&self) -> [[u64; 3]; 8] {
        let mut out = [[0; 3]; 8];
        for (i, o) in out.iter_mut().enumerate() {
            let hs: Vec<&FineHistogram> = self.live().map(|s| &s.stages[i]).collect();
            let p = percentiles(&hs, &[0.5, 0.95, 0.99]);
            *o = [p[0], p[1], p[2]];
        }
        out
    }

    /// Requests in the window, and the seconds it spans: from the start of its oldest live slot (or of
    /// the process) to now.
    pub fn requests(&self) -> (u64, f64) {
        let n = self.live().map(|s| s.requests.load(Relaxed)).sum();
        (n, window_span_s(self.start))
    }
}

/// Request counters and stage histograms of one model.
#[derive(Debug, Default)]
pub struct ModelStats {
    pub requests: AtomicU64,
    /// Requests that failed on hydrant's side (5xx: shed, store, internal).
    pub errors: AtomicU64,
    /// Requests refused for what the caller sent (4xx): the model's own health is not in question.
    pub rejected: AtomicU64,
    pub rows: AtomicU64,
    pub stages: [Histogram; 7],
    pub total: Histogram,
    /// Rows per batch the queue formed (its own requests' and others'), as first run; the runs that take
    /// a failed batch apart are counted in `batch_reruns`.
    pub batch_rows: CountHistogram,
    /// Runs made to give each request of a failed batch its own outcome (`Worker::run_apart`).
    pub batch_reruns: AtomicU64,
    /// Requests refused because the queue was full.
    pub shed_queue_full: AtomicU64,
    /// Requests that waited longer than `inference.queue_timeout` and were not run.
    pub shed_queue_timeout: AtomicU64,
    /// Requests whose own deadline passed in the queue and were not run.
    pub shed_deadline: AtomicU64,
    /// Recent stage latencies, for percentiles over the last minute.
    pub window: Window,
}

/// Upper bounds of the batch-size histogram buckets.
pub const ROW_BUCKETS: [u64; 17] = [
    1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536,
];

/// A Prometheus-style histogram of counts (rows per batch), lock-free.
#[derive(Debug, Default)]
pub struct CountHistogram {
    counts: [AtomicU64; ROW_BUCKETS.len() + 1],
    sum: AtomicU64,
}

impl CountHistogram {
    pub fn observe(&self, n: u64) {
        let i = ROW_BUCKETS
            .iter()
            .position(|b| n <= *b)
            .unwrap_or(ROW_BUCKETS.len());
        self.counts[i].fetch_add(1, Relaxed);
        self.sum.fetch_add(n, Relaxed);
    }

    /// Cumulative counts per bucket (the last is +Inf), and the sum.
    pub fn snapshot(&self) -> ([u64; ROW_BUCKETS.len() + 1], u64) {
        let mut out = [0; ROW_BUCKETS.len() + 1];
        let mut acc = 0;
        for (i, c) in self.counts.iter().enumerate() {
            acc += c.load(Relaxed);
            out[i] = acc;
        }
        (out, self.sum.load(Relaxed))
    }
}

impl ModelStats {
    /// Counts a request that failed with `status`: a rejection (4xx) or an error (5xx).
    pub fn failed(&self, status: axum::http::StatusCode) {
        // 501 answers a transfer coding the caller chose and the gateway does not take: the caller's
        // to change, like a 4xx, not a fault of the gateway.
        if status.is_client_error() || status == axum::http::StatusCode::NOT_IMPLEMENTED {
            self.rejected.fetch_add(1, Relaxed);
        } else {
            self.errors.fetch_add(1, Relaxed);
        }
    }

    /// A predict: every stage.
    pub fn record(&self, t: &Timings, rows: usize) {
        self.record_stages(t, rows, &Stage::ALL);
    }

    /// A request that has only some of the stages (V2 infer: [`Stage::RAW`]): the others are not
    /// observed as 0, which would pull their percentiles down.
    pub fn record_stages(&self, t: &Timings, rows: usize, stages: &[Stage]) {
        self.window.record(t, stages);
        self.requests.fetch_add(1, Relaxed);
        self.rows.fetch_add(rows as u64, Relaxed);
        for &stage in stages {
            self.stages[stage as usize].observe_us(t.get(stage));
        }
        self.total.observe_us(t.total_us);
    }
}

/// (route, model, status) of `hydrant_request_duration_seconds`.
pub type RequestKey = (&'static str, String, u16);
/// How a store call ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreOutcome {
    Ok,
    Error,
    Timeout,
}

/// Store calls counted by how they ended.
#[derive(Debug, Default)]
pub struct Outcomes {
    pub ok: AtomicU64,
    pub error: AtomicU64,
    pub timeout: AtomicU64,
}

impl Outcomes {
    pub fn add(&self, outcome: StoreOutcome) {
        match outcome {
            StoreOutcome::Ok => &self.ok,
            StoreOutcome::Error => &self.error,
            StoreOutcome::Timeout => &self.timeout,
        }
        .fetch_add(1, Relaxed);
    }

    pub fn total(&self) -> u64 {
        self.ok.load(Relaxed) + self.error.load(Relaxed) + self.timeout.load(Relaxed)
    }
}

/// Round trips of one kind (reads or writes) to one store backend.
#[derive(Debug, Default)]
pub struct RoundTrips {
    pub outcomes: Outcomes,
    /// Keys the round trips carried.
    pub keys: AtomicU64,
    pub duration: Histogram,
}

impl RoundTrips {
    /// Records one round trip of `keys` keys that took `us` (timeouts are recorded at the timeout).
    pub fn record(&self, outcome: StoreOutcome, keys: usize, us: u64) {
        self.outcomes.add(outcome);
        self.keys.fetch_add(keys as u64, Relaxed);
        self.duration.observe_us(us);
    }
}

/// Round trips to one store backend (`embedded`, `redis`), reads and writes apart:
/// `hydrant_store_round_trips_total{backend,op,outcome}` and `hydrant_store_duration_seconds{backend,op}`.
/// One read round trip carries all the misses of a request (or a refresh, prefetch or warm-start batch).
#[derive(Debug, Default)]
pub struct StoreStats {
    pub reads: RoundTrips,
    pub writes: RoundTrips,
}

/// Prefetching (`POST /v1/prefetch`), warm start and hot-key sampling: `hydrant_prefetch_total{outcome}`,
/// counted in keys (one key = one entity of one view).
#[derive(Debug, Default)]
pub struct PrefetchStats {
    /// Keys accepted by `POST /v1/prefetch` (202).
    pub accepted: AtomicU64,
    /// Keys in prefetch requests refused with 429 because `prefetch.max_concurrent` batches were running.
    pub rejected: AtomicU64,
    /// Keys read from the store into the cache (found or not found).
    pub fetched: AtomicU64,
    /// Keys skipped because the cache already held them fresh.
    pub cached: AtomicU64,
    /// Keys whose fetch failed or timed out (the cache is left as it was).
    pub failed: AtomicU64,
    /// Keys prefetched by the warm start (also counted in `fetched`/`failed`).
    pub warm_keys: AtomicU64,
    /// Warm starts cut short by `prefetch.warm_timeout` or a store failure (the replica turned ready anyway).
    pub warm_incomplete: AtomicU64,
    /// Lookups sampled into the hot-key sets, and flushes of those samples that failed.
    pub hot_samples: AtomicU64,
    pub hot_flush_errors: AtomicU64,
}

/// Cache invalidation between replicas: `hydrant_invalidations_total{kind}`.
#[derive(Debug, Default)]
pub struct InvalidationStats {
    /// Keys this replica announced as changed (writes through `POST /v1/views/{view}/rows`). The
    /// metrics add the store's [`background_announcements`](crate::store::Store::background_announcements):
    /// those of writes that failed but may have landed.
    pub published_keys: AtomicU64,
    /// Announcements that failed (the keys are then fresh everywhere only after the view's `cache.ttl`).
    pub publish_errors: AtomicU64,
    /// Keys dropped from this replica's cache on an announcement heard on the channel: another
    /// replica's, the loader's, or this replica's own (which it hears too; its cache dropped them already).
    pub received_keys: AtomicU64,
    /// Whole-cache flushes: the invalidation subscription (re)connected, so messages may have been missed.
    pub flushes: AtomicU64,
}

/// Reloads of the schemas folder (`registry.reload_interval`): `hydrant_schema_reloads_total{outcome}`.
#[derive(Debug, Default)]
pub struct ReloadStats {
    /// Changes found in the folder and swapped in.
    pub applied: AtomicU64,
    /// Changes found in the folder and refused (the running schemas stay).
    pub refused: AtomicU64,
}

/// The telemetry's maps: looked up several times per request, by names from the registry and the routes
/// (never inserted into from what a caller sends), so a fast hasher rather than SipHash, whose keying
/// was ~1,000 instructions of every hot-path request.
type Map<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// Request histograms of one (route, status), by model name.
type ByModel = Map<String, Arc<Histogram>>;

/// All counters of one gateway.
#[derive(Debug, Default)]
pub struct Telemetry {
    views: RwLock<Map<String, Arc<ViewStats>>>,
    models: RwLock<Map<String, Arc<ModelStats>>>,
    /// `hydrant_request_duration_seconds` by (route, model, status).
    /// By (route, status), then model: the lookup borrows the model name, so recording allocates nothing.
    requests: RwLock<Map<(&'static str, u16), ByModel>>,
    started: OnceStart,
    stores: RwLock<Map<&'static str, Arc<StoreStats>>>,
    pub prefetch: PrefetchStats,
    pub invalidation: InvalidationStats,
    pub reloads: ReloadStats,
    /// Changes of the token files (`auth.reload_interval`): `hydrant_auth_reloads_total{outcome}`.
    pub auth_reloads: ReloadStats,
}

/// When the telemetry (so the gateway) started.
#[derive(Debug)]
pub struct OnceStart(pub std::time::Instant);

impl Default for OnceStart {
    fn default() -> Self {
        Self(std::time::Instant::now())
    }
}

impl Telemetry {
    /// The counters of `view`, created on first use. Hot paths keep the returned `Arc`.
    pub fn view(&self, view: &str) -> Arc<ViewStats> {
        if let Some(v) = self.views.read().get(view) {
            return v.clone();
        }
        self.views
            .write()
            .entry(view.to_owned())
            .or_default()
            .clone()
    }

    /// Gives each of `views` its counters now, so `/v1/stats` and `/metrics` list a registered view
    /// (with zeros) before its first lookup, and notes how long its policy keeps cache entries now
    /// ([`crate::cache::note_policy`]).
    pub fn know_views<'a>(&self, views: impl IntoIterator<Item = &'a Arc<crate::schema::View>>) {
        let mut known = self.views.write();
        for v in views {
            let stats = known.entry(v.name.clone()).or_default();
            crate::cache::note_policy(stats, v);
        }
    }

    /// Forgets the counters of the views `registered` says no to (deleted ones), and retires them, so the
    /// cache's upkeep removes the entries they account for: a view registered again under the name starts
    /// from zeros.
    pub fn retain_views(&self, registered: impl Fn(&str) -> bool) {
        self.views.write().retain(|name, stats| {
            let keep = registered(name);
            if !keep {
                stats.retired.store(true, Relaxed);
            }
            keep
        });
    }

    /// Forgets the counters of the models `running` says no to (refused or deleted ones).
    pub fn retain_models(&self, running: impl Fn(&str) -> bool) {
        self.models.write().retain(|name, _| running(name));
    }

    pub fn model(&self, model: &str) -> Arc<ModelStats> {
        if let Some(m) = self.models.read().get(model) {
            return m.clone();
        }
        self.models
            .write()
            .entry(model.to_owned())
            .or_default()
            .clone()
    }

    /// The request-duration histogram of one route, model and status.
    pub fn request(&self, route: &'static str, model: &str, status: u16) -> Arc<Histogram> {
        if let Some(h) = self
            .requests
            .read()
            .get(&(route, status))
            .and_then(|m| m.get(model))
        {
            return h.clone();
        }
        self.requests
            .write()
            .entry((route, status))
            .or_default()
            .entry(model.to_owned())
            .or_default()
            .clone()
    }

    pub fn requests(&self) -> Vec<(RequestKey, Arc<Histogram>)> {
        let mut v: Vec<_> = self
            .requests
            .read()
            .iter()
            .flat_map(|((route, status), by_model)| {
                by_model
                    .iter()
                    .map(|(model, h)| ((*route, model.clone(), *status), h.clone()))
            })
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    pub fn uptime_s(&self) -> f64 {
        self.started.0.elapsed().as_secs_f64()
    }

    /// The seconds a window started with the process would hold now ([`window_span_s`]).
    pub fn window_s(&self) -> f64 {
        window_span_s(self.started.0)
    }

    /// The round-trip counters of a store backend, created on first use.
    pub fn store(&self, backend: &'static str) -> Arc<StoreStats> {
        if let Some(s) = self.stores.read().get(backend) {
            return s.clone();
        }
        self.stores.write().entry(backend).or_default().clone()
    }

    pub fn stores(&self) -> Vec<(&'static str, Arc<StoreStats>)> {
        let mut v: Vec<_> = self
            .stores
            .read()
            .iter()
            .map(|(k, v)| (*k, v.clone()))
            .collect();
        v.sort_by(|a, b| a.0.cmp(b.0));
        v
    }

    pub fn views(&self) -> Vec<(String, Arc<ViewStats>)> {
        let mut v: Vec<_> = self
            .views
            .read()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    pub fn models(&self) -> Vec<(String, Arc<ModelStats>)> {
        let mut v: Vec<_> = self
            .models
            .read()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }
}

/// Lets one log line through per `every` for each reason (the failure's text), and counts the ones it
/// holds back: for failures that repeat at the rate of a timer or a retry loop, which a line each would
/// flood the log with. A new reason is let through at once (a Redis that refused connections while it
/// restarted and now refuses the password says so), up to [`Throttle::REASONS`] lines per period.
pub struct Throttle {
    every: std::time::Duration,
    state: parking_lot::Mutex<Reasons>,
}

struct Reasons {
    /// Per recent reason: when a line last went through for it, and how many were held back since.
    recent: Vec<(String, Instant, u64)>,
    /// Lines held back and not yet reported that no remembered reason counts: of reasons past the bound,
    /// and of reasons forgotten to make room.
    untracked: u64,
}

impl Throttle {
    /// Reasons remembered at once. A further reason takes the place of one whose period is over, and is
    /// held back while there is none.
    pub const REASONS: usize = 8;

    pub const fn new(every: std::time::Duration) -> Self {
        Self {
            every,
            state: parking_lot::Mutex::new(Reasons {
                recent: Vec::new(),
                untracked: 0,
            }),
        }
    }

    /// `Some(n)` when a line for `reason` may go out now, `n` being the lines held back and not yet
    /// reported: this reason's since its last line, and those no remembered reason counts (see
    /// [`Reasons::untracked`]); `None` when this one is held back (and counted).
    pub fn admit_reason(&self, reason: &str) -> Option<u64> {
        let now = Instant::now();
        let mut state = self.state.lock();
        let Reasons { recent, untracked } = &mut *state;
        if let Some(seen) = recent.iter_mut().find(|(r, _, _)| r == reason) {
            if now.duration_since(seen.1) < self.every {
                seen.2 += 1;
                return None;
            }
            seen.1 = now;
            return Some(std::mem::take(&mut seen.2) + std::mem::take(untracked));
        }
        if recent.len() < Self::REASONS {
            recent.push((reason.to_owned(), now, 0));
            return Some(std::mem::take(untracked));
        }
        let over = recent
            .iter_mut()
            .filter(|(_, at, _)| now.duration_since(*at) >= self.every)
            .min_by_key(|(_, at, _)| *at);
        let Some(over) = over else {
            *untracked += 1;
            return None;
        };
        *untracked += over.2;
        *over = (reason.to_owned(), now, 0);
        Some(std::mem::take(untracked))
    }
}

/// Installs the global `tracing` subscriber (once; later calls are ignored, as in tests).
pub fn init_logging(cfg: &TelemetryConfig) {
    let filter = tracing_subscriber::EnvFilter::try_new(&cfg.log_level)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colours only on a terminal: in a file (`serve > log`, `make loadtest`'s hydrant.log) the escape
    // codes would split `id="..."` and defeat grep.
    let terminal = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(terminal)
        .with_writer(std::io::stderr);
    let _ = match cfg.log_format {
        LogFormat::Json => builder
            .json()
            .event_format(Tagged {
                inner: tracing_subscriber::fmt::format().json(),
                json: true,
            })
            .try_init(),
        // The line format's own colour setting: a tagged line is formatted into a buffer (see
        // `Tagged`), whose writer would otherwise say "no colours".
        LogFormat::Text => builder
            .event_format(Tagged {
                inner: tracing_subscriber::fmt::format().with_ansi(terminal),
                json: false,
            })
            .try_init(),
    };
}

/// The longest request id a line is tagged with: the middleware takes a caller's id of at most this
/// many visible ASCII bytes and generates a shorter one otherwise.
pub const MAX_REQUEST_ID: usize = 128;

struct RequestIdSlot {
    len: usize,
    bytes: [u8; MAX_REQUEST_ID],
}

thread_local! {
    /// The id of the request being polled on this thread while its span is off (see [`tag_request`]).
    static REQUEST_ID: std::cell::RefCell<RequestIdSlot> = const {
        std::cell::RefCell::new(RequestIdSlot { len: 0, bytes: [0; MAX_REQUEST_ID] })
    };
}

/// Names the request whose future this thread polls until the guard is dropped, so that a line logged
/// meanwhile carries `request_id`. For `log_level = "warn"` and quieter, where the request's span (which
/// shows the id at `info`) is off: a span costs about 6,600 instructions per request, this a copy of the
/// id per poll. Tags do not nest: the guard clears the tag (a request's future never polls another's).
pub fn tag_request(id: &[u8]) -> RequestTag {
    let _ = REQUEST_ID.try_with(|slot| {
        if let Ok(mut slot) = slot.try_borrow_mut() {
            let n = id.len().min(MAX_REQUEST_ID);
            slot.bytes[..n].copy_from_slice(&id[..n]);
            slot.len = n;
        }
    });
    RequestTag(())
}

/// Ends a [`tag_request`] when dropped.
pub struct RequestTag(());

impl Drop for RequestTag {
    fn drop(&mut self) {
        let _ = REQUEST_ID.try_with(|slot| {
            if let Ok(mut slot) = slot.try_borrow_mut() {
                slot.len = 0;
            }
        });
    }
}

/// A request id as the thread-local holds it: the bytes and how many of them are the id.
type Tag = ([u8; MAX_REQUEST_ID], usize);

/// The tag [`tag_request`] set on this thread, if any.
fn current_tag() -> Option<Tag> {
    REQUEST_ID
        .try_with(|slot| {
            let slot = slot.try_borrow().ok()?;
            (slot.len > 0).then(|| (slot.bytes, slot.len))
        })
        .ok()
        .flatten()
}

/// `future`, for a task a request spawns (a store fetch, a row write), in the request's span and tagged
/// with its id as the request is now ([`tag_request`]), so that what the task logs names the request
/// as the request's own lines do, at any log level.
pub fn in_request<F: std::future::Future>(
    future: F,
) -> CarriedTag<tracing::instrument::Instrumented<F>> {
    CarriedTag {
        future: tracing::Instrument::instrument(future, tracing::Span::current()),
        id: current_tag(),
    }
}

pin_project_lite::pin_project! {
    /// A future that is tagged with a request id while it is polled ([`in_request`]).
    pub struct CarriedTag<F> {
        #[pin]
        future: F,
        id: Option<Tag>,
    }
}

impl<F: std::future::Future> std::future::Future for CarriedTag<F> {
    type Output = F::Output;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<F::Output> {
        let this = self.project();
        let _tag = this
            .id
            .as_ref()
            .and_then(|(bytes, len)| bytes.get(..*len))
            .map(tag_request);
        this.future.poll(cx)
    }
}

/// A line format that adds `request_id` to a line logged while a request is tagged ([`tag_request`]):
/// ` request_id=...` at the end of a text line, a `"request_id"` member in a JSON one.
struct Tagged<F> {
    inner: F,
    json: bool,
}

impl<S, N, F> tracing_subscriber::fmt::FormatEvent<S, N> for Tagged<F>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'a> tracing_subscriber::fmt::FormatFields<'a> + 'static,
    F: tracing_subscriber::fmt::FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut writer: tracing_subscriber::fmt::format::Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        let tag = current_tag();
        let Some(id) = tag
            .as_ref()
            .and_then(|(bytes, len)| std::str::from_utf8(bytes.get(..*len)?).ok())
        else {
            return self.inner.format_event(ctx, writer, event);
        };
        // Formatted aside (colours, on a terminal, come from the format's own setting), then written
        // with the id.
        let mut line = String::new();
        self.inner.format_event(
            ctx,
            tracing_subscriber::fmt::format::Writer::new(&mut line),
            event,
        )?;
        let line = line.strip_suffix('\n').unwrap_or(&line);
        match line.strip_suffix('}') {
            Some(object) if self.json => {
                let id = serde_json::to_string(&id).map_err(|_| std::fmt::Error)?;
                writeln!(writer, "{object},\"request_id\":{id}}}")
            }
            _ => writeln!(writer, "{line} request_id={id}"),
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_throttle_lets_one_line_through_per_period_and_counts_the_rest() {
        let t = super::Throttle::new(std::time::Duration::from_millis(200));
        assert_eq!(t.admit_reason(""), Some(0));
        assert_eq!((t.admit_reason(""), t.admit_reason("")), (None, None));
        std::thread::sleep(std::time::Duration::from_millis(250));
        assert_eq!(t.admit_reason(""), Some(2));
        assert_eq!(t.admit_reason(""), None);
    }

    #[test]
    fn a_new_reason_gets_its_line_at_once_up_to_a_bound_per_period() {
        let t = super::Throttle::new(std::time::Duration::from_millis(300));
        assert_eq!(t.admit_reason("connection refused"), Some(0));
        assert_eq!(t.admit_reason("connection refused"), None);
        assert_eq!(t.admit_reason("NOAUTH"), Some(0));
        assert_eq!(t.admit_reason("NOAUTH"), None);
        assert_eq!(t.admit_reason("connection refused"), None);
        // A reason past the bound is held back while no remembered reason's period is over, and
        // counted apart (untracked).
        for i in 2..super::Throttle::REASONS {
            assert_eq!(t.admit_reason(&format!("reason {i}")), Some(0));
        }
        assert_eq!(t.admit_reason("one too many"), None);
        assert_eq!(t.admit_reason("connection refused"), None);
        std::thread::sleep(std::time::Duration::from_millis(350));
        // A remembered reason's line reports its own held-back lines and the untracked one.
        assert_eq!(t.admit_reason("NOAUTH"), Some(2));
        // A new one takes the place of a reason whose period is over (the oldest such), whose three
        // held-back lines it reports, as they would go unreported otherwise.
        assert_eq!(t.admit_reason("one too many"), Some(3));
        assert_eq!(t.admit_reason("connection refused"), Some(0));
        assert_eq!(t.admit_reason("one too many"), None);
    }

    use super::*;

    #[test]
    fn server_timing_lists_every_stage_in_milliseconds() {
        let mut t = Timings::default();
        t.set(Stage::Hydrate, 41);
        t.set(Stage::Infer, 1500);
        t.total_us = 1600;
        let h = String::from_utf8_lossy(&t.server_timing()).into_owned();
        assert_eq!(
            h,
            "decode;dur=0.000, hydrate;dur=0.041, assemble;dur=0.000, queue;dur=0.000, \
             infer;dur=1.500, postprocess;dur=0.000, encode;dur=0.000, total;dur=1.600"
        );
        assert!(
            h.starts_with("decode;dur=0.000, hydrate;dur=0.041, "),
            "{h}"
        );
        assert!(
            h.contains("infer;dur=1.500") && h.ends_with("total;dur=1.600"),
            "{h}"
        );
        // Of some stages: those, in order, then the total; of all of them, the same header.
        let raw = String::from_utf8_lossy(&t.server_timing_of(&Stage::RAW)).into_owned();
        assert_eq!(
            raw,
            "decode;dur=0.000, queue;dur=0.000, infer;dur=1.500, encode;dur=0.000, total;dur=1.600"
        );
        assert_eq!(t.server_timing_of(&Stage::ALL), t.server_timing());
    }

    /// The rate divides by the span the live slots hold: 91 s after start they are the ones from 30 s
    /// on, 61 s, not the 60 s of a nominal minute (nor the 51 s six slots held).
    #[test]
    fn the_window_rate_divides_by_the_span_it_holds() {
        let Some(start) = std::time::Instant::now().checked_sub(std::time::Duration::from_secs(91))
        else {
            return; // a clock too close to its origin to go back 91 s
        };
        let w = Window {
            start,
            slots: Default::default(),
        };
        let t = Timings::default();
        for _ in 0..61 {
            w.record(&t, &Stage::ALL);
        }
        let (n, span) = w.requests();
        assert_eq!(n, 61);
        assert!((61.0..62.0).contains(&span), "{span}");
    }

    /// In its first minute a window holds the time since it started; after that, 60 to 70 s.
    #[test]
    fn a_window_spans_its_age_then_60_to_70_seconds() {
        for (age_ms, want) in [
            (0, 0.001),
            (30_500, 30.5),
            (65_000, 65.0),
            (70_000, 60.0),
            (75_250, 65.25),
            (129_999, 69.999),
        ] {
            let span = span_after(std::time::Duration::from_millis(age_ms));
            assert!((span - want).abs() < 1e-9, "{age_ms} ms: {span}");
        }
    }

    /// V2 infer has no hydrate, assemble or postprocess: they are not observed (as 0) for it.
    #[test]
    fn requests_without_some_stages_leave_those_histograms_alone() {
        let m = ModelStats::default();
        let mut t = Timings::default();
        t.set(Stage::Infer, 40);
        // A hydrate time a request without that stage must not leave in its histograms.
        t.set(Stage::Hydrate, 5_000);
        m.record_stages(&t, 1, &Stage::RAW);
        let count = |s: Stage| m.stages[s as usize].snapshot().0[20];
        assert_eq!((count(Stage::Infer), count(Stage::Hydrate)), (1, 0));
        let window = |s: Stage| m.window.stage_percentiles()[s as usize][0];
        assert_eq!(window(Stage::Hydrate), 0, "nothing observed in the window");
        assert!(window(Stage::Infer) >= 40, "{}", window(Stage::Infer));
        m.record(&t, 1);
        assert_eq!((count(Stage::Infer), count(Stage::Hydrate)), (2, 1));
        let hydrate = window(Stage::Hydrate);
        assert!((5_000..5_200).contains(&hydrate), "{hydrate}");
    }

    #[test]
    fn server_timing_numbers_match_the_formatter() {
        for us in [0u64, 7, 10, 99, 999, 1000, 1001, 123_456_789, u64::MAX] {
            let mut s = Vec::new();
            push_ms(&mut s, us);
            assert_eq!(
                String::from_utf8_lossy(&s),
                format!("{}.{:03}", us / 1000, us % 1000)
            );
        }
    }

    #[test]
    fn fine_histogram_percentiles_are_within_a_few_percent() {
        let h = FineHistogram::default();
        for us in 1..=10_000u64 {
            h.observe(us);
        }
        let p = percentiles(&[&h], &[0.5, 0.99, 1.0]);
        for (got, want) in p.iter().zip([5_000u64, 9_900, 10_000]) {
            let err = (*got as f64 - want as f64).abs() / want as f64;
            assert!(err < 0.04, "got {got}, want about {want}");
        }
        for us in [0, 1, 63, 64, 65, 1000, 123_456, 10_000_000] {
            assert!(
                fine_upper(fine_index(us)) >= us,
                "{us} falls in a bucket whose upper bound is below it"
            );
        }
    }

    #[test]
    fn histogram_counts_are_cumulative() {
        let h = Histogram::default();
        h.observe_us(3);
        h.observe_us(70);
        h.observe_us(20_000_000);
        let (c, sum) = h.snapshot();
        assert_eq!(c[0], 1); // <= 5 µs
        assert_eq!(c[4], 2); // <= 100 µs
        assert_eq!(c[19], 2); // <= 10 s
        assert_eq!(c[20], 3); // +Inf
        assert!((sum - 20.000_073).abs() < 1e-9);
    }
}
