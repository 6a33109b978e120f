//! The files a person writes, mutated: schema files, kept schema versions edited by hand, the config file
//! and its environment overrides, and feature rows for the bulk loader. Whatever the mutation, hydrant refuses with a message that says where
//! (the file, the key, the line) or accepts, and never panics; a row the loader accepts reads back as
//! loaded.
//!
//! Seeded like `tests/mutated_requests.rs`: `MUTATION_CASES=N` runs N cases per file,
//! `MUTATION_SEED=S` starts from another seed.

mod common;

use std::panic::AssertUnwindSafe;
use std::path::Path;
use std::sync::Arc;

use common::mutate::{REQUEST_NAMES, Rng, SCHEMA_NAMES, describe, env_number, mutated};
use common::{print_yaml_documents, yaml_documents};
use futures::FutureExt as _;
use hydrant::config::Config;
use hydrant::schema::Registry;
use hydrant::store::{EmbeddedStore, Store};
use hydrant::value::{Record, Value};
use serde_json::Value as Json;

const SEED: u64 = 0x0066_696c_6573;

/// Keys of the config file.
const CONFIG_NAMES: &[&str] = &[
    "server",
    "bind",
    "shutdown_grace",
    "idle_timeout",
    "max_connections",
    "workers",
    "store",
    "prefix",
    "embedded",
    "path",
    "redis",
    "url",
    "pool_size",
    "connect_timeout",
    "command_timeout",
    "registry",
    "schemas",
    "models",
    "writes",
    "reload_interval",
    "limits",
    "max_body_bytes",
    "max_candidates",
    "request_timeout",
    "cache",
    "max_bytes",
    "prefetch",
    "max_concurrent",
    "warm_top_k",
    "inference",
    "intra_threads",
    "default_sessions",
    "max_queue",
    "queue_timeout",
    "batching",
    "telemetry",
    "log_level",
    "log_format",
    "250ms",
    "0s",
    "-1s",
    "1e3s",
];

/// Runs `f`, failing the test with `case` if it panics.
fn no_panic<T>(case: &str, f: impl FnOnce() -> T) -> T {
    std::panic::catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| panic!("panicked on {case}"))
}

/// The `name`s a schema file defines: its documents' and their features'.
fn defined_names(yaml: &str) -> Vec<String> {
    use serde::Deserialize as _;
    let mut names = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(yaml) {
        let Ok(doc) = Json::deserialize(doc) else {
            continue;
        };
        let features = doc["features"].as_array().cloned().unwrap_or_default();
        for v in std::iter::once(&doc).chain(features.iter()) {
            if let Some(n) = v["name"].as_str() {
                names.push(n.to_owned());
            }
        }
    }
    names
}

/// Serves a few requests from a gateway started on mutated schemas that were accepted: each gets a 2xx or
/// a 4xx (a schema the registry accepts must not make requests fail on hydrant's side), or the gateway
/// refuses to start with a message.
async fn serve_with(schemas: &Path, case: &str) -> bool {
    let mut config = common::test_config();
    config.registry.schemas = schemas.to_owned();
    config.inference.default_sessions = 1;
    let (store, dir) = common::demo_store().await;
    let app = match common::TestApp::try_spawn_with(config, store, Some(dir)).await {
        Ok(app) => app,
        Err(e) => {
            assert!(
                !format!("{e:#}").is_empty(),
                "{case}: a start-up error with no message"
            );
            return false;
        }
    };
    let bodies = [
        serde_json::json!({"entities": {"user_id": "u_24"}, "context": {"hour_of_day": 20, "device": "ios"},
                           "candidates": [{"item_id": "i_1"}, {"item_id": "i_unknown"}]}),
        serde_json::json!({"entities": {"user_id": "u_missing", "item_id": "i_2"}}),
        serde_json::json!({"entities": {"user_id": "u_1", "item_id": "i_3"}, "context": {"hour_of_day": -5}}),
    ];
    // The demo model, unless the mutation renamed it (then the predicts get 404).
    for body in &bodies {
        let r = app.predict("ctr", body).await;
        assert!(
            r.status == 200 || (400..500).contains(&r.status),
            "{case}: predict answered {}: {}",
            r.status,
            String::from_utf8_lossy(&r.body)
        );
    }
    let r = app
        .post_json(
            "/v1/features",
            &serde_json::json!({"entities": {"user_id": ["u_1"], "item_id": ["i_1"]}}),
        )
        .await;
    assert!(
        r.status == 200 || (400..500).contains(&r.status),
        "{case}: features answered {}",
        r.status
    );
    app.stop().await;
    true
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutated_schema_files_are_loaded_or_refused_naming_the_file() {
    let root = common::root();
    let cases = env_number("MUTATION_CASES", 150);
    let mut rng = Rng(env_number("MUTATION_SEED", SEED));
    // Each schema file's name and text, read once.
    let files: Vec<_> = std::fs::read_dir(root.join("schemas"))
        .expect("schemas")
        .map(|e| {
            let path = e.expect("entry").path();
            let text = std::fs::read_to_string(&path).expect("read");
            (path.file_name().expect("name").to_owned(), text)
        })
        .collect();
    let (mut loaded, mut refused, mut served) = (0, 0, 0);
    for i in 0..cases {
        let dir = tempfile::tempdir().expect("tempdir");
        for (name, text) in &files {
            std::fs::write(dir.path().join(name), text).expect("copy");
        }
        let (name, text) = rng.pick(&files);
        let case_seed = rng.next();
        let mut r = Rng(case_seed);
        let bytes = mutated(
            &mut r,
            SCHEMA_NAMES,
            text.as_bytes(),
            yaml_documents(text),
            print_yaml_documents,
        );
        std::fs::write(dir.path().join(name), &bytes).expect("write");
        let case = format!(
            "case {i} (seed {case_seed:#x}), {}: {}",
            name.display(),
            describe(&bytes)
        );
        match no_panic(&case, || {
            Registry::load_dir(dir.path(), &root.join("models"))
        }) {
            Ok(_) => {
                loaded += 1;
                if serve_with(dir.path(), &case).await {
                    served += 1;
                }
            }
            Err(errors) => {
                refused += 1;
                assert!(!errors.0.is_empty(), "no problem named for {case}");
                for e in &errors.0 {
                    assert!(
                        e.file.starts_with(dir.path()) && !e.message.is_empty(),
                        "{case}: a problem that names no schema file or says nothing: {e}"
                    );
                }
                // The mutated file is among those blamed, unless the mutation broke a reference from
                // another file (a model's input naming a view's feature that is gone, say): then the
                // problem names what the mutated file defined.
                let blamed = errors.0.iter().any(|e| e.file.ends_with(name));
                let problems = errors.to_string();
                assert!(
                    blamed
                        || defined_names(text)
                            .iter()
                            .any(|n| problems.contains(n.as_str())),
                    "{case}: the mutated file is not blamed: {problems}"
                );
            }
        }
    }
    eprintln!(
        "schema mutations: {loaded} loaded ({served} of them served requests), {refused} refused"
    );
    assert!(refused > cases / 4, "{refused} of {cases} refused");
}

#[test]
fn a_mutated_config_file_or_environment_is_loaded_or_refused_naming_the_key() {
    let root = common::root();
    let text = std::fs::read_to_string(root.join("config/hydrant.toml")).expect("config");
    let cases = env_number("MUTATION_CASES", 300);
    let mut rng = Rng(env_number("MUTATION_SEED", SEED) ^ 1);
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("hydrant.toml");
    let (mut loaded, mut refused) = (0, 0);
    for i in 0..cases {
        let case_seed = rng.next();
        let mut r = Rng(case_seed);
        let bytes = mutated(
            &mut r,
            CONFIG_NAMES,
            text.as_bytes(),
            toml::from_str(&text).ok(),
            |v| toml::to_string(v).ok().map(String::into_bytes),
        );
        std::fs::write(&path, &bytes).expect("write");
        // Sometimes an environment override as well, of a real or a mangled key.
        let mut env = Vec::new();
        if r.chance(40) {
            let section = *r.pick(&[
                "SERVER",
                "STORE",
                "STORE__REDIS",
                "LIMITS",
                "CACHE",
                "INFERENCE",
                "",
            ]);
            let key = *r.pick(CONFIG_NAMES);
            let value = *r.pick(&["", "0", "-1", "abc", "2s", "1e400", "true", "[1]", "😀"]);
            env.push((
                format!("HYDRANT_{section}__{}", key.to_ascii_uppercase()),
                value.to_owned(),
            ));
        }
        let case = format!(
            "case {i} (seed {case_seed:#x}), env {env:?}: {}",
            describe(&bytes)
        );
        match no_panic(&case, || Config::load(Some(&path), env.clone())) {
            Ok(_) => loaded += 1,
            Err(e) => {
                refused += 1;
                let message = e.to_string();
                assert!(
                    message.contains("hydrant.toml") || message.contains("HYDRANT_"),
                    "{case}: the refusal names neither the file nor the variable: {message}"
                );
            }
        }
    }
    eprintln!("config mutations: {loaded} loaded, {refused} refused");
    assert!(refused > cases / 4, "{refused} of {cases} refused");
}

/// The values `store` holds for `key`, decoded as the gateway reads them (the event time aside: a demo
/// row without one is stamped with the time of its load).
async fn stored(store: &dyn Store, key: &str) -> Option<Vec<Value>> {
    let bytes = store
        .get_many(&[key.to_owned()])
        .await
        .expect("read")
        .into_iter()
        .next()
        .flatten()?;
    Some(Record::decode(&bytes).expect("a record").values)
}

#[tokio::test]
async fn mutated_feature_rows_are_loaded_or_rejected_by_line() {
    let root = common::root();
    let registry = common::registry();
    let cases = env_number("MUTATION_CASES", 150);
    let mut rng = Rng(env_number("MUTATION_SEED", SEED) ^ 2);
    let limits = Config::default().limits;
    let (mut written, mut rejected) = (0, 0);
    for (view, key_field) in [("user_profile", "user_id"), ("item_stats", "item_id")] {
        let text =
            std::fs::read_to_string(root.join(format!("demo/rows/{view}.jsonl"))).expect("rows");
        let lines: Vec<&str> = text.lines().take(40).collect();
        let reference = tempfile::tempdir().expect("tempdir");
        let clean: Arc<dyn Store> =
            Arc::new(EmbeddedStore::open(&reference.path().join("t.redb")).expect("store"));
        common::load_rows(&clean, view, std::io::Cursor::new(text.clone()), false).await;
        for i in 0..cases {
            let dir = tempfile::tempdir().expect("tempdir");
            let store: Arc<dyn Store> =
                Arc::new(EmbeddedStore::open(&dir.path().join("t.redb")).expect("store"));
            let case_seed = rng.next();
            let mut r = Rng(case_seed);
            // A few lines mutated among intact ones.
            let mut body = Vec::new();
            let mut intact = Vec::new();
            for (n, line) in lines.iter().enumerate() {
                if r.chance(15) {
                    let mut bad = mutated(
                        &mut r,
                        REQUEST_NAMES,
                        line.as_bytes(),
                        serde_json::from_str(line).ok(),
                        |v| serde_json::to_vec(v).ok(),
                    );
                    // One line stays one line, so line numbers keep meaning the rows written.
                    for b in &mut bad {
                        if *b == b'\n' {
                            *b = b' ';
                        }
                    }
                    body.extend(bad);
                } else {
                    body.extend_from_slice(line.as_bytes());
                    intact.push(n);
                }
                body.push(b'\n');
            }
            let case = format!("{view} case {i} (seed {case_seed:#x})");
            let report = hydrant::loader::load(
                &registry.views[view],
                "hy",
                std::io::Cursor::new(body.clone()),
                false,
                &limits,
                store.clone(),
            );
            let report = AssertUnwindSafe(report)
                .catch_unwind()
                .await
                .unwrap_or_else(|_| panic!("the loader panicked on {case}"))
                .unwrap_or_else(|e| panic!("{case}: the load failed as a whole: {e}"));
            assert!(report.failed.is_empty(), "{case}: {:?}", report.failed);
            // Every line is accounted for: written or rejected (an empty one is neither).
            let nonempty = body
                .split(|&b| b == b'\n')
                .filter(|l| !l.iter().all(u8::is_ascii_whitespace))
                .count();
            assert!(
                report.written + report.rejected_rows == nonempty,
                "{case}: {} written + {} rejected of {nonempty} lines",
                report.written,
                report.rejected_rows
            );
            for rj in &report.rejected {
                assert!(
                    rj.line >= 1 && rj.line <= lines.len() + 1 && !rj.reason.is_empty(),
                    "{case}: {rj:?}"
                );
                assert!(
                    !intact.contains(&(rj.line - 1)),
                    "{case}: an intact line was rejected: {rj:?}"
                );
            }
            // An intact row that no later mutated line overwrote (same key) reads back as the loader
            // stores it from the unmutated file.
            for &n in intact.iter().rev().take(3) {
                let row: Json = serde_json::from_str(lines[n]).expect("row");
                let k = row[key_field].as_str().expect("key");
                let key = format!("hy:{view}:{k}");
                let overwritten = body
                    .split(|&b| b == b'\n')
                    .skip(n + 1)
                    .any(|l| String::from_utf8_lossy(l).contains(k));
                if !overwritten {
                    assert_eq!(
                        stored(store.as_ref(), &key).await,
                        stored(clean.as_ref(), &key).await,
                        "{case}: {key} does not read back as loaded"
                    );
                }
            }
            written += report.written;
            rejected += report.rejected_rows;
        }
    }
    eprintln!("row mutations: {written} rows written, {rejected} rejected");
    assert!(rejected > 0 && written > 0);
}

/// A kept version edited by hand (`.versions/view/user_profile/1.yaml`), mutated: showing it answers 200
/// or 409 naming the file, a rollback to it is registered or refused with a code, never a 5xx, and a
/// refused one leaves version 2 running and serving as before; one that was registered is undone by
/// rolling forward to version 2 again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutated_kept_versions_are_shown_or_refused_and_a_refusal_changes_nothing() {
    let cases = env_number("MUTATION_CASES", 150) / 3;
    let mut rng = Rng(env_number("MUTATION_SEED", SEED) ^ 0x6b);
    let dir = common::schemas_with_ctr_edit("version: 1", "version: 1");
    let mut config = common::test_config();
    config.registry.schemas = dir.path().to_owned();
    config.registry.writes = true;
    config.inference.default_sessions = 1;
    let (store, store_dir) = common::demo_store().await;
    let app = common::TestApp::spawn_with(config, store, Some(store_dir)).await;

    // Version 2 registered, with one feature more: version 1 is kept.
    let v1 = std::fs::read_to_string(dir.path().join("user_profile.yaml")).expect("v1");
    let age = "  - {name: age, dtype: int64, default: 30}\n";
    assert!(v1.contains("version: 1\n") && v1.contains(age), "{v1}");
    let v2 = v1.replacen("version: 1\n", "version: 2\n", 1).replacen(
        age,
        &format!("{age}  - {{name: tenure_days, dtype: int64, default: 7}}\n"),
        1,
    );
    let put = app.put_yaml("/v1/schemas/views/user_profile", &v2).await;
    assert_eq!(put.status, 200, "{}", put.message());
    let kept = dir.path().join(".versions/view/user_profile/1.yaml");
    let kept_text = std::fs::read_to_string(&kept).expect("version 1 kept");

    let rollback = |version: u32| {
        let app = &app;
        async move {
            app.post_json(
                "/v1/schemas/views/user_profile/rollback",
                &serde_json::json!({ "version": version }),
            )
            .await
        }
    };
    let running = || async {
        let r = app.get("/v1/schemas/views/user_profile").await;
        assert_eq!(r.status, 200);
        r.json()["version"].clone()
    };
    let (mut registered, mut refused) = (0, 0);
    for i in 0..cases {
        let case_seed = rng.next();
        let mut r = Rng(case_seed);
        let bytes = mutated(
            &mut r,
            SCHEMA_NAMES,
            kept_text.as_bytes(),
            common::yaml_documents(&kept_text),
            print_yaml_documents,
        );
        std::fs::write(&kept, &bytes).expect("edit the kept file");
        let case = format!("case {i} (seed {case_seed:#x}): {}", describe(&bytes));

        let shown = app.get("/v1/schemas/views/user_profile/versions/1").await;
        match shown.status {
            200 => {}
            409 => {
                assert!(
                    ["kept_version_unreadable", "kept_version_mismatch"]
                        .contains(&shown.code().as_str()),
                    "{case}: {}",
                    shown.message()
                );
                assert!(
                    shown.message().contains("1.yaml"),
                    "{case}: {}",
                    shown.message()
                );
            }
            s => panic!(
                "{case}: showing the kept version answered {s}: {}",
                shown.message()
            ),
        }

        let back = rollback(1).await;
        match back.status {
            200 => {
                registered += 1;
                assert_eq!(running().await, 1, "{case}");
                let forward = rollback(2).await;
                assert_eq!(forward.status, 200, "{case}: {}", forward.message());
            }
            400..=499 => {
                refused += 1;
                assert!(
                    !back.code().is_empty() && !back.message().is_empty(),
                    "{case}"
                );
            }
            s => panic!("{case}: the rollback answered {s}: {}", back.message()),
        }
        // Either way version 2 runs, and the gateway serves it.
        assert_eq!(running().await, 2, "{case}");
        let p = app
            .predict(
                "ctr",
                &serde_json::json!({"entities": {"user_id": "u_6"}, "candidates": [{"item_id": "i_1"}]}),
            )
            .await;
        assert_eq!(
            p.status,
            200,
            "{case}: {}",
            String::from_utf8_lossy(&p.body)
        );
    }
    eprintln!(
        "kept-version mutations: {registered} rolled back to and forward again, {refused} refused"
    );
    assert!(refused > 0, "no mutation was refused in {cases} cases");
    app.stop().await;
}
