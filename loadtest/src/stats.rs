//! The gateway's own numbers: `GET /v1/stats`, sampled every second during a run.
//!
//! Every field is optional on the wire (serde defaults), so the tool keeps working against a
//! gateway that lacks some of them; the report then says what it could not show. Counters
//! (`requests`, `hits`, `stale`, `misses`, `negative`) are monotonic since the gateway started, so a
//! run's cache hit rate is a difference of two samples; stage percentiles cover the gateway's last
//! `window_s` seconds.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::task::JoinHandle;

use crate::client::Pool;
use crate::drive::Cancel;

/// How long one `/v1/stats` request may take.
pub const FETCH_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Stats {
    pub uptime_s: f64,
    pub window_s: f64,
    /// The gateway's async worker threads (`server.workers`); 0 from a gateway that does not say.
    pub workers: u64,
    /// Where the kernel shares the gateway's CPU time (`hydrant::observe::sched_group`); None from a
    /// gateway that does not say.
    pub sched_group: Option<String>,
    pub models: BTreeMap<String, ModelStats>,
    pub views: BTreeMap<String, ViewStats>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ModelStats {
    pub requests: f64,
    pub errors: f64,
    pub rps: f64,
    pub error_rate: f64,
    pub rows: f64,
    pub stages: BTreeMap<String, StagePercentiles>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct StagePercentiles {
    pub p50_us: Option<f64>,
    pub p95_us: Option<f64>,
    pub p99_us: Option<f64>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ViewStats {
    pub hits: f64,
    pub stale: f64,
    pub misses: f64,
    pub negative: f64,
    pub hit_rate: f64,
    pub entries: f64,
    pub bytes: f64,
}

/// Fetches and decodes `/v1/stats`; the error says why it is unavailable.
pub async fn fetch(pool: &Pool) -> Result<Stats, String> {
    let resp = pool
        .get("/v1/stats", FETCH_TIMEOUT)
        .await
        .map_err(|e| e.to_string())?;
    if !resp.status.is_success() {
        return Err(format!(
            "GET /v1/stats answered HTTP {}",
            resp.status.as_u16()
        ));
    }
    serde_json::from_slice(&resp.body)
        .map_err(|e| format!("GET /v1/stats: not the expected JSON: {e}"))
}

/// Cache lookups of one view (or all views) between two samples.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ViewDelta {
    pub hits: u64,
    pub stale: u64,
    pub misses: u64,
    pub negative: u64,
    pub lookups: u64,
    /// `hits / lookups`; `None` when there were no lookups.
    pub hit_rate: Option<f64>,
}

impl ViewDelta {
    fn from_parts(hits: f64, stale: f64, misses: f64, negative: f64) -> Option<ViewDelta> {
        if [hits, stale, misses, negative]
            .iter()
            .any(|v| !v.is_finite() || *v < 0.0)
        {
            return None;
        }
        let (hits, stale, misses, negative) =
            (hits as u64, stale as u64, misses as u64, negative as u64);
        let lookups = hits + stale + misses + negative;
        Some(ViewDelta {
            hits,
            stale,
            misses,
            negative,
            lookups,
            hit_rate: served_from_memory(hits, stale, negative, lookups),
        })
    }

    fn add(&mut self, o: &ViewDelta) {
        self.hits += o.hits;
        self.stale += o.stale;
        self.misses += o.misses;
        self.negative += o.negative;
        self.lookups += o.lookups;
        self.hit_rate = served_from_memory(self.hits, self.stale, self.negative, self.lookups);
    }
}

/// The gateway's own hit rate (as `/v1/stats` computes it): lookups answered from the cache without a
/// store read, fresh, stale or cached-as-absent, over all lookups.
fn served_from_memory(hits: u64, stale: u64, negative: u64, lookups: u64) -> Option<f64> {
    (lookups > 0).then(|| (hits + stale + negative) as f64 / lookups as f64)
}

/// The same hit rate from the answers' `cache` fields, the fallback when `/v1/stats` has no view
/// counters. An answer's `hits` counts every fresh lookup, found or cached-as-absent (the gateway's
/// hits and negative together), so the lookups served from memory are `hits + stale` of
/// `hits + stale + misses`. `None` when no answer carried a lookup.
pub fn answers_hit_rate(hits: u64, stale: u64, misses: u64) -> Option<f64> {
    served_from_memory(hits, stale, 0, hits + stale + misses)
}

/// Counter differences between two samples.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StatsDelta {
    pub views: BTreeMap<String, ViewDelta>,
    pub total: ViewDelta,
    /// Predict requests the gateway counted for the model.
    pub model_requests: Option<u64>,
    pub model_errors: Option<u64>,
}

/// `after - before`; `None` when a counter went backwards (the gateway restarted in between).
pub fn delta(before: &Stats, after: &Stats, model: &str) -> Option<StatsDelta> {
    let mut out = StatsDelta::default();
    for (name, b) in &after.views {
        let a = before.views.get(name).cloned().unwrap_or_default();
        let d = ViewDelta::from_parts(
            b.hits - a.hits,
            b.stale - a.stale,
            b.misses - a.misses,
            b.negative - a.negative,
        )?;
        out.total.add(&d);
        out.views.insert(name.clone(), d);
    }
    if let (Some(a), Some(b)) = (before.models.get(model), after.models.get(model)) {
        let r = b.requests - a.requests;
        let e = b.errors - a.errors;
        if r < 0.0 || e < 0.0 {
            return None;
        }
        out.model_requests = Some(r as u64);
        out.model_errors = Some(e as u64);
    }
    Some(out)
}

/// A point of the hit-rate-over-time chart (between two consecutive samples).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatsPoint {
    pub t_s: f64,
    pub hit_rate: Option<f64>,
    pub lookups_per_s: f64,
    pub requests_per_s: Option<f64>,
}

/// Samples taken during a run.
#[derive(Debug, Clone, Default)]
pub struct Series {
    /// (seconds since the run started, stats).
    pub samples: Vec<(f64, Stats)>,
    pub failures: u64,
    pub last_error: Option<String>,
}

impl Series {
    pub fn points(&self, model: &str) -> Vec<StatsPoint> {
        self.samples
            .windows(2)
            .filter_map(|w| {
                let (t0, a) = &w[0];
                let (t1, b) = &w[1];
                let dt = t1 - t0;
                if dt <= 0.0 {
                    return None;
                }
                let d = delta(a, b, model)?;
                Some(StatsPoint {
                    t_s: *t1,
                    hit_rate: d.total.hit_rate,
                    lookups_per_s: d.total.lookups as f64 / dt,
                    requests_per_s: d.model_requests.map(|r| r as f64 / dt),
                })
            })
            .collect()
    }
}

/// Samples `/v1/stats` every `period` until `stop` is cancelled or `max` has passed (whichever
/// comes first); the loop is bounded in count too.
pub fn spawn_sampler(
    pool: Arc<Pool>,
    origin: Instant,
    period: Duration,
    max: Duration,
    stop: Cancel,
) -> JoinHandle<Series> {
    tokio::spawn(async move {
        let mut series = Series::default();
        let deadline = Instant::now() + max;
        let max_samples = (max.as_secs_f64() / period.as_secs_f64().max(0.001)).ceil() as u64 + 2;
        let mut ticker = tokio::time::interval(period);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        for _ in 0..max_samples {
            tokio::select! {
                _ = ticker.tick() => {}
                _ = stop.cancelled() => break,
            }
            if stop.is_cancelled() || Instant::now() >= deadline {
                break;
            }
            match fetch(&pool).await {
                Ok(s) => series.samples.push((origin.elapsed().as_secs_f64(), s)),
                Err(e) => {
                    series.failures += 1;
                    series.last_error = Some(e);
                }
            }
        }
        series
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tolerates_missing_fields_and_computes_deltas() {
        let a: Stats = serde_json::from_str(r#"{"views":{"user_profile":{"hits":10,"misses":2}}}"#)
            .expect("partial stats");
        let b: Stats = serde_json::from_str(
            r#"{"uptime_s":3,"models":{"ctr":{"requests":5}},"views":{"user_profile":{"hits":19,"stale":0,"misses":3,"negative":0},"item_stats":{"hits":4}}}"#,
        )
        .expect("stats");
        let d = delta(&a, &b, "ctr").expect("delta");
        assert_eq!(d.views["user_profile"].hits, 9);
        assert_eq!(d.views["user_profile"].lookups, 10);
        assert_eq!(d.total.lookups, 14);
        assert_eq!(d.total.hit_rate, Some(13.0 / 14.0));
        // Stale and cached-as-absent answers came from memory too, as the gateway counts them.
        let c: Stats = serde_json::from_str(
            r#"{"views":{"user_profile":{"hits":19,"stale":2,"misses":3,"negative":4}}}"#,
        )
        .expect("stats");
        let d = delta(&a, &c, "ctr").expect("delta");
        assert_eq!(d.total.hit_rate, Some(15.0 / 16.0));
        assert_eq!(d.model_requests, None, "model missing in the first sample");
        assert!(delta(&b, &a, "ctr").is_none(), "counters going backwards");
        let empty: Stats = serde_json::from_str("{}").expect("empty");
        assert!(empty.views.is_empty());
    }

    #[test]
    fn the_answers_hit_rate_counts_what_the_counters_count() {
        // Counters: 6 hits, 2 stale, 3 misses, 1 negative. The answers carry the same lookups with
        // the negative among the hits: 7 hits, 2 stale, 3 misses.
        let counters = ViewDelta::from_parts(6.0, 2.0, 3.0, 1.0).expect("counters");
        assert_eq!(counters.hit_rate, Some(9.0 / 12.0));
        assert_eq!(answers_hit_rate(7, 2, 3), counters.hit_rate);
        assert_eq!(answers_hit_rate(0, 0, 4), Some(0.0));
        assert_eq!(answers_hit_rate(0, 0, 0), None, "no lookups, no rate");
    }
}
