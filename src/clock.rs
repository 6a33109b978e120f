//! Time as the cache policies see it: a monotonic clock and a wall clock that tests can move forward.
//!
//! The cache computes every age itself from these clocks rather than relying on moka's own expiry, so
//! policy tests advance time without sleeping, and moka's expiry only bounds memory.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

#[derive(Clone)]
pub struct Clock {
    inner: Arc<Inner>,
}

struct Inner {
    start: Instant,
    /// Added to both clocks; only tests move it.
    offset_ms: AtomicI64,
}

impl Default for Clock {
    fn default() -> Self {
        Self {
            inner: Arc::new(Inner {
                start: Instant::now(),
                offset_ms: AtomicI64::new(0),
            }),
        }
    }
}

impl Clock {
    /// Monotonic milliseconds since the clock was made.
    pub fn now_ms(&self) -> i64 {
        self.inner.start.elapsed().as_millis() as i64 + self.inner.offset_ms.load(Ordering::Relaxed)
    }

    /// Wall-clock milliseconds since the Unix epoch (for event timestamps and `max_age`).
    pub fn wall_ms(&self) -> i64 {
        crate::value::now_ms() + self.inner.offset_ms.load(Ordering::Relaxed)
    }

    /// Moves both clocks forward (tests).
    pub fn advance(&self, d: Duration) {
        self.inner
            .offset_ms
            .fetch_add(d.as_millis() as i64, Ordering::Relaxed);
    }
}
