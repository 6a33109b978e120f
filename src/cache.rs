//! The in-process feature cache: one moka cache for all views, keyed by store key, bounded by bytes.
//!
//! Entries carry the time they were fetched; [`FeatureCache::lookup`] classifies them against the view's
//! policy (fresh, past `refresh_after`, past `ttl` but within `max_staleness`), so the policy decisions stay
//! here, testable with a [`Clock`] that tests move. An entry past the longest it can still be useful is
//! removed by [`FeatureCache::sweep`], which the server runs on a blocking thread every second or so; moka
//! itself bounds memory by bytes, and has no expiry of its own (see [`FeatureCache::sweep`] for why).

use std::sync::Arc;
use std::time::Duration;

use compact_str::CompactString;

use moka::notification::RemovalCause;

use crate::clock::Clock;
use crate::packed::Packed;
use crate::schema::View;
use crate::telemetry::ViewStats;

/// A decoded record as cached.
#[derive(Debug)]
pub struct Found {
    pub event_ts_ms: i64,
    /// In the view's feature order, each already of its declared type or null, packed in one allocation.
    pub values: Packed,
}

/// What the cache holds for one key.
#[derive(Debug)]
pub struct Entry {
    /// When the value was read from the store, on [`Clock::now_ms`].
    pub fetched_at_ms: i64,
    /// `None` caches "not found" (negative caching).
    pub found: Option<Found>,
    /// The store held a record that could not be decoded (cached like "not found", reported as `DEFAULTED`).
    pub unreadable: bool,
    /// [`View::shape`] of the view the record was decoded for: a lookup for another shape of the view
    /// (after a registered change) is a miss.
    shape: u64,
    /// How long the entry stays cached, in milliseconds: ttl + max_staleness, or negative_ttl. Past it,
    /// [`FeatureCache::sweep`] removes it.
    keep_ms: u64,
    weight: u32,
    /// The view's counters: the entry accounts itself in them when inserted and when removed.
    stats: Arc<ViewStats>,
}

impl Entry {
    pub fn new(
        fetched_at_ms: i64,
        found: Option<Found>,
        view: &View,
        key_len: usize,
        stats: Arc<ViewStats>,
    ) -> Self {
        let keep_ms = keep_ms(view, found.is_some());
        // What the entry really costs in memory: every heap allocation at the size the allocator hands
        // out ([`allocated`]), plus moka's per-entry bookkeeping (its entry node, access-order and
        // write-order deque nodes, key hash and its share of the hash table), with a margin. Calibrated
        // against resident memory with 1,000,000 cached demo users (scripts/bench-memory.sh: 453 B per
        // entity measured, 496 B estimated), so `cache.max_bytes` errs on the safe side.
        let values = found.as_ref().map_or(0, |f| allocated(f.values.bytes()));
        // moka's share includes the `Arc` around the key (40 bytes); a key longer than a
        // `CompactString` holds inline has its bytes in an allocation of their own.
        const MOKA_PER_ENTRY: usize = 360;
        const INLINE_KEY: usize = std::mem::size_of::<CompactString>();
        let key_heap = if key_len > INLINE_KEY {
            allocated(key_len)
        } else {
            0
        };
        let weight =
            key_heap + allocated(std::mem::size_of::<Entry>() + 16) + values + MOKA_PER_ENTRY;
        Self {
            fetched_at_ms,
            found,
            unreadable: false,
            shape: view.shape(),
            keep_ms,
            weight: u32::try_from(weight).unwrap_or(u32::MAX),
            stats,
        }
    }

    /// An entry for a record that could not be decoded: cached for `negative_ttl`, so a bad hot key does not
    /// hammer the store, and served as defaults.
    pub fn unreadable(
        fetched_at_ms: i64,
        view: &View,
        key_len: usize,
        stats: Arc<ViewStats>,
    ) -> Self {
        Self {
            unreadable: true,
            ..Self::new(fetched_at_ms, None, view, key_len, stats)
        }
    }

    pub fn weight(&self) -> u32 {
        self.weight
    }

    /// Whether the entry is past the longest any policy would still serve it, at `now_ms`: the one it
    /// was cached under, or its view's now, when a registration raised it since. An entry of another
    /// shape than the view's now (its version or features changed) is never served again: at once.
    fn outlived(&self, now_ms: i64) -> bool {
        if self.stats.of_another_shape(self.shape) {
            return true;
        }
        let keep = self.keep_ms.max(self.stats.keep_ms(self.found.is_some()));
        now_ms.saturating_sub(self.fetched_at_ms) >= i64::try_from(keep).unwrap_or(i64::MAX)
    }
}

/// How long `view`'s policy keeps an entry cached, in milliseconds: `ttl + max_staleness` for a found
/// record, `negative_ttl` for none. Rounded up: the sweep removes nothing the policy would still serve.
pub fn keep_ms(view: &View, found: bool) -> u64 {
    let policy = &view.policy;
    let keep = if found {
        policy.ttl + policy.max_staleness
    } else {
        policy.negative_ttl
    };
    u64::try_from(keep.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX)
}

/// Tells `stats` how long `view`'s policy keeps entries now, so that the sweep keeps those cached under
/// a shorter one until the longer one has passed (a raised `max_staleness` serves them in an outage).
pub fn note_policy(stats: &ViewStats, view: &View) {
    stats.set_keep_ms(view.shape(), keep_ms(view, true), keep_ms(view, false));
}

/// The bytes an allocation of `bytes` takes from mimalloc: up to 64 bytes, a multiple of 8; above, four
/// size classes per doubling (a request of 1,037 bytes gets a block of 1,280). A packed record is one
/// allocation, so a large one lands in a coarse class, and the weight must count the class.
fn allocated(bytes: usize) -> usize {
    match bytes {
        0 => 0,
        1..=64 => bytes.div_ceil(8) * 8,
        _ => {
            // Within (2^k, 2^(k+1)], classes are 2^(k-2) apart.
            let step = bytes.next_power_of_two() / 8;
            bytes.div_ceil(step) * step
        }
    }
}

/// How a cached entry stands against its view's policy.
#[derive(Debug, Clone)]
pub enum Lookup {
    /// Younger than `refresh_after` (or `ttl` when no refresh is configured): serve it.
    Fresh(Arc<Entry>),
    /// Past `refresh_after`, younger than `ttl`: serve it and refresh in the background.
    RefreshDue(Arc<Entry>),
    /// Past `ttl`: fetch again; serve it only if the store fails and it is within `max_staleness`.
    Expired(Arc<Entry>),
    Absent,
}

/// How often the server runs [`FeatureCache::upkeep`], at most.
const UPKEEP_EVERY: Duration = Duration::from_secs(1);

/// Keys are inline strings: moka holds each key behind an `Arc`, and a key of up to 24 bytes (the usual
/// `{prefix}:{view}:{id}`) then sits in that allocation, where a `Box<str>` put its bytes in another. A
/// lookup compares the key it finds with the one asked for, and on a cold cache each allocation it
/// touches is a memory load: one fewer per lookup, and one allocation fewer per entry.
type Moka = moka::sync::Cache<CompactString, Arc<Entry>, foldhash::fast::RandomState>;

/// The cache, shared by the clones of a gateway. A flush swaps in an empty moka cache and empties the old
/// one on a thread of its own ([`FeatureCache::invalidate_all`]).
#[derive(Clone)]
pub struct FeatureCache {
    inner: Arc<arc_swap::ArcSwap<Moka>>,
    max_bytes: u64,
    clock: Clock,
}

fn moka(max_bytes: u64) -> Moka {
    moka::sync::Cache::builder()
        .max_capacity(max_bytes)
        .weigher(|_k, v: &Arc<Entry>| v.weight)
        // Every removal (sweep, eviction, replacement, invalidation) undoes one insert.
        .eviction_listener(|_k, v: Arc<Entry>, cause: RemovalCause| {
            v.stats.removed(v.weight);
            if cause == RemovalCause::Size {
                v.stats
                    .evicted
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        })
        .build_with_hasher(foldhash::fast::RandomState::default())
}

/// Empties a cache no longer in use: every entry leaves through the removal listener, so the views'
/// entries and bytes gauges drop by what it held. First waits for the lookups and inserts that still hold
/// it (each a few microseconds), so nothing lands in it after it is emptied.
fn drain(mut old: Arc<Moka>) {
    let cache = loop {
        match Arc::try_unwrap(old) {
            Ok(cache) => break cache,
            Err(held) => {
                old = held;
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    };
    cache.invalidate_all();
    // moka stops each run after 100 ms when a listener is set, with more left to do; a run that removes
    // nothing ends it (dropping the cache frees the rest, uncounted).
    let mut left = cache.entry_count();
    while left > 0 {
        cache.run_pending_tasks();
        let now = cache.entry_count();
        if now >= left {
            break;
        }
        left = now;
    }
}

impl FeatureCache {
    /// A cache holding at most `max_bytes` (by the entries' estimated size).
    pub fn new(max_bytes: u64, clock: Clock) -> Self {
        Self {
            inner: Arc::new(arc_swap::ArcSwap::from_pointee(moka(max_bytes))),
            max_bytes,
            clock,
        }
    }

    pub fn clock(&self) -> &Clock {
        &self.clock
    }

    /// Classifies the entry at `key` against `view`'s policy at `now_ms` (on [`Clock::now_ms`], read once
    /// per request rather than per key). An entry decoded for another version or layout of the view is
    /// absent.
    pub fn lookup(&self, key: &str, view: &View, now_ms: i64) -> Lookup {
        let Some(e) = self.inner.load().get(key) else {
            return Lookup::Absent;
        };
        if e.shape != view.shape() {
            return Lookup::Absent;
        }
        let policy = &view.policy;
        let age = Duration::from_millis(now_ms.saturating_sub(e.fetched_at_ms).max(0) as u64);
        if e.found.is_none() {
            return if age < policy.negative_ttl {
                Lookup::Fresh(e)
            } else {
                Lookup::Absent
            };
        }
        if age >= policy.ttl + policy.max_staleness {
            Lookup::Absent
        } else if age >= policy.ttl {
            Lookup::Expired(e)
        } else if policy.refresh_after.is_some_and(|r| age >= r) {
            Lookup::RefreshDue(e)
        } else {
            Lookup::Fresh(e)
        }
    }

    /// Stores an entry (accounted in its view's entries and bytes; the removal listener undoes it).
    pub fn insert(&self, key: CompactString, entry: Arc<Entry>) {
        entry.stats.inserted(entry.weight);
        self.inner.load().insert(key, entry);
    }

    /// Drops a key, e.g. after a write through hydrant or an invalidation message.
    pub fn invalidate(&self, key: &str) {
        self.inner.load().invalidate(key);
    }

    /// Drops everything (e.g. after a lost invalidation connection): lookups from now on find an empty
    /// cache. The old entries are removed on a thread of its own. moka would remove them in its upkeep,
    /// which runs on whichever thread reads or writes the cache next, 100 ms at a time: with a few hundred
    /// thousand entries cached, that stalled the async workers, and every request with them, for up to
    /// half a second. Until the old cache is empty, its entries still count in the views' gauges.
    pub fn invalidate_all(&self) {
        let old = self.inner.swap(Arc::new(moka(self.max_bytes)));
        let spawned = std::thread::Builder::new()
            .name("cache-flush".to_owned())
            .spawn({
                let old = old.clone();
                move || drain(old)
            });
        if let Err(e) = spawned {
            tracing::warn!("cannot start a thread to empty the old cache ({e}); emptying it here");
            drain(old);
        }
    }

    /// The server's upkeep of the cache, on a blocking thread: a [`sweep`](Self::sweep), then moka's pending
    /// maintenance (eviction, its listeners), so memory and the entries/bytes gauges stay accurate when
    /// traffic is idle. Returns how long to wait before the next: a second, or 50 times what this one took
    /// when longer, so upkeep takes at most a fiftieth of a core.
    pub fn upkeep(&self) -> Duration {
        let started = std::time::Instant::now();
        self.sweep();
        self.run_pending_tasks();
        UPKEEP_EVERY.max(started.elapsed() * 50)
    }

    /// Removes the entries past their keep time (`ttl + max_staleness`, or `negative_ttl`) and returns how
    /// many. Run by [`upkeep`](Self::upkeep), never on a request's thread.
    ///
    /// moka could expire the entries itself, but it removes expired entries in its upkeep, which runs on
    /// whichever thread reads or writes the cache next, and its timer wheel hands over a whole second's
    /// worth of expired entries at once, with no time limit. 400,000 entries cached within two seconds
    /// stalled the async worker that next touched the cache, and every request on it, for 322–390 ms when
    /// they expired. Here each removal is one small record in moka's write log, which this thread applies
    /// itself as it goes (a request that runs moka's routine upkeep meanwhile applies at most a few
    /// hundred).
    ///
    /// An entry refreshed between the check and its removal is removed all the same: one more store read
    /// for that key, and nothing served wrong.
    pub fn sweep(&self) -> usize {
        /// Removals between two runs of moka's upkeep on this thread, which apply them.
        const STEP: usize = 256;
        /// Entries looked at between two checks that a flush has not replaced the cache.
        const CHECK: usize = 4096;
        let cache = self.inner.load_full();
        let now_ms = self.clock.now_ms();
        let mut removed = 0;
        for (seen, (key, entry)) in cache.iter().enumerate() {
            // An entry of a deleted view can never be served again.
            if entry.outlived(now_ms) || entry.stats.is_retired() {
                cache.invalidate(&**key);
                removed += 1;
                if removed % STEP == 0 {
                    cache.run_pending_tasks();
                }
            }
            // After a flush the old cache is emptied on a thread of its own, which waits for this one to
            // let go of it.
            if seen % CHECK == CHECK - 1 && !Arc::ptr_eq(&cache, &self.inner.load()) {
                break;
            }
        }
        removed
    }

    pub fn entry_count(&self) -> u64 {
        self.inner.load().entry_count()
    }

    /// Runs moka's pending maintenance (eviction, its listeners) now; for tests and stats.
    pub fn run_pending_tasks(&self) {
        self.inner.load().run_pending_tasks();
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::time::Instant;

    use std::sync::atomic::Ordering::Relaxed;

    use super::*;
    use crate::schema::Registry;
    use crate::telemetry::{Telemetry, ViewStats};
    use crate::value::Value;

    /// The demo registry, and fresh counters for its `user_profile` view.
    fn user_profile() -> (Registry, Arc<ViewStats>) {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let r = Registry::load_dir(&root.join("schemas"), &root.join("models")).expect("schemas");
        (r, Telemetry::default().view("user_profile"))
    }

    /// A view's entries and bytes gauges.
    fn gauges(stats: &ViewStats) -> (i64, i64) {
        (stats.entries.load(Relaxed), stats.bytes.load(Relaxed))
    }

    #[test]
    fn allocations_are_weighed_at_the_allocators_size_classes() {
        for (asked, got) in [
            (0, 0),
            (1, 8),
            (55, 56),
            (64, 64),
            (65, 80),
            (80, 80),
            (81, 96),
            (129, 160),
            (324, 384),
            (1024, 1024),
            (1037, 1280),
            (1281, 1536),
            (4097, 5120),
        ] {
            assert_eq!(allocated(asked), got, "{asked} bytes");
        }
    }

    /// Entries evicted to keep within the bound are counted as evictions; those removed for another
    /// reason (a flush, an invalidation) are not.
    #[test]
    fn evictions_to_stay_within_the_bound_are_counted() {
        let (r, stats) = user_profile();
        let view = &*r.views["user_profile"];
        let one = Entry::new(7, None, view, 8, stats.clone()).weight();
        let cache = FeatureCache::new(u64::from(one) * 10, Clock::default());
        for i in 0..100 {
            let key = format!("k{i}");
            let entry = Arc::new(Entry::new(7, None, view, key.len(), stats.clone()));
            cache.insert(key.as_str().into(), entry);
            cache.run_pending_tasks();
        }
        let (entries, _) = gauges(&stats);
        let evicted = stats.evicted.load(Relaxed);
        assert!(entries <= 10, "{entries} entries");
        assert_eq!(
            evicted,
            100 - entries as u64,
            "every entry not held was evicted"
        );
        let held = (0..100)
            .map(|i| format!("k{i}"))
            .find(|k| matches!(cache.lookup(k, view, 7), Lookup::Fresh(_)))
            .expect("a key held");
        cache.invalidate(&held);
        cache.run_pending_tasks();
        assert_eq!(gauges(&stats).0, entries - 1, "{held} was removed");
        assert_eq!(
            stats.evicted.load(Relaxed),
            evicted,
            "an invalidation is no eviction"
        );
    }

    /// Keys are inline strings up to 24 bytes and heap strings past that: both are found by the same
    /// text, a key one byte different is not, and only a key past 24 bytes weighs its own allocation.
    #[test]
    fn short_and_long_keys_are_found_by_their_text_and_weighed_by_where_they_live() {
        let (r, stats) = user_profile();
        let view = &*r.views["user_profile"];
        let cache = FeatureCache::new(1 << 30, Clock::default());
        let keys = [
            "u",
            "hy:user_profile:u_123456",
            "hy:user_profile:u_1234567",
            &"k".repeat(300),
        ];
        assert_eq!((keys[1].len(), keys[2].len()), (24, 25));
        for key in keys {
            let entry = Arc::new(Entry::new(7, None, view, key.len(), stats.clone()));
            cache.insert(key.into(), entry);
        }
        for key in keys {
            match cache.lookup(key, view, 7) {
                Lookup::Fresh(e) => assert_eq!(e.fetched_at_ms, 7, "{key}"),
                other => panic!("{key}: {other:?}"),
            }
            let mut near = key.to_owned();
            near.push('x');
            assert!(
                matches!(cache.lookup(&near, view, 7), Lookup::Absent),
                "{near}"
            );
        }
        let weight = |len: usize| Entry::new(0, None, view, len, stats.clone()).weight();
        assert_eq!(
            weight(1),
            weight(24),
            "an inline key takes no allocation of its own"
        );
        assert_eq!(weight(25), weight(24) + 32, "25 bytes take a 32-byte block");
        assert_eq!(weight(300), weight(24) + 320);
    }

    #[test]
    fn a_flush_empties_the_cache_at_once_and_its_gauges_settle_on_what_is_cached_after() {
        let (r, stats) = user_profile();
        let view = &*r.views["user_profile"];
        let cache = FeatureCache::new(1 << 30, Clock::default());
        let entry = || Arc::new(Entry::new(0, None, view, 20, stats.clone()));
        let weight = i64::from(entry().weight());
        for i in 0..20_000 {
            cache.insert(format!("hy:user_profile:u_{i}").into(), entry());
        }
        cache.run_pending_tasks();
        assert_eq!(gauges(&stats), (20_000, 20_000 * weight));
        let clone = cache.clone();
        cache.invalidate_all();
        // Every clone (each replica's handle) sees the empty cache at once.
        assert!(matches!(
            clone.lookup("hy:user_profile:u_7", view, 0),
            Lookup::Absent
        ));
        cache.insert("hy:user_profile:after".into(), entry());
        assert!(matches!(
            clone.lookup("hy:user_profile:after", view, 0),
            Lookup::Fresh(_)
        ));
        // The old entries leave the gauges as the flush thread empties the old cache.
        let until = Instant::now() + Duration::from_secs(10);
        while gauges(&stats) != (1, weight) {
            assert!(
                Instant::now() < until,
                "gauges stuck at {:?}",
                gauges(&stats)
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        cache.run_pending_tasks();
        assert_eq!(cache.entry_count(), 1);
    }

    /// A registration that raises a view's `max_staleness` or `negative_ttl` keeps the entries cached
    /// under the shorter one until the longer one has passed; one that lowers it removes them no sooner
    /// than they were cached for (lookups read the policy in force, so they are not served past it).
    #[test]
    fn a_raised_policy_keeps_the_entries_cached_under_the_shorter_one() {
        // user_profile: ttl 10m, max_staleness 1h, negative_ttl 30s.
        let (r, stats) = user_profile();
        let view = &*r.views["user_profile"];
        note_policy(&stats, view);
        let clock = Clock::default();
        let cache = FeatureCache::new(1 << 30, clock.clone());
        let found = Found {
            event_ts_ms: 0,
            values: Packed::new(&[Value::Int(1)]),
        };
        for (key, found) in [("found", Some(found)), ("missing", None)] {
            let entry = Entry::new(clock.now_ms(), found, view, key.len(), stats.clone());
            cache.insert(key.into(), Arc::new(entry));
        }
        cache.run_pending_tasks();
        // Raised to 5 hours of staleness and 10 minutes of negative caching.
        stats.set_keep_ms(
            view.shape(),
            keep_ms(view, true) + 4 * 3_600_000,
            keep_ms(view, false) + 570_000,
        );
        let present = |key: &str| cache.inner.load().contains_key(key);
        // 5 minutes in: the negative entry is past the 30 s it was cached under, within the 10 minutes.
        clock.advance(Duration::from_secs(5 * 60));
        assert_eq!(cache.sweep(), 0, "both are within the raised policy");
        // 2 hours in: the found one is past the 1 h 10 m it was cached under, within the 5 h 10 m.
        clock.advance(Duration::from_secs(2 * 3600));
        assert_eq!(cache.sweep(), 1);
        assert!(present("found") && !present("missing"));
        clock.advance(Duration::from_secs(4 * 3600));
        assert_eq!(cache.sweep(), 1, "and past it, it goes");
        // Once the view has another shape (its version raised, its features changed), entries of this
        // one are never served again: the next sweep removes them, well within their own keep.
        let entry = Entry::new(clock.now_ms(), None, view, 7, stats.clone());
        cache.insert("missing".into(), Arc::new(entry));
        assert_eq!(cache.sweep(), 0, "of the view's shape now");
        stats.set_keep_ms(view.shape() ^ 1, u64::MAX, u64::MAX);
        assert_eq!(cache.sweep(), 1, "of another shape");
    }

    #[test]
    fn a_sweep_removes_the_entries_past_their_keep_time_and_only_those() {
        // user_profile: ttl 10m, max_staleness 1h, negative_ttl 30s.
        let (r, stats) = user_profile();
        let view = &*r.views["user_profile"];
        let clock = Clock::default();
        let cache = FeatureCache::new(1 << 30, clock.clone());
        let found = || Found {
            event_ts_ms: 0,
            values: Packed::new(&[Value::Int(1)]),
        };
        let put = |key: &str, found: Option<Found>| {
            let entry = Entry::new(clock.now_ms(), found, view, key.len(), stats.clone());
            cache.insert(key.into(), Arc::new(entry));
        };
        put("hy:user_profile:old", Some(found()));
        put("hy:user_profile:gone_early", None);
        clock.advance(Duration::from_secs(40 * 60));
        put("hy:user_profile:young", Some(found()));
        put("hy:user_profile:gone_late", None);
        cache.run_pending_tasks();
        let present = |key: &str| cache.inner.load().contains_key(key);

        // 40 minutes in: the negative entry cached at 0 is past its 30 s; the found one, within ttl +
        // max_staleness, is kept (it is served when the store fails).
        assert_eq!(cache.sweep(), 1);
        assert!(!present("hy:user_profile:gone_early"));
        assert!(present("hy:user_profile:old"));
        assert!(matches!(
            cache.lookup("hy:user_profile:old", view, clock.now_ms()),
            Lookup::Expired(_)
        ));
        // 31 seconds later the second negative entry goes too; nothing else.
        clock.advance(Duration::from_secs(31));
        assert_eq!(cache.sweep(), 1);
        assert!(!present("hy:user_profile:gone_late"));
        assert_eq!(cache.sweep(), 0, "a second sweep finds nothing more");
        // Past 1 h 10 m the first found entry goes; the one cached at 40 minutes stays.
        clock.advance(Duration::from_secs(30 * 60));
        assert_eq!(cache.sweep(), 1);
        assert!(!present("hy:user_profile:old"));
        assert!(present("hy:user_profile:young"));
        cache.run_pending_tasks();
        assert_eq!(cache.entry_count(), 1);
        let weight = i64::from(
            Entry::new(
                0,
                Some(found()),
                view,
                "hy:user_profile:young".len(),
                stats.clone(),
            )
            .weight(),
        );
        assert_eq!(
            gauges(&stats),
            (1, weight),
            "removed entries leave the gauges"
        );
    }

    #[test]
    fn the_cache_stays_within_its_byte_budget() {
        let (r, stats) = user_profile();
        let view = &*r.views["user_profile"];
        let budget = 50_000;
        let cache = FeatureCache::new(budget, Clock::default());
        let found = || Found {
            event_ts_ms: 0,
            values: Packed::new(&[Value::Str("x".repeat(100).into()), Value::Int(1)]),
        };
        let weight = Entry::new(0, Some(found()), view, 20, stats.clone()).weight();
        for i in 0..2_000 {
            let key = format!("hy:user_profile:u_{i:05}");
            cache.insert(
                key.into(),
                Arc::new(Entry::new(0, Some(found()), view, 20, stats.clone())),
            );
        }
        cache.run_pending_tasks();
        let (entries, bytes) = gauges(&stats);
        assert!(
            bytes as u64 <= budget,
            "{bytes} bytes cached, budget {budget}"
        );
        assert!(cache.entry_count() * u64::from(weight) <= budget);
        assert!(cache.entry_count() > 0);
        assert_eq!(entries as u64, cache.entry_count());
    }
}
