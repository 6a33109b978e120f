//! Thousands of mutated requests against the real gateway: every one gets a 2xx or a 4xx with a proper
//! error body (never a 5xx, a dropped connection or a hang), and afterwards the gateway still answers
//! valid requests with the same scores as before.
//!
//! The mutations are seeded, so a failure names a case that can be replayed. `MUTATION_CASES=N` runs
//! N cases per endpoint and format instead of the default (for a longer campaign on a workstation);
//! `MUTATION_SEED=S` starts from another seed.

mod common;

use std::time::Duration;

use common::TestApp;
use common::mutate::{REQUEST_NAMES, Rng, describe, env_number, mutated};
use serde_json::{Value as Json, json};

/// Bodies no mutation of a valid one is likely to reach.
fn crafted() -> Vec<(&'static str, Vec<u8>)> {
    let deep_json = |n: usize| {
        let mut s = String::from(r#"{"entities": {"user_id": "u_1"}, "context": {"device": "#);
        s.push_str(&"[".repeat(n));
        s.push_str(&"]".repeat(n));
        s.push_str("}}");
        s.into_bytes()
    };
    // {"entities": [[[[...]]]]} in MessagePack: fixmap(1), fixstr "entities", then n fixarrays of one.
    let deep_msgpack = |n: usize| {
        let mut b = vec![0x81, 0xa8];
        b.extend_from_slice(b"entities");
        b.extend(std::iter::repeat_n(0x91, n));
        b.push(0xc0);
        b
    };
    // A map with an integer key, a binary value and an extension value.
    let odd_msgpack = vec![
        0x83, 0x01, 0x02, 0xa7, b'o', b'p', b't', b'i', b'o', b'n', b's', 0xc4, 0x02, 0xff, 0x00,
        0xa7, b'c', b'o', b'n', b't', b'e', b'x', b't', 0xd4, 0x05, 0x01,
    ];
    // A map that claims 2^32 - 1 entries and a string that claims 2^32 - 1 bytes.
    let huge_claims = vec![
        0xdf, 0xff, 0xff, 0xff, 0xff, 0xdb, 0xff, 0xff, 0xff, 0xff, b'x',
    ];
    vec![
        ("application/json", deep_json(100)),
        ("application/json", deep_json(200_000)),
        ("application/msgpack", deep_msgpack(100)),
        ("application/msgpack", deep_msgpack(500)),
        ("application/msgpack", deep_msgpack(1_023)),
        ("application/msgpack", deep_msgpack(200_000)),
        ("application/msgpack", odd_msgpack),
        ("application/msgpack", huge_claims),
        ("application/json", b"".to_vec()),
        ("application/msgpack", b"".to_vec()),
        ("application/json", b"null".to_vec()),
        ("application/json", b"\xef\xbb\xbf{}".to_vec()),
        (
            "application/json",
            br#"{"entities": {"user_id": "u_1"}} trailing"#.to_vec(),
        ),
        (
            "application/json",
            br#"{"entities": {"user_id": "\ud800"}}"#.to_vec(),
        ),
        (
            "application/json",
            br#"{"entities": {"user_id": "u_1", "user_id": "u_2"}}"#.to_vec(),
        ),
        (
            "application/json",
            format!(
                r#"{{"entities": {{"user_id": "u_1"}}, "context": {{"hour_of_day": 1{}}}}}"#,
                "0".repeat(400)
            )
            .into_bytes(),
        ),
    ]
}

/// Sends one body; a dropped connection or a hang fails the test.
async fn send(
    client: &reqwest::Client,
    addr: &str,
    path: &str,
    content_type: &str,
    body: Vec<u8>,
    case: &str,
) -> (u16, Vec<u8>) {
    let len = body.len();
    let resp = client
        .post(format!("{addr}{path}"))
        .header("content-type", content_type)
        .body(body)
        .send()
        .await
        .unwrap_or_else(|e| panic!("{path}: no answer to {case} ({len} bytes): {e:?}"));
    let status = resp.status().as_u16();
    let body = resp
        .bytes()
        .await
        .unwrap_or_else(|e| panic!("{path}: the answer to {case} broke off: {e:?}"));
    (status, body.to_vec())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutated_requests_get_2xx_or_a_named_4xx_and_change_nothing() {
    let app = TestApp::spawn().await;
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .expect("client");
    let cases = env_number("MUTATION_CASES", 300);
    let seed = env_number("MUTATION_SEED", 0x0068_7964_7261_6e74);

    let meta = app.get("/v2/models/ctr").await.json();
    let input = meta["inputs"][0]["name"]
        .as_str()
        .expect("input name")
        .to_owned();
    let width = meta["inputs"][0]["shape"][1].as_u64().expect("input width") as usize;

    let valid_predict = json!({
        "entities": {"user_id": "u_24"},
        "context": {"hour_of_day": 20, "device": "ios"},
        "candidates": [{"item_id": "i_1"}, {"item_id": "i_10"}, {"item_id": "i_unknown"}],
        "options": {"timings": true, "return_features": false, "deadline_ms": 500},
    });
    let before = app.settled_predict("ctr", &valid_predict).await;
    let scores_before = common::scores(&before.json());

    // Endpoints that only read, then the writes (whose mutated rows may be valid and change data).
    let seeds: Vec<(&str, Json, bool)> = vec![
        ("/v1/models/ctr/predict", valid_predict.clone(), true),
        (
            "/v2/models/ctr/infer",
            json!({"id": "r1", "inputs": [{"name": input, "shape": [2, width], "datatype": "FP32",
                   "data": vec![0.25f32; 2 * width]}], "outputs": [{"name": "score"}]}),
            false,
        ),
        (
            "/v1/features",
            json!({"entities": {"user_id": ["u_1", "u_2"], "item_id": ["i_7"]},
                   "features": ["user_profile:age", "item_stats"]}),
            true,
        ),
        (
            "/v1/prefetch",
            json!({"entities": {"user_id": ["u_3", "u_4"], "item_id": ["i_8"]}}),
            true,
        ),
        (
            "/get-online-features",
            json!({"entities": {"user_id": ["u_1", "u_2"], "item_id": ["i_7", "i_unknown"]},
                   "features": ["user_profile:age", "item_stats:price"], "full_feature_names": false}),
            true,
        ),
        (
            "/get-online-features",
            json!({"entities": {"user_id": [1, "u_2"], "item_id": ["i_7", "i_8"]},
                   "feature_service": "ctr", "full_feature_names": true, "request_context": {}}),
            true,
        ),
        // A schema change, dry run: JSON is read as YAML. A valid mutation loads ctr once to check it.
        (
            "/v1/schemas:validate",
            json!({"kind": "view", "name": "user_profile", "version": 2, "entity": "user_id",
                   "max_age": "365d", "cache": {"ttl": "10m", "refresh_after": "2m"},
                   "features": [{"name": "age", "dtype": "int64", "default": 30},
                                {"name": "country", "dtype": "string", "default": "unknown"},
                                {"name": "is_premium", "dtype": "bool", "default": false},
                                {"name": "avg_session_minutes", "dtype": "float32", "default": 10.0},
                                {"name": "embedding", "dtype": "float32[4]", "default": [0, 0, 0, 0]}]}),
            false,
        ),
    ];
    let writes: Vec<(&str, Json, bool)> = vec![
        (
            "/v1/views/user_profile/rows",
            json!({"rows": [{"user_id": "u_fuzz", "age": 31, "country": "de", "is_premium": true,
                   "avg_session_minutes": 12.5, "embedding": [0.1, 0.2, 0.3, 0.4],
                   "event_timestamp": 1_700_000_000_000i64}]}),
            false,
        ),
        (
            "/v1/views/item_stats/rows",
            json!({"rows": [{"item_id": "i_fuzz", "price": 9.99, "ctr_7d": 0.02}]}),
            false,
        ),
    ];

    let mut rng = Rng(seed);
    let mut statuses = std::collections::BTreeMap::<u16, u64>::new();
    for (round, list) in [seeds, writes].into_iter().enumerate() {
        for (path, valid, msgpack_too) in list {
            let formats: &[&str] = if msgpack_too {
                &["application/json", "application/msgpack"]
            } else {
                &["application/json"]
            };
            for &format in formats {
                for i in 0..cases {
                    let case_seed = rng.next();
                    let mut r = Rng(case_seed);
                    let body = mutated(&mut r, REQUEST_NAMES, &[], Some(valid.clone()), |t| {
                        if format == "application/json" {
                            serde_json::to_vec(t).ok()
                        } else {
                            rmp_serde::to_vec_named(t).ok()
                        }
                    });
                    let case = format!(
                        "case {i} (seed {case_seed:#x}, {format}): {}",
                        describe(&body)
                    );
                    let (status, answer) =
                        send(&client, &app.addr, path, format, body, &case).await;
                    common::check_answer(path, &case, status, &answer);
                    *statuses.entry(status).or_default() += 1;
                }
            }
            if round == 0 {
                for (format, body) in crafted() {
                    let case = format!("a crafted body ({format}): {}", describe(&body));
                    let (status, answer) =
                        send(&client, &app.addr, path, format, body, &case).await;
                    common::check_answer(path, &case, status, &answer);
                    *statuses.entry(status).or_default() += 1;
                }
            }
        }
        if round == 0 {
            // Nothing the reads were sent changed what a valid request is answered.
            let after = app.predict("ctr", &valid_predict).await;
            assert_eq!(after.status, 200);
            assert_eq!(common::scores(&after.json()), scores_before);
        }
    }
    eprintln!("statuses over the run: {statuses:?}");
    // The mutations must reach the decoders' acceptance as well as their refusals, or they test little.
    assert!(statuses.range(200..300).count() > 0, "{statuses:?}");
    assert!(
        statuses.keys().filter(|s| (400..500).contains(*s)).count() >= 3,
        "{statuses:?}"
    );
    // The gateway still serves after the writes.
    let after = app.predict("ctr", &valid_predict).await;
    assert_eq!(after.status, 200);
    assert_eq!(app.get("/v2/health/live").await.status, 200);
    app.stop().await;
}

/// One request over a fresh connection, as raw bytes; the status and the body (empty when hyper refused
/// the head itself).
async fn raw(addr: &str, request: &[u8]) -> (u16, Vec<u8>) {
    let mut answer = common::exchange(addr, request, &describe(request)).await;
    // An `Expect: 100-continue` may get an interim answer first.
    let interim = b"HTTP/1.1 100 Continue\r\n\r\n";
    if answer.starts_with(interim) {
        answer.drain(..interim.len());
    }
    let head_end = answer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no answer head to {}", describe(request)));
    let status = std::str::from_utf8(&answer[9..12])
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {}", describe(&answer)));
    (status, answer[head_end + 4..].to_vec())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutated_paths_and_headers_get_2xx_or_a_named_4xx() {
    let app = TestApp::spawn().await;
    let cases = env_number("MUTATION_CASES", 300);
    let mut rng = Rng(env_number("MUTATION_SEED", 0x0068_7964_7261_6e74) ^ 0x5eed);
    const SEGMENTS: &[&str] = &[
        "ctr",
        "c%74r",
        "%63%74%72",
        "nope",
        "",
        "%",
        "%zz",
        "%ff%fe",
        "%00",
        "..",
        ".",
        "ctr%2Fpredict",
        "user_profile",
        "item_stats",
        "u%CC%88",
        "~!$&'()*+,;=:@",
    ];
    const SHAPES: &[&str] = &[
        "/v1/models/{}/predict",
        "/v2/models/{}/infer",
        "/v2/models/{}",
        "/v2/models/{}/ready",
        "/v1/views/{}/rows",
        "/v1/{}",
        "/{}",
    ];
    const CONTENT_TYPES: &[&str] = &[
        "application/json",
        "application/msgpack",
        "application/x-msgpack",
        "APPLICATION/JSON; charset=utf-8",
        "application/json; charset=utf-16",
        "application/json;;;",
        "text/plain",
        "*/*",
        "",
        "application/",
        "multipart/form-data; boundary=x",
    ];
    const ACCEPTS: &[&str] = &[
        "application/json",
        "application/msgpack",
        "application/msgpack;q=0, application/json;q=0",
        "*/*;q=0",
        "application/json;q=abc",
        "application/json;q=2",
        "application/json;q=-1",
        "text/html",
        ",,,,",
        "application/json;q=0.5, application/msgpack;q=0.5",
    ];
    let body = br#"{"entities": {"user_id": "u_1", "item_id": "i_1"}}"#;
    let mut statuses = std::collections::BTreeMap::<u16, u64>::new();
    for i in 0..cases {
        // Half the cases keep the path and method right, so the headers reach the handlers.
        let right = rng.chance(50);
        let segment: String = if right {
            "ctr".to_owned()
        } else {
            (0..1 + rng.below(2))
                .map(|_| *rng.pick(SEGMENTS))
                .collect::<Vec<_>>()
                .join(if rng.chance(20) { "/" } else { "" })
        };
        let shape = if right {
            *rng.pick(&SHAPES[..2])
        } else {
            *rng.pick(SHAPES)
        };
        let path = shape.replace("{}", &segment);
        let method = if right {
            "POST"
        } else {
            *rng.pick(&["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS"])
        };
        let mut head = format!("{method} {path} HTTP/1.1\r\nhost: h\r\nconnection: close\r\n");
        for _ in 0..rng.below(4) {
            let line = match rng.below(5) {
                0 => format!("content-type: {}", rng.pick(CONTENT_TYPES)),
                1 => format!("accept: {}", rng.pick(ACCEPTS)),
                2 => format!(
                    "x-request-id: {}",
                    rng.pick(&["r-1", "", "with space", &"x".repeat(200), "ü"])
                ),
                3 => format!(
                    "content-encoding: {}",
                    rng.pick(&["identity", "gzip", "", "br, identity"])
                ),
                _ => format!("expect: {}", rng.pick(&["100-continue", "nonsense"])),
            };
            head.push_str(&line);
            head.push_str("\r\n");
        }
        let mut request = head.into_bytes();
        if method == "GET" || method == "HEAD" || rng.chance(10) {
            request.extend_from_slice(b"\r\n");
        } else {
            request.extend_from_slice(format!("content-length: {}\r\n\r\n", body.len()).as_bytes());
            request.extend_from_slice(body);
        }
        let (status, answer) = raw(&app.addr, &request).await;
        *statuses.entry(status).or_default() += 1;
        let case = format!("case {i}: {}", describe(&request));
        assert!(
            (200..300).contains(&status) || (400..500).contains(&status),
            "{status} to {case}: {}",
            describe(&answer)
        );
        // hyper answers a head it cannot parse itself, with no body; every other refusal says why.
        if status >= 400 && !answer.is_empty() {
            let err: Json = serde_json::from_slice(&answer)
                .unwrap_or_else(|e| panic!("the {status} to {case} is not JSON ({e})"));
            let message = if path.starts_with("/v2") {
                err["error"].as_str()
            } else {
                err["error"]["message"].as_str()
            };
            assert!(
                message.is_some_and(|m| !m.is_empty()),
                "the {status} to {case} has no message: {err}"
            );
        } else if status >= 400 && method != "HEAD" {
            assert!(
                status == 400 && path.contains('%') || path.contains(' '),
                "a bare {status} to {case}"
            );
        }
    }
    eprintln!("statuses over the run: {statuses:?}");
    assert!(statuses.range(200..300).count() > 0, "{statuses:?}");
    let r = app
        .predict(
            "ctr",
            &json!({"entities": {"user_id": "u_1", "item_id": "i_1"}}),
        )
        .await;
    assert_eq!(r.status, 200);
    app.stop().await;
}
