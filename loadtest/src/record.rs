//! Recording: latency histograms per segment, error counts, and the per-second timeline.
//!
//! A run is a sequence of segments (warm-up, sweep steps, the measured phase; hydrant or floor),
//! one active at a time. Request tasks record into the [`Collector`] behind a std mutex: the
//! critical section is a few counter bumps and a histogram increment, never held across an await.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

use crate::client::{ErrorKind, Outcome};

/// The gateway's stages, in pipeline order, as named in `timings_us` and `/v1/stats`.
pub const STAGES: [&str; 8] = [
    "decode",
    "hydrate",
    "assemble",
    "queue",
    "infer",
    "postprocess",
    "encode",
    "total",
];

/// Highest latency a histogram holds (one hour in microseconds); larger values saturate.
const MAX_US: u64 = 3_600_000_000;
/// Timeline length cap, in one-second buckets.
const MAX_BUCKETS: usize = 90_000;

/// Which server a segment drives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Which {
    Hydrant,
    Floor,
}

impl Which {
    pub fn name(self) -> &'static str {
        match self {
            Which::Hydrant => "hydrant",
            Which::Floor => "floor",
        }
    }

    fn index(self) -> usize {
        match self {
            Which::Hydrant => 0,
            Which::Floor => 1,
        }
    }
}

/// A microsecond histogram, 1 us to 1 h, `sigfig` significant digits.
pub fn histogram(sigfig: u8) -> Histogram<u64> {
    histogram_to(MAX_US, sigfig)
}

/// A microsecond histogram, 1 us to `max_us`.
fn histogram_to(max_us: u64, sigfig: u8) -> Histogram<u64> {
    // Constant, valid bounds (max_us >= 2, sigfig <= 5): this cannot fail.
    Histogram::new_with_bounds(1, max_us, sigfig).expect("constant histogram bounds are valid")
}

fn us(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// One finished (or refused) request.
#[derive(Debug, Clone)]
pub struct Sample {
    /// Intended send time (open loop) or actual send time (closed loop).
    pub at: Instant,
    /// From `at` to the end of the response body.
    pub latency: Duration,
    /// Sent later than the late threshold after its intended time (open loop only).
    pub late: bool,
    pub outcome: Outcome,
}

/// What one segment recorded.
#[derive(Debug, Clone)]
pub struct Segment {
    pub which: Which,
    pub label: String,
    pub measured: bool,
    /// Latencies of successful (2xx) requests, and of those given up at the timeout or abandoned at
    /// Ctrl-C (the time they were open: a lower bound).
    pub hist: Histogram<u64>,
    /// Requests attempted, refused ones (overload) included.
    pub sent: u64,
    pub ok: u64,
    pub late: u64,
    pub errors: BTreeMap<String, u64>,
    pub error_codes: BTreeMap<String, u64>,
    /// Summed `cache` of the answers: hits, stale, misses.
    pub cache: [u64; 3],
    pub cache_replies: u64,
    pub degraded: u64,
    /// Per stage of [`STAGES`], from the answers' `timings_us`.
    pub stages: Vec<Histogram<u64>>,
    /// Time the segment's load ran (set by the driver).
    pub elapsed: Duration,
    /// Open loop: when the schedule started, and when each successful answer completed (µs after it).
    pub schedule: Option<(Instant, Histogram<u64>)>,
    /// Open loop: the time the schedule's sends stand for, one interval each (the duration, or less when
    /// cancelled; a little more when rate × duration is not whole). Closed loop: `elapsed`.
    pub span: Duration,
    /// Achieved rps is `ok_in_window` answers per `window`. Closed loop: all the successful answers,
    /// over `elapsed`. Open loop: the rate at which answers completed while the server's load was
    /// steady, from once the first sends' answers are in (the 99th percentile latency after the
    /// schedule started, at most half its span) until the last sends' answers start to come in (the
    /// span plus the fastest latency); there, answers complete at the rate the server answers. So a
    /// server that keeps up shows the offered rate however slowly and unevenly it answers, and one that
    /// falls behind shows the rate at which it answered, as its backlog completes after the window.
    /// Counted as the completions less one over the time from the first to the last of them (see
    /// [`steady_rate`]). (A window of the span's length shifted by the fastest latency is exact only
    /// when every answer takes the same time: with latencies spread over 0-400 ms it lost the late
    /// answers to the last sends, some 10% of a 2 s run.)
    pub ok_in_window: u64,
    /// The time `ok_in_window` was counted over.
    pub window: Duration,
    /// Driven on a schedule (open loop), so late sends mean something.
    pub open_loop: bool,
}

impl Segment {
    pub fn new(which: Which, label: impl Into<String>, measured: bool) -> Segment {
        Segment {
            which,
            label: label.into(),
            measured,
            hist: histogram(3),
            sent: 0,
            ok: 0,
            late: 0,
            errors: BTreeMap::new(),
            error_codes: BTreeMap::new(),
            cache: [0; 3],
            cache_replies: 0,
            degraded: 0,
            stages: (0..STAGES.len()).map(|_| histogram(2)).collect(),
            elapsed: Duration::ZERO,
            schedule: None,
            span: Duration::ZERO,
            ok_in_window: 0,
            window: Duration::ZERO,
            open_loop: false,
        }
    }

    pub fn record(&mut self, s: &Sample) {
        self.sent += 1;
        if s.late {
            self.late += 1;
        }
        match &s.outcome {
            Outcome::Ok(reply) => {
                self.ok += 1;
                if let Some((start, done)) = self.schedule.as_mut() {
                    let at = (s.at + s.latency).saturating_duration_since(*start);
                    done.saturating_record(us(at).max(1));
                }
                self.hist.saturating_record(us(s.latency).max(1));
                if reply.degraded {
                    self.degraded += 1;
                }
                if let Some(c) = reply.cache {
                    self.cache_replies += 1;
                    for (acc, v) in self.cache.iter_mut().zip(c) {
                        *acc += v;
                    }
                }
                for (h, t) in self.stages.iter_mut().zip(reply.timings) {
                    if let Some(t) = t {
                        // Zero is a valid reading here (a stage a server skips).
                        h.saturating_record(t);
                    }
                }
            }
            Outcome::Failed { kind, code } => {
                // A request given up at the timeout took at least that long: left out, it would let a
                // p99 read below the timeout while many requests exceeded it. So did one abandoned.
                if kind.has_latency() {
                    self.hist.saturating_record(us(s.latency).max(1));
                }
                *self.errors.entry(kind.label()).or_insert(0) += 1;
                if let Some(code) = code {
                    *self.error_codes.entry(code.clone()).or_insert(0) += 1;
                }
            }
        }
    }

    /// Adds `other`'s counts into `self` (the two halves of an alternated phase).
    pub fn merge(&mut self, other: &Segment) {
        // Same bounds on both sides, so adding cannot go out of range.
        let _ = self.hist.add(&other.hist);
        self.sent += other.sent;
        self.ok += other.ok;
        self.late += other.late;
        for (k, v) in &other.errors {
            *self.errors.entry(k.clone()).or_insert(0) += v;
        }
        for (k, v) in &other.error_codes {
            *self.error_codes.entry(k.clone()).or_insert(0) += v;
        }
        for (a, b) in self.cache.iter_mut().zip(other.cache) {
            *a += b;
        }
        self.cache_replies += other.cache_replies;
        self.degraded += other.degraded;
        for (a, b) in self.stages.iter_mut().zip(&other.stages) {
            let _ = a.add(b);
        }
        self.elapsed += other.elapsed;
        self.span += other.span;
        self.ok_in_window += other.ok_in_window;
        self.window += other.window;
        self.open_loop |= other.open_loop;
    }

    /// Closes the segment's books once every answer is in: see `ok_in_window`.
    fn settle(&mut self, elapsed: Duration) {
        self.elapsed = elapsed;
        match self.schedule.take() {
            Some((_, done)) => {
                self.open_loop = true;
                let end = us(self.span).min(done.high());
                let (fastest, p99) = if self.hist.is_empty() {
                    (0, 0)
                } else {
                    (self.hist.min(), self.hist.value_at_quantile(0.99))
                };
                (self.ok_in_window, self.window) = if end == 0 {
                    (0, Duration::ZERO)
                } else {
                    steady_rate(&done, p99.min(end / 2), end.saturating_add(fastest))
                        .unwrap_or_else(|| {
                            // Too few answers for a rate between them (a handful of sends): those
                            // within one schedule length from the fastest answer, per schedule length.
                            let (low, high) = bounds(&done, fastest, fastest.saturating_add(end));
                            (done.count_between(low, high), self.span)
                        })
                };
            }
            None => {
                self.span = elapsed;
                self.window = elapsed;
                self.ok_in_window = self.ok;
            }
        }
    }

    pub fn error_count(&self) -> u64 {
        self.errors.values().sum()
    }

    /// Successful answers per second of load (see `ok_in_window`); `None` when no load was measured
    /// (a run interrupted before the phase's measurement began).
    pub fn achieved_rps(&self) -> Option<f64> {
        let s = self.window.as_secs_f64();
        (s > 0.0).then(|| self.ok_in_window as f64 / s)
    }

    /// Latency at `q` (0..=1) in microseconds, of the successful answers and the timeouts; `None` when
    /// there are none.
    pub fn quantile_us(&self, q: f64) -> Option<u64> {
        (!self.hist.is_empty()).then(|| self.hist.value_at_quantile(q))
    }
}

/// The rate at which answers completed between `from` and `to` (µs after the schedule started), as
/// (intervals, time): the count of completions less one over the time from the first to the last, so
/// that the bounds of the window, which cut between completions, do not bias it: two answers 400 ms
/// apart are 2.5 per second whether the window around them is 0.8 or 1.2 s long. `None` with fewer than
/// two of them at different times.
fn steady_rate(done: &Histogram<u64>, from: u64, to: u64) -> Option<(u64, Duration)> {
    let (low, high) = bounds(done, from, to);
    if high < low {
        return None;
    }
    let mut first = None;
    let mut last = 0;
    let mut count = 0u64;
    for v in done.iter_recorded() {
        let at = done.median_equivalent(v.value_iterated_to());
        if (low..=high).contains(&at) {
            first.get_or_insert(at);
            last = at;
            count += v.count_at_value();
        }
    }
    match first {
        Some(first) if count >= 2 && last > first => {
            Some((count - 1, Duration::from_micros(last - first)))
        }
        _ => None,
    }
}

/// The completion times `from`..=`to` (µs after the schedule started) as the histogram holds them: from
/// 1 µs, where completions are recorded from, to its resolution (0.1%) and within its range.
fn bounds(done: &Histogram<u64>, from: u64, to: u64) -> (u64, u64) {
    (
        done.lowest_equivalent(from.max(1)),
        done.highest_equivalent(to.min(done.high())),
    )
}

/// One second of the timeline.
#[derive(Debug, Clone)]
struct Bucket {
    hist: Histogram<u64>,
    ok: u64,
    errors: u64,
}

/// A point of the latency-over-time chart.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TimelinePoint {
    /// Seconds since the run started (start of the bucket).
    pub t_s: f64,
    pub ok: u64,
    pub errors: u64,
    /// `None` (JSON `null`) for a second in which no request succeeded.
    pub p50_us: Option<u64>,
    pub p99_us: Option<u64>,
    pub max_us: Option<u64>,
}

/// Per-second buckets keyed by intended send time, so a stall shows where it happened.
#[derive(Debug, Clone, Default)]
pub struct Timeline {
    buckets: Vec<Option<Bucket>>,
}

impl Timeline {
    fn record(&mut self, second: usize, s: &Sample) {
        if second >= MAX_BUCKETS {
            return;
        }
        if self.buckets.len() <= second {
            self.buckets.resize(second + 1, None);
        }
        let b = self.buckets[second].get_or_insert_with(|| Bucket {
            hist: histogram(2),
            ok: 0,
            errors: 0,
        });
        match s.outcome {
            Outcome::Ok(_) => {
                b.ok += 1;
                b.hist.saturating_record(us(s.latency).max(1));
            }
            Outcome::Failed { kind, .. } => {
                b.errors += 1;
                if kind.has_latency() {
                    b.hist.saturating_record(us(s.latency).max(1));
                }
            }
        }
    }

    pub fn points(&self) -> Vec<TimelinePoint> {
        self.buckets
            .iter()
            .enumerate()
            .filter_map(|(i, b)| {
                let b = b.as_ref()?;
                let q = |q: f64| (!b.hist.is_empty()).then(|| b.hist.value_at_quantile(q));
                Some(TimelinePoint {
                    t_s: i as f64,
                    ok: b.ok,
                    errors: b.errors,
                    p50_us: q(0.5),
                    p99_us: q(0.99),
                    max_us: (!b.hist.is_empty()).then(|| b.hist.max()),
                })
            })
            .collect()
    }
}

/// What the progress line shows.
#[derive(Debug, Clone)]
pub struct Progress {
    pub label: String,
    pub which: Which,
    pub measured: bool,
    pub elapsed: Duration,
    pub ok: u64,
    pub errors: u64,
    pub late: u64,
    pub sent: u64,
    pub p99_us: Option<u64>,
}

/// Everything recorded so far in a run.
#[derive(Debug)]
pub struct Collector {
    origin: Instant,
    active: Option<(Segment, Instant)>,
    timelines: [Timeline; 2],
}

pub type SharedCollector = Arc<Mutex<Collector>>;

impl Collector {
    pub fn new(origin: Instant) -> Collector {
        Collector {
            origin,
            active: None,
            timelines: [Timeline::default(), Timeline::default()],
        }
    }

    pub fn shared(origin: Instant) -> SharedCollector {
        Arc::new(Mutex::new(Collector::new(origin)))
    }

    pub fn origin(&self) -> Instant {
        self.origin
    }

    /// Makes `seg` the segment that samples go to.
    pub fn begin(&mut self, seg: Segment) {
        self.active = Some((seg, Instant::now()));
    }

    pub fn record(&mut self, s: Sample) {
        let Some((seg, _)) = self.active.as_mut() else {
            return;
        };
        seg.record(&s);
        let second = s.at.saturating_duration_since(self.origin).as_secs() as usize;
        self.timelines[seg.which.index()].record(second, &s);
    }

    /// Open loop: the active segment's schedule starts at `start`; its answers' completion times are
    /// kept until the segment ends, for achieved rps.
    pub fn start_schedule(&mut self, start: Instant) {
        if let Some((seg, _)) = self.active.as_mut() {
            // Completions of a schedule of up to a day (`load.duration_s`), and its drain.
            seg.schedule = Some((start, histogram_to(2 * 86_400_000_000, 3)));
        }
    }

    /// Open loop: the time the schedule's sends stand for (see `Segment::span`).
    pub fn set_span(&mut self, span: Duration) {
        if let Some((seg, _)) = self.active.as_mut() {
            seg.span = span;
        }
    }

    /// Ends the active segment, every answer in; `elapsed` is how long its load ran.
    pub fn end(&mut self, elapsed: Duration) -> Option<Segment> {
        self.active.take().map(|(mut seg, _)| {
            seg.settle(elapsed);
            seg
        })
    }

    pub fn progress(&self) -> Option<Progress> {
        let (seg, started) = self.active.as_ref()?;
        Some(Progress {
            label: seg.label.clone(),
            which: seg.which,
            measured: seg.measured,
            elapsed: started.elapsed(),
            ok: seg.ok,
            errors: seg.error_count(),
            late: seg.late,
            sent: seg.sent,
            p99_us: seg.quantile_us(0.99),
        })
    }

    pub fn timeline(&self, which: Which) -> &Timeline {
        &self.timelines[which.index()]
    }
}

/// Locks the collector, recovering from a poisoned lock (a panicking request task must not stop
/// the report from being written).
pub fn lock(c: &SharedCollector) -> std::sync::MutexGuard<'_, Collector> {
    c.lock().unwrap_or_else(|e| e.into_inner())
}

/// A request still open when the run was stopped and its grace ran out: an error, with the time it had
/// been open (since `at`) as a lower bound of its latency, as for a timeout.
pub fn abandoned_sample(at: Instant, now: Instant) -> Sample {
    Sample {
        at,
        latency: now.saturating_duration_since(at),
        late: false,
        outcome: Outcome::Failed {
            kind: ErrorKind::Abandoned,
            code: None,
        },
    }
}

/// A send refused at `load.max_in_flight`. It counts as late: it never went out on schedule, and a
/// generator that refuses most of its sends is as far behind as one that sends them late.
pub fn overload_sample(at: Instant) -> Sample {
    Sample {
        at,
        latency: Duration::ZERO,
        late: true,
        outcome: Outcome::Failed {
            kind: ErrorKind::Overload,
            code: None,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::Reply;

    fn ok(at: Instant, ms: u64) -> Sample {
        Sample {
            at,
            latency: Duration::from_millis(ms),
            late: false,
            outcome: Outcome::Ok(Reply {
                cache: Some([1, 0, 1]),
                timings: [Some(0), Some(40), None, None, None, None, None, Some(80)],
                ..Reply::default()
            }),
        }
    }

    #[test]
    fn open_loop_achieved_rps_is_the_rate_answered_whatever_the_latency() {
        let origin = Instant::now();
        let ms = Duration::from_millis;
        let run = |latency: &dyn Fn(u64) -> u64| {
            let mut c = Collector::new(origin);
            c.begin(Segment::new(Which::Hydrant, "open", true));
            c.start_schedule(origin);
            // 100 sends at 100/s: one every 10 ms, each half an interval in, so that no answer lands
            // on a bound of the window (to the millisecond, as real answers do not).
            for i in 0..100 {
                c.record(ok(origin + ms(10 * i + 5), latency(i)));
            }
            c.set_span(ms(1000));
            c.end(ms(1000)).expect("segment")
        };
        // Keeping up, slowly: 400 ms each, so the last 40 answers arrive after the schedule.
        let slow = run(&|_| 400);
        assert!(
            (slow.achieved_rps().unwrap_or(f64::NAN) - 100.0).abs() < 1.0,
            "{}",
            slow.achieved_rps().unwrap_or(f64::NAN)
        );
        assert!(slow.open_loop);
        // Keeping up with latencies spread over 0-400 ms: the answers to the last sends arrive after
        // the schedule, some of them long after its fastest answer's latency.
        let mut c = Collector::new(origin);
        c.begin(Segment::new(Which::Hydrant, "spread", true));
        c.start_schedule(origin);
        // 1,000 sends at 1,000/s, latencies scattered over 0-400 ms by a multiplicative hash.
        for i in 0..1000u64 {
            c.record(ok(
                origin + ms(i),
                (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) % 400,
            ));
        }
        c.set_span(ms(1000));
        let spread = c.end(ms(1000)).expect("segment");
        let rps = spread.achieved_rps().unwrap_or(f64::NAN);
        // (The window of the span's length from the fastest answer on counted 801 of them: 801/s.)
        assert!((rps - 1000.0).abs() < 15.0, "{rps}");
        // Falling behind: one answer per 20 ms (50/s), so send i waits 10 ms * i more.
        let behind = run(&|i| 20 + 10 * i);
        assert!(
            (behind.achieved_rps().unwrap_or(f64::NAN) - 50.0).abs() < 3.0,
            "{}",
            behind.achieved_rps().unwrap_or(f64::NAN)
        );
        // Halves merged around a floor segment add their counts and windows.
        let mut merged = slow.clone();
        merged.merge(&behind);
        let both = (slow.ok_in_window + behind.ok_in_window) as f64
            / (slow.window + behind.window).as_secs_f64();
        let rps = merged.achieved_rps().unwrap_or(f64::NAN);
        assert!(
            (rps - both).abs() < 1e-9 && (50.0..100.0).contains(&rps),
            "{rps}"
        );
        // Two sends at 2/s, answered in 1 and 1.1 ms: too few for a rate between answers; the two
        // within one schedule length of the fastest are 2 per second.
        let mut c = Collector::new(origin);
        c.begin(Segment::new(Which::Hydrant, "two", true));
        c.start_schedule(origin);
        c.record(ok(origin, 1));
        let mut second = ok(origin + ms(500), 1);
        second.latency = Duration::from_micros(1100);
        c.record(second);
        c.set_span(ms(1000));
        let two = c.end(ms(1000)).expect("segment");
        assert_eq!(two.achieved_rps(), Some(2.0));
        // Nothing answered: 0, not NaN.
        let mut c = Collector::new(origin);
        c.begin(Segment::new(Which::Hydrant, "none", true));
        c.start_schedule(origin);
        c.record(overload_sample(origin));
        c.set_span(ms(1000));
        assert_eq!(c.end(ms(1000)).expect("segment").achieved_rps(), Some(0.0));
        // Nothing measured (cut short before the measurement began): no rate at all, not 0.
        let mut c = Collector::new(origin);
        c.begin(Segment::new(Which::Hydrant, "cut", true));
        assert_eq!(c.end(ms(0)).expect("segment").achieved_rps(), None);
    }

    #[test]
    fn segments_and_timeline() {
        let origin = Instant::now();
        let mut c = Collector::new(origin);
        c.record(ok(origin, 1)); // no active segment: ignored
        c.begin(Segment::new(Which::Hydrant, "a", true));
        for _ in 0..99 {
            c.record(ok(origin, 10));
        }
        c.record(ok(origin + Duration::from_secs(2), 500));
        c.record(overload_sample(origin));
        let seg = c.end(Duration::from_secs(2)).expect("segment");
        assert_eq!((seg.ok, seg.sent, seg.error_count()), (100, 101, 1));
        assert_eq!(seg.errors.get("overload"), Some(&1));
        assert_eq!(seg.late, 1, "a refused send never went out on time");
        assert_eq!(seg.cache, [100, 0, 100]);
        assert!((seg.achieved_rps().unwrap_or(f64::NAN) - 50.0).abs() < 1e-9);
        let p50 = seg.quantile_us(0.5).expect("answers were measured");
        assert!((9_900..=10_100).contains(&p50), "{p50}");
        let empty = Segment::new(Which::Floor, "b", true);
        assert_eq!(
            empty.quantile_us(0.99),
            None,
            "nothing measured is not 0 µs"
        );
        assert_eq!(seg.stages[0].value_at_quantile(0.99), 0);
        assert_eq!(seg.stages[1].value_at_quantile(0.5), 40);
        assert!(seg.stages[2].is_empty());
        let points = c.timeline(Which::Hydrant).points();
        assert_eq!(points.len(), 2);
        assert_eq!(points[1].t_s, 2.0);
        assert!(points[1].max_us >= Some(499_000));

        let mut merged = seg.clone();
        merged.merge(&seg);
        assert_eq!(merged.ok, 200);
        assert_eq!(merged.elapsed, Duration::from_secs(4));
    }
}
