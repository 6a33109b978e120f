//! Writing feature rows: the bulk loader (JSON Lines or CSV files) and the rows API
//! (`POST /v1/views/{view}/rows`), both validated against the view's schema, written in atomic batches with
//! the view's `store.key_ttl`, and announced to every replica so each drops the changed keys from its cache.
//!
//! A row names its entity key (the view's entity, e.g. `user_id`), optionally `event_timestamp` (RFC 3339 or
//! milliseconds since the epoch; the load time when absent), and features by name; a feature left out is
//! stored as null and served as its default.
//!
//! The loader rejects a bad row with its line number and the reason, and still loads the good rows; each
//! batch of [`BATCH`] rows is one atomic write (Redis: one `MULTI`/`EXEC` round trip), so no row is ever
//! half-written, and up to [`IN_FLIGHT`] batches are in flight at once. It streams: a file is read while
//! earlier batches are being written, and memory stays bounded by the batches in flight whatever the file's
//! size. The rows API is all-or-nothing per request: one bad row refuses the request and nothing is written.

use std::io::{BufRead, Read};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use serde::Deserialize;

use crate::config::LimitsConfig;
use crate::decode::{EntityKey, check_key, whole_key};
use crate::error::ApiError;
use crate::hydrate::Hydrator;
use crate::schema::{EVENT_TIMESTAMP, View};
use crate::store::{Store, StoreError, Writes, key};
use crate::telemetry::{StoreOutcome, us_since};
use crate::value::{Dtype, Record, Value};

/// Rows per store write.
pub const BATCH: usize = 1000;

/// Batches the loader has in flight at once.
pub const IN_FLIGHT: usize = 4;

/// The longest line of a JSON Lines file (a row with a float32[65536] embedding is under 1 MiB).
const MAX_LINE_BYTES: usize = 8 << 20;

/// How far in the future a row's `event_timestamp` may be (clock skew between the writer and hydrant).
pub(crate) const MAX_FUTURE_SKEW_MS: i64 = 24 * 3600 * 1000;

/// Rejected rows a [`Report`] lists by line; past this many it only counts them.
pub const MAX_LISTED_REJECTS: usize = 1000;

/// A line number and the row parsed from it (or why it could not be).
type ParsedLine = (
    usize,
    Result<serde_json::Map<String, serde_json::Value>, String>,
);

/// What a row before `--from-line` is read as: such rows are only counted, so they are not parsed (a
/// resumed load of a large file would otherwise decode every row it skips). An empty map allocates nothing.
fn unread() -> serde_json::Map<String, serde_json::Value> {
    serde_json::Map::new()
}

/// A row the loader refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejected {
    /// 1-based line in the file (for CSV, counting the header).
    pub line: usize,
    pub reason: String,
}

/// What a load did.
#[derive(Debug, Default)]
pub struct Report {
    pub written: usize,
    /// Rows before the load's first line (`--from-line`), read past and not written.
    pub skipped: usize,
    /// The first [`MAX_LISTED_REJECTS`] rejected rows, in file order.
    pub rejected: Vec<Rejected>,
    /// All rejected rows, listed or not.
    pub rejected_rows: usize,
    /// Batches whose write failed, with the lines they held and why; none of their rows were written.
    pub failed: Vec<FailedBatch>,
    /// Batches written but not announced to the other replicas (they see the rows within `cache.ttl`).
    pub unannounced: usize,
    /// Why the load stopped reading before the end of the file: the store failed
    /// [`GIVE_UP_AFTER`] batches in a row (a full disk, a store gone for good), the file could not be
    /// read on, or the load was interrupted.
    pub gave_up: Option<String>,
    /// The first line of the last batch (in file order) that was written.
    last_written_line: usize,
}

/// Consecutive failed batches after which a load stops reading: the store is not coming back soon, and
/// going on would only print the same failure for every remaining batch.
pub const GIVE_UP_AFTER: usize = 8;

/// A batch the store refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailedBatch {
    pub first_line: usize,
    pub last_line: usize,
    pub rows: usize,
    pub reason: String,
    /// The store did not answer in time: the batch may have been written all the same (the store
    /// announces its keys to the replicas, in case), and later rows of its keys are not sent in this load.
    /// Loading the file again from this batch's first line on is safe.
    pub unconfirmed: bool,
    /// The store wrote some of the batch's rows and not the others (a cluster's pipelined SETs; the
    /// reason says how many). Loading the file again from this batch's first line on is safe.
    pub partial: bool,
}

/// Why a row was refused, and the field it is about when it is one field's fault.
#[derive(Debug)]
pub struct RowError {
    pub field: Option<String>,
    pub reason: String,
}

impl From<String> for RowError {
    fn from(reason: String) -> Self {
        Self {
            field: None,
            reason,
        }
    }
}

impl From<RowError> for String {
    fn from(e: RowError) -> Self {
        e.reason
    }
}

/// Turns one JSON object into the store key and record of `view`.
pub fn parse_row(
    view: &View,
    prefix: &str,
    row: &serde_json::Map<String, serde_json::Value>,
    now_ms: i64,
    limits: &LimitsConfig,
) -> Result<(String, Record), RowError> {
    let entity = &view.entity;
    // Every problem with the key names the key's field.
    let key_error = |reason: String| RowError {
        field: Some(entity.name.to_string()),
        reason,
    };
    let raw_key = row
        .get(&entity.name)
        .ok_or_else(|| key_error(format!("missing the entity key `{}`", entity.name)))?;
    let k = match raw_key {
        serde_json::Value::String(s) => EntityKey::Str(s.as_str().into()),
        serde_json::Value::Number(n) if n.is_i64() => {
            EntityKey::Int(n.as_i64().unwrap_or_default())
        }
        serde_json::Value::Number(n) if n.is_u64() => {
            return Err(key_error(format!(
                "`{}` {n} is past the int64 range of integer entity keys (write it as a string if the entity's keys are strings)",
                entity.name
            )));
        }
        // `1e3` or `1000.0`: an integer while float64 holds it exactly, as in a request.
        serde_json::Value::Number(n) => match n.as_f64().map(whole_key) {
            Some(Ok(i)) => EntityKey::Int(i),
            Some(Err(reason)) => return Err(key_error(reason)),
            None => {
                return Err(key_error(format!(
                    "`{}` must be a string or an integer, got {n}",
                    entity.name
                )));
            }
        },
        other => {
            return Err(key_error(format!(
                "`{}` must be a string or an integer, got {}",
                entity.name,
                excerpt(&other.to_string())
            )));
        }
    };
    let entity_key = check_key(entity, &k, limits).map_err(key_error)?;
    let event_ts_ms = event_timestamp(row, now_ms).map_err(|reason| RowError {
        field: Some(EVENT_TIMESTAMP.to_owned()),
        reason,
    })?;
    for name in row.keys() {
        if !takes_column(view, name) {
            return Err(RowError {
                field: Some(name.clone()),
                reason: format!(
                    "unknown feature `{name}` (view `{}` has: {})",
                    view.name,
                    feature_names(view)
                ),
            });
        }
    }
    let mut values = Vec::with_capacity(view.features.len());
    for f in &view.features {
        let v = match row.get(&f.name) {
            None => Value::Null,
            Some(j) => f.dtype.from_json(j).map_err(|e| RowError {
                field: Some(f.name.clone()),
                reason: format!("feature `{}`: {e}", f.name),
            })?,
        };
        values.push(v);
    }
    Ok((
        key(prefix, &view.name, &entity_key),
        Record {
            schema_version: view.version,
            event_ts_ms,
            values,
            layout: view.layout,
        },
    ))
}

/// A row's `event_timestamp` in milliseconds since the Unix epoch (`now_ms` when it has none).
fn event_timestamp(
    row: &serde_json::Map<String, serde_json::Value>,
    now_ms: i64,
) -> Result<i64, String> {
    let event_ts_ms = match row.get(EVENT_TIMESTAMP) {
        None | Some(serde_json::Value::Null) => now_ms,
        Some(serde_json::Value::Number(n)) => {
            let ms = match n.as_i64() {
                Some(ms) => ms,
                None if n.is_u64() => {
                    return Err(format!(
                        "`event_timestamp` {n} is too far in the future (milliseconds since the Unix epoch)"
                    ));
                }
                // A whole number written as a float (MessagePack encoders do that) is the same instant,
                // by the rule an int64 feature follows.
                None => {
                    let f = n.as_f64().unwrap_or(f64::NAN);
                    match Dtype::Int64.coerce(Value::Float(f)) {
                        Ok(Value::Int(ms)) => ms,
                        // Whole, but past what a float holds exactly: some millions of years away.
                        _ if f.fract() == 0.0 => {
                            let (side, when) = if f > 0.0 {
                                ("future", "later")
                            } else {
                                ("past", "earlier")
                            };
                            return Err(format!(
                                "`event_timestamp` {n} is too far in the {side} (milliseconds since the Unix epoch; {when} than any real event)"
                            ));
                        }
                        _ => {
                            return Err(format!(
                                "`event_timestamp` {n} is not whole milliseconds since the Unix epoch (an integer)"
                            ));
                        }
                    }
                }
            };
            // 1e11 ms is March 1973; 1e11 s is the year 5138. A number below it is almost surely seconds,
            // and read as milliseconds it would age every row past any `max_age`.
            if (0..100_000_000_000).contains(&ms) {
                return Err(format!(
                    "`event_timestamp` {ms} is before March 1973 in milliseconds since the Unix epoch: if it is seconds, multiply by 1000 (or write an RFC 3339 time)"
                ));
            }
            ms
        }
        Some(serde_json::Value::String(s)) => crate::clock::rfc3339_ms(s).ok_or_else(|| {
            format!(
                "`event_timestamp` `{}` is not an RFC 3339 time (e.g. 2026-11-01T12:00:00Z or 2026-11-01T13:00:00+01:00)",
                excerpt(s)
            )
        })?,
        Some(other) => {
            return Err(format!(
                "`event_timestamp` must be a string or a number, got {}",
                excerpt(&other.to_string())
            ));
        }
    };
    if event_ts_ms < 0 {
        return Err("`event_timestamp` is before 1970".to_owned());
    }
    // A time in the future would never grow older than the view's `max_age`.
    if event_ts_ms > now_ms.saturating_add(MAX_FUTURE_SKEW_MS) {
        return Err(format!(
            "`event_timestamp` is more than a day in the future ({event_ts_ms} ms since the epoch): it is when the values were true"
        ));
    }
    Ok(event_ts_ms)
}

/// Whether a row of `view` may name `name`: its entity key, `event_timestamp`, or one of its features.
fn takes_column(view: &View, name: &str) -> bool {
    name == view.entity.name || name == EVENT_TIMESTAMP || view.feature_index(name).is_some()
}

fn feature_names(view: &View) -> String {
    view.features
        .iter()
        .map(|f| f.name.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Reads rows from `reader`: JSON Lines, or CSV when `csv` is set, and writes the valid ones to `store` in
/// batches, announcing each written batch's keys to the replicas. The reading overlaps the writing; at most
/// [`IN_FLIGHT`] batches are held in memory.
///
/// A row that cannot be read as UTF-8, JSON or CSV is rejected like any other bad row. An I/O error
/// (the file cannot be read further) stops the load: the rows read before it are still written, and the
/// error says how far it got.
pub async fn load<R: BufRead>(
    view: &View,
    prefix: &str,
    reader: R,
    csv: bool,
    limits: &LimitsConfig,
    store: Arc<dyn Store>,
) -> anyhow::Result<Report> {
    let never = std::sync::atomic::AtomicBool::new(false);
    let input = Input {
        reader,
        csv,
        from_line: 1,
    };
    load_until(view, prefix, input, limits, store, &never).await
}

/// What a load reads: a file's lines, its format, and the line the rows to write start on.
pub struct Input<R> {
    pub reader: R,
    /// CSV with a header line; JSON Lines otherwise ([`is_csv`]).
    pub csv: bool,
    /// 1 for the whole file; a later line to resume a load (`hydrant load --from-line`).
    pub from_line: usize,
}

/// [`load`] from the row that starts on line `input.from_line` on (the rows before it are read past, neither
/// checked nor written: a load resumed where an earlier one's writes timed out), stopping at the next
/// row read once `stop` is set (Ctrl-C, SIGTERM): the rows read before it and the batches in flight are
/// written, and the report says where it stopped.
///
/// Each batch is written, then announced, by a task of its own, so a written batch is announced at once
/// even while the input keeps the loader waiting (a pipe that pauses). On a multi-threaded runtime the
/// input is read in [`tokio::task::block_in_place`], up to the rows the batch being filled still takes at
/// a time, so those tasks (and the store's connection) go on running while a read blocks.
pub async fn load_until<R: BufRead>(
    view: &View,
    prefix: &str,
    input: Input<R>,
    limits: &LimitsConfig,
    store: Arc<dyn Store>,
    stop: &std::sync::atomic::AtomicBool,
) -> anyhow::Result<Report> {
    let Input {
        reader,
        csv,
        from_line,
    } = input;
    // Read again after each batch: a row without an event_timestamp is stamped with (about) the time it
    // was written, not the time a long load began, and the future-skew check keeps up with the clock.
    let mut now = crate::value::now_ms();
    let mut report = Report::default();
    let mut rows: Box<dyn Iterator<Item = std::io::Result<ParsedLine>> + '_> = if csv {
        Box::new(csv_rows(view, reader, from_line)?)
    } else {
        Box::new(json_rows(reader, from_line))
    };
    let blocking_allowed = tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
    // Rows read ahead, each with whether `stop` was set once it had been read: the load stops before the
    // first such row (the rows read before it are loaded). No more are read ahead than the batch being
    // filled still takes, so the row that completes a batch is never held back by a read that blocks.
    let mut read: std::collections::VecDeque<(std::io::Result<ParsedLine>, bool)> =
        std::collections::VecDeque::with_capacity(BATCH);
    let mut writer = Writer::new(store, view.policy.key_ttl);
    let mut batch = Batch::default();
    let mut last_read = 0;
    let mut stopped = None;
    // Whether `stop` was set once the input had ended: a pipe's writer stopped by the same Ctrl-C ends
    // the input, and the end then says nothing of whether all of it came.
    let mut ended_stopped = false;
    loop {
        if read.is_empty() {
            let want = BATCH.saturating_sub(batch.writes.len()).max(1);
            let mut fill = || {
                while read.len() < want {
                    let Some(row) = rows.next() else {
                        ended_stopped = stop.load(Relaxed);
                        break;
                    };
                    let stop_seen = stop.load(Relaxed);
                    let last = row.is_err() || stop_seen;
                    read.push_back((row, stop_seen));
                    if last {
                        break;
                    }
                }
            };
            if blocking_allowed {
                tokio::task::block_in_place(fill);
            } else {
                fill();
            }
        }
        let Some((row, stop_seen)) = read.pop_front() else {
            break;
        };
        let (line, parsed) = match row {
            Ok(r) => r,
            Err(e) => {
                stopped = Some(e);
                break;
            }
        };
        if stop_seen {
            report.gave_up = Some(format!(
                "interrupted before line {line}: the rest of the file was not read"
            ));
            break;
        }
        last_read = line;
        // Read as `unread()` by the row readers: counted, never checked or written.
        if line < from_line {
            report.skipped += 1;
            continue;
        }
        match parsed.and_then(|m| parse_row(view, prefix, &m, now, limits).map_err(String::from)) {
            Ok((k, record)) => {
                if batch.writes.is_empty() {
                    batch.first_line = line;
                }
                batch.last_line = line;
                batch.writes.push((k, record.encode()));
            }
            Err(reason) => report.reject(line, reason),
        }
        if batch.writes.len() >= BATCH {
            writer.send(std::mem::take(&mut batch), &mut report).await;
            now = crate::value::now_ms();
            if report.failed_in_a_row() >= GIVE_UP_AFTER {
                let last = report.failed.last().map_or("", |b| b.reason.as_str());
                report.gave_up = Some(format!(
                    "stopped after line {line}: the store failed {GIVE_UP_AFTER} batches in a row (the last: {last}); nothing after that line was read"
                ));
                break;
            }
        }
    }
    if !batch.writes.is_empty() {
        writer.send(batch, &mut report).await;
    }
    writer.finish(&mut report).await;
    // Batches finish in any order; they are listed in the file's.
    report.failed.sort_by_key(|b| b.first_line);
    // A file that cannot be read on (a device error, a CSV quote never closed) still gets its report:
    // the batches that failed before it are in there, and nothing the load did goes unsaid.
    if stopped.is_some() && stop.load(Relaxed) {
        // A read that waited on a paused input ([`Stoppable`]) while the load was stopped.
        report.gave_up = Some(format!(
            "interrupted while waiting for input after line {last_read}: the rows read were loaded, the rest of the input was not read"
        ));
    } else if let Some(e) = stopped {
        report.gave_up = Some(format!(
            "cannot read past line {last_read}: {e}; the rest of the file was not read"
        ));
    } else if ended_stopped && report.gave_up.is_none() {
        report.gave_up = Some(format!(
            "interrupted as the input ended, after line {last_read}: every row read was loaded, but an input piped from a command the same signal stopped may have been cut short"
        ));
    } else if report.gave_up.is_none() && last_read < from_line && from_line > 1 {
        // A line past the end (a resume from the wrong file, or a line number mistyped) loads nothing,
        // and says so rather than reporting a load that did all it was asked.
        report.gave_up = Some(match last_read {
            0 => format!(
                "the file has no rows, so none starts on line {from_line} or later: nothing was loaded"
            ),
            n => format!(
                "the file's last row starts on line {n}, before line {from_line} where the load was to start: nothing was loaded"
            ),
        });
    }
    Ok(report)
}

/// What writing a batch did: its keys (to announce, and to release), its first line, and its rows written
/// or refused.
type BatchDone = (Vec<String>, usize, Result<(usize, bool), FailedBatch>);

/// A reader of input that can pause without end (a pipe, a FIFO, a terminal) whose read a stop
/// interrupts: the blocking reads happen on a thread of their own, and a read that has been waiting
/// while `stop` is set fails, so a load stopped by Ctrl-C or SIGTERM while its input pauses writes
/// what it has read and ends, instead of waiting for the writer to send more or to close.
pub struct Stoppable {
    chunks: std::sync::mpsc::Receiver<std::io::Result<Vec<u8>>>,
    chunk: Vec<u8>,
    at: usize,
    stop: Arc<std::sync::atomic::AtomicBool>,
    ended: bool,
}

/// How often a read that waits for input looks at the stop flag.
const STOP_POLL: Duration = Duration::from_millis(50);

impl Stoppable {
    pub fn new(
        mut inner: impl Read + Send + 'static,
        stop: Arc<std::sync::atomic::AtomicBool>,
    ) -> std::io::Result<Stoppable> {
        // Two chunks read ahead at most: memory stays bounded whatever the writer sends.
        let (tx, chunks) = std::sync::mpsc::sync_channel(2);
        std::thread::Builder::new()
            .name("hydrant-load-read".into())
            .spawn(move || {
                loop {
                    let mut buf = vec![0; 64 << 10];
                    let read = match inner.read(&mut buf) {
                        Ok(0) => return,
                        Ok(n) => {
                            buf.truncate(n);
                            Ok(buf)
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                        Err(e) => Err(e),
                    };
                    let failed = read.is_err();
                    // The loader gone (it stopped) or a read error sent: this thread is done.
                    if tx.send(read).is_err() || failed {
                        return;
                    }
                }
            })?;
        Ok(Stoppable {
            chunks,
            chunk: Vec::new(),
            at: 0,
            stop,
            ended: false,
        })
    }
}

impl Read for Stoppable {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        while self.at == self.chunk.len() {
            if self.ended {
                return Ok(0);
            }
            match self.chunks.recv_timeout(STOP_POLL) {
                Ok(Ok(chunk)) => {
                    self.chunk = chunk;
                    self.at = 0;
                }
                Ok(Err(e)) => {
                    self.ended = true;
                    return Err(e);
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    if self.stop.load(Relaxed) {
                        return Err(std::io::Error::other("the load was stopped"));
                    }
                }
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => self.ended = true,
            }
        }
        let n = out.len().min(self.chunk.len() - self.at);
        out[..n].copy_from_slice(&self.chunk[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

/// The batches being written, up to [`IN_FLIGHT`] at once. Batches in flight may land in any order, so a
/// batch that writes a key still being written by an earlier one waits for the earlier ones first: the
/// last row of a key in the file is always the one stored.
struct Writer {
    store: Arc<dyn Store>,
    ttl: Option<Duration>,
    in_flight: futures::stream::FuturesUnordered<crate::store::BoxFuture<'static, BatchDone>>,
    writing: std::collections::HashSet<String>,
    /// Keys of batches that timed out, with those batches' lines. Such a batch may still be applied
    /// (Redis keeps it queued for the reconnection), so a later row of one of its keys is not sent:
    /// the older row could land over it.
    doubtful: std::collections::HashMap<String, (usize, usize)>,
}

impl Writer {
    fn new(store: Arc<dyn Store>, ttl: Option<Duration>) -> Self {
        Self {
            store,
            ttl,
            in_flight: futures::stream::FuturesUnordered::new(),
            writing: std::collections::HashSet::new(),
            doubtful: std::collections::HashMap::new(),
        }
    }

    async fn send(&mut self, b: Batch, report: &mut Report) {
        let overlaps = b.writes.iter().any(|(k, _)| self.writing.contains(k));
        while (overlaps && !self.in_flight.is_empty()) || self.in_flight.len() >= IN_FLIGHT {
            self.next(report).await;
        }
        let late = b.writes.iter().find_map(|(k, _)| self.doubtful.get(k));
        if let Some(&(first, last)) = late {
            report.tally(
                b.first_line,
                Err(FailedBatch {
                    first_line: b.first_line,
                    last_line: b.last_line,
                    rows: b.writes.len(),
                    reason: format!(
                        "not sent: it writes keys of lines {first}-{last}, whose batch timed out and may still be applied over it"
                    ),
                    unconfirmed: false,
                    partial: false,
                }),
            );
            return;
        }
        self.writing.extend(b.writes.iter().map(|(k, _)| k.clone()));
        let (first_line, last_line, rows) = (b.first_line, b.last_line, b.writes.len());
        // Spawned, the write goes on and announces its keys whether or not the loader is polling it;
        // aborted if the load is dropped, as the write itself would have been.
        let mut task =
            crate::app::AbortOnDrop(tokio::spawn(write_batch(self.store.clone(), b, self.ttl)));
        self.in_flight.push(Box::pin(async move {
            match (&mut task.0).await {
                Ok(done) => done,
                // A panic in the write goes on to the loader's caller, as it did before the write had a
                // task of its own.
                Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                // Cancelled: only by the runtime shutting down. Its keys stay marked as being written,
                // so a later batch of one of them waits for every batch in flight.
                Err(e) => (
                    Vec::new(),
                    first_line,
                    Err(FailedBatch {
                        first_line,
                        last_line,
                        rows,
                        reason: format!(
                            "the write was cancelled, the runtime shutting down, and may have been applied: {e}"
                        ),
                        unconfirmed: true,
                        partial: false,
                    }),
                ),
            }
        }));
        // Collect the batches already done, so the report keeps up while the file is read.
        self.collect_done(report);
        // Lets the new task start its write at once, on a runtime of one thread too: the loader does not
        // otherwise yield until the window is full.
        tokio::task::yield_now().await;
    }

    fn collect_done(&mut self, report: &mut Report) {
        use futures::{FutureExt, StreamExt};
        while let Some(Some(done)) = self.in_flight.next().now_or_never() {
            self.done(done, report);
        }
    }

    fn done(&mut self, (keys, first_line, r): BatchDone, report: &mut Report) {
        let timed_out = match &r {
            Err(f) if f.unconfirmed => Some((f.first_line, f.last_line)),
            _ => None,
        };
        for k in keys {
            self.writing.remove(&k);
            if let Some(lines) = timed_out {
                self.doubtful.insert(k, lines);
            }
        }
        report.tally(first_line, r);
    }

    async fn next(&mut self, report: &mut Report) {
        use futures::StreamExt;
        if let Some(done) = self.in_flight.next().await {
            self.done(done, report);
        }
    }

    async fn finish(&mut self, report: &mut Report) {
        while !self.in_flight.is_empty() {
            self.next(report).await;
        }
    }
}

impl Report {
    fn reject(&mut self, line: usize, reason: String) {
        self.rejected_rows += 1;
        if self.rejected.len() < MAX_LISTED_REJECTS {
            self.rejected.push(Rejected { line, reason });
        }
    }

    fn tally(&mut self, first_line: usize, r: Result<(usize, bool), FailedBatch>) {
        match r {
            Ok((rows, announced)) => {
                self.written += rows;
                self.unannounced += usize::from(!announced);
                self.last_written_line = self.last_written_line.max(first_line);
            }
            Err(failed) => self.failed.push(failed),
        }
    }

    /// Failed batches after the last written one, in file order: batches in flight complete in any
    /// order, so a success that lands between two failures must not reset the count.
    fn failed_in_a_row(&self) -> usize {
        // Only the most recent failures can follow the last success; looking further back is waste.
        self.failed
            .iter()
            .rev()
            .take(GIVE_UP_AFTER + 2 * IN_FLIGHT)
            .filter(|b| b.first_line > self.last_written_line)
            .count()
    }
}

/// JSON Lines: one object per line; blank lines are skipped. A line that is not UTF-8 is a bad row, not
/// the end of the file. Rows before `from_line` are counted but not parsed ([`unread`]). A line with no
/// line end is the last one read: the file ended there when it was read (a file still being written
/// would otherwise have the rest of that line read as a row of its own).
fn json_rows<R: BufRead>(
    mut reader: R,
    from_line: usize,
) -> impl Iterator<Item = std::io::Result<ParsedLine>> {
    let mut buf = Vec::new();
    let mut line = 0;
    let mut ended_file = false;
    std::iter::from_fn(move || {
        loop {
            if ended_file {
                return None;
            }
            buf.clear();
            let limit = MAX_LINE_BYTES as u64 + 1;
            match (&mut reader).take(limit).read_until(b'\n', &mut buf) {
                Ok(0) => return None,
                Ok(_) => {}
                Err(e) => return Some(Err(e)),
            }
            line += 1;
            // The newline is not part of the row: a row of exactly the limit is read whole, newline
            // and all, and must neither be refused nor take the next line with it.
            let ended = buf.last() == Some(&b'\n');
            if buf.len() - usize::from(ended) > MAX_LINE_BYTES {
                // Skip the rest of the line without holding it.
                if let Err(e) = reader.skip_until(b'\n') {
                    return Some(Err(e));
                }
                let reason = format!("longer than {MAX_LINE_BYTES} bytes");
                return Some(Ok((line, Err(reason))));
            }
            ended_file = !ended;
            // A byte order mark (some Windows tools write one) is not part of the first row.
            let bytes = if line == 1 {
                buf.strip_prefix(b"\xef\xbb\xbf").unwrap_or(&buf)
            } else {
                &buf
            };
            let text = match std::str::from_utf8(bytes) {
                Ok(t) => t,
                Err(e) => return Some(Ok((line, Err(format!("not UTF-8: {e}"))))),
            };
            if text.trim().is_empty() {
                continue;
            }
            if line < from_line {
                return Some(Ok((line, Ok(unread()))));
            }
            // Without its line ending: a row cut short would otherwise end "at line 2, column 0".
            let text = text.strip_suffix('\n').unwrap_or(text);
            let text = text.strip_suffix('\r').unwrap_or(text);
            let parsed = match serde_json::from_str::<FiniteRow>(text) {
                Ok(FiniteRow(m)) => Ok(m),
                Err(e) if ended_file && e.is_eof() => Err(format!(
                    "{} (the file's last line has no line end: was the file still being written?)",
                    json_rejection(text, &e)
                )),
                Err(e) => Err(json_rejection(text, &e)),
            };
            return Some(Ok((line, parsed)));
        }
    })
}

/// Why a JSON Lines row was refused, naming the feature whose value could not be read (`price`: a number
/// out of range) as the other refusals do. The row is read again to find where: only a refused row pays
/// for the path.
fn json_rejection(text: &str, e: &serde_json::Error) -> String {
    if !(e.is_syntax() || e.is_eof()) {
        // Not an object, or a name given twice (which names itself).
        return within_line(e);
    }
    let reason = format!("not valid JSON: {}", within_line(e));
    let mut de = serde_json::Deserializer::from_str(text);
    let path = match serde_path_to_error::deserialize::<_, FiniteRow>(&mut de) {
        Err(e) => crate::decode::path_text(e.path(), &[]),
        Ok(_) => return reason,
    };
    match path.as_str() {
        "." => reason,
        field => format!("`{field}`: {reason}"),
    }
}

/// A JSON error in one line of a JSON Lines file: serde's "at line 1 column 38" would read as the file's
/// line 1, so only the column is kept.
fn within_line(e: &serde_json::Error) -> String {
    let text = e.to_string();
    match text.rfind(" at line ") {
        // Column 0 is serde's for an error about the whole value (an array for a row): no place to give.
        Some(i) if e.line() > 0 && e.column() == 0 => text[..i].to_owned(),
        Some(i) if e.line() > 0 => format!("{} (column {})", &text[..i], e.column()),
        _ => text,
    }
}

#[derive(Default)]
struct Batch {
    first_line: usize,
    last_line: usize,
    writes: Writes,
}

/// Writes one batch, then announces its keys; `Ok((rows, announced))`.
async fn write_batch(store: Arc<dyn Store>, b: Batch, ttl: Option<Duration>) -> BatchDone {
    let rows = b.writes.len();
    let keys: Vec<String> = b.writes.iter().map(|(k, _)| k.clone()).collect();
    if let Err(e) = store.put_many(b.writes, ttl).await {
        let failed = FailedBatch {
            first_line: b.first_line,
            last_line: b.last_line,
            rows,
            reason: e.to_string(),
            unconfirmed: matches!(e, StoreError::Timeout),
            partial: matches!(e, StoreError::Partial(_)),
        };
        return (keys, b.first_line, Err(failed));
    }
    let announced = store.publish_invalidations(&keys).await.is_ok();
    (keys, b.first_line, Ok((rows, announced)))
}

/// `POST /v1/views/{view}/rows`: rows as the loader reads them, one JSON object each.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RowsRequest {
    pub rows: SentRows,
}

/// A rows request's rows as read: every one of them, or, past [`BATCH`], the first `BATCH` and the count
/// of the rest (read and checked as JSON, not kept). A row is some 80 bytes in memory and `{},` three in
/// the body: a 1 MiB body of empty rows, held whole, took 28 MB more than the body before it was refused.
#[derive(Debug, Default)]
pub struct SentRows {
    list: Vec<serde_json::Map<String, serde_json::Value>>,
    /// How many rows were sent, held or not.
    pub sent: usize,
}

impl std::ops::Deref for SentRows {
    type Target = [serde_json::Map<String, serde_json::Value>];

    /// The rows held.
    fn deref(&self) -> &Self::Target {
        &self.list
    }
}

impl<'de> Deserialize<'de> for SentRows {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = SentRows;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a sequence")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, seq: A) -> Result<SentRows, A::Error> {
                let (rows, sent) = crate::decode::read_capped::<FiniteRow, _>(seq, BATCH)?;
                let list = rows.into_iter().map(|r| r.0).collect();
                Ok(SentRows { list, sent })
            }
        }
        d.deserialize_seq(V)
    }
}

/// The 413 for more than [`BATCH`] rows in one request.
pub fn check_row_count(sent: usize) -> Result<(), ApiError> {
    if sent > BATCH {
        return Err(ApiError::TooLarge {
            code: "too_many_rows",
            message: format!(
                "rows: {sent} rows, the limit is {BATCH} per request (use the bulk loader for more)"
            ),
            field: Some("rows".to_owned()),
        });
    }
    Ok(())
}

impl crate::decode::Positional for RowsRequest {
    const FIELDS: &'static [(&'static str, &'static [&'static str])] = &[("rows", &[])];
}

/// One row: a JSON object whose numbers are all finite, refusing NaN and infinities (which MessagePack
/// can carry and JSON cannot): `serde_json::Value` would quietly turn them into null, a missing value.
struct FiniteRow(serde_json::Map<String, serde_json::Value>);

impl<'de> Deserialize<'de> for FiniteRow {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match d.deserialize_map(FiniteVisitor(
            "a row (an object of feature names and values)",
        ))? {
            FiniteJson(serde_json::Value::Object(m)) => Ok(FiniteRow(m)),
            _ => Err(serde::de::Error::custom("expected a row")),
        }
    }
}

/// A JSON value whose numbers are all finite.
struct FiniteJson(serde_json::Value);

impl<'de> Deserialize<'de> for FiniteJson {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(FiniteVisitor(
            "a feature value (null, a boolean, a number, a string or a list of numbers)",
        ))
    }
}

/// Builds a [`FiniteJson`]; says it expected `.0` when the input is something else.
struct FiniteVisitor(&'static str);

impl<'de> serde::de::Visitor<'de> for FiniteVisitor {
    type Value = FiniteJson;
    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
    fn visit_unit<E: serde::de::Error>(self) -> Result<FiniteJson, E> {
        Ok(FiniteJson(serde_json::Value::Null))
    }
    fn visit_none<E: serde::de::Error>(self) -> Result<FiniteJson, E> {
        Ok(FiniteJson(serde_json::Value::Null))
    }
    fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<FiniteJson, D::Error> {
        FiniteJson::deserialize(d)
    }
    fn visit_bool<E: serde::de::Error>(self, b: bool) -> Result<FiniteJson, E> {
        Ok(FiniteJson(serde_json::Value::Bool(b)))
    }
    fn visit_i64<E: serde::de::Error>(self, i: i64) -> Result<FiniteJson, E> {
        Ok(FiniteJson(serde_json::Value::from(i)))
    }
    fn visit_u64<E: serde::de::Error>(self, u: u64) -> Result<FiniteJson, E> {
        Ok(FiniteJson(serde_json::Value::from(u)))
    }
    fn visit_f64<E: serde::de::Error>(self, f: f64) -> Result<FiniteJson, E> {
        serde_json::Number::from_f64(f)
            .map(|n| FiniteJson(serde_json::Value::Number(n)))
            .ok_or_else(|| E::custom(format_args!("expected a finite number, got {f}")))
    }
    fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<FiniteJson, E> {
        Ok(FiniteJson(serde_json::Value::String(s.to_owned())))
    }
    fn visit_string<E: serde::de::Error>(self, s: String) -> Result<FiniteJson, E> {
        Ok(FiniteJson(serde_json::Value::String(s)))
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<FiniteJson, A::Error> {
        // A MessagePack list declares its length, which is a claim, not bytes that back it: with up to 128
        // levels of lists open at once, reserving what each claims cost 16 MB for a 647-byte body.
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(16));
        while let Some(FiniteJson(v)) = seq.next_element()? {
            out.push(v);
        }
        Ok(FiniteJson(serde_json::Value::Array(out)))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<FiniteJson, A::Error> {
        let mut out = serde_json::Map::new();
        while let Some((k, FiniteJson(v))) = map.next_entry::<String, FiniteJson>()? {
            // Last-wins would store whichever came last, e.g. of two entity keys.
            if out.contains_key(&k) {
                return Err(crate::decode::given_twice(&k));
            }
            out.insert(k, v);
        }
        Ok(FiniteJson(serde_json::Value::Object(out)))
    }
}

/// Validates every row of a rows request: all of them or none, so the error names the first bad row (as
/// `rows[i]`) and nothing is written.
pub fn parse_rows(
    view: &View,
    prefix: &str,
    rows: &[serde_json::Map<String, serde_json::Value>],
    now_ms: i64,
    limits: &LimitsConfig,
) -> Result<Writes, ApiError> {
    if rows.is_empty() {
        return Err(ApiError::invalid(
            "invalid_field",
            "rows",
            "rows: expected at least one row",
        ));
    }
    check_row_count(rows.len())?;
    let mut writes = Vec::with_capacity(rows.len());
    let mut first_bad: Option<(usize, RowError)> = None;
    let mut bad = 0;
    for (i, row) in rows.iter().enumerate() {
        match parse_row(view, prefix, row, now_ms, limits) {
            Ok((k, record)) => writes.push((k, record.encode())),
            Err(e) => {
                bad += 1;
                first_bad.get_or_insert((i, e));
            }
        }
    }
    match first_bad {
        None => Ok(writes),
        Some((i, e)) => Err(ApiError::invalid(
            "invalid_row",
            match &e.field {
                Some(field) => format!("rows[{i}].{field}"),
                None => format!("rows[{i}]"),
            },
            format!(
                "rows[{i}]: {} ({bad} of {} rows invalid; nothing was written)",
                e.reason,
                rows.len()
            ),
        )),
    }
}

/// What a write through hydrant did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Written {
    pub rows: usize,
    /// The other replicas were told; when false they see the rows within the view's `cache.ttl`.
    pub announced: bool,
}

/// Writes validated rows through to the store, drops them from this replica's cache at once (read your
/// writes), and announces them to the other replicas.
pub async fn write_through(
    h: &Hydrator,
    writes: Writes,
    ttl: Option<Duration>,
) -> Result<Written, StoreError> {
    let store = h.store();
    let stats = h.store_stats();
    let rows = writes.len();
    // Of rows for one key, the last wins: only it is written and announced.
    let writes = last_per_key(writes);
    let keys: Vec<String> = writes.iter().map(|(k, _)| k.clone()).collect();
    let started = Instant::now();
    let result = store.put_many(writes, ttl).await;
    let outcome = match &result {
        Ok(()) => StoreOutcome::Ok,
        Err(StoreError::Timeout) => StoreOutcome::Timeout,
        Err(_) => StoreOutcome::Error,
    };
    stats.writes.record(outcome, keys.len(), us_since(started));
    if let Err(e) = result {
        // The batch may have landed in part (a cluster's pipelined SETs), or may still land (a
        // timeout): drop the keys here too; the store announces them to the other replicas.
        h.invalidate(&keys);
        return Err(e);
    }
    h.invalidate(&keys);
    let inv = &h.telemetry().invalidation;
    let announced = match store.publish_invalidations(&keys).await {
        // No other replica to tell: nothing was published, and nobody was left out.
        Ok(()) if !store.shared() => true,
        Ok(()) => {
            inv.published_keys.fetch_add(keys.len() as u64, Relaxed);
            true
        }
        Err(e) => {
            inv.publish_errors.fetch_add(1, Relaxed);
            tracing::warn!(
                keys = keys.len(),
                "rows written but not announced to the other replicas (they see them within cache.ttl): {e}"
            );
            false
        }
    };
    Ok(Written { rows, announced })
}

/// `writes` with only the last write of each key, in their order.
fn last_per_key(mut writes: Writes) -> Writes {
    if writes.len() < 2 {
        return writes;
    }
    let mut seen = std::collections::HashSet::with_capacity(writes.len());
    let mut keep = vec![false; writes.len()];
    for (i, (k, _)) in writes.iter().enumerate().rev() {
        keep[i] = seen.insert(k.as_str());
    }
    drop(seen);
    let mut at = 0;
    writes.retain(|_| {
        at += 1;
        keep[at - 1]
    });
    writes
}

/// Checks a CSV file's header against `view` as loading it would (a column named twice, one the view does
/// not have, no entity key column), reading no further, so that a command loading several files can
/// refuse a bad header before it writes any.
pub fn check_csv_header<R: BufRead>(view: &View, reader: R) -> anyhow::Result<()> {
    csv_rows(view, reader, 1).map(|_| ())
}

/// CSV rows as JSON objects typed by the view. The header row names the entity key, `event_timestamp` and
/// features; a cell is typed by its column's feature, an empty cell is a missing value, and a `float32[N]`
/// cell holds a JSON list.
fn csv_rows<'a, R: BufRead + 'a>(
    view: &'a View,
    reader: R,
    from_line: usize,
) -> anyhow::Result<impl Iterator<Item = std::io::Result<ParsedLine>> + 'a> {
    let mut rdr = csv::ReaderBuilder::new()
        .flexible(true)
        .from_reader(LineStarts::new(reader));
    // Spaces around a column name are layout (`user_id, age`), as around a number in a cell.
    let headers: csv::StringRecord = rdr.headers()?.iter().map(str::trim).collect();
    if headers.iter().all(str::is_empty) {
        anyhow::bail!(
            "the file is empty: a CSV file of view `{}` starts with a header line naming its columns (`{}`, `event_timestamp` and its features: {})",
            view.name,
            view.entity.name,
            feature_names(view)
        );
    }
    // `user_id,,age`, or a line ending in a comma: a cell under no name could not be placed.
    if let Some(i) = headers.iter().position(str::is_empty) {
        anyhow::bail!(
            "column {} of the CSV header has no name (the header: `{}`): each column names `{}`, `event_timestamp` or a feature of view `{}`",
            i + 1,
            headers.iter().collect::<Vec<_>>().join(","),
            view.entity.name,
            view.name
        );
    }
    if let Some(twice) = headers
        .iter()
        .enumerate()
        .find_map(|(i, h)| headers.iter().skip(i + 1).any(|o| o == h).then_some(h))
    {
        anyhow::bail!("the CSV header names the column `{twice}` twice");
    }
    // A column the view does not have would be refused in every row: say it once, for the file.
    if let Some(unknown) = headers.iter().find(|h| !takes_column(view, h)) {
        anyhow::bail!(
            "the CSV header names `{unknown}`, which is not a column of view `{}` (it takes `{}`, `event_timestamp` and its features: {})",
            view.name,
            view.entity.name,
            feature_names(view)
        );
    }
    if !headers.iter().any(|h| h == view.entity.name) {
        anyhow::bail!(
            "the CSV header has no `{}` column: every row of view `{}` needs its entity key (the header is: {})",
            view.entity.name,
            view.name,
            excerpt(&headers.iter().collect::<Vec<_>>().join(","))
        );
    }
    // Each column's type, found once per file rather than once per cell.
    let columns: Vec<(String, Option<Dtype>)> = headers
        .iter()
        .map(|h| {
            let dtype = if h == view.entity.name {
                Some(view.entity.dtype)
            } else {
                view.feature_index(h).map(|i| view.features[i].dtype)
            };
            (h.to_owned(), dtype)
        })
        .collect();
    let mut rec = csv::StringRecord::new();
    Ok(std::iter::from_fn(move || {
        // The line a row starts on, from where the parser says it starts (the end of the row before).
        let line_of = |rdr: &mut csv::Reader<LineStarts<R>>, p: Option<&csv::Position>| {
            p.map_or(0, |p| rdr.get_mut().line_at(p.byte(), p.line() as usize))
        };
        let result = rdr.read_record(&mut rec);
        rdr.get_mut().row_start = rdr.position().byte();
        match result {
            Ok(false) => None,
            Ok(true) => {
                let line = line_of(&mut rdr, rec.position());
                if line < from_line {
                    return Some(Ok((line, Ok(unread()))));
                }
                // A quote left open runs the row on over the lines after it, to the end of the file,
                // and a string cell would take them all in silence. No feature value spans lines in
                // CSV (JSON Lines can hold one), so a line break in a cell is refused, naming it.
                let spans = columns
                    .iter()
                    .zip(rec.iter())
                    .find(|(_, c)| c.contains(['\n', '\r']));
                let row = match spans {
                    Some(((h, _), _)) => Err(format!(
                        "`{h}` runs over several lines, most likely from a quote left open (the rest of the file may have gone into it): a CSV value may not hold a line break; write such a value in JSON Lines"
                    )),
                    None => csv_row(&columns, &rec),
                };
                Some(Ok((line, row)))
            }
            Err(e) => {
                let line = line_of(&mut rdr, e.position());
                let reason = format!("not valid CSV: {e}");
                Some(match e.into_kind() {
                    csv::ErrorKind::Io(io) => Err(io),
                    _ => Ok((line, Err(reason))),
                })
            }
        }
    }))
}

/// Passes a CSV file through to the parser, noting where each line's content starts, so a row is
/// numbered by the line it starts on. The parser's own count runs behind by the line ends it has yet to
/// skip: one per CRLF, and every blank line.
struct LineStarts<R> {
    inner: R,
    /// Bytes passed through so far.
    offset: u64,
    /// The line `offset` is on (1-based).
    line: usize,
    /// Whether the last byte ended a line (or nothing has been read).
    at_line_start: bool,
    /// Whether the last byte was a carriage return: a line feed after it ends the same line.
    after_cr: bool,
    /// Offsets where a line's content starts, with that line, from the parser's position on.
    starts: std::collections::VecDeque<(u64, usize)>,
    /// Where the row being parsed starts: reading more than [`MAX_LINE_BYTES`] past it (and the parser's
    /// read-ahead) is an error, so one endless row (or a quote never closed) cannot take all memory.
    row_start: u64,
}

/// What the parser may read beyond a row's limit: its buffer's read-ahead.
const CSV_READ_AHEAD: u64 = 64 << 10;

impl<R> LineStarts<R> {
    fn new(inner: R) -> Self {
        Self {
            inner,
            offset: 0,
            line: 1,
            at_line_start: true,
            after_cr: false,
            starts: Default::default(),
            row_start: 0,
        }
    }

    /// The line of the first content at or after byte `at`, where a row the parser places at `at`
    /// starts; `fallback` when the file ends first.
    fn line_at(&mut self, at: u64, fallback: usize) -> usize {
        let starts = &mut self.starts;
        while starts.front().is_some_and(|(o, _)| *o < at) {
            starts.pop_front();
        }
        starts.front().map_or(fallback, |(_, line)| *line)
    }
}

impl<R: std::io::Read> std::io::Read for LineStarts<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.offset > self.row_start + MAX_LINE_BYTES as u64 + CSV_READ_AHEAD {
            let line = self.line_at(self.row_start, self.line);
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "the CSV row starting on line {line} is longer than {MAX_LINE_BYTES} bytes (a quote opened and never closed?)"
                ),
            ));
        }
        let n = self.inner.read(buf)?;
        let starts = &mut self.starts;
        // Lines end as the parser ends rows: at CRLF, LF, or a lone CR (files saved as "CSV (Macintosh)").
        for &b in &buf[..n] {
            match b {
                b'\n' if self.after_cr => self.after_cr = false,
                b'\n' | b'\r' => {
                    self.line += 1;
                    self.at_line_start = true;
                    self.after_cr = b == b'\r';
                }
                _ => {
                    self.after_cr = false;
                    if self.at_line_start {
                        starts.push_back((self.offset, self.line));
                        self.at_line_start = false;
                    }
                }
            }
            self.offset += 1;
        }
        Ok(n)
    }
}

/// One CSV record as a JSON object, against the file's `columns` (name and type).
fn csv_row(
    columns: &[(String, Option<Dtype>)],
    rec: &csv::StringRecord,
) -> Result<serde_json::Map<String, serde_json::Value>, String> {
    if rec.len() != columns.len() {
        return Err(format!(
            "{} cells, the header has {}",
            rec.len(),
            columns.len()
        ));
    }
    let mut m = serde_json::Map::new();
    for ((h, dtype), raw) in columns.iter().zip(rec.iter()) {
        if raw.is_empty() {
            continue;
        }
        // Spaces around a number, boolean or timestamp are layout, as JSON numbers already allow;
        // a string keeps them.
        let cell = if *dtype == Some(Dtype::String) {
            raw
        } else {
            raw.trim()
        };
        let v = match dtype {
            Some(Dtype::String) => serde_json::Value::String(cell.to_owned()),
            Some(Dtype::Bool) => match cell.to_ascii_lowercase().as_str() {
                "true" | "1" => serde_json::Value::Bool(true),
                "false" | "0" => serde_json::Value::Bool(false),
                _ => {
                    return Err(format!(
                        "`{h}`: `{}` is not a boolean (true or false, in any case, or 1 or 0)",
                        excerpt(cell)
                    ));
                }
            },
            Some(Dtype::Float32List(_)) => serde_json::from_str(cell).map_err(|_| {
                format!(
                    "`{h}`: `{}` is not a list of numbers (lists are written as [0.1, 0.2])",
                    excerpt(cell)
                )
            })?,
            Some(_) => {
                csv_number(cell).map_err(|why| format!("`{h}`: `{}` {why}", excerpt(cell)))?
            }
            // event_timestamp (the header has no other columns without a type).
            None => serde_json::from_str(cell)
                .unwrap_or_else(|_| serde_json::Value::String(cell.to_owned())),
        };
        m.insert(h.clone(), v);
    }
    Ok(m)
}

/// A CSV number as spreadsheets and exporters write it: `21`, `+1`, `021`, `-0`, `.5`, `1.`, `1e3`. Whole
/// numbers stay integers, so an int64 column keeps all 64 bits; NaN and infinities are not numbers here.
/// The error completes "`cell` ...".
fn csv_number(cell: &str) -> Result<serde_json::Value, &'static str> {
    if let Ok(i) = cell.parse::<i64>() {
        // `-0` is a float's negative zero, as in JSON Lines, where it keeps its sign for a float
        // feature (an integer one takes it as 0 either way).
        if i == 0 && cell.starts_with('-') {
            return serde_json::Number::from_f64(-0.0)
                .map(serde_json::Value::Number)
                .ok_or("is not a number");
        }
        return Ok(i.into());
    }
    match cell.parse::<f64>() {
        Err(_) => Err("is not a number"),
        // `inf` or `infinity` (any case) is written with an `i`; `1e400` only with digits and an `e`.
        Ok(f) if f.is_nan() || (f.is_infinite() && cell.bytes().any(|b| (b | 0x20) == b'i')) => {
            Err("is not a number: NaN and infinities cannot be stored")
        }
        // Written with digits, yet past what a 64-bit float holds (about ±1.8e308).
        Ok(f) if f.is_infinite() => Err("is too large for a number (at most about ±1.8e308)"),
        Ok(f) => serde_json::Number::from_f64(f)
            .map(serde_json::Value::Number)
            .ok_or("is not a number"),
    }
}

/// A value as a message shows it: whole when short, else its start and its length, so a rejected
/// megabyte cell does not become a megabyte of error output.
fn excerpt(s: &str) -> std::borrow::Cow<'_, str> {
    const SHOWN: usize = 80;
    if s.len() <= SHOWN {
        return s.into();
    }
    format!("{}… ({} bytes)", crate::error::head(s, SHOWN), s.len()).into()
}

/// Whether `path` is read as CSV (by its extension).
pub fn is_csv(path: &Path) -> bool {
    path.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e.eq_ignore_ascii_case("csv"))
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::sync::Arc;

    use super::*;
    use crate::schema::Registry;

    fn view() -> std::sync::Arc<View> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let r = Registry::load_dir(&root.join("schemas"), &root.join("models")).expect("schemas");
        r.views["user_profile"].clone()
    }

    /// A file still being written: each chunk is what one read finds; an empty chunk is the end of
    /// the file as it was at that moment.
    struct Growing(std::collections::VecDeque<&'static [u8]>);

    impl std::io::Read for Growing {
        fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
            let Some(chunk) = self.0.pop_front() else {
                return Ok(0);
            };
            let n = chunk.len().min(out.len());
            out[..n].copy_from_slice(&chunk[..n]);
            if n < chunk.len() {
                self.0.push_front(&chunk[n..]);
            }
            Ok(n)
        }
    }

    #[test]
    fn a_line_being_written_is_the_last_one_read_not_two_rows() {
        let file = Growing(
            [
                &b"{\"user_id\": \"a\"}\n{\"user_id\": "[..],
                b"",
                b"\"b\"}\n{\"user_id\": \"c\"}\n",
            ]
            .into(),
        );
        let read: Vec<_> = json_rows(std::io::BufReader::new(file), 1)
            .map(|r| r.expect("read"))
            .collect();
        assert_eq!(read.len(), 2, "{read:?}");
        assert_eq!(read[0].0, 1);
        assert!(read[0].1.is_ok(), "{read:?}");
        assert_eq!(read[1].0, 2);
        let reason = read[1].1.as_ref().expect_err("cut short");
        assert!(reason.contains("no line end"), "{reason}");
        // A whole last row without a line end is a row like any other.
        let file = Growing([&b"{\"user_id\": \"a\"}\n{\"user_id\": \"b\"}"[..]].into());
        let read: Vec<_> = json_rows(std::io::BufReader::new(file), 1)
            .map(|r| r.expect("read"))
            .collect();
        assert_eq!(read.len(), 2, "{read:?}");
        assert!(read.iter().all(|(_, r)| r.is_ok()), "{read:?}");
    }

    fn rows(v: serde_json::Value) -> Vec<serde_json::Map<String, serde_json::Value>> {
        serde_json::from_value(v).expect("rows")
    }

    /// A real embedded store in a temporary directory.
    fn store() -> (tempfile::TempDir, crate::store::embedded::EmbeddedStore) {
        let dir = tempfile::tempdir().expect("tempdir");
        let store =
            crate::store::embedded::EmbeddedStore::open(&dir.path().join("s.redb")).expect("open");
        (dir, store)
    }

    /// Loads `reader` into `store` as `user_profile` rows, with the default limits.
    async fn load_users(
        store: &(impl Store + Clone + 'static),
        reader: impl BufRead,
        csv: bool,
    ) -> anyhow::Result<Report> {
        let store: Arc<dyn Store> = Arc::new(store.clone());
        load(&view(), "hy", reader, csv, &LimitsConfig::default(), store).await
    }

    /// [`load_users`] from `input` (its first line and format), until `stop` is set.
    async fn load_users_until<R: BufRead>(
        store: &(impl Store + Clone + 'static),
        input: Input<R>,
        stop: &std::sync::atomic::AtomicBool,
    ) -> Report {
        let store: Arc<dyn Store> = Arc::new(store.clone());
        load_until(&view(), "hy", input, &LimitsConfig::default(), store, stop)
            .await
            .expect("load")
    }

    async fn age_of(store: &dyn Store, user: &str) -> Option<Value> {
        let got = store
            .get_many(&[format!("hy:user_profile:{user}")])
            .await
            .expect("read");
        let bytes = got.into_iter().next().flatten()?;
        Some(Record::decode(&bytes).expect("record").values[0].clone())
    }

    #[tokio::test]
    async fn a_file_larger_than_the_batches_in_flight_loads_every_good_row_and_lists_the_bad_by_line()
     {
        let (_dir, store) = store();
        // More rows than IN_FLIGHT full batches, a bad row every 1000 lines, a line that is not UTF-8 and
        // more bad rows than the report lists.
        let n = BATCH * (IN_FLIGHT + 2) + 17;
        let mut file: Vec<u8> = Vec::new();
        let mut good = 0;
        for i in 0..n {
            if i % 1000 == 999 {
                file.extend_from_slice(
                    format!("{{\"user_id\": \"u{i}\", \"age\": \"x\"}}\n").as_bytes(),
                );
            } else if i == 2500 {
                file.extend_from_slice(b"{\"user_id\": \"\xff\xfe\"}\n");
            } else {
                file.extend_from_slice(
                    format!("{{\"user_id\": \"u{i}\", \"age\": {i}}}\n").as_bytes(),
                );
                good += 1;
            }
        }
        for _ in 0..MAX_LISTED_REJECTS {
            file.extend_from_slice(b"[]\n");
        }
        let report = load_users(&store, &file[..], false).await.expect("load");
        assert_eq!(report.written, good);
        assert!(report.failed.is_empty());
        let bad_lines = n / 1000 + 1 + MAX_LISTED_REJECTS;
        assert_eq!(report.rejected_rows, bad_lines);
        assert_eq!(report.rejected.len(), MAX_LISTED_REJECTS);
        assert_eq!(report.rejected[0].line, 1000);
        assert_eq!(report.rejected[2].line, 2501);
        assert!(
            report.rejected[2].reason.contains("not UTF-8"),
            "{:?}",
            report.rejected[2]
        );
        assert_eq!(age_of(&store, "u0").await, Some(Value::Int(0)));
        assert_eq!(
            age_of(&store, &format!("u{}", n - 1)).await,
            Some(Value::Int(n as i64 - 1))
        );
        assert_eq!(age_of(&store, "u999").await, None);
    }

    /// The embedded store, counting the batch writes it is asked for; with `first_late`, the first write is
    /// held back so that later batches land before it, as concurrent round trips may; with `full`, every
    /// write fails, as on a full disk.
    #[derive(Clone)]
    struct TestStore {
        inner: crate::store::embedded::EmbeddedStore,
        writes: Arc<std::sync::atomic::AtomicUsize>,
        first_late: bool,
        full: bool,
        /// The first write answers [`StoreError::Timeout`] (and is not applied here).
        first_times_out: bool,
    }

    impl TestStore {
        fn open(first_late: bool) -> (tempfile::TempDir, Self) {
            let (dir, inner) = store();
            let store = Self {
                inner,
                writes: Default::default(),
                first_late,
                full: false,
                first_times_out: false,
            };
            (dir, store)
        }
    }

    impl Store for TestStore {
        fn backend(&self) -> &'static str {
            "test"
        }

        fn get_many<'a>(
            &'a self,
            keys: &'a [String],
        ) -> crate::store::BoxFuture<'a, Result<Vec<Option<Vec<u8>>>, StoreError>> {
            self.inner.get_many(keys)
        }

        fn put_many(
            &self,
            writes: Writes,
            ttl: Option<Duration>,
        ) -> crate::store::BoxFuture<'_, Result<(), StoreError>> {
            let first = self.writes.fetch_add(1, Relaxed) == 0;
            let late = first && self.first_late;
            let times_out = first && self.first_times_out;
            Box::pin(async move {
                if times_out {
                    return Err(StoreError::Timeout);
                }
                if self.full {
                    return Err(StoreError::Io("No space left on device".to_owned()));
                }
                if late {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                self.inner.put_many(writes, ttl).await
            })
        }
    }

    #[tokio::test]
    async fn an_interrupted_load_stops_at_the_next_row_and_says_where() {
        let (_dir, store) = store();
        let file: String = (0..3 * BATCH)
            .map(|i| format!("{{\"user_id\": \"u{i}\", \"age\": 1}}\n"))
            .collect();
        // The flag goes up while the second batch is being read.
        struct StopAfter<'a> {
            inner: &'a [u8],
            read: usize,
            stop: &'a std::sync::atomic::AtomicBool,
        }
        impl std::io::Read for StopAfter<'_> {
            fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
                let n = buf.len().min(self.inner.len()).min(64);
                buf[..n].copy_from_slice(&self.inner[..n]);
                self.inner = &self.inner[n..];
                self.read += n;
                if self.read > file_bytes_per_row() * (BATCH + BATCH / 2) {
                    self.stop.store(true, Relaxed);
                }
                Ok(n)
            }
        }
        fn file_bytes_per_row() -> usize {
            "{\"user_id\": \"u1000\", \"age\": 1}\n".len()
        }
        let stop = std::sync::atomic::AtomicBool::new(false);
        let reader = std::io::BufReader::with_capacity(
            64,
            StopAfter {
                inner: file.as_bytes(),
                read: 0,
                stop: &stop,
            },
        );
        let input = Input {
            reader,
            csv: false,
            from_line: 1,
        };
        let report = load_users_until(&store, input, &stop).await;
        let why = report.gave_up.expect("interrupted");
        let line: usize = why
            .strip_prefix("interrupted before line ")
            .and_then(|r| r.split(':').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{why}"));
        assert!(
            (BATCH + 2..2 * BATCH).contains(&line),
            "stopped in the second batch: {why}"
        );
        assert_eq!(
            report.written,
            line - 1,
            "every row read before the stop is written"
        );
        assert!(report.failed.is_empty());
    }

    /// A pipe whose writer pauses without end (`tail -f`, a stalled export): a stop ends the load at
    /// once, with the rows read so far written, rather than when the writer sends more or closes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stop_ends_a_load_whose_pipe_pauses() {
        use std::io::Write as _;
        let (_dir, store) = store();
        let (reader, mut writer) = std::io::pipe().expect("pipe");
        writer
            .write_all(b"{\"user_id\": \"a\", \"age\": 1}\n{\"user_id\": \"b\", \"age\": 2}\n")
            .expect("write");
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let input = Input {
            reader: std::io::BufReader::new(Stoppable::new(reader, stop.clone()).expect("thread")),
            csv: false,
            from_line: 1,
        };
        let flag = stop.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            flag.store(true, Relaxed);
        });
        let started = Instant::now();
        let report = load_users_until(&store, input, &stop).await;
        // The writer is still open: only the stop can have ended the load.
        assert!(started.elapsed() < Duration::from_secs(5));
        assert_eq!(report.written, 2);
        assert_eq!(
            report.gave_up.as_deref(),
            Some(
                "interrupted while waiting for input after line 2: the rows read were loaded, the rest of the input was not read"
            )
        );
        assert_eq!(age_of(&store, "b").await, Some(Value::Int(2)));
        drop(writer);
    }

    /// Until a stop, a [`Stoppable`] reads what its input holds and ends where it ends.
    #[test]
    fn a_stoppable_reader_reads_its_input_whole() {
        let text: Vec<u8> = (0..200_000u32).flat_map(|i| i.to_le_bytes()).collect();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut read = Vec::new();
        Stoppable::new(std::io::Cursor::new(text.clone()), stop)
            .expect("thread")
            .read_to_end(&mut read)
            .expect("read");
        assert!(read == text, "{} bytes of {}", read.len(), text.len());
    }

    /// Ctrl-C in a shell stops a pipe's writer too, and the loader may see the input end before it sees
    /// the signal's flag: the report still says the load was interrupted, and what that may mean.
    #[tokio::test]
    async fn an_input_that_ends_once_the_load_is_stopped_is_reported_as_interrupted() {
        let (_dir, store) = store();
        struct EndsStopped<'a> {
            rows: &'a [u8],
            stop: &'a std::sync::atomic::AtomicBool,
        }
        impl std::io::Read for EndsStopped<'_> {
            fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
                if self.rows.is_empty() {
                    // The writer died of the same signal: the flag is up, then the input ends.
                    self.stop.store(true, Relaxed);
                    return Ok(0);
                }
                let n = buf.len().min(self.rows.len());
                buf[..n].copy_from_slice(&self.rows[..n]);
                self.rows = &self.rows[n..];
                Ok(n)
            }
        }
        let stop = std::sync::atomic::AtomicBool::new(false);
        let rows = "{\"user_id\": \"a\", \"age\": 1}\n{\"user_id\": \"b\", \"age\": 2}\n";
        let input = Input {
            reader: std::io::BufReader::new(EndsStopped {
                rows: rows.as_bytes(),
                stop: &stop,
            }),
            csv: false,
            from_line: 1,
        };
        let report = load_users_until(&store, input, &stop).await;
        assert_eq!(report.written, 2);
        assert_eq!(
            report.gave_up.as_deref(),
            Some(
                "interrupted as the input ended, after line 2: every row read was loaded, but an input piped from a command the same signal stopped may have been cut short"
            )
        );
        assert_eq!(age_of(&store, "b").await, Some(Value::Int(2)));
    }

    #[tokio::test]
    async fn a_later_row_of_a_key_whose_batch_timed_out_is_not_sent() {
        let (_dir, mut store) = TestStore::open(false);
        store.first_times_out = true;
        // Batch 1 times out; batch 2 rewrites its keys; batch 3 has keys of its own.
        let file: String = (0..BATCH)
            .map(|i| format!("{{\"user_id\": \"u{i}\", \"age\": 1}}\n"))
            .chain((0..BATCH).map(|i| format!("{{\"user_id\": \"u{i}\", \"age\": 2}}\n")))
            .chain((0..BATCH).map(|i| format!("{{\"user_id\": \"v{i}\", \"age\": 3}}\n")))
            .collect();
        let report = load_users(&store, file.as_bytes(), false)
            .await
            .expect("load");
        assert_eq!(report.failed.len(), 2, "{:?}", report.failed);
        let (timed_out, held) = (&report.failed[0], &report.failed[1]);
        assert!(timed_out.unconfirmed && timed_out.first_line == 1);
        assert!(!held.unconfirmed, "{held:?}");
        assert_eq!((held.first_line, held.last_line), (BATCH + 1, 2 * BATCH));
        assert!(
            held.reason
                .contains(&format!("keys of lines 1-{BATCH}, whose batch timed out")),
            "{}",
            held.reason
        );
        assert_eq!(report.written, BATCH);
        assert_eq!(age_of(&store.inner, "u0").await, None);
        assert_eq!(age_of(&store.inner, "v0").await, Some(Value::Int(3)));
    }

    #[tokio::test]
    async fn a_load_stops_reading_once_the_store_fails_batch_after_batch() {
        let (_dir, mut store) = TestStore::open(false);
        store.full = true;
        let file: String = (0..50 * BATCH)
            .map(|i| format!("{{\"user_id\": \"u{i}\", \"age\": 1}}\n"))
            .collect();
        let report = load_users(&store, file.as_bytes(), false)
            .await
            .expect("load");
        assert_eq!(report.written, 0);
        assert!(
            (GIVE_UP_AFTER..GIVE_UP_AFTER + IN_FLIGHT + 1).contains(&report.failed.len()),
            "{} batches tried of 50",
            report.failed.len()
        );
        let why = report.gave_up.expect("gave up");
        assert!(
            why.contains("No space left") && why.contains("nothing after that line was read"),
            "{why}"
        );
    }

    #[tokio::test]
    async fn the_last_row_of_a_key_in_the_file_is_the_one_stored() {
        let (_dir, store) = TestStore::open(true);
        // `x` in the first batch and again in the third; the first batch lands last.
        let mut file = String::from("{\"user_id\": \"x\", \"age\": 1}\n");
        for i in 1..2 * BATCH {
            file.push_str(&format!("{{\"user_id\": \"u{i}\", \"age\": {i}}}\n"));
        }
        file.push_str("{\"user_id\": \"x\", \"age\": 2}\n");
        let report = load_users(&store, file.as_bytes(), false)
            .await
            .expect("load");
        assert_eq!(report.written, 2 * BATCH + 1);
        assert_eq!(age_of(&store, "x").await, Some(Value::Int(2)));
    }

    /// Serves `data`, and notes how many batch writes had started when the reader reached its end.
    struct WatchedReader {
        data: std::io::Cursor<Vec<u8>>,
        writes: Arc<std::sync::atomic::AtomicUsize>,
        at_end: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl std::io::Read for WatchedReader {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let n = self.data.read(buf)?;
            if n == 0 {
                self.at_end.store(self.writes.load(Relaxed), Relaxed);
            }
            Ok(n)
        }
    }

    #[tokio::test]
    async fn batches_are_written_while_the_file_is_still_being_read() {
        let (_dir, store) = TestStore::open(false);
        let writes = store.writes.clone();
        let mut file = String::new();
        for i in 0..2 * BATCH + 1 {
            file.push_str(&format!("{{\"user_id\": \"u{i}\", \"age\": 1}}\n"));
        }
        let at_end = Arc::new(std::sync::atomic::AtomicUsize::new(usize::MAX));
        let reader = std::io::BufReader::new(WatchedReader {
            data: std::io::Cursor::new(file.into_bytes()),
            writes: writes.clone(),
            at_end: at_end.clone(),
        });
        let report = load_users(&store, reader, false).await.expect("load");
        assert_eq!(report.written, 2 * BATCH + 1);
        // The two full batches were being written before the last line was read.
        assert_eq!(at_end.load(Relaxed), 2);
        assert_eq!(writes.load(Relaxed), 3);
    }

    #[tokio::test]
    async fn an_overlong_line_is_a_rejected_row_and_the_next_line_still_loads() {
        let (_dir, store) = store();
        let mut file = format!(
            "{{\"user_id\": \"a\", \"country\": \"{}\"}}\n",
            "x".repeat(MAX_LINE_BYTES)
        );
        file.push_str("{\"user_id\": \"b\", \"age\": 3}\n");
        let report = load_users(&store, file.as_bytes(), false)
            .await
            .expect("load");
        assert_eq!((report.written, report.rejected_rows), (1, 1));
        assert_eq!(report.rejected[0].line, 1);
        assert!(
            report.rejected[0].reason.contains("longer than"),
            "{:?}",
            report.rejected
        );
        assert_eq!(age_of(&store, "b").await, Some(Value::Int(3)));
    }

    #[tokio::test]
    async fn a_line_of_exactly_the_limit_loads_and_so_does_the_next() {
        let (_dir, store) = store();
        let head = "{\"user_id\": \"a\", \"country\": \"";
        let tail = "\"}";
        let pad = MAX_LINE_BYTES - head.len() - tail.len();
        let mut file = format!("{head}{}{tail}\n", "x".repeat(pad));
        assert_eq!(file.len(), MAX_LINE_BYTES + 1);
        file.push_str("{\"user_id\": \"b\", \"age\": 3}\n");
        let report = load_users(&store, file.as_bytes(), false)
            .await
            .expect("load");
        assert_eq!(
            (report.written, report.rejected_rows),
            (2, 0),
            "{:?}",
            report.rejected
        );
        assert_eq!(age_of(&store, "b").await, Some(Value::Int(3)));
    }

    /// Serves `data`, then fails as a broken disk or a cut pipe would.
    struct FailsAfter<'a> {
        data: &'a [u8],
    }

    impl std::io::Read for FailsAfter<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            if self.data.is_empty() {
                return Err(std::io::Error::other("device error"));
            }
            let n = buf.len().min(self.data.len());
            buf[..n].copy_from_slice(&self.data[..n]);
            self.data = &self.data[n..];
            Ok(n)
        }
    }

    #[tokio::test]
    async fn a_read_error_stops_the_load_after_writing_the_rows_read_before_it() {
        let (_dir, store) = store();
        let data = b"{\"user_id\": \"a\", \"age\": 1}\n{\"user_id\": \"b\", \"age\": 2}\n";
        let reader = std::io::BufReader::new(FailsAfter { data });
        let report = load_users(&store, reader, false).await.expect("a report");
        let why = report.gave_up.clone().unwrap_or_default();
        assert!(
            why.contains("cannot read past line 2") && why.contains("device error"),
            "{why}"
        );
        assert_eq!(report.written, 2);
        assert_eq!(age_of(&store, "b").await, Some(Value::Int(2)));

        let csv = b"user_id,age\na,5\n";
        let reader = std::io::BufReader::new(FailsAfter { data: csv });
        let report = load_users(&store, reader, true).await.expect("a report");
        let why = report.gave_up.unwrap_or_default();
        assert!(why.contains("device error"), "{why}");
        assert_eq!(age_of(&store, "a").await, Some(Value::Int(5)));
    }

    #[tokio::test]
    async fn a_byte_order_mark_before_the_first_row_is_not_part_of_it() {
        let (_dir, store) = store();
        let file = b"\xef\xbb\xbf{\"user_id\": \"a\", \"age\": 7}\n";
        let report = load_users(&store, &file[..], false).await.expect("load");
        assert_eq!(
            (report.written, report.rejected_rows),
            (1, 0),
            "{:?}",
            report.rejected
        );
        assert_eq!(age_of(&store, "a").await, Some(Value::Int(7)));
    }

    #[tokio::test]
    async fn csv_numbers_are_read_as_exporters_write_them() {
        let (_dir, store) = store();
        let csv = "user_id,age,avg_session_minutes\na,+1,.5\nb,021,1.\nc,1e1,-0\nd,inf,1\ne,1,NaN\nf,1,-1e400\n";
        let report = load_users(&store, csv.as_bytes(), true)
            .await
            .expect("load");
        assert_eq!(report.written, 3, "{:?}", report.rejected);
        let said: Vec<(usize, &str)> = report
            .rejected
            .iter()
            .map(|r| (r.line, r.reason.as_str()))
            .collect();
        assert_eq!(
            said,
            vec![
                (
                    5,
                    "`age`: `inf` is not a number: NaN and infinities cannot be stored"
                ),
                (
                    6,
                    "`avg_session_minutes`: `NaN` is not a number: NaN and infinities cannot be stored"
                ),
                (
                    7,
                    "`avg_session_minutes`: `-1e400` is too large for a number (at most about ±1.8e308)"
                ),
            ]
        );
        for (user, age) in [("a", 1), ("b", 21), ("c", 10)] {
            assert_eq!(age_of(&store, user).await, Some(Value::Int(age)), "{user}");
        }
        // `-0` keeps its sign in a float feature, as it does in JSON Lines.
        let got = store
            .get_many(&["hy:user_profile:c".to_owned()])
            .await
            .expect("read");
        let record = Record::decode(got[0].as_deref().expect("c")).expect("record");
        let minutes = record.values.iter().find_map(|v| match v {
            Value::Float(f) if *f == 0.0 => Some(*f),
            _ => None,
        });
        assert!(
            minutes.is_some_and(|f| f.is_sign_negative()),
            "{:?}",
            record.values
        );
    }

    #[tokio::test]
    async fn a_csv_load_from_a_line_counts_the_rows_before_it_and_writes_the_rest() {
        let (_dir, store) = store();
        // Line 2: a bad age; lines 3-4: one row over two lines; lines 5 and 6: good rows.
        let csv = "user_id,age,country\na,x,de\nb,2,\"two\nlines\"\nc,3,fr\nd,4,us\n";
        let stop = std::sync::atomic::AtomicBool::new(false);
        let from = |line| {
            let input = Input {
                reader: csv.as_bytes(),
                csv: true,
                from_line: line,
            };
            load_users_until(&store, input, &stop)
        };
        let report = from(6).await;
        assert_eq!((report.skipped, report.written), (3, 1), "{report:?}");
        assert!(report.rejected.is_empty(), "{:?}", report.rejected);
        assert_eq!(age_of(&store, "d").await, Some(Value::Int(4)));
        assert_eq!(age_of(&store, "c").await, None, "before the line");
        let report = from(5).await;
        assert_eq!((report.skipped, report.written), (2, 2), "{report:?}");
        assert_eq!(age_of(&store, "c").await, Some(Value::Int(3)));
    }

    #[tokio::test]
    async fn a_load_from_a_line_past_the_last_row_says_it_loaded_nothing() {
        let (_dir, store) = store();
        let stop = std::sync::atomic::AtomicBool::new(false);
        // The last row starts on line 3 and runs over line 4.
        let csv = "user_id,age,country\na,1,de\nb,2,\"two\nlines\"\n";
        let json = "{\"user_id\": \"a\", \"age\": 1}\n\n{\"user_id\": \"b\", \"age\": 2}\n";
        let past = |line| {
            format!(
                "the file's last row starts on line 3, before line {line} where the load was to start: nothing was loaded"
            )
        };
        let empty = "the file has no rows, so none starts on line 2 or later: nothing was loaded";
        for (text, csv, line, why) in [
            (csv, true, 4, past(4)),
            (csv, true, 90, past(90)),
            (json, false, 4, past(4)),
            ("", false, 2, empty.to_owned()),
        ] {
            let input = Input {
                reader: text.as_bytes(),
                csv,
                from_line: line,
            };
            let report = load_users_until(&store, input, &stop).await;
            assert_eq!(report.written, 0, "{report:?}");
            assert_eq!(report.gave_up, Some(why), "line {line}");
        }
        // The last row's own line is not past it.
        let input = Input {
            reader: json.as_bytes(),
            csv: false,
            from_line: 3,
        };
        let report = load_users_until(&store, input, &stop).await;
        assert_eq!((report.written, report.gave_up), (1, None));
    }

    #[tokio::test]
    async fn csv_rows_are_numbered_by_the_line_they_start_on() {
        let (_dir, store) = store();
        let csv = "user_id,age,country\na,1,\"two\nlines\"\nb,x,de\nc,3\nd,4,fr\n";
        let report = load_users(&store, csv.as_bytes(), true)
            .await
            .expect("load");
        assert_eq!(report.written, 1);
        let lines: Vec<(usize, &str)> = report
            .rejected
            .iter()
            .map(|r| (r.line, r.reason.split(',').next().unwrap_or_default()))
            .collect();
        assert_eq!(
            lines,
            vec![
                (2, "`country` runs over several lines"),
                (4, "`age`: `x` is not a number"),
                (5, "2 cells"),
            ]
        );
    }

    #[tokio::test]
    async fn an_endless_csv_row_stops_the_load_in_bounded_memory_and_says_where() {
        let (_dir, store) = store();
        // A quote opened on line 3 and never closed: the rest of the file would be one cell.
        let mut csv = String::from("user_id,age,country\na,1,de\nb,2,\"open\n");
        while csv.len() <= MAX_LINE_BYTES + 2 * CSV_READ_AHEAD as usize {
            csv.push_str("c,3,fr\n");
        }
        let report = load_users(&store, csv.as_bytes(), true)
            .await
            .expect("a report");
        let e = report.gave_up.unwrap_or_default();
        assert!(
            e.contains("line 3 is longer than 8388608 bytes") && e.contains("never closed"),
            "{e}"
        );
        assert_eq!(report.written, 1);
        assert_eq!(age_of(&store, "a").await, Some(Value::Int(1)));
        // A short file with the same mistake: the row reaches the end, and the message says why.
        let report = load_users(&store, "user_id,age\n\"u,1\nq,2\n".as_bytes(), true)
            .await
            .expect("load");
        assert_eq!(report.rejected.len(), 1);
        assert!(
            report.rejected[0].reason.contains("a quote left open"),
            "{}",
            report.rejected[0].reason
        );
        // ...also where the open cell is a string, which would otherwise take the rest of the file in.
        let csv = "user_id,age,country\nv,1,\"never closed\nw,2,fine\n";
        let report = load_users(&store, csv.as_bytes(), true)
            .await
            .expect("load");
        assert_eq!((report.written, report.rejected.len()), (0, 1));
        assert!(
            report.rejected[0]
                .reason
                .starts_with("`country` runs over several lines"),
            "{}",
            report.rejected[0].reason
        );
        assert_eq!(age_of(&store, "w").await, None);
    }

    #[tokio::test]
    async fn a_csv_header_without_the_entity_key_is_refused_for_the_file() {
        let (_dir, store) = store();
        let e = load_users(&store, "age,country\n1,de\n".as_bytes(), true)
            .await
            .expect_err("no key column")
            .to_string();
        assert!(e.contains("no `user_id` column"), "{e}");
    }

    #[tokio::test]
    async fn a_csv_column_with_no_name_is_named_by_its_place() {
        let (_dir, store) = store();
        for header in ["user_id,,age", "user_id,age,", "user_id, ,age"] {
            let body = format!("{header}\na,x,31\n");
            let e = load_users(&store, body.as_bytes(), true)
                .await
                .expect_err("nameless column")
                .to_string();
            let place = if header == "user_id,age," { 3 } else { 2 };
            assert!(
                e.starts_with(&format!("column {place} of the CSV header has no name")),
                "{e}"
            );
        }
        assert_eq!(age_of(&store, "a").await, None);
    }

    #[tokio::test]
    async fn spaces_around_csv_column_names_are_layout() {
        let (_dir, store) = store();
        let report = load_users(&store, "user_id , age\na, 31 \n".as_bytes(), true)
            .await
            .expect("load");
        assert_eq!((report.written, report.rejected_rows), (1, 0), "{report:?}");
        assert_eq!(age_of(&store, "a").await, Some(Value::Int(31)));
    }

    #[tokio::test]
    async fn an_empty_csv_file_is_called_empty() {
        let (_dir, store) = store();
        for empty in ["", "\n", "\r\n"] {
            let e = load_users(&store, empty.as_bytes(), true)
                .await
                .expect_err("empty")
                .to_string();
            assert!(
                e.starts_with("the file is empty: a CSV file of view `user_profile` starts with a header line naming its columns (`user_id`, "),
                "{empty:?}: {e}"
            );
        }
    }

    #[tokio::test]
    async fn a_long_bad_cell_is_shown_cut_short() {
        let (_dir, store) = store();
        let csv = format!("user_id,age\na,{}\n", "9x".repeat(50_000));
        let report = load_users(&store, csv.as_bytes(), true)
            .await
            .expect("load");
        let reason = &report.rejected[0].reason;
        assert!(
            reason.len() < 200 && reason.contains("(100000 bytes)"),
            "{reason}"
        );
    }

    /// A float64 written as JSON is stored as exactly the double its text names (serde_json's default
    /// parser is off by one unit in the last place for about one 17-digit value in five).
    #[tokio::test]
    async fn float64_values_written_as_json_are_stored_exactly() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let reg = Registry::load_dir(&root.join("schemas"), &root.join("models")).expect("schemas");
        let items = reg.views["item_stats"].clone();
        let price = items.feature_index("price").expect("price");
        // Doubles spread over many magnitudes, each written in its shortest round-trip form.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut lines = String::from(r#"{"item_id": "i_ulp", "price": -476209.41623479564}"#);
        lines.push('\n');
        let mut sent = vec![-476_209.416_234_795_64_f64];
        for i in 0..500 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let v = f64::from_bits(x >> 2) * if i % 2 == 0 { 1.0 } else { -1.0 };
            if !v.is_finite() {
                continue;
            }
            lines.push_str(&format!("{{\"item_id\": \"i_{i}\", \"price\": {v}}}\n"));
            sent.push(v);
        }
        let (_dir, store) = store();
        let report = load(
            &items,
            "hy",
            lines.as_bytes(),
            false,
            &LimitsConfig::default(),
            Arc::new(store.clone()),
        )
        .await
        .expect("load");
        assert!(report.rejected.is_empty(), "{report:?}");
        let keys: Vec<String> = std::iter::once("i_ulp".to_owned())
            .chain((0..500).map(|i| format!("i_{i}")))
            .map(|k| format!("hy:item_stats:{k}"))
            .collect();
        let got = store.get_many(&keys).await.expect("read");
        let stored: Vec<f64> = got
            .into_iter()
            .flatten()
            .map(
                |b| match &Record::decode(&b).expect("record").values[price] {
                    Value::Float(f) => *f,
                    other => panic!("{other:?}"),
                },
            )
            .collect();
        assert_eq!(stored.len(), sent.len());
        for (s, w) in stored.iter().zip(&sent) {
            assert_eq!(s.to_bits(), w.to_bits(), "sent {w}, stored {s}");
        }
    }

    #[tokio::test]
    async fn a_name_given_twice_is_refused_not_last_wins() {
        let (_dir, store) = store();
        let jsonl = "{\"user_id\": \"a\", \"user_id\": \"b\", \"age\": 1}\n{\"user_id\": \"c\", \"age\": 1, \"age\": 2}\n{\"user_id\": \"d\", \"age\": 4}\n";
        let report = load_users(&store, jsonl.as_bytes(), false)
            .await
            .expect("load");
        assert_eq!(report.written, 1);
        let reasons: Vec<&str> = report.rejected.iter().map(|r| r.reason.as_str()).collect();
        assert!(
            reasons[0].starts_with("`user_id` is given twice"),
            "{reasons:?}"
        );
        assert!(
            reasons[1].starts_with("`age` is given twice"),
            "{reasons:?}"
        );
        // The position is within the file's line 2, not "at line 1".
        assert!(
            reasons[1].ends_with("(column 36)") && !reasons[1].contains("line 1"),
            "{reasons:?}"
        );
        // A row cut short ends where it was cut, not at "column 0" past its line ending.
        let cut = "{\"user_id\": \"e\", \"age\": 1}\n{\"user_id\":\"x5\",\"age\":1,\r\n[1,2]\n";
        let report = load_users(&store, cut.as_bytes(), false)
            .await
            .expect("load");
        let reasons: Vec<&str> = report.rejected.iter().map(|r| r.reason.as_str()).collect();
        assert_eq!(
            reasons[0], "not valid JSON: EOF while parsing a value (column 24)",
            "{reasons:?}"
        );
        assert_eq!(
            reasons[1],
            "invalid type: sequence, expected a row (an object of feature names and values)"
        );
        // A value JSON cannot hold is named by its feature, as other refusals are.
        let wide = "{\"user_id\":\"w\",\"age\":1e400}\n{\"user_id\":\"n\",\"age\":NaN}\n{\"user_id\":\"q\",\"tags\":[1,2e999]}\n";
        let report = load_users(&store, wide.as_bytes(), false)
            .await
            .expect("load");
        let reasons: Vec<&str> = report.rejected.iter().map(|r| r.reason.as_str()).collect();
        assert_eq!(
            reasons,
            [
                "`age`: not valid JSON: number out of range (column 26)",
                "`age`: not valid JSON: expected value (column 22)",
                "`tags[1]`: not valid JSON: number out of range (column 30)",
            ]
        );
        assert_eq!(age_of(&store, "b").await, None);
        assert_eq!(age_of(&store, "d").await, Some(Value::Int(4)));
        let csv = "user_id,age,age\na,1,2\n";
        let e = load_users(&store, csv.as_bytes(), true)
            .await
            .expect_err("a column twice");
        assert!(e.to_string().contains("`age` twice"), "{e}");
        let csv = "user_id,is_premium,age\ns, true , 46 \n";
        let report = load_users(&store, csv.as_bytes(), true)
            .await
            .expect("load");
        assert_eq!(report.written, 1, "{:?}", report.rejected);
        assert_eq!(age_of(&store, "s").await, Some(Value::Int(46)));
    }

    #[tokio::test]
    async fn csv_rows_are_numbered_right_with_crlf_and_blank_lines() {
        let (_dir, store) = store();
        for (csv, want) in [
            ("user_id,age\r\nr_2,x\r\nr_3,y\r\n", vec![2, 3]),
            ("user_id,age\nr_2,x\nr_3,y\n\n\n\nr_7,z\n", vec![2, 3, 7]),
            ("user_id,age\r\n\r\nr_3,\"x\r\n\"\r\nr_5,y", vec![3, 5]),
            // A lone CR ends a line, as it ends a row ("CSV (Macintosh)"); CR CR is a blank line.
            ("user_id,age\rr_2,x\rr_3,3\rr_4,y\r", vec![2, 4]),
            ("user_id,age\r\rr_3,x\nr_4,4\r\nr_5,y\rr_6,z", vec![3, 5, 6]),
        ] {
            let report = load_users(&store, csv.as_bytes(), true)
                .await
                .expect("load");
            let lines: Vec<usize> = report.rejected.iter().map(|r| r.line).collect();
            assert_eq!(lines, want, "{csv:?}: {:?}", report.rejected);
        }
    }

    #[test]
    fn an_event_timestamp_in_seconds_is_refused_not_read_as_1970() {
        let v = view();
        let now = crate::value::now_ms();
        let limits = LimitsConfig::default();
        let one = |ts: serde_json::Value| {
            parse_rows(
                &v,
                "hy",
                &rows(serde_json::json!([{"user_id": "a", "event_timestamp": ts}])),
                now,
                &limits,
            )
        };
        let e = one(serde_json::json!(now / 1000))
            .expect_err("seconds")
            .to_string();
        assert!(e.contains("multiply by 1000"), "{e}");
        assert!(one(serde_json::json!(now - 1000)).is_ok(), "milliseconds");
        assert!(
            one(serde_json::json!("1970-01-02T00:00:00Z")).is_ok(),
            "an explicit old time"
        );
        // Whole numbers past what a float holds exactly are out of range, not "not whole".
        for (ts, side) in [(1e20, "future"), (-1e20, "past")] {
            let e = one(serde_json::json!(ts))
                .expect_err("far away")
                .to_string();
            assert!(e.contains(&format!("too far in the {side}")), "{e}");
        }
        let e = one(serde_json::json!(1.7e12 + 0.5))
            .expect_err("fraction")
            .to_string();
        assert!(e.contains("not whole milliseconds"), "{e}");
    }

    #[test]
    fn a_rows_request_is_refused_whole_naming_the_first_bad_row() {
        let v = view();
        let limits = LimitsConfig::default();
        let e = parse_rows(
            &v,
            "hy",
            &rows(serde_json::json!([
                {"user_id": "a", "age": 1},
                {"user_id": "b", "age": 1.5},
                {"age": 3}
            ])),
            0,
            &limits,
        )
        .expect_err("bad rows");
        let msg = e.to_string();
        assert!(
            msg.starts_with("rows[1]: feature `age`") && msg.contains("2 of 3"),
            "{msg}"
        );
        assert!(matches!(e, ApiError::Invalid { field: Some(ref f), .. } if f == "rows[1].age"));

        let ok = parse_rows(
            &v,
            "hy",
            &rows(serde_json::json!([{"user_id": "a", "age": 1}, {"user_id": "b"}])),
            7,
            &limits,
        )
        .expect("valid");
        assert_eq!(ok.len(), 2);
        assert_eq!(ok[1].0, "hy:user_profile:b");
        let rec = Record::decode(&ok[0].1).expect("record");
        assert_eq!((rec.event_ts_ms, &rec.values[0]), (7, &Value::Int(1)));

        let e = parse_rows(&v, "hy", &[], 0, &limits).expect_err("empty");
        assert_eq!(e.code(), "invalid_field");
        let many = vec![serde_json::Map::new(); BATCH + 1];
        let e = parse_rows(&v, "hy", &many, 0, &limits).expect_err("too many");
        assert_eq!(e.code(), "too_many_rows");
    }
}
