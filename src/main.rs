//! The `hydrant` command: serve the gateway, validate schemas, or bulk-load feature rows.

/// mimalloc rather than glibc malloc: the request path allocates and frees across the async workers and the
/// inference threads, where glibc's per-arena locks and consolidation cost about a fifth of the CPU per
/// hot-path request (measured side by side with wrk: 30-41 vs 42-49 µs of server CPU per request).
///
/// With the crate's `override` feature (Cargo.toml) mimalloc also stands in for the process's `malloc`
/// and `free`, which ONNX Runtime (C++, loaded at run time) allocates through: a run of the demo model at
/// batch 1 took 26,987 instructions with glibc's allocator and 21,195 with mimalloc's.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use hydrant::app::{Application, load_models, open_store, read_registry, shutdown_signal};
use hydrant::config::Config;

#[derive(Parser)]
#[command(
    name = "hydrant",
    version,
    about = "Feature-hydration and caching gateway in front of ONNX models"
)]
struct Cli {
    /// Config file (default: config/hydrant.toml when it exists). HYDRANT_SECTION__KEY variables override it.
    /// Given once, before or after the subcommand.
    #[arg(long, global = true)]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the HTTP API.
    Serve,
    /// Validate the schemas (and, unless --no-models, load each model to check its binding width).
    Validate {
        /// Schemas folder (default: registry.schemas).
        dir: Option<PathBuf>,
        /// Models folder (default: registry.models).
        #[arg(long)]
        models: Option<PathBuf>,
        /// Check the schemas only, without loading ONNX Runtime.
        #[arg(long)]
        no_models: bool,
    },
    /// Load feature rows (JSON Lines, or CSV by extension) into the configured store.
    Load {
        /// The view the rows belong to.
        #[arg(long)]
        view: String,
        /// Files to load.
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Start at the row that begins on this line of the file (one file only), as a load whose
        /// writes timed out says to: the rows before it are read past, not checked or written.
        #[arg(long, value_name = "LINE")]
        from_line: Option<usize>,
    },
}

fn main() -> ExitCode {
    // A usage error (an unknown flag, a missing value) could not start anything: exit status 1, as the
    // commands' other start-up errors, not clap's 2, which `load` keeps for rows not written.
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn load_config(path: Option<&Path>) -> anyhow::Result<Config> {
    let default = Path::new("config/hydrant.toml");
    let path = match path {
        Some(p) => Some(p),
        None if default.exists() => Some(default),
        None => None,
    };
    Ok(Config::load(path, Config::environment()?)?)
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    // Two files are not merged, and which one wins would be a guess: refused. clap takes a global option
    // given before and after the subcommand as the later one, in silence, so the words are counted here.
    let given = config_flags(std::env::args_os().skip(1));
    if let [first, second, ..] = given.as_slice() {
        anyhow::bail!(
            "--config is given {} times ({} and {}); give it once (nothing was done)",
            given.len(),
            first.to_string_lossy(),
            second.to_string_lossy()
        );
    }
    let config_file = cli.config.as_deref();
    let mut config = load_config(config_file)?;
    if matches!(cli.command, Command::Load { .. }) {
        // A load reports every batch the store failed in its own lines; the Redis client's warnings
        // about the same connection (its errors broadcast, its commands dropped when the load quits)
        // would bury them. A level that names the client itself is kept.
        quiet_store_client(&mut config.telemetry.log_level);
    }
    hydrant::telemetry::init_logging(&config.telemetry);
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if config.server.workers > 0 {
        rt.worker_threads(config.server.workers);
    }
    let rt = rt
        .enable_all()
        // The blocking pool hands each task to its idle threads in turn, so the folder watch (every
        // `registry.reload_interval`, 2 s) alone kept a thread alive per 2 s of tokio's 10 s keep-alive:
        // five threads a burst of embedded-store reads had started never retired. At 3 s, one or two stay.
        .thread_keep_alive(std::time::Duration::from_secs(3))
        .build()?;
    match cli.command {
        Command::Serve => serve(&rt, config),
        Command::Validate {
            dir,
            models,
            no_models,
        } => {
            let mut config = config;
            // Messages name the setting a path came from; here the command line may have given it.
            let mut renames: Vec<(&str, &str)> = Vec::new();
            if let Some(d) = dir {
                config.registry.schemas = d;
                renames.push(("registry.schemas", "the folder given to validate"));
            }
            if let Some(m) = models {
                config.registry.models = m;
                renames.push(("registry.models", "--models"));
            }
            let result = if no_models {
                read_registry(&config).map(|r| r.models.len())
            } else {
                load_models(&config, &hydrant::telemetry::Telemetry::default())
                    .map(|(r, _)| r.models.len())
            };
            match result {
                Ok(n) => {
                    println!(
                        "ok: {} is valid ({n} model(s))",
                        config.registry.schemas.display()
                    );
                    Ok(ExitCode::SUCCESS)
                }
                Err(e) => {
                    let text = renames
                        .iter()
                        .fold(format!("{e:#}"), |t, (from, to)| t.replace(from, to));
                    eprintln!("{text}");
                    Ok(ExitCode::FAILURE)
                }
            }
        }
        Command::Load {
            view,
            files,
            from_line,
        } => rt.block_on(async {
            if from_line == Some(0) {
                anyhow::bail!("--from-line: lines are numbered from 1 (nothing was loaded)");
            }
            if from_line.is_some() && files.len() > 1 {
                anyhow::bail!(
                    "--from-line names a line of one file, and {} files were given: load the others separately (nothing was loaded)",
                    files.len()
                );
            }
            let from_line = from_line.unwrap_or(1);
            // What a message that tells the user to run `hydrant` again puts before the subcommand.
            let global = match config_file {
                Some(c) => format!(" --config {}", shell_word(&c.to_string_lossy())),
                None => String::new(),
            };
            // Settings from the environment (the store's URL or path among them) are part of the
            // command to resume with; named, not shown, since a URL may hold a password.
            let mut from_env: Vec<String> = std::env::vars_os()
                .filter_map(|(k, _)| k.into_string().ok())
                .filter(|k| k.starts_with("HYDRANT_"))
                .collect();
            from_env.sort();
            let with_env = if from_env.is_empty() {
                String::new()
            } else {
                format!(", with {} set as for this run", from_env.join(", "))
            };
            let registry = read_registry(&config)?;
            let v = registry.views.get(&view).ok_or_else(|| {
                let known = hydrant::schema::known_names(registry.views.keys().map(String::as_str));
                anyhow::anyhow!(
                    "no view `{view}` is registered (views: {})",
                    known
                )
            })?;
            // Ctrl-C or SIGTERM: finish the batches in flight and print what was done; again: quit now.
            // Listening starts before the store is opened, so an interrupted connect also says so.
            let mut stopped = on_signals(None);
            // Every file opens before any is loaded (and before the store is opened, or created): a
            // typo in the last name must not leave the first files loaded and the rest not. Every problem
            // found here is named, file by file, so that one round of fixes settles them all.
            // On a thread of their own, raced against a signal: opening a FIFO waits for a writer.
            let (tx, rx) = tokio::sync::oneshot::channel();
            let (view_copy, names) = (v.clone(), files.clone());
            std::thread::Builder::new()
                .name("hydrant-load-open".into())
                .spawn(move || {
                    let mut opened = Vec::with_capacity(names.len());
                    let mut problems = Vec::new();
                    for file in &names {
                        match open_rows(&view_copy, file) {
                            Ok(f) => opened.push(f),
                            Err(why) => problems.push(why),
                        }
                    }
                    let _ = tx.send((opened, problems));
                })?;
            let (opened, problems) = tokio::select! {
                done = rx => done?,
                _ = stopped.wait_for(|s| *s) => {
                    eprintln!("interrupted while opening the files (a FIFO waits for a writer): nothing was loaded");
                    return Ok(ExitCode::from(130));
                }
            };
            match problems.as_slice() {
                [] => {}
                [one] => anyhow::bail!("{one} (nothing was loaded)"),
                many => anyhow::bail!(
                    "{} of the {} files cannot be loaded (nothing was loaded):\n  {}",
                    many.len(),
                    files.len(),
                    many.join("\n  ")
                ),
            }
            // Nothing is written while the store connects: a signal then stops at once.
            let store = tokio::select! {
                store = open_store(&config) => store?,
                _ = stopped.wait_for(|s| *s) => {
                    eprintln!("interrupted while opening the store: nothing was loaded");
                    return Ok(ExitCode::from(130));
                }
            };
            // From here a signal lets the batches being written finish.
            let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let flag = stop.clone();
            tokio::spawn(async move {
                if stopped.wait_for(|s| *s).await.is_ok() {
                    flag.store(true, std::sync::atomic::Ordering::Relaxed);
                    eprintln!("interrupted: finishing the batches being written (again to quit at once)");
                }
            });
            let mut failed = false;
            let count = files.len();
            for (i, (file, f)) in files.into_iter().zip(opened).enumerate() {
                if stop.load(std::sync::atomic::Ordering::Relaxed) {
                    eprintln!(
                        "interrupted: {} of the {count} files were not read, from {} on",
                        count - i,
                        file.display()
                    );
                    break;
                }
                // A pipe, FIFO or terminal can pause without end: a signal must still stop the load.
                let reader: Box<dyn std::io::Read + Send> =
                    if f.metadata().is_ok_and(|m| m.is_file()) {
                        Box::new(f)
                    } else {
                        Box::new(hydrant::loader::Stoppable::new(f, stop.clone())?)
                    };
                let input = hydrant::loader::Input {
                    reader: std::io::BufReader::new(reader),
                    csv: hydrant::loader::is_csv(&file),
                    from_line,
                };
                let report = hydrant::loader::load_until(
                    v,
                    &config.store.prefix,
                    input,
                    &config.limits,
                    store.clone(),
                    &stop,
                )
                .await
                .map_err(|e| anyhow::anyhow!("{}: {e:#}", file.display()))?;
                for r in &report.rejected {
                    eprintln!("{}:{}: rejected: {}", file.display(), r.line, r.reason);
                }
                if report.rejected_rows > report.rejected.len() {
                    eprintln!(
                        "{}: ... and {} more rejected rows (only the first {} are listed)",
                        file.display(),
                        report.rejected_rows - report.rejected.len(),
                        report.rejected.len()
                    );
                }
                for b in &report.failed {
                    let what = if b.unconfirmed {
                        "not confirmed, may have been written"
                    } else if b.partial {
                        "written in part"
                    } else {
                        "not written"
                    };
                    eprintln!(
                        "{}:{}-{}: {what} ({} rows): {}",
                        file.display(),
                        b.first_line,
                        b.last_line,
                        b.rows,
                        b.reason
                    );
                }
                if let Some(why) = &report.gave_up {
                    eprintln!("{}: {why}", file.display());
                }
                let (unconfirmed, not_written): (Vec<_>, Vec<_>) =
                    report.failed.iter().partition(|b| b.unconfirmed);
                let (partial, not_written): (Vec<_>, Vec<_>) =
                    not_written.into_iter().partition(|b| b.partial);
                // How to resume from `line`: the same command on the same file, or, for a pipe (which
                // cannot be read twice), the rows sent again.
                // Standard input and inherited descriptors are this process's: named again, they are
                // another process's, even where they are files.
                let regular = !(file.starts_with("/dev/stdin")
                    || file.starts_with("/dev/fd")
                    || file.starts_with("/proc"))
                    && std::fs::metadata(&file).is_ok_and(|m| m.is_file());
                let again = |line: usize| {
                    if regular {
                        format!(
                            "load the file again from line {line} on (hydrant{global} load --view {} --from-line {line} {}){with_env}",
                            shell_word(&view),
                            shell_word(&file.to_string_lossy())
                        )
                    } else {
                        format!(
                            "send its rows from line {line} on again (this input is not a file and cannot be read twice: save the rows to a file to resume it with --from-line {line})"
                        )
                    }
                };
                if !unconfirmed.is_empty() {
                    eprintln!(
                        "{}: {} batch(es) timed out (store.redis.write_timeout): they may still be applied, so later rows of their keys were not sent. Once Redis answers in time, {}: that writes each key's last row last",
                        file.display(),
                        unconfirmed.len(),
                        again(unconfirmed[0].first_line),
                    );
                }
                // The first row of a batch the store refused: every row before it was written (or
                // rejected for itself), so the load resumes there; rows after it already written are
                // written again, which is safe.
                if let Some(first) = not_written
                    .iter()
                    .chain(&partial)
                    .map(|b| b.first_line)
                    .min()
                {
                    eprintln!(
                        "{}: to write the rows the store refused, once it takes writes again, {}{}",
                        file.display(),
                        again(first),
                        if unconfirmed.is_empty() {
                            ""
                        } else {
                            " or from the timed-out batch's line above, whichever is earlier"
                        }
                    );
                }
                if report.unannounced > 0 {
                    eprintln!(
                        "{}: {} batch(es) written but not announced to running replicas; they see them within the view's cache.ttl",
                        file.display(),
                        report.unannounced
                    );
                }
                let rows = |v: &[&hydrant::loader::FailedBatch]| v.iter().map(|b| b.rows).sum::<usize>();
                let partial = if partial.is_empty() {
                    String::new()
                } else {
                    format!(
                        ", {} in batches written in part (listed above; loading them again is safe)",
                        rows(&partial)
                    )
                };
                let skipped = if report.skipped > 0 {
                    format!(
                        " ({} before line {from_line} skipped)",
                        count_rows(report.skipped)
                    )
                } else {
                    String::new()
                };
                println!(
                    "{}: {} written to view `{view}`, {} rejected, {} not written, {} not confirmed{partial}{skipped}",
                    file.display(),
                    count_rows(report.written),
                    report.rejected_rows,
                    rows(&not_written),
                    rows(&unconfirmed)
                );
                failed |= report.rejected_rows > 0
                    || !report.failed.is_empty()
                    || report.gave_up.is_some();
            }
            // Closed here, while the runtime still runs: closing from the store's drop as the process
            // exits is cut short, and fred warns about it.
            store.close().await;
            Ok(if stop.load(std::sync::atomic::Ordering::Relaxed) {
                ExitCode::from(130)
            } else if failed {
                ExitCode::from(2)
            } else {
                ExitCode::SUCCESS
            })
        }),
    }
}

/// Opens a file of rows for `hydrant load` and checks what can be checked before anything is written:
/// that it is a readable, uncompressed file and, for a CSV file that can be read twice (not a pipe),
/// that the view takes its header. The error names the file.
fn open_rows(view: &hydrant::schema::View, file: &Path) -> Result<std::fs::File, String> {
    let name = file.display();
    let mut f = std::fs::File::open(file).map_err(|e| format!("cannot open {name}: {e}"))?;
    if f.metadata().is_ok_and(|m| m.is_dir()) {
        return Err(format!(
            "{name} is a directory: expected a JSON Lines or CSV file"
        ));
    }
    if let Some(kind) = compressed(&f).map_err(|e| format!("cannot read {name}: {e}"))? {
        return Err(format!(
            "{name} is {kind}-compressed: expected a JSON Lines or CSV file; decompress it first"
        ));
    }
    if hydrant::loader::is_csv(file) && f.metadata().is_ok_and(|m| m.is_file()) {
        hydrant::loader::check_csv_header(view, std::io::BufReader::new(&f))
            .map_err(|e| format!("{name}: {e:#}"))?;
        std::io::Seek::rewind(&mut f).map_err(|e| format!("cannot read {name}: {e}"))?;
    }
    Ok(f)
}

/// The values of every `--config` on a command line (`--config F` and `--config=F`), up to a `--`.
fn config_flags(mut args: impl Iterator<Item = std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    let mut values = Vec::new();
    while let Some(a) = args.next() {
        let bytes = a.as_encoded_bytes();
        if bytes == b"--" {
            break;
        } else if bytes == b"--config" {
            values.push(args.next().unwrap_or_default());
        } else if let Some(v) = a.to_str().and_then(|s| s.strip_prefix("--config=")) {
            values.push(v.into());
        }
    }
    values
}

/// `n rows`, or `1 row`.
fn count_rows(n: usize) -> String {
    if n == 1 {
        "1 row".to_owned()
    } else {
        format!("{n} rows")
    }
}

/// Adds `fred=error` to a log filter that does not name the Redis client (`fred`) itself.
fn quiet_store_client(filter: &mut String) {
    if !filter.contains("fred") {
        filter.push_str(",fred=error");
    }
}

/// `word` as one word for a POSIX shell, to be pasted from a message: as it is when it holds only
/// characters no shell treats specially, else in single quotes (a `'` inside closes, escapes and reopens).
fn shell_word(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./=:,+@%".contains(&b));
    if plain {
        word.to_owned()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// The compression a regular file `f` starts with, by its magic bytes; `f` is left at its start. (A
/// compressed file would be read as text and refused line by line as "not UTF-8".) A pipe or FIFO, as
/// from `<(zcat rows.jsonl.gz)`, is not looked at: what was read could not be put back.
fn compressed(mut f: &std::fs::File) -> std::io::Result<Option<&'static str>> {
    use std::io::{Read as _, Seek as _};
    if !f.metadata()?.is_file() {
        return Ok(None);
    }
    let mut head = [0u8; 6];
    let mut n = 0;
    while n < head.len() {
        match f.read(&mut head[n..])? {
            0 => break,
            k => n += k,
        }
    }
    f.rewind()?;
    let head = &head[..n];
    Ok([
        (&b"\x1f\x8b"[..], "gzip"),
        (b"\x28\xb5\x2f\xfd", "zstd"),
        (b"BZh", "bzip2"),
        (b"\xfd7zXZ\x00", "xz"),
        (b"PK\x03\x04", "zip"),
    ]
    .into_iter()
    .find(|(magic, _)| head.starts_with(magic))
    .map(|(_, kind)| kind))
}

/// Listens for SIGTERM and Ctrl-C: the first sets the returned channel to `true`; a second exits at
/// once with status 130, printing `second` first when given.
fn on_signals(second: Option<&'static str>) -> tokio::sync::watch::Receiver<bool> {
    let (tx, rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown_signal().await;
        let _ = tx.send(true);
        shutdown_signal().await;
        if let Some(line) = second {
            eprintln!("{line}");
        }
        std::process::exit(130);
    });
    rx
}

/// `hydrant serve`: until SIGTERM or Ctrl-C.
fn serve(rt: &tokio::runtime::Runtime, config: Config) -> anyhow::Result<ExitCode> {
    rt.block_on(async {
        // Listened for from the start: a SIGTERM or Ctrl-C while the models load or the store
        // connects ends the start-up cleanly rather than killing the process. A second one does not
        // wait for in-flight requests (server.shutdown_grace).
        let stopped = on_signals(Some(
            "second signal: quitting without waiting for requests in flight",
        ));
        let mut during = stopped.clone();
        let app = tokio::select! {
            app = Application::build(config) => app?,
            _ = during.wait_for(|s| *s) => {
                eprintln!("interrupted during start-up: not serving");
                return Ok(ExitCode::SUCCESS);
            }
        };
        let mut stopped = stopped;
        app.run_until_stopped(async move {
            let _ = stopped.wait_for(|s| *s).await;
        })
        .await?;
        Ok(ExitCode::SUCCESS)
    })
}

#[cfg(test)]
mod tests {
    use super::shell_word;

    #[test]
    fn a_shell_word_pastes_back_as_the_same_single_argument() {
        for (word, want) in [
            ("rows/user_profile.jsonl", "rows/user_profile.jsonl"),
            ("my rows.csv", "'my rows.csv'"),
            ("it's.csv", r"'it'\''s.csv'"),
            ("$HOME/x;rm", "'$HOME/x;rm'"),
            ("", "''"),
        ] {
            assert_eq!(shell_word(word), want, "{word:?}");
            // And a real shell reads it back as the one word it was.
            let out = std::process::Command::new("sh")
                .arg("-c")
                .arg(format!("printf %s {}", shell_word(word)))
                .output()
                .expect("sh runs");
            assert_eq!(String::from_utf8_lossy(&out.stdout), word);
        }
    }
}
