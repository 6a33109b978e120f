//! The terminal summary printed at the end of a run.

use std::fmt::Write as _;

use super::{
    ConfirmResult, LatencySummary, RunResult, fmt_latency, fmt_pct, fmt_rate, fmt_ratio, fmt_rps,
    fmt_us, rps_ratio, us_or_nan,
};

fn row(out: &mut String, name: &str, h: String, f: Option<String>, r: Option<String>) {
    // A space before each column: a value as wide as its column (`26160 (100.0%)`) must not run into
    // the one before it.
    let _ = write!(out, "  {name:<14} {h:>14}");
    if let Some(f) = f {
        let _ = write!(out, " {f:>14}");
        if let Some(r) = r {
            let _ = write!(out, " {r:>9}");
        }
    }
    out.push('\n');
}

fn lat_rows(out: &mut String, h: &LatencySummary, f: Option<&LatencySummary>) {
    for (name, get) in super::LATENCY_ROWS {
        let hv = us_or_nan(get(h));
        let fv = f.map(|f| us_or_nan(get(f)));
        row(
            out,
            name,
            fmt_us(hv),
            fv.map(fmt_us),
            fv.map(|fv| fmt_ratio((fv > 0.0).then(|| hv / fv))),
        );
    }
}

/// How many error codes the summary lists (the most frequent).
const MAX_LISTED_CODES: usize = 10;

/// Renders the summary table.
pub fn render(r: &RunResult) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\nscenario {} ({}) against {}: model {}, {}{}",
        r.scenario,
        r.mode,
        r.target,
        r.model,
        r.format,
        if r.interrupted {
            "  [INTERRUPTED: partial results]"
        } else {
            ""
        }
    );

    if !r.steps.is_empty() {
        let _ = writeln!(out, "\nclosed-loop sweep");
        let _ = writeln!(
            out,
            "  {:<12}{:>12}{:>12}{:>12}{:>10}{:>12}{:>12}",
            "concurrency", "rps", "p50", "p99", "errors", "floor rps", "floor p99"
        );
        for s in &r.steps {
            let _ = writeln!(
                out,
                "  {:<12}{:>12}{:>12}{:>12}{:>10}{:>12}{:>12}",
                s.concurrency
                    .map_or_else(|| "-".to_string(), |c| c.to_string()),
                fmt_rps(s.hydrant.achieved_rps),
                fmt_latency(s.hydrant.p50_us),
                fmt_latency(s.hydrant.p99_us),
                s.hydrant.errors,
                s.floor
                    .as_ref()
                    .map_or_else(|| "-".to_string(), |f| fmt_rps(f.achieved_rps)),
                s.floor
                    .as_ref()
                    .map_or_else(|| "-".to_string(), |f| fmt_latency(f.p99_us)),
            );
        }
        if let Some(c) = &r.confirm {
            let _ = writeln!(out, "  {}", confirm_line(c));
        }
        if let Some(m) = r.max_rps {
            let _ = write!(out, "  max throughput: {}", fmt_rate(m));
            if let (Some(f), Some(ratio)) = (r.floor_rps, r.ratio_to_floor) {
                let _ = write!(out, " (floor {}, ratio {:.2})", fmt_rate(f), ratio);
            }
            if let Some(c) = &r.confirm {
                let _ = write!(out, "; {}", sweep_maxima(c));
            }
            out.push('\n');
            if let Some(line) = threads_line(r) {
                let _ = writeln!(out, "  {line}");
            }
        }
    }

    if let Some(g) = &r.redis_get {
        let _ = writeln!(
            out,
            "\nplain Redis GET, same run ({} samples): p50 {}, p99 {}, p99.9 {}",
            g.samples,
            fmt_us(g.p50_us as f64),
            fmt_us(g.p99_us as f64),
            fmt_us(g.p999_us as f64)
        );
    }

    let _ = writeln!(
        out,
        "\nmeasured: {} ({:.1} s{})",
        r.headline,
        r.hydrant.measured_s,
        r.offered_rps
            .map_or_else(String::new, |o| format!(", offered {}", fmt_rate(o)))
    );
    let f = r.floor.as_ref();
    row(
        &mut out,
        "",
        "hydrant".into(),
        f.map(|_| "floor".into()),
        f.map(|_| "ratio".into()),
    );
    row(
        &mut out,
        "achieved rps",
        fmt_rps(r.hydrant.achieved_rps),
        f.map(|f| fmt_rps(f.achieved_rps)),
        f.map(|f| fmt_ratio(rps_ratio(r.hydrant.achieved_rps, f.achieved_rps))),
    );
    lat_rows(&mut out, &r.hydrant, f);
    row(
        &mut out,
        "requests",
        r.hydrant.requests.to_string(),
        f.map(|f| f.requests.to_string()),
        None,
    );
    row(
        &mut out,
        "errors",
        format!("{} ({})", r.hydrant.errors, fmt_pct(r.hydrant.error_rate)),
        f.map(|f| format!("{} ({})", f.errors, fmt_pct(f.error_rate))),
        None,
    );
    if let Some(late) = r.hydrant.late_share {
        row(
            &mut out,
            "late sends",
            fmt_pct(late),
            f.map(|f| fmt_pct(f.late_share.unwrap_or(0.0))),
            None,
        );
    }
    if !r.hydrant.errors_by_kind.is_empty() {
        let kinds: Vec<String> = r
            .hydrant
            .errors_by_kind
            .iter()
            .map(|(k, v)| format!("{k}: {v}"))
            .collect();
        let _ = writeln!(out, "  errors by status or kind: {}", kinds.join(", "));
    }
    if !r.error_codes.is_empty() {
        // The most frequent first, and only so many: a target that puts a request id in its error
        // codes would otherwise print one line of thousands of them.
        let mut codes: Vec<(&String, &u64)> = r.error_codes.iter().collect();
        codes.sort_by(|a, b| b.1.cmp(a.1).then_with(|| a.0.cmp(b.0)));
        let listed: Vec<String> = codes
            .iter()
            .take(MAX_LISTED_CODES)
            .map(|(k, v)| format!("{k}: {v}"))
            .collect();
        let _ = write!(out, "  error codes: {}", listed.join(", "));
        if codes.len() > MAX_LISTED_CODES {
            let _ = write!(
                out,
                ", and {} more (all of them are in the JSON result's error_codes)",
                codes.len() - MAX_LISTED_CODES
            );
        }
        out.push('\n');
    }
    if r.degraded > 0 {
        let _ = writeln!(out, "  degraded answers: {}", r.degraded);
    }

    let _ = writeln!(out, "\ngateway stages");
    if !r.stages.is_empty() {
        let _ = writeln!(
            out,
            "  (from the answers' timings_us)\n  {:<14}{:>12}{:>12}{:>12}",
            "stage", "p50", "p95", "p99"
        );
        for (name, s) in super::in_stage_order(&r.stages) {
            let _ = writeln!(
                out,
                "  {:<14}{:>12}{:>12}{:>12}",
                name,
                fmt_us(s.p50_us as f64),
                fmt_us(s.p95_us as f64),
                fmt_us(s.p99_us as f64)
            );
        }
    }
    if !r.stats_window_stages.is_empty() {
        let _ = writeln!(
            out,
            "  (from /v1/stats, last {:.0} s window after the phase)\n  {:<14}{:>12}{:>12}{:>12}",
            r.stats_window_s.unwrap_or(0.0),
            "stage",
            "p50",
            "p95",
            "p99"
        );
        let opt = |v: Option<f64>| v.map_or_else(|| "-".to_string(), fmt_us);
        for (name, s) in super::in_stage_order(&r.stats_window_stages) {
            let _ = writeln!(
                out,
                "  {:<14}{:>12}{:>12}{:>12}",
                name,
                opt(s.p50_us),
                opt(s.p95_us),
                opt(s.p99_us)
            );
        }
    }
    if r.stages.is_empty() && r.stats_window_stages.is_empty() {
        let _ = writeln!(
            out,
            "  not available (no timings_us in answers, no stages in /v1/stats)"
        );
    }

    let _ = write!(out, "\ncache: ");
    match r.hit_rate {
        Some(h) => {
            let _ = write!(out, "hit rate {} (from {})", fmt_pct(h), r.hit_rate_source);
        }
        None => {
            let _ = write!(out, "hit rate not available");
        }
    }
    if let Some(c) = r.cache.as_ref().filter(|c| c.lookups > 0) {
        let _ = write!(
            out,
            ": hits {}, stale {}, misses {}, negative {}",
            c.hits, c.stale, c.misses, c.negative
        );
    }
    out.push('\n');
    for (name, v) in &r.views {
        let _ = writeln!(
            out,
            "  {:<20} hit rate {:>7}  lookups {}",
            name,
            v.hit_rate.map_or_else(|| "-".to_string(), fmt_pct),
            v.lookups
        );
    }
    if let Some(note) = &r.stats_note {
        let _ = writeln!(out, "  note: {note}");
    }
    for w in &r.warnings {
        let _ = writeln!(out, "\nwarning: {w}");
    }
    out
}

/// What the best steps gave when run again (`load.confirm_s`).
pub fn confirm_line(c: &ConfirmResult) -> String {
    let rate = |v: Option<f64>| v.map_or_else(|| "-".to_string(), fmt_rate);
    let mut line = format!(
        "best steps run again for {:.0} s: hydrant {} at concurrency {}",
        c.duration_s,
        rate(c.hydrant.achieved_rps),
        c.concurrency
    );
    if let (Some(f), Some(fc)) = (&c.floor, c.floor_concurrency) {
        let _ = write!(line, ", floor {} at concurrency {fc}", rate(f.achieved_rps));
    }
    if c.cut {
        line.push_str(" (cut short by Ctrl-C: the sweep's maxima stand)");
    }
    line
}

/// The sweep's own maxima, which the run of its best steps replaced.
pub fn sweep_maxima(c: &ConfirmResult) -> String {
    let rate = |v: Option<f64>| v.map_or_else(|| "-".to_string(), fmt_rate);
    match (c.sweep_floor_rps, c.sweep_ratio_to_floor) {
        (Some(f), Some(ratio)) => format!(
            "the sweep's best steps: {} and {} (ratio {ratio:.2})",
            rate(c.sweep_max_rps),
            fmt_rate(f)
        ),
        _ => format!("the sweep's best step: {}", rate(c.sweep_max_rps)),
    }
}

/// What each server ran on: the gateway's async workers and the in-process floor's threads.
pub fn threads_line(r: &RunResult) -> Option<String> {
    let floor = r.floor_threads?;
    let threads = |n: u64| format!("{n} thread{}", if n == 1 { "" } else { "s" });
    Some(match r.gateway_workers {
        Some(g) if g == floor as u64 => {
            format!(
                "both servers on {} (the gateway's server.workers)",
                threads(g)
            )
        }
        Some(g) => format!(
            "gateway on {} (server.workers), floor on {} (floor.threads)",
            threads(g),
            threads(floor as u64)
        ),
        None => format!(
            "floor on {} (the gateway's /v1/stats does not say its workers)",
            threads(floor as u64)
        ),
    })
}
