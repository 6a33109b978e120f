//! Start-up refuses what it cannot serve, saying which file and what is wrong; and the binary shuts down
//! cleanly on SIGTERM.

mod common;

use std::path::Path;
use std::sync::Arc;

use common::{root, test_config};
use hydrant::app::Application;
use hydrant::clock::Clock;
use hydrant::store::EmbeddedStore;

/// The hydrant binary, run from `cwd`.
fn hydrant(cwd: &Path) -> std::process::Command {
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_hydrant"));
    c.current_dir(cwd);
    c
}

/// Runs `cmd`, which must fail, and returns what it printed on stderr.
fn fails(cmd: &mut std::process::Command) -> String {
    let out = cmd.output().expect("runs");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "it succeeded: {err}");
    err
}

/// Sends SIGTERM to a running `hydrant serve`, waits for it, and checks that it exited cleanly: its stderr.
fn terminate(child: std::process::Child) -> String {
    let out = sigterm(child);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "exit status {:?}: {err}", out.status);
    err
}

/// Sends SIGTERM to `child` and waits for it.
fn sigterm(child: std::process::Child) -> std::process::Output {
    let status = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    child.wait_with_output().expect("exits")
}

/// Runs hydrant with `args` against a Redis that accepts the connection and never answers, sends
/// SIGTERM 1.5 s in, and returns how it ended; it must not have waited out the 30 s connect timeout.
fn interrupted_while_redis_connects(args: &[&str]) -> std::process::Output {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let redis = silent.local_addr().expect("addr");
    let started = std::time::Instant::now();
    let child = hydrant(&root())
        .env("HYDRANT_SERVER__BIND", "127.0.0.1:0")
        .env("HYDRANT_STORE__REDIS__URL", format!("redis://{redis}"))
        .env("HYDRANT_STORE__REDIS__CONNECT_TIMEOUT", "30s")
        .args(args)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("starts");
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let out = sigterm(child);
    assert!(
        started.elapsed() < std::time::Duration::from_secs(20),
        "it waited out the connect timeout"
    );
    drop(silent);
    out
}

/// A copy of the demo schemas and models in a temp folder, with `edit` applied.
fn workspace(edit: impl FnOnce(&Path, &Path)) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    for sub in ["schemas", "models"] {
        std::fs::create_dir_all(dir.path().join(sub)).expect("mkdir");
        for e in std::fs::read_dir(root().join(sub)).expect("read") {
            let p = e.expect("entry").path();
            if p.is_file() {
                std::fs::copy(&p, dir.path().join(sub).join(p.file_name().expect("name")))
                    .expect("copy");
            }
        }
    }
    edit(&dir.path().join("schemas"), &dir.path().join("models"));
    dir
}

async fn build_error(dir: &tempfile::TempDir) -> String {
    build_error_with(dir, test_config()).await
}

async fn build_error_with(dir: &tempfile::TempDir, mut c: hydrant::config::Config) -> String {
    c.registry.schemas = dir.path().join("schemas");
    c.registry.models = dir.path().join("models");
    let store = Arc::new(EmbeddedStore::open(&dir.path().join("s.redb")).expect("store"));
    match Application::build_with_store(c, store, Clock::default()).await {
        Ok(_) => panic!("start-up should fail"),
        Err(e) => format!("{e:#}"),
    }
}

/// Makes a FIFO at `path` (with `mkfifo`, as a user would).
fn mkfifo(path: &Path) {
    let made = std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .expect("mkfifo runs");
    assert!(made.success(), "mkfifo {}", path.display());
}

fn replace(path: &Path, from: &str, to: &str) {
    let s = std::fs::read_to_string(path).expect("read");
    assert!(s.contains(from), "{from} not in {}", path.display());
    std::fs::write(path, s.replace(from, to)).expect("write");
}

#[tokio::test]
async fn a_typo_in_a_schema_names_the_file_and_path() {
    let dir = workspace(|s, _| {
        replace(
            &s.join("ctr.yaml"),
            "feature: user_profile:age",
            "feature: user_profile:agee",
        )
    });
    let e = build_error(&dir).await;
    assert!(
        e.contains("ctr.yaml") && e.contains("inputs[0].feature") && e.contains("agee"),
        "{e}"
    );
}

#[tokio::test]
async fn a_dtype_mismatch_names_the_feature() {
    let dir = workspace(|s, _| {
        replace(
            &s.join("user_profile.yaml"),
            "{name: age, dtype: int64, default: 30}",
            "{name: age, dtype: int64, default: thirty}",
        )
    });
    let e = build_error(&dir).await;
    assert!(
        e.contains("user_profile.yaml") && e.contains("features[0].default") && e.contains("int64"),
        "{e}"
    );
}

#[tokio::test]
async fn defaults_that_drive_the_model_to_nan_are_refused_at_start_up() {
    // A valid float32, but the demo model's hidden layer turns it into infinity, then NaN: every user not
    // in the store would get a 500.
    let dir = workspace(|s, _| {
        replace(
            &s.join("user_profile.yaml"),
            "default: [0, 0, 0, 0]",
            "default: [-3.4e38, 0, 0, 0]",
        )
    });
    let e = build_error(&dir).await;
    assert!(
        e.contains("output `score`")
            && e.contains("row of defaults")
            && e.contains("user_profile:embedding = [-3.4e+38,0.0,0.0,0.0]"),
        "{e}"
    );
}

#[tokio::test]
async fn a_binding_narrower_than_the_model_input_is_refused() {
    let dir = workspace(|s, _| {
        replace(
            &s.join("ctr.yaml"),
            "  - feature: user_profile:embedding\n",
            "",
        )
    });
    let e = build_error(&dir).await;
    assert!(
        e.contains("23 columns wide") && e.contains("takes 27"),
        "{e}"
    );
}

#[tokio::test]
async fn a_corrupt_or_missing_onnx_file_is_a_start_up_error() {
    let dir = workspace(|_, m| {
        std::fs::write(m.join("ctr.onnx"), b"this is not a model").expect("write")
    });
    let e = build_error(&dir).await;
    assert!(
        e.contains("ctr.onnx") && e.contains("not a loadable ONNX model"),
        "{e}"
    );
    let dir = workspace(|_, m| std::fs::remove_file(m.join("ctr.onnx")).expect("rm"));
    let e = build_error(&dir).await;
    assert!(
        e.contains("ctr.onnx") && e.contains("does not exist"),
        "{e}"
    );
    // It names the schema file and its key, where the fix goes.
    assert!(e.contains("ctr.yaml") && e.contains("`file: "), "{e}");
    // A FIFO would block ONNX Runtime's read for ever; a folder fails obscurely.
    let dir = workspace(|_, m| {
        std::fs::remove_file(m.join("ctr.onnx")).expect("rm");
        mkfifo(&m.join("ctr.onnx"));
    });
    let e = build_error(&dir).await;
    assert!(
        e.contains("ctr.onnx") && e.contains("not a regular file"),
        "{e}"
    );
}

#[tokio::test]
async fn a_model_may_not_start_more_threads_than_the_bound() {
    // 5 sessions × 256 intra-op threads: each number is within its own bound, the product is not.
    let dir = workspace(|s, _| {
        replace(
            &s.join("ctr.yaml"),
            "device: cpu",
            "device: cpu\nsessions: 5",
        )
    });
    let mut c = test_config();
    c.inference.intra_threads = 256;
    let e = build_error_with(&dir, c).await;
    assert!(
        e.contains("1280 threads, more than 1024")
            && e.contains("ctr.yaml")
            && e.contains("`sessions`"),
        "{e}"
    );
    let dir = workspace(|_, _| {});
    let mut c = test_config();
    c.inference.intra_threads = 256;
    c.inference.default_sessions = 256;
    let e = build_error_with(&dir, c).await;
    assert!(e.contains("inference.default_sessions"), "{e}");
}

/// Models that load and look right but cannot serve the binding are refused at start-up, not answered
/// with 500 on every request (tests/models/make.py writes them).
#[tokio::test]
async fn a_model_that_cannot_run_the_binding_is_refused_at_start_up() {
    for (file, why) in [
        ("fixed_batch.onnx", "first dimension must be dynamic"),
        ("two_inputs.onnx", "another required input"),
        ("symbolic_width.onnx", "trial run on one row"),
        ("batch_mean.onnx", "must score each row on its own"),
    ] {
        let dir = workspace(|s, m| {
            std::fs::copy(root().join("tests/models").join(file), m.join(file)).expect("copy");
            replace(
                &s.join("ctr.yaml"),
                "file: ctr.onnx",
                &format!("file: {file}"),
            );
        });
        let e = build_error(&dir).await;
        assert!(
            e.contains(file) && e.contains("trial run") && e.contains(why),
            "{file}: {e}"
        );
    }
    // Without batching a run holds one request's rows: a model that relates them may serve.
    let dir = workspace(|s, m| {
        std::fs::copy(
            root().join("tests/models/batch_mean.onnx"),
            m.join("batch_mean.onnx"),
        )
        .expect("copy");
        replace(
            &s.join("ctr.yaml"),
            "file: ctr.onnx",
            "file: batch_mean.onnx",
        );
    });
    let mut c = test_config();
    c.inference.batching = false;
    c.registry.schemas = dir.path().join("schemas");
    c.registry.models = dir.path().join("models");
    let store = Arc::new(EmbeddedStore::open(&dir.path().join("s.redb")).expect("store"));
    if let Err(e) = Application::build_with_store(c, store, Clock::default()).await {
        panic!("batch_mean.onnx without batching: {e:#}");
    }
}

/// A damaged store file, or one another process holds, is a start-up error that says so, never a
/// panic inside the storage engine.
#[tokio::test]
async fn a_damaged_or_busy_embedded_store_is_refused_with_what_to_do() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("s.redb");
    {
        let store: std::sync::Arc<dyn hydrant::store::Store> =
            std::sync::Arc::new(EmbeddedStore::open(&path).expect("store"));
        common::load_demo_rows(&store).await;
        let again = EmbeddedStore::open(&path).err().expect("held by the first");
        assert!(
            format!("{again:#}").contains("in use by another process"),
            "{again:#}"
        );
    }
    let mut bytes = std::fs::read(&path).expect("read");
    let mid = bytes.len() / 2;
    for (i, b) in bytes[mid..mid + 8192].iter_mut().enumerate() {
        *b ^= 0x5a ^ (i as u8);
    }
    std::fs::write(&path, bytes).expect("write");
    let e = EmbeddedStore::open(&path).err().expect("damaged");
    let e = format!("{e:#}");
    assert!(
        e.contains("is damaged") && e.contains("hydrant load"),
        "{e}"
    );
    // An empty file is no store either (redb would quietly make it a new one).
    std::fs::write(&path, b"").expect("truncate");
    let e = EmbeddedStore::open(&path).err().expect("empty");
    let e = format!("{e:#}");
    assert!(e.contains("is an empty file"), "{e}");
    assert_eq!(
        std::fs::metadata(&path).expect("kept").len(),
        0,
        "left as it was"
    );
}

/// A schema saved with a byte-order mark right before its first key loads like any other; a config
/// path that is a FIFO or a device is refused at once instead of hanging or filling memory.
#[tokio::test]
async fn a_bom_is_skipped_and_a_config_that_is_not_a_file_is_refused() {
    let dir = workspace(|s, _| {
        let ctr = s.join("ctr.yaml");
        let text = std::fs::read_to_string(&ctr).expect("read");
        let body: String = text
            .lines()
            .skip_while(|l| l.starts_with('#'))
            .map(|l| format!("{l}\n"))
            .collect();
        assert!(body.starts_with("kind: model"), "{body}");
        std::fs::write(&ctr, format!("\u{feff}{body}")).expect("write");
    });
    let mut c = test_config();
    c.registry.schemas = dir.path().join("schemas");
    c.registry.models = dir.path().join("models");
    let store = Arc::new(EmbeddedStore::open(&dir.path().join("s.redb")).expect("store"));
    let app = Application::build_with_store(c, store, Clock::default()).await;
    assert!(app.is_ok(), "{:#}", app.err().expect("error"));

    let fifo = dir.path().join("hydrant.toml");
    mkfifo(&fifo);
    for path in [fifo.as_path(), Path::new("/dev/zero")] {
        let e = hydrant::config::Config::load(Some(path), std::iter::empty()).expect_err("refused");
        assert!(e.to_string().contains("not a regular file"), "{e}");
    }
}

/// Set on a GPU machine to skip the test below. Not HYDRANT_*: every HYDRANT_ variable is read as a config
/// key, and an unknown one stops start-up.
const CUDA_SWITCH: &str = "TEST_HAS_CUDA";

#[test]
fn the_gpu_test_switch_the_readme_names_is_not_read_as_config() {
    hydrant::config::Config::load(None, [(CUDA_SWITCH.to_owned(), "1".to_owned())])
        .expect("the switch must not stop start-up");
    let readme = std::fs::read_to_string(root().join("README.md")).expect("README");
    assert!(
        readme.contains(&format!("`{CUDA_SWITCH}=1`")),
        "README names another switch"
    );
}

#[tokio::test]
async fn cuda_on_a_machine_without_it_is_a_clear_start_up_error() {
    if std::env::var(CUDA_SWITCH).is_ok_and(|v| !v.is_empty() && v != "0") {
        return; // on a GPU machine this configuration is valid
    }
    let dir = workspace(|s, _| replace(&s.join("ctr.yaml"), "device: cpu", "device: cuda"));
    let e = build_error(&dir).await;
    assert!(
        e.contains("CUDA execution provider cannot be used") && e.contains("device: auto"),
        "{e}"
    );
    // ONNX Runtime's own reason ends a sentence of ours, without doubling its full stop.
    assert!(!e.contains(".."), "{e}");
    // `auto` falls back to the CPU and serves.
    let dir = workspace(|s, _| replace(&s.join("ctr.yaml"), "device: cpu", "device: auto"));
    let mut c = test_config();
    c.registry.schemas = dir.path().join("schemas");
    c.registry.models = dir.path().join("models");
    let store = Arc::new(EmbeddedStore::open(&dir.path().join("s.redb")).expect("store"));
    let app = Application::build_with_store(c, store, Clock::default())
        .await
        .expect("auto falls back");
    assert_eq!(
        app.gateway().catalog.load().engines["ctr"].info().device,
        "cpu"
    );
}

#[test]
fn the_binary_reports_a_missing_onnx_runtime_library_and_how_to_get_it() {
    let err = fails(
        hydrant(&root())
            .env("ORT_DYLIB_PATH", "/nonexistent/libonnxruntime.so")
            .args(["validate"]),
    );
    assert!(
        err.contains("ONNX Runtime library not found")
            && err.contains("make ort")
            && err.contains("inference.onnxruntime_library"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn a_serve_that_fails_at_start_up_leaves_no_store_file_behind() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = dir.path().join("data/s.redb");
    let err = fails(
        hydrant(&root())
            .env("HYDRANT_STORE__EMBEDDED__PATH", &store)
            .env("HYDRANT_REGISTRY__SCHEMAS", dir.path().join("nosuch"))
            .env("HYDRANT_SERVER__BIND", "127.0.0.1:0")
            .args(["serve"]),
    );
    assert!(err.contains("cannot read the schemas folder"), "{err}");
    assert!(
        !store.exists(),
        "a failed start created {}",
        store.display()
    );
}

/// A CSV header the view cannot take, in the last of several files, is refused before the first file
/// is loaded: a run loads all its files or, for such a mistake, none.
#[test]
fn a_bad_csv_header_in_a_later_file_loads_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let good = dir.path().join("good.jsonl");
    std::fs::write(&good, "{\"user_id\": \"u_first\", \"age\": 3}\n").expect("write");
    let bad = dir.path().join("later.csv");
    std::fs::write(&bad, "user_id,age,age\nu_later,1,2\n").expect("write");
    let store = dir.path().join("s.redb");
    let err = fails(
        hydrant(&root())
            .env("HYDRANT_STORE__EMBEDDED__PATH", &store)
            .args(["load", "--view", "user_profile"])
            .arg(&good)
            .arg(&bad),
    );
    assert!(
        err.contains("later.csv: the CSV header names the column `age` twice")
            && err.contains("nothing was loaded"),
        "{err}"
    );
    assert!(
        !store.exists(),
        "no store was created, so nothing was written"
    );
    // Every file's problem is named in the one run, not just the first one found.
    let other = dir.path().join("other.csv");
    std::fs::write(&other, "user_id,agee\nu_other,1\n").expect("write");
    let err = fails(
        hydrant(&root())
            .env("HYDRANT_STORE__EMBEDDED__PATH", &store)
            .args(["load", "--view", "user_profile"])
            .arg(&bad)
            .arg(&good)
            .arg(dir.path().join("missing.jsonl"))
            .arg(&other),
    );
    assert!(
        err.contains("3 of the 4 files cannot be loaded (nothing was loaded)")
            && err.contains("later.csv: the CSV header names the column `age` twice")
            && err.contains("cannot open ")
            && err.contains("missing.jsonl")
            && err.contains("other.csv: ")
            && err.contains("`agee`"),
        "{err}"
    );
    assert!(!store.exists(), "nothing was written");
    // With the header put right, both files load.
    std::fs::write(&bad, "user_id,age\nu_later,1\n").expect("write");
    let out = hydrant(&root())
        .env("HYDRANT_STORE__EMBEDDED__PATH", &store)
        .args(["load", "--view", "user_profile"])
        .arg(&good)
        .arg(&bad)
        .output()
        .expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("later.csv: 1 row written"), "{said}");
    // Logs written to a pipe or a file carry no terminal colour codes.
    assert!(
        err.contains("created a new, empty embedded store") && !err.contains('\u{1b}'),
        "{err:?}"
    );
}

/// `--from-line` resumes a load where an earlier one's writes timed out: the rows before the line are
/// read past (a bad one among them is not reported), the rest are written. It names a line of one file.
#[test]
fn a_load_resumed_from_a_line_writes_only_the_rows_from_it_on() {
    let dir = tempfile::tempdir().expect("tempdir");
    let rows = dir.path().join("rows.jsonl");
    std::fs::write(
        &rows,
        "{\"user_id\": \"u_a\", \"age\": 1}\n{\"user_id\": \"u_b\", \"age\": \"not a number\"}\n{\"user_id\": \"u_c\", \"age\": 3}\n{\"user_id\": \"u_d\", \"age\": \"bad too\"}\n",
    )
    .expect("write");
    let store = dir.path().join("s.redb");
    let load = |extra: &[&str]| {
        hydrant(&root())
            .env("HYDRANT_STORE__EMBEDDED__PATH", &store)
            .args(["load", "--view", "user_profile"])
            .args(extra)
            .arg(&rows)
            .output()
            .expect("runs")
    };
    let out = load(&["--from-line", "3"]);
    let (said, err) = texts(&out);
    assert_eq!(
        out.status.code(),
        Some(2),
        "line 4 is still bad: {said} {err}"
    );
    assert!(
        said.contains("1 row written to view `user_profile`, 1 rejected")
            && said.contains("(2 rows before line 3 skipped)"),
        "{said}"
    );
    assert!(
        err.contains("rows.jsonl:4: rejected") && !err.contains("rows.jsonl:2:"),
        "{err}"
    );
    // From the first line, the whole file, as without the flag.
    let out = load(&["--from-line", "1"]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains("2 rows written to view `user_profile`, 2 rejected")
            && !said.contains("skipped"),
        "{said}"
    );
    // Past the last row: nothing to load, and the load fails saying why.
    let out = load(&["--from-line", "9"]);
    let (said, err) = texts(&out);
    assert_eq!(out.status.code(), Some(2), "{said} {err}");
    assert!(
        err.contains("rows.jsonl: the file's last row starts on line 4, before line 9 where the load was to start: nothing was loaded")
            && said.contains("0 rows written"),
        "{said} {err}"
    );

    // Refused before anything is opened: line 0, and a line of several files.
    for (line, files, why) in [
        ("0", 1, "--from-line: lines are numbered from 1"),
        (
            "3",
            2,
            "--from-line names a line of one file, and 2 files were given",
        ),
    ] {
        let err = fails(
            hydrant(&root())
                .env(
                    "HYDRANT_STORE__EMBEDDED__PATH",
                    dir.path().join("other.redb"),
                )
                .args(["load", "--view", "user_profile", "--from-line", line])
                .args(std::iter::repeat_n(&rows, files)),
        );
        assert!(err.contains(why), "{err}");
    }
    assert!(
        !dir.path().join("other.redb").exists(),
        "nothing was opened"
    );
}

/// A signal stops a load whose input waits: a FIFO no writer has opened yet (its open waits), and a
/// pipe whose writer has sent some rows and then pauses (its read waits). Neither waits for the writer.
#[test]
fn a_load_waiting_for_its_input_stops_on_sigterm() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fifo = dir.path().join("rows.jsonl");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .expect("mkfifo");
    assert!(made.success());
    let load = || {
        let mut cmd = hydrant(&root());
        cmd.env("HYDRANT_STORE__EMBEDDED__PATH", dir.path().join("s.redb"))
            .args(["load", "--view", "user_profile"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        cmd
    };
    let started = std::time::Instant::now();
    let child = load().arg(&fifo).spawn().expect("starts");
    std::thread::sleep(std::time::Duration::from_millis(1000));
    let out = sigterm(child);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{err}");
    assert!(
        err.contains(
            "interrupted while opening the files (a FIFO waits for a writer): nothing was loaded"
        ),
        "{err}"
    );

    let mut child = load()
        .arg("/dev/stdin")
        .stdin(std::process::Stdio::piped())
        .spawn()
        .expect("starts");
    let mut rows = child.stdin.take().expect("stdin");
    std::io::Write::write_all(
        &mut rows,
        b"{\"user_id\": \"p_1\", \"age\": 1}\n{\"user_id\": \"p_2\", \"age\": 2}\n",
    )
    .expect("write");
    std::thread::sleep(std::time::Duration::from_millis(2000));
    let out = sigterm(child);
    let (said, err) = texts(&out);
    assert_eq!(out.status.code(), Some(130), "{said} {err}");
    assert!(
        err.contains("interrupted while waiting for input after line 2")
            && said.contains("2 rows written to view `user_profile`"),
        "{said} {err}"
    );
    // The pipe's writer (this test) never closed it.
    drop(rows);
    assert!(started.elapsed() < std::time::Duration::from_secs(20));
}

/// A compressed data file is refused by name before anything is opened, the store included, rather
/// than read as text and refused line by line as "not UTF-8".
#[test]
fn a_compressed_data_file_is_refused_before_the_store_is_created() {
    let dir = tempfile::tempdir().expect("tempdir");
    let gz = dir.path().join("rows.jsonl.gz");
    std::fs::write(&gz, b"\x1f\x8b\x08\x00\x00\x00\x00\x00").expect("write");
    let store = dir.path().join("s.redb");
    let err = fails(
        hydrant(&root())
            .env("HYDRANT_STORE__EMBEDDED__PATH", &store)
            .args(["load", "--view", "user_profile"])
            .arg(&gz),
    );
    assert!(
        err.contains("rows.jsonl.gz is gzip-compressed") && err.contains("nothing was loaded"),
        "{err}"
    );
    assert!(!store.exists(), "no store was created for nothing");
    // A FIFO (as from `<(zcat rows.jsonl.gz)`) is not sniffed: its first bytes could not be put back.
    let fifo = dir.path().join("rows.jsonl");
    mkfifo(&fifo);
    let writer = {
        let fifo = fifo.clone();
        std::thread::spawn(move || {
            let row = "{\"user_id\": \"u_fifo\", \"age\": 33}\n";
            std::fs::write(fifo, row).expect("write the fifo");
        })
    };
    let out = hydrant(&root())
        .env("HYDRANT_STORE__EMBEDDED__PATH", &store)
        .args(["load", "--view", "user_profile"])
        .arg(&fifo)
        .output()
        .expect("runs");
    writer.join().expect("writer");
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{said} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(said.contains("1 row written"), "{said}");
}

#[test]
fn the_binary_says_where_a_relative_schemas_folder_was_looked_for() {
    let dir = tempfile::tempdir().expect("tempdir");
    let err = fails(
        hydrant(dir.path())
            .env("HYDRANT_REGISTRY__SCHEMAS", "nope/schemas")
            .args(["validate", "--no-models"]),
    );
    let cwd = std::fs::canonicalize(dir.path()).expect("canonical");
    assert!(
        err.contains("nope/schemas")
            && err.contains("registry.schemas")
            && err.contains(&cwd.display().to_string()),
        "{err}"
    );
    // Given on the command line, the folder is named as such, not as the setting.
    let err = fails(hydrant(dir.path()).args(["validate", "elsewhere", "--no-models"]));
    assert!(
        err.contains("elsewhere")
            && err.contains("the folder given to validate")
            && !err.contains("registry.schemas"),
        "{err}"
    );
}

#[test]
fn the_binary_reports_a_bad_config_with_file_key_and_reason() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = dir.path().join("h.toml");
    std::fs::write(&cfg, "[limits]\nrequest_timeout = \"forever\"\n").expect("write");
    let err = fails(hydrant(&root()).arg("--config").arg(&cfg).arg("serve"));
    assert!(
        err.contains("h.toml")
            && err.contains("limits.request_timeout")
            && err.contains("not a valid duration"),
        "{err}"
    );
}

#[test]
fn config_given_twice_is_refused_naming_both_files() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (a, b) = (dir.path().join("a.toml"), dir.path().join("b.toml"));
    std::fs::write(&a, "").expect("write");
    std::fs::write(&b, "").expect("write");
    // Before and after the subcommand, as clap takes a global option in either place.
    let out = hydrant(&root())
        .arg("--config")
        .arg(&a)
        .args(["validate", "--no-models", "--config"])
        .arg(&b)
        .output()
        .expect("runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("--config is given 2 times")
            && err.contains("a.toml")
            && err.contains("b.toml"),
        "{err}"
    );
}

#[test]
fn validate_at_a_models_folder_that_is_not_there_names_the_folder() {
    let err =
        fails(hydrant(&root()).args(["validate", "--models", "/nonexistent/models", "schemas"]));
    assert!(
        err.contains("the folder /nonexistent/models does not exist")
            && err.contains("--models")
            && !err.contains("registry.models"),
        "{err}"
    );
}

/// Runs `hydrant validate --no-models` on the schemas in `dir`, which must fail; its error output.
fn validate_refused(dir: &std::path::Path) -> String {
    fails(
        hydrant(&root())
            .args(["validate", "--no-models"])
            .arg(dir.join("schemas")),
    )
}

#[test]
fn validate_lists_every_schema_problem() {
    let dir = workspace(|s, _| {
        replace(
            &s.join("ctr.yaml"),
            "feature: user_profile:age",
            "feature: user_profile:agee",
        );
        replace(
            &s.join("item_stats.yaml"),
            "dtype: float64",
            "dtype: double",
        );
    });
    let err = validate_refused(dir.path());
    assert!(
        err.contains("item_stats.yaml") && err.contains("double"),
        "{err}"
    );
    // The view that failed is not reported again from the model that reads it.
    assert!(!err.contains("not registered"), "{err}");
}

#[test]
fn validate_refuses_reserved_names_bad_ttls_ignored_parameters_and_duplicate_outputs() {
    let dir = workspace(|s, _| {
        // Both in item_stats, so user_profile compiles and the model's transforms on it are checked.
        replace(&s.join("item_stats.yaml"), "key_ttl: 14d", "key_ttl: 0s");
        replace(
            &s.join("item_stats.yaml"),
            "name: impressions_7d",
            "name: event_timestamp",
        );
        replace(
            &s.join("ctr.yaml"),
            "outputs: [score]",
            "outputs: [score, score]",
        );
        replace(
            &s.join("ctr.yaml"),
            "transform: log1p",
            "transform: {log1p: {base: 2}}",
        );
    });
    let err = validate_refused(dir.path());
    for want in [
        "item_stats.yaml: store.key_ttl: `0s` is out of range",
        "item_stats.yaml: features[",
        "`event_timestamp` is reserved",
        "ctr.yaml: outputs[1]: output `score` is named twice",
        "ctr.yaml: inputs[2].transform: `log1p` takes no parameters",
    ] {
        assert!(err.contains(want), "{want}: {err}");
    }
}

#[test]
fn the_binary_refuses_absurd_sizes_without_panicking() {
    for (var, value) in [
        ("HYDRANT_INFERENCE__MAX_QUEUE", "100000000000000"),
        ("HYDRANT_INFERENCE__MAX_QUEUE", "9223372036854775807"),
        ("HYDRANT_PREFETCH__MAX_CONCURRENT", "9223372036854775807"),
        ("HYDRANT_INFERENCE__INTRA_THREADS", "100000"),
        ("HYDRANT_STORE__REDIS__POOL_SIZE", "100000"),
        ("HYDRANT_SERVER__WORKERS", "100000"),
        ("HYDRANT_LIMITS__REQUEST_TIMEOUT", "500000000d"),
        (
            "HYDRANT_LIMITS__REQUEST_TIMEOUT",
            "99999999999999999999999s",
        ),
    ] {
        let err = fails(
            hydrant(&root())
                .env(var, value)
                .args(["validate", "--no-models"]),
        );
        assert!(err.contains(var) && err.contains("must be"), "{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

/// Another program's variable that is not UTF-8 (a Latin-1 locale setting, say) is none of hydrant's
/// business; one of hydrant's own is refused by name.
#[test]
fn a_variable_that_is_not_utf8_is_ignored_unless_it_is_ours() {
    use std::os::unix::ffi::OsStrExt as _;
    let latin1 = std::ffi::OsStr::from_bytes(b"caf\xe9");
    let out = hydrant(&root())
        .env("SOME_OTHER_TOOL", latin1)
        .args(["validate", "--no-models"])
        .output()
        .expect("runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let err = fails(
        hydrant(&root())
            .env("HYDRANT_SERVER__BIND", latin1)
            .args(["validate", "--no-models"]),
    );
    assert!(
        err.contains("HYDRANT_SERVER__BIND") && err.contains("not valid UTF-8"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

/// A SIGTERM while the gateway is still starting (here: waiting for a Redis that accepts the connection
/// and never answers) ends the start-up cleanly, without waiting out the connect timeout.
#[test]
fn sigterm_during_start_up_exits_cleanly() {
    let out = interrupted_while_redis_connects(&["serve"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "exit status {:?}: {err}", out.status);
    assert!(err.contains("interrupted during start-up"), "{err}");
}

/// The same for the bulk loader: nothing is written while the store connects, so a signal stops it at
/// once (exit 130), not when the connect timeout runs out.
#[test]
fn sigterm_while_the_loader_connects_stops_it_at_once() {
    let out = interrupted_while_redis_connects(&[
        "load",
        "--view",
        "user_profile",
        "demo/rows/user_profile.jsonl",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{err}");
    assert!(err.contains("nothing was loaded"), "{err}");
}

/// What a request's store fetch logs (an unreadable record here) carries the request's id: the fetch
/// task runs in the span of the request that started it.
#[test]
fn a_fetch_logs_in_the_span_of_its_request() {
    let log = request_log("info", "text");
    let line = line_with(&log, "unreadable record served as defaults");
    assert!(line.contains(r#"request{id="trace-me-7""#), "{line}");
}

/// At `warn`, where the request span is off, a request's lines still name it, in either log format:
/// one logged by the request's own future (a score the model could not give) and one by the fetch it
/// started (an unreadable record).
#[test]
fn at_warn_a_requests_lines_still_carry_its_id() {
    let log = request_log("warn", "text");
    let line = line_with(&log, "unreadable record served as defaults");
    assert!(line.ends_with(" request_id=trace-me-7"), "{line}");
    let line = line_with(&log, "gave a non-finite `score`");
    assert!(line.ends_with(" request_id=trace-me-8"), "{line}");
    // Lines no request logged carry no id.
    assert!(
        log.lines()
            .filter(|l| l.contains("request_id="))
            .all(|l| l.contains("trace-me-")),
        "{log}"
    );

    let log = request_log("warn", "json");
    for (says, id) in [
        ("unreadable record served as defaults", "trace-me-7"),
        ("gave a non-finite `score`", "trace-me-8"),
    ] {
        let line = line_with(&log, says);
        let parsed: serde_json::Value = serde_json::from_str(line).expect("a JSON line");
        assert_eq!(parsed["request_id"], id, "{line}");
        assert_eq!(parsed["level"], "WARN", "{line}");
        assert!(
            parsed["fields"]["message"]
                .as_str()
                .is_some_and(|m| m.contains(says)),
            "{line}"
        );
    }
}

/// The first line of `log` that holds `says`.
fn line_with<'a>(log: &'a str, says: &str) -> &'a str {
    log.lines()
        .find(|l| l.contains(says))
        .unwrap_or_else(|| panic!("no line says {says:?}: {log}"))
}

/// What a gateway logging at `level` in `format` logs for two predicts: one (`X-Request-Id: trace-me-7`)
/// for a user whose stored record is garbled, one (`trace-me-8`) for a user whose features drive the
/// model to infinity.
fn request_log(level: &str, format: &str) -> String {
    use std::io::{Read as _, Write as _};

    let redis = common::redis::RedisServer::start();
    redis.cmd(&["SET", "hy:user_profile:u_garbled", "not a record"]);
    let port = free_port();
    // The line is logged once the read is back: bounds far above a read's time keep a loaded test
    // machine from turning it into a timeout, which logs something else.
    let schemas = common::schemas_with_edit("user_profile.yaml", "timeout: 50ms", "timeout: 5s");
    let child = hydrant(&root())
        .env("HYDRANT_SERVER__BIND", format!("127.0.0.1:{port}"))
        .env("HYDRANT_STORE__REDIS__URL", redis.url())
        .env("HYDRANT_STORE__REDIS__COMMAND_TIMEOUT", "5s")
        .env("HYDRANT_REGISTRY__SCHEMAS", schemas.path())
        .env("HYDRANT_TELEMETRY__LOG_LEVEL", level)
        .env("HYDRANT_TELEMETRY__LOG_FORMAT", format)
        .env("HYDRANT_PREFETCH__WARM_TOP_K", "0")
        .arg("serve")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("starts");
    let send = |path: &str, id: &str, body: &str| -> Option<String> {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
        let request = format!(
            "POST {path} HTTP/1.1\r\nhost: h\r\nx-request-id: {id}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        s.write_all(request.as_bytes()).expect("send");
        let mut answer = String::new();
        s.read_to_string(&mut answer).expect("read");
        Some(answer)
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let garbled = r#"{"entities": {"user_id": "u_garbled"}, "candidates": [{"item_id": "i_1"}]}"#;
    let answer = loop {
        assert!(
            std::time::Instant::now() < deadline,
            "the server did not start"
        );
        match send("/v1/models/ctr/predict", "trace-me-7", garbled) {
            // Not listening, or not ready yet.
            None => std::thread::sleep(std::time::Duration::from_millis(50)),
            Some(a) if a.starts_with("HTTP/1.1 503") => {
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            Some(a) => break a,
        }
    };
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let huge =
        r#"{"rows": [{"user_id": "u_huge", "embedding": [3.4e38, -3.4e38, 3.4e38, -3.4e38]}]}"#;
    let answer = send("/v1/views/user_profile/rows", "write-1", huge).expect("connects");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let item =
        r#"{"rows": [{"item_id": "i_huge", "embedding": [3.4e38, 3.4e38, 3.4e38, 3.4e38]}]}"#;
    let answer = send("/v1/views/item_stats/rows", "write-2", item).expect("connects");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let body = r#"{"entities": {"user_id": "u_huge"}, "candidates": [{"item_id": "i_huge"}]}"#;
    let answer = send("/v1/models/ctr/predict", "trace-me-8", body).expect("connects");
    assert!(answer.starts_with("HTTP/1.1 422"), "{answer}");
    terminate(child)
}

/// A free loopback port.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// `hydrant serve` on a free port over an embedded store in `dir`, logging at `level` to a pipe, once it
/// listens; with its port.
fn serve_embedded(dir: &Path, level: &str) -> (std::process::Child, u16) {
    serve_embedded_with(dir, level, |_| {})
}

/// [`serve_embedded`], with `more` set on the command first (more variables, say).
fn serve_embedded_with(
    dir: &Path,
    level: &str,
    more: impl FnOnce(&mut std::process::Command),
) -> (std::process::Child, u16) {
    let port = free_port();
    let mut cmd = hydrant(&root());
    cmd.env("HYDRANT_SERVER__BIND", format!("127.0.0.1:{port}"))
        .env("HYDRANT_STORE__EMBEDDED__PATH", dir.join("s.redb"))
        .env("HYDRANT_TELEMETRY__LOG_LEVEL", level)
        .arg("serve")
        .stderr(std::process::Stdio::piped());
    more(&mut cmd);
    let child = cmd.spawn().expect("starts");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "the server did not start"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    (child, port)
}

/// `GET path` with `connection: close`: the whole answer, status line to body.
fn get(port: u16, path: &str) -> String {
    use std::io::{Read as _, Write as _};

    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    write!(
        s,
        "GET {path} HTTP/1.1\r\nhost: h\r\nconnection: close\r\n\r\n"
    )
    .expect("send");
    let mut answer = String::new();
    s.read_to_string(&mut answer).expect("read");
    answer
}

/// The async workers are as many as `server.workers` says, one per core when it is 0, and `/v1/stats`
/// says how many (a load tester runs its floor with as many), and the scheduling group it runs in.
#[test]
fn the_async_workers_are_as_many_as_server_workers_says() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    for (workers, expected) in [(Some("3"), 3), (None, cores)] {
        let (child, port) = serve_embedded_with(dir.path(), "warn", |cmd| {
            // tokio's own variable would set the count that 0 leaves to it.
            cmd.env_remove("TOKIO_WORKER_THREADS");
            if let Some(w) = workers {
                cmd.env("HYDRANT_SERVER__WORKERS", w);
            }
        });
        let answer = get(port, "/v1/stats");
        terminate(child);
        let body = answer.split_once("\r\n\r\n").map_or("", |(_, b)| b);
        let stats: serde_json::Value = serde_json::from_str(body).expect("stats JSON");
        assert_eq!(stats["workers"], expected, "{workers:?}: {stats}");
        // Started from this process's session and cgroup: the kernel shares CPU time in the same group.
        assert_eq!(
            stats["sched_group"],
            serde_json::json!(hydrant::observe::sched_group()),
            "{stats}"
        );
    }
}

#[test]
fn sigterm_drains_and_exits_cleanly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (child, _) = serve_embedded(dir.path(), "info");
    let err = terminate(child);
    assert!(err.contains("draining in-flight requests"), "{err}");
}

/// A finished command's standard output and error, as text.
fn texts(out: &std::process::Output) -> (std::borrow::Cow<'_, str>, std::borrow::Cow<'_, str>) {
    (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    )
}

/// The process's thread count, from `/proc`.
fn threads(pid: u32) -> usize {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .expect("status")
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|n| n.trim().parse().ok())
        .expect("a Threads line")
}

/// A burst of embedded-store reads starts blocking threads; once it is over they retire, though the
/// folder watch runs every 2 s. (With tokio's 10 s keep-alive and its idle threads woken in turn, the
/// watch and the cache's upkeep had kept five to fifteen of them alive for good.)
#[test]
fn threads_started_by_a_burst_retire_after_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (child, port) = serve_embedded(dir.path(), "warn");
    // Settled: the watch's first reads are done.
    std::thread::sleep(std::time::Duration::from_secs(3));
    let before = threads(child.id());
    let burst: Vec<_> = (0..48)
        .map(|t| {
            std::thread::spawn(move || {
                for i in 0..10 {
                    let keys: Vec<String> = (0..50).map(|j| format!("\"x{t}_{i}_{j}\"")).collect();
                    let body = format!(
                        r#"{{"entities": {{"user_id": [{}]}}, "features": ["user_profile:age"]}}"#,
                        keys.join(",")
                    );
                    let answer = post(port, "/v1/features", &body).expect("connect");
                    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
                }
            })
        })
        .collect();
    for b in burst {
        b.join().expect("burst");
    }
    let during = threads(child.id());
    let started = std::time::Instant::now();
    let left = loop {
        let now = threads(child.id());
        if now <= before + 1 || started.elapsed() > std::time::Duration::from_secs(20) {
            break now;
        }
        std::thread::sleep(std::time::Duration::from_millis(250));
    };
    // Stopped before the verdict, so that a failure leaves no server behind.
    terminate(child);
    assert!(
        left <= before + 1,
        "{left} threads 20 s after the burst, {before} before it ({during} at its end)"
    );
}

/// Batches the store refuses (Redis at its `maxmemory`) are listed, and the loader says from which line
/// to load the file again, with the command.
#[test]
fn a_load_the_store_refuses_says_where_to_resume() {
    let redis = common::redis::RedisServer::start();
    redis.cmd(&["CONFIG", "SET", "maxmemory", "1"]);
    let err = fails(
        hydrant(&root())
            .env("HYDRANT_STORE__REDIS__URL", redis.url())
            .env("HYDRANT_PREFETCH__WARM_TOP_K", "0")
            .args(["load", "--view", "user_profile"])
            .arg("demo/rows/user_profile.jsonl"),
    );
    assert!(err.contains("not written"), "{err}");
    // The settings from the environment are part of the command to resume with (the store's URL among
    // them, which may hold a password: named, not shown).
    let advice = err
        .lines()
        .find(|l| l.contains("load the file again"))
        .unwrap_or_else(|| panic!("no advice: {err}"));
    assert!(
        advice.contains("load the file again from line 1 on (hydrant load --view user_profile --from-line 1 demo/rows/user_profile.jsonl), with ")
            && advice.contains("HYDRANT_STORE__REDIS__URL")
            && advice.contains("HYDRANT_PREFETCH__WARM_TOP_K")
            && advice.contains(" set as for this run"),
        "{advice}"
    );
    assert!(!advice.contains(&redis.url()), "{advice}");
    // Rows from a pipe cannot be read again: the loader says to send them again.
    let rows = std::fs::File::open(root().join("demo/rows/user_profile.jsonl")).expect("rows");
    let err = fails(
        hydrant(&root())
            .env("HYDRANT_STORE__REDIS__URL", redis.url())
            .env("HYDRANT_PREFETCH__WARM_TOP_K", "0")
            .args(["load", "--view", "user_profile", "/dev/stdin"])
            .stdin(std::process::Stdio::from(rows)),
    );
    assert!(
        err.contains(
            "send its rows from line 1 on again (this input is not a file and cannot be read twice"
        ),
        "{err}"
    );
}

/// Sends one request with `connection: close` and returns the whole answer, or `None` when nothing
/// listens on `port` yet.
fn post(port: u16, path: &str, body: &str) -> Option<String> {
    use std::io::{Read as _, Write as _};

    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    let request = format!(
        "POST {path} HTTP/1.1\r\nhost: h\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(request.as_bytes()).expect("send");
    let mut answer = String::new();
    s.read_to_string(&mut answer).expect("read");
    Some(answer)
}

/// Failures of the store that no request sees (the hot-key flush, a reconnection Redis refuses) are
/// logged with the store's own words, once per period however often they repeat.
#[test]
fn background_store_failures_are_logged_once_per_period() {
    let mut redis = common::redis::RedisServer::start();
    let port = free_port();
    let child = hydrant(&root())
        .env("HYDRANT_SERVER__BIND", format!("127.0.0.1:{port}"))
        .env("HYDRANT_STORE__REDIS__URL", redis.url())
        .env("HYDRANT_STORE__REDIS__RECONNECT_MIN_DELAY", "10ms")
        .env("HYDRANT_STORE__REDIS__RECONNECT_MAX_DELAY", "50ms")
        .env("HYDRANT_TELEMETRY__LOG_LEVEL", "warn")
        .env("HYDRANT_PREFETCH__WARM_TOP_K", "0")
        .env("HYDRANT_PREFETCH__HOT_SAMPLE_EVERY", "1")
        .env("HYDRANT_PREFETCH__HOT_FLUSH_INTERVAL", "50ms")
        .arg("serve")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("starts");
    // A hot set that is no sorted set: every flush of sampled keys fails with WRONGTYPE.
    redis.cmd(&["SET", "hy:hot:user_profile", "not a sorted set"]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let features = |user: usize| {
        format!(r#"{{"entities": {{"user_id": "u_{user}"}}, "features": ["user_profile:age"]}}"#)
    };
    for user in 0..20 {
        loop {
            match post(port, "/v1/features", &features(user)) {
                Some(a) if a.starts_with("HTTP/1.1 200") => break,
                _ if std::time::Instant::now() > deadline => {
                    terminate(child);
                    panic!("the server did not answer");
                }
                _ => std::thread::sleep(std::time::Duration::from_millis(50)),
            }
        }
        // About 20 flushes in all, each with a key sampled since the last.
        std::thread::sleep(std::time::Duration::from_millis(60));
    }
    // Then Redis away for a moment (reconnections refused), and back with a password the gateway
    // does not have (some 30 reconnections refused for it in 1.5 s).
    // The last sampled keys flushed (and refused) before Redis goes.
    std::thread::sleep(std::time::Duration::from_millis(500));
    redis.stop();
    std::thread::sleep(std::time::Duration::from_millis(500));
    redis.restart_with_password("rotated-secret");
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let err = terminate(child);
    let flushes = err
        .lines()
        .filter(|l| l.contains("hot-key flush of") && l.contains("WRONGTYPE"))
        .count();
    assert_eq!(flushes, 1, "{err}");
    // A line for each reason: the password's is not held back behind the refused connections'.
    let refusals = |reason: &str| {
        err.lines()
            .filter(|l| l.contains("refused or failed a reconnection") && l.contains(reason))
            .count()
    };
    assert_eq!(refusals("ConnectionRefused"), 1, "{err}");
    assert_eq!(refusals("NOAUTH"), 1, "{err}");
}

/// A usage error starts nothing: exit status 1, as the other start-up errors, not 2, which `load`
/// keeps for rows that were not written. Help is no error.
#[test]
fn usage_errors_exit_1_and_help_exits_0() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for args in [
        &["load", "--bogus"][..],
        &["load", "demo/rows/user_profile.jsonl"],
        &[
            "load",
            "--view",
            "user_profile",
            "--from-line",
            "abc",
            "x.jsonl",
        ],
        &["frobnicate"],
    ] {
        let out = hydrant(root).args(args).output().expect("runs");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.starts_with("error:"), "{args:?}: {err}");
    }
    let out = hydrant(root)
        .args(["load", "--help"])
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stdout).contains("--from-line"));
}
