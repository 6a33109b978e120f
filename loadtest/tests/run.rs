//! Whole runs: result files, floor comparison, unreachable targets, Ctrl-C, the binary.

mod common;

use std::net::TcpListener;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{FakeConfig, FakeGateway, scenario, temp_dir};
use loadtest::drive::Cancel;
use loadtest::run::{RunError, RunOptions, run};
use loadtest::scenario::Scenario;

fn closed_port() -> String {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    drop(l);
    format!("http://{addr}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_then_fraction_with_floor_writes_json_and_html() {
    let dir = temp_dir("full");
    let out = sweep_with_floor(
        "mode = \"max-then-fraction\"\nconcurrency = [1, 4]\nfraction = 0.5\nstep_s = 1\nduration_s = 2\nwarm_up_s = 0.5",
        dir.clone(),
    )
    .await;
    assert_eq!(out.json_path, dir.join("test.json"));

    let v = result_json(&out);
    for key in [
        "achieved_rps",
        "p50_us",
        "p99_us",
        "p999_us",
        "errors",
        "hit_rate",
        "floor_rps",
        "ratio_to_floor",
        "max_rps",
    ] {
        assert!(v[key].is_number(), "{key} should be a number: {}", v[key]);
    }
    assert!(v["stages_p99_us"].is_object(), "stages_p99_us");
    assert_eq!(
        v["stages_p99_us"]["hydrate"], 41,
        "from the answers' timings_us"
    );
    assert_eq!(v["hit_rate_source"], "stats");
    let hit_rate = v["hit_rate"].as_f64().unwrap_or(0.0);
    assert!(hit_rate > 0.8, "warm keys should mostly hit: {hit_rate}");
    assert_eq!(v["stats_window_stages"]["decode"]["p99_us"], 12.0);
    assert_eq!(v["steps"].as_array().map(Vec::len), Some(2));
    assert!(
        v["stats_timeline"]
            .as_array()
            .is_some_and(|a| !a.is_empty())
    );
    assert!(
        v["latency_histogram"]
            .as_array()
            .is_some_and(|a| !a.is_empty())
    );
    assert_eq!(v["errors"], 0);
    assert_eq!(v["interrupted"], false);
    // The headline is the open-loop phase at half the sweep's max.
    let max = v["max_rps"].as_f64().unwrap_or(0.0);
    let offered = v["offered_rps"].as_f64().unwrap_or(0.0);
    assert!(
        (offered - max * 0.5).abs() < 1e-6 * max.max(1.0),
        "{offered} vs {max}"
    );
    assert!(v["floor"]["p50_us"].is_number());
    assert!(v["latency_ratio_to_floor"]["p50"].is_number());

    let html = std::fs::read_to_string(&out.html_path).expect("html file");
    for id in [
        "chart-latency-over-time",
        "chart-latency-histogram",
        "chart-stages",
        "chart-hit-rate",
        "chart-sweep",
    ] {
        assert!(html.contains(&format!("<svg id=\"{id}\"")), "missing {id}");
    }
    assert!(
        html.contains("Hit rate = (hits + stale + negative) / (hits + stale + misses + negative)"),
        "the definition the README and /v1/stats use"
    );
    assert!(html.contains("<polyline"), "line charts have lines");
    assert!(html.contains("<rect"), "bar charts have bars");
    // Self-contained: nothing fetched from anywhere.
    for external in ["<script", "<link", "src=", "@import", "https://"] {
        assert!(!html.contains(external), "html must not contain {external}");
    }
}

/// A run of `load` with the in-process floor on one thread, against a gateway that answers every predict
/// in 2 ms, in parallel (so its throughput grows with the concurrency), its report written to `dir`.
async fn sweep_with_floor(load: &str, dir: std::path::PathBuf) -> loadtest::run::RunOutput {
    let gw = FakeGateway::start(FakeConfig {
        delay: Duration::from_millis(2),
        stats: true,
        ..FakeConfig::default()
    })
    .await;
    let s = scenario(&gw.url(), load, "[floor]\nenabled = true\nthreads = 1");
    run(s, &quiet(dir), Cancel::new()).await.expect("run")
}

/// The in-process floor runs on as many threads as the gateway says it runs async workers, unless the
/// scenario sets `floor.threads`; on 2 without either. The result and the summary say which.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_floor_runs_on_as_many_threads_as_the_gateways_workers() {
    let load = "mode = \"closed-loop\"\nconcurrency = [2]\nduration_s = 0.5\nwarm_up_s = 0";
    for (workers, floor, expected, says) in [
        (
            Some(3),
            "",
            3,
            "both servers on 3 threads (the gateway's server.workers)",
        ),
        (
            Some(3),
            "\nthreads = 1",
            1,
            "gateway on 3 threads (server.workers), floor on 1 thread (floor.threads)",
        ),
        (
            None,
            "",
            2,
            "floor on 2 threads (the gateway's /v1/stats does not say its workers)",
        ),
    ] {
        let gw = FakeGateway::start(FakeConfig {
            delay: Duration::from_millis(1),
            stats: true,
            workers,
            ..FakeConfig::default()
        })
        .await;
        let s = scenario(&gw.url(), load, &format!("[floor]\nenabled = true{floor}"));
        let dir = temp_dir(&format!("floor-threads-{expected}"));
        let out = run(s, &quiet(dir), Cancel::new()).await.expect("run");
        let v = result_json(&out);
        assert_eq!(v["floor_threads"], expected, "{workers:?} {floor:?}");
        assert_eq!(v["gateway_workers"], serde_json::json!(workers));
        let summary = loadtest::report::table::render(&out.result);
        assert!(summary.contains(says), "{summary}");
    }
}

/// A gateway on this machine in another scheduling group than the load tester (and so than its
/// in-process floor) is warned of, by name; one in the same group is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_in_another_scheduling_group_than_the_floor_is_warned_of() {
    let Some(ours) = hydrant::observe::sched_group() else {
        // Nothing to compare where /proc says nothing (not Linux).
        return;
    };
    let load = "mode = \"closed-loop\"\nconcurrency = [2]\nduration_s = 0.3\nwarm_up_s = 0";
    for (group, warned) in [
        ("cpu cgroup /, /autogroup-999999".to_string(), true),
        (ours.clone(), false),
    ] {
        let gw = FakeGateway::start(FakeConfig {
            delay: Duration::from_millis(1),
            stats: true,
            sched_group: Some(group.clone()),
            ..FakeConfig::default()
        })
        .await;
        let s = scenario(&gw.url(), load, "[floor]\nenabled = true\nthreads = 1");
        let dir = temp_dir(&format!("sched-group-{warned}"));
        let out = run(s, &quiet(dir), Cancel::new()).await.expect("run");
        let warnings = out.result.warnings.join("\n");
        let says = format!(
            "another scheduling group ({group}) than the load tester and its floor ({ours})"
        );
        assert_eq!(warnings.contains(&says), warned, "{group}: {warnings}");
        let summary = loadtest::report::table::render(&out.result);
        assert_eq!(summary.contains("not like for like"), warned, "{summary}");
    }
}

/// A max-then-fraction run (`load`) against a fake gateway (`fake`) whose open-loop phase does not run:
/// the result and the failure it reports, which is also among its warnings.
async fn without_open_loop(
    fake: FakeConfig,
    load: &str,
    dir: &str,
) -> (loadtest::report::RunResult, String) {
    let gw = FakeGateway::start(fake).await;
    let s = scenario(&gw.url(), load, "");
    let out = run(s, &quiet(temp_dir(dir)), Cancel::new())
        .await
        .expect("the sweep ran");
    let r = out.result;
    assert_eq!(r.offered_rps, None, "no open-loop phase ran");
    let why = r.failure(None).expect("a failed run");
    assert!(r.warnings.contains(&why), "{:?}", r.warnings);
    (r, why)
}

/// A fraction so small that the open-loop phase would schedule nothing: no panic in the schedule, and a
/// run that fails, saying why, rather than one reported as a success at 0 rps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fraction_that_schedules_nothing_fails_the_run_and_says_why() {
    let (r, why) = without_open_loop(
        FakeConfig::default(),
        "mode = \"max-then-fraction\"\nconcurrency = [1]\nfraction = 1e-300\nstep_s = 0.5\nduration_s = 1\nwarm_up_s = 0",
        "tiny-fraction",
    )
    .await;
    assert!(r.max_rps.is_some_and(|m| m > 0.0), "{:?}", r.max_rps);
    assert!(
        why.starts_with("the open-loop phase did not run: load.fraction 1e-300")
            && why.contains("raise load.fraction or load.duration_s"),
        "{why}"
    );
}

/// A sweep in which nothing succeeded gives no rate for the open-loop phase: the run fails saying so,
/// and no failed step is reported as the measured phase.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_where_nothing_succeeded_says_the_open_loop_phase_did_not_run() {
    let (r, why) = without_open_loop(
        FakeConfig {
            overloaded_above: Some(0),
            ..FakeConfig::default()
        },
        "mode = \"max-then-fraction\"\nconcurrency = [1, 2]\nfraction = 0.5\nstep_s = 0.5\nduration_s = 1\nwarm_up_s = 0",
        "nothing-succeeded",
    )
    .await;
    assert!(
        r.steps
            .iter()
            .all(|s| s.hydrant.ok == 0 && s.hydrant.errors > 0)
    );
    assert_eq!(r.headline, "none");
    assert_eq!(r.hydrant.requests, 0, "{:?}", r.hydrant);
    assert!(
        why.starts_with("the open-loop phase did not run: no request succeeded in the sweep"),
        "{why}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_target_is_an_error() {
    let url = closed_port();
    let s = scenario(&url, "mode = \"open-loop\"\nrate = 10\nduration_s = 1", "");
    let err = run(s, &quiet(temp_dir("unreachable")), Cancel::new())
        .await
        .expect_err("must fail");
    assert!(matches!(err, RunError::Unreachable { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("unreachable") && msg.contains(&url), "{msg}");
}

/// A `redis-server` of the test's own on a free port, stopped when dropped.
struct Redis(std::process::Child, u16);

impl Redis {
    fn start() -> Redis {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("redis-server runs (make test installs it)");
        let redis = Redis(child, port);
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "redis-server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        redis
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `--redis-url` measures plain GET round trips in the same run, and the report shows them beside
/// the gateway's numbers: in the JSON and in the HTML page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_redis_get_floor_is_in_the_json_and_the_html() {
    let redis = Redis::start();
    let gw = FakeGateway::start(FakeConfig::default()).await;
    let opts = RunOptions {
        redis_url: Some(format!("redis://127.0.0.1:{}", redis.1)),
        ..quiet(temp_dir("redis-get"))
    };
    let s = scenario(
        &gw.url(),
        "mode = \"open-loop\"\nrate = 20\nduration_s = 1",
        "",
    );
    let out = run(s, &opts, Cancel::new()).await.expect("run");
    let g = out.result.redis_get.as_ref().expect("redis_get");
    assert!(
        g.samples > 0 && g.p50_us > 0 && g.p50_us <= g.p99_us,
        "{g:?}"
    );
    let html = std::fs::read_to_string(&out.html_path).expect("html file");
    let at = html
        .find("<h2>Plain Redis GET</h2>")
        .expect("a Redis GET section");
    assert!(
        html[at..].contains(&format!("{} samples", g.samples)),
        "{}",
        &html[at..(at + 400).min(html.len())]
    );
}

/// A Redis or a floor that is not there is found before any load is sent, and named as such.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_absent_redis_or_floor_fails_before_the_load() {
    let gw = FakeGateway::start(FakeConfig::default()).await;
    let load = "mode = \"open-loop\"\nrate = 10\nduration_s = 30";
    let redis = format!("redis://{}", closed_port().trim_start_matches("http://"));
    let started = Instant::now();
    let opts = RunOptions {
        redis_url: Some(redis.clone()),
        ..quiet(temp_dir("no-redis"))
    };
    let err = run(scenario(&gw.url(), load, ""), &opts, Cancel::new())
        .await
        .expect_err("no Redis there");
    assert!(matches!(err, RunError::Redis(_)), "{err:?}");
    assert!(err.to_string().contains("--redis-url"), "{err}");

    let floor = closed_port();
    let s = scenario(
        &gw.url(),
        load,
        &format!("\n[floor]\nenabled = true\nurl = \"{floor}\""),
    );
    let err = run(s, &quiet(temp_dir("no-floor")), Cancel::new())
        .await
        .expect_err("no floor there");
    assert!(matches!(err, RunError::FloorUnreachable(_)), "{err:?}");
    assert!(err.to_string().starts_with("floor.url"), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "no load was run"
    );
}

/// `load` run against a fake gateway that answers the readiness probe and the first requests at once,
/// then holds every request from 0.5 s after it started; Ctrl-C at 1.5 s, with a request timeout of 30 s.
async fn interrupted_in_a_stall(load: &str, dir: &str) -> loadtest::run::RunOutput {
    let gw = FakeGateway::start(FakeConfig {
        delay: Duration::from_millis(1),
        stall: Some((Duration::from_millis(500), Duration::from_secs(120))),
        ..FakeConfig::default()
    })
    .await;
    let mut s = scenario(&gw.url(), load, "");
    s.timeout = Duration::from_secs(30);
    run(
        s,
        &quiet(temp_dir(dir)),
        cancel_after(Duration::from_millis(1500)),
    )
    .await
    .expect("partial run")
}

/// Ctrl-C against a server that holds every request: the report comes promptly, not after the
/// requests' 30 s timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_does_not_wait_for_requests_a_hung_server_holds() {
    for load in [
        "mode = \"open-loop\"\nrate = 20\nduration_s = 30",
        "mode = \"closed-loop\"\nconcurrency = [4]\nduration_s = 30",
    ] {
        let started = Instant::now();
        let out = interrupted_in_a_stall(load, "cancel-hung").await;
        assert!(
            started.elapsed() < Duration::from_secs(6),
            "{load}: the report took {:?}",
            started.elapsed()
        );
        assert!(out.result.interrupted, "{load}");
        assert!(out.json_path.exists(), "{load}");
    }
}

/// Ctrl-C during a stall: the requests the stall holds are not dropped from the report, which would
/// hide the stall, but counted as `abandoned`, each with the time it had been open (from its intended
/// send in open loop) as its latency.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_a_stall_holds_at_ctrl_c_are_counted_as_abandoned() {
    for (load, abandoned) in [
        (
            "mode = \"open-loop\"\nrate = 20\nduration_s = 30\nwarm_up_s = 0",
            15..=25,
        ),
        (
            "mode = \"closed-loop\"\nconcurrency = [4]\nduration_s = 30\nwarm_up_s = 0",
            4..=4,
        ),
    ] {
        let v = result_json(&interrupted_in_a_stall(load, "cancel-stall").await);
        let n = v["errors_by_kind"]["abandoned"].as_u64().unwrap_or(0);
        assert!(abandoned.contains(&n), "{load}: {}", v["errors_by_kind"]);
        assert_eq!(v["errors"].as_u64(), Some(n), "{load}: nothing else failed");
        assert!(
            v["ok"].as_u64().unwrap_or(0) > 0,
            "{load}: answered before the stall"
        );
        // Held from the stall (0.5 s) to the end of the grace (about 2 s): the tail shows it.
        let max = v["max_us"].as_u64().unwrap_or(0);
        assert!(max >= 900_000, "{load}: max {max} µs");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_writes_a_partial_report() {
    let gw = FakeGateway::start(FakeConfig {
        delay: Duration::from_millis(1),
        ..FakeConfig::default()
    })
    .await;
    let s = scenario(
        &gw.url(),
        "mode = \"open-loop\"\nrate = 50\nduration_s = 30",
        "",
    );
    let mut s = s;
    s.format = loadtest::scenario::Format::Msgpack;
    let cancel = cancel_after(Duration::from_millis(1500));
    let started = Instant::now();
    let dir = temp_dir("cancel");
    let out = run(s, &quiet(dir), cancel).await.expect("partial run");
    assert!(started.elapsed() < Duration::from_secs(10), "stopped early");
    let v = result_json(&out);
    assert_eq!(v["interrupted"], true);
    let ok = v["ok"].as_u64().unwrap_or(0);
    assert!((40..=120).contains(&ok), "about 1.5 s at 50 rps: {ok}");
    assert_eq!(
        v["errors"], 0,
        "msgpack bodies were accepted: {}",
        v["errors_by_kind"]
    );
    assert!(out.html_path.exists());
}

/// Interrupted in the warm-up, before anything was measured: the report says there is no rate
/// (`null`, `-`), not a rate of 0 that reads as a server that answered nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_in_the_warm_up_reports_no_rate_rather_than_zero() {
    let gw = FakeGateway::start(FakeConfig::default()).await;
    let s = scenario(
        &gw.url(),
        "mode = \"open-loop\"\nrate = 50\nduration_s = 30\nwarm_up_s = 20",
        "",
    );
    let out = run(
        s,
        &quiet(temp_dir("cancel-warm")),
        cancel_after(Duration::from_millis(800)),
    )
    .await
    .expect("partial run");
    let v = result_json(&out);
    assert_eq!(v["interrupted"], true);
    assert_eq!(v["achieved_rps"], serde_json::Value::Null, "{v}");
    assert_eq!(v["p50_us"], serde_json::Value::Null, "{v}");
    let html = std::fs::read_to_string(&out.html_path).expect("html report");
    assert!(
        html.contains(r#"<div class="card"><b>-</b><span>achieved rps</span></div>"#),
        "the report's rate card does not say `-`"
    );
}

/// An output directory that cannot be created: its parent is a regular file.
fn uncreatable_dir(name: &str) -> std::path::PathBuf {
    let file = temp_dir(name).join("a-file");
    std::fs::write(&file, b"not a directory").expect("write file");
    file.join("out")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unwritable_out_dir_fails_before_any_load() {
    let gw = FakeGateway::start(FakeConfig::default()).await;
    let s = scenario(
        &gw.url(),
        "mode = \"open-loop\"\nrate = 20\nduration_s = 10\nwarm_up_s = 2",
        "",
    );
    let out_dir = uncreatable_dir("out-dir-check");
    let started = Instant::now();
    let err = run(s, &quiet(out_dir.clone()), Cancel::new())
        .await
        .expect_err("an uncreatable out dir must fail");
    assert!(matches!(err, RunError::OutDir { .. }), "{err:?}");
    assert!(
        err.to_string().contains(&out_dir.display().to_string()),
        "names the path: {err}"
    );
    assert!(started.elapsed() < Duration::from_secs(5), "before the run");
    assert_eq!(gw.predicts(), 0, "nothing was sent");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_model_fails_before_the_warm_up() {
    let gw = FakeGateway::start(FakeConfig {
        models: Some(vec!["ctr".to_string()]),
        ..FakeConfig::default()
    })
    .await;
    let mut s = scenario(
        &gw.url(),
        "mode = \"open-loop\"\nrate = 20\nduration_s = 10\nwarm_up_s = 2",
        "",
    );
    s.model = "no_such_model".to_string();
    let dir = temp_dir("unknown-model");
    let started = Instant::now();
    let err = run(s, &quiet(dir.clone()), Cancel::new())
        .await
        .expect_err("an unknown model must fail");
    assert!(matches!(err, RunError::UnknownModel { .. }), "{err:?}");
    let msg = err.to_string();
    for part in ["`no_such_model`", "HTTP 404", "unknown_model", &gw.url()] {
        assert!(msg.contains(part), "{part:?} missing from: {msg}");
    }
    assert!(started.elapsed() < Duration::from_secs(5), "before the run");
    assert_eq!(gw.predicts(), 1, "one probe, no load");
    assert!(
        !dir.join("test.json").exists(),
        "no report for a run that did not happen"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn floor_target_passes_the_model_probe() {
    // The floor answers predict for any model: pointing a run at it must still work.
    let floor =
        loadtest::floor::FloorHandle::spawn(std::net::SocketAddr::from(([127, 0, 0, 1], 0)), 3, 1)
            .expect("floor");
    let mut s = scenario(
        &format!("http://{}", floor.addr),
        "mode = \"open-loop\"\nrate = 40\nduration_s = 0.5",
        "",
    );
    s.model = "whatever".to_string();
    let out = run(s, &quiet(temp_dir("floor-target")), Cancel::new())
        .await
        .expect("a floor target runs");
    assert!(out.result.hydrant.ok > 0, "{:?}", out.result.hydrant);
    assert_eq!(out.result.hydrant.errors, 0);
    let _ = tokio::task::spawn_blocking(move || drop(floor)).await;
}

/// The part of the HTML report from its "Errors" heading to the next heading.
fn errors_section(html: &str) -> &str {
    let start = html.find("<h2>Errors</h2>").unwrap_or(html.len());
    let rest = &html[start..];
    let end = rest[1..].find("<h2>").map_or(rest.len(), |i| i + 1);
    &rest[..end]
}

/// A target that answers 503 whenever another request is open: the first step of a sweep
/// (concurrency 1) is clean and has the highest throughput, the second (concurrency 8) fails
/// almost entirely. Its failures must not hide behind the clean step's numbers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_step_that_fails_is_warned_about_and_listed() {
    for (mode, load) in [
        (
            "closed-loop",
            "mode = \"closed-loop\"\nconcurrency = [1, 8]\nduration_s = 1",
        ),
        (
            "max-then-fraction",
            "mode = \"max-then-fraction\"\nconcurrency = [1, 8]\nstep_s = 1\nfraction = 0.2\nduration_s = 0.5",
        ),
    ] {
        let gw = FakeGateway::start(FakeConfig {
            delay: Duration::from_millis(2),
            overloaded_above: Some(1),
            ..FakeConfig::default()
        })
        .await;
        let s = scenario(&gw.url(), load, "");
        let out = run(s, &quiet(temp_dir("failing-step")), Cancel::new())
            .await
            .expect("run");
        let r = &out.result;
        let step8 = &r.steps[1].hydrant;
        assert!(
            step8.error_rate > 0.5,
            "{mode}: the fake fails the concurrent step: {step8:?}"
        );
        assert_eq!(
            r.steps[0].hydrant.errors, 0,
            "{mode}: one at a time is fine"
        );
        if mode == "closed-loop" {
            assert_eq!(r.headline, "concurrency 1", "the clean step is the best");
        }
        let warned: Vec<&String> = r
            .warnings
            .iter()
            .filter(|w| w.contains("concurrency 8") && w.contains("503"))
            .collect();
        assert_eq!(warned.len(), 1, "{mode}: {:?}", r.warnings);
        let html = std::fs::read_to_string(&out.html_path).expect("html");
        let errors = errors_section(&html);
        if mode == "closed-loop" {
            assert!(
                !errors.contains("None in"),
                "{mode}: every step is measured: {errors}"
            );
        }
        assert!(
            errors.contains("concurrency 8") && errors.contains("503"),
            "{mode}: {errors}"
        );
    }
}

/// A floor that fails in one step of the sweep is warned about by step: the floor's max, and so the
/// ratio to it, would otherwise rest on a step whose failures nobody saw.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_floor_step_that_fails_is_warned_about() {
    let gw = FakeGateway::start(FakeConfig {
        delay: Duration::from_millis(2),
        ..FakeConfig::default()
    })
    .await;
    let floor = FakeGateway::start(FakeConfig {
        delay: Duration::from_millis(2),
        overloaded_above: Some(1),
        ..FakeConfig::default()
    })
    .await;
    let load = "mode = \"max-then-fraction\"\nconcurrency = [1, 8]\nstep_s = 1\nfraction = 0.2\nduration_s = 0.5";
    let s = scenario(
        &gw.url(),
        load,
        &format!("\n[floor]\nenabled = true\nurl = \"{}\"", floor.url()),
    );
    let out = run(s, &quiet(temp_dir("failing-floor-step")), Cancel::new())
        .await
        .expect("run");
    let r = &out.result;
    let floor8 = r.steps[1]
        .floor
        .as_ref()
        .expect("the floor ran in the sweep");
    assert!(floor8.error_rate > 0.5, "the fake floor fails: {floor8:?}");
    assert_eq!(r.steps[1].hydrant.errors, 0, "{:?}", r.steps[1].hydrant);
    let warned: Vec<&String> = r
        .warnings
        .iter()
        .filter(|w| w.starts_with("floor, step concurrency 8") && w.contains("503"))
        .collect();
    assert_eq!(warned.len(), 1, "{:?}", r.warnings);
    assert!(
        !r.warnings
            .iter()
            .any(|w| w.starts_with("floor, step concurrency 1")),
        "the clean step is not warned about: {:?}",
        r.warnings
    );
}

/// The binary holds every measured step of a closed-loop sweep to `max_error_rate`, not only the
/// highest-throughput one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_fails_a_closed_loop_sweep_whose_step_exceeds_max_error_rate() {
    let gw = FakeGateway::start(FakeConfig {
        delay: Duration::from_millis(2),
        overloaded_above: Some(1),
        ..FakeConfig::default()
    })
    .await;
    let dir = temp_dir("bin-failing-step");
    let file = dir.join("sweep.toml");
    let text = std::fs::read_to_string(crate_path("scenarios/smoke.toml")).expect("smoke");
    let load_start = text.find("[load]").expect("a [load] table");
    let load_end = text[load_start + 1..]
        .find("\n[")
        .map_or(text.len(), |i| load_start + 1 + i);
    let text = format!(
        "{}[load]\nmode = \"closed-loop\"\nconcurrency = [1, 8]\nduration_s = 1\n{}",
        &text[..load_start],
        &text[load_end..]
    );
    std::fs::write(&file, &text).expect("write");
    assert!(text.contains("max_error_rate = 0.01"), "{text}");
    let out = output(run_command("1", &gw.url(), &dir.join("out"), &file)).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(3),
        "stdout: {stdout}\nstderr: {stderr}"
    );
    assert!(
        stderr.contains("concurrency 8") && stderr.contains("max_error_rate"),
        "{stderr}"
    );
}

/// `loadtest run … | head`: the terminal has gone by the time the table is written. The run's
/// status is still the run's, not a panic's (101), and the report files are there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_with_its_terminal_gone_keeps_the_runs_status() {
    let gw = FakeGateway::start(FakeConfig {
        delay: Duration::from_millis(1),
        ..FakeConfig::default()
    })
    .await;
    let dir = temp_dir("bin-closed-pipe");
    let mut cmd = run_command(
        "1",
        &gw.url(),
        &dir.join("out"),
        &crate_path("scenarios/smoke.toml"),
    );
    cmd.stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let status = tokio::task::spawn_blocking(move || {
        let mut child = cmd.spawn().expect("start the binary");
        // Both read ends closed before the binary writes a byte.
        drop(child.stdout.take());
        drop(child.stderr.take());
        child.wait()
    })
    .await
    .expect("join")
    .expect("wait");
    assert_eq!(status.code(), Some(0), "{status:?}");
    assert!(dir.join("out/smoke.json").is_file());
    assert!(dir.join("out/smoke.html").is_file());
}

/// Ctrl-C in the first hydrant half of a sweep's first step: the floor never ran, so it has no
/// throughput (null, `-`), not 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_floor_that_never_ran_has_no_throughput() {
    let out = interrupted_with_floor(
        "mode = \"closed-loop\"\nconcurrency = [1, 2]\nduration_s = 30",
        "floor-never-ran",
        Duration::from_millis(800),
    )
    .await;
    assert!(out.result.interrupted);
    assert!(out.result.hydrant.ok > 0, "hydrant ran");
    let v = result_json(&out);
    assert!(v["floor_rps"].is_null(), "floor_rps: {}", v["floor_rps"]);
    assert!(v["ratio_to_floor"].is_null(), "{}", v["ratio_to_floor"]);
    assert!(v["floor"].is_null(), "{}", v["floor"]);
    assert!(v["steps"][0]["floor"].is_null(), "{}", v["steps"][0]);
    let table = loadtest::report::table::render(&out.result);
    let row = table
        .lines()
        .find(|l| l.trim_start().starts_with("1 "))
        .unwrap_or_else(|| panic!("no sweep row for concurrency 1: {table}"));
    assert!(
        row.trim_end().ends_with("-           -"),
        "floor columns: {row}"
    );
}

/// Ctrl-C in the open-loop phase of max-then-fraction, after a sweep that ran the floor: the ratio of
/// the sweep's maxima still stands, in the JSON and in the table, though the phase's floor never ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_keeps_its_floor_ratio_when_the_open_loop_phase_is_cut_short() {
    let out = interrupted_with_floor(
        "mode = \"max-then-fraction\"\nconcurrency = [1]\nfraction = 0.5\nstep_s = 0.5\nduration_s = 60\nwarm_up_s = 0",
        "sweep-then-cut",
        Duration::from_millis(2500),
    )
    .await;
    let r = &out.result;
    assert!(r.interrupted);
    assert!(r.floor.is_none(), "the open-loop phase's floor never ran");
    let step_floor = r.steps[0].floor.as_ref().expect("the sweep's floor ran");
    assert_eq!(r.floor_rps, step_floor.achieved_rps);
    let max = r.max_rps.expect("the sweep's max");
    let step_floor_rps = step_floor
        .achieved_rps
        .expect("the sweep's floor was measured");
    assert_eq!(r.ratio_to_floor, Some(max / step_floor_rps));
    let v = result_json(&out);
    assert!(v["ratio_to_floor"].is_number(), "{}", v["ratio_to_floor"]);
    let table = loadtest::report::table::render(r);
    assert!(
        table.contains(&format!(
            "max throughput: {} (floor ",
            loadtest::report::fmt_rate(max)
        )),
        "{table}"
    );
}

/// With `load.confirm_s`, each server's best sweep step is run again, and those runs, not the sweep's best
/// steps, are the maxima: the ratio, the open-loop rate and the table come from them, and the sweep's
/// own maxima are kept beside them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_best_steps_run_again_give_the_maxima() {
    // 2 ms a predict, answered in parallel: hydrant's throughput is about concurrency / 2 ms, so its
    // best step is the higher concurrency.
    let out = sweep_with_floor(
        "mode = \"max-then-fraction\"\nconcurrency = [1, 4]\nfraction = 0.5\nstep_s = 1\nconfirm_s = 1\nduration_s = 1\nwarm_up_s = 0",
        temp_dir("confirm"),
    )
    .await;
    let r = &out.result;
    let c = r.confirm.as_ref().expect("the best steps ran again");
    assert_eq!(c.concurrency, 4, "hydrant's best step");
    let floor_best = r
        .steps
        .iter()
        .max_by(|a, b| {
            let rps = |s: &loadtest::report::StepResult| {
                s.floor.as_ref().and_then(|f| f.achieved_rps).unwrap_or(0.0)
            };
            rps(a).total_cmp(&rps(b))
        })
        .and_then(|s| s.concurrency);
    assert_eq!(c.floor_concurrency, floor_best, "the floor's own best step");
    let sweep_best = r
        .steps
        .iter()
        .filter_map(|s| s.hydrant.achieved_rps)
        .fold(0.0, f64::max);
    assert_eq!(c.sweep_max_rps, Some(sweep_best));

    // The maxima are the runs again, measured apart from the sweep.
    let max = c.hydrant.achieved_rps.expect("hydrant ran again");
    let floor = c
        .floor
        .as_ref()
        .and_then(|f| f.achieved_rps)
        .expect("the floor ran again");
    assert_eq!(r.max_rps, Some(max));
    assert_eq!(r.floor_rps, Some(floor));
    assert_eq!(r.ratio_to_floor, Some(max / floor));
    assert!(
        (500.0..=2_100.0).contains(&max),
        "4 connections at 2 ms each: {max}"
    );
    assert_eq!(c.hydrant.errors, 0);
    assert!(!c.cut);
    let offered = r.offered_rps.expect("the open loop ran");
    assert!(
        (offered - max * 0.5).abs() < 1e-6 * max,
        "{offered} vs {max}"
    );

    // Its segments, at each one's concurrency: hydrant in halves around the floor.
    let again: Vec<(String, loadtest::record::Which)> = r
        .segments
        .iter()
        .filter(|s| s.label.starts_with("best step again"))
        .map(|s| (s.label.clone(), s.which))
        .collect();
    let floor_c = c.floor_concurrency.expect("the floor ran");
    assert_eq!(
        again,
        vec![
            (
                "best step again, concurrency 4".to_string(),
                loadtest::record::Which::Hydrant
            ),
            (
                format!("best step again, concurrency {floor_c}"),
                loadtest::record::Which::Floor
            ),
            (
                "best step again, concurrency 4".to_string(),
                loadtest::record::Which::Hydrant
            ),
        ]
    );

    let v = result_json(&out);
    assert_eq!(v["confirm"]["concurrency"], 4);
    assert_eq!(v["confirm"]["duration_s"], 1.0);
    assert!(v["confirm"]["sweep_ratio_to_floor"].is_number());
    let table = loadtest::report::table::render(r);
    assert!(
        table.contains(&format!(
            "best steps run again for 1 s: hydrant {} at concurrency 4, floor {} at concurrency {floor_c}",
            loadtest::report::fmt_rate(max),
            loadtest::report::fmt_rate(floor)
        )),
        "{table}"
    );
    assert!(
        table.contains(&format!(
            "max throughput: {} (floor {}, ratio {:.2}); the sweep's best steps: {} and ",
            loadtest::report::fmt_rate(max),
            loadtest::report::fmt_rate(floor),
            max / floor,
            loadtest::report::fmt_rate(sweep_best)
        )),
        "{table}"
    );
    let html = std::fs::read_to_string(&out.html_path).expect("html file");
    assert!(
        html.contains("the sweep&#39;s best steps: ") || html.contains("the sweep's best steps: "),
        "the HTML says it too"
    );
}

/// Ctrl-C while the best steps run again: those runs are partial, so the sweep's maxima stand.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_c_while_the_best_steps_run_again_keeps_the_sweeps_maxima() {
    let out = interrupted_with_floor(
        "mode = \"max-then-fraction\"\nconcurrency = [1]\nfraction = 0.5\nstep_s = 0.5\nconfirm_s = 60\nduration_s = 60\nwarm_up_s = 0",
        "confirm-then-cut",
        Duration::from_millis(2500),
    )
    .await;
    let r = &out.result;
    assert!(r.interrupted);
    assert_eq!(r.offered_rps, None, "no open loop after Ctrl-C");
    let c = r.confirm.as_ref().expect("the runs again had started");
    assert!(c.cut);
    assert_eq!(r.max_rps, c.sweep_max_rps);
    assert_eq!(r.floor_rps, c.sweep_floor_rps);
    assert_eq!(r.max_rps, r.steps[0].hydrant.achieved_rps);
    let table = loadtest::report::table::render(r);
    assert!(
        table.contains("(cut short by Ctrl-C: the sweep's maxima stand)"),
        "{table}"
    );
}

/// The terminal table: columns as wide as their values stay apart, and a flood of distinct error codes
/// is cut to the most frequent, with a count of the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_summary_keeps_columns_apart_and_lists_the_top_error_codes() {
    let gw = FakeGateway::start(FakeConfig::default()).await;
    let s = scenario(
        &gw.url(),
        "mode = \"open-loop\"\nrate = 50\nduration_s = 0.2\nwarm_up_s = 0",
        "[floor]\nenabled = true\nthreads = 1",
    );
    let out = run(s, &quiet(temp_dir("table")), Cancel::new())
        .await
        .expect("run");
    let mut r = out.result.clone();
    r.hydrant.errors = 604;
    r.hydrant.error_rate = 0.023;
    let floor = r.floor.as_mut().expect("the floor ran");
    floor.errors = 26160;
    floor.error_rate = 1.0;
    r.error_codes = (0..15u64)
        .map(|i| (format!("code_{i:02}"), 100 + i))
        .collect();
    let table = loadtest::report::table::render(&r);
    assert!(table.contains("604 (2.3%) 26160 (100.0%)"), "{table}");
    assert!(
        table.contains("error codes: code_14: 114, code_13: 113,")
            && table.contains(
                "code_05: 105, and 5 more (all of them are in the JSON result's error_codes)"
            )
            && !table.contains("code_04"),
        "{table}"
    );
}

/// Ctrl-C while the readiness probe waits on a target that accepts connections but never answers
/// ends the wait at once, not when the probe's 2 s timeout runs out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_ends_the_wait_for_a_target_that_never_answers() {
    use loadtest::client::Pool;
    use loadtest::scenario::parse_loopback_url;

    // Never accepted: the kernel completes the handshakes and nothing ever answers.
    let silent = TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}", silent.local_addr().expect("addr"));
    let pool = Pool::new(&parse_loopback_url(&url).expect("url")).expect("pool");
    let cancel = cancel_after(Duration::from_millis(200));
    let started = Instant::now();
    let err = loadtest::run::wait_ready(&pool, Duration::from_secs(10), &cancel)
        .await
        .expect_err("interrupted");
    assert!(matches!(err, RunError::Interrupted), "{err:?}");
    assert!(
        started.elapsed() < Duration::from_millis(1000),
        "took {:?}",
        started.elapsed()
    );
}

/// Run options writing to `out_dir`, without the progress line.
/// The JSON result file a run wrote.
fn result_json(out: &loadtest::run::RunOutput) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(&out.json_path).expect("json file")).expect("json")
}

/// A run of `load` with the floor, against a gateway answering in 1 ms, cut short by a Ctrl-C `after`
/// (its report written to a folder named `dir`).
async fn interrupted_with_floor(
    load: &str,
    dir: &str,
    after: Duration,
) -> loadtest::run::RunOutput {
    let gw = FakeGateway::start(FakeConfig {
        delay: Duration::from_millis(1),
        ..FakeConfig::default()
    })
    .await;
    let s = scenario(&gw.url(), load, "[floor]\nenabled = true\nthreads = 1");
    run(s, &quiet(temp_dir(dir)), cancel_after(after))
        .await
        .expect("partial run")
}

/// A cancellation that fires by itself after `after`, as a Ctrl-C would.
fn cancel_after(after: Duration) -> Cancel {
    let cancel = Cancel::new();
    let c2 = cancel.clone();
    tokio::spawn(async move {
        tokio::time::sleep(after).await;
        c2.cancel();
    });
    cancel
}

fn quiet(out_dir: std::path::PathBuf) -> RunOptions {
    RunOptions {
        out_dir,
        progress: false,
        ..RunOptions::default()
    }
}

/// Runs the binary off the async workers (the fake gateway answers on them meanwhile).
async fn output(mut cmd: Command) -> std::process::Output {
    tokio::task::spawn_blocking(move || cmd.output())
        .await
        .expect("join")
        .expect("run the binary")
}

/// `loadtest run --quiet --duration-s D --target T --out-dir O SCENARIO`.
fn run_command(duration_s: &str, target: &str, out_dir: &Path, scenario: &Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_loadtest"));
    cmd.args([
        "run",
        "--quiet",
        "--duration-s",
        duration_s,
        "--target",
        target,
    ])
    .arg("--out-dir")
    .arg(out_dir)
    .arg(scenario);
    cmd
}

/// The smoke scenario for one second against a port nobody listens on.
fn smoke_at_closed_port(out_dir: &Path) -> std::process::Output {
    run_command(
        "1",
        &closed_port(),
        out_dir,
        &crate_path("scenarios/smoke.toml"),
    )
    .output()
    .expect("run the binary")
}

fn crate_path(rel: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

#[test]
fn shipped_scenarios_are_valid() {
    let dir = crate_path("scenarios");
    let mut names = Vec::new();
    for entry in std::fs::read_dir(&dir).expect("scenarios dir") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "toml") {
            let s = Scenario::load(&path).unwrap_or_else(|e| panic!("{e}"));
            names.push(s.name);
        }
    }
    for required in ["hot-path", "miss-path", "ranking", "smoke"] {
        assert!(
            names.iter().any(|n| n == required),
            "missing scenario {required}"
        );
    }
}

#[test]
fn binary_exits_non_zero_on_unreachable_target() {
    let out_dir = temp_dir("bin-unreachable");
    let out = smoke_at_closed_port(&out_dir);
    assert_eq!(out.status.code(), Some(1), "an unreachable target exits 1");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("unreachable"), "{stderr}");
    // A host name that does not resolve (`.invalid` never does) is unreachable too, not a mistake in
    // the scenario (exit 2).
    let out = run_command(
        "1",
        "http://nonexistent.invalid:8080",
        &out_dir,
        &crate_path("scenarios/smoke.toml"),
    )
    .arg("--allow-remote")
    .output()
    .expect("run the binary");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("target http://nonexistent.invalid:8080 is unreachable: cannot resolve"),
        "{stderr}"
    );
}

#[test]
fn binary_check_validates() {
    let ok = Command::new(env!("CARGO_BIN_EXE_loadtest"))
        .arg("check")
        .arg(crate_path("scenarios/hot-path.toml"))
        .output()
        .expect("run the binary");
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert!(String::from_utf8_lossy(&ok.stdout).starts_with("ok: hot-path"));

    let dir = temp_dir("bin-check");
    let bad = dir.join("bad.toml");
    let text = std::fs::read_to_string(crate_path("scenarios/smoke.toml")).expect("smoke");
    std::fs::write(&bad, text.replace("[load]", "[load]\nburst = 3")).expect("write");
    let out = Command::new(env!("CARGO_BIN_EXE_loadtest"))
        .arg("check")
        .arg(&bad)
        .output()
        .expect("run the binary");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("burst"));

    // A path to something that is no scenario and never ends: refused after the limit, not read on.
    let out = Command::new(env!("CARGO_BIN_EXE_loadtest"))
        .args(["check", "/dev/zero"])
        .output()
        .expect("run the binary");
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("cannot read scenario /dev/zero: it is larger than 1024 KiB"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let refused = Command::new(env!("CARGO_BIN_EXE_loadtest"))
        .args(["floor", "--bind", "0.0.0.0:0", "--for-s", "1"])
        .output()
        .expect("run the binary");
    assert_eq!(
        refused.status.code(),
        Some(2),
        "floor must refuse non-loopback binds as a usage error"
    );
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--bind"));
}

#[test]
fn binary_refuses_an_unwritable_out_dir_before_the_run() {
    let out_dir = uncreatable_dir("bin-out-dir");
    let started = Instant::now();
    // The target is closed: a check made only after the run would report it unreachable instead.
    let out = smoke_at_closed_port(&out_dir);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&out_dir.display().to_string()) && stderr.contains("not writable"),
        "{stderr}"
    );
    assert!(!stderr.contains("unreachable"), "checked first: {stderr}");
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_prints_the_table_when_the_report_cannot_be_written() {
    let gw = FakeGateway::start(FakeConfig::default()).await;
    let out_dir = temp_dir("bin-unwritable-at-end").join("out");
    let child = run_command(
        "2",
        &gw.url(),
        &out_dir,
        &crate_path("scenarios/smoke.toml"),
    )
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::piped())
    .spawn()
    .expect("start the binary");
    // The up-front check creates the directory; once the load is flowing, make it unwritable by
    // putting a file in its place.
    let deadline = Instant::now() + Duration::from_secs(20);
    while gw.predicts() == 0 {
        assert!(Instant::now() < deadline, "the run never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(out_dir.is_dir(), "created by the up-front check");
    std::fs::remove_dir_all(&out_dir).expect("remove out dir");
    std::fs::write(&out_dir, b"in the way").expect("file in its place");
    let out = tokio::task::spawn_blocking(move || child.wait_with_output())
        .await
        .expect("join")
        .expect("wait for the binary");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(1),
        "stdout: {stdout}\nstderr: {stderr}"
    );
    assert!(
        stdout.contains("scenario smoke") && stdout.contains("p99"),
        "the table is printed anyway: {stdout}"
    );
    assert!(
        stderr.contains("cannot write") && stderr.contains(&out_dir.display().to_string()),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_refuses_an_unknown_model() {
    let gw = FakeGateway::start(FakeConfig {
        models: Some(vec!["ctr".to_string()]),
        ..FakeConfig::default()
    })
    .await;
    let dir = temp_dir("bin-unknown-model");
    let file = dir.join("nope.toml");
    let text = std::fs::read_to_string(crate_path("scenarios/smoke.toml")).expect("smoke");
    std::fs::write(&file, text.replace("model = \"ctr\"", "model = \"nope\"")).expect("write");
    let cmd = run_command("5", &gw.url(), &dir.join("out"), &file);
    let started = Instant::now();
    let out = output(cmd).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("`nope`")
            && stderr.contains("HTTP 404")
            && stderr.contains("unknown_model"),
        "{stderr}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "before the warm-up"
    );
    assert_eq!(gw.predicts(), 1, "one probe, no load");
    assert!(stderr.contains("check `model`"), "{stderr}");

    // A target URL with a path: the hint is about the path, not the model.
    let cmd = run_command(
        "5",
        &format!("{}/v1", gw.url()),
        &dir.join("out"),
        &crate_path("scenarios/smoke.toml"),
    );
    let out = output(cmd).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("a path in the target URL is a prefix"),
        "{stderr}"
    );
}

/// The floor answers a MessagePack request in MessagePack, as hydrant does, so a `format =
/// "msgpack"` run compares like with like.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_floor_answers_in_the_format_it_was_asked() {
    use loadtest::client::Pool;
    use loadtest::floor::FloorHandle;
    use loadtest::scenario::{Format, parse_loopback_url};

    let floor = FloorHandle::spawn("127.0.0.1:0".parse().expect("addr"), 3, 1).expect("floor");
    let pool = Pool::new(&parse_loopback_url(&format!("http://{}", floor.addr)).expect("url"))
        .expect("pool");
    let uri = pool.uri("/v1/models/ctr/predict").expect("uri");
    for (format, msgpack) in [(Format::Json, false), (Format::Msgpack, true)] {
        let r = pool
            .send(
                hyper::Method::POST,
                uri.clone(),
                Some(format),
                hyper::body::Bytes::from_static(b"{}"),
                Duration::from_secs(5),
            )
            .await
            .expect("answer");
        assert_eq!(r.status, 200);
        assert_eq!(r.msgpack, msgpack, "{format:?}");
        let v: serde_json::Value = if msgpack {
            rmp_serde::from_slice(&r.body).expect("msgpack body")
        } else {
            serde_json::from_slice(&r.body).expect("json body")
        };
        assert_eq!(v["outputs"]["score"].as_array().map(Vec::len), Some(3));
    }
}

/// `--floor-url` drives a floor that is already running (a compose service of its own) instead of one
/// inside the load tester, turning the floor on for a scenario that left it off; a floor beyond loopback
/// needs `--allow-remote`, as a target does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn floor_url_on_the_command_line_drives_that_floor() {
    let gw = FakeGateway::start(FakeConfig {
        delay: Duration::from_millis(1),
        ..FakeConfig::default()
    })
    .await;
    let floor = FakeGateway::start(FakeConfig {
        delay: Duration::from_millis(1),
        ..FakeConfig::default()
    })
    .await;
    let dir = temp_dir("bin-floor-url");
    let smoke = crate_path("scenarios/smoke.toml");
    let mut cmd = run_command("1", &gw.url(), &dir, &smoke);
    cmd.args(["--floor-url", &floor.url()]);
    let out = output(cmd).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("smoke.json")).expect("json"))
            .expect("json");
    assert!(floor.predicts() > 0, "the floor at --floor-url was driven");
    assert!(
        v["floor_rps"].as_f64().is_some_and(|r| r > 0.0),
        "{}",
        v["floor_rps"]
    );
    // Not an in-process floor: no thread count of its own.
    assert!(v["floor_threads"].is_null(), "{}", v["floor_threads"]);

    // Beyond loopback only with --allow-remote: refused (exit 2) naming the flag, before any load.
    let mut cmd = run_command("1", &gw.url(), &dir, &smoke);
    cmd.args(["--floor-url", "http://10.255.255.1:9100"]);
    let out = output(cmd).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--floor-url"), "{stderr}");
}

/// `loadtest floor` listens on loopback unless `--allow-remote` (a compose network), and says so.
#[test]
fn the_floor_listens_beyond_loopback_only_when_allowed() {
    let floor = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_loadtest"))
            .args(["floor", "--bind", "0.0.0.0:0", "--for-s", "1"])
            .args(extra)
            .output()
            .expect("run the binary")
    };
    let refused = floor(&[]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--allow-remote"), "{stderr}");
    let served = floor(&["--allow-remote"]);
    let stderr = String::from_utf8_lossy(&served.stderr);
    assert_eq!(served.status.code(), Some(0), "{stderr}");
}
