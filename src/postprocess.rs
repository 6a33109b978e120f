//! Stage `postprocess`: shapes the model's outputs and the hydration outcome into the response's fields
//! (`outputs`, `feature_status`, `defaulted`, `features`), borrowing rather than copying the numbers.

use serde::ser::{Serialize, SerializeMap, SerializeSeq, Serializer};

use crate::hydrate::{Resolved, Status};
use crate::infer::OutputRows;
use crate::schema::Model;

/// `outputs`: per output name, one number per row (width 1) or one list per row.
pub struct Outputs<'a> {
    pub model: &'a Model,
    /// Per binding output: numbers per row, and all rows' numbers.
    pub values: &'a OutputRows,
}

struct Rows<'a>(usize, &'a [f32]);

impl Serialize for Rows<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let Rows(width, data) = *self;
        if width == 1 {
            data.serialize(s)
        } else {
            Matrix(width, data).serialize(s)
        }
    }
}

/// Row-major numbers as a list of rows of `width`.
struct Matrix<'a>(usize, &'a [f32]);

impl Serialize for Matrix<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let Matrix(width, data) = *self;
        let width = width.max(1);
        let mut seq = s.serialize_seq(Some(data.len() / width))?;
        for row in data.chunks(width) {
            seq.serialize_element(row)?;
        }
        seq.end()
    }
}

impl Serialize for Outputs<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.values.len()))?;
        for (name, (width, data)) in self.model.outputs.iter().zip(self.values.iter()) {
            map.serialize_entry(name, &Rows(width, data))?;
        }
        map.end()
    }
}

/// `feature_status`: per view, the entity's status, or one per candidate.
pub struct FeatureStatus<'a> {
    pub model: &'a Model,
    pub views: &'a [Vec<Resolved>],
    /// Whether each view is keyed per candidate (a list) or shared (one status).
    pub per_row: &'a [bool],
}

struct Statuses<'a>(&'a [Resolved]);

impl Serialize for Statuses<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.0.len()))?;
        for r in self.0 {
            seq.serialize_element(&r.status)?;
        }
        seq.end()
    }
}

impl Serialize for FeatureStatus<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.views.len()))?;
        for ((view, resolved), per_row) in self.model.views.iter().zip(self.views).zip(self.per_row)
        {
            if *per_row {
                map.serialize_entry(&view.name, &Statuses(resolved))?;
            } else {
                let st = resolved.first().map_or(Status::Defaulted, |r| r.status);
                map.serialize_entry(&view.name, &st)?;
            }
        }
        map.end()
    }
}

/// The labels (`view:feature`, `context:name`) of the slots that used a default in any row, each once
/// (a feature may fill two slots).
pub fn defaulted<'m>(model: &'m Model, flags: &[bool]) -> Vec<&'m str> {
    let mut out: Vec<&str> = Vec::new();
    for (s, _) in model.slots.iter().zip(flags).filter(|(_, d)| **d) {
        if !out.contains(&s.label.as_str()) {
            out.push(&s.label);
        }
    }
    out
}

/// `features` (with `return_features`): the assembled input rows.
pub struct InputRows<'a> {
    pub width: usize,
    pub data: &'a [f32],
}

impl Serialize for InputRows<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        Matrix(self.width, self.data).serialize(s)
    }
}
