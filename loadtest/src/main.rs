//! `loadtest` command line: parses arguments and calls into the library.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use loadtest::drive::Cancel;
use loadtest::run::{RunError, RunOptions};
use loadtest::scenario::{Mode, Scenario, parse_loopback_url};
use loadtest::{floor, report};

#[derive(Parser)]
#[command(
    name = "loadtest",
    version,
    about = "Load generator and report for the hydrant gateway"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a scenario and write <out-dir>/<scenario>.json and .html.
    Run(RunArgs),
    /// Serve the floor: the cheapest server on hydrant's own HTTP stack, answering predict with a fixed body.
    Floor {
        /// Address to listen on (loopback only, unless --allow-remote), e.g. 127.0.0.1:9100.
        #[arg(long)]
        bind: String,
        /// Allow an address beyond loopback (0.0.0.0:9100 in a compose network); refused by default.
        #[arg(long)]
        allow_remote: bool,
        // A negative number is taken as the value (and refused with the reason), not as an unknown flag.
        /// Scores in the fixed answer (its size should match the real answers).
        #[arg(long, default_value_t = 1, allow_negative_numbers = true)]
        scores: usize,
        /// Runtime worker threads.
        #[arg(long, default_value_t = 2, allow_negative_numbers = true)]
        threads: usize,
        /// Stop by itself after this many seconds.
        #[arg(long, default_value_t = 3600, allow_negative_numbers = true)]
        for_s: u64,
    },
    /// Validate a scenario and print its plan, without sending anything.
    Check {
        /// Scenario file (TOML).
        scenario: PathBuf,
    },
}

/// `loadtest run`'s arguments.
#[derive(clap::Args)]
struct RunArgs {
    /// Scenario file (TOML).
    scenario: PathBuf,
    /// Override the scenario's target (loopback only, unless --allow-remote).
    #[arg(long)]
    target: Option<String>,
    /// Override the measured duration in seconds (warm-up and sweep steps are capped to it).
    // A negative number is taken as the value (and refused with the reason), not as an unknown flag.
    #[arg(long, allow_negative_numbers = true)]
    duration_s: Option<f64>,
    /// Where to write the result files.
    #[arg(long, default_value = "target/loadtest")]
    out_dir: PathBuf,
    /// No progress line on stderr.
    #[arg(long)]
    quiet: bool,
    /// Also measure plain Redis GET round trips against this server, reported beside the gateway.
    #[arg(long)]
    redis_url: Option<String>,
    /// Allow non-loopback targets and floors (a compose network); refused by default.
    #[arg(long)]
    allow_remote: bool,
    /// Drive the floor already serving at this URL (`loadtest floor`) rather than one inside the load
    /// tester, turning the floor on if the scenario left it off (loopback only, unless --allow-remote).
    #[arg(long)]
    floor_url: Option<String>,
    /// A file whose first token (one per line, `#` comments) is sent as `Authorization: Bearer`,
    /// for a gateway with `[auth]` on.
    #[arg(long)]
    token_file: Option<PathBuf>,
}

/// Exit codes: 0 ok, 1 error (unreachable target, bad file...), 2 invalid scenario or arguments,
/// 3 error budget exceeded or no request succeeded, 130 interrupted.
fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Check { scenario } => check(&scenario),
        Command::Run(args) => run(args),
        Command::Floor {
            bind,
            allow_remote,
            scores,
            threads,
            for_s,
        } => {
            let addr = match floor_addr(&bind, allow_remote, scores, threads) {
                Ok(addr) => addr,
                Err(e) => {
                    loadtest::errln!("error: {e}");
                    return ExitCode::from(2);
                }
            };
            match serve_floor(addr, scores, threads, for_s) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    loadtest::errln!("error: {e:#}");
                    ExitCode::from(1)
                }
            }
        }
    }
}

fn load(path: &std::path::Path) -> Result<Scenario, ExitCode> {
    Scenario::load(path).map_err(|e| {
        loadtest::errln!("error: {e}");
        ExitCode::from(e.exit_code())
    })
}

fn check(path: &std::path::Path) -> ExitCode {
    let s = match load(path) {
        Ok(s) => s,
        Err(code) => return code,
    };
    let mode = match &s.load.mode {
        Mode::OpenLoop { rate } => format!("open loop at {}", report::fmt_rate(*rate)),
        Mode::ClosedLoop { concurrency } => format!("closed loop, concurrency {concurrency:?}"),
        Mode::MaxThenFraction {
            concurrency,
            fraction,
            step,
            confirm,
        } => format!(
            "closed-loop sweep {concurrency:?} ({:.1} s per step){}, then open loop at {fraction} x max",
            step.as_secs_f64(),
            if confirm.is_zero() {
                String::new()
            } else {
                format!(
                    ", the best steps run again for {:.1} s",
                    confirm.as_secs_f64()
                )
            }
        ),
    };
    loadtest::outln!(
        "ok: {} against {} (model {}, {})\n  {mode}, {:.1} s measured, {:.1} s warm-up{}\n  users {} keys (zipf {}), items {} keys (zipf {}), candidates {}..={}\n  planned run time about {:.0} s",
        s.name,
        s.target,
        s.model,
        s.format.as_str(),
        s.load.duration.as_secs_f64(),
        s.load.warm_up.as_secs_f64(),
        if s.floor.is_some() {
            ", floor enabled"
        } else {
            ""
        },
        s.users.keys,
        s.users.zipf,
        s.items.keys,
        s.items.zipf,
        s.candidates.min,
        s.candidates.max,
        s.planned_duration().as_secs_f64()
    );
    ExitCode::SUCCESS
}

fn run(args: RunArgs) -> ExitCode {
    let RunArgs {
        scenario: path,
        target,
        duration_s,
        out_dir,
        quiet,
        redis_url,
        allow_remote,
        floor_url,
        token_file,
    } = args;
    let progress = !quiet;
    let path = path.as_path();
    let mut s = match load(path) {
        Ok(s) => s,
        Err(code) => return code,
    };
    if let Some(t) = target
        && let Err(e) = if allow_remote {
            s.override_target_remote(&t)
        } else {
            s.override_target(&t)
        }
    {
        loadtest::errln!("error: {e}");
        return ExitCode::from(e.exit_code());
    }
    if let Some(u) = &floor_url
        && let Err(e) = s.override_floor_url(u, allow_remote)
    {
        loadtest::errln!("error: {e}");
        return ExitCode::from(e.exit_code());
    }
    if let Some(d) = duration_s
        && let Err(e) = s.override_duration_s(d)
    {
        loadtest::errln!("error: {e}");
        return ExitCode::from(e.exit_code());
    }
    if let Some(u) = &redis_url
        && let Err(e) = loadtest::redis_probe::check_url(u, allow_remote)
    {
        loadtest::errln!("error: --redis-url {e}");
        return ExitCode::from(2);
    }
    let authorization = match token_file.as_deref().map(bearer_from_file).transpose() {
        Ok(a) => a,
        Err(e) => {
            loadtest::errln!("error: --token-file {e}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(s.client_threads)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            loadtest::errln!("error: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let max_error_rate = s.max_error_rate;
    let opts = RunOptions {
        out_dir,
        progress,
        redis_url,
        allow_remote,
        authorization,
    };
    let outcome = runtime.block_on(async move {
        let cancel = Cancel::new();
        let on_signal = cancel.clone();
        tokio::spawn(async move {
            // SIGTERM as Ctrl-C: `timeout`, `docker stop` and a cancelled CI job send it, and the
            // partial report is what they need.
            hydrant::app::shutdown_signal().await;
            loadtest::errln!("\ninterrupted: stopping the load and reporting what was measured (Ctrl-C again to quit at once)");
            on_signal.cancel();
            hydrant::app::shutdown_signal().await;
            std::process::exit(130);
        });
        // On a worker thread (not block_on's), so the open-loop dispatcher spawns request tasks
        // onto its local queue instead of waking a worker from outside for each one.
        match tokio::spawn(async move { loadtest::run::run(s, &opts, cancel).await }).await {
            Ok(r) => r,
            Err(e) => Err(RunError::Task(e.to_string())),
        }
    });
    // Request tasks still draining after a timeout must not hold the process open.
    runtime.shutdown_timeout(Duration::from_secs(1));
    match outcome {
        Ok(out) => {
            loadtest::out!("{}", report::table::render(&out.result));
            loadtest::outln!(
                "\nreport: {}\n        {}",
                out.json_path.display(),
                out.html_path.display()
            );
            let r = &out.result;
            if r.interrupted {
                return ExitCode::from(130);
            }
            if let Some(why) = r.failure(max_error_rate) {
                loadtest::errln!("error: {why}");
                return ExitCode::from(3);
            }
            ExitCode::SUCCESS
        }
        Err(RunError::ReportNotWritten {
            result,
            path,
            source,
        }) => {
            // The measurements are not lost: the table goes to the terminal all the same.
            loadtest::out!("{}", report::table::render(&result));
            loadtest::errln!("error: cannot write {path}: {source}");
            loadtest::errln!(
                "error: not every report file was written (see above); the table above is the result"
            );
            ExitCode::from(1)
        }
        Err(RunError::Interrupted) => {
            loadtest::errln!(
                "interrupted before the target was ready: nothing was measured, so no report was written"
            );
            ExitCode::from(130)
        }
        Err(e @ RunError::UnknownModel { .. }) => {
            loadtest::errln!("error: {e}");
            // A 404 for the route itself (not `unknown_model`) usually means a path in the target URL:
            // it is a prefix put before /v1/models/..., for a gateway served under one.
            let route_missing = matches!(&e, RunError::UnknownModel { body, target, .. }
                if body.contains("unknown_route")
                    || target.trim_start_matches("http://").contains('/'));
            if route_missing {
                loadtest::errln!(
                    "hint: a path in the target URL is a prefix put before /v1/models/...: give the gateway's base URL (e.g. http://127.0.0.1:8080) unless it is served under that prefix"
                );
            } else {
                loadtest::errln!(
                    "hint: check `model` in {}, or point --target at a gateway that serves it",
                    path.display()
                );
            }
            ExitCode::from(1)
        }
        Err(e @ RunError::Unauthorized { .. }) => {
            loadtest::errln!("error: {e}");
            ExitCode::from(1)
        }
        Err(e @ (RunError::Unreachable { .. } | RunError::NotReady { .. })) => {
            loadtest::errln!("error: {e}");
            loadtest::errln!(
                "hint: start the gateway first, or point --target at the HTTP address of a running one"
            );
            ExitCode::from(1)
        }
        Err(e) => {
            loadtest::errln!("error: {e}");
            ExitCode::from(1)
        }
    }
}

/// The floor's arguments, checked: the address to listen on.
fn floor_addr(
    bind: &str,
    allow_remote: bool,
    scores: usize,
    threads: usize,
) -> Result<SocketAddr, String> {
    // Same rule and host syntax as targets (localhost included): loopback unless --allow-remote.
    // Port 0 picks a free port.
    if bind.contains("://") {
        return Err(format!(
            "--bind {bind:?} takes an address, not a URL: e.g. 127.0.0.1:9100"
        ));
    }
    let Some((host, port)) = bind
        .rsplit_once(':')
        .filter(|(h, _)| !h.is_empty() && !bind.ends_with(']'))
    else {
        return Err(format!(
            "--bind {bind:?} needs a host and a port, e.g. 127.0.0.1:9100"
        ));
    };
    let Ok(port) = port.parse::<u16>() else {
        return Err(format!(
            "--bind {bind:?}: the port must be 0-65535 (0 picks a free one)"
        ));
    };
    let addr = if allow_remote {
        loadtest::scenario::resolve(host.trim_matches(['[', ']']), port)
            .map_err(|reason| format!("--bind {bind:?}: {reason}"))?
    } else {
        let mut addr: SocketAddr = parse_loopback_url(&format!("http://{host}"))
            .map_err(|reason| {
                format!("--bind {bind:?}: {reason} (--allow-remote to listen beyond loopback)")
            })?
            .addr;
        addr.set_port(port);
        addr
    };
    if !(1..=10_000).contains(&scores) {
        return Err(format!(
            "--scores must be between 1 and 10000 (got {scores})"
        ));
    }
    if !(1..=64).contains(&threads) {
        return Err(format!(
            "--threads must be between 1 and 64 (got {threads})"
        ));
    }
    Ok(addr)
}

fn serve_floor(addr: SocketAddr, scores: usize, threads: usize, for_s: u64) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .context("cannot start the runtime")?;
    runtime.block_on(async move {
        let listener = hydrant::serve::listen(addr)
            .await
            .with_context(|| format!("cannot listen on {addr} (--bind)"))?;
        let local = listener.local_addr().context("listener address")?;
        loadtest::outln!("floor listening on http://{local} (stops after {for_s} s or on Ctrl-C)");
        let stop = async move {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = tokio::time::sleep(Duration::from_secs(for_s)) => {}
            }
        };
        floor::serve(listener, scores, stop)
            .await
            .context("floor server")
    })
}

/// `Bearer <token>` from the first token in `path` (one per line; blank lines and `#` comments skipped).
fn bearer_from_file(path: &std::path::Path) -> Result<hyper::header::HeaderValue, String> {
    let text = loadtest::scenario::read_at_most(path, 64 * 1024)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let token = text
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with('#'))
        .ok_or_else(|| format!("{}: holds no token", path.display()))?;
    hyper::header::HeaderValue::from_str(&format!("Bearer {token}"))
        .map_err(|_| format!("{}: the token is not visible ASCII", path.display()))
}
