//! `POST /get-online-features`: Feast's feature-server read, so a service that reads features through a
//! Feast client (or Feast's JSON by hand) can point at hydrant instead.
//!
//! The request and the answer follow Feast's Python feature server: entities as columns (`{"user_id":
//! ["u_1", "u_2"]}`, one row per position), features as `view:feature` references or a `feature_service`
//! (here: a model, whose binding names the features it reads), and an answer of columns, the entity
//! columns first, each with a value, a status and an event timestamp per row. Feast has no defaults: a
//! feature without a value is `null` with a status saying why, and only `PRESENT` values are to be used.
//! hydrant's own statuses map onto Feast's: a value served stale because the store failed is `PRESENT`
//! (and the answer carries `x-hydrant-degraded: true`); no value because the store failed or held an
//! unreadable record is `INVALID`.

use std::collections::HashMap;
use std::sync::Arc;

use compact_str::CompactString;
use serde::de::IgnoredAny;
use serde::ser::{SerializeMap, SerializeSeq, SerializeStruct};
use serde::{Deserialize, Serialize, Serializer};

use crate::clock::Rfc3339;
use crate::config::LimitsConfig;
use crate::decode::{
    EntityKey, EntityKeys, Fields, Positional, check_key_count, entity_keys, unknown_view,
    unregistered_entity, view_keys_missing,
};
use crate::encode::BodyWriter;
use crate::error::ApiError;
use crate::hydrate::{Resolved, Status};
use crate::packed::ValueRef;
use crate::schema::{Registry, Source, View};

/// Set to `true` on an answer that has values served stale, or none at all, because the store failed
/// (Feast's statuses have no word for it).
pub const DEGRADED_HEADER: axum::http::HeaderName =
    axum::http::HeaderName::from_static("x-hydrant-degraded");

/// `POST /get-online-features`, as Feast's feature server takes it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OnlineFeaturesRequest {
    /// Join key -> one key per row; every list is a column of the same rows.
    pub entities: Fields<EntityKeys>,
    /// `view:feature` (Feast's feature references), or `view` for all of a view's features.
    #[serde(default)]
    pub features: Option<crate::decode::FeatureRefs>,
    /// A model: the features its binding reads, in binding order.
    #[serde(default)]
    pub feature_service: Option<String>,
    /// Name features `view__feature` rather than `feature`.
    #[serde(default, deserialize_with = "crate::decode::flag_off")]
    pub full_feature_names: bool,
    /// Input to Feast's on-demand feature views, which hydrant does not have: refused unless empty.
    #[serde(default)]
    pub request_context: Option<Fields<IgnoredAny>>,
    /// Name each view read, and its version, in `metadata.feature_view_metadata`, as Feast's remote
    /// client asks on every call (`false` there). Last, as in [`Positional::FIELDS`].
    #[serde(default, deserialize_with = "crate::decode::flag_off")]
    pub include_feature_view_version_metadata: bool,
}

impl Positional for OnlineFeaturesRequest {
    const FIELDS: &'static [(&'static str, &'static [&'static str])] = &[
        ("entities", &[]),
        ("features", &[]),
        ("feature_service", &[]),
        ("full_feature_names", &[]),
        ("request_context", &[]),
        ("include_feature_view_version_metadata", &[]),
    ];
}

/// A resolved `/get-online-features` request.
#[derive(Debug)]
pub struct OnlinePlan {
    /// Entity rows.
    pub rows: usize,
    /// The views to read, each with its entity's key for every row.
    pub views: Vec<(Arc<View>, Vec<CompactString>)>,
    /// The answer's feature columns in order: (index into `views`, feature index, name in the answer).
    pub columns: Vec<(usize, usize, String)>,
}

impl OnlineFeaturesRequest {
    /// Checks the request against the registry and the limits.
    pub fn plan(&self, registry: &Registry, limits: &LimitsConfig) -> Result<OnlinePlan, ApiError> {
        let full_names = self.full_feature_names;
        if let Some(ctx) = &self.request_context
            && !ctx.is_empty()
        {
            return Err(ApiError::invalid(
                "invalid_field",
                "request_context",
                "request_context: hydrant has no on-demand feature views to give it to; leave it out",
            ));
        }
        // The references asked for: (view, feature or all, field to name in errors).
        let mut refs: Vec<(&str, Option<&str>, String)> = Vec::new();
        match (&self.features, &self.feature_service) {
            (Some(_), Some(_)) => {
                return Err(ApiError::invalid(
                    "invalid_field",
                    "feature_service",
                    "feature_service: send either `features` or `feature_service`, not both",
                ));
            }
            (None, None) => {
                return Err(ApiError::invalid(
                    "invalid_field",
                    "features",
                    "features: expected a list of `view:feature` references (or a `feature_service`)",
                ));
            }
            (Some(features), None) => {
                let features = features.checked()?;
                if features.is_empty() {
                    return Err(ApiError::invalid(
                        "invalid_field",
                        "features",
                        "features: expected at least one `view:feature`",
                    ));
                }
                for (i, name) in features.iter().enumerate() {
                    let (view, feature) = match name.split_once(':') {
                        Some((v, f)) => (v, Some(f)),
                        None => (name.as_str(), None),
                    };
                    refs.push((view, feature, format!("features[{i}]")));
                }
            }
            (None, Some(service)) => {
                let Some(model) = registry.models.get(service) else {
                    let known =
                        crate::schema::known_names(registry.models.keys().map(String::as_str));
                    return Err(ApiError::invalid(
                        "unknown_feature_service",
                        "feature_service",
                        format!(
                            "feature_service: no model `{service}` is registered (a feature service here is a model, whose binding names the features it reads; models: {known})"
                        ),
                    ));
                };
                for slot in &model.slots {
                    if let Source::View { view, feature } = slot.source {
                        let v = &model.views[view];
                        refs.push((
                            &v.name,
                            Some(&v.features[feature].name),
                            "feature_service".to_owned(),
                        ));
                    }
                }
            }
        }

        check_key_count(self.entities.iter().map(|(_, k)| k), limits)?;
        let mut rows: Option<(&str, usize)> = None;
        for (name, keys) in self.entities.iter() {
            if !registry.entities.contains_key(name) {
                return Err(unregistered_entity(registry, name));
            }
            match rows {
                None => rows = Some((name, keys.keys.len())),
                Some((first, n)) if n != keys.keys.len() => {
                    return Err(ApiError::invalid(
                        "invalid_field",
                        format!("entities.{name}"),
                        format!(
                            "entities.{name}: {}, but entities.{first} has {n}: each entity is a column of the same rows",
                            match keys.keys.len() {
                                1 => "1 key".to_owned(),
                                k => format!("{k} keys"),
                            }
                        ),
                    ));
                }
                Some(_) => {}
            }
        }
        let rows = match rows {
            None => {
                return Err(ApiError::invalid(
                    "missing_entity",
                    "entities",
                    "entities: expected the join keys of the features' views, each a list of keys",
                ));
            }
            Some((name, 0)) => {
                return Err(ApiError::invalid(
                    "missing_entity",
                    format!("entities.{name}"),
                    format!("entities.{name}: expected at least one key"),
                ));
            }
            Some((_, n)) => n,
        };

        let mut views: Vec<(Arc<View>, Vec<CompactString>)> = Vec::new();
        let mut columns: Vec<(usize, usize, String)> = Vec::new();
        // Per view in `views`, which of its features are columns already (a feature may be named twice,
        // and a view's name alone names all of them); and each column's name, to find one given twice.
        // Both are looked up once per feature a reference names, so a request costs the features its
        // references name (a view's name, all of that view's), not that times the columns so far.
        let mut asked: Vec<Vec<bool>> = Vec::new();
        let mut named: HashMap<String, usize> = HashMap::new();
        for (vname, fname, field) in refs {
            let Some(view) = registry.views.get(vname) else {
                return Err(unknown_view(registry, &field, vname));
            };
            let vi = match views.iter().position(|(v, _)| v.name == vname) {
                Some(vi) => vi,
                None => {
                    let Some(keys) = self.entities.get(&view.entity.name) else {
                        return Err(view_keys_missing(view));
                    };
                    views.push((view.clone(), entity_keys(&view.entity, keys, limits)?));
                    asked.push(vec![false; view.features.len()]);
                    views.len() - 1
                }
            };
            let wanted = match fname {
                None => 0..view.features.len(),
                Some(f) => {
                    let fi = crate::decode::feature_of(view, f, &field)?;
                    fi..fi + 1
                }
            };
            for fi in wanted {
                if asked
                    .get_mut(vi)
                    .and_then(|seen| seen.get_mut(fi))
                    .is_none_or(|seen| std::mem::replace(seen, true))
                {
                    continue;
                }
                let feature = &view.features[fi].name;
                let name = if full_names {
                    format!("{vname}__{feature}")
                } else {
                    feature.clone()
                };
                // Feast refuses the same short name from two views: the answer could not tell them apart.
                if let Some((other, of, _)) = named.get(&name).and_then(|&c| columns.get(c)) {
                    let other = &views[*other].0;
                    let message = if full_names {
                        // `a__b:c` and `a:b__c` are both `a__b__c`: no naming option tells them apart.
                        format!(
                            "{field}: `{vname}:{feature}` and `{}:{}` are both named `{name}` in the answer (`view__feature`): request one of them at a time",
                            other.name, other.features[*of].name
                        )
                    } else {
                        format!(
                            "{field}: views `{}` and `{vname}` both have a feature `{feature}`: set full_feature_names to true to name them `view__feature`",
                            other.name
                        )
                    };
                    return Err(ApiError::invalid("ambiguous_feature", &field, message));
                }
                if self.entities.contains_key(&name) {
                    let message = if full_names {
                        format!(
                            "{field}: `{vname}:{feature}` is named `{name}` in the answer (`view__feature`), the name of a join key this request sends: request it without that key"
                        )
                    } else {
                        format!(
                            "{field}: feature `{feature}` has the name of a join key: set full_feature_names to true to name it `{vname}__{feature}`"
                        )
                    };
                    return Err(ApiError::invalid("ambiguous_feature", &field, message));
                }
                named.insert(name.clone(), columns.len());
                columns.push((vi, fi, name));
            }
        }
        // A join key no requested view is keyed by is answered as Feast answers it, as a column of the
        // keys sent (a caller may send one set of keys with every feature list); its keys are still
        // checked against the entity's type.
        for (name, keys) in self.entities.iter() {
            if !views.iter().any(|(v, _)| v.entity.name == name)
                && let Some(entity) = registry.entities.get(name)
            {
                entity_keys(entity, keys, limits)?;
            }
        }
        Ok(OnlinePlan {
            rows,
            views,
            columns,
        })
    }
}

/// Feast's field statuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum FieldStatus {
    /// No value could be read: the store failed (or held an unreadable record) and nothing was cached.
    Invalid,
    Present,
    NullValue,
    NotFound,
    OutsideMaxAge,
}

/// One cell: the value (or `None` for null), its status and its event time.
fn cell(resolved: &Resolved, feature: usize) -> (Option<ValueRef<'_>>, FieldStatus, i64) {
    match resolved.status {
        Status::Present | Status::Stale => {
            match resolved.found().map(|f| (f.values.get(feature), f)) {
                Some((v, f)) if !v.is_null() => (Some(v), FieldStatus::Present, f.event_ts_ms),
                Some((_, f)) => (None, FieldStatus::NullValue, f.event_ts_ms),
                None => (None, FieldStatus::NotFound, 0),
            }
        }
        Status::NotFound => (None, FieldStatus::NotFound, 0),
        // `found()` is for values to serve; the record is still there, and its time made it too old.
        Status::OutsideMaxAge => {
            let record = resolved.entry.as_ref().and_then(|e| e.found.as_ref());
            (
                None,
                FieldStatus::OutsideMaxAge,
                record.map_or(0, |f| f.event_ts_ms),
            )
        }
        Status::Defaulted => (None, FieldStatus::Invalid, 0),
    }
}

/// The answer: `{"metadata": {"feature_names": [...]}, "results": [{"values", "statuses",
/// "event_timestamps"}, ...]}`, the entity columns first.
pub struct OnlineBody<'a> {
    pub request: &'a OnlineFeaturesRequest,
    pub plan: &'a OnlinePlan,
    /// Per plan view, one resolution per row.
    pub resolved: &'a [Vec<Resolved>],
}

impl OnlineBody<'_> {
    /// Writes the answer's two fields.
    pub fn write(&self, w: &mut BodyWriter) {
        w.field("metadata", &Metadata(self));
        w.field("results", &Results(self));
    }
}

struct Metadata<'a, 'b>(&'a OnlineBody<'b>);

impl Serialize for Metadata<'_, '_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let versions = self.0.request.include_feature_view_version_metadata;
        let mut m = s.serialize_map(Some(1 + usize::from(versions)))?;
        m.serialize_entry("feature_names", &FeatureNames(self.0))?;
        if versions {
            m.serialize_entry("feature_view_metadata", &ViewNames(self.0))?;
        }
        m.end()
    }
}

/// `[{"name": view, "version": N}, ...]`: the views read, in the order first asked.
struct ViewNames<'a, 'b>(&'a OnlineBody<'b>);

impl Serialize for ViewNames<'_, '_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct ViewMetadata<'a> {
            name: &'a str,
            version: u32,
        }
        let views = &self.0.plan.views;
        let mut seq = s.serialize_seq(Some(views.len()))?;
        for (view, _) in views {
            seq.serialize_element(&ViewMetadata {
                name: &view.name,
                version: view.version,
            })?;
        }
        seq.end()
    }
}

struct FeatureNames<'a, 'b>(&'a OnlineBody<'b>);

impl Serialize for FeatureNames<'_, '_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let body = self.0;
        let mut seq =
            s.serialize_seq(Some(body.request.entities.len() + body.plan.columns.len()))?;
        for (name, _) in body.request.entities.iter() {
            seq.serialize_element(name)?;
        }
        for (_, _, name) in &body.plan.columns {
            seq.serialize_element(name)?;
        }
        seq.end()
    }
}

struct Results<'a, 'b>(&'a OnlineBody<'b>);

impl Serialize for Results<'_, '_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let body = self.0;
        let mut seq =
            s.serialize_seq(Some(body.request.entities.len() + body.plan.columns.len()))?;
        for (_, keys) in body.request.entities.iter() {
            seq.serialize_element(&EntityColumn(keys))?;
        }
        for &(vi, fi, _) in &body.plan.columns {
            seq.serialize_element(&FeatureColumn {
                resolved: &body.resolved[vi],
                feature: fi,
            })?;
        }
        seq.end()
    }
}

/// A join key's column: the keys as sent, `PRESENT`, at the epoch (as Feast answers them).
struct EntityColumn<'a>(&'a EntityKeys);

impl Serialize for EntityColumn<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let keys = &self.0.keys;
        let mut st = s.serialize_struct("FeatureVector", 3)?;
        st.serialize_field("values", &EntityValues(keys))?;
        st.serialize_field("statuses", &Repeat(FieldStatus::Present, keys.len()))?;
        st.serialize_field("event_timestamps", &Repeat(Timestamp(0), keys.len()))?;
        st.end()
    }
}

struct EntityValues<'a>(&'a [EntityKey]);

impl Serialize for EntityValues<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.0.len()))?;
        for k in self.0 {
            match k {
                EntityKey::Str(v) => seq.serialize_element(v.as_str())?,
                EntityKey::Int(i) => seq.serialize_element(i)?,
            }
        }
        seq.end()
    }
}

struct Repeat<T>(T, usize);

impl<T: Serialize> Serialize for Repeat<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.1))?;
        for _ in 0..self.1 {
            seq.serialize_element(&self.0)?;
        }
        seq.end()
    }
}

struct FeatureColumn<'a> {
    resolved: &'a [Resolved],
    feature: usize,
}

impl Serialize for FeatureColumn<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut st = s.serialize_struct("FeatureVector", 3)?;
        st.serialize_field("values", &Cells(self, Part::Value))?;
        st.serialize_field("statuses", &Cells(self, Part::Status))?;
        st.serialize_field("event_timestamps", &Cells(self, Part::Timestamp))?;
        st.end()
    }
}

#[derive(Clone, Copy)]
enum Part {
    Value,
    Status,
    Timestamp,
}

struct Cells<'a, 'b>(&'a FeatureColumn<'b>, Part);

impl Serialize for Cells<'_, '_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let col = self.0;
        let mut seq = s.serialize_seq(Some(col.resolved.len()))?;
        for r in col.resolved {
            let (value, status, ts) = cell(r, col.feature);
            match self.1 {
                Part::Value => seq.serialize_element(&value.map(AsFeast))?,
                Part::Status => seq.serialize_element(&status)?,
                Part::Timestamp => seq.serialize_element(&Timestamp(ts))?,
            }
        }
        seq.end()
    }
}

/// A value as Feast's feature server writes it: a float32 (a number or an embedding's) in the digits of
/// the float64 it widens to (`0.03423000127077103`, not `0.03423`), since its answer goes through
/// protobuf's float values and Python's floats. Parsed as float64, each is then the same number from
/// either server.
struct AsFeast<'a>(ValueRef<'a>);

impl Serialize for AsFeast<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.0 {
            ValueRef::List(l) => {
                let mut seq = s.serialize_seq(Some(l.len()))?;
                for x in l.iter() {
                    seq.serialize_element(&f64::from(x))?;
                }
                seq.end()
            }
            // A float32 feature is stored rounded to float32 already: its float64 is the widened one.
            other => other.serialize(s),
        }
    }
}

/// An event time as protobuf's JSON writes a `Timestamp` ([`Rfc3339`]).
#[derive(Clone, Copy)]
struct Timestamp(i64);

impl Serialize for Timestamp {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&Rfc3339(self.0))
    }
}
