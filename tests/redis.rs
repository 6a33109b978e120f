//! The gateway on Redis: each test starts its own `redis-server` on a free port and real gateways on port 0
//! over it. Cache policies are checked with the gateway's clock moved forward (no sleeping through TTLs),
//! round trips are counted with Redis's own `INFO commandstats`, and faults are real: the server is stopped,
//! restarted, frozen (SIGSTOP) or kept busy (`DEBUG SLEEP`).

mod common;

use std::io::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::time::{Duration, Instant};

use common::redis::{RedisServer, Reply, Sentinel, config_for, gateway, gateway_over, seeded};
use common::{TestApp, demo_rows, load_demo_rows};
use hydrant::app::open_store;
use hydrant::hydrate::Status;
use hydrant::store::{BoxFuture, HotCounts, InvalidationSink, Store, StoreError, Writes};
use hydrant::value::{Record, Value, now_ms};
use serde_json::{Value as Json, json};

// ------------------------------------------------------------------------------------------------------
// Helpers

/// `POST /v1/features` for `keys` of the view keyed by `entity`.
async fn features(
    app: &TestApp,
    entity: &str,
    keys: &[&str],
    names: &[&str],
    deadline_ms: Option<u64>,
) -> Json {
    let mut body = json!({"entities": {entity: keys}, "features": names});
    if let Some(ms) = deadline_ms {
        body["options"] = json!({"deadline_ms": ms});
    }
    let r = app.post_json("/v1/features", &body).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    r.json()
}

/// The ages and statuses of `users`, read through `/v1/features`.
async fn ages(app: &TestApp, users: &[&str]) -> (Vec<i64>, Vec<String>, Json) {
    let j = features(app, "user_id", users, &["user_profile:age"], None).await;
    let col = &j["features"]["user_profile:age"];
    let values = col["values"]
        .as_array()
        .expect("values")
        .iter()
        .map(|v| v.as_i64().expect("int"))
        .collect();
    let statuses = col["statuses"]
        .as_array()
        .expect("statuses")
        .iter()
        .map(|v| v.as_str().expect("str").to_owned())
        .collect();
    (values, statuses, j)
}

/// A user_profile record as the loader writes it.
fn user_record(age: i64, event_ts_ms: i64) -> Vec<u8> {
    Record {
        schema_version: 1,
        event_ts_ms,
        values: vec![
            Value::Int(age),
            Value::Str("de".into()),
            Value::Bool(true),
            Value::Float(12.5),
            Value::List(vec![0.5, -0.5, 0.25, 1.0].into_boxed_slice()),
        ],
        layout: common::registry().views["user_profile"].layout,
    }
    .encode()
}

fn item_record(price: f64, event_ts_ms: i64) -> Vec<u8> {
    Record {
        schema_version: 1,
        event_ts_ms,
        values: vec![
            Value::Str("tech".into()),
            Value::Str("brand_1".into()),
            Value::Float(price),
            Value::Float(0.05),
            Value::Int(100),
            Value::List(vec![0.0, 0.1, 0.2, 0.3].into_boxed_slice()),
        ],
        layout: common::registry().views["item_stats"].layout,
    }
    .encode()
}

/// Writes straight into Redis, around hydrant: no invalidation is sent, as with a writer that bypasses it.
fn put_raw(redis: &RedisServer, key: &str, value: &[u8]) {
    assert_eq!(
        redis.cmd_bytes(&[b"SET", key.as_bytes(), value]),
        Reply::Status("OK".into())
    );
}

const DAY: Duration = Duration::from_secs(86_400);

/// Polls `check` every 5 ms until it holds or `limit` passes; returns how long it took.
async fn eventually<F, Fut>(limit: Duration, what: &str, mut check: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    loop {
        if check().await {
            return start.elapsed();
        }
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A store in front of another that counts reads and can make them, or the hot-key read, slow.
struct Slowed {
    inner: Arc<dyn Store>,
    read_delay: Duration,
    hottest_delay: Duration,
    reads: AtomicUsize,
}

impl Slowed {
    fn new(inner: Arc<dyn Store>, read_delay: Duration, hottest_delay: Duration) -> Arc<Self> {
        Arc::new(Self {
            inner,
            read_delay,
            hottest_delay,
            reads: AtomicUsize::new(0),
        })
    }
}

impl Store for Slowed {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    fn keeps_hot_keys(&self) -> bool {
        self.inner.keeps_hot_keys()
    }
    fn shared(&self) -> bool {
        self.inner.shared()
    }
    fn get_many<'a>(
        &'a self,
        keys: &'a [String],
    ) -> BoxFuture<'a, Result<Vec<Option<Vec<u8>>>, StoreError>> {
        Box::pin(async move {
            self.reads.fetch_add(1, Relaxed);
            tokio::time::sleep(self.read_delay).await;
            self.inner.get_many(keys).await
        })
    }
    fn put_many(
        &self,
        writes: Writes,
        ttl: Option<Duration>,
    ) -> BoxFuture<'_, Result<(), StoreError>> {
        self.inner.put_many(writes, ttl)
    }
    fn background_announcements(&self) -> (u64, u64) {
        self.inner.background_announcements()
    }
    fn publish_invalidations<'a>(
        &'a self,
        keys: &'a [String],
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        self.inner.publish_invalidations(keys)
    }
    fn subscribe_invalidations(
        &self,
        sink: InvalidationSink,
    ) -> BoxFuture<'_, Result<(), StoreError>> {
        self.inner.subscribe_invalidations(sink)
    }
    fn record_hot<'a>(
        &'a self,
        counts: &'a [HotCounts],
        keep: usize,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        self.inner.record_hot(counts, keep)
    }
    fn hottest<'a>(
        &'a self,
        view: &'a str,
        k: usize,
    ) -> BoxFuture<'a, Result<Vec<String>, StoreError>> {
        Box::pin(async move {
            tokio::time::sleep(self.hottest_delay).await;
            self.inner.hottest(view, k).await
        })
    }
}

// ------------------------------------------------------------------------------------------------------
// Reads

#[tokio::test]
async fn features_read_from_redis_equal_the_rows_loaded() {
    let redis = RedisServer::start();
    seeded(&redis).await;
    let app = gateway(&redis, |_| {}).await;
    let users = demo_rows("user_profile", "user_id");
    let items = demo_rows("item_stats", "item_id");
    let keys = ["u_0", "u_1", "u_999", "u_nobody"];
    let j = features(&app, "user_id", &keys, &["user_profile"], None).await;
    for f in [
        "age",
        "country",
        "is_premium",
        "avg_session_minutes",
        "embedding",
    ] {
        let col = &j["features"][format!("user_profile:{f}")];
        for (i, k) in keys[..3].iter().enumerate() {
            let want = &users[*k][f];
            let got = &col["values"][i];
            match (want.as_f64(), got.as_f64()) {
                (Some(w), Some(g)) => assert!((w - g).abs() < 1e-5, "{k}.{f}: {got} != {want}"),
                _ if want.is_array() => {
                    for (a, b) in want
                        .as_array()
                        .expect("list")
                        .iter()
                        .zip(got.as_array().expect("list"))
                    {
                        assert!(
                            (a.as_f64().expect("f") - b.as_f64().expect("f")).abs() < 1e-6,
                            "{k}.{f}"
                        );
                    }
                }
                _ if want.is_null() => assert_eq!(col["statuses"][i], "NULL_VALUE", "{k}.{f}"),
                _ => assert_eq!(got, want, "{k}.{f}"),
            }
        }
        assert_eq!(col["statuses"][3], "NOT_FOUND");
    }
    let j = features(
        &app,
        "item_id",
        &["i_7"],
        &["item_stats:price", "item_stats:category"],
        None,
    )
    .await;
    assert_eq!(
        j["features"]["item_stats:category"]["values"][0],
        items["i_7"]["category"]
    );
    let price = j["features"]["item_stats:price"]["values"][0]
        .as_f64()
        .expect("price");
    assert!((price - items["i_7"]["price"].as_f64().expect("price")).abs() < 1e-9);
    assert_eq!(j["degraded"], false);
}

#[tokio::test]
async fn all_misses_of_a_request_cost_one_round_trip() {
    let redis = RedisServer::start();
    seeded(&redis).await;
    let app = gateway(&redis, |c| c.prefetch.hot_sample_every = 0).await;
    redis.reset_stats();
    let candidates: Vec<Json> = (0..200)
        .map(|i| json!({"item_id": format!("i_{i}")}))
        .collect();
    let body = json!({"entities": {"user_id": "u_3"}, "candidates": candidates, "context": {"hour_of_day": 9}});
    let r = app.predict("ctr", &body).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let j = r.json();
    assert_eq!(j["cache"], json!({"hits": 0, "stale": 0, "misses": 201}));
    assert_eq!(j["degraded"], false);
    assert_eq!(
        redis.calls("mget"),
        1,
        "one MGET for the user and 200 items"
    );
    assert_eq!(redis.calls("get"), 0);
    // The same request again is served from the cache: no round trip at all.
    let j = app.predict("ctr", &body).await.json();
    assert_eq!(j["cache"], json!({"hits": 201, "stale": 0, "misses": 0}));
    assert_eq!(redis.calls("mget"), 1);
    let stats = app.gateway.telemetry.store("redis");
    assert_eq!(stats.reads.outcomes.ok.load(Relaxed), 1);
    assert_eq!(stats.reads.keys.load(Relaxed), 201);
}

#[tokio::test]
async fn concurrent_misses_of_one_key_share_one_store_read() {
    let redis = RedisServer::start();
    seeded(&redis).await;
    // The read is slowed by 20 ms so that the misses pile up behind it; bounds far above that keep a
    // loaded test machine from turning the shared read into a timeout, which is not what is tested.
    let schemas = common::schemas_with_edit("user_profile.yaml", "timeout: 50ms", "timeout: 5s");
    let mut c = config_for(&redis);
    c.registry.schemas = schemas.path().to_owned();
    c.store.redis.command_timeout = Duration::from_secs(5);
    let inner = open_store(&c).await.expect("store");
    let slowed = Slowed::new(inner, Duration::from_millis(20), Duration::ZERO);
    let app = gateway_over(c, slowed.clone()).await;
    redis.reset_stats();
    let view = app.gateway.registry().views["user_profile"].clone();
    let keys = vec!["u_42".to_owned()];
    let h = app.gateway.hydrator.clone();
    let deadline = Instant::now() + Duration::from_secs(1);
    let runs = (0..50).map(|_| {
        let (h, view, keys) = (h.clone(), view.clone(), keys.clone());
        async move { h.hydrate(&[(&view, &keys)], deadline).await }
    });
    let results = futures::future::join_all(runs).await;
    assert_eq!(
        slowed.reads.load(Relaxed),
        1,
        "50 concurrent misses, one read"
    );
    assert_eq!(redis.calls("mget"), 1);
    let want = demo_rows("user_profile", "user_id")["u_42"]["age"]
        .as_i64()
        .expect("age");
    for r in results {
        let resolved = &r.views[0][0];
        assert_eq!(resolved.status, Status::Present);
        assert_eq!(
            resolved.found().expect("found").values.get(0).to_value(),
            Value::Int(want)
        );
    }
}

// ------------------------------------------------------------------------------------------------------
// Cache policies, with the gateway's clock moved instead of waiting

#[tokio::test]
async fn a_fresh_value_is_a_hit_then_served_stale_while_refreshed_then_refetched_after_ttl() {
    let redis = RedisServer::start();
    let app = gateway(&redis, |_| {}).await;
    let ts = now_ms();
    put_raw(&redis, "hy:user_profile:u_r", &user_record(40, ts));
    let (v, s, j) = ages(&app, &["u_r"]).await;
    assert_eq!((v, s), (vec![40], vec!["PRESENT".to_owned()]));
    assert_eq!(j["cache"]["misses"], 1);

    // Changed around hydrant: the cached value is fresh (younger than refresh_after = 2m), so it is served.
    put_raw(&redis, "hy:user_profile:u_r", &user_record(41, ts));
    let (v, _, j) = ages(&app, &["u_r"]).await;
    assert_eq!(v, vec![40]);
    assert_eq!(j["cache"]["hits"], 1);

    // Past refresh_after: the old value is served at once and refreshed in the background.
    app.clock.advance(Duration::from_secs(121));
    let (v, s, j) = ages(&app, &["u_r"]).await;
    assert_eq!((v, s), (vec![40], vec!["PRESENT".to_owned()]));
    assert_eq!(j["cache"]["stale"], 1);
    eventually(Duration::from_secs(2), "the refreshed value", || async {
        let (v, _, j) = ages(&app, &["u_r"]).await;
        v == vec![41] && j["cache"]["hits"] == 1
    })
    .await;
    let stats = app.gateway.telemetry.view("user_profile");
    assert_eq!(stats.refresh.ok.load(Relaxed), 1);

    // Past ttl (10m) the value is fetched again before answering (a miss).
    put_raw(&redis, "hy:user_profile:u_r", &user_record(42, ts));
    app.clock.advance(Duration::from_secs(601));
    let (v, s, j) = ages(&app, &["u_r"]).await;
    assert_eq!((v, s), (vec![42], vec!["PRESENT".to_owned()]));
    assert_eq!(j["cache"]["misses"], 1);
}

#[tokio::test]
async fn not_found_is_cached_for_negative_ttl() {
    let redis = RedisServer::start();
    let app = gateway(&redis, |_| {}).await;
    let (v, s, j) = ages(&app, &["u_new"]).await;
    assert_eq!((v, s), (vec![30], vec!["NOT_FOUND".to_owned()]));
    assert_eq!(j["cache"]["misses"], 1);
    put_raw(&redis, "hy:user_profile:u_new", &user_record(55, now_ms()));
    let (v, s, j) = ages(&app, &["u_new"]).await;
    assert_eq!(
        (v, s),
        (vec![30], vec!["NOT_FOUND".to_owned()]),
        "negative entry still fresh"
    );
    assert_eq!(j["cache"]["hits"], 1);
    assert_eq!(
        app.gateway
            .telemetry
            .view("user_profile")
            .negative
            .load(Relaxed),
        1
    );
    // negative_ttl is 30s.
    app.clock.advance(Duration::from_secs(31));
    let (v, s, j) = ages(&app, &["u_new"]).await;
    assert_eq!((v, s), (vec![55], vec!["PRESENT".to_owned()]));
    assert_eq!(j["cache"]["misses"], 1);
}

#[tokio::test]
async fn entries_past_their_keep_time_leave_the_cache_with_no_traffic() {
    let redis = RedisServer::start();
    let app = gateway(&redis, |_| {}).await;
    put_raw(&redis, "hy:user_profile:u_kept", &user_record(41, now_ms()));
    let (_, s, _) = ages(&app, &["u_kept", "u_absent"]).await;
    assert_eq!(s, ["PRESENT", "NOT_FOUND"]);
    let entries = |s: &Json| s["views"]["user_profile"]["entries"].clone();
    assert_eq!(entries(&app.get("/v1/stats").await.json()), 2);
    // negative_ttl is 30s; the found entry is kept for ttl + max_staleness (1h10m). The server's
    // upkeep, about once a second, removes the negative one without any request touching the cache.
    app.clock.advance(Duration::from_secs(31));
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let s = app.get("/v1/stats").await.json();
        if entries(&s) == 1 {
            break;
        }
        assert!(
            Instant::now() < until,
            "the negative entry was never removed: {}",
            s["views"]["user_profile"]
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The kept entry is still served from the cache.
    let (v, s, j) = ages(&app, &["u_kept"]).await;
    assert_eq!((v, s), (vec![41], vec!["PRESENT".to_owned()]));
    assert_eq!(j["cache"]["hits"], 1);
}

#[tokio::test]
async fn values_older_than_max_age_are_served_as_defaults() {
    let redis = RedisServer::start();
    let app = gateway(&redis, |_| {}).await;
    // item_stats: max_age 30d.
    let now = now_ms();
    put_raw(
        &redis,
        "hy:item_stats:i_young",
        &item_record(99.0, now - 29 * DAY.as_millis() as i64),
    );
    put_raw(
        &redis,
        "hy:item_stats:i_old",
        &item_record(99.0, now - 31 * DAY.as_millis() as i64),
    );
    let price = |j: &Json, i: usize| {
        (
            j["features"]["item_stats:price"]["values"][i]
                .as_f64()
                .expect("price"),
            j["features"]["item_stats:price"]["statuses"][i]
                .as_str()
                .expect("status")
                .to_owned(),
        )
    };
    let j = features(
        &app,
        "item_id",
        &["i_young", "i_old"],
        &["item_stats:price"],
        None,
    )
    .await;
    assert_eq!(price(&j, 0), (99.0, "PRESENT".to_owned()));
    assert_eq!(
        price(&j, 1),
        (20.0, "OUTSIDE_MAX_AGE".to_owned()),
        "the default price"
    );
    // Two days later the young record is 31 days old too.
    app.clock.advance(2 * DAY);
    let j = features(&app, "item_id", &["i_young"], &["item_stats:price"], None).await;
    assert_eq!(price(&j, 0), (20.0, "OUTSIDE_MAX_AGE".to_owned()));
}

#[tokio::test]
async fn with_redis_down_cached_values_are_served_stale_up_to_max_staleness_then_defaults() {
    let mut redis = RedisServer::start();
    seeded(&redis).await;
    let app = gateway(&redis, |_| {}).await;
    let want = demo_rows("user_profile", "user_id")["u_1"]["age"]
        .as_i64()
        .expect("age");
    let (v, _, _) = ages(&app, &["u_1"]).await;
    assert_eq!(v, vec![want]);
    redis.stop();

    // Past ttl (10m), within ttl + max_staleness (1h): the cached value, flagged.
    app.clock.advance(Duration::from_secs(11 * 60));
    let (v, s, j) = ages(&app, &["u_1", "u_2"]).await;
    assert_eq!(v, vec![want, 30]);
    assert_eq!(s, vec!["STALE".to_owned(), "DEFAULTED".to_owned()]);
    assert_eq!(j["degraded"], true);
    // Feast's read has no such statuses: the stale value is PRESENT, the one with nothing to serve is
    // INVALID and null (Feast has no defaults), and a header says the answer is degraded.
    let r = app
        .post_json(
            "/get-online-features",
            &json!({"features": ["user_profile:age"], "entities": {"user_id": ["u_1", "u_2"]}}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.headers["x-hydrant-degraded"], "true");
    let feast = r.json();
    assert_eq!(feast["results"][1]["values"], json!([want, null]));
    assert_eq!(
        feast["results"][1]["statuses"],
        json!(["PRESENT", "INVALID"])
    );

    // Past ttl + max_staleness: nothing usable is cached any more.
    app.clock.advance(Duration::from_secs(60 * 60));
    let (v, s, j) = ages(&app, &["u_1"]).await;
    assert_eq!((v, s), (vec![30], vec!["DEFAULTED".to_owned()]));
    assert_eq!(j["degraded"], true);
    let stats = app.gateway.telemetry.view("user_profile");
    assert!(stats.degraded_error.load(Relaxed) + stats.degraded_timeout.load(Relaxed) >= 3);

    // Redis back (empty: it keeps nothing on disk): the next miss reads it again, no restart needed.
    redis.restart();
    put_raw(&redis, "hy:user_profile:u_1", &user_record(61, now_ms()));
    eventually(
        Duration::from_secs(5),
        "u_1 read from the restarted Redis",
        || async { ages(&app, &["u_1"]).await.0 == vec![61] },
    )
    .await;
}

// ------------------------------------------------------------------------------------------------------
// Faults

#[tokio::test]
async fn requests_keep_succeeding_within_their_deadline_while_redis_is_stopped_and_restarted() {
    let mut redis = RedisServer::start();
    seeded(&redis).await;
    let app = Arc::new(gateway(&redis, |_| {}).await);
    // Each request asks for one key cached before the outage and one never asked for before.
    let keys: Vec<String> = (0..10).map(|i| format!("u_{i}")).collect();
    let cached: Vec<&str> = keys.iter().map(String::as_str).collect();
    ages(&app, &cached).await;

    let deadline_ms = 50;
    let traffic = {
        let app = app.clone();
        let keys = keys.clone();
        tokio::spawn(async move {
            let mut worst = Duration::ZERO;
            let mut degraded = 0;
            let mut n = 0;
            let stop_at = Instant::now() + Duration::from_millis(1500);
            while Instant::now() < stop_at {
                let fresh = format!("u_{}", 100 + n % 900);
                let k = [keys[n % keys.len()].as_str(), fresh.as_str()];
                let started = Instant::now();
                let j = features(
                    &app,
                    "user_id",
                    &k,
                    &["user_profile:age"],
                    Some(deadline_ms),
                )
                .await;
                worst = worst.max(started.elapsed());
                degraded += usize::from(j["degraded"] == true);
                n += 1;
            }
            (n, degraded, worst)
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    redis.stop();
    tokio::time::sleep(Duration::from_millis(700)).await;
    redis.restart();
    let (n, degraded, worst) = traffic.await.expect("traffic task");
    assert!(n > 20, "only {n} requests");
    assert!(
        degraded > 0,
        "some answers were degraded while Redis was down"
    );
    assert!(
        worst < Duration::from_millis(deadline_ms + 450),
        "a request took {worst:?} with a {deadline_ms} ms deadline"
    );
    // Back: a key never cached is read from Redis again (the restarted server is empty: write it).
    put_raw(&redis, "hy:user_profile:u_back", &user_record(70, now_ms()));
    eventually(
        Duration::from_secs(5),
        "a miss served from Redis after the restart",
        || async { ages(&app, &["u_back"]).await.0 == vec![70] },
    )
    .await;
    // The invalidation subscription reconnected and flushed the cache (messages may have been lost).
    eventually(
        Duration::from_secs(5),
        "a flush after the subscriber reconnected",
        || async { flushes(&app) >= 1 },
    )
    .await;
}

#[tokio::test]
async fn a_frozen_or_busy_redis_does_not_hold_a_request_past_its_deadline() {
    let redis = RedisServer::start();
    seeded(&redis).await;
    let app = gateway(&redis, |_| {}).await;
    let want = demo_rows("user_profile", "user_id")["u_1"]["age"]
        .as_i64()
        .expect("age");
    ages(&app, &["u_1"]).await;
    app.clock.advance(Duration::from_secs(11 * 60)); // u_1 expired, within max_staleness

    redis.pause();
    let started = Instant::now();
    let j = features(
        &app,
        "user_id",
        &["u_1", "u_2"],
        &["user_profile:age"],
        Some(30),
    )
    .await;
    let took = started.elapsed();
    // No deadline in the request: the view's store.timeout (50ms) bounds the wait, not the gateway's
    // 2 s request timeout.
    let started = Instant::now();
    let k = features(&app, "user_id", &["u_5"], &["user_profile:age"], None).await;
    let took_default = started.elapsed();
    // A prediction whose deadline is spent waiting on the store is a degraded answer, not a 503 from
    // the inference queue it reaches late.
    let p = app
        .predict(
            "ctr",
            &json!({"entities": {"user_id": "u_7"}, "candidates": [{"item_id": "i_7"}], "options": {"deadline_ms": 30}}),
        )
        .await;
    redis.resume();
    assert_eq!(p.status, 200, "{}", String::from_utf8_lossy(&p.body));
    assert_eq!(p.json()["degraded"], true);
    assert!(
        took < Duration::from_millis(300),
        "took {took:?} with a 30 ms deadline"
    );
    assert!(
        took_default < Duration::from_millis(400),
        "took {took_default:?} with store.timeout = 50ms"
    );
    assert_eq!(
        k["features"]["user_profile:age"]["statuses"],
        json!(["DEFAULTED"])
    );
    assert_eq!(j["degraded"], true);
    assert_eq!(
        j["features"]["user_profile:age"]["values"],
        json!([want, 30])
    );
    assert_eq!(
        j["features"]["user_profile:age"]["statuses"],
        json!(["STALE", "DEFAULTED"])
    );
    assert!(
        app.gateway
            .telemetry
            .view("user_profile")
            .degraded_timeout
            .load(Relaxed)
            >= 3
    );

    // DEBUG SLEEP: the server is busy, the request still answers by its deadline.
    redis.sleep(Duration::from_millis(400));
    let started = Instant::now();
    let j = features(&app, "user_id", &["u_3"], &["user_profile:age"], Some(40)).await;
    let took = started.elapsed();
    assert!(
        took < Duration::from_millis(300),
        "took {took:?} with a 40 ms deadline"
    );
    assert_eq!(
        j["features"]["user_profile:age"]["statuses"],
        json!(["DEFAULTED"])
    );

    // Once Redis answers again, so does the gateway.
    let want3 = demo_rows("user_profile", "user_id")["u_3"]["age"]
        .as_i64()
        .expect("age");
    eventually(Duration::from_secs(3), "u_3 once Redis answers", || async {
        ages(&app, &["u_3"]).await.0 == vec![want3]
    })
    .await;
}

#[tokio::test]
async fn unreadable_records_are_defaulted_counted_and_never_a_500() {
    let redis = RedisServer::start();
    seeded(&redis).await;
    let app = gateway(&redis, |_| {}).await;
    put_raw(
        &redis,
        "hy:user_profile:bad_msgpack",
        b"\xc1\xc1 not messagepack",
    );
    let wrong_version = Record {
        schema_version: 99,
        event_ts_ms: now_ms(),
        values: vec![Value::Int(1); 5],
        layout: 0,
    }
    .encode();
    put_raw(&redis, "hy:user_profile:bad_version", &wrong_version);
    let wrong_length = Record {
        schema_version: 1,
        event_ts_ms: now_ms(),
        values: vec![Value::Int(1)],
        layout: 0,
    }
    .encode();
    put_raw(&redis, "hy:user_profile:bad_length", &wrong_length);
    // Same version, same length, same types: written under a view whose features were reordered.
    let mut wrong_layout = Record::decode(&user_record(41, now_ms())).expect("record");
    wrong_layout.layout = wrong_layout.layout.wrapping_add(1);
    put_raw(&redis, "hy:user_profile:bad_layout", &wrong_layout.encode());
    let mut wrong_type = Record::decode(&user_record(1, now_ms())).expect("record");
    wrong_type.values[0] = Value::Str("forty".into());
    put_raw(&redis, "hy:user_profile:bad_type", &wrong_type.encode());
    redis.cmd(&["HSET", "hy:user_profile:bad_redis_type", "f", "v"]);

    let users = [
        "bad_msgpack",
        "bad_version",
        "u_1",
        "bad_length",
        "bad_type",
        "bad_redis_type",
        "bad_layout",
    ];
    let (v, s, j) = ages(&app, &users).await;
    let u1 = demo_rows("user_profile", "user_id")["u_1"]["age"]
        .as_i64()
        .expect("age");
    assert_eq!(v, vec![30, 30, u1, 30, 30, 30, 30]);
    assert_eq!(
        s[..5],
        [
            "DEFAULTED",
            "DEFAULTED",
            "PRESENT",
            "DEFAULTED",
            "DEFAULTED"
        ]
    );
    // A key holding another Redis type reads as absent (MGET answers nil for it).
    assert_eq!(s[5], "NOT_FOUND");
    assert_eq!(s[6], "DEFAULTED", "a record of another layout is not read");
    assert_eq!(
        j["degraded"], false,
        "the store answered: nothing is degraded"
    );
    let view = app.gateway.telemetry.view("user_profile");
    let bad = &view.bad_records;
    assert_eq!(bad.load(Relaxed), 5);
    // Cached like "not found": the next request does not read (or log) them again.
    let (_, _, j) = ages(&app, &users).await;
    assert_eq!(j["cache"]["hits"], 7);
    assert_eq!(bad.load(Relaxed), 5);
    // In the view's counters only the key known absent (another Redis type) is `negative`; the
    // cached unreadable records were found, and count as hits.
    assert_eq!(
        (view.hits.load(Relaxed), view.negative.load(Relaxed)),
        (6, 1)
    );
    // The model is served too.
    let r = app
        .predict(
            "ctr",
            &json!({"entities": {"user_id": "bad_msgpack"}, "candidates": [{"item_id": "i_1"}]}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()["feature_status"]["user_profile"], "DEFAULTED");
}

/// A `redis-sentinel://` URL connects to the master the sentinel names, and serves from it.
#[tokio::test]
async fn a_sentinel_url_reaches_the_master_it_names() {
    let master = RedisServer::start();
    let sentinel = Sentinel::start(&master);
    let (c, store) = open_through_sentinel(&master, sentinel.url()).await;
    loads_and_serves_through_the_master(&master, c, store, "u_5").await;
}

/// A config for `master` that reaches it through the sentinel URL `url` (a sentinel that does not answer
/// is given up on after 500 ms), and the store opened with it.
async fn open_through_sentinel(
    master: &RedisServer,
    url: String,
) -> (hydrant::config::Config, Arc<dyn Store>) {
    let mut c = config_for(master);
    c.store.redis.url = url;
    c.store.redis.connect_timeout = Duration::from_millis(500);
    let store = open_store(&c)
        .await
        .expect("the master, through the sentinel");
    (c, store)
}

/// Loads the demo rows through `store` (opened through a sentinel), checks they went to `master`, and
/// that a gateway over the store serves `user`'s age.
async fn loads_and_serves_through_the_master(
    master: &RedisServer,
    c: hydrant::config::Config,
    store: Arc<dyn Store>,
    user: &str,
) {
    load_demo_rows(&store).await;
    assert_eq!(
        master.cmd(&["EXISTS", &format!("hy:user_profile:{user}")]),
        Reply::Int(1),
        "the rows went to the master"
    );
    let app = gateway_over(c, store).await;
    let (values, statuses, _) = ages(&app, &[user]).await;
    let age = demo_rows("user_profile", "user_id")[user]["age"]
        .as_i64()
        .expect("age");
    assert_eq!((values, statuses), (vec![age], vec!["PRESENT".to_owned()]));
}

/// Several sentinels in one URL (`node=`), the first of them down: the gateway asks the next one and
/// starts on the master it names, as a deployment with one sentinel out of three down must.
#[tokio::test]
async fn a_sentinel_url_with_its_first_sentinel_down_asks_the_next() {
    let master = RedisServer::start();
    let sentinel = Sentinel::start(&master);
    // A port nothing listens on: the first sentinel is down.
    let down = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
        l.local_addr().expect("its address").port()
    };
    let (c, store) = open_through_sentinel(
        &master,
        format!(
            "redis-sentinel://127.0.0.1:{down}/0?sentinelServiceName=mymaster&node=127.0.0.1:{}",
            sentinel.port
        ),
    )
    .await;
    loads_and_serves_through_the_master(&master, c, store, "u_7").await;
}

/// A master with a replica, a sentinel quick to fail over between them, the demo rows loaded through
/// it and on the replica, and a ready gateway that knows only the sentinel.
async fn ready_to_fail_over() -> (RedisServer, RedisServer, Sentinel, TestApp) {
    ready_to_fail_over_with(None).await
}

/// The same, with `password` required by the master, the replica and the sentinel when given.
async fn ready_to_fail_over_with(
    password: Option<&str>,
) -> (RedisServer, RedisServer, Sentinel, TestApp) {
    let (master, replica) = match password {
        Some(p) => (
            RedisServer::start_with_password(p),
            RedisServer::start_with_password(p),
        ),
        None => (RedisServer::start(), RedisServer::start()),
    };
    let port = master.port().to_string();
    if let Some(p) = password {
        // Either may be the master after a fail-over.
        for node in [&master, &replica] {
            node.cmd(&["CONFIG", "SET", "masterauth", p]);
        }
    }
    replica.cmd(&["REPLICAOF", "127.0.0.1", &port]);
    let sentinel = Sentinel::start_quick_to_fail_over(&master);
    let (c, store) = open_through_sentinel(&master, sentinel.url()).await;
    load_demo_rows(&store).await;
    // Every row on the replica before the master goes, and the sentinel knows the replica.
    let synced = master.cmd(&["WAIT", "1", "5000"]);
    assert_eq!(synced, Reply::Int(1), "the replica did not catch up");
    replicas_known(&sentinel, 1).await;
    let app = gateway_over(c, store).await;
    (master, replica, sentinel, app)
}

/// Waits until `sentinel` knows `n` replicas of its master.
async fn replicas_known(sentinel: &Sentinel, n: usize) {
    eventually(
        Duration::from_secs(20),
        &format!("the sentinel sees {n} replica(s)"),
        || async {
            matches!(
                sentinel.cmd(&["SENTINEL", "replicas", "mymaster"]),
                Ok(Reply::Array(ref r)) if r.len() == n
            )
        },
    )
    .await;
}

/// Writes 10 rows `u_{name}_{i}` (age `age + i`) through `app`, 50 ms apart, and checks that each one
/// answered 200 is on `master` (the new one, `since` the fail-over's `event`); the number answered 200.
async fn writes_land_on(
    app: &TestApp,
    master: &RedisServer,
    name: &str,
    age: i64,
    event: &str,
    since: Duration,
) -> usize {
    let mut landed = 0;
    for i in 0..10 {
        let user = format!("u_{name}_{i}");
        let body = json!({"rows": [{"user_id": user, "age": age + i, "country": "fr", "is_premium": false}]});
        let r = app.post_json("/v1/views/user_profile/rows", &body).await;
        // Refused writes are not lost: the caller is told.
        if r.status == 200 {
            landed += 1;
            assert_eq!(
                master.cmd(&["EXISTS", &format!("hy:user_profile:{user}")]),
                Reply::Int(1),
                "a write answered 200 {since:?} after the {event} went to the old master"
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    landed
}

/// A sentinel failover: the master is killed, the sentinel promotes its replica, and the gateway,
/// which knows only the sentinel, reads and writes on the new master without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_failover_moves_the_gateway_to_the_promoted_replica() {
    let (mut master, replica, sentinel, app) = ready_to_fail_over().await;
    let expected = |user: &str| {
        demo_rows("user_profile", "user_id")[user]["age"]
            .as_i64()
            .expect("age")
    };
    assert_eq!(ages(&app, &["u_5"]).await.0, vec![expected("u_5")]);

    master.stop();
    let moved = eventually(
        Duration::from_secs(30),
        "the sentinel promotes the replica",
        || async { sentinel.master_port() == Some(replica.port()) },
    )
    .await;
    // A key never read before, so it comes from the store, not the cache.
    let served = eventually(
        Duration::from_secs(30),
        "the gateway reads the new master",
        || async {
            let (values, statuses, _) = ages(&app, &["u_6"]).await;
            statuses == ["PRESENT"] && values == [expected("u_6")]
        },
    )
    .await;
    let body = json!({"rows": [{"user_id": "u_failover", "age": 41, "country": "fr", "is_premium": false}]});
    eventually(
        Duration::from_secs(30),
        "the gateway writes to the new master",
        || async {
            app.post_json("/v1/views/user_profile/rows", &body)
                .await
                .status
                == 200
        },
    )
    .await;
    assert_eq!(
        replica.cmd(&["EXISTS", "hy:user_profile:u_failover"]),
        Reply::Int(1),
        "the row went to the promoted replica"
    );
    // Read back; a read that meets a connection still moving is served degraded (defaults) and tried
    // again, but the row must never read as absent.
    eventually(Duration::from_secs(10), "the row read back", || async {
        let (values, statuses, _) = ages(&app, &["u_failover"]).await;
        assert_ne!(statuses, ["NOT_FOUND"], "the written row is absent");
        statuses == ["PRESENT"] && values == [41]
    })
    .await;
    eprintln!("failover: promoted after {moved:?}, served {served:?} later");
}

/// The same with the master frozen rather than killed (its host still acknowledges, so nothing tells
/// fred the connections are dead while reads keep coming): the gateway's connections, whose reads go
/// unanswered, reconnect through the sentinel and read and write on the promoted replica while the old
/// master is still frozen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_failover_from_a_frozen_master_moves_the_gateway_too() {
    let (master, replica, _sentinel, app) = ready_to_fail_over().await;
    let want = demo_rows("user_profile", "user_id")["u_6"]["age"]
        .as_i64()
        .expect("age");
    master.pause();
    // Reads all along (a key never read before, so each comes from the store): the traffic that keeps
    // fred's own check from firing.
    let served = eventually(
        Duration::from_secs(30),
        "the gateway reads the promoted replica",
        || async {
            let (values, statuses, _) = ages(&app, &["u_6"]).await;
            statuses == ["PRESENT"] && values == [want]
        },
    )
    .await;
    let body =
        json!({"rows": [{"user_id": "u_frozen", "age": 42, "country": "fr", "is_premium": false}]});
    // A write may still take a pooled connection to the frozen master that has not moved yet (each
    // moves once its own reads go unanswered): answered 503, "sending them again is safe", as a caller
    // does until it lands, while the old master is still frozen.
    let mut r = app.post_json("/v1/views/user_profile/rows", &body).await;
    let mut tries = 1;
    while r.status == 503 && tries < 10 {
        r = app.post_json("/v1/views/user_profile/rows", &body).await;
        tries += 1;
    }
    master.resume();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    eprintln!("the write landed on try {tries}");
    assert_eq!(
        replica.cmd(&["EXISTS", "hy:user_profile:u_frozen"]),
        Reply::Int(1),
        "the row went to the promoted replica"
    );
    eprintln!("frozen master: served from the promoted replica {served:?} after the freeze");
}

/// A fail-over the sentinel is asked for (`SENTINEL FAILOVER`): the old master keeps answering, and
/// takes writes until the sentinel turns it into a replica, seconds later, which throws them away. The
/// gateway hears the sentinel's `+switch-master` and moves at once: every write answered 200 after
/// the switch is on the new master.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_ordered_through_the_sentinel_moves_writes_at_once() {
    failover_ordered_through_the_sentinel(None).await;
}

/// The same where the master and the sentinel want a password: the sentinel's announcements are
/// heard with the URL's credentials, as fred reaches the sentinels.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_ordered_through_sentinels_with_a_password_moves_writes_at_once() {
    failover_ordered_through_the_sentinel(Some("s3ntinel-pw")).await;
}

async fn failover_ordered_through_the_sentinel(password: Option<&str>) {
    let (master, replica, sentinel, app) = ready_to_fail_over_with(password).await;
    let flushed_before = flushes(&app);
    let r = sentinel.cmd(&["SENTINEL", "FAILOVER", "mymaster"]);
    assert!(matches!(r, Ok(Reply::Status(_))), "{r:?}");
    let moved = eventually(
        Duration::from_secs(30),
        "the sentinel promotes the replica",
        || async { sentinel.master_port() == Some(replica.port()) },
    )
    .await;
    // The announcement and the reconnection take milliseconds; writes made in them may still reach
    // the old master, as with any client that follows the sentinels.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let landed = writes_land_on(&app, &replica, "moved", 30, "switch", moved).await;
    assert!(landed >= 8, "only {landed} of 10 writes answered 200");
    assert_eq!(ages(&app, &["u_moved_9"]).await.0, vec![39]);
    // The invalidation subscriber moved too: its reconnection flushed the cache.
    assert!(
        flushes(&app) > flushed_before,
        "the subscriber stayed on the old master"
    );
    drop(master);
}

/// With two replicas, the sentinel leading the fail-over announces `+switch-master` only once the
/// second follows the new master, seconds after the promotion; a URL naming only that sentinel moves
/// on its `+promoted-slave` instead, so writes after the promotion are not left on the old master.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_is_followed_from_the_promotion_when_the_leader_is_the_only_sentinel_named() {
    let (master, replica, sentinel, app) = ready_to_fail_over().await;
    let second = RedisServer::start();
    second.cmd(&["REPLICAOF", "127.0.0.1", &master.port().to_string()]);
    replicas_known(&sentinel, 2).await;
    let r = sentinel.cmd(&["SENTINEL", "FAILOVER", "mymaster"]);
    assert!(matches!(r, Ok(Reply::Status(_))), "{r:?}");
    let promoted = eventually(
        Duration::from_secs(30),
        "the sentinel promotes a replica",
        || async { sentinel.master_port().is_some_and(|p| p != master.port()) },
    )
    .await;
    let new = if sentinel.master_port() == Some(replica.port()) {
        &replica
    } else {
        &second
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let landed = writes_land_on(&app, new, "promoted", 50, "promotion", promoted).await;
    assert!(landed >= 8, "only {landed} of 10 writes answered 200");
}

#[tokio::test]
async fn a_cluster_node_named_as_a_single_server_is_refused_at_start_up() {
    let node = RedisServer::start_cluster();
    let mut c = config_for(&node);
    c.store.redis.url = c
        .store
        .redis
        .url
        .replacen("redis-cluster://", "redis://", 1);
    assert!(
        c.store.redis.url.starts_with("redis://"),
        "{}",
        c.store.redis.url
    );
    let e = format!("{:#}", open_store(&c).await.err().expect("must fail"));
    assert!(
        e.contains("cluster_enabled:1") && e.contains("redis-cluster://"),
        "{e}"
    );
}

#[tokio::test]
async fn start_up_fails_clearly_when_redis_is_unreachable_or_refuses_the_password() {
    let mut redis = RedisServer::start();
    let mut c = config_for(&redis);
    redis.stop();
    c.store.redis.connect_timeout = Duration::from_millis(500);
    let started = Instant::now();
    let e = format!("{:#}", open_store(&c).await.err().expect("must fail"));
    assert!(started.elapsed() < Duration::from_secs(3));
    assert!(e.contains("Redis") && e.contains("store.redis"), "{e}");

    let redis = RedisServer::start_with_password("s3cret-pw");
    let mut c = config_for(&redis);
    let store = open_store(&c)
        .await
        .expect("the password in the URL is used");
    load_demo_rows(&store).await;
    let app = gateway_over(c.clone(), store).await;
    assert_eq!(ages(&app, &["u_5"]).await.1, vec!["PRESENT".to_owned()]);
    c.store.redis.url = c.store.redis.url.replace("s3cret-pw", "wrong-pw");
    let e = format!("{:#}", open_store(&c).await.err().expect("wrong password"));
    assert!(
        !e.contains("wrong-pw"),
        "the password leaked into the message: {e}"
    );
    assert!(e.contains("Redis"), "{e}");

    // Something else on the port (an HTTP server here) answers bytes that are not Redis's.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    tokio::spawn(async move {
        use tokio::io::AsyncWriteExt as _;
        while let Ok((mut s, _)) = listener.accept().await {
            let _ = s
                .write_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
                .await;
        }
    });
    c.store.redis.url = format!("redis://127.0.0.1:{port}");
    let e = format!("{:#}", open_store(&c).await.err().expect("not Redis"));
    assert!(e.contains("did not answer as Redis does"), "{e}");
}

/// Redis 7 gives a new ACL user no pub/sub access, and refuses its `SUBSCRIBE`; the client does not pass
/// that on, so a replica started that way never heard an invalidation. It is now refused at start-up,
/// saying what to grant.
#[tokio::test]
async fn start_up_fails_clearly_when_the_redis_user_may_not_use_the_invalidation_channel() {
    let redis = RedisServer::start();
    let user = |name: &str, channels: &str| {
        redis.cmd(&[
            "ACL", "SETUSER", name, "on", ">app-pw", "~*", "+@all", channels,
        ]);
    };
    user("nochannels", "resetchannels");
    user("channels", "allchannels");
    let mut c = config_for(&redis);
    c.store.redis.url = format!("redis://nochannels:app-pw@127.0.0.1:{}", redis.port());
    let store = open_store(&c)
        .await
        .expect("the user may read and write keys");
    let e = store
        .subscribe_invalidations(std::sync::Arc::new(|_| {}))
        .await
        .expect_err("the subscription is refused");
    assert!(
        e.to_string().contains("pub/sub access") && e.to_string().contains("ACL SETUSER"),
        "{e}"
    );
    c.store.redis.url = format!("redis://channels:app-pw@127.0.0.1:{}", redis.port());
    let store = open_store(&c).await.expect("store");
    store
        .subscribe_invalidations(std::sync::Arc::new(|_| {}))
        .await
        .expect("subscribed");
}

/// A subscriber that reconnects while its user may not use the channel (an ACL edited for a moment:
/// Redis 7 then closes its connection) has its `SUBSCRIBE` refused in silence. It tries again until an
/// echo comes back, so that once access is back it hears announcements again, and flushes the cache then.
#[tokio::test]
async fn a_resubscription_refused_for_a_moment_is_tried_again_until_it_holds() {
    use hydrant::store::Invalidation;
    let redis = RedisServer::start();
    redis.cmd(&[
        "ACL",
        "SETUSER",
        "app",
        "on",
        ">app-pw",
        "~*",
        "+@all",
        "allchannels",
    ]);
    let mut c = config_for(&redis);
    c.store.redis.url = format!("redis://app:app-pw@127.0.0.1:{}", redis.port());
    let store = open_store(&c).await.expect("store");
    let (keys, flushes) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (k, f) = (keys.clone(), flushes.clone());
    store
        .subscribe_invalidations(Arc::new(move |inv| match inv {
            Invalidation::Keys(v) => {
                k.fetch_add(v.len(), Relaxed);
            }
            Invalidation::All => {
                f.fetch_add(1, Relaxed);
            }
        }))
        .await
        .expect("subscribed");
    let subscribers = || match redis.cmd(&["PUBSUB", "NUMSUB", "hy:invalidate"]) {
        Reply::Array(a) => match a.get(1) {
            Some(Reply::Int(n)) => *n,
            other => panic!("NUMSUB: {other:?}"),
        },
        other => panic!("NUMSUB: {other:?}"),
    };
    assert_eq!(subscribers(), 1);
    // Access taken away (the subscriber is disconnected, and its resubscriptions refused) for a second.
    redis.cmd(&["ACL", "SETUSER", "app", "resetchannels"]);
    let until = Instant::now() + Duration::from_secs(10);
    while subscribers() != 0 {
        assert!(
            Instant::now() < until,
            "the subscriber was not disconnected"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(subscribers(), 0, "refused while the user has no channels");
    redis.cmd(&["ACL", "SETUSER", "app", "allchannels"]);
    let until = Instant::now() + Duration::from_secs(15);
    while subscribers() != 1 || flushes.load(Relaxed) == 0 {
        assert!(
            Instant::now() < until,
            "not subscribed again ({} subscribers, {} flushes) 15 s after access came back",
            subscribers(),
            flushes.load(Relaxed)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    redis.cmd(&["PUBLISH", "hy:invalidate", "hy:user_profile:u_1"]);
    let until = Instant::now() + Duration::from_secs(5);
    while keys.load(Relaxed) == 0 {
        assert!(Instant::now() < until, "an announcement was not heard");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

// ------------------------------------------------------------------------------------------------------
// Writes, invalidation and the loader

#[tokio::test]
async fn a_write_through_one_gateway_is_served_by_another_within_the_bound() {
    let redis = RedisServer::start();
    seeded(&redis).await;
    let a = gateway(&redis, |_| {}).await;
    let b = gateway(&redis, |_| {}).await;
    let before = demo_rows("user_profile", "user_id")["u_9"]["age"]
        .as_i64()
        .expect("age");
    assert_eq!(ages(&a, &["u_9"]).await.0, vec![before]);
    assert_eq!(ages(&b, &["u_9"]).await.0, vec![before]);
    assert_eq!(
        ages(&b, &["u_9"]).await.2["cache"]["hits"],
        1,
        "b has it cached"
    );

    let body =
        json!({"rows": [{"user_id": "u_9", "age": 77, "country": "br", "is_premium": true}]});
    let started = Instant::now();
    let r = a.post_json("/v1/views/user_profile/rows", &body).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json(), json!({"written": 1, "announced": true}));
    // The writer reads its own write at once.
    assert_eq!(ages(&a, &["u_9"]).await.0, vec![77]);
    // The other replica within the bound (documented: the pub/sub delivery time, milliseconds).
    let took = eventually(Duration::from_secs(1), "b serves the new value", || async {
        ages(&b, &["u_9"]).await.0 == vec![77]
    })
    .await;
    eprintln!(
        "invalidation seen by the second gateway after {:?} ({:?} after the write began)",
        took,
        started.elapsed()
    );
    assert!(b.gateway.telemetry.invalidation.received_keys.load(Relaxed) >= 1);
    assert_eq!(
        a.gateway
            .telemetry
            .invalidation
            .published_keys
            .load(Relaxed),
        1
    );
    // What was written is what is read, feature by feature (left-out features are null: defaults).
    let j = features(&b, "user_id", &["u_9"], &["user_profile"], None).await;
    assert_eq!(j["features"]["user_profile:country"]["values"][0], "br");
    assert_eq!(j["features"]["user_profile:is_premium"]["values"][0], true);
    assert_eq!(
        j["features"]["user_profile:avg_session_minutes"]["statuses"][0],
        "NULL_VALUE"
    );
    // Written with the view's key_ttl (30d).
    let Reply::Int(pttl) = redis.cmd(&["PTTL", "hy:user_profile:u_9"]) else {
        panic!("PTTL")
    };
    assert!(pttl > (29 * DAY).as_millis() as i64, "{pttl}");
}

/// A rows write while Redis is down is refused as not written, without waiting out the request, and is
/// not replayed when Redis comes back (it was never handed to the client's reconnection queue).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rows_write_while_redis_is_down_is_refused_unsent_and_never_replayed() {
    let mut redis = RedisServer::start();
    let app = gateway(&redis, |_| {}).await;
    redis.stop();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = Instant::now();
    let r = app
        .post_json(
            "/v1/views/user_profile/rows",
            &json!({"rows": [{"user_id": "u_down", "age": 20}]}),
        )
        .await;
    assert_eq!(r.status, 503, "{}", String::from_utf8_lossy(&r.body));
    let j = r.json();
    let msg = j["error"]["message"].as_str().unwrap_or("");
    assert_eq!(j["error"]["code"], "store_unavailable", "{j}");
    assert!(
        msg.contains("not written") && msg.contains("not connected"),
        "{msg}"
    );
    assert!(
        started.elapsed() < Duration::from_millis(1800),
        "refused before the request's limit: {:?}",
        started.elapsed()
    );
    redis.restart();
    // Long enough for the client to reconnect and send anything it had queued.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        redis.cmd(&["EXISTS", "hy:user_profile:u_down"]),
        Reply::Int(0)
    );
    // And the next write goes through.
    let r = app
        .post_json(
            "/v1/views/user_profile/rows",
            &json!({"rows": [{"user_id": "u_down", "age": 21}]}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
}

/// Redis restarted with a password the gateway does not have: the gateway cannot reconnect, and the
/// writes refused meanwhile say why (`NOAUTH`), not only that Redis is not connected, though it answers
/// (the log says it too, at WARN, as do the failed reads' lines).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_password_required_after_a_restart_is_named_in_the_errors_meanwhile() {
    let mut redis = RedisServer::start();
    let app = gateway(&redis, |c| {
        c.store.redis.reconnect_min_delay = Duration::from_millis(10);
        c.store.redis.reconnect_max_delay = Duration::from_millis(100);
    })
    .await;
    redis.restart_with_password("rotated-secret");
    let row = json!({"rows": [{"user_id": "u_auth", "age": 20}]});
    let started = Instant::now();
    let said = loop {
        let r = app.post_json("/v1/views/user_profile/rows", &row).await;
        assert_eq!(r.status, 503, "{}", String::from_utf8_lossy(&r.body));
        let said = r.json()["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        if said.contains("NOAUTH") {
            break said;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "{said}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        said.contains("not connected") && said.contains("the last reconnection failed"),
        "{said}"
    );
    assert_eq!(
        redis.cmd(&["EXISTS", "hy:user_profile:u_auth"]),
        Reply::Int(0)
    );
}

/// Whole-cache flushes the gateway has made (each after its subscription reconnected).
fn flushes(app: &TestApp) -> u64 {
    app.gateway.telemetry.invalidation.flushes.load(Relaxed)
}

/// Asserts that the subscription was never taken for dead (`why` otherwise) and that a predict is then
/// served from Redis in time, not degraded.
async fn kept_its_subscription_and_serves_fresh(app: &TestApp, why: &str) {
    assert_eq!(flushes(app), 0, "{why}");
    let r = app
        .predict(
            "ctr",
            &json!({"entities": {"user_id": "u_1"}, "candidates": [{"item_id": "i_1"}]}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()["degraded"], false);
}

/// Connections Redis has accepted since it started, one more for this question's own.
fn connections_opened(redis: &RedisServer) -> u64 {
    let info = redis.cmd(&["INFO", "stats"]).text();
    info.lines()
        .find_map(|l| l.strip_prefix("total_connections_received:"))
        .and_then(|n| n.trim().parse::<u64>().ok())
        .expect("total_connections_received")
}

/// A Redis that closes idle connections (`timeout`) does not close a quiet gateway's: the heartbeat
/// pings each pooled connection within a third of that time (read at start-up) and the subscriber's every
/// second, so none has to be opened again (with a warning from fred each, a request in that moment served
/// degraded, and the subscriber's reconnection flushing the cache).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_gateway_keeps_its_connections_through_the_servers_idle_timeout() {
    let redis = RedisServer::start();
    redis.cmd(&["CONFIG", "SET", "timeout", "2"]);
    let app = gateway(&redis, |_| {}).await;
    let opened = || connections_opened(&redis);
    let before = opened();
    let pings = redis.calls("ping");
    // Idle for twice the server's timeout (which it checks in whole seconds).
    tokio::time::sleep(Duration::from_secs(5)).await;
    let after = opened();
    assert!(redis.calls("ping") > pings, "no heartbeat was sent");
    // Only this test's own two connections (`calls`, then `INFO`) are new.
    assert_eq!(after, before + 2, "connections were opened again");
    kept_its_subscription_and_serves_fresh(&app, "the subscription reconnected").await;
}

/// The same on a cluster: the pool's and the subscriber's connections to every node are kept, so the
/// subscription is not reconnected and the cache not flushed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_a_quiet_gateway_keeps_its_connections_to_every_node() {
    let (a, b) = RedisServer::start_cluster_pair();
    for node in [&a, &b] {
        node.cmd(&["CONFIG", "SET", "timeout", "2"]);
    }
    let app = gateway(&a, |_| {}).await;
    let before = [connections_opened(&a), connections_opened(&b)];
    tokio::time::sleep(Duration::from_secs(5)).await;
    let after = [connections_opened(&a), connections_opened(&b)];
    // This test's own question, on each node.
    assert_eq!(
        after,
        [before[0] + 1, before[1] + 1],
        "connections were opened again"
    );
    assert_eq!(flushes(&app), 0, "the subscription reconnected");
}

/// A server busy for a few seconds (a fork, a slow command) is waited for, not taken for dead: no
/// connection is closed, so the subscription keeps its messages and the cache is not flushed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_of_a_few_seconds_neither_reconnects_nor_flushes_the_cache() {
    let redis = RedisServer::start();
    let app = gateway(&redis, |_| {}).await;
    let before = connections_opened(&redis);
    // Pings are in flight on every connection while it sleeps.
    redis.sleep(Duration::from_secs(3));
    tokio::time::sleep(Duration::from_millis(4500)).await;
    // This test's own: the sleep's, and this question's.
    assert_eq!(
        connections_opened(&redis),
        before + 2,
        "connections were opened again"
    );
    kept_its_subscription_and_serves_fresh(&app, "the subscription was taken for dead").await;
}

/// A server that stops answering for longer (frozen here) is found by the subscriber's unanswered ping,
/// though the heartbeat goes on: its subscription is reconnected once the server answers again, and the
/// cache flushed, since messages may have been lost meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_redis_is_found_by_the_heartbeat_and_the_cache_flushed_after() {
    let redis = RedisServer::start();
    let app = gateway(&redis, |_| {}).await;
    redis.pause();
    // Past the 5 s without an answer (and fred's check, every 1.25 s), with pings due every second.
    tokio::time::sleep(Duration::from_secs(8)).await;
    redis.resume();
    eventually(
        Duration::from_secs(10),
        "a flush after the subscription was taken for dead",
        || async { flushes(&app) >= 1 },
    )
    .await;
}

/// Drops every packet to a local port while it lives (iptables), as a partition or a crashed host does:
/// nothing is acknowledged, nothing refused.
struct Partition(u16);

impl Partition {
    /// `None` where iptables is missing or may not be used (not root, no NET_ADMIN).
    fn start(port: u16) -> Option<Self> {
        let rule = ["-p", "tcp", "--dport", &port.to_string(), "-j", "DROP"].map(str::to_owned);
        let ok = std::process::Command::new("iptables")
            .args(["-w", "-I", "INPUT"])
            .args(&rule)
            .output()
            .is_ok_and(|o| o.status.success());
        ok.then_some(Self(port))
    }
}

impl Drop for Partition {
    fn drop(&mut self) {
        let _ = std::process::Command::new("iptables")
            .args(["-w", "-D", "INPUT", "-p", "tcp", "--dport"])
            .arg(self.0.to_string())
            .args(["-j", "DROP"])
            .output();
    }
}

/// Whether a miss (a key never read before) was answered from Redis rather than degraded.
async fn read_from_redis(app: &TestApp, n: u64) -> bool {
    let key = format!("u_part_{n}");
    let j = features(app, "user_id", &[&key], &["user_profile:age"], None).await;
    j["degraded"] == false
}

/// Redis partitioned away while misses keep coming: the kernel gives each connection up after 5 s of
/// unacknowledged data (TCP_USER_TIMEOUT), fred reconnects, and misses are read from Redis again within
/// a few seconds of the path coming back. fred's own check, timed from the latest write, never fires
/// while requests keep writing, and TCP's retries back off: a 15 s partition left the pool stuck for
/// some 11 s after it healed. Runs where iptables may be used (root with NET_ADMIN; `make test`
/// installs iptables); elsewhere it says so and passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_redis_is_given_up_and_read_again_soon_after_it_heals() {
    let redis = RedisServer::start();
    let app = gateway(&redis, |_| {}).await;
    let Some(partition) = Partition::start(redis.port()) else {
        eprintln!("skipped: iptables is missing or may not be used here");
        return;
    };
    let mut n = 0u64;
    let started = Instant::now();
    // 14 s: TCP's retries of the first unanswered read come about 0.2, 0.6, 1.4, 3, 6.2 and 12.6 s after
    // it, then at 25.4 s, which is when the old connection would answer again.
    while started.elapsed() < Duration::from_secs(14) {
        n += 1;
        let _ = read_from_redis(&app, n).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(partition);
    let took = eventually(
        Duration::from_secs(5),
        "a miss read from Redis after the partition",
        || {
            n += 1;
            read_from_redis(&app, n)
        },
    )
    .await;
    eprintln!("misses read from Redis again {took:?} after the partition ended");
}

/// A write answered 503 during a partition is not sent again once the path is back: sent again after the
/// reconnection, it could land after its caller had written the keys anew, and undo that write (2 keys
/// of 8 in a probe). Where iptables may be used; elsewhere it says so and passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_lost_in_a_partition_is_not_replayed_after_it_heals() {
    let redis = RedisServer::start();
    let app = gateway(&redis, |_| {}).await;
    let Some(partition) = Partition::start(redis.port()) else {
        eprintln!("skipped: iptables is missing or may not be used here");
        return;
    };
    let r = app
        .post_json(
            "/v1/views/user_profile/rows",
            &json!({"rows": [{"user_id": "u_replay", "age": 1}]}),
        )
        .await;
    assert_eq!(r.status, 503, "{}", String::from_utf8_lossy(&r.body));
    // Past the 5 s after which the kernel gives the connection up, as a partition outlasting it would.
    tokio::time::sleep(Duration::from_secs(7)).await;
    drop(partition);
    let mut n = 0u64;
    eventually(
        Duration::from_secs(5),
        "a miss read from Redis after the partition",
        || {
            n += 1;
            read_from_redis(&app, n)
        },
    )
    .await;
    // Reconnected for a while: the batch had its chance to be sent again.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        redis.cmd(&["EXISTS", "hy:user_profile:u_replay"]),
        Reply::Int(0),
        "the write answered 503 landed after the partition"
    );
}

/// A server that stops answering while its host still acknowledges (frozen here; a master deposed by a
/// Sentinel fail-over looks the same) under steady reads: fred's own check never fires, since each read
/// restarts it, so the gateway makes each pooled connection whose reads went unanswered for 5 s
/// reconnect (which through Sentinel finds the new master). After the freeze every connection is new.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_whose_reads_go_unanswered_under_traffic_are_reconnected() {
    let redis = RedisServer::start();
    let app = gateway(&redis, |_| {}).await;
    let mut n = 0u64;
    redis.pause();
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(8) {
        n += 1;
        let _ = read_from_redis(&app, n).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    redis.resume();
    eventually(
        Duration::from_secs(10),
        "a miss read from Redis after the freeze",
        || {
            n += 1;
            read_from_redis(&app, n)
        },
    )
    .await;
    // Every connection open now (this question's own aside) is younger than the freeze.
    let list = redis.cmd(&["CLIENT", "LIST"]).text();
    let old: Vec<&str> = list
        .lines()
        .filter(|l| !l.contains("cmd=client|list"))
        .filter(|l| {
            l.split(' ')
                .find_map(|f| f.strip_prefix("age="))
                .and_then(|a| a.parse::<u64>().ok())
                .is_some_and(|age| age >= 6)
        })
        .collect();
    assert!(
        old.is_empty(),
        "connections kept through the freeze:\n{}",
        old.join("\n")
    );
}

/// A write the store does not confirm before the request's limit: the 503 says the rows may have been
/// written and that sending them again is safe, and once Redis answers they are there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rows_write_that_outlives_the_request_says_it_may_have_landed() {
    let redis = RedisServer::start();
    let app = gateway(&redis, |c| {
        c.limits.request_timeout = Duration::from_millis(300);
    })
    .await;
    redis.pause();
    let r = app
        .post_json(
            "/v1/views/user_profile/rows",
            &json!({"rows": [{"user_id": "u_slow", "age": 20}]}),
        )
        .await;
    redis.resume();
    assert_eq!(r.status, 503, "{}", String::from_utf8_lossy(&r.body));
    let msg = r.json()["error"]["message"]
        .as_str()
        .unwrap_or("")
        .to_owned();
    assert!(
        msg.contains("may have been written") && msg.contains("sending them again is safe"),
        "{msg}"
    );
    eventually(Duration::from_secs(10), "the write lands", || async {
        redis.cmd(&["EXISTS", "hy:user_profile:u_slow"]) == Reply::Int(1)
    })
    .await;
}

#[tokio::test]
async fn the_rows_api_writes_all_rows_or_none() {
    let redis = RedisServer::start();
    let app = gateway(&redis, |_| {}).await;
    let post = |body: Json| {
        let app = &app;
        async move { app.post_json("/v1/views/user_profile/rows", &body).await }
    };
    let r = post(json!({"rows": [
        {"user_id": "u_w1", "age": 20},
        {"user_id": "u_w2", "age": "old"},
        {"user_id": "u_w3", "agee": 3}
    ]}))
    .await;
    assert_eq!(r.status, 400);
    let j = r.json();
    assert_eq!(j["error"]["field"], "rows[1].age", "{j}");
    let msg = j["error"]["message"].as_str().expect("message");
    assert!(
        msg.contains("age") && msg.contains("2 of 3") && msg.contains("nothing was written"),
        "{msg}"
    );
    assert_eq!(
        redis.cmd(&["EXISTS", "hy:user_profile:u_w1"]),
        Reply::Int(0),
        "the good row was not written"
    );

    let r = post(json!({"rows": [{"user_id": "u_w1", "age": 20, "embedding": [1, 2, 3, 4]}, {"user_id": "u_w2", "age": 21}]}))
        .await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()["written"], 2);
    let stored = redis
        .cmd(&["GET", "hy:user_profile:u_w1"])
        .bytes()
        .expect("written");
    let rec = Record::decode(&stored).expect("a record");
    assert_eq!(rec.schema_version, 1);
    assert_eq!(rec.values[0], Value::Int(20));
    assert_eq!(
        rec.values[4],
        Value::List(vec![1.0, 2.0, 3.0, 4.0].into_boxed_slice())
    );
    assert_eq!(ages(&app, &["u_w1", "u_w2"]).await.0, vec![20, 21]);

    let r = post(json!({"rows": []})).await;
    assert_eq!((r.status, r.code()), (400, "invalid_field".to_owned()));
    let r = app
        .post(
            "/v1/views/nope/rows",
            "application/json",
            b"{\"rows\": []}".to_vec(),
        )
        .await;
    assert_eq!((r.status, r.code()), (404, "unknown_view".to_owned()));
    let r = post(json!({"rows": [7]})).await;
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["field"], "rows[0]");
}

/// A batch that times out but lands later: the keys are announced again once it does, so a gateway that
/// re-read the old value in between does not keep serving it until its ttl.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_that_lands_after_its_timeout_is_announced_again() {
    let redis = RedisServer::start();
    let mut c = config_for(&redis);
    c.store.redis.write_timeout = Duration::from_millis(200);
    let store = open_store(&c).await.expect("store");
    let load = |age: i64| {
        let store = store.clone();
        async move {
            let row = format!("{{\"user_id\": \"u_late\", \"age\": {age}}}\n");
            common::load_rows(&store, "user_profile", row.as_bytes(), false).await
        }
    };
    assert_eq!(load(1).await.written, 1);
    let app = gateway(&redis, |_| {}).await;
    assert_eq!(ages(&app, &["u_late"]).await.0, vec![1], "cached");
    // Writes (and PUBLISH) wait 700 ms: the batch times out at 200 ms, then lands.
    redis.cmd(&["CLIENT", "PAUSE", "700", "WRITE"]);
    let report = load(2).await;
    assert_eq!(report.failed.len(), 1, "{:?}", report.failed);
    assert!(report.failed[0].unconfirmed);
    // Re-read while the write is still held: the old value goes back into the cache.
    assert_eq!(ages(&app, &["u_late"]).await.0, vec![1]);
    eventually(
        Duration::from_secs(5),
        "the late write is announced",
        || async { ages(&app, &["u_late"]).await.0 == vec![2] },
    )
    .await;
    // Both announcements, at once (which may time out behind the paused writes) and once the batch
    // landed, count in `hydrant_invalidations_total`: `published_keys` or `publish_errors` (the store
    // adds them to the gateway's own).
    eventually(
        Duration::from_secs(5),
        "both announcements counted",
        || async {
            let (keys, errors) = store.background_announcements();
            keys >= 1 && keys + errors == 2
        },
    )
    .await;
}

/// A Redis that stops answering mid-load: each batch gives up after `store.redis.write_timeout`
/// and is reported as unconfirmed (it may still land when Redis wakes), and the load ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_against_a_frozen_redis_ends_and_reports_its_batches_unconfirmed() {
    let redis = RedisServer::start();
    let mut c = config_for(&redis);
    c.store.redis.write_timeout = Duration::from_millis(300);
    let store = open_store(&c).await.expect("store");
    redis.pause();
    let rows = (0..5)
        .map(|i| format!("{{\"user_id\": \"u_f{i}\", \"age\": {i}}}\n"))
        .collect::<String>();
    let started = std::time::Instant::now();
    let report = tokio::time::timeout(
        Duration::from_secs(20),
        common::load_rows(&store, "user_profile", rows.as_bytes(), false),
    )
    .await;
    redis.resume();
    let report = report.expect("the load ends while Redis is frozen");
    assert_eq!(report.written, 0);
    assert_eq!(report.failed.len(), 1, "{:?}", report.failed);
    let b = &report.failed[0];
    assert!(b.unconfirmed, "a timed-out batch may have been written");
    assert_eq!((b.first_line, b.last_line, b.rows), (1, 5, 5));
    assert!(b.reason.contains("deadline"), "{}", b.reason);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "bounded by write_timeout (and the announcement's): {:?}",
        started.elapsed()
    );

    // Killed: the client reconnects forever, and each batch still gives up in time.
    let mut redis = redis;
    redis.stop();
    let started = std::time::Instant::now();
    let report = tokio::time::timeout(
        Duration::from_secs(20),
        common::load_rows(&store, "user_profile", rows.as_bytes(), false),
    )
    .await
    .expect("the load ends while Redis is down");
    assert_eq!(report.written, 0);
    assert_eq!(report.failed.len(), 1, "{:?}", report.failed);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

/// A file read from a pipe whose writer pauses: `first` comes at once, then reads block until `go` says
/// go (or its sender is dropped), then `rest`.
struct PausingPipe {
    first: std::io::Cursor<Vec<u8>>,
    go: std::sync::mpsc::Receiver<()>,
    waited: bool,
    rest: std::io::Cursor<Vec<u8>>,
}

impl std::io::Read for PausingPipe {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.first.read(buf)?;
        if n > 0 {
            return Ok(n);
        }
        if !self.waited {
            let _ = self.go.recv();
            self.waited = true;
        }
        self.rest.read(buf)
    }
}

/// A written batch is announced at once, not when the loader next gets a row: with its input paused
/// after one batch, the running gateway already serves that batch's values.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_loader_announces_a_written_batch_while_its_input_pauses() {
    let redis = RedisServer::start();
    seeded(&redis).await;
    let app = Arc::new(gateway(&redis, |_| {}).await);
    let old = demo_rows("user_profile", "user_id")["u_4"]["age"]
        .as_i64()
        .expect("age");
    assert_eq!(ages(&app, &["u_4"]).await.0, vec![old], "cached before");

    // A bad row, then one whole batch of good rows (u_4 last), then the pause, then one more row. The bad
    // row puts the batch's end one row past a round number of lines read.
    let mut first = String::from("{\"user_id\": \"u_bad\", \"age\": \"old\"}\n");
    for i in 1..hydrant::loader::BATCH {
        first.push_str(&format!("{{\"user_id\": \"u_p{i}\", \"age\": 20}}\n"));
    }
    first.push_str("{\"user_id\": \"u_4\", \"age\": 77}\n");
    let (go, wait) = std::sync::mpsc::channel();
    let pipe = PausingPipe {
        first: std::io::Cursor::new(first.into_bytes()),
        go: wait,
        waited: false,
        rest: std::io::Cursor::new(b"{\"user_id\": \"u_last\", \"age\": 21}\n".to_vec()),
    };
    // Watches the gateway while the loader waits on its input; lets the input go on either way.
    let watcher = tokio::spawn({
        let app = app.clone();
        async move {
            let until = Instant::now() + Duration::from_secs(5);
            let mut seen = false;
            while !seen && Instant::now() < until {
                seen = ages(&app, &["u_4"]).await.0 == vec![77];
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let _ = go.send(());
            seen
        }
    });
    let store = open_store(&config_for(&redis)).await.expect("store");
    let report =
        common::load_rows(&store, "user_profile", std::io::BufReader::new(pipe), false).await;
    assert!(
        watcher.await.expect("watcher"),
        "the gateway kept serving the old value while the loader waited on its input"
    );
    assert_eq!(
        (report.written, report.unannounced, report.rejected_rows),
        (hydrant::loader::BATCH + 1, 0, 1),
        "{report:?}"
    );
    assert_eq!(ages(&app, &["u_last"]).await.0, vec![21]);
}

#[tokio::test]
async fn the_loader_reports_bad_rows_by_line_loads_the_good_ones_and_invalidates_them() {
    let redis = RedisServer::start();
    seeded(&redis).await;
    let app = gateway(&redis, |_| {}).await;
    let old = demo_rows("user_profile", "user_id")["u_4"]["age"]
        .as_i64()
        .expect("age");
    assert_eq!(
        ages(&app, &["u_4"]).await.0,
        vec![old],
        "cached before the load"
    );

    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("rows.jsonl");
    let mut f = std::fs::File::create(&path).expect("create");
    writeln!(f, r#"{{"user_id": "u_4", "age": 88, "country": "in"}}"#).expect("write");
    writeln!(f, r#"{{"user_id": "u_l2", "age": 5"#).expect("write"); // line 2: cut short
    writeln!(
        f,
        r#"{{"user_id": "u_l3", "age": 33, "event_timestamp": "2026-01-02T03:04:05Z"}}"#
    )
    .expect("write");
    writeln!(f, r#"{{"user_id": "u_l4", "shoe_size": 44}}"#).expect("write"); // line 4: unknown feature
    writeln!(f, r#"{{"user_id": "u_l5", "age": "old"}}"#).expect("write"); // line 5: wrong type
    writeln!(f).expect("write");
    writeln!(f, r#"{{"user_id": "u_l7", "embedding": [0.5, 0.5, 0.5]}}"#).expect("write"); // line 7: short list
    writeln!(f, r#"{{"user_id": "u_l8", "is_premium": true}}"#).expect("write");
    drop(f);

    // As the CLI does: its own connection to Redis.
    let c = config_for(&redis);
    let store = open_store(&c).await.expect("store");
    let report = common::load_rows(
        &store,
        "user_profile",
        std::io::BufReader::new(std::fs::File::open(&path).expect("open")),
        false,
    )
    .await;
    assert_eq!(report.written, 3);
    let lines: Vec<usize> = report.rejected.iter().map(|r| r.line).collect();
    assert_eq!(lines, vec![2, 4, 5, 7], "{:?}", report.rejected);
    assert!(
        report.rejected[1].reason.contains("shoe_size"),
        "{:?}",
        report.rejected[1]
    );
    assert!(
        report.rejected[3].reason.contains('4'),
        "{:?}",
        report.rejected[3]
    );
    assert!(report.failed.is_empty() && report.unannounced == 0);
    for k in ["u_l2", "u_l4", "u_l5", "u_l7"] {
        assert_eq!(
            redis.cmd(&["EXISTS", &format!("hy:user_profile:{k}")]),
            Reply::Int(0),
            "{k}"
        );
    }
    let rec = Record::decode(
        &redis
            .cmd(&["GET", "hy:user_profile:u_l3"])
            .bytes()
            .expect("u_l3"),
    )
    .expect("record");
    assert_eq!(rec.values[0], Value::Int(33));
    assert_eq!(rec.event_ts_ms, 1_767_323_045_000);
    let Reply::Int(pttl) = redis.cmd(&["PTTL", "hy:user_profile:u_l8"]) else {
        panic!("PTTL")
    };
    assert!(
        pttl > (29 * DAY).as_millis() as i64,
        "key_ttl applied: {pttl}"
    );

    // The running gateway drops u_4 on the loader's announcement.
    eventually(
        Duration::from_secs(1),
        "the gateway serves the loaded value",
        || async { ages(&app, &["u_4"]).await.0 == vec![88] },
    )
    .await;

    // CSV: the header counts as line 1.
    let csv = dir.path().join("rows.csv");
    std::fs::write(
        &csv,
        "user_id,age,is_premium\nu_c2,41,true\nu_c3,x,false\nu_c4,43,maybe\nu_c5,45,0\n",
    )
    .expect("csv");
    let report = common::load_rows(
        &store,
        "user_profile",
        std::io::BufReader::new(std::fs::File::open(&csv).expect("open")),
        true,
    )
    .await;
    assert_eq!(report.written, 2);
    assert_eq!(
        report.rejected.iter().map(|r| r.line).collect::<Vec<_>>(),
        vec![3, 4]
    );
    assert_eq!(ages(&app, &["u_c2", "u_c5"]).await.0, vec![41, 45]);
}

#[tokio::test]
async fn the_rows_api_and_prefetch_work_on_the_embedded_store_too() {
    let app = TestApp::spawn().await;
    app.wait_ready().await;
    assert_eq!(ages(&app, &["u_3"]).await.1, vec!["PRESENT".to_owned()]);
    let body = json!({"rows": [{"user_id": "u_3", "age": 64}]});
    let r = app.post_json("/v1/views/user_profile/rows", &body).await;
    assert_eq!(r.json(), json!({"written": 1, "announced": true}));
    assert_eq!(ages(&app, &["u_3"]).await.0, vec![64]);
    let body = json!({"entities": {"item_id": ["i_3"]}});
    let r = app.post_json("/v1/prefetch", &body).await;
    assert_eq!(r.status, 202);
}

// ------------------------------------------------------------------------------------------------------
// Prefetch and warm start

#[tokio::test]
async fn prefetch_warms_the_cache_in_the_background() {
    let redis = RedisServer::start();
    seeded(&redis).await;
    let app = gateway(&redis, |_| {}).await;
    let body = json!({"entities": {"user_id": ["u_1", "u_2"], "item_id": ["i_1", "i_2", "i_3"]}});
    let r = app.post_json("/v1/prefetch", &body).await;
    assert_eq!(r.status, 202, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json(), json!({"accepted": 5}));
    let stats = &app.gateway.telemetry.prefetch;
    eventually(Duration::from_secs(2), "the prefetch done", || async {
        stats.fetched.load(Relaxed) == 5
    })
    .await;
    let j = features(&app, "user_id", &["u_1", "u_2"], &["user_profile"], None).await;
    assert_eq!(j["cache"], json!({"hits": 2, "stale": 0, "misses": 0}));
    let j = features(
        &app,
        "item_id",
        &["i_1", "i_2", "i_3"],
        &["item_stats"],
        None,
    )
    .await;
    assert_eq!(j["cache"]["hits"], 3);

    // Only the views asked for; keys already fresh are not read again, and a key sent twice counts once.
    let body = json!({"entities": {"user_id": ["u_7", "u_1", "u_7"]}, "views": ["user_profile"]});
    let r = app.post_json("/v1/prefetch", &body).await;
    assert_eq!(r.json(), json!({"accepted": 2}));
    eventually(
        Duration::from_secs(2),
        "the second prefetch done",
        || async { stats.fetched.load(Relaxed) == 6 },
    )
    .await;
    assert_eq!(stats.cached.load(Relaxed), 1);

    for (body, status, field) in [
        (
            json!({"entities": {"user_id": ["u_1"]}, "views": ["item_stats"]}),
            400,
            "views[0]",
        ),
        (
            json!({"entities": {"user_id": ["u_1"]}, "views": ["nope"]}),
            400,
            "views[0]",
        ),
        (
            json!({"entities": {"shop_id": ["s_1"]}}),
            400,
            "entities.shop_id",
        ),
        (
            json!({"entities": {"user_id": [""]}}),
            400,
            "entities.user_id[0]",
        ),
        (json!({"entities": {}}), 400, "entities"),
    ] {
        let r = app.post_json("/v1/prefetch", &body).await;
        assert_eq!(
            r.status,
            status,
            "{body}: {}",
            String::from_utf8_lossy(&r.body)
        );
        assert_eq!(r.json()["error"]["field"], field, "{body}");
    }
}

#[tokio::test]
async fn prefetches_beyond_the_bound_get_429_with_retry_after() {
    let redis = RedisServer::start();
    seeded(&redis).await;
    let mut c = config_for(&redis);
    c.prefetch.max_concurrent = 1;
    let inner = open_store(&c).await.expect("store");
    let app = gateway_over(
        c,
        Slowed::new(inner, Duration::from_millis(400), Duration::ZERO),
    )
    .await;
    let body = serde_json::to_vec(&json!({"entities": {"user_id": ["u_1"]}})).expect("json");
    let r = app
        .post("/v1/prefetch", "application/json", body.clone())
        .await;
    assert_eq!(r.status, 202);
    let r = app
        .post("/v1/prefetch", "application/json", body.clone())
        .await;
    assert_eq!((r.status, r.code()), (429, "too_many_requests".to_owned()));
    assert!(r.headers.get("retry-after").is_some());
    let stats = &app.gateway.telemetry.prefetch;
    assert_eq!(stats.rejected.load(Relaxed), 1);
    // Once the first is done, the bound lets the next one in.
    eventually(
        Duration::from_secs(3),
        "the first prefetch done",
        || async { stats.fetched.load(Relaxed) == 1 },
    )
    .await;
    let r = app.post("/v1/prefetch", "application/json", body).await;
    assert_eq!(r.status, 202);
}

#[tokio::test]
async fn a_starting_gateway_loads_the_hottest_keys_before_it_reports_ready() {
    let redis = RedisServer::start();
    seeded(&redis).await;
    let a = gateway(&redis, |c| c.prefetch.hot_sample_every = 1).await;
    // u_1 hottest, then u_2, u_3; the others once.
    for (user, times) in [("u_1", 5), ("u_2", 4), ("u_3", 3), ("u_4", 1), ("u_5", 1)] {
        for _ in 0..times {
            ages(&a, &[user]).await;
        }
    }
    features(
        &a,
        "item_id",
        &["i_9", "i_9", "i_8"],
        &["item_stats:price"],
        None,
    )
    .await;
    hydrant::prefetch::flush_hot(&a.gateway.hydrator, 100).await;
    assert_eq!(
        a.gateway.telemetry.prefetch.hot_samples.load(Relaxed),
        17,
        "hydrant_hot_key_samples_total counts the 14 + 3 sampled lookups, not the 7 keys"
    );
    let top = redis.cmd(&["ZREVRANGE", "hy:hot:user_profile", "0", "2"]);
    let top: Vec<String> = match top {
        Reply::Array(items) => items.iter().map(Reply::text).collect(),
        other => panic!("{other:?}"),
    };
    assert_eq!(top, ["u_1", "u_2", "u_3"]);

    let b = gateway(&redis, |c| c.prefetch.warm_top_k = 3).await;
    let warm = &b.gateway.telemetry.prefetch;
    assert_eq!(
        warm.warm_keys.load(Relaxed),
        5,
        "3 users and both hot items"
    );
    assert_eq!(warm.warm_incomplete.load(Relaxed), 0);
    let (_, _, j) = ages(&b, &["u_1", "u_2", "u_3"]).await;
    assert_eq!(j["cache"]["hits"], 3, "served from the warm cache");
    let (_, _, j) = ages(&b, &["u_4"]).await;
    assert_eq!(j["cache"]["misses"], 1, "only the top 3 were loaded");
}

/// Another Redis type at one view's hot-set key (written by something else) fails that view's part of
/// a flush, not the other views' sets nor their decay, and a starting replica still warms the others.
#[tokio::test]
async fn one_views_hot_set_of_another_type_does_not_stop_the_others() {
    let redis = RedisServer::start();
    seeded(&redis).await;
    redis.cmd(&["SET", "hy:hot:item_stats", "not a sorted set"]);
    let a = gateway(&redis, |c| c.prefetch.hot_sample_every = 1).await;
    // 60 flushes, each with a lookup of both views: the 60th decays the scores (halves them).
    for _ in 0..60 {
        ages(&a, &["u_1"]).await;
        features(&a, "item_id", &["i_9"], &["item_stats:price"], None).await;
        hydrant::prefetch::flush_hot(&a.gateway.hydrator, 100).await;
    }
    let flush_errors = a.gateway.telemetry.prefetch.hot_flush_errors.load(Relaxed);
    assert_eq!(flush_errors, 60, "item_stats' part fails every time");
    let score = redis.cmd(&["ZSCORE", "hy:hot:user_profile", "u_1"]).text();
    assert_eq!(score, "30", "60 lookups, halved once");
    let b = gateway(&redis, |c| c.prefetch.warm_top_k = 3).await;
    let warm = &b.gateway.telemetry.prefetch;
    assert_eq!(warm.warm_keys.load(Relaxed), 1, "u_1 is warmed");
    assert_eq!(
        warm.warm_incomplete.load(Relaxed),
        1,
        "item_stats' set was unreadable"
    );
}

/// Replicas that sample different views: the one that decays halves every view's hot set, not only
/// those it writes itself, so a view sampled only elsewhere does not keep growing.
#[tokio::test]
async fn the_decay_halves_the_hot_sets_other_replicas_write() {
    let redis = RedisServer::start();
    seeded(&redis).await;
    let a = gateway(&redis, |c| c.prefetch.hot_sample_every = 1).await;
    let b = gateway(&redis, |c| c.prefetch.hot_sample_every = 1).await;
    // B samples only item_stats; its 60th flush decays (and lists item_stats as a hot view).
    for _ in 0..60 {
        features(&b, "item_id", &["i_9"], &["item_stats:price"], None).await;
        hydrant::prefetch::flush_hot(&b.gateway.hydrator, 100).await;
    }
    assert_eq!(
        redis.cmd(&["ZSCORE", "hy:hot:item_stats", "i_9"]).text(),
        "30"
    );
    // A minute later (the lock let go), A, which samples only user_profile, decays.
    redis.cmd(&["DEL", "hy:hot-decay"]);
    for _ in 0..60 {
        ages(&a, &["u_1"]).await;
        hydrant::prefetch::flush_hot(&a.gateway.hydrator, 100).await;
    }
    assert_eq!(
        redis.cmd(&["ZSCORE", "hy:hot:user_profile", "u_1"]).text(),
        "30"
    );
    assert_eq!(
        redis.cmd(&["ZSCORE", "hy:hot:item_stats", "i_9"]).text(),
        "15",
        "B's view halved by A's decay"
    );
    // A hot set gone is taken off the list at the next decay.
    redis.cmd(&["DEL", "hy:hot-decay", "hy:hot:item_stats"]);
    for _ in 0..60 {
        ages(&a, &["u_1"]).await;
        hydrant::prefetch::flush_hot(&a.gateway.hydrator, 100).await;
    }
    let listed = redis.cmd(&["SMEMBERS", "hy:hot-views"]);
    assert_eq!(
        listed,
        Reply::Array(vec![Reply::Bulk(Some(b"user_profile".to_vec()))]),
        "{listed:?}"
    );
}

/// Hot-set members written by another tool that name no key a request could send (bytes that are not
/// text, an empty or overlong key) are skipped at a warm start: the view's real hot keys are still
/// warmed, and the junk takes no memory.
#[tokio::test]
async fn a_warm_start_skips_hot_set_members_that_are_no_keys() {
    let redis = RedisServer::start();
    seeded(&redis).await;
    let long = "u".repeat(300);
    for (score, member) in [
        (&b"50"[..], &b"u_1"[..]),
        (b"99", b"\xff\xfe\x00bin"),
        (b"98", b""),
        (b"97", long.as_bytes()),
    ] {
        redis.cmd_bytes(&[b"ZADD", b"hy:hot:user_profile", score, member]);
    }
    let app = gateway(&redis, |c| c.prefetch.warm_top_k = 10).await;
    let warm = &app.gateway.telemetry.prefetch;
    assert_eq!(warm.warm_keys.load(Relaxed), 1, "u_1 alone is a key");
    assert_eq!(
        warm.warm_incomplete.load(Relaxed),
        0,
        "nothing cut it short"
    );
    let (_, _, j) = ages(&app, &["u_1"]).await;
    assert_eq!(j["cache"]["hits"], 1, "u_1 was warmed: {j}");
}

#[tokio::test]
async fn the_warm_start_is_bounded_by_warm_timeout() {
    let redis = RedisServer::start();
    let mut c = config_for(&redis);
    c.prefetch.warm_timeout = Duration::from_millis(200);
    let inner = open_store(&c).await.expect("store");
    let started = Instant::now();
    let app = TestApp::spawn_with(
        c,
        Slowed::new(inner, Duration::ZERO, Duration::from_secs(30)),
        None,
    )
    .await;
    let r = app.get("/v2/health/ready").await;
    assert_eq!(r.status, 503, "not ready while warming");
    // The Open Inference Protocol's answer, like every /v2 path's.
    assert_eq!(r.json(), json!({"ready": false}));
    assert_eq!(r.headers["retry-after"], "1");
    assert_eq!(app.get("/v2/health/live").await.status, 200, "but alive");
    app.wait_ready().await;
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(
        app.gateway.telemetry.prefetch.warm_incomplete.load(Relaxed),
        1
    );
}

// ------------------------------------------------------------------------------------------------------
// Redis Cluster

#[tokio::test]
async fn on_a_cluster_requests_across_hash_slots_are_served_and_invalidated() {
    let redis = RedisServer::start_cluster();
    assert!(redis.url().starts_with("redis-cluster://"));
    // Demo rows across all slots (pipelined SETs: MULTI would fail with CROSSSLOT).
    seeded(&redis).await;
    let a = gateway(&redis, |_| {}).await;
    let b = gateway(&redis, |_| {}).await;
    let items = demo_rows("item_stats", "item_id");
    let keys: Vec<String> = (0..50).map(|i| format!("i_{i}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let j = features(&a, "item_id", &refs, &["item_stats:impressions_7d"], None).await;
    assert_eq!(j["degraded"], false, "{j}");
    for (i, k) in keys.iter().enumerate() {
        assert_eq!(
            j["features"]["item_stats:impressions_7d"]["values"][i], items[k]["impressions_7d"],
            "{k}"
        );
    }
    let candidates: Vec<Json> = refs.iter().map(|k| json!({"item_id": k})).collect();
    let r = a
        .predict(
            "ctr",
            &json!({"entities": {"user_id": "u_1"}, "candidates": candidates}),
        )
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["degraded"], false);

    assert_eq!(ages(&b, &["u_11"]).await.1, vec!["PRESENT".to_owned()]);
    let body = json!({"rows": [{"user_id": "u_11", "age": 99}, {"user_id": "u_12", "age": 98}]});
    let r = a.post_json("/v1/views/user_profile/rows", &body).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    eventually(
        Duration::from_secs(1),
        "b sees the write over the cluster",
        || async { ages(&b, &["u_11", "u_12"]).await.0 == vec![99, 98] },
    )
    .await;
}

/// The hash slot Redis Cluster gives `key` (no hash tags in hydrant's keys): CRC16-XMODEM modulo 16384,
/// computed here to find ids in a given slot without a round trip each.
fn key_slot(key: &str) -> u16 {
    let mut crc: u16 = 0;
    for &byte in key.as_bytes() {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % 16384
}

/// Schemas whose views wait up to 5 s for the store, for [`patient`].
fn patient_schemas() -> tempfile::TempDir {
    let dir = common::schemas_with_edit("user_profile.yaml", "timeout: 50ms", "timeout: 5s");
    let items = dir.path().join("item_stats.yaml");
    let text = std::fs::read_to_string(&items).expect("read");
    assert!(
        text.contains("timeout: 50ms"),
        "item_stats.yaml holds its store timeout"
    );
    std::fs::write(&items, text.replace("timeout: 50ms", "timeout: 5s")).expect("write");
    dir
}

/// `c` on `schemas` (from [`patient_schemas`]), with Redis commands that may take 5 s. A read that follows
/// a redirection makes several round trips in a row, which a loaded test machine can stretch past the
/// default 50 ms bounds; defaults served for a timeout would then look like a redirection not followed.
fn patient(c: &mut hydrant::config::Config, schemas: &tempfile::TempDir) {
    c.registry.schemas = schemas.path().to_owned();
    c.store.redis.command_timeout = Duration::from_secs(5);
}

/// Resharding moves a slot's keys one by one: while it runs, the old owner answers for a moved key with
/// an `ASK` redirection, and once it ends, with `MOVED`. Reads and writes follow both: a read serves the
/// stored value, not defaults for the length of the migration, and the store's connections survive it
/// (fred 10.1, following an `ASK` itself, failed the command and closed the client for good).
#[tokio::test]
async fn on_a_cluster_reads_and_writes_follow_a_slot_being_migrated_and_its_new_owner() {
    let (a, b) = RedisServer::start_cluster_pair();
    let store = seeded(&a).await;
    let schemas = patient_schemas();
    let app = gateway(&a, |c| patient(c, &schemas)).await;
    let rows = demo_rows("user_profile", "user_id");
    let key = |user: &str| format!("hy:user_profile:{user}");
    // Demo users whose keys live on `a`, and a user written for the test into the slot of the first.
    let mut on_a = rows.keys().filter(|u| key_slot(&key(u)) <= 8191);
    let moving = on_a.next().expect("a demo user on the first node").clone();
    let later: Vec<String> = on_a.take(2).cloned().collect();
    let slot = a.key_slot(&key(&moving));
    let staying = (0..)
        .map(|i| format!("s_{i}"))
        .find(|u| key_slot(&key(u)) == slot)
        .expect("an id in the slot");
    assert_eq!(a.key_slot(&key(&staying)), slot);
    let body = json!({"rows": [{"user_id": staying, "age": 77}]});
    let r = app.post_json("/v1/views/user_profile/rows", &body).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let age = |user: &str| {
        rows.get(user)
            .map_or(77, |r| r["age"].as_i64().expect("age"))
    };

    // Mid-migration: `moving` is on `b` now (ASK), `staying` still on `a`; neither is cached.
    let stored = a.cmd(&["GET", &key(&moving)]).bytes();
    assert!(stored.is_some());
    a.migrate_key(&b, &key(&moving));
    assert_eq!(a.cmd(&["GET", &key(&moving)]).text().get(..3), Some("ASK"));
    let (values, statuses, j) = ages(&app, &[&moving, &staying]).await;
    assert_eq!(j["degraded"], false, "{j}");
    assert_eq!(statuses, ["PRESENT", "PRESENT"], "{j}");
    assert_eq!(values, [age(&moving), age(&staying)]);
    // More reads than the pool has connections, each redirected: every one is served.
    for _ in 0..10 {
        let got = store.get_many(&[key(&moving), key(&staying)]).await;
        assert_eq!(got.expect("a read mid-migration")[0], stored);
    }
    // A write of a moved key lands on the node importing it; one of a key not moved yet, on its owner.
    let body = json!({"rows": [{"user_id": moving, "age": 55}, {"user_id": staying, "age": 66}]});
    let r = app.post_json("/v1/views/user_profile/rows", &body).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(ages(&app, &[&moving, &staying]).await.0, [55, 66]);
    // `a` holds no `moving` (it redirects), but `staying`.
    assert_eq!(a.cmd(&["GET", &key(&moving)]).text().get(..3), Some("ASK"));
    assert_eq!(a.cmd(&["EXISTS", &key(&staying)]), Reply::Int(1));

    // The migration ends: `b` owns the slot, and `a` answers MOVED for all of it, which the gateway
    // learns from its first read there.
    a.migrate_key(&b, &key(&staying));
    a.hand_over_slot(&b, slot);
    for user in &later {
        let slot = a.migrate_key(&b, &key(user));
        a.hand_over_slot(&b, slot);
    }
    let (values, statuses, j) = ages(&app, &[&later[0], &later[1]]).await;
    assert_eq!(j["degraded"], false, "{j}");
    assert_eq!(statuses, ["PRESENT", "PRESENT"], "{j}");
    assert_eq!(values, [age(&later[0]), age(&later[1])]);
    let body = json!({"rows": [{"user_id": moving, "age": 44}]});
    let r = app.post_json("/v1/views/user_profile/rows", &body).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(ages(&app, &[&moving, &staying]).await.0, [44, 66]);
}

/// Adding a primary: slots are moved to a node that owns none yet, which the gateway's connections,
/// made from the cluster's slot map, do not reach. Reads and writes of the keys moved there are still
/// served, and once the node owns the slot, its `MOVED` brings it into the slot map.
#[tokio::test]
async fn on_a_cluster_keys_moved_to_a_node_just_added_are_served() {
    let (a, _b) = RedisServer::start_cluster_pair();
    let store = seeded(&a).await;
    let schemas = patient_schemas();
    let app = gateway(&a, |c| patient(c, &schemas)).await;
    let c = RedisServer::join_empty_node(&a);
    let rows = demo_rows("user_profile", "user_id");
    let key = |user: &str| format!("hy:user_profile:{user}");
    let mut on_a = rows.keys().filter(|u| key_slot(&key(u)) <= 8191);
    let (moving, written) = (
        on_a.next().expect("a demo user on a").clone(),
        on_a.next().expect("another").clone(),
    );
    let age = |user: &str| rows[user]["age"].as_i64().expect("age");

    let slot = a.migrate_key(&c, &key(&moving));
    let (values, statuses, j) = ages(&app, &[&moving]).await;
    assert_eq!(j["degraded"], false, "{j}");
    assert_eq!(
        (values, statuses),
        (vec![age(&moving)], vec!["PRESENT".to_owned()])
    );

    // A write of a key moved there lands there.
    let other = a.migrate_key(&c, &key(&written));
    let body = json!({"rows": [{"user_id": written, "age": 12}]});
    let r = app.post_json("/v1/views/user_profile/rows", &body).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(
        c.cmd_asking(&["EXISTS", &key(&written)]),
        Reply::Int(1),
        "written on the new node"
    );
    assert_eq!(ages(&app, &[&written]).await.0, [12]);

    // Many commands at this store's first contact with the node (the seeding store has not met it),
    // eight of them for one key: one connection, and the last write wins. New keys in the two slots
    // being moved: the old owner sends them on with ASK. Raw bytes: the store does not read them.
    let in_slot = |s: u16| {
        (0..)
            .map(|i| key(&format!("x_{i}")))
            .find(|k| key_slot(k) == s)
            .expect("a key in the slot")
    };
    let (x, y) = (in_slot(other), in_slot(slot));
    let writes: Vec<(String, Vec<u8>)> = (0..8)
        .map(|i| (x.clone(), format!("v{i}").into_bytes()))
        .chain([(y.clone(), b"y".to_vec())])
        .collect();
    store.put_many(writes, None).await.expect("written");
    let got = store.get_many(&[x.clone(), y.clone()]).await.expect("read");
    assert_eq!(got, [Some(b"v7".to_vec()), Some(b"y".to_vec())]);
    assert_eq!(c.cmd_asking(&["GET", &x]).bytes(), Some(b"v7".to_vec()));

    // The moves end: the new node owns both slots.
    for s in [slot, other] {
        a.hand_over_slot(&c, s);
    }
    let body = json!({"rows": [{"user_id": moving, "age": 13}]});
    let r = app.post_json("/v1/views/user_profile/rows", &body).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(ages(&app, &[&moving, &written]).await.0, [13, 12]);
    assert_eq!(c.cmd(&["EXISTS", &key(&moving)]), Reply::Int(1));
}

/// The hot sets are written through a resharding too, each command once: one view's set moved to the
/// node importing its slot (its commands redirected with `ASK`), the other's not, and no count is
/// added twice (a pipeline failed by one redirection, sent again whole, would add the other view's
/// again).
#[tokio::test]
async fn on_a_cluster_hot_sets_are_counted_once_while_one_of_them_is_migrated() {
    let (a, b) = RedisServer::start_cluster_pair();
    let store = seeded(&a).await;
    let counts = |n: u32| {
        ["user_profile", "item_stats"].map(|view| hydrant::store::HotCounts {
            view: view.to_owned(),
            keys: vec![("k_1".to_owned(), n)],
        })
    };
    store
        .record_hot(&counts(3), 100)
        .await
        .expect("first flush");
    let (moved, kept) = ("hy:hot:user_profile", "hy:hot:item_stats");
    let owner = |key: &str| {
        if key_slot(key) <= 8191 {
            (&a, &b)
        } else {
            (&b, &a)
        }
    };
    let (from, to) = owner(moved);
    from.migrate_key(to, moved);
    assert_eq!(
        from.cmd(&["ZSCORE", moved, "k_1"]).text().get(..3),
        Some("ASK")
    );

    store
        .record_hot(&counts(4), 100)
        .await
        .expect("flush mid-migration");
    assert_eq!(to.cmd_asking(&["ZSCORE", moved, "k_1"]).text(), "7");
    assert_eq!(owner(kept).0.cmd(&["ZSCORE", kept, "k_1"]).text(), "7");
    for view in ["user_profile", "item_stats"] {
        assert_eq!(
            store.hottest(view, 5).await.expect("top"),
            ["k_1"],
            "{view}"
        );
    }
    // A flush trims each set after its increments: kept to the hottest one, k_2 (1) goes, k_1 (7)
    // stays. Trimmed first, both would stay.
    let k2 = ["user_profile", "item_stats"].map(|view| hydrant::store::HotCounts {
        view: view.to_owned(),
        keys: vec![("k_2".to_owned(), 1)],
    });
    store.record_hot(&k2, 1).await.expect("flush kept to one");
    let only_k1 = Reply::Array(vec![Reply::Bulk(Some(b"k_1".to_vec()))]);
    assert_eq!(to.cmd_asking(&["ZRANGE", moved, "0", "-1"]), only_k1);
    assert_eq!(owner(kept).0.cmd(&["ZRANGE", kept, "0", "-1"]), only_k1);
}

/// On a cluster a batch is pipelined SETs, which can fail in part. The part that landed must not
/// stay hidden behind cached values: the writer drops the keys, and the other replicas are told.
/// The partial failure is real: the writer's Redis user may write one of the two keys only (ACL).
#[tokio::test]
async fn a_cluster_batch_that_fails_in_part_still_announces_its_keys() {
    let redis = RedisServer::start_cluster();
    seeded(&redis).await;
    let r = redis.cmd(&[
        "ACL",
        "SETUSER",
        "limited",
        "on",
        ">limited-pw-0123",
        "%R~*",
        "%W~hy:user_profile:u_11",
        "&*",
        "+@all",
    ]);
    assert_eq!(r, Reply::Status("OK".into()), "{r:?}");
    let a = gateway(&redis, |c| {
        c.store.redis.url = format!(
            "redis-cluster://limited:limited-pw-0123@127.0.0.1:{}",
            redis.port()
        );
    })
    .await;
    let b = gateway(&redis, |_| {}).await;
    let before = ages(&b, &["u_11", "u_12"]).await;
    assert_eq!(before.1, ["PRESENT", "PRESENT"]);
    assert_eq!(
        ages(&a, &["u_11", "u_12"]).await.0,
        before.0,
        "a has them cached"
    );

    let body = json!({"rows": [{"user_id": "u_11", "age": 99}, {"user_id": "u_12", "age": 98}]});
    let r = a.post_json("/v1/views/user_profile/rows", &body).await;
    assert_eq!(r.status, 503, "{}", String::from_utf8_lossy(&r.body));
    let error = &r.json()["error"];
    assert_eq!(error["code"], "store_unavailable", "{error}");
    let message = error["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("only some of the rows")
            && message
                .contains("1 of 2 keys stored; 1 not, the first of them hy:user_profile:u_12"),
        "{message}"
    );
    // u_11 landed, u_12 did not: both gateways serve what is stored, not what they had cached.
    let stored = vec![99, before.0[1]];
    assert_eq!(ages(&a, &["u_11", "u_12"]).await.0, stored, "the writer");
    eventually(
        Duration::from_secs(2),
        "b drops the announced keys",
        || async { ages(&b, &["u_11", "u_12"]).await.0 == stored },
    )
    .await;
}

// ------------------------------------------------------------------------------------------------------
// TLS

#[tokio::test]
async fn a_tls_url_connects_when_the_server_certificate_is_trusted() {
    let redis = RedisServer::start_tls();
    assert!(redis.url().starts_with("rediss://"));
    let mut c = config_for(&redis);
    // The test CA is not among the system's roots: refused, naming the key that would trust it.
    let e = format!(
        "{:#}",
        open_store(&c).await.err().expect("untrusted certificate")
    );
    assert!(
        e.contains("Redis") && e.contains("store.redis.tls_ca_file"),
        "{e}"
    );
    c.store.redis.tls_ca_file = redis.ca_file();
    let store = open_store(&c).await.expect("TLS with the test CA");
    load_demo_rows(&store).await;
    let app = gateway_over(c, store).await;
    let want = demo_rows("user_profile", "user_id")["u_8"]["age"]
        .as_i64()
        .expect("age");
    assert_eq!(ages(&app, &["u_8"]).await.0, vec![want]);
    let body = json!({"rows": [{"user_id": "u_8", "age": 19}]});
    let r = app.post_json("/v1/views/user_profile/rows", &body).await;
    assert_eq!(r.json()["announced"], true, "pub/sub over TLS too");
    assert_eq!(ages(&app, &["u_8"]).await.0, vec![19]);
}

/// On a cluster, one reconnection of the subscriber (each node's connection, dropped at once) flushes
/// the cache once, not once per node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_a_subscriber_reconnection_flushes_the_cache_once() {
    let (a, b) = RedisServer::start_cluster_pair();
    let app = gateway(&a, |_| {}).await;
    for node in [&a, &b] {
        node.cmd(&["CLIENT", "KILL", "TYPE", "pubsub"]);
        node.cmd(&["CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"]);
    }
    eventually(
        Duration::from_secs(10),
        "a flush after the subscription was lost",
        || async { flushes(&app) >= 1 },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(flushes(&app), 1, "flushes");
}

/// Rows written while a registration moves their view to a new version: they were encoded under the
/// version before, which the view no longer reads, so answered 200 they would be served as defaults.
/// The write is held (Redis paused) while the registration lands; the gateway then writes the rows
/// again in the view's new shape, and they are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_written_while_their_view_changes_version_are_written_again_in_its_new_shape() {
    let redis = RedisServer::start();
    let dir = common::schemas_with_ctr_edit("version: 1", "version: 1");
    let schemas = dir.path().to_owned();
    let app = Arc::new(
        gateway(&redis, |c| {
            c.registry.schemas = schemas;
            c.registry.writes = true;
        })
        .await,
    );
    redis.pause();
    let writer = app.clone();
    let write = tokio::spawn(async move {
        let body = json!({"rows": [{"user_id": "u_race", "age": 33, "country": "de", "is_premium": true}]});
        writer.post_json("/v1/views/user_profile/rows", &body).await
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let v1 = std::fs::read_to_string(dir.path().join("user_profile.yaml")).expect("view file");
    assert!(v1.contains("version: 1"), "{v1}");
    let v2 = v1.replacen("version: 1", "version: 2", 1);
    let registered = app.put_yaml("/v1/schemas/views/user_profile", &v2).await;
    assert_eq!(
        registered.status,
        200,
        "{}",
        String::from_utf8_lossy(&registered.body)
    );
    redis.resume();
    let r = write.await.expect("write task");
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let body = json!({"entities": {"user_id": ["u_race"]}, "features": ["user_profile:age"]});
    let j = app.post_json("/v1/features", &body).await.json();
    assert_eq!(
        (
            &j["features"]["user_profile:age"]["values"][0],
            &j["features"]["user_profile:age"]["statuses"][0]
        ),
        (&json!(33), &json!("PRESENT")),
        "{j}"
    );

    // Version 3 adds `x`; version 4, registered while a row carrying `x` as an integer is written,
    // makes it a string: the row cannot follow, and the answer says which field and which versions.
    let v3 = v1.replacen("version: 1", "version: 3", 1).replacen(
        "  - {name: age, dtype: int64, default: 30}\n",
        "  - {name: age, dtype: int64, default: 30}\n  - {name: x, dtype: int64, default: 0}\n",
        1,
    );
    let v4 = v3.replacen("version: 3", "version: 4", 1).replacen(
        "{name: x, dtype: int64, default: 0}",
        "{name: x, dtype: string, default: \"\"}",
        1,
    );
    let register = |doc: String| {
        let app = app.clone();
        async move {
            app.client
                .put(format!("{}/v1/schemas/views/user_profile", app.addr))
                .header("content-type", "application/yaml")
                .body(doc)
                .send()
                .await
                .expect("registration sent")
        }
    };
    let r = register(v3).await;
    assert_eq!(r.status(), 200, "{:?}", r.text().await);
    redis.pause();
    let writer = app.clone();
    let write = tokio::spawn(async move {
        let body = json!({"rows": [{"user_id": "u_x", "age": 34, "x": 7}]});
        writer.post_json("/v1/views/user_profile/rows", &body).await
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let r = register(v4).await;
    assert_eq!(r.status(), 200, "{:?}", r.text().await);
    redis.resume();
    let r = write.await.expect("write task");
    assert_eq!(r.status, 409, "{}", String::from_utf8_lossy(&r.body));
    let e = r.json()["error"].clone();
    assert_eq!(e["code"], "view_changed", "{e}");
    assert_eq!(e["field"], "rows[0].x", "{e}");
    let message = e["message"].as_str().unwrap_or_default();
    assert!(message.contains("from version 3 to 4"), "{message}");
}
