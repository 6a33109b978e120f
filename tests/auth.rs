//! Bearer tokens (`[auth]`): every route but the health checks and `/metrics` needs one, and writing rows
//! or schemas needs an admin token. A bad token file stops start-up, naming the key and the line.

mod common;

use common::{TestApp, demo_store, test_config};
use serde_json::{Value as Json, json};

const CLIENT: &str = "client-0123456789abcdef0123456789";
const ADMIN: &str = "admin-0123456789abcdef0123456789ab";

/// A request with `token` (if any) as a bearer token: (status, `WWW-Authenticate`, body as JSON).
async fn send(
    app: &TestApp,
    method: reqwest::Method,
    path: &str,
    body: Option<&Json>,
    token: Option<&str>,
) -> (u16, String, Json) {
    let mut req = app.client.request(method, format!("{}{path}", app.addr));
    if let Some(body) = body {
        req = req.json(body);
    }
    if let Some(token) = token {
        req = req.bearer_auth(token);
    }
    let resp = req.send().await.expect("send");
    let status = resp.status().as_u16();
    let challenge = resp
        .headers()
        .get("www-authenticate")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let bytes = resp.bytes().await.expect("body");
    (
        status,
        challenge,
        serde_json::from_slice(&bytes).unwrap_or(Json::Null),
    )
}

/// `user_profile:age` of `u_auth`, read with a client token: its `values` and `statuses`.
async fn age_of_u_auth(app: &TestApp) -> Json {
    let features = json!({"entities": {"user_id": ["u_auth"]}, "features": ["user_profile:age"]});
    let (_, _, body) = send(
        app,
        reqwest::Method::POST,
        "/v1/features",
        Some(&features),
        Some(CLIENT),
    )
    .await;
    body["features"]["user_profile:age"].clone()
}

async fn guarded() -> (TestApp, tempfile::TempDir) {
    guarded_with(|_| {}).await
}

async fn guarded_with(
    change: impl FnOnce(&mut hydrant::config::Config),
) -> (TestApp, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("tempdir");
    let clients = dir.path().join("clients");
    std::fs::write(&clients, format!("# product services\n{CLIENT}\n")).expect("write");
    let admins = dir.path().join("admins");
    std::fs::write(&admins, format!("{ADMIN}\n")).expect("write");
    let mut c = test_config();
    c.auth.token_file = clients;
    c.auth.admin_token_file = admins;
    change(&mut c);
    let (store, store_dir) = demo_store().await;
    (TestApp::spawn_with(c, store, Some(store_dir)).await, dir)
}

#[tokio::test]
async fn tokens_guard_every_route_but_health_and_metrics() {
    use reqwest::Method;
    let (app, _dir) = guarded().await;
    app.wait_ready().await;
    let predict = json!({"entities": {"user_id": "u_1"}, "candidates": [{"item_id": "i_1"}]});
    let path = "/v1/models/ctr/predict";

    // Load balancers and Prometheus need no token.
    for open in [
        "/v2/health/live",
        "/v2/health/ready",
        "/v2/models/ctr/ready",
        "/metrics",
    ] {
        let (status, _, _) = send(&app, Method::GET, open, None, None).await;
        assert_eq!(status, 200, "{open}");
    }
    // No token, or an unknown one: 401 with the RFC 6750 challenge, before any work is done.
    let (status, challenge, body) = send(&app, Method::POST, path, Some(&predict), None).await;
    assert_eq!(
        (status, challenge.as_str()),
        (401, "Bearer realm=\"hydrant\"")
    );
    assert_eq!(body["error"]["code"], "unauthorized", "{body}");
    let wrong = format!("{CLIENT}x");
    let (status, challenge, _) = send(&app, Method::POST, path, Some(&predict), Some(&wrong)).await;
    assert_eq!(status, 401);
    assert!(challenge.contains("error=\"invalid_token\""), "{challenge}");
    // Two Authorization headers, even of good tokens, are a malformed request (RFC 6750's
    // `invalid_request`), not a wrong token.
    let r = app
        .client
        .post(format!("{}{path}", app.addr))
        .header("authorization", format!("Bearer {CLIENT}"))
        .header("authorization", format!("Bearer {ADMIN}"))
        .json(&predict)
        .send()
        .await
        .expect("send");
    assert_eq!(r.status().as_u16(), 401);
    assert_eq!(
        r.headers()
            .get("www-authenticate")
            .and_then(|v| v.to_str().ok()),
        Some("Bearer realm=\"hydrant\", error=\"invalid_request\"")
    );
    // A client token scores; so does an admin token.
    for token in [CLIENT, ADMIN] {
        let (status, _, body) = send(&app, Method::POST, path, Some(&predict), Some(token)).await;
        assert_eq!(status, 200, "{body}");
        assert!(body["outputs"]["score"][0].is_number(), "{body}");
    }
    // Unknown routes and reads need a token too; the V2 route answers in its own error shape.
    let (status, _, _) = send(&app, Method::GET, "/v1/nothing", None, None).await;
    assert_eq!(status, 401);
    let (status, _, _) = send(&app, Method::GET, "/v1/schemas", None, Some(CLIENT)).await;
    assert_eq!(status, 200);
    let (status, _, body) = send(
        &app,
        Method::POST,
        "/v2/models/ctr/infer",
        Some(&json!({})),
        None,
    )
    .await;
    assert_eq!(status, 401);
    assert!(
        body["error"].as_str().is_some_and(|e| e.contains("Bearer")),
        "{body}"
    );

    // Writing rows or schemas needs an admin token: a client token gets 403, and nothing is written.
    let rows = json!({"rows": [{"user_id": "u_auth", "age": 41}]});
    let write = "/v1/views/user_profile/rows";
    let (status, _, body) = send(&app, Method::POST, write, Some(&rows), Some(CLIENT)).await;
    assert_eq!(status, 403, "{body}");
    assert_eq!(body["error"]["code"], "admin_token_required");
    assert_eq!(age_of_u_auth(&app).await["statuses"][0], "NOT_FOUND");
    let (status, _, body) = send(&app, Method::POST, write, Some(&rows), Some(ADMIN)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(age_of_u_auth(&app).await["values"][0], 41);
    let (status, _, _) = send(
        &app,
        Method::DELETE,
        "/v1/schemas/views/item_stats",
        None,
        Some(CLIENT),
    )
    .await;
    assert_eq!(status, 403);

    // The refusals count as rejected, not as gateway errors.
    let (_, _, stats) = send(&app, Method::GET, "/v1/stats", None, Some(CLIENT)).await;
    assert_eq!(stats["models"]["ctr"]["errors"], 0, "{stats}");
    // Three predicts (no token, a wrong one, two tokens) and one V2 infer.
    assert_eq!(stats["models"]["ctr"]["rejected"], 4, "{stats}");
}

#[tokio::test]
async fn a_bad_token_file_stops_start_up_naming_the_key_and_line() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("tokens");
    std::fs::write(&file, format!("{CLIENT}\nshort\n")).expect("write");
    let mut c = test_config();
    c.auth.token_file = file;
    let (store, store_dir) = demo_store().await;
    let e = match TestApp::try_spawn_with(c, store, Some(store_dir)).await {
        Ok(_) => panic!("a 5-character token must stop start-up"),
        Err(e) => format!("{e:#}"),
    };
    assert!(
        e.contains("auth.token_file") && e.contains("line 2") && !e.contains(CLIENT),
        "{e}"
    );
}

/// The status of `GET /v1/schemas` with `token`, if any.
async fn schemas_status(app: &TestApp, token: Option<&str>) -> u16 {
    send(app, reqwest::Method::GET, "/v1/schemas", None, token)
        .await
        .0
}

/// `GET /v1/schemas` with `token`: its status, polled until it is `want` (or 10 s have passed).
async fn status_becomes(app: &TestApp, token: &str, want: u16) -> u16 {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let status = schemas_status(app, Some(token)).await;
        if status == want || std::time::Instant::now() > deadline {
            return status;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// `hydrant_auth_reloads_total{outcome}` from `/metrics`.
async fn auth_reloads(app: &TestApp, outcome: &str) -> u64 {
    let text = String::from_utf8(app.get("/metrics").await.body).expect("metrics text");
    let prefix = format!("hydrant_auth_reloads_total{{outcome=\"{outcome}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no {prefix} in /metrics"))
}

/// (applied, refused) reloads, after 600 ms: six reads of the files at the test's 100 ms interval.
async fn reloads_after_a_while(app: &TestApp) -> (u64, u64) {
    tokio::time::sleep(std::time::Duration::from_millis(600)).await;
    (
        auth_reloads(app, "applied").await,
        auth_reloads(app, "refused").await,
    )
}

/// `auth_reloads(app, "refused")`, polled until it reaches `n` (or 10 s have passed).
async fn refusals_reach(app: &TestApp, n: u64) -> u64 {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let refused = auth_reloads(app, "refused").await;
        if refused >= n || std::time::Instant::now() > deadline {
            return refused;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// Tokens rotate without a restart: a token file replaced (as a secrets volume replaces it) is read
/// within `auth.reload_interval`, the new token is good and the old one is not. A replacement that
/// fails the start-up checks keeps the tokens in force, and both are counted.
#[tokio::test]
async fn token_files_are_read_again_and_a_bad_change_keeps_the_tokens_in_force() {
    let (app, dir) = guarded_with(|c| {
        c.auth.reload_interval = std::time::Duration::from_millis(100);
    })
    .await;
    app.wait_ready().await;
    let replace = |text: String| {
        let tmp = dir.path().join("clients.new");
        std::fs::write(&tmp, text).expect("write");
        std::fs::rename(&tmp, dir.path().join("clients")).expect("rename");
    };
    assert_eq!(status_becomes(&app, CLIENT, 200).await, 200);
    const ROTATED: &str = "rotated-0123456789abcdef01234567";
    replace(format!("{ROTATED}\n"));
    assert_eq!(
        status_becomes(&app, ROTATED, 200).await,
        200,
        "the new token"
    );
    assert_eq!(
        status_becomes(&app, CLIENT, 401).await,
        401,
        "the old token"
    );
    assert_eq!(
        status_becomes(&app, ADMIN, 200).await,
        200,
        "admins unchanged"
    );
    assert_eq!(auth_reloads(&app, "applied").await, 1);

    // A line the start-up check refuses: the rotated token stays good, the old one stays refused.
    replace(format!("{CLIENT}\nshort\n"));
    assert_eq!(refusals_reach(&app, 1).await, 1);
    assert_eq!(schemas_status(&app, Some(ROTATED)).await, 200);
    assert_eq!(schemas_status(&app, Some(CLIENT)).await, 401);
    // A file deleted is refused the same way: authentication is never turned off by a reload.
    std::fs::remove_file(dir.path().join("clients")).expect("remove");
    assert_eq!(refusals_reach(&app, 2).await, 2);
    assert_eq!(schemas_status(&app, None).await, 401);
    assert_eq!(schemas_status(&app, Some(ROTATED)).await, 200);
    assert_eq!(auth_reloads(&app, "applied").await, 1);
    // The file in force put back undoes the refusal: nothing new is put in force or refused. A real
    // change after it still counts.
    replace(format!("{ROTATED}\n"));
    assert_eq!(
        reloads_after_a_while(&app).await,
        (1, 2),
        "the tokens in force again are not a change"
    );
    assert_eq!(schemas_status(&app, Some(ROTATED)).await, 200);
    replace(format!("{CLIENT}\n"));
    assert_eq!(status_becomes(&app, CLIENT, 200).await, 200);
    assert_eq!(auth_reloads(&app, "applied").await, 2);
    // Comments added and the token listed twice: the same tokens, so nothing is applied or refused.
    replace(format!("# billing\n{CLIENT}  # since 2026-11\n{CLIENT}\n"));
    assert_eq!(
        reloads_after_a_while(&app).await,
        (2, 2),
        "a change of comments is not a change of tokens"
    );
    assert_eq!(schemas_status(&app, Some(CLIENT)).await, 200);
    replace(format!("{ROTATED}  # rotated back\n"));
    assert_eq!(status_becomes(&app, ROTATED, 200).await, 200);
    assert_eq!(auth_reloads(&app, "applied").await, 3);
}
