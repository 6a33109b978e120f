//! The CUDA path, checked on a machine with a GPU. CI has none, so these tests run only where
//! `TEST_HAS_CUDA=1` is set, with the onnxruntime-gpu libraries installed (`make ort-gpu`) and CUDA 13
//! and cuDNN 9 on the loader path; `scripts/check-gpu.sh` does all of that. Elsewhere they return at
//! once, and startup.rs checks the clear refusal of `device: cuda` instead.

mod common;

use std::sync::Arc;

use common::{TestApp, demo_store, scores, test_config};
use serde_json::{Value as Json, json};

/// `TEST_HAS_CUDA` set to anything but empty or `0`.
fn has_cuda() -> bool {
    std::env::var("TEST_HAS_CUDA").is_ok_and(|v| !v.is_empty() && v != "0")
}

/// A copy of the schemas with the ctr model's `device: cpu` replaced by `device: {device}`.
fn schemas_on(device: &str) -> tempfile::TempDir {
    common::schemas_with_ctr_edit("device: cpu", &format!("device: {device}"))
}

/// The demo gateway with the ctr model on `device`; the schema copy lives as long as the app.
async fn gateway_on(device: &str) -> (TestApp, tempfile::TempDir) {
    let schemas = schemas_on(device);
    let mut c = test_config();
    c.registry.schemas = schemas.path().to_owned();
    let (store, dir) = demo_store().await;
    (TestApp::spawn_with(c, store, Some(dir)).await, schemas)
}

/// Request `i` of a fixed sequence: user, context and 1 to 128 candidates all vary with `i`.
fn request(i: usize) -> Json {
    let device = ["ios", "android", "web"][i % 3];
    let candidates = 1 + (i * 37) % 128;
    json!({
        "entities": {"user_id": format!("u_{}", (i * 11) % 1000)},
        "context": {"hour_of_day": i % 24, "device": device},
        "candidates": (0..candidates).map(|c| json!({"item_id": format!("i_{}", (i * 7 + c * 13) % 2000)})).collect::<Vec<_>>(),
    })
}

/// cuBLAS sums in another order than the CPU kernels, so the last bits of a float32 score may differ.
/// TF32 is off (with it on, H100 scores differed from the CPU's by up to 4.6e-4), so the scores agree
/// to float32 rounding.
const TOLERANCE: f64 = 1e-5;

#[tokio::test]
async fn cuda_sessions_score_what_cpu_sessions_score() {
    if !has_cuda() {
        return;
    }
    let (cpu, _a) = gateway_on("cpu").await;
    let (gpu, _b) = gateway_on("cuda").await;
    let meta = gpu.get("/v2/models/ctr").await.json();
    assert_eq!(meta["parameters"]["device"], "cuda", "{meta}");

    // One at a time, then all at once (so the batcher runs concurrent requests together on the GPU).
    let n = 64;
    let mut want = Vec::with_capacity(n);
    let mut worst = 0f64;
    for i in 0..n {
        let c = cpu.predict("ctr", &request(i)).await;
        let g = gpu.predict("ctr", &request(i)).await;
        assert_eq!(c.status, 200, "{}", String::from_utf8_lossy(&c.body));
        assert_eq!(g.status, 200, "{}", String::from_utf8_lossy(&g.body));
        let (c, g) = (scores(&c.json()), scores(&g.json()));
        assert_eq!(c.len(), g.len(), "request {i}: one score per candidate");
        for (a, b) in c.iter().zip(&g) {
            worst = worst.max((a - b).abs());
            assert!(
                (a - b).abs() < TOLERANCE,
                "request {i}: cpu {a} vs cuda {b}"
            );
        }
        want.push(c);
    }
    let gpu = Arc::new(gpu);
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let gpu = gpu.clone();
            tokio::spawn(async move { (i, gpu.predict("ctr", &request(i)).await) })
        })
        .collect();
    for t in tasks {
        let (i, r) = t.await.expect("task");
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let got = scores(&r.json());
        assert_eq!(got.len(), want[i].len(), "request {i} got its own rows");
        for (a, b) in want[i].iter().zip(&got) {
            worst = worst.max((a - b).abs());
            assert!(
                (a - b).abs() < TOLERANCE,
                "request {i} (concurrent): cpu {a} vs cuda {b}"
            );
        }
    }
    eprintln!("largest cpu/cuda score difference: {worst:e}");

    // The committed worked examples hold on the GPU too.
    for (ex, body) in common::ctr_examples() {
        let r = gpu.predict("ctr", &body).await.json();
        let want = ex["score"].as_f64().expect("score");
        assert!(
            (scores(&r)[0] - want).abs() < TOLERANCE,
            "example {ex}: got {r}"
        );
    }
}

#[tokio::test]
async fn v2_infer_runs_raw_tensors_on_the_gpu() {
    if !has_cuda() {
        return;
    }
    let (gpu, _s) = gateway_on("cuda").await;
    // A 3 x 27 tensor of known values; row r, column c holds (r * 27 + c) / 100 - 0.4.
    let data: Vec<f64> = (0..81).map(|k| f64::from(k) / 100.0 - 0.4).collect();
    let body = json!({"inputs": [{"name": "features", "shape": [3, 27], "datatype": "FP32", "data": data}]});
    let bytes = serde_json::to_vec(&body).expect("json");
    let g = gpu
        .post("/v2/models/ctr/infer", "application/json", bytes.clone())
        .await;
    assert_eq!(g.status, 200, "{}", String::from_utf8_lossy(&g.body));
    let (cpu, _c) = gateway_on("cpu").await;
    let c = cpu
        .post("/v2/models/ctr/infer", "application/json", bytes)
        .await;
    assert_eq!(c.status, 200, "{}", String::from_utf8_lossy(&c.body));
    let (g, c) = (g.json(), c.json());
    assert_eq!(g["outputs"][0]["shape"], json!([3, 1]));
    let (g, c) = (
        g["outputs"][0]["data"].as_array().expect("data").clone(),
        c["outputs"][0]["data"].as_array().expect("data").clone(),
    );
    assert_eq!(g.len(), 3);
    for (a, b) in g.iter().zip(&c) {
        let (a, b) = (a.as_f64().expect("f"), b.as_f64().expect("f"));
        assert!((a - b).abs() < TOLERANCE, "cuda {a} vs cpu {b}");
    }
}

#[tokio::test]
async fn auto_runs_on_the_gpu_when_there_is_one() {
    if !has_cuda() {
        return;
    }
    let (app, _s) = gateway_on("auto").await;
    let meta = app.get("/v2/models/ctr").await.json();
    assert_eq!(meta["parameters"]["device"], "cuda", "{meta}");
    let r = app.predict("ctr", &request(5)).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
}

/// A registration moves the ctr model from the CPU to the GPU and back while serving (the device is
/// not part of the binding, so the version stays): `/v2/models/ctr` reports each device, the scores
/// stay the CPU's, and requests in flight across both swaps are all answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_moves_a_model_to_the_gpu_and_back_while_serving() {
    if !has_cuda() {
        return;
    }
    let schemas = schemas_on("cpu");
    let mut c = test_config();
    c.registry.schemas = schemas.path().to_owned();
    c.registry.writes = true;
    let (store, dir) = demo_store().await;
    let app = Arc::new(TestApp::spawn_with(c, store, Some(dir)).await);
    let want: Vec<Vec<f64>> = scores_of(&app, 16).await;

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let clients: Vec<_> = (0..4)
        .map(|k| {
            let (app, stop) = (app.clone(), stop.clone());
            tokio::spawn(async move {
                let mut answered = 0u32;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let r = app.predict("ctr", &request(k)).await;
                    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
                    answered += 1;
                }
                answered
            })
        })
        .collect();
    let text = std::fs::read_to_string(schemas.path().join("ctr.yaml")).expect("ctr.yaml");
    for device in ["cuda", "cpu", "cuda"] {
        let body = text.replacen("device: cpu", &format!("device: {device}"), 1);
        let r = app
            .client
            .put(format!("{}/v1/schemas/models/ctr", app.addr))
            .header("content-type", "application/yaml")
            .body(body)
            .send()
            .await
            .expect("registration sent");
        let status = r.status().as_u16();
        assert_eq!(status, 200, "{}", r.text().await.unwrap_or_default());
        let meta = app.get("/v2/models/ctr").await.json();
        assert_eq!(meta["parameters"]["device"], device, "{meta}");
        let got = scores_of(&app, 16).await;
        for (i, (w, g)) in want.iter().zip(&got).enumerate() {
            assert_eq!(w.len(), g.len());
            for (a, b) in w.iter().zip(g) {
                assert!(
                    (a - b).abs() < TOLERANCE,
                    "request {i} on {device}: cpu {a} vs {b}"
                );
            }
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut total = 0;
    for c in clients {
        total += c
            .await
            .expect("every request across the swaps was answered");
    }
    eprintln!("{total} requests answered across three registrations");
}

/// The scores of requests `0..n`, one at a time.
async fn scores_of(app: &TestApp, n: usize) -> Vec<Vec<f64>> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let r = app.predict("ctr", &request(i)).await;
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        out.push(scores(&r.json()));
    }
    out
}
