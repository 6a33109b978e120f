//! Open-loop schedule and latency accounting against a server with a known delay.

mod common;

use std::time::Duration;

use common::{FakeConfig, FakeGateway, scenario, temp_dir};
use loadtest::drive::Cancel;
use loadtest::run::{RunOptions, run};

fn opts(name: &str) -> RunOptions {
    RunOptions {
        out_dir: temp_dir(name),
        progress: false,
        ..RunOptions::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_loop_measures_the_known_delay() {
    let gw = FakeGateway::start(FakeConfig {
        delay: Duration::from_millis(20),
        ..FakeConfig::default()
    })
    .await;
    let s = scenario(
        &gw.url(),
        // A 5 ms late threshold rather than 1 ms: what is checked is that a server that keeps up gets its
        // sends on time, not how promptly a busy shared machine wakes the sender.
        "mode = \"open-loop\"\nrate = 100\nduration_s = 3\nlate_threshold_ms = 5",
        "",
    );
    let out = run(s, &opts("known-delay"), Cancel::new())
        .await
        .expect("run");
    let r = &out.result;
    assert_eq!(r.hydrant.errors, 0, "{:?}", r.hydrant.errors_by_kind);
    assert!(
        (19_000..=40_000).contains(&r.hydrant.p50_us.expect("p50")),
        "p50 {:?} us should be about 20 ms",
        r.hydrant.p50_us
    );
    assert!(
        (280..=301).contains(&r.hydrant.requests),
        "3 s at 100 rps sends about 300, sent {}",
        r.hydrant.requests
    );
    assert!(
        (90.0..=101.0).contains(&r.hydrant.achieved_rps.unwrap_or(f64::NAN)),
        "{:?}",
        r.hydrant.achieved_rps
    );
    assert!(
        r.hydrant.late_share.expect("open loop") < 0.2,
        "late share {:?}",
        r.hydrant.late_share
    );
    assert_eq!(r.offered_rps, Some(100.0));
}

/// Bodies that take long to build (here a thousand distinct candidates from a steeply skewed key
/// space) are built before their send is due, so they are neither late nor charged as latency; and a
/// warm-up lasts its whole time, so the measured phase's first send comes one interval after the
/// warm-up's last rather than straight after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_bodies_are_built_ahead_and_a_warm_up_lasts_its_time() {
    let gw = FakeGateway::start(FakeConfig {
        delay: Duration::from_millis(5),
        ..FakeConfig::default()
    })
    .await;
    let text = format!(
        r#"
target = "{}"
model = "ctr"
candidates = 1000
ready_timeout_s = 2

[load]
mode = "open-loop"
rate = 4
duration_s = 2
warm_up_s = 1
late_threshold_ms = 5

[users]
keys = 50

[items]
keys = 1000
zipf = 3.0
"#,
        gw.url()
    );
    let s = loadtest::scenario::Scenario::from_toml_str(&text, "test", "test").expect("scenario");
    let r = run(s, &opts("slow-bodies"), Cancel::new())
        .await
        .expect("run")
        .result;
    assert_eq!(r.hydrant.errors, 0, "{:?}", r.hydrant.errors_by_kind);
    assert_eq!(r.hydrant.requests, 8, "2 s at 4/s");
    // Built at its send time, every body would be late; one late send is the test machine's jitter
    // (7 tests share 2 cores here, and 5 ms is a tight threshold).
    assert!(
        r.hydrant.late_sends.is_some_and(|late| late <= 1),
        "{:?}",
        r.hydrant
    );
    assert!(
        r.hydrant.p99_us.is_some_and(|p| p < 100_000),
        "latency is the server's (5 ms), not the body's building: {:?}",
        r.hydrant
    );
    let span = |measured: bool| {
        r.segments
            .iter()
            .find(|s| s.measured == measured)
            .unwrap_or_else(|| panic!("a segment with measured = {measured}: {:?}", r.segments))
    };
    let (warm, measured) = (span(false), span(true));
    assert!(
        warm.end_s - warm.start_s >= 0.99 && measured.start_s >= warm.start_s + 0.99,
        "a 1 s warm-up: {:?}",
        r.segments
    );
}

/// A server that cannot keep up with the schedule: achieved rps is what it delivered, not the offered
/// rate, though every request is answered in the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn achieved_rps_is_what_a_server_that_falls_behind_delivered() {
    let gw = FakeGateway::start(FakeConfig {
        delay: Duration::from_millis(20),
        serial: true,
        ..FakeConfig::default()
    })
    .await;
    let mut s = scenario(
        &gw.url(),
        "mode = \"open-loop\"\nrate = 100\nduration_s = 2",
        "",
    );
    s.timeout = Duration::from_secs(20);
    let r = run(s, &opts("falls-behind"), Cancel::new())
        .await
        .expect("run")
        .result;
    assert_eq!(r.hydrant.errors, 0, "{:?}", r.hydrant.errors_by_kind);
    assert!(
        r.hydrant.ok >= 190,
        "all answered in the end: {}",
        r.hydrant.ok
    );
    assert!(
        (35.0..=55.0).contains(&r.hydrant.achieved_rps.unwrap_or(f64::NAN)),
        "a server that answers one request per 20 ms delivers at most 50 rps, reported {:?}",
        r.hydrant.achieved_rps
    );
}

/// A server that keeps up however slowly it answers: achieved rps is the offered rate, though the
/// last second's answers arrive after the schedule ends. And a rate whose sends do not fill the
/// duration evenly (1 s at 2.5/s sends at 0, 0.4 and 0.8 s) is not reported as 3 per second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn achieved_rps_of_a_slow_server_that_keeps_up_is_the_offered_rate() {
    let gw = FakeGateway::start(FakeConfig {
        delay: Duration::from_millis(400),
        ..FakeConfig::default()
    })
    .await;
    for (rate, duration, low, high) in [("50", 2, 45.0, 51.0), ("2.5", 1, 2.3, 2.7)] {
        let s = scenario(
            &gw.url(),
            &format!("mode = \"open-loop\"\nrate = {rate}\nduration_s = {duration}"),
            "",
        );
        let r = run(s, &opts("slow-keeps-up"), Cancel::new())
            .await
            .expect("run")
            .result;
        assert_eq!(r.hydrant.errors, 0, "{:?}", r.hydrant.errors_by_kind);
        assert!(
            (low..=high).contains(&r.hydrant.achieved_rps.unwrap_or(f64::NAN)),
            "{rate}/s for {duration} s to a server that answers in 400 ms: reported {:?}",
            r.hydrant.achieved_rps
        );
    }
}

/// The coordinated-omission check: a 500 ms stall shows in the open-loop p99 because every request
/// scheduled during it is charged from its intended send time, while a closed-loop client (which
/// simply stops sending while it waits) records the stall once and its p99 hides it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stall_shows_in_open_loop_p99_but_not_in_closed_loop() {
    let stall = FakeConfig {
        delay: Duration::from_millis(20),
        stall: Some((Duration::from_millis(1400), Duration::from_millis(500))),
        ..FakeConfig::default()
    };

    let gw = FakeGateway::start(stall.clone()).await;
    let s = scenario(
        &gw.url(),
        "mode = \"open-loop\"\nrate = 100\nduration_s = 4",
        "",
    );
    let open = run(s, &opts("stall-open"), Cancel::new())
        .await
        .expect("open-loop run")
        .result;
    assert_eq!(open.hydrant.errors, 0, "{:?}", open.hydrant.errors_by_kind);
    assert!(
        open.hydrant.p99_us >= Some(400_000),
        "open-loop p99 {:?} us must reflect the 500 ms stall",
        open.hydrant.p99_us
    );
    assert!(
        open.hydrant.max_us >= Some(450_000),
        "max {:?}",
        open.hydrant.max_us
    );
    assert!(
        open.hydrant.p50_us.expect("p50") < 40_000,
        "p50 {:?}",
        open.hydrant.p50_us
    );
    // The timeline puts the stall where it happened (1.4 s to 1.9 s: second 1), not elsewhere.
    let worst = open
        .timeline
        .iter()
        .max_by_key(|p| p.max_us)
        .expect("timeline");
    assert_eq!(
        worst.t_s, 1.0,
        "stall should be in second 1: {:?}",
        open.timeline
    );
    drop(gw);

    let gw = FakeGateway::start(stall).await;
    let s = scenario(
        &gw.url(),
        "mode = \"closed-loop\"\nconcurrency = [1]\nduration_s = 4",
        "",
    );
    let closed = run(s, &opts("stall-closed"), Cancel::new())
        .await
        .expect("closed-loop run")
        .result;
    assert!(
        closed.hydrant.late_sends.is_none() && closed.hydrant.late_share.is_none(),
        "a closed loop has no schedule to be late for"
    );
    assert!(
        closed.hydrant.max_us >= Some(450_000),
        "the closed loop saw the stall once"
    );
    assert!(
        closed.hydrant.p99_us.expect("p99") < 100_000,
        "closed-loop p99 {:?} us hides the stall (that is the point of the comparison)",
        closed.hydrant.p99_us
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sends_over_the_in_flight_cap_count_as_overload() {
    let gw = FakeGateway::start(FakeConfig {
        delay: Duration::from_millis(200),
        ..FakeConfig::default()
    })
    .await;
    // 100 rps x 200 ms needs ~20 in flight; a cap of 5 must refuse most sends, visibly.
    let s = scenario(
        &gw.url(),
        "mode = \"open-loop\"\nrate = 100\nduration_s = 1\nmax_in_flight = 5",
        "",
    );
    let r = run(s, &opts("overload"), Cancel::new())
        .await
        .expect("run")
        .result;
    let overload = r
        .hydrant
        .errors_by_kind
        .get("overload")
        .copied()
        .unwrap_or(0);
    assert!(
        overload >= 50,
        "expected refused sends, got {:?}",
        r.hydrant.errors_by_kind
    );
    assert_eq!(r.hydrant.ok + r.hydrant.errors, r.hydrant.requests);
    assert!(
        r.hydrant.late_sends.expect("open loop") >= overload,
        "refused sends never went out on time: late {:?} vs refused {overload}",
        r.hydrant.late_sends
    );
    assert!(
        r.hydrant.ok >= 20,
        "the 5 slots keep working: ok {}",
        r.hydrant.ok
    );
}

/// Requests given up at the timeout are in the percentiles at the time they were given up: with most of
/// them timing out, the p50 cannot read below the timeout, and the run says how many failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeouts_count_in_the_percentiles_and_are_warned_about() {
    let gw = FakeGateway::start(FakeConfig {
        delay: Duration::from_millis(300),
        ..FakeConfig::default()
    })
    .await;
    let mut s = scenario(
        &gw.url(),
        "mode = \"open-loop\"\nrate = 50\nduration_s = 1",
        "",
    );
    s.timeout = Duration::from_millis(100);
    let r = run(s, &opts("timeouts"), Cancel::new())
        .await
        .expect("run")
        .result;
    let timeouts = r
        .hydrant
        .errors_by_kind
        .get("timeout")
        .copied()
        .unwrap_or(0);
    assert!(
        timeouts * 10 >= r.hydrant.requests * 9,
        "{:?}",
        r.hydrant.errors_by_kind
    );
    let p50 = r.hydrant.p50_us.expect("timeouts make a p50");
    assert!(
        (100_000..300_000).contains(&p50),
        "p50 {p50} us: at least the 100 ms timeout"
    );
    assert!(
        r.warnings
            .iter()
            .any(|w| w.contains("requests failed") && w.contains("timeout")),
        "{:?}",
        r.warnings
    );
}
