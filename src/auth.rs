//! Bearer-token authentication (`[auth]`). Off unless a token file is named: then every route but the
//! health and readiness checks and `/metrics` needs `Authorization: Bearer <token>`, and the routes that change
//! stored rows or the registered schemas need an admin token.
//!
//! Tokens are read at start-up from files of one token per line (`#` starts a comment), as a secrets
//! volume provides them; they never go into the config struct, which is logged and printed. The files
//! are read again every `auth.reload_interval` ([`watch_files`]): a change that holds still for two
//! reads and is valid replaces the tokens in force, so tokens rotate without a restart; one that is
//! not keeps the tokens in force and is logged once. A token is compared in time independent of where
//! it differs, against every configured token.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use arc_swap::ArcSwap;
use axum::http::{HeaderMap, Method, header};

use crate::config::AuthConfig;
use crate::error::{ApiError, BearerError};
use crate::telemetry::Telemetry;

/// The tokens in force, swapped whole by [`watch_files`].
pub type Tokens = Arc<ArcSwap<Auth>>;

/// Shortest and longest token: shorter ones are guessable, longer ones are a pasted file.
pub const MIN_TOKEN_BYTES: usize = 16;
pub const MAX_TOKEN_BYTES: usize = 256;

/// What a request needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// Health and readiness checks and `/metrics`: load balancers, kubelets and Prometheus call them
    /// without credentials.
    Open,
    /// Scoring, features, prefetch, stats, schema reads and dry runs.
    Client,
    /// Writing rows, and registering, deleting or rolling back schemas.
    Admin,
}

/// What `method` on `route` (a request layer route label) at `path` needs.
pub fn need(route: &str, path: &str, method: &Method) -> Need {
    // Probes and scrapers: kubelets and KServe poll the readiness routes, Prometheus `/metrics`.
    if matches!(path, "/v2/health/live" | "/v2/health/ready" | "/metrics")
        || route == "/v2/models/{model}/ready"
        || route == crate::api::VERSIONED_READY
    {
        return Need::Open;
    }
    let admin = match route {
        "/v1/views/{view}/rows" | "/v1/schemas/{kind}/{name}/rollback" | "/v1/schemas" => {
            method == Method::POST
        }
        "/v1/schemas/{kind}/{name}" => method == Method::PUT || method == Method::DELETE,
        _ => false,
    };
    if admin { Need::Admin } else { Need::Client }
}

/// The configured tokens.
pub struct Auth {
    clients: Vec<Box<[u8]>>,
    admins: Vec<Box<[u8]>>,
    /// What the files held when these tokens were read from them: [`watch_files`] compares with it.
    source: Texts,
}

impl Auth {
    /// Whether `other` holds the same client and admin tokens, in any order.
    fn same_tokens(&self, other: &Auth) -> bool {
        // Each list holds a token once (`parse_tokens`).
        let same = |a: &[Box<[u8]>], b: &[Box<[u8]>]| {
            let b: std::collections::HashSet<&[u8]> = b.iter().map(|t| &**t).collect();
            a.len() == b.len() && a.iter().all(|t| b.contains(&**t))
        };
        same(&self.clients, &other.clients) && same(&self.admins, &other.admins)
    }
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the tokens themselves.
        write!(
            f,
            "Auth {{ {} client token(s), {} admin token(s) }}",
            self.clients.len(),
            self.admins.len()
        )
    }
}

impl Auth {
    /// The tokens of `cfg`, or `None` when no token file is named (authentication off). An error names
    /// the config key, the file and the line.
    pub fn load(cfg: &AuthConfig) -> Result<Option<Self>, String> {
        Self::from_texts(cfg, &Texts::read(cfg))
    }

    /// The tokens of the files' `texts`, as [`Auth::load`] reads them.
    fn from_texts(cfg: &AuthConfig, texts: &Texts) -> Result<Option<Self>, String> {
        let clients = parse_tokens(TOKEN_FILE, &cfg.token_file, &texts.clients)?;
        let admins = parse_tokens(ADMIN_TOKEN_FILE, &cfg.admin_token_file, &texts.admins)?;
        if clients.is_empty() && admins.is_empty() {
            return Ok(None);
        }
        Ok(Some(Self {
            clients,
            admins,
            source: texts.clone(),
        }))
    }

    /// Whether the request's credentials suffice for `need`: a 401 when it has none or an unknown token,
    /// a 403 when a client token calls an admin route. Admin tokens are good on every route.
    pub fn check(&self, need: Need, headers: &HeaderMap) -> Result<(), ApiError> {
        if need == Need::Open {
            return Ok(());
        }
        if headers
            .get_all(header::AUTHORIZATION)
            .iter()
            .nth(1)
            .is_some()
        {
            // Which one would count is anybody's guess (a proxy may have added one): neither does.
            return Err(ApiError::Unauthorized {
                message: "the request carries more than one Authorization header: send one"
                    .to_owned(),
                bearer: BearerError::InvalidRequest,
            });
        }
        let Some(sent) = bearer(headers) else {
            return Err(ApiError::Unauthorized {
                message: "this route needs `Authorization: Bearer <token>` (a token of the gateway's auth.token_file or auth.admin_token_file)".to_owned(),
                bearer: BearerError::Missing,
            });
        };
        let admin = any_equal(&self.admins, sent);
        if admin {
            return Ok(());
        }
        if !any_equal(&self.clients, sent) {
            return Err(ApiError::Unauthorized {
                message: "the bearer token is not one of the gateway's tokens".to_owned(),
                bearer: BearerError::InvalidToken,
            });
        }
        if need == Need::Admin {
            return Err(ApiError::Forbidden {
                code: "admin_token_required",
                message: if self.admins.is_empty() {
                    "writing rows or schemas needs an admin token, and none is configured (auth.admin_token_file)".to_owned()
                } else {
                    "writing rows or schemas needs an admin token (one of auth.admin_token_file); this one is a client token".to_owned()
                },
            });
        }
        Ok(())
    }
}

/// The token of an `Authorization: Bearer <token>` header (the scheme in any case), if there is one.
fn bearer(headers: &HeaderMap) -> Option<&[u8]> {
    let value = headers.get(header::AUTHORIZATION)?.as_bytes();
    let (scheme, rest) = value.split_at_checked(7)?;
    if !scheme.eq_ignore_ascii_case(b"bearer ") {
        return None;
    }
    let token = rest.trim_ascii();
    (!token.is_empty()).then_some(token)
}

/// Whether `sent` equals one of `tokens`, comparing every one of them in full: the time taken does not
/// say which one matched, nor how much of a wrong token was right.
fn any_equal(tokens: &[Box<[u8]>], sent: &[u8]) -> bool {
    let mut found = false;
    for t in tokens {
        let same =
            t.len() == sent.len() && t.iter().zip(sent).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0;
        found |= std::hint::black_box(same);
    }
    found
}

const TOKEN_FILE: &str = "auth.token_file";
const ADMIN_TOKEN_FILE: &str = "auth.admin_token_file";

/// What the two token files held when read: their text, or why they could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Texts {
    clients: Result<String, String>,
    admins: Result<String, String>,
}

impl Texts {
    fn read(cfg: &AuthConfig) -> Self {
        Self {
            clients: read_text(TOKEN_FILE, &cfg.token_file),
            admins: read_text(ADMIN_TOKEN_FILE, &cfg.admin_token_file),
        }
    }
}

/// The text of `path` (empty when the path is empty: that file is not used).
fn read_text(key: &str, path: &Path) -> Result<String, String> {
    if path.as_os_str().is_empty() {
        return Ok(String::new());
    }
    crate::config::read_text_file(path, 1 << 20)
        .map_err(|e| format!("{key}: cannot read {}: {e}", path.display()))
}

/// The tokens of `text`, read from `path` (nothing when the path is empty).
fn parse_tokens(
    key: &str,
    path: &Path,
    text: &Result<String, String>,
) -> Result<Vec<Box<[u8]>>, String> {
    if path.as_os_str().is_empty() {
        return Ok(Vec::new());
    }
    let text = text.as_ref().map_err(Clone::clone)?;
    let mut tokens: Vec<Box<[u8]>> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        // A comment may follow the token after a space: `TOKEN  # the billing service`.
        let (token, rest) = line.split_once(char::is_whitespace).unwrap_or((line, ""));
        let rest = rest.trim_start();
        let at = format!("{key}: {} line {}", path.display(), i + 1);
        if !(rest.is_empty() || rest.starts_with('#'))
            || !token.bytes().all(|b| b.is_ascii_graphic())
        {
            return Err(format!(
                "{at}: a token is one word of visible ASCII characters (no spaces; a `#` after a space starts a comment)"
            ));
        }
        if !(MIN_TOKEN_BYTES..=MAX_TOKEN_BYTES).contains(&token.len()) {
            return Err(format!(
                "{at}: a token of {} characters; tokens are {MIN_TOKEN_BYTES} to {MAX_TOKEN_BYTES} (e.g. `openssl rand -hex 32`)",
                token.len()
            ));
        }
        // Listed twice (the old line kept beside a pasted new one) is one token.
        if seen.insert(token) {
            tokens.push(token.as_bytes().into());
        }
    }
    if tokens.is_empty() {
        return Err(format!(
            "{key}: {} holds no token (one per line; `#` starts a comment)",
            path.display()
        ));
    }
    Ok(tokens)
}

/// Reads the token files every `auth.reload_interval` (never when it is 0) and swaps in the tokens
/// of a change once the files have held still for one more read (a file being written is not taken
/// half written, which would lock out the callers of a token cut short). A change that cannot be
/// read, or that fails the start-up checks (a file emptied, deleted, or with a bad line), leaves
/// the tokens in force and is logged once, naming the key, the file and the line; with
/// `hydrant_auth_reloads_total{outcome}` counting both. Runs until aborted.
pub async fn watch_files(cfg: AuthConfig, tokens: Tokens, telemetry: Arc<Telemetry>) {
    let stats = &telemetry.auth_reloads;
    let interval = cfg.reload_interval;
    if interval.is_zero() {
        return;
    }
    let cfg = Arc::new(cfg);
    let read = |cfg: Arc<AuthConfig>| async move {
        tokio::task::spawn_blocking(move || Texts::read(&cfg))
            .await
            .ok()
    };
    // What the tokens in force were read from, and what was last acted on (they differ after a refusal).
    let mut in_force = tokens.load().source.clone();
    let mut acted = in_force.clone();
    let mut pending: Option<Texts> = None;
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let Some(now) = read(cfg.clone()).await else {
            continue;
        };
        if now == acted {
            pending = None;
            continue;
        }
        if pending.as_ref() != Some(&now) {
            pending = Some(now);
            continue;
        }
        pending = None;
        // A refused change undone: the files hold the tokens in force again, and nothing changes (as
        // the schemas folder's watch does not count going back to the running registry).
        if now == in_force {
            tracing::info!("auth: the token files hold the tokens in force again");
            acted = now;
            continue;
        }
        // No tokens at all would turn authentication off, which a reload never does (a named file
        // must hold a token, so this is refused before).
        let changed = Auth::from_texts(&cfg, &now)
            .and_then(|auth| auth.ok_or_else(|| "the token files hold no token".to_owned()));
        match changed {
            // Only comments or the order of lines changed: the same tokens, nothing to apply.
            Ok(auth) if tokens.load().same_tokens(&auth) => {
                if acted == in_force {
                    tracing::debug!("auth: the token files changed, but not their tokens");
                } else {
                    tracing::info!("auth: the token files hold the tokens in force again");
                }
                in_force = now.clone();
            }
            Ok(auth) => {
                tracing::info!("auth: the token files changed; now in force: {auth:?}");
                tokens.store(Arc::new(auth));
                stats.applied.fetch_add(1, Relaxed);
                in_force = now.clone();
            }
            Err(e) => {
                tracing::error!(
                    "auth: the token files changed and are refused ({e}); the tokens in force stay"
                );
                stats.refused.fetch_add(1, Relaxed);
            }
        }
        acted = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tokens in `path` (nothing when the path is empty), as start-up reads them.
    fn read_tokens(key: &str, path: &Path) -> Result<Vec<Box<[u8]>>, String> {
        parse_tokens(key, path, &read_text(key, path))
    }

    fn headers(value: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Ok(v) = value.parse() {
            h.insert(header::AUTHORIZATION, v);
        }
        h
    }

    #[test]
    fn tokens_are_checked_by_route_and_kind() {
        let auth = Auth {
            clients: vec![b"client-token-0123456789".as_slice().into()],
            admins: vec![b"admin-token-0123456789ab".as_slice().into()],
            source: Texts {
                clients: Ok(String::new()),
                admins: Ok(String::new()),
            },
        };
        let client = headers("Bearer client-token-0123456789");
        let admin = headers("bearer  admin-token-0123456789ab ");
        assert!(auth.check(Need::Client, &client).is_ok());
        assert!(auth.check(Need::Client, &admin).is_ok());
        // Two headers, whichever comes first: neither counts.
        for second in ["Bearer wrong-token", "Bearer client-token-0123456789"] {
            let mut twice = admin.clone();
            twice.append(
                header::AUTHORIZATION,
                second.parse().expect("a header value"),
            );
            let e = auth.check(Need::Client, &twice).expect_err("two headers");
            assert_eq!(e.status().as_u16(), 401, "{second}");
            assert!(e.to_string().contains("more than one"), "{e}");
        }
        assert!(auth.check(Need::Admin, &admin).is_ok());
        let e = auth
            .check(Need::Admin, &client)
            .expect_err("client on admin");
        assert_eq!(
            (e.status().as_u16(), e.code()),
            (403, "admin_token_required")
        );
        for h in [
            HeaderMap::new(),
            headers("Basic client-token-0123456789"),
            headers("Bearer client-token-012345678"),
            headers("Bearer client-token-01234567890"),
            headers("Bearer "),
        ] {
            let e = auth.check(Need::Client, &h).expect_err("refused");
            assert_eq!((e.status().as_u16(), e.code()), (401, "unauthorized"));
        }
        assert!(auth.check(Need::Open, &HeaderMap::new()).is_ok());
        assert!(!format!("{auth:?}").contains("token-0123"));
    }

    #[test]
    fn routes_need_what_they_change() {
        let n = |route, path, m: Method| need(route, path, &m);
        assert_eq!(n("other", "/v2/health/ready", Method::GET), Need::Open);
        assert_eq!(n("/metrics", "/metrics", Method::GET), Need::Open);
        assert_eq!(
            n(
                "/v2/models/{model}/ready",
                "/v2/models/ctr/ready",
                Method::GET
            ),
            Need::Open
        );
        assert_eq!(
            n("/v2/models/{model}", "/v2/models/ctr", Method::GET),
            Need::Client
        );
        assert_eq!(
            n(
                "/v1/models/{model}/predict",
                "/v1/models/ctr/predict",
                Method::POST
            ),
            Need::Client
        );
        assert_eq!(n("/v1/schemas", "/v1/schemas", Method::GET), Need::Client);
        assert_eq!(n("/v1/schemas", "/v1/schemas", Method::POST), Need::Admin);
        assert_eq!(
            n(
                "/v1/schemas/{kind}/{name}",
                "/v1/schemas/views/v",
                Method::DELETE
            ),
            Need::Admin
        );
        assert_eq!(
            n("/v1/views/{view}/rows", "/v1/views/v/rows", Method::POST),
            Need::Admin
        );
        assert_eq!(
            n("/v1/schemas:validate", "/v1/schemas:validate", Method::POST),
            Need::Client
        );
        assert_eq!(n("unmatched", "/nothing", Method::GET), Need::Client);
    }

    #[test]
    fn token_files_are_checked_line_by_line() {
        let dir = tempfile::tempdir().expect("tempdir");
        let write = |text: &str| {
            let p = dir.path().join("tokens");
            std::fs::write(&p, text).expect("write");
            p
        };
        let p = write("# ops\n\n  0123456789abcdef0123  \n");
        let tokens = read_tokens("auth.token_file", &p).expect("one token");
        assert_eq!(tokens.len(), 1);
        // A comment after the token, and the same token twice, read as that one token.
        let p = write("0123456789abcdef0123\t# billing\n0123456789abcdef0123 #again\n");
        let again = read_tokens("auth.token_file", &p).expect("one token");
        assert_eq!(again, tokens);
        for (text, says) in [
            ("short\n", "line 1: a token of 5 characters"),
            ("# nothing\n", "holds no token"),
            ("two words here 0123456789\n", "no spaces"),
            (
                "0123456789abcdef0123 billing\n",
                "a `#` after a space starts a comment",
            ),
        ] {
            let e = read_tokens("auth.token_file", &write(text)).expect_err(text);
            assert!(
                e.starts_with("auth.token_file: ") && e.contains(says),
                "{e}"
            );
        }
        let e =
            read_tokens("auth.admin_token_file", &dir.path().join("missing")).expect_err("missing");
        assert!(e.contains("cannot read"), "{e}");
        assert!(
            read_tokens("auth.token_file", Path::new(""))
                .expect("off")
                .is_empty()
        );
    }
}
