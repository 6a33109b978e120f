//! `loadtest`: the load generator for the hydrant gateway, its floor server, and its report.
//!
//! # Layout
//!
//! A run flows scenario → workload → drive (client) → record → report:
//!
//! - [`scenario`]: TOML scenario files, strictly parsed and validated; loopback-only targets.
//! - [`sample`]: the seeded PRNG and the Zipf key sampler.
//! - [`workload`]: turns a scenario into predict request bodies (JSON or MessagePack).
//! - [`client`]: HTTP/1 client, one keep-alive connection per in-flight slot; outcome classes.
//! - [`drive`]: the open-loop (fixed schedule, latency from intended send time) and closed-loop
//!   drivers, and Ctrl-C cancellation.
//! - [`record`]: latency histograms per segment, error counts, per-second timeline.
//! - [`stats`]: the gateway's `/v1/stats`: types, per-second sampler, counter deltas.
//! - [`floor`]: the minimal axum server used as a throughput and latency floor.
//! - [`run`]: one run end to end: readiness, warm-up, sweep, phases, floor alternation, files.
//! - [`report`]: the result JSON, the terminal table, the self-contained HTML report.

/// Terminal output that never panics. `println!` and friends panic when the other end of a pipe has
/// gone (`loadtest … | head`); by then the report files are written, so a closed terminal stream is
/// no reason to lose the exit status. These write, and drop a failed write.
#[macro_export]
macro_rules! outln {
    ($($t:tt)*) => {{
        use ::std::io::Write as _;
        let _ = ::std::writeln!(::std::io::stdout().lock(), $($t)*);
    }};
}

/// [`outln!`] without the newline.
#[macro_export]
macro_rules! out {
    ($($t:tt)*) => {{
        use ::std::io::Write as _;
        let mut o = ::std::io::stdout().lock();
        let _ = ::std::write!(o, $($t)*).and_then(|()| o.flush());
    }};
}

/// [`outln!`] on stderr.
#[macro_export]
macro_rules! errln {
    ($($t:tt)*) => {{
        use ::std::io::Write as _;
        let _ = ::std::writeln!(::std::io::stderr().lock(), $($t)*);
    }};
}

/// [`errln!`] without the newline (the progress line).
#[macro_export]
macro_rules! err {
    ($($t:tt)*) => {{
        use ::std::io::Write as _;
        let _ = ::std::write!(::std::io::stderr().lock(), $($t)*);
    }};
}

pub mod client;
pub mod drive;
pub mod floor;
pub mod record;
pub mod redis_probe;
pub mod report;
pub mod run;
pub mod sample;
pub mod scenario;
pub mod stats;
pub mod workload;
