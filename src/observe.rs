//! What ops read: Prometheus text at `/metrics` (DESIGN.md's metric names) and JSON at `/v1/stats` (recent
//! per-stage percentiles next to cache hit rates), both rendered from the gateway's own counters.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use serde_json::{Map, Value as Json, json};

use crate::gateway::Gateway;
use crate::telemetry::{BUCKETS_S, Histogram, ROW_BUCKETS, Stage, ViewStats};

fn esc(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// Writes a family whose one label is `view`: `value` of each view's counters.
fn per_view(
    out: &mut String,
    views: &[(String, Arc<ViewStats>)],
    (name, kind): (&str, &str),
    help: &str,
    value: impl Fn(&ViewStats) -> u64,
) {
    header(out, name, kind, help);
    for (view, v) in views {
        let _ = writeln!(out, "{name}{{view=\"{}\"}} {}", esc(view), value(v));
    }
}

/// Writes a counter family whose one label is `outcome`.
fn outcomes(
    out: &mut String,
    name: &str,
    help: &str,
    counters: &[(&str, &std::sync::atomic::AtomicU64)],
) {
    header(out, name, "counter", help);
    for (outcome, c) in counters {
        let _ = writeln!(out, "{name}{{outcome=\"{outcome}\"}} {}", c.load(Relaxed));
    }
}

/// Writes one histogram: cumulative `counts` per upper bound (the last is +Inf), and the sum.
fn buckets(
    out: &mut String,
    name: &str,
    labels: &str,
    bounds: &[impl std::fmt::Display],
    counts: &[u64],
    sum: impl std::fmt::Display,
) {
    for (b, c) in bounds.iter().zip(counts.iter()) {
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{b}\"}} {c}");
    }
    let total = counts.last().copied().unwrap_or(0);
    let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {total}");
    let _ = writeln!(out, "{name}_sum{{{labels}}} {sum}");
    let _ = writeln!(out, "{name}_count{{{labels}}} {total}");
}

fn histogram(out: &mut String, name: &str, labels: &str, h: &Histogram) {
    let (counts, sum) = h.snapshot();
    buckets(out, name, labels, &BUCKETS_S, &counts, sum);
}

/// The Prometheus text exposition of every counter.
/// `hydrant_invalidations_total` by kind, and `/v1/stats`' `invalidation`: the gateway's own counts,
/// with the announcements the store made in the background for writes that failed but may have landed.
fn invalidations(gw: &Gateway) -> [(&'static str, u64); 4] {
    let inv = &gw.telemetry.invalidation;
    let (bg_keys, bg_errors) = gw.hydrator.store().background_announcements();
    [
        ("published_keys", inv.published_keys.load(Relaxed) + bg_keys),
        (
            "publish_errors",
            inv.publish_errors.load(Relaxed) + bg_errors,
        ),
        ("received_keys", inv.received_keys.load(Relaxed)),
        ("flushes", inv.flushes.load(Relaxed)),
    ]
}

pub fn prometheus(gw: &Gateway) -> String {
    let t = &gw.telemetry;
    let mut out = String::with_capacity(16 * 1024);

    header(
        &mut out,
        "hydrant_request_duration_seconds",
        "histogram",
        "HTTP request latency by route, model and status.",
    );
    for ((route, model, status), h) in t.requests() {
        let labels = format!(
            "route=\"{}\",model=\"{}\",status=\"{status}\"",
            esc(route),
            esc(&model)
        );
        histogram(&mut out, "hydrant_request_duration_seconds", &labels, &h);
    }

    let models = t.models();
    header(
        &mut out,
        "hydrant_stage_duration_seconds",
        "histogram",
        "Time spent in each stage of a predict or V2 infer request (V2 infer has decode, queue, infer and encode only).",
    );
    for (model, m) in &models {
        for stage in Stage::ALL {
            let labels = format!("model=\"{}\",stage=\"{}\"", esc(model), stage.name());
            histogram(
                &mut out,
                "hydrant_stage_duration_seconds",
                &labels,
                &m.stages[stage as usize],
            );
        }
    }
    header(
        &mut out,
        "hydrant_batch_rows",
        "histogram",
        "Rows per inference batch, as the queue formed it.",
    );
    for (model, m) in &models {
        let (counts, sum) = m.batch_rows.snapshot();
        let labels = format!("model=\"{}\"", esc(model));
        buckets(
            &mut out,
            "hydrant_batch_rows",
            &labels,
            &ROW_BUCKETS,
            &counts,
            sum,
        );
    }
    header(
        &mut out,
        "hydrant_batch_reruns_total",
        "counter",
        "Inference runs made to give each request of a failed batch its own outcome.",
    );
    for (model, m) in &models {
        let _ = writeln!(
            out,
            "hydrant_batch_reruns_total{{model=\"{}\"}} {}",
            esc(model),
            m.batch_reruns.load(Relaxed)
        );
    }
    header(
        &mut out,
        "hydrant_queue_depth",
        "gauge",
        "Requests waiting for an inference session.",
    );
    let catalog = gw.catalog.load_full();
    let mut engines: Vec<_> = catalog.engines.iter().collect();
    engines.sort_by(|a, b| a.0.cmp(b.0));
    for (name, e) in &engines {
        let _ = writeln!(
            out,
            "hydrant_queue_depth{{model=\"{}\"}} {}",
            esc(name),
            e.queue_depth()
        );
    }
    header(
        &mut out,
        "hydrant_shed_total",
        "counter",
        "Requests refused or dropped by the inference queue, by reason.",
    );
    for (model, m) in &models {
        for (reason, c) in [
            ("queue_full", &m.shed_queue_full),
            ("queue_timeout", &m.shed_queue_timeout),
            ("deadline", &m.shed_deadline),
        ] {
            let _ = writeln!(
                out,
                "hydrant_shed_total{{model=\"{}\",reason=\"{reason}\"}} {}",
                esc(model),
                c.load(Relaxed)
            );
        }
    }

    let views = t.views();
    header(
        &mut out,
        "hydrant_cache_lookups_total",
        "counter",
        "Feature cache lookups by outcome; hit rate (as /v1/stats gives it) = (hit + stale + negative) / all.",
    );
    for (view, v) in &views {
        for (outcome, c) in [
            ("hit", &v.hits),
            ("stale", &v.stale),
            ("miss", &v.misses),
            ("negative", &v.negative),
        ] {
            let _ = writeln!(
                out,
                "hydrant_cache_lookups_total{{view=\"{}\",outcome=\"{outcome}\"}} {}",
                esc(view),
                c.load(Relaxed)
            );
        }
    }
    per_view(
        &mut out,
        &views,
        ("hydrant_cache_entries", "gauge"),
        "Entries in the feature cache.",
        |v| v.entries.load(Relaxed).max(0).unsigned_abs(),
    );
    per_view(
        &mut out,
        &views,
        ("hydrant_cache_bytes", "gauge"),
        "Estimated bytes held by the feature cache.",
        |v| v.bytes.load(Relaxed).max(0).unsigned_abs(),
    );
    per_view(
        &mut out,
        &views,
        ("hydrant_cache_evictions_total", "counter"),
        "Entries evicted from the feature cache to stay within cache.max_bytes.",
        |v| v.evicted.load(Relaxed),
    );
    header(
        &mut out,
        "hydrant_degraded_total",
        "counter",
        "Lookups answered from stale values or defaults because the store failed, by reason.",
    );
    for (view, v) in &views {
        for (reason, c) in [
            ("timeout", &v.degraded_timeout),
            ("error", &v.degraded_error),
        ] {
            let _ = writeln!(
                out,
                "hydrant_degraded_total{{view=\"{}\",reason=\"{reason}\"}} {}",
                esc(view),
                c.load(Relaxed)
            );
        }
    }
    header(
        &mut out,
        "hydrant_refresh_total",
        "counter",
        "Background refreshes (refresh-ahead) by outcome, in keys.",
    );
    for (view, v) in &views {
        for (outcome, c) in [
            ("ok", &v.refresh.ok),
            ("error", &v.refresh.error),
            ("timeout", &v.refresh.timeout),
        ] {
            let _ = writeln!(
                out,
                "hydrant_refresh_total{{view=\"{}\",outcome=\"{outcome}\"}} {}",
                esc(view),
                c.load(Relaxed)
            );
        }
    }
    let stores = t.stores();
    header(
        &mut out,
        "hydrant_store_round_trips_total",
        "counter",
        "Store round trips by backend, operation and outcome (one read carries all of a request's misses).",
    );
    for (backend, st) in &stores {
        for (op, trips) in [("read", &st.reads), ("write", &st.writes)] {
            let o = &trips.outcomes;
            for (outcome, c) in [("ok", &o.ok), ("error", &o.error), ("timeout", &o.timeout)] {
                let _ = writeln!(
                    out,
                    "hydrant_store_round_trips_total{{backend=\"{backend}\",op=\"{op}\",outcome=\"{outcome}\"}} {}",
                    c.load(Relaxed)
                );
            }
        }
    }
    header(
        &mut out,
        "hydrant_store_keys_total",
        "counter",
        "Keys carried by store round trips.",
    );
    for (backend, st) in &stores {
        for (op, trips) in [("read", &st.reads), ("write", &st.writes)] {
            let _ = writeln!(
                out,
                "hydrant_store_keys_total{{backend=\"{backend}\",op=\"{op}\"}} {}",
                trips.keys.load(Relaxed)
            );
        }
    }
    header(
        &mut out,
        "hydrant_store_duration_seconds",
        "histogram",
        "Store round-trip latency by backend and operation.",
    );
    for (backend, st) in &stores {
        for (op, trips) in [("read", &st.reads), ("write", &st.writes)] {
            histogram(
                &mut out,
                "hydrant_store_duration_seconds",
                &format!("backend=\"{backend}\",op=\"{op}\""),
                &trips.duration,
            );
        }
    }
    let p = &t.prefetch;
    outcomes(
        &mut out,
        "hydrant_prefetch_total",
        "Prefetched keys (POST /v1/prefetch and warm start) by outcome.",
        &[
            ("accepted", &p.accepted),
            ("rejected", &p.rejected),
            ("fetched", &p.fetched),
            ("cached", &p.cached),
            ("failed", &p.failed),
            ("warm", &p.warm_keys),
        ],
    );
    for (name, help, stats) in [
        (
            "hydrant_schema_reloads_total",
            "Changes found in the schemas folder (registry.reload_interval), applied or refused.",
            &t.reloads,
        ),
        (
            "hydrant_auth_reloads_total",
            "Changes found in the token files (auth.reload_interval), applied or refused.",
            &t.auth_reloads,
        ),
    ] {
        outcomes(
            &mut out,
            name,
            help,
            &[("applied", &stats.applied), ("refused", &stats.refused)],
        );
    }
    header(
        &mut out,
        "hydrant_warm_start_incomplete_total",
        "counter",
        "Warm starts cut short by prefetch.warm_timeout or a store failure.",
    );
    let _ = writeln!(
        out,
        "hydrant_warm_start_incomplete_total {}",
        p.warm_incomplete.load(Relaxed)
    );
    header(
        &mut out,
        "hydrant_hot_key_samples_total",
        "counter",
        "Lookups sampled into the hot-key sets (warm start).",
    );
    let _ = writeln!(
        out,
        "hydrant_hot_key_samples_total {}",
        p.hot_samples.load(Relaxed)
    );
    header(
        &mut out,
        "hydrant_hot_key_flush_errors_total",
        "counter",
        "Failed writes of hot-key samples to the store.",
    );
    let _ = writeln!(
        out,
        "hydrant_hot_key_flush_errors_total {}",
        p.hot_flush_errors.load(Relaxed)
    );
    header(
        &mut out,
        "hydrant_invalidations_total",
        "counter",
        "Cache invalidation between replicas: keys published, publish errors, keys received, whole-cache flushes.",
    );
    for (kind, n) in invalidations(gw) {
        let _ = writeln!(out, "hydrant_invalidations_total{{kind=\"{kind}\"}} {n}");
    }
    per_view(
        &mut out,
        &views,
        ("hydrant_bad_records_total", "counter"),
        "Stored records that could not be decoded and were served as defaults.",
        |v| v.bad_records.load(Relaxed),
    );
    out
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}

/// Seconds to the millisecond.
fn millis(s: f64) -> f64 {
    (s * 1000.0).round() / 1000.0
}

/// The group the kernel shares CPU time by for this process, as far as `/proc` tells: its cpu cgroup, and,
/// in the root cgroup where `kernel.sched_autogroup_enabled` is 1, its session's autogroup. The kernel
/// divides the cores between groups before it divides a group's share between threads, so a server in a
/// group of its own beside a busy load generator gets about its group's share, however many threads it
/// runs. `/v1/stats` says it (`sched_group`), and the load tester compares it with its own, whose
/// in-process floor shares its group. None where `/proc` says nothing (not Linux).
pub fn sched_group() -> Option<String> {
    let read = |path: &str| std::fs::read_to_string(path).ok();
    sched_group_of(
        &read("/proc/self/cgroup")?,
        read("/proc/sys/kernel/sched_autogroup_enabled").as_deref(),
        read("/proc/self/autogroup").as_deref(),
    )
}

/// [`sched_group`] from the contents of `/proc/self/cgroup`, `/proc/sys/kernel/sched_autogroup_enabled`
/// and `/proc/self/autogroup`.
fn sched_group_of(
    cgroup: &str,
    autogroup_on: Option<&str>,
    autogroup: Option<&str>,
) -> Option<String> {
    // cgroup v1 names the cpu controller ("4:cpu,cpuacct:/path"); v2 has one line for all ("0::/path").
    fn field(line: &str) -> Option<(&str, &str)> {
        let mut parts = line.splitn(3, ':');
        let _id = parts.next()?;
        Some((parts.next()?, parts.next()?))
    }
    let mut v2 = None;
    let mut path = None;
    for (controllers, p) in cgroup.lines().filter_map(field) {
        if controllers.split(',').any(|c| c == "cpu") {
            path = Some(p);
            break;
        }
        if controllers.is_empty() {
            v2 = v2.or(Some(p));
        }
    }
    let path = path.or(v2)?.trim();
    // Autogroups are used only for tasks in the root cgroup, and only when enabled.
    let auto = (path == "/" && autogroup_on.is_some_and(|on| on.trim() == "1"))
        .then(|| autogroup?.split_whitespace().next())
        .flatten();
    Some(match auto {
        Some(a) => format!("cpu cgroup {path}, {a}"),
        None => format!("cpu cgroup {path}"),
    })
}

/// The `/v1/stats` document.
pub fn stats(gw: &Gateway) -> Json {
    let t = &gw.telemetry;
    let catalog = gw.catalog.load();
    let mut models = Map::new();
    // The longest of the models' windows (those loaded at start-up began with it, give or take their
    // load); the process's own age before any model is loaded.
    let mut window_s: Option<f64> = None;
    for (name, m) in t.models() {
        let p = m.window.stage_percentiles();
        let mut stages = Map::new();
        for stage in Stage::ALL {
            let [p50, p95, p99] = p[stage as usize];
            stages.insert(
                stage.name().to_owned(),
                json!({"p50_us": p50, "p95_us": p95, "p99_us": p99}),
            );
        }
        let [p50, p95, p99] = p[7];
        stages.insert(
            "total".to_owned(),
            json!({"p50_us": p50, "p95_us": p95, "p99_us": p99}),
        );
        let (recent, span) = m.window.requests();
        window_s = Some(window_s.map_or(span, |w| w.max(span)));
        let requests = m.requests.load(Relaxed);
        let errors = m.errors.load(Relaxed);
        let rejected = m.rejected.load(Relaxed);
        models.insert(
            name.clone(),
            json!({
                "requests": requests,
                "errors": errors,
                "rejected": rejected,
                "rows": m.rows.load(Relaxed),
                "rps": recent as f64 / span,
                "window_s": millis(span),
                "error_rate": ratio(errors, requests + errors + rejected),
                "queue_depth": catalog.engines.get(&name).map_or(0, |e| e.queue_depth()),
                "shed": {
                    "queue_full": m.shed_queue_full.load(Relaxed),
                    "queue_timeout": m.shed_queue_timeout.load(Relaxed),
                    "deadline": m.shed_deadline.load(Relaxed),
                },
                "stages": stages,
            }),
        );
    }
    let mut views = Map::new();
    for (name, v) in t.views() {
        let (h, s, mi, n) = (
            v.hits.load(Relaxed),
            v.stale.load(Relaxed),
            v.misses.load(Relaxed),
            v.negative.load(Relaxed),
        );
        let lookups = h + s + mi + n;
        views.insert(
            name,
            json!({
                "hits": h, "stale": s, "misses": mi, "negative": n,
                "hit_rate": ratio(h + s + n, lookups),
                "entries": v.entries.load(Relaxed).max(0),
                "bytes": v.bytes.load(Relaxed).max(0),
                "evictions": v.evicted.load(Relaxed),
                "bad_records": v.bad_records.load(Relaxed),
                "degraded": {"timeout": v.degraded_timeout.load(Relaxed), "error": v.degraded_error.load(Relaxed)},
            }),
        );
    }
    let mut stores = Map::new();
    for (backend, st) in t.stores() {
        let (r, w) = (&st.reads, &st.writes);
        let reads = r.outcomes.total();
        let read_keys = r.keys.load(Relaxed);
        stores.insert(
            backend.to_owned(),
            json!({
                "reads": reads,
                "read_errors": r.outcomes.error.load(Relaxed),
                "read_timeouts": r.outcomes.timeout.load(Relaxed),
                "read_keys": read_keys,
                "keys_per_read": ratio(read_keys, reads),
                // Round trips attempted, and how many failed; keys carried by all of them.
                "writes": w.outcomes.total(),
                "write_errors": w.outcomes.error.load(Relaxed),
                "write_timeouts": w.outcomes.timeout.load(Relaxed),
                "write_keys": w.keys.load(Relaxed),
            }),
        );
    }
    let p = &t.prefetch;
    json!({
        "uptime_s": t.uptime_s(),
        "window_s": millis(window_s.unwrap_or_else(|| t.window_s())),
        // The async workers serving requests (`server.workers`): a load tester runs its floor with as many.
        "workers": tokio::runtime::Handle::try_current().map_or(0, |h| h.metrics().num_workers()),
        // Where the kernel shares CPU time (`sched_group`): a load tester warns when its floor's differs.
        "sched_group": sched_group(),
        "store": gw.hydrator.store().backend(),
        "stores": stores,
        "prefetch": {
            "accepted": p.accepted.load(Relaxed), "rejected": p.rejected.load(Relaxed),
            "fetched": p.fetched.load(Relaxed), "cached": p.cached.load(Relaxed), "failed": p.failed.load(Relaxed),
            "warm_keys": p.warm_keys.load(Relaxed), "warm_incomplete": p.warm_incomplete.load(Relaxed),
        },
        "invalidation": invalidations(gw)
            .into_iter()
            .map(|(kind, n)| (kind.to_owned(), json!(n)))
            .collect::<serde_json::Map<_, _>>(),
        "models": models,
        "views": views,
    })
}

#[cfg(test)]
mod tests {
    use super::sched_group_of;

    #[test]
    fn the_sched_group_is_the_cpu_cgroup_and_in_the_root_one_the_autogroup() {
        let v1 = "9:name=systemd:/\n4:memory:/box\n2:cpu,cpuacct:/\n0::/\n";
        let on = Some("1\n");
        let auto = Some("/autogroup-229 nice 0\n");
        assert_eq!(
            sched_group_of(v1, on, auto).as_deref(),
            Some("cpu cgroup /, /autogroup-229")
        );
        // Autogroups are not used when disabled, nor for a task in a cgroup of its own.
        assert_eq!(
            sched_group_of(v1, Some("0\n"), auto).as_deref(),
            Some("cpu cgroup /")
        );
        let boxed = "2:cpu,cpuacct:/docker/abc\n";
        assert_eq!(
            sched_group_of(boxed, on, auto).as_deref(),
            Some("cpu cgroup /docker/abc")
        );
        // cgroup v2: one line for every controller.
        let v2 = "0::/system.slice/hydrant.service\n";
        assert_eq!(
            sched_group_of(v2, on, auto).as_deref(),
            Some("cpu cgroup /system.slice/hydrant.service")
        );
        assert_eq!(
            sched_group_of("0::/\n", on, None).as_deref(),
            Some("cpu cgroup /")
        );
        // Nothing that names a cpu cgroup.
        assert_eq!(sched_group_of("4:memory:/box\n", on, auto), None);
        assert_eq!(sched_group_of("", on, auto), None);
    }
}
