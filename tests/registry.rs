//! Registering schema changes while serving: `PUT`/`DELETE /v1/schemas/{kind}/{name}`, `POST
//! /v1/schemas`, kept versions and rollback. Each test runs a gateway over its own copy of the repo's
//! schemas, edited as a data team would edit them, and checks what is served, what is on disk, and what
//! a restart serves.

mod common;

use common::{Reply, TestApp, demo_rows, root};
use serde_json::{Value as Json, json};

fn schema_file(file: &str) -> String {
    std::fs::read_to_string(root().join("schemas").join(file)).expect("schema file")
}

fn edit(text: &str, from: &str, to: &str) -> String {
    assert!(text.contains(from), "the schema holds {from:?}");
    text.replacen(from, to, 1)
}

/// Version 2 of the `user_profile` view in `v1` (its text at version 1): one feature more,
/// `tenure_days`.
fn with_tenure_days(v1: &str) -> String {
    edit(
        &edit(v1, "version: 1", "version: 2"),
        "  - {name: age, dtype: int64, default: 30}\n",
        "  - {name: age, dtype: int64, default: 30}\n  - {name: tenure_days, dtype: int64, default: 7}\n",
    )
}

/// A gateway over a copy of the repo's schemas (in `dir`) with registering on.
async fn spawn(dir: &tempfile::TempDir, writes: bool) -> TestApp {
    spawn_configured(dir, |c| c.registry.writes = writes).await
}

/// A gateway over `dir` with registering on that reads the folder every `interval`.
async fn watching(dir: &tempfile::TempDir, interval: std::time::Duration) -> TestApp {
    spawn_configured(dir, |c| {
        c.registry.writes = true;
        c.registry.reload_interval = interval;
    })
    .await
}

/// A gateway over the schemas in `dir`, configured further by `set`.
async fn spawn_configured(
    dir: &tempfile::TempDir,
    set: impl FnOnce(&mut hydrant::config::Config),
) -> TestApp {
    let mut c = common::test_config();
    c.registry.schemas = dir.path().to_owned();
    set(&mut c);
    let (store, store_dir) = common::demo_store().await;
    TestApp::spawn_with(c, store, Some(store_dir)).await
}

fn copy_of_schemas() -> tempfile::TempDir {
    common::schemas_with_ctr_edit("version: 1", "version: 1")
}

async fn send(app: &TestApp, method: reqwest::Method, path: &str, body: Option<&str>) -> Reply {
    let mut req = app.client.request(method, format!("{}{path}", app.addr));
    if let Some(body) = body {
        req = req
            .header("content-type", "application/yaml")
            .body(body.to_owned());
    }
    Reply::read(req.send().await.expect("request sent")).await
}

async fn put(app: &TestApp, path: &str, body: &str) -> Reply {
    send(app, reqwest::Method::PUT, path, Some(body)).await
}

/// `POST /v1/schemas:validate` with `body`: the dry run of a registration.
async fn validate(app: &TestApp, body: &str) -> Reply {
    send(
        app,
        reqwest::Method::POST,
        "/v1/schemas:validate",
        Some(body),
    )
    .await
}

async fn delete(app: &TestApp, path: &str) -> Reply {
    send(app, reqwest::Method::DELETE, path, None).await
}

/// `POST {path}/rollback` with `body`.
async fn rollback(app: &TestApp, path: &str, body: Json) -> Reply {
    app.post_json(&format!("{path}/rollback"), &body).await
}

/// A rollback of `user_profile` to `version` refused with 409 `code`; its message.
async fn kept_refused(app: &TestApp, version: u32, code: &str) -> String {
    let r = rollback(
        app,
        "/v1/schemas/views/user_profile",
        json!({ "version": version }),
    )
    .await;
    assert_eq!(
        (r.status, r.code().as_str()),
        (409, code),
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    r.json()["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

fn ok(r: &Reply) -> Json {
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    r.json()
}

/// `user_profile:age` of `user` as `/v1/features` serves it: (value, status).
async fn age(app: &TestApp, user: &str) -> (Json, String) {
    let body = json!({"entities": {"user_id": [user]}, "features": ["user_profile:age"]});
    let j = ok(&app.post_json("/v1/features", &body).await);
    let age = &j["features"]["user_profile:age"];
    (
        age["values"][0].clone(),
        age["statuses"][0].as_str().unwrap_or_default().to_owned(),
    )
}

/// A new version with the same features still leaves the rows stored under the old one unread (a record is
/// read under the version it was written with), and both the dry run and the registration say so.
#[tokio::test]
async fn a_version_bump_alone_says_its_stored_rows_are_served_as_defaults() {
    let dir = copy_of_schemas();
    let app = spawn(&dir, true).await;
    let users = demo_rows("user_profile", "user_id");
    let present = (users["u_5"]["age"].clone(), "PRESENT".to_owned());
    assert_eq!(age(&app, "u_5").await, present);

    let v2 = edit(
        &edit(
            &schema_file("user_profile.yaml"),
            "version: 1",
            "version: 2",
        ),
        "description: ",
        "description: (v2) ",
    );
    let note = "records stored under version 1 are served as DEFAULTED until their rows are written again: a record is read only under the version it was written with, even where the features are unchanged";
    let dry = validate(&app, &v2).await;
    assert_eq!(
        ok(&dry)["documents"],
        json!([{"kind": "view", "name": "user_profile", "change": "changed", "version": 2, "running_version": 1,
                "notes": [note]}])
    );
    let j = ok(&put(&app, "/v1/schemas/views/user_profile", &v2).await);
    assert_eq!(j["registered"], true);
    assert_eq!(j["documents"][0]["notes"], json!([note]));
    assert_eq!(age(&app, "u_5").await, (json!(30), "DEFAULTED".to_owned()));

    // A description edited at the same version changes nothing stored, and says nothing.
    let v2b = edit(&v2, "description: (v2) ", "description: (v2b) ");
    let j = ok(&put(&app, "/v1/schemas/views/user_profile", &v2b).await);
    assert_eq!(j["documents"][0].get("notes"), None, "{j}");
    app.stop().await;
}

#[tokio::test]
async fn a_new_view_version_is_served_at_once_kept_and_rolled_back() {
    let dir = copy_of_schemas();
    let app = spawn(&dir, true).await;
    let users = demo_rows("user_profile", "user_id");
    // Served, and now cached, under version 1.
    assert_eq!(
        age(&app, "u_5").await,
        (users["u_5"]["age"].clone(), "PRESENT".to_owned())
    );

    let v2 = edit(
        &edit(
            &schema_file("user_profile.yaml"),
            "version: 1",
            "version: 2",
        ),
        "  - {name: age, dtype: int64, default: 30}\n",
        "  - {name: age, dtype: int64, default: 30}\n  - {name: tenure_days, dtype: int64, default: 0}\n",
    );
    let j = ok(&put(&app, "/v1/schemas/views/user_profile", &v2).await);
    assert_eq!(j["registered"], true);
    assert_eq!(
        j["documents"],
        json!([{"kind": "view", "name": "user_profile", "change": "changed", "version": 2, "running_version": 1,
                "notes": ["features added: tenure_days", "records stored under version 1's features are served as DEFAULTED until their rows are written again"]}])
    );

    // The rows stored under version 1 are not served as version 2's, not even from the cache.
    assert_eq!(age(&app, "u_5").await, (json!(30), "DEFAULTED".to_owned()));
    let body = json!({"entities": {"user_id": ["u_5"]}, "features": ["user_profile:tenure_days"]});
    let j = ok(&app.post_json("/v1/features", &body).await);
    assert_eq!(
        j["features"]["user_profile:tenure_days"]["values"],
        json!([0])
    );
    // The model that reads the view was restarted on it and still scores.
    let predict = json!({"entities": {"user_id": "u_5"}, "candidates": [{"item_id": "i_1"}]});
    assert_eq!(app.predict("ctr", &predict).await.status, 200);
    // A row written now, under version 2, is served.
    let rows = json!({"rows": [{"user_id": "u_5", "age": 41, "tenure_days": 12}]});
    ok(&app.post_json("/v1/views/user_profile/rows", &rows).await);
    assert_eq!(age(&app, "u_5").await, (json!(41), "PRESENT".to_owned()));

    // On disk: the file as sent (comments and all), and both versions kept.
    let on_disk = std::fs::read_to_string(dir.path().join("user_profile.yaml")).expect("file");
    assert_eq!(on_disk, v2);
    let kept = dir.path().join(".versions/view/user_profile");
    assert_eq!(
        std::fs::read_to_string(kept.join("1.yaml")).expect("v1"),
        schema_file("user_profile.yaml")
    );
    assert!(kept.join("2.yaml").exists());
    let j = ok(&app.get("/v1/schemas/views/user_profile/versions").await);
    assert_eq!(
        j["versions"],
        json!([{"version": 1, "running": false}, {"version": 2, "running": true}])
    );
    let j = ok(&app.get("/v1/schemas/views/user_profile/versions/1").await);
    assert_eq!(j["document"]["version"], 1);
    assert_eq!(j["running"], false);

    // A restart serves what was registered.
    app.stop().await;
    let app = spawn(&dir, true).await;
    let j = ok(&app.get("/v1/schemas/views/user_profile").await);
    assert_eq!(j["version"], 2);

    // Rollback: version 1 again, and the rows stored under it are served again.
    let r = rollback(
        &app,
        "/v1/schemas/views/user_profile",
        json!({"version": 1}),
    )
    .await;
    let j = ok(&r);
    assert_eq!(j["documents"][0]["version"], 1);
    assert_eq!(j["documents"][0]["running_version"], 2);
    assert_eq!(
        age(&app, "u_6").await,
        (users["u_6"]["age"].clone(), "PRESENT".to_owned())
    );
    assert_eq!(
        std::fs::read_to_string(dir.path().join("user_profile.yaml")).expect("file"),
        schema_file("user_profile.yaml")
    );
    let r = rollback(
        &app,
        "/v1/schemas/views/user_profile",
        json!({"version": 7}),
    )
    .await;
    assert_eq!(r.status, 404);
    assert_eq!(r.code(), "unknown_version");
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("kept: 1, 2")
    );
    let r = rollback(
        &app,
        "/v1/schemas/views/user_profile",
        json!({"versoin": 1}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(&r.body));
    // A whole number written as a float is that version; a string says what is expected.
    let r = rollback(
        &app,
        "/v1/schemas/views/user_profile",
        json!({"version": 7.0}),
    )
    .await;
    assert_eq!(r.code(), "unknown_version");
    let r = rollback(
        &app,
        "/v1/schemas/views/user_profile",
        json!({"version": "1"}),
    )
    .await;
    assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(
        r.json()["error"]["message"],
        "version: invalid type: string \"1\", expected a version number (a whole number from 1)"
    );
    // In the path: a word is not a version; a number past the largest is said to be one.
    for (path, says) in [
        (
            "versions/two",
            "`two` is not a version: expected a whole number",
        ),
        (
            "versions/99999999999",
            "`99999999999` is past the largest version, 4294967295",
        ),
    ] {
        let r = app
            .get(&format!("/v1/schemas/views/user_profile/{path}"))
            .await;
        assert_eq!((r.status, r.code().as_str()), (404, "unknown_version"));
        let message = r.message();
        assert!(message.starts_with(says), "{message}");
    }
    // Version 0 is not a version that might have been kept: a caller's mistake, as -1 is.
    for zero in [json!({"version": 0}), json!({"version": 0.0})] {
        let r = rollback(&app, "/v1/schemas/views/user_profile", zero).await;
        assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(&r.body));
        assert_eq!(
            r.json()["error"]["message"],
            "version: versions are numbered from 1: there is no version 0"
        );
    }

    // A kept file edited by hand: named in a 409, and nothing changes.
    std::fs::write(kept.join("2.yaml"), "kind: view\nname: [unclosed\n").expect("edit");
    let r = app.get("/v1/schemas/views/user_profile/versions/2").await;
    assert_eq!(r.status, 409, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.code(), "kept_version_unreadable");
    assert!(String::from_utf8_lossy(&r.body).contains("2.yaml"));
    // A rollback to it says the same, rather than reporting a problem in a "request body".
    let said = kept_refused(&app, 2, "kept_version_unreadable").await;
    assert!(said.contains("2.yaml"), "{said}");
    // Bytes that are not text, or more of them than a schema file may hold, are the same mistake, not a
    // failing disk to retry (503).
    for (bytes, why) in [
        (b"\xff\xfe kind: view\n".to_vec(), "UTF-8"),
        (vec![b'#'; (1 << 20) + 1], "more than"),
    ] {
        std::fs::write(kept.join("2.yaml"), bytes).expect("edit");
        let r = app.get("/v1/schemas/views/user_profile/versions/2").await;
        assert_eq!(r.status, 409, "{}", String::from_utf8_lossy(&r.body));
        assert_eq!(r.code(), "kept_version_unreadable");
        let said = kept_refused(&app, 2, "kept_version_unreadable").await;
        assert!(said.contains("2.yaml") && said.contains(why), "{said}");
    }
    // A kept file whose version was edited would register another number: refused too.
    std::fs::write(
        kept.join("2.yaml"),
        edit(
            &schema_file("user_profile.yaml"),
            "version: 1",
            "version: 5",
        ),
    )
    .expect("edit");
    let said = kept_refused(&app, 2, "kept_version_mismatch").await;
    assert!(said.contains("version 5"), "{said}");
    assert!(!kept.join("5.yaml").exists());
    // A folder where a kept file would be is named, not taken for a failing disk (503).
    std::fs::create_dir(kept.join("3.yaml")).expect("a folder");
    kept_refused(&app, 3, "kept_version_unreadable").await;
    // ... and not listed as a kept version, which it is not; nor are files by other names, which
    // show and rollback would not find (`01.yaml` is not version 1's file).
    for stray in ["0.yaml", "01.yaml", "+2.yaml", "abc.yaml"] {
        std::fs::write(kept.join(stray), "kind: view\n").expect("stray");
    }
    let j = ok(&app.get("/v1/schemas/views/user_profile/versions").await);
    assert_eq!(
        j["versions"],
        json!([{"version": 1, "running": true}, {"version": 2, "running": false}])
    );
    std::fs::remove_dir(kept.join("3.yaml")).expect("removed");
    for stray in ["0.yaml", "01.yaml", "+2.yaml", "abc.yaml"] {
        std::fs::remove_file(kept.join(stray)).expect("removed");
    }
    let other = edit(
        &schema_file("user_profile.yaml"),
        "name: user_profile",
        "name: someone_else",
    );
    std::fs::write(kept.join("2.yaml"), other).expect("edit");
    let message = kept_refused(&app, 2, "kept_version_mismatch").await;
    assert!(
        message.contains("2.yaml") && message.contains("someone_else"),
        "{message}"
    );
    let j = ok(&app.get("/v1/schemas/views/user_profile").await);
    assert_eq!(j["version"], 1);
}

/// A document registered again at its running version (only what may change without a new version
/// changed) replaces that version's kept text, rather than failing on the kept file's two writes.
#[tokio::test]
async fn a_document_registered_again_at_its_version_is_kept_as_submitted() {
    let dir = copy_of_schemas();
    let app = spawn(&dir, true).await;
    let edited = edit(
        &schema_file("ctr.yaml"),
        "max_batch_rows: 256",
        "max_batch_rows: 128",
    );
    let j = ok(&put(&app, "/v1/schemas/models/ctr", &edited).await);
    assert_eq!(j["documents"][0]["version"], 1);
    assert_eq!(j["documents"][0]["running_version"], 1);
    let kept = ok(&app.get("/v1/schemas/models/ctr/versions/1").await);
    assert_eq!(kept["document"]["batching"]["max_batch_rows"], 128);
    assert_eq!(
        std::fs::read_to_string(dir.path().join("ctr.yaml")).expect("ctr.yaml"),
        edited
    );
    // Nothing half-written is left beside the files.
    let leftovers: Vec<_> = files(dir.path())
        .into_iter()
        .filter(|(p, _)| p.ends_with(".hydrant-tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    let predict = json!({"entities": {"user_id": "u_5"}, "candidates": [{"item_id": "i_1"}]});
    assert_eq!(app.predict("ctr", &predict).await.status, 200);
}

/// Requests in flight while registrations restart the model they score with are all answered, with the
/// scores of a model that did not change what it computes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_in_flight_during_registrations_are_all_answered() {
    let dir = copy_of_schemas();
    let app = std::sync::Arc::new(spawn(&dir, true).await);
    let predict = json!({"entities": {"user_id": "u_5"}, "context": {"hour_of_day": 9, "device": "ios"},
                         "candidates": [{"item_id": "i_1"}, {"item_id": "i_2"}]});
    let first = app.settled_predict("ctr", &predict).await;
    let want = common::scores(&first.json());
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let clients: Vec<_> = (0..4)
        .map(|_| {
            let (app, stop) = (app.clone(), stop.clone());
            let (predict, want) = (predict.clone(), want.clone());
            tokio::spawn(async move {
                let mut answered = 0u32;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let r = app.predict("ctr", &predict).await;
                    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
                    assert_eq!(common::scores(&r.json()), want);
                    answered += 1;
                }
                answered
            })
        })
        .collect();
    let text = schema_file("ctr.yaml");
    for i in 0..8 {
        let rows = if i % 2 == 0 { "128" } else { "256" };
        let edited = edit(
            &text,
            "max_batch_rows: 256",
            &format!("max_batch_rows: {rows}"),
        );
        ok(&put(&app, "/v1/schemas/models/ctr", &edited).await);
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut total = 0;
    for c in clients {
        total += c.await.expect("a client's requests all succeeded");
    }
    assert!(
        total >= 8,
        "only {total} requests ran beside the registrations"
    );
}

#[tokio::test]
async fn refused_changes_leave_the_gateway_and_the_files_as_they_were() {
    let dir = copy_of_schemas();
    let off = spawn(&dir, false).await;
    let r = put(
        &off,
        "/v1/schemas/views/user_profile",
        &schema_file("user_profile.yaml"),
    )
    .await;
    assert_eq!(
        (r.status, r.code().as_str()),
        (403, "schema_writes_disabled")
    );
    assert!(r.message().contains("and restart"), "{}", r.message());
    off.stop().await;
    // With the folder watch on, edited files are taken without a restart, and the answer says so.
    let watched = spawn_configured(&dir, |c| {
        c.registry.writes = false;
        c.registry.reload_interval = std::time::Duration::from_secs(2);
    })
    .await;
    let r = put(
        &watched,
        "/v1/schemas/views/user_profile",
        &schema_file("user_profile.yaml"),
    )
    .await;
    assert_eq!(r.status, 403);
    assert!(
        r.message().contains("the folder watch takes them"),
        "{}",
        r.message()
    );
    watched.stop().await;

    let app = spawn(&dir, true).await;
    let before: Vec<(String, String)> = files(dir.path());

    // The body must be the document the path names.
    let r = put(
        &app,
        "/v1/schemas/views/item_stats",
        &schema_file("user_profile.yaml"),
    )
    .await;
    assert_eq!((r.status, r.code().as_str()), (400, "schema_mismatch"));
    assert_eq!(r.json()["error"]["field"], "name");
    // Also when the document it holds, put in the other's place, would not compile: the mismatch is
    // the mistake, and the caller is told that rather than what `item_stats` would break.
    let r = put(
        &app,
        "/v1/schemas/views/user_profile",
        &edit(
            &schema_file("user_profile.yaml"),
            "name: user_profile",
            "name: item_stats",
        ),
    )
    .await;
    assert_eq!(
        (r.status, r.code().as_str()),
        (400, "schema_mismatch"),
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("the body holds view `item_stats`")),
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    // A dtype change under a running model that is not re-bound.
    let retyped = edit(
        &edit(
            &schema_file("user_profile.yaml"),
            "version: 1",
            "version: 2",
        ),
        "{name: age, dtype: int64, default: 30}",
        "{name: age, dtype: float32, default: 30}",
    );
    let r = put(&app, "/v1/schemas/views/user_profile", &retyped).await;
    assert_eq!((r.status, r.code().as_str()), (422, "invalid_schema"));
    // A view a model reads cannot go; the problem is named where it is.
    let r = delete(&app, "/v1/schemas/views/user_profile").await;
    assert_eq!((r.status, r.code().as_str()), (422, "invalid_schema"));
    assert!(
        r.json()["error"]["problems"][0]["file"]
            .as_str()
            .unwrap_or_default()
            .ends_with("ctr.yaml"),
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    // A model file outside the models folder.
    let outside = edit(
        &schema_file("ctr.yaml"),
        "file: ctr.onnx",
        "file: ../models/ctr.onnx",
    );
    let outside = edit(&outside, "version: 1", "version: 2");
    let r = put(&app, "/v1/schemas/models/ctr", &outside).await;
    assert_eq!(r.status, 422, "{}", String::from_utf8_lossy(&r.body));
    // New models refused once their sessions were tried leave no counters behind.
    let renamed = |name: &str| {
        edit(
            &schema_file("ctr.yaml"),
            "name: ctr",
            &format!("name: {name}"),
        )
    };
    let ghosts = [
        (
            "ctr_ghost",
            edit(&renamed("ctr_ghost"), "file: ctr.onnx", "file: ghost.onnx"),
        ),
        (
            "ctr_wrong",
            edit(&renamed("ctr_wrong"), "outputs: [score]", "outputs: [nope]"),
        ),
    ];
    for (name, text) in &ghosts {
        let r = put(&app, &format!("/v1/schemas/models/{name}"), text).await;
        assert_eq!(r.status, 422, "{}", String::from_utf8_lossy(&r.body));
    }
    // A model that cannot load, second in a request: named where the caller wrote it (the request
    // body's document 2), not in the file it would have gone to, whose numbering differs.
    let body = format!(
        "kind: entity\nname: shop_id\ndtype: string\n---\n{}",
        edit(
            &edit(&schema_file("ctr.yaml"), "version: 1", "version: 2"),
            "file: ctr.onnx",
            "file: ctr.weights.json"
        )
    );
    for path in ["/v1/schemas", "/v1/schemas:validate"] {
        let r = send(&app, reqwest::Method::POST, path, Some(&body)).await;
        assert_eq!(
            r.status,
            422,
            "{path}: {}",
            String::from_utf8_lossy(&r.body)
        );
        let j = r.json();
        let problem = &j["error"]["problems"][0];
        assert_eq!(
            (&problem["file"], &problem["path"], &j["error"]["field"]),
            (
                &json!("request body"),
                &json!("document 2: file"),
                &json!("document 2: file")
            ),
            "{path}: {}",
            String::from_utf8_lossy(&r.body)
        );
        assert!(
            problem["message"]
                .as_str()
                .is_some_and(|m| m.contains("cannot be loaded")),
            "{problem}"
        );
    }
    let stats = ok(&app.get("/v1/stats").await);
    let models: Vec<&String> = stats["models"]
        .as_object()
        .map(|m| m.keys().collect())
        .unwrap_or_default();
    assert_eq!(models, ["ctr"], "{stats}");
    let metrics = String::from_utf8_lossy(&app.get("/metrics").await.body).into_owned();
    assert!(!metrics.contains("ctr_ghost") && !metrics.contains("ctr_wrong"));
    // Unknown names and kinds.
    let r = delete(&app, "/v1/schemas/models/nope").await;
    assert_eq!((r.status, r.code().as_str()), (404, "unknown_model"));
    let r = put(&app, "/v1/schemas/widgets/x", "kind: view\n").await;
    assert_eq!((r.status, r.code().as_str()), (404, "unknown_schema_kind"));
    // A name from the path that no document could have is not a path under the schemas folder.
    std::fs::create_dir_all(dir.path().join("outside")).expect("dir");
    std::fs::write(dir.path().join("outside/1.yaml"), schema_file("ctr.yaml")).expect("file");
    for path in [
        "/v1/schemas/views/..%2F..%2Foutside/versions",
        "/v1/schemas/views/..%2F..%2Foutside/versions/1",
    ] {
        let r = app.get(path).await;
        assert_eq!(
            (r.status, r.code().as_str()),
            (404, "unknown_view"),
            "{path}"
        );
    }
    let r = rollback(
        &app,
        "/v1/schemas/models/..%2F..%2Foutside",
        json!({"version": 1}),
    )
    .await;
    assert_eq!((r.status, r.code().as_str()), (404, "unknown_model"));
    std::fs::remove_dir_all(dir.path().join("outside")).expect("cleanup");
    // A method the route does not take says which it does.
    let r = send(
        &app,
        reqwest::Method::PATCH,
        "/v1/schemas/views/user_profile",
        None,
    )
    .await;
    assert_eq!(r.status, 405);
    assert_eq!(r.headers["allow"], "GET, PUT, DELETE");

    assert_eq!(files(dir.path()), before, "nothing was written");
    let predict = json!({"entities": {"user_id": "u_5"}, "candidates": [{"item_id": "i_1"}]});
    assert_eq!(app.predict("ctr", &predict).await.status, 200);

    // A file edited on disk since it was loaded (no folder watch here) is not overwritten.
    let profile = dir.path().join("user_profile.yaml");
    let by_hand = edit(
        &schema_file("user_profile.yaml"),
        "default: 30",
        "default: 31",
    );
    std::fs::write(&profile, &by_hand).expect("edit");
    let v2 = edit(&schema_file("user_profile.yaml"), "ttl: 10m", "ttl: 11m");
    let r = put(&app, "/v1/schemas/views/user_profile", &v2).await;
    assert_file_changed(&r, &["user_profile.yaml", "restart to load it"]);
    assert_eq!(std::fs::read_to_string(&profile).expect("read"), by_hand);
    std::fs::write(&profile, schema_file("user_profile.yaml")).expect("restore");
    // A schema file that appeared since the folder was loaded could define what a change adds.
    let extra = dir.path().join("extra.yaml");
    std::fs::write(&extra, "kind: entity\nname: shop_id\ndtype: string\n").expect("extra");
    let r = put(&app, "/v1/schemas/views/user_profile", &v2).await;
    assert_file_changed(&r, &["extra.yaml", "appeared"]);
    std::fs::remove_file(&extra).expect("remove");
    // A loaded file that is gone.
    let items = dir.path().join("item_stats.yaml");
    std::fs::remove_file(&items).expect("remove");
    let r = put(&app, "/v1/schemas/views/user_profile", &v2).await;
    assert_file_changed(&r, &["item_stats.yaml", "removed"]);
    std::fs::write(&items, schema_file("item_stats.yaml")).expect("restore");
    // Put back as loaded, the folder takes the change.
    ok(&put(&app, "/v1/schemas/views/user_profile", &v2).await);
}

#[tokio::test]
async fn models_are_added_deleted_and_restored_and_shared_files_keep_their_other_documents() {
    let dir = copy_of_schemas();
    let app = spawn(&dir, true).await;
    let predict = json!({"entities": {"user_id": "u_5"}, "candidates": [{"item_id": "i_1"}, {"item_id": "i_2"}]});
    let scores = ok(&app.predict("ctr", &predict).await)["outputs"].clone();

    // A second model on the same file, registered with POST: it scores as ctr does.
    let twin = edit(&schema_file("ctr.yaml"), "name: ctr", "name: ctr_twin");
    let j = ok(&app
        .post("/v1/schemas", "application/yaml", twin.clone().into_bytes())
        .await);
    assert_eq!(j["documents"][0]["change"], "added");
    assert_eq!(
        ok(&app.predict("ctr_twin", &predict).await)["outputs"],
        scores
    );
    assert_eq!(
        std::fs::read_to_string(dir.path().join("ctr_twin.yaml")).expect("file"),
        twin
    );
    let metrics = String::from_utf8_lossy(&app.get("/metrics").await.body).into_owned();
    assert!(
        metrics.contains("route=\"/v1/models/{model}/predict\",model=\"ctr_twin\""),
        "a registered model is its own metrics label"
    );

    // Deleted: no longer served, its file gone, its version kept.
    let r = delete(&app, "/v1/schemas/models/ctr_twin").await;
    assert_eq!(
        ok(&r)["deleted"],
        json!([{"kind": "model", "name": "ctr_twin"}])
    );
    let r = app.predict("ctr_twin", &predict).await;
    assert_eq!((r.status, r.code().as_str()), (404, "unknown_model"));
    assert!(!dir.path().join("ctr_twin.yaml").exists());
    let j = ok(&app.get("/v1/schemas/models/ctr_twin/versions").await);
    assert_eq!(j["running_version"], Json::Null);
    // Rolled back into service.
    let r = rollback(&app, "/v1/schemas/models/ctr_twin", json!({"version": 1})).await;
    assert_eq!(ok(&r)["documents"][0]["change"], "added");
    assert_eq!(
        ok(&app.predict("ctr_twin", &predict).await)["outputs"],
        scores
    );
    // Deleted again and added back under its old version with another binding: refused, since
    // version 1 is kept and names the first one.
    ok(&delete(&app, "/v1/schemas/models/ctr_twin").await);
    let kept_v1 = dir.path().join(".versions/model/ctr_twin/1.yaml");
    let kept_text = std::fs::read_to_string(&kept_v1).expect("kept v1");
    let rebound = edit(&twin, "mean: 40, std: 12", "mean: 10, std: 3");
    let r = put(&app, "/v1/schemas/models/ctr_twin", &rebound).await;
    assert_eq!(
        (r.status, r.code().as_str()),
        (409, "version_kept"),
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("as version 2 or more"),
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    assert_eq!(
        std::fs::read_to_string(&kept_v1).expect("kept v1"),
        kept_text
    );
    // Under a new version it is added, and both versions stay readable.
    let rebound = edit(&rebound, "version: 1", "version: 2");
    assert_eq!(
        ok(&put(&app, "/v1/schemas/models/ctr_twin", &rebound).await)["documents"][0]["version"],
        2
    );
    assert_eq!(
        std::fs::read_to_string(&kept_v1).expect("kept v1"),
        kept_text
    );
    let j = ok(&app.get("/v1/schemas/models/ctr_twin/versions").await);
    assert_eq!(
        j["versions"],
        json!([{"version": 1, "running": false}, {"version": 2, "running": true}])
    );

    // An entity in a file of two: the other document and the file's comments stay as written.
    let entities = schema_file("entities.yaml");
    let item = "kind: entity\nname: item_id\ndtype: string\ndescription: Anything we recommend.\n";
    ok(&put(&app, "/v1/schemas/entities/item_id", item).await);
    let on_disk = std::fs::read_to_string(dir.path().join("entities.yaml")).expect("file");
    let (head, _) = entities.split_once("---\n").expect("two documents");
    assert_eq!(on_disk, format!("{head}---\n{item}"));
    let j = ok(&app.get("/v1/schemas/entities/item_id").await);
    assert_eq!(j["document"]["description"], "Anything we recommend.");
    assert_eq!(app.predict("ctr", &predict).await.status, 200);

    // A view registered is listed by /v1/stats, with zeros, before its first lookup.
    let view = edit(
        &schema_file("user_profile.yaml"),
        "name: user_profile",
        "name: user_twin",
    );
    ok(&app
        .post("/v1/schemas", "application/yaml", view.into_bytes())
        .await);
    let s = ok(&app.get("/v1/stats").await);
    assert_eq!(s["views"]["user_twin"]["misses"], 0, "{s}");
}

/// A schema file with a byte order mark, or one whose documents its `---` lines do not tell apart, loads;
/// it does not stop registering documents in other files, and only a change to the file itself is
/// refused, by name.
#[tokio::test]
async fn odd_schema_files_block_only_changes_to_themselves() {
    let dir = copy_of_schemas();
    let bom = "\u{feff}kind: entity\nname: shop_id\ndtype: string\n";
    std::fs::write(dir.path().join("shops.yaml"), bom).expect("write");
    let inline = "kind: entity\nname: brand_id\n--- {kind: entity, name: region_id}\n";
    std::fs::write(dir.path().join("more.yaml"), inline).expect("write");
    // An editor's hidden copy, which would define `shop_id` twice were it read.
    std::fs::write(dir.path().join(".shops.yaml"), bom).expect("write");
    let app = spawn(&dir, true).await;
    for name in ["shop_id", "brand_id", "region_id"] {
        ok(&app.get(&format!("/v1/schemas/entities/{name}")).await);
    }
    // The link Emacs keeps while a file is open, pointing nowhere, appearing after the folder was
    // loaded: not a schema file that "appeared since" (409), nor one that cannot be read.
    std::os::unix::fs::symlink(
        "root@host.12345:1700000000",
        dir.path().join(".#shops.yaml"),
    )
    .expect("link");
    // A document in another file.
    let entities = edit(
        &schema_file("entities.yaml"),
        "description: A signed-in user.",
        "description: Someone signed in.",
    );
    let (user, _) = entities.split_once("---\n").expect("two documents");
    ok(&put(&app, "/v1/schemas/entities/user_id", user).await);
    // The file with a byte order mark is edited like any other (and written without the mark).
    ok(&put(
        &app,
        "/v1/schemas/entities/shop_id",
        "kind: entity\nname: shop_id\ndtype: string\ndescription: A seller.\n",
    )
    .await);
    let shops = std::fs::read_to_string(dir.path().join("shops.yaml")).expect("read");
    assert!(
        shops.starts_with("kind: entity") && shops.contains("A seller."),
        "{shops:?}"
    );
    // The file whose second document begins on its `---` line is not cut into pieces: 409, unchanged.
    let r = put(
        &app,
        "/v1/schemas/entities/region_id",
        "kind: entity\nname: region_id\ndescription: A sales region.\n",
    )
    .await;
    assert_eq!(
        (r.status, r.code().as_str()),
        (409, "schema_file_uncuttable"),
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    assert!(String::from_utf8_lossy(&r.body).contains("more.yaml"));
    assert_eq!(
        std::fs::read_to_string(dir.path().join("more.yaml")).expect("read"),
        inline
    );
    let r = delete(&app, "/v1/schemas/entities/brand_id").await;
    assert_eq!(r.code(), "schema_file_uncuttable");
    // A restart loads what was registered.
    app.stop().await;
    let app = spawn(&dir, true).await;
    let j = ok(&app.get("/v1/schemas/entities/shop_id").await);
    assert_eq!(j["document"]["description"], "A seller.");
    let j = ok(&app.get("/v1/schemas/entities/user_id").await);
    assert_eq!(j["document"]["description"], "Someone signed in.");
}

/// A body whose document begins on its `---` line (`--- !!map`, `--- &a`, `--- {...}`) registered into
/// a file shared with another document: the file stays one the next edit can cut, so both of its
/// documents can still be registered, and a restart loads them.
#[tokio::test]
async fn a_document_begun_on_its_marker_line_leaves_its_file_editable() {
    let dir = copy_of_schemas();
    let app = spawn(&dir, true).await;
    for (i, body) in [
        "--- !!map\nkind: entity\nname: item_id\ndtype: string\ndescription: tagged\n",
        "--- &a\nkind: entity\nname: item_id\ndtype: string\ndescription: anchored\n",
        "--- {kind: entity, name: item_id, dtype: string, description: flow}\n",
    ]
    .iter()
    .enumerate()
    {
        ok(&put(&app, "/v1/schemas/entities/item_id", body).await);
        let user = format!("kind: entity\nname: user_id\ndtype: string\ndescription: edit {i}\n");
        ok(&put(&app, "/v1/schemas/entities/user_id", &user).await);
        let text = std::fs::read_to_string(dir.path().join("entities.yaml")).expect("read");
        assert!(
            !text.contains("--- !!map") && !text.contains("--- &a") && !text.contains("--- {"),
            "{text}"
        );
    }
    app.stop().await;
    let app = spawn(&dir, true).await;
    let j = ok(&app.get("/v1/schemas/entities/item_id").await);
    assert_eq!(j["document"]["description"], "flow");
    let j = ok(&app.get("/v1/schemas/entities/user_id").await);
    assert_eq!(j["document"]["description"], "edit 2");
}

/// A 409 `schema_file_changed` whose message holds each of `words`.
fn assert_file_changed(r: &Reply, words: &[&str]) {
    assert_eq!((r.status, r.code().as_str()), (409, "schema_file_changed"));
    let j = r.json();
    let message = j["error"]["message"].as_str().unwrap_or_default();
    assert!(words.iter().all(|w| message.contains(w)), "{message}");
}

/// Every file under `dir` (kept versions included) with its text, sorted.
fn files(dir: &std::path::Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).expect("read_dir") {
            let p = e.expect("entry").path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push((
                    p.display().to_string(),
                    std::fs::read_to_string(&p).unwrap_or_default(),
                ));
            }
        }
    }
    out.sort();
    out
}

/// Mutated schema documents registered while serving, as `PUT /v1/schemas/{kind}/{name}` (one document)
/// and `POST /v1/schemas` (a file's documents together). Each gets a 2xx or a 4xx with a code and a
/// message. A refusal leaves every file as it was; an acceptance leaves a folder that loads into exactly
/// what is served; and a gateway restarted over the folder serves what the first one served last.
/// Seeded like `tests/mutated_requests.rs` (`MUTATION_CASES`, `MUTATION_SEED`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutated_registrations_get_a_named_4xx_or_leave_a_folder_that_loads_as_served() {
    use common::mutate::{Rng, SCHEMA_NAMES, describe, env_number, mutated};
    use common::{print_yaml_documents, yaml_documents};
    use hydrant::schema::Registry;

    let cases = env_number("MUTATION_CASES", 300);
    let mut rng = Rng(env_number("MUTATION_SEED", 0x0072_6567_6973));
    let dir = copy_of_schemas();
    let app = spawn(&dir, true).await;
    let models = root().join("models");
    let originals: Vec<(&str, String)> = ["entities.yaml", "user_profile.yaml", "item_stats.yaml"]
        .into_iter()
        .chain(["ctr.yaml"])
        .map(|f| (f, schema_file(f)))
        .collect();
    let mut statuses = std::collections::BTreeMap::<u16, u64>::new();
    let mut rollbacks = statuses.clone();
    for i in 0..cases {
        let (file, text) = rng.pick(&originals);
        let case_seed = rng.next();
        let mut r = Rng(case_seed);
        let body = mutated(
            &mut r,
            SCHEMA_NAMES,
            text.as_bytes(),
            yaml_documents(text),
            print_yaml_documents,
        );
        // A single-document file goes to its own path; entities.yaml (two documents) is posted.
        let path = match *file {
            "user_profile.yaml" => "/v1/schemas/views/user_profile",
            "item_stats.yaml" => "/v1/schemas/views/item_stats",
            "ctr.yaml" => "/v1/schemas/models/ctr",
            _ => "/v1/schemas",
        };
        let rollback;
        let (method, path) = if path != "/v1/schemas" && r.chance(30) {
            (reqwest::Method::POST, "/v1/schemas")
        } else if path == "/v1/schemas" {
            (reqwest::Method::POST, path)
        } else if r.chance(15) {
            // A rollback to a kept version (there are some once a change was registered).
            rollback = format!("{path}/rollback");
            (reqwest::Method::POST, rollback.as_str())
        } else {
            (reqwest::Method::PUT, path)
        };
        let (body, content_type) = if path.ends_with("/rollback") {
            let valid = serde_json::json!({"version": 1 + r.below(3)});
            let text = serde_json::to_vec(&valid).unwrap_or_default();
            let body = mutated(&mut r, SCHEMA_NAMES, &text, Some(valid), |t| {
                serde_json::to_vec(t).ok()
            });
            (body, "application/json")
        } else {
            (body, "application/yaml")
        };
        let case = format!(
            "case {i} (seed {case_seed:#x}), {method} {path} with {file}: {}",
            describe(&body)
        );
        let before = files(dir.path());
        let resp = app
            .client
            .request(method, format!("{}{path}", app.addr))
            .header("content-type", content_type)
            .body(body)
            .send()
            .await
            .unwrap_or_else(|e| panic!("no answer to {case}: {e:?}"));
        let status = resp.status().as_u16();
        let answer = resp
            .bytes()
            .await
            .unwrap_or_else(|e| panic!("the answer to {case} broke off: {e:?}"));
        *statuses.entry(status).or_default() += 1;
        if path.ends_with("/rollback") {
            *rollbacks.entry(status).or_default() += 1;
        }
        common::check_answer(path, &case, status, &answer);
        if (200..300).contains(&status) {
            let loaded = Registry::load_dir(dir.path(), &models)
                .unwrap_or_else(|e| panic!("{case} was registered, but the folder fails: {e}"));
            let mut served = ok(&app.get("/v1/schemas").await);
            served.as_object_mut().map(|o| o.remove("folder"));
            assert_eq!(
                hydrant::proposal::listing(&loaded),
                served,
                "{case}: the folder loads into something else than is served"
            );
        } else {
            assert!(
                files(dir.path()) == before,
                "{case} was refused with {status}, but the files changed: {}",
                String::from_utf8_lossy(&answer)
            );
        }
    }
    eprintln!("statuses over the run: {statuses:?}, of which rollbacks: {rollbacks:?}");
    // The mutations must reach acceptance as well as several kinds of refusal.
    assert!(statuses.range(200..300).count() > 0, "{statuses:?}");
    assert!(
        statuses.keys().filter(|s| (400..500).contains(*s)).count() >= 2,
        "{statuses:?}"
    );
    let last = ok(&app.get("/v1/schemas").await);
    app.stop().await;
    let again = spawn(&dir, true).await;
    assert_eq!(ok(&again.get("/v1/schemas").await), last);
    again.stop().await;
}

/// The value of the metric line that starts with `name` in `/metrics`.
async fn metric(app: &TestApp, name: &str) -> f64 {
    let text = String::from_utf8(app.get("/metrics").await.body).expect("metrics text");
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in /metrics"))
}

/// Polls `GET path` until `done` holds for its JSON (10 s at most).
async fn wait_for(app: &TestApp, path: &str, what: &str, done: impl Fn(&Json) -> bool) -> Json {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let j = app.get(path).await.json();
        if done(&j) {
            return j;
        }
        assert!(std::time::Instant::now() < until, "{what}: still {j}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// Waits until the folder watch shows a refusal, and answers its problems as one string.
async fn refusal(app: &TestApp, what: &str) -> String {
    let j = wait_for(app, "/v1/schemas", what, |j| {
        j["folder"]["refused"].is_object()
    })
    .await;
    j["folder"]["refused"]["problems"].to_string()
}

/// A registration, then the file put back as it was before the folder watch read it again (a
/// checkout, a config-map sync): the folder is the one the watch checked last, but no longer what
/// runs. The watch checks it against what runs, as any change, rather than never looking again:
/// version 1 is kept, so going back to it is a rollback, and the folder's version is served (as a
/// restart would serve it), and registering works again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_undone_in_the_folder_before_the_watch_looks_is_still_checked() {
    let dir = copy_of_schemas();
    let app = spawn_configured(&dir, |c| {
        c.registry.writes = true;
        c.registry.reload_interval = std::time::Duration::from_millis(1500);
    })
    .await;
    // Two reads: the watch has checked the folder as it is.
    tokio::time::sleep(std::time::Duration::from_millis(3500)).await;
    let profile = dir.path().join("user_profile.yaml");
    let v1 = std::fs::read_to_string(&profile).expect("user_profile.yaml");
    ok(&put(
        &app,
        "/v1/schemas/views/user_profile",
        &with_tenure_days(&v1),
    )
    .await);
    std::fs::write(&profile, &v1).expect("put version 1 back");
    wait_for(
        &app,
        "/v1/schemas/views/user_profile",
        "the folder's version 1 served",
        |j| j["document"]["version"] == 1,
    )
    .await;
    let applied = "hydrant_schema_reloads_total{outcome=\"applied\"}";
    assert_eq!(metric(&app, applied).await, 1.0);
    let v3 = with_tenure_days(&v1).replacen("version: 2", "version: 3", 1);
    ok(&put(&app, "/v1/schemas/views/user_profile", &v3).await);
}

/// Deleting the last document would leave a schemas folder the gateway refuses to start on.
#[tokio::test]
async fn the_last_schema_file_cannot_be_deleted() {
    let dir = copy_of_schemas();
    let app = spawn(&dir, true).await;
    for path in [
        "/v1/schemas/models/ctr",
        "/v1/schemas/views/item_stats",
        "/v1/schemas/views/user_profile",
        "/v1/schemas/entities/item_id",
    ] {
        ok(&delete(&app, path).await);
    }
    let r = delete(&app, "/v1/schemas/entities/user_id").await;
    assert_eq!(
        (r.status, r.code().as_str()),
        (409, "registry_would_be_empty"),
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("last schema file")),
        "{}",
        r.json()
    );
    // Still served, and the folder still starts a gateway.
    ok(&app.get("/v1/schemas/entities/user_id").await);
    drop(app);
    let again = spawn(&dir, true).await;
    ok(&again.get("/v1/schemas/entities/user_id").await);
}

/// A model version names the ONNX file it was served from: a change within the version (its sessions,
/// batching) or a rollback to it that would load a file whose bytes changed since is refused, dry run
/// and registration alike, and the version keeps serving what it loaded; a new version may load the
/// new file.
#[tokio::test]
async fn a_change_within_a_model_version_cannot_load_a_file_that_changed_on_disk() {
    let dir = copy_of_schemas();
    let models = tempfile::tempdir().expect("models dir");
    let file = models.path().join("ctr.onnx");
    std::fs::copy(root().join("models/ctr.onnx"), &file).expect("copy");
    let app = spawn_configured(&dir, |c| {
        c.registry.writes = true;
        c.registry.models = models.path().to_owned();
    })
    .await;
    let predict =
        json!({"entities": {"user_id": "u_5", "item_id": "i_1", }, "context": {"hour_of_day": 3}});
    let before = ok(&app.predict("ctr", &predict).await);
    // Another model of the same shape in the same file: it scores [0.1, 0.2, 0.3][the hour's bucket].
    std::fs::copy(root().join("tests/models/hour_table.onnx"), &file).expect("replace");
    let ctr = schema_file("ctr.yaml");
    let tuned = edit(&ctr, "max_batch_rows: 256", "max_batch_rows: 64");
    let refused_for_its_bytes = |r: &Reply| {
        assert_eq!(r.status, 422, "{}", String::from_utf8_lossy(&r.body));
        let problems = r.json()["error"]["problems"].to_string();
        assert!(
            problems.contains("its bytes changed since version 1 was served from it"),
            "{problems}"
        );
    };
    refused_for_its_bytes(&validate(&app, &tuned).await);
    let r = put(&app, "/v1/schemas/models/ctr", &tuned).await;
    refused_for_its_bytes(&r);
    // The change named the model: nothing to explain.
    let problems = r.json()["error"]["problems"].to_string();
    assert!(!problems.contains("loaded again"), "{problems}");
    // A change to a view it reads (its cache settings alone) loads the model again too, and says so,
    // checked and registered alike.
    let items = edit(&schema_file("item_stats.yaml"), "ttl: 5m", "ttl: 4m");
    for r in [
        validate(&app, &items).await,
        put(&app, "/v1/schemas/views/item_stats", &items).await,
    ] {
        refused_for_its_bytes(&r);
        let problems = r.json()["error"]["problems"].to_string();
        assert!(
            problems.contains(
                "(it is loaded again because the change touches view `item_stats`, which it reads)"
            ),
            "{problems}"
        );
    }
    let still = ok(&app.predict("ctr", &predict).await);
    assert_eq!(still["outputs"], before["outputs"]);
    assert_eq!(still["model_version"], 1);
    // As version 2, the new file is what it names.
    ok(&put(
        &app,
        "/v1/schemas/models/ctr",
        &edit(&tuned, "version: 1", "version: 2"),
    )
    .await);
    let after = ok(&app.predict("ctr", &predict).await);
    assert_eq!(after["model_version"], 2);
    assert_eq!(after["outputs"]["score"], json!([0.1]));
    // Nor may version 1 come back on the file as it is now.
    refused_for_its_bytes(&rollback(&app, "/v1/schemas/models/ctr", json!({"version": 1})).await);
    assert_eq!(ok(&app.predict("ctr", &predict).await)["model_version"], 2);
}

/// With `registry.reload_interval`, a change made in the schemas folder (by a person, a deploy, or
/// another replica sharing it) is checked as a registration is and swapped in; a folder that fails
/// is refused, shown and counted while the running schemas keep serving; a removed file removes what
/// it defined; and the gateway's own registrations are not taken for changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_made_in_the_folder_are_checked_and_swapped_in() {
    let dir = copy_of_schemas();
    let models = tempfile::tempdir().expect("models dir");
    std::fs::copy(
        root().join("models/ctr.onnx"),
        models.path().join("ctr.onnx"),
    )
    .expect("copy");
    let app = spawn_configured(&dir, |c| {
        c.registry.writes = true;
        c.registry.reload_interval = std::time::Duration::from_millis(100);
        c.registry.models = models.path().to_owned();
    })
    .await;
    let folder = ok(&app.get("/v1/schemas").await)["folder"].clone();
    assert_eq!(folder, json!({"reload_interval": "100ms", "refused": null}));
    let predict = json!({"entities": {"user_id": "u_5"}, "candidates": [{"item_id": "i_1"}]});
    let applied = "hydrant_schema_reloads_total{outcome=\"applied\"}";
    let refused = "hydrant_schema_reloads_total{outcome=\"refused\"}";
    // The first look at the folder finds what runs: nothing applied.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert_eq!(metric(&app, applied).await, 0.0);

    // A new version of a view, written in place.
    let profile = dir.path().join("user_profile.yaml");
    let v1 = std::fs::read_to_string(&profile).expect("user_profile.yaml");
    let v2 = with_tenure_days(&v1);
    std::fs::write(&profile, &v2).expect("write");
    wait_for(
        &app,
        "/v1/schemas/views/user_profile",
        "version 2 served",
        |j| j["document"]["version"] == 2,
    )
    .await;
    let body = json!({"entities": {"user_id": ["u_5"]}, "features": ["user_profile:tenure_days"]});
    let j = ok(&app.post_json("/v1/features", &body).await);
    assert_eq!(
        j["features"]["user_profile:tenure_days"]["values"],
        json!([7])
    );
    assert_eq!(app.predict("ctr", &predict).await.status, 200);
    assert!(metric(&app, applied).await >= 1.0);

    // A version that goes down is refused, naming the file; version 2 keeps serving.
    std::fs::write(&profile, &v1).expect("write");
    let problems = refusal(&app, "the refusal shown").await;
    assert!(
        problems.contains("user_profile.yaml") && problems.contains("versions only go up"),
        "{problems}"
    );
    assert_eq!(
        ok(&app.get("/v1/schemas/views/user_profile").await)["document"]["version"],
        2
    );
    assert!(metric(&app, refused).await >= 1.0);
    assert_eq!(app.predict("ctr", &predict).await.status, 200);

    // Fixed: version 3 is served and the refusal is cleared.
    std::fs::write(&profile, v2.replacen("version: 2", "version: 3", 1)).expect("write");
    wait_for(&app, "/v1/schemas", "version 3 served", |j| {
        j["folder"]["refused"].is_null()
            && j["views"].as_array().is_some_and(|v| {
                v.iter()
                    .any(|v| v["name"] == "user_profile" && v["version"] == 3)
            })
    })
    .await;

    // A file removed takes its model out of service; put back, the model serves again.
    let ctr = dir.path().join("ctr.yaml");
    let ctr_text = std::fs::read_to_string(&ctr).expect("ctr.yaml");
    std::fs::remove_file(&ctr).expect("remove");
    wait_for(&app, "/v1/schemas", "ctr removed", |j| {
        j["models"].as_array().is_some_and(Vec::is_empty)
    })
    .await;
    let r = app.predict("ctr", &predict).await;
    assert_eq!((r.status, r.code().as_str()), (404, "unknown_model"));
    std::fs::write(&ctr, &ctr_text).expect("write");
    wait_for(&app, "/v1/schemas", "ctr back", |j| {
        j["models"].as_array().is_some_and(|m| m.len() == 1)
    })
    .await;
    assert_eq!(app.predict("ctr", &predict).await.status, 200);

    // A model whose ONNX file is missing, and then the file naming it taken away again: the folder is
    // back to what runs, and the refusal goes with the change.
    let ctr3 = dir.path().join("ctr3.yaml");
    std::fs::write(
        &ctr3,
        ctr_text.replacen("name: ctr", "name: ctr3", 1).replacen(
            "file: ctr.onnx",
            "file: ctr3.onnx",
            1,
        ),
    )
    .expect("ctr3.yaml");
    let problems = refusal(&app, "ctr3 refused").await;
    assert!(problems.contains("ctr3"), "{problems}");
    std::fs::remove_file(&ctr3).expect("remove");
    wait_for(&app, "/v1/schemas", "ctr3's refusal gone", |j| {
        j["folder"]["refused"].is_null()
    })
    .await;

    // A model whose ONNX file is not there yet is refused, and tried again until the file arrives.
    std::fs::write(
        dir.path().join("ctr2.yaml"),
        ctr_text.replacen("name: ctr", "name: ctr2", 1).replacen(
            "file: ctr.onnx",
            "file: ctr2.onnx",
            1,
        ),
    )
    .expect("ctr2.yaml");
    let problems = refusal(&app, "ctr2 refused").await;
    assert!(
        problems.contains("ctr2.yaml") && problems.contains("ctr2"),
        "{problems}"
    );
    let refusals = metric(&app, refused).await;
    std::fs::copy(
        models.path().join("ctr.onnx"),
        models.path().join("ctr2.onnx"),
    )
    .expect("copy");
    wait_for(&app, "/v1/schemas", "ctr2 served", |j| {
        j["folder"]["refused"].is_null() && j["models"].as_array().is_some_and(|m| m.len() == 2)
    })
    .await;
    assert_eq!(app.predict("ctr2", &predict).await.status, 200);
    // Tried again while the file was missing, but said once.
    assert_eq!(metric(&app, refused).await, refusals);

    // The gateway's own registration writes the folder, and is not reloaded as a change.
    let before = metric(&app, applied).await;
    let edited = edit(&ctr_text, "max_batch_rows: 256", "max_batch_rows: 64");
    ok(&put(&app, "/v1/schemas/models/ctr", &edited).await);
    tokio::time::sleep(std::time::Duration::from_millis(400)).await;
    assert_eq!(metric(&app, applied).await, before);
    assert!(ok(&app.get("/v1/schemas").await)["folder"]["refused"].is_null());
    app.stop().await;

    // A hand edit the watch has not read yet: the registration's 409 points at the watch.
    let dir = copy_of_schemas();
    let app = watching(&dir, std::time::Duration::from_secs(3600)).await;
    let text = schema_file("user_profile.yaml");
    std::fs::write(
        dir.path().join("user_profile.yaml"),
        edit(&text, "default: 30", "default: 31"),
    )
    .expect("edit");
    let r = put(
        &app,
        "/v1/schemas/views/user_profile",
        &edit(&text, "ttl: 10m", "ttl: 11m"),
    )
    .await;
    assert_file_changed(&r, &["the folder watch loads it"]);
    app.stop().await;
}

/// Replicas that share a schemas folder take each other's registrations through the folder watch,
/// rollbacks included: a rollback writes a lower version, which the watch takes because that version's
/// kept text is what the file now holds. Afterwards either replica registers again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_sharing_a_folder_take_each_others_registrations_and_rollbacks() {
    let dir = copy_of_schemas();
    let a = watching(&dir, std::time::Duration::from_millis(100)).await;
    let b = watching(&dir, std::time::Duration::from_millis(100)).await;
    let v1 = schema_file("user_profile.yaml");
    let v2 = with_tenure_days(&v1);
    ok(&put(&a, "/v1/schemas/views/user_profile", &v2).await);
    version_on(&b, 2).await;

    let r = a
        .post_json(
            "/v1/schemas/views/user_profile/rollback",
            &json!({"version": 1}),
        )
        .await;
    ok(&r);
    version_on(&b, 1).await;
    let j = ok(&b.get("/v1/schemas").await);
    assert!(j["folder"]["refused"].is_null(), "{j}");

    // The other replica registers next, over the rolled-back folder.
    let v3 = v2.replacen("version: 2", "version: 3", 1);
    ok(&put(&b, "/v1/schemas/views/user_profile", &v3).await);
    version_on(&a, 3).await;
    let j = ok(&a.get("/v1/schemas").await);
    assert!(j["folder"]["refused"].is_null(), "{j}");
    // Each version's kept text survived the other replica's reloads.
    for v in [1, 2] {
        let j = ok(&b
            .get(&format!("/v1/schemas/views/user_profile/versions/{v}"))
            .await);
        assert_eq!(j["document"]["version"], v);
    }
    a.stop().await;
    b.stop().await;
}

/// A deploy that writes several schema files holds the folder's lock while it writes, as the README
/// shows with `flock(1)`: the watch reads none of the files until it lets go, then takes them in one
/// step. Here the model is written first and names a feature that only the view written second has,
/// so a read in between would find an invalid folder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_written_under_the_folder_lock_are_taken_in_one_step_when_it_is_released() {
    let dir = copy_of_schemas();
    let app = watching(&dir, std::time::Duration::from_millis(100)).await;
    let applied = "hydrant_schema_reloads_total{outcome=\"applied\"}";
    let refused = "hydrant_schema_reloads_total{outcome=\"refused\"}";
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let before = metric(&app, applied).await;

    let deploy = FolderLock::hold(&dir);

    let read = |dir: &tempfile::TempDir, file: &str| {
        std::fs::read_to_string(dir.path().join(file)).expect("schema file")
    };
    let ctr = edit(
        &edit(&read(&dir, "ctr.yaml"), "version: 1", "version: 2"),
        "feature: user_profile:age",
        "feature: user_profile:tenure_days",
    );
    std::fs::write(dir.path().join("ctr.yaml"), ctr).expect("write ctr.yaml");
    // Five intervals with half of the change in the folder: nothing is read, so nothing is refused.
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let profile = with_tenure_days(&read(&dir, "user_profile.yaml"));
    std::fs::write(dir.path().join("user_profile.yaml"), profile).expect("write user_profile.yaml");
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let j = ok(&app.get("/v1/schemas").await);
    assert!(j["folder"]["refused"].is_null(), "{j}");
    assert_eq!(
        ok(&app.get("/v1/schemas/models/ctr").await)["document"]["version"],
        1
    );

    deploy.release();
    wait_for(
        &app,
        "/v1/schemas/models/ctr",
        "ctr version 2 served",
        |j| j["document"]["version"] == 2,
    )
    .await;
    assert_eq!(
        ok(&app.get("/v1/schemas/views/user_profile").await)["document"]["version"],
        2
    );
    assert_eq!(metric(&app, applied).await, before + 1.0);
    assert_eq!(metric(&app, refused).await, 0.0);
    let predict = json!({"entities": {"user_id": "u_5"}, "candidates": [{"item_id": "i_1"}]});
    assert_eq!(app.predict("ctr", &predict).await.status, 200);
    app.stop().await;
}

/// A registration that waits for the folder's lock past its request's end (the backstop answers 503, a
/// retry is the caller's) registers nothing once the lock is free: a caller told to retry must not find
/// the change made anyway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_whose_request_ends_while_it_waits_for_the_folder_lock_registers_nothing() {
    let dir = copy_of_schemas();
    let app = spawn_configured(&dir, |c| {
        c.registry.writes = true;
        c.limits.request_timeout = std::time::Duration::from_millis(300);
    })
    .await;
    let before = std::fs::read_to_string(dir.path().join("user_profile.yaml")).expect("schema");
    let deploy = FolderLock::hold(&dir);

    let r = put(
        &app,
        "/v1/schemas/views/user_profile",
        &with_tenure_days(&before),
    )
    .await;
    assert_eq!(r.status, 503, "{}", String::from_utf8_lossy(&r.body));
    deploy.release();
    // Time for the registration, still waiting for the lock, to take it and go on.
    tokio::time::sleep(std::time::Duration::from_millis(800)).await;
    assert_eq!(
        ok(&app.get("/v1/schemas/views/user_profile").await)["document"]["version"],
        1
    );
    assert_eq!(
        std::fs::read_to_string(dir.path().join("user_profile.yaml")).expect("schema"),
        before
    );
    app.stop().await;
}

/// A deleted view leaves `/v1/stats` and `/metrics` as a deleted model does, and the cache's upkeep
/// removes its entries, which can never be served again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_view_leaves_the_stats_and_its_cached_entries_go() {
    let dir = copy_of_schemas();
    let app = spawn(&dir, true).await;
    let promo = "kind: view\nname: promo\nversion: 1\nentity: user_id\nfeatures:\n  - {name: x, dtype: float32, default: 1}\n";
    ok(&put(&app, "/v1/schemas/views/promo", promo).await);
    let r = app
        .post_json(
            "/v1/features",
            &json!({"entities": {"user_id": ["u_1", "u_2"]}, "features": ["promo:x"]}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let counters = app.gateway.telemetry.view("promo");
    assert_eq!(
        counters.entries.load(std::sync::atomic::Ordering::Relaxed),
        2
    );
    let stats = ok(&app.get("/v1/stats").await);
    assert_eq!(stats["views"]["promo"]["entries"], 2, "{stats}");

    ok(&delete(&app, "/v1/schemas/views/promo").await);
    let stats = ok(&app.get("/v1/stats").await);
    assert!(stats["views"].get("promo").is_none(), "{stats}");
    assert!(stats["views"].get("user_profile").is_some(), "{stats}");
    let metrics = String::from_utf8_lossy(&app.get("/metrics").await.body).into_owned();
    assert!(!metrics.contains("view=\"promo\""), "{metrics}");
    // The upkeep runs every second.
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while counters.entries.load(std::sync::atomic::Ordering::Relaxed) > 0 {
        assert!(
            std::time::Instant::now() < until,
            "the deleted view's entries stayed cached"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(counters.bytes.load(std::sync::atomic::Ordering::Relaxed), 0);

    // Registered again, it starts from zeros.
    ok(&put(&app, "/v1/schemas/views/promo", promo).await);
    let stats = ok(&app.get("/v1/stats").await);
    assert_eq!(stats["views"]["promo"]["entries"], 0, "{stats}");
    assert_eq!(stats["views"]["promo"]["misses"], 0, "{stats}");
    app.stop().await;
}

/// Rolling back to the running version changes nothing, whether or not it is kept: one loaded from the
/// folder and never changed over HTTP has no kept file, and used to get 404 where a kept one got 200.
#[tokio::test]
async fn a_rollback_to_the_running_version_changes_nothing_when_it_was_never_kept() {
    let dir = copy_of_schemas();
    let app = spawn(&dir, true).await;
    let before = std::fs::read_to_string(dir.path().join("item_stats.yaml")).expect("schema");
    let r = rollback(&app, "/v1/schemas/views/item_stats", json!({"version": 1})).await;
    let j = ok(&r);
    assert_eq!(j["documents"][0]["change"], "unchanged", "{j}");
    assert_eq!(
        std::fs::read_to_string(dir.path().join("item_stats.yaml")).expect("schema"),
        before
    );
    // Any other version is still not kept.
    let r = rollback(&app, "/v1/schemas/views/item_stats", json!({"version": 2})).await;
    assert_eq!((r.status, r.code().as_str()), (404, "unknown_version"));
    app.stop().await;
}

/// A document registered as it runs, here sent back as the JSON `GET` shows it, is `unchanged` and
/// leaves its file as it was: its YAML, its comments, and no kept version made of it.
#[tokio::test]
async fn an_unchanged_registration_leaves_the_files_alone() {
    let dir = copy_of_schemas();
    let app = spawn(&dir, true).await;
    let file = dir.path().join("user_profile.yaml");
    let before = std::fs::read_to_string(&file).expect("schema");
    let shown = ok(&app.get("/v1/schemas/views/user_profile").await);
    let as_json = shown["document"].to_string();
    let j = ok(&put(&app, "/v1/schemas/views/user_profile", &as_json).await);
    assert_eq!(j["documents"][0]["change"], "unchanged", "{j}");
    assert_eq!(std::fs::read_to_string(&file).expect("schema"), before);
    assert!(!dir.path().join(".versions/view/user_profile").exists());
    // Sent with another document that does change, only that one's file is written.
    let promo = "kind: view\nname: promo\nversion: 1\nentity: user_id\nfeatures:\n  - {name: p, dtype: int64, default: 0}\n";
    let j = ok(&app
        .post(
            "/v1/schemas",
            "application/yaml",
            format!("{as_json}\n---\n{promo}").into_bytes(),
        )
        .await);
    assert_eq!(
        j["files"],
        json!([dir.path().join("promo.yaml").display().to_string()]),
        "{j}"
    );
    assert_eq!(std::fs::read_to_string(&file).expect("schema"), before);
    app.stop().await;
}

/// After a rollback, a version number that is kept stays the document it was: registering other content
/// under it is refused with 409, as it is for a document added back after a delete, and the kept
/// binding stays readable. The same content under it, or a number above every kept one, is taken.
#[tokio::test]
async fn a_version_kept_above_a_rollback_cannot_name_another_document() {
    let dir = copy_of_schemas();
    let app = spawn(&dir, true).await;
    let (v2, other_v2) = rolled_back_from_v2(&app).await;
    // The dry run says what the registration will: a data team's check before it ships.
    for r in [
        validate(&app, &other_v2).await,
        put(&app, "/v1/schemas/views/user_profile", &other_v2).await,
    ] {
        assert_eq!(
            (r.status, r.code().as_str()),
            (409, "version_kept"),
            "{}",
            String::from_utf8_lossy(&r.body)
        );
    }
    let dry = validate(&app, &v2).await;
    assert_eq!(ok(&dry)["documents"][0]["version"], 2);
    let kept = ok(&app.get("/v1/schemas/views/user_profile/versions/2").await);
    assert_eq!(kept["document"]["features"][1]["default"], 7, "{kept}");
    // Version 2 as kept is taken again; so is other content as version 3.
    ok(&put(&app, "/v1/schemas/views/user_profile", &v2).await);
    let v3 = edit(&other_v2, "version: 2", "version: 3");
    ok(&put(&app, "/v1/schemas/views/user_profile", &v3).await);
    app.stop().await;
}

/// The folder watch keeps a kept version number to its document as a registration does: a hand edit
/// that writes other content under a kept number is refused, and what runs stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_folder_watch_refuses_other_content_under_a_kept_version() {
    let dir = copy_of_schemas();
    let app = watching(&dir, std::time::Duration::from_millis(100)).await;
    let (v2, other_v2) = rolled_back_from_v2(&app).await;
    std::fs::write(dir.path().join("user_profile.yaml"), &other_v2).expect("hand edit");
    let j = wait_for(&app, "/v1/schemas", "the hand edit refused", |j| {
        !j["folder"]["refused"].is_null()
    })
    .await;
    assert!(
        j["folder"]["refused"]
            .to_string()
            .contains("version 2 would name another document"),
        "{j}"
    );
    assert_eq!(
        ok(&app.get("/v1/schemas/views/user_profile").await)["document"]["version"],
        1
    );
    // The kept version 2, written back by hand as it was kept, is taken.
    std::fs::write(dir.path().join("user_profile.yaml"), &v2).expect("hand edit");
    version_on(&app, 2).await;
    app.stop().await;
}

/// `user_profile` registered as version 2 (a `tenure_days` defaulting to 7), then rolled back to 1.
/// Answers version 2 as kept, and other content under the same number (the default 8).
async fn rolled_back_from_v2(app: &TestApp) -> (String, String) {
    let v2 = with_tenure_days(&schema_file("user_profile.yaml"));
    ok(&put(app, "/v1/schemas/views/user_profile", &v2).await);
    ok(&rollback(app, "/v1/schemas/views/user_profile", json!({"version": 1})).await);
    let other_v2 = edit(
        &v2,
        "name: tenure_days, dtype: int64, default: 7",
        "name: tenure_days, dtype: int64, default: 8",
    );
    (v2, other_v2)
}

/// A deploy holding the schemas folder's lock with `flock(1)`, as the README shows, until released.
struct FolderLock(std::process::Child);

impl FolderLock {
    /// Returns once `flock` holds the lock: it runs `cat`, which ends when the pipe is closed.
    fn hold(dir: &tempfile::TempDir) -> Self {
        use std::io::{BufRead as _, BufReader};
        let mut deploy = std::process::Command::new("flock")
            .arg(dir.path().join(".hydrant.lock"))
            .args(["sh", "-c", "echo locked; cat"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("flock(1) (util-linux) runs");
        let mut line = String::new();
        BufReader::new(deploy.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("flock's first line");
        assert_eq!(line, "locked\n");
        Self(deploy)
    }

    fn release(mut self) {
        drop(self.0.stdin.take());
        assert!(self.0.wait().expect("flock ends").success());
    }
}

/// Waits until `app` serves `version` of the view `user_profile`.
async fn version_on(app: &TestApp, version: u64) {
    let what = format!("user_profile version {version} served");
    wait_for(app, "/v1/schemas/views/user_profile", &what, |j| {
        j["document"]["version"] == version
    })
    .await;
}

/// The folder as a registration of a new `user_profile` version and a `ctr` that reads it leaves it
/// when its process is killed between its two renames: the journal written, `user_profile.yaml`
/// renamed into place, `ctr.yaml` still under its temporary name. Done under the folder's lock, as the
/// registration holds it, which the kill releases.
fn cut_registration(dir: &std::path::Path) -> String {
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join(".hydrant.lock"))
        .expect("lock file");
    lock.lock().expect("the folder's lock");
    let (profile, ctr) = (dir.join("user_profile.yaml"), dir.join("ctr.yaml"));
    let old_profile = std::fs::read_to_string(&profile).expect("user_profile.yaml");
    let old_ctr = std::fs::read_to_string(&ctr).expect("ctr.yaml");
    let new_ctr = edit(&old_ctr, "version: 1", "version: 2");
    std::fs::write(dir.join(".ctr.yaml.hydrant-tmp"), &new_ctr).expect("staged ctr");
    let new_profile = with_tenure_days(&old_profile);
    let undo = hydrant::journal::Undo {
        changes: vec![
            hydrant::journal::Change {
                file: "user_profile.yaml".into(),
                before: Some(old_profile.clone()),
                after: Some(new_profile.clone()),
            },
            hydrant::journal::Change {
                file: "ctr.yaml".into(),
                before: Some(old_ctr),
                after: Some(new_ctr),
            },
        ],
        temporaries: vec![".ctr.yaml.hydrant-tmp".into()],
    };
    hydrant::journal::begin(dir, &undo).expect("journal");
    std::fs::write(&profile, new_profile).expect("the one rename done");
    drop(lock);
    old_profile
}

/// The half change would compile (a view with one feature more, the model as it was) and be served;
/// instead start-up takes it back, and the folder holds what it held before the registration.
#[tokio::test]
async fn a_registration_killed_between_its_renames_is_taken_back_at_start_up() {
    let dir = copy_of_schemas();
    let old_profile = cut_registration(dir.path());
    assert!(hydrant::journal::pending(dir.path()));
    let app = spawn(&dir, true).await;
    let users = demo_rows("user_profile", "user_id");
    assert_eq!(
        age(&app, "u_5").await,
        (users["u_5"]["age"].clone(), "PRESENT".to_owned()),
        "version 1 is served: version 2 would serve the stored rows as DEFAULTED"
    );
    assert_eq!(
        std::fs::read_to_string(dir.path().join("user_profile.yaml")).expect("file"),
        old_profile
    );
    assert!(!hydrant::journal::pending(dir.path()));
    let hidden: Vec<String> = std::fs::read_dir(dir.path())
        .expect("dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.') && n != ".hydrant.lock")
        .collect();
    assert!(hidden.is_empty(), "{hidden:?}");
    app.stop().await;
}

/// A replica watching a folder it shares with one whose registration was killed takes the half change
/// back too, rather than reloading it.
#[tokio::test]
async fn the_folder_watch_takes_back_a_registration_killed_between_its_renames() {
    let dir = copy_of_schemas();
    let app = watching(&dir, std::time::Duration::from_millis(50)).await;
    let old_profile = cut_registration(dir.path());
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while hydrant::journal::pending(dir.path()) {
        assert!(std::time::Instant::now() < until, "the journal stayed");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(
        std::fs::read_to_string(dir.path().join("user_profile.yaml")).expect("file"),
        old_profile
    );
    // A few more looks: nothing was reloaded, and version 1 is still served.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let users = demo_rows("user_profile", "user_id");
    assert_eq!(
        age(&app, "u_5").await,
        (users["u_5"]["age"].clone(), "PRESENT".to_owned())
    );
    let j = ok(&app.get("/v1/schemas").await);
    assert_eq!(j["folder"]["refused"], Json::Null, "{j}");
    app.stop().await;
}

/// A registration made after another process's was cut takes the cut one back first (its journal is
/// not overwritten, and its half change not kept), and then registers.
#[tokio::test]
async fn a_registration_after_one_killed_between_its_renames_takes_that_one_back_first() {
    let dir = copy_of_schemas();
    let app = spawn_configured(&dir, |c| {
        c.registry.writes = true;
        c.registry.reload_interval = std::time::Duration::ZERO;
    })
    .await;
    let old_profile = cut_registration(dir.path());
    let items = schema_file("item_stats.yaml");
    let described = edit(&items, "description: ", "description: (edited) ");
    let j = ok(&put(&app, "/v1/schemas/views/item_stats", &described).await);
    assert_eq!(j["registered"], true, "{j}");
    assert!(!hydrant::journal::pending(dir.path()));
    assert_eq!(
        std::fs::read_to_string(dir.path().join("user_profile.yaml")).expect("file"),
        old_profile,
        "the cut registration's half is gone"
    );
    assert_eq!(
        std::fs::read_to_string(dir.path().join("item_stats.yaml")).expect("file"),
        described
    );
    assert!(!dir.path().join(".ctr.yaml.hydrant-tmp").exists());
    app.stop().await;
}
