//! The drivers: open loop (fixed schedule) and closed loop (N workers back to back).
//!
//! Open loop is what product traffic looks like: requests arrive on their own clock whether or not
//! the server keeps up. Request i is due at `t0 + i/rate`, and its latency is measured from that
//! *intended* time, so a server stall shows up in every request that should have been sent during
//! it (no coordinated omission). The schedule runs on a blocking thread with `std::thread::sleep`
//! (tens of microseconds of jitter) rather than tokio's millisecond timer wheel, which would make
//! every send look up to a millisecond late.
//!
//! Closed loop finds throughput: each worker sends its next request when the previous answer
//! arrives, and latency is measured from the actual send.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hyper::body::Bytes;
use hyper::{Method, Uri};
use tokio::sync::{Semaphore, mpsc, watch};
use tokio::task::JoinSet;

use crate::client::{ErrorKind, ExchangeError, Outcome, Pool, classify};
use crate::record::{Sample, SharedCollector, abandoned_sample, lock, overload_sample};
use crate::sample::stream_seed;
use crate::scenario::Scenario;
use crate::workload::Workload;

/// Hard cap on requests one segment may start, whatever the rate and duration. Scenario validation
/// refuses an open-loop rate x duration past it; a schedule it stops anyway (max-then-fraction's
/// rate is known only after the sweep) reports the time its sends covered, not the duration.
pub const MAX_REQUESTS_PER_SEGMENT: u64 = 100_000_000;
/// Longest single sleep of the scheduler, so it notices cancellation promptly.
const MAX_SLEEP: Duration = Duration::from_millis(50);
/// Shortest sleep: at high rates the schedule wakes at most every 100 us and sends what is due
/// as one batch (far below the 1 ms late threshold, far fewer wake-ups than one per request).
const MIN_SLEEP: Duration = Duration::from_micros(100);
/// Pause after a refused connection in closed loop, so a dead target is not hammered in a spin.
const CONNECT_BACKOFF: Duration = Duration::from_millis(10);
/// After Ctrl-C, how long requests still in flight get to finish before they are abandoned (counted
/// as `abandoned`, with the time they were open), so the report is written promptly even against a
/// server that hangs.
const CANCEL_GRACE: Duration = Duration::from_millis(500);

/// Cooperative cancellation (Ctrl-C), visible to async tasks and to the scheduler thread.
#[derive(Debug, Clone)]
pub struct Cancel {
    tx: Arc<watch::Sender<bool>>,
}

impl Default for Cancel {
    fn default() -> Self {
        Cancel::new()
    }
}

impl Cancel {
    pub fn new() -> Cancel {
        Cancel {
            tx: Arc::new(watch::Sender::new(false)),
        }
    }

    pub fn cancel(&self) {
        self.tx.send_replace(true);
    }

    pub fn is_cancelled(&self) -> bool {
        *self.tx.borrow()
    }

    /// Resolves once [`Cancel::cancel`] was called.
    pub async fn cancelled(&self) {
        let mut rx = self.tx.subscribe();
        // The sender lives in `self`, so this only returns once the value is true.
        let _ = rx.wait_for(|v| *v).await;
    }

    /// Runs `work` to its end, or until [`CANCEL_GRACE`] after a cancellation, whichever is first.
    /// Returns whether `work` finished.
    async fn or_grace(&self, work: impl std::future::Future<Output = ()>) -> bool {
        tokio::select! {
            () = work => true,
            () = async {
                self.cancelled().await;
                tokio::time::sleep(CANCEL_GRACE).await;
            } => false,
        }
    }
}

/// What a driver needs to send predict requests to one server.
pub struct Driver {
    pub pool: Arc<Pool>,
    pub collector: SharedCollector,
    pub scenario: Arc<Scenario>,
    pub cancel: Cancel,
    predict_uri: Uri,
}

impl Driver {
    pub fn new(
        pool: Arc<Pool>,
        collector: SharedCollector,
        scenario: Arc<Scenario>,
        cancel: Cancel,
    ) -> Result<Driver, ExchangeError> {
        let predict_uri = pool.uri(&format!("/v1/models/{}/predict", scenario.model))?;
        Ok(Driver {
            pool,
            collector,
            scenario,
            cancel,
            predict_uri,
        })
    }

    /// Sends one predict; with its outcome, the instant its answer was in (or it failed), taken before
    /// the answer is read for the report, so that reading it is not counted in the latency.
    async fn predict(&self, body: Bytes) -> (Outcome, Instant) {
        let answer = self
            .pool
            .send(
                Method::POST,
                self.predict_uri.clone(),
                Some(self.scenario.format),
                body,
                self.scenario.timeout,
            )
            .await;
        let done = Instant::now();
        (classify(answer), done)
    }

    fn record(&self, s: Sample) {
        lock(&self.collector).record(s);
    }
}

/// One bit per send of an open-loop schedule, set by whoever accounts for the send first: its own task
/// when the answer is in, or the driver when it abandons the sends still open after Ctrl-C. So a send
/// is counted once, whichever comes first, with no lock on the request's path.
struct Claims(Vec<std::sync::atomic::AtomicU64>);

impl Claims {
    fn new(sends: u64) -> Claims {
        let words = usize::try_from(sends.div_ceil(64)).unwrap_or(0);
        Claims((0..words).map(|_| Default::default()).collect())
    }

    /// Claims send `i`: true for the first caller only.
    fn claim(&self, i: u64) -> bool {
        let bit = 1u64 << (i % 64);
        usize::try_from(i / 64)
            .ok()
            .and_then(|w| self.0.get(w))
            .is_none_or(|w| w.fetch_or(bit, std::sync::atomic::Ordering::AcqRel) & bit == 0)
    }

    /// Claims every send below `sent` not yet claimed, and answers which they were.
    fn claim_rest(&self, sent: u64) -> Vec<u64> {
        let mut rest = Vec::new();
        for (w, word) in self.0.iter().enumerate() {
            let base = w as u64 * 64;
            if base >= sent {
                break;
            }
            let mask = if sent - base >= 64 {
                u64::MAX
            } else {
                (1u64 << (sent - base)) - 1
            };
            let was = word.fetch_or(mask, std::sync::atomic::Ordering::AcqRel);
            let mut open = !was & mask;
            while open != 0 {
                rest.push(base + u64::from(open.trailing_zeros()));
                open &= open - 1;
            }
        }
        rest
    }
}

/// Open loop at `rate` for `duration`; `stream` seeds the request mix. In-flight requests are
/// awaited before returning; after Ctrl-C, for [`CANCEL_GRACE`] at most, and those still open then
/// are counted as abandoned, with the time since their intended send as their latency. Returns the
/// time the schedule covered (shorter when cancelled). The segment learns when the schedule started
/// and the time its sends stand for, for achieved rps (`Segment::ok_in_window`).
///
/// The schedule thread builds the bodies and hands the due sends over in batches; this task
/// (on a runtime worker) spawns them, so a spawn goes to the worker's local queue instead of
/// waking a worker from outside once per request.
pub async fn open_loop(d: &Arc<Driver>, rate: f64, duration: Duration, stream: u64) -> Duration {
    let cap = d.scenario.load.max_in_flight.max(1);
    let sem = Arc::new(Semaphore::new(cap));
    let planned = (rate * duration.as_secs_f64()).ceil();
    let claims = Arc::new(Claims::new((planned as u64).min(MAX_REQUESTS_PER_SEGMENT)));
    let (tx, mut rx) = mpsc::unbounded_channel::<Vec<(Instant, Bytes)>>();
    let d2 = d.clone();
    let scheduler = tokio::task::spawn_blocking(move || schedule(&d2, &tx, rate, duration, stream));
    // The schedule's sends arrive in order, so each one's place in it is a count; the first is due
    // when the schedule starts.
    let mut sent = 0u64;
    let mut t0 = None;
    // Ends when the scheduler finishes and drops its sender: bounded like the schedule.
    while let Some(batch) = rx.recv().await {
        for (intended, body) in batch {
            let i = sent;
            sent += 1;
            t0.get_or_insert(intended);
            match sem.clone().try_acquire_owned() {
                Ok(permit) => {
                    let d = d.clone();
                    let claims = claims.clone();
                    tokio::spawn(async move {
                        let late = Instant::now().saturating_duration_since(intended)
                            > d.scenario.load.late_threshold;
                        let (outcome, done) = d.predict(body).await;
                        // Abandoned at Ctrl-C meanwhile: counted then.
                        if claims.claim(i) {
                            let latency = done.saturating_duration_since(intended);
                            d.record(Sample {
                                at: intended,
                                latency,
                                late,
                                outcome,
                            });
                        }
                        drop(permit);
                    });
                }
                // Over the in-flight cap: counted as an error, never silently skipped.
                Err(_) => {
                    claims.claim(i);
                    d.record(overload_sample(intended));
                }
            }
        }
    }
    let (covered, span) = match scheduler.await {
        Ok(done) => done,
        // A bug in the schedule is a bug, not a run that sent nothing.
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(_) => Default::default(),
    };
    lock(&d.collector).set_span(span);
    // Every request is bounded by the request timeout, so the drain is too.
    let drain = d.scenario.timeout + Duration::from_secs(2);
    let permits = u32::try_from(cap).unwrap_or(u32::MAX);
    let drained = d
        .cancel
        .or_grace(async {
            let _ = tokio::time::timeout(drain, sem.acquire_many(permits)).await;
        })
        .await;
    if !drained && let Some(t0) = t0 {
        let now = Instant::now();
        for i in claims.claim_rest(sent) {
            let due = due_at(t0, 1.0 / rate, i).unwrap_or(now);
            d.record(abandoned_sample(due, now));
        }
    }
    covered
}

/// Runs the fixed schedule on a blocking thread: every due send (intended time, body) goes to
/// `tx`, batched per wake-up. Returns the time the schedule covered and the time its sends stand
/// for, one interval each: 3 s at 0.4/s sends at 0 and 2.5 s, which stand for 5 s, not 3. A schedule
/// stopped by [`MAX_REQUESTS_PER_SEGMENT`] covered only the time its sends stand for.
fn schedule(
    d: &Arc<Driver>,
    tx: &mpsc::UnboundedSender<Vec<(Instant, Bytes)>>,
    rate: f64,
    duration: Duration,
    stream: u64,
) -> (Duration, Duration) {
    let mut wl = Workload::new(&d.scenario, stream_seed(d.scenario.seed, stream));
    let interval = 1.0 / rate;
    let planned = (rate * duration.as_secs_f64()).ceil();
    let capped = planned > MAX_REQUESTS_PER_SEGMENT as f64;
    let max_sends = (planned as u64).min(MAX_REQUESTS_PER_SEGMENT);
    // The body of the next send, built before its time comes (the first before the schedule starts):
    // building one can take milliseconds (a thousand distinct candidates from a skewed key space),
    // which would otherwise make its send late and count in its latency.
    let mut next = Some(wl.next_body());
    let t0 = Instant::now();
    // Completion times are measured from the instant the sends are timed from.
    lock(&d.collector).start_schedule(t0);
    let end = t0 + duration;
    // Past what a Duration or an Instant holds (a rate so low that the next send is centuries
    // away), a send is due after the end, and the span is the longest there is: never a panic.
    let after = |sent: u64| Duration::try_from_secs_f64(sent as f64 * interval).ok();
    let due = |i: u64| due_at(t0, interval, i).unwrap_or(end);
    let mut i = 0u64;
    let span = |sent: u64| after(sent).unwrap_or(Duration::MAX);
    while i < max_sends {
        if d.cancel.is_cancelled() {
            return (t0.elapsed().min(duration), span(i));
        }
        let now = Instant::now();
        let mut batch = Vec::new();
        while i < max_sends && due(i) <= now && due(i) < end {
            let body = next.take().unwrap_or_else(|| wl.next_body());
            batch.push((due(i), body));
            i += 1;
        }
        if !batch.is_empty() && tx.send(batch).is_err() {
            break;
        }
        if i >= max_sends || due(i) >= end {
            break;
        }
        // Built once the due sends are handed over, not among them: building it there would hold them.
        if next.is_none() {
            next = Some(wl.next_body());
        }
        let wait = due(i).saturating_duration_since(Instant::now());
        if !wait.is_zero() {
            std::thread::sleep(wait.max(MIN_SLEEP).min(MAX_SLEEP));
        }
    }
    if capped && i >= max_sends {
        return (span(i).min(duration), span(i));
    }
    // The segment lasts its whole duration, not until its last send: the next segment's first send
    // then comes one interval after this one's last, as the schedule would have had it, rather than
    // at once (at 2 rps, a warm-up of 1 s would otherwise end at 0.5 s, and send twice in a row).
    while !d.cancel.is_cancelled() {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        std::thread::sleep(left.min(MAX_SLEEP));
    }
    (duration, span(i))
}

/// When send `i` of a schedule that started at `t0`, one every `interval` seconds, is due; `None` past
/// what an `Instant` holds.
fn due_at(t0: Instant, interval: f64, i: u64) -> Option<Instant> {
    Duration::try_from_secs_f64(i as f64 * interval)
        .ok()
        .and_then(|d| t0.checked_add(d))
}

/// Closed loop with `concurrency` workers for `duration`. Returns the time until the last worker
/// finished its last request (after Ctrl-C, requests still open after [`CANCEL_GRACE`] are
/// abandoned).
pub async fn closed_loop(
    d: &Arc<Driver>,
    concurrency: usize,
    duration: Duration,
    stream: u64,
) -> Duration {
    let start = Instant::now();
    let end = start + duration;
    let per_worker = MAX_REQUESTS_PER_SEGMENT / concurrency.max(1) as u64;
    let mut set = JoinSet::new();
    for w in 0..concurrency {
        let d = d.clone();
        let seed = stream_seed(d.scenario.seed, stream.wrapping_mul(1_000_003) + w as u64);
        set.spawn(async move {
            let mut wl = Workload::new(&d.scenario, seed);
            let mut n = 0u64;
            while n < per_worker && Instant::now() < end && !d.cancel.is_cancelled() {
                let body = wl.next_body();
                let at = Instant::now();
                // Dropped with the task when it is abandoned after Ctrl-C: counts the request then.
                let open = Open { d: &d, at };
                let (outcome, done) = d.predict(body).await;
                std::mem::forget(open);
                let refused = matches!(
                    outcome,
                    Outcome::Failed {
                        kind: ErrorKind::Connect,
                        ..
                    }
                );
                d.record(Sample {
                    at,
                    latency: done.saturating_duration_since(at),
                    late: false,
                    outcome,
                });
                n += 1;
                if refused {
                    tokio::time::sleep(CONNECT_BACKOFF).await;
                }
            }
        });
    }
    let finished = d
        .cancel
        .or_grace(async { while set.join_next().await.is_some() {} })
        .await;
    if !finished {
        // Each aborted worker's request is counted as it is dropped; the segment ends after that.
        set.abort_all();
        while set.join_next().await.is_some() {}
    }
    start.elapsed()
}

/// A closed-loop request on its way: if its task is dropped before the answer (abandoned after
/// Ctrl-C), it is counted as abandoned, with the time it was open.
struct Open<'a> {
    d: &'a Driver,
    at: Instant,
}

impl Drop for Open<'_> {
    fn drop(&mut self) {
        self.d.record(abandoned_sample(self.at, Instant::now()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_send_is_claimed_once_by_its_answer_or_by_the_abandoning() {
        let claims = Claims::new(130);
        // Answered: 0, 63, 64 and 100; 129 was scheduled but not sent when the run stopped.
        for i in [0, 63, 64, 100] {
            assert!(claims.claim(i));
        }
        assert!(!claims.claim(64), "a send is counted once");
        let rest = claims.claim_rest(129);
        let expected: Vec<u64> = (0..129).filter(|i| ![0, 63, 64, 100].contains(i)).collect();
        assert_eq!(rest, expected);
        // An answer that comes after the abandoning is not counted again; nor is a second sweep.
        assert!(!claims.claim(5));
        assert!(claims.claim_rest(129).is_empty());
        assert!(claims.claim(129), "the send never made is nobody's yet");
        // Past the sends planned (a schedule of rate x duration rounded): answers count as themselves.
        assert!(claims.claim(10_000) && claims.claim(10_000));
    }
}
