//! Typed configuration: `config/hydrant.toml` overlaid by `HYDRANT_SECTION__KEY` environment variables.
//!
//! Every key has a default, unknown keys are rejected, and a bad value stops start-up with the file, the key
//! and the reason. Environment overrides are parsed as TOML values when they look like one (`8`, `true`,
//! `[1, 2]`) and as strings otherwise, so `HYDRANT_SERVER__BIND=0.0.0.0:9000` needs no quoting; a key that
//! takes a string gets the variable's text as written (`HYDRANT_STORE__PREFIX=2024` is the prefix `2024`).
//!
//! Sizes, counts and durations have upper bounds as well as lower ones: far above what a deployment needs,
//! and low enough that a typo (a few extra zeros) is refused at start-up instead of exhausting memory or
//! threads, or overflowing a clock, later.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

/// The environment variable prefix for overrides, e.g. `HYDRANT_STORE__REDIS__URL`.
pub const ENV_PREFIX: &str = "HYDRANT_";

/// Most sessions in one model's pool (`inference.default_sessions`, a model's `sessions`).
pub const MAX_SESSIONS: usize = 256;
/// Most async worker threads (`server.workers`).
pub const MAX_WORKERS: usize = 1024;
/// Most ONNX Runtime intra-op threads per session (`inference.intra_threads`).
pub const MAX_INTRA_THREADS: usize = 256;
/// Most threads one model's pool may run: sessions × intra-op threads. Each session is a thread of its own,
/// and ONNX Runtime starts `intra_threads - 1` more for it.
pub const MAX_MODEL_THREADS: usize = 1024;
/// Most queued requests per model (`inference.max_queue`). The queue's slots are allocated when the model
/// loads, about 130 bytes each.
pub const MAX_QUEUE: usize = 100_000;
/// Longest config duration (timeouts, delays, intervals): longer ones are a mistake, not a setting.
pub const MAX_CONFIG_DURATION: Duration = Duration::from_secs(86_400);
/// The `store.redis.url` schemes the Redis client is built for.
pub const REDIS_SCHEMES: [&str; 6] = [
    "redis",
    "rediss",
    "redis-cluster",
    "rediss-cluster",
    "redis-sentinel",
    "rediss-sentinel",
];
/// The level names `telemetry.log_level` accepts, alone or as `target=level`.
pub const LOG_LEVELS: [&str; 6] = ["error", "warn", "info", "debug", "trace", "off"];

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub server: ServerConfig,
    pub store: StoreConfig,
    pub registry: RegistryConfig,
    pub limits: LimitsConfig,
    pub cache: CacheConfig,
    pub prefetch: PrefetchConfig,
    pub inference: InferenceConfig,
    pub telemetry: TelemetryConfig,
    pub auth: AuthConfig,
}

/// Bearer tokens ([`crate::auth`]): off while both paths are empty.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// A file of client tokens, one per line: scoring, features, prefetch, stats, schema reads.
    pub token_file: PathBuf,
    /// A file of admin tokens: all of that, and writing rows and registering schemas.
    pub admin_token_file: PathBuf,
    /// How often the token files are read again, so tokens rotate without a restart. `0s`: never.
    #[serde(with = "duration")]
    pub reload_interval: Duration,
}

impl Default for AuthConfig {
    fn default() -> Self {
        Self {
            token_file: PathBuf::new(),
            admin_token_file: PathBuf::new(),
            reload_interval: Duration::from_secs(10),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Address the HTTP API listens on; port 0 picks a free port.
    #[serde(deserialize_with = "socket_addr")]
    pub bind: SocketAddr,
    /// How long in-flight requests get to finish after SIGINT/SIGTERM.
    #[serde(with = "duration")]
    pub shutdown_grace: Duration,
    /// A client connection that starts no request for this long is closed: an idle keep-alive connection,
    /// or one sending a request's head too slowly (slowloris). Keep it above a load balancer's idle
    /// timeout, so that the balancer closes first.
    #[serde(with = "duration")]
    pub idle_timeout: Duration,
    /// Client connections open at once; more wait in the accept queue until one closes. Kept below the
    /// process's open-files limit at start-up.
    pub max_connections: usize,
    /// Async worker threads, which read requests, hydrate, assemble and answer (the models' sessions run
    /// on threads of their own); 0 means one per core.
    pub workers: usize,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreConfig {
    /// Key prefix: records live at `{prefix}:{view}:{entity_key}`.
    pub prefix: String,
    pub embedded: EmbeddedConfig,
    pub redis: RedisConfig,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EmbeddedConfig {
    /// The file the embedded store keeps its records in; used when no Redis URL is set.
    pub path: PathBuf,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RedisConfig {
    /// `redis://[user:pass@]host:port[/db]`, `rediss://` (TLS), `redis-cluster://host:port?node=host:port`
    /// (`rediss-cluster://` with TLS); empty means the embedded store.
    pub url: String,
    /// Connections, used round-robin.
    pub pool_size: usize,
    /// How long start-up waits for the first connection (and each reconnection attempt may take).
    #[serde(with = "duration")]
    pub connect_timeout: Duration,
    /// The longest a read may take at the client. Reads also stop at the view's `store.timeout` and the
    /// request's deadline, whichever comes first.
    #[serde(with = "duration")]
    pub command_timeout: Duration,
    /// The longest a batch write (loader, `POST /v1/views/{view}/rows`) may take.
    #[serde(with = "duration")]
    pub write_timeout: Duration,
    /// Reconnection backoff: the first retry waits `reconnect_min_delay`, each next one twice as long, up to
    /// `reconnect_max_delay`; retries never stop.
    #[serde(with = "duration")]
    pub reconnect_min_delay: Duration,
    #[serde(with = "duration")]
    pub reconnect_max_delay: Duration,
    /// Commands queued in the client beyond this (Redis slow or reconnecting) fail at once instead of
    /// queueing without bound.
    pub max_command_buffer: usize,
    /// PEM file of the CA(s) that signed the server's certificate, for `rediss://` with a private CA; empty
    /// means the system's trusted roots.
    pub tls_ca_file: PathBuf,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RegistryConfig {
    /// Folder of `*.yaml` schema files (entities, views, models).
    pub schemas: PathBuf,
    /// Folder the models' `file:` paths are relative to.
    pub models: PathBuf,
    /// Whether `PUT`, `POST` and `DELETE` under `/v1/schemas` may register changes (into the schemas
    /// folder, which must then be writable). Off by default: any client of the port could change what
    /// is served.
    pub writes: bool,
    /// How often the schemas folder is read for changes made beside this process (a person, a
    /// deploy, another replica sharing the folder); a change is checked and swapped in as a
    /// registration is. `0s`: never (a change on disk then waits for a restart).
    #[serde(with = "duration")]
    pub reload_interval: Duration,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    /// Largest request body accepted; larger ones get 413.
    pub max_body_bytes: usize,
    /// Most candidates one predict request may carry; more get 413.
    pub max_candidates: usize,
    /// Most entity keys one `/v1/features`, `/get-online-features` or `/v1/prefetch` request may carry.
    pub max_entities: usize,
    /// Longest entity key, in bytes.
    pub max_key_bytes: usize,
    /// Each request's deadline (`options.deadline_ms` can only shorten it); a backstop answers a request
    /// still running 250 ms past it: 408 while its body is still arriving, 503 after (except a schema
    /// registration that has begun writing its files: it is let finish, and answered with its result).
    #[serde(with = "duration")]
    pub request_timeout: Duration,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CacheConfig {
    /// Memory budget of the feature cache, in bytes, across all views (entries are weighed by size).
    pub max_bytes: u64,
}

/// Warming the cache ahead of requests: `POST /v1/prefetch`, hot-key sampling and the warm start.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PrefetchConfig {
    /// Prefetch batches fetched at once; a `POST /v1/prefetch` beyond this gets 429 with `Retry-After`.
    pub max_concurrent: usize,
    /// How many of each view's hottest keys a starting replica loads before it reports ready (0: none).
    pub warm_top_k: usize,
    /// The longest the warm start may hold readiness back; the replica turns ready when it is over.
    #[serde(with = "duration")]
    pub warm_timeout: Duration,
    /// One lookup in this many records its key in the view's hot set (`{prefix}:hot:{view}`); 0 disables.
    pub hot_sample_every: u64,
    /// How often sampled keys are written to the hot sets (one pipelined round trip).
    #[serde(with = "duration")]
    pub hot_flush_interval: Duration,
    /// Keys kept per hot set; the coldest are trimmed on each flush.
    pub hot_keep: usize,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct InferenceConfig {
    /// Path of `libonnxruntime.so`; `ORT_DYLIB_PATH` wins when set.
    pub onnxruntime_library: PathBuf,
    /// ONNX Runtime intra-op threads per session. Sessions × threads should not exceed the cores.
    pub intra_threads: usize,
    /// Default session pool size for models that do not set `sessions`; 0 means cores / `intra_threads`.
    pub default_sessions: usize,
    /// Most queued requests per model before new ones are shed with 503.
    pub max_queue: usize,
    /// A request that waited longer than this for a session is shed with 503 instead of run.
    #[serde(with = "duration")]
    pub queue_timeout: Duration,
    /// Micro-batch the rows of concurrent requests (`false`: every request runs alone, for comparison).
    pub batching: bool,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    /// `tracing` filter directive, e.g. `info` or `hydrant=debug,info`.
    pub log_level: String,
    /// `text` or `json`.
    pub log_format: LogFormat,
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            bind: SocketAddr::from(([127, 0, 0, 1], 8080)),
            shutdown_grace: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(75),
            max_connections: 10_000,
            workers: 0,
        }
    }
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            prefix: "hy".to_owned(),
            embedded: EmbeddedConfig::default(),
            redis: RedisConfig::default(),
        }
    }
}

impl Default for EmbeddedConfig {
    fn default() -> Self {
        Self {
            path: PathBuf::from("data/hydrant.redb"),
        }
    }
}

impl Default for RedisConfig {
    fn default() -> Self {
        Self {
            url: String::new(),
            pool_size: 4,
            connect_timeout: Duration::from_secs(2),
            command_timeout: Duration::from_millis(50),
            write_timeout: Duration::from_secs(5),
            reconnect_min_delay: Duration::from_millis(20),
            reconnect_max_delay: Duration::from_secs(1),
            max_command_buffer: 10_000,
            tls_ca_file: PathBuf::new(),
        }
    }
}

impl Default for PrefetchConfig {
    fn default() -> Self {
        Self {
            max_concurrent: 8,
            warm_top_k: 1000,
            warm_timeout: Duration::from_secs(5),
            hot_sample_every: 32,
            hot_flush_interval: Duration::from_secs(1),
            hot_keep: 10_000,
        }
    }
}

impl Default for RegistryConfig {
    fn default() -> Self {
        Self {
            schemas: PathBuf::from("schemas"),
            models: PathBuf::from("models"),
            writes: false,
            reload_interval: Duration::ZERO,
        }
    }
}

impl Default for LimitsConfig {
    fn default() -> Self {
        Self {
            max_body_bytes: 1 << 20,
            max_candidates: 1000,
            max_entities: 1000,
            max_key_bytes: 256,
            request_timeout: Duration::from_secs(2),
        }
    }
}

impl Default for CacheConfig {
    fn default() -> Self {
        Self {
            max_bytes: 512 << 20,
        }
    }
}

impl Default for InferenceConfig {
    fn default() -> Self {
        Self {
            onnxruntime_library: PathBuf::from(".ort/lib/libonnxruntime.so.1.31.1"),
            intra_threads: 1,
            default_sessions: 0,
            max_queue: 1024,
            queue_timeout: Duration::from_millis(500),
            batching: true,
        }
    }
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        Self {
            log_level: "info".to_owned(),
            log_format: LogFormat::Text,
        }
    }
}

/// A configuration that cannot be used, with where and why.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// `cause` is in the message and deliberately not a `#[source]`: a report that prints the cause chain
    /// would print it twice.
    #[error("cannot read config file {}: {cause}", path.display())]
    Read {
        path: PathBuf,
        cause: std::io::Error,
    },
    #[error("config file {} is not valid TOML: line {line}, column {column}{}: {message}", path.display(), key.as_ref().map_or(String::new(), |k| format!(" (key `{k}`)")))]
    Syntax {
        path: PathBuf,
        line: usize,
        column: usize,
        /// The key whose value the error is in, where its line says (`cache.max_bytes`).
        key: Option<String>,
        message: String,
    },
    #[error("environment variable {var}: {reason}")]
    Env { var: String, reason: String },
    #[error("{origin}: key `{key}`: {reason}")]
    Invalid {
        origin: String,
        key: String,
        reason: String,
    },
}

/// The TOML reader's words, except for an integer past 64 bits, which it reports as a type it reads
/// internally ("invalid type: integer 99999999999999999999 as i128, expected any valid TOML value", or
/// "u64 value was too large").
fn toml_message(message: &str) -> String {
    const TOO_LARGE: &str =
        "too large for a number (TOML integers are 64-bit, at most 9223372036854775807)";
    let message = message.trim_end();
    if let Some(rest) = message.strip_prefix("invalid type: integer ")
        && let Some((number, _)) = rest.split_once(" as i128")
    {
        let number = number.trim_matches('`');
        return format!("{number} is out of range: {TOO_LARGE}");
    }
    if message.ends_with("value was too large") {
        return format!("the number is out of range: {TOO_LARGE}");
    }
    message.to_owned()
}

/// Reads a text file a person points hydrant at (config, schema): a regular file of at most `max_bytes`,
/// UTF-8, with a leading byte-order mark dropped. A FIFO or device would hang or never end, so it is
/// refused up front.
pub fn read_text_file(path: &Path, max_bytes: u64) -> std::io::Result<String> {
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        return Err(std::io::Error::other(
            "not a regular file (a folder, FIFO or device)",
        ));
    }
    if meta.len() > max_bytes {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "{} bytes, more than the {max_bytes} a file of this kind may have",
                meta.len()
            ),
        ));
    }
    let text = std::fs::read_to_string(path)?;
    Ok(match text.strip_prefix('\u{feff}') {
        Some(rest) => rest.to_owned(),
        None => text,
    })
}

impl Config {
    /// The process environment for [`Config::load`]. A variable that is not UTF-8 is skipped, unless it
    /// is one of ours, which is an error naming it (`std::env::vars` would panic on any of them).
    pub fn environment() -> Result<Vec<(String, String)>, ConfigError> {
        let mut out = Vec::new();
        for (var, value) in std::env::vars_os() {
            match (var.to_str(), value.into_string()) {
                (Some(name), Ok(value)) => out.push((name.to_owned(), value)),
                _ => {
                    let name = var.to_string_lossy();
                    if has_env_prefix(&name) {
                        return Err(ConfigError::Env {
                            var: name.into_owned(),
                            reason: "is not valid UTF-8".to_owned(),
                        });
                    }
                }
            }
        }
        Ok(out)
    }

    /// Loads `path` (when given) and applies `HYDRANT_*` overrides from `env`.
    pub fn load(
        path: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ConfigError> {
        let mut table = match path {
            Some(path) => {
                let text = read_text_file(path, 1 << 20).map_err(|cause| ConfigError::Read {
                    path: path.to_owned(),
                    cause,
                })?;
                text.parse::<toml::Table>().map_err(|e| {
                    let at = e.span().map_or(0, |s| s.start);
                    let (line, column) = line_and_column(&text, at);
                    ConfigError::Syntax {
                        path: path.to_owned(),
                        line,
                        column,
                        key: key_at(&text, at),
                        message: match e.message().trim_end() {
                            "duplicate key" => given_twice(&text, at),
                            other => toml_message(other),
                        },
                    }
                })?
            }
            None => toml::Table::new(),
        };
        if let (Some(path), Err((key, reason))) = (path, check_sections(&table)) {
            return Err(ConfigError::Invalid {
                origin: path.display().to_string(),
                key,
                reason,
            });
        }
        let mut overrides: Vec<EnvOverride> = Vec::new();
        for (var, value) in env {
            let Some(rest) = var.strip_prefix(ENV_PREFIX) else {
                // Variable names are case-sensitive: `hydrant_server__bind` would be ignored in silence.
                if has_env_prefix(&var) {
                    return Err(ConfigError::Env {
                        var,
                        reason: format!("is not read: the prefix is {ENV_PREFIX} in capitals"),
                    });
                }
                continue;
            };
            let keys: Vec<String> = rest.split("__").map(str::to_ascii_lowercase).collect();
            if keys.iter().any(String::is_empty) {
                return Err(ConfigError::Env {
                    var,
                    reason:
                        "expected HYDRANT_SECTION__KEY (sections separated by a double underscore)"
                            .to_owned(),
                });
            }
            let key = keys.join(".");
            // Keys are case-insensitive, so two spellings of one variable would race (the environment's
            // order decides): refuse rather than pick.
            if let Some(other) = overrides.iter().find(|o| o.key == key) {
                return Err(ConfigError::Env {
                    var,
                    reason: format!(
                        "sets `{key}` again, as {} does: keep one of them",
                        other.var
                    ),
                });
            }
            let parsed = parse_env_value(&value);
            let typed = !parsed.is_str();
            set_path(&mut table, &keys, parsed).map_err(|reason| ConfigError::Env {
                var: var.clone(),
                reason,
            })?;
            overrides.push(EnvOverride {
                key,
                keys,
                var,
                raw: value,
                typed,
            });
        }
        let origin = match path {
            Some(p) if overrides.is_empty() => p.display().to_string(),
            Some(p) => format!(
                "{} (with env overrides of {})",
                p.display(),
                known_keys(&overrides)
            ),
            None if overrides.is_empty() => "defaults".to_owned(),
            None => format!("env overrides of {}", known_keys(&overrides)),
        };
        let invalid_at = |overrides: &[EnvOverride], key: String, reason: String| match blame(
            overrides, &key, &reason,
        ) {
            Some(var) => ConfigError::Env {
                var: var.to_owned(),
                reason: format!("key `{key}`: {reason}"),
            },
            None => ConfigError::Invalid {
                origin: origin.clone(),
                key,
                reason,
            },
        };
        let invalid = |overrides: &[EnvOverride], key: String, reason: String| {
            // A number too large for TOML's 64 bits arrives as a string: say what is wrong with it.
            let too_big = overrides.iter().rev().find(|o| o.key == key).filter(|o| {
                reason.starts_with("invalid type: string")
                    && o.raw
                        .trim_start_matches(['-', '+'])
                        .bytes()
                        .all(|b| b.is_ascii_digit())
                    && !o.raw.trim_start_matches(['-', '+']).is_empty()
            });
            let reason = match too_big {
                Some(o) => format!("{} is out of range: too large for a number", o.raw),
                None => reason,
            };
            invalid_at(overrides, key, reason)
        };
        // A value the environment gave as a number, a boolean or an array where the key takes a string
        // (`HYDRANT_STORE__PREFIX=2024`) is read again as the text it was written as. Each override is
        // retried at most once, so this ends. When the text fails too, the reason is the text's (`5` is not
        // a valid duration), unless the key takes no string at all (`1.5` for a count): then the first.
        // The file's sections were checked above; a variable that sets a whole section
        // (`HYDRANT_SERVER=x`) leaves it a value, not a table.
        if !overrides.is_empty()
            && let Err((key, reason)) = check_sections(&table)
        {
            return Err(invalid_at(&overrides, key, reason));
        }
        let mut retried: Option<(String, String)> = None;
        let config: Config = loop {
            let e = match serde_path_to_error::deserialize(toml::Value::Table(table.clone())) {
                Ok(config) => break config,
                Err(e) => e,
            };
            let key = e.path().to_string();
            let reason = crate::decode::plain_types(e.inner().message());
            if let Some((_, first)) = retried.take().filter(|(k, _)| *k == key) {
                let takes_strings = !reason.starts_with("invalid type: string");
                return Err(invalid(
                    &overrides,
                    key,
                    if takes_strings { reason } else { first },
                ));
            }
            let Some(o) = overrides
                .iter_mut()
                .rev()
                .find(|o| o.key == key)
                .filter(|o| o.typed)
            else {
                return Err(invalid(&overrides, key, reason));
            };
            o.typed = false;
            set_path(&mut table, &o.keys, toml::Value::String(o.raw.clone())).map_err(
                |reason| ConfigError::Env {
                    var: o.var.clone(),
                    reason,
                },
            )?;
            retried = Some((key, reason));
        };
        config
            .check()
            .map_err(|(key, reason)| invalid(&overrides, key.to_owned(), reason))?;
        Ok(config)
    }

    /// Range checks serde cannot express.
    fn check(&self) -> Result<(), (&'static str, String)> {
        let count = |v: usize| u64::try_from(v).unwrap_or(u64::MAX);
        let (limits, redis, prefetch, inference) = (
            &self.limits,
            &self.store.redis,
            &self.prefetch,
            &self.inference,
        );
        for (key, v, min, max) in [
            (
                "limits.max_body_bytes",
                count(limits.max_body_bytes),
                1,
                1 << 30,
            ),
            (
                "limits.max_candidates",
                count(limits.max_candidates),
                1,
                100_000,
            ),
            (
                "limits.max_entities",
                count(limits.max_entities),
                1,
                100_000,
            ),
            (
                "limits.max_key_bytes",
                count(limits.max_key_bytes),
                1,
                65_536,
            ),
            ("cache.max_bytes", self.cache.max_bytes, 1, 1 << 40),
            (
                "inference.intra_threads",
                count(inference.intra_threads),
                1,
                count(MAX_INTRA_THREADS),
            ),
            (
                "inference.default_sessions",
                count(inference.default_sessions),
                0,
                count(MAX_SESSIONS),
            ),
            (
                "inference.max_queue",
                count(inference.max_queue),
                1,
                count(MAX_QUEUE),
            ),
            ("store.redis.pool_size", count(redis.pool_size), 1, 256),
            (
                "server.max_connections",
                count(self.server.max_connections),
                1,
                1_000_000,
            ),
            (
                "server.workers",
                count(self.server.workers),
                0,
                count(MAX_WORKERS),
            ),
            (
                "store.redis.max_command_buffer",
                count(redis.max_command_buffer),
                1,
                1_000_000,
            ),
            (
                "prefetch.max_concurrent",
                count(prefetch.max_concurrent),
                1,
                10_000,
            ),
            (
                "prefetch.warm_top_k",
                count(prefetch.warm_top_k),
                0,
                1_000_000,
            ),
            (
                "prefetch.hot_sample_every",
                prefetch.hot_sample_every,
                0,
                1_000_000,
            ),
            ("prefetch.hot_keep", count(prefetch.hot_keep), 1, 1_000_000),
        ] {
            in_range(v, min, max).map_err(|e| (key, e))?;
        }
        // (key, value, shortest that makes sense: 0 where zero means "none" or "at once"). A 1 ns request
        // timeout would parse and then fail every request, so the floors are set where a value stops
        // being a typo.
        let ms = Duration::from_millis;
        for (key, d, min) in [
            ("server.shutdown_grace", self.server.shutdown_grace, ms(0)),
            ("server.idle_timeout", self.server.idle_timeout, ms(100)),
            ("limits.request_timeout", limits.request_timeout, ms(1)),
            // The wait includes waking a parked session (50-100 µs on an idle machine, more on a busy
            // one): below a millisecond an idle gateway would shed requests no other request held up.
            ("inference.queue_timeout", inference.queue_timeout, ms(1)),
            ("store.redis.connect_timeout", redis.connect_timeout, ms(10)),
            ("store.redis.command_timeout", redis.command_timeout, ms(1)),
            ("store.redis.write_timeout", redis.write_timeout, ms(10)),
            (
                "store.redis.reconnect_min_delay",
                redis.reconnect_min_delay,
                ms(1),
            ),
            (
                "store.redis.reconnect_max_delay",
                redis.reconnect_max_delay,
                ms(0),
            ),
            ("prefetch.warm_timeout", prefetch.warm_timeout, ms(0)),
            (
                "registry.reload_interval",
                self.registry.reload_interval,
                ms(0),
            ),
            (
                "prefetch.hot_flush_interval",
                prefetch.hot_flush_interval,
                ms(10),
            ),
            ("auth.reload_interval", self.auth.reload_interval, ms(0)),
        ] {
            if d < min {
                return Err((key, format!("must be at least {}", duration::format(min))));
            }
            if d > MAX_CONFIG_DURATION {
                return Err((
                    key,
                    format!("{} is too long: must be at most 1d", duration::quoted(d)),
                ));
            }
        }
        for (key, reload, what) in [
            (
                "registry.reload_interval",
                self.registry.reload_interval,
                "the schemas folder",
            ),
            (
                "auth.reload_interval",
                self.auth.reload_interval,
                "the token files",
            ),
        ] {
            if !reload.is_zero() && reload < ms(100) {
                return Err((
                    key,
                    format!(
                        "{} reads {what} too often: expected 0s (never) or at least 100ms",
                        duration::quoted(reload)
                    ),
                ));
            }
        }
        for (key, path) in [
            ("store.embedded.path", &self.store.embedded.path),
            ("registry.schemas", &self.registry.schemas),
            ("registry.models", &self.registry.models),
            (
                "inference.onnxruntime_library",
                &self.inference.onnxruntime_library,
            ),
        ] {
            if path.as_os_str().is_empty() {
                return Err((key, "expected a path, got an empty one".to_owned()));
            }
        }
        if redis.reconnect_max_delay < redis.reconnect_min_delay {
            return Err((
                "store.redis.reconnect_max_delay",
                "must not be shorter than store.redis.reconnect_min_delay".to_owned(),
            ));
        }
        if self.store.prefix.is_empty()
            || self
                .store
                .prefix
                .contains(|c: char| c.is_whitespace() || c.is_control())
        {
            return Err((
                "store.prefix",
                "expected a non-empty prefix without whitespace or control characters".to_owned(),
            ));
        }
        // In Redis Cluster the part of a key between `{` and `}` alone picks its slot: every key of the
        // deployment would land on one node.
        if self.store.prefix.contains(['{', '}']) {
            return Err((
                "store.prefix",
                "expected a prefix without `{` or `}`: in Redis Cluster they make a hash tag, which would put every key on one node".to_owned(),
            ));
        }
        check_redis_url(&redis.url).map_err(|reason| ("store.redis.url", reason))?;
        if redis.url.is_empty() && !redis.tls_ca_file.as_os_str().is_empty() {
            return Err((
                "store.redis.tls_ca_file",
                "is set, but store.redis.url is empty, so the embedded store is used: set the rediss:// URL too, or remove it".to_owned(),
            ));
        }
        check_log_level(&self.telemetry.log_level)
            .map_err(|reason| ("telemetry.log_level", reason))?;
        Ok(())
    }

    /// The ONNX Runtime library to load: `ORT_DYLIB_PATH` when set, else the configured path.
    pub fn onnxruntime_library(&self) -> PathBuf {
        match std::env::var_os("ORT_DYLIB_PATH") {
            Some(p) if !p.is_empty() => PathBuf::from(p),
            _ => self.inference.onnxruntime_library.clone(),
        }
    }
}

/// One key set from the environment.
struct EnvOverride {
    /// `store.redis.url`
    key: String,
    keys: Vec<String>,
    /// `HYDRANT_STORE__REDIS__URL`
    var: String,
    /// The variable's text.
    raw: String,
    /// The text was read as a TOML number, boolean, array or table, not as a string.
    typed: bool,
}

fn known_keys(overrides: &[EnvOverride]) -> String {
    let keys: Vec<&str> = overrides.iter().map(|o| o.key.as_str()).collect();
    keys.join(", ")
}

/// The variable to blame for an error at `key`: the one that set it, or, for an unknown key, the one that
/// named it (serde reports an unknown field at its parent's path).
fn blame<'a>(overrides: &'a [EnvOverride], key: &str, reason: &str) -> Option<&'a str> {
    let mut parent = if key == "." { "" } else { key };
    // At the top level the path already ends with the unknown field itself (`foo` for `foo`): its parent
    // is what is left.
    if let Some(field) = reason
        .strip_prefix("unknown field `")
        .and_then(|r| r.split('`').next())
    {
        if parent == field {
            parent = "";
        } else if let Some(p) = parent.strip_suffix(&format!(".{field}")) {
            parent = p;
        }
    }
    overrides
        .iter()
        .rev()
        .find(|o| {
            o.key == key
                || o.keys.iter().enumerate().any(|(i, k)| {
                    o.keys[..i].join(".") == parent
                        && reason.starts_with(&format!("unknown field `{k}`"))
                })
        })
        .map(|o| o.var.as_str())
}

/// 1-based line and column (in characters) of byte `offset` of `text`.
fn line_and_column(text: &str, offset: usize) -> (usize, usize) {
    let before = text.get(..offset).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, column)
}

/// The TOML reader's "duplicate key", naming the key or table on the line at `offset`.
fn given_twice(text: &str, offset: usize) -> String {
    let start = text
        .get(..offset)
        .map_or(0, |b| b.rfind('\n').map_or(0, |i| i + 1));
    let raw = text
        .get(start..)
        .and_then(|l| l.lines().next())
        .unwrap_or("");
    let line = raw.trim();
    if line.starts_with('[') {
        let header = line.split('#').next().unwrap_or(line).trim();
        return format!("the table `{header}` is given twice: write its keys under one `{header}`");
    }
    match key_at(text, start + raw.len()) {
        Some(key) => format!("`{key}` is set twice: keep one of them"),
        None => "duplicate key".to_owned(),
    }
}

/// The key whose value starts before `offset` on its line (`key = value`), under the last `[table]`
/// header above it: `cache.max_bytes` for a number too large for TOML. `None` where the line is no
/// assignment (a bad header, a value continued from an earlier line).
fn key_at(text: &str, offset: usize) -> Option<String> {
    let before = text.get(..offset)?;
    let line = before.rsplit('\n').next()?;
    let (key, _) = line.split_once('=')?;
    let key = key.trim().trim_matches('"');
    if key.is_empty() || key.starts_with('#') {
        return None;
    }
    let table = before
        .lines()
        .rev()
        .skip(1)
        .map(str::trim)
        .find(|l| l.starts_with('[') && !l.starts_with("[["))
        .and_then(|l| l.strip_prefix('[')?.split(']').next())
        .map(str::trim)
        .filter(|t| !t.is_empty());
    Some(match table {
        Some(t) => format!("{t}.{key}"),
        None => key.to_owned(),
    })
}

/// Refuses URLs the Redis client would misread: only the documented schemes. The URL itself is never echoed,
/// since it may hold a password.
fn check_redis_url(url: &str) -> Result<(), String> {
    if url.is_empty() {
        return Ok(()); // the embedded store
    }
    let expected = "expected redis://, rediss:// (TLS), redis-cluster:// or rediss-cluster:// (Redis Cluster), or redis-sentinel:// or rediss-sentinel:// (Sentinel) (the URL is not shown: it may hold a password)";
    match url.split_once("://") {
        Some((scheme, rest)) if REDIS_SCHEMES.iter().any(|s| s.eq_ignore_ascii_case(scheme)) => {
            // The database is the path: `redis://host:6379/1`.
            let before_query = rest.split(['?', '#']).next().unwrap_or_default();
            if let Some((_, db)) = before_query.split_once('/')
                && !db.is_empty()
                && db.parse::<u8>().is_err()
            {
                // `redis://user:pa/ss@host`: the path would start inside the password.
                let hint = if db.contains('@') {
                    "; a `/` before the `@` is in the user name or password: percent-encode it as %2F"
                } else {
                    ""
                };
                return Err(format!(
                    "not a valid Redis URL: the database (the path, as in redis://host:6379/1) must be a number from 0 to 255{hint} (the URL is not shown: it may hold a password)"
                ));
            }
            // The client reads `node` (more cluster seed nodes, or more sentinels) and, for Sentinel,
            // `sentinelServiceName` (the master's name), and ignores every other parameter: a misspelt
            // one would silently do nothing.
            let scheme = scheme.to_ascii_lowercase();
            let cluster = scheme.ends_with("-cluster");
            let sentinel = scheme.ends_with("-sentinel");
            let query = rest.split('#').next().unwrap_or_default().split_once('?');
            let mut service = false;
            for pair in query.map(|(_, q)| q).unwrap_or_default().split('&') {
                let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
                if sentinel && key == "sentinelServiceName" {
                    service |= !value.is_empty();
                    continue;
                }
                if key.is_empty() || ((cluster || sentinel) && key == "node") {
                    continue;
                }
                // Named only when it looks like a parameter name: after a `?` left unencoded in a
                // password, the "key" would be the rest of the password.
                let name = if key.len() <= 32
                    && key
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
                {
                    format!("`{key}` ")
                } else {
                    String::new()
                };
                return Err(format!(
                    "not a valid Redis URL: the query parameter {name}is not one hydrant's Redis client reads; it reads only `node=HOST:PORT` (more seed nodes or sentinels, in cluster and sentinel URLs) and `sentinelServiceName=NAME` (sentinel URLs); a `?` in a password must be percent-encoded as %3F (the URL is not shown: it may hold a password)"
                ));
            }
            if sentinel && !service {
                return Err("not a valid Redis URL: a sentinel URL names the master it follows: redis-sentinel://SENTINEL_HOST:26379/0?sentinelServiceName=mymaster (the URL is not shown: it may hold a password)".to_owned());
            }
            // Parsed here, as the client will parse it, so a typo is a start-up error naming the
            // file or variable, in words rather than the URL parser's.
            fred::types::config::Config::from_url(url)
                .map(drop)
                .map_err(|e| {
                    // Reading a `rediss://` URL loads the system's TLS roots, which `SSL_CERT_FILE`
                    // or `SSL_CERT_DIR` can point elsewhere: a bad one is no fault of the URL's.
                    if *e.kind() == fred::error::ErrorKind::Tls {
                        tls_roots_problem(e.details())
                    } else {
                        redis_url_problem(e.details(), url.contains('@'))
                    }
                })
        }
        Some((scheme, _))
            if !scheme.is_empty()
                && scheme.len() <= 32
                && scheme
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.')) =>
        {
            Err(format!(
                "the scheme `{scheme}://` is not supported: {expected}"
            ))
        }
        _ => Err(format!("not a URL with a scheme: {expected}")),
    }
}

/// The system's TLS roots, loaded for a `rediss://` URL, could not be read.
fn tls_roots_problem(details: &str) -> String {
    format!(
        "the URL asks for TLS, and the system's TLS roots cannot be read ({details}); check SSL_CERT_FILE and SSL_CERT_DIR in the environment (unset, the system's own roots are read)"
    )
}

/// What the Redis client's URL parser found wrong, in words. The URL is not echoed: it may hold a
/// password.
fn redis_url_problem(details: &str, has_credentials: bool) -> String {
    let d = details.to_ascii_lowercase();
    let what = if d.contains("port") {
        "a port is not a number from 1 to 65535".to_owned()
    } else if ["ipv6", "ipv4", "host", "domain"]
        .iter()
        .any(|w| d.contains(w))
    {
        "a host is not a valid name or address (an IPv6 address goes in brackets: redis://[::1]:6379)".to_owned()
    } else {
        format!("the client cannot read it ({details})")
    };
    let hint = if has_credentials {
        "; if the user name or password holds `/`, `@`, `:`, `?` or `#`, percent-encode it (`/` is %2F)"
    } else {
        ""
    };
    format!("not a valid Redis URL: {what}{hint} (the URL is not shown: it may hold a password)")
}

/// A `tracing` filter whose bare directives are level names. `EnvFilter` reads a bare word as a target
/// (`warnig` = "everything from module `warnig`"), which turns every other log off.
fn check_log_level(filter: &str) -> Result<(), String> {
    let expected = format!(
        "expected a level ({}), `target=level` directives, or both separated by commas (e.g. `info,hydrant=debug`)",
        LOG_LEVELS.join(", ")
    );
    if filter.trim().is_empty() {
        return Err(format!("is empty: {expected}"));
    }
    for d in filter.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        if !d.contains(['=', '[']) && !LOG_LEVELS.iter().any(|l| l.eq_ignore_ascii_case(d)) {
            return Err(format!("`{d}` is not a level: {expected}"));
        }
    }
    tracing_subscriber::EnvFilter::try_new(filter)
        .map(drop)
        .map_err(|e| format!("`{filter}` is not a valid filter ({e}): {expected}"))
}

/// The config's sections, which must be tables.
const SECTIONS: [&str; 11] = [
    "server",
    "store",
    "store.embedded",
    "store.redis",
    "registry",
    "limits",
    "cache",
    "prefetch",
    "inference",
    "telemetry",
    "auth",
];

/// Refuses a section written as something other than a table. Left to serde, `[[server]]` (an array of
/// tables) reads as a sequence of the struct's fields and fails with "expected socket address".
fn check_sections(table: &toml::Table) -> Result<(), (String, String)> {
    for section in SECTIONS {
        let mut value = None;
        let mut cur = Some(table);
        for k in section.split('.') {
            value = cur.and_then(|t| t.get(k));
            cur = value.and_then(toml::Value::as_table);
        }
        let found = match value {
            None | Some(toml::Value::Table(_)) => continue,
            Some(toml::Value::Array(a)) if a.iter().all(toml::Value::is_table) => {
                format!(
                    "`[[{section}]]` (an array of tables): write `[{section}]`, with single brackets"
                )
            }
            Some(v) => format!(
                "{} {v}: write the section as `[{section}]` followed by its keys",
                v.type_str()
            ),
        };
        return Err((
            section.to_owned(),
            format!("expected a table, found {found}"),
        ));
    }
    Ok(())
}

fn parse_env_value(raw: &str) -> toml::Value {
    // `key = <raw>` parses for numbers, booleans, arrays and quoted strings; anything else is a bare string.
    match format!("v = {raw}").parse::<toml::Table>() {
        Ok(mut t) => t
            .remove("v")
            .unwrap_or_else(|| toml::Value::String(raw.to_owned())),
        Err(_) => toml::Value::String(raw.to_owned()),
    }
}

fn set_path(table: &mut toml::Table, keys: &[String], value: toml::Value) -> Result<(), String> {
    let (last, parents) = keys.split_last().ok_or("empty key")?;
    let mut cur = table;
    for k in parents {
        let entry = cur
            .entry(k.clone())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        cur = entry
            .as_table_mut()
            .ok_or_else(|| format!("`{k}` is a value, not a section"))?;
    }
    cur.insert(last.clone(), value);
    Ok(())
}

/// `name` starts with [`ENV_PREFIX`] in any case: a variable meant for hydrant.
fn has_env_prefix(name: &str) -> bool {
    name.get(..ENV_PREFIX.len())
        .is_some_and(|p| p.eq_ignore_ascii_case(ENV_PREFIX))
}

/// An IP address and port. Host names are not resolved: a listener binds an address.
fn socket_addr<'de, D: serde::Deserializer<'de>>(d: D) -> Result<SocketAddr, D::Error> {
    let s = String::deserialize(d)?;
    s.trim().parse().map_err(|_| {
        serde::de::Error::custom(format!(
            "`{s}` is not an IP address and port: expected e.g. `0.0.0.0:8080`, `127.0.0.1:8080` or `[::1]:8080` (a host name such as localhost is not resolved)"
        ))
    })
}

/// Durations written as `250ms`, `2s`, `5m`, `1h`, `30d`.
pub mod duration {
    use std::time::Duration;

    use serde::{Deserializer, de::Error};

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Duration;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a duration such as `250ms`, `2s`, `5m`, `1h` or `30d`")
            }
            fn visit_str<E: Error>(self, s: &str) -> Result<Duration, E> {
                parse(s).map_err(E::custom)
            }
            // A bare number has no unit to read it in (is `300` seconds or milliseconds?); 0 is 0.
            fn visit_u64<E: Error>(self, n: u64) -> Result<Duration, E> {
                if n == 0 {
                    return Ok(Duration::ZERO);
                }
                Err(E::custom(format!(
                    "`{n}` is a number without a unit: write a duration such as `{n}s` or `{n}ms` (units: ns, us, ms, s, m, h, d)"
                )))
            }
            fn visit_i64<E: Error>(self, n: i64) -> Result<Duration, E> {
                match u64::try_from(n) {
                    Ok(n) => self.visit_u64(n),
                    Err(_) => Err(E::custom(format!(
                        "`{n}` is negative: expected a duration such as `250ms`, `2s`, `5m`"
                    ))),
                }
            }
            fn visit_f64<E: Error>(self, n: f64) -> Result<Duration, E> {
                Err(E::custom(format!(
                    "`{n}` is a number without a unit: write a duration such as `1500ms` or `2s` (units: ns, us, ms, s, m, h, d)"
                )))
            }
        }
        d.deserialize_any(V)
    }

    /// Parses a duration such as `250ms`, `30d` or `1h 30m`: whole numbers, each with one of the units
    /// `ns`, `us`, `ms`, `s`, `m`, `h`, `d` (or their long names, `min`, `hours`, ...). Months, years and
    /// weeks are refused: `10M` for `10m` would otherwise mean ten months.
    pub fn parse(s: &str) -> Result<Duration, String> {
        let expected = "expected e.g. `250ms`, `2s`, `5m`, `1h`, `30d`";
        let text = s.trim();
        if text.is_empty() {
            return Err(format!("`{s}` is not a valid duration ({expected})"));
        }
        // Zero is zero in any unit.
        if text == "0" {
            return Ok(Duration::ZERO);
        }
        let mut rest = text;
        let mut total_ns: u64 = 0;
        let mut units_seen: Vec<u64> = Vec::new();
        while !rest.is_empty() {
            let digits = rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
            if digits == 0 {
                return Err(format!("`{s}` is not a valid duration ({expected})"));
            }
            if rest[digits..].starts_with(['.', ',']) {
                return Err(format!(
                    "`{s}`: durations take whole numbers; write a fraction in a smaller unit (`1500ms`, not `1.5s`)"
                ));
            }
            // Too many digits for 64 bits is too long a duration: saturate, and the caller's range
            // check says so in its own terms.
            let number: u64 = rest[..digits].parse().unwrap_or(u64::MAX);
            rest = rest[digits..].trim_start();
            let letters = rest.len() - rest.trim_start_matches(|c: char| c.is_alphabetic()).len();
            let unit = &rest[..letters];
            rest = rest[letters..].trim_start();
            let ns_per: u64 = match unit {
                "ns" | "nsec" | "nanos" => 1,
                "us" | "µs" | "usec" | "micros" => 1_000,
                "ms" | "msec" | "msecs" | "millis" => 1_000_000,
                "s" | "sec" | "secs" | "second" | "seconds" => 1_000_000_000,
                "m" | "min" | "mins" | "minute" | "minutes" => 60_000_000_000,
                "h" | "hr" | "hrs" | "hour" | "hours" => 3_600_000_000_000,
                "d" | "day" | "days" => 86_400_000_000_000,
                "" => {
                    return Err(format!("`{s}` has a number without a unit ({expected})"));
                }
                other => {
                    return Err(format!(
                        "`{s}`: the unit `{other}` is not one hydrant takes: write ns, us, ms, s, m, h or d (e.g. `250ms`, `5m`, `30d`)"
                    ));
                }
            };
            // `1d 1d` is most likely a typo for something else; it is not read as `2d`.
            if units_seen.contains(&ns_per) {
                return Err(format!("`{s}` gives the unit `{unit}` twice ({expected})"));
            }
            units_seen.push(ns_per);
            total_ns = total_ns.saturating_add(number.saturating_mul(ns_per));
        }
        Ok(Duration::from_nanos(total_ns))
    }

    /// `d` quoted for a message as [`format`] writes it; one that [`parse`] saturated (too many digits
    /// for 64 bits of nanoseconds) is not echoed as the odd value it became.
    pub fn quoted(d: Duration) -> String {
        if d >= Duration::from_nanos(u64::MAX) {
            "a duration of over 500 years".to_owned()
        } else {
            format!("`{}`", format(d))
        }
    }

    /// A duration the way [`parse`] reads it back: `2d`, `1h 30m`, `250ms`, `200us`.
    pub fn format(d: Duration) -> String {
        if d.is_zero() {
            return "0s".to_owned();
        }
        let mut ns = d.as_nanos();
        let mut parts = Vec::new();
        for (unit, per) in [
            ("d", 86_400_000_000_000u128),
            ("h", 3_600_000_000_000),
            ("m", 60_000_000_000),
            ("s", 1_000_000_000),
            ("ms", 1_000_000),
            ("us", 1_000),
            ("ns", 1),
        ] {
            if ns >= per {
                parts.push(format!("{}{unit}", ns / per));
                ns %= per;
            }
        }
        parts.join(" ")
    }
}

/// `v` within `min..=max`, or the message every size and count bound gives.
pub fn in_range<T: PartialOrd + Copy + std::fmt::Display>(
    v: T,
    min: T,
    max: T,
) -> Result<(), String> {
    if (min..=max).contains(&v) {
        Ok(())
    } else {
        Err(format!(
            "{v} is out of range: must be between {min} and {max}"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn env_overrides_file_values_with_typed_parsing() {
        let (_dir, path) =
            config_file("[server]\nbind = \"127.0.0.1:1\"\n[limits]\nmax_candidates = 5\n");
        let c = Config::load(
            Some(&path),
            env(&[
                ("HYDRANT_SERVER__BIND", "0.0.0.0:9000"),
                ("HYDRANT_LIMITS__REQUEST_TIMEOUT", "250ms"),
                ("HYDRANT_STORE__REDIS__URL", "redis://127.0.0.1:6379"),
                ("UNRELATED", "x"),
            ]),
        )
        .expect("valid");
        assert_eq!(c.server.bind.port(), 9000);
        assert_eq!(c.limits.max_candidates, 5);
        assert_eq!(c.limits.request_timeout, Duration::from_millis(250));
        assert_eq!(c.store.redis.url, "redis://127.0.0.1:6379");
    }

    #[test]
    fn unknown_key_names_the_key_and_file() {
        let (_dir, path) = config_file("[server]\nbnd = \"127.0.0.1:1\"\n");
        let e = Config::load(Some(&path), [])
            .expect_err("must fail")
            .to_string();
        assert!(e.contains("h.toml"), "{e}");
        assert!(e.contains("server"), "{e}");
        assert!(e.contains("bnd"), "{e}");
    }

    #[test]
    fn bad_values_say_what_was_expected() {
        let e = Config::load(None, env(&[("HYDRANT_LIMITS__REQUEST_TIMEOUT", "soon")]))
            .expect_err("must fail")
            .to_string();
        assert!(
            e.contains("limits.request_timeout") && e.contains("not a valid duration"),
            "{e}"
        );
        for bad in ["nowhere", "localhost:8080"] {
            let e = Config::load(None, env(&[("HYDRANT_SERVER__BIND", bad)]))
                .expect_err("must fail")
                .to_string();
            assert!(
                e.contains("server.bind") && e.contains("127.0.0.1:8080"),
                "{e}"
            );
        }
        let e = Config::load(None, env(&[("HYDRANT_LIMITS__MAX_CANDIDATES", "0")]))
            .expect_err("must fail")
            .to_string();
        assert!(
            e.contains("limits.max_candidates") && e.contains("between 1 and"),
            "{e}"
        );
        let e = Config::load(None, env(&[("HYDRANT_TELEMETRY__LOG_FORMAT", "xml")]))
            .expect_err("must fail")
            .to_string();
        assert!(e.contains("telemetry.log_format"), "{e}");
    }

    #[test]
    fn redis_and_prefetch_settings_are_checked() {
        let c = Config::load(
            None,
            env(&[
                ("HYDRANT_STORE__REDIS__WRITE_TIMEOUT", "3s"),
                ("HYDRANT_PREFETCH__WARM_TOP_K", "50"),
            ]),
        )
        .expect("valid");
        assert_eq!(c.store.redis.write_timeout, Duration::from_secs(3));
        assert_eq!(c.prefetch.warm_top_k, 50);
        let e = Config::load(
            None,
            env(&[
                ("HYDRANT_STORE__REDIS__RECONNECT_MIN_DELAY", "2s"),
                ("HYDRANT_STORE__REDIS__RECONNECT_MAX_DELAY", "1s"),
            ]),
        )
        .expect_err("max below min")
        .to_string();
        assert!(e.contains("store.redis.reconnect_max_delay"), "{e}");
        let e = Config::load(None, env(&[("HYDRANT_PREFETCH__MAX_CONCURRENT", "0")]))
            .expect_err("zero")
            .to_string();
        assert!(e.contains("prefetch.max_concurrent"), "{e}");
    }

    /// A config file holding `text`, in a temporary directory that lives as long as the handle.
    fn config_file(text: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("h.toml");
        std::fs::write(&path, text).expect("write");
        (dir, path)
    }

    fn load_err(pairs: &[(&str, &str)]) -> String {
        match Config::load(None, env(pairs)) {
            Ok(_) => panic!("{pairs:?} must be refused"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn a_number_of_the_wrong_kind_is_named_in_words_not_rust_types() {
        let e = load_err(&[("HYDRANT_LIMITS__MAX_CANDIDATES", "-5")]);
        assert!(
            e.contains("limits.max_candidates")
                && e.contains("integer `-5`, expected a whole number, 0 or more"),
            "{e}"
        );
        let e = load_err(&[("HYDRANT_LIMITS__MAX_CANDIDATES", "1.5")]);
        assert!(e.contains("expected a whole number, 0 or more"), "{e}");
        assert!(!e.contains("usize"), "{e}");
    }

    #[test]
    fn sizes_and_counts_are_bounded_above() {
        for (var, value, key, max) in [
            (
                "HYDRANT_INFERENCE__MAX_QUEUE",
                "100000000000000",
                "inference.max_queue",
                "100000",
            ),
            (
                "HYDRANT_INFERENCE__MAX_QUEUE",
                "9223372036854775807",
                "inference.max_queue",
                "100000",
            ),
            (
                "HYDRANT_PREFETCH__MAX_CONCURRENT",
                "9223372036854775807",
                "prefetch.max_concurrent",
                "10000",
            ),
            (
                "HYDRANT_INFERENCE__INTRA_THREADS",
                "100000",
                "inference.intra_threads",
                "256",
            ),
            (
                "HYDRANT_INFERENCE__DEFAULT_SESSIONS",
                "1000000",
                "inference.default_sessions",
                "256",
            ),
            (
                "HYDRANT_STORE__REDIS__POOL_SIZE",
                "100000",
                "store.redis.pool_size",
                "256",
            ),
            (
                "HYDRANT_STORE__REDIS__MAX_COMMAND_BUFFER",
                "1000000000",
                "store.redis.max_command_buffer",
                "1000000",
            ),
            (
                "HYDRANT_PREFETCH__HOT_KEEP",
                "1000000000",
                "prefetch.hot_keep",
                "1000000",
            ),
            (
                "HYDRANT_PREFETCH__WARM_TOP_K",
                "1000000000",
                "prefetch.warm_top_k",
                "1000000",
            ),
            (
                "HYDRANT_PREFETCH__HOT_SAMPLE_EVERY",
                "1000000000",
                "prefetch.hot_sample_every",
                "1000000",
            ),
            (
                "HYDRANT_LIMITS__MAX_BODY_BYTES",
                "1000000000000",
                "limits.max_body_bytes",
                "1073741824",
            ),
            (
                "HYDRANT_LIMITS__MAX_CANDIDATES",
                "10000000",
                "limits.max_candidates",
                "100000",
            ),
            (
                "HYDRANT_LIMITS__MAX_ENTITIES",
                "10000000",
                "limits.max_entities",
                "100000",
            ),
            (
                "HYDRANT_LIMITS__MAX_KEY_BYTES",
                "10000000",
                "limits.max_key_bytes",
                "65536",
            ),
            (
                "HYDRANT_CACHE__MAX_BYTES",
                "9223372036854775807",
                "cache.max_bytes",
                "1099511627776",
            ),
        ] {
            let e = load_err(&[(var, value)]);
            assert!(
                e.contains(var) && e.contains(key) && e.contains(&format!("and {max}")),
                "{e}"
            );
        }
        // The bounds themselves are accepted, and so is 0 where it means something.
        let c = Config::load(
            None,
            env(&[
                ("HYDRANT_INFERENCE__MAX_QUEUE", "100000"),
                ("HYDRANT_INFERENCE__INTRA_THREADS", "256"),
                ("HYDRANT_INFERENCE__DEFAULT_SESSIONS", "0"),
                ("HYDRANT_STORE__REDIS__POOL_SIZE", "256"),
                ("HYDRANT_PREFETCH__WARM_TOP_K", "0"),
            ]),
        )
        .expect("at the bounds");
        assert_eq!(c.inference.max_queue, MAX_QUEUE);
    }

    #[test]
    fn the_folder_and_token_files_are_read_never_or_at_most_ten_times_a_second() {
        for (var, what) in [
            ("HYDRANT_REGISTRY__RELOAD_INTERVAL", "the schemas folder"),
            ("HYDRANT_AUTH__RELOAD_INTERVAL", "the token files"),
        ] {
            let e = load_err(&[(var, "10ms")]);
            assert!(
                e.contains(var)
                    && e.contains(what)
                    && e.contains("expected 0s (never) or at least 100ms"),
                "{e}"
            );
            for (value, want) in [("0s", 0), ("100ms", 100), ("2s", 2000)] {
                let c = Config::load(None, env(&[(var, value)])).expect("a valid interval");
                let got = if var.contains("AUTH") {
                    c.auth.reload_interval
                } else {
                    c.registry.reload_interval
                };
                assert_eq!(got, Duration::from_millis(want));
            }
        }
        let c = Config::load(None, env(&[])).expect("defaults");
        assert_eq!(c.auth.reload_interval, Duration::from_secs(10));
    }

    #[test]
    fn absurd_durations_are_refused_without_panicking() {
        for var in [
            "HYDRANT_SERVER__SHUTDOWN_GRACE",
            "HYDRANT_LIMITS__REQUEST_TIMEOUT",
            "HYDRANT_INFERENCE__QUEUE_TIMEOUT",
            "HYDRANT_STORE__REDIS__CONNECT_TIMEOUT",
            "HYDRANT_STORE__REDIS__COMMAND_TIMEOUT",
            "HYDRANT_STORE__REDIS__WRITE_TIMEOUT",
            "HYDRANT_PREFETCH__WARM_TIMEOUT",
            "HYDRANT_AUTH__RELOAD_INTERVAL",
            "HYDRANT_PREFETCH__HOT_FLUSH_INTERVAL",
            "HYDRANT_REGISTRY__RELOAD_INTERVAL",
        ] {
            for value in ["500000000d", "25h", "18446744073709551615s"] {
                let e = load_err(&[(var, value)]);
                assert!(e.contains(var) && e.contains("at most 1d"), "{e}");
            }
        }
        let e = load_err(&[
            ("HYDRANT_STORE__REDIS__RECONNECT_MIN_DELAY", "500000000d"),
            ("HYDRANT_STORE__REDIS__RECONNECT_MAX_DELAY", "500000000d"),
        ]);
        assert!(e.contains("reconnect_") && e.contains("at most 1d"), "{e}");
        let c = Config::load(None, env(&[("HYDRANT_LIMITS__REQUEST_TIMEOUT", "1d")])).expect("1d");
        assert_eq!(c.limits.request_timeout, MAX_CONFIG_DURATION);
        // Too short to be meant: every request would fail, every connection would drop.
        for (var, value, floor) in [
            ("HYDRANT_LIMITS__REQUEST_TIMEOUT", "1ns", "1ms"),
            ("HYDRANT_SERVER__IDLE_TIMEOUT", "1ns", "100ms"),
            ("HYDRANT_STORE__REDIS__WRITE_TIMEOUT", "1ms", "10ms"),
        ] {
            let e = load_err(&[(var, value)]);
            assert!(
                e.contains(var) && e.contains(&format!("at least {floor}")),
                "{e}"
            );
        }
        let e = load_err(&[("HYDRANT_INFERENCE__QUEUE_TIMEOUT", "200us")]);
        assert!(e.contains("at least 1ms"), "{e}");
        Config::load(None, env(&[("HYDRANT_INFERENCE__QUEUE_TIMEOUT", "1ms")])).expect("1ms");
        let e = load_err(&[
            ("HYDRANT_SERVER__BIND", "127.0.0.1:1"),
            ("HYDRANT_server__bind", "127.0.0.1:2"),
        ]);
        assert!(
            e.contains("HYDRANT_server__bind") && e.contains("HYDRANT_SERVER__BIND"),
            "{e}"
        );
        // An unknown section named by a variable blames the variable, not the file.
        let e = load_err(&[("HYDRANT_FOO__BAR", "1")]);
        assert!(
            e.contains("HYDRANT_FOO__BAR") && e.contains("unknown field `foo`"),
            "{e}"
        );
        // A number past 64 bits is out of range, not "a string".
        let e = load_err(&[("HYDRANT_CACHE__MAX_BYTES", "99999999999999999999999")]);
        assert!(
            e.contains("cache.max_bytes") && e.contains("out of range"),
            "{e}"
        );
        let e = load_err(&[("HYDRANT_STORE__EMBEDDED__PATH", "")]);
        assert!(
            e.contains("store.embedded.path") && e.contains("empty"),
            "{e}"
        );
    }

    #[test]
    fn log_level_typos_are_refused_and_directives_accepted() {
        for typo in ["warnig", "debg", "verbose", "hydrant", "info,hydrant", ""] {
            let e = load_err(&[("HYDRANT_TELEMETRY__LOG_LEVEL", typo)]);
            assert!(
                e.contains("telemetry.log_level")
                    && e.contains("error, warn, info, debug, trace, off"),
                "{typo}: {e}"
            );
        }
        let e = load_err(&[("HYDRANT_TELEMETRY__LOG_LEVEL", "hydrant=debg")]);
        assert!(e.contains("telemetry.log_level"), "{e}");
        for ok in [
            "info",
            "WARN",
            "off",
            "info,hydrant=debug",
            "hydrant=debug,info",
            "hydrant::gateway=trace",
        ] {
            let c = Config::load(None, env(&[("HYDRANT_TELEMETRY__LOG_LEVEL", ok)]))
                .unwrap_or_else(|e| panic!("{ok}: {e}"));
            assert_eq!(c.telemetry.log_level, ok);
        }
    }

    /// What the client says when `SSL_CERT_FILE` names no file (set by hand, the process's environment
    /// would reach the other tests): the roots are blamed, not the URL.
    #[test]
    fn unreadable_tls_roots_are_not_called_a_bad_url() {
        let details = r#"Error { context: "failed to read PEM from file", kind: Io { inner: Os { code: 2, kind: NotFound, message: "No such file or directory" }, path: "/nonexistent/ca.crt" } }"#;
        let e = tls_roots_problem(details);
        assert!(
            e.contains("SSL_CERT_FILE") && !e.contains("not a valid Redis URL"),
            "{e}"
        );
        let e = redis_url_problem("Invalid port", false);
        assert!(e.starts_with("not a valid Redis URL: a port"), "{e}");
    }

    #[test]
    fn redis_urls_need_a_redis_scheme_and_are_never_echoed() {
        for url in [
            "http://user:secret@127.0.0.1:6379",
            "127.0.0.1:6379",
            "valkey://127.0.0.1:6379",
            "redis+unix:///tmp/redis.sock",
        ] {
            let e = load_err(&[("HYDRANT_STORE__REDIS__URL", url)]);
            assert!(
                e.contains("store.redis.url") && e.contains("expected redis://"),
                "{e}"
            );
            assert!(!e.contains("secret") && !e.contains("127.0.0.1"), "{e}");
        }
        for url in [
            "redis://127.0.0.1:6379",
            "rediss://h:6380/1",
            "redis-cluster://h:1?node=h:2",
            "rediss-cluster://h:1?node=h:2&node=h:3",
            "rediss-cluster://h:1",
            "REDIS://h:1",
            "redis://h:1/0?",
            "redis-sentinel://h:26379/0?sentinelServiceName=mymaster&node=h2:26379",
            "rediss-sentinel://:pw@h:26379?sentinelServiceName=m",
        ] {
            Config::load(None, env(&[("HYDRANT_STORE__REDIS__URL", url)]))
                .unwrap_or_else(|e| panic!("{url}: {e}"));
        }
        for (url, says) in [
            ("redis://:secret@[bad", "a host is not a valid"),
            ("redis://:secret@127.0.0.1:99999", "a port is not a number"),
            ("redis://:secret@127.0.0.1:6379/abc", "the database"),
            ("redis://:secret@127.0.0.1:6379/1/2", "the database"),
            ("redis://:secret@127.0.0.1:6379/256", "the database"),
            // A query parameter the client would ignore, misspelt or not for this scheme.
            (
                "redis-cluster://:secret@h:1?nodes=h:2",
                "the query parameter `nodes` is not one",
            ),
            ("redis://:secret@h:1?node=h:2", "the query parameter `node`"),
            ("redis://:secret@h:1/0?timeout=5", "`timeout`"),
            // A `?` left in a password: what follows it is not echoed as a parameter name.
            ("redis://:secret?tail@h:6379", "percent-encoded as %3F"),
            (
                "redis://alice:p@ss:w/rd%@h:6379",
                "a `/` before the `@` is in the user name or password: percent-encode it as %2F",
            ),
            (
                "redis-sentinel://:secret@h:26379",
                "names the master it follows",
            ),
            (
                "redis-sentinel://:secret@h:26379?sentinelServiceName=",
                "names the master it follows",
            ),
            (
                "redis://:secret@h:1?sentinelServiceName=m",
                "`sentinelServiceName`",
            ),
        ] {
            let e = load_err(&[("HYDRANT_STORE__REDIS__URL", url)]);
            assert!(
                e.contains("HYDRANT_STORE__REDIS__URL") && e.contains(says),
                "{url}: {e}"
            );
            assert!(!e.contains("secret") && !e.contains("tail"), "{e}");
        }
        let e = load_err(&[("HYDRANT_STORE__REDIS__TLS_CA_FILE", "/etc/ssl/ca.pem")]);
        assert!(e.contains("store.redis.url is empty"), "{e}");
    }

    #[test]
    fn toml_syntax_errors_give_line_and_column() {
        let (_dir, path) = config_file("[server]\nbind = \"127.0.0.1:1\"\nshutdown_grace = 10s\n");
        let e = Config::load(Some(&path), [])
            .expect_err("syntax")
            .to_string();
        assert!(
            e.contains("h.toml") && e.contains("line 3, column 18 (key `server.shutdown_grace`)"),
            "{e}"
        );
        // A number beyond TOML's 64-bit integers: the parser refuses it, and the key is named.
        let (_dir, path) = config_file(
            "[server]\nbind = \"127.0.0.1:1\"\n\n[cache]\n# bytes\nmax_bytes = 18446744073709551615\n",
        );
        let e = Config::load(Some(&path), [])
            .expect_err("too large")
            .to_string();
        assert!(
            e.contains(
                "line 6, column 13 (key `cache.max_bytes`): the number is out of range: too large for a number"
            ),
            "{e}"
        );
        let (_dir, path) = config_file("[cache]\nmax_bytes = 99999999999999999999\n");
        let e = Config::load(Some(&path), [])
            .expect_err("past u64")
            .to_string();
        assert!(
            e.contains("(key `cache.max_bytes`): 99999999999999999999 is out of range: too large for a number"),
            "{e}"
        );
        // A line that assigns nothing names no key.
        let (_dir, path) = config_file("[server\nbind = 1\n");
        let e = Config::load(Some(&path), [])
            .expect_err("header")
            .to_string();
        assert!(e.contains("line 1") && !e.contains("(key"), "{e}");
        // Given twice: the table or the key is named, not only "duplicate key".
        let (_dir, path) = config_file("[server]\nbind = \"127.0.0.1:1\"\n\n[server]  # again\n");
        let e = Config::load(Some(&path), [])
            .expect_err("table twice")
            .to_string();
        assert!(
            e.contains("line 4") && e.contains("the table `[server]` is given twice"),
            "{e}"
        );
        let (_dir, path) =
            config_file("[server]\nbind = \"127.0.0.1:1\"\n  bind = \"127.0.0.1:2\"\n");
        let e = Config::load(Some(&path), [])
            .expect_err("key twice")
            .to_string();
        assert!(
            e.contains("line 3") && e.contains("`server.bind` is set twice"),
            "{e}"
        );
    }

    #[test]
    fn durations_take_the_units_the_docs_list_and_refuse_months_and_years() {
        use super::duration::{format, parse};
        for (text, ms) in [
            ("250ms", 250),
            ("2s", 2_000),
            (" 5m ", 300_000),
            ("1h 30m", 5_400_000),
            ("1h30m", 5_400_000),
            ("30d", 2_592_000_000),
            ("10min", 600_000),
            ("2 hours", 7_200_000),
            ("0", 0),
            ("0s", 0),
        ] {
            assert_eq!(parse(text), Ok(Duration::from_millis(ms)), "{text}");
        }
        for (text, says) in [
            ("10M", "the unit `M`"),
            ("1y", "the unit `y`"),
            ("2w", "the unit `w`"),
            ("5", "without a unit"),
            ("", "not a valid duration"),
            ("m5", "not a valid duration"),
            ("-5s", "not a valid duration"),
        ] {
            let e = parse(text).expect_err(text);
            assert!(e.contains(says), "{text}: {e}");
        }
        assert_eq!(format(Duration::from_secs(2 * 86_400)), "2d");
        assert_eq!(format(Duration::from_millis(86_401_250)), "1d 1s 250ms");
        assert_eq!(format(Duration::ZERO), "0s");
        assert_eq!(
            parse("99999999999999999999s"),
            Ok(Duration::from_nanos(u64::MAX))
        );
        let e = load_err(&[("HYDRANT_LIMITS__REQUEST_TIMEOUT", "99999999999999999999s")]);
        assert!(e.contains("over 500 years is too long"), "{e}");
        // A bare number in the file asks for a unit, rather than saying "expected a string".
        for (line, says) in [
            (
                "request_timeout = 2",
                "`2` is a number without a unit: write a duration such as `2s`",
            ),
            ("request_timeout = 1.5", "`1.5` is a number without a unit"),
            (
                "request_timeout = true",
                "expected a duration such as `250ms`",
            ),
        ] {
            let (_dir, path) = config_file(&format!("[limits]\n{line}\n"));
            let e = Config::load(Some(&path), []).expect_err(line).to_string();
            assert!(
                e.contains("request_timeout") && e.contains(says),
                "{line}: {e}"
            );
        }
        for (text, says) in [
            ("1.5s", "whole numbers"),
            ("1d1d", "the unit `d` twice"),
            ("1x", "write ns, us, ms"),
        ] {
            let e = parse(text).expect_err(text);
            assert!(e.contains(says), "{text}: {e}");
        }
        assert_eq!(parse("200us"), Ok(Duration::from_micros(200)));
        assert_eq!(format(Duration::from_micros(1_200)), "1ms 200us");
        let e = load_err(&[("HYDRANT_LIMITS__REQUEST_TIMEOUT", "2d")]);
        assert!(e.contains("`2d` is too long"), "{e}");
    }

    #[test]
    fn a_variable_that_replaces_a_section_is_named() {
        let e = load_err(&[("HYDRANT_SERVER", "x")]);
        assert!(
            e.contains("HYDRANT_SERVER")
                && e.contains("`server`")
                && e.contains("expected a table"),
            "{e}"
        );
        assert!(!e.contains("ServerConfig"), "{e}");
        let e = load_err(&[("HYDRANT_AUTH", "1")]);
        assert!(
            e.contains("`auth`") && e.contains("expected a table"),
            "{e}"
        );
        assert!(!e.contains("AuthConfig"), "{e}");
    }

    #[test]
    fn a_lowercase_prefix_is_refused_rather_than_ignored() {
        let e = load_err(&[("hydrant_server__bind", "127.0.0.1:1")]);
        assert!(
            e.contains("hydrant_server__bind") && e.contains("HYDRANT_ in capitals"),
            "{e}"
        );
    }

    #[test]
    fn a_section_that_is_not_a_table_is_named_with_the_fix() {
        for (text, key, says) in [
            (
                "[[server]]\nbind = \"127.0.0.1:1\"\n",
                "`server`",
                "write `[server]`",
            ),
            (
                "[[store.redis]]\nurl = \"\"\n",
                "`store.redis`",
                "write `[store.redis]`",
            ),
            ("limits = 5\n", "`limits`", "found integer 5"),
            ("[[auth]]\ntoken_file = \"t\"\n", "`auth`", "write `[auth]`"),
            (
                "[store]\nembedded = \"x\"\n",
                "`store.embedded`",
                "found string",
            ),
        ] {
            let (_dir, path) = config_file(text);
            let e = Config::load(Some(&path), []).expect_err(text).to_string();
            assert!(
                e.contains("h.toml") && e.contains(key) && e.contains(says),
                "{text}: {e}"
            );
        }
    }

    #[test]
    fn a_missing_file_names_its_cause_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let e = anyhow::Error::from(
            Config::load(Some(&dir.path().join("nope.toml")), []).expect_err("missing"),
        );
        let e = format!("{e:#}");
        assert!(e.contains("nope.toml"), "{e}");
        assert_eq!(e.matches("No such file or directory").count(), 1, "{e}");
    }

    #[test]
    fn env_values_for_string_keys_are_taken_as_written() {
        let c = Config::load(
            None,
            env(&[
                ("HYDRANT_STORE__PREFIX", "2024"),
                ("HYDRANT_STORE__EMBEDDED__PATH", "true"),
                ("HYDRANT_TELEMETRY__LOG_LEVEL", "\"debug\""),
            ]),
        )
        .expect("strings");
        assert_eq!(c.store.prefix, "2024");
        assert_eq!(c.store.embedded.path, PathBuf::from("true"));
        // A namespace is fine; a Redis Cluster hash tag is not.
        let ns = Config::load(None, env(&[("HYDRANT_STORE__PREFIX", "team:hy")])).expect("colon");
        assert_eq!(ns.store.prefix, "team:hy");
        let tag = load_err(&[("HYDRANT_STORE__PREFIX", "hy{1}")]);
        assert!(
            tag.contains("HYDRANT_STORE__PREFIX") && tag.contains("hash tag"),
            "{tag}"
        );
        assert_eq!(c.telemetry.log_level, "debug");
        // A key that takes no string keeps the first, clearer reason, and names the variable.
        let e = load_err(&[("HYDRANT_LIMITS__MAX_CANDIDATES", "1.5")]);
        assert!(
            e.contains("HYDRANT_LIMITS__MAX_CANDIDATES")
                && e.contains("limits.max_candidates")
                && e.contains("float"),
            "{e}"
        );
        let e = load_err(&[("HYDRANT_LIMITS__REQUEST_TIMEOUT", "5")]);
        assert!(
            e.contains("HYDRANT_LIMITS__REQUEST_TIMEOUT") && e.contains("without a unit"),
            "{e}"
        );
        // An unknown key is blamed on the variable that named it.
        let e = load_err(&[("HYDRANT_SERVER__BND", "x")]);
        assert!(
            e.contains("HYDRANT_SERVER__BND") && e.contains("bnd"),
            "{e}"
        );
        // A typo in the file is not blamed on a variable that set a valid sibling key.
        let (_dir, path) = config_file("[server]\nbnd = \"127.0.0.1:1\"\n");
        let e = Config::load(
            Some(&path),
            env(&[("HYDRANT_SERVER__SHUTDOWN_GRACE", "5s")]),
        )
        .expect_err("typo")
        .to_string();
        assert!(
            e.contains("bnd") && !e.contains("HYDRANT_SERVER__SHUTDOWN_GRACE"),
            "{e}"
        );
    }

    #[test]
    fn the_shipped_config_file_is_valid() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/hydrant.toml");
        Config::load(Some(&path), []).expect("config/hydrant.toml must load");
    }
}
