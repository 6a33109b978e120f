//! Warming the cache ahead of requests: the `POST /v1/prefetch` request and its bounded background work,
//! the sampling of hot keys into the store, and the warm start of a new replica from those hot keys.
//!
//! Hot keys: one lookup in `prefetch.hot_sample_every` records its entity key; every
//! `prefetch.hot_flush_interval` the sampled counts go to the store in one pipelined round trip (Redis:
//! `ZINCRBY {prefix}:hot:{view}`, trimmed to the `prefetch.hot_keep` hottest). Each lookup is sampled on
//! its own, with chance 1/N: a draw from a thread-local generator per lookup, and a short lock one time
//! in N.
//!
//! Warm start: before a new replica reports ready it reads the `prefetch.warm_top_k` hottest keys of every
//! view into its cache, for at most `prefetch.warm_timeout`; a store that is slow or down only delays
//! readiness by that much.

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use compact_str::CompactString;
use parking_lot::Mutex;
use serde::Deserialize;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::{LimitsConfig, PrefetchConfig};
use crate::decode::{EntityKey, EntityKeys, check_key_count, entity_keys, unknown_view};
use crate::error::ApiError;
use crate::hydrate::{Hydrator, Prefetched};
use crate::schema::{Registry, View};
use crate::store::HotCounts;

/// Most distinct keys held between two flushes; samples beyond it are dropped (the hottest keys are
/// sampled early and often, so they are not the ones lost).
const MAX_PENDING_KEYS: usize = 50_000;

/// Keys per store round trip of the warm start.
const WARM_BATCH: usize = 1000;

/// Samples lookups into per-view counts, until the flusher takes them.
pub struct HotKeys {
    every: u64,
    /// A draw at or below this samples the lookup: one draw in `every`.
    threshold: u64,
    pending: Mutex<Pending>,
}

/// Samples since the last flush: view -> entity key -> count, and how many keys that is in all.
#[derive(Default)]
struct Pending {
    views: HashMap<Box<str>, HashMap<Box<str>, u32>>,
    keys: usize,
}

impl Pending {
    fn count(&mut self, view: &str, entity_key: &str) {
        if let Some(n) = self.views.get_mut(view).and_then(|k| k.get_mut(entity_key)) {
            *n = n.saturating_add(1);
            return;
        }
        if self.keys >= MAX_PENDING_KEYS {
            return;
        }
        self.keys += 1;
        self.views
            .entry(view.into())
            .or_default()
            .insert(entity_key.into(), 1);
    }
}

impl HotKeys {
    /// Samples one lookup in `every` (0: never).
    pub fn new(every: u64) -> Self {
        Self {
            every,
            threshold: u64::MAX / every.max(1),
            pending: Mutex::new(Pending::default()),
        }
    }

    pub fn disabled() -> Self {
        Self::new(0)
    }

    /// Counts lookups of `entity_keys` in `view`, each sampled with chance one in N. A random draw per
    /// lookup, not every Nth lookup of a shared count: requests of one shape (a user and 31 items, with
    /// N = 32) would otherwise be sampled at the same position every time, and the keys at the other
    /// positions, however hot, never. The lock is taken only when a key in the slice is sampled.
    pub fn sample<K: AsRef<str>>(&self, view: &str, entity_keys: &[K]) {
        if self.every == 0 || entity_keys.is_empty() {
            return;
        }
        // One access to the thread's generator per call, then draws from a local copy.
        let mut rng = fastrand::Rng::new();
        let mut sampled = entity_keys
            .iter()
            .filter(|_| rng.u64(..) <= self.threshold)
            .peekable();
        if sampled.peek().is_none() {
            return;
        }
        let mut p = self.pending.lock();
        for k in sampled {
            p.count(view, k.as_ref());
        }
    }

    /// The counts sampled since the last call.
    pub fn take(&self) -> Vec<HotCounts> {
        let views = std::mem::take(&mut *self.pending.lock()).views;
        let mut out: Vec<HotCounts> = views
            .into_iter()
            .map(|(view, keys)| HotCounts {
                view: view.into(),
                keys: keys.into_iter().map(|(k, n)| (k.into(), n)).collect(),
            })
            .collect();
        out.sort_by(|a, b| a.view.cmp(&b.view));
        out
    }
}

/// Writes the sampled hot keys to the store every `interval` (best-effort background task: a failed flush
/// loses its samples, counted in `prefetch.hot_flush_errors`; the task ends with the hydrator).
pub fn spawn_hot_flusher(hydrator: Weak<Hydrator>, interval: Duration, keep: usize) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            let Some(h) = hydrator.upgrade() else { break };
            flush_hot(&h, keep).await;
        }
    });
}

/// Writes the sampled hot keys now (the flusher's step; tests call it to skip the wait).
pub async fn flush_hot(h: &Hydrator, keep: usize) {
    let counts = h.hot_keys().take();
    if counts.is_empty() {
        return;
    }
    let n: usize = counts.iter().map(|c| c.keys.len()).sum();
    // The metric counts sampled lookups, as its help says: a key sampled five times is five.
    let lookups: u64 = counts
        .iter()
        .flat_map(|c| &c.keys)
        .map(|&(_, times)| u64::from(times))
        .sum();
    let stats = &h.telemetry().prefetch;
    stats.hot_samples.fetch_add(lookups, Relaxed);
    if let Err(e) = h.store().record_hot(&counts, keep).await {
        stats.hot_flush_errors.fetch_add(1, Relaxed);
        // A flush runs every `hot_flush_interval`: one line a minute per reason says a lasting failure
        // (a hot set of another type, an ACL without the command) without a line per flush.
        static LINES: crate::telemetry::Throttle =
            crate::telemetry::Throttle::new(Duration::from_secs(60));
        if let Some(more) = LINES.admit_reason(&e.to_string()) {
            tracing::warn!(
                more_since_last_line = more,
                "hot-key flush of {n} keys failed (for the view named, or for all; counted in hydrant_hot_key_flush_errors_total, logged at most once a minute per reason): {e}"
            );
        }
    }
}

/// Whether `key`, read from a hot set, is one a request could send for `entity`: an int64 entity's keys
/// are integers as hydrant writes them (`7`, not `07`).
fn sendable_key(entity: &crate::schema::Entity, key: &str, limits: &LimitsConfig) -> bool {
    let sent = match entity.dtype {
        crate::value::Dtype::Int64 => match key.parse::<i64>() {
            Ok(i) if i.to_string() == key => EntityKey::Int(i),
            _ => return false,
        },
        _ => EntityKey::Str(CompactString::from(key)),
    };
    crate::decode::check_key(entity, &sent, limits).is_ok()
}

/// What a warm start did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Warmed {
    pub keys: Prefetched,
    /// The time bound or a store failure cut it short.
    pub incomplete: bool,
}

/// Reads the hottest keys of every view into the cache, within `cfg.warm_timeout`. A hot-set member that
/// is no key a request could send (`limits`: empty, too long, not an integer for an int64 entity,
/// written by another tool) is skipped.
pub async fn warm_start(
    h: &Arc<Hydrator>,
    registry: &Registry,
    cfg: &PrefetchConfig,
    limits: &LimitsConfig,
) -> Warmed {
    if cfg.warm_top_k == 0 {
        return Warmed::default();
    }
    let deadline = Instant::now() + cfg.warm_timeout;
    // Views are warmed side by side (their round trips overlap); the counts live behind a lock so that
    // what finished before the time bound is still counted when the bound cuts the rest short.
    let tally = parking_lot::Mutex::new(Warmed::default());
    let tally_ref = &tally;
    let work = futures::future::join_all(registry.views.values().map(|view| {
        let tally = tally_ref;
        async move {
            let mut keys = match h.store().hottest(&view.name, cfg.warm_top_k).await {
                Ok(keys) => keys,
                Err(e) => {
                    tracing::warn!(view = %view.name, "warm start: cannot read the hot keys: {e}");
                    tally.lock().incomplete = true;
                    return;
                }
            };
            let listed = keys.len();
            keys.retain(|k| sendable_key(&view.entity, k, limits));
            if keys.len() < listed {
                tracing::warn!(
                    view = %view.name,
                    skipped = listed - keys.len(),
                    "warm start: hot keys that no request could send (empty, over limits.max_key_bytes, or not of the entity's dtype) were skipped"
                );
            }
            for chunk in keys.chunks(WARM_BATCH) {
                let p = h.prefetch(&[(view, chunk)], deadline).await;
                let mut t = tally.lock();
                t.keys.fetched += p.fetched;
                t.keys.cached += p.cached;
                t.keys.failed += p.failed;
            }
        }
    }));
    let timed_out = tokio::time::timeout_at(deadline.into(), work)
        .await
        .is_err();
    let mut out = tally.into_inner();
    out.incomplete |= timed_out;
    out.incomplete |= out.keys.failed > 0;
    let stats = &h.telemetry().prefetch;
    let total = out.keys.fetched + out.keys.cached + out.keys.failed;
    stats.warm_keys.fetch_add(u64::from(total), Relaxed);
    stats
        .fetched
        .fetch_add(u64::from(out.keys.fetched), Relaxed);
    stats.failed.fetch_add(u64::from(out.keys.failed), Relaxed);
    if out.incomplete {
        stats.warm_incomplete.fetch_add(1, Relaxed);
    }
    out
}

/// `POST /v1/prefetch`: the entities about to be scored, and optionally which views to warm (default: every
/// view keyed by one of the entities).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrefetchRequest {
    #[serde(deserialize_with = "crate::decode::unique_names")]
    pub entities: HashMap<String, EntityKeys>,
    #[serde(default)]
    pub views: Option<Vec<String>>,
}

impl crate::decode::Positional for PrefetchRequest {
    const FIELDS: &'static [(&'static str, &'static [&'static str])] =
        &[("entities", &[]), ("views", &[])];
}

/// The keys a prefetch reads, per view.
pub type PrefetchPlan = Vec<(Arc<View>, Vec<CompactString>)>;

impl PrefetchRequest {
    /// Checks the request against the registry and the limits: every entity known, every key valid, every
    /// named view known and keyed by one of the entities sent.
    pub fn plan(
        &self,
        registry: &Registry,
        limits: &LimitsConfig,
    ) -> Result<PrefetchPlan, ApiError> {
        if self.entities.is_empty() {
            return Err(ApiError::invalid(
                "missing_entity",
                "entities",
                "entities: expected at least one entity with keys, e.g. {\"user_id\": [\"u_1\"]}",
            ));
        }
        check_key_count(self.entities.values(), limits)?;
        // In name order, so of several bad entities the same one is reported each time.
        let mut entities: Vec<(&String, &EntityKeys)> = self.entities.iter().collect();
        entities.sort_unstable_by(|a, b| a.0.cmp(b.0));
        let mut keys: HashMap<&str, Vec<CompactString>> = HashMap::new();
        for (name, sent) in entities {
            let Some(entity) = registry.entities.get(name.as_str()) else {
                return Err(crate::decode::unregistered_entity(registry, name));
            };
            let mut ks = entity_keys(entity, sent, limits)?;
            // A key sent twice is read, and counted, once.
            ks.sort_unstable();
            ks.dedup();
            keys.insert(name.as_str(), ks);
        }
        let views: Vec<Arc<View>> = match &self.views {
            Some(names) if names.is_empty() => {
                return Err(ApiError::invalid(
                    "invalid_field",
                    "views",
                    "views: expected at least one view (leave `views` out to warm every view keyed by these entities)",
                ));
            }
            Some(names) => {
                let mut out = Vec::with_capacity(names.len());
                for (i, vname) in names.iter().enumerate() {
                    let field = format!("views[{i}]");
                    let Some(view) = registry.views.get(vname) else {
                        return Err(unknown_view(registry, &field, vname));
                    };
                    if !keys.contains_key(view.entity.name.as_str()) {
                        return Err(ApiError::invalid(
                            "missing_entity",
                            &field,
                            format!(
                                "{field}: view `{vname}` is keyed by `{}`: send its keys in entities",
                                view.entity.name
                            ),
                        ));
                    }
                    if !out.iter().any(|v: &Arc<View>| v.name == view.name) {
                        out.push(view.clone());
                    }
                }
                out
            }
            None => {
                let mut out: Vec<Arc<View>> = registry
                    .views
                    .values()
                    .filter(|v| keys.contains_key(v.entity.name.as_str()))
                    .cloned()
                    .collect();
                out.sort_by(|a, b| a.name.cmp(&b.name));
                out
            }
        };
        if views.is_empty() {
            return Err(ApiError::invalid(
                "no_view",
                "entities",
                "entities: no registered view is keyed by these entities",
            ));
        }
        // Keys that would warm nothing are a mistake to name, as `/v1/features` names them, not to drop
        // in silence.
        let mut sent: Vec<&str> = keys.keys().copied().collect();
        sent.sort_unstable();
        if let Some(unused) = sent
            .into_iter()
            .find(|name| !views.iter().any(|v| v.entity.name == *name))
        {
            return Err(if self.views.is_some() {
                crate::decode::entity_unused(unused)
            } else {
                ApiError::invalid(
                    "unknown_entity",
                    format!("entities.{unused}"),
                    format!("entities.{unused}: no registered view is keyed by `{unused}`"),
                )
            });
        }
        Ok(views
            .into_iter()
            .filter_map(|v| {
                let ks = keys.get(v.entity.name.as_str())?.clone();
                (!ks.is_empty()).then_some((v, ks))
            })
            .collect())
    }
}

/// Bounds the prefetches running at once.
pub struct Prefetcher {
    permits: Arc<Semaphore>,
}

impl Prefetcher {
    pub fn new(max_concurrent: usize) -> Self {
        Self {
            permits: Arc::new(Semaphore::new(max_concurrent)),
        }
    }

    /// Starts `plan` in the background if fewer than `max_concurrent` prefetches are running; returns the
    /// number of keys accepted, or `None` when over the bound (the caller answers 429; the keys are counted
    /// as rejected). The fetch stops at `deadline`.
    pub fn start(&self, h: &Arc<Hydrator>, plan: PrefetchPlan, deadline: Instant) -> Option<usize> {
        let n: usize = plan.iter().map(|(_, k)| k.len()).sum();
        let stats = &h.telemetry().prefetch;
        let Ok(permit) = self.permits.clone().try_acquire_owned() else {
            stats.rejected.fetch_add(n as u64, Relaxed);
            return None;
        };
        stats.accepted.fetch_add(n as u64, Relaxed);
        let h = h.clone();
        tokio::spawn(run(h, plan, deadline, permit));
        Some(n)
    }
}

/// One accepted prefetch (best-effort background task: its outcome is only counted).
async fn run(
    h: Arc<Hydrator>,
    plan: PrefetchPlan,
    deadline: Instant,
    _permit: OwnedSemaphorePermit,
) {
    let views: Vec<(&Arc<View>, &[CompactString])> =
        plan.iter().map(|(v, k)| (v, k.as_slice())).collect();
    let p = h.prefetch(&views, deadline).await;
    let stats = &h.telemetry().prefetch;
    stats.fetched.fetch_add(u64::from(p.fetched), Relaxed);
    stats.cached.fetch_add(u64::from(p.cached), Relaxed);
    stats.failed.fetch_add(u64::from(p.failed), Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_counts_about_one_lookup_in_n() {
        fastrand::seed(7);
        let h = HotKeys::new(4);
        for _ in 0..4000 {
            h.sample("user_profile", &["u_1"]);
        }
        let counts = h.take();
        assert_eq!(counts.len(), 1);
        assert_eq!(counts[0].view, "user_profile");
        let [(key, n)] = &counts[0].keys[..] else {
            panic!("one key: {counts:?}")
        };
        assert_eq!(key, "u_1");
        // 1,000 expected; the standard deviation is 27.
        assert!((850..=1150).contains(n), "{n} of 4000 lookups sampled");
        assert!(h.take().is_empty(), "take empties the samples");
        let off = HotKeys::disabled();
        off.sample("user_profile", &["u_1"]);
        assert!(off.take().is_empty());
        let all = HotKeys::new(1);
        all.sample("v", &["a", "b", "a"]);
        let mut keys = all.take().remove(0).keys;
        keys.sort();
        assert_eq!(keys, [("a".to_owned(), 2), ("b".to_owned(), 1)]);
    }

    #[test]
    fn requests_of_one_shape_sample_every_position() {
        // One user and the same 31 items per request, N = 32: a stride over a shared count of lookups
        // sampled one position of the 32 in every request, so 30 of the items were never recorded.
        fastrand::seed(11);
        let h = HotKeys::new(32);
        let items: Vec<String> = (0..31).map(|i| format!("i_{i}")).collect();
        for u in 0..1000 {
            h.sample("user_profile", &[format!("u_{u}")]);
            h.sample("item_stats", &items);
        }
        let counts = h.take();
        let items_view = counts
            .iter()
            .find(|c| c.view == "item_stats")
            .expect("items sampled");
        // Each item: about 31 samples expected; none is missed but with odds below 1e-13.
        assert_eq!(items_view.keys.len(), 31, "{:?}", items_view.keys);
        let total: u32 = items_view.keys.iter().map(|(_, n)| n).sum();
        // 969 expected; the standard deviation is 31.
        assert!((800..=1150).contains(&total), "{total} item samples");
        let users = counts
            .iter()
            .find(|c| c.view == "user_profile")
            .map_or(0, |c| c.keys.len());
        assert!(
            (10..=60).contains(&users),
            "{users} users sampled, 31 expected"
        );
    }

    #[test]
    fn pending_samples_are_bounded() {
        let h = HotKeys::new(1);
        for i in 0..(MAX_PENDING_KEYS + 10) {
            h.sample("v", &[format!("k{i}")]);
        }
        let n: usize = h.take().iter().map(|c| c.keys.len()).sum();
        assert_eq!(n, MAX_PENDING_KEYS);
    }
}
