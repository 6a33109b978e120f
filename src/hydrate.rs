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

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::Serialize;
use tokio::sync::watch;

use crate::cache::{Entry, FeatureCache, Found, Lookup};
use crate::schema::View;
use crate::store::{Store, StoreError, write_key};
use crate::telemetry::Telemetry;
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

/// Resolves features for requests; shared by all requests of a gateway.
pub struct Hydrator {
    store: Arc<dyn Store>,
    cache: FeatureCache,
    prefix: String,
    telemetry: Arc<Telemetry>,
    /// Keys being fetched now, with the channel their result will be published on. The lock is held only
    /// to look up or insert, never across an await.
    inflight: Mutex<HashMap<Box<str>, watch::Receiver<Option<Outcome>>>>,
    /// Keys whose unreadable record was already logged (bounded), so a bad hot key logs once.
    logged_bad: Mutex<HashSet<Box<str>>>,
}

/// A key the request waits for.
struct Pending {
    view: usize,
    row: usize,
    /// The expired entry, served if the fetch fails.
    old: Option<Arc<Entry>>,
    rx: watch::Receiver<Option<Outcome>>,
}

/// One key a fetch task reads.
struct FetchItem {
    key: String,
    view: Arc<View>,
    tx: watch::Sender<Option<Outcome>>,
}

impl Hydrator {
    pub fn new(
        store: Arc<dyn Store>,
        cache: FeatureCache,
        prefix: String,
        telemetry: Arc<Telemetry>,
    ) -> Arc<Self> {
        Arc::new(Self {
            store,
            cache,
            prefix,
            telemetry,
            inflight: Mutex::new(HashMap::new()),
            logged_bad: Mutex::new(HashSet::new()),
        })
    }

    pub fn cache(&self) -> &FeatureCache {
        &self.cache
    }

    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Resolves `keys[i]` of `views[i]` for every `i`. Waits for the store at most until `deadline`.
    pub async fn hydrate(
        self: &Arc<Self>,
        views: &[(&Arc<View>, &[String])],
        deadline: Instant,
    ) -> Hydrated {
        let mut out = Hydrated {
            views: Vec::with_capacity(views.len()),
            ..Hydrated::default()
        };
        let mut pending: Vec<Pending> = Vec::new();
        let mut to_fetch: Vec<FetchItem> = Vec::new();
        let mut key = String::with_capacity(64);
        for (vi, (view, keys)) in views.iter().enumerate() {
            let stats = self.telemetry.view(&view.name);
            let mut rows = Vec::with_capacity(keys.len());
            for (ri, k) in keys.iter().enumerate() {
                write_key(&mut key, &self.prefix, &view.name, k);
                let old = match self.cache.lookup(&key, &view.policy) {
                    Lookup::Fresh(e) => {
                        if e.found.is_some() {
                            stats.hits.fetch_add(1, Relaxed);
                        } else {
                            stats.negative.fetch_add(1, Relaxed);
                        }
                        out.cache.hits += 1;
                        rows.push(self.resolve(view, Some(e)));
                        continue;
                    }
                    Lookup::RefreshDue(e) => {
                        stats.stale.fetch_add(1, Relaxed);
                        out.cache.stale += 1;
                        self.refresh(&key, view);
                        rows.push(self.resolve(view, Some(e)));
                        continue;
                    }
                    Lookup::Expired(e) => Some(e),
                    Lookup::Absent => None,
                };
                stats.misses.fetch_add(1, Relaxed);
                out.cache.misses += 1;
                let rx = self.join_or_lead(&key, view, &mut to_fetch);
                pending.push(Pending {
                    view: vi,
                    row: ri,
                    old,
                    rx,
                });
                // Placeholder, replaced once the fetch answers.
                rows.push(Resolved {
                    entry: None,
                    status: Status::Defaulted,
                });
            }
            out.views.push(rows);
        }
        if !to_fetch.is_empty() {
            self.spawn_fetch(to_fetch);
        }
        for p in pending {
            let view = views[p.view].0;
            let outcome = wait(p.rx, deadline).await;
            let resolved = match outcome {
                Ok(entry) => self.resolve(view, Some(entry)),
                Err(fail) => {
                    out.degraded = true;
                    let stats = self.telemetry.view(&view.name);
                    match fail {
                        Fail::Timeout => stats.degraded_timeout.fetch_add(1, Relaxed),
                        Fail::Error => stats.degraded_error.fetch_add(1, Relaxed),
                    };
                    match p.old {
                        Some(old) if old.found.is_some() => {
                            let mut r = self.resolve(view, Some(old));
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

    /// Applies `max_age` and turns a cache entry into a status.
    fn resolve(&self, view: &View, entry: Option<Arc<Entry>>) -> Resolved {
        let Some(e) = entry else {
            return Resolved {
                entry: None,
                status: Status::NotFound,
            };
        };
        let status = match &e.found {
            None if e.unreadable => Status::Defaulted,
            None => Status::NotFound,
            Some(f) => match view.policy.max_age {
                Some(max)
                    if self.cache.clock().wall_ms() - f.event_ts_ms > max.as_millis() as i64 =>
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
        to_fetch: &mut Vec<FetchItem>,
    ) -> watch::Receiver<Option<Outcome>> {
        let mut inflight = self.inflight.lock();
        if let Some(rx) = inflight.get(key) {
            return rx.clone();
        }
        let (tx, rx) = watch::channel(None);
        inflight.insert(key.into(), rx.clone());
        to_fetch.push(FetchItem {
            key: key.to_owned(),
            view: view.clone(),
            tx,
        });
        rx
    }

    /// Starts a background refresh of `key` unless one is already in flight (best-effort: a failed refresh
    /// leaves the cached value, which expires by its ttl).
    fn refresh(self: &Arc<Self>, key: &str, view: &Arc<View>) {
        let mut items = Vec::new();
        drop(self.join_or_lead(key, view, &mut items));
        if !items.is_empty() {
            self.spawn_fetch(items);
        }
    }

    fn spawn_fetch(self: &Arc<Self>, items: Vec<FetchItem>) {
        let this = self.clone();
        tokio::spawn(async move { this.fetch(items).await });
    }

    /// Reads `items` in one round trip, caches what came back and publishes each key's outcome.
    async fn fetch(&self, items: Vec<FetchItem>) {
        let timeout = items
            .iter()
            .map(|i| i.view.policy.store_timeout)
            .max()
            .unwrap_or(Duration::from_millis(50));
        let keys: Vec<String> = items.iter().map(|i| i.key.clone()).collect();
        let result = match tokio::time::timeout(timeout, self.store.get_many(&keys)).await {
            Ok(Ok(values)) if values.len() == keys.len() => Ok(values),
            Ok(Ok(_)) => Err((
                Fail::Error,
                "store returned the wrong number of values".to_owned(),
            )),
            Ok(Err(StoreError::Timeout)) | Err(_) => {
                Err((Fail::Timeout, format!("no answer within {timeout:?}")))
            }
            Ok(Err(e)) => Err((Fail::Error, e.to_string())),
        };
        let now = self.cache.clock().now_ms();
        match result {
            Ok(values) => {
                for (item, bytes) in items.into_iter().zip(values) {
                    let entry = Arc::new(self.decode(&item, bytes.as_deref(), now));
                    self.cache
                        .insert(&item.view.name, item.key.as_str().into(), entry.clone());
                    self.publish(item, Ok(entry));
                }
            }
            Err((fail, why)) => {
                tracing::warn!(
                    backend = self.store.backend(),
                    keys = keys.len(),
                    "store read failed: {why}"
                );
                for item in items {
                    self.publish(item, Err(fail));
                }
            }
        }
    }

    fn publish(&self, item: FetchItem, outcome: Outcome) {
        // Remove first: a request arriving after this finds the cache filled (or fetches anew after a failure).
        self.inflight.lock().remove(item.key.as_str());
        let _ = item.tx.send(Some(outcome));
    }

    /// Decodes a stored record for `item.view`. Unreadable records (bad MessagePack, another schema version,
    /// the wrong number or type of values) are served as defaults, counted, and logged once per key.
    fn decode(&self, item: &FetchItem, bytes: Option<&[u8]>, now: i64) -> Entry {
        let view = &item.view;
        let Some(bytes) = bytes else {
            return Entry::new(now, None, &view.policy, item.key.len());
        };
        match decode_record(view, bytes) {
            Ok(found) => Entry::new(now, Some(found), &view.policy, item.key.len()),
            Err(why) => {
                self.telemetry
                    .view(&view.name)
                    .bad_records
                    .fetch_add(1, Relaxed);
                let mut logged = self.logged_bad.lock();
                if logged.len() < 10_000 && logged.insert(item.key.as_str().into()) {
                    tracing::warn!(key = %item.key, view = %view.name, "unreadable record served as defaults: {why}");
                }
                Entry::unreadable(now, &view.policy, item.key.len())
            }
        }
    }
}

/// Checks a stored record against the view and converts its values to the declared types.
pub fn decode_record(view: &View, bytes: &[u8]) -> Result<Found, String> {
    let record = Record::decode(bytes)?;
    if record.schema_version != view.version {
        return Err(format!(
            "written under version {} of view `{}`, which is now at version {}",
            record.schema_version, view.name, view.version
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
        values: values.into_boxed_slice(),
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
