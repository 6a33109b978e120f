//! Registering schema changes while serving: `PUT /v1/schemas/{kind}/{name}`, `POST /v1/schemas` (several
//! documents at once), `DELETE /v1/schemas/{kind}/{name}`, and each view's and model's past versions with
//! rollback.
//!
//! A change is checked as `POST /v1/schemas:validate` checks it ([`crate::proposal`]), then the models it
//! touches are started, then it is written to the schemas folder (so a restart serves the same), and
//! last the new catalog is swapped in whole. Requests already running finish on the catalog they took;
//! cached records decoded for another version or layout of a view are misses ([`crate::schema::View::shape`]).
//!
//! The schemas folder stays the source of truth, written as a person would: a registered document
//! replaces its own text in the file it came from (the file's other documents and comments stay as they
//! are), a new document gets a file of its own, and a deleted document leaves its file (or the file goes,
//! when it held nothing else). Every version of a view or model that a registration registered or
//! replaced is kept in `.versions/{kind}/{name}/{version}.yaml` under the schemas folder, which
//! start-up does not read.
//!
//! Changes made in the folder by others (a person, a deploy, another replica) are read every
//! `registry.reload_interval` ([`watch_folder`]) and swapped in by the same rules.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

use serde::Deserialize as _;
use serde_json::json;

use crate::error::ApiError;
use crate::gateway::Gateway;
use crate::infer::Engine;
use crate::journal;
use crate::middleware::BodyRead;
use crate::proposal::{self, Edit};
use crate::schema::{Kind, Registry, SchemaErrors};

/// What a request asks the registry to do.
pub enum Action {
    /// `PUT /v1/schemas/{kind}/{name}`: one document, of that kind and name.
    Put {
        kind: Kind,
        name: String,
        body: String,
    },
    /// `POST /v1/schemas`: one or more documents, registered together.
    Post { body: String },
    /// `DELETE /v1/schemas/{kind}/{name}`.
    Delete { kind: Kind, name: String },
    /// `POST /v1/schemas/{kind}/{name}/rollback`: a kept version registered again.
    Rollback {
        kind: Kind,
        name: String,
        version: u32,
    },
}

/// The folder under the schemas folder that keeps every version.
pub const VERSIONS_DIR: &str = ".versions";

/// The path's kind segment (`entities`, `views`, `models`).
pub fn kind_of_segment(segment: &str) -> Result<Kind, ApiError> {
    [Kind::Entity, Kind::View, Kind::Model]
        .into_iter()
        .find(|k| k.plural() == segment)
        .ok_or_else(|| ApiError::NotFound {
            code: "unknown_schema_kind",
            message: format!(
                "`/v1/schemas/{segment}/...`: expected /v1/schemas/entities/NAME, /v1/schemas/views/NAME or /v1/schemas/models/NAME"
            ),
        })
}

/// Registers `action` on the gateway: checked, the touched models started, written, swapped in. One
/// registration or check runs at a time.
pub async fn register(
    gw: &Arc<Gateway>,
    action: Action,
    commit: Option<BodyRead>,
) -> Result<serde_json::Value, ApiError> {
    if !gw.config.registry.writes {
        let files = if gw.config.registry.reload_interval.is_zero() {
            "change the files in registry.schemas and restart"
        } else {
            "change the files in registry.schemas: the folder watch takes them once two of its reads, registry.reload_interval apart, find them the same"
        };
        return Err(ApiError::Forbidden {
            code: "schema_writes_disabled",
            message: format!(
                "registering over HTTP is off (registry.writes = false): set registry.writes = true, or {files}"
            ),
        });
    }
    let g = gw.clone();
    proposal::exclusive(gw, "registration", move |env, gone| {
        apply(&g, action, env, gone, commit.as_ref())
    })
    .await
}

/// Checks that the body of `PUT /v1/schemas/{kind}/{name}` holds that one document (`sent`, the kinds and
/// names it holds).
fn put_holds_one(kind: Kind, name: &str, sent: &[(Kind, String)]) -> Result<(), ApiError> {
    if sent.len() == 1 && sent[0].0 == kind && sent[0].1 == name {
        return Ok(());
    }
    let listed: Vec<String> = sent
        .iter()
        .map(|(k, n)| format!("{} `{n}`", k.as_str()))
        .collect();
    Err(ApiError::Invalid {
        code: "schema_mismatch",
        message: format!(
            "PUT /v1/schemas/{}/{name} takes one document, the {} `{name}`; the body holds {}: send several documents together to POST /v1/schemas",
            kind.plural(),
            kind.as_str(),
            if listed.is_empty() {
                "none with a kind and a name".to_owned()
            } else {
                listed.join(", ")
            }
        ),
        field: Some(if sent.first().is_some_and(|(k, _)| *k != kind) {
            "kind".to_owned()
        } else {
            "name".to_owned()
        }),
    })
}

fn apply(
    gw: &Gateway,
    action: Action,
    env: &ort::environment::Environment,
    gone: &AtomicBool,
    commit: Option<&BodyRead>,
) -> Result<serde_json::Value, ApiError> {
    let schemas_dir = gw.config.registry.schemas.as_path();
    // A registration that another process left half done is taken back before this one is planned
    // from the folder (and again under the lock below, for one left meanwhile).
    recover_interrupted(schemas_dir)?;
    let running = gw.registry();
    let models_dir = gw.config.registry.models.as_path();
    // `expect`: the one document a PUT must hold.
    let (body, removed, rollback, expect) = match action {
        Action::Put { kind, name, body } => (Some(body), Vec::new(), false, Some((kind, name))),
        Action::Post { body } => (Some(body), Vec::new(), false, None),
        Action::Delete { kind, name } => {
            if running.document(kind, &name).is_none() {
                return Err(not_registered(&running, kind, &name));
            }
            (None, vec![(kind, name)], false, None)
        }
        Action::Rollback {
            kind,
            name,
            version,
        } => {
            let text = match read_version(schemas_dir, &running, kind, &name, version) {
                Ok(text) => {
                    let file = kept_file(schemas_dir, kind, &name, version);
                    // A kept file edited by hand is named as such, before it is compiled as if it were
                    // sent; past this check it holds the one document it is kept as.
                    kept_document(&text, &file, kind, &name, version)?;
                    text
                }
                // The running version, never kept (registered from the folder, and not changed over
                // HTTP since): rolling back to it changes nothing, as it does where it is kept.
                Err(e) => match running_at(&running, kind, &name, version) {
                    Some(doc) => running_text(doc)?,
                    None => return Err(e),
                },
            };
            (Some(text), Vec::new(), true, None)
        }
    };
    let edit = Edit {
        body: body.as_deref(),
        removed: &removed,
        rollback,
    };
    // A PUT whose body names other documents is refused before they are compiled: compiled, they would
    // be refused for what they would change elsewhere, which is not the caller's mistake.
    if let (Some((kind, name)), Some(body)) = (&expect, body.as_deref()) {
        let named = proposal::submitted(body);
        if !named.is_empty() {
            put_holds_one(*kind, name, &named)?;
        }
    }
    let proposal =
        proposal::propose(&running, &edit, models_dir).map_err(ApiError::InvalidSchema)?;
    if let Some((kind, name)) = &expect {
        put_holds_one(*kind, name, &proposal.submitted)?;
    }

    kept_numbers_hold(schemas_dir, &proposal.changes, &proposal.registry)?;

    let reload = if gw.config.registry.reload_interval.is_zero() {
        "restart to load it, then register"
    } else {
        "the folder watch loads it once two of its reads, registry.reload_interval apart, find the folder the same (while another replica keeps registering more often than that, wait for it to stop); if the watch refused it (GET /v1/schemas shows why under `folder`), fix or revert the file; then register"
    };
    // A document that registers as it runs is not written: its file keeps its text (its comments, its
    // layout, YAML rather than the JSON it may have been sent as).
    let changed: Vec<(Kind, String)> = proposal
        .submitted
        .iter()
        .filter(|(kind, name)| {
            !proposal.changes.iter().any(|c| {
                c.kind == *kind && c.name == *name && c.change == proposal::Verdict::Unchanged
            })
        })
        .cloned()
        .collect();
    let plan = plan_files(
        &running,
        schemas_dir,
        body.as_deref(),
        &changed,
        &removed,
        reload,
    )?;
    // Start-up refuses a schemas folder without a schema file (a mistyped registry.schemas, most
    // often): a change must not leave one that a restart would refuse.
    if plan.sources.is_empty() {
        return Err(ApiError::Conflict {
            code: "registry_would_be_empty",
            message: format!(
                "this would remove the last schema file from {}, and the gateway refuses to start on a schemas folder without one: register another document first",
                schemas_dir.display()
            ),
        });
    }
    let registry = Registry::compile(&plan.sources, models_dir).map_err(|e| {
        ApiError::Internal(format!(
            "the change checked, but not once placed in its files: {e}"
        ))
    })?;

    // Start the touched models before anything is written: a model that cannot start leaves all as it was.
    let engines = start_engines(
        gw,
        &registry,
        &proposal.touched,
        &proposal.changes,
        &proposal.registry,
        env,
        gone,
    )?;

    // A caller answered 503 (its request ended: the backstop, a disconnect) must find nothing registered.
    let still_asked = |when: &str| {
        if gone.load(Relaxed) {
            return Err(ApiError::Timeout(format!(
                "the registration's request ended {when}: nothing was registered"
            )));
        }
        Ok(())
    };
    still_asked("before its files were written")?;
    // The lock is held only to check and write, not while models start (which can take longer than
    // another replica waits for it): so that another replica sharing the folder neither writes at the
    // same time nor reloads a change half written. What the plan was made from is read again under it:
    // an edit made meanwhile is not written over.
    let _lock = lock_folder(schemas_dir, true)?;
    // The wait for the lock (up to 5 s, while a deploy holds it) can outlast the request.
    still_asked("while it waited for the schemas folder's lock")?;
    // A registration that another process left half done is taken back first: its journal would
    // otherwise be overwritten by this one's, and its half change kept. Files it touched that this plan
    // read are then no longer as planned, and the check below refuses (409).
    recover_locked(schemas_dir)?;
    unchanged_since_planned(&plan, schemas_dir, reload)?;
    // The point of no return: from here the request layer's backstop waits for this answer rather than
    // answering 503 (writing the files and swapping the registry take a bounded time); if it already
    // has, or the client left, nothing is written.
    if !commit.is_none_or(BodyRead::commit) {
        gone.store(true, Relaxed);
    }
    still_asked("before its files were written")?;
    write_files(schemas_dir, &plan.writes, &plan.read)?;
    // The folder watch checks the folder against what runs again: a change that puts the files back
    // as the watch last saw them (a checkout, a config-map sync) is not the folder it last checked.
    gw.folder.written.fetch_add(1, Relaxed);
    let files: Vec<String> = plan
        .writes
        .iter()
        .filter(|w| !w.history)
        .map(|w| w.path.display().to_string())
        .collect();
    gw.put_in_force(Arc::new(registry), engines);
    for c in &proposal.changes {
        tracing::info!(kind = c.kind.as_str(), name = %c.name, change = ?c.change, version = ?c.version, "schema registered");
    }
    for (kind, name) in &removed {
        tracing::info!(kind = kind.as_str(), name = %name, "schema deleted");
    }
    let deleted: Vec<_> = removed
        .iter()
        .map(|(k, n)| json!({"kind": k, "name": n}))
        .collect();
    let mut answer = json!({"registered": true, "documents": proposal.changes, "files": files});
    if !deleted.is_empty() {
        answer["deleted"] = json!(deleted);
    }
    Ok(answer)
}

/// The engines of `registry`'s models: the running ones for models outside `touched`, new ones for the
/// rest. A model that cannot start is a schema problem at its document in `named` (the proposal, whose
/// documents a request's body holds), and nothing starts being served.
fn start_engines(
    gw: &Gateway,
    registry: &Registry,
    touched: &std::collections::BTreeSet<String>,
    changes: &[proposal::Change],
    named: &Registry,
    env: &ort::environment::Environment,
    gone: &AtomicBool,
) -> Result<HashMap<String, Arc<Engine>>, ApiError> {
    let catalog = gw.catalog.load_full();
    let mut engines = HashMap::with_capacity(registry.models.len());
    let mut errors = Vec::new();
    let mut names: Vec<&String> = registry.models.keys().collect();
    names.sort();
    for name in names {
        if !touched.contains(name)
            && let Some(engine) = catalog.engines.get(name)
        {
            engines.insert(name.clone(), engine.clone());
            continue;
        }
        if gone.load(Relaxed) {
            return Err(ApiError::Timeout(
                "stopped before the change's models were started: nothing was changed".to_owned(),
            ));
        }
        let model = registry.models[name].clone();
        // A version served before must find its file's bytes as they were: checked by a hash before the
        // model is loaded (so the folder watch's retries cost no load), and on what was loaded.
        let started = gw
            .served
            .check_file(&model)
            .and_then(|()| {
                Engine::start(
                    env,
                    model.clone(),
                    &gw.config.inference,
                    gw.telemetry.model(name),
                )
            })
            .and_then(|engine| gw.served.check(&model, engine.digest()).map(|()| engine));
        match started {
            Ok(engine) => {
                engines.insert(name.clone(), Arc::new(engine));
            }
            Err(e) => errors.push(proposal::load_error(
                e,
                named.document(Kind::Model, name),
                changes,
                &model,
            )),
        }
    }
    if errors.is_empty() {
        Ok(engines)
    } else {
        Err(ApiError::InvalidSchema(SchemaErrors(errors)))
    }
}

/// The lock file in the schemas folder: hidden, and not `*.yaml`, so start-up never reads it.
const LOCK_FILE: &str = ".hydrant.lock";

/// How long a registration or a read of the folder waits for another process's lock on it.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Locks the schemas folder against other processes: exclusively to write it, shared to read it.
/// `Ok(None)` where the folder cannot be locked (a read-only folder, where nothing writes either, or a
/// file system without locks): it goes unlocked. `Err` when another process held the lock for
/// [`LOCK_WAIT`].
fn lock_folder(dir: &Path, exclusive: bool) -> Result<Option<std::fs::File>, ApiError> {
    let path = dir.join(LOCK_FILE);
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .or_else(|_| std::fs::File::open(&path));
    let Ok(file) = file else {
        return Ok(None);
    };
    let until = std::time::Instant::now() + LOCK_WAIT;
    loop {
        let tried = if exclusive {
            file.try_lock()
        } else {
            file.try_lock_shared()
        };
        match tried {
            Ok(()) => return Ok(Some(file)),
            Err(std::fs::TryLockError::WouldBlock) if std::time::Instant::now() < until => {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(ApiError::RegistryUnwritable(format!(
                    "{} stayed locked by another process for {LOCK_WAIT:?}: another replica is writing the schemas folder, or one died holding the lock",
                    path.display()
                )));
            }
            Err(std::fs::TryLockError::Error(_)) => return Ok(None),
        }
    }
}

/// The last change found in the schemas folder that was refused, for `GET /v1/schemas`.
#[derive(Debug, Default)]
pub struct FolderState {
    refused: parking_lot::Mutex<Option<serde_json::Value>>,
    /// Registrations that wrote the folder: the watch forgets what it last checked when this moves.
    written: std::sync::atomic::AtomicU64,
}

impl FolderState {
    /// `{"reload_interval": ..., "refused": null | {"at": ..., "problems": [...]}}`.
    pub fn describe(&self, interval: std::time::Duration) -> serde_json::Value {
        json!({
            "reload_interval": crate::config::duration::format(interval),
            "refused": self.refused.lock().clone(),
        })
    }
}

/// Reads the schemas folder every `registry.reload_interval` and, when its files changed and then held
/// still for one more read (a file being saved is not taken half written), checks the folder against
/// what runs as a registration is checked and swaps it in. A folder that fails (a broken reference, a
/// version that went down) is logged, counted and shown by `GET /v1/schemas`, and the running schemas
/// stay until the files change again; a model that failed to start (its ONNX file not there yet, say)
/// is tried again every [`RETRY_EVERY`] reads. Runs until aborted.
pub async fn watch_folder(gw: Arc<Gateway>) {
    let interval = gw.config.registry.reload_interval;
    if interval.is_zero() {
        return;
    }
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    let mut watch = Watch::default();
    let mut written = gw.folder.written.load(Relaxed);
    loop {
        tick.tick().await;
        let now_written = gw.folder.written.load(Relaxed);
        if now_written != written {
            // What was checked last is not what a registration wrote since: compare with what runs.
            written = now_written;
            watch.seen = None;
        }
        // Read in the registrations' turn, so what is read is never older than what runs.
        let g = gw.clone();
        let before = watch.clone();
        let looked = proposal::exclusive(&gw, "reload", move |env, gone| {
            Ok(look(&g, &before, env, gone))
        })
        .await;
        let (now, outcome) = match looked {
            Ok(looked) => looked,
            Err(e) => {
                tracing::warn!(error = %e, "reading the schemas folder failed");
                continue;
            }
        };
        if watch.failing == Some(now) {
            watch.retry_in = watch.retry_in.saturating_sub(1);
        }
        match outcome {
            // Back to what was checked last, after a change whose models failed to start: that change
            // is gone, and so is its refusal (what the last check found is shown again).
            Outcome::Same if watch.seen == Some(now) && watch.failing.is_some() => {
                let shown = watch.seen_refused.take();
                watch.settled(now);
                watch.seen_refused = shown.clone();
                *gw.folder.refused.lock() = shown;
            }
            Outcome::Same | Outcome::Unread => {}
            Outcome::Moving => watch.moving = Some(now),
            Outcome::Reloaded(changes) => {
                watch.settled(now);
                *gw.folder.refused.lock() = None;
                if let Some(changes) = changes {
                    gw.telemetry.reloads.applied.fetch_add(1, Relaxed);
                    for c in changes {
                        tracing::info!(kind = c.kind.as_str(), name = %c.name, change = ?c.change, version = ?c.version, "schema reloaded from the schemas folder");
                    }
                }
            }
            Outcome::Refused(refused) => {
                if refused.again {
                    // Left unseen: read and tried again after RETRY_EVERY reads, said only once.
                    watch.retry_in = RETRY_EVERY;
                    watch.moving = None;
                    if watch.failing != Some(now) {
                        watch.failing = Some(now);
                        refuse(&gw, &refused.error);
                    }
                } else {
                    watch.settled(now);
                    refuse(&gw, &refused.error);
                    watch.seen_refused = gw.folder.refused.lock().clone();
                }
            }
        }
    }
}

/// Reads between tries of a folder whose models failed to start.
const RETRY_EVERY: u32 = 15;

/// What the watch knows of the folder, by fingerprint.
#[derive(Clone, Default)]
struct Watch {
    /// Last checked (applied, found unchanged, or refused for good); `None` until the first check,
    /// which compares the folder with what runs.
    seen: Option<u64>,
    /// Read once and not yet checked: taken when the next read finds the same.
    moving: Option<u64>,
    /// Refused for a reason outside the schema files, and tried again in `retry_in` reads.
    failing: Option<u64>,
    retry_in: u32,
    /// What `GET /v1/schemas` showed as refused when `seen` was checked.
    seen_refused: Option<serde_json::Value>,
}

impl Watch {
    fn settled(&mut self, now: u64) {
        *self = Watch {
            seen: Some(now),
            ..Watch::default()
        };
    }
}

/// What one read of the folder found.
enum Outcome {
    /// The folder was not read (its lock stayed taken, or an unfinished registration in it could not be
    /// taken back): nothing is known of it.
    Unread,
    /// What was checked last, or a failure whose retry is not due.
    Same,
    /// Changed since the last read: checked when the next read finds the same.
    Moving,
    /// Checked: swapped in (with what changed) or found to hold what runs (`None`).
    Reloaded(Option<Vec<proposal::Change>>),
    Refused(Refused),
}

/// A refused change, and whether the cause lies outside the schema files (worth trying again).
struct Refused {
    error: ApiError,
    again: bool,
}

impl Refused {
    fn again(error: ApiError) -> Self {
        Self { error, again: true }
    }
}

/// Reads the folder and decides, with `watch`, whether to reload it: the folder's fingerprint, and
/// what came of it.
fn look(
    gw: &Gateway,
    watch: &Watch,
    env: &ort::environment::Environment,
    gone: &AtomicBool,
) -> (u64, Outcome) {
    let dir = gw.config.registry.schemas.as_path();
    let read = {
        let mut lock = match lock_folder(dir, false) {
            Ok(lock) => lock,
            Err(e) => {
                tracing::warn!(error = %e, "the schemas folder was not read: its lock stayed taken");
                return (watch.seen.unwrap_or_default(), Outcome::Unread);
            }
        };
        // A journal seen under the lock belongs to a registration whose process died (a live one holds
        // the lock until its journal is gone). Without a lock, it may still be running: left alone.
        if lock.is_some() && journal::pending(dir) {
            drop(lock.take());
            if let Err(e) = recover_interrupted(dir) {
                tracing::warn!(error = %e, "the schemas folder holds an unfinished registration that could not be taken back");
                return (watch.seen.unwrap_or_default(), Outcome::Unread);
            }
            lock = match lock_folder(dir, false) {
                Ok(lock) => lock,
                Err(_) => return (watch.seen.unwrap_or_default(), Outcome::Unread),
            };
        }
        let read = Registry::read_dir(dir);
        drop(lock);
        read
    };
    let (now, sources) = match read {
        Ok(sources) => {
            let now = fingerprint(
                sources
                    .iter()
                    .map(|(f, t)| (f.to_str().unwrap_or_default(), t.as_str())),
            );
            (now, Ok(sources))
        }
        Err(errors) => {
            let print = errors.to_string();
            (
                fingerprint(std::iter::once(("", print.as_str()))),
                Err(errors),
            )
        }
    };
    if watch.seen == Some(now) {
        return (now, Outcome::Same);
    }
    if watch.failing == Some(now) && watch.retry_in > 1 {
        return (now, Outcome::Same);
    }
    // The first read too: a file being written as the gateway starts is not taken half written.
    if watch.moving != Some(now) && watch.failing != Some(now) {
        return (now, Outcome::Moving);
    }
    let outcome = match sources {
        Err(errors) => Outcome::Refused(Refused {
            error: ApiError::InvalidSchema(errors),
            again: false,
        }),
        Ok(sources) => match reload(gw, &sources, env, gone) {
            Ok(changes) => Outcome::Reloaded(changes),
            Err(refused) => Outcome::Refused(refused),
        },
    };
    (now, outcome)
}

/// A hash of the folder's files and texts.
fn fingerprint<'a>(files: impl Iterator<Item = (&'a str, &'a str)>) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for (file, text) in files {
        file.hash(&mut h);
        text.hash(&mut h);
    }
    h.finish()
}

/// A change in the folder that was refused: said, counted, and kept for `GET /v1/schemas`.
fn refuse(gw: &Gateway, e: &ApiError) {
    gw.telemetry.reloads.refused.fetch_add(1, Relaxed);
    let problems: Vec<String> = match e {
        ApiError::InvalidSchema(errors) => errors.0.iter().map(ToString::to_string).collect(),
        other => vec![other.to_string()],
    };
    tracing::warn!(
        problems = %problems.join("; "),
        "the schemas folder changed, but the change is refused: the running schemas stay until the files are fixed"
    );
    let at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    *gw.folder.refused.lock() = Some(json!({"at_unix_ms": at, "problems": problems}));
}

/// Compiles `sources` (the folder's files), compares them with what runs as a registration is
/// compared, starts the models the change touches, and swaps the whole in. `None` when the folder holds
/// what runs.
fn reload(
    gw: &Gateway,
    sources: &[(PathBuf, String)],
    env: &ort::environment::Environment,
    gone: &AtomicBool,
) -> Result<Option<Vec<proposal::Change>>, Refused> {
    let refused = |error| Refused {
        error,
        again: false,
    };
    let running = gw.registry();
    let models_dir = gw.config.registry.models.as_path();
    let compiled =
        Registry::compile(sources, models_dir).map_err(|e| refused(ApiError::InvalidSchema(e)))?;
    let schemas_dir = gw.config.registry.schemas.as_path();
    let kept =
        |kind, name: &str, body: &serde_yaml::Value| kept_holds(schemas_dir, kind, name, body);
    let Some(proposal) = proposal::propose_folder(&running, compiled, &kept)
        .map_err(|e| refused(ApiError::InvalidSchema(e)))?
    else {
        return Ok(None);
    };
    kept_numbers_hold(schemas_dir, &proposal.changes, &proposal.registry).map_err(refused)?;
    let engines = start_engines(
        gw,
        &proposal.registry,
        &proposal.touched,
        &proposal.changes,
        &proposal.registry,
        env,
        gone,
    )
    .map_err(Refused::again)?;
    let changes: Vec<_> = proposal
        .changes
        .into_iter()
        .filter(|c| c.change != proposal::Verdict::Unchanged)
        .collect();
    let registry = Arc::new(proposal.registry);
    gw.put_in_force(registry.clone(), engines);
    // A version kept before and now changed in place on disk no longer holds what that version
    // serves: dropped, so that the next registration over it keeps the text that ran.
    // One that holds the new text (written by another replica's registration of it) stays.
    for c in &changes {
        if let (Some(v), Some(r)) = (c.version, c.running_version)
            && v == r
            && !registry
                .document(c.kind, &c.name)
                .is_some_and(|d| kept_holds(schemas_dir, c.kind, &c.name, &d.body))
        {
            let _ = std::fs::remove_file(kept_file(schemas_dir, c.kind, &c.name, v));
        }
    }
    for doc in &running.documents {
        if registry.document(doc.kind, &doc.name).is_none() {
            tracing::info!(kind = doc.kind.as_str(), name = %doc.name, "schema removed from the schemas folder");
        }
    }
    Ok(Some(changes))
}

/// A document added again after it was deleted keeps its history: its kept versions stay readable and
/// versions go on above them, so one number never names two bindings. So does one rolled back below
/// versions it had: a new number goes above them all, or is a kept version as it was kept. A
/// registration, its dry run (`POST /v1/schemas:validate`) and the folder watch check this alike.
pub(crate) fn kept_numbers_hold(
    schemas_dir: &Path,
    changes: &[proposal::Change],
    proposed: &Registry,
) -> Result<(), ApiError> {
    for c in changes {
        let Some(version) = c.version else {
            continue;
        };
        if c.running_version == Some(version) {
            continue;
        }
        let kept = versions(schemas_dir, c.kind, &c.name);
        let Some(&highest) = kept.last() else {
            continue;
        };
        let same_as_kept = proposed
            .document(c.kind, &c.name)
            .is_some_and(|d| kept_holds(schemas_dir, c.kind, &c.name, &d.body));
        if version <= highest && !same_as_kept {
            return Err(ApiError::Conflict {
                code: "version_kept",
                message: format!(
                    "version: {} `{}` was registered before, up to version {highest} (kept in {}), and version {version} would name another document: versions only go up, so register it as version {} or more, or roll back to a kept version",
                    c.kind.as_str(),
                    c.name,
                    kept_dir(schemas_dir, c.kind, &c.name).display(),
                    highest + 1
                ),
            });
        }
    }
    Ok(())
}

/// The 404 of a name of `kind` that is not registered, listing the registered ones.
pub(crate) fn not_registered(registry: &Registry, kind: Kind, name: &str) -> ApiError {
    let known = crate::schema::known_names(
        registry
            .documents
            .iter()
            .filter(|d| d.kind == kind)
            .map(|d| d.name.as_str()),
    );
    ApiError::NotFound {
        code: kind.unknown_code(),
        message: format!(
            "no {} `{name}` is registered (registered: {known})",
            kind.as_str()
        ),
    }
}

/// One file to write (or remove, with `text: None`).
struct Write {
    path: PathBuf,
    text: Option<String>,
    /// A kept version under [`VERSIONS_DIR`], written before the schema files.
    history: bool,
}

/// Where a change goes: the files to write, and every schema file's text afterwards (to compile).
struct FilePlan {
    writes: Vec<Write>,
    sources: Vec<(PathBuf, String)>,
    /// The schema files listed when the plan was made.
    listed: Vec<PathBuf>,
    /// What each file the plan read or claims held then (`None`: absent).
    read: Vec<(PathBuf, Option<String>)>,
}

/// The error of a schemas-folder file or listing that cannot be read.
fn cannot_read(path: &Path, e: std::io::Error) -> ApiError {
    ApiError::RegistryUnwritable(format!("cannot read {}: {e}", path.display()))
}

/// Refuses with 409 when the folder no longer holds what `plan` was made from: a schema file appeared,
/// vanished or changed since (a person, a deploy or another replica wrote it).
fn unchanged_since_planned(
    plan: &FilePlan,
    schemas_dir: &Path,
    reload: &str,
) -> Result<(), ApiError> {
    let changed = |path: &Path| ApiError::Conflict {
        code: "schema_file_changed",
        message: format!(
            "{} changed while this registration ran (a person, a deploy or another replica wrote it); nothing was registered: {reload}",
            path.display()
        ),
    };
    let listed = Registry::schema_files(schemas_dir).map_err(|e| cannot_read(schemas_dir, e))?;
    let moved = listed
        .iter()
        .find(|f| !plan.listed.contains(f))
        .or_else(|| plan.listed.iter().find(|f| !listed.contains(f)));
    if let Some(path) = moved {
        return Err(changed(path));
    }
    for (path, then) in &plan.read {
        let now = match std::fs::read_to_string(path) {
            Ok(text) => Some(text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(cannot_read(path, e)),
        };
        if now != *then {
            return Err(changed(path));
        }
    }
    Ok(())
}

/// The 409 for a change to a file whose documents its `---` lines do not tell apart (a document that
/// begins on its marker line, `--- {kind: view, ...}`, or a `...` end marker): editing it piece by piece
/// could drop or merge documents.
fn uncuttable(file: &Path) -> ApiError {
    ApiError::Conflict {
        code: "schema_file_uncuttable",
        message: format!(
            "{} cannot be edited document by document: its documents are not each begun by a `---` line of their own (a document that starts on its `---` line, or a `...` marker); put each document after a bare `---` line, or edit the file by hand",
            file.display()
        ),
    }
}

/// A schema file as it is on disk, cut into its documents' texts.
struct FileText {
    /// Each piece holds one document (or, only the first, none: comments before a `---`); every piece
    /// but the first begins with its `---` line.
    pieces: Vec<String>,
    /// For each piece, the index of its document in the file, if it holds one.
    docs: Vec<Option<usize>>,
    /// The file's documents as the parser reads them.
    values: Vec<serde_yaml::Value>,
}

impl FileText {
    /// The piece that holds document `index`.
    fn piece_of(&self, index: usize) -> Option<usize> {
        self.docs.iter().position(|d| *d == Some(index))
    }
}

/// Cuts `text` at its `---` lines, and checks that the pieces hold the file's documents one each, in
/// order. `None` when they do not (a `...` end marker, a `---` the cut misreads): the text is then not
/// edited piece by piece.
fn cut(text: &str) -> Option<FileText> {
    let whole = parse_all(text)?;
    let mut pieces = Vec::new();
    let (mut start, mut pos) = (0, 0);
    for line in text.split_inclusive('\n') {
        if pos > 0 && is_marker(line) {
            pieces.push(text[start..pos].to_owned());
            start = pos;
        }
        pos += line.len();
    }
    pieces.push(text[start..].to_owned());
    let mut docs = Vec::with_capacity(pieces.len());
    let mut next = 0;
    for (i, piece) in pieces.iter().enumerate() {
        // Comments before a leading `---` are no document of their own.
        let comments = piece
            .lines()
            .all(|l| l.trim().is_empty() || l.trim_start().starts_with('#'));
        if i == 0 && comments {
            docs.push(None);
            continue;
        }
        match parse_all(piece)?.as_slice() {
            [] => docs.push(None),
            [one] if whole.get(next) == Some(one) => {
                docs.push(Some(next));
                next += 1;
            }
            _ => return None,
        }
    }
    (next == whole.len()).then_some(FileText {
        pieces,
        docs,
        values: whole,
    })
}

/// A `---` line that starts a document and holds nothing else (a comment at most). YAML also lets a
/// document begin on its marker line (`--- {kind: model, ...}`, `--- |`): such a line is not cut at,
/// so the text is not edited piece by piece, and its content is never dropped with the marker.
fn is_marker(line: &str) -> bool {
    let line = line.trim_end_matches(['\n', '\r']);
    match line.strip_prefix("---") {
        Some("") => true,
        Some(rest) if rest.starts_with([' ', '\t']) => {
            let after = rest.trim_start_matches([' ', '\t']);
            after.is_empty() || after.starts_with('#')
        }
        _ => false,
    }
}

fn parse_all(text: &str) -> Option<Vec<serde_yaml::Value>> {
    if crate::yaml::expansion_problem(text).is_some() {
        return None;
    }
    serde_yaml::Deserializer::from_str(text)
        .map(serde_yaml::Value::deserialize)
        .collect::<Result<Vec<_>, _>>()
        .ok()
}

/// A document's text for a file of its own or a piece of one: without a leading `---` line, ending in
/// a newline.
fn bare(piece: &str) -> String {
    let mut text = match piece.split_once('\n') {
        Some((first, rest)) if is_marker(first) => rest.to_owned(),
        _ if is_marker(piece) => String::new(),
        _ => piece.to_owned(),
    };
    if !text.ends_with('\n') {
        text.push('\n');
    }
    text
}

/// A registered document's text as its file holds it (comments and layout kept, so submitting it again
/// writes nothing), or as the parser read it when the file no longer cuts into its documents.
fn running_text(doc: &crate::schema::Document) -> Result<String, ApiError> {
    let from_file = std::fs::read_to_string(&doc.file).ok().and_then(|text| {
        let file = cut(&text)?;
        let piece = file.piece_of(doc.index)?;
        (file.values.get(doc.index) == Some(&doc.body)).then(|| bare(&file.pieces[piece]))
    });
    match from_file {
        Some(text) => Ok(text),
        None => serde_yaml::to_string(&doc.body)
            .map_err(|e| ApiError::Internal(format!("cannot write `{}` as YAML: {e}", doc.name))),
    }
}

/// A submitted document as it is written to its files.
struct Submitted {
    text: String,
    version: Option<u32>,
}

/// Each submitted document's text, as sent (comments kept) when the body cuts cleanly, else as the
/// parser read it.
fn submitted_texts(body: &str) -> Result<HashMap<(Kind, String), Submitted>, ApiError> {
    let mut out = HashMap::new();
    let cut = cut(body);
    let parsed;
    let values = match &cut {
        Some(c) => &c.values,
        None => {
            parsed = parse_all(body).unwrap_or_default();
            &parsed
        }
    };
    for (i, value) in values.iter().enumerate() {
        let Some((kind, name)) = Kind::of_document(value) else {
            continue;
        };
        // A document that begins on its `---` line (`--- !!map`, `--- &anchor`) is written as the parser
        // read it: kept as sent, that line would make its file one the next edit cannot cut.
        let text = match cut
            .as_ref()
            .and_then(|c| c.piece_of(i).map(|p| &c.pieces[p]))
            .map(|piece| bare(piece))
            .filter(|text| !text.starts_with("---"))
        {
            Some(text) => text,
            None => serde_yaml::to_string(value).map_err(|e| {
                ApiError::Internal(format!("cannot write {} `{name}`: {e}", kind.as_str()))
            })?,
        };
        let version = document_version(value);
        out.insert((kind, name.to_owned()), Submitted { text, version });
    }
    Ok(out)
}

/// A document's `version`, when it has one.
fn document_version(value: &serde_yaml::Value) -> Option<u32> {
    value
        .get("version")
        .and_then(|v| v.as_u64())
        .and_then(|v| u32::try_from(v).ok())
}

/// The registered document of `kind` and `name`, when it runs at `version`.
fn running_at<'a>(
    registry: &'a Registry,
    kind: Kind,
    name: &str,
    version: u32,
) -> Option<&'a crate::schema::Document> {
    registry
        .document(kind, name)
        .filter(|d| document_version(&d.body) == Some(version))
}

/// Whether the kept file of `body`'s version holds `body`: what a registration keeps, and a rollback
/// writes back.
fn kept_holds(schemas_dir: &Path, kind: Kind, name: &str, body: &serde_yaml::Value) -> bool {
    document_version(body).is_some_and(|v| {
        std::fs::read_to_string(kept_file(schemas_dir, kind, name, v))
            .ok()
            .and_then(|text| parse_all(&text))
            .and_then(|mut values| (values.len() == 1).then(|| values.swap_remove(0)))
            .is_some_and(|kept| kept == *body)
    })
}

/// Where version `version` of a view or model is kept.
fn kept_file(schemas_dir: &Path, kind: Kind, name: &str, version: u32) -> PathBuf {
    kept_dir(schemas_dir, kind, name).join(format!("{version}.yaml"))
}

fn kept_dir(schemas_dir: &Path, kind: Kind, name: &str) -> PathBuf {
    schemas_dir
        .join(VERSIONS_DIR)
        .join(kind.as_str())
        .join(name)
}

/// Works out every file the change writes, and what each schema file holds afterwards.
fn plan_files(
    running: &Registry,
    schemas_dir: &Path,
    body: Option<&str>,
    submitted: &[(Kind, String)],
    removed: &[(Kind, String)],
    // What the 409 of a file changed on disk tells the caller to do.
    reload: &str,
) -> Result<FilePlan, ApiError> {
    // A schema file that appeared since the folder was loaded could define what this change adds, or
    // name what it removes: the folder would then no longer load.
    let listed = Registry::schema_files(schemas_dir).map_err(|e| cannot_read(schemas_dir, e))?;
    let mut read: Vec<(PathBuf, Option<String>)> = Vec::new();
    if let Some(new) = listed
        .iter()
        .find(|f| !running.documents.iter().any(|d| d.file == **f))
    {
        return Err(ApiError::Conflict {
            code: "schema_file_changed",
            message: format!(
                "{} appeared since the folder was loaded: {reload}",
                new.display()
            ),
        });
    }
    let texts = match body {
        Some(body) => submitted_texts(body)?,
        None => HashMap::new(),
    };
    // The registered files, in order, each with its text on disk, which must still hold what was loaded:
    // cut into its documents, or whole (`Err`) when its `---` lines do not tell them apart. Only a file
    // the change edits needs cutting; the others are sources as they are.
    let mut files: Vec<(PathBuf, Result<FileText, String>, bool)> = Vec::new();
    for doc in &running.documents {
        if files.iter().any(|(f, _, _)| *f == doc.file) {
            continue;
        }
        // Bounded as the folder's load is: a file grown past the limit since is not read whole.
        if std::fs::metadata(&doc.file)
            .is_ok_and(|m| m.len() > crate::schema::MAX_SCHEMA_FILE_BYTES)
        {
            return Err(ApiError::Conflict {
                code: "schema_file_changed",
                message: format!(
                    "{} has grown past {} bytes since it was loaded: {reload}",
                    doc.file.display(),
                    crate::schema::MAX_SCHEMA_FILE_BYTES
                ),
            });
        }
        let on_disk = match std::fs::read_to_string(&doc.file) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(ApiError::Conflict {
                    code: "schema_file_changed",
                    message: format!(
                        "{} was removed since it was loaded: {reload}",
                        doc.file.display()
                    ),
                });
            }
            Err(e) => return Err(cannot_read(&doc.file, e)),
        };
        // Read as the folder is loaded: a byte order mark is not part of the YAML.
        let text = on_disk.strip_prefix('\u{feff}').unwrap_or(&on_disk);
        let as_loaded = parse_all(text).is_some_and(|values| {
            running
                .documents
                .iter()
                .filter(|d| d.file == doc.file)
                .all(|d| values.get(d.index) == Some(&d.body))
        });
        if !as_loaded {
            return Err(ApiError::Conflict {
                code: "schema_file_changed",
                message: format!(
                    "{} no longer holds what was loaded from it (edited since it was loaded): {reload}",
                    doc.file.display()
                ),
            });
        }
        let pieces = cut(text).ok_or_else(|| text.to_owned());
        files.push((doc.file.clone(), pieces, false));
        read.push((doc.file.clone(), Some(on_disk)));
    }
    let mut writes = Vec::new();
    // The running documents that the change replaces or removes are kept first, unless kept already.
    for (kind, name) in submitted.iter().chain(removed) {
        let Some(doc) = running.document(*kind, name) else {
            continue;
        };
        if *kind == Kind::Entity {
            continue;
        }
        let Some(version) = document_version(&doc.body) else {
            continue;
        };
        let path = kept_file(schemas_dir, *kind, name, version);
        if path.exists() {
            continue;
        }
        // The document's own text, comments and all; from a file that cannot be cut, the document as
        // parsed.
        let text = files
            .iter()
            .find(|(f, _, _)| *f == doc.file)
            .and_then(|(_, c, _)| match c {
                Ok(c) => Some(bare(&c.pieces[c.piece_of(doc.index)?])),
                Err(_) => serde_yaml::to_string(&doc.body).ok(),
            });
        if let Some(text) = text {
            writes.push(Write {
                path,
                text: Some(text),
                history: true,
            });
        }
    }
    let mut new_files: Vec<(PathBuf, String)> = Vec::new();
    for (kind, name) in submitted {
        let Some(Submitted { text, version }) = texts.get(&(*kind, name.clone())) else {
            continue;
        };
        if *kind != Kind::Entity
            && let Some(version) = *version
        {
            // A document registered again at its running version (a changed description or cache
            // policy) is kept as submitted: its version's file holds what is served under that number.
            let path = kept_file(schemas_dir, *kind, name, version);
            writes.retain(|w| w.path != path);
            writes.push(Write {
                path,
                text: Some(text.clone()),
                history: true,
            });
        }
        match running.document(*kind, name) {
            Some(doc) => {
                let Some((_, cut, changed)) = files.iter_mut().find(|(f, _, _)| *f == doc.file)
                else {
                    continue;
                };
                let cut = cut.as_mut().map_err(|_| uncuttable(&doc.file))?;
                if let Some(p) = cut.piece_of(doc.index) {
                    let marker = match cut.pieces[p].split_once('\n') {
                        Some((first, _)) if is_marker(first) => format!("{first}\n"),
                        _ => String::new(),
                    };
                    cut.pieces[p] = format!("{marker}{text}");
                    *changed = true;
                }
            }
            None => {
                let taken = |p: &Path| {
                    p.exists()
                        || files.iter().any(|(f, _, _)| f == p)
                        || new_files.iter().any(|(f, _)| f == p)
                };
                let plain = schemas_dir.join(format!("{name}.yaml"));
                let kinded = schemas_dir.join(format!("{name}.{}.yaml", kind.as_str()));
                let path = if !taken(&plain) {
                    plain
                } else if !taken(&kinded) {
                    kinded
                } else {
                    return Err(ApiError::Conflict {
                        code: "schema_file_taken",
                        message: format!(
                            "both {} and {} exist: a new {} `{name}` needs a file of its own; move one of them",
                            plain.display(),
                            kinded.display(),
                            kind.as_str()
                        ),
                    });
                };
                read.push((path.clone(), None));
                new_files.push((path, text.clone()));
            }
        }
    }
    for (kind, name) in removed {
        let Some(doc) = running.document(*kind, name) else {
            continue;
        };
        let Some((_, cut, changed)) = files.iter_mut().find(|(f, _, _)| *f == doc.file) else {
            continue;
        };
        let cut = cut.as_mut().map_err(|_| uncuttable(&doc.file))?;
        if let Some(p) = cut.piece_of(doc.index) {
            cut.pieces.remove(p);
            cut.docs.remove(p);
            *changed = true;
        }
    }
    let mut sources = Vec::with_capacity(files.len() + new_files.len());
    for (path, cut, changed) in files {
        let (text, empty) = match cut {
            Ok(cut) => (cut.pieces.concat(), cut.docs.iter().all(Option::is_none)),
            // Never changed: the change would have been refused.
            Err(text) => (text, false),
        };
        if changed {
            writes.push(Write {
                path: path.clone(),
                text: (!empty).then(|| text.clone()),
                history: false,
            });
        }
        if !empty {
            sources.push((path, text));
        }
    }
    for (path, text) in new_files {
        writes.push(Write {
            path: path.clone(),
            text: Some(text.clone()),
            history: false,
        });
        sources.push((path, text));
    }
    sources.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(FilePlan {
        writes,
        sources,
        listed,
        read,
    })
}

/// Writes every file: each to a temporary name beside it first, then renamed into place, so a reader
/// (or a crash) sees a file whole, before or after. Kept versions go first; a failure before the
/// schema files are renamed leaves the schema files as they were, and a rename that fails puts back
/// the schema files already renamed, from `before` (what each held: [`FilePlan::read`], checked
/// under the lock just before), so the folder never holds half a change for a reload to serve. The
/// renames are covered by the journal in `dir` ([`crate::journal`]): a process killed between two of
/// them leaves the folder to be put back by the next start-up or folder watch.
fn write_files(
    dir: &Path,
    writes: &[Write],
    before: &[(PathBuf, Option<String>)],
) -> Result<(), ApiError> {
    let unwritable = |path: &Path, e: std::io::Error| {
        ApiError::RegistryUnwritable(format!(
            "cannot write {}: {e} (registering needs a writable registry.schemas folder)",
            path.display()
        ))
    };
    // What each write replaces: a schema file's text as the plan read it; a kept version's as it is
    // now (none for a version kept for the first time). `None` where that is not known.
    let olds: Vec<Option<Option<String>>> = writes
        .iter()
        .map(|w| {
            if w.history {
                match std::fs::read_to_string(&w.path) {
                    Ok(text) => Some(Some(text)),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => Some(None),
                    Err(_) => None,
                }
            } else {
                before
                    .iter()
                    .find(|(p, _)| *p == w.path)
                    .map(|(_, old)| old.clone())
            }
        })
        .collect();
    let mut staged = Vec::new();
    let result = (|| {
        for w in writes {
            let Some(text) = &w.text else { continue };
            if let Some(dir) = w.path.parent() {
                std::fs::create_dir_all(dir).map_err(|e| unwritable(dir, e))?;
            }
            let tmp = temporary(&w.path);
            // Staged before it is written: a write that fails part-way leaves a file to remove.
            staged.push(tmp.clone());
            std::fs::write(&tmp, text).map_err(|e| unwritable(&tmp, e))?;
            std::fs::File::open(&tmp)
                .and_then(|f| f.sync_all())
                .map_err(|e| unwritable(&tmp, e))?;
        }
        // What the renames below replace, on disk before the first of them. Kept versions too: one
        // kept by a registration that is taken back would name a version that never ran.
        let undo = journal::Undo {
            changes: writes
                .iter()
                .zip(&olds)
                .filter_map(|(w, old)| {
                    Some(journal::Change {
                        file: journal::Undo::inside(dir, &w.path),
                        before: old.clone()?,
                        after: w.text.clone(),
                    })
                })
                .collect(),
            temporaries: staged
                .iter()
                .map(|t| journal::Undo::inside(dir, t))
                .collect(),
        };
        journal::begin(dir, &undo).map_err(|e| unwritable(&dir.join(journal::JOURNAL_FILE), e))
    })();
    if let Err(e) = result {
        for tmp in staged {
            let _ = std::fs::remove_file(tmp);
        }
        return Err(e);
    }
    for (i, w) in writes.iter().enumerate() {
        #[cfg(test)]
        if tests::CUT_AFTER_RENAMES.get() == Some(i) {
            // The process is killed here: nothing more happens, the journal stays.
            return Err(ApiError::RegistryUnwritable("cut".to_owned()));
        }
        let done = match &w.text {
            Some(_) => std::fs::rename(temporary(&w.path), &w.path),
            None => std::fs::remove_file(&w.path),
        };
        if let Err(e) = done {
            // The temporary files not yet renamed would otherwise stay behind.
            for rest in &writes[i..] {
                if rest.text.is_some() {
                    let _ = std::fs::remove_file(temporary(&rest.path));
                }
            }
            let mut put_back_all = true;
            for (done, old) in writes[..i].iter().zip(&olds).rev() {
                let Some(old) = old else {
                    continue;
                };
                let tmp = temporary(&done.path);
                let put_back = match old {
                    Some(text) => journal::replace(&done.path, text, &tmp),
                    None => std::fs::remove_file(&done.path),
                };
                if put_back.is_err() {
                    put_back_all = false;
                    let _ = std::fs::remove_file(&tmp);
                }
            }
            // What could not be put back now is left to the journal.
            if put_back_all {
                let _ = journal::end(dir);
            }
            return Err(unwritable(&w.path, e));
        }
    }
    // Each written file's folder, and the folders above it up to the schemas folder: a kept version's
    // folders (`.versions/view/NAME`) may have been made by this registration, and their entries are
    // only durable once their own parents are synced.
    let mut dirs: Vec<&Path> = writes
        .iter()
        .filter_map(|w| w.path.parent())
        .flat_map(|p| p.ancestors().take_while(|a| a.starts_with(dir)))
        .collect();
    dirs.sort();
    dirs.dedup();
    for d in dirs {
        journal::sync_dir(d);
    }
    // A journal left behind would take this change back at the next start: when it cannot be removed,
    // the change is taken back now, and refused.
    if let Err(e) = journal::end(dir) {
        let _ = journal::roll_back(dir);
        return Err(unwritable(&dir.join(journal::JOURNAL_FILE), e));
    }
    Ok(())
}

/// Puts back the schema files of a registration that a killed process left half done (its journal in
/// `dir`, see [`crate::journal`]), under the folder's lock. Run at start-up, before the folder is read,
/// and by the folder watch when it finds a journal that no live registration holds the lock for.
pub fn recover_interrupted(dir: &Path) -> Result<(), ApiError> {
    if !journal::pending(dir) {
        return Ok(());
    }
    let _lock = lock_folder(dir, true)?;
    recover_locked(dir)
}

/// [`recover_interrupted`], by a caller holding the folder's lock.
fn recover_locked(dir: &Path) -> Result<(), ApiError> {
    match journal::roll_back(dir) {
        Ok(Some(files)) => {
            let files: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
            tracing::warn!(
                files = ?files,
                "a registration that did not finish (its process stopped between renaming its files) was taken back: the schema files are as they were before it"
            );
            Ok(())
        }
        Ok(None) => Ok(()),
        Err(e) => Err(ApiError::RegistryUnwritable(e)),
    }
}

/// The temporary name a file is written under: hidden, and not `*.yaml`, so start-up never reads one.
fn temporary(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.hydrant-tmp"))
}

/// The kept text of `version` of a view or model.
fn read_version(
    schemas_dir: &Path,
    running: &Registry,
    kind: Kind,
    name: &str,
    version: u32,
) -> Result<String, ApiError> {
    versioned(kind, name)?;
    let path = kept_file(schemas_dir, kind, name, version);
    match crate::config::read_text_file(&path, crate::schema::MAX_SCHEMA_FILE_BYTES) {
        Ok(text) => Ok(text),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let kept = versions(schemas_dir, kind, name);
            if kept.is_empty() && running.document(kind, name).is_none() {
                return Err(not_registered(running, kind, name));
            }
            Err(ApiError::NotFound {
                code: "unknown_version",
                message: format!(
                    "version {version} of {} `{name}` is not kept (kept: {})",
                    kind.as_str(),
                    if kept.is_empty() {
                        "none: versions are kept from the first change registered over HTTP"
                            .to_owned()
                    } else {
                        kept.iter()
                            .map(u32::to_string)
                            .collect::<Vec<_>>()
                            .join(", ")
                    }
                ),
            })
        }
        // Something other than a file where the kept file should be (a folder): not the registry's to
        // guess about, and not a failure of the disk either.
        Err(_) if path.exists() && !path.is_file() => Err(ApiError::Conflict {
            code: "kept_version_unreadable",
            message: format!(
                "kept version {version} of `{name}` ({}) is not a regular file: remove it",
                path.display()
            ),
        }),
        // Not UTF-8, or larger than a schema file may be: edited into something unreadable, which no
        // retry mends.
        Err(e) if e.kind() == std::io::ErrorKind::InvalidData => Err(ApiError::Conflict {
            code: "kept_version_unreadable",
            message: format!(
                "kept version {version} of `{name}` ({}) cannot be read: {e}; restore it or remove it",
                path.display()
            ),
        }),
        Err(e) => Err(cannot_read(&path, e)),
    }
}

/// The document of a kept file, checked to be the version it is kept as. A kept file is edited by hand
/// at times: a 409 names it, and what is wrong with it, rather than registering (or showing) another
/// document under this version's number.
fn kept_document(
    text: &str,
    file: &Path,
    kind: Kind,
    name: &str,
    version: u32,
) -> Result<serde_yaml::Value, ApiError> {
    if let Some(why) = crate::yaml::expansion_problem(text) {
        return Err(ApiError::Conflict {
            code: "kept_version_unreadable",
            message: format!(
                "kept version {version} of `{name}` ({}) is refused: {why}",
                file.display()
            ),
        });
    }
    let value: serde_yaml::Value = serde_yaml::from_str(text).map_err(|e| ApiError::Conflict {
        code: "kept_version_unreadable",
        message: format!(
            "kept version {version} of `{name}` ({}) is not one valid YAML document: {e}",
            file.display()
        ),
    })?;
    let field = |key: &str| value.get(key).and_then(serde_yaml::Value::as_str);
    let holds = (field("kind"), field("name"), document_version(&value));
    if holds != (Some(kind.as_str()), Some(name), Some(version)) {
        let shown = |v: Option<&str>| v.map_or_else(|| "(none)".to_owned(), |v| format!("`{v}`"));
        return Err(ApiError::Conflict {
            code: "kept_version_mismatch",
            message: format!(
                "the kept file of version {version} of {} `{name}` ({}) holds kind {}, name {}, version {}: it was edited by hand; restore it or remove it",
                kind.as_str(),
                file.display(),
                shown(holds.0),
                shown(holds.1),
                holds
                    .2
                    .map_or_else(|| "(none)".to_owned(), |v| v.to_string()),
            ),
        });
    }
    Ok(value)
}

/// Refuses a kind without versions (entities), and a name from a request path that no document could
/// have: names are lowercase identifiers, and one that is not would otherwise be a path under the
/// schemas folder (`..%2F..`).
fn versioned(kind: Kind, name: &str) -> Result<(), ApiError> {
    if kind == Kind::Entity {
        return Err(ApiError::NotFound {
            code: "not_versioned",
            message: "entities have no versions: only views and models are versioned".to_owned(),
        });
    }
    if crate::schema::is_valid_name(name) {
        return Ok(());
    }
    Err(ApiError::NotFound {
        code: kind.unknown_code(),
        message: format!(
            "no {} `{name}` can be registered: names are lowercase letters, digits and `_`, starting with a letter",
            kind.as_str()
        ),
    })
}

/// The version a kept file's name says it holds: `{version}.yaml`, written as [`kept_file`] writes it
/// (from 1, no leading zeros), so that `01.yaml` or `0.yaml` put there by hand are not listed as
/// versions that show and rollback would then not find.
fn kept_number(file_name: &str) -> Option<u32> {
    let digits = file_name.strip_suffix(".yaml")?;
    let n: u32 = digits.parse().ok()?;
    (n >= 1 && n.to_string() == digits).then_some(n)
}

/// The kept versions of a view or model, ascending.
fn versions(schemas_dir: &Path, kind: Kind, name: &str) -> Vec<u32> {
    let mut out: Vec<u32> = std::fs::read_dir(kept_dir(schemas_dir, kind, name))
        .map(|entries| {
            entries
                .filter_map(|e| e.ok())
                // A folder of that name (made by hand) is no kept version: it could not be shown.
                .filter(|e| e.path().is_file())
                .filter_map(|e| kept_number(e.file_name().to_str()?))
                .collect()
        })
        .unwrap_or_default();
    out.sort_unstable();
    out
}

/// `GET /v1/schemas/{kind}/{name}/versions`: the kept versions and the running one.
pub fn list_versions(gw: &Gateway, kind: Kind, name: &str) -> Result<serde_json::Value, ApiError> {
    versioned(kind, name)?;
    let registry = gw.registry();
    let running = registry
        .document(kind, name)
        .and_then(|d| document_version(&d.body));
    let mut kept = versions(&gw.config.registry.schemas, kind, name);
    if kept.is_empty() && running.is_none() {
        return Err(not_registered(&registry, kind, name));
    }
    if let Some(v) = running
        && !kept.contains(&v)
    {
        kept.push(v);
        kept.sort_unstable();
    }
    Ok(json!({
        "kind": kind,
        "name": name,
        "running_version": running,
        "versions": kept.iter().map(|v| json!({"version": v, "running": Some(*v) == running})).collect::<Vec<_>>(),
    }))
}

/// `GET /v1/schemas/{kind}/{name}/versions/{version}`: a kept version as JSON (the running version
/// answers from the registry when it was never changed over HTTP).
pub fn show_version(
    gw: &Gateway,
    kind: Kind,
    name: &str,
    version: &str,
) -> Result<serde_json::Value, ApiError> {
    let Ok(version) = version.parse::<u32>() else {
        let why = if !version.is_empty() && version.bytes().all(|b| b.is_ascii_digit()) {
            format!("`{version}` is past the largest version, {}", u32::MAX)
        } else {
            format!("`{version}` is not a version: expected a whole number, as in versions/2")
        };
        return Err(ApiError::NotFound {
            code: "unknown_version",
            message: why,
        });
    };
    let registry = gw.registry();
    let from_registry = running_at(&registry, kind, name, version);
    let (document, file) =
        match read_version(&gw.config.registry.schemas, &registry, kind, name, version) {
            Ok(text) => {
                let file = kept_file(&gw.config.registry.schemas, kind, name, version);
                (kept_document(&text, &file, kind, name, version)?, file)
            }
            Err(e) => match from_registry {
                Some(doc) => (doc.body.clone(), doc.file.clone()),
                None => return Err(e),
            },
        };
    let document = serde_json::to_value(&document)
        .map_err(|e| ApiError::Internal(format!("cannot show `{name}` as JSON: {e}")))?;
    Ok(json!({
        "kind": kind,
        "name": name,
        "version": version,
        "running": from_registry.is_some(),
        "file": file.display().to_string(),
        "document": document,
    }))
}

/// The request body as UTF-8 schema text (a byte order mark dropped), for the registering routes.
pub fn body_text(body: &[u8]) -> Result<String, ApiError> {
    let body = body.strip_prefix(b"\xef\xbb\xbf").unwrap_or(body);
    std::str::from_utf8(body)
        .map(str::to_owned)
        .map_err(|e| ApiError::Malformed {
            code: "invalid_body",
            message: format!(
                "the schema is not UTF-8 text: {e}; send YAML documents, as in schemas/*.yaml"
            ),
            field: None,
        })
}

#[cfg(test)]
mod tests {
    thread_local! {
        /// [`write_files`] stops as a killed process would, before this rename (by index).
        pub static CUT_AFTER_RENAMES: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
    }

    #[test]
    fn write_files_journals_before_renaming_so_a_cut_registration_is_taken_back() {
        let (dir, a, b, c) = journal::tests::folder_of_a_and_b();
        let kept = dir.path().join(VERSIONS_DIR).join("a.yaml");
        let write = |path: &Path, text: Option<&str>, history: bool| Write {
            path: path.to_owned(),
            text: text.map(str::to_owned),
            history,
        };
        let writes = [
            write(&kept, Some("old a"), true),
            write(&a, Some("new a"), false),
            write(&c, Some("new c"), false),
            write(&b, None, false),
        ];
        let before = [
            (a.clone(), Some("old a".to_owned())),
            (b.clone(), Some("old b".to_owned())),
            (c.clone(), None),
        ];
        // Killed after a.yaml's rename, before c.yaml's.
        CUT_AFTER_RENAMES.set(Some(2));
        let cut = write_files(dir.path(), &writes, &before);
        CUT_AFTER_RENAMES.set(None);
        assert!(cut.is_err());
        assert_eq!(
            std::fs::read_to_string(&a).expect("a"),
            "new a",
            "half done"
        );
        assert!(journal::pending(dir.path()));

        recover_interrupted(dir.path()).expect("taken back");
        assert_eq!(std::fs::read_to_string(&a).expect("a"), "old a");
        assert_eq!(std::fs::read_to_string(&b).expect("b"), "old b");
        assert!(!c.exists());
        // Kept for the first time by the registration taken back: not kept.
        assert!(!kept.exists(), "a kept version of a change that never ran");
        assert!(!journal::pending(dir.path()));
        let hidden: Vec<String> = journal::tests::names_in(dir.path())
            .into_iter()
            .filter(|n| n.starts_with('.') && ![VERSIONS_DIR, LOCK_FILE].contains(&n.as_str()))
            .collect();
        assert!(hidden.is_empty(), "{hidden:?}");

        // Uncut, the same writes leave no journal behind.
        write_files(dir.path(), &writes, &before).expect("written");
        assert_eq!(std::fs::read_to_string(&a).expect("a"), "new a");
        assert!(!b.exists());
        assert!(!journal::pending(dir.path()));
    }

    #[test]
    fn a_rename_that_fails_puts_back_the_files_already_renamed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = dir.path().join("a.yaml");
        std::fs::write(&a, "old").expect("a");
        // A folder where a file should go: its rename fails after a.yaml's succeeded.
        let b = dir.path().join("b.yaml");
        std::fs::create_dir(&b).expect("b");
        std::fs::write(b.join("inside"), "x").expect("inside");
        let c = dir.path().join("c.yaml");
        let kept = dir.path().join(VERSIONS_DIR).join("c.yaml");
        let writes = [
            Write {
                path: kept.clone(),
                text: Some("new c".to_owned()),
                history: true,
            },
            Write {
                path: c.clone(),
                text: Some("new c".to_owned()),
                history: false,
            },
            Write {
                path: a.clone(),
                text: Some("new".to_owned()),
                history: false,
            },
            Write {
                path: b.clone(),
                text: Some("new b".to_owned()),
                history: false,
            },
        ];
        let before = [(c.clone(), None), (a.clone(), Some("old".to_owned()))];
        let e = write_files(dir.path(), &writes, &before).expect_err("b.yaml is a folder");
        assert!(e.to_string().contains("b.yaml"), "{e}");
        assert_eq!(std::fs::read_to_string(&a).expect("a"), "old");
        assert!(!c.exists(), "c.yaml was new, so it is gone again");
        assert!(!kept.exists(), "and so is its kept version");
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .expect("dir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        assert!(
            left.iter().all(|n| !n.ends_with(".hydrant-tmp")),
            "{left:?}"
        );
    }

    use super::*;

    #[test]
    fn a_folder_written_after_the_plan_was_made_refuses_the_registration() {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = dir.path().join("a.yaml");
        std::fs::write(&a, "kind: entity\nname: a\n").expect("a");
        let plan = || FilePlan {
            writes: Vec::new(),
            sources: Vec::new(),
            listed: vec![a.clone()],
            read: vec![
                (a.clone(), Some("kind: entity\nname: a\n".to_owned())),
                (dir.path().join("b.yaml"), None),
            ],
        };
        let check = |plan: &FilePlan| unchanged_since_planned(plan, dir.path(), "then register");
        assert!(check(&plan()).is_ok());
        let refused = |e: ApiError, file: &str| {
            let message = e.to_string();
            assert!(
                matches!(
                    e,
                    ApiError::Conflict {
                        code: "schema_file_changed",
                        ..
                    }
                ) && message.contains(file)
                    && message.contains("nothing was registered"),
                "{message}"
            );
        };
        // A comment added to a file the plan read.
        std::fs::write(&a, "# edited\nkind: entity\nname: a\n").expect("a");
        refused(check(&plan()).expect_err("a.yaml changed"), "a.yaml");
        std::fs::write(&a, "kind: entity\nname: a\n").expect("a");
        // A file created where the plan puts a new document.
        std::fs::write(dir.path().join("b.yaml"), "kind: entity\nname: b\n").expect("b");
        refused(check(&plan()).expect_err("b.yaml appeared"), "b.yaml");
        std::fs::remove_file(dir.path().join("b.yaml")).expect("b");
        // A file the plan read, gone.
        std::fs::remove_file(&a).expect("a");
        refused(check(&plan()).expect_err("a.yaml vanished"), "a.yaml");
    }

    #[test]
    fn a_file_is_cut_into_its_documents_and_put_back_together() {
        let text = "# entities\nkind: entity\nname: a\n---\n# b\nkind: entity\nname: b\n--- # c\nkind: entity\nname: c\n";
        let c = cut(text).expect("cuts");
        assert_eq!(c.pieces.len(), 3);
        assert_eq!(c.docs, vec![Some(0), Some(1), Some(2)]);
        assert_eq!(c.pieces.concat(), text);
        assert_eq!(bare(&c.pieces[1]), "# b\nkind: entity\nname: b\n");
        let lead = cut("# only a comment\n---\nkind: entity\nname: a\n").expect("cuts");
        assert_eq!(
            lead.docs,
            vec![None, Some(0)],
            "comments before a leading `---` are no document"
        );
        let texts = submitted_texts("# a\nkind: entity\nname: a\n---\nkind: view\nname: b\n")
            .unwrap_or_default();
        assert_eq!(
            texts
                .get(&(Kind::Entity, "a".to_owned()))
                .map(|s| s.text.as_str()),
            Some("# a\nkind: entity\nname: a\n")
        );
        assert_eq!(
            texts
                .get(&(Kind::View, "b".to_owned()))
                .map(|s| s.text.as_str()),
            Some("kind: view\nname: b\n")
        );
        assert!(cut("a: |\n  ---\n  b\n").is_some_and(|c| c.pieces.len() == 1));
    }

    #[test]
    fn a_document_that_begins_on_its_marker_line_keeps_its_content() {
        // A flow mapping on the `---` line is the whole document: dropping the line with the marker
        // would write an empty file (or, in a shared file, delete the document).
        let one = r#"--- {"kind": "entity", "name": "a", "key": "a_id"}"#;
        let texts = submitted_texts(one).unwrap_or_default();
        let text = texts
            .get(&(Kind::Entity, "a".to_owned()))
            .map(|s| s.text.clone())
            .unwrap_or_default();
        let back: serde_yaml::Value = serde_yaml::from_str(&text).expect("parses");
        assert_eq!(
            back.get("key").and_then(|v| v.as_str()),
            Some("a_id"),
            "{text:?}"
        );
        // In a file of several documents such a line is not cut at: the file is not edited piece by
        // piece rather than edited wrongly.
        let shared = format!("kind: entity\nname: b\n{one}\n");
        assert!(cut(&shared).is_none());
        for marker in ["---", "--- ", "---\t# c", "--- # c", "---\r\n"] {
            assert!(is_marker(marker), "{marker:?}");
        }
        for content in ["--- {}", "--- |", "--- !tag", "----", "---a"] {
            assert!(!is_marker(content), "{content:?}");
        }
    }
}
