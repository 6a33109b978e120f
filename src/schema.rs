//! Schema registry: parses and validates the entities, feature views and model bindings that data teams write
//! in `schemas/*.yaml`, and compiles them into the lookup tables the request path uses.
//!
//! Validation collects every problem it finds, each with the file, the path inside the document and what was
//! expected, so a data team fixes a schema in one round. The binding width is checked against the ONNX
//! model's input by [`crate::infer`] when the model is loaded.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use crate::config::{MAX_CONFIG_DURATION, MAX_SESSIONS, in_range};
use crate::value::{Dtype, Value};

/// Reserved source name for request-time features in a model binding (`context:hour_of_day`).
pub const CONTEXT: &str = "context";

/// Reserved view name: the Redis store keeps each view's hot-key set at the key of entity `<view>` in this
/// view (`hy:hot:user_profile`), so a real view of this name would overwrite those sets.
pub const HOT_VIEW: &str = "hot";

/// The row field the loader and the rows API read a record's event time from, so no feature may take it.
pub const EVENT_TIMESTAMP: &str = "event_timestamp";

/// Most rows one model run may batch (`batching.max_batch_rows`).
pub const MAX_BATCH_ROWS: usize = 100_000;

/// Largest schema file read: in the schemas folder, and a kept version. A thousand-feature view is about
/// 60 KiB. The YAML parser holds about 300 bytes per node: a 1 MiB file of 350,000 empty flow lists took
/// 0.4 s and 300 MB to check, a 16 MiB one 2.4-3.9 GB. (Flow collections nested thousands deep still cost
/// seconds: the folder is the operator's, and bodies sent over HTTP are bounded by `proposal::check_size`.)
pub const MAX_SCHEMA_FILE_BYTES: u64 = 1 << 20;

/// Longest cache duration of a view (`cache.ttl`, `negative_ttl`, `max_staleness`).
const MAX_CACHE_DURATION: Duration = Duration::from_secs(365 * 86_400);

/// Longest `max_age` and `store.key_ttl`: 100 years of 365.25 days (36525d).
/// Longer expiries are typos; Redis refuses expiry times past what its clock can add.
const MAX_RETENTION: Duration = Duration::from_secs(100 * 31_557_600);

/// Names for an error message, sorted, each once: `a, b, c`.
pub fn known_names<'a>(names: impl IntoIterator<Item = &'a str>) -> String {
    let mut v: Vec<&str> = names.into_iter().collect();
    v.sort_unstable();
    v.dedup();
    if v.is_empty() {
        return "none".to_owned();
    }
    v.join(", ")
}

/// One problem in one schema file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchemaError {
    pub file: PathBuf,
    /// Where in the document, e.g. `inputs[4].feature`; empty for the whole file.
    pub path: String,
    pub message: String,
}

impl fmt::Display for SchemaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            write!(f, "{}: {}", self.file.display(), self.message)
        } else {
            write!(
                f,
                "{}: {}: {}",
                self.file.display(),
                self.path,
                self.message
            )
        }
    }
}

/// Every problem found in a set of schema files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchemaErrors(pub Vec<SchemaError>);

impl fmt::Display for SchemaErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} schema problem(s):", self.0.len())?;
        for e in &self.0 {
            write!(f, "\n  {e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for SchemaErrors {}

// ---------------------------------------------------------------------------------------------------------
// The documents as written.

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct EntityDoc {
    name: String,
    #[serde(default = "default_entity_dtype")]
    dtype: String,
    #[serde(default)]
    description: Option<String>,
}

fn default_entity_dtype() -> String {
    "string".to_owned()
}

#[derive(Debug, Clone, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a feature such as {name: age, dtype: int64}"
)]
struct FeatureDoc {
    name: String,
    dtype: String,
    #[serde(default)]
    default: Option<serde_yaml::Value>,
    #[serde(default)]
    description: Option<String>,
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields, expecting = "a cache table such as {ttl: 5m}")]
struct CacheDoc {
    #[serde(default, with = "opt_duration")]
    ttl: Option<Duration>,
    #[serde(default, with = "opt_duration")]
    refresh_after: Option<Duration>,
    #[serde(default, with = "opt_duration")]
    negative_ttl: Option<Duration>,
    #[serde(default, with = "opt_duration")]
    max_staleness: Option<Duration>,
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(
    deny_unknown_fields,
    expecting = "a store table such as {timeout: 50ms}"
)]
struct StoreDoc {
    #[serde(default, with = "opt_duration")]
    key_ttl: Option<Duration>,
    #[serde(default, with = "opt_duration")]
    timeout: Option<Duration>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct ViewDoc {
    name: String,
    version: u32,
    entity: String,
    #[serde(default)]
    description: Option<String>,
    #[serde(default, with = "opt_duration")]
    max_age: Option<Duration>,
    #[serde(default)]
    cache: CacheDoc,
    #[serde(default)]
    store: StoreDoc,
    features: Vec<FeatureDoc>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "an input such as {feature: user_profile:age}"
)]
struct SlotDoc {
    feature: String,
    #[serde(default)]
    transform: Option<serde_yaml::Value>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a batching table such as {max_batch_rows: 256}"
)]
struct BatchingDoc {
    #[serde(default = "default_max_batch_rows")]
    max_batch_rows: usize,
    #[serde(default)]
    max_delay_us: u64,
}

impl Default for BatchingDoc {
    fn default() -> Self {
        Self {
            max_batch_rows: default_max_batch_rows(),
            max_delay_us: 0,
        }
    }
}

fn default_max_batch_rows() -> usize {
    256
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelDoc {
    name: String,
    version: u32,
    file: PathBuf,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    input: Option<String>,
    outputs: Vec<String>,
    #[serde(default)]
    device: DeviceKind,
    #[serde(default)]
    sessions: Option<usize>,
    #[serde(default)]
    batching: BatchingDoc,
    #[serde(default)]
    context: Vec<FeatureDoc>,
    inputs: Vec<SlotDoc>,
}

/// Where a model runs.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    #[default]
    Cpu,
    Cuda,
    /// CUDA when it can be registered, else CPU (logged and shown on `/v2/models/{model}`).
    Auto,
}

mod opt_duration {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer};

    /// Read as the config file's durations are: a bare number asks for a unit.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        #[derive(Deserialize)]
        struct Wrapped(
            #[serde(deserialize_with = "crate::config::duration::deserialize")] Duration,
        );
        Ok(Option::<Wrapped>::deserialize(d)?.map(|w| w.0))
    }
}

// ---------------------------------------------------------------------------------------------------------
// The compiled registry.

/// A key type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entity {
    pub name: String,
    /// `String` or `Int64`.
    pub dtype: Dtype,
    pub description: Option<String>,
}

/// One feature of a view.
#[derive(Debug, Clone)]
pub struct Feature {
    pub name: String,
    pub dtype: Dtype,
    /// Served when the value is missing; always of `dtype`, never null.
    pub default: Value,
}

/// Per-view cache and store policies (DESIGN.md, "Cache semantics").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// Expire a cached value this long after it was fetched.
    pub ttl: Duration,
    /// Serve, and refresh in the background, once a cached value is older than this.
    pub refresh_after: Option<Duration>,
    /// How long "entity not found" is cached.
    pub negative_ttl: Duration,
    /// How long a cached value may still be served when the store fails.
    pub max_staleness: Duration,
    /// Values whose event timestamp is older than this are `OUTSIDE_MAX_AGE`.
    pub max_age: Option<Duration>,
    /// Redis key expiry set on write.
    pub key_ttl: Option<Duration>,
    /// Store deadline for this view's reads.
    pub store_timeout: Duration,
}

/// A named group of features of one entity, stored together under one key per entity.
#[derive(Debug, Clone)]
pub struct View {
    pub name: String,
    pub version: u32,
    pub entity: Entity,
    pub description: Option<String>,
    pub features: Vec<Feature>,
    /// [`crate::value::layout`] of `features`, stored in every record.
    pub layout: u32,
    pub policy: Policy,
    pub file: PathBuf,
}

impl View {
    /// The version and the layout together: what a cached record decoded for this view is tagged with, so
    /// that a record decoded for another version or layout of the view (before a registered change) is
    /// never served as this one.
    pub fn shape(&self) -> u64 {
        (u64::from(self.version) << 32) | u64::from(self.layout)
    }

    pub fn feature_index(&self, name: &str) -> Option<usize> {
        self.features.iter().position(|f| f.name == name)
    }
}

/// One step of a slot's transform chain.
#[derive(Debug, Clone, PartialEq)]
pub enum Transform {
    Identity,
    Standardize { mean: f64, std: f64 },
    Log1p,
    Clip { min: f64, max: f64 },
    OneHot { vocabulary: Vec<Box<str>> },
    Bucketize { boundaries: Vec<f64> },
    HashBucket { buckets: u64 },
}

/// Where a slot's raw value comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// `view` indexes [`Model::views`]; `feature` indexes that view's features.
    View { view: usize, feature: usize },
    /// Indexes [`Model::context`].
    Context { index: usize },
}

/// One entry of a model binding: a feature, its transforms, and the input columns it fills.
#[derive(Debug, Clone)]
pub struct Slot {
    /// `view:feature` or `context:name`, as written.
    pub label: String,
    pub source: Source,
    pub dtype: Dtype,
    /// Replaces a missing value before the transforms (`fill_missing`); else the feature's default does.
    pub fill: Option<Value>,
    pub default: Value,
    pub steps: Vec<Transform>,
    /// First input column this slot writes.
    pub offset: usize,
    /// Number of input columns this slot writes.
    pub width: usize,
}

impl Slot {
    /// What a missing value becomes before the transforms: the fill value, else the feature's default.
    pub fn fallback(&self) -> &Value {
        self.fill.as_ref().unwrap_or(&self.default)
    }
}

/// Batching knobs of a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Batching {
    pub max_batch_rows: usize,
    pub max_delay_us: u64,
}

/// An ONNX model and its binding.
#[derive(Debug, Clone)]
pub struct Model {
    pub name: String,
    pub version: u32,
    pub description: Option<String>,
    /// The ONNX file, resolved against the models folder.
    pub path: PathBuf,
    /// The ONNX input the binding fills; `None` means the model's only input.
    pub input: Option<String>,
    pub outputs: Vec<String>,
    pub device: DeviceKind,
    pub sessions: Option<usize>,
    pub batching: Batching,
    pub context: Vec<Feature>,
    /// The views the binding reads, each once, in first-use order.
    pub views: Vec<Arc<View>>,
    pub slots: Vec<Slot>,
    /// Total input columns: the sum of the slots' widths.
    pub width: usize,
    pub file: PathBuf,
}

impl Model {
    pub fn context_index(&self, name: &str) -> Option<usize> {
        self.context.iter().position(|f| f.name == name)
    }
}

/// Everything registered: the compiled, validated schemas.
#[derive(Debug, Clone, Default)]
pub struct Registry {
    pub entities: HashMap<String, Entity>,
    pub views: HashMap<String, Arc<View>>,
    pub models: HashMap<String, Arc<Model>>,
    /// The documents as written, in file order: what `GET /v1/schemas/...` shows, and what a proposed
    /// change is compiled beside ([`crate::proposal`]).
    pub documents: Vec<Document>,
}

/// The three kinds of schema document.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Entity,
    View,
    Model,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Entity => "entity",
            Self::View => "view",
            Self::Model => "model",
        }
    }

    /// The kind as `/v1/schemas/{kind}/...` writes it.
    pub fn plural(self) -> &'static str {
        match self {
            Self::Entity => "entities",
            Self::View => "views",
            Self::Model => "models",
        }
    }

    /// The error code of a name of this kind that is not registered.
    pub fn unknown_code(self) -> &'static str {
        match self {
            Self::Entity => "unknown_entity",
            Self::View => "unknown_view",
            Self::Model => "unknown_model",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "entity" => Some(Self::Entity),
            "view" => Some(Self::View),
            "model" => Some(Self::Model),
            _ => None,
        }
    }

    /// The kind and name a parsed document declares, when it declares both and the kind is known.
    pub fn of_document(value: &serde_yaml::Value) -> Option<(Self, &str)> {
        let kind = value.get("kind")?.as_str().and_then(Self::parse)?;
        Some((kind, value.get("name")?.as_str()?))
    }
}

/// One schema document as written.
#[derive(Debug, Clone)]
pub struct Document {
    pub kind: Kind,
    pub name: String,
    pub file: PathBuf,
    /// Its position in the file, from 0, counting empty documents (as `document N:` in errors does).
    pub index: usize,
    /// The whole document, `kind` included.
    pub body: serde_yaml::Value,
}

impl Registry {
    /// The document that defined `name` of `kind`.
    pub fn document(&self, kind: Kind, name: &str) -> Option<&Document> {
        self.documents
            .iter()
            .find(|d| d.kind == kind && d.name == name)
    }
}

/// For a message about a relative path that could not be read: where it was looked for.
pub fn relative_hint(path: &Path) -> String {
    match std::env::current_dir() {
        Ok(cwd) if path.is_relative() => format!(
            "; a relative path is read from the working directory, {}",
            cwd.display()
        ),
        _ => String::new(),
    }
}

impl Registry {
    /// Reads every `*.yaml`/`*.yml` file of `dir` (sorted by name) and compiles them.
    pub fn load_dir(dir: &Path, models_dir: &Path) -> Result<Self, SchemaErrors> {
        Self::compile(&Self::read_dir(dir)?, models_dir)
    }

    /// The paths of the `*.yaml` (and `*.yml`) files of the schemas folder `dir`, sorted. Hidden names
    /// (`.#user_profile.yaml`, the link Emacs keeps while a file is edited; `.ctr.yaml.swp`) are
    /// editors' and tools' files, not schemas.
    pub fn schema_files(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                let hidden = p
                    .file_name()
                    .is_some_and(|n| n.as_encoded_bytes().starts_with(b"."));
                !hidden
                    && p.extension().and_then(|e| e.to_str()).is_some_and(|e| {
                        e.eq_ignore_ascii_case("yaml") || e.eq_ignore_ascii_case("yml")
                    })
            })
            .collect();
        files.sort();
        Ok(files)
    }

    /// The `*.yaml` (and `*.yml`) files of the schemas folder `dir`, sorted, each with its text: what
    /// [`Registry::load_dir`] compiles.
    pub fn read_dir(dir: &Path) -> Result<Vec<(PathBuf, String)>, SchemaErrors> {
        let read_err = |message: String| {
            SchemaErrors(vec![SchemaError {
                file: dir.to_owned(),
                path: String::new(),
                message,
            }])
        };
        let files = Self::schema_files(dir).map_err(|e| {
            read_err(format!(
                "cannot read the schemas folder (registry.schemas{}): {e}",
                relative_hint(dir)
            ))
        })?;
        if files.is_empty() {
            return Err(read_err("no *.yaml schema files found".to_owned()));
        }
        let mut sources = Vec::with_capacity(files.len());
        let mut errors = Vec::new();
        for file in files {
            match crate::config::read_text_file(&file, MAX_SCHEMA_FILE_BYTES) {
                Ok(text) => sources.push((file, text)),
                Err(e) => errors.push(SchemaError {
                    file,
                    path: String::new(),
                    message: format!("cannot read: {e}"),
                }),
            }
        }
        if !errors.is_empty() {
            return Err(SchemaErrors(errors));
        }
        Ok(sources)
    }

    /// Compiles schema sources given as `(file name, YAML text)`.
    pub fn compile(sources: &[(PathBuf, String)], models_dir: &Path) -> Result<Self, SchemaErrors> {
        let mut errs = Errs::default();
        // Names of documents that did not compile: what names them gets no second, misleading error.
        let mut broken = Broken::default();
        let mut entities = Vec::new();
        let mut views = Vec::new();
        let mut models = Vec::new();
        let mut written = Vec::new();
        for (file, text) in sources {
            // A file with no document at all (empty, or only comments) is most likely one saved before
            // it was written: said, rather than skipped.
            let mut documents = 0;
            if let Some(why) = crate::yaml::expansion_problem(text) {
                errs.in_document("");
                errs.push(file, "", format!("not valid YAML: {why}"));
                broken.unread(file);
                continue;
            }
            for (i, doc) in serde_yaml::Deserializer::from_str(text).enumerate() {
                // Errors name the document, all but the first (`document 2: ...`); a YAML syntax error
                // is the file's.
                let prefix = if i == 0 {
                    String::new()
                } else {
                    format!("document {}: ", i + 1)
                };
                errs.in_document("");
                let value = match serde_yaml::Value::deserialize(doc) {
                    Ok(v) => v,
                    Err(e) => {
                        let (path, what) = yaml_problem(&e);
                        // One with a path (a number out of range, a key written twice) is in this
                        // document.
                        if !path.is_empty() {
                            errs.in_document(&prefix);
                        }
                        errs.push(file, &path, format!("not valid YAML: {what}"));
                        broken.unread(file);
                        break;
                    }
                };
                if value.is_null() {
                    continue; // an empty document, e.g. a trailing `---`
                }
                documents += 1;
                errs.in_document(&prefix);
                let Some(kind) = value
                    .get("kind")
                    .and_then(|k| k.as_str())
                    .map(str::to_owned)
                else {
                    errs.push(
                        file,
                        "kind",
                        "missing: expected `kind: entity`, `kind: view` or `kind: model`".into(),
                    );
                    broken.unread(file);
                    continue;
                };
                if let Some((kind, name)) = Kind::of_document(&value) {
                    written.push(Document {
                        kind,
                        name: name.to_owned(),
                        file: file.clone(),
                        index: i,
                        body: value.clone(),
                    });
                }
                let mut body = value;
                if let Some(m) = body.as_mapping_mut() {
                    // In place: `remove` swaps the last key into its slot, and the first unknown key
                    // reported would then be the file's last.
                    m.shift_remove("kind");
                }
                let name = body.get("name").and_then(|n| n.as_str()).map(str::to_owned);
                match kind.as_str() {
                    "entity" => match parse_doc::<EntityDoc>(&mut errs, file, body) {
                        Some(d) => entities.push((file.clone(), prefix, d)),
                        None if name.is_none() => broken.unread(file),
                        None => broken.entities.extend(name),
                    },
                    "view" => match parse_doc::<ViewDoc>(&mut errs, file, body) {
                        Some(d) => views.push((file.clone(), prefix, d)),
                        None if name.is_none() => broken.unread(file),
                        None => broken.views.extend(name),
                    },
                    "model" => {
                        if let Some(d) = parse_doc::<ModelDoc>(&mut errs, file, body) {
                            models.push((file.clone(), prefix, d));
                        }
                    }
                    other => {
                        errs.push(
                            file,
                            "kind",
                            format!("unknown kind `{other}`: expected entity, view or model"),
                        );
                        broken.unread(file);
                    }
                }
            }
            errs.in_document("");
            if documents == 0 && !broken.unread.contains(file) {
                errs.push(
                    file,
                    "",
                    if file.as_os_str() == crate::proposal::ORIGIN {
                        "the body holds no schema (it is empty or only comments): expected a document with `kind: entity`, `kind: view` or `kind: model`".into()
                    } else {
                        "the file holds no schema (it is empty or only comments): expected a document with `kind: entity`, `kind: view` or `kind: model`, or remove the file".into()
                    },
                );
            }
        }

        let mut reg = Registry {
            documents: written,
            ..Registry::default()
        };
        // Where each name was first defined, for "defined twice" messages that name both places.
        let mut first: HashMap<(&str, String), String> = HashMap::new();
        let mut twice = |errs: &mut Errs,
                         kind: &'static str,
                         name: &str,
                         file: &Path,
                         prefix: &str| {
            match first.get(&(kind, name.to_owned())) {
                Some(there) => {
                    errs.push(
                        file,
                        "name",
                        format!("{kind} `{name}` is defined twice: also in {there}"),
                    );
                    true
                }
                None => {
                    let here = if prefix.is_empty() {
                        file.display().to_string()
                    } else {
                        format!("{} ({})", file.display(), prefix.trim_end_matches(": "))
                    };
                    first.insert((kind, name.to_owned()), here);
                    false
                }
            }
        };
        for (file, prefix, d) in entities {
            errs.in_document(&prefix);
            let name = d.name.clone();
            let compiled = compile_entity(&mut errs, &file, d);
            if compiled.is_none() {
                broken.entities.insert(name);
            }
            if let Some(e) = compiled
                && !twice(&mut errs, "entity", &e.name, &file, &prefix)
            {
                reg.entities.insert(e.name.clone(), e);
            }
        }
        for (file, prefix, d) in views {
            errs.in_document(&prefix);
            let name = d.name.clone();
            let compiled = compile_view(&mut errs, &file, d, &reg.entities, &broken);
            if compiled.is_none() {
                broken.views.insert(name);
            }
            if let Some(v) = compiled {
                if twice(&mut errs, "view", &v.name, &file, &prefix) {
                    // Which definition is meant is unknown: models naming it are checked against
                    // neither, rather than against the first with errors that may not apply.
                    reg.views.remove(&v.name);
                    broken.views.insert(v.name.clone());
                } else {
                    reg.views.insert(v.name.clone(), Arc::new(v));
                }
            }
        }
        for (file, prefix, d) in models {
            errs.in_document(&prefix);
            if let Some(m) = compile_model(&mut errs, &file, d, &reg.views, &broken, models_dir)
                && !twice(&mut errs, "model", &m.name, &file, &prefix)
            {
                reg.models.insert(m.name.clone(), Arc::new(m));
            }
        }
        errs.in_document("");
        errs.finish(reg)
    }
}

#[derive(Default)]
struct Errs(Vec<SchemaError>, String);

/// Entities and views that were declared but did not compile (their own errors are reported).
#[derive(Default)]
struct Broken {
    entities: HashSet<String>,
    views: HashSet<String>,
    /// Files with a document whose kind or name could not be read (not YAML, no `kind`): whatever is
    /// missing may be declared there.
    unread: Vec<PathBuf>,
}

impl Broken {
    fn unread(&mut self, file: &Path) {
        if !self.unread.iter().any(|f| f == file) {
            self.unread.push(file.to_owned());
        }
    }

    /// For "X is not registered" while some file could not be read: where X may be.
    fn unread_hint(&self) -> String {
        if self.unread.is_empty() {
            return String::new();
        }
        let files: Vec<String> = self
            .unread
            .iter()
            .map(|f| f.display().to_string())
            .collect();
        format!(
            "; it may be declared in {}, which could not be read (see above)",
            files.join(", ")
        )
    }
}

impl Errs {
    fn push(&mut self, file: &Path, path: &str, message: String) {
        // In a file of several documents, which one (`document 2: ...`); empty for the first.
        let doc = &self.1;
        let path = match (doc.is_empty(), path.is_empty()) {
            (true, _) => path.to_owned(),
            (false, true) => doc.trim_end_matches(": ").to_owned(),
            (false, false) => format!("{doc}{path}"),
        };
        self.0.push(SchemaError {
            file: file.to_owned(),
            path,
            message,
        });
    }

    /// Errors pushed from here on are in the document `prefix` names (`document 2: `, or empty).
    fn in_document(&mut self, prefix: &str) {
        self.1.clear();
        self.1.push_str(prefix);
    }

    fn finish<T>(self, ok: T) -> Result<T, SchemaErrors> {
        if self.0.is_empty() {
            Ok(ok)
        } else {
            Err(SchemaErrors(self.0))
        }
    }
}

fn parse_doc<T: serde::de::DeserializeOwned>(
    errs: &mut Errs,
    file: &Path,
    body: serde_yaml::Value,
) -> Option<T> {
    match serde_path_to_error::deserialize::<_, T>(&body) {
        Ok(d) => Some(d),
        Err(e) => {
            // A map key that is no string (`1: x`, `~: x`, `[a, b]: x`) has no name: the field is its
            // map, and the message says it is about a key.
            let path = crate::decode::path_text(e.path(), &[]);
            let about_key = e
                .path()
                .iter()
                .any(|s| matches!(s, serde_path_to_error::Segment::Unknown));
            let message = e.inner().to_string();
            // A field left out is the field to fix: its name goes in the path, as for any other field.
            let missing = message
                .strip_prefix("missing field `")
                .and_then(|m| m.split('`').next());
            let path = match (path.as_str(), missing) {
                ("." | "", Some(field)) => field.to_owned(),
                (path, Some(field)) => format!("{path}.{field}"),
                (".", None) => String::new(),
                (path, None) => path.to_owned(),
            };
            let mut message = crate::decode::plain_types(&message);
            if about_key {
                match key_not_text(&body, e.path()) {
                    Some(key) => message.push_str(&format!(
                        " (as a map key: the key `{key}` is not a name; keys are names, written as text)"
                    )),
                    None => message.push_str(" (as a map key: keys are names, written as text)"),
                }
            }
            errs.push(file, &path, message);
            None
        }
    }
}

/// The first key of the map at `path` in `body` that is not text, as YAML writes it (`[a, b]`, `1`, `~`):
/// the key a "map key" error is about, which the error's path cannot name.
fn key_not_text(body: &serde_yaml::Value, path: &serde_path_to_error::Path) -> Option<String> {
    use serde_path_to_error::Segment;
    let mut at = body;
    for segment in path.iter() {
        at = match segment {
            Segment::Seq { index } => at.as_sequence()?.get(*index)?,
            Segment::Map { key } => at.as_mapping()?.get(key.as_str())?,
            Segment::Enum { .. } => at,
            Segment::Unknown => break,
        };
    }
    let key = at.as_mapping()?.keys().find(|k| !k.is_string())?;
    // A key can be a whole list: the message quotes its start.
    Some(crate::error::clipped(&flow(key), 80).into_owned())
}

/// `v` in YAML's flow style, on one line (`[a, b]`, `{a: 1}`, `~`), for a message.
fn flow(v: &serde_yaml::Value) -> String {
    use serde_yaml::Value as Y;
    match v {
        Y::Null => "~".to_owned(),
        Y::Bool(b) => b.to_string(),
        Y::Number(n) => n.to_string(),
        Y::String(s) => s.clone(),
        Y::Sequence(items) => format!(
            "[{}]",
            items.iter().map(flow).collect::<Vec<_>>().join(", ")
        ),
        Y::Mapping(m) => format!(
            "{{{}}}",
            m.iter()
                .map(|(k, v)| format!("{}: {}", flow(k), flow(v)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        Y::Tagged(t) => format!("{} {}", t.tag, flow(&t.value)),
    }
}

/// Names are lowercase identifiers so keys (`{prefix}:{view}:{key}`) and bindings (`view:feature`) stay
/// unambiguous.
pub fn is_valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

fn check_name(errs: &mut Errs, file: &Path, path: &str, name: &str) -> bool {
    let ok = is_valid_name(name);
    if !ok {
        errs.push(
            file,
            path,
            format!("`{name}` is not a valid name: expected lowercase letters, digits and `_`, starting with a letter, at most 64 characters"),
        );
    }
    ok
}

fn compile_entity(errs: &mut Errs, file: &Path, d: EntityDoc) -> Option<Entity> {
    let mut name_ok = check_name(errs, file, "name", &d.name);
    // A view's rows carry its entity's key beside `event_timestamp`: a key of that name would be read
    // as the row's event time too.
    if d.name == EVENT_TIMESTAMP {
        errs.push(
            file,
            "name",
            format!(
                "`{EVENT_TIMESTAMP}` is reserved: a view's rows carry it beside the entity key"
            ),
        );
        name_ok = false;
    }
    let dtype = match d.dtype.as_str() {
        "string" => Some(Dtype::String),
        "int64" => Some(Dtype::Int64),
        other => {
            errs.push(
                file,
                "dtype",
                format!("entity keys are `string` or `int64`, not `{other}`"),
            );
            None
        }
    };
    Some(Entity {
        name: d.name,
        dtype: dtype?,
        description: d.description,
    })
    .filter(|_| name_ok)
}

/// The features that compile. `failed` gets the names of those that did not, so that inputs naming
/// them are not reported a second time as undeclared.
fn compile_features(
    errs: &mut Errs,
    file: &Path,
    base: &str,
    docs: Vec<FeatureDoc>,
    failed: &mut HashSet<String>,
) -> Vec<Feature> {
    let mut out = Vec::with_capacity(docs.len());
    let mut seen = HashSet::new();
    for (i, f) in docs.into_iter().enumerate() {
        let at = format!("{base}[{i}]");
        let mut ok = check_name(errs, file, &format!("{at}.name"), &f.name);
        if !ok {
            failed.insert(f.name.clone());
        }
        if !seen.insert(f.name.clone()) {
            errs.push(
                file,
                &format!("{at}.name"),
                format!(
                    "{} `{}` appears twice",
                    if base == CONTEXT {
                        "context field"
                    } else {
                        "feature"
                    },
                    f.name
                ),
            );
            ok = false;
        }
        let dtype = match Dtype::parse(&f.dtype) {
            Ok(t) => t,
            Err(e) => {
                errs.push(file, &format!("{at}.dtype"), e);
                failed.insert(f.name);
                continue;
            }
        };
        let default = match &f.default {
            None => dtype.zero(),
            Some(v) => match Value::from_yaml(v).and_then(|v| dtype.coerce(v)) {
                Ok(Value::Null) => {
                    errs.push(file, &format!("{at}.default"), format!("expected a {dtype} value, got null (leave `default` out for the zero value)"));
                    failed.insert(f.name);
                    continue;
                }
                Ok(v) => v,
                Err(e) => {
                    // YAML reads a number too large for a float (`1e400`) as text: say so, not
                    // "got a string".
                    let message = match v {
                        serde_yaml::Value::String(t)
                            if dtype != Dtype::String
                                && t.trim().parse::<f64>().is_ok_and(f64::is_infinite) =>
                        {
                            format!(
                                "`{t}` is beyond the range of a 64-bit float, and so of dtype {dtype}"
                            )
                        }
                        _ => format!("does not match dtype {dtype}: {e}"),
                    };
                    errs.push(file, &format!("{at}.default"), message);
                    failed.insert(f.name);
                    continue;
                }
            },
        };
        let _ = &f.description;
        if ok {
            out.push(Feature {
                name: f.name,
                dtype,
                default,
            });
        }
    }
    out
}

fn compile_view(
    errs: &mut Errs,
    file: &Path,
    d: ViewDoc,
    entities: &HashMap<String, Entity>,
    broken: &Broken,
) -> Option<View> {
    let before = errs.0.len();
    check_name(errs, file, "name", &d.name);
    if d.name == CONTEXT {
        errs.push(
            file,
            "name",
            "`context` is reserved for request-time features".into(),
        );
    }
    if d.name == HOT_VIEW {
        errs.push(
            file,
            "name",
            "`hot` is reserved: the store keeps each view's hot keys under it".into(),
        );
    }
    if d.version == 0 {
        errs.push(file, "version", "versions start at 1".into());
    }
    let entity = entities.get(&d.entity).cloned();
    // An entity that did not compile has its own error; "unknown entity" would send the reader to the
    // wrong file. The view still does not compile (it has no entity).
    if entity.is_none() && !broken.entities.contains(&d.entity) {
        let known = known_names(entities.keys().map(String::as_str));
        errs.push(
            file,
            "entity",
            format!(
                "unknown entity `{}` (declared entities: {}){}",
                d.entity,
                known,
                broken.unread_hint()
            ),
        );
    }
    if d.features.is_empty() {
        errs.push(file, "features", "a view needs at least one feature".into());
    }
    // A row's fields are the entity key, `event_timestamp` and the features, all in one namespace: a
    // feature of either name would be read as the other.
    for (i, f) in d.features.iter().enumerate() {
        if f.name == EVENT_TIMESTAMP || f.name == d.entity {
            errs.push(
                file,
                &format!("features[{i}].name"),
                format!(
                    "`{}` is reserved: rows carry the entity key `{}` and `{EVENT_TIMESTAMP}` beside the features",
                    f.name, d.entity
                ),
            );
        }
    }
    // A view with a feature that does not compile is not registered at all: models naming it get no
    // follow-on errors through `Broken::views`.
    let features = compile_features(errs, file, "features", d.features, &mut HashSet::new());
    let ttl = d.cache.ttl.unwrap_or(Duration::from_secs(300));
    let store_timeout = d.store.timeout.unwrap_or(Duration::from_millis(50));
    let (zero, ms1) = (Duration::ZERO, Duration::from_millis(1));
    // (path, value, min, max, the range as a schema writes it)
    for (path, value, min, max, range) in [
        // Floors of 1ms: a duration under it is a unit typo (`50us` for `50ms`) that would make every
        // lookup a miss, every record too old, or every store read time out.
        (
            "cache.ttl",
            Some(ttl),
            ms1,
            MAX_CACHE_DURATION,
            "between 1ms and 365d",
        ),
        // Every hit would be stale and start a store read: `0s` or `50us` is a typo for a real interval.
        (
            "cache.refresh_after",
            d.cache.refresh_after,
            ms1,
            MAX_CACHE_DURATION,
            "between 1ms and 365d, and shorter than cache.ttl (leave it out for no refresh-ahead)",
        ),
        (
            "cache.negative_ttl",
            d.cache.negative_ttl,
            zero,
            MAX_CACHE_DURATION,
            "at most 365d",
        ),
        (
            "cache.max_staleness",
            d.cache.max_staleness,
            zero,
            MAX_CACHE_DURATION,
            "at most 365d",
        ),
        (
            "max_age",
            d.max_age,
            ms1,
            MAX_RETENTION,
            "between 1ms and 36525d (100 years)",
        ),
        (
            "store.key_ttl",
            d.store.key_ttl,
            Duration::from_secs(1),
            MAX_RETENTION,
            "between 1s and 36525d (100 years; leave `key_ttl` out for keys that never expire)",
        ),
        (
            "store.timeout",
            Some(store_timeout),
            ms1,
            MAX_CONFIG_DURATION,
            "between 1ms and 1d",
        ),
    ] {
        if let Some(v) = value
            && !(min..=max).contains(&v)
        {
            let v = crate::config::duration::quoted(v);
            errs.push(file, path, format!("{v} is out of range: must be {range}"));
        }
    }
    // Against a ttl that is itself out of range this would only repeat that error.
    if let Some(r) = d.cache.refresh_after
        && r >= ttl
        && (ms1..=MAX_CACHE_DURATION).contains(&ttl)
    {
        errs.push(
            file,
            "cache.refresh_after",
            format!(
                "must be shorter than cache.ttl ({})",
                crate::config::duration::format(ttl)
            ),
        );
    }
    let policy = Policy {
        ttl,
        refresh_after: d.cache.refresh_after,
        negative_ttl: d.cache.negative_ttl.unwrap_or(Duration::from_secs(30)),
        max_staleness: d.cache.max_staleness.unwrap_or(Duration::from_secs(3600)),
        max_age: d.max_age,
        key_ttl: d.store.key_ttl,
        store_timeout,
    };
    if errs.0.len() != before {
        return None;
    }
    Some(View {
        name: d.name,
        version: d.version,
        entity: entity?,
        description: d.description,
        layout: crate::value::layout(features.iter().map(|f| (f.name.as_str(), f.dtype))),
        features,
        policy,
        file: file.to_owned(),
    })
}

/// The type flowing through a transform chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flow {
    Str,
    Num(usize),
}

fn parse_transform(v: &serde_yaml::Value) -> Result<Option<Transform>, String> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Standardize {
        mean: f64,
        std: f64,
    }
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Clip {
        min: f64,
        max: f64,
    }
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct OneHot {
        vocabulary: Vec<String>,
    }
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Bucketize {
        boundaries: Vec<f64>,
    }
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct HashBucket {
        buckets: u64,
    }
    const KNOWN: &str = "identity, standardize{mean,std}, log1p, clip{min,max}, one_hot{vocabulary}, bucketize{boundaries}, hash_bucket{buckets}, fill_missing{value}";
    fn params<T: serde::de::DeserializeOwned>(
        name: &str,
        v: &serde_yaml::Value,
    ) -> Result<T, String> {
        serde_yaml::from_value(v.clone()).map_err(|e| format!("{name}: {e}"))
    }
    let (name, p) = match v {
        serde_yaml::Value::String(s) => (s.as_str(), None),
        serde_yaml::Value::Mapping(m) if m.len() == 1 => {
            let (k, p) = m.iter().next().ok_or("empty transform")?;
            (
                k.as_str().ok_or("a transform name must be a string")?,
                Some(p),
            )
        }
        _ => {
            return Err(format!(
                "expected a transform name or a one-key map: {KNOWN}"
            ));
        }
    };
    let need = |p: Option<&serde_yaml::Value>| {
        p.cloned()
            .ok_or_else(|| format!("`{name}` needs parameters"))
    };
    // `{log1p: {base: 2}}` must not pass as a plain log1p: parameters a transform ignores are a mistake.
    let none = |p: Option<&serde_yaml::Value>| match p {
        None | Some(serde_yaml::Value::Null) => Ok(()),
        Some(serde_yaml::Value::Mapping(m)) if m.is_empty() => Ok(()),
        Some(_) => Err(format!("`{name}` takes no parameters (write `{name}`)")),
    };
    Ok(Some(match name {
        "identity" => {
            none(p)?;
            Transform::Identity
        }
        "log1p" => {
            none(p)?;
            Transform::Log1p
        }
        "standardize" => {
            let s: Standardize = params(name, &need(p)?)?;
            if !(s.std.is_finite() && s.std > 0.0 && s.mean.is_finite()) {
                return Err("standardize: std must be a positive number and mean finite".into());
            }
            Transform::Standardize {
                mean: s.mean,
                std: s.std,
            }
        }
        "clip" => {
            let c: Clip = params(name, &need(p)?)?;
            if c.min.is_nan() || c.max.is_nan() {
                return Err("clip: min and max must be numbers, not NaN".into());
            }
            if c.min > c.max {
                return Err(format!(
                    "clip: min ({}) must not exceed max ({})",
                    c.min, c.max
                ));
            }
            Transform::Clip {
                min: c.min,
                max: c.max,
            }
        }
        "one_hot" => {
            let o: OneHot = params(name, &need(p)?)?;
            if o.vocabulary.is_empty() {
                return Err("one_hot: the vocabulary is empty".into());
            }
            let mut seen = HashSet::new();
            for w in &o.vocabulary {
                if !seen.insert(w) {
                    return Err(format!("one_hot: `{w}` appears twice in the vocabulary"));
                }
            }
            Transform::OneHot {
                vocabulary: o
                    .vocabulary
                    .into_iter()
                    .map(String::into_boxed_str)
                    .collect(),
            }
        }
        "bucketize" => {
            let b: Bucketize = params(name, &need(p)?)?;
            if b.boundaries.is_empty()
                || b.boundaries.iter().any(|x| !x.is_finite())
                || b.boundaries
                    .windows(2)
                    .any(|w| w[0].partial_cmp(&w[1]) != Some(std::cmp::Ordering::Less))
            {
                return Err(
                    "bucketize: boundaries must be non-empty, finite and strictly increasing"
                        .into(),
                );
            }
            Transform::Bucketize {
                boundaries: b.boundaries,
            }
        }
        "hash_bucket" => {
            let h: HashBucket = params(name, &need(p)?)?;
            if h.buckets == 0 || h.buckets > 1 << 24 {
                return Err("hash_bucket: buckets must be between 1 and 16777216".into());
            }
            Transform::HashBucket { buckets: h.buckets }
        }
        "fill_missing" => return Ok(None), // handled by the caller, which knows the dtype
        other => {
            return Err(format!(
                "unknown transform `{other}`: expected one of {KNOWN}"
            ));
        }
    }))
}

/// A compiled chain: the fill value, the steps, and the output width.
type Chain = (Option<Value>, Vec<Transform>, usize);

/// Parses a slot's `transform` (one transform or a list) into its fill value and steps, checking each step
/// against the type flowing into it. Returns the output width.
fn compile_chain(
    spec: Option<&serde_yaml::Value>,
    dtype: Dtype,
) -> Result<Chain, (String, String)> {
    let items: Vec<&serde_yaml::Value> = match spec {
        None => Vec::new(),
        Some(serde_yaml::Value::Sequence(s)) => s.iter().collect(),
        Some(v) => vec![v],
    };
    let single = !matches!(spec, Some(serde_yaml::Value::Sequence(_)));
    let at = |i: usize| {
        if single {
            String::new()
        } else {
            format!("[{i}]")
        }
    };
    let mut flow = match dtype {
        Dtype::String => Flow::Str,
        other => Flow::Num(other.width()),
    };
    let mut fill = None;
    let mut steps = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let t = parse_transform(item).map_err(|e| (at(i), e))?;
        let Some(t) = t else {
            // fill_missing{value}
            if i != 0 {
                return Err((at(i), "fill_missing must come first in the chain".into()));
            }
            let v = match item.get("fill_missing") {
                Some(serde_yaml::Value::Mapping(m)) if m.len() == 1 => m.get("value"),
                _ => None,
            }
            .ok_or_else(|| {
                (
                    at(i),
                    "fill_missing takes one parameter, `value`: {fill_missing: {value: ...}}"
                        .to_owned(),
                )
            })?;
            let v = Value::from_yaml(v)
                .and_then(|v| dtype.coerce(v))
                .map_err(|e| {
                    (
                        at(i),
                        format!("fill_missing: value does not match dtype {dtype}: {e}"),
                    )
                })?;
            if v.is_null() {
                return Err((at(i), "fill_missing: value must not be null".into()));
            }
            fill = Some(v);
            continue;
        };
        flow = match (&t, flow) {
            (Transform::Identity, f) => f,
            (Transform::OneHot { vocabulary }, Flow::Str) => Flow::Num(vocabulary.len()),
            (Transform::HashBucket { .. }, Flow::Str) => Flow::Num(1),
            (
                Transform::Standardize { .. } | Transform::Log1p | Transform::Clip { .. },
                Flow::Num(n),
            ) => Flow::Num(n),
            (Transform::Bucketize { .. }, Flow::Num(1)) => Flow::Num(1),
            (Transform::Bucketize { .. }, Flow::Num(n)) => {
                return Err((
                    at(i),
                    format!("bucketize takes one number, but this value has {n}"),
                ));
            }
            (Transform::OneHot { .. } | Transform::HashBucket { .. }, Flow::Num(_)) => {
                let why = if i == 0 {
                    format!("the feature is {dtype}")
                } else {
                    format!("transform[{}] has made it numbers", i - 1)
                };
                return Err((
                    at(i),
                    format!("one_hot and hash_bucket take strings, but {why}"),
                ));
            }
            (_, Flow::Str) => {
                return Err((at(i), "this transform takes numbers, but the value is a string: use one_hot or hash_bucket first".into()));
            }
        };
        steps.push(t);
    }
    match flow {
        Flow::Num(n) => Ok((fill, steps, n)),
        Flow::Str => Err((
            String::new(),
            "a string feature must be turned into numbers: end its transform with one_hot{vocabulary} or hash_bucket{buckets}".into(),
        )),
    }
}

fn compile_model(
    errs: &mut Errs,
    file: &Path,
    d: ModelDoc,
    views: &HashMap<String, Arc<View>>,
    broken: &Broken,
    models_dir: &Path,
) -> Option<Model> {
    let before = errs.0.len();
    check_name(errs, file, "name", &d.name);
    if d.version == 0 {
        errs.push(file, "version", "versions start at 1".into());
    }
    if d.outputs.is_empty() {
        errs.push(
            file,
            "outputs",
            "name at least one model output to return".into(),
        );
    }
    // The answer is a JSON object keyed by output name: a name twice would be a duplicate key.
    let mut seen = HashSet::new();
    for (i, o) in d.outputs.iter().enumerate() {
        if !seen.insert(o) {
            errs.push(
                file,
                &format!("outputs[{i}]"),
                format!("output `{o}` is named twice"),
            );
        }
    }
    if d.inputs.is_empty() {
        errs.push(
            file,
            "inputs",
            "the binding needs at least one input".into(),
        );
    }
    if d.file.as_os_str().is_empty() {
        errs.push(
            file,
            "file",
            "is empty: expected the ONNX file's name, read from the models folder (e.g. `ctr.onnx`)"
                .into(),
        );
    }
    if d.input.as_ref().is_some_and(|i| i.trim().is_empty()) {
        errs.push(
            file,
            "input",
            "is empty: name the ONNX input the binding fills, or leave `input` out when the model has one"
                .into(),
        );
    }
    if let Some(Err(e)) = d.sessions.map(|n| in_range(n, 1, MAX_SESSIONS)) {
        errs.push(file, "sessions", e);
    }
    if let Err(e) = in_range(d.batching.max_batch_rows, 1, MAX_BATCH_ROWS) {
        errs.push(file, "batching.max_batch_rows", e);
    }
    if d.batching.max_delay_us > 1_000_000 {
        errs.push(
            file,
            "batching.max_delay_us",
            "must be at most 1000000 (1 s)".into(),
        );
    }
    let mut broken_context = HashSet::new();
    let context = compile_features(errs, file, "context", d.context, &mut broken_context);
    // Inputs that name a view which did not compile.
    let mut skipped = 0;
    let mut missing: HashSet<String> = HashSet::new();
    let mut model_views: Vec<Arc<View>> = Vec::new();
    let mut slots = Vec::with_capacity(d.inputs.len());
    let mut offset = 0;
    for (i, s) in d.inputs.into_iter().enumerate() {
        let at = format!("inputs[{i}]");
        let Some((src, feat)) = s.feature.split_once(':') else {
            errs.push(
                file,
                &format!("{at}.feature"),
                format!("`{}`: expected `view:feature` or `context:name`", s.feature),
            );
            continue;
        };
        let (source, dtype, default) = if src == CONTEXT {
            match context.iter().position(|f| f.name == feat) {
                Some(index) => (
                    Source::Context { index },
                    context[index].dtype,
                    context[index].default.clone(),
                ),
                // Its own error is reported; the model still does not compile.
                None if broken_context.contains(feat) => continue,
                None => {
                    errs.push(file, &format!("{at}.feature"), format!("model `{}` input {i} names context field `{feat}`, which the model's `context` does not declare", d.name));
                    continue;
                }
            }
        } else {
            let Some(view) = views.get(src) else {
                if broken.views.contains(src) {
                    // The view's own errors are reported; "not registered" would mislead. The model
                    // still does not compile.
                    skipped += 1;
                    continue;
                }
                // Once per missing view: while a file could not be read, the view is most likely in
                // it, and one line per input naming it would bury that file's own error.
                if !broken.unread.is_empty() && !missing.insert(src.to_owned()) {
                    skipped += 1;
                    continue;
                }
                let known = known_names(views.keys().map(String::as_str));
                let more = if broken.unread.is_empty() {
                    String::new()
                } else {
                    " (and later inputs from it)".to_owned()
                };
                errs.push(file, &format!("{at}.feature"), format!("model `{}` input {i}{more} names view `{src}`, which is not registered (views: {}){}", d.name, known, broken.unread_hint()));
                continue;
            };
            let Some(feature) = view.feature_index(feat) else {
                errs.push(
                    file,
                    &format!("{at}.feature"),
                    format!(
                        "model `{}` input {i} names feature `{}`, which view `{src}` does not have",
                        d.name, s.feature
                    ),
                );
                continue;
            };
            let vi = match model_views.iter().position(|v| v.name == view.name) {
                Some(vi) => vi,
                None => {
                    model_views.push(view.clone());
                    model_views.len() - 1
                }
            };
            let f = &view.features[feature];
            (
                Source::View { view: vi, feature },
                f.dtype,
                f.default.clone(),
            )
        };
        match compile_chain(s.transform.as_ref(), dtype) {
            Ok((fill, steps, width)) => {
                let slot = Slot {
                    label: s.feature,
                    source,
                    dtype,
                    fill,
                    default,
                    steps,
                    offset,
                    width,
                };
                if crate::assemble::fallback_overflows(&slot) {
                    let whose = match slot.fill {
                        Some(_) => "the `fill_missing` value".to_owned(),
                        None => format!("the `default` of `{}`", slot.label),
                    };
                    errs.push(file, &format!("{at}.transform"), format!("{whose} is beyond float32 after these transforms: the model would be given infinity for every missing value"));
                    continue;
                }
                slots.push(slot);
                offset += width;
            }
            Err((sub, msg)) => errs.push(file, &format!("{at}.transform{sub}"), msg),
        }
    }
    // Two views of one entity would be fine; two entities of one name cannot happen (names are unique).
    if errs.0.len() != before || skipped > 0 {
        return None;
    }
    let path = if d.file.is_absolute() {
        d.file
    } else {
        models_dir.join(d.file)
    };
    Some(Model {
        name: d.name,
        version: d.version,
        description: d.description,
        path,
        input: d.input,
        outputs: d.outputs,
        device: d.device,
        sessions: d.sessions,
        batching: Batching {
            max_batch_rows: d.batching.max_batch_rows,
            max_delay_us: d.batching.max_delay_us,
        },
        context,
        views: model_views,
        slots,
        width: offset,
        file: file.to_owned(),
    })
}

/// serde_yaml's message, except that an integer beyond 64 bits, which it reports as "invalid type:
/// integer `N` as u128, expected any YAML value", is said to be out of range.
/// A YAML error as a problem, `(path, message)`: the path serde_yaml writes in front of its message
/// (`context[0].default: ...`) becomes the problem's path, as every other problem has one, and a key
/// written twice is named in it (`kind`, `features[1].name`).
fn yaml_problem(e: &serde_yaml::Error) -> (String, String) {
    let message = yaml_message(e);
    let (mut path, what) = match message.split_once(": ") {
        Some((p, what))
            if !p.is_empty() && !p.contains(char::is_whitespace) && !p.contains('?') =>
        {
            (p.to_owned(), what.to_owned())
        }
        _ => (String::new(), message),
    };
    let twice = what
        .strip_prefix("duplicate entry with key \"")
        .and_then(|rest| rest.split_once('"'))
        .map(|(key, _)| key)
        .filter(|key| !key.contains('\\'));
    if let Some(key) = twice {
        if !path.is_empty() {
            path.push('.');
        }
        path.push_str(key);
    }
    (path, what)
}

fn yaml_message(e: &serde_yaml::Error) -> String {
    let message = e.to_string();
    let parts = message
        .split_once("invalid type: integer `")
        .and_then(|(head, rest)| Some((head, rest.split_once("` as ")?)))
        .and_then(|(head, (number, rest))| {
            Some((
                head,
                number,
                rest.split_once(", expected any YAML value")?.1,
            ))
        });
    match parts {
        Some((head, number, tail)) => {
            format!("{head}{number} is out of range: numbers here must fit in 64 bits{tail}")
        }
        None => message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ENTITIES: &str =
        "kind: entity\nname: user_id\ndtype: string\n---\nkind: entity\nname: item_id\n";
    const VIEW: &str = r#"
kind: view
name: user_profile
version: 1
entity: user_id
max_age: 30d
cache: {ttl: 5m, refresh_after: 1m, negative_ttl: 30s, max_staleness: 1h}
features:
  - {name: age, dtype: int64, default: 30}
  - {name: country, dtype: string, default: unknown}
  - {name: emb, dtype: "float32[2]"}
"#;

    fn model(inputs: &str) -> String {
        format!(
            "kind: model\nname: m\nversion: 1\nfile: m.onnx\noutputs: [score]\ncontext:\n  - {{name: device, dtype: string, default: web}}\ninputs:\n{inputs}"
        )
    }

    fn compile(extra: &str) -> Result<Registry, SchemaErrors> {
        Registry::compile(
            &[
                (PathBuf::from("entities.yaml"), ENTITIES.into()),
                (PathBuf::from("user.yaml"), VIEW.into()),
                (PathBuf::from("m.yaml"), extra.into()),
            ],
            Path::new("models"),
        )
    }

    #[test]
    fn a_valid_binding_compiles_with_offsets_and_widths() {
        let reg = compile(&model(
            "  - {feature: user_profile:age, transform: {standardize: {mean: 40, std: 12}}}\n  - {feature: user_profile:country, transform: {one_hot: {vocabulary: [us, de]}}}\n  - {feature: user_profile:emb}\n  - {feature: context:device, transform: [{fill_missing: {value: ios}}, {hash_bucket: {buckets: 8}}]}\n",
        ))
        .expect("valid");
        let m = &reg.models["m"];
        assert_eq!(m.width, 1 + 2 + 2 + 1);
        let offsets: Vec<_> = m.slots.iter().map(|s| (s.offset, s.width)).collect();
        assert_eq!(offsets, vec![(0, 1), (1, 2), (3, 2), (5, 1)]);
        assert_eq!(m.slots[3].fill, Some(Value::Str("ios".into())));
        assert_eq!(m.path, PathBuf::from("models/m.onnx"));
        let v = &reg.views["user_profile"];
        assert_eq!(v.policy.refresh_after, Some(Duration::from_secs(60)));
        assert_eq!(v.policy.max_age, Some(Duration::from_secs(30 * 86400)));
    }

    #[test]
    fn a_context_field_given_twice_is_called_a_context_field() {
        let m = model("  - {feature: user_profile:age}\n").replace(
            "default: web}\n",
            "default: web}\n  - {name: device, dtype: string}\n",
        );
        let e = compile(&m).expect_err("twice");
        assert_eq!(e.0[0].path, "context[1].name", "{e}");
        assert_eq!(
            e.0[0].message, "context field `device` appears twice",
            "{e}"
        );
    }

    #[test]
    fn a_typo_in_a_feature_name_is_reported_with_file_and_path() {
        let e = compile(&model(
            "  - {feature: user_profile:age}\n  - {feature: user_profile:agee}\n",
        ))
        .expect_err("typo");
        assert_eq!(e.0.len(), 1, "{e}");
        assert_eq!(e.0[0].file, PathBuf::from("m.yaml"));
        assert_eq!(e.0[0].path, "inputs[1].feature");
        assert!(e.0[0].message.contains("user_profile:agee"), "{e}");
    }

    #[test]
    fn a_map_key_that_is_not_text_is_reported_at_its_map() {
        let view = VIEW.replace("default: 30}", "default: 30, ? [a, b] : c}");
        assert_ne!(view, VIEW);
        let e = compile_view(view).expect_err("a list as a key");
        assert_eq!(e.0[0].path, "features[0]", "{e}");
        assert!(
            e.0[0].message.contains("the key `[a, b]` is not a name"),
            "{e}"
        );
        // At the top of a document too, where the path is empty: the key itself is quoted.
        let e = compile_view(format!("{VIEW}7: x\n")).expect_err("a number as a key");
        assert_eq!(e.0[0].path, "", "{e}");
        assert!(e.0[0].message.contains("the key `7` is not a name"), "{e}");
    }

    #[test]
    fn type_mismatches_are_reported() {
        // A string feature without a string-to-number transform.
        let e = compile(&model("  - {feature: user_profile:country}\n")).expect_err("string");
        assert!(e.to_string().contains("one_hot"), "{e}");
        // A numeric transform on a string.
        let e = compile(&model(
            "  - {feature: user_profile:country, transform: log1p}\n",
        ))
        .expect_err("log1p on string");
        assert_eq!(e.0[0].path, "inputs[0].transform");
        // one_hot on a number.
        let e = compile(&model(
            "  - {feature: user_profile:age, transform: {one_hot: {vocabulary: [a]}}}\n",
        ))
        .expect_err("one_hot on int");
        assert!(e.to_string().contains("take strings"), "{e}");
        // A default that does not match the dtype.
        let bad_view = VIEW.replace("default: 30", "default: thirty");
        let e = compile_view(bad_view).expect_err("bad default");
        assert_eq!(e.0[0].path, "features[0].default");
        // A number too large for any float, which YAML reads as text.
        let huge = VIEW.replace("default: 30", "default: 1e400");
        let e = compile_view(huge).expect_err("huge default");
        assert_eq!(e.0[0].path, "features[0].default");
        assert!(
            e.0[0].message.contains("`1e400` is beyond the range"),
            "{e}"
        );
        // fill_missing of the wrong type, in a chain.
        let e = compile(&model(
            "  - {feature: user_profile:age, transform: [{fill_missing: {value: x}}, log1p]}\n",
        ))
        .expect_err("fill");
        assert_eq!(e.0[0].path, "inputs[0].transform[0]");
        // A fallback the model's float32 input cannot hold once transformed: every missing value would
        // reach the model as infinity.
        let e = compile(&model(
            "  - {feature: user_profile:age, transform: [{fill_missing: {value: 5}}, {standardize: {mean: 0, std: 1.0e-300}}]}\n",
        ))
        .expect_err("fill beyond float32");
        assert_eq!(e.0[0].path, "inputs[0].transform");
        assert!(
            e.0[0]
                .message
                .contains("`fill_missing` value is beyond float32"),
            "{e}"
        );
        let e = compile(&model(
            "  - {feature: user_profile:age, transform: {standardize: {mean: 0, std: 1.0e-300}}}\n",
        ))
        .expect_err("default beyond float32 once standardized");
        assert!(
            e.0[0]
                .message
                .contains("`default` of `user_profile:age` is beyond float32"),
            "{e}"
        );
        // The same transform is fine while the default stays in range: only sent values can overflow.
        compile(&model(
            "  - {feature: user_profile:age, transform: {standardize: {mean: 30, std: 1.0e-300}}}\n",
        ))
        .expect("a default that standardizes to 0");
        // A boundary that is not a number would bucket nothing the way the schema says.
        for bounds in ["[.nan]", "[1, .inf]"] {
            let e = compile(&model(&format!(
                "  - {{feature: user_profile:age, transform: {{bucketize: {{boundaries: {bounds}}}}}}}\n"
            )))
            .expect_err(bounds);
            assert!(e.to_string().contains("finite"), "{bounds}: {e}");
        }
        // Two one_hot in a chain: the second meets numbers, and says so.
        let e = compile(&model(
            "  - {feature: user_profile:country, transform: [{one_hot: {vocabulary: [us]}}, {one_hot: {vocabulary: [us]}}]}\n",
        ))
        .expect_err("one_hot twice");
        assert!(
            e.to_string().contains("transform[0] has made it numbers"),
            "{e}"
        );
    }

    #[test]
    fn unknown_keys_transforms_and_kinds_are_rejected() {
        let e = Registry::compile(
            &[(
                PathBuf::from("e.yaml"),
                "kind: entity\nname: u\ndtyp: string\n".into(),
            )],
            Path::new("."),
        )
        .expect_err("unknown key");
        assert!(e.to_string().contains("dtyp"), "{e}");
        let e = compile(&model(
            "  - {feature: user_profile:age, transform: standardise}\n",
        ))
        .expect_err("unknown transform");
        assert!(
            e.to_string().contains("unknown transform `standardise`"),
            "{e}"
        );
        let e = Registry::compile(
            &[(PathBuf::from("x.yaml"), "kind: widget\n".into())],
            Path::new("."),
        )
        .expect_err("kind");
        assert!(e.to_string().contains("unknown kind"), "{e}");
        let e = Registry::compile(
            &[(PathBuf::from("x.yaml"), "kind: [\n".into())],
            Path::new("."),
        )
        .expect_err("syntax");
        assert!(e.to_string().contains("not valid YAML"), "{e}");
        let e = Registry::compile(
            &[(
                PathBuf::from("v.yaml"),
                "kind: view\nname: v\nentity: u\nfeatures:\n  - {name: a, dtype: int64, default: 99999999999999999999}\n".into(),
            )],
            Path::new("."),
        )
        .expect_err("overflow");
        // The path serde_yaml puts in its message is the problem's path, as for any other problem.
        assert_eq!(e.0[0].path, "features[0].default", "{e}");
        assert_eq!(
            e.0[0].message,
            "not valid YAML: 99999999999999999999 is out of range: numbers here must fit in 64 bits at line 5 column 38"
        );
        // A key written twice is named, at the top and below it, in the document it is in.
        for (yaml, path) in [
            ("kind: entity\nkind: entity\nname: x\n", "kind"),
            (
                "kind: entity\nname: u\n---\nkind: view\nname: v\nentity: u\nfeatures:\n  - {name: a, name: b}\n",
                "document 2: features[0].name",
            ),
        ] {
            let e = Registry::compile(&[(PathBuf::from("d.yaml"), yaml.into())], Path::new("."))
                .expect_err("a key twice");
            assert_eq!(e.0[0].path, path, "{e}");
            assert!(
                e.0[0]
                    .message
                    .starts_with("not valid YAML: duplicate entry with key"),
                "{e}"
            );
        }
    }

    #[test]
    fn a_file_whose_aliases_multiply_is_refused_before_it_is_read() {
        let mut yaml = String::from("kind: entity\nname: u\ndtype: string\nx: &a\n");
        yaml.extend(std::iter::repeat_n("  - 1\n", 4_000));
        yaml.push_str("y:\n");
        yaml.extend(std::iter::repeat_n("  - *a\n", 4_000));
        let e = Registry::compile(&[(PathBuf::from("d.yaml"), yaml)], Path::new("."))
            .expect_err("16 million values");
        assert_eq!(e.0.len(), 1, "{e}");
        assert_eq!(e.0[0].path, "", "{e}");
        assert!(
            e.0[0]
                .message
                .starts_with("not valid YAML: its aliases (`*name`) expand it past"),
            "{e}"
        );
    }

    #[test]
    fn policies_are_checked() {
        let v = VIEW.replace("refresh_after: 1m", "refresh_after: 10m");
        let e = compile_view(v).expect_err("refresh_after >= ttl");
        assert_eq!(e.0[0].path, "cache.refresh_after");
        for zero in ["0s", "0ms", "500us"] {
            let v = VIEW.replace("refresh_after: 1m", &format!("refresh_after: {zero}"));
            let e = compile_view(v).expect_err("refresh_after under 1ms");
            assert_eq!(e.0.len(), 1, "{e}");
            assert_eq!(e.0[0].path, "cache.refresh_after");
            assert!(e.to_string().contains("between 1ms and 365d"), "{e}");
        }
        let v = VIEW.replace("refresh_after: 1m", "refresh_after: 1ms");
        assert!(compile_view(v).is_ok());
        let v = VIEW.replace("max_age: 30d", "max_age: a month");
        let e = compile_view(v).expect_err("duration");
        assert!(
            e.to_string().contains("max_age") && e.to_string().contains("not a valid duration"),
            "{e}"
        );
    }

    #[test]
    fn a_number_of_the_wrong_kind_is_named_in_words() {
        let e = compile_view(VIEW.replace("version: 1", "version: -1")).expect_err("version");
        assert_eq!(e.0[0].path, "version", "{e}");
        assert!(
            e.0[0]
                .message
                .ends_with("expected a whole number from 0 to 4294967295"),
            "{e}"
        );
    }

    #[test]
    fn the_first_unknown_key_in_the_file_is_the_one_named() {
        let e = Registry::compile(
            &[(
                PathBuf::from("e.yaml"),
                "kind: entity\nname: x\ndtype: string\nalpha: 1\nbeta: 1\n".into(),
            )],
            Path::new("."),
        )
        .expect_err("unknown keys");
        assert_eq!(e.0[0].path, "alpha", "{e}");
    }

    #[test]
    fn a_missing_field_is_named_in_the_path() {
        let e = compile_view(VIEW.replace("entity: user_id\n", "")).expect_err("no entity");
        assert_eq!(e.0[0].path, "entity", "{e}");
        assert!(e.0[0].message.contains("missing field `entity`"), "{e}");
    }

    #[test]
    fn reserved_view_names_are_refused() {
        for name in [CONTEXT, HOT_VIEW] {
            let v = VIEW.replace("name: user_profile", &format!("name: {name}"));
            let e = compile_view(v).expect_err("reserved");
            assert_eq!(e.0[0].path, "name", "{e}");
            assert!(e.to_string().contains("reserved"), "{e}");
        }
    }

    fn compile_view(view: String) -> Result<Registry, SchemaErrors> {
        Registry::compile(
            &[
                (PathBuf::from("e.yaml"), ENTITIES.into()),
                (PathBuf::from("v.yaml"), view),
            ],
            Path::new("."),
        )
    }

    #[test]
    fn view_durations_are_bounded() {
        for (from, to, path, range) in [
            (
                "cache: {",
                "store: {key_ttl: 0s}\ncache: {",
                "store.key_ttl",
                "between 1s and 36525d",
            ),
            (
                "cache: {",
                "store: {key_ttl: 500ms}\ncache: {",
                "store.key_ttl",
                "between 1s and 36525d",
            ),
            (
                "cache: {",
                "store: {key_ttl: 500000000d}\ncache: {",
                "store.key_ttl",
                "between 1s and 36525d",
            ),
            (
                "cache: {",
                "store: {timeout: 2d}\ncache: {",
                "store.timeout",
                "between 1ms and 1d",
            ),
            (
                "cache: {",
                "store: {timeout: 50us}\ncache: {",
                "store.timeout",
                "between 1ms and 1d",
            ),
            ("ttl: 5m", "ttl: 300us", "cache.ttl", "between 1ms and 365d"),
            // A bare number asks for a unit, rather than saying "expected a string".
            (
                "ttl: 5m",
                "ttl: 300",
                "cache.ttl",
                "`300` is a number without a unit",
            ),
            (
                "max_age: 30d",
                "max_age: 0s",
                "max_age",
                "between 1ms and 36525d",
            ),
            (
                "max_age: 30d",
                "max_age: 500000000d",
                "max_age",
                "over 500 years is out of range: must be between 1ms and 36525d",
            ),
            ("ttl: 5m", "ttl: 500000000d", "cache.ttl", "and 365d"),
            (
                "max_staleness: 1h",
                "max_staleness: 18446744073709551615s",
                "cache.max_staleness",
                "at most 365d",
            ),
            (
                "negative_ttl: 30s",
                "negative_ttl: 400d",
                "cache.negative_ttl",
                "at most 365d",
            ),
        ] {
            let e = compile_view(VIEW.replace(from, to)).expect_err(to);
            assert_eq!(e.0.len(), 1, "{e}");
            assert_eq!(e.0[0].file, PathBuf::from("v.yaml"), "{e}");
            assert_eq!(e.0[0].path, path, "{e}");
            assert!(e.0[0].message.contains(range), "{e}");
        }
        let reg = compile_view(VIEW.replace("cache: {", "store: {key_ttl: 36525d}\ncache: {"))
            .expect("36525d is the bound");
        assert_eq!(
            reg.views["user_profile"].policy.key_ttl,
            Some(MAX_RETENTION)
        );
    }

    #[test]
    fn an_entity_may_not_be_named_event_timestamp() {
        let entities = ENTITIES.replace("name: item_id", "name: event_timestamp\ndtype: int64");
        let view = VIEW.replace("entity: user_id", "entity: event_timestamp");
        let e = Registry::compile(
            &[
                (PathBuf::from("e.yaml"), entities),
                (PathBuf::from("v.yaml"), view),
            ],
            Path::new("models"),
        )
        .expect_err("reserved");
        // The entity's own error, and no follow-on "unknown entity" for the view naming it.
        assert_eq!(e.0.len(), 1, "{e}");
        assert_eq!(e.0[0].file, PathBuf::from("e.yaml"), "{e}");
        assert_eq!(e.0[0].path, "document 2: name", "{e}");
        assert!(e.0[0].message.contains("reserved"), "{e}");
    }

    #[test]
    fn features_may_not_take_the_entity_key_or_event_timestamp() {
        for name in ["event_timestamp", "user_id"] {
            let v = VIEW.replace("{name: country,", &format!("{{name: {name},"));
            let e = compile_view(v).expect_err(name);
            assert_eq!(e.0.len(), 1, "{e}");
            assert_eq!(e.0[0].file, PathBuf::from("v.yaml"), "{e}");
            assert_eq!(e.0[0].path, "features[1].name", "{e}");
            assert!(e.0[0].message.contains("reserved"), "{e}");
        }
    }

    #[test]
    fn a_nan_default_is_called_nan_not_null() {
        let v = VIEW.replace(
            "{name: age, dtype: int64, default: 30}",
            "{name: age, dtype: float64, default: .nan}",
        );
        let e = compile_view(v).expect_err("nan");
        assert!(e.to_string().contains("finite number"), "{e}");
        let e = compile(&model(
            "  - feature: user_profile:age\n    transform: {clip: {min: .nan, max: 1}}\n",
        ))
        .expect_err("nan clip");
        assert!(e.to_string().contains("not NaN"), "{e}");
    }

    #[test]
    fn transforms_without_parameters_refuse_parameters() {
        for t in [
            "{log1p: {base: 2}}",
            "{identity: 5}",
            "[{identity: {x: 1}}]",
        ] {
            let e = compile(&model(&format!(
                "  - {{feature: user_profile:age, transform: {t}}}\n"
            )))
            .expect_err(t);
            assert_eq!(e.0.len(), 1, "{e}");
            assert!(e.0[0].path.starts_with("inputs[0].transform"), "{e}");
            assert!(e.0[0].message.contains("takes no parameters"), "{e}");
        }
        let e = compile(&model(
            "  - {feature: user_profile:age, transform: [{fill_missing: {value: 1, extra: 2}}, log1p]}\n",
        ))
        .expect_err("fill_missing extra");
        assert_eq!(e.0[0].path, "inputs[0].transform[0]", "{e}");
        assert!(e.0[0].message.contains("one parameter"), "{e}");
        compile(&model(
            "  - {feature: user_profile:age, transform: [log1p, {log1p: }, identity, {identity: {}}]}\n",
        ))
        .expect("bare names and empty parameters are fine");
    }

    #[test]
    fn outputs_sessions_and_batch_rows_are_checked() {
        let m = model("  - {feature: user_profile:age}\n");
        let e = compile(&m.replace("outputs: [score]", "outputs: [score, p, score]"))
            .expect_err("duplicate");
        assert_eq!(e.0.len(), 1, "{e}");
        assert_eq!(e.0[0].path, "outputs[2]", "{e}");
        assert!(e.0[0].message.contains("`score` is named twice"), "{e}");
        let e =
            compile(&m.replace("outputs:", "sessions: 1000000\noutputs:")).expect_err("sessions");
        assert_eq!(e.0[0].path, "sessions", "{e}");
        assert!(e.0[0].message.contains("between 1 and 256"), "{e}");
        let e = compile(&m.replace(
            "outputs:",
            "batching: {max_batch_rows: 100000000}\noutputs:",
        ))
        .expect_err("rows");
        assert_eq!(e.0[0].path, "batching.max_batch_rows", "{e}");
        assert!(e.0[0].message.contains("between 1 and 100000"), "{e}");
        compile(&m.replace("outputs:", "sessions: 256\noutputs:")).expect("at the bound");
        let e = compile(&m.replace("file: m.onnx", "file: \"\"")).expect_err("no file");
        assert_eq!(e.0[0].path, "file", "{e}");
        let e = compile(&m.replace("outputs:", "input: \"\"\noutputs:")).expect_err("no input");
        assert_eq!(e.0[0].path, "input", "{e}");
        // A wrong shape names what was expected in the schema's terms, not a Rust type.
        let e =
            compile(&m.replace("inputs:\n", "inputs:\n  - user_profile:age\n")).expect_err("shape");
        assert!(
            e.to_string()
                .contains("an input such as {feature: user_profile:age}"),
            "{e}"
        );
    }

    #[test]
    fn a_broken_view_or_entity_gets_no_follow_on_errors() {
        // A bad dtype drops the view; the model that reads it must not add "not registered".
        let m = model("  - {feature: user_profile:age}\n");
        for view in [
            VIEW.replace("dtype: int64", "dtype: integer"),
            format!("{VIEW}features_x: 1\n"), // does not parse at all
        ] {
            let e = Registry::compile(
                &[
                    (PathBuf::from("e.yaml"), ENTITIES.into()),
                    (PathBuf::from("v.yaml"), view),
                    (PathBuf::from("m.yaml"), m.clone()),
                ],
                Path::new("."),
            )
            .expect_err("bad view");
            assert_eq!(e.0.len(), 1, "{e}");
            assert_eq!(e.0[0].file, PathBuf::from("v.yaml"), "{e}");
        }
        // A context field with a bad dtype or default: its own error, not "does not declare" as well.
        for field in ["dtype: text, default: web", "dtype: string, default: [1]"] {
            let bad = model("  - {feature: context:device}\n")
                .replace("dtype: string, default: web", field);
            let e = compile(&bad).expect_err("bad context field");
            assert_eq!(e.0.len(), 1, "{e}");
            assert!(e.0[0].path.starts_with("context[0]."), "{e}");
        }
        // Undeclared is still undeclared.
        let e = compile(&model("  - {feature: context:weekday}\n")).expect_err("undeclared");
        assert!(e.to_string().contains("does not declare"), "{e}");

        // A bad entity: no "unknown entity" on the views of it.
        let e = Registry::compile(
            &[
                (
                    PathBuf::from("e.yaml"),
                    ENTITIES.replace("dtype: string", "dtype: uuid"),
                ),
                (PathBuf::from("v.yaml"), VIEW.into()),
            ],
            Path::new("."),
        )
        .expect_err("bad entity");
        assert_eq!(e.0.len(), 1, "{e}");
        assert!(e.to_string().contains("uuid"), "{e}");

        // A view file that is not YAML at all names nothing: the model's inputs from the view it
        // declared get one line, pointing at that file, not one each.
        let m = model("  - {feature: user_profile:age}\n  - {feature: user_profile:age}\n");
        let e = Registry::compile(
            &[
                (PathBuf::from("e.yaml"), ENTITIES.into()),
                (
                    PathBuf::from("v.yaml"),
                    "kind: view\nname: x\n  bad: [\n".into(),
                ),
                (PathBuf::from("m.yaml"), m.clone()),
            ],
            Path::new("."),
        )
        .expect_err("unreadable view");
        assert_eq!(e.0.len(), 2, "{e}");
        assert_eq!(e.0[0].file, PathBuf::from("v.yaml"), "{e}");
        assert!(e.0[1].message.contains("may be declared in v.yaml"), "{e}");
        // With every file read, each input naming a missing view is its own error.
        let e = Registry::compile(
            &[
                (PathBuf::from("e.yaml"), ENTITIES.into()),
                (PathBuf::from("v.yaml"), VIEW.into()),
                (
                    PathBuf::from("m.yaml"),
                    m.replace("user_profile:", "user_profil:"),
                ),
            ],
            Path::new("."),
        )
        .expect_err("a typo");
        assert_eq!(e.0.len(), 2, "{e}");
        assert!(!e.to_string().contains("may be declared"), "{e}");
    }

    #[test]
    fn errors_name_the_document_and_a_second_definition_names_the_first() {
        let m = model("  - {feature: user_profile:age}\n");
        let other = VIEW.replace(
            "- {name: age, dtype: int64, default: 30}",
            "- {name: other, dtype: int64}",
        );
        assert_ne!(other, VIEW, "the test's view lost its `age`");
        let two_entities = "kind: entity\nname: shop_id\ndtype: strin\n---\nkind: entity\nname: shop2_id\ndtype: strin\n";
        let e = Registry::compile(
            &[
                (PathBuf::from("e.yaml"), ENTITIES.into()),
                (
                    PathBuf::from("a.yaml"),
                    format!("{two_entities}---\n{other}"),
                ),
                (PathBuf::from("v.yaml"), VIEW.into()),
                (PathBuf::from("m.yaml"), m),
            ],
            Path::new("."),
        )
        .expect_err("two problems and a duplicate");
        let paths: Vec<(String, &str)> =
            e.0.iter()
                .map(|x| (x.file.display().to_string(), x.path.as_str()))
                .collect();
        assert_eq!(
            paths,
            [
                ("a.yaml".to_owned(), "dtype"),
                ("a.yaml".to_owned(), "document 2: dtype"),
                ("v.yaml".to_owned(), "name"),
            ],
            "{e}"
        );
        // No follow-on error from the model, whose `age` only one of the two definitions has.
        assert!(
            e.0[2]
                .message
                .contains("defined twice: also in a.yaml (document 3)"),
            "{e}"
        );
    }

    #[test]
    fn a_schema_file_with_no_document_is_refused() {
        for empty in ["", "# to do\n", "---\n"] {
            let e = Registry::compile(
                &[
                    (PathBuf::from("e.yaml"), ENTITIES.into()),
                    (PathBuf::from("v.yaml"), VIEW.into()),
                    (PathBuf::from("blank.yaml"), empty.into()),
                ],
                Path::new("."),
            )
            .expect_err("an empty file");
            assert_eq!(e.0.len(), 1, "{empty:?}: {e}");
            assert_eq!(e.0[0].file, PathBuf::from("blank.yaml"));
            assert!(e.0[0].message.contains("holds no schema"), "{e}");
        }
        // A trailing `---` after a document is no empty file.
        Registry::compile(
            &[
                (PathBuf::from("e.yaml"), format!("{ENTITIES}---\n")),
                (PathBuf::from("v.yaml"), VIEW.into()),
            ],
            Path::new("."),
        )
        .expect("a trailing ---");
    }

    #[test]
    fn the_shipped_schemas_compile() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let reg = Registry::load_dir(&root.join("schemas"), &root.join("models"))
            .expect("schemas/ must be valid");
        assert!(reg.models.contains_key("ctr"));
        assert_eq!(reg.models["ctr"].width, 27);
    }
}
