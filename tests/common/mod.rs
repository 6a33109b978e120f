//! Test harness: starts the real gateway on port 0 over a real store, with typed request helpers.
#![allow(dead_code)]

pub mod mutate;
pub mod redis;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use hydrant::app::Application;
use hydrant::clock::Clock;
use hydrant::config::Config;
use hydrant::gateway::Gateway;
use hydrant::schema::Registry;
use hydrant::store::{EmbeddedStore, Store};
use serde_json::Value as Json;

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A config for tests: port 0, the repo's schemas and models, logs quiet.
pub fn test_config() -> Config {
    let mut c = Config::default();
    c.server.bind = "127.0.0.1:0".parse().expect("addr");
    c.registry.schemas = root().join("schemas");
    c.registry.models = root().join("models");
    c.inference.onnxruntime_library = root().join(".ort/lib/libonnxruntime.so.1.31.1");
    c.inference.default_sessions = 2;
    c.telemetry.log_level = "warn".to_owned();
    c
}

/// The demo rows of `view` (`demo/rows/<view>.jsonl`) by their `key` field, read as plain JSON.
pub fn demo_rows(view: &str, key: &str) -> HashMap<String, Json> {
    let text =
        std::fs::read_to_string(root().join(format!("demo/rows/{view}.jsonl"))).expect("rows");
    text.lines()
        .map(|l| serde_json::from_str::<Json>(l).expect("json"))
        .map(|r| (r[key].as_str().expect("key").to_owned(), r))
        .collect()
}

/// A running gateway.
pub struct TestApp {
    pub addr: String,
    pub client: reqwest::Client,
    pub gateway: Arc<Gateway>,
    pub store: Arc<dyn Store>,
    pub clock: Clock,
    pub config: Config,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    handle: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
    _dir: Option<tempfile::TempDir>,
}

/// A response as the tests look at it.
pub struct Reply {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: Vec<u8>,
}

impl Reply {
    /// The whole of `resp`: status, headers and body.
    pub async fn read(resp: reqwest::Response) -> Self {
        Reply {
            status: resp.status().as_u16(),
            headers: resp.headers().clone(),
            body: resp.bytes().await.expect("body").to_vec(),
        }
    }

    pub fn json(&self) -> Json {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "body is not JSON ({e}): {}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    /// The error code of an error body.
    pub fn code(&self) -> String {
        self.json()["error"]["code"]
            .as_str()
            .unwrap_or("")
            .to_owned()
    }

    /// The error's message (empty when there is none).
    pub fn message(&self) -> String {
        self.json()["error"]["message"]
            .as_str()
            .unwrap_or("")
            .to_owned()
    }
}

/// Sends `request` (raw bytes: head and body) on a fresh connection to `addr` and reads until the gateway
/// closes it: the whole answer. The send buffer is small, so a large body cannot sit whole in the kernel
/// before the gateway answers: the client is still writing when a refusal goes out, as a real one would
/// be. A failure to send or to read, or 20 s without the end, panics naming `what`.
pub async fn exchange(addr: &str, request: &[u8], what: &str) -> Vec<u8> {
    exchange_in_pieces(addr, &[request], what).await
}

/// [`exchange`], with the request sent in `pieces` 30 ms apart, so that the gateway reads each one as
/// it comes.
pub async fn exchange_in_pieces(addr: &str, pieces: &[&[u8]], what: &str) -> Vec<u8> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_send_buffer_size(64 * 1024).expect("send buffer");
    let addr = addr.trim_start_matches("http://").parse().expect("address");
    let mut s = socket.connect(addr).await.expect("connect");
    s.set_nodelay(true).expect("nodelay");
    for (i, piece) in pieces.iter().enumerate() {
        if i > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(30)).await;
        }
        s.write_all(piece)
            .await
            .unwrap_or_else(|e| panic!("{what}: sending the request failed: {e}"));
    }
    let mut answer = Vec::new();
    tokio::time::timeout(
        std::time::Duration::from_secs(20),
        s.read_to_end(&mut answer),
    )
    .await
    .unwrap_or_else(|_| panic!("{what}: no end to the answer"))
    .unwrap_or_else(|e| panic!("{what}: reading the answer failed: {e}"));
    answer
}

/// An embedded store in a temporary folder, loaded with the demo rows.
pub async fn demo_store() -> (Arc<dyn Store>, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("tempdir");
    let store: Arc<dyn Store> =
        Arc::new(EmbeddedStore::open(&dir.path().join("t.redb")).expect("store"));
    load_demo_rows(&store).await;
    (store, dir)
}

/// A copy of the repo's schemas with `replace` replaced by `with` in the ctr model's file (which must
/// hold it).
pub fn schemas_with_ctr_edit(replace: &str, with: &str) -> tempfile::TempDir {
    schemas_with_edit("ctr.yaml", replace, with)
}

/// A copy of the repo's schemas with `replace` replaced by `with` in `file`.
pub fn schemas_with_edit(file: &str, replace: &str, with: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    for e in std::fs::read_dir(root().join("schemas")).expect("read") {
        let p = e.expect("entry").path();
        std::fs::copy(&p, dir.path().join(p.file_name().expect("name"))).expect("copy");
    }
    let path = dir.path().join(file);
    let s = std::fs::read_to_string(&path).expect("read");
    assert!(s.contains(replace), "{file} holds {replace:?}");
    std::fs::write(&path, s.replace(replace, with)).expect("write");
    dir
}

/// The committed worked examples (`models/ctr.examples.json`), each with the predict body that scores
/// its user, context and item.
pub fn ctr_examples() -> Vec<(Json, Json)> {
    let examples: Json = serde_json::from_str(
        &std::fs::read_to_string(root().join("models/ctr.examples.json")).expect("examples"),
    )
    .expect("json");
    examples
        .as_array()
        .expect("list")
        .iter()
        .map(|ex| {
            let body = serde_json::json!({
                "entities": {"user_id": ex["user"]["user_id"]},
                "context": ex["context"],
                "candidates": [{"item_id": ex["item"]["item_id"]}],
                "options": {"return_features": true},
            });
            (ex.clone(), body)
        })
        .collect()
}

/// The `score` outputs of a predict answer.
pub fn scores(reply: &Json) -> Vec<f64> {
    reply["outputs"]["score"]
        .as_array()
        .unwrap_or_else(|| panic!("no scores in {reply}"))
        .iter()
        .map(|x| x.as_f64().expect("score"))
        .collect()
}

/// The repo's schemas, compiled.
pub fn registry() -> Registry {
    Registry::load_dir(&root().join("schemas"), &root().join("models")).expect("schemas")
}

/// Loads rows (JSON Lines, or CSV when `csv`) of `view` into `store` with the bulk loader, under prefix `hy`.
pub async fn load_rows(
    store: &Arc<dyn Store>,
    view: &str,
    rows: impl std::io::BufRead,
    csv: bool,
) -> hydrant::loader::Report {
    hydrant::loader::load(
        &registry().views[view],
        "hy",
        rows,
        csv,
        &Config::default().limits,
        store.clone(),
    )
    .await
    .expect("load")
}

/// Loads `demo/rows/*.jsonl` into `store`, under prefix `hy`.
pub async fn load_demo_rows(store: &Arc<dyn Store>) {
    for view in ["user_profile", "item_stats"] {
        let path = root().join(format!("demo/rows/{view}.jsonl"));
        let f = std::io::BufReader::new(std::fs::File::open(&path).expect("rows"));
        let report = load_rows(store, view, f, false).await;
        assert!(report.rejected.is_empty(), "{:?}", report.rejected);
    }
}

impl TestApp {
    /// The demo gateway on the embedded store with the demo rows.
    pub async fn spawn() -> Self {
        let (store, dir) = demo_store().await;
        Self::spawn_with(test_config(), store, Some(dir)).await
    }

    pub async fn spawn_with(
        config: Config,
        store: Arc<dyn Store>,
        dir: Option<tempfile::TempDir>,
    ) -> Self {
        Self::try_spawn_with(config, store, dir)
            .await
            .unwrap_or_else(|e| panic!("the app does not build: {e:#}"))
    }

    /// Like [`TestApp::spawn_with`], but a start-up error is returned.
    pub async fn try_spawn_with(
        config: Config,
        store: Arc<dyn Store>,
        dir: Option<tempfile::TempDir>,
    ) -> anyhow::Result<Self> {
        let clock = Clock::default();
        let app =
            Application::build_with_store(config.clone(), store.clone(), clock.clone()).await?;
        let addr = format!("http://127.0.0.1:{}", app.port());
        let gateway = app.gateway();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let handle = tokio::spawn(app.run_until_stopped(async move {
            let _ = rx.await;
        }));
        Ok(Self {
            addr,
            client: reqwest::Client::new(),
            gateway,
            store,
            clock,
            config,
            shutdown: Some(tx),
            handle: Some(handle),
            _dir: dir,
        })
    }

    pub async fn post(&self, path: &str, content_type: &str, body: Vec<u8>) -> Reply {
        self.post_with(path, &[("content-type", content_type)], body)
            .await
    }

    pub async fn post_with(&self, path: &str, headers: &[(&str, &str)], body: Vec<u8>) -> Reply {
        let mut req = self.client.post(format!("{}{path}", self.addr)).body(body);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        Reply::read(req.send().await.expect("request sent")).await
    }

    pub async fn get(&self, path: &str) -> Reply {
        Reply::read(
            self.client
                .get(format!("{}{path}", self.addr))
                .send()
                .await
                .expect("request sent"),
        )
        .await
    }

    /// `POST path` with a JSON body.
    pub async fn post_json(&self, path: &str, body: &Json) -> Reply {
        self.post(
            path,
            "application/json",
            serde_json::to_vec(body).expect("json"),
        )
        .await
    }

    /// `PUT path` with a YAML body: a schema document registered in place of the running one.
    pub async fn put_yaml(&self, path: &str, yaml: &str) -> Reply {
        let req = self
            .client
            .put(format!("{}{path}", self.addr))
            .header("content-type", "application/yaml")
            .body(yaml.to_owned());
        Reply::read(req.send().await.expect("request sent")).await
    }

    /// `POST /v1/models/{model}/predict` with a JSON body.
    pub async fn predict(&self, model: &str, body: &Json) -> Reply {
        self.post_json(&format!("/v1/models/{model}/predict"), body)
            .await
    }

    /// A predict answer that is not degraded, for a test to take as its reference. The first request for
    /// a key reads the store within the view's 50 ms bound, which a loaded test machine can miss: the
    /// answer is then degraded, with defaults, a different score for a reason no test here is about.
    /// Sends `body` again (at most 50 times) until an answer is whole.
    pub async fn settled_predict(&self, model: &str, body: &Json) -> Reply {
        for _ in 0..50 {
            let r = self.predict(model, body).await;
            assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
            if r.json()["degraded"] == false {
                return r;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        panic!("every answer to {body} was degraded");
    }

    /// Waits (at most 10 s) for `/v2/health/ready` to answer 200.
    pub async fn wait_ready(&self) {
        let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while self.get("/v2/health/ready").await.status != 200 {
            assert!(
                std::time::Instant::now() < until,
                "the gateway never turned ready"
            );
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }

    /// Stops the server and waits for it to drain.
    pub async fn stop(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(h) = self.handle.take() {
            let _ = h.await;
        }
    }
}

impl Drop for TestApp {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

/// A YAML file's documents, as one list.
pub fn yaml_documents(text: &str) -> Option<Json> {
    use serde::Deserialize as _;
    serde_yaml::Deserializer::from_str(text)
        .map(Json::deserialize)
        .collect::<Result<Vec<_>, _>>()
        .ok()
        .map(Json::Array)
}

/// A list back as YAML documents (anything else as one document).
pub fn print_yaml_documents(v: &Json) -> Option<Vec<u8>> {
    match v {
        Json::Array(docs) => docs
            .iter()
            .map(serde_yaml::to_string)
            .collect::<Result<Vec<_>, _>>()
            .ok()
            .map(|docs| docs.join("---\n").into_bytes()),
        other => serde_yaml::to_string(other).ok().map(String::into_bytes),
    }
}

/// What every answer must be: a success, or a 4xx whose body says what was wrong.
pub fn check_answer(path: &str, case: &str, status: u16, body: &[u8]) {
    assert!(
        (200..300).contains(&status) || (400..500).contains(&status),
        "{path} answered {status} to {case}: {}",
        String::from_utf8_lossy(body)
    );
    if status >= 400 {
        let err: Json = serde_json::from_slice(body).unwrap_or_else(|e| {
            panic!(
                "{path}: the {status} to {case} is not JSON ({e}): {}",
                String::from_utf8_lossy(body)
            )
        });
        if path.starts_with("/v2") {
            assert!(
                err["error"].as_str().is_some_and(|m| !m.is_empty()),
                "{path}: the {status} to {case} has no error message: {err}"
            );
        } else {
            assert!(
                err["error"]["code"].as_str().is_some_and(|c| !c.is_empty())
                    && err["error"]["message"]
                        .as_str()
                        .is_some_and(|m| !m.is_empty()),
                "{path}: the {status} to {case} has no code and message: {err}"
            );
        }
    }
}
