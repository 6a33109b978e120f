//! The HTML report: one self-contained file (inline CSS and SVG, no script, no external asset)
//! that a person opens in a browser.

use std::fmt::Write as _;

use super::svg::{Axis, Band, Series, bar_chart, esc, hbar_chart, line_chart};
use super::{
    LatencySummary, RunResult, SegmentSpan, fmt_latency, fmt_pct, fmt_rate, fmt_ratio, fmt_rps,
    fmt_us, rps_ratio, us_or_nan,
};
use crate::record::{STAGES, TimelinePoint, Which};

const HYDRANT: &str = "#1f6feb";
const HYDRANT_2: &str = "#8250df";
const FLOOR: &str = "#d4731c";
const FLOOR_2: &str = "#b35900";
const GREEN: &str = "#1a7f37";

const CSS: &str = r#"
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px auto;max-width:1000px;color:#1f2328;padding:0 12px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #d0d7de;padding-bottom:4px}
.meta{color:#59636e}.warn{background:#fff8c5;border:1px solid #d4a72c;padding:8px 12px;border-radius:6px;margin:12px 0}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin:14px 0}.card{border:1px solid #d0d7de;border-radius:8px;padding:8px 14px;min-width:120px}
.card b{display:block;font-size:20px}.card span{color:#59636e;font-size:12px}
table{border-collapse:collapse;margin:6px 0}td,th{padding:3px 12px;text-align:right;border-bottom:1px solid #eaeef2}
th{background:#f6f8fa}td:first-child,th:first-child{text-align:left}
svg.chart{width:100%;height:auto;display:block;margin:8px 0 4px}
svg .title{font-weight:600;font-size:14px}svg .tick,svg .legend,svg .value{font-size:11px;fill:#59636e}svg .label{font-size:12px;fill:#1f2328}
svg .grid{stroke:#eaeef2}svg .axis{stroke:#8c959f}svg .band{opacity:.35}
pre{background:#f6f8fa;padding:10px;border-radius:6px;overflow:auto;font-size:12px}.note{color:#59636e;font-size:13px}
"#;

fn card(out: &mut String, label: &str, value: &str) {
    let _ = write!(
        out,
        r#"<div class="card"><b>{}</b><span>{}</span></div>"#,
        esc(value),
        esc(label)
    );
}

fn latency_table(
    out: &mut String,
    h: &LatencySummary,
    f: Option<&LatencySummary>,
    open_loop: bool,
) {
    out.push_str("<table><tr><th></th><th>hydrant</th>");
    if f.is_some() {
        out.push_str("<th>floor</th><th>hydrant / floor</th>");
    }
    out.push_str("</tr>");
    let mut row = |name: &str, hv: String, fv: Option<String>, ratio: Option<String>| {
        let _ = write!(out, "<tr><td>{}</td><td>{}</td>", esc(name), esc(&hv));
        if let Some(fv) = fv {
            let _ = write!(
                out,
                "<td>{}</td><td>{}</td>",
                esc(&fv),
                esc(&ratio.unwrap_or_default())
            );
        }
        out.push_str("</tr>");
    };
    let r = |a: f64, b: f64| fmt_ratio((b > 0.0).then(|| a / b));
    row(
        "achieved rps",
        fmt_rps(h.achieved_rps),
        f.map(|f| fmt_rps(f.achieved_rps)),
        f.map(|f| fmt_ratio(rps_ratio(h.achieved_rps, f.achieved_rps))),
    );
    for (name, get) in super::LATENCY_ROWS {
        row(
            name,
            fmt_latency(get(h)),
            f.map(|f| fmt_latency(get(f))),
            f.map(|f| r(us_or_nan(get(h)), us_or_nan(get(f)))),
        );
    }
    row(
        "requests",
        h.requests.to_string(),
        f.map(|f| f.requests.to_string()),
        None,
    );
    row(
        "errors",
        format!("{} ({})", h.errors, fmt_pct(h.error_rate)),
        f.map(|f| format!("{} ({})", f.errors, fmt_pct(f.error_rate))),
        None,
    );
    if open_loop {
        row(
            "late sends",
            fmt_pct(h.late_share.unwrap_or(0.0)),
            f.map(|f| fmt_pct(f.late_share.unwrap_or(0.0))),
            None,
        );
    }
    out.push_str("</table>");
}

/// `3`, `2.5`: whole seconds without a fraction, half-second ticks of a short run with one.
fn fmt_seconds(v: f64) -> String {
    if (v - v.round()).abs() < 1e-6 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

/// Time since the start, by the time each request was sent: in open loop the time it was meant to be
/// sent (so a stall counts where it happened); a closed loop has no schedule, only send times.
fn seconds_axis(mode: &str) -> Axis {
    let by = match mode {
        "closed-loop" => "by send time",
        "open-loop" => "by intended send time",
        _ => "by send time in the sweep, intended send time in open loop",
    };
    Axis {
        label: format!("seconds since start ({by})"),
        fmt: fmt_seconds,
        log: false,
        zero: true,
    }
}

/// The share of second `[t, t + 1)` that `which`'s segments cover (0 to 1).
fn coverage(spans: &[SegmentSpan], which: Which, t: f64) -> f64 {
    spans
        .iter()
        .filter(|s| s.which == which)
        .map(|s| (s.end_s.min(t + 1.0) - s.start_s.max(t)).max(0.0))
        .sum::<f64>()
        .min(1.0)
}

/// One value per timeline second; a second with no answers breaks the line (so a floor line does
/// not bridge the hydrant segments between its own).
fn per_second(
    points: &[TimelinePoint],
    f: impl Fn(&TimelinePoint) -> Option<f64>,
) -> Vec<(f64, Option<f64>)> {
    let mut out = Vec::with_capacity(points.len());
    let mut prev: Option<f64> = None;
    for p in points {
        if prev.is_some_and(|t| p.t_s - t > 1.5) {
            out.push((p.t_s - 0.5, None));
        }
        out.push((p.t_s + 0.5, f(p)));
        prev = Some(p.t_s);
    }
    out
}

fn latency_series(
    points: &[TimelinePoint],
    name: &str,
    c1: &'static str,
    c2: &'static str,
    dashed: bool,
) -> Vec<Series> {
    vec![
        Series {
            name: format!("{name} p50"),
            color: c1,
            points: per_second(points, |p| p.p50_us.map(|v| v as f64)),
            dashed,
        },
        Series {
            name: format!("{name} p99"),
            color: c2,
            points: per_second(points, |p| p.p99_us.map(|v| v as f64)),
            dashed,
        },
    ]
}

fn bands(r: &RunResult) -> Vec<Band> {
    r.segments
        .iter()
        .map(|s| Band {
            x0: s.start_s,
            x1: s.end_s,
            label: format!(
                "{}{}: {}",
                s.which.name(),
                if s.measured { "" } else { " warm-up" },
                s.label
            ),
            fill: match (s.which, s.measured) {
                (_, false) => "#d0d7de",
                (Which::Hydrant, true) => "#ddf4ff",
                (Which::Floor, true) => "#fff1e5",
            },
        })
        .collect()
}

/// Renders the report.
pub fn render(r: &RunResult) -> String {
    let mut out = String::with_capacity(64 * 1024);
    let _ = write!(
        out,
        r#"<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width,initial-scale=1"><title>loadtest: {n}</title><style>{CSS}</style></head><body>"#,
        n = esc(&r.scenario)
    );
    let _ = write!(
        out,
        r#"<h1>loadtest: {}</h1><div class="meta">{} against {} &middot; model <b>{}</b> &middot; {} &middot; started {} &middot; {:.0} s wall</div>"#,
        esc(&r.scenario),
        esc(&r.mode),
        esc(&r.target),
        esc(&r.model),
        esc(&r.format),
        esc(&r.started_at),
        r.wall_s
    );
    if r.interrupted {
        out.push_str(r#"<div class="warn">This run was interrupted (Ctrl-C or SIGTERM): the numbers cover only what ran before that.</div>"#);
    }
    if let Some(note) = &r.stats_note {
        let _ = write!(out, r#"<div class="warn">{}</div>"#, esc(note));
    }
    for w in r.warnings.iter().filter(|w| !w.starts_with("interrupted")) {
        let _ = write!(out, r#"<div class="warn">{}</div>"#, esc(w));
    }

    // Headline cards.
    let h = &r.hydrant;
    out.push_str(r#"<div class="cards">"#);
    card(&mut out, "achieved rps", &fmt_rps(h.achieved_rps));
    card(&mut out, "p50", &fmt_latency(h.p50_us));
    card(&mut out, "p99", &fmt_latency(h.p99_us));
    card(&mut out, "p99.9", &fmt_latency(h.p999_us));
    card(
        &mut out,
        "errors",
        &format!("{} ({})", h.errors, fmt_pct(h.error_rate)),
    );
    card(
        &mut out,
        "cache hit rate",
        &r.hit_rate.map_or_else(|| "n/a".into(), fmt_pct),
    );
    if let Some(m) = r.max_rps {
        card(&mut out, "max throughput", &fmt_rate(m));
    }
    if r.ratio_to_floor.is_some() {
        card(
            &mut out,
            "throughput vs floor",
            &fmt_ratio(r.ratio_to_floor),
        );
    }
    out.push_str("</div>");

    // Whether the headline phase ran on a schedule: its late-send share says (a max-then-fraction run
    // cut short in its sweep has a closed-loop headline). One that never ran goes by the mode.
    let open_loop = h.late_share.is_some() || (h.requests == 0 && r.mode != "closed-loop");
    let _ = write!(
        out,
        "<h2>Measured phase: {}</h2><p class=\"note\">{:.1} s measured{}. Latencies are of successful answers, of timeouts (at the time given up) and of requests abandoned at Ctrl-C (at the time abandoned){}.</p>",
        esc(&r.headline),
        h.measured_s,
        r.offered_rps
            .map_or_else(String::new, |o| format!(", offered {}", fmt_rate(o))),
        if open_loop {
            ", measured from each request's intended send time (open loop: a stall counts against every request that should have been sent during it)"
        } else {
            ", measured from the actual send (closed loop)"
        }
    );
    latency_table(&mut out, h, r.floor.as_ref(), open_loop);
    if r.floor.is_some() {
        let _ = write!(
            out,
            "<p class=\"note\">Floor: the cheapest server on hydrant's own HTTP stack, answering a fixed body, driven with the same mix and load shape (hydrant half / floor / hydrant half). Throughput ratio {} (hydrant {} / floor {}).</p>",
            fmt_ratio(r.ratio_to_floor),
            r.max_rps
                .or(h.achieved_rps)
                .map_or_else(|| "-".into(), fmt_rate),
            r.floor_rps.map_or_else(|| "-".into(), fmt_rate)
        );
        if let Some(line) = super::table::threads_line(r) {
            let _ = write!(out, "<p class=\"note\">{}.</p>", esc(&line));
        }
    }
    if let Some(c) = &r.confirm {
        let _ = write!(
            out,
            "<p class=\"note\">Maximum throughput: the {}; {}. Each best step is chosen by the sweep and measured apart from it, since the best of several noisy steps overstates a level curve's maximum.</p>",
            esc(&super::table::confirm_line(c)),
            esc(&super::table::sweep_maxima(c))
        );
    }

    // Latency over time.
    let mut series = latency_series(&r.timeline, "hydrant", HYDRANT, HYDRANT_2, false);
    if !r.floor_timeline.is_empty() {
        series.extend(latency_series(
            &r.floor_timeline,
            "floor",
            FLOOR,
            FLOOR_2,
            true,
        ));
    }
    let bands = bands(r);
    out.push_str("<h2>Latency over time</h2>");
    out.push_str(&line_chart(
        "chart-latency-over-time",
        "Latency per second (log scale); shaded: warm-up (grey), hydrant (blue), floor (orange)",
        &seconds_axis(&r.mode),
        &Axis {
            label: "latency".into(),
            fmt: fmt_us,
            log: true,
            zero: false,
        },
        &series,
        &bands,
    ));

    // Throughput over time: a second the server's segments only partly cover (where hydrant and the
    // floor take turns) is scaled to a full second rather than drawn as a dip.
    let rate = |which: Which, n: fn(&TimelinePoint) -> u64| {
        move |p: &TimelinePoint| {
            let covered = coverage(&r.segments, which, p.t_s);
            (covered >= 0.05).then(|| n(p) as f64 / covered)
        }
    };
    let mut tput = vec![Series {
        name: "hydrant ok/s".into(),
        color: HYDRANT,
        points: per_second(&r.timeline, rate(Which::Hydrant, |p| p.ok)),
        dashed: false,
    }];
    if !r.floor_timeline.is_empty() {
        tput.push(Series {
            name: "floor ok/s".into(),
            color: FLOOR,
            points: per_second(&r.floor_timeline, rate(Which::Floor, |p| p.ok)),
            dashed: true,
        });
    }
    if r.timeline.iter().any(|p| p.errors > 0) {
        tput.push(Series {
            name: "hydrant errors/s".into(),
            color: "#cf222e",
            points: per_second(&r.timeline, rate(Which::Hydrant, |p| p.errors)),
            dashed: false,
        });
    }
    out.push_str(&line_chart(
        "chart-throughput-over-time",
        "Answers per second",
        &seconds_axis(&r.mode),
        &Axis {
            label: "per second".into(),
            fmt: |v| format!("{v:.0}"),
            log: false,
            zero: true,
        },
        &tput,
        &bands,
    ));

    // Latency histogram.
    out.push_str("<h2>Latency histogram</h2>");
    if r.latency_histogram.is_empty() {
        out.push_str("<p class=\"note\">No successful answers.</p>");
    } else {
        let labels: Vec<String> = r
            .latency_histogram
            .iter()
            .map(|b| format!("{}–{}", fmt_us(b.lo_us), fmt_us(b.hi_us)))
            .collect();
        let th: u64 = r.latency_histogram.iter().map(|b| b.hydrant).sum();
        let tf: u64 = r.latency_histogram.iter().map(|b| b.floor).sum();
        let share = |v: u64, t: u64| if t > 0 { v as f64 / t as f64 } else { 0.0 };
        let mut groups = vec![(
            "hydrant",
            HYDRANT,
            r.latency_histogram
                .iter()
                .map(|b| share(b.hydrant, th))
                .collect(),
        )];
        if tf > 0 {
            groups.push((
                "floor",
                FLOOR,
                r.latency_histogram
                    .iter()
                    .map(|b| share(b.floor, tf))
                    .collect(),
            ));
        }
        out.push_str(&bar_chart(
            "chart-latency-histogram",
            "Share of answers (and timeouts) per latency range (ten ranges per decade)",
            &labels,
            &groups,
            "latency",
        ));
    }

    // Stage breakdown.
    out.push_str("<h2>Gateway stage breakdown</h2>");
    let mut names: Vec<String> = STAGES.iter().map(|s| s.to_string()).collect();
    for k in r.stages.keys().chain(r.stats_window_stages.keys()) {
        if !names.contains(k) {
            names.push(k.clone());
        }
    }
    if !r.stages.is_empty() {
        let names: Vec<String> = names
            .into_iter()
            .filter(|n| r.stages.contains_key(n))
            .collect();
        let col = |f: fn(&super::StageSummary) -> u64| -> Vec<Option<f64>> {
            names
                .iter()
                .map(|n| r.stages.get(n).map(|s| f(s) as f64))
                .collect()
        };
        out.push_str(&hbar_chart(
            "chart-stages",
            "Per-stage latency from the answers' timings_us (measured phase)",
            &names,
            &[
                ("p50", "#54aeff", col(|s| s.p50_us)),
                ("p95", HYDRANT, col(|s| s.p95_us)),
                ("p99", "#0a3069", col(|s| s.p99_us)),
            ],
            fmt_us,
        ));
    } else if !r.stats_window_stages.is_empty() {
        let names: Vec<String> = names
            .into_iter()
            .filter(|n| r.stats_window_stages.contains_key(n))
            .collect();
        let col = |f: fn(&crate::stats::StagePercentiles) -> Option<f64>| -> Vec<Option<f64>> {
            names
                .iter()
                .map(|n| r.stats_window_stages.get(n).and_then(f))
                .collect()
        };
        out.push_str(&hbar_chart(
            "chart-stages",
            "Per-stage latency from /v1/stats (window after the measured phase)",
            &names,
            &[
                ("p50", "#54aeff", col(|s| s.p50_us)),
                ("p95", HYDRANT, col(|s| s.p95_us)),
                ("p99", "#0a3069", col(|s| s.p99_us)),
            ],
            fmt_us,
        ));
    } else {
        out.push_str(if h.ok == 0 {
            "<p class=\"note\">Not available: no request succeeded.</p>"
        } else {
            "<p class=\"note\">Not available: the answers carried no timings_us and /v1/stats had no stages for this model.</p>"
        });
    }
    if !r.stages.is_empty() && !r.stats_window_stages.is_empty() {
        let _ = write!(
            out,
            "<p class=\"note\">/v1/stats window ({:.0} s after the phase, which may include the sweep or warm-up):</p><table><tr><th>stage</th><th>p50</th><th>p95</th><th>p99</th></tr>",
            r.stats_window_s.unwrap_or(0.0)
        );
        let o = |v: Option<f64>| v.map_or_else(|| "-".into(), fmt_us);
        for (n, s) in super::in_stage_order(&r.stats_window_stages) {
            let _ = write!(
                out,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                esc(n),
                o(s.p50_us),
                o(s.p95_us),
                o(s.p99_us)
            );
        }
        out.push_str("</table>");
    }

    // Cache.
    let _ = write!(
        out,
        "<h2>Cache</h2><p>Hit rate over the measured phase: <b>{}</b> (source: {}). Hit rate = (hits + stale + negative) / (hits + stale + misses + negative): the lookups answered from memory, as /v1/stats computes it (in the answers' <code>cache</code>, <code>hits</code> already counts the negative ones).</p>",
        r.hit_rate.map_or_else(|| "n/a".into(), fmt_pct),
        esc(&r.hit_rate_source)
    );
    out.push_str(&line_chart(
        "chart-hit-rate",
        "Cache hit rate per second, from /v1/stats counter deltas (all views)",
        &Axis {
            label: "seconds since start".into(),
            fmt: fmt_seconds,
            log: false,
            zero: true,
        },
        &Axis {
            label: "hit rate".into(),
            fmt: |v| format!("{:.0}%", v * 100.0),
            log: false,
            zero: true,
        },
        &[Series {
            name: "hit rate".into(),
            color: GREEN,
            points: r
                .stats_timeline
                .iter()
                .map(|p| (p.t_s, p.hit_rate))
                .collect(),
            dashed: false,
        }],
        &bands,
    ));
    if r.stats_timeline.is_empty() {
        out.push_str("<p class=\"note\">No /v1/stats samples: the chart is empty.</p>");
    }
    if !r.views.is_empty() {
        out.push_str("<table><tr><th>view</th><th>hit rate</th><th>hits</th><th>stale</th><th>misses</th><th>negative</th><th>lookups</th></tr>");
        for (n, v) in &r.views {
            let _ = write!(
                out,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                esc(n),
                v.hit_rate.map_or_else(|| "-".into(), fmt_pct),
                v.hits,
                v.stale,
                v.misses,
                v.negative,
                v.lookups
            );
        }
        out.push_str("</table>");
    }

    // The store floor.
    if let Some(g) = &r.redis_get {
        let _ = write!(
            out,
            "<h2>Plain Redis GET</h2><p>The store's own round trip, measured in the same run (<code>--redis-url</code>, {} samples, one at a time): p50 <b>{}</b>, p99 <b>{}</b>, p99.9 <b>{}</b>. Compare it with the gateway's <code>hydrate</code> stage above.</p>",
            g.samples,
            fmt_us(g.p50_us as f64),
            fmt_us(g.p99_us as f64),
            fmt_us(g.p999_us as f64)
        );
    }

    // Sweep.
    if !r.steps.is_empty() {
        out.push_str("<h2>Closed-loop sweep</h2>");
        let x = Axis {
            label: "concurrency (log scale)".into(),
            fmt: |v| format!("{v:.0}"),
            log: true,
            zero: false,
        };
        let pts = |f: fn(&LatencySummary) -> Option<f64>, floor: bool| -> Vec<(f64, Option<f64>)> {
            r.steps
                .iter()
                .filter_map(|s| {
                    let c = s.concurrency? as f64;
                    let summary = if floor { s.floor.as_ref()? } else { &s.hydrant };
                    Some((c, f(summary)))
                })
                .collect()
        };
        let mut rps = vec![Series {
            name: "hydrant rps".into(),
            color: HYDRANT,
            points: pts(|s| s.achieved_rps, false),
            dashed: false,
        }];
        let mut p99 = vec![Series {
            name: "hydrant p99".into(),
            color: HYDRANT,
            points: pts(|s| s.p99_us.map(|v| v as f64), false),
            dashed: false,
        }];
        if r.steps.iter().any(|s| s.floor.is_some()) {
            rps.push(Series {
                name: "floor rps".into(),
                color: FLOOR,
                points: pts(|s| s.achieved_rps, true),
                dashed: true,
            });
            p99.push(Series {
                name: "floor p99".into(),
                color: FLOOR,
                points: pts(|s| s.p99_us.map(|v| v as f64), true),
                dashed: true,
            });
        }
        out.push_str(&line_chart(
            "chart-sweep",
            "Throughput by concurrency",
            &x,
            &Axis {
                label: "answers per second".into(),
                fmt: |v| format!("{v:.0}"),
                log: false,
                zero: true,
            },
            &rps,
            &[],
        ));
        out.push_str(&line_chart(
            "chart-sweep-p99",
            "p99 latency by concurrency (log scale)",
            &x,
            &Axis {
                label: "p99".into(),
                fmt: fmt_us,
                log: true,
                zero: false,
            },
            &p99,
            &[],
        ));
        out.push_str("<table><tr><th>concurrency</th><th>rps</th><th>p50</th><th>p99</th><th>errors</th><th>floor rps</th><th>floor p99</th></tr>");
        for s in &r.steps {
            let _ = write!(
                out,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                s.concurrency.map_or_else(|| "-".into(), |c| c.to_string()),
                fmt_rps(s.hydrant.achieved_rps),
                fmt_latency(s.hydrant.p50_us),
                fmt_latency(s.hydrant.p99_us),
                s.hydrant.errors,
                s.floor
                    .as_ref()
                    .map_or_else(|| "-".into(), |f| fmt_rps(f.achieved_rps)),
                s.floor
                    .as_ref()
                    .map_or_else(|| "-".into(), |f| fmt_latency(f.p99_us)),
            );
        }
        out.push_str("</table>");
    }

    // Errors.
    // In a sweep every step's errors are listed: in closed-loop mode each step is measured (the
    // headline is only the fastest), and in max-then-fraction mode the steps set the open-loop rate.
    out.push_str("<h2>Errors</h2>");
    let failed_steps: Vec<&super::StepResult> =
        r.steps.iter().filter(|s| s.hydrant.errors > 0).collect();
    if h.errors_by_kind.is_empty() && failed_steps.is_empty() {
        out.push_str(if r.steps.is_empty() {
            "<p>None in the measured phase.</p>"
        } else {
            "<p>None in the measured phase or in any step of the sweep.</p>"
        });
    } else {
        // In closed-loop mode the headline is one of the steps, all listed below.
        let closed_loop = r.mode == "closed-loop";
        if h.errors_by_kind.is_empty() {
            if !closed_loop {
                let _ = write!(
                    out,
                    "<p>None in the measured phase ({}).</p>",
                    esc(&r.headline)
                );
            }
        } else {
            let _ = write!(
                out,
                "<p>{} ({}):</p><table><tr><th>status or kind</th><th>count</th></tr>",
                if closed_loop {
                    "The highest-throughput step, whose numbers are the top-level ones"
                } else {
                    "Measured phase"
                },
                esc(&r.headline)
            );
            for (k, v) in &h.errors_by_kind {
                let _ = write!(out, "<tr><td>{}</td><td>{}</td></tr>", esc(k), v);
            }
            for (k, v) in &r.error_codes {
                let _ = write!(out, "<tr><td>code {}</td><td>{}</td></tr>", esc(k), v);
            }
            out.push_str("</table>");
        }
        if !failed_steps.is_empty() {
            out.push_str("<p>Steps of the sweep with errors:</p><table><tr><th>step</th><th>requests</th><th>errors</th><th>by status or kind</th></tr>");
            for s in failed_steps {
                let kinds: Vec<String> = s
                    .hydrant
                    .errors_by_kind
                    .iter()
                    .map(|(k, v)| format!("{k}: {v}"))
                    .collect();
                let _ = write!(
                    out,
                    "<tr><td>{}</td><td>{}</td><td>{} ({})</td><td>{}</td></tr>",
                    esc(&s.label),
                    s.hydrant.requests,
                    s.hydrant.errors,
                    fmt_pct(s.hydrant.error_rate),
                    esc(&kinds.join(", "))
                );
            }
            out.push_str("</table>");
        }
        out.push_str("<p class=\"note\">overload: not sent because max_in_flight requests were already open; timeout: no full answer within timeout_ms; connect/io: the connection failed.</p>");
    }
    if r.degraded > 0 {
        let _ = write!(out, "<p>Degraded answers: {}</p>", r.degraded);
    }

    let _ = write!(
        out,
        "<h2>Scenario</h2><pre>{}</pre><p class=\"note\">Raw numbers: {}.json next to this file.</p></body></html>",
        esc(&r.scenario_toml),
        esc(&r.scenario)
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(which: Which, start_s: f64, end_s: f64) -> SegmentSpan {
        SegmentSpan {
            label: String::new(),
            which,
            measured: true,
            start_s,
            end_s,
        }
    }

    #[test]
    fn a_second_shared_by_two_segments_is_scaled_not_dipped() {
        // Hydrant 0-2.5 s, the floor 2.5-5 s, hydrant again 5-7.5 s.
        let spans = [
            span(Which::Hydrant, 0.0, 2.5),
            span(Which::Floor, 2.5, 5.0),
            span(Which::Hydrant, 5.0, 7.5),
        ];
        assert_eq!(coverage(&spans, Which::Hydrant, 1.0), 1.0);
        assert_eq!(coverage(&spans, Which::Hydrant, 2.0), 0.5);
        assert_eq!(coverage(&spans, Which::Floor, 2.0), 0.5);
        assert_eq!(coverage(&spans, Which::Hydrant, 3.0), 0.0);
        assert_eq!(coverage(&spans, Which::Hydrant, 4.0), 0.0);
        assert_eq!(coverage(&spans, Which::Floor, 4.0), 1.0);
        assert_eq!(coverage(&spans, Which::Hydrant, 7.0), 0.5);
    }

    #[test]
    fn half_second_ticks_keep_their_fraction() {
        assert_eq!(fmt_seconds(0.5), "0.5");
        assert_eq!(fmt_seconds(2.0), "2");
        assert_eq!(fmt_seconds(12.0), "12");
    }
}
