//! A proposed schema change, checked against the running registry without registering anything
//! (`POST /v1/schemas:validate`).
//!
//! The submitted documents are compiled beside the registered ones, a submitted document taking the
//! place of the registered one of the same kind and name, so a change is checked with everything that
//! names it. The result is then compared with what runs: versions only go up, a view whose features
//! change needs a new version, and a feature whose dtype changes under a running model needs a new
//! version of that model in the same change. Last, every model the change touches is loaded once, as
//! start-up would load it: its file, its inputs and outputs, the binding's width, the trial runs.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::Relaxed;

use ort::environment::Environment;
use serde::{Deserialize as _, Serialize};
use serde_json::json;

use crate::config::InferenceConfig;
use crate::error::ApiError;
use crate::gateway::Gateway;
use crate::infer::{Engine, InferError};
use crate::schema::{
    Document, Feature, Kind, Model, Registry, SchemaError, SchemaErrors, Slot, Source, View,
};

/// The name messages give the request's documents.
pub const ORIGIN: &str = "request body";

/// Largest schema body: a thousand-feature view is about 60 KiB.
pub const MAX_BODY_BYTES: usize = 128 << 10;

/// Most `[` and `{` in a schema body. The YAML parser's cost grows with the tokens times the nesting
/// of flow collections (`[[[...]]]`): a body nested 200,000 deep kept a core busy for minutes. The
/// brackets are counted before parsing, inside quoted strings too. With this many and the size limit,
/// the worst body (all of them open, then 65,000 tokens) took 0.25-0.45 s to check on the 2-core
/// development machine.
pub const MAX_BRACKETS: usize = 512;

/// Refuses a body too large or holding too many flow brackets to parse in bounded time.
pub fn check_size(body: &[u8]) -> Result<(), ApiError> {
    if body.len() > MAX_BODY_BYTES {
        return Err(ApiError::TooLarge {
            code: "schema_too_large",
            message: format!(
                "the schema body is {} bytes, more than the {MAX_BODY_BYTES} a check takes: send fewer documents at a time",
                body.len()
            ),
            field: None,
        });
    }
    let brackets = body.iter().filter(|b| matches!(b, b'[' | b'{')).count();
    if brackets > MAX_BRACKETS {
        return Err(ApiError::TooLarge {
            code: "schema_too_large",
            message: format!(
                "the schema body holds {brackets} `[` and `{{`, more than the {MAX_BRACKETS} a check takes (quoted ones count too): send fewer documents at a time, or write long lists in block style (`- item` lines)"
            ),
            field: None,
        });
    }
    Ok(())
}

/// What the check says of one submitted document.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Change {
    pub kind: Kind,
    pub name: String,
    pub change: Verdict,
    /// The submitted version (views and models).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub version: Option<u32>,
    /// The running version, when there is one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub running_version: Option<u32>,
    /// What registering it would mean for stored records and running models.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

/// How a submitted document compares with the running one.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    Added,
    Changed,
    Unchanged,
}

/// What loading the touched models takes: the runtime, the sessions' settings, and the flag that says
/// the request is gone (the rest of the models are then skipped).
pub struct Load<'a> {
    pub env: &'a Environment,
    pub cfg: &'a InferenceConfig,
    pub gone: &'a AtomicBool,
    /// The files model versions were served from: a version checked again must find the same bytes.
    pub served: &'a crate::infer::ServedFiles,
}

/// A change compiled beside the registered documents and compared with them.
pub struct Proposal {
    /// Everything, as it would be registered (the submitted documents under [`ORIGIN`]).
    pub registry: Registry,
    /// What each submitted document changes.
    pub changes: Vec<Change>,
    /// The models whose engines the change replaces or adds.
    pub touched: BTreeSet<String>,
    /// The submitted documents' kinds and names, in order.
    pub submitted: Vec<(Kind, String)>,
}

/// What a proposal takes the place of: documents submitted in a body, documents removed, and whether a
/// version may go down (a rollback).
#[derive(Default)]
pub struct Edit<'a> {
    pub body: Option<&'a str>,
    pub removed: &'a [(Kind, String)],
    pub rollback: bool,
}

/// Compiles `edit` beside the registered documents of `running` and compares the result with them.
pub fn propose(
    running: &Registry,
    edit: &Edit<'_>,
    models_dir: &Path,
) -> Result<Proposal, SchemaErrors> {
    let submitted = edit.body.map(submitted).unwrap_or_default();
    let mut replaced = submitted.clone();
    replaced.extend(edit.removed.iter().cloned());
    let proposed = Registry::compile(&sources(running, &replaced, edit.body)?, models_dir)?;
    let changes = compare(running, &proposed, &submitted, &|_, _| edit.rollback)?;
    let touched = touched_models(&proposed, &changes);
    let errors = outside_models_folder(&proposed, &touched);
    if !errors.is_empty() {
        return Err(SchemaErrors(errors));
    }
    Ok(Proposal {
        registry: proposed,
        changes,
        touched,
        submitted,
    })
}

/// The schemas folder as it is now (`proposed`, compiled from its files) compared with `running`, by the
/// rules a registration follows: each document added or changed on disk is a submitted one, and one
/// gone from the folder is removed. Answers `None` when the folder holds what runs, where it runs from
/// (same bodies, same files, same places in them).
///
/// A document whose version goes down is a rollback when `kept` says that version's kept text is the
/// document (another replica sharing the folder rolled it back); otherwise it is refused.
pub fn propose_folder(
    running: &Registry,
    proposed: Registry,
    kept: &dyn Fn(Kind, &str, &serde_yaml::Value) -> bool,
) -> Result<Option<Proposal>, SchemaErrors> {
    let placed = |r: &Registry| {
        let mut v: Vec<_> = r
            .documents
            .iter()
            .map(|d| (d.kind, d.name.clone(), d.file.clone(), d.index))
            .collect();
        v.sort();
        v
    };
    let submitted: Vec<(Kind, String)> = proposed
        .documents
        .iter()
        .filter(|d| {
            running
                .document(d.kind, &d.name)
                .is_none_or(|r| r.body != d.body)
        })
        .map(|d| (d.kind, d.name.clone()))
        .collect();
    let removed = running
        .documents
        .iter()
        .any(|d| proposed.document(d.kind, &d.name).is_none());
    if submitted.is_empty() && !removed && placed(running) == placed(&proposed) {
        return Ok(None);
    }
    let rolled_back = |kind: Kind, name: &str| {
        proposed
            .document(kind, name)
            .is_some_and(|d| kept(kind, name, &d.body))
    };
    let changes = compare(running, &proposed, &submitted, &rolled_back)?;
    let touched = touched_models(&proposed, &changes);
    Ok(Some(Proposal {
        registry: proposed,
        changes,
        touched,
        submitted,
    }))
}

/// Checks `body` (one or more YAML documents) against `running`: compiled with the registered documents,
/// compared with them, its version numbers against those kept in `schemas_dir` (as a registration checks
/// them: 409 `version_kept`), and each model it touches loaded once on its device. Blocking (it opens
/// ONNX Runtime sessions): call it off the async executor.
pub fn check(
    running: &Registry,
    body: &str,
    dirs: (&Path, &Path),
    load: Load<'_>,
) -> Result<Vec<Change>, ApiError> {
    let (schemas_dir, models_dir) = dirs;
    let edit = Edit {
        body: Some(body),
        ..Edit::default()
    };
    let Proposal {
        registry: proposed,
        changes,
        touched,
        ..
    } = propose(running, &edit, models_dir).map_err(ApiError::InvalidSchema)?;
    crate::registrar::kept_numbers_hold(schemas_dir, &changes, &proposed)?;
    let mut errors = Vec::new();
    for name in touched {
        if load.gone.load(Relaxed) {
            break;
        }
        let Some(model) = proposed.models.get(&name) else {
            continue;
        };
        // The file's bytes first, as a registration checks them: a cheap refusal before the load.
        let checked = load
            .served
            .check_file(model)
            .and_then(|()| Engine::check(load.env, model, load.cfg).map(drop));
        if let Err(e) = checked {
            errors.push(load_error(
                e,
                proposed.document(Kind::Model, &name),
                &changes,
                model,
            ));
        }
    }
    if errors.is_empty() {
        Ok(changes)
    } else {
        Err(ApiError::InvalidSchema(SchemaErrors(errors)))
    }
}

/// The request's models among `touched` whose `file:` is absolute or climbs out with `..`. A request
/// names ONNX files inside the models folder only: else any HTTP client could have the gateway read, and
/// say whether it can read, any file on the host.
fn outside_models_folder(proposed: &Registry, touched: &BTreeSet<String>) -> Vec<SchemaError> {
    touched
        .iter()
        .filter_map(|name| proposed.document(Kind::Model, name))
        .filter(|doc| doc.file.as_os_str() == ORIGIN)
        .filter_map(|doc| {
            let file = Path::new(doc.body.get("file")?.as_str()?);
            let outside = file.is_absolute()
                || file
                    .components()
                    .any(|c| matches!(c, std::path::Component::ParentDir));
            outside.then(|| SchemaError {
                file: PathBuf::from(ORIGIN),
                path: at(doc, "file"),
                message: format!(
                    "`{}` is outside the models folder: a schema sent over HTTP names its ONNX file relative to registry.models, without `..`",
                    file.display()
                ),
            })
        })
        .collect()
}

/// The kind and name of each document of `body`, in order, each once. A document without them is left
/// to the compiler, which says what is missing.
pub fn submitted(body: &str) -> Vec<(Kind, String)> {
    let mut out: Vec<(Kind, String)> = Vec::new();
    // Not read at all when its aliases expand past the bound: compiled, the body is refused for it.
    if crate::yaml::expansion_problem(body).is_some() {
        return out;
    }
    for doc in serde_yaml::Deserializer::from_str(body) {
        let Ok(value) = serde_yaml::Value::deserialize(doc) else {
            break;
        };
        if let Some((kind, name)) = Kind::of_document(&value)
            && !out.iter().any(|(k, n)| *k == kind && n == name)
        {
            out.push((kind, name.to_owned()));
        }
    }
    out
}

/// The registered documents, file by file, less the submitted ones, and then the request's. A replaced
/// document leaves an empty one in its place, so that `document N:` in a message about the rest of its
/// file still counts as the file does; a file left with nothing is left out.
fn sources(
    running: &Registry,
    submitted: &[(Kind, String)],
    body: Option<&str>,
) -> Result<Vec<(PathBuf, String)>, SchemaErrors> {
    let mut files: Vec<(&Path, Vec<Option<&Document>>)> = Vec::new();
    for doc in &running.documents {
        if files.last().is_none_or(|(f, _)| *f != doc.file.as_path()) {
            files.push((&doc.file, Vec::new()));
        }
        let Some((_, slots)) = files.last_mut() else {
            continue;
        };
        if slots.len() <= doc.index {
            slots.resize(doc.index + 1, None);
        }
        let replaced = submitted
            .iter()
            .any(|(k, n)| *k == doc.kind && *n == doc.name);
        if !replaced {
            slots[doc.index] = Some(doc);
        }
    }
    let mut out = Vec::with_capacity(files.len() + 1);
    for (file, slots) in files {
        if slots.iter().all(Option::is_none) {
            continue;
        }
        let mut text = String::new();
        for (i, slot) in slots.iter().enumerate() {
            if i > 0 {
                text.push_str("---\n");
            }
            match slot {
                Some(doc) => {
                    let yaml = serde_yaml::to_string(&doc.body).map_err(|e| {
                        SchemaErrors(vec![SchemaError {
                            file: file.to_owned(),
                            path: String::new(),
                            message: format!(
                                "cannot re-read the registered {} `{}`: {e}",
                                doc.kind.as_str(),
                                doc.name
                            ),
                        }])
                    })?;
                    text.push_str(&yaml);
                }
                None => text.push_str("null\n"),
            }
        }
        out.push((file.to_owned(), text));
    }
    if let Some(body) = body {
        out.push((PathBuf::from(ORIGIN), body.to_owned()));
    }
    Ok(out)
}

/// Where in the request a document's field is, as the compiler writes it: `document 2: version`.
fn at(doc: &Document, field: &str) -> String {
    if doc.index == 0 {
        field.to_owned()
    } else {
        format!("document {}: {field}", doc.index + 1)
    }
}

/// Whether two compiled models compute the same thing from the same features: the file, the input and
/// outputs, the context and every slot. Compared compiled, not as written, so `40` and `40.0` or `log1p`
/// and `[log1p]` are the same; `description`, `sessions`, `batching` and `device` may differ.
fn same_binding(a: &Model, b: &Model) -> bool {
    let same_feature =
        |x: &Feature, y: &Feature| x.name == y.name && x.dtype == y.dtype && x.default == y.default;
    let same_slot = |x: &Slot, y: &Slot| {
        x.label == y.label
            && x.dtype == y.dtype
            && x.fill == y.fill
            && x.default == y.default
            && x.steps == y.steps
            && x.offset == y.offset
            && x.width == y.width
    };
    a.path == b.path
        && a.input == b.input
        && a.outputs == b.outputs
        && a.width == b.width
        && a.context.len() == b.context.len()
        && a.context
            .iter()
            .zip(&b.context)
            .all(|(x, y)| same_feature(x, y))
        && a.slots.len() == b.slots.len()
        && a.slots.iter().zip(&b.slots).all(|(x, y)| same_slot(x, y))
}

/// Compares each submitted document with the running one of its kind and name.
fn compare(
    running: &Registry,
    proposed: &Registry,
    submitted: &[(Kind, String)],
    // Whether the document may go down in version (a rollback).
    rollback: &dyn Fn(Kind, &str) -> bool,
) -> Result<Vec<Change>, SchemaErrors> {
    let mut errors = Vec::new();
    let mut changes = Vec::with_capacity(submitted.len());
    for (kind, name) in submitted {
        // Compiled, so the registry has the request's document of that kind and name.
        let Some(new) = proposed.document(*kind, name) else {
            continue;
        };
        let old = running.document(*kind, name);
        let mut refuse = |field: &str, message: String| {
            errors.push(SchemaError {
                file: new.file.clone(),
                path: at(new, field),
                message,
            });
        };
        let mut change = Change {
            kind: *kind,
            name: name.clone(),
            change: match old {
                None => Verdict::Added,
                Some(old) if old.body == new.body => Verdict::Unchanged,
                Some(_) => Verdict::Changed,
            },
            version: None,
            running_version: None,
            notes: Vec::new(),
        };
        // Versions only go up; at the same version, what the kind says may not change must not.
        let mut retyped = Vec::new();
        let (version, running_version, reshaped) = match kind {
            Kind::Entity => {
                if let (Some(o), Some(n)) =
                    (running.entities.get(name), proposed.entities.get(name))
                    && o.dtype != n.dtype
                {
                    let users = still_keyed_by(running, proposed, name);
                    if !users.is_empty() {
                        refuse(
                            "dtype",
                            format!(
                                "changes from {} to {} while views {users} key their stored records by it: define a new entity for the new keys",
                                o.dtype, n.dtype
                            ),
                        );
                    }
                }
                (None, None, None)
            }
            Kind::View => {
                let n = proposed.views.get(name);
                let o = running.views.get(name);
                let mut reshaped = None;
                if let (Some(n), Some(o)) = (n, o) {
                    if o.layout != n.layout || o.entity.name != n.entity.name {
                        change.notes.extend(feature_notes(o, n));
                        change.notes.push(format!(
                            "records stored under version {}'s features are served as DEFAULTED until their rows are written again",
                            o.version
                        ));
                        reshaped = Some(
                            "the view's features or entity changed: a view whose stored records change shape needs a new version",
                        );
                        retyped = retyped_under_models(running, proposed, n);
                    } else if o.version != n.version {
                        // Same features, but a record is read only under the version it was written with.
                        change.notes.push(format!(
                            "records stored under version {} are served as DEFAULTED until their rows are written again: a record is read only under the version it was written with, even where the features are unchanged",
                            o.version
                        ));
                    }
                }
                (n.map(|v| v.version), o.map(|v| v.version), reshaped)
            }
            Kind::Model => {
                let n = proposed.models.get(name);
                let o = running.models.get(name);
                let mut reshaped = None;
                if let (Some(n), Some(o)) = (n, o) {
                    if o.width != n.width {
                        change.notes.push(format!(
                            "input width changes from {} to {}",
                            o.width, n.width
                        ));
                    }
                    if !same_binding(o, n) {
                        reshaped = Some(
                            "the binding (file, input, outputs, context or inputs) changed: a changed binding needs a new version",
                        );
                    }
                }
                (n.map(|m| m.version), o.map(|m| m.version), reshaped)
            }
        };
        if let (Some(n), Some(o)) = (version, running_version) {
            if n < o && !rollback(*kind, name) {
                refuse(
                    "version",
                    format!("{n} is lower than the running version {o}: versions only go up"),
                );
            } else if let Some(why) = reshaped.filter(|_| n == o) {
                refuse("version", format!("is still {o}, but {why}"));
            }
        }
        for message in retyped {
            refuse("features", message);
        }
        change.version = version;
        change.running_version = running_version;
        changes.push(change);
    }
    if errors.is_empty() {
        Ok(changes)
    } else {
        Err(SchemaErrors(errors))
    }
}

/// The views that would still key stored records by entity `name` after the change: those keyed by it
/// now and in the proposal, as a list for a message (empty when none).
fn still_keyed_by(running: &Registry, proposed: &Registry, name: &str) -> String {
    let users: Vec<&str> = proposed
        .views
        .values()
        .filter(|v| v.entity.name == name)
        .filter(|v| {
            running
                .views
                .get(&v.name)
                .is_some_and(|r| r.entity.name == name)
        })
        .map(|v| v.name.as_str())
        .collect();
    if users.is_empty() {
        String::new()
    } else {
        crate::schema::known_names(users)
    }
}

/// For view `view` as proposed: a message per feature whose dtype changes while a running model that
/// keeps its binding (no new version in the proposal) reads it, and one per such model when the view's
/// entity changes. Such a model would take values of another type through transforms written for the
/// old one, or have its callers send another entity than the one they send.
fn retyped_under_models(running: &Registry, proposed: &Registry, view: &View) -> Vec<String> {
    let mut out = Vec::new();
    for model in running.models.values() {
        let rebound = proposed
            .models
            .get(&model.name)
            .is_some_and(|m| m.version > model.version);
        if rebound {
            continue;
        }
        if let Some(read) = model.views.iter().find(|v| v.name == view.name)
            && read.entity.name != view.entity.name
        {
            out.push(format!(
                "the entity changes from {} to {}, and model `{}` (version {}) reads the view: its callers send `{}`; submit a new version of model `{}` in the same change",
                read.entity.name, view.entity.name, model.name, model.version, read.entity.name, model.name
            ));
        }
        for slot in &model.slots {
            let Source::View { view: vi, feature } = slot.source else {
                continue;
            };
            let read = &model.views[vi];
            if read.name != view.name {
                continue;
            }
            let before = &read.features[feature];
            if let Some(after) = view.features.iter().find(|f| f.name == before.name)
                && after.dtype != before.dtype
            {
                out.push(format!(
                    "`{}` changes dtype from {} to {}, and model `{}` (version {}) reads it: submit a new version of model `{}` in the same change",
                    before.name, before.dtype, after.dtype, model.name, model.version, model.name
                ));
            }
        }
    }
    out
}

/// Features added, removed and retyped between two versions of a view.
fn feature_notes(old: &crate::schema::View, new: &crate::schema::View) -> Vec<String> {
    let mut notes = Vec::new();
    /// The names of `a`'s features that `b` does not have.
    fn missing<'a>(a: &'a View, b: &View) -> Vec<&'a str> {
        a.features
            .iter()
            .filter(|f| b.feature_index(&f.name).is_none())
            .map(|f| f.name.as_str())
            .collect()
    }
    let added = missing(new, old);
    let removed = missing(old, new);
    let retyped: Vec<String> = old
        .features
        .iter()
        .filter_map(|o| {
            let n = new.features.iter().find(|n| n.name == o.name)?;
            (n.dtype != o.dtype).then(|| format!("{} ({} to {})", o.name, o.dtype, n.dtype))
        })
        .collect();
    if !added.is_empty() {
        notes.push(format!("features added: {}", added.join(", ")));
    }
    if !removed.is_empty() {
        notes.push(format!("features removed: {}", removed.join(", ")));
    }
    if !retyped.is_empty() {
        notes.push(format!("dtypes changed: {}", retyped.join(", ")));
    }
    if old.entity.name != new.entity.name {
        notes.push(format!(
            "entity changes from {} to {}",
            old.entity.name, new.entity.name
        ));
    }
    if added.is_empty() && removed.is_empty() && retyped.is_empty() && old.entity == new.entity {
        notes.push("features reordered".to_owned());
    }
    notes
}

/// The models a change touches, by name, each once: the submitted ones that are added or changed, and
/// the models reading a submitted view that changed (a changed embedding width changes theirs).
fn touched_models(proposed: &Registry, changes: &[Change]) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for c in changes.iter().filter(|c| c.change != Verdict::Unchanged) {
        let reads = |m: &Model| match c.kind {
            Kind::Model => m.name == c.name,
            Kind::View => m.views.iter().any(|v| v.name == c.name),
            Kind::Entity => m.views.iter().any(|v| v.entity.name == c.name),
        };
        out.extend(
            proposed
                .models
                .values()
                .filter(|m| reads(m))
                .map(|m| m.name.clone()),
        );
    }
    out
}

/// Why a change that does not name `model` loads it again: the views and entities it reads that the
/// change touches (a view's cache settings alone reload the models reading it), for an error that would
/// otherwise seem to be about something the change never named. `None` where the change names the model.
fn loaded_for(changes: &[Change], model: &Model) -> Option<String> {
    let changed = || changes.iter().filter(|c| c.change != Verdict::Unchanged);
    if changed().any(|c| c.kind == Kind::Model && c.name == model.name) {
        return None;
    }
    let read: Vec<String> = changed()
        .filter(|c| match c.kind {
            Kind::View => model.views.iter().any(|v| v.name == c.name),
            Kind::Entity => model.views.iter().any(|v| v.entity.name == c.name),
            Kind::Model => false,
        })
        .map(|c| format!("{} `{}`", c.kind.as_str(), c.name))
        .collect();
    (!read.is_empty()).then(|| {
        format!(
            " (it is loaded again because the change touches {}, which it reads)",
            read.join(" and ")
        )
    })
}

/// `model`, which `changes` loaded and which cannot load, as a schema problem at the `file:` of its
/// document, saying why it was loaded where the change does not name it ([`loaded_for`]).
pub(crate) fn load_error(
    e: InferError,
    doc: Option<&Document>,
    changes: &[Change],
    model: &Model,
) -> SchemaError {
    let mut error = model_error(e, doc);
    if let Some(why) = loaded_for(changes, model) {
        error.message.push_str(&why);
    }
    error
}

/// A model that cannot load, as a schema problem at the `file:` of its document.
fn model_error(e: InferError, doc: Option<&Document>) -> SchemaError {
    match e {
        InferError::Load {
            model,
            schema,
            path,
            message,
        } => SchemaError {
            // Where the document is: a submitted one is in the request body, and numbered as it is
            // there, not in the file it would be written to.
            file: doc.map_or(schema, |d| d.file.clone()),
            path: doc.map_or_else(|| "file".to_owned(), |d| at(d, "file")),
            message: format!(
                "model `{model}` ({}) cannot be loaded: {message}",
                path.display()
            ),
        },
        other => SchemaError {
            file: doc.map_or_else(|| PathBuf::from(ORIGIN), |d| d.file.clone()),
            path: String::new(),
            message: other.to_string(),
        },
    }
}

/// One check or registration at a time ([`exclusive`]).
static CHECKS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(1);

/// Set when the request a check runs for is gone (answered by the timeout backstop, or the client left).
struct Abandoned(Arc<AtomicBool>);

impl Drop for Abandoned {
    fn drop(&mut self) {
        self.0.store(true, Relaxed);
    }
}

/// Runs `job` on the blocking pool with ONNX Runtime at hand, one job at a time: a check or a
/// registration (`what`, for messages) opens ONNX Runtime sessions, which take memory and a core.
///
/// The turn is held by the blocking job, not by the request, so a request dropped by its deadline does
/// not let the next job start beside the one still running. `job` gets the flag that says the request
/// is gone, to stop before its next model rather than load models for nobody.
pub(crate) async fn exclusive<R: Send + 'static>(
    gw: &Gateway,
    what: &str,
    job: impl FnOnce(&'static Environment, &AtomicBool) -> Result<R, ApiError> + Send + 'static,
) -> Result<R, ApiError> {
    let env = crate::infer::runtime(&gw.config.onnxruntime_library()).map_err(|e| {
        ApiError::Internal(format!("cannot load models for the schema {what}: {e}"))
    })?;
    let turn = CHECKS
        .acquire()
        .await
        .map_err(|e| ApiError::Internal(format!("schema {what}s stopped: {e}")))?;
    let gone = Arc::new(AtomicBool::new(false));
    let _abandoned = Abandoned(gone.clone());
    let (catalog, telemetry) = (gw.catalog.clone(), gw.telemetry.clone());
    tokio::task::spawn_blocking(move || {
        let _turn = turn;
        if gone.load(Relaxed) {
            return Err(ApiError::Timeout(
                "the request ended before its turn".to_owned(),
            ));
        }
        let out = job(env, &gone);
        // A change that was refused after its models were started leaves their counters behind, and a
        // deleted model's stay too: only running models are reported.
        let running = catalog.load();
        telemetry.retain_models(|name| running.engines.contains_key(name));
        out
    })
    .await
    .map_err(|e| ApiError::Internal(format!("the schema {what} failed: {e}")))?
}

/// [`check`] for the gateway's running registry, with the models loaded through its ONNX Runtime (see
/// [`exclusive`]). A schema that fails is a 422 listing every problem.
pub async fn check_for(gw: &Arc<Gateway>, body: String) -> Result<Vec<Change>, ApiError> {
    let models_dir = gw.config.registry.models.clone();
    let schemas_dir = gw.config.registry.schemas.clone();
    let inference = gw.config.inference.clone();
    let g = gw.clone();
    exclusive(gw, "check", move |env, gone| {
        // Taken in the turn, so a registration or reload just before is what the change is checked on.
        let running = g.registry();
        let load = Load {
            env,
            cfg: &inference,
            gone,
            served: &g.served,
        };
        check(&running, &body, (&schemas_dir, &models_dir), load)
    })
    .await
}

/// `GET /v1/schemas`: each kind's registered names, sorted, with their versions and files.
pub fn listing(registry: &Registry) -> serde_json::Value {
    let mut entities: Vec<_> = registry.entities.values().collect();
    entities.sort_by(|a, b| a.name.cmp(&b.name));
    let mut views: Vec<_> = registry.views.values().collect();
    views.sort_by(|a, b| a.name.cmp(&b.name));
    let mut models: Vec<_> = registry.models.values().collect();
    models.sort_by(|a, b| a.name.cmp(&b.name));
    let file = |kind: Kind, name: &str| {
        registry
            .document(kind, name)
            .map(|d| d.file.display().to_string())
    };
    json!({
        "entities": entities.iter().map(|e| json!({
            "name": e.name,
            "dtype": e.dtype.to_string(),
            "file": file(Kind::Entity, &e.name),
        })).collect::<Vec<_>>(),
        "views": views.iter().map(|v| json!({
            "name": v.name,
            "version": v.version,
            "entity": v.entity.name,
            "features": v.features.len(),
            "file": file(Kind::View, &v.name),
        })).collect::<Vec<_>>(),
        "models": models.iter().map(|m| json!({
            "name": m.name,
            "version": m.version,
            "views": m.views.iter().map(|v| v.name.as_str()).collect::<Vec<_>>(),
            "width": m.width,
            "file": file(Kind::Model, &m.name),
        })).collect::<Vec<_>>(),
    })
}

/// `GET /v1/schemas/{kind}/{name}`: the registered document, as JSON, with its file.
pub fn document(
    registry: &Registry,
    kind: Kind,
    name: &str,
) -> Result<serde_json::Value, ApiError> {
    let Some(doc) = registry.document(kind, name) else {
        return Err(crate::registrar::not_registered(registry, kind, name));
    };
    let body = serde_json::to_value(&doc.body).map_err(|e| {
        ApiError::Internal(format!(
            "cannot show {} `{name}` as JSON: {e}",
            kind.as_str()
        ))
    })?;
    let version = body.get("version").cloned();
    let mut answer = json!({
        "kind": kind.as_str(),
        "name": doc.name,
        "file": doc.file.display().to_string(),
        "document": body,
    });
    if let Some(v) = version {
        answer["version"] = v;
    }
    Ok(answer)
}
