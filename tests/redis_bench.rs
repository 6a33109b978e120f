//! Latency of the Redis tier, measured by hand (not part of CI):
//!
//! ```text
//! cargo test --release --test redis_bench -- --ignored --nocapture
//! ```
//!
//! One run, one local redis-server, sequential requests (no concurrency, so the numbers are per-request
//! latency, not throughput): a plain Redis GET with fred (the floor for a miss), `POST /v1/features` and
//! predict on the hit path and the miss path, and how long a write through one gateway takes to be served
//! by a second one (the invalidation staleness bound).

mod common;

use std::time::{Duration, Instant};

use common::TestApp;
use common::redis::{RedisServer, gateway, seeded};
use fred::prelude::{Builder, ClientLike, Config as FredConfig, KeysInterface, Value};
use serde_json::{Value as Json, json};

const N: usize = 2000;

struct Sample(Vec<Duration>);

impl Sample {
    fn line(mut self, what: &str) -> String {
        self.0.sort();
        let q = |p: f64| self.0[((self.0.len() as f64 - 1.0) * p).round() as usize];
        format!(
            "{what:<52} n={:<5} p50={:>8.1?} p99={:>8.1?} max={:>8.1?}",
            self.0.len(),
            q(0.5),
            q(0.99),
            q(1.0)
        )
    }
}

async fn time<F, Fut, T>(n: usize, mut f: F) -> Sample
where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = T>,
{
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let t = Instant::now();
        f(i).await;
        out.push(t.elapsed());
    }
    Sample(out)
}

async fn spawn(redis: &RedisServer) -> TestApp {
    gateway(redis, |c| c.telemetry.log_level = "error".into()).await
}

async fn post(app: &TestApp, path: &str, body: &Json) -> Json {
    let r = app.post_json(path, body).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    r.json()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: run by hand with --release --ignored --nocapture"]
async fn redis_tier_latency() {
    let redis = RedisServer::start();
    seeded(&redis).await;
    let a = spawn(&redis).await;
    let b = spawn(&redis).await;
    let mut report = Vec::new();

    // The floor: one GET of one record over a fred client, as hydrant's pool would send it.
    let client = Builder::from_config(FredConfig::from_url(&redis.url()).expect("url"))
        .build()
        .expect("client");
    client.init().await.expect("connect");
    let s = time(N, |i| {
        let client = client.clone();
        async move {
            let _: Value = client
                .get(format!("hy:user_profile:u_{}", i % 1000))
                .await
                .expect("get");
        }
    })
    .await;
    report.push(s.line("redis GET (fred, one key)"));
    let keys: Vec<String> = (0..21).map(|i| format!("hy:item_stats:i_{i}")).collect();
    let s = time(N, |_| {
        let (client, keys) = (client.clone(), keys.clone());
        async move {
            let _: Value = client.mget(keys).await.expect("mget");
        }
    })
    .await;
    report.push(s.line("redis MGET (fred, 21 keys)"));

    let features = |k: usize| json!({"entities": {"user_id": format!("u_{}", k % 1000)}, "features": ["user_profile"], "options": {"timings": false}});
    // Hit path: the key is cached.
    post(&a, "/v1/features", &features(1)).await;
    let hit = features(1);
    let s = time(N, |_| post(&a, "/v1/features", &hit)).await;
    report.push(s.line("POST /v1/features, 1 key, hit"));
    // Miss path: the cache is emptied before each request (in process, not timed), so each one reads Redis.
    let h = a.gateway.hydrator.clone();
    let mut samples = Vec::with_capacity(N);
    for i in 0..N {
        h.invalidate_all();
        let t = Instant::now();
        post(&a, "/v1/features", &features(i)).await;
        samples.push(t.elapsed());
    }
    report.push(Sample(samples).line("POST /v1/features, 1 key, miss (one MGET)"));

    let candidates: Vec<Json> = (0..20)
        .map(|i| json!({"item_id": format!("i_{i}")}))
        .collect();
    let predict = json!({"entities": {"user_id": "u_5"}, "candidates": candidates, "context": {"hour_of_day": 9}, "options": {"timings": false}});
    post(&a, "/v1/models/ctr/predict", &predict).await;
    let s = time(N, |_| post(&a, "/v1/models/ctr/predict", &predict)).await;
    report.push(s.line("POST predict, user + 20 candidates, hit"));
    let mut samples = Vec::with_capacity(N);
    for _ in 0..N {
        h.invalidate_all();
        let t = Instant::now();
        post(&a, "/v1/models/ctr/predict", &predict).await;
        samples.push(t.elapsed());
    }
    report.push(Sample(samples).line("POST predict, user + 20 candidates, miss (one MGET)"));

    // Invalidation: write through `a`, poll `b` (which has the key cached) until it serves the new value.
    let rounds = 200;
    let mut since_start = Vec::with_capacity(rounds);
    let mut since_ack = Vec::with_capacity(rounds);
    for i in 0..rounds {
        let age = 100 + i as i64;
        let ask = json!({"entities": {"user_id": "u_7"}, "features": ["user_profile:age"], "options": {"timings": false}});
        post(&b, "/v1/features", &ask).await;
        let t0 = Instant::now();
        post(
            &a,
            "/v1/views/user_profile/rows",
            &json!({"rows": [{"user_id": "u_7", "age": age}]}),
        )
        .await;
        let t1 = Instant::now();
        loop {
            let j = post(&b, "/v1/features", &ask).await;
            if j["features"]["user_profile:age"]["values"][0] == age {
                break;
            }
            assert!(t0.elapsed() < Duration::from_secs(2), "never invalidated");
        }
        since_start.push(t0.elapsed());
        since_ack.push(t1.elapsed());
    }
    report.push(Sample(since_start).line("write via A -> served by B (from write start)"));
    report.push(Sample(since_ack).line("write via A -> served by B (from A's 200)"));

    eprintln!("\n{}\n", report.join("\n"));
}
