//! Orchestration of one run: readiness, warm-up, sweep and measured phases, floor alternation,
//! `/v1/stats` sampling, progress line, Ctrl-C, and the result files.
//!
//! With a floor, every measured phase is run hydrant / floor / hydrant (half, whole, half): both
//! servers get the same total time, and slow drift on the machine (thermal, other work) affects
//! both equally because their time centres coincide.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use hyper::{Method, StatusCode};
use tokio::task::JoinHandle;

use crate::client::{ExchangeError, Pool};
use crate::drive::{Cancel, Driver, MAX_REQUESTS_PER_SEGMENT, closed_loop, open_loop};
use crate::floor::FloorHandle;
use crate::record::{Collector, Progress, STAGES, Segment, SharedCollector, Which, lock};
use crate::report::{
    self, HistBin, LatencyRatio, LatencySummary, RunResult, SegmentSpan, StageSummary, StepResult,
    ratio, rps_ratio, us_or_nan,
};
use crate::sample::stream_seed;
use crate::scenario::{DEFAULT_FLOOR_THREADS, MAX_FLOOR_THREADS, Mode, Scenario, TargetUrl};
use crate::stats::{self, Stats};
use crate::workload::Workload;

/// Where files go and whether to print progress.
#[derive(Debug, Clone)]
pub struct RunOptions {
    pub out_dir: PathBuf,
    pub progress: bool,
    /// Redis to probe with plain GETs after the load, for the store-round-trip floor.
    pub redis_url: Option<String>,
    /// Lift the loopback-only rule for the Redis probe (the compose topology).
    pub allow_remote: bool,
    /// `Authorization` for every request (`Bearer <token>`), for a gateway with `[auth]` on. The floor
    /// gets it too, so both carry the same headers.
    pub authorization: Option<hyper::header::HeaderValue>,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            out_dir: PathBuf::from("target/loadtest"),
            progress: true,
            redis_url: None,
            allow_remote: false,
            authorization: None,
        }
    }
}

/// A finished (possibly interrupted) run and where its files are.
#[derive(Debug, Clone)]
pub struct RunOutput {
    pub result: RunResult,
    pub json_path: PathBuf,
    pub html_path: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("target {target} is unreachable: {reason}")]
    Unreachable { target: String, reason: String },
    #[error(
        "target {target} did not become ready within {waited_s:.0} s (GET /v2/health/ready answered HTTP {status})"
    )]
    NotReady {
        target: String,
        waited_s: f64,
        status: u16,
    },
    #[error("interrupted before the target was ready")]
    Interrupted,
    #[error("cannot start the floor server: {0}")]
    Floor(String),
    /// `floor.url` names a floor that is not there.
    #[error("floor.url: {0}")]
    FloorUnreachable(String),
    /// `--redis-url` names a server that does not answer a GET.
    #[error("--redis-url: {0}")]
    Redis(String),
    #[error("the run task failed: {0}")]
    Task(String),
    #[error("client set-up failed: {0}")]
    Client(#[from] ExchangeError),
    /// The output directory cannot be created or written; found before any load was sent.
    #[error("output directory {path} is not writable: {source}")]
    OutDir {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// The run finished but its files could not be written; `result` is what it measured.
    #[error("cannot write {path}: {source}")]
    ReportNotWritten {
        result: Box<RunResult>,
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// The probe predict before the warm-up was answered 404: the target does not serve the model.
    #[error(
        "target {target} does not serve model `{model}`: POST {path} answered HTTP {status}{}",
        colon_prefixed(.body)
    )]
    UnknownModel {
        target: String,
        model: String,
        path: String,
        status: u16,
        body: String,
    },
    /// The probe predict was answered 401 or 403: the gateway has `[auth]` on, and the run would measure
    /// nothing but refusals.
    #[error(
        "target {target} refused the probe predict with HTTP {status}{}: {}",
        colon_prefixed(.body),
        if *.token_sent {
            "the token of --token-file was refused: pass a client token of the gateway (auth.token_file)"
        } else {
            "pass --token-file with a client token of the gateway (auth.token_file)"
        }
    )]
    Unauthorized {
        target: String,
        status: u16,
        body: String,
        /// A token was sent (`--token-file`), so it is the token that was refused.
        token_sent: bool,
    },
}

/// Load shape of one segment.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Shape {
    Open(f64),
    Closed(usize),
}

/// A measured phase: hydrant (both halves merged) and, with a floor, the floor.
struct Phase {
    label: String,
    shape: Shape,
    hydrant: Segment,
    floor: Option<Segment>,
    /// Cut short by Ctrl-C: its numbers cover part of its duration, and its floor may not have run.
    cut: bool,
    stats_before: Option<Stats>,
    stats_after: Option<Stats>,
}

struct Runner {
    scenario: Arc<Scenario>,
    hydrant: Arc<Driver>,
    floor: Option<Arc<Driver>>,
    stats_pool: Arc<Pool>,
    collector: SharedCollector,
    cancel: Cancel,
    spans: Vec<SegmentSpan>,
    stream: u64,
}

/// Polls `GET /v2/health/ready` until 200 (a 404 counts as ready: the server has no such route).
/// A refused connection fails at once: the target is not running.
pub async fn wait_ready(pool: &Pool, wait: Duration, cancel: &Cancel) -> Result<(), RunError> {
    let target = pool.target().to_string();
    let start = Instant::now();
    let poll = Duration::from_millis(250);
    let max_polls = (wait.as_secs_f64() / poll.as_secs_f64()).ceil() as u64 + 1;
    let mut last_status = 0;
    for _ in 0..max_polls {
        if cancel.is_cancelled() {
            return Err(RunError::Interrupted);
        }
        // Raced against Ctrl-C: a target that takes connections but never answers would otherwise
        // hold the interrupt for the probe's whole timeout.
        // Each try gets 2 s, or what is left of the wait, so the wait ends on time.
        let try_for = wait
            .saturating_sub(start.elapsed())
            .clamp(Duration::from_millis(100), Duration::from_secs(2));
        let probe = tokio::select! {
            r = pool.get("/v2/health/ready", try_for) => r,
            _ = cancel.cancelled() => return Err(RunError::Interrupted),
        };
        match probe {
            Ok(r) if r.status.is_success() => return Ok(()),
            Ok(r) if r.status.as_u16() == 404 => {
                crate::errln!("note: {target} has no /v2/health/ready; assuming it is ready");
                return Ok(());
            }
            Ok(r) => last_status = r.status.as_u16(),
            Err(ExchangeError::Timeout(_)) if start.elapsed() >= wait => {
                return Err(RunError::Unreachable {
                    target,
                    reason: format!(
                        "it takes connections but GET /v2/health/ready never answered: no try (each waits up to 2 s) got a complete answer in {:.1} s (ready_timeout_s = {})",
                        start.elapsed().as_secs_f64(),
                        wait.as_secs_f64()
                    ),
                });
            }
            Err(ExchangeError::Timeout(_)) => {}
            Err(e @ (ExchangeError::Connect { .. } | ExchangeError::Build(_))) => {
                return Err(RunError::Unreachable {
                    target,
                    reason: e.to_string(),
                });
            }
            // Something listens there, but not an HTTP server (a Redis port, say).
            Err(e) => {
                return Err(RunError::Unreachable {
                    target,
                    reason: format!(
                        "it takes connections, but did not answer GET /v2/health/ready in HTTP ({e}): is it the gateway's HTTP port?"
                    ),
                });
            }
        }
        if start.elapsed() >= wait {
            break;
        }
        tokio::select! {
            _ = tokio::time::sleep(poll) => {}
            _ = cancel.cancelled() => return Err(RunError::Interrupted),
        }
    }
    Err(RunError::NotReady {
        target,
        waited_s: start.elapsed().as_secs_f64(),
        status: last_status,
    })
}

/// Creates `dir` and checks that a file can be written in it (a probe file, removed again), so an
/// unwritable `--out-dir` fails before the run instead of throwing its results away.
pub fn check_out_dir(dir: &Path) -> Result<(), RunError> {
    let err = |source| RunError::OutDir {
        path: dir.display().to_string(),
        source,
    };
    if dir.exists() && !dir.is_dir() {
        return Err(err(std::io::Error::other(
            "it is a file, not a folder: name a folder (it is created when missing)",
        )));
    }
    std::fs::create_dir_all(dir).map_err(err)?;
    let probe = dir.join(format!(".loadtest-write-probe-{}", std::process::id()));
    if let Err(e) = std::fs::write(&probe, b"probe") {
        // A write that failed part-way may have left the file behind.
        let _ = std::fs::remove_file(&probe);
        return Err(err(e));
    }
    std::fs::remove_file(&probe).map_err(err)
}

/// The soft limit on open files (Linux: `/proc/self/limits`); `None` where it cannot be read or is
/// unlimited.
fn open_file_limit() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line["Max open files".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// A warning when the open-file limit cannot hold `load.max_in_flight` connections (and the
/// floor's, in the same process): past it, connects fail with EMFILE and show up as `connect`
/// errors that look like the target refusing.
fn fd_limit_warning(s: &Scenario) -> Option<String> {
    let limit = open_file_limit()?;
    let floor = if s.floor.as_ref().is_some_and(|f| f.url.is_none()) {
        2
    } else {
        1
    };
    // A closed loop holds one connection per worker; an open loop up to max_in_flight.
    let (open, what) = match &s.load.mode {
        Mode::ClosedLoop { concurrency } => (
            concurrency.iter().copied().max().unwrap_or(1),
            "load.concurrency",
        ),
        _ => (s.load.max_in_flight, "load.max_in_flight"),
    };
    let need = (open as u64) * floor + 64;
    (limit < need).then(|| {
        format!(
            "the open-file limit ({limit}) is below what {what} ({open}) may need (~{need}): connections past it would fail as `connect` errors; raise it (`ulimit -n {need}`) or lower {what}"
        )
    })
}

/// Longest part of an error body quoted in [`RunError::UnknownModel`].
const MAX_QUOTED_BODY: usize = 500;

/// Sends one predict of the scenario's mix and fails if the target answers 404 (hydrant's
/// `unknown_model`, or no predict route at all), so a wrong `model` is reported before the
/// warm-up rather than as a run of nothing but errors. Any other answer, or none, lets the run go
/// ahead: the run itself counts and reports those. The floor serves every model, so a floor
/// target passes.
pub async fn probe_model(pool: &Pool, s: &Scenario, cancel: &Cancel) -> Result<(), RunError> {
    let uri = pool.uri(&format!("/v1/models/{}/predict", s.model))?;
    // The path as sent: under the target's own path, when it has one.
    let path = uri.path().to_string();
    // A stream number no sender uses: the probe must not warm the keys the first measured request reads.
    let body = Workload::new(s, stream_seed(s.seed, u64::MAX)).next_body();
    let send = pool.send(Method::POST, uri, Some(s.format), body, s.timeout);
    let resp = tokio::select! {
        r = send => r,
        _ = cancel.cancelled() => return Err(RunError::Interrupted),
    };
    match resp {
        Ok(r) if r.status == StatusCode::NOT_FOUND => Err(RunError::UnknownModel {
            target: pool.target().to_string(),
            model: s.model.clone(),
            path,
            status: r.status.as_u16(),
            body: quote_body(&r.body, r.msgpack),
        }),
        Ok(r) if r.status == StatusCode::UNAUTHORIZED || r.status == StatusCode::FORBIDDEN => {
            Err(RunError::Unauthorized {
                target: pool.target().to_string(),
                status: r.status.as_u16(),
                body: quote_body(&r.body, r.msgpack),
                token_sent: pool.sends_token(),
            })
        }
        Ok(r) if !r.status.is_success() => {
            crate::errln!(
                "note: the probe predict to {} answered HTTP {}{}; running anyway",
                pool.target(),
                r.status.as_u16(),
                colon_prefixed(&quote_body(&r.body, r.msgpack))
            );
            Ok(())
        }
        Ok(_) => Ok(()),
        Err(e) => {
            crate::errln!(
                "note: the probe predict to {} failed ({e}); running anyway",
                pool.target()
            );
            Ok(())
        }
    }
}

/// `": text"`, or nothing for an empty text.
fn colon_prefixed(text: &str) -> String {
    if text.is_empty() {
        String::new()
    } else {
        format!(": {text}")
    }
}

/// An error body as one line of text (MessagePack shown as JSON), cut to [`MAX_QUOTED_BODY`].
fn quote_body(body: &[u8], msgpack: bool) -> String {
    let text = match msgpack
        .then(|| rmp_serde::from_slice::<serde_json::Value>(body).ok())
        .flatten()
    {
        Some(v) => v.to_string(),
        None => String::from_utf8_lossy(body).into_owned(),
    };
    let text = text.split_whitespace().collect::<Vec<_>>().join(" ");
    match text.char_indices().nth(MAX_QUOTED_BODY) {
        Some((cut, _)) => format!("{}...", &text[..cut]),
        None => text,
    }
}

/// Runs `scenario` and writes `<out_dir>/<name>.json` and `.html`. Cancelling `cancel` (Ctrl-C)
/// stops the load early; the partial result is still written, marked `interrupted`.
///
/// Before sending anything it checks that `out_dir` is writable ([`check_out_dir`]), that the
/// target is ready ([`wait_ready`]) and that it serves the model ([`probe_model`]). If the files
/// still cannot be written at the end, the error is [`RunError::ReportNotWritten`], which carries
/// the result.
pub async fn run(
    scenario: Scenario,
    opts: &RunOptions,
    cancel: Cancel,
) -> Result<RunOutput, RunError> {
    let scenario = Arc::new(scenario);
    let started_at = SystemTime::now();
    let wall = Instant::now();

    check_out_dir(&opts.out_dir)?;
    if let Some(w) = fd_limit_warning(&scenario) {
        crate::errln!("note: {w}");
    }
    if let Some(url) = &opts.redis_url {
        // One GET now, so a Redis that is not there is found before the load, not after it.
        let key = |_| "hy:loadtest:probe".to_string();
        let one = crate::redis_probe::probe(url, opts.allow_remote, 1, Duration::from_secs(2), key);
        match tokio::time::timeout(Duration::from_secs(3), one).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(RunError::Redis(e)),
            Err(_) => {
                return Err(RunError::Redis(format!(
                    "{}: no answer within 3 s",
                    crate::redis_probe::redact(url)
                )));
            }
        }
    }
    // Every pool sends the run's `Authorization`: the gateway's, the floor's and the stats sampler's.
    let pool = |target: &TargetUrl| -> Result<Arc<Pool>, ExchangeError> {
        Ok(Arc::new(
            Pool::new(target)?.with_authorization(opts.authorization.clone()),
        ))
    };
    let hydrant_pool = pool(&scenario.target)?;
    wait_ready(&hydrant_pool, scenario.ready_timeout, &cancel).await?;
    probe_model(&hydrant_pool, &scenario, &cancel).await?;
    // What the in-process floor runs on, and the gateway's async workers it goes by.
    let (mut gateway_workers, mut floor_threads) = (None, None);
    let mut sched_warning = None;

    let mut floor_server = None;
    let floor_pool = match &scenario.floor {
        None => None,
        Some(f) => {
            let url = match &f.url {
                Some(u) => u.clone(),
                None => {
                    let bind = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
                    // As many threads as the gateway's async workers, unless the scenario says.
                    let gw = stats::fetch(&hydrant_pool).await.ok();
                    gateway_workers = gw.as_ref().map(|s| s.workers).filter(|&w| w > 0);
                    sched_warning = sched_group_warning(
                        &scenario.target,
                        gw.and_then(|s| s.sched_group),
                        hydrant::observe::sched_group(),
                    );
                    let threads = floor_threads_for(f.threads, gateway_workers);
                    floor_threads = Some(threads);
                    let h = FloorHandle::spawn(bind, f.scores, threads)
                        .map_err(|e| RunError::Floor(e.to_string()))?;
                    let url = TargetUrl {
                        addr: h.addr,
                        authority: h.addr.to_string(),
                        base_path: String::new(),
                    };
                    floor_server = Some(h);
                    url
                }
            };
            let p = pool(&url)?;
            wait_ready(&p, scenario.ready_timeout, &cancel)
                .await
                .map_err(|e| match e {
                    RunError::Interrupted => e,
                    e if f.url.is_some() => RunError::FloorUnreachable(format!(
                        "{e}; start it (`loadtest floor --bind {}`) or remove floor.url to run one inside the load tester",
                        url.addr
                    )),
                    e => RunError::Floor(e.to_string()),
                })?;
            Some(p)
        }
    };

    let origin = Instant::now();
    let collector = Collector::shared(origin);
    let hydrant = Arc::new(Driver::new(
        hydrant_pool.clone(),
        collector.clone(),
        scenario.clone(),
        cancel.clone(),
    )?);
    let floor = match &floor_pool {
        Some(p) => Some(Arc::new(Driver::new(
            p.clone(),
            collector.clone(),
            scenario.clone(),
            cancel.clone(),
        )?)),
        None => None,
    };

    let stop = Cancel::new();
    let stats_pool = pool(&scenario.target)?;
    let bound = scenario.planned_duration() * 2 + Duration::from_secs(600);
    let sampler = stats::spawn_sampler(
        stats_pool.clone(),
        origin,
        Duration::from_secs(1),
        bound,
        stop.clone(),
    );
    let progress = opts
        .progress
        .then(|| spawn_progress(collector.clone(), stop.clone(), bound));

    let mut runner = Runner {
        scenario: scenario.clone(),
        hydrant,
        floor,
        stats_pool,
        collector: collector.clone(),
        cancel: cancel.clone(),
        spans: Vec::new(),
        stream: 0,
    };
    let executed = runner.execute().await;

    stop.cancel();
    let series = sampler.await.unwrap_or_default();
    if let Some(p) = progress {
        let _ = p.await;
    }

    let mut result = assemble(
        &scenario,
        &runner,
        executed,
        &series,
        started_at,
        wall.elapsed(),
        cancel.is_cancelled(),
    );

    result.gateway_workers = gateway_workers;
    result.floor_threads = floor_threads;
    result.warnings.extend(sched_warning);
    if opts.redis_url.is_some() && cancel.is_cancelled() {
        result
            .warnings
            .push("the Redis GET probe (--redis-url) was skipped: the run was interrupted".into());
    }
    if let Some(url) = &opts.redis_url
        && !cancel.is_cancelled()
    {
        // Keys shaped like the gateway's user records, drawn from the scenario's key space.
        let users = scenario.users.keys.max(1);
        let probe =
            crate::redis_probe::probe(url, opts.allow_remote, 5000, Duration::from_secs(5), |i| {
                format!(
                    "hy:user_profile:u_{}",
                    (i as u64).wrapping_mul(7919) % users
                )
            })
            .await;
        match probe {
            Ok(p) => result.redis_get = Some(p),
            Err(e) => result
                .warnings
                .push(format!("the Redis GET probe failed: {e}")),
        }
    }

    // Let the floor see its connections close before it shuts down (its drop joins a thread).
    hydrant_pool.close_idle();
    if let Some(p) = &floor_pool {
        p.close_idle();
    }
    if let Some(h) = floor_server {
        let _ = tokio::task::spawn_blocking(move || drop(h)).await;
    }

    write_outputs(result, &opts.out_dir)
}

/// A warning when the gateway runs on this machine in another scheduling group (see
/// [`hydrant::observe::sched_group`]) than the load tester, whose in-process floor shares the load
/// tester's: the kernel divides the cores between the groups first, so the two servers did not get the
/// cores alike beside the load. Started with `setsid`, the gateway got about one core of two, and its
/// ratio to the floor fell from 0.83-0.86x to 0.59-0.76x (docs/performance.md).
fn sched_group_warning(
    target: &TargetUrl,
    gateway: Option<String>,
    ours: Option<String>,
) -> Option<String> {
    if !target.addr.ip().is_loopback() {
        return None;
    }
    let (gateway, ours) = (gateway?, ours?);
    (gateway != ours).then(|| {
        format!(
            "the gateway runs in another scheduling group ({gateway}) than the load tester and its \
             floor ({ours}): the kernel shares the cores between groups before threads, so the two \
             servers did not get the cores alike and the ratio to the floor is not like for like; start \
             the gateway from the load tester's session (not with setsid), as `make loadtest` does"
        )
    })
}

/// The in-process floor's worker threads: the scenario's `floor.threads`, else as many as the gateway's
/// async workers (at most [`MAX_FLOOR_THREADS`]), else [`DEFAULT_FLOOR_THREADS`] for a gateway that does
/// not say.
fn floor_threads_for(set: Option<usize>, gateway_workers: Option<u64>) -> usize {
    set.unwrap_or_else(|| {
        gateway_workers.map_or(DEFAULT_FLOOR_THREADS, |w| {
            usize::try_from(w).map_or(MAX_FLOOR_THREADS, |w| w.clamp(1, MAX_FLOOR_THREADS))
        })
    })
}

/// Writes the JSON and HTML files for `result` into `out_dir`; on failure the error carries the
/// result ([`RunError::ReportNotWritten`]) so the caller can still show it.
pub fn write_outputs(result: RunResult, out_dir: &Path) -> Result<RunOutput, RunError> {
    let files = match write_files(&result, out_dir) {
        Ok(files) => files,
        Err((path, source)) => {
            return Err(RunError::ReportNotWritten {
                result: Box::new(result),
                path,
                source,
            });
        }
    };
    Ok(RunOutput {
        result,
        json_path: files.0,
        html_path: files.1,
    })
}

/// Writes the JSON and HTML files for `result` into `out_dir`; returns their paths, or the path that
/// could not be written and why.
fn write_files(
    result: &RunResult,
    out_dir: &Path,
) -> Result<(PathBuf, PathBuf), (String, std::io::Error)> {
    let write_err = |path: &Path| {
        let path = path.display().to_string();
        move |source| (path, source)
    };
    std::fs::create_dir_all(out_dir).map_err(write_err(out_dir))?;
    let json_path = out_dir.join(format!("{}.json", result.scenario));
    let html_path = out_dir.join(format!("{}.html", result.scenario));
    let json = serde_json::to_vec_pretty(result)
        .map_err(|e| std::io::Error::other(e.to_string()))
        .map_err(write_err(&json_path))?;
    std::fs::write(&json_path, json).map_err(write_err(&json_path))?;
    std::fs::write(&html_path, report::html::render(result)).map_err(write_err(&html_path))?;
    Ok((json_path, html_path))
}

/// What [`Runner::execute`] produced.
#[derive(Default)]
struct Executed {
    phases: Vec<Phase>,
    headline: Option<usize>,
    sweep: bool,
    max_rps: Option<f64>,
    floor_max_rps: Option<f64>,
    fraction: Option<f64>,
    /// The best steps run again (`load.confirm_s`), whose rates are `max_rps` and `floor_max_rps`.
    confirm: Option<Confirmed>,
    /// Warnings found while running (beside those read off the numbers).
    warnings: Vec<String>,
}

/// Hydrant and the floor run again, each at the concurrency of its best sweep step.
struct Confirmed {
    duration: Duration,
    concurrency: usize,
    floor_concurrency: Option<usize>,
    hydrant: Segment,
    floor: Option<Segment>,
    /// Cut short by Ctrl-C: the sweep's maxima stand.
    cut: bool,
    /// The sweep's best steps, which chose the concurrencies.
    sweep_max_rps: Option<f64>,
    sweep_floor_max_rps: Option<f64>,
}

/// Whether a segment's load ran at all (a segment opened after Ctrl-C is empty).
fn ran(seg: &Segment) -> bool {
    seg.sent > 0 || !seg.elapsed.is_zero()
}

/// The phase with the highest achieved rps of `which`, among those where it ran, leaving out a step
/// cut short by Ctrl-C when a whole one ran: a fraction of a second of a step is not its maximum, and
/// its floor half may never have run, so the ratio would compare two concurrencies.
fn best_index(phases: &[Phase], which: Which) -> Option<(usize, f64)> {
    let whole = phases.iter().any(|p| !p.cut);
    phases
        .iter()
        .enumerate()
        .filter(|(_, p)| !(whole && p.cut))
        .filter_map(|(i, p)| {
            let seg = match which {
                Which::Hydrant => Some(&p.hydrant),
                Which::Floor => p.floor.as_ref(),
            }
            .filter(|seg| ran(seg))?;
            Some((i, seg.achieved_rps()?))
        })
        .max_by(|a, b| a.1.total_cmp(&b.1))
}

impl Runner {
    async fn execute(&mut self) -> Executed {
        let s = self.scenario.clone();
        let mut ex = Executed::default();
        let warm_shape = match &s.load.mode {
            Mode::OpenLoop { rate } => Shape::Open(*rate),
            Mode::ClosedLoop { concurrency } | Mode::MaxThenFraction { concurrency, .. } => {
                Shape::Closed(concurrency.first().copied().unwrap_or(1))
            }
        };
        if !s.load.warm_up.is_zero() {
            let label = match warm_shape {
                Shape::Open(rate) => format!("open loop at {}", report::fmt_rate(rate)),
                Shape::Closed(c) => format!("concurrency {c}"),
            };
            self.segment(Which::Hydrant, &label, warm_shape, s.load.warm_up, false)
                .await;
            if self.floor.is_some() {
                let w = s.load.warm_up.min(Duration::from_secs(1));
                self.segment(Which::Floor, &label, warm_shape, w, false)
                    .await;
            }
        }
        if self.cancel.is_cancelled() {
            // Interrupted during warm-up: nothing was measured, and the report says so.
            return ex;
        }
        match &s.load.mode {
            Mode::OpenLoop { rate } => {
                let label = format!("open loop at {}", report::fmt_rate(*rate));
                let p = self.phase(label, Shape::Open(*rate), s.load.duration).await;
                ex.phases.push(p);
                ex.headline = Some(0);
            }
            Mode::ClosedLoop { concurrency } => {
                ex.sweep = true;
                for &c in concurrency {
                    if self.cancel.is_cancelled() {
                        break;
                    }
                    let p = self
                        .phase(
                            format!("concurrency {c}"),
                            Shape::Closed(c),
                            s.load.duration,
                        )
                        .await;
                    ex.phases.push(p);
                }
                ex.headline = best_index(&ex.phases, Which::Hydrant).map(|b| b.0);
                ex.max_rps = best_index(&ex.phases, Which::Hydrant).map(|b| b.1);
                ex.floor_max_rps = best_index(&ex.phases, Which::Floor).map(|b| b.1);
            }
            Mode::MaxThenFraction {
                concurrency,
                fraction,
                step,
                confirm,
            } => {
                ex.sweep = true;
                ex.fraction = Some(*fraction);
                for &c in concurrency {
                    if self.cancel.is_cancelled() {
                        break;
                    }
                    let p = self
                        .phase(format!("concurrency {c}"), Shape::Closed(c), *step)
                        .await;
                    ex.phases.push(p);
                }
                let best = best_index(&ex.phases, Which::Hydrant);
                let floor_best = best_index(&ex.phases, Which::Floor);
                ex.max_rps = best.map(|b| b.1);
                ex.floor_max_rps = floor_best.map(|b| b.1);
                ex.headline = best.map(|b| b.0);
                let step_of = |i: usize| match ex.phases.get(i).map(|p| p.shape) {
                    Some(Shape::Closed(c)) => Some(c),
                    _ => None,
                };
                if let Some(c) = best.and_then(|b| step_of(b.0))
                    && !confirm.is_zero()
                    && !self.cancel.is_cancelled()
                {
                    // The sweep only chooses: each server runs again at its best step, measured apart
                    // from the sweep, since the best of several noisy steps overstates a level curve's
                    // maximum (the floor's, level from a few connections on) more than a rising one's.
                    let floor_c = floor_best.and_then(|b| step_of(b.0));
                    let label = |c: usize| format!("best step again, concurrency {c}");
                    let floor_label = floor_c.map(label);
                    let (hydrant, floor) = self
                        .alternate(
                            &label(c),
                            Shape::Closed(c),
                            floor_label.as_deref().zip(floor_c.map(Shape::Closed)),
                            *confirm,
                        )
                        .await;
                    let cut = self.cancel.is_cancelled();
                    // Cut short by Ctrl-C, the runs are partial and the open loop does not run: the
                    // sweep's maxima stand.
                    if !cut {
                        ex.max_rps = hydrant.achieved_rps();
                        ex.floor_max_rps = floor.as_ref().and_then(Segment::achieved_rps);
                    }
                    ex.confirm = Some(Confirmed {
                        duration: *confirm,
                        concurrency: c,
                        floor_concurrency: floor.as_ref().and(floor_c),
                        hydrant,
                        floor,
                        cut,
                        sweep_max_rps: best.map(|b| b.1),
                        sweep_floor_max_rps: floor_best.map(|b| b.1),
                    });
                }
                let max = ex.max_rps.unwrap_or(0.0);
                let rate = max * fraction;
                let sends = rate * s.load.duration.as_secs_f64();
                if self.cancel.is_cancelled() {
                    // Ctrl-C during the sweep: no open-loop phase, and the sweep is the report.
                } else if max <= 0.0 {
                    // No step is the measured phase: the report's top-level numbers stay empty.
                    ex.headline = None;
                    ex.warnings.push(format!(
                        "{}: no request succeeded in the {}, so it gave no maximum throughput to take load.fraction of",
                        report::NO_OPEN_LOOP,
                        if ex.confirm.is_some() {
                            "run of the sweep's best step again (load.confirm_s)"
                        } else {
                            "sweep"
                        },
                    ));
                } else if sends < 1.0 {
                    ex.headline = None;
                    // The scenario check cannot know the maximum; a phase that would send nothing
                    // measures nothing, and the run says so (and fails) rather than reporting it.
                    let fraction = if *fraction >= 1e-3 {
                        fraction.to_string()
                    } else {
                        format!("{fraction:e}")
                    };
                    ex.warnings.push(format!(
                        "{}: load.fraction {fraction} x the sweep's maximum of {} is {rate:.3e} rps, which schedules no request in {:.0} s (load.duration_s); raise load.fraction or load.duration_s",
                        report::NO_OPEN_LOOP,
                        report::fmt_rate(max),
                        s.load.duration.as_secs_f64(),
                    ));
                } else {
                    if sends > MAX_REQUESTS_PER_SEGMENT as f64 {
                        ex.warnings.push(format!(
                            "the open-loop phase at {} for {:.0} s (load.duration_s) would send {sends:.0} requests: it stopped at the limit of {MAX_REQUESTS_PER_SEGMENT} per phase, after {:.0} s (measured_s); lower load.duration_s",
                            report::fmt_rate(rate),
                            s.load.duration.as_secs_f64(),
                            MAX_REQUESTS_PER_SEGMENT as f64 / rate
                        ));
                    }
                    let label = format!(
                        "open loop at {} ({} x max)",
                        report::fmt_rate(rate),
                        fraction
                    );
                    let p = self.phase(label, Shape::Open(rate), s.load.duration).await;
                    ex.phases.push(p);
                    ex.headline = Some(ex.phases.len() - 1);
                }
            }
        }
        ex
    }

    /// Hydrant (`label`, `shape`) for half of `duration`, the floor (`floor`: its label and shape) for
    /// all of it, then hydrant for the other half, so both get the same time and slow drift on the machine
    /// hits both equally; hydrant alone without a floor (or without a floor shape).
    async fn alternate(
        &mut self,
        label: &str,
        shape: Shape,
        floor: Option<(&str, Shape)>,
        duration: Duration,
    ) -> (Segment, Option<Segment>) {
        match floor.filter(|_| self.floor.is_some()) {
            Some((floor_label, floor_shape)) => {
                let half = duration / 2;
                let mut h = self.segment(Which::Hydrant, label, shape, half, true).await;
                let f = self
                    .segment(Which::Floor, floor_label, floor_shape, duration, true)
                    .await;
                let h2 = self
                    .segment(Which::Hydrant, label, shape, duration - half, true)
                    .await;
                h.merge(&h2);
                // After Ctrl-C in the first half the floor never ran: it has no numbers, not zeros.
                (h, ran(&f).then_some(f))
            }
            None => {
                let h = self
                    .segment(Which::Hydrant, label, shape, duration, true)
                    .await;
                (h, None)
            }
        }
    }

    async fn phase(&mut self, label: String, shape: Shape, duration: Duration) -> Phase {
        let stats_before = stats::fetch(&self.stats_pool).await.ok();
        let (hydrant, floor) = self
            .alternate(&label, shape, Some((&label, shape)), duration)
            .await;
        // Read before the stats: a Ctrl-C during that last request does not cut a step that ran whole.
        let cut = self.cancel.is_cancelled();
        let stats_after = stats::fetch(&self.stats_pool).await.ok();
        Phase {
            label,
            shape,
            hydrant,
            floor,
            cut,
            stats_before,
            stats_after,
        }
    }

    async fn segment(
        &mut self,
        which: Which,
        label: &str,
        shape: Shape,
        duration: Duration,
        measured: bool,
    ) -> Segment {
        let driver = match which {
            Which::Hydrant => Some(self.hydrant.clone()),
            Which::Floor => self.floor.clone(),
        };
        let origin = lock(&self.collector).origin();
        let start_s = origin.elapsed().as_secs_f64();
        // After Ctrl-C no segment opens, so a late answer of an abandoned request lands nowhere.
        if !self.cancel.is_cancelled() {
            lock(&self.collector).begin(Segment::new(which, label, measured));
        }
        self.stream += 1;
        let elapsed = match driver {
            Some(d) if !self.cancel.is_cancelled() && !duration.is_zero() => match shape {
                Shape::Open(rate) => open_loop(&d, rate, duration, self.stream).await,
                Shape::Closed(c) => closed_loop(&d, c, duration, self.stream).await,
            },
            _ => Duration::ZERO,
        };
        let seg = lock(&self.collector)
            .end(elapsed)
            .unwrap_or_else(|| Segment::new(which, label, measured));
        self.spans.push(SegmentSpan {
            label: label.to_string(),
            which,
            measured,
            start_s,
            end_s: origin.elapsed().as_secs_f64(),
        });
        seg
    }
}

fn spawn_progress(collector: SharedCollector, stop: Cancel, bound: Duration) -> JoinHandle<()> {
    tokio::spawn(async move {
        let tty = std::io::stderr().is_terminal();
        // Segments start on whole and half seconds of the run (warm-ups, halves of a phase), so the
        // line ticks a quarter second off them: a tick on a boundary would show a segment just begun
        // (0.0 s, no rate yet) or, between two segments, nothing.
        let first = tokio::time::Instant::now() + Duration::from_millis(1250);
        let mut ticker = tokio::time::interval_at(first, Duration::from_secs(1));
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        for _ in 0..bound.as_secs().max(1) {
            tokio::select! {
                _ = ticker.tick() => {}
                _ = stop.cancelled() => break,
            }
            let p = lock(&collector).progress();
            if let Some(p) = p {
                let line = progress_line(&p);
                if tty {
                    crate::err!("\r\x1b[2K{line}");
                } else {
                    crate::errln!("{line}");
                }
            }
        }
        if tty {
            crate::err!("\r\x1b[2K");
        }
    })
}

/// The progress line: segment, time, rps, p99 and errors so far.
pub fn progress_line(p: &Progress) -> String {
    let secs = p.elapsed.as_secs_f64();
    let rps = if secs > 0.0 { p.ok as f64 / secs } else { 0.0 };
    // Only open loop has a schedule to be late for; a closed loop's sends are never late.
    let late = if p.sent > 0 && p.late > 0 {
        format!("  late {:.1}%", 100.0 * p.late as f64 / p.sent as f64)
    } else {
        String::new()
    };
    format!(
        "[{}{} {}] {:>5.1} s  rps {:>8.1}  p99 {:>9}  errors {}{}",
        p.which.name(),
        if p.measured { "" } else { " warm-up" },
        p.label,
        secs,
        rps,
        report::fmt_latency(p.p99_us),
        p.errors,
        late
    )
}

fn summary(seg: &Segment) -> LatencySummary {
    let requests = seg.sent;
    let errors = seg.error_count();
    LatencySummary {
        requests,
        ok: seg.ok,
        errors,
        error_rate: if requests > 0 {
            errors as f64 / requests as f64
        } else {
            0.0
        },
        measured_s: seg.elapsed.as_secs_f64(),
        achieved_rps: seg.achieved_rps(),
        p50_us: seg.quantile_us(0.5),
        p90_us: seg.quantile_us(0.9),
        p95_us: seg.quantile_us(0.95),
        p99_us: seg.quantile_us(0.99),
        p999_us: seg.quantile_us(0.999),
        max_us: (!seg.hist.is_empty()).then(|| seg.hist.max()),
        mean_us: (!seg.hist.is_empty()).then(|| seg.hist.mean()),
        late_sends: seg.open_loop.then_some(seg.late),
        late_share: seg.open_loop.then(|| {
            if requests > 0 {
                seg.late as f64 / requests as f64
            } else {
                0.0
            }
        }),
        errors_by_kind: seg.errors.clone(),
    }
}

/// A warning when more than 1% of `sum`'s requests failed other than by a refusal at
/// `load.max_in_flight` (which has its own). Percentiles hold the successful answers and the timeouts
/// (at the time given up, a lower bound); the other failures are in no percentile, so a share of them
/// makes the percentiles flattering.
fn failure_warning(who: &str, sum: &LatencySummary, note: &str) -> Option<String> {
    let overload = sum.errors_by_kind.get("overload").copied().unwrap_or(0);
    let failed = sum.errors.saturating_sub(overload);
    if sum.requests == 0 || failed as f64 <= 0.01 * sum.requests as f64 {
        return None;
    }
    let kinds: Vec<String> = sum
        .errors_by_kind
        .iter()
        .filter(|(k, _)| k.as_str() != "overload")
        .map(|(k, n)| format!("{n} {k}"))
        .collect();
    Some(format!(
        "{who}: {failed} of {} requests failed ({}): timeouts are in the latency percentiles at the time they were given up (timeout_ms), other failures in none{note}",
        sum.requests,
        kinds.join(", ")
    ))
}

/// Log-spaced bins, ten per decade, over the latencies (answers and timeouts) of hydrant and floor.
fn histogram_bins(h: &Segment, f: Option<&Segment>) -> Vec<HistBin> {
    let bin_of = |v: u64| ((v.max(1) as f64).log10() * 10.0).floor() as i64;
    let mut counts: BTreeMap<i64, (u64, u64)> = BTreeMap::new();
    for v in h.hist.iter_recorded() {
        counts.entry(bin_of(v.value_iterated_to())).or_default().0 += v.count_at_value();
    }
    if let Some(f) = f {
        for v in f.hist.iter_recorded() {
            counts.entry(bin_of(v.value_iterated_to())).or_default().1 += v.count_at_value();
        }
    }
    let (Some(lo), Some(hi)) = (
        counts.keys().next().copied(),
        counts.keys().next_back().copied(),
    ) else {
        return Vec::new();
    };
    (lo..=hi)
        .map(|i| {
            let (hydrant, floor) = counts.get(&i).copied().unwrap_or_default();
            HistBin {
                lo_us: 10f64.powf(i as f64 / 10.0),
                hi_us: 10f64.powf((i + 1) as f64 / 10.0),
                hydrant,
                floor,
            }
        })
        .collect()
}

fn assemble(
    s: &Scenario,
    runner: &Runner,
    ex: Executed,
    series: &stats::Series,
    started_at: SystemTime,
    wall: Duration,
    interrupted: bool,
) -> RunResult {
    let headline = ex.headline.and_then(|i| ex.phases.get(i));
    let empty = Segment::new(Which::Hydrant, "none", true);
    let h_seg = headline.map_or(&empty, |p| &p.hydrant);
    let f_seg = headline.and_then(|p| p.floor.as_ref());
    let hydrant = summary(h_seg);
    let floor = f_seg.map(summary);

    // Cache hit rate: the gateway's counters over the headline phase, else the answers' `cache`.
    let delta = headline.and_then(|p| match (&p.stats_before, &p.stats_after) {
        (Some(a), Some(b)) => stats::delta(a, b, &s.model),
        _ => None,
    });
    let [hits, stale, misses] = h_seg.cache;
    let (hit_rate, hit_rate_source) = match (
        delta.as_ref().and_then(|d| d.total.hit_rate),
        stats::answers_hit_rate(hits, stale, misses),
    ) {
        (Some(r), _) => (Some(r), "stats"),
        (None, Some(r)) => (Some(r), "responses"),
        (None, None) => (None, "none"),
    };

    // Stages: the answers' timings cover exactly the measured requests; the stats window also
    // covers whatever ran in the window before (sweep, warm-up), so it is the fallback.
    let mut stages = BTreeMap::new();
    for (name, h) in STAGES.iter().zip(&h_seg.stages) {
        if !h.is_empty() {
            stages.insert(
                name.to_string(),
                StageSummary {
                    p50_us: h.value_at_quantile(0.5),
                    p95_us: h.value_at_quantile(0.95),
                    p99_us: h.value_at_quantile(0.99),
                },
            );
        }
    }
    let window = headline
        .and_then(|p| p.stats_after.as_ref())
        .and_then(|st| {
            st.models
                .get(&s.model)
                .map(|m| (st.window_s, m.stages.clone()))
        });
    let (stats_window_s, stats_window_stages) = match window {
        Some((w, st)) => (Some(w), st),
        None => (None, BTreeMap::new()),
    };
    let (stages_p99_us, stages_source): (BTreeMap<String, u64>, &str) = if !stages.is_empty() {
        (
            stages.iter().map(|(k, v)| (k.clone(), v.p99_us)).collect(),
            "responses",
        )
    } else if !stats_window_stages.is_empty() {
        (
            stats_window_stages
                .iter()
                .filter_map(|(k, v)| Some((k.clone(), v.p99_us? as u64)))
                .collect(),
            "stats_window",
        )
    } else {
        (BTreeMap::new(), "none")
    };

    let stats_note = if series.samples.is_empty() {
        Some(match &series.last_error {
            Some(e) => format!("gateway stats unavailable: {e}"),
            None => "gateway stats unavailable".to_string(),
        })
    } else {
        None
    };

    let steps: Vec<StepResult> = if ex.sweep {
        ex.phases
            .iter()
            .filter_map(|p| match p.shape {
                Shape::Closed(c) => Some(StepResult {
                    label: p.label.clone(),
                    concurrency: Some(c),
                    rate: None,
                    hydrant: summary(&p.hydrant),
                    floor: p.floor.as_ref().map(summary),
                }),
                Shape::Open(_) => None,
            })
            .collect()
    } else {
        Vec::new()
    };

    let mut warnings = Vec::new();
    let late_limit = 0.05;
    for (name, sum) in
        std::iter::once(("hydrant", &hydrant)).chain(floor.iter().map(|f| ("floor", f)))
    {
        if let Some(late) = sum.late_share.filter(|l| *l > late_limit) {
            warnings.push(format!(
                "{name}: {} of the sends started more than {} ms after their intended time or were refused at load.max_in_flight: the load generator (or the machine) could not keep the schedule, so the offered load was not applied evenly; latencies still count from the intended times",
                report::fmt_pct(late),
                s.load.late_threshold.as_secs_f64() * 1000.0
            ));
        }
        if let Some(n) = sum.errors_by_kind.get("overload") {
            warnings.push(format!(
                "{name}: {n} sends were refused because load.max_in_flight ({}) requests were already open",
                s.load.max_in_flight
            ));
        }
    }
    // In closed-loop mode every step is measured and the headline is only the fastest of them, so
    // each step's failures are warned about; in max-then-fraction mode the sweep's steps are warned
    // about beside the measured phase, since their failures skew the max the open-loop rate derives
    // from. A headline that is a step (closed loop, or a sweep cut short) has its step's warning.
    let closed_loop = matches!(s.load.mode, Mode::ClosedLoop { .. });
    let headline_is_step = headline.is_some_and(|p| matches!(p.shape, Shape::Closed(_)));
    if !headline_is_step && let Some(w) = failure_warning("hydrant", &hydrant, "") {
        warnings.push(w);
    }
    for step in &steps {
        let (who, note) = if closed_loop {
            (format!("hydrant, step {}", step.label), "")
        } else {
            (
                format!("hydrant, sweep step {}", step.label),
                "; the sweep's max throughput, which sets the open-loop rate, counts only the successful answers",
            )
        };
        if let Some(w) = failure_warning(&who, &step.hydrant, note) {
            warnings.push(w);
        }
        // The floor's steps too: the floor's max, and so the ratio to it, counts only its
        // successful answers.
        if let Some(f) = &step.floor {
            let who = format!("floor, step {}", step.label);
            let note = "; the floor's max throughput, and the ratio to it, count only the successful answers";
            if let Some(w) = failure_warning(&who, f, note) {
                warnings.push(w);
            }
        }
    }
    let confirm = ex.confirm.as_ref().map(|c| {
        let (h, f) = (summary(&c.hydrant), c.floor.as_ref().map(summary));
        let note =
            "; the max throughput, and the ratio to the floor's, count only the successful answers";
        for (who, sum) in std::iter::once(("hydrant", &h)).chain(f.iter().map(|f| ("floor", f))) {
            let who = format!("{who}, best step run again");
            if let Some(w) = failure_warning(&who, sum, note) {
                warnings.push(w);
            }
        }
        report::ConfirmResult {
            duration_s: c.duration.as_secs_f64(),
            concurrency: c.concurrency,
            floor_concurrency: c.floor_concurrency,
            hydrant: h,
            floor: f,
            cut: c.cut,
            sweep_max_rps: c.sweep_max_rps,
            sweep_floor_rps: c.sweep_floor_max_rps,
            sweep_ratio_to_floor: c
                .sweep_max_rps
                .and_then(|m| ratio(m, c.sweep_floor_max_rps?)),
        }
    });
    // A floor that fails is no floor: the ratios to it compare against errors.
    if let Some(f) = &floor
        && f.requests > 0
        && f.error_rate > 0.01
    {
        warnings.push(format!(
            "floor: {} of its requests failed ({}): the comparison with it does not hold{}",
            f.errors,
            report::fmt_pct(f.error_rate),
            if s.floor.as_ref().is_some_and(|fl| fl.url.is_some()) {
                "; check floor.url"
            } else {
                ""
            }
        ));
    }
    warnings.extend(ex.warnings.iter().cloned());
    if interrupted {
        warnings.push(
            "interrupted: the numbers cover only what ran before Ctrl-C (or SIGTERM)".to_string(),
        );
    }

    // In sweep modes the ratio is of the sweep's maxima, which stand even when the measured phase's
    // floor never ran (Ctrl-C in the open-loop phase of max-then-fraction).
    let (floor_rps, ratio_to_floor) = match (&floor, ex.sweep) {
        (_, true) => (
            ex.floor_max_rps,
            ex.max_rps.and_then(|m| ratio(m, ex.floor_max_rps?)),
        ),
        (None, false) => (None, None),
        (Some(f), false) => (
            f.achieved_rps,
            rps_ratio(hydrant.achieved_rps, f.achieved_rps),
        ),
    };
    let latency_ratio_to_floor = floor.as_ref().map(|f| LatencyRatio {
        p50: ratio(us_or_nan(hydrant.p50_us), us_or_nan(f.p50_us)),
        p99: ratio(us_or_nan(hydrant.p99_us), us_or_nan(f.p99_us)),
    });

    let (timeline, floor_timeline) = {
        let c = lock(&runner.collector);
        (
            c.timeline(Which::Hydrant).points(),
            c.timeline(Which::Floor).points(),
        )
    };

    RunResult {
        scenario: s.name.clone(),
        mode: s.load.mode.name().to_string(),
        target: s.target.to_string(),
        model: s.model.clone(),
        format: s.format.as_str().to_string(),
        started_at: report::rfc3339(started_at),
        wall_s: wall.as_secs_f64(),
        interrupted,
        headline: headline.map_or_else(|| "none".to_string(), |p| p.label.clone()),
        offered_rps: headline.and_then(|p| match p.shape {
            Shape::Open(r) => Some(r),
            Shape::Closed(_) => None,
        }),
        concurrency: headline.and_then(|p| match p.shape {
            Shape::Closed(c) => Some(c),
            Shape::Open(_) => None,
        }),
        hydrant,
        degraded: h_seg.degraded,
        error_codes: h_seg.error_codes.clone(),
        hit_rate,
        hit_rate_source: hit_rate_source.to_string(),
        cache: delta.as_ref().map(|d| d.total.clone()),
        views: delta.as_ref().map(|d| d.views.clone()).unwrap_or_default(),
        response_cache: report::ResponseCache {
            hits,
            stale,
            misses,
            answers: h_seg.cache_replies,
        },
        gateway_requests: delta.as_ref().and_then(|d| d.model_requests),
        stages_p99_us,
        stages_source: stages_source.to_string(),
        stages,
        stats_window_s,
        stats_window_stages,
        stats_note,
        warnings,
        max_rps: ex.max_rps,
        fraction: ex.fraction,
        floor_rps,
        ratio_to_floor,
        latency_ratio_to_floor,
        gateway_workers: None,
        floor_threads: None,
        redis_get: None,
        confirm,
        floor,
        steps,
        segments: runner.spans.clone(),
        timeline,
        floor_timeline,
        stats_timeline: series.points(&s.model),
        latency_histogram: histogram_bins(h_seg, f_seg),
        scenario_toml: s.source.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_floor_takes_the_scenarios_threads_else_the_gateways_workers_else_two() {
        assert_eq!(floor_threads_for(Some(5), Some(3)), 5);
        assert_eq!(floor_threads_for(None, Some(3)), 3);
        assert_eq!(floor_threads_for(None, Some(1_000)), MAX_FLOOR_THREADS);
        assert_eq!(floor_threads_for(None, None), DEFAULT_FLOOR_THREADS);
    }

    fn seg(which: Which, rps: u64) -> Segment {
        let mut s = Segment::new(which, "step", true);
        s.sent = rps;
        s.ok = rps;
        s.ok_in_window = rps;
        s.elapsed = Duration::from_secs(1);
        s.window = Duration::from_secs(1);
        s
    }

    fn step(c: usize, hydrant: u64, floor: Option<u64>, cut: bool) -> Phase {
        Phase {
            label: format!("concurrency {c}"),
            shape: Shape::Closed(c),
            hydrant: seg(Which::Hydrant, hydrant),
            floor: floor.map(|f| seg(Which::Floor, f)),
            cut,
            stats_before: None,
            stats_after: None,
        }
    }

    #[test]
    fn a_sweep_cut_short_compares_the_steps_that_ran_whole() {
        // Ctrl-C a moment into the second step: its hydrant half ran for a fraction of a second, at a
        // higher rate than the first step's, and its floor half never ran.
        let phases = [
            step(1, 3_000, Some(10_000), false),
            step(4, 6_700, None, true),
        ];
        assert_eq!(best_index(&phases, Which::Hydrant), Some((0, 3_000.0)));
        assert_eq!(best_index(&phases, Which::Floor), Some((0, 10_000.0)));
        // Cut in the first step: that part of a step is all there is, and it is reported.
        let phases = [step(1, 2_000, None, true)];
        assert_eq!(best_index(&phases, Which::Hydrant), Some((0, 2_000.0)));
        assert_eq!(best_index(&phases, Which::Floor), None);
        // A whole sweep: the fastest step of each.
        let phases = [
            step(1, 3_000, Some(10_000), false),
            step(4, 6_700, Some(12_000), false),
        ];
        assert_eq!(best_index(&phases, Which::Hydrant), Some((1, 6_700.0)));
        assert_eq!(best_index(&phases, Which::Floor), Some((1, 12_000.0)));
    }
}
