//! `POST /get-online-features`: Feast's feature-server read. Values are checked against the demo rows
//! (the files the store was loaded from), and the request is sent as Feast's own clients send it.

mod common;

use common::{TestApp, demo_rows};
use serde_json::{Value as Json, json};

/// The answer's column `name`: (values, statuses, event timestamps).
fn column(j: &Json, name: &str) -> (Vec<Json>, Vec<String>, Vec<String>) {
    let names = j["metadata"]["feature_names"]
        .as_array()
        .unwrap_or_else(|| panic!("feature_names in {j}"));
    let at = names
        .iter()
        .position(|n| n == name)
        .unwrap_or_else(|| panic!("no column {name} in {names:?}"));
    let col = &j["results"][at];
    let strings = |k: &str| -> Vec<String> {
        col[k]
            .as_array()
            .unwrap_or_else(|| panic!("{k} of {name}"))
            .iter()
            .map(|s| s.as_str().expect("a string").to_owned())
            .collect()
    };
    (
        col["values"].as_array().expect("values").clone(),
        strings("statuses"),
        strings("event_timestamps"),
    )
}

#[tokio::test]
async fn online_features_are_the_rows_loaded_as_feast_columns() {
    let app = TestApp::spawn().await;
    let users = demo_rows("user_profile", "user_id");
    let items = demo_rows("item_stats", "item_id");
    // Sent as Feast's Python client sends it: a JSON string body with no content type. (Written out,
    // since the order of the join keys is the order of the answer's first columns.)
    let body = r#"{"features": ["user_profile:age", "user_profile:embedding", "item_stats:price", "user_profile:country"],
                   "entities": {"user_id": ["u_5", "u_missing", "u_6"], "item_id": ["i_3", "i_4", "i_nope"]}}"#;
    let r = app
        .post_with("/get-online-features", &[], body.as_bytes().to_vec())
        .await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert!(r.headers.get("x-hydrant-degraded").is_none());
    let j = r.json();
    assert_eq!(
        j["metadata"]["feature_names"],
        json!(["user_id", "item_id", "age", "embedding", "price", "country"]),
        "join keys first, then the features in the order asked"
    );
    assert_eq!(j["results"].as_array().expect("results").len(), 6);

    // The join keys come back as sent, PRESENT, at the epoch.
    let (v, s, t) = column(&j, "user_id");
    assert_eq!(v, vec![json!("u_5"), json!("u_missing"), json!("u_6")]);
    assert_eq!(s, vec!["PRESENT"; 3]);
    assert_eq!(t, vec!["1970-01-01T00:00:00Z"; 3]);

    // Features: the stored values; a missing entity is null and NOT_FOUND (Feast has no defaults).
    let (v, s, t) = column(&j, "age");
    assert_eq!(
        v,
        vec![
            users["u_5"]["age"].clone(),
            Json::Null,
            users["u_6"]["age"].clone()
        ]
    );
    assert_eq!(s, vec!["PRESENT", "NOT_FOUND", "PRESENT"]);
    assert_eq!(t[1], "1970-01-01T00:00:00Z");
    for present in [&t[0], &t[2]] {
        let ms = hydrant::clock::rfc3339_ms(present).expect("an RFC 3339 time");
        let age_ms = hydrant::value::now_ms() - ms;
        assert!(
            (0..600_000).contains(&age_ms),
            "the demo rows carry no event time, so they were stamped when loaded: {present}"
        );
    }
    let (v, _, _) = column(&j, "embedding");
    for (got, want) in v[2]
        .as_array()
        .expect("a list")
        .iter()
        .zip(users["u_6"]["embedding"].as_array().expect("a list"))
    {
        assert!((got.as_f64().expect("f") - want.as_f64().expect("f")).abs() < 1e-6);
    }
    assert_eq!(v[1], Json::Null);
    let (v, s, _) = column(&j, "price");
    assert_eq!(s, vec!["PRESENT", "PRESENT", "NOT_FOUND"]);
    for (i, item) in ["i_3", "i_4"].iter().enumerate() {
        assert_eq!(v[i], items[*item]["price"], "{item}");
    }
    // A float32 in the digits Feast's server writes it in, the float64 it widens to (0.03423 is
    // 0.03423000127077103), so that either server's answer parses to the same numbers.
    let r = app
        .post_json(
            "/get-online-features",
            &json!({"features": ["item_stats:ctr_7d", "item_stats:embedding"], "entities": {"item_id": ["i_3"]}}),
        )
        .await;
    let floats = r.json();
    let widened = |v: &Json| f64::from(v.as_f64().expect("a number") as f32);
    assert_eq!(
        floats["results"][1]["values"][0].as_f64(),
        Some(widened(&items["i_3"]["ctr_7d"]))
    );
    for (got, stored) in floats["results"][2]["values"][0]
        .as_array()
        .expect("a list")
        .iter()
        .zip(items["i_3"]["embedding"].as_array().expect("a list"))
    {
        assert_eq!(got.as_f64(), Some(widened(stored)));
    }
    let (v, _, _) = column(&j, "country");
    assert_eq!(v[0], users["u_5"]["country"]);
}

#[tokio::test]
async fn event_times_nulls_and_max_age_read_as_feast_statuses() {
    let app = TestApp::spawn().await;
    let now = hydrant::value::now_ms();
    let two_years_ago = now - 2 * 365 * 86_400_000;
    // A day ago, at 250 ms past a second.
    let dated = (now - 86_400_000) / 1000 * 1000 + 250;
    let rows = format!(
        "{{\"user_id\": \"u_dated\", \"age\": 41, \"avg_session_minutes\": null, \"event_timestamp\": {dated}}}\n\
         {{\"user_id\": \"u_old\", \"age\": 52, \"event_timestamp\": {two_years_ago}}}\n"
    );
    common::load_rows(&app.store, "user_profile", rows.as_bytes(), false).await;
    let body = json!({
        "features": ["user_profile:age", "user_profile:avg_session_minutes"],
        "entities": {"user_id": ["u_dated", "u_old"]},
    });
    let r = app.post_json("/get-online-features", &body).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let j = r.json();
    let (v, s, t) = column(&j, "age");
    assert_eq!(v[0], 41);
    assert_eq!(s[0], "PRESENT");
    assert!(t[0].ends_with(".250Z"), "{}", t[0]);
    assert_eq!(hydrant::clock::rfc3339_ms(&t[0]), Some(dated));
    // Older than the view's max_age (365d): no value, and the time that made it too old.
    assert_eq!(v[1], Json::Null);
    assert_eq!(s[1], "OUTSIDE_MAX_AGE");
    assert_eq!(hydrant::clock::rfc3339_ms(&t[1]), Some(two_years_ago));
    // A null stored for a present entity: NULL_VALUE, with the record's time.
    let (v, s, t) = column(&j, "avg_session_minutes");
    assert_eq!((v[0].clone(), s[0].as_str()), (Json::Null, "NULL_VALUE"));
    assert_eq!(hydrant::clock::rfc3339_ms(&t[0]), Some(dated));
}

#[tokio::test]
async fn a_feature_service_is_a_model_and_full_names_keep_views_apart() {
    let app = TestApp::spawn().await;
    let users = demo_rows("user_profile", "user_id");
    let items = demo_rows("item_stats", "item_id");
    let body = json!({
        "feature_service": "ctr",
        "entities": {"user_id": ["u_7"], "item_id": ["i_2"]},
        "full_feature_names": true,
    });
    let r = app.post_json("/get-online-features", &body).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let j = r.json();
    // Every view feature the ctr binding reads, named view__feature, in binding order.
    let registry = common::registry();
    let model = &registry.models["ctr"];
    // The join keys in the order sent (`json!` writes object keys sorted), then the features.
    let mut want = vec!["item_id".to_owned(), "user_id".to_owned()];
    for slot in &model.slots {
        if let hydrant::schema::Source::View { view, feature } = slot.source {
            let v = &model.views[view];
            let name = format!("{}__{}", v.name, v.features[feature].name);
            if !want.contains(&name) {
                want.push(name);
            }
        }
    }
    assert!(want.len() > 4, "{want:?}");
    assert_eq!(j["metadata"]["feature_names"], json!(want));
    assert_eq!(column(&j, "user_profile__age").0[0], users["u_7"]["age"]);
    assert_eq!(
        column(&j, "item_stats__category").0[0],
        items["i_2"]["category"]
    );

    // Two views with a feature of the same name: refused unless the full names tell them apart.
    let both = |full: bool| {
        json!({
            "features": ["user_profile:embedding", "item_stats:embedding"],
            "entities": {"user_id": ["u_7"], "item_id": ["i_2"]},
            "full_feature_names": full,
        })
    };
    let r = app.post_json("/get-online-features", &both(false)).await;
    assert_eq!((r.status, r.code().as_str()), (400, "ambiguous_feature"));
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .expect("message")
            .contains("full_feature_names"),
        "{}",
        r.json()
    );
    let r = app.post_json("/get-online-features", &both(true)).await;
    assert_eq!(r.status, 200);
    let j = r.json();
    assert_eq!(
        j["metadata"]["feature_names"],
        json!([
            "item_id",
            "user_id",
            "user_profile__embedding",
            "item_stats__embedding"
        ])
    );
}

/// Full names are `view__feature`, so `a__b:c` and `a:b__c` are both `a__b__c`: refused, naming the two
/// and the shared name, rather than telling the caller to set the option it already set.
#[tokio::test]
async fn full_names_that_still_collide_are_named() {
    let dir = common::schemas_with_edit("entities.yaml", "kind:", "kind:");
    std::fs::write(
        dir.path().join("collide.yaml"),
        "kind: view\nname: a__b\nversion: 1\nentity: user_id\nfeatures:\n  - {name: c, dtype: int64, default: 0}\n---\nkind: view\nname: a\nversion: 1\nentity: user_id\nfeatures:\n  - {name: b__c, dtype: int64, default: 0}\n",
    )
    .expect("write");
    let mut config = common::test_config();
    config.registry.schemas = dir.path().to_path_buf();
    let (store, store_dir) = common::demo_store().await;
    let app = TestApp::spawn_with(config, store, Some(store_dir)).await;
    let body = |full: bool| {
        json!({
            "features": ["a__b:c", "a:b__c"],
            "entities": {"user_id": ["u_7"]},
            "full_feature_names": full,
        })
    };
    let r = app.post_json("/get-online-features", &body(true)).await;
    assert_eq!((r.status, r.code().as_str()), (400, "ambiguous_feature"));
    let message = r.message();
    assert!(
        message.contains("`a:b__c` and `a__b:c` are both named `a__b__c`")
            && !message.contains("set full_feature_names"),
        "{message}"
    );
    // Without full names, they are `c` and `b__c`: apart.
    let r = app.post_json("/get-online-features", &body(false)).await;
    assert_eq!(r.status, 200, "{}", r.json());
    app.stop().await;
    drop(dir);
}

#[tokio::test]
async fn mistakes_get_a_400_that_names_the_field() {
    let app = TestApp::spawn().await;
    let cases: Vec<(&str, Json, u16, &str, &str)> = vec![
        (
            "lists of different lengths",
            json!({"features": ["user_profile:age", "item_stats:price"], "entities": {"user_id": ["u_1", "u_2"], "item_id": ["i_1"]}}),
            400,
            "invalid_field",
            "entities.item_id",
        ),
        (
            "features and a feature service",
            json!({"features": ["user_profile:age"], "feature_service": "ctr", "entities": {"user_id": ["u_1"]}}),
            400,
            "invalid_field",
            "feature_service",
        ),
        (
            "neither features nor a feature service",
            json!({"entities": {"user_id": ["u_1"]}}),
            400,
            "invalid_field",
            "features",
        ),
        (
            "no entities",
            json!({"features": ["user_profile:age"], "entities": {}}),
            400,
            "missing_entity",
            "entities",
        ),
        (
            "an empty key list",
            json!({"features": ["user_profile:age"], "entities": {"user_id": []}}),
            400,
            "missing_entity",
            "entities.user_id",
        ),
        (
            "the view's join key missing",
            json!({"features": ["item_stats:price"], "entities": {"user_id": ["u_1"]}}),
            400,
            "missing_entity",
            "entities.item_id",
        ),
        (
            "a key of the wrong type for a join key no requested view uses",
            json!({"features": ["user_profile:age"], "entities": {"user_id": ["u_1"], "item_id": [7]}}),
            400,
            "invalid_entity_key",
            "entities.item_id[0]",
        ),
        (
            "an unregistered entity",
            json!({"features": ["user_profile:age"], "entities": {"driver_id": [1001]}}),
            400,
            "unknown_entity",
            "entities.driver_id",
        ),
        (
            "an unknown feature",
            json!({"features": ["user_profile:agee"], "entities": {"user_id": ["u_1"]}}),
            400,
            "unknown_feature",
            "features[0]",
        ),
        (
            "an unknown view",
            json!({"features": ["user_profile:age", "driver_stats:conv_rate"], "entities": {"user_id": ["u_1"]}}),
            400,
            "unknown_view",
            "features[1]",
        ),
        (
            "an unknown feature service",
            json!({"feature_service": "driver_activity", "entities": {"user_id": ["u_1"]}}),
            400,
            "unknown_feature_service",
            "feature_service",
        ),
        (
            "an integer key for a string entity",
            json!({"features": ["user_profile:age"], "entities": {"user_id": ["u_1", 7]}}),
            400,
            "invalid_entity_key",
            "entities.user_id[1]",
        ),
        (
            "request context for on-demand views",
            json!({"features": ["user_profile:age"], "entities": {"user_id": ["u_1"]}, "request_context": {"val": [1]}}),
            400,
            "invalid_field",
            "request_context",
        ),
        (
            "an unknown field",
            json!({"features": ["user_profile:age"], "entities": {"user_id": ["u_1"]}, "project": "p"}),
            400,
            "invalid_field",
            "project",
        ),
        (
            "features that is not a list",
            json!({"features": "user_profile:age", "entities": {"user_id": ["u_1"]}}),
            400,
            "invalid_field",
            "features",
        ),
    ];
    for (name, body, status, code, field) in cases {
        let r = app.post_json("/get-online-features", &body).await;
        let j = r.json();
        assert_eq!((r.status, r.code().as_str()), (status, code), "{name}: {j}");
        let message = j["error"]["message"].as_str().expect("a message");
        assert!(
            j["error"]["field"] == field || message.contains(field),
            "{name}: the error should name {field}: {j}"
        );
    }
    // What Feast's own client sends on every call, and a join key no requested view uses, which Feast
    // answers as a column of the keys sent.
    let r = app
        .post_json(
            "/get-online-features",
            &json!({"features": ["user_profile:age"], "entities": {"item_id": ["i_1"], "user_id": ["u_1"]}, "full_feature_names": false, "include_feature_view_version_metadata": false}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let j = r.json();
    assert_eq!(
        j["metadata"],
        json!({"feature_names": ["item_id", "user_id", "age"]})
    );
    assert_eq!(j["results"][0]["values"], json!(["i_1"]));
    assert_eq!(j["results"][0]["statuses"], json!(["PRESENT"]));
    let r = app
        .post_json(
            "/get-online-features",
            &json!({"features": ["item_stats:price", "user_profile:age"], "entities": {"item_id": ["i_1"], "user_id": ["u_1"]}, "include_feature_view_version_metadata": true}),
        )
        .await;
    assert_eq!(
        r.json()["metadata"]["feature_view_metadata"],
        json!([{"name": "item_stats", "version": 1}, {"name": "user_profile", "version": 1}])
    );
    // More keys than limits.max_entities, over all the join keys.
    let many: Vec<String> = (0..=app.config.limits.max_entities)
        .map(|i| format!("u_{i}"))
        .collect();
    let r = app
        .post_json(
            "/get-online-features",
            &json!({"features": ["user_profile:age"], "entities": {"user_id": many}}),
        )
        .await;
    assert_eq!((r.status, r.code().as_str()), (413, "too_many_entities"));
    // Still serving.
    let r = app
        .post_json(
            "/get-online-features",
            &json!({"features": ["user_profile:age"], "entities": {"user_id": ["u_1"]}}),
        )
        .await;
    assert_eq!(r.status, 200);
}

#[tokio::test]
async fn a_msgpack_caller_gets_msgpack_and_the_route_is_counted() {
    let app = TestApp::spawn().await;
    let body = rmp_serde::to_vec_named(&json!({
        "features": ["user_profile:age"],
        "entities": {"user_id": ["u_1"]},
    }))
    .expect("msgpack");
    let r = app
        .post("/get-online-features", "application/msgpack", body)
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.headers["content-type"], "application/msgpack");
    let j: Json = rmp_serde::from_slice(&r.body).expect("a MessagePack answer");
    assert_eq!(j["metadata"]["feature_names"], json!(["user_id", "age"]));
    assert_eq!(
        j["results"][1]["values"][0],
        demo_rows("user_profile", "user_id")["u_1"]["age"]
    );
    // The request as an array, its fields by position: entities, features, feature_service,
    // full_feature_names, request_context, include_feature_view_version_metadata.
    let positional = rmp_serde::to_vec(&json!([
        {"user_id": ["u_1"]},
        ["user_profile:age"],
        null,
        false,
        null,
        true
    ]))
    .expect("msgpack");
    let r = app
        .post("/get-online-features", "application/msgpack", positional)
        .await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let j: Json = rmp_serde::from_slice(&r.body).expect("a MessagePack answer");
    assert_eq!(
        j["metadata"]["feature_view_metadata"],
        json!([{"name": "user_profile", "version": 1}])
    );
    let metrics = String::from_utf8(app.get("/metrics").await.body).expect("utf-8");
    assert!(
        metrics.contains(
            "hydrant_request_duration_seconds_count{route=\"/get-online-features\",model=\"\",status=\"200\"} 2"
        ),
        "{}",
        metrics
            .lines()
            .filter(|l| l.starts_with("hydrant_request_duration_seconds_count"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}
