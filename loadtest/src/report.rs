//! The result of a run as one serializable value, and the number formatting shared by the
//! terminal table and the HTML report (both are pure functions of [`RunResult`]).

pub mod html;
pub mod svg;
pub mod table;

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::record::{TimelinePoint, Which};
use crate::stats::{StagePercentiles, StatsPoint, ViewDelta};

/// Latency and throughput of one server over one phase. Latencies are of successful answers and of
/// timeouts, a timeout at the time it was given up (a lower bound).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LatencySummary {
    pub requests: u64,
    pub ok: u64,
    pub errors: u64,
    pub error_rate: f64,
    pub measured_s: f64,
    /// `None` (JSON `null`) when no load was measured: a run interrupted before the phase's measurement
    /// began.
    pub achieved_rps: Option<f64>,
    /// Latencies: `None` (JSON `null`) when no answer succeeded or timed out, so nothing was measured.
    pub p50_us: Option<u64>,
    pub p90_us: Option<u64>,
    pub p95_us: Option<u64>,
    pub p99_us: Option<u64>,
    pub p999_us: Option<u64>,
    pub max_us: Option<u64>,
    pub mean_us: Option<f64>,
    /// Open loop only (`None`, JSON `null`, for a closed loop, which has no schedule to be late for).
    pub late_sends: Option<u64>,
    pub late_share: Option<f64>,
    pub errors_by_kind: BTreeMap<String, u64>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StageSummary {
    pub p50_us: u64,
    pub p95_us: u64,
    pub p99_us: u64,
}

/// Hydrant latency divided by the floor's (so 3.0 = three times the floor).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LatencyRatio {
    pub p50: Option<f64>,
    pub p99: Option<f64>,
}

/// One closed-loop step of a sweep.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepResult {
    pub label: String,
    pub concurrency: Option<usize>,
    pub rate: Option<f64>,
    pub hydrant: LatencySummary,
    pub floor: Option<LatencySummary>,
}

/// Hydrant and the floor run again after the sweep, each at the concurrency of its best step: their
/// rates are the run's maxima. The sweep's best steps are kept beside them for comparison.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConfirmResult {
    pub duration_s: f64,
    pub concurrency: usize,
    pub floor_concurrency: Option<usize>,
    pub hydrant: LatencySummary,
    pub floor: Option<LatencySummary>,
    /// Cut short by Ctrl-C: `max_rps` and `floor_rps` are the sweep's.
    pub cut: bool,
    pub sweep_max_rps: Option<f64>,
    pub sweep_floor_rps: Option<f64>,
    pub sweep_ratio_to_floor: Option<f64>,
}

/// When a segment ran, for the shaded bands of the time charts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SegmentSpan {
    pub label: String,
    pub which: Which,
    pub measured: bool,
    pub start_s: f64,
    pub end_s: f64,
}

/// One bar of the latency histogram: successful answers and timeouts in `[lo_us, hi_us)`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HistBin {
    pub lo_us: f64,
    pub hi_us: f64,
    pub hydrant: u64,
    pub floor: u64,
}

/// Summed `cache` fields of the answers (the fallback when `/v1/stats` has no views).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ResponseCache {
    pub hits: u64,
    pub stale: u64,
    pub misses: u64,
    /// Answers that carried a `cache` field.
    pub answers: u64,
}

/// Everything a run produced; written as `<scenario>.json`.
///
/// The top-level latency fields (`achieved_rps`, `p50_us`, ...) are hydrant's, over the headline
/// phase: the open-loop phase in open-loop and max-then-fraction modes, the highest-throughput
/// step in closed-loop mode.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunResult {
    pub scenario: String,
    pub mode: String,
    pub target: String,
    pub model: String,
    pub format: String,
    pub started_at: String,
    pub wall_s: f64,
    pub interrupted: bool,
    /// Label of the phase the top-level numbers come from.
    pub headline: String,
    pub offered_rps: Option<f64>,
    pub concurrency: Option<usize>,
    #[serde(flatten)]
    pub hydrant: LatencySummary,
    pub degraded: u64,
    pub error_codes: BTreeMap<String, u64>,
    /// Cache hits / lookups over the headline phase.
    pub hit_rate: Option<f64>,
    /// `stats` (the gateway's counters), `responses` (the answers' `cache`), or `none`.
    pub hit_rate_source: String,
    pub cache: Option<ViewDelta>,
    pub views: BTreeMap<String, ViewDelta>,
    pub response_cache: ResponseCache,
    /// Predict requests the gateway itself counted during the headline phase.
    pub gateway_requests: Option<u64>,
    pub stages_p99_us: BTreeMap<String, u64>,
    /// `responses` (the answers' `timings_us`), `stats_window`, or `none`.
    pub stages_source: String,
    pub stages: BTreeMap<String, StageSummary>,
    pub stats_window_s: Option<f64>,
    pub stats_window_stages: BTreeMap<String, StagePercentiles>,
    pub stats_note: Option<String>,
    /// Things that make the numbers less trustworthy (late schedule, refused sends...).
    pub warnings: Vec<String>,
    /// Hydrant's maximum throughput in sweep modes: its best step's, or, with `load.confirm_s`, the
    /// rate of its best step run again (`confirm`).
    pub max_rps: Option<f64>,
    pub fraction: Option<f64>,
    /// The floor's throughput that `ratio_to_floor` divides by: its maximum in sweep modes (as
    /// `max_rps` is hydrant's), its achieved rate in open-loop mode.
    pub floor_rps: Option<f64>,
    /// Hydrant throughput / floor throughput (same basis as `floor_rps`).
    pub ratio_to_floor: Option<f64>,
    pub latency_ratio_to_floor: Option<LatencyRatio>,
    /// The gateway's async worker threads, as its `/v1/stats` said before the run (asked only when the
    /// in-process floor starts).
    #[serde(default)]
    pub gateway_workers: Option<u64>,
    /// Worker threads of the in-process floor (none for a floor at `floor.url`).
    #[serde(default)]
    pub floor_threads: Option<usize>,
    /// A plain Redis GET round trip measured in the same run (with `--redis-url`).
    #[serde(default)]
    pub redis_get: Option<crate::redis_probe::RedisGet>,
    /// The best sweep steps run again (`load.confirm_s`), which give `max_rps` and `floor_rps`.
    #[serde(default)]
    pub confirm: Option<ConfirmResult>,
    /// The floor over the headline phase (same load shape).
    pub floor: Option<LatencySummary>,
    pub steps: Vec<StepResult>,
    pub segments: Vec<SegmentSpan>,
    pub timeline: Vec<TimelinePoint>,
    pub floor_timeline: Vec<TimelinePoint>,
    pub stats_timeline: Vec<StatsPoint>,
    pub latency_histogram: Vec<HistBin>,
    pub scenario_toml: String,
}

impl RunResult {
    /// Why the run fails its error budget (exit 3), if it does: a measured phase in which no
    /// request succeeded, or whose error rate is above `max_error_rate`. In closed-loop mode every
    /// step is measured and each is held to this on its own (the headline is only the fastest
    /// step); in the other modes the measured phase is the headline (in max-then-fraction mode, the
    /// open-loop phase: the sweep's errors are warnings).
    pub fn failure(&self, max_error_rate: Option<f64>) -> Option<String> {
        let phases: Vec<(Option<&str>, &LatencySummary)> =
            if self.mode == "closed-loop" && !self.steps.is_empty() {
                self.steps
                    .iter()
                    .map(|s| (Some(s.label.as_str()), &s.hydrant))
                    .collect()
            } else {
                vec![(None, &self.hydrant)]
            };
        let in_step =
            |label: Option<&str>| label.map_or_else(String::new, |l| format!(" in step {l}"));
        if let Some((label, _)) = phases.iter().find(|(_, p)| p.requests > 0 && p.ok == 0) {
            return Some(format!("no request succeeded{}", in_step(*label)));
        }
        // The phase this mode exists for (the open loop at a fraction of the maximum) did not run.
        if self.mode == "max-then-fraction" && self.offered_rps.is_none() {
            let why = self.warnings.iter().find(|w| w.starts_with(NO_OPEN_LOOP));
            return Some(why.map_or_else(|| NO_OPEN_LOOP.to_owned(), Clone::clone));
        }
        let max = max_error_rate?;
        let (label, worst) = phases
            .iter()
            .filter(|(_, p)| p.error_rate > max)
            .max_by(|a, b| a.1.error_rate.total_cmp(&b.1.error_rate))?;
        Some(format!(
            "error rate {}{} exceeds max_error_rate {}",
            fmt_pct(worst.error_rate),
            in_step(*label),
            fmt_pct(max)
        ))
    }
}

/// The entries of a per-stage map in pipeline order ([`crate::record::STAGES`]), then any others.
pub fn in_stage_order<V>(m: &BTreeMap<String, V>) -> Vec<(&String, &V)> {
    let rank = |k: &str| {
        crate::record::STAGES
            .iter()
            .position(|s| *s == k)
            .unwrap_or(usize::MAX)
    };
    let mut v: Vec<(&String, &V)> = m.iter().collect();
    v.sort_by_key(|(k, _)| rank(k));
    v
}

/// Reads one latency out of a summary.
pub type Pick = fn(&LatencySummary) -> Option<u64>;

/// The latency rows of both reports, in order.
pub const LATENCY_ROWS: [(&str, Pick); 6] = [
    ("p50", |s| s.p50_us),
    ("p90", |s| s.p90_us),
    ("p95", |s| s.p95_us),
    ("p99", |s| s.p99_us),
    ("p99.9", |s| s.p999_us),
    ("max", |s| s.max_us),
];

/// A latency for formatting: NaN (shown as `-`) when nothing was measured.
pub fn us_or_nan(v: Option<u64>) -> f64 {
    v.map_or(f64::NAN, |v| v as f64)
}

/// A measured latency as [`fmt_us`] writes it; `-` when nothing was measured.
pub fn fmt_latency(v: Option<u64>) -> String {
    fmt_us(us_or_nan(v))
}

/// `850 µs`, `1.23 ms`, `2.50 s`.
pub fn fmt_us(us: f64) -> String {
    if !us.is_finite() {
        "-".to_string()
    } else if us < 1_000.0 {
        format!("{us:.0} µs")
    } else if us < 1_000_000.0 {
        format!("{:.2} ms", us / 1_000.0)
    } else {
        format!("{:.2} s", us / 1_000_000.0)
    }
}

/// How the warning, and the failure, of a max-then-fraction run whose open-loop phase did not run begin.
pub const NO_OPEN_LOOP: &str = "the open-loop phase did not run";

/// An achieved rate with one decimal, as the tables show it; `-` when nothing was measured.
pub fn fmt_rps(rps: Option<f64>) -> String {
    rps.map_or_else(|| "-".to_string(), |r| format!("{r:.1}"))
}

/// `a / b`; `None` when `b` is not positive or `a` is not a number.
pub fn ratio(a: f64, b: f64) -> Option<f64> {
    (b > 0.0 && a.is_finite()).then(|| a / b)
}

/// The ratio of two achieved rates; `None` when either was not measured or the second is 0.
pub fn rps_ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    ratio(a?, b?)
}

/// `200 rps`, `1234 rps`, `12.5 rps`.
pub fn fmt_rate(rps: f64) -> String {
    if rps >= 100.0 {
        format!("{rps:.0} rps")
    } else if rps >= 1.0 {
        format!("{rps:.1} rps")
    } else {
        format!("{rps:.3} rps")
    }
}

pub fn fmt_pct(share: f64) -> String {
    format!("{:.1}%", share * 100.0)
}

pub fn fmt_ratio(r: Option<f64>) -> String {
    match r {
        Some(r) if r.is_finite() => format!("{r:.2}x"),
        _ => "-".to_string(),
    }
}

/// UTC timestamp, e.g. `2026-11-22T04:08:00Z`.
pub fn rfc3339(t: SystemTime) -> String {
    let secs = t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()) as i64;
    hydrant::clock::Rfc3339(secs.saturating_mul(1000)).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn formats() {
        assert_eq!(fmt_us(850.0), "850 µs");
        assert_eq!(fmt_us(1_234.0), "1.23 ms");
        assert_eq!(fmt_us(2_500_000.0), "2.50 s");
        assert_eq!(fmt_rate(200.0), "200 rps");
        assert_eq!(fmt_ratio(None), "-");
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00Z");
        assert_eq!(
            rfc3339(UNIX_EPOCH + Duration::from_secs(1_700_000_000)),
            "2023-11-14T22:13:20Z"
        );
        assert_eq!(
            rfc3339(UNIX_EPOCH + Duration::from_secs(951_782_400)),
            "2000-02-29T00:00:00Z"
        );
    }
}
