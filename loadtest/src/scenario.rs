//! Scenario files: the TOML a person writes, parsed strictly and validated into a [`Scenario`].
//!
//! Parsing is two-step on purpose: serde (with `deny_unknown_fields`) rejects unknown keys and wrong
//! types with the line and key, then [`validate`] rejects impossible values ("rate 0") with the
//! dotted key and the reason. Targets are loopback-only: a load generator must never be pointed at
//! somebody else's machine by a typo.

use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use crate::drive::MAX_REQUESTS_PER_SEGMENT;

use serde::Deserialize;
use serde::de::{self, Deserializer, SeqAccess, Visitor};

/// Most candidates one request may carry (matches the gateway's own limit in the issue).
pub const MAX_CANDIDATES: u64 = 10_000;
/// Most concurrent requests (and so connections) one run may hold open.
pub const MAX_IN_FLIGHT: u64 = 10_000;
/// Largest key space; the Zipf sampler needs no table, so this only guards against typos.
pub const MAX_KEYS: u64 = 1_000_000_000;

/// Why a scenario was refused.
#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    #[error("cannot read scenario {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("scenario {origin}: {message}")]
    Parse { origin: String, message: String },
    #[error("scenario {origin}: `{key}` {reason}")]
    Invalid {
        origin: String,
        key: String,
        reason: String,
    },
    /// A well-formed `--target` whose host name does not resolve: the target cannot be reached
    /// (exit 1, as for a closed port), not a mistake in the scenario.
    #[error("target {url} is unreachable: {reason}")]
    Unresolved { url: String, reason: String },
}

impl ScenarioError {
    /// The exit code the command ends with: 1 for a target that cannot be reached, 2 for a mistake in
    /// the scenario or its command-line overrides.
    pub fn exit_code(&self) -> u8 {
        match self {
            ScenarioError::Unresolved { .. } => 1,
            _ => 2,
        }
    }

    /// The dotted key an [`ScenarioError::Invalid`] names (for tests and tooling).
    pub fn key(&self) -> Option<&str> {
        match self {
            ScenarioError::Invalid { key, .. } => Some(key),
            _ => None,
        }
    }
}

/// Request body encoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    #[default]
    Json,
    Msgpack,
}

impl Format {
    pub fn as_str(self) -> &'static str {
        match self {
            Format::Json => "json",
            Format::Msgpack => "msgpack",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
enum ModeName {
    OpenLoop,
    ClosedLoop,
    MaxThenFraction,
}

/// How one context field is generated per request.
#[derive(Debug, Clone, PartialEq)]
pub enum ContextGen {
    /// Uniform integer in `[lo, hi]`.
    IntRange([i64; 2]),
    /// Uniform float in `[lo, hi)`.
    FloatRange([f64; 2]),
    /// One of the listed values, uniformly.
    OneOf(Vec<ContextValue>),
    /// Always this value.
    Value(ContextValue),
}

const CONTEXT_GENERATORS: &[&str] = &["int_range", "float_range", "one_of", "value"];

impl<'de> Deserialize<'de> for ContextGen {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ContextGen;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(
                    "a table with one of int_range = [lo, hi], float_range = [lo, hi], one_of = [...] or value = ...",
                )
            }
            fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<ContextGen, A::Error> {
                let Some(key) = map.next_key::<String>()? else {
                    return Err(de::Error::custom(
                        "is empty: give one of int_range, float_range, one_of or value",
                    ));
                };
                let generator = match key.as_str() {
                    "int_range" => ContextGen::IntRange(map.next_value::<Pair<i64>>()?.0),
                    "float_range" => ContextGen::FloatRange(map.next_value::<Pair<f64>>()?.0),
                    "one_of" => ContextGen::OneOf(map.next_value()?),
                    "value" => ContextGen::Value(map.next_value()?),
                    other => return Err(de::Error::unknown_field(other, CONTEXT_GENERATORS)),
                };
                if let Some(more) = map.next_key::<String>()? {
                    return Err(de::Error::custom(format!(
                        "gives both `{key}` and `{more}`: give exactly one of int_range, float_range, one_of or value"
                    )));
                }
                Ok(generator)
            }
        }
        d.deserialize_map(V)
    }
}

/// `[lo, hi]`: exactly two elements (a plain `[T; 2]` would ignore a third).
struct Pair<T>([T; 2]);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Pair<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for V<T> {
            type Value = Pair<T>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an array of two numbers, [lo, hi]")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Pair<T>, A::Error> {
                let lo = seq
                    .next_element()?
                    .ok_or_else(|| de::Error::invalid_length(0, &self))?;
                let hi = seq
                    .next_element()?
                    .ok_or_else(|| de::Error::invalid_length(1, &self))?;
                let mut n = 2;
                while seq.next_element::<de::IgnoredAny>()?.is_some() {
                    n += 1;
                }
                if n > 2 {
                    return Err(de::Error::invalid_length(n, &self));
                }
                Ok(Pair([lo, hi]))
            }
        }
        d.deserialize_seq(V(std::marker::PhantomData))
    }
}

/// A context value as it goes on the wire.
#[derive(Debug, Clone, PartialEq)]
pub enum ContextValue {
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
}

impl ContextValue {
    /// The number, when it is NaN or an infinity: JSON cannot carry it.
    fn non_finite(&self) -> Option<f64> {
        match self {
            ContextValue::Float(f) if !f.is_finite() => Some(*f),
            _ => None,
        }
    }
}

impl<'de> Deserialize<'de> for ContextValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = ContextValue;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a boolean, a number or a string")
            }
            fn visit_bool<E: de::Error>(self, b: bool) -> Result<ContextValue, E> {
                Ok(ContextValue::Bool(b))
            }
            fn visit_i64<E: de::Error>(self, i: i64) -> Result<ContextValue, E> {
                Ok(ContextValue::Int(i))
            }
            fn visit_u64<E: de::Error>(self, u: u64) -> Result<ContextValue, E> {
                i64::try_from(u)
                    .map(ContextValue::Int)
                    .map_err(|_| E::custom(format!("{u} is outside the int64 range")))
            }
            fn visit_f64<E: de::Error>(self, f: f64) -> Result<ContextValue, E> {
                Ok(ContextValue::Float(f))
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<ContextValue, E> {
                Ok(ContextValue::Str(s.to_owned()))
            }
        }
        d.deserialize_any(V)
    }
}

/// `candidates = 100` or `candidates = [1, 10]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct CandidatesSpec {
    min: i64,
    max: i64,
}

impl<'de> Deserialize<'de> for CandidatesSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = CandidatesSpec;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a count (e.g. 100) or a [min, max] range (e.g. [1, 10])")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
                Ok(CandidatesSpec { min: v, max: v })
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                let v = i64::try_from(v).map_err(|_| E::custom("count too large"))?;
                Ok(CandidatesSpec { min: v, max: v })
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let min: i64 = seq
                    .next_element()?
                    .ok_or_else(|| de::Error::invalid_length(0, &self))?;
                let max: i64 = seq
                    .next_element()?
                    .ok_or_else(|| de::Error::invalid_length(1, &self))?;
                if seq.next_element::<de::IgnoredAny>()?.is_some() {
                    return Err(de::Error::invalid_length(3, &self));
                }
                Ok(CandidatesSpec { min, max })
            }
        }
        d.deserialize_any(V)
    }
}

/// The keys of [`RawScenario`] that are not tables.
const TOP_LEVEL_KEYS: [&str; 12] = [
    "name",
    "target",
    "model",
    "format",
    "timeout_ms",
    "timings",
    "seed",
    "client_threads",
    "max_error_rate",
    "ready_timeout_s",
    "candidates",
    "distinct_candidates",
];

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawScenario {
    name: Option<String>,
    target: String,
    model: String,
    #[serde(default)]
    format: Format,
    timeout_ms: Option<i64>,
    timings: Option<bool>,
    seed: Option<u64>,
    client_threads: Option<i64>,
    max_error_rate: Option<f64>,
    ready_timeout_s: Option<f64>,
    candidates: CandidatesSpec,
    distinct_candidates: Option<bool>,
    load: RawLoad,
    users: RawKeySpace,
    items: RawKeySpace,
    #[serde(default)]
    context: BTreeMap<String, ContextGen>,
    floor: Option<RawFloor>,
}

#[derive(Debug, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a [load] table (mode = ..., duration_s = ...)"
)]
struct RawLoad {
    mode: ModeName,
    rate: Option<f64>,
    concurrency: Option<Vec<i64>>,
    fraction: Option<f64>,
    duration_s: f64,
    warm_up_s: Option<f64>,
    step_s: Option<f64>,
    confirm_s: Option<f64>,
    max_in_flight: Option<i64>,
    late_threshold_ms: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a table such as [users] keys = 1000 (and zipf, entity, prefix)"
)]
struct RawKeySpace {
    entity: Option<String>,
    prefix: Option<String>,
    keys: i64,
    zipf: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a [floor] table (enabled = true, ...)"
)]
struct RawFloor {
    enabled: Option<bool>,
    url: Option<String>,
    scores: Option<i64>,
    threads: Option<i64>,
}

/// A loopback `http://` base URL, already resolved to a socket address (no DNS is ever done).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetUrl {
    pub addr: SocketAddr,
    /// `host:port` as written (goes into the Host header).
    pub authority: String,
    /// Path prefix without a trailing slash (usually empty).
    pub base_path: String,
}

impl fmt::Display for TargetUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "http://{}{}", self.authority, self.base_path)
    }
}

/// A number from a scenario file as a message quotes it: as written for the usual sizes, in exponent
/// form past them (`1e300`, not three hundred digits).
fn num(v: f64) -> String {
    if v.is_finite() && v != 0.0 && !(1e-6..1e15).contains(&v.abs()) {
        format!("{v:e}")
    } else {
        v.to_string()
    }
}

/// Parses `text` as an `http://` URL whose host is a loopback address; the error is the reason.
pub fn parse_loopback_url(text: &str) -> Result<TargetUrl, String> {
    let uri: hyper::Uri = text
        .parse()
        .map_err(|e| format!("is not a valid URL ({e}): {text:?}"))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some(other) => {
            return Err(format!(
                "uses scheme {other:?}; only http:// to a loopback address is supported"
            ));
        }
        None => {
            return Err(format!(
                "needs a scheme, e.g. http://127.0.0.1:8080 (got {text:?})"
            ));
        }
    }
    let authority = uri
        .authority()
        .ok_or_else(|| format!("has no host: {text:?}"))?;
    if authority.as_str().contains('@') {
        return Err("must not carry credentials".to_string());
    }
    if uri.query().is_some() {
        return Err("must not carry a query string".to_string());
    }
    // The URL parser drops a fragment without a word; a target that names one means something else.
    if text.contains('#') {
        return Err("must not carry a fragment (#...)".to_string());
    }
    let host = authority.host();
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let ip: IpAddr = if bare.eq_ignore_ascii_case("localhost") {
        IpAddr::V4(Ipv4Addr::LOCALHOST)
    } else {
        bare.parse().map_err(|_| {
            format!(
                "host {host:?} is not a loopback address; only 127.0.0.0/8, [::1] and localhost are allowed"
            )
        })?
    };
    if !ip.is_loopback() {
        return Err(format!(
            "host {host} is not a loopback address; only 127.0.0.0/8, [::1] and localhost are allowed"
        ));
    }
    let port = url_port(authority)?;
    let base_path = uri.path().trim_end_matches('/').to_string();
    Ok(TargetUrl {
        addr: SocketAddr::new(ip, port),
        authority: authority.as_str().to_string(),
        base_path,
    })
}

/// `host` (a name, or an address without brackets) and `port` as the first address they resolve to
/// (`--allow-remote`: a compose network's service names).
pub fn resolve(host: &str, port: u16) -> Result<SocketAddr, String> {
    std::net::ToSocketAddrs::to_socket_addrs(&(host, port))
        .map_err(|e| format!("cannot resolve {host}: {e}"))?
        .next()
        .ok_or_else(|| format!("{host} resolves to no address"))
}

/// An http:// URL with any host (`--allow-remote`), resolved once here; errors name `key`.
fn remote_target(key: &str, url: &str) -> Result<TargetUrl, ScenarioError> {
    let fail = |reason: String| ScenarioError::Invalid {
        origin: "command line".to_string(),
        key: key.to_string(),
        reason,
    };
    let uri: hyper::Uri = url
        .parse()
        .map_err(|e| fail(format!("is not a valid URL ({e}): {url:?}")))?;
    if uri.scheme_str() != Some("http") {
        return Err(fail("only http:// targets are supported".to_string()));
    }
    let authority = uri
        .authority()
        .ok_or_else(|| fail(format!("has no host: {url:?}")))?;
    let port = url_port(authority).map_err(fail)?;
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']');
    let unresolved = |reason: String| ScenarioError::Unresolved {
        url: url.to_string(),
        reason,
    };
    let addr = resolve(host, port).map_err(unresolved)?;
    Ok(TargetUrl {
        addr,
        authority: authority.as_str().to_string(),
        base_path: uri.path().trim_end_matches('/').to_string(),
    })
}

/// The URL's port, 80 when it names none. (`Authority::port` is `None` both for no port and for one
/// past 65535, which would silently load port 80; so the text after the host is read here.)
fn url_port(authority: &hyper::http::uri::Authority) -> Result<u16, String> {
    let text = authority.as_str();
    // `user:password@host:port`: the colon that counts comes after the `@`.
    let text = text.rsplit_once('@').map_or(text, |(_, host)| host);
    let after_host = text.rfind(']').map_or(text, |i| &text[i + 1..]);
    match after_host.rsplit_once(':') {
        None => Ok(80),
        Some((_, p)) => match p.parse::<u16>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(format!("port must be 1-65535 (got {p:?})")),
        },
    }
}

/// A key space: `{prefix}{index}` for index in `0..keys`, drawn by Zipf rank (rank 1 = index 0).
#[derive(Debug, Clone, PartialEq)]
pub struct KeySpace {
    pub entity: String,
    pub prefix: String,
    pub keys: u64,
    pub zipf: f64,
}

/// The load shape of a run.
#[derive(Debug, Clone, PartialEq)]
pub enum Mode {
    /// Fixed schedule at `rate` requests/s.
    OpenLoop { rate: f64 },
    /// One measured step per concurrency.
    ClosedLoop { concurrency: Vec<usize> },
    /// Closed-loop sweep (`step` per concurrency) to find the max throughput, then open loop at
    /// `fraction` of it for the run's duration. With a non-zero `confirm`, hydrant and the floor are
    /// each run again at the concurrency of their best step for that long, and those runs, not the
    /// sweep's best steps, give the maximum (see `load.confirm_s` in the load tester's README).
    MaxThenFraction {
        concurrency: Vec<usize>,
        fraction: f64,
        step: Duration,
        confirm: Duration,
    },
}

impl Mode {
    pub fn name(&self) -> &'static str {
        match self {
            Mode::OpenLoop { .. } => "open-loop",
            Mode::ClosedLoop { .. } => "closed-loop",
            Mode::MaxThenFraction { .. } => "max-then-fraction",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Load {
    pub mode: Mode,
    /// Measured time of the open-loop phase, or of each closed-loop step.
    pub duration: Duration,
    pub warm_up: Duration,
    pub max_in_flight: usize,
    pub late_threshold: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidates {
    pub min: usize,
    pub max: usize,
    pub distinct: bool,
}

/// Most worker threads of the in-process floor.
pub const MAX_FLOOR_THREADS: usize = 64;

/// Worker threads of the in-process floor when neither the scenario nor the gateway says how many.
pub const DEFAULT_FLOOR_THREADS: usize = 2;

/// The floor: the cheapest server on hydrant's own HTTP stack, driven with the same mix, for comparison.
#[derive(Debug, Clone, PartialEq)]
pub struct Floor {
    /// An already running floor (`loadtest floor`); `None` spawns one in-process.
    pub url: Option<TargetUrl>,
    /// Scores in the floor's fixed answer (so its size is like a real one).
    pub scores: usize,
    /// Worker threads of the in-process floor's runtime; `None`: as many as the gateway's async workers
    /// (`workers` in its `/v1/stats`), so that both servers run the same stack on as many threads.
    pub threads: Option<usize>,
}

/// A validated scenario.
#[derive(Debug, Clone, PartialEq)]
pub struct Scenario {
    pub name: String,
    pub target: TargetUrl,
    pub model: String,
    pub format: Format,
    pub timeout: Duration,
    pub timings: bool,
    pub seed: u64,
    pub client_threads: usize,
    pub max_error_rate: Option<f64>,
    pub ready_timeout: Duration,
    pub load: Load,
    pub users: KeySpace,
    pub items: KeySpace,
    pub candidates: Candidates,
    pub context: Vec<(String, ContextGen)>,
    pub floor: Option<Floor>,
    /// The TOML as read, echoed in the report.
    pub source: String,
}

struct Check<'a> {
    origin: &'a str,
}

impl Check<'_> {
    fn fail<T>(&self, key: &str, reason: impl Into<String>) -> Result<T, ScenarioError> {
        Err(ScenarioError::Invalid {
            origin: self.origin.to_string(),
            key: key.to_string(),
            reason: reason.into(),
        })
    }

    fn positive_f64(&self, key: &str, v: f64, max: f64) -> Result<f64, ScenarioError> {
        if !v.is_finite() {
            return self.fail(key, format!("must be a finite number (got {})", num(v)));
        }
        if v <= 0.0 {
            return self.fail(key, format!("must be greater than 0 (got {})", num(v)));
        }
        if v > max {
            return self.fail(key, format!("must be at most {max} (got {})", num(v)));
        }
        Ok(v)
    }

    /// A phase of `seconds` at `rate` stays within [`MAX_REQUESTS_PER_SEGMENT`] sends: past it the
    /// schedule would stop early, measuring less than was asked for. The error is filed under `key`
    /// and names `with`, the other of the two it multiplies.
    fn within_segment_cap(
        &self,
        key: &str,
        with: &str,
        rate: f64,
        seconds: f64,
    ) -> Result<(), ScenarioError> {
        let sends = rate * seconds;
        if sends > MAX_REQUESTS_PER_SEGMENT as f64 {
            return self.fail(
                key,
                format!(
                    "x {with} must schedule at most {MAX_REQUESTS_PER_SEGMENT} requests in one phase (got {} rps x {} s = {}): lower one of them",
                    num(rate),
                    num(seconds),
                    num(sends.round())
                ),
            );
        }
        Ok(())
    }

    fn non_negative_f64(&self, key: &str, v: f64, max: f64) -> Result<f64, ScenarioError> {
        if !v.is_finite() {
            return self.fail(key, format!("must be a finite number (got {})", num(v)));
        }
        if v < 0.0 {
            return self.fail(key, format!("must be 0 or more (got {})", num(v)));
        }
        if v > max {
            return self.fail(key, format!("must be at most {max} (got {})", num(v)));
        }
        Ok(v)
    }

    fn int_in(&self, key: &str, v: i64, min: i64, max: i64) -> Result<u64, ScenarioError> {
        if v < min || v > max {
            return self.fail(key, format!("must be between {min} and {max} (got {v})"));
        }
        // min >= 0 at every call site, so the value is non-negative here.
        u64::try_from(v).or_else(|_| self.fail(key, format!("must not be negative (got {v})")))
    }

    fn name_like(&self, key: &str, v: &str) -> Result<(), ScenarioError> {
        let ok = !v.is_empty()
            && v.len() <= 128
            && v.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
        if ok {
            Ok(())
        } else {
            self.fail(
                key,
                format!("must be 1-128 characters of A-Z a-z 0-9 _ - . (got {v:?})"),
            )
        }
    }

    fn target(&self, key: &str, v: &str) -> Result<TargetUrl, ScenarioError> {
        parse_loopback_url(v).or_else(|reason| self.fail(key, reason))
    }

    fn unused<T>(&self, key: &str, v: &Option<T>, mode: &str) -> Result<(), ScenarioError> {
        if v.is_some() {
            return self.fail(
                key,
                format!("is not used when load.mode = {mode:?}; remove it"),
            );
        }
        Ok(())
    }

    fn concurrency(
        &self,
        v: Option<Vec<i64>>,
        max_in_flight: usize,
    ) -> Result<Vec<usize>, ScenarioError> {
        let key = "load.concurrency";
        let Some(list) = v else {
            return self.fail(key, "is required for this load.mode (e.g. [1, 2, 4, 8])");
        };
        if list.is_empty() {
            return self.fail(key, "must list at least one concurrency");
        }
        if list.len() > 64 {
            return self.fail(key, "must list at most 64 concurrencies");
        }
        let mut out = Vec::with_capacity(list.len());
        for c in list {
            let c = self.int_in(key, c, 1, MAX_IN_FLIGHT as i64)? as usize;
            if c > max_in_flight {
                return self.fail(
                    key,
                    format!("{c} exceeds load.max_in_flight ({max_in_flight})"),
                );
            }
            out.push(c);
        }
        Ok(out)
    }

    fn key_space(
        &self,
        table: &str,
        raw: RawKeySpace,
        default_entity: &str,
        default_prefix: &str,
    ) -> Result<KeySpace, ScenarioError> {
        let entity = raw.entity.unwrap_or_else(|| default_entity.to_string());
        // An entity is a field name in the request: hydrant names entities like identifiers.
        let ident = entity
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && entity
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !ident || entity.len() > 64 {
            return self.fail(
                &format!("{table}.entity"),
                format!("must be 1-64 characters of A-Z a-z 0-9 _, not starting with a digit (got {entity:?})"),
            );
        }
        let prefix = raw.prefix.unwrap_or_else(|| default_prefix.to_string());
        if prefix.len() > 64 {
            return self.fail(&format!("{table}.prefix"), "must be at most 64 characters");
        }
        let keys = self.int_in(&format!("{table}.keys"), raw.keys, 1, MAX_KEYS as i64)?;
        let zipf = raw.zipf.unwrap_or(0.0);
        let zkey = format!("{table}.zipf");
        if !zipf.is_finite() {
            return self.fail(
                &zkey,
                format!("must be a finite number (got {})", num(zipf)),
            );
        }
        if zipf < 0.0 {
            return self.fail(
                &zkey,
                format!(
                    "is a Zipf exponent and must be 0 (uniform) or more (got {})",
                    num(zipf)
                ),
            );
        }
        if zipf > 20.0 {
            return self.fail(&zkey, format!("must be at most 20 (got {})", num(zipf)));
        }
        Ok(KeySpace {
            entity,
            prefix,
            keys,
            zipf,
        })
    }

    /// Refuses a context value of NaN or infinity (`non_finite`), which JSON would send as null.
    fn finite(&self, key: &str, non_finite: Option<f64>) -> Result<(), ScenarioError> {
        match non_finite {
            Some(f) => self.fail(
                key,
                format!(
                    "values must be finite numbers (got {f}): JSON cannot carry NaN or infinity"
                ),
            ),
            None => Ok(()),
        }
    }

    fn context(&self, key: &str, g: &ContextGen) -> Result<(), ScenarioError> {
        match g {
            ContextGen::IntRange([lo, hi]) if lo > hi => {
                self.fail(key, format!("int_range needs lo <= hi (got [{lo}, {hi}])"))
            }
            // hi - lo must be finite too: the draw is lo + (hi - lo) * u.
            ContextGen::FloatRange([lo, hi]) if !(lo <= hi && (hi - lo).is_finite()) => self.fail(
                key,
                format!(
                    "float_range needs finite lo <= hi, less than 1.7e308 apart (got [{lo}, {hi}])"
                ),
            ),
            ContextGen::OneOf(v) if v.is_empty() => {
                self.fail(key, "one_of needs at least one value")
            }
            ContextGen::Value(v) => self.finite(key, v.non_finite()),
            ContextGen::OneOf(v) => self.finite(key, v.iter().find_map(ContextValue::non_finite)),
            _ => Ok(()),
        }
    }
}

/// A top-level key written below `[context]` whose value is no generator table (`max_error_rate = 0.5`
/// after the last header), if the text is TOML at all.
fn top_level_key_in_context(text: &str) -> Option<&'static str> {
    let table: toml::Table = toml::from_str(text).ok()?;
    let context = table.get("context")?.as_table()?;
    TOP_LEVEL_KEYS
        .into_iter()
        .find(|k| context.get(*k).is_some_and(|v| !v.is_table()))
}

/// The largest scenario file read: a scenario is a page of TOML, and a path to something else (a device,
/// a pipe that never ends, a data file named by mistake) must be an error, not a read without end.
pub const MAX_SCENARIO_BYTES: u64 = 1 << 20;

/// Reads a small text file whole, or says it is larger than `max` bytes without reading past them.
pub fn read_at_most(path: &Path, max: u64) -> std::io::Result<String> {
    use std::io::Read as _;
    let mut text = String::new();
    std::fs::File::open(path)?
        .take(max + 1)
        .read_to_string(&mut text)?;
    if text.len() as u64 > max {
        return Err(std::io::Error::other(format!(
            "it is larger than {} KiB, which no file of this kind is",
            max / 1024
        )));
    }
    Ok(text)
}

impl Scenario {
    /// Reads and validates a scenario file; its name defaults to the file stem.
    pub fn load(path: &Path) -> Result<Scenario, ScenarioError> {
        let text =
            read_at_most(path, MAX_SCENARIO_BYTES).map_err(|source| ScenarioError::Read {
                path: path.display().to_string(),
                source,
            })?;
        let stem = path
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or("scenario");
        Scenario::from_toml_str(&text, &path.display().to_string(), stem)
    }

    /// Parses and validates scenario TOML. `origin` names it in errors.
    pub fn from_toml_str(
        text: &str,
        origin: &str,
        default_name: &str,
    ) -> Result<Scenario, ScenarioError> {
        let raw: RawScenario = toml::from_str(text).map_err(|e| {
            let mut message = e.to_string().trim_end().to_string();
            // A top-level key written after a `[table]` header lands in that table.
            if let Some(key) = TOP_LEVEL_KEYS
                .iter()
                .find(|k| message.contains(&format!("unknown field `{k}`")))
            {
                message.push_str(&format!(
                    "\nhint: `{key}` is a top-level key: write it above the first [table] header"
                ));
            } else if let Some(key) = top_level_key_in_context(text) {
                // [context] takes any field name, so there the key is no unknown field: it is a
                // context field whose value is no generator.
                message.push_str(&format!(
                    "\nhint: `{key}` is a top-level key, but written below [context] it is read as the context field `context.{key}`: write it above the first [table] header"
                ));
            }
            ScenarioError::Parse {
                origin: origin.to_string(),
                message,
            }
        })?;
        validate(raw, text, origin, default_name)
    }

    /// `--target`: replaces the target (still loopback-only).
    pub fn override_target(&mut self, url: &str) -> Result<(), ScenarioError> {
        let check = Check {
            origin: "command line",
        };
        self.target = check.target("--target", url)?;
        self.note_override(&format!("--target {url}"));
        Ok(())
    }

    /// `--target` with `--allow-remote`: any http:// host, resolved once here (the compose network).
    pub fn override_target_remote(&mut self, url: &str) -> Result<(), ScenarioError> {
        self.target = remote_target("--target", url)?;
        self.note_override(&format!("--target {url} --allow-remote"));
        Ok(())
    }

    /// `--floor-url`: drive the floor at `url` (a `loadtest floor` already running) rather than one
    /// in-process, turning the floor on if the scenario left it off. Loopback only unless
    /// `allow_remote` (the compose network, where the floor is a service of its own).
    pub fn override_floor_url(
        &mut self,
        url: &str,
        allow_remote: bool,
    ) -> Result<(), ScenarioError> {
        let target = if allow_remote {
            remote_target("--floor-url", url)?
        } else {
            Check {
                origin: "command line",
            }
            .target("--floor-url", url)?
        };
        match &mut self.floor {
            Some(f) => f.url = Some(target),
            None => {
                self.floor = Some(Floor {
                    url: Some(target),
                    scores: self.candidates.max,
                    threads: None,
                })
            }
        }
        self.note_override(&format!("--floor-url {url}"));
        Ok(())
    }

    /// `--duration-s`: replaces the measured duration; warm-up and sweep steps are shortened to
    /// at most the same, so a quick run stays quick.
    pub fn override_duration_s(&mut self, seconds: f64) -> Result<(), ScenarioError> {
        let check = Check {
            origin: "command line",
        };
        let s = check.positive_f64("--duration-s", seconds, 86_400.0)?;
        // Any positive rate and duration schedule at least the request due at the start.
        if let Mode::OpenLoop { rate } = self.load.mode {
            check.within_segment_cap("--duration-s", "load.rate", rate, s)?;
        }
        let d = Duration::from_secs_f64(s);
        self.load.duration = d;
        self.load.warm_up = self.load.warm_up.min(d);
        if let Mode::MaxThenFraction { step, confirm, .. } = &mut self.load.mode {
            *step = (*step).min(d);
            *confirm = (*confirm).min(d);
        }
        self.note_override(&format!("--duration-s {s}"));
        Ok(())
    }

    /// Records a command-line override under the echoed TOML, so the report says what really ran.
    fn note_override(&mut self, flag: &str) {
        if !self.source.ends_with('\n') {
            self.source.push('\n');
        }
        self.source
            .push_str(&format!("# overridden on the command line: {flag}\n"));
    }

    /// Roughly how long the run takes, floor alternation included.
    pub fn planned_duration(&self) -> Duration {
        let floor_factor = if self.floor.is_some() { 2 } else { 1 };
        let floor_warm = if self.floor.is_some() {
            self.load.warm_up.min(Duration::from_secs(1))
        } else {
            Duration::ZERO
        };
        let measured = match &self.load.mode {
            Mode::OpenLoop { .. } => self.load.duration,
            Mode::ClosedLoop { concurrency } => self.load.duration * concurrency.len() as u32,
            Mode::MaxThenFraction {
                concurrency,
                step,
                confirm,
                ..
            } => *step * concurrency.len() as u32 + *confirm + self.load.duration,
        };
        self.load.warm_up + floor_warm + measured * floor_factor
    }
}

fn validate(
    raw: RawScenario,
    text: &str,
    origin: &str,
    default_name: &str,
) -> Result<Scenario, ScenarioError> {
    let c = Check { origin };
    // A name starting with `.` (`.`, `..`, or `.toml` from a file named `.toml`) would name hidden or
    // parent-relative result files.
    let hidden = |name: &str| name.starts_with('.');
    let name = match raw.name {
        Some(name) => {
            c.name_like("name", &name)?;
            if hidden(&name) {
                return c.fail(
                    "name",
                    format!("must not start with `.`: it names the result files, which would be hidden (got {name:?})"),
                );
            }
            name
        }
        // The name comes from the file: say so, since the user never wrote a `name`.
        None => {
            if c.name_like("name", default_name).is_err() || hidden(default_name) {
                return c.fail(
                    "name",
                    format!(
                        "is taken from the file name, {default_name:?}, which is not 1-128 characters of A-Z a-z 0-9 _ - . not starting with `.` (it names the result files): rename the file or set `name`"
                    ),
                );
            }
            default_name.to_string()
        }
    };
    let target = c.target("target", &raw.target)?;
    c.name_like("model", &raw.model)?;
    let timeout_ms = c.int_in("timeout_ms", raw.timeout_ms.unwrap_or(2_000), 1, 600_000)?;
    let client_threads = c.int_in("client_threads", raw.client_threads.unwrap_or(1), 1, 64)?;
    let max_error_rate = match raw.max_error_rate {
        Some(r) if !(0.0..=1.0).contains(&r) => {
            return c.fail(
                "max_error_rate",
                format!("must be between 0 and 1 (got {})", num(r)),
            );
        }
        other => other,
    };
    let ready_timeout_s = c.non_negative_f64(
        "ready_timeout_s",
        raw.ready_timeout_s.unwrap_or(30.0),
        600.0,
    )?;

    let l = raw.load;
    let max_in_flight = c.int_in(
        "load.max_in_flight",
        l.max_in_flight.unwrap_or(512),
        1,
        MAX_IN_FLIGHT as i64,
    )? as usize;
    let duration_s = c.positive_f64("load.duration_s", l.duration_s, 86_400.0)?;
    let warm_up_s = c.non_negative_f64("load.warm_up_s", l.warm_up_s.unwrap_or(0.0), 3_600.0)?;
    let late_ms = c.positive_f64(
        "load.late_threshold_ms",
        l.late_threshold_ms.unwrap_or(1.0),
        60_000.0,
    )?;
    let mode = match l.mode {
        ModeName::OpenLoop => {
            let mode = "open-loop";
            c.unused("load.concurrency", &l.concurrency, mode)?;
            c.unused("load.fraction", &l.fraction, mode)?;
            c.unused("load.step_s", &l.step_s, mode)?;
            c.unused("load.confirm_s", &l.confirm_s, mode)?;
            let Some(rate) = l.rate else {
                return c.fail("load.rate", "is required when load.mode = \"open-loop\"");
            };
            // Any positive rate and duration schedule at least the request due at the start (a
            // phase sends `ceil(rate x duration)`).
            let rate = c.positive_f64("load.rate", rate, 1_000_000.0)?;
            c.within_segment_cap("load.rate", "load.duration_s", rate, duration_s)?;
            c.within_segment_cap("load.rate", "load.warm_up_s", rate, warm_up_s)?;
            Mode::OpenLoop { rate }
        }
        ModeName::ClosedLoop => {
            let mode = "closed-loop";
            c.unused("load.rate", &l.rate, mode)?;
            c.unused("load.fraction", &l.fraction, mode)?;
            c.unused("load.step_s", &l.step_s, mode)?;
            c.unused("load.confirm_s", &l.confirm_s, mode)?;
            // A closed loop sends when the previous answer arrives: there is no schedule to be late for.
            c.unused("load.late_threshold_ms", &l.late_threshold_ms, mode)?;
            Mode::ClosedLoop {
                concurrency: c.concurrency(l.concurrency, max_in_flight)?,
            }
        }
        ModeName::MaxThenFraction => {
            c.unused("load.rate", &l.rate, "max-then-fraction")?;
            let concurrency = c.concurrency(l.concurrency, max_in_flight)?;
            let Some(fraction) = l.fraction else {
                return c.fail(
                    "load.fraction",
                    "is required when load.mode = \"max-then-fraction\" (e.g. 0.5)",
                );
            };
            let fraction = c.positive_f64("load.fraction", fraction, 1.0)?;
            let step_s = c.positive_f64(
                "load.step_s",
                l.step_s.unwrap_or(duration_s.min(5.0)),
                3_600.0,
            )?;
            let confirm_s =
                c.non_negative_f64("load.confirm_s", l.confirm_s.unwrap_or(0.0), 3_600.0)?;
            Mode::MaxThenFraction {
                concurrency,
                fraction,
                step: Duration::from_secs_f64(step_s),
                confirm: Duration::from_secs_f64(confirm_s),
            }
        }
    };

    let users = c.key_space("users", raw.users, "user_id", "u_")?;
    let items = c.key_space("items", raw.items, "item_id", "i_")?;
    if users.entity == items.entity {
        // Every request would name the entity twice, once for all rows and once per candidate.
        return c.fail(
            "items.entity",
            format!(
                "must differ from users.entity (both are {:?}): the user's key and the candidates' keys are different entities",
                items.entity
            ),
        );
    }

    let cand = raw.candidates;
    if cand.min < 1 {
        return c.fail(
            "candidates",
            format!("must be at least 1 per request (got {})", cand.min),
        );
    }
    if cand.max > MAX_CANDIDATES as i64 {
        return c.fail(
            "candidates",
            format!(
                "must be at most {MAX_CANDIDATES} per request (got {})",
                cand.max
            ),
        );
    }
    if cand.min > cand.max {
        return c.fail(
            "candidates",
            format!("range needs min <= max (got [{}, {}])", cand.min, cand.max),
        );
    }
    let distinct = raw.distinct_candidates.unwrap_or(true);
    if distinct && cand.max as u64 > items.keys {
        return c.fail(
            "candidates",
            format!(
                "asks for up to {} distinct candidates but items.keys is only {}",
                cand.max, items.keys
            ),
        );
    }

    let mut context = Vec::with_capacity(raw.context.len());
    for (field, g) in raw.context {
        c.context(&format!("context.{field}"), &g)?;
        context.push((field, g));
    }

    let floor = match raw.floor {
        None => None,
        // A [floor] that sets something but not `enabled` is ambiguous: say which it is.
        Some(f)
            if f.enabled.is_none()
                && (f.url.is_some() || f.scores.is_some() || f.threads.is_some()) =>
        {
            return c.fail(
                "floor.enabled",
                "is required when [floor] sets other keys: true to drive the floor, false to skip it",
            );
        }
        Some(f) if f.enabled != Some(true) => None,
        Some(f) => {
            let url = match f.url {
                Some(u) => Some(c.target("floor.url", &u)?),
                None => None,
            };
            let scores = c.int_in(
                "floor.scores",
                f.scores.unwrap_or(cand.max),
                1,
                MAX_CANDIDATES as i64,
            )? as usize;
            let threads = f
                .threads
                .map(|t| c.int_in("floor.threads", t, 1, MAX_FLOOR_THREADS as i64))
                .transpose()?
                .map(|t| t as usize);
            Some(Floor {
                url,
                scores,
                threads,
            })
        }
    };

    Ok(Scenario {
        name,
        target,
        model: raw.model,
        format: raw.format,
        timeout: Duration::from_millis(timeout_ms),
        timings: raw.timings.unwrap_or(true),
        seed: raw.seed.unwrap_or(1),
        client_threads: client_threads as usize,
        max_error_rate,
        ready_timeout: Duration::from_secs_f64(ready_timeout_s),
        load: Load {
            mode,
            duration: Duration::from_secs_f64(duration_s),
            warm_up: Duration::from_secs_f64(warm_up_s),
            max_in_flight,
            late_threshold: Duration::from_secs_f64(late_ms / 1000.0),
        },
        users,
        items,
        candidates: Candidates {
            min: cand.min as usize,
            max: cand.max as usize,
            distinct,
        },
        context,
        floor,
        source: text.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = r#"
target = "http://127.0.0.1:8080"
model = "ctr"
candidates = 1

[load]
mode = "open-loop"
rate = 100
duration_s = 5

[users]
keys = 1000
zipf = 1.1

[items]
keys = 2000
"#;

    fn parse(text: &str) -> Result<Scenario, ScenarioError> {
        Scenario::from_toml_str(text, "test.toml", "test")
    }

    fn invalid(text: &str) -> (String, String) {
        match parse(text) {
            Err(e @ ScenarioError::Invalid { .. }) => {
                (e.key().unwrap_or_default().to_string(), e.to_string())
            }
            other => panic!("expected an invalid-value error, got {other:?}"),
        }
    }

    #[test]
    fn base_parses_with_defaults() {
        let s = parse(BASE).expect("base scenario");
        assert_eq!(s.name, "test");
        assert_eq!(s.users.entity, "user_id");
        assert_eq!(s.items.prefix, "i_");
        assert_eq!(s.load.mode, Mode::OpenLoop { rate: 100.0 });
        assert_eq!(s.target.addr, "127.0.0.1:8080".parse().expect("addr"));
        assert!(s.floor.is_none());
    }

    #[test]
    fn unknown_key_is_rejected_by_name() {
        let text = BASE.replace("rate = 100", "rate = 100\nrat = 5");
        let err = parse(&text).expect_err("unknown key");
        let msg = err.to_string();
        assert!(msg.contains("unknown field `rat`"), "{msg}");
        let text = BASE.replace("keys = 1000", "keys = 1000\nzipff = 1.0");
        let msg = parse(&text).expect_err("unknown key").to_string();
        assert!(msg.contains("zipff"), "{msg}");
    }

    #[test]
    fn impossible_values_name_key_and_reason() {
        let (key, msg) = invalid(&BASE.replace("rate = 100", "rate = 0"));
        assert_eq!(key, "load.rate");
        assert!(msg.contains("greater than 0"), "{msg}");

        let (key, msg) = invalid(&BASE.replace("zipf = 1.1", "zipf = -0.5"));
        assert_eq!(key, "users.zipf");
        assert!(msg.contains("0 (uniform) or more"), "{msg}");

        // A huge number is quoted as a number, not three hundred digits.
        let (key, msg) = invalid(&BASE.replace("zipf = 1.1", "zipf = 1e300"));
        assert_eq!(key, "users.zipf");
        assert!(msg.ends_with("(got 1e300)"), "{msg}");
        let (_, msg) = invalid(&BASE.replace("rate = 100", "rate = 1e300"));
        assert!(msg.ends_with("(got 1e300)"), "{msg}");

        let (key, msg) = invalid(&BASE.replace("duration_s = 5", "duration_s = 0"));
        assert_eq!(key, "load.duration_s");
        assert!(msg.contains("greater than 0"), "{msg}");

        // Infinity is not "less than 0": the reason says what it is.
        for inf in ["inf", "-inf", "nan"] {
            let (key, msg) = invalid(&BASE.replace(
                "duration_s = 5",
                &format!("duration_s = 5\nwarm_up_s = {inf}"),
            ));
            assert_eq!(key, "load.warm_up_s");
            assert!(msg.contains("must be a finite number"), "{msg}");
        }

        let (key, msg) = invalid(&BASE.replace("candidates = 1", "candidates = 0"));
        assert_eq!(key, "candidates");
        assert!(msg.contains("at least 1"), "{msg}");

        let (key, msg) = invalid(&BASE.replace("candidates = 1", "candidates = 10001"));
        assert_eq!(key, "candidates");
        assert!(msg.contains("at most 10000"), "{msg}");

        let (key, msg) = invalid(&BASE.replace("127.0.0.1", "10.0.0.5"));
        assert_eq!(key, "target");
        assert!(msg.contains("not a loopback"), "{msg}");

        let (key, _) = invalid(&BASE.replace("127.0.0.1:8080", "example.com"));
        assert_eq!(key, "target");

        let (key, msg) = invalid(&BASE.replace("rate = 100", "concurrency = [1]"));
        assert_eq!(key, "load.concurrency");
        assert!(msg.contains("not used"), "{msg}");
    }

    #[test]
    fn a_name_that_would_hide_the_result_files_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        // A file named `.toml` has the stem `.toml`, not an empty one.
        let path = dir.path().join(".toml");
        std::fs::write(&path, BASE).expect("write");
        let err = Scenario::load(&path).expect_err("a hidden name");
        assert!(
            err.to_string()
                .contains("is taken from the file name, \".toml\""),
            "{err}"
        );
        for name in [".", "..", ".hidden"] {
            let (key, msg) = invalid(&format!("name = \"{name}\"\n{BASE}"));
            assert_eq!(key, "name");
            assert!(msg.contains("must not start with `.`"), "{msg}");
        }
        // A dot inside is fine.
        let path = dir.path().join("hot-path.v2.toml");
        std::fs::write(&path, BASE).expect("write");
        assert_eq!(
            Scenario::load(&path).expect("a dotted name").name,
            "hot-path.v2"
        );
    }

    #[test]
    fn modes_need_their_keys() {
        let text = BASE.replace(
            "mode = \"open-loop\"\nrate = 100",
            "mode = \"max-then-fraction\"\nconcurrency = [1, 2]",
        );
        let (key, _) = invalid(&text);
        assert_eq!(key, "load.fraction");
        let ok = text.replace(
            "concurrency = [1, 2]",
            "concurrency = [1, 2]\nfraction = 0.5\nstep_s = 2",
        );
        let s = parse(&ok).expect("max-then-fraction");
        assert_eq!(
            s.load.mode,
            Mode::MaxThenFraction {
                concurrency: vec![1, 2],
                fraction: 0.5,
                step: Duration::from_secs(2),
                confirm: Duration::ZERO,
            }
        );
        let (key, _) = invalid(&ok.replace("fraction = 0.5", "fraction = 1.5"));
        assert_eq!(key, "load.fraction");
        // The confirming runs: a length of time, in this mode only.
        let confirmed =
            parse(&ok.replace("step_s = 2", "step_s = 2\nconfirm_s = 6")).expect("confirm_s");
        assert!(matches!(
            confirmed.load.mode,
            Mode::MaxThenFraction { confirm, .. } if confirm == Duration::from_secs(6)
        ));
        assert_eq!(
            confirmed.planned_duration(),
            parse(&ok).expect("max-then-fraction").planned_duration() + Duration::from_secs(6)
        );
        let (key, why) = invalid(&ok.replace("step_s = 2", "step_s = 2\nconfirm_s = -1"));
        assert_eq!(key, "load.confirm_s");
        assert!(why.contains("0"), "{why}");
        let (key, why) = invalid(&BASE.replace("rate = 100", "rate = 100\nconfirm_s = 5"));
        assert_eq!(key, "load.confirm_s");
        assert!(why.contains("open-loop"), "{why}");
    }

    #[test]
    fn candidates_range_and_context() {
        let text = BASE.replace("candidates = 1", "candidates = [1, 10]")
            + "\n[context]\nhour_of_day = { int_range = [0, 23] }\ndevice = { one_of = [\"ios\", \"android\", \"web\"] }\n";
        let s = parse(&text).expect("range");
        assert_eq!((s.candidates.min, s.candidates.max), (1, 10));
        assert_eq!(s.context.len(), 2);
        let (key, _) = invalid(&text.replace("[0, 23]", "[23, 0]"));
        assert_eq!(key, "context.hour_of_day");
        let wide = text.replace(
            "{ int_range = [0, 23] }",
            "{ float_range = [-1e308, 1e308] }",
        );
        let (key, reason) = invalid(&wide);
        assert_eq!(key, "context.hour_of_day", "{reason}");
        // NaN and infinity cannot go in a JSON body: refused, not sent as null.
        for generator in [
            "{ value = nan }",
            "{ one_of = [1.5, inf] }",
            "{ one_of = [\"a\", -nan] }",
        ] {
            let (key, reason) = invalid(&text.replace("{ int_range = [0, 23] }", generator));
            assert_eq!(key, "context.hour_of_day", "{generator}: {reason}");
            assert!(
                reason.contains("must be finite numbers"),
                "{generator}: {reason}"
            );
        }
        // The user's entity and the candidates' are two entities.
        let (key, reason) = invalid(&text.replace(
            "[items]\nkeys = 2000",
            "[items]\nkeys = 2000\nentity = \"user_id\"",
        ));
        assert_eq!(key, "items.entity", "{reason}");
        let bad = BASE.replace("candidates = 1", "candidates = \"many\"");
        let msg = parse(&bad).expect_err("bad type").to_string();
        assert!(msg.contains("[min, max]"), "{msg}");
        // A top-level key written below [context] reads as a context field: the error says so.
        let msg = parse(&(text.clone() + "max_error_rate = 0.5\n"))
            .expect_err("no generator")
            .to_string();
        assert!(
            msg.contains("hint: `max_error_rate` is a top-level key, but written below [context] it is read as the context field `context.max_error_rate`"),
            "{msg}"
        );

        // Generators of the wrong shape are refused with what was expected, not ignored in part.
        let base = BASE.to_string() + "\n[context]\n";
        for (generator, expected) in [
            (
                "{ int_range = [1, 2, 100] }",
                "invalid length 3, expected an array of two numbers",
            ),
            (
                "{ float_range = [0.0] }",
                "invalid length 1, expected an array of two numbers",
            ),
            (
                "{ int_range = [0, 1], value = 3 }",
                "gives both `int_range` and `value`",
            ),
            (
                "{ range = [0, 1] }",
                "unknown field `range`, expected one of `int_range`",
            ),
            (
                "{ value = { a = 1 } }",
                "expected a boolean, a number or a string",
            ),
            (
                "{ value = [1, 2] }",
                "expected a boolean, a number or a string",
            ),
            ("{ }", "is empty: give one of int_range"),
            ("3", "expected a table with one of int_range"),
        ] {
            let msg = parse(&format!("{base}h = {generator}\n"))
                .expect_err(generator)
                .to_string();
            assert!(msg.contains(expected), "{generator}: {msg}");
        }
        let s = parse(&format!(
            "{base}h = {{ float_range = [0, 1] }}\nv = {{ value = 2 }}\n"
        ))
        .expect("integers are numbers");
        assert_eq!(s.context[0].1, ContextGen::FloatRange([0.0, 1.0]));
        assert_eq!(s.context[1].1, ContextGen::Value(ContextValue::Int(2)));

        let top = format!(
            "users = 5\n{}",
            BASE.replace("[users]\nkeys = 1000\nzipf = 1.1", "")
        );
        let msg = parse(&top).expect_err("not a table").to_string();
        assert!(msg.contains("a table such as [users] keys = 1000"), "{msg}");
    }

    #[test]
    fn floor_and_closed_loop_keys_say_when_they_do_not_apply() {
        let (key, msg) = invalid(&format!("{BASE}\n[floor]\nthreads = 4\n"));
        assert_eq!(key, "floor.enabled", "{msg}");
        let s = parse(&format!("{BASE}\n[floor]\n")).expect("an empty [floor] is off");
        assert!(s.floor.is_none());
        let s = parse(&format!("{BASE}\n[floor]\nenabled = true\n")).expect("floor");
        assert!(s.floor.is_some());
        let closed = BASE.replace(
            "mode = \"open-loop\"\nrate = 100",
            "mode = \"closed-loop\"\nconcurrency = [1]\nlate_threshold_ms = 5",
        );
        let (key, msg) = invalid(&closed);
        assert_eq!(key, "load.late_threshold_ms", "{msg}");
    }

    #[test]
    fn loopback_urls() {
        assert!(parse_loopback_url("http://localhost:9000").is_ok());
        assert!(parse_loopback_url("http://127.1.2.3:9000/prefix/").is_ok());
        let v6 = parse_loopback_url("http://[::1]:9000").expect("v6");
        assert_eq!(v6.addr.port(), 9000);
        assert!(parse_loopback_url("https://127.0.0.1").is_err());
        assert!(parse_loopback_url("http://0.0.0.0:80").is_err());
        assert!(parse_loopback_url("http://192.168.1.1:80").is_err());
        assert!(parse_loopback_url("127.0.0.1:80").is_err());
        for (url, why) in [
            ("http://127.0.0.1:80/?a=1", "query string"),
            ("http://127.0.0.1:80/#x", "fragment"),
            ("http://127.0.0.1:80#x", "fragment"),
        ] {
            let e = parse_loopback_url(url).expect_err(url);
            assert!(e.contains(why), "{url}: {e}");
        }
        for port in ["99999", "65536", "0"] {
            let e = parse_loopback_url(&format!("http://127.0.0.1:{port}")).expect_err(port);
            assert!(e.contains("port must be 1-65535"), "{e}");
        }
        assert_eq!(
            parse_loopback_url("http://127.0.0.1")
                .expect("no port")
                .addr
                .port(),
            80
        );
        assert_eq!(
            parse_loopback_url("http://127.0.0.1:1/x/")
                .expect("url")
                .to_string(),
            "http://127.0.0.1:1/x"
        );
    }

    #[test]
    fn overrides_are_validated() {
        let mut s = parse(BASE).expect("base");
        assert!(s.override_target("http://8.8.8.8:80").is_err());
        assert!(s.override_target_remote("http://127.0.0.1:99999").is_err());
        s.override_duration_s(2.0).expect("duration");
        assert_eq!(s.load.duration, Duration::from_secs(2));
        assert!(
            s.source
                .ends_with("# overridden on the command line: --duration-s 2\n"),
            "the report echoes the override: {}",
            s.source
        );
        assert!(s.override_duration_s(0.0).is_err());
        // A phase shorter than one interval still sends the request due at its start.
        let mut open = parse(&BASE.replace("rate = 100", "rate = 10")).expect("open loop");
        open.override_duration_s(0.001).expect("one request");
        let mut fast = parse(&BASE.replace("rate = 100", "rate = 100000")).expect("open loop");
        let e = fast
            .override_duration_s(2_000.0)
            .expect_err("2e8 requests")
            .to_string();
        assert!(
            e.contains("--duration-s") && e.contains("at most 100000000 requests"),
            "{e}"
        );
    }

    #[test]
    fn an_open_loop_phase_past_the_request_cap_is_refused() {
        // 1e6 rps for a day: 8.64e10 sends, far past what one phase may send.
        let (key, msg) = invalid(
            &BASE
                .replace("rate = 100", "rate = 1000000")
                .replace("duration_s = 5", "duration_s = 86400"),
        );
        assert_eq!(key, "load.rate");
        for part in [
            "load.duration_s",
            "at most 100000000 requests",
            "86400000000",
        ] {
            assert!(msg.contains(part), "{part:?} missing from: {msg}");
        }
        // The warm-up runs at the same rate, under the same cap.
        let (key, msg) = invalid(
            &BASE
                .replace("rate = 100", "rate = 100000")
                .replace("duration_s = 5", "duration_s = 5\nwarm_up_s = 1001"),
        );
        assert_eq!(key, "load.rate");
        assert!(msg.contains("load.warm_up_s"), "{msg}");
        // Right at the cap is fine.
        parse(
            &BASE
                .replace("rate = 100", "rate = 100000")
                .replace("duration_s = 5", "duration_s = 1000"),
        )
        .expect("exactly 1e8 requests");
    }
}
