//! Typed configuration: `config/hydrant.toml` overlaid by `HYDRANT_SECTION__KEY` environment variables.
//!
//! Every key has a default, unknown keys are rejected, and a bad value stops start-up with the file, the key
//! and the reason. Environment overrides are parsed as TOML values when they look like one (`8`, `true`,
//! `[1, 2]`) and as strings otherwise, so `HYDRANT_SERVER__BIND=0.0.0.0:9000` needs no quoting.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

/// The environment variable prefix for overrides, e.g. `HYDRANT_STORE__REDIS__URL`.
pub const ENV_PREFIX: &str = "HYDRANT_";

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
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Address the HTTP API listens on; port 0 picks a free port.
    pub bind: SocketAddr,
    /// How long in-flight requests get to finish after SIGINT/SIGTERM.
    #[serde(with = "duration")]
    pub shutdown_grace: Duration,
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
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    /// Largest request body accepted; larger ones get 413.
    pub max_body_bytes: usize,
    /// Most candidates one predict request may carry; more get 413.
    pub max_candidates: usize,
    /// Most entity keys one `/v1/features` request may carry.
    pub max_entities: usize,
    /// Longest entity key, in bytes.
    pub max_key_bytes: usize,
    /// Each request's deadline (`options.deadline_ms` can only shorten it); a backstop answers 503 to a
    /// request still running 250 ms past it.
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
    /// Default session pool size for models that do not set `sessions`; 0 means one per core.
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
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {path} is not valid TOML: {message}")]
    Syntax { path: PathBuf, message: String },
    #[error("environment variable {var}: {reason}")]
    Env { var: String, reason: String },
    #[error("{origin}: key `{key}`: {reason}")]
    Invalid {
        origin: String,
        key: String,
        reason: String,
    },
}

impl Config {
    /// Loads `path` (when given) and applies `HYDRANT_*` overrides from `env`.
    pub fn load(
        path: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ConfigError> {
        let mut table = match path {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                    path: path.to_owned(),
                    source,
                })?;
                text.parse::<toml::Table>()
                    .map_err(|e| ConfigError::Syntax {
                        path: path.to_owned(),
                        message: e.message().to_owned(),
                    })?
            }
            None => toml::Table::new(),
        };
        let mut overridden = Vec::new();
        for (var, value) in env {
            let Some(rest) = var.strip_prefix(ENV_PREFIX) else {
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
            set_path(&mut table, &keys, parse_env_value(&value)).map_err(|reason| {
                ConfigError::Env {
                    var: var.clone(),
                    reason,
                }
            })?;
            overridden.push(keys.join("."));
        }
        let origin = match path {
            Some(p) if overridden.is_empty() => p.display().to_string(),
            Some(p) => format!(
                "{} (with env overrides of {})",
                p.display(),
                overridden.join(", ")
            ),
            None if overridden.is_empty() => "defaults".to_owned(),
            None => format!("env overrides of {}", overridden.join(", ")),
        };
        let config: Config =
            serde_path_to_error::deserialize(toml::Value::Table(table)).map_err(|e| {
                ConfigError::Invalid {
                    origin: origin.clone(),
                    key: e.path().to_string(),
                    reason: e.inner().message().to_owned(),
                }
            })?;
        config
            .check()
            .map_err(|(key, reason)| ConfigError::Invalid {
                origin,
                key: key.to_owned(),
                reason,
            })?;
        Ok(config)
    }

    /// Range checks serde cannot express.
    fn check(&self) -> Result<(), (&'static str, String)> {
        let positive = |key: &'static str, v: usize| {
            if v == 0 {
                Err((key, "must be greater than 0".to_owned()))
            } else {
                Ok(())
            }
        };
        positive("limits.max_body_bytes", self.limits.max_body_bytes)?;
        positive("limits.max_candidates", self.limits.max_candidates)?;
        positive("limits.max_entities", self.limits.max_entities)?;
        positive("limits.max_key_bytes", self.limits.max_key_bytes)?;
        positive("inference.intra_threads", self.inference.intra_threads)?;
        positive("inference.max_queue", self.inference.max_queue)?;
        positive("store.redis.pool_size", self.store.redis.pool_size)?;
        positive(
            "store.redis.max_command_buffer",
            self.store.redis.max_command_buffer,
        )?;
        positive("prefetch.max_concurrent", self.prefetch.max_concurrent)?;
        positive("prefetch.hot_keep", self.prefetch.hot_keep)?;
        for (key, d) in [
            ("inference.queue_timeout", self.inference.queue_timeout),
            ("limits.request_timeout", self.limits.request_timeout),
            (
                "store.redis.connect_timeout",
                self.store.redis.connect_timeout,
            ),
            (
                "store.redis.command_timeout",
                self.store.redis.command_timeout,
            ),
            ("store.redis.write_timeout", self.store.redis.write_timeout),
            (
                "store.redis.reconnect_min_delay",
                self.store.redis.reconnect_min_delay,
            ),
            (
                "prefetch.hot_flush_interval",
                self.prefetch.hot_flush_interval,
            ),
        ] {
            if d.is_zero() {
                return Err((key, "must be longer than 0".to_owned()));
            }
        }
        if self.store.redis.reconnect_max_delay < self.store.redis.reconnect_min_delay {
            return Err((
                "store.redis.reconnect_max_delay",
                "must not be shorter than store.redis.reconnect_min_delay".to_owned(),
            ));
        }
        if self.cache.max_bytes == 0 {
            return Err(("cache.max_bytes", "must be greater than 0".to_owned()));
        }
        if self.store.prefix.is_empty() || self.store.prefix.contains(char::is_whitespace) {
            return Err((
                "store.prefix",
                "expected a non-empty prefix without whitespace".to_owned(),
            ));
        }
        if tracing_subscriber::EnvFilter::try_new(&self.telemetry.log_level).is_err() {
            return Err((
                "telemetry.log_level",
                format!(
                    "`{}` is not a valid filter (try `info` or `hydrant=debug,info`)",
                    self.telemetry.log_level
                ),
            ));
        }
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

/// Durations written as `250ms`, `2s`, `5m`, `1h`, `30d`.
pub mod duration {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, de::Error};

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let s = String::deserialize(d)?;
        parse(&s).map_err(D::Error::custom)
    }

    /// Parses a duration such as `250ms` or `30d`.
    pub fn parse(s: &str) -> Result<Duration, String> {
        humantime::parse_duration(s.trim()).map_err(|_| {
            format!(
                "`{s}` is not a valid duration (expected e.g. `250ms`, `2s`, `5m`, `1h`, `30d`)"
            )
        })
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
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("h.toml");
        std::fs::write(
            &path,
            "[server]\nbind = \"127.0.0.1:1\"\n[limits]\nmax_candidates = 5\n",
        )
        .expect("write");
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
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("h.toml");
        std::fs::write(&path, "[server]\nbnd = \"127.0.0.1:1\"\n").expect("write");
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
        let e = Config::load(None, env(&[("HYDRANT_SERVER__BIND", "nowhere")]))
            .expect_err("must fail")
            .to_string();
        assert!(e.contains("server.bind"), "{e}");
        let e = Config::load(None, env(&[("HYDRANT_LIMITS__MAX_CANDIDATES", "0")]))
            .expect_err("must fail")
            .to_string();
        assert!(
            e.contains("limits.max_candidates") && e.contains("greater than 0"),
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

    #[test]
    fn the_shipped_config_file_is_valid() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/hydrant.toml");
        Config::load(Some(&path), []).expect("config/hydrant.toml must load");
    }
}
