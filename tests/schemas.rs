//! The schema registry over HTTP: `GET /v1/schemas`, `GET /v1/schemas/{kind}/{name}` and the dry run
//! `POST /v1/schemas:validate`, which checks a change against the running registry and registers nothing.
//! Documents are the repo's own schema files, edited as a data team would edit them.

mod common;

use common::{Reply, TestApp, root};
use serde_json::{Value as Json, json};

/// The text of `schemas/{file}`.
fn schema_file(file: &str) -> String {
    std::fs::read_to_string(root().join("schemas").join(file)).expect("schema file")
}

/// `text` with `from` replaced by `to`, which it must hold.
fn edit(text: &str, from: &str, to: &str) -> String {
    assert!(text.contains(from), "the schema holds {from:?}");
    text.replacen(from, to, 1)
}

async fn validate(app: &TestApp, body: &str) -> Reply {
    app.post(
        "/v1/schemas:validate",
        "application/yaml",
        body.as_bytes().to_vec(),
    )
    .await
}

/// The problems of a 422, as (file name, path, message).
fn problems(r: &Reply) -> Vec<(String, String, String)> {
    assert_eq!(r.status, 422, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.code(), "invalid_schema");
    r.json()["error"]["problems"]
        .as_array()
        .expect("problems")
        .iter()
        .map(|p| {
            let file = p["file"].as_str().expect("file");
            let name = std::path::Path::new(file)
                .file_name()
                .map_or(file.to_owned(), |n| n.to_string_lossy().into_owned());
            (
                name,
                p["path"].as_str().expect("path").to_owned(),
                p["message"].as_str().expect("message").to_owned(),
            )
        })
        .collect()
}

/// The `documents` of a 200 answer.
fn documents(r: &Reply) -> Vec<Json> {
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()["valid"], true);
    r.json()["documents"].as_array().expect("documents").clone()
}

#[tokio::test]
async fn registered_schemas_are_listed_and_shown_as_written() {
    let app = TestApp::spawn().await;
    let list = app.get("/v1/schemas").await;
    assert_eq!(list.status, 200);
    let list = list.json();
    let names = |kind: &str| -> Vec<String> {
        list[kind]
            .as_array()
            .expect("kind")
            .iter()
            .map(|d| d["name"].as_str().expect("name").to_owned())
            .collect()
    };
    assert_eq!(names("entities"), ["item_id", "user_id"]);
    assert_eq!(names("views"), ["item_stats", "user_profile"]);
    assert_eq!(names("models"), ["ctr"]);
    let ctr = &list["models"][0];
    assert_eq!(ctr["version"], 1);
    assert_eq!(ctr["views"], json!(["user_profile", "item_stats"]));
    assert_eq!(ctr["width"], 27);
    assert!(
        ctr["file"].as_str().expect("file").ends_with("ctr.yaml"),
        "{ctr}"
    );

    // The document is the file's, read independently here.
    let shown = app.get("/v1/schemas/views/user_profile").await;
    assert_eq!(shown.status, 200);
    let shown = shown.json();
    let yaml: serde_yaml::Value =
        serde_yaml::from_str(&schema_file("user_profile.yaml")).expect("yaml");
    assert_eq!(
        shown["document"],
        serde_json::to_value(&yaml).expect("json")
    );
    assert_eq!(shown["kind"], "view");
    assert_eq!(shown["version"], 1);

    // The second document of entities.yaml.
    let item = app.get("/v1/schemas/entities/item_id").await.json();
    assert_eq!(item["document"]["dtype"], "string");

    let r = app.get("/v1/schemas/widgets/ctr").await;
    assert_eq!(r.status, 404);
    assert_eq!(r.code(), "unknown_schema_kind");
    let r = app.get("/v1/schemas/views/user_profil").await;
    assert_eq!(r.status, 404);
    assert_eq!(r.code(), "unknown_view");
    let message = r.json()["error"]["message"].to_string();
    assert!(message.contains("item_stats, user_profile"), "{message}");
}

#[tokio::test]
async fn validation_reports_changes_and_registers_nothing() {
    let app = TestApp::spawn().await;
    let profile = schema_file("user_profile.yaml");

    let same = documents(&validate(&app, &profile).await);
    assert_eq!(same.len(), 1);
    assert_eq!(same[0]["change"], "unchanged");
    assert_eq!(same[0]["version"], 1);

    // A new feature in a new version: valid, and the answer says what happens to stored records.
    let v2 = edit(
        &edit(&profile, "version: 1", "version: 2"),
        "  - {name: age, dtype: int64, default: 30}\n",
        "  - {name: age, dtype: int64, default: 30}\n  - {name: tenure_days, dtype: int64, default: 0}\n",
    );
    let changed = documents(&validate(&app, &v2).await);
    assert_eq!(changed[0]["change"], "changed");
    assert_eq!(changed[0]["version"], 2);
    assert_eq!(changed[0]["running_version"], 1);
    let notes = changed[0]["notes"].to_string();
    assert!(notes.contains("features added: tenure_days"), "{notes}");
    assert!(notes.contains("DEFAULTED"), "{notes}");

    // Nothing was registered: the view is still version 1 and predictions still run on it.
    let shown = app.get("/v1/schemas/views/user_profile").await.json();
    assert_eq!(shown["version"], 1);
    let r = app
        .predict(
            "ctr",
            &json!({"entities": {"user_id": "u_1"}, "candidates": [{"item_id": "i_1"}]}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()["model_version"], 1);

    // A model whose description alone changes keeps its version.
    let ctr = edit(
        &schema_file("ctr.yaml"),
        "name: ctr\n",
        "name: ctr\ndescription: scores rows\n",
    );
    let docs = documents(&validate(&app, &ctr).await);
    assert_eq!(docs[0]["change"], "changed");
}

#[tokio::test]
async fn changes_that_would_break_stored_records_or_running_models_are_refused() {
    let app = TestApp::spawn().await;
    let profile = schema_file("user_profile.yaml");
    let retyped = edit(
        &profile,
        "{name: age, dtype: int64, default: 30}",
        "{name: age, dtype: float32, default: 30}",
    );

    // New features under the old version (and, said too, under a model that reads them).
    let p = problems(&validate(&app, &retyped).await);
    assert_eq!(p.len(), 2, "{p:?}");
    assert_eq!(p[0].0, "request body");
    assert_eq!(p[0].1, "version");
    assert!(p[0].2.contains("needs a new version"), "{p:?}");

    // A lower version, against a gateway running ctr version 2.
    let dir = common::schemas_with_ctr_edit("version: 1", "version: 2");
    let mut c = common::test_config();
    c.registry.schemas = dir.path().to_owned();
    let (store, store_dir) = common::demo_store().await;
    let at_v2 = TestApp::spawn_with(c, store, Some(store_dir)).await;
    let p = problems(&validate(&at_v2, &schema_file("ctr.yaml")).await);
    assert_eq!(p[0].1, "version");
    assert!(
        p[0].2.contains("1 is lower than the running version 2"),
        "{p:?}"
    );

    // A new version, but ctr reads `age` and keeps its binding.
    let v2 = edit(&retyped, "version: 1", "version: 2");
    let p = problems(&validate(&app, &v2).await);
    assert_eq!(p[0].1, "features");
    assert!(
        p[0].2.contains("`age` changes dtype from int64 to float32")
            && p[0].2.contains("model `ctr`"),
        "{p:?}"
    );
    // With a new version of ctr in the same change it is valid; ctr is loaded again to check it.
    let ctr2 = edit(&schema_file("ctr.yaml"), "version: 1", "version: 2");
    let docs = documents(&validate(&app, &format!("{v2}\n---\n{ctr2}")).await);
    let changes: Vec<(&str, &str)> = docs
        .iter()
        .map(|d| {
            (
                d["name"].as_str().expect("name"),
                d["change"].as_str().expect("change"),
            )
        })
        .collect();
    assert_eq!(changes, [("user_profile", "changed"), ("ctr", "changed")]);

    // A new version keyed by another entity, while ctr reads it and keeps its binding: ctr's callers
    // send `user_id`, and would be refused.
    let rekeyed = edit(
        &edit(&profile, "version: 1", "version: 2"),
        "entity: user_id",
        "entity: item_id",
    );
    let p = problems(&validate(&app, &rekeyed).await);
    assert!(
        p.iter().any(|(_, field, m)| field == "features"
            && m.contains("entity changes from user_id to item_id")
            && m.contains("model `ctr`")),
        "{p:?}"
    );

    // A feature ctr reads, removed: named where ctr reads it.
    let removed = edit(
        &edit(&profile, "version: 1", "version: 2"),
        "  - {name: country, dtype: string, default: unknown}\n",
        "",
    );
    let p = problems(&validate(&app, &removed).await);
    assert_eq!(p[0].0, "ctr.yaml");
    assert_eq!(p[0].1, "inputs[3].feature");
    assert!(p[0].2.contains("user_profile:country"), "{p:?}");

    // The same binding written another way is not a change of binding: no new version needed.
    let same = edit(
        &edit(&schema_file("ctr.yaml"), "mean: 40,", "mean: 40.0,"),
        "file: ctr.onnx",
        "file: ./ctr.onnx",
    );
    assert_eq!(
        documents(&validate(&app, &same).await)[0]["change"],
        "changed"
    );

    // ctr's binding changed under the same version.
    let rebound = edit(
        &schema_file("ctr.yaml"),
        "transform: {standardize: {mean: 40, std: 12}}",
        "transform: {standardize: {mean: 41, std: 12}}",
    );
    let p = problems(&validate(&app, &rebound).await);
    assert_eq!(p[0].1, "version");
    assert!(p[0].2.contains("binding"), "{p:?}");

    // An entity's dtype, while views key their records by it. `user_id` is the first document of
    // entities.yaml: the second stays registered beside the request's.
    let entity = "kind: entity\nname: user_id\ndtype: int64\n";
    let p = problems(&validate(&app, entity).await);
    assert_eq!(p[0].1, "dtype");
    assert!(p[0].2.contains("user_profile"), "{p:?}");
    let same = "kind: entity\nname: user_id\ndtype: string\ndescription: A signed-in user.\n";
    assert_eq!(
        documents(&validate(&app, same).await)[0]["change"],
        "unchanged"
    );
    // It may change once no view keys records by it any more: item_stats moves to a new entity, and ctr,
    // which reads it, gets a new version in the same change (its callers send `item_num` now).
    let moved = format!(
        "{}---\nkind: entity\nname: item_num\n---\nkind: entity\nname: item_id\ndtype: int64\n---\n{ctr2}",
        edit(
            &edit(&schema_file("item_stats.yaml"), "version: 1", "version: 2"),
            "entity: item_id",
            "entity: item_num"
        )
    );
    let r = validate(&app, &moved).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
}

#[tokio::test]
async fn a_model_that_cannot_load_is_refused_with_the_reason() {
    let app = TestApp::spawn().await;
    // One slot fewer: the binding is 26 columns wide and the ONNX input takes 27.
    let narrow = edit(
        &edit(&schema_file("ctr.yaml"), "name: ctr\n", "name: ctr_small\n"),
        "  - feature: user_profile:is_premium\n",
        "",
    );
    let entity = "kind: entity\nname: shop_id\n";
    let p = problems(&validate(&app, &format!("{entity}---\n{narrow}")).await);
    assert_eq!(p.len(), 1, "{p:?}");
    assert_eq!(p[0].1, "document 2: file");
    assert!(
        p[0].2.contains("26 columns wide") && p[0].2.contains("takes 27"),
        "{p:?}"
    );
    let r = validate(&app, &format!("{entity}---\n{narrow}")).await;
    assert_eq!(r.json()["error"]["field"], "document 2: file");

    let missing = edit(
        &edit(&schema_file("ctr.yaml"), "name: ctr\n", "name: ctr_x\n"),
        "file: ctr.onnx",
        "file: nowhere.onnx",
    );
    let p = problems(&validate(&app, &missing).await);
    assert!(p[0].2.contains("does not exist"), "{p:?}");

    // Over HTTP, a model's file stays inside the models folder: the gateway would otherwise read any
    // file on the host, and say whether it exists.
    for outside in ["/etc/passwd", "../models/ctr.onnx"] {
        let m = edit(
            &edit(&schema_file("ctr.yaml"), "name: ctr\n", "name: ctr_z\n"),
            "file: ctr.onnx",
            &format!("file: {outside}"),
        );
        let p = problems(&validate(&app, &m).await);
        assert_eq!(p[0].1, "file");
        assert!(p[0].2.contains("outside the models folder"), "{p:?}");
        assert!(!p[0].2.contains("Protobuf"), "{p:?}");
    }

    // The same model under a new name loads, and is new.
    let copy = edit(&schema_file("ctr.yaml"), "name: ctr\n", "name: ctr_copy\n");
    let docs = documents(&validate(&app, &copy).await);
    assert_eq!(docs[0]["change"], "added");
    assert!(app.get("/v1/schemas/models/ctr_copy").await.status == 404);
}

#[tokio::test]
async fn bad_bodies_get_clear_errors() {
    let app = TestApp::spawn().await;
    let p = problems(&validate(&app, "kind: view\nname: [oops\n").await);
    assert!(p[0].2.contains("not valid YAML"), "{p:?}");
    // A key written twice is caught by the YAML parser, and named as any other problem's field is.
    let r = validate(&app, "kind: entity\nkind: entity\nname: x\ndtype: int64\n").await;
    let p = problems(&r);
    assert_eq!(p[0].1, "kind", "{p:?}");
    assert!(p[0].2.contains("duplicate entry"), "{p:?}");
    assert_eq!(r.json()["error"]["field"], "kind");
    let p = problems(&validate(&app, "").await);
    assert!(
        p[0].2.contains("the body holds no schema") && !p[0].2.contains("remove the file"),
        "{p:?}"
    );
    let p = problems(&validate(&app, "kind: widget\nname: w\n").await);
    assert_eq!(p[0].1, "kind");

    let r = app
        .post(
            "/v1/schemas:validate",
            "text/html",
            b"kind: entity".to_vec(),
        )
        .await;
    assert_eq!(r.status, 415);
    assert!(
        r.json()["error"]["message"]
            .to_string()
            .contains("application/yaml"),
        "{}",
        r.json()
    );
    // A YAML body in another charset is refused by name, not misread.
    let r = app
        .post(
            "/v1/schemas:validate",
            "application/yaml; charset=utf-16le",
            b"k\0".to_vec(),
        )
        .await;
    assert_eq!(r.status, 415);
    assert!(
        r.json()["error"]["message"]
            .to_string()
            .contains("charset=utf-16le"),
        "{}",
        r.json()
    );
    let r = app
        .post(
            "/v1/schemas:validate",
            "application/yaml",
            vec![0xff, 0xfe, b'k'],
        )
        .await;
    assert_eq!(r.status, 400);
    assert_eq!(r.code(), "invalid_body");
    for path in ["/v1/schemas:validate", "/get-online-features"] {
        let r = app.get(path).await;
        assert_eq!(r.status, 405);
        assert_eq!(r.headers["allow"], "POST", "{path}");
        let message = r.json()["error"]["message"].to_string();
        assert!(message.contains("use POST"), "{path}: {message}");
    }
    // A byte order mark may start a YAML stream.
    let r = validate(
        &app,
        "\u{feff}kind: entity\nname: user_id\ndtype: string\ndescription: A signed-in user.\n",
    )
    .await;
    assert_eq!(documents(&r)[0]["change"], "unchanged");
    // Too large, or nested deep enough to keep the YAML parser busy: refused before parsing.
    let big = format!(
        "kind: entity\nname: e\ndescription: {}\n",
        "x".repeat(200 << 10)
    );
    let r = validate(&app, &big).await;
    assert_eq!(r.status, 413);
    assert_eq!(r.code(), "schema_too_large");
    let deep = format!(
        "kind: entity\nname: e\ndescription: {}{}\n",
        "[".repeat(600),
        "]".repeat(600)
    );
    let r = validate(&app, &deep).await;
    assert_eq!(r.status, 413);
    assert!(
        r.json()["error"]["message"].to_string().contains("600"),
        "{}",
        r.json()
    );
    // Aliases that copy one large anchor thousands of times (16 million values from 52 KiB): refused
    // before any copy is built, where the parser would have built them all.
    let mut bomb = String::from("kind: entity\nname: e\ndtype: string\nx: &a\n");
    bomb.extend(std::iter::repeat_n("  - 1\n", 4_000));
    bomb.push_str("y:\n");
    bomb.extend(std::iter::repeat_n("  - *a\n", 4_000));
    let found = problems(&validate(&app, &bomb).await);
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].0, "request body", "{found:?}");
    assert!(
        found[0]
            .2
            .starts_with("not valid YAML: its aliases (`*name`) expand it past"),
        "{found:?}"
    );
    // YAML is a superset of JSON: a JSON document is read as one.
    let r = app
        .post(
            "/v1/schemas:validate",
            "application/json",
            br#"{"kind": "entity", "name": "shop_id", "dtype": "int64"}"#.to_vec(),
        )
        .await;
    assert_eq!(documents(&r)[0]["change"], "added");
}
