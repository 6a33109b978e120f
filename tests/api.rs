//! The gateway end to end on the embedded store: real app on port 0, real ONNX Runtime, demo schemas and rows.

mod common;

use common::{TestApp, demo_rows, root, scores};
use serde_json::{Value as Json, json};

// ------------------------------------------------------------------------------------------------------
// An independent computation of the demo model: the input layout of models/README.md and a plain MLP
// forward pass over models/ctr.weights.json. Nothing here calls hydrant's code.

fn fnv(s: &str) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for b in s.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}

fn get<'a>(row: Option<&'a Json>, f: &str) -> Option<&'a Json> {
    row.and_then(|r| r.get(f)).filter(|v| !v.is_null())
}

fn num(row: Option<&Json>, f: &str, default: f64) -> f64 {
    get(row, f).and_then(Json::as_f64).unwrap_or(default)
}

fn text<'a>(row: Option<&'a Json>, f: &str, default: &'a str) -> &'a str {
    get(row, f).and_then(Json::as_str).unwrap_or(default)
}

fn one_hot(v: &str, vocab: &[&str], out: &mut Vec<f64>) {
    out.extend(vocab.iter().map(|w| if *w == v { 1.0 } else { 0.0 }));
}

fn list(row: Option<&Json>, f: &str, out: &mut Vec<f64>) {
    match get(row, f).and_then(Json::as_array) {
        Some(a) => out.extend(a.iter().map(|x| x.as_f64().expect("number"))),
        None => out.extend([0.0; 4]),
    }
}

fn bucket(x: f64, bounds: &[f64]) -> f64 {
    bounds.iter().filter(|b| x >= **b).count() as f64
}

fn vector(
    user: Option<&Json>,
    item: Option<&Json>,
    hour: Option<i64>,
    device: Option<&str>,
) -> Vec<f64> {
    let mut v = Vec::with_capacity(27);
    v.push((num(user, "age", 30.0) - 40.0) / 12.0);
    v.push(
        if get(user, "is_premium")
            .and_then(Json::as_bool)
            .unwrap_or(false)
        {
            1.0
        } else {
            0.0
        },
    );
    v.push(num(user, "avg_session_minutes", 10.0).ln_1p());
    one_hot(
        text(user, "country", "unknown"),
        &["us", "de", "in", "br"],
        &mut v,
    );
    list(user, "embedding", &mut v);
    one_hot(
        text(item, "category", "other"),
        &["sports", "tech", "fashion", "food"],
        &mut v,
    );
    v.push((fnv(text(item, "brand", "unknown")) % 16) as f64);
    v.push(num(item, "price", 20.0).ln_1p());
    v.push(num(item, "ctr_7d", 0.01).clamp(0.0, 0.5));
    v.push(bucket(
        num(item, "impressions_7d", 0.0),
        &[10.0, 100.0, 1000.0, 10000.0],
    ));
    list(item, "embedding", &mut v);
    v.push(bucket(hour.unwrap_or(12) as f64, &[6.0, 12.0, 18.0]));
    one_hot(device.unwrap_or("web"), &["ios", "android", "web"], &mut v);
    v.into_iter().map(|x| f64::from(x as f32)).collect()
}

struct Mlp {
    w1: Vec<Vec<f64>>,
    b1: Vec<f64>,
    w2: Vec<Vec<f64>>,
    b2: Vec<f64>,
}

impl Mlp {
    fn load() -> Self {
        let j: Json = serde_json::from_str(
            &std::fs::read_to_string(root().join("models/ctr.weights.json")).expect("weights"),
        )
        .expect("json");
        let m = |v: &Json| -> Vec<Vec<f64>> {
            v.as_array()
                .expect("rows")
                .iter()
                .map(|r| {
                    r.as_array()
                        .expect("row")
                        .iter()
                        .map(|x| x.as_f64().expect("f"))
                        .collect()
                })
                .collect()
        };
        let b = |v: &Json| -> Vec<f64> {
            v.as_array()
                .expect("b")
                .iter()
                .map(|x| x.as_f64().expect("f"))
                .collect()
        };
        Self {
            w1: m(&j["w1"]),
            b1: b(&j["b1"]),
            w2: m(&j["w2"]),
            b2: b(&j["b2"]),
        }
    }

    fn score(&self, x: &[f64]) -> f64 {
        assert_eq!(x.len(), self.w1.len(), "input width");
        let hidden: Vec<f64> = (0..self.b1.len())
            .map(|j| {
                (self.b1[j]
                    + x.iter()
                        .zip(&self.w1)
                        .map(|(xi, row)| xi * row[j])
                        .sum::<f64>())
                .max(0.0)
            })
            .collect();
        let z = self.b2[0]
            + hidden
                .iter()
                .zip(&self.w2)
                .map(|(h, row)| h * row[0])
                .sum::<f64>();
        1.0 / (1.0 + (-z).exp())
    }
}

// ------------------------------------------------------------------------------------------------------

#[tokio::test]
async fn predict_scores_equal_the_model_run_on_an_independently_assembled_vector() {
    let app = TestApp::spawn().await;
    let users = demo_rows("user_profile", "user_id");
    let items = demo_rows("item_stats", "item_id");
    let mlp = Mlp::load();
    // Users with a null field and out-of-vocabulary countries, items with null ctr, one unknown item,
    // one unknown user, and a request without context.
    type Case<'a> = (&'a str, Vec<&'a str>, Option<i64>, Option<&'a str>);
    let cases: Vec<Case> = vec![
        (
            "u_24",
            vec!["i_1", "i_0", "i_10", "i_81", "i_84", "i_nope"],
            Some(20),
            Some("ios"),
        ),
        ("u_1", vec!["i_0", "i_1999"], Some(3), Some("android")),
        ("u_23", vec!["i_10"], Some(18), Some("web")),
        ("u_49", vec!["i_81", "i_5", "i_6", "i_7"], None, None),
        ("nobody", vec!["i_3", "i_4"], Some(12), Some("ios")),
    ];
    for (user, cands, hour, device) in cases {
        let mut context = serde_json::Map::new();
        if let Some(h) = hour {
            context.insert("hour_of_day".into(), json!(h));
        }
        if let Some(d) = device {
            context.insert("device".into(), json!(d));
        }
        let body = json!({
            "entities": {"user_id": user},
            "context": context,
            "candidates": cands.iter().map(|c| json!({"item_id": c})).collect::<Vec<_>>(),
        });
        let r = app.predict("ctr", &body).await;
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let got = scores(&r.json());
        assert_eq!(got.len(), cands.len());
        for (i, item) in cands.iter().enumerate() {
            let x = vector(users.get(user), items.get(*item), hour, device);
            let want = mlp.score(&x);
            assert!(
                (got[i] - want).abs() < 1e-5,
                "user {user} item {item}: gateway {} vs independent {want}",
                got[i]
            );
        }
        let st = &r.json()["feature_status"];
        assert_eq!(
            st["user_profile"],
            if users.contains_key(user) {
                "PRESENT"
            } else {
                "NOT_FOUND"
            }
        );
        for (i, item) in cands.iter().enumerate() {
            let want = if items.contains_key(*item) {
                "PRESENT"
            } else {
                "NOT_FOUND"
            };
            assert_eq!(st["item_stats"][i], want, "status of {item}");
        }
    }
    // The committed worked examples agree too.
    for (ex, body) in common::ctr_examples() {
        let r = app.predict("ctr", &body).await.json();
        let want = ex["score"].as_f64().expect("score");
        assert!((scores(&r)[0] - want).abs() < 1e-5, "example {ex}: got {r}");
        let features: Vec<f64> = r["features"][0]
            .as_array()
            .expect("features")
            .iter()
            .map(|x| x.as_f64().expect("f"))
            .collect();
        let vector: Vec<f64> = ex["vector"]
            .as_array()
            .expect("vector")
            .iter()
            .map(|x| x.as_f64().expect("f"))
            .collect();
        // The same float32 numbers, bit for bit: the examples follow hydrant's documented arithmetic.
        assert_eq!(features.len(), vector.len());
        for (a, b) in features.iter().zip(&vector) {
            assert!(
                (*a as f32).to_bits() == (*b as f32).to_bits(),
                "assembled {features:?} vs example {vector:?}"
            );
        }
    }
}

#[tokio::test]
async fn a_second_identical_request_is_served_from_the_cache() {
    let app = TestApp::spawn().await;
    let body = json!({"entities": {"user_id": "u_7"}, "candidates": [{"item_id": "i_7"}, {"item_id": "i_8"}]});
    let first = app.predict("ctr", &body).await.json();
    assert_eq!(first["cache"], json!({"hits": 0, "stale": 0, "misses": 3}));
    let second = app.predict("ctr", &body).await.json();
    assert_eq!(second["cache"], json!({"hits": 3, "stale": 0, "misses": 0}));
    assert_eq!(first["outputs"], second["outputs"]);
    // A key that does not exist is cached as "not found" too (negative caching).
    let body = json!({"entities": {"user_id": "u_ghost"}, "candidates": [{"item_id": "i_7"}]});
    app.predict("ctr", &body).await;
    let again = app.predict("ctr", &body).await.json();
    assert_eq!(again["cache"]["hits"], 2);
    assert_eq!(again["feature_status"]["user_profile"], "NOT_FOUND");
}

#[tokio::test]
async fn json_and_messagepack_give_the_same_answer() {
    let app = TestApp::spawn().await;
    let body = json!({
        "entities": {"user_id": "u_3"},
        "context": {"hour_of_day": 9, "device": "android"},
        "candidates": [{"item_id": "i_11"}, {"item_id": "i_12"}, {"item_id": "i_x"}],
        "options": {"timings": false},
    });
    let j = app.predict("ctr", &body).await;
    assert_eq!(j.status, 200);
    let packed = rmp_serde::to_vec_named(&body).expect("msgpack");
    let m = app
        .post_with(
            "/v1/models/ctr/predict",
            &[
                ("content-type", "application/msgpack"),
                ("accept", "application/msgpack"),
            ],
            packed,
        )
        .await;
    assert_eq!(m.status, 200, "{}", String::from_utf8_lossy(&m.body));
    assert_eq!(m.headers["content-type"], "application/msgpack");
    let decoded: Json = rmp_serde::from_slice(&m.body).expect("a MessagePack body");
    let mut j = j.json();
    let mut decoded = decoded;
    // The second request hit the cache the first one filled; everything else is identical. Scores are
    // float32 in both; JSON prints their shortest form, so compare them as float32.
    j["cache"] = decoded["cache"].clone();
    let as_f32 = |v: &mut Json| {
        for s in v["outputs"]["score"].as_array_mut().expect("scores") {
            *s = json!(s.as_f64().expect("f") as f32);
        }
    };
    as_f32(&mut j);
    as_f32(&mut decoded);
    assert_eq!(decoded, j);
    // Asked in MessagePack, answered in JSON when that is what Accept says.
    let packed = rmp_serde::to_vec_named(&body).expect("msgpack");
    let r = app
        .post_with(
            "/v1/models/ctr/predict",
            &[
                ("content-type", "application/msgpack"),
                ("accept", "application/json"),
            ],
            packed,
        )
        .await;
    assert_eq!(r.headers["content-type"], "application/json");
    let mut r = r.json();
    as_f32(&mut r);
    assert_eq!(r["outputs"], decoded["outputs"]);
}

#[tokio::test]
async fn timings_cover_every_stage_in_the_body_and_the_server_timing_header() {
    let app = TestApp::spawn().await;
    let r = app
        .predict(
            "ctr",
            &json!({"entities": {"user_id": "u_1"}, "candidates": [{"item_id": "i_1"}]}),
        )
        .await;
    let t = &r.json()["timings_us"];
    let stages = [
        "decode",
        "hydrate",
        "assemble",
        "queue",
        "infer",
        "postprocess",
        "encode",
    ];
    let sum: u64 = stages
        .iter()
        .map(|s| t[*s].as_u64().unwrap_or_else(|| panic!("stage {s} in {t}")))
        .sum();
    let total = t["total"].as_u64().expect("total");
    assert!(sum <= total + 2, "stages {sum} exceed total {total}");
    assert!(t["infer"].as_u64().expect("infer") > 0);
    let header = r.headers["server-timing"].to_str().expect("ascii");
    for s in stages.iter().chain(&["total"]) {
        assert!(header.contains(&format!("{s};dur=")), "{header}");
    }
}

#[tokio::test]
async fn features_endpoint_returns_the_values_written() {
    let app = TestApp::spawn().await;
    let users = demo_rows("user_profile", "user_id");
    let body = json!({"entities": {"user_id": ["u_5", "u_missing", "u_6"]}, "features": ["user_profile:age", "user_profile:embedding", "user_profile:avg_session_minutes"]});
    let r = app.post_json("/v1/features", &body).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let j = r.json();
    let ages = &j["features"]["user_profile:age"];
    assert_eq!(ages["values"][0], users["u_5"]["age"]);
    assert_eq!(ages["values"][1], 30, "the default for a missing user");
    assert_eq!(ages["statuses"], json!(["PRESENT", "NOT_FOUND", "PRESENT"]));
    let emb = j["features"]["user_profile:embedding"]["values"][2]
        .as_array()
        .expect("list")
        .clone();
    let want = users["u_6"]["embedding"].as_array().expect("list").clone();
    for (a, b) in emb.iter().zip(&want) {
        assert!((a.as_f64().expect("f") - b.as_f64().expect("f")).abs() < 1e-6);
    }
    // A user whose avg_session_minutes is null in the store reads as NULL_VALUE with the default.
    let (null_user, _) = users
        .iter()
        .find(|(_, r)| r["avg_session_minutes"].is_null())
        .expect("a null row");
    let body = json!({"entities": {"user_id": null_user}, "features": ["user_profile:avg_session_minutes"]});
    let j = app.post_json("/v1/features", &body).await.json();
    assert_eq!(
        j["features"]["user_profile:avg_session_minutes"]["statuses"][0],
        "NULL_VALUE"
    );
    assert_eq!(
        j["features"]["user_profile:avg_session_minutes"]["values"][0],
        10.0
    );
}

#[tokio::test]
async fn a_feature_named_twice_is_answered_once_and_the_list_has_a_limit() {
    let app = TestApp::spawn().await;
    let whole = app
        .post_json(
            "/v1/features",
            &json!({"entities": {"user_id": "u_5"}, "features": ["user_profile"]}),
        )
        .await
        .json();
    let all: Vec<String> = whole["features"]
        .as_object()
        .expect("features")
        .keys()
        .cloned()
        .collect();
    assert!(all.len() > 2, "{whole}");
    // A feature, its whole view and the feature again: every feature of the view, each once.
    let body = json!({"entities": {"user_id": "u_5"}, "features": ["user_profile:age", "user_profile", "user_profile:age"]});
    let r = app.post_json("/v1/features", &body).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let text = String::from_utf8_lossy(&r.body).into_owned();
    for name in &all {
        assert_eq!(
            text.matches(&format!("\"{name}\"")).count(),
            1,
            "{name}: {text}"
        );
    }
    assert_eq!(r.json()["features"], whole["features"]);
    // The references are held up to hydrant's limit, and past it counted, not held.
    let many = |n: usize| vec!["user_profile"; n];
    let r = app
        .post_json(
            "/v1/features",
            &json!({"entities": {"user_id": "u_5"}, "features": many(4096)}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()["features"], whole["features"]);
    for (path, entities) in [
        ("/v1/features", json!({"user_id": "u_5"})),
        ("/get-online-features", json!({"user_id": ["u_5"]})),
    ] {
        let r = app
            .post_json(
                path,
                &json!({"entities": entities, "features": many(50_000)}),
            )
            .await;
        let j = r.json();
        assert_eq!(
            (r.status, r.code().as_str()),
            (413, "too_many_features"),
            "{path}: {j}"
        );
        assert_eq!(j["error"]["field"], "features", "{path}: {j}");
        let message = j["error"]["message"].as_str().expect("a message");
        assert!(message.contains("50000 references"), "{path}: {message}");
    }
}

#[tokio::test]
async fn keys_with_unicode_and_separators_stay_inside_their_view() {
    let app = TestApp::spawn().await;
    // Write a user whose key looks like another view's key, and one with non-ASCII characters.
    let rows = "{\"user_id\": \"item_stats:i_1\", \"age\": 77}\n{\"user_id\": \"Zoë 🙂 ユーザー\", \"age\": 55}\n";
    common::load_rows(&app.store, "user_profile", rows.as_bytes(), false).await;
    let feats =
        |user: &str| json!({"entities": {"user_id": user}, "features": ["user_profile:age"]});
    let age = |j: Json| j["features"]["user_profile:age"]["values"][0].clone();
    let r = app
        .post(
            "/v1/features",
            "application/json",
            serde_json::to_vec(&feats("item_stats:i_1")).expect("j"),
        )
        .await;
    assert_eq!(age(r.json()), 77);
    let r = app
        .post(
            "/v1/features",
            "application/json",
            serde_json::to_vec(&feats("Zoë 🙂 ユーザー")).expect("j"),
        )
        .await;
    assert_eq!(age(r.json()), 55);
    // An item key made to look like a path into the user view finds nothing there.
    let body = json!({"entities": {"item_id": ["../user_profile:u_1", "hy:user_profile:u_1", ":u_1"]}, "features": ["item_stats:price"]});
    let j = app
        .post(
            "/v1/features",
            "application/json",
            serde_json::to_vec(&body).expect("j"),
        )
        .await
        .json();
    assert_eq!(
        j["features"]["item_stats:price"]["statuses"],
        json!(["NOT_FOUND", "NOT_FOUND", "NOT_FOUND"])
    );
    // Control characters are refused.
    let r = app
        .post(
            "/v1/features",
            "application/json",
            serde_json::to_vec(&feats("a\nb")).expect("j"),
        )
        .await;
    assert_eq!((r.status, r.code().as_str()), (400, "invalid_entity_key"));
}

/// Every bad input gets its documented status and error code, and the process keeps serving.
#[tokio::test]
async fn bad_requests_get_documented_errors_and_the_gateway_keeps_serving() {
    let app = TestApp::spawn().await;
    let good = json!({"entities": {"user_id": "u_1"}, "candidates": [{"item_id": "i_1"}]});
    struct Case {
        name: &'static str,
        path: &'static str,
        content_type: &'static str,
        body: Vec<u8>,
        status: u16,
        code: &'static str,
        field: Option<&'static str>,
    }
    let j = |v: Json| serde_json::to_vec(&v).expect("json");
    let many: Vec<Json> = (0..1001)
        .map(|i| json!({"item_id": format!("i_{i}")}))
        .collect();
    let mp = |v: Json| rmp_serde::to_vec_named(&v).expect("msgpack");
    let mut trailing = mp(good.clone());
    trailing.extend_from_slice(b"\xc0garbage");
    // MessagePack can carry NaN and infinities, which JSON cannot.
    #[derive(serde::Serialize)]
    struct Row {
        user_id: &'static str,
        age: f64,
        avg_session_minutes: f64,
    }
    #[derive(serde::Serialize)]
    struct Rows {
        rows: Vec<Row>,
    }
    let non_finite = rmp_serde::to_vec_named(&Rows {
        rows: vec![Row {
            user_id: "u_nan",
            age: f64::INFINITY,
            avg_session_minutes: f64::NAN,
        }],
    })
    .expect("msgpack");
    let cases = vec![
        Case {
            name: "candidates that name no entity",
            path: "/v1/models/ctr/predict",
            content_type: "application/json",
            body: j(
                json!({"entities": {"user_id": "u_1", "item_id": "i_1"}, "candidates": [{}, {}, {}]}),
            ),
            status: 400,
            code: "missing_entity",
            field: Some("candidates[0]"),
        },
        Case {
            name: "an empty candidate for a model that needs its item",
            path: "/v1/models/ctr/predict",
            content_type: "application/json",
            body: j(json!({"entities": {"user_id": "u_1"}, "candidates": [{}]})),
            status: 400,
            code: "missing_entity",
            field: Some("candidates[0]"),
        },
        Case {
            name: "the user given in entities and again in the third candidate",
            path: "/v1/models/ctr/predict",
            content_type: "application/json",
            body: j(json!({"entities": {"user_id": "u_1"}, "candidates": [
                {"item_id": "i_1"}, {"item_id": "i_2"}, {"item_id": "i_3", "user_id": "u_9"}
            ]})),
            status: 400,
            code: "ambiguous_entity",
            field: Some("candidates[2].user_id"),
        },
        Case {
            name: "a candidate naming its item twice",
            path: "/v1/models/ctr/predict",
            content_type: "application/json",
            body: br#"{"entities": {"user_id": "u_1"}, "candidates": [{"item_id": "i_1"}, {"item_id": "i_2", "item_id": "i_3"}]}"#.to_vec(),
            status: 400,
            code: "invalid_field",
            field: Some("candidates[1].item_id"),
        },
        Case {
            name: "bytes after the MessagePack request",
            path: "/v1/models/ctr/predict",
            content_type: "application/msgpack",
            body: trailing,
            status: 400,
            code: "invalid_msgpack",
            field: None,
        },
        Case {
            name: "a float32 feature written beyond float32's range",
            path: "/v1/views/user_profile/rows",
            content_type: "application/json",
            body: j(json!({"rows": [{"user_id": "u_big", "avg_session_minutes": 1e300}]})),
            status: 400,
            code: "invalid_row",
            field: Some("rows[0].avg_session_minutes"),
        },
        Case {
            name: "an embedding element beyond float32's range",
            path: "/v1/views/user_profile/rows",
            content_type: "application/json",
            body: j(json!({"rows": [{"user_id": "u_big", "embedding": [0, 1e300, 0, 0]}]})),
            status: 400,
            code: "invalid_row",
            field: Some("rows[0].embedding"),
        },
        Case {
            name: "NaN and infinity in MessagePack rows",
            path: "/v1/views/user_profile/rows",
            content_type: "application/msgpack",
            body: non_finite,
            status: 400,
            code: "invalid_row",
            field: Some("rows[0].age"),
        },
        Case {
            name: "an event timestamp in the future",
            path: "/v1/views/user_profile/rows",
            content_type: "application/json",
            body: j(
                json!({"rows": [{"user_id": "u_f", "event_timestamp": "9999-12-31T23:59:59Z"}]}),
            ),
            status: 400,
            code: "invalid_row",
            field: Some("rows[0].event_timestamp"),
        },
        Case {
            name: "a negative event timestamp",
            path: "/v1/views/user_profile/rows",
            content_type: "application/json",
            body: j(json!({"rows": [{"user_id": "u_f", "event_timestamp": -5}]})),
            status: 400,
            code: "invalid_row",
            field: Some("rows[0].event_timestamp"),
        },
        Case {
            name: "malformed JSON",
            path: "/v1/models/ctr/predict",
            content_type: "application/json",
            body: b"{\"entities\": {".to_vec(),
            status: 400,
            code: "invalid_json",
            field: None,
        },
        Case {
            name: "trailing garbage",
            path: "/v1/models/ctr/predict",
            content_type: "application/json",
            body: b"{} x".to_vec(),
            status: 400,
            code: "invalid_json",
            field: None,
        },
        Case {
            name: "an integer key in a MessagePack map",
            path: "/v1/models/ctr/predict",
            content_type: "application/msgpack",
            // {"entities": {"user_id": "u_1"}, "context": {7: 1}}
            body: [
                &[0x82, 0xa8][..],
                b"entities",
                &[0x81, 0xa7],
                b"user_id",
                &[0xa3],
                b"u_1",
                &[0xa7],
                b"context",
                &[0x81, 0x07, 0x01],
            ]
            .concat(),
            status: 400,
            code: "invalid_msgpack",
            field: Some("context"),
        },
        Case {
            name: "malformed MessagePack",
            path: "/v1/models/ctr/predict",
            content_type: "application/msgpack",
            body: vec![0xc1, 0xff, 0x00],
            status: 400,
            code: "invalid_msgpack",
            field: None,
        },
        Case {
            name: "wrong type of a key",
            path: "/v1/models/ctr/predict",
            content_type: "application/json",
            body: j(
                json!({"entities": {"user_id": "u_1"}, "candidates": [{"item_id": "i_1"}, {"item_id": [1]}]}),
            ),
            status: 400,
            code: "invalid_field",
            field: Some("candidates[1].item_id"),
        },
        Case {
            name: "integer key for a string entity",
            path: "/v1/models/ctr/predict",
            content_type: "application/json",
            body: j(json!({"entities": {"user_id": 5}, "candidates": [{"item_id": "i_1"}]})),
            status: 400,
            code: "invalid_entity_key",
            field: Some("entities.user_id"),
        },
        Case {
            name: "wrong context type",
            path: "/v1/models/ctr/predict",
            content_type: "application/json",
            body: j(
                json!({"entities": {"user_id": "u_1"}, "context": {"hour_of_day": "noon"}, "candidates": [{"item_id": "i_1"}]}),
            ),
            status: 400,
            code: "invalid_field",
            field: Some("context.hour_of_day"),
        },
        Case {
            name: "options of the wrong type",
            path: "/v1/models/ctr/predict",
            content_type: "application/json",
            body: j(json!({"entities": {"user_id": "u_1"}, "options": {"deadline_ms": "soon"}})),
            status: 400,
            code: "invalid_field",
            field: Some("options.deadline_ms"),
        },
        Case {
            name: "unknown top-level field",
            path: "/v1/models/ctr/predict",
            content_type: "application/json",
            body: j(json!({"entity": {"user_id": "u_1"}})),
            status: 400,
            code: "invalid_field",
            field: None,
        },
        Case {
            name: "missing entity",
            path: "/v1/models/ctr/predict",
            content_type: "application/json",
            body: j(json!({"candidates": [{"item_id": "i_1"}]})),
            status: 400,
            code: "missing_entity",
            field: Some("entities.user_id"),
        },
        Case {
            name: "a candidate without its key",
            path: "/v1/models/ctr/predict",
            content_type: "application/json",
            body: j(
                json!({"entities": {"user_id": "u_1"}, "candidates": [{"item_id": "i_1"}, {}]}),
            ),
            status: 400,
            code: "missing_entity",
            field: Some("candidates[1].item_id"),
        },
        Case {
            name: "unknown entity",
            path: "/v1/models/ctr/predict",
            content_type: "application/json",
            body: j(
                json!({"entities": {"user_id": "u_1", "shop_id": "s"}, "candidates": [{"item_id": "i_1"}]}),
            ),
            status: 400,
            code: "unknown_entity",
            field: Some("entities.shop_id"),
        },
        Case {
            name: "unknown context field",
            path: "/v1/models/ctr/predict",
            content_type: "application/json",
            body: j(
                json!({"entities": {"user_id": "u_1"}, "context": {"weekday": 3}, "candidates": [{"item_id": "i_1"}]}),
            ),
            status: 400,
            code: "unknown_context_field",
            field: Some("context.weekday"),
        },
        Case {
            name: "empty candidate list",
            path: "/v1/models/ctr/predict",
            content_type: "application/json",
            body: j(json!({"entities": {"user_id": "u_1"}, "candidates": []})),
            status: 400,
            code: "empty_candidates",
            field: Some("candidates"),
        },
        Case {
            name: "oversized candidate list",
            path: "/v1/models/ctr/predict",
            content_type: "application/json",
            body: j(json!({"entities": {"user_id": "u_1"}, "candidates": many})),
            status: 413,
            code: "too_many_candidates",
            field: Some("candidates"),
        },
        Case {
            name: "empty key",
            path: "/v1/models/ctr/predict",
            content_type: "application/json",
            body: j(json!({"entities": {"user_id": ""}, "candidates": [{"item_id": "i_1"}]})),
            status: 400,
            code: "invalid_entity_key",
            field: Some("entities.user_id"),
        },
        Case {
            name: "overlong key",
            path: "/v1/models/ctr/predict",
            content_type: "application/json",
            body: j(
                json!({"entities": {"user_id": "u".repeat(300)}, "candidates": [{"item_id": "i_1"}]}),
            ),
            status: 400,
            code: "invalid_entity_key",
            field: Some("entities.user_id"),
        },
        Case {
            name: "unknown model",
            path: "/v1/models/ctrr/predict",
            content_type: "application/json",
            body: j(good.clone()),
            status: 404,
            code: "unknown_model",
            field: None,
        },
        Case {
            name: "unsupported content type",
            path: "/v1/models/ctr/predict",
            content_type: "text/plain",
            body: j(good.clone()),
            status: 415,
            code: "unsupported_media_type",
            field: None,
        },
        Case {
            name: "a charset other than UTF-8",
            path: "/v1/models/ctr/predict",
            content_type: "application/json; charset=utf-16",
            body: j(good.clone()),
            status: 415,
            code: "unsupported_media_type",
            field: None,
        },
        Case {
            name: "body over the limit",
            path: "/v1/models/ctr/predict",
            content_type: "application/json",
            body: vec![b' '; 2 << 20],
            status: 413,
            code: "body_too_large",
            field: None,
        },
        Case {
            name: "unknown feature",
            path: "/v1/features",
            content_type: "application/json",
            body: j(json!({"entities": {"user_id": ["u_1"]}, "features": ["user_profile:agee"]})),
            status: 400,
            code: "unknown_feature",
            field: Some("features[0]"),
        },
        Case {
            name: "unknown view",
            path: "/v1/features",
            content_type: "application/json",
            body: j(json!({"entities": {"user_id": ["u_1"]}, "features": ["user_profiles:age"]})),
            status: 400,
            code: "unknown_view",
            field: Some("features[0]"),
        },
        Case {
            name: "features without the view's entity",
            path: "/v1/features",
            content_type: "application/json",
            body: j(json!({"entities": {"user_id": ["u_1"]}, "features": ["item_stats:price"]})),
            status: 400,
            code: "missing_entity",
            field: Some("entities.item_id"),
        },
        Case {
            name: "an unknown entity in /v1/features, not the missing one",
            path: "/v1/features",
            content_type: "application/json",
            body: j(json!({"entities": {"foo": ["u_1"]}, "features": ["user_profile"]})),
            status: 400,
            code: "unknown_entity",
            field: Some("entities.foo"),
        },
        Case {
            name: "return_features in /v1/features",
            path: "/v1/features",
            content_type: "application/json",
            body: j(json!({"entities": {"user_id": ["u_1"]}, "features": ["user_profile"], "options": {"return_features": true}})),
            status: 400,
            code: "invalid_field",
            field: Some("options.return_features"),
        },
        Case {
            name: "unknown route",
            path: "/v1/nothing",
            content_type: "application/json",
            body: j(good.clone()),
            status: 404,
            code: "unknown_route",
            field: None,
        },
        Case {
            name: "an unknown feature in a row",
            path: "/v1/views/user_profile/rows",
            content_type: "application/json",
            body: j(json!({"rows": [{"user_id": "u_x", "bogus": 1}]})),
            status: 400,
            code: "invalid_row",
            field: Some("rows[0].bogus"),
        },
        Case {
            name: "a row without its entity key",
            path: "/v1/views/user_profile/rows",
            content_type: "application/json",
            body: j(json!({"rows": [{"age": 1}]})),
            status: 400,
            code: "invalid_row",
            field: Some("rows[0].user_id"),
        },
        Case {
            name: "a row whose entity key is not a string or an integer",
            path: "/v1/views/user_profile/rows",
            content_type: "application/json",
            body: j(json!({"rows": [{"user_id": [1], "age": 1}]})),
            status: 400,
            code: "invalid_row",
            field: Some("rows[0].user_id"),
        },
        Case {
            name: "an entity key given twice in a row",
            path: "/v1/views/user_profile/rows",
            content_type: "application/json",
            body: br#"{"rows": [{"user_id": "u_dup2", "user_id": "u_dup3", "age": 1}]}"#.to_vec(),
            status: 400,
            code: "invalid_row",
            field: Some("rows[0].user_id"),
        },
        Case {
            name: "an entity given twice to /v1/features",
            path: "/v1/features",
            content_type: "application/json",
            body: br#"{"entities": {"user_id": ["u_1"], "user_id": ["u_2"]}, "features": ["user_profile:age"]}"#.to_vec(),
            status: 400,
            code: "invalid_field",
            field: Some("entities.user_id"),
        },
        Case {
            name: "an entity given twice to /v1/prefetch",
            path: "/v1/prefetch",
            content_type: "application/json",
            body: br#"{"entities": {"user_id": ["u_1"], "user_id": ["u_2"]}}"#.to_vec(),
            status: 400,
            code: "invalid_field",
            field: Some("entities.user_id"),
        },
        Case {
            name: "features without entities",
            path: "/v1/features",
            content_type: "application/json",
            body: j(json!({"features": ["user_profile:age"]})),
            status: 400,
            code: "invalid_field",
            field: Some("entities"),
        },
        Case {
            name: "`entities` given twice",
            path: "/v1/models/ctr/predict",
            content_type: "application/json",
            body: br#"{"entities": {"user_id": "u_1"}, "entities": {"user_id": "u_2"}}"#.to_vec(),
            status: 400,
            code: "invalid_field",
            field: Some("entities"),
        },
        Case {
            name: "a prefetch of no keys",
            path: "/v1/prefetch",
            content_type: "application/json",
            body: j(json!({"entities": {"user_id": []}})),
            status: 400,
            code: "missing_entity",
            field: Some("entities.user_id"),
        },
        Case {
            name: "a prefetch of item keys for the user view only",
            path: "/v1/prefetch",
            content_type: "application/json",
            body: j(
                json!({"entities": {"user_id": ["u_1"], "item_id": ["i_1"]}, "views": ["user_profile"]}),
            ),
            status: 400,
            code: "unknown_entity",
            field: Some("entities.item_id"),
        },
        Case {
            name: "a prefetch of no views",
            path: "/v1/prefetch",
            content_type: "application/json",
            body: j(json!({"entities": {"user_id": ["u_1"]}, "views": []})),
            status: 400,
            code: "invalid_field",
            field: Some("views"),
        },
        Case {
            name: "a deadline of 0 ms",
            path: "/v1/models/ctr/predict",
            content_type: "application/json",
            body: j(json!({"entities": {"user_id": "u_1"}, "candidates": [{"item_id": "i_1"}], "options": {"deadline_ms": 0}})),
            status: 400,
            code: "invalid_field",
            field: Some("options.deadline_ms"),
        },
    ];
    for c in cases {
        let r = app.post(c.path, c.content_type, c.body).await;
        assert_eq!(
            r.status,
            c.status,
            "{}: {}",
            c.name,
            String::from_utf8_lossy(&r.body)
        );
        let body = r.json();
        assert_eq!(body["error"]["code"], c.code, "{}: {body}", c.name);
        assert!(
            !body["error"]["message"].as_str().unwrap_or("").is_empty(),
            "{}: message",
            c.name
        );
        if let Some(f) = c.field {
            assert_eq!(body["error"]["field"], f, "{}: {body}", c.name);
        }
        // Still serving.
        assert_eq!(
            app.predict("ctr", &good).await.status,
            200,
            "after {}",
            c.name
        );
    }
    // A row's time sent as a MessagePack timestamp (extension -1): the answer says what it takes.
    // {"rows": [{"user_id": "u_t", "event_timestamp": <timestamp 32: 1 s>}]}
    let stamped = [
        &[0x81, 0xa4][..],
        b"rows",
        &[0x91, 0x82, 0xa7],
        b"user_id",
        &[0xa3],
        b"u_t",
        &[0xaf],
        b"event_timestamp",
        &[0xd6, 0xff, 0, 0, 0, 1],
    ]
    .concat();
    let r = app
        .post(
            "/v1/views/user_profile/rows",
            "application/msgpack",
            stamped,
        )
        .await;
    assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(&r.body));
    let e = r.json()["error"].clone();
    assert_eq!(e["field"], "rows[0].event_timestamp", "{e}");
    let message = e["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("expected an RFC 3339 time") && !message.contains("feature value"),
        "{message}"
    );
    // A huge unknown name comes back cut, once it is long past what names it.
    let name = "x".repeat(100_000);
    let r = app
        .predict(
            "ctr",
            &json!({"entities": {"user_id": "u_1", "item_id": "i_1"}, "context": {name.clone(): 1}}),
        )
        .await;
    assert_eq!(r.status, 400);
    assert!(r.body.len() < 6_000, "{} bytes", r.body.len());
    let e = r.json()["error"].clone();
    let (message, field) = (
        e["message"].as_str().unwrap_or_default(),
        e["field"].as_str().unwrap_or_default(),
    );
    assert!(
        message.starts_with("context.xxx") && message.ends_with(" more bytes)"),
        "{e}"
    );
    assert!(
        field.starts_with("context.xxx") && field.ends_with(" more bytes)"),
        "{e}"
    );
    // UTF-8 said in any of its spellings is read.
    for ct in [
        "application/json; charset=utf-8",
        "application/json;charset=\"UTF-8\"",
    ] {
        let r = app
            .post("/v1/models/ctr/predict", ct, j(good.clone()))
            .await;
        assert_eq!(r.status, 200, "{ct}: {}", String::from_utf8_lossy(&r.body));
    }
    let r = app
        .post(
            "/v1/models/ctr/predict",
            "application/json; charset=latin1",
            j(good.clone()),
        )
        .await;
    assert_eq!(
        r.json()["error"]["message"],
        "unsupported `charset=latin1` in Content-Type: hydrant reads the body as UTF-8; send it in UTF-8"
    );
    // The V2 infer route answers in the Open Inference Protocol's error shape.
    let infer = json!({"inputs": [{"name": "features", "shape": [1, 27], "datatype": "FP32", "data": vec![0.0; 27]}]});
    let r = app
        .post(
            "/v2/models/ctr/infer",
            "application/json;charset=\"ISO-8859-1\"",
            j(infer.clone()),
        )
        .await;
    assert_eq!(r.status, 415, "{}", String::from_utf8_lossy(&r.body));
    let r = app
        .post(
            "/v2/models/ctr/infer",
            "application/json; charset=utf-8",
            j(infer),
        )
        .await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    // The messages name each field once, the way it was sent: a key sent alone has no index.
    for (path, body, says) in [
        (
            "/v1/views/user_profile/rows",
            json!({"rows": [{"user_id": 1}]}),
            "rows[0]: entity `user_id` takes string keys, got an integer (1 of 1 rows invalid; nothing was written)",
        ),
        (
            "/v1/views/user_profile/rows",
            json!({"rows": [{"user_id": "u_ok"}, {"user_id": ""}]}),
            "rows[1]: the key is empty (1 of 2 rows invalid; nothing was written)",
        ),
        (
            "/v1/features",
            json!({"entities": {"user_id": 5}, "features": ["user_profile"]}),
            "entities.user_id: entity `user_id` takes string keys, got an integer",
        ),
        (
            "/v1/features",
            json!({"entities": {"user_id": ["u_1", 5]}, "features": ["user_profile"]}),
            "entities.user_id[1]: entity `user_id` takes string keys, got an integer",
        ),
    ] {
        let r = app.post_json(path, &body).await;
        assert_eq!(r.status, 400, "{body}");
        assert_eq!(r.json()["error"]["message"], says, "{body}");
    }
    let live = app.get("/v2/health/live").await;
    assert_eq!(live.status, 200);
    assert_eq!(
        live.json(),
        json!({"live": true}),
        "the Open Inference Protocol's answer"
    );
    assert_eq!(app.get("/v2/health/ready").await.status, 200);
}

#[tokio::test]
async fn error_messages_name_what_was_expected() {
    let app = TestApp::spawn().await;
    let r = app
        .predict("ctr", &json!({"entities": {"user_id": "u_1"}, "context": {"hour_of_day": "noon"}, "candidates": [{"item_id": "i_1"}]}))
        .await;
    let m = r.json()["error"]["message"]
        .as_str()
        .expect("message")
        .to_owned();
    assert!(m.contains("int64") && m.contains("string"), "{m}");
    // A shape no feature type takes is put in the field's terms, not the decoder's.
    for (context, field, expected) in [
        (
            json!({"device": ["ios"]}),
            "context.device",
            "context.device: expected string, got a list",
        ),
        (
            json!({"device": {"os": "ios"}}),
            "context.device",
            "context.device: expected string, got an object",
        ),
        (
            json!({"hour_of_day": [1, "a"]}),
            "context.hour_of_day",
            "context.hour_of_day: expected int64, got a list",
        ),
        (
            json!({"hour_of_day": 18446744073709551615_u64}),
            "context.hour_of_day",
            "context.hour_of_day: expected int64, got a number outside its range",
        ),
    ] {
        let r = app
            .predict("ctr", &json!({"entities": {"user_id": "u_1"}, "context": context, "candidates": [{"item_id": "i_1"}]}))
            .await;
        assert_eq!(r.status, 400, "{context}");
        let body = r.json();
        assert_eq!(body["error"]["field"], field, "{body}");
        let m = body["error"]["message"].as_str().expect("message");
        assert!(m.starts_with(expected), "{context}: {m}");
    }
    // A compressed body is named as such, not reported as malformed JSON.
    for path in ["/v1/models/ctr/predict", "/v2/models/ctr/infer"] {
        let r = app
            .post_with(
                path,
                &[
                    ("content-type", "application/json"),
                    ("content-encoding", "gzip"),
                ],
                vec![0x1f, 0x8b, 0x08, 0x00],
            )
            .await;
        assert_eq!(r.status, 415, "{path}");
        let body = r.json();
        let m = body["error"]["message"]
            .as_str()
            .or(body["error"].as_str())
            .expect("message");
        assert!(m.contains("Content-Encoding: gzip"), "{path}: {m}");
        // RFC 9110, 15.5.16: the codings that are taken.
        assert_eq!(r.headers["accept-encoding"], "identity", "{path}");
    }
    let r = app
        .post_with(
            "/v1/models/ctr/predict",
            &[
                ("content-type", "application/json"),
                ("content-encoding", "identity"),
            ],
            serde_json::to_vec(
                &json!({"entities": {"user_id": "u_1"}, "candidates": [{"item_id": "i_1"}]}),
            )
            .expect("json"),
        )
        .await;
    assert_eq!(r.status, 200, "identity is no encoding");
    let r = app.predict("ctrr", &json!({})).await;
    let m = r.json()["error"]["message"]
        .as_str()
        .expect("message")
        .to_owned();
    assert!(
        m.contains("ctrr") && m.contains("ctr"),
        "lists the known models: {m}"
    );
}

#[tokio::test]
async fn model_metadata_describes_the_onnx_input_and_outputs() {
    let app = TestApp::spawn().await;
    let j = app.get("/v2/models/ctr").await.json();
    assert_eq!(j["name"], "ctr");
    assert_eq!(j["inputs"][0]["name"], "features");
    assert_eq!(j["inputs"][0]["shape"], json!([-1, 27]));
    assert_eq!(j["outputs"][0]["name"], "score");
    assert_eq!(j["parameters"]["device"], "cpu");
    assert_eq!(app.get("/v2/models/nope").await.status, 404);
}

#[tokio::test]
async fn an_extreme_event_timestamp_is_an_unreadable_record_not_a_crash() {
    let app = TestApp::spawn().await;
    // The loader refuses it...
    let rows = format!(
        "{{\"user_id\": \"u_ancient\", \"age\": 44, \"event_timestamp\": {}}}\n",
        i64::MIN
    );
    let report = common::load_rows(&app.store, "user_profile", rows.as_bytes(), false).await;
    assert_eq!((report.written, report.rejected_rows), (0, 1));
    assert!(
        report.rejected[0].reason.contains("before 1970"),
        "{:?}",
        report.rejected
    );
    // ...but another writer may still put one in the store, or one that would be PRESENT for ever (no
    // time ever grows older than `max_age` from it). Neither is a time hydrant writes: the record is
    // unreadable, served as defaults and counted.
    for (key, event_ts_ms) in [("u_ancient", i64::MIN), ("u_future", i64::MAX)] {
        let record = hydrant::value::Record {
            schema_version: 1,
            event_ts_ms,
            // age, country, is_premium, avg_session_minutes, embedding
            values: vec![
                hydrant::value::Value::Int(44),
                hydrant::value::Value::Null,
                hydrant::value::Value::Null,
                hydrant::value::Value::Null,
                hydrant::value::Value::Null,
            ],
            layout: 0,
        };
        app.store
            .put_many(
                vec![(format!("hy:user_profile:{key}"), record.encode())],
                None,
            )
            .await
            .expect("write");
    }
    let body = json!({"entities": {"user_id": ["u_ancient", "u_future"]}, "features": ["user_profile:age"]});
    let r = app
        .post(
            "/v1/features",
            "application/json",
            serde_json::to_vec(&body).expect("j"),
        )
        .await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let age = &r.json()["features"]["user_profile:age"];
    assert_eq!(age["statuses"], json!(["DEFAULTED", "DEFAULTED"]));
    assert_eq!(age["values"], json!([30, 30]), "served as the default");
    let bad = &app.gateway.telemetry.view("user_profile").bad_records;
    assert_eq!(bad.load(std::sync::atomic::Ordering::Relaxed), 2);
}

#[tokio::test]
async fn wrong_methods_undecodable_names_and_non_json_v2_bodies_get_json_errors() {
    let app = TestApp::spawn().await;
    // The last: a model named like a POST route's last segment is still a GET route there.
    for (method, path, allowed) in [
        ("GET", "/v1/models/ctr/predict", "POST"),
        ("POST", "/v2/health/live", "GET"),
        ("POST", "/v2/models/infer", "GET"),
    ] {
        let r = if method == "GET" {
            app.get(path).await
        } else {
            app.post(path, "application/json", b"{}".to_vec()).await
        };
        assert_eq!(r.status, 405, "{method} {path}");
        let listed = if allowed == "GET" {
            "GET, HEAD"
        } else {
            allowed
        };
        assert_eq!(
            r.headers.get("allow").and_then(|v| v.to_str().ok()),
            Some(listed),
            "{method} {path}: RFC 9110 wants the methods listed"
        );
        assert!(
            r.headers.contains_key("x-request-id"),
            "{method} {path}: {:?}",
            r.headers
        );
        let j = r.json();
        // `/v2` answers errors as the Open Inference Protocol does, the rest in hydrant's own shape.
        let message = if path.starts_with("/v2/") {
            j["error"].as_str()
        } else {
            assert_eq!(j["error"]["code"], "method_not_allowed", "{j}");
            j["error"]["message"].as_str()
        };
        assert!(
            message.is_some_and(|m| m.contains(&format!("use {allowed}"))),
            "{method} {path}: {j}"
        );
    }

    // An unknown route is answered in the shape of its prefix, with the caller's request id echoed.
    for (path, v2) in [("/v1/nothing", false), ("/v2/nothing/here", true)] {
        let r = app
            .client
            .get(format!("{}{path}", app.addr))
            .header("x-request-id", "lost-1")
            .send()
            .await
            .expect("send");
        assert_eq!(r.status(), 404, "{path}");
        assert_eq!(
            r.headers()
                .get("x-request-id")
                .and_then(|v| v.to_str().ok()),
            Some("lost-1"),
            "{path}"
        );
        let j: serde_json::Value = r.json().await.expect("json");
        let message = if v2 {
            j["error"].as_str()
        } else {
            assert_eq!(j["error"]["code"], "unknown_route", "{j}");
            j["error"]["message"].as_str()
        };
        assert!(message.is_some_and(|m| m.contains(path)), "{path}: {j}");
    }

    // The hot routes (predict, V2 infer, features) are served before the router (a shortcut); paths the
    // router would not match as those routes are still the router's: unknown routes. The last column is
    // the error code, or on `/v2` (the Open Inference Protocol's shape) a part of the message.
    let predict =
        br#"{"entities": {"user_id": "u_1"}, "candidates": [{"item_id": "i_1"}]}"#.to_vec();
    let wanted =
        br#"{"entities": {"user_id": ["u_1"]}, "features": ["user_profile:age"]}"#.to_vec();
    let zeros = vec![0.0f32; 27];
    let tensor = serde_json::to_vec(&json!({"inputs": [{"name": "features", "shape": [1, 27], "datatype": "FP32", "data": zeros}]}))
        .expect("json");
    let cases: [(&str, &Vec<u8>, u16, &str); 16] = [
        ("/v1/models/ctr/predict/", &predict, 404, "unknown_route"),
        ("/v1/models/ctr/x/predict", &predict, 404, "unknown_route"),
        ("/v1/models/ctr/predicts", &predict, 404, "unknown_route"),
        ("/v1/models/ctr/predict?debug=1", &predict, 200, ""),
        ("/v1/models/nope/predict", &predict, 404, "unknown_model"),
        ("/v1/models//predict", &predict, 404, "unknown_model"),
        ("/v1/features?x=1", &wanted, 200, ""),
        ("/v1/features/", &wanted, 404, "unknown_route"),
        ("/v1/featuresx", &wanted, 404, "unknown_route"),
        ("//v1/features", &wanted, 404, "unknown_route"),
        ("/v2/models/ctr/infer/", &tensor, 404, "no route"),
        ("/v2/models/ctr/x/infer", &tensor, 404, "no route"),
        ("/v2/models/ctr/infers", &tensor, 404, "no route"),
        ("/v2/models/ctr/infer?x=1", &tensor, 200, ""),
        ("/v2/models/nope/infer", &tensor, 404, "is not registered"),
        ("/v2/models//infer", &tensor, 404, "is not registered"),
    ];
    for (path, body, status, error) in cases {
        let r = app.post(path, "application/json", body.clone()).await;
        assert_eq!(
            r.status,
            status,
            "{path}: {}",
            String::from_utf8_lossy(&r.body)
        );
        if status == 200 {
            continue;
        }
        let j = r.json();
        if path.starts_with("/v2/") {
            assert!(
                j["error"].as_str().is_some_and(|m| m.contains(error)),
                "{path}: {j}"
            );
        } else {
            assert_eq!(j["error"]["code"], error, "{path}");
        }
    }
    let r = app
        .post("/v2/models/ctr/infer?x=1", "application/json", tensor)
        .await;
    assert_eq!(r.json()["outputs"][0]["shape"], json!([1, 1]));
    let r = app.get("/v1/features").await;
    assert_eq!(r.status, 405, "{}", String::from_utf8_lossy(&r.body));

    // A name that is not UTF-8 once percent-decoded is an unknown name, answered in JSON like any other.
    for path in [
        "/v2/models/%ff",
        "/v2/models/%ff/ready",
        "/v2/models/%ff/infer",
        "/v1/views/%ff/rows",
    ] {
        let r = if path.ends_with("/infer") || path.ends_with("/rows") {
            app.post(path, "application/json", b"{}".to_vec()).await
        } else {
            app.get(path).await
        };
        assert_eq!(
            r.status,
            404,
            "{path}: {}",
            String::from_utf8_lossy(&r.body)
        );
        let j = r.json();
        assert!(j["error"].to_string().contains("%ff"), "{path}: {j}");
    }

    let r = app
        .post("/v2/models/ctr/infer", "text/xml", b"<infer/>".to_vec())
        .await;
    assert_eq!(r.status, 415, "{}", String::from_utf8_lossy(&r.body));
    assert!(
        r.json()["error"]
            .as_str()
            .is_some_and(|m| m.contains("application/json"))
    );
}

/// A client that stops sending mid-body gets 408 `body_timeout` once the request timeout has passed (not
/// the 503 of a slow gateway), and the connection is closed: the rest of that body could not be told
/// from a next request.
#[tokio::test]
async fn a_body_that_stops_coming_gets_408_and_the_connection_closes() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    let mut config = common::test_config();
    config.limits.request_timeout = std::time::Duration::from_millis(300);
    let (store, dir) = common::demo_store().await;
    let app = TestApp::spawn_with(config, store, Some(dir)).await;
    app.wait_ready().await;
    let mut s = tokio::net::TcpStream::connect(app.addr.trim_start_matches("http://"))
        .await
        .expect("connect");
    s.write_all(
        b"POST /v1/models/ctr/predict HTTP/1.1\r\nhost: hydrant\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"entities\": ",
    )
    .await
    .expect("send");
    let started = std::time::Instant::now();
    let mut answer = Vec::new();
    tokio::time::timeout(
        std::time::Duration::from_secs(5),
        s.read_to_end(&mut answer),
    )
    .await
    .expect("the gateway answers and closes the connection")
    .expect("read");
    let text = String::from_utf8_lossy(&answer);
    assert!(text.starts_with("HTTP/1.1 408 "), "{text}");
    assert!(
        text.to_ascii_lowercase()
            .contains("\r\nconnection: close\r\n"),
        "{text}"
    );
    assert!(text.contains(r#""code":"body_timeout""#), "{text}");
    assert!(text.contains("limits.request_timeout"), "{text}");
    assert!(
        started.elapsed() >= std::time::Duration::from_millis(250),
        "answered after {:?}, before the request timeout",
        started.elapsed()
    );
    // The answer came from the backstop, not the handler; the model's stats count it all the same.
    let stats = app.get("/v1/stats").await.json();
    assert_eq!(stats["models"]["ctr"]["rejected"], 1, "{stats}");
    app.stop().await;
}

/// An `event_timestamp` with an offset means that instant: `+12:00` is 12 hours ahead of UTC. Read as
/// UTC, an item 30 days and 10 hours old would look 30 days minus 2 hours old and be served as present.
/// A float32 feature stores the float32 the model sees, whatever the wire format.
#[tokio::test]
async fn event_timestamps_apply_their_offset_and_float32_values_are_stored_as_float32() {
    let app = TestApp::spawn().await;
    let at = |age: std::time::Duration, offset_h: i64| {
        let utc = std::time::SystemTime::now() - age;
        let local = if offset_h >= 0 {
            utc + std::time::Duration::from_secs(offset_h as u64 * 3600)
        } else {
            utc - std::time::Duration::from_secs(offset_h.unsigned_abs() * 3600)
        };
        let text = humantime::format_rfc3339_millis(local).to_string();
        let sign = if offset_h >= 0 { '+' } else { '-' };
        text.replace('Z', &format!("{sign}{:02}:00", offset_h.abs()))
    };
    let day = std::time::Duration::from_secs(86_400);
    let hour = std::time::Duration::from_secs(3600);
    let rows = json!({"rows": [
        {"item_id": "ts_old", "ctr_7d": 0.5, "event_timestamp": at(day * 30 + hour * 10, 12)},
        {"item_id": "ts_new", "ctr_7d": 0.1, "price": 16777217, "event_timestamp": at(day * 29, -5)},
    ]});
    let r = app.post_json("/v1/views/item_stats/rows", &rows).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let body = json!({"entities": {"item_id": ["ts_old", "ts_new"]}, "features": ["item_stats:ctr_7d", "item_stats:price"]});
    let r = app.post_json("/v1/features", &body).await;
    let j = r.json();
    let ctr = &j["features"]["item_stats:ctr_7d"];
    assert_eq!(
        ctr["statuses"],
        json!(["OUTSIDE_MAX_AGE", "PRESENT"]),
        "{j}"
    );
    // float32 (ctr_7d) holds the float32 nearest 0.1, written with float32's digits; float64 (price)
    // keeps every integer up to 2^53.
    assert_eq!(ctr["values"][1], json!(0.1), "{j}");
    assert_eq!(
        j["features"]["item_stats:price"]["values"][1],
        json!(16777217.0),
        "{j}"
    );
    assert!(
        String::from_utf8_lossy(&r.body).contains(r#""values":[0.02,0.1]"#),
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    let r = app
        .post_json(
            "/v1/views/item_stats/rows",
            &json!({"rows": [{"item_id": "ts_z", "price": 1, "event_timestamp": "2026-10-23T12:00:00.Z"}]}),
        )
        .await;
    assert_eq!(r.status, 400, "a fraction with no digits");
}

/// A request's `Host` header must be there (in HTTP/1.1), once, and be a host: RFC 9112 says a server
/// must answer 400 otherwise. HTTP/1.0 had no such header and is served without one.
#[tokio::test]
async fn a_request_without_one_valid_host_is_refused() {
    let app = TestApp::spawn().await;
    app.wait_ready().await;
    let body = r#"{"entities": {"user_id": "u_1"}, "candidates": [{"item_id": "i_1"}]}"#;
    for (version, host, status, code) in [
        ("HTTP/1.1", "", "400", "missing_host"),
        ("HTTP/1.1", "host: h\r\n", "200", ""),
        ("HTTP/1.1", "host: 127.0.0.1:8080\r\n", "200", ""),
        ("HTTP/1.1", "host: [::1]:8080\r\n", "200", ""),
        ("HTTP/1.1", "host:\r\n", "200", ""),
        ("HTTP/1.0", "", "200", ""),
        ("HTTP/1.1", "host: a\r\nhost: b\r\n", "400", "invalid_host"),
        ("HTTP/1.0", "host: a\r\nhost: a\r\n", "400", "invalid_host"),
        ("HTTP/1.1", "host: a b\r\n", "400", "invalid_host"),
        ("HTTP/1.1", "host: a:abc\r\n", "400", "invalid_host"),
        ("HTTP/1.1", "host: [::1\r\n", "400", "invalid_host"),
        ("HTTP/1.1", "host: h:99999\r\n", "400", "invalid_host"),
        (
            "HTTP/1.1",
            "host: evil.example/x\r\n",
            "400",
            "invalid_host",
        ),
        (
            "HTTP/1.1",
            "host: caf\u{e9}.example\r\n",
            "400",
            "invalid_host",
        ),
    ] {
        let head = format!(
            "POST /v1/models/ctr/predict {version}\r\n{host}content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        let answer = common::exchange(&app.addr, head.as_bytes(), version).await;
        let text = String::from_utf8_lossy(&answer);
        assert_eq!(
            text.split(' ').nth(1),
            Some(status),
            "{version} {host:?}: {text}"
        );
        if status == "400" {
            assert!(
                text.contains(&format!(r#""code":"{code}""#)) && text.contains(r#""field":"Host""#),
                "{version} {host:?}: {text}"
            );
        }
    }
}

/// A target with no path (the authority form of `CONNECT`) is named as sent in the 404.
#[tokio::test]
async fn a_connect_request_is_refused_naming_its_target() {
    let app = TestApp::spawn().await;
    let answer = common::exchange(
        &app.addr,
        b"CONNECT example.com:443 HTTP/1.1\r\nhost: example.com:443\r\nconnection: close\r\n\r\n",
        "CONNECT",
    )
    .await;
    let text = String::from_utf8_lossy(&answer);
    assert!(text.starts_with("HTTP/1.1 404 "), "{text}");
    assert!(text.contains("no route CONNECT example.com:443"), "{text}");
}

/// What the headers alone settle is answered without waiting for the body: a body declared over
/// `limits.max_body_bytes` (413), a predict for a model that does not exist (404), a content type
/// hydrant does not read (415: a client that asked `Expect: 100-continue` gets no 100 first), and an
/// `Accept` that takes neither answer format (406). Each closes
/// the connection, since the body would follow on it, and says `Connection: close`.
#[tokio::test]
async fn an_oversized_body_or_unknown_model_is_refused_before_the_body_arrives() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    let app = TestApp::spawn().await;
    app.wait_ready().await;
    for (head, status, code) in [
        (
            "POST /v1/models/ctr/predict HTTP/1.1\r\nhost: h\r\ncontent-length: 1000000000\r\n\r\n",
            "413",
            "body_too_large",
        ),
        (
            "POST /v1/models/nope/predict HTTP/1.1\r\nhost: h\r\ncontent-length: 100\r\n\r\n{",
            "404",
            "unknown_model",
        ),
        (
            "POST /v1/models/ctr/predict HTTP/1.1\r\nhost: h\r\ncontent-type: text/plain\r\nexpect: 100-continue\r\ncontent-length: 100\r\n\r\n",
            "415",
            "unsupported_media_type",
        ),
        // An `Accept` that refuses both answer formats, on each route that negotiates one.
        (
            "POST /v1/models/ctr/predict HTTP/1.1\r\nhost: h\r\naccept: application/json;q=0, application/msgpack;q=0\r\nexpect: 100-continue\r\ncontent-length: 100\r\n\r\n",
            "406",
            "not_acceptable",
        ),
        (
            "POST /v1/features HTTP/1.1\r\nhost: h\r\naccept: application/json;q=0, application/msgpack;q=0\r\nexpect: 100-continue\r\ncontent-length: 100\r\n\r\n",
            "406",
            "not_acceptable",
        ),
        (
            "POST /get-online-features HTTP/1.1\r\nhost: h\r\naccept: application/json;q=0, application/msgpack;q=0\r\nexpect: 100-continue\r\ncontent-length: 100\r\n\r\n",
            "406",
            "not_acceptable",
        ),
        // The other routes whose path names what they act on.
        (
            "POST /v2/models/nope/infer HTTP/1.1\r\nhost: h\r\nexpect: 100-continue\r\ncontent-length: 100\r\n\r\n",
            "404",
            "",
        ),
        (
            "POST /v1/views/nope/rows HTTP/1.1\r\nhost: h\r\nexpect: 100-continue\r\ncontent-length: 100\r\n\r\n",
            "404",
            "unknown_view",
        ),
        // A body sent to a path no route has, and to a route that takes none.
        (
            "POST /v1/nope HTTP/1.1\r\nhost: h\r\ncontent-length: 100000\r\n\r\n",
            "404",
            "unknown_route",
        ),
        (
            "POST /v1/stats HTTP/1.1\r\nhost: h\r\ncontent-length: 100000\r\n\r\n",
            "405",
            "method_not_allowed",
        ),
        (
            "GET /v1/stats HTTP/1.1\r\nhost: h\r\ntransfer-encoding: chunked\r\n\r\n",
            "200",
            "",
        ),
    ] {
        let mut s = tokio::net::TcpStream::connect(app.addr.trim_start_matches("http://"))
            .await
            .expect("connect");
        s.write_all(head.as_bytes()).await.expect("send");
        let mut answer = vec![0u8; 4096];
        // Well inside limits.request_timeout (2 s), after which a stalled body would get 408.
        let n = tokio::time::timeout(std::time::Duration::from_secs(1), s.read(&mut answer))
            .await
            .expect("answered before the body")
            .expect("read");
        let text = String::from_utf8_lossy(&answer[..n]);
        assert!(text.starts_with(&format!("HTTP/1.1 {status} ")), "{text}");
        assert!(
            code.is_empty() || text.contains(&format!(r#""code":"{code}""#)),
            "{text}"
        );
        // Answered before the body was read: the connection closes, and the answer says so.
        assert!(
            text.to_ascii_lowercase()
                .contains("\r\nconnection: close\r\n"),
            "{text}"
        );
    }
    // Answers given once the body was read keep the connection open, refusals included.
    for body in [
        json!({"entities": {"user_id": "u_1"}, "candidates": [{"item_id": "i_1"}]}),
        json!({"candidates": [{"item_id": "i_1"}]}),
    ] {
        let r = app.predict("ctr", &body).await;
        assert!(
            !r.headers.contains_key("connection"),
            "{}: {:?}",
            r.status,
            r.headers
        );
    }
    // Two content types: which to believe would be a guess.
    let r = app
        .post_with(
            "/v1/models/ctr/predict",
            &[
                ("content-type", "application/json"),
                ("content-type", "application/msgpack"),
            ],
            b"{}".to_vec(),
        )
        .await;
    assert_eq!(r.status, 415, "{}", String::from_utf8_lossy(&r.body));
    assert!(
        String::from_utf8_lossy(&r.body).contains("more than one Content-Type"),
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    app.stop().await;
}

/// A client that sends its whole body before it reads (Python's `http.client`, reqwest) gets the refusal
/// that went out before the body was read, not a broken pipe or a reset: the gateway reads and discards
/// the rest before it closes.
#[tokio::test]
async fn a_client_that_sends_the_whole_body_first_still_reads_the_early_refusal() {
    let app = TestApp::spawn().await;
    app.wait_ready().await;
    let big = format!(
        r#"{{"entities": {{"user_id": "u_1"}}, "context": {{"device": "{}"}}}}"#,
        "x".repeat(3 << 20)
    );
    let chunked = {
        let mut b = String::new();
        for chunk in big.as_bytes().chunks(64 * 1024) {
            b.push_str(&format!("{:x}\r\n", chunk.len()));
            b.push_str(std::str::from_utf8(chunk).expect("ascii"));
            b.push_str("\r\n");
        }
        b.push_str("0\r\n\r\n");
        b
    };
    // Within limits.max_body_bytes (1 MiB), for the refusals that come before the length matters.
    let within = &big[..1_000_000];
    let sized = |path: &str, content_type: &str, body: &str| {
        format!(
            "POST {path} HTTP/1.1\r\nhost: h\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
    };
    for (request, status, code) in [
        (
            sized("/v1/models/ctr/predict", "application/json", &big),
            "413",
            "body_too_large",
        ),
        (
            format!(
                "POST /v1/models/ctr/predict HTTP/1.1\r\nhost: h\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n{chunked}"
            ),
            "413",
            "body_too_large",
        ),
        (
            sized("/v1/models/ctr/predict", "text/plain", within),
            "415",
            "unsupported_media_type",
        ),
        (
            sized("/v1/models/nope/predict", "application/json", within),
            "404",
            "unknown_model",
        ),
        // Routes that take no body: hyper reads one chunk of it and closes.
        (
            sized("/v1/stats", "application/json", within),
            "405",
            "method_not_allowed",
        ),
        (
            sized("/v1/no/such/route", "application/json", within),
            "404",
            "unknown_route",
        ),
    ] {
        let answer =
            common::exchange(&app.addr, request.as_bytes(), &format!("the {status} case")).await;
        let text = String::from_utf8_lossy(&answer);
        assert!(text.starts_with(&format!("HTTP/1.1 {status} ")), "{text}");
        assert!(text.contains(&format!(r#""code":"{code}""#)), "{text}");
    }
    // And through an HTTP client library.
    let r = app
        .post(
            "/v1/models/ctr/predict",
            "application/json",
            big.clone().into_bytes(),
        )
        .await;
    assert_eq!(r.status, 413);
    assert_eq!(r.code(), "body_too_large");
    // The gateway keeps serving.
    let ok = app
        .predict(
            "ctr",
            &json!({"entities": {"user_id": "u_1", "item_id": "i_1"}}),
        )
        .await;
    assert_eq!(ok.status, 200);
    app.stop().await;
}

/// Stored features that drive the model to NaN or infinity get a 422 naming the output, the candidate
/// and the entities whose features they are, not a `null` score in a 200 that says nothing was
/// degraded, nor a 500 that leaves the caller guessing.
#[tokio::test]
async fn a_non_finite_score_is_an_error_not_a_null() {
    let app = TestApp::spawn().await;
    let rows =
        json!({"rows": [{"user_id": "u_huge", "embedding": [3.4e38, -3.4e38, 3.4e38, -3.4e38]}]});
    assert_eq!(
        app.post_json("/v1/views/user_profile/rows", &rows)
            .await
            .status,
        200
    );
    let rows =
        json!({"rows": [{"item_id": "i_huge", "embedding": [3.4e38, 3.4e38, 3.4e38, 3.4e38]}]});
    assert_eq!(
        app.post_json("/v1/views/item_stats/rows", &rows)
            .await
            .status,
        200
    );
    let r = app
        .predict(
            "ctr",
            &json!({"entities": {"user_id": "u_huge"}, "candidates": [{"item_id": "i_1"}, {"item_id": "i_huge"}]}),
        )
        .await;
    assert_eq!(r.status, 422, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(
        r.json()["error"],
        json!({
            "code": "non_finite_output",
            "message": "candidates[0]: model `ctr` gave a non-finite `score` (NaN or infinity) from the features hydrated for user_id `u_huge` (view `user_profile`), item_id `i_1` (view `item_stats`): the model cannot score those values; correct the rows or the model",
            "field": "candidates[0]",
        })
    );
    // A request without candidates is one row, named by its entities alone.
    let r = app
        .predict(
            "ctr",
            &json!({"entities": {"user_id": "u_1", "item_id": "i_huge"}}),
        )
        .await;
    assert_eq!(r.status, 422, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()["error"]["field"], json!(null));
    let says = r.message();
    assert!(
        says.starts_with("model `ctr` gave a non-finite `score`")
            && says.contains("item_id `i_huge`"),
        "{says}"
    );
    // The context sent is an input too, and is named beside the entities: it may be what the model
    // cannot score.
    let r = app
        .predict(
            "ctr",
            &json!({"entities": {"user_id": "u_1", "item_id": "i_huge"}, "context": {"hour_of_day": 20, "device": "ios"}}),
        )
        .await;
    assert_eq!(r.status, 422, "{}", String::from_utf8_lossy(&r.body));
    let says = r.message();
    assert!(
        says.contains(
            "(view `item_stats`) and the context sent (`context.hour_of_day`, `context.device`)"
        ) && says.ends_with("check the context values sent, the rows and the model"),
        "{says}"
    );
    // Counted as refused, not as a gateway error.
    let stats = app.get("/v1/stats").await.json();
    assert_eq!(
        (
            &stats["models"]["ctr"]["errors"],
            &stats["models"]["ctr"]["rejected"]
        ),
        (&json!(0), &json!(3)),
        "{stats}"
    );
    let ok = app
        .predict(
            "ctr",
            &json!({"entities": {"user_id": "u_1"}, "candidates": [{"item_id": "i_1"}]}),
        )
        .await;
    assert_eq!(ok.status, 200);
}

/// A value that its transforms take beyond float32 would reach the model as infinity. A stored one is
/// unusable: its slot takes the default and is listed in `defaulted`, and the score is the one that
/// default gives. A context one is the caller's to fix: 400, naming the field.
#[tokio::test]
async fn values_beyond_float32_after_their_transforms_never_reach_the_model() {
    // `price` (float64) fed as is, and `hour_of_day` standardized by a tiny std: 12 (the default) is 0,
    // 13 is 1e300.
    let schemas = common::schemas_with_ctr_edit(
        "  - feature: item_stats:price\n    transform: log1p\n",
        "  - feature: item_stats:price\n",
    );
    let ctr = schemas.path().join("ctr.yaml");
    let text = std::fs::read_to_string(&ctr).expect("read");
    let hour = "transform: {bucketize: {boundaries: [6, 12, 18]}}";
    assert!(text.contains(hour));
    std::fs::write(
        &ctr,
        text.replace(hour, "transform: {standardize: {mean: 12, std: 1.0e-300}}"),
    )
    .expect("write");
    let mut config = common::test_config();
    config.registry.schemas = schemas.path().to_owned();
    let (store, dir) = common::demo_store().await;
    let app = TestApp::spawn_with(config, store, Some(dir)).await;
    app.wait_ready().await;

    // Two items alike but for the price: one beyond float32, one at the view's default (20.0).
    let rows = json!({"rows": [
        {"item_id": "i_huge", "category": "tech", "price": 1e39},
        {"item_id": "i_dflt", "category": "tech", "price": 20.0},
    ]});
    let r = app.post_json("/v1/views/item_stats/rows", &rows).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let ask = |item: &str, hour: i64| {
        json!({"entities": {"user_id": "u_1"}, "context": {"hour_of_day": hour},
               "candidates": [{"item_id": item}], "options": {"return_features": true}})
    };
    let huge = app.predict("ctr", &ask("i_huge", 12)).await;
    assert_eq!(huge.status, 200, "{}", String::from_utf8_lossy(&huge.body));
    let huge = huge.json();
    let dflt = app.predict("ctr", &ask("i_dflt", 12)).await.json();
    let listed = |reply: &Json| {
        reply["defaulted"]
            .as_array()
            .is_some_and(|d| d.contains(&json!("item_stats:price")))
    };
    assert!(listed(&huge) && !listed(&dflt), "{huge} vs {dflt}");
    assert_eq!(scores(&huge), scores(&dflt), "{huge} vs {dflt}");
    assert_eq!(huge["features"], dflt["features"]);

    let r = app.predict("ctr", &ask("i_dflt", 13)).await;
    assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(&r.body));
    let body = r.json();
    assert_eq!(body["error"]["code"], "invalid_field", "{body}");
    assert_eq!(body["error"]["field"], "context.hour_of_day", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("beyond float32")),
        "{body}"
    );
    app.stop().await;
}

/// A client that shuts its write side once the request is sent (HTTP/1.0-style tools, `nc -N`, a proxy
/// passing on the client's FIN) still gets the answer, and a write it sent is answered, never applied in
/// silence.
#[tokio::test]
async fn a_client_that_half_closes_after_its_request_still_gets_the_answer() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let app = TestApp::spawn().await;
    app.wait_ready().await;
    let addr: std::net::SocketAddr = app
        .addr
        .trim_start_matches("http://")
        .parse()
        .expect("address");
    let post = |path: &str, body: &str| {
        format!(
            "POST {path} HTTP/1.1\r\nhost: h\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
    };
    let predict = post(
        "/v1/models/ctr/predict",
        r#"{"entities": {"user_id": "u_24"}, "candidates": [{"item_id": "i_1"}]}"#,
    );
    let write = post(
        "/v1/views/user_profile/rows",
        r#"{"rows": [{"user_id": "u_half", "age": 64}]}"#,
    );
    for (what, request, answers) in [
        ("a predict", predict.clone(), 1),
        ("a rows write", write, 1),
        (
            "GET /v2/health/live",
            "GET /v2/health/live HTTP/1.1\r\nhost: h\r\n\r\n".to_owned(),
            1,
        ),
        ("two pipelined predicts", format!("{predict}{predict}"), 2),
    ] {
        let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
        s.write_all(request.as_bytes()).await.expect("send");
        s.shutdown().await.expect("shut the write side");
        let mut answer = Vec::new();
        tokio::time::timeout(
            std::time::Duration::from_secs(10),
            s.read_to_end(&mut answer),
        )
        .await
        .unwrap_or_else(|_| panic!("{what}: no end to the answer"))
        .unwrap_or_else(|e| panic!("{what}: reading the answer failed: {e}"));
        let text = String::from_utf8_lossy(&answer);
        assert_eq!(
            text.matches("HTTP/1.1 200 OK").count(),
            answers,
            "{what}: {text}"
        );
    }
    let j = app
        .post_json(
            "/v1/features",
            &json!({"entities": {"user_id": "u_half"}, "features": ["user_profile:age"]}),
        )
        .await
        .json();
    assert_eq!(j["features"]["user_profile:age"]["values"][0], 64);
}

/// hyper decodes `chunked` and passes other transfer codings through undecoded: a `gzip, chunked` body
/// would reach the decoder as gzip bytes. Anything but one `chunked` gets 501 naming the coding.
#[tokio::test]
async fn transfer_codings_other_than_chunked_are_refused_by_name() {
    let app = TestApp::spawn().await;
    app.wait_ready().await;
    let body = r#"{"entities": {"user_id": "u_24"}, "candidates": [{"item_id": "i_1"}]}"#;
    let chunked = format!("{:x}\r\n{body}\r\n0\r\n\r\n", body.len());
    for (codings, status) in [
        ("transfer-encoding: chunked\r\n", "200"),
        ("transfer-encoding: Chunked\r\n", "200"),
        ("transfer-encoding: gzip, chunked\r\n", "501"),
        ("transfer-encoding: chunked, chunked\r\n", "501"),
        (
            "transfer-encoding: x-custom\r\ntransfer-encoding: chunked\r\n",
            "501",
        ),
    ] {
        let request = format!(
            "POST /v1/models/ctr/predict HTTP/1.1\r\nhost: h\r\ncontent-type: application/json\r\n{codings}connection: close\r\n\r\n{chunked}"
        );
        let answer = common::exchange(&app.addr, request.as_bytes(), codings).await;
        let text = String::from_utf8_lossy(&answer);
        assert!(
            text.starts_with(&format!("HTTP/1.1 {status} ")),
            "{codings}: {text}"
        );
        if status == "501" {
            let (_, json_body) = text.split_once("\r\n\r\n").expect("a body");
            let j: Json = serde_json::from_str(json_body).expect("a JSON error body");
            assert_eq!(j["error"]["code"], "unsupported_transfer_coding", "{j}");
            let named = codings
                .lines()
                .next()
                .and_then(|l| l.split_once(": "))
                .expect("a header")
                .1;
            assert!(
                j["error"]["message"]
                    .as_str()
                    .expect("message")
                    .contains(named),
                "{j}"
            );
        }
    }
    // Those are the caller's to change: counted as rejected, not as the gateway's errors.
    let stats = app.get("/v1/stats").await.json();
    let ctr = &stats["models"]["ctr"];
    assert_eq!(
        (ctr["errors"].as_u64(), ctr["rejected"].as_u64()),
        (Some(0), Some(3)),
        "{ctr}"
    );
}

/// A body that arrives in pieces (several chunks, sent apart, and a Content-Length body split across
/// writes) is read whole: the answer is the one the same body sent at once gets. A chunk that breaks off
/// is a 400 naming the framing.
#[tokio::test]
async fn a_body_sent_in_pieces_is_read_whole() {
    let app = TestApp::spawn().await;
    app.wait_ready().await;
    let body = r#"{"entities": {"user_id": "u_24"}, "context": {"hour_of_day": 9, "device": "web"}, "candidates": [{"item_id": "i_1"}, {"item_id": "i_2"}]}"#;
    let whole = app
        .settled_predict("ctr", &serde_json::from_str(body).expect("json"))
        .await
        .json();
    let head = "POST /v1/models/ctr/predict HTTP/1.1\r\nhost: h\r\ncontent-type: application/json\r\nconnection: close\r\n";
    let (a, rest) = body.split_at(17);
    let (b, c) = rest.split_at(40);
    let chunk = |s: &str| format!("{:x}\r\n{s}\r\n", s.len());
    let cases = [
        (
            "chunked, three chunks",
            vec![
                format!("{head}transfer-encoding: chunked\r\n\r\n{}", chunk(a)),
                chunk(b),
                format!("{}0\r\n\r\n", chunk(c)),
            ],
            "200",
        ),
        (
            "content-length, three writes",
            vec![
                format!("{head}content-length: {}\r\n\r\n{a}", body.len()),
                b.to_owned(),
                c.to_owned(),
            ],
            "200",
        ),
        (
            "chunked, a chunk that breaks off",
            vec![
                format!("{head}transfer-encoding: chunked\r\n\r\n{}", chunk(a)),
                "zz\r\nnot a chunk\r\n".to_owned(),
            ],
            "400",
        ),
    ];
    for (what, pieces, status) in cases {
        let pieces: Vec<&[u8]> = pieces.iter().map(|p| p.as_bytes()).collect();
        let answer = common::exchange_in_pieces(&app.addr, &pieces, what).await;
        let text = String::from_utf8_lossy(&answer);
        assert!(
            text.starts_with(&format!("HTTP/1.1 {status} ")),
            "{what}: {text}"
        );
        let (_, json_body) = text.split_once("\r\n\r\n").expect("a body");
        let j: Json = serde_json::from_str(json_body).expect("a JSON body");
        if status == "200" {
            assert_eq!(j["degraded"], false, "{what}: {j}");
            assert_eq!(common::scores(&j), common::scores(&whole), "{what}: {j}");
            assert_eq!(common::scores(&j).len(), 2, "{what}: {j}");
            // The body's pieces came 30 ms apart: the time spent waiting for them is the request's,
            // in `decode` and in the total (from when the gateway took the request, as
            // `hydrant_request_duration_seconds` counts it).
            let timing = text
                .lines()
                .find_map(|l| l.strip_prefix("server-timing: "))
                .unwrap_or_else(|| panic!("{what}: no server-timing in {text}"));
            let dur = |stage: &str| -> f64 {
                timing
                    .split(", ")
                    .find_map(|p| p.strip_prefix(&format!("{stage};dur=")))
                    .and_then(|v| v.parse().ok())
                    .unwrap_or_else(|| panic!("{what}: no {stage} in {timing}"))
            };
            assert!(
                dur("decode") >= 55.0 && dur("total") >= dur("decode"),
                "{what}: {timing}"
            );
        } else {
            assert_eq!(j["error"]["code"], "invalid_body", "{what}: {j}");
            assert!(
                j["error"]["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("framing")),
                "{what}: {j}"
            );
        }
    }
    // `/v1/stats` times them so too: its total's p99 is one of the slow bodies.
    let stats = app.get("/v1/stats").await.json();
    let p99 = stats["models"]["ctr"]["stages"]["total"]["p99_us"]
        .as_u64()
        .unwrap_or(0);
    assert!(p99 >= 55_000, "{}", stats["models"]["ctr"]["stages"]);
}

/// curl's `-d` sends `application/x-www-form-urlencoded` unless a type is given: the 415 says so and what
/// to add, on every route that reads a body, where any other refused type gets no such hint.
#[tokio::test]
async fn a_form_type_is_refused_with_the_header_curl_needs() {
    let app = TestApp::spawn().await;
    let body = serde_json::to_vec(&json!({"entities": {"user_id": "u_1", "item_id": "i_1"}}))
        .expect("json");
    for (path, send) in [
        ("/v1/models/ctr/predict", "application/json"),
        ("/v1/features", "application/json"),
        ("/get-online-features", "application/json"),
        ("/v2/models/ctr/infer", "application/json"),
        ("/v1/schemas:validate", "application/yaml"),
    ] {
        let r = app
            .post(path, "application/x-www-form-urlencoded", body.clone())
            .await;
        assert_eq!(
            r.status,
            415,
            "{path}: {}",
            String::from_utf8_lossy(&r.body)
        );
        // The V2 route's error is a string.
        let error = &r.json()["error"];
        let m = error["message"].as_str().or(error.as_str()).unwrap_or("");
        assert!(
            m.contains("unsupported content type `application/x-www-form-urlencoded`")
                && m.contains(&format!("add `-H 'Content-Type: {send}'`")),
            "{path}: {m}"
        );
        let r = app.post(path, "text/csv", body.clone()).await;
        assert_eq!(r.status, 415, "{path}");
        let error = &r.json()["error"];
        let m = error["message"].as_str().or(error.as_str()).unwrap_or("");
        assert!(m.contains("text/csv") && !m.contains("curl"), "{path}: {m}");
    }
}

/// Rows for one key in one request: the last wins, and only it is written and announced (`written`
/// still counts the rows sent).
#[tokio::test]
async fn rows_for_one_key_in_one_request_write_the_last_once() {
    use std::sync::atomic::Ordering::Relaxed;
    let app = TestApp::spawn().await;
    let store = app.gateway.telemetry.store("embedded");
    let inv = &app.gateway.telemetry.invalidation;
    let (keys_before, published_before) = (
        store.writes.keys.load(Relaxed),
        inv.published_keys.load(Relaxed),
    );
    let rows = json!({"rows": [
        {"user_id": "u_dup", "age": 1},
        {"user_id": "u_other", "age": 5},
        {"user_id": "u_dup", "age": 2},
        {"user_id": "u_dup", "age": 3},
    ]});
    let r = app.post_json("/v1/views/user_profile/rows", &rows).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()["written"], 4);
    assert_eq!(store.writes.keys.load(Relaxed) - keys_before, 2);
    // Announced to nobody: an embedded store has no other replica (`tests/redis.rs` counts them there).
    assert_eq!(inv.published_keys.load(Relaxed) - published_before, 0);
    assert_eq!(r.json()["announced"], true, "nobody was left out");
    let j = app
        .post_json(
            "/v1/features",
            &json!({"entities": {"user_id": ["u_dup", "u_other"]}, "features": ["user_profile:age"]}),
        )
        .await
        .json();
    assert_eq!(
        j["features"]["user_profile:age"]["values"],
        json!([3, 5]),
        "{j}"
    );
}
