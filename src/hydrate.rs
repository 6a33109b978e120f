//! Stage `hydrate`: resolves the entity features a request needs, from the cache or the store.
//!
//! Per key: a fresh cache entry is served (hit); one past `refresh_after` is served and refreshed in the
//! background (stale); anything else is a miss. All misses of one request, across views and candidates, go
//! to the store in one batched round trip. Concurrent misses of the same key share one fetch
//! (single-flight): the first request to miss a key leads, later ones wait for its result.
//!
//! Fetches run in spawned tasks, not in the request's future, so a request that is cancelled (client gone,
//! deadline) never leaves followers waiting on a fetch nobody finishes. When the store fails or misses its
//! deadline, an expired entry still within `max_staleness` is served as `STALE`, else the defaults as
//! `DEFAULTED`; the answer is flagged `degraded` and never fails.
//!
//! Invalidation (a write through any replica) drops the key from the cache *and* from the in-flight map:
//! a fetch that was already reading the key may carry the value from before the write, so its result is
//! still handed to the requests waiting on it but is not cached. Both happen under the in-flight lock, so
//! no interleaving of a fetch's completion and an invalidation can leave the old value cached.
//!
//! Also here: [`Hydrator::prefetch`], the same single-flight fetch for keys nobody waits on yet (the
//! prefetch API and the warm start), and the hot-key sampling of lookups ([`crate::prefetch::HotKeys`]).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::Serialize;
use tokio::sync::watch;

use crate::cache::{Entry, FeatureCache, Found, Lookup};
use crate::packed::Packed;
use crate::prefetch::HotKeys;
use crate::schema::View;
use crate::store::{Invalidation, Store, StoreError, write_key};
use crate::telemetry::{StoreOutcome, StoreStats, Telemetry, ViewStats, us_since};
use crate::value::Record;

/// How an entity's features were served (DESIGN.md's feature statuses, per entity).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Status {
    Present,
    NotFound,
    OutsideMaxAge,
    /// Served from cache past its ttl because the store failed (within `max_staleness`).
    Stale,
    /// The store failed (or held an unreadable record) and no usable cached value existed: defaults served.
    Defaulted,
}

impl crate::encode::WriteJson for Status {
    fn write_json(&self, buf: &mut Vec<u8>) {
        buf.extend_from_slice(match self {
            Status::Present => b"\"PRESENT\"",
            Status::NotFound => b"\"NOT_FOUND\"",
            Status::OutsideMaxAge => b"\"OUTSIDE_MAX_AGE\"",
            Status::Stale => b"\"STALE\"",
            Status::Defaulted => b"\"DEFAULTED\"",
        });
    }
}

/// One entity's resolution.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// The values to serve; `None` means every feature takes its default.
    pub entry: Option<Arc<Entry>>,
    pub status: Status,
}

impl Resolved {
    pub fn found(&self) -> Option<&Found> {
        match self.status {
            Status::Present | Status::Stale => self.entry.as_ref().and_then(|e| e.found.as_ref()),
            _ => None,
        }
    }
}

/// Cache outcomes of one request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct CacheOutcome {
    pub hits: u32,
    pub stale: u32,
    pub misses: u32,
}

/// The result of hydrating one request: per requested view, one resolution per key.
#[derive(Debug, Default)]
pub struct Hydrated {
    pub views: Vec<Vec<Resolved>>,
    pub cache: CacheOutcome,
    pub degraded: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fail {
    Timeout,
    Error,
}

/// What a fetch produced for one key: the entry to cache and serve, or a failure.
type Outcome = Result<Arc<Entry>, Fail>;

/// Why a fetch runs: a request's misses and refreshes (of values it still serves), or warming the cache
/// (off any request's path, so it may take until the prefetch's own deadline).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Purpose {
    Request,
    Prefetch { until: Instant },
}

/// A fetch in flight for one key: its id (so a completing fetch knows whether an invalidation superseded
/// it) and the channel its result is published on.
struct Flight {
    id: u64,
    /// [`View::shape`] of the view it decodes for: a lookup for another shape (a registered change
    /// arrived meanwhile) leads a fetch of its own rather than take records decoded for the old one.
    shape: u64,
    rx: watch::Receiver<Option<Outcome>>,
}

/// What a prefetch did, in keys.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Prefetched {
    /// Read from the store (found or not).
    pub fetched: u32,
    /// Already fresh in the cache: not read.
    pub cached: u32,
    /// The store failed or timed out.
    pub failed: u32,
}

/// Resolves features for requests; shared by all requests of a gateway.
pub struct Hydrator {
    store: Arc<dyn Store>,
    store_stats: Arc<StoreStats>,
    cache: FeatureCache,
    prefix: String,
    telemetry: Arc<Telemetry>,
    hot: HotKeys,
    /// Keys being fetched now. The lock is held only to look up, insert or remove, and (on completion) to
    /// fill the cache, never across an await; it orders completions against invalidations.
    inflight: Mutex<HashMap<Box<str>, Flight>>,
    next_flight: AtomicU64,
    /// Keys whose unreadable record was already logged (bounded), so a bad hot key logs once.
    logged_bad: Mutex<HashSet<Box<str>>>,
    /// Failed store reads are logged at most once a second (with how many were not): a store that is
    /// down fails every read, and a line each would flood the log at the request rate.
    read_warned_ms: AtomicU64,
    reads_unlogged: AtomicU64,
}

/// `read_warned_ms` before the first failed read is logged: the cache's clock starts at 0, so a 0 here
/// would hold back a failure in the process's first second, and with no later one, for good.
const NEVER_WARNED: u64 = u64::MAX;

/// Whether a failed read at `now_ms` is logged, the last line having gone out at `last`.
fn read_warning_due(last: u64, now_ms: u64) -> bool {
    last == NEVER_WARNED || now_ms.saturating_sub(last) >= 1_000
}

/// A key the request waits for.
struct Pending {
    view: usize,
    row: usize,
    /// The expired entry, served if the fetch fails.
    old: Option<Arc<Entry>>,
    rx: watch::Receiver<Option<Outcome>>,
    /// The view's counters, for a degraded answer.
    stats: Arc<ViewStats>,
}

/// One key a fetch task reads.
struct FetchItem {
    key: String,
    view: Arc<View>,
    id: u64,
    tx: watch::Sender<Option<Outcome>>,
    /// A refresh of a value still being served (counted in `hydrant_refresh_total`), not a miss.
    refresh: bool,
    /// The view's counters, looked up once per request or prefetch, not once per fetched key.
    stats: Arc<ViewStats>,
}

impl Hydrator {
    pub fn new(
        store: Arc<dyn Store>,
        cache: FeatureCache,
        prefix: String,
        telemetry: Arc<Telemetry>,
        hot: HotKeys,
    ) -> Arc<Self> {
        Arc::new(Self {
            store_stats: telemetry.store(store.backend()),
            store,
            cache,
            prefix,
            telemetry,
            hot,
            inflight: Mutex::new(HashMap::new()),
            next_flight: AtomicU64::new(0),
            logged_bad: Mutex::new(HashSet::new()),
            read_warned_ms: AtomicU64::new(NEVER_WARNED),
            reads_unlogged: AtomicU64::new(0),
        })
    }

    pub fn hot_keys(&self) -> &HotKeys {
        &self.hot
    }

    /// The store backend's round-trip counters.
    pub fn store_stats(&self) -> &Arc<StoreStats> {
        &self.store_stats
    }

    pub fn telemetry(&self) -> &Arc<Telemetry> {
        &self.telemetry
    }

    /// Drops `keys` (written elsewhere) from the cache; a fetch of one of them already in flight is still
    /// answered but not cached.
    pub fn invalidate(&self, keys: &[String]) {
        let mut inflight = self.inflight.lock();
        for k in keys {
            inflight.remove(k.as_str());
            self.cache.invalidate(k);
        }
    }

    /// Drops everything cached (the invalidation channel was down: writes may have been missed).
    pub fn invalidate_all(&self) {
        let mut inflight = self.inflight.lock();
        inflight.clear();
        self.cache.invalidate_all();
    }

    /// Applies an invalidation received from another replica.
    pub fn apply(&self, inv: Invalidation) {
        let stats = &self.telemetry.invalidation;
        match inv {
            Invalidation::Keys(keys) => {
                stats.received_keys.fetch_add(keys.len() as u64, Relaxed);
                self.invalidate(&keys);
            }
            Invalidation::All => {
                stats.flushes.fetch_add(1, Relaxed);
                self.invalidate_all();
            }
        }
    }

    pub fn cache(&self) -> &FeatureCache {
        &self.cache
    }

    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// Resolves `keys[i]` of `views[i]` for every `i`. Waits for the store at most until `deadline`.
    pub async fn hydrate<K: AsRef<str>>(
        self: &Arc<Self>,
        views: &[(&Arc<View>, &[K])],
        deadline: Instant,
    ) -> Hydrated {
        let mut out = Hydrated {
            views: Vec::with_capacity(views.len()),
            ..Hydrated::default()
        };
        let mut pending: Vec<Pending> = Vec::new();
        let mut to_fetch: Vec<FetchItem> = Vec::new();
        let mut key = String::with_capacity(64);
        let now = self.cache.clock().now_ms();
        let wall = self.cache.clock().wall_ms();
        for (vi, (view, keys)) in views.iter().enumerate() {
            // The view's counters, looked up once per request (a lock and a hash), not once per key.
            let stats = &self.telemetry.view(&view.name);
            let mut rows = Vec::with_capacity(keys.len());
            // Counted here and added to the shared counters once per view: a ranking request's hundred
            // lookups would otherwise bounce their cache lines between the workers a hundred times.
            let (mut hits, mut negative, mut stale, mut misses) = (0u64, 0u64, 0u64, 0u64);
            self.hot.sample(&view.name, keys);
            for (ri, k) in keys.iter().enumerate() {
                write_key(&mut key, &self.prefix, &view.name, k.as_ref());
                let old = match self.cache.lookup(&key, view, now) {
                    Lookup::Fresh(e) => {
                        // `negative` is a key known absent; a cached unreadable record was found, and
                        // is counted in `bad_records` when it is read.
                        if e.found.is_some() || e.unreadable {
                            hits += 1;
                        } else {
                            negative += 1;
                        }
                        out.cache.hits += 1;
                        rows.push(Self::resolve(view, e, wall));
                        continue;
                    }
                    Lookup::RefreshDue(e) => {
                        stale += 1;
                        out.cache.stale += 1;
                        // Joining a fetch already in flight starts nothing; the receiver is not needed.
                        drop(self.join_or_lead(&key, view, stats, true, &mut to_fetch));
                        rows.push(Self::resolve(view, e, wall));
                        continue;
                    }
                    Lookup::Expired(e) => Some(e),
                    Lookup::Absent => None,
                };
                misses += 1;
                out.cache.misses += 1;
                let rx = self.join_or_lead(&key, view, stats, false, &mut to_fetch);
                pending.push(Pending {
                    view: vi,
                    row: ri,
                    old,
                    rx,
                    stats: stats.clone(),
                });
                // Placeholder, replaced once the fetch answers.
                rows.push(Resolved {
                    entry: None,
                    status: Status::Defaulted,
                });
            }
            for (counter, n) in [
                (&stats.hits, hits),
                (&stats.negative, negative),
                (&stats.stale, stale),
                (&stats.misses, misses),
            ] {
                if n > 0 {
                    counter.fetch_add(n, Relaxed);
                }
            }
            out.views.push(rows);
        }
        // A request's misses and refreshes share one round trip.
        if !to_fetch.is_empty() {
            self.spawn_fetch(to_fetch, Purpose::Request);
        }
        // When the waits for the store start: the clock is read at the first, so not on an all-hits
        // request.
        let mut started = None;
        for p in pending {
            let view = views[p.view].0;
            let started = *started.get_or_insert_with(Instant::now);
            // A key joined to another's fetch (a prefetch's, whose bound is longer, or a request's of a
            // view with a longer `store.timeout`) waits no longer than this view's own read would.
            let until = deadline.min(started + view.policy.store_timeout);
            let outcome = wait(p.rx, until).await;
            let resolved = match outcome {
                Ok(entry) => Self::resolve(view, entry, wall),
                Err(fail) => {
                    out.degraded = true;
                    match fail {
                        Fail::Timeout => p.stats.degraded_timeout.fetch_add(1, Relaxed),
                        Fail::Error => p.stats.degraded_error.fetch_add(1, Relaxed),
                    };
                    match p.old {
                        Some(old) if old.found.is_some() => {
                            let mut r = Self::resolve(view, old, wall);
                            if r.status == Status::Present {
                                r.status = Status::Stale;
                            }
                            r
                        }
                        _ => Resolved {
                            entry: None,
                            status: Status::Defaulted,
                        },
                    }
                }
            };
            out.views[p.view][p.row] = resolved;
        }
        out
    }

    /// Applies `max_age` (against `wall_ms`, the wall clock read once per request) and turns a cache entry
    /// into a status.
    fn resolve(view: &View, e: Arc<Entry>, wall_ms: i64) -> Resolved {
        let status = match &e.found {
            None if e.unreadable => Status::Defaulted,
            None => Status::NotFound,
            Some(f) => match view.policy.max_age {
                Some(max)
                    if wall_ms.saturating_sub(f.event_ts_ms)
                        > i64::try_from(max.as_millis()).unwrap_or(i64::MAX) =>
                {
                    Status::OutsideMaxAge
                }
                _ => Status::Present,
            },
        };
        Resolved {
            entry: Some(e),
            status,
        }
    }

    /// Joins the fetch in flight for `key`, or registers this request as its leader.
    fn join_or_lead(
        &self,
        key: &str,
        view: &Arc<View>,
        stats: &Arc<ViewStats>,
        refresh: bool,
        to_fetch: &mut Vec<FetchItem>,
    ) -> watch::Receiver<Option<Outcome>> {
        let mut inflight = self.inflight.lock();
        if let Some(f) = inflight.get(key)
            && f.shape == view.shape()
        {
            return f.rx.clone();
        }
        let (tx, rx) = watch::channel(None);
        let id = self.next_flight.fetch_add(1, Relaxed);
        let shape = view.shape();
        inflight.insert(
            key.into(),
            Flight {
                id,
                shape,
                rx: rx.clone(),
            },
        );
        to_fetch.push(FetchItem {
            key: key.to_owned(),
            view: view.clone(),
            id,
            tx,
            refresh,
            stats: stats.clone(),
        });
        rx
    }

    /// Warms the cache: reads every key of `views` that is not fresh in the cache, in one round trip, and
    /// waits (until `deadline`) for the outcome. Keys already being fetched are joined, not read twice.
    /// Lookups here are not counted as hits or misses: nobody is served.
    pub async fn prefetch<K: AsRef<str>>(
        self: &Arc<Self>,
        views: &[(&Arc<View>, &[K])],
        deadline: Instant,
    ) -> Prefetched {
        let mut out = Prefetched::default();
        let mut to_fetch = Vec::new();
        let mut waits = Vec::new();
        let mut key = String::with_capacity(64);
        let now = self.cache.clock().now_ms();
        for (view, keys) in views {
            let stats = self.telemetry.view(&view.name);
            for k in keys.iter() {
                write_key(&mut key, &self.prefix, &view.name, k.as_ref());
                match self.cache.lookup(&key, view, now) {
                    Lookup::Fresh(_) => out.cached += 1,
                    Lookup::RefreshDue(_) | Lookup::Expired(_) | Lookup::Absent => {
                        waits.push(self.join_or_lead(&key, view, &stats, false, &mut to_fetch));
                    }
                }
            }
        }
        if !to_fetch.is_empty() {
            self.spawn_fetch(to_fetch, Purpose::Prefetch { until: deadline });
        }
        for rx in waits {
            match wait(rx, deadline).await {
                Ok(_) => out.fetched += 1,
                Err(_) => out.failed += 1,
            }
        }
        out
    }

    fn spawn_fetch(self: &Arc<Self>, items: Vec<FetchItem>, purpose: Purpose) {
        let this = self.clone();
        // In the span of the request that started it, so that what the fetch logs (a store that failed,
        // an unreadable record) carries that request's id; where the span is off (`log_level = "warn"`),
        // tagged with the id instead.
        tokio::spawn(crate::telemetry::in_request(async move {
            this.fetch(items, purpose).await
        }));
    }

    /// Reads `items` in one round trip, caches what came back and publishes each key's outcome.
    async fn fetch(&self, items: Vec<FetchItem>, purpose: Purpose) {
        let mut timeout = items
            .iter()
            .map(|i| i.view.policy.store_timeout)
            .max()
            .unwrap_or(Duration::from_millis(50));
        if let Purpose::Prefetch { until } = purpose {
            timeout = timeout.max(until.saturating_duration_since(Instant::now()));
        }
        let keys: Vec<String> = items.iter().map(|i| i.key.clone()).collect();
        let started = Instant::now();
        let result = match tokio::time::timeout(timeout, self.store.get_many(&keys)).await {
            Ok(Ok(values)) if values.len() == keys.len() => Ok(values),
            Ok(Ok(_)) => Err((
                Fail::Error,
                "store returned the wrong number of values".to_owned(),
            )),
            // The store's own read timeout (`store.redis.command_timeout`), often the shorter one.
            Ok(Err(StoreError::Timeout)) => Err((
                Fail::Timeout,
                format!(
                    "no answer within the store's read timeout ({:?} after sending)",
                    started.elapsed()
                ),
            )),
            Err(_) => Err((Fail::Timeout, format!("no answer within {timeout:?}"))),
            Ok(Err(e)) => Err((Fail::Error, e.to_string())),
        };
        let outcome = match &result {
            Ok(_) => StoreOutcome::Ok,
            Err((Fail::Timeout, _)) => StoreOutcome::Timeout,
            Err((Fail::Error, _)) => StoreOutcome::Error,
        };
        self.store_stats
            .reads
            .record(outcome, keys.len(), us_since(started));
        for item in items.iter().filter(|i| i.refresh) {
            item.stats.refresh.add(outcome);
        }
        let now = self.cache.clock().now_ms();
        match result {
            Ok(values) => {
                let wall_ms = self.cache.clock().wall_ms();
                // Every waiting request gets its keys first, and the cache is filled after: inserting a
                // thousand entries into a full cache takes milliseconds, which the keys at the end of the
                // batch would otherwise wait out, past their view's `store.timeout` on a busy machine,
                // and be served as defaults for a store that answered in time. A request arriving in
                // between joins the flight, which holds the outcome already.
                let fetched: Vec<(FetchItem, Arc<Entry>)> = items
                    .into_iter()
                    .zip(values)
                    .map(|(item, bytes)| {
                        let entry = Arc::new(self.decode(&item, bytes.as_deref(), now, wall_ms));
                        let _ = item.tx.send(Some(Ok(entry.clone())));
                        (item, entry)
                    })
                    .collect();
                for (item, entry) in fetched {
                    self.publish(item, Ok(entry));
                }
            }
            Err((fail, why)) => {
                let (now_ms, last) = (
                    u64::try_from(now).unwrap_or(0),
                    self.read_warned_ms.load(Relaxed),
                );
                if read_warning_due(last, now_ms)
                    && self
                        .read_warned_ms
                        .compare_exchange(last, now_ms, Relaxed, Relaxed)
                        .is_ok()
                {
                    let unlogged = self.reads_unlogged.swap(0, Relaxed);
                    tracing::warn!(
                        backend = self.store.backend(),
                        keys = keys.len(),
                        "store read failed: {why}{}",
                        if unlogged > 0 {
                            format!(
                                " ({unlogged} more failed reads since the last line; see hydrant_store_round_trips_total)"
                            )
                        } else {
                            String::new()
                        }
                    );
                } else {
                    self.reads_unlogged.fetch_add(1, Relaxed);
                }
                for item in items {
                    self.publish(item, Err(fail));
                }
            }
        }
    }

    /// Caches a fetched entry (unless an invalidation superseded the fetch) and hands the outcome to the
    /// requests waiting on it.
    fn publish(&self, item: FetchItem, outcome: Outcome) {
        {
            let mut inflight = self.inflight.lock();
            let current = inflight
                .get(item.key.as_str())
                .is_some_and(|f| f.id == item.id);
            if current {
                if let Ok(entry) = &outcome {
                    // Under the lock: an invalidation either comes before (and `current` is false) or
                    // after (and removes this entry).
                    self.cache.insert(item.key.as_str().into(), entry.clone());
                }
                // After the insert: a request arriving now finds the cache filled (or, after a failure,
                // fetches anew).
                inflight.remove(item.key.as_str());
            }
        }
        // Sent already where the fetch answered (`fetch`); the same outcome again wakes nobody new.
        item.tx.send_if_modified(|sent| {
            if sent.is_some() {
                return false;
            }
            *sent = Some(outcome);
            true
        });
    }

    /// Decodes a stored record for `item.view`. Unreadable records (bad MessagePack, another schema version,
    /// the wrong number or type of values) are served as defaults, counted, and logged once per key.
    fn decode(&self, item: &FetchItem, bytes: Option<&[u8]>, now: i64, wall_ms: i64) -> Entry {
        let view = &item.view;
        let stats = item.stats.clone();
        let Some(bytes) = bytes else {
            return Entry::new(now, None, view, item.key.len(), stats);
        };
        match decode_record(view, bytes, wall_ms) {
            Ok(found) => Entry::new(now, Some(found), view, item.key.len(), stats),
            Err(why) => {
                stats.bad_records.fetch_add(1, Relaxed);
                let mut logged = self.logged_bad.lock();
                if logged.len() < 10_000 && logged.insert(item.key.as_str().into()) {
                    tracing::warn!(key = %item.key, view = %view.name, "unreadable record served as defaults: {why}");
                }
                Entry::unreadable(now, view, item.key.len(), stats)
            }
        }
    }
}

/// How far past the wall clock a stored record's event time may be: the day a row may be written ahead
/// (clock skew between its writer and hydrant, `loader`), and as much again for the skew between the
/// replica that wrote it and the one reading it.
const MAX_READ_SKEW_MS: i64 = 2 * crate::loader::MAX_FUTURE_SKEW_MS;

/// Checks a stored record against the view and converts its values to the declared types. `wall_ms` is
/// the wall clock: an event time hydrant never writes (before 1970, or days ahead, which would never
/// grow older than `max_age`) makes the record unreadable.
pub fn decode_record(view: &View, bytes: &[u8], wall_ms: i64) -> Result<Found, String> {
    let record = Record::decode(bytes)?;
    if record.event_ts_ms < 0 || record.event_ts_ms > wall_ms.saturating_add(MAX_READ_SKEW_MS) {
        return Err(format!(
            "its event time, {} ms since the epoch, is {}: not a time hydrant writes",
            record.event_ts_ms,
            if record.event_ts_ms < 0 {
                "before 1970"
            } else {
                "more than two days ahead of now"
            }
        ));
    }
    if record.schema_version != view.version {
        return Err(format!(
            "written under version {} of view `{}`, which is now at version {}",
            record.schema_version, view.name, view.version
        ));
    }
    if record.layout != 0 && record.layout != view.layout {
        return Err(format!(
            "written under another layout of version {} of view `{}`: its features were reordered, renamed or retyped without a new version; bump `version` in {} and reload the rows",
            view.version,
            view.name,
            view.file.display()
        ));
    }
    if record.values.len() != view.features.len() {
        return Err(format!(
            "has {} values, view `{}` has {} features",
            record.values.len(),
            view.name,
            view.features.len()
        ));
    }
    let mut values = Vec::with_capacity(record.values.len());
    for (f, v) in view.features.iter().zip(record.values) {
        values.push(
            f.dtype
                .coerce(v)
                .map_err(|e| format!("feature `{}`: {e}", f.name))?,
        );
    }
    Ok(Found {
        event_ts_ms: record.event_ts_ms,
        values: Packed::new(&values),
    })
}

/// Waits for a fetch outcome until `deadline`.
async fn wait(mut rx: watch::Receiver<Option<Outcome>>, deadline: Instant) -> Outcome {
    let got = tokio::time::timeout_at(deadline.into(), rx.wait_for(Option::is_some)).await;
    match got {
        Ok(Ok(v)) => v.clone().unwrap_or(Err(Fail::Error)),
        // The fetch task ended without publishing (it cannot, but never hang on it).
        Ok(Err(_)) => Err(Fail::Error),
        Err(_) => Err(Fail::Timeout),
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::sync::atomic::AtomicUsize;

    use tokio::sync::Semaphore;

    use super::*;
    use crate::clock::Clock;
    use crate::schema::Registry;
    use crate::store::{BoxFuture, Writes};
    use crate::value::{Value, now_ms};

    /// An in-memory store whose reads each wait for a permit (when gated) and are counted.
    struct Gated {
        data: Mutex<HashMap<String, Vec<u8>>>,
        gate: Option<Arc<Semaphore>>,
        reads: AtomicUsize,
    }

    impl Store for Gated {
        fn backend(&self) -> &'static str {
            "test"
        }
        fn get_many<'a>(
            &'a self,
            keys: &'a [String],
        ) -> BoxFuture<'a, Result<Vec<Option<Vec<u8>>>, StoreError>> {
            Box::pin(async move {
                self.reads.fetch_add(1, Relaxed);
                // Read before waiting: the value a fetch carries is the one from before any later write.
                let out = {
                    let data = self.data.lock();
                    keys.iter().map(|k| data.get(k).cloned()).collect()
                };
                if let Some(g) = &self.gate {
                    g.acquire().await.map_err(|_| StoreError::Timeout)?.forget();
                }
                Ok(out)
            })
        }
        fn put_many(
            &self,
            writes: Writes,
            _ttl: Option<Duration>,
        ) -> BoxFuture<'_, Result<(), StoreError>> {
            Box::pin(async move {
                self.data.lock().extend(writes);
                Ok(())
            })
        }
    }

    fn view() -> Arc<View> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let r = Registry::load_dir(&root.join("schemas"), &root.join("models")).expect("schemas");
        r.views["user_profile"].clone()
    }

    fn record(age: i64) -> Vec<u8> {
        Record {
            schema_version: 1,
            event_ts_ms: now_ms(),
            values: vec![
                Value::Int(age),
                Value::Null,
                Value::Null,
                Value::Null,
                Value::Null,
            ],
            layout: 0,
        }
        .encode()
    }

    fn setup(gated: bool) -> (Arc<Hydrator>, Arc<Gated>, Option<Arc<Semaphore>>, Clock) {
        let gate = gated.then(|| Arc::new(Semaphore::new(0)));
        let store = Arc::new(Gated {
            data: Mutex::new(HashMap::new()),
            gate: gate.clone(),
            reads: AtomicUsize::new(0),
        });
        let telemetry = Arc::new(Telemetry::default());
        let clock = Clock::default();
        let cache = FeatureCache::new(1 << 20, clock.clone());
        let h = Hydrator::new(
            store.clone(),
            cache,
            "hy".into(),
            telemetry,
            HotKeys::disabled(),
        );
        (h, store, gate, clock)
    }

    fn age(h: &Hydrated, i: usize) -> Option<Value> {
        h.views[0][i].found().map(|f| f.values.get(0).to_value())
    }

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(5)
    }

    #[test]
    fn an_event_time_hydrant_never_writes_makes_a_record_unreadable() {
        let view = view();
        let now = now_ms();
        let at = |event_ts_ms: i64| {
            let mut r = Record::decode(&record(33)).expect("record");
            r.event_ts_ms = event_ts_ms;
            decode_record(&view, &r.encode(), now)
        };
        let day = 24 * 3600 * 1000;
        // Now, a year back, and a day ahead (a writer's clock ahead of this one's): read.
        for ok in [now, now - 365 * day, now + day, 0] {
            assert!(at(ok).is_ok(), "{ok}");
        }
        for (bad, why) in [
            (-1, "before 1970"),
            (i64::MIN, "before 1970"),
            (now + 3 * day, "ahead of now"),
            (i64::MAX, "ahead of now"),
        ] {
            let e = at(bad).err().unwrap_or_default();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }

    #[test]
    fn the_first_failed_read_is_logged_even_in_the_first_second() {
        assert!(read_warning_due(NEVER_WARNED, 0));
        assert!(read_warning_due(NEVER_WARNED, 999));
        assert!(!read_warning_due(0, 999));
        assert!(read_warning_due(0, 1_000));
        assert!(!read_warning_due(5_000, 5_999));
    }

    #[tokio::test]
    async fn a_write_during_a_fetch_keeps_the_fetched_old_value_out_of_the_cache() {
        let (h, store, gate, _) = setup(true);
        let gate = gate.expect("gated");
        let v = view();
        let keys = vec!["u_1".to_owned()];
        store
            .data
            .lock()
            .insert("hy:user_profile:u_1".into(), record(40));
        let request = {
            let (h, v, keys) = (h.clone(), v.clone(), keys.clone());
            tokio::spawn(async move { h.hydrate(&[(&v, &keys)], soon()).await })
        };
        while store.reads.load(Relaxed) == 0 {
            tokio::task::yield_now().await;
        }
        // The fetch has read 40; now the key is rewritten and invalidated before the fetch completes.
        store
            .data
            .lock()
            .insert("hy:user_profile:u_1".into(), record(41));
        h.invalidate(&["hy:user_profile:u_1".to_owned()]);
        gate.add_permits(1);
        let got = request.await.expect("request");
        assert_eq!(
            age(&got, 0),
            Some(Value::Int(40)),
            "its waiter still gets it"
        );
        assert!(matches!(
            h.cache()
                .lookup("hy:user_profile:u_1", &v, h.cache().clock().now_ms()),
            Lookup::Absent
        ));
        gate.add_permits(1);
        let got = h.hydrate(&[(&v, &keys)], soon()).await;
        assert_eq!(age(&got, 0), Some(Value::Int(41)));
        assert_eq!(store.reads.load(Relaxed), 2);
    }

    #[tokio::test]
    async fn concurrent_misses_share_one_read_and_invalidate_all_forgets_everything() {
        let (h, store, gate, _) = setup(true);
        let gate = gate.expect("gated");
        let v = view();
        store
            .data
            .lock()
            .insert("hy:user_profile:u_1".into(), record(40));
        let keys = vec!["u_1".to_owned(), "u_2".to_owned()];
        let runs: Vec<_> = (0..20)
            .map(|_| {
                let (h, v, keys) = (h.clone(), v.clone(), keys.clone());
                tokio::spawn(async move { h.hydrate(&[(&v, &keys)], soon()).await })
            })
            .collect();
        while store.reads.load(Relaxed) == 0 {
            tokio::task::yield_now().await;
        }
        tokio::task::yield_now().await;
        gate.add_permits(100);
        for r in runs {
            let got = r.await.expect("run");
            assert_eq!(age(&got, 0), Some(Value::Int(40)));
            assert_eq!(got.views[0][1].status, Status::NotFound);
        }
        assert_eq!(store.reads.load(Relaxed), 1);
        h.invalidate_all();
        let got = h.hydrate(&[(&v, &keys)], soon()).await;
        assert_eq!(got.cache.misses, 2);
        assert_eq!(store.reads.load(Relaxed), 2);
    }

    #[tokio::test]
    async fn a_request_refreshes_all_its_refresh_due_keys_in_one_read() {
        let (h, store, _, clock) = setup(false);
        let v = view();
        let keys: Vec<String> = (0..5).map(|i| format!("u_{i}")).collect();
        for k in &keys {
            store
                .data
                .lock()
                .insert(format!("hy:user_profile:{k}"), record(40));
        }
        h.hydrate(&[(&v, &keys)], soon()).await;
        assert_eq!(store.reads.load(Relaxed), 1);
        for k in &keys {
            store
                .data
                .lock()
                .insert(format!("hy:user_profile:{k}"), record(41));
        }
        clock.advance(Duration::from_secs(121)); // past refresh_after (2m), before ttl (10m)
        let got = h.hydrate(&[(&v, &keys)], soon()).await;
        assert_eq!(got.cache.stale, 5);
        assert_eq!(
            age(&got, 0),
            Some(Value::Int(40)),
            "served while refreshing"
        );
        let stats = h.telemetry().view("user_profile");
        while stats.refresh.ok.load(Relaxed) < 5 {
            tokio::task::yield_now().await;
        }
        assert_eq!(store.reads.load(Relaxed), 2, "five refreshes, one read");
        let got = h.hydrate(&[(&v, &keys)], soon()).await;
        assert_eq!(got.cache.hits, 5);
        assert_eq!(age(&got, 4), Some(Value::Int(41)));
    }

    #[tokio::test]
    async fn prefetch_reads_only_what_is_not_fresh_and_counts_no_lookups() {
        let (h, store, _, _) = setup(false);
        let v = view();
        store
            .data
            .lock()
            .insert("hy:user_profile:u_1".into(), record(40));
        let keys = vec!["u_1".to_owned(), "u_2".to_owned()];
        let p = h.prefetch(&[(&v, &keys)], soon()).await;
        assert_eq!(
            p,
            Prefetched {
                fetched: 2,
                cached: 0,
                failed: 0
            }
        );
        let p = h.prefetch(&[(&v, &keys)], soon()).await;
        assert_eq!(p.cached, 2);
        assert_eq!(store.reads.load(Relaxed), 1);
        let stats = h.telemetry().view("user_profile");
        assert_eq!(stats.misses.load(Relaxed) + stats.hits.load(Relaxed), 0);
        let got = h.hydrate(&[(&v, &keys)], soon()).await;
        assert_eq!(got.cache.hits, 2);
    }

    #[tokio::test]
    async fn a_request_joined_to_a_prefetch_waits_no_longer_than_its_view_allows() {
        let (h, store, gate, _) = setup(true);
        let gate = gate.expect("gated");
        let v = view();
        let keys = vec!["u_1".to_owned()];
        // A prefetch may wait for the store up to its own deadline, seconds away.
        let prefetch = {
            let (h, v, keys) = (h.clone(), v.clone(), keys.clone());
            tokio::spawn(async move { h.prefetch(&[(&v, &keys)], soon()).await })
        };
        while store.reads.load(Relaxed) == 0 {
            tokio::task::yield_now().await;
        }
        let started = Instant::now();
        let got = h.hydrate(&[(&v, &keys)], soon()).await;
        let waited = started.elapsed();
        assert!(got.degraded, "served while the store had not answered");
        // user_profile's store.timeout is 50ms: the request's own read would have given up then.
        assert!(
            waited < v.policy.store_timeout * 4,
            "waited {waited:?} for a read its view bounds at {:?}",
            v.policy.store_timeout
        );
        gate.add_permits(1);
        prefetch.await.expect("prefetch");
    }
}
