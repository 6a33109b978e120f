//! The queue between request tasks and one model's session threads, and when it wakes a sleeping session.
//!
//! A general channel (crossbeam's, std's) wakes a sleeping receiver for every message, and every receiver
//! that finds the channel empty spins and calls `sched_yield` a few times before it sleeps. Both are right
//! for a channel whose receivers are few and whose messages are expensive; neither is for a pool of
//! sessions that answer a small model in a few microseconds on a machine with few cores, where the session
//! threads share the cores with the async workers that feed them and with whatever else runs there. With
//! the load tester on the same two cores, `strace` counted 1.8 `sched_yield` and 0.7 `futex` calls per
//! request, and the gateway spent 57 µs of CPU per hot-path request against 42 µs with this queue (the
//! README's benchmark notes).
//!
//! This queue makes four choices instead:
//!
//! - One session at a time searches: it spins briefly, then yields the core a few times
//!   ([`SEARCH_SPINS`], [`SEARCH_YIELDS`]), looking for the next job before it sleeps. The others sleep at
//!   once, each on its own condition variable.
//! - A push wakes a sleeping session only when no session is awake to take the job, when the awake ones
//!   are expected to stay busy for longer than waking another costs (their recent run time is over
//!   [`WAKE_WORTH`]), or when more rows are queued than the awake sessions take in their next batches.
//!   An awake session takes what was queued while it ran, so a fast model under load is served by few
//!   sessions in batches, and a slow one gets every session it has.
//! - An awake session takes its share of the queue in one step: what is queued divided among the sessions
//!   that are awake, up to the room left in its batch.
//! - A session that is gathering a batch for `max_delay_us` is woken by every push, as it waits for company.
//! - The reaper, which sheds what no session took in time, sleeps until the earliest expiry among the
//!   queued jobs, or for [`REAPER_LINGER`] when the queue is empty, and until a push only when it was
//!   empty that long. A push wakes it only when the new job expires before its wake-up time: a request
//!   with a tight `deadline_ms`, not the steady stream of jobs under load or a light load's sparse ones.
//!
//! Every change to who is asleep, searching or gathering is made under the one lock, together with the
//! look at the queue that decided it, so a push cannot slip between a session's last look and its sleep.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// How long the awake sessions may be expected to stay busy before a push wakes a sleeping one: about
/// what waking a thread costs in time to its first instruction on a loaded machine.
pub const WAKE_WORTH: Duration = Duration::from_micros(40);

/// Busy-wait rounds of the searching session before it starts yielding: about a microsecond, for a job
/// pushed while it finished its batch.
pub const SEARCH_SPINS: usize = 64;

/// Times the searching session yields its core before it sleeps: a push from an async worker that was
/// waiting for the core is taken without a wake-up. Sleeping at once cost 8 µs of CPU per hot-path request
/// more under `wrk`; 32 yields instead of 8 made no difference.
pub const SEARCH_YIELDS: usize = 8;

/// How long the reaper keeps a timed sleep after it found the queue empty, before it sleeps until a push.
pub const REAPER_LINGER: Duration = Duration::from_millis(100);

/// What the queue needs to know of a job: how many rows it adds to a batch, and when it must be shed if
/// no session has taken it.
pub trait Rows {
    fn rows(&self) -> usize;
    fn expires(&self) -> Instant;
}

/// What the reaper is doing, as a push needs to know it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reaper {
    /// Looking at the queue: it sees any job pushed now before it sleeps.
    Awake,
    /// Asleep until a push (the queue was empty).
    Idle,
    /// Asleep until this instant: the earliest expiry it saw, or the end of its linger on an empty queue.
    Until(Instant),
}

/// Why a push was refused; the job comes back.
#[derive(Debug)]
pub enum PushError<T> {
    Full(T),
    Closed(T),
}

struct State<T> {
    jobs: VecDeque<T>,
    /// The rows of the queued jobs.
    rows: usize,
    /// Sessions asleep with nothing to do, the most recent last (woken first: its caches are warm).
    idle: Vec<usize>,
    /// Sessions waiting for company for a batch until a deadline.
    gathering: Vec<usize>,
    /// Per session: a push chose it, so its wait is over.
    woken: Vec<bool>,
    /// A session is looking for work before it sleeps: a push need wake nobody.
    searching: bool,
    /// The reaper's state: whether a push must wake it.
    reaper: Reaper,
    /// Sessions whose thread still runs.
    alive: usize,
    closed: bool,
}

impl<T> State<T> {
    /// Sessions neither asleep nor gone: each takes what is queued before it sleeps.
    fn awake(&self) -> usize {
        self.alive - self.idle.len() - self.gathering.len()
    }
}

/// A bounded queue of jobs for `workers` sessions.
pub struct Dispatch<T> {
    state: Mutex<State<T>>,
    /// One per session, so a push wakes exactly the session it chose.
    bells: Box<[Condvar]>,
    /// The reaper's, rung by a push it would otherwise sleep past.
    reaper_bell: Condvar,
    capacity: usize,
    /// Jobs queued now, readable without the lock.
    len: AtomicUsize,
    /// An exponentially weighted average of the sessions' recent run times, in nanoseconds.
    run_ns: AtomicU64,
    /// Rows one session takes in a batch: a backlog of more than the awake sessions take in their next
    /// batches wakes another, however fast the runs are.
    batch_rows: usize,
}

impl<T: Rows> Dispatch<T> {
    /// A queue of at most `capacity` jobs for `workers` sessions that each take up to `batch_rows` rows
    /// in a batch.
    pub fn new(capacity: usize, workers: usize, batch_rows: usize) -> Self {
        let workers = workers.max(1);
        Self {
            state: Mutex::new(State {
                jobs: VecDeque::with_capacity(capacity.min(4096)),
                rows: 0,
                idle: Vec::with_capacity(workers),
                gathering: Vec::with_capacity(workers),
                woken: vec![false; workers],
                searching: false,
                reaper: Reaper::Awake,
                alive: workers,
                closed: false,
            }),
            bells: (0..workers).map(|_| Condvar::new()).collect(),
            reaper_bell: Condvar::new(),
            capacity,
            len: AtomicUsize::new(0),
            run_ns: AtomicU64::new(0),
            batch_rows: batch_rows.max(1),
        }
    }

    /// Rows one session takes in a batch at most.
    pub fn batch_rows(&self) -> usize {
        self.batch_rows
    }

    /// Jobs waiting for a session now.
    pub fn len(&self) -> usize {
        self.len.load(Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The first job in line, if any, out of the queue and its counts.
    fn pop(&self, s: &mut State<T>) -> Option<T> {
        let job = s.jobs.pop_front()?;
        s.rows -= job.rows();
        self.len.store(s.jobs.len(), Relaxed);
        Some(job)
    }

    /// Moves jobs from the front of the queue into `batch`, which holds `rows` rows: at most `limit` jobs,
    /// and no job that would take the batch past `max_rows` (it stays first in line). Answers the batch's
    /// rows, and whether a job was left because it did not fit.
    fn take(
        &self,
        s: &mut State<T>,
        mut rows: usize,
        max_rows: usize,
        limit: usize,
        batch: &mut Vec<T>,
    ) -> (usize, bool) {
        for _ in 0..limit {
            let Some(next) = s.jobs.front() else { break };
            if rows + next.rows() > max_rows {
                return (rows, true);
            }
            rows += next.rows();
            batch.extend(self.pop(s));
        }
        (rows, false)
    }

    fn lock(&self) -> MutexGuard<'_, State<T>> {
        // No code holding the lock can panic (it only moves jobs and indices), and if some did, the state
        // is still consistent: every change to it is one push or pop.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues `job`, waking a session if one should take it now.
    pub fn push(&self, job: T) -> Result<(), PushError<T>> {
        let mut s = self.lock();
        if s.closed {
            return Err(PushError::Closed(job));
        }
        if s.jobs.len() >= self.capacity {
            return Err(PushError::Full(job));
        }
        let expires = job.expires();
        s.rows += job.rows();
        s.jobs.push_back(job);
        self.len.store(s.jobs.len(), Relaxed);
        let sooner = match s.reaper {
            Reaper::Awake => false,
            Reaper::Idle => true,
            Reaper::Until(at) => expires < at,
        };
        if sooner {
            // Rare under load: the queued jobs expire in the order they came, unless a caller set a
            // tighter deadline than those before it.
            s.reaper = Reaper::Awake;
            self.reaper_bell.notify_one();
        }
        let wake = if let Some(w) = s.gathering.pop() {
            Some(w)
        } else if s.searching {
            None
        } else if s.awake() == 0
            || self.run_ns.load(Relaxed) > WAKE_WORTH.as_nanos() as u64
            || s.rows > s.awake() * self.batch_rows
        {
            s.idle.pop()
        } else {
            None
        };
        self.ring(s, wake);
        Ok(())
    }

    /// Wakes session `wake`, if any: marks it woken under the lock, then rings its bell after letting the
    /// lock go, so the session does not wake only to wait for the lock.
    fn ring(&self, mut s: MutexGuard<'_, State<T>>, wake: Option<usize>) {
        let Some(w) = wake else { return };
        s.woken[w] = true;
        drop(s);
        self.bells[w].notify_one();
    }

    /// The reaper's round: sleeps until a queued job expires (a job pushed meanwhile that expires sooner
    /// wakes it), then moves every job that has expired into `out`, keeping the others in order. Answers
    /// false once the queue is closed.
    pub fn reap(&self, out: &mut Vec<T>) -> bool {
        let mut s = self.lock();
        // Whether the queue was empty a whole [`REAPER_LINGER`] ago too: only then does the reaper sleep
        // until a push, so that under light load, where sessions take each job at once, a push does not
        // wake it every time (a system call on the request's path).
        let mut lingered = false;
        loop {
            s.reaper = Reaper::Awake;
            if s.closed {
                return false;
            }
            let now = Instant::now();
            let next = s.jobs.iter().map(Rows::expires).min();
            if next.is_some_and(|at| at <= now) {
                let mut kept = VecDeque::with_capacity(s.jobs.len());
                for job in s.jobs.drain(..) {
                    if job.expires() <= now {
                        out.push(job);
                    } else {
                        kept.push_back(job);
                    }
                }
                s.jobs = kept;
                s.rows = s.jobs.iter().map(Rows::rows).sum();
                self.len.store(s.jobs.len(), Relaxed);
                return true;
            }
            let until = match next {
                Some(at) => {
                    lingered = false;
                    at
                }
                None if !lingered => {
                    lingered = true;
                    now + REAPER_LINGER
                }
                None => {
                    s.reaper = Reaper::Idle;
                    s = self
                        .reaper_bell
                        .wait(s)
                        .unwrap_or_else(PoisonError::into_inner);
                    lingered = false;
                    continue;
                }
            };
            s.reaper = Reaper::Until(until);
            s = self
                .reaper_bell
                .wait_timeout(s, until.saturating_duration_since(now))
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Whether the reaper sleeps until a push (a push would wake it).
    #[cfg(test)]
    fn reaper_idle(&self) -> bool {
        self.lock().reaper == Reaper::Idle
    }

    /// Refuses further pushes and wakes every session: each takes what is still queued, then [`next`]
    /// answers false.
    ///
    /// [`next`]: Dispatch::next
    pub fn close(&self) {
        let mut s = self.lock();
        let s = &mut *s;
        s.closed = true;
        self.reaper_bell.notify_one();
        let sleeping: Vec<usize> = s.idle.drain(..).chain(s.gathering.drain(..)).collect();
        for &w in &sleeping {
            s.woken[w] = true;
        }
        for w in sleeping {
            self.bells[w].notify_one();
        }
    }

    /// Session `me`'s next batch: blocks until a job is queued, then puts it and the session's share of the
    /// rest (up to `max_rows` rows in all) in `batch`. Answers false once the queue is closed and empty.
    pub fn next(&self, me: usize, max_rows: usize, batch: &mut Vec<T>) -> bool {
        let mut s = self.lock();
        loop {
            if let Some(first) = self.pop(&mut s) {
                let rows = first.rows();
                batch.push(first);
                // The session's share: what is queued divided among the sessions awake to take it.
                let share = s.jobs.len().div_ceil(s.awake().max(1));
                self.take(&mut s, rows, max_rows, share, batch);
                return true;
            }
            if s.closed {
                return false;
            }
            if !s.searching {
                s.searching = true;
                drop(s);
                self.search();
                s = self.lock();
                s.searching = false;
                if !s.jobs.is_empty() || s.closed {
                    continue;
                }
            }
            s.woken[me] = false;
            s.idle.push(me);
            while !s.woken[me] {
                s = self.bells[me]
                    .wait(s)
                    .unwrap_or_else(PoisonError::into_inner);
            }
        }
    }

    /// Adds to `batch` (now `rows` rows) what else is queued until `until`, up to `max_rows` rows: for a
    /// model that batches with a delay. Answers the rows of the batch.
    pub fn gather(
        &self,
        me: usize,
        mut rows: usize,
        max_rows: usize,
        until: Instant,
        batch: &mut Vec<T>,
    ) -> usize {
        let mut s = self.lock();
        loop {
            let (taken, full) = self.take(&mut s, rows, max_rows, usize::MAX, batch);
            rows = taken;
            let now = Instant::now();
            if full || rows >= max_rows || now >= until || s.closed {
                return rows;
            }
            s.woken[me] = false;
            s.gathering.push(me);
            let (guard, _) = self.bells[me]
                .wait_timeout(s, until - now)
                .unwrap_or_else(PoisonError::into_inner);
            s = guard;
            if !s.woken[me] {
                s.gathering.retain(|&w| w != me);
            }
        }
    }

    /// Looks for a job for a while without the lock, yielding the core to the threads that may be about to
    /// push one; answers when one is queued or the time is up.
    fn search(&self) {
        for _ in 0..SEARCH_SPINS {
            if !self.is_empty() {
                return;
            }
            std::hint::spin_loop();
        }
        for _ in 0..SEARCH_YIELDS {
            if !self.is_empty() {
                return;
            }
            std::thread::yield_now();
        }
    }

    /// Session `me` is gone (its thread ends, or unwinds). The last one to go closes the queue and drops
    /// what is still queued, so no caller waits for an answer that cannot come; otherwise a sleeping
    /// session is woken if the queue holds jobs and no session is awake to take them.
    pub fn leave(&self, me: usize) {
        let mut s = self.lock();
        s.idle.retain(|&w| w != me);
        s.gathering.retain(|&w| w != me);
        s.alive = s.alive.saturating_sub(1);
        if s.alive == 0 {
            s.closed = true;
            self.reaper_bell.notify_one();
            let orphans = std::mem::take(&mut s.jobs);
            s.rows = 0;
            self.len.store(0, Relaxed);
            drop(s);
            drop(orphans);
            return;
        }
        let wake = if !s.jobs.is_empty() && s.awake() == 0 {
            s.idle.pop().or_else(|| s.gathering.pop())
        } else {
            None
        };
        self.ring(s, wake);
    }

    /// Records how long a batch took to run, for the choice of whether a push wakes another session.
    pub fn ran(&self, took: Duration) {
        let took = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        let old = self.run_ns.load(Relaxed);
        // Weight 1/8: a few slow runs (a large batch, a preempted thread) move it, one does not.
        let new = if old == 0 {
            took
        } else {
            old - old / 8 + took / 8
        };
        self.run_ns.store(new, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::mpsc;

    #[derive(Debug)]
    struct Job(usize);

    impl Rows for Job {
        fn rows(&self) -> usize {
            self.0
        }
        fn expires(&self) -> Instant {
            Instant::now() + Duration::from_secs(3600)
        }
    }

    /// A job that expires at a given instant, for the reaper.
    #[derive(Debug)]
    struct Timed(usize, Instant);

    impl Rows for Timed {
        fn rows(&self) -> usize {
            1
        }
        fn expires(&self) -> Instant {
            self.1
        }
    }

    #[test]
    fn an_empty_queue_keeps_the_reaper_on_a_timer_for_a_while_before_a_push_would_wake_it() {
        let q = Arc::new(Dispatch::<Timed>::new(8, 1, 64));
        let reaper = {
            let q = q.clone();
            std::thread::spawn(move || {
                let mut out = Vec::new();
                while q.reap(&mut out) {
                    out.clear();
                }
            })
        };
        let idle_within = |bound: Duration| {
            let until = Instant::now() + bound + WAIT;
            while !q.reaper_idle() {
                assert!(Instant::now() < until, "the reaper never went to sleep");
                std::thread::sleep(Duration::from_millis(5));
            }
        };
        // An empty queue from the start: after the linger, it sleeps until a push.
        idle_within(REAPER_LINGER);
        // A push wakes it, and the job is taken at once, as a searching session takes it under light
        // load (most often before the reaper looks).
        q.push(Timed(1, Instant::now() + Duration::from_millis(300)))
            .expect("queued");
        let mut batch = Vec::new();
        assert!(q.next(0, 16, &mut batch));
        assert_eq!(batch.len(), 1);
        std::thread::sleep(Duration::from_millis(20));
        // Finding the queue empty again, it keeps a timer: the next sparse push need not wake it.
        assert!(
            !q.reaper_idle(),
            "the next push would wake the reaper again"
        );
        idle_within(Duration::from_millis(300) + REAPER_LINGER);
        q.close();
        reaper.join().expect("reaper thread");
    }

    #[test]
    fn the_reaper_sleeps_until_the_first_expiry_and_a_sooner_one_wakes_it() {
        let q = Arc::new(Dispatch::<Timed>::new(8, 1, 64));
        let (tx, rx) = mpsc::channel();
        let reaper = {
            let q = q.clone();
            std::thread::spawn(move || {
                let mut out = Vec::new();
                while q.reap(&mut out) {
                    for Timed(id, expires) in out.drain(..) {
                        tx.send((id, expires, Instant::now())).expect("collector");
                    }
                }
            })
        };
        let t0 = Instant::now();
        // The reaper sleeps until job 1 expires, two seconds on; job 2, pushed after, expires first.
        q.push(Timed(1, t0 + Duration::from_secs(2)))
            .expect("queued");
        std::thread::sleep(Duration::from_millis(50));
        q.push(Timed(2, t0 + Duration::from_millis(100)))
            .expect("queued");
        q.push(Timed(3, t0 + Duration::from_secs(60)))
            .expect("queued");
        let (id, expires, at) = rx.recv_timeout(WAIT).expect("reaped");
        assert_eq!(id, 2);
        assert!(at >= expires, "reaped before it expired");
        assert!(
            at < t0 + Duration::from_secs(1),
            "reaped {:?} after its expiry: the push did not wake the reaper",
            at - expires
        );
        let (id, expires, at) = rx.recv_timeout(WAIT).expect("reaped");
        assert_eq!(id, 1);
        assert!(at >= expires, "reaped before it expired");
        // Job 3 is still queued, in place; closing ends the reaper.
        assert_eq!(q.len(), 1);
        q.close();
        reaper.join().expect("reaper thread");
        assert!(rx.try_recv().is_err(), "job 3 was reaped before it expired");
    }

    fn start(
        q: &Arc<Dispatch<Job>>,
        me: usize,
        max_rows: usize,
    ) -> (std::thread::JoinHandle<()>, mpsc::Receiver<Vec<usize>>) {
        let (tx, rx) = mpsc::channel();
        let q = q.clone();
        let handle = std::thread::spawn(move || {
            let mut batch = Vec::new();
            while q.next(me, max_rows, &mut batch) {
                let rows = batch.drain(..).map(|j| j.0).collect();
                if tx.send(rows).is_err() {
                    return;
                }
            }
        });
        (handle, rx)
    }

    const WAIT: Duration = Duration::from_secs(10);

    #[test]
    fn a_sleeping_session_is_woken_by_a_push_and_exits_when_closed() {
        let q = Arc::new(Dispatch::new(8, 1, 64));
        let (handle, rx) = start(&q, 0, 16);
        // Give it time to find the queue empty and sleep.
        std::thread::sleep(Duration::from_millis(50));
        q.push(Job(3)).expect("queued");
        assert_eq!(rx.recv_timeout(WAIT).expect("answered"), vec![3]);
        q.close();
        handle.join().expect("session thread");
        assert!(matches!(q.push(Job(1)), Err(PushError::Closed(_))));
    }

    #[test]
    fn every_job_pushed_from_many_threads_is_taken_with_no_wake_up_lost() {
        // Pushers that pause now and then, so sessions keep falling asleep and being woken (or not) while
        // jobs arrive: a push that slipped between a session's last look and its sleep would hang here.
        let sessions = 3;
        let q = Arc::new(Dispatch::<Job>::new(100_000, sessions, 64));
        let (tx, rx) = mpsc::channel();
        let mut threads = Vec::new();
        for me in 0..sessions {
            let (q, tx) = (q.clone(), tx.clone());
            threads.push(std::thread::spawn(move || {
                let mut batch = Vec::new();
                while q.next(me, 8, &mut batch) {
                    q.ran(Duration::from_micros(if me == 0 { 5 } else { 60 }));
                    for j in batch.drain(..) {
                        tx.send(j.0).expect("collector");
                    }
                }
            }));
        }
        drop(tx);
        let pushers: Vec<_> = (0..4)
            .map(|p| {
                let q = q.clone();
                std::thread::spawn(move || {
                    for i in 0..2_000 {
                        q.push(Job(p * 10_000 + i)).expect("queued");
                        if i % 64 == 0 {
                            std::thread::sleep(Duration::from_micros(200));
                        }
                    }
                })
            })
            .collect();
        for p in pushers {
            p.join().expect("pusher");
        }
        let mut seen = std::collections::HashSet::new();
        while seen.len() < 8_000 {
            let j = rx.recv_timeout(WAIT).expect("every job is taken");
            assert!(seen.insert(j), "job {j} taken twice");
        }
        q.close();
        for t in threads {
            t.join().expect("session thread");
        }
    }

    #[test]
    fn a_full_queue_refuses_the_push_and_gives_the_job_back() {
        let q = Dispatch::new(2, 1, 64);
        q.push(Job(1)).expect("first");
        q.push(Job(2)).expect("second");
        match q.push(Job(7)) {
            Err(PushError::Full(Job(7))) => {}
            other => panic!("expected Full(7), got {:?}", other.map(|_| ())),
        }
        assert_eq!(q.len(), 2);
    }

    #[test]
    fn what_was_queued_before_close_is_still_run() {
        let q = Arc::new(Dispatch::new(8, 1, 64));
        for rows in [1, 2, 3] {
            q.push(Job(rows)).expect("queued");
        }
        q.close();
        let (handle, rx) = start(&q, 0, 2);
        handle.join().expect("session thread");
        let batches: Vec<Vec<usize>> = rx.try_iter().collect();
        // Two rows at most per batch: 1 alone (1 + 2 > 2), then 2, then 3 (alone, larger than a batch).
        assert_eq!(batches, vec![vec![1], vec![2], vec![3]]);
    }

    #[test]
    fn a_lone_awake_session_takes_everything_queued_that_fits() {
        let q = Dispatch::new(16, 2, 64);
        for _ in 0..5 {
            q.push(Job(1)).expect("queued");
        }
        let mut batch = Vec::new();
        // Session 1 is asleep: session 0 is the only one awake, so its share is the whole queue.
        q.lock().idle.push(1);
        assert!(q.next(0, 4, &mut batch));
        assert_eq!(batch.len(), 4, "up to max_rows");
        assert_eq!(q.len(), 1);
    }

    #[test]
    fn two_awake_sessions_split_the_queue() {
        let q = Dispatch::new(16, 2, 64);
        for _ in 0..6 {
            q.push(Job(1)).expect("queued");
        }
        let mut batch = Vec::new();
        assert!(q.next(0, 64, &mut batch));
        // The first job, then half of the five left.
        assert_eq!(batch.len(), 4);
        assert_eq!(q.len(), 2);
    }

    /// Two sessions taking `batch_rows` rows a batch: 0 awake with fast recent runs, 1 asleep; one job
    /// pushed.
    fn one_job_for_a_fast_awake_session(batch_rows: usize) -> Dispatch<Job> {
        let q = Dispatch::new(16, 2, batch_rows);
        q.lock().idle.push(1);
        q.ran(Duration::from_micros(5));
        q.push(Job(1)).expect("queued");
        q
    }

    #[test]
    fn a_push_leaves_a_sleeping_session_asleep_while_a_fast_session_is_awake() {
        let q = one_job_for_a_fast_awake_session(64);
        assert_eq!(
            q.lock().idle,
            vec![1],
            "session 0 is awake and fast: 1 sleeps on"
        );
        // The runs grow slow: the next push wakes session 1.
        for _ in 0..64 {
            q.ran(Duration::from_millis(1));
        }
        q.push(Job(1)).expect("queued");
        let s = q.lock();
        assert!(s.idle.is_empty() && s.woken[1]);
    }

    #[test]
    fn a_backlog_larger_than_the_awake_sessions_take_wakes_another_however_fast_the_runs() {
        // Without batching (a batch is one job), two jobs queued for one awake session.
        let q = one_job_for_a_fast_awake_session(1);
        assert_eq!(
            q.lock().idle,
            vec![1],
            "one job: the awake session takes it next"
        );
        q.push(Job(1)).expect("queued");
        let s = q.lock();
        assert!(s.idle.is_empty() && s.woken[1], "two: session 1 is woken");
        assert_eq!(s.rows, 2);
    }

    #[test]
    fn a_push_wakes_a_session_when_none_is_awake() {
        let q = Dispatch::new(16, 2, 64);
        q.lock().idle.extend([0, 1]);
        q.ran(Duration::from_micros(5));
        q.push(Job(1)).expect("queued");
        let s = q.lock();
        assert_eq!(s.idle, vec![0], "the most recent sleeper is woken");
        assert!(s.woken[1]);
    }

    #[test]
    fn when_the_last_session_is_gone_queued_jobs_are_dropped_and_pushes_refused() {
        let q = Dispatch::new(16, 2, 64);
        q.push(Job(1)).expect("queued");
        q.leave(0);
        assert_eq!(q.len(), 1, "session 1 can still take it");
        q.leave(1);
        assert_eq!(q.len(), 0);
        assert!(matches!(q.push(Job(1)), Err(PushError::Closed(_))));
    }

    #[test]
    fn a_session_that_goes_wakes_a_sleeping_one_for_what_is_queued() {
        let q = Dispatch::new(16, 2, 64);
        q.lock().idle.push(1);
        q.ran(Duration::from_micros(5));
        q.push(Job(1)).expect("queued");
        assert_eq!(q.lock().idle, vec![1]);
        q.leave(0);
        let s = q.lock();
        assert!(s.idle.is_empty() && s.woken[1]);
    }

    #[test]
    fn a_gathering_session_takes_jobs_pushed_before_its_deadline() {
        let q = Arc::new(Dispatch::new(16, 1, 64));
        let pusher = {
            let q = q.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                q.push(Job(2)).expect("queued");
            })
        };
        let mut batch = vec![Job(1)];
        let rows = q.gather(0, 1, 3, Instant::now() + WAIT, &mut batch);
        pusher.join().expect("pusher");
        assert_eq!(
            rows, 3,
            "gathered until the batch was full, long before the deadline"
        );
        assert_eq!(batch.len(), 2);
    }

    #[test]
    fn gathering_stops_at_a_job_that_does_not_fit_and_leaves_it_first_in_line() {
        let q = Dispatch::new(16, 1, 64);
        q.push(Job(5)).expect("queued");
        q.push(Job(1)).expect("queued");
        let mut batch = vec![Job(1)];
        let started = Instant::now();
        let rows = q.gather(0, 1, 4, started + WAIT, &mut batch);
        assert_eq!(rows, 1);
        // Nothing could join the batch in order any more: it runs now, not at the deadline.
        assert!(started.elapsed() < WAIT / 2);
        assert_eq!(q.len(), 2, "the five-row job waits for the next batch");
        let mut next = Vec::new();
        assert!(q.next(0, 4, &mut next));
        assert_eq!(next.first().map(|j| j.0), Some(5), "still first in line");
        assert!(q.lock().gathering.is_empty());
    }

    #[test]
    fn gathering_with_nothing_queued_stops_at_the_deadline() {
        let q = Dispatch::new(16, 1, 64);
        let mut batch = vec![Job(1)];
        let started = Instant::now();
        let rows = q.gather(0, 1, 4, started + Duration::from_millis(30), &mut batch);
        assert_eq!(rows, 1);
        assert!(started.elapsed() >= Duration::from_millis(30));
        assert!(q.lock().gathering.is_empty());
    }
}
