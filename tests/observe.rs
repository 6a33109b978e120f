//! What ops see after real traffic: Prometheus metric names and values, `/v1/stats`, request ids.

mod common;

use common::TestApp;
use serde_json::json;

/// The value of one sample line `name{labels} value` in Prometheus text.
fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| {
            l.strip_prefix(series)
                .and_then(|rest| rest.strip_prefix(' '))
        })
        .unwrap_or_else(|| panic!("no sample {series} in:\n{text}"))
        .parse()
        .expect("a number")
}

#[tokio::test]
async fn metrics_count_the_traffic_that_was_sent() {
    let app = TestApp::spawn().await;
    let body = json!({"entities": {"user_id": "u_1"}, "candidates": [{"item_id": "i_1"}, {"item_id": "i_2"}]});
    // The last names the model percent-encoded: served as `ctr`, and counted as `ctr`.
    for model in ["ctr", "ctr", "ctr", "ctr", "c%74r"] {
        assert_eq!(app.predict(model, &body).await.status, 200);
    }
    assert_eq!(
        app.predict("ctr", &json!({"candidates": []})).await.status,
        400
    );
    let r = app.get("/metrics").await;
    assert_eq!(r.status, 200);
    assert!(
        r.headers["content-type"]
            .to_str()
            .expect("ascii")
            .starts_with("text/plain")
    );
    let m = String::from_utf8(r.body).expect("utf8");
    // 5 requests x 3 keys: the first request misses all 3, the other four hit.
    assert_eq!(
        sample(
            &m,
            "hydrant_cache_lookups_total{view=\"user_profile\",outcome=\"miss\"}"
        ),
        1.0
    );
    assert_eq!(
        sample(
            &m,
            "hydrant_cache_lookups_total{view=\"user_profile\",outcome=\"hit\"}"
        ),
        4.0
    );
    assert_eq!(
        sample(
            &m,
            "hydrant_cache_lookups_total{view=\"item_stats\",outcome=\"hit\"}"
        ),
        8.0
    );
    assert_eq!(
        sample(&m, "hydrant_cache_entries{view=\"item_stats\"}"),
        2.0
    );
    assert!(sample(&m, "hydrant_cache_bytes{view=\"item_stats\"}") > 100.0);
    for stage in [
        "decode",
        "hydrate",
        "assemble",
        "queue",
        "infer",
        "postprocess",
        "encode",
    ] {
        assert_eq!(
            sample(
                &m,
                &format!("hydrant_stage_duration_seconds_count{{model=\"ctr\",stage=\"{stage}\"}}")
            ),
            5.0,
            "{stage}"
        );
    }
    assert_eq!(
        sample(
            &m,
            "hydrant_request_duration_seconds_count{route=\"/v1/models/{model}/predict\",model=\"ctr\",status=\"200\"}"
        ),
        5.0
    );
    assert_eq!(
        sample(
            &m,
            "hydrant_request_duration_seconds_count{route=\"/v1/models/{model}/predict\",model=\"ctr\",status=\"400\"}"
        ),
        1.0
    );
    assert_eq!(sample(&m, "hydrant_batch_rows_sum{model=\"ctr\"}"), 10.0);
    // The first request's 3 misses went to the store in one round trip.
    assert_eq!(
        sample(
            &m,
            "hydrant_store_round_trips_total{backend=\"embedded\",op=\"read\",outcome=\"ok\"}"
        ),
        1.0
    );
    assert_eq!(
        sample(
            &m,
            "hydrant_store_keys_total{backend=\"embedded\",op=\"read\"}"
        ),
        3.0
    );
    assert_eq!(
        sample(
            &m,
            "hydrant_store_duration_seconds_count{backend=\"embedded\",op=\"read\"}"
        ),
        1.0
    );
    for name in [
        "hydrant_refresh_total",
        "hydrant_prefetch_total",
        "hydrant_invalidations_total",
    ] {
        assert!(
            m.contains(&format!("# TYPE {name} counter")),
            "{name} declared"
        );
    }
    assert_eq!(sample(&m, "hydrant_queue_depth{model=\"ctr\"}"), 0.0);
    assert_eq!(
        sample(
            &m,
            "hydrant_shed_total{model=\"ctr\",reason=\"queue_full\"}"
        ),
        0.0
    );
    // Bucket counts are cumulative and end at the count.
    let inf = sample(
        &m,
        "hydrant_stage_duration_seconds_bucket{model=\"ctr\",stage=\"infer\",le=\"+Inf\"}",
    );
    let ten_s = sample(
        &m,
        "hydrant_stage_duration_seconds_bucket{model=\"ctr\",stage=\"infer\",le=\"10\"}",
    );
    assert_eq!((inf, ten_s), (5.0, 5.0));
    for name in [
        "hydrant_degraded_total",
        "hydrant_shed_total",
        "hydrant_batch_rows",
        "hydrant_batch_reruns_total",
        "hydrant_cache_bytes",
        "hydrant_cache_evictions_total",
    ] {
        assert!(m.contains(&format!("# TYPE {name} ")), "{name} declared");
    }
}

#[tokio::test]
async fn stats_report_stage_percentiles_beside_hit_rates() {
    let app = TestApp::spawn().await;
    // Before any lookup, every registered view is listed, with zeros.
    let s = app.get("/v1/stats").await.json();
    for view in ["user_profile", "item_stats"] {
        let v = &s["views"][view];
        assert_eq!(
            (&v["hits"], &v["misses"], &v["entries"]),
            (&json!(0), &json!(0), &json!(0)),
            "{view}: {s}"
        );
    }
    let m = String::from_utf8(app.get("/metrics").await.body).expect("utf8");
    assert_eq!(
        sample(
            &m,
            "hydrant_cache_lookups_total{view=\"item_stats\",outcome=\"hit\"}"
        ),
        0.0
    );
    for i in 0..20 {
        let body = json!({"entities": {"user_id": format!("u_{}", i % 4)}, "candidates": [{"item_id": "i_1"}]});
        assert_eq!(app.predict("ctr", &body).await.status, 200);
    }
    // A caller's mistake is a rejection, not an error of the model.
    let r = app
        .predict("ctr", &json!({"candidates": [{"item_id": "i_1"}]}))
        .await;
    assert_eq!(r.status, 400);
    // So is a wrong method on the model's route, answered by the router rather than the handler.
    assert_eq!(app.get("/v1/models/ctr/predict").await.status, 405);
    // The model's metadata routes are not its requests: nothing there counts, a 405 neither.
    let r = app
        .post("/v2/models/ctr", "application/json", b"{}".to_vec())
        .await;
    assert_eq!(r.status, 405);
    let s = app.get("/v1/stats").await.json();
    let m = &s["models"]["ctr"];
    assert_eq!(m["requests"], 20);
    assert_eq!(m["errors"], 0);
    assert_eq!(m["rejected"], 2);
    assert_eq!(m["error_rate"], 0.0);
    assert_eq!(m["rows"], 20);
    assert!(m["rps"].as_f64().expect("rps") > 0.0);
    for stage in [
        "decode",
        "hydrate",
        "assemble",
        "queue",
        "infer",
        "postprocess",
        "encode",
        "total",
    ] {
        let st = &m["stages"][stage];
        let (p50, p99) = (
            st["p50_us"].as_u64().expect("p50"),
            st["p99_us"].as_u64().expect("p99"),
        );
        assert!(p50 <= p99, "{stage}: {st}");
    }
    assert!(m["stages"]["total"]["p50_us"].as_u64().expect("p50") > 0);
    // Users: 4 misses then 16 hits; the item: 1 miss then 19 hits.
    let u = &s["views"]["user_profile"];
    assert_eq!(
        (u["hits"].as_u64(), u["misses"].as_u64()),
        (Some(16), Some(4))
    );
    assert!((u["hit_rate"].as_f64().expect("rate") - 0.8).abs() < 1e-9);
    assert_eq!(s["views"]["item_stats"]["hits"], 19);
    // In its first minute the window holds the time since start-up, as the model's own does.
    let (window, uptime) = (
        s["window_s"].as_f64().expect("window_s"),
        s["uptime_s"].as_f64().expect("uptime_s"),
    );
    assert!(
        window > 0.0 && window <= uptime + 0.1 && window < 60.0,
        "{s}"
    );
    // The one model's window is the gateway's.
    assert_eq!(m["window_s"], s["window_s"], "{s}");
    assert_eq!(s["store"], "embedded");
    assert_eq!(
        s["stores"]["embedded"]["reads"], 4,
        "one round trip per request with misses: 4 users, the item riding with the first"
    );
    let st = &s["stores"]["embedded"];
    assert_eq!(
        (&st["read_keys"], &st["write_keys"]),
        (&json!(5), &json!(0)),
        "{st}"
    );
}

#[tokio::test]
async fn request_ids_are_echoed_or_generated() {
    let app = TestApp::spawn().await;
    let body = serde_json::to_vec(&json!({"entities": {"user_id": "u_1"}})).expect("json");
    let r = app
        .post_with(
            "/v1/models/ctr/predict",
            &[
                ("content-type", "application/json"),
                ("x-request-id", "abc-123"),
            ],
            body.clone(),
        )
        .await;
    assert_eq!(r.headers["x-request-id"], "abc-123");
    let r = app
        .post("/v1/models/ctr/predict", "application/json", body)
        .await;
    let id = r.headers["x-request-id"]
        .to_str()
        .expect("ascii")
        .to_owned();
    assert!(id.starts_with("hy-"), "{id}");
}
