//! Bearer-token authentication (`[auth]`). Off unless a token file is named: then every route but the
//! health and readiness checks and `/metrics` needs `Authorization: Bearer <token>`, and the routes that change
//! stored rows or the registered schemas need an admin token.
//!
//! Tokens are read once, at start-up, from files of one token per line (`#` starts a comment), as a
//! secrets volume provides them; they never go into the config struct, which is logged and printed.
//! A token is compared in time independent of where it differs, against every configured token.

use std::path::Path;

use axum::http::{HeaderMap, Method, header};

use crate::config::AuthConfig;
use crate::error::ApiError;

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
#[derive(Default)]
pub struct Auth {
    clients: Vec<Box<[u8]>>,
    admins: Vec<Box<[u8]>>,
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
        let clients = read_tokens("auth.token_file", &cfg.token_file)?;
        let admins = read_tokens("auth.admin_token_file", &cfg.admin_token_file)?;
        if clients.is_empty() && admins.is_empty() {
            return Ok(None);
        }
        Ok(Some(Self { clients, admins }))
    }

    /// Whether the request's credentials suffice for `need`: a 401 when it has none or an unknown token,
    /// a 403 when a client token calls an admin route. Admin tokens are good on every route.
    pub fn check(&self, need: Need, headers: &HeaderMap) -> Result<(), ApiError> {
        if need == Need::Open {
            return Ok(());
        }
        let Some(sent) = bearer(headers) else {
            return Err(ApiError::Unauthorized {
                message: "this route needs `Authorization: Bearer <token>` (the gateway's auth.token_file holds the tokens)".to_owned(),
                invalid_token: false,
            });
        };
        let admin = any_equal(&self.admins, sent);
        if admin {
            return Ok(());
        }
        if !any_equal(&self.clients, sent) {
            return Err(ApiError::Unauthorized {
                message: "the bearer token is not one of the gateway's tokens".to_owned(),
                invalid_token: true,
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

/// The tokens in `path` (nothing when the path is empty).
fn read_tokens(key: &str, path: &Path) -> Result<Vec<Box<[u8]>>, String> {
    if path.as_os_str().is_empty() {
        return Ok(Vec::new());
    }
    let text = crate::config::read_text_file(path, 1 << 20)
        .map_err(|e| format!("{key}: cannot read {}: {e}", path.display()))?;
    let mut tokens = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let token = line.trim();
        if token.is_empty() || token.starts_with('#') {
            continue;
        }
        let at = format!("{key}: {} line {}", path.display(), i + 1);
        if !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(format!(
                "{at}: a token is one word of visible ASCII characters (no spaces)"
            ));
        }
        if !(MIN_TOKEN_BYTES..=MAX_TOKEN_BYTES).contains(&token.len()) {
            return Err(format!(
                "{at}: a token of {} characters; tokens are {MIN_TOKEN_BYTES} to {MAX_TOKEN_BYTES} (e.g. `openssl rand -hex 32`)",
                token.len()
            ));
        }
        tokens.push(token.as_bytes().into());
    }
    if tokens.is_empty() {
        return Err(format!(
            "{key}: {} holds no token (one per line; `#` starts a comment)",
            path.display()
        ));
    }
    Ok(tokens)
}

#[cfg(test)]
mod tests {
    use super::*;

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
        };
        let client = headers("Bearer client-token-0123456789");
        let admin = headers("bearer  admin-token-0123456789ab ");
        assert!(auth.check(Need::Client, &client).is_ok());
        assert!(auth.check(Need::Client, &admin).is_ok());
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
        for (text, says) in [
            ("short\n", "line 1: a token of 5 characters"),
            ("# nothing\n", "holds no token"),
            ("two words here 0123456789\n", "no spaces"),
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
