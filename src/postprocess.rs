//! Stage `postprocess`: shapes the model's outputs and the hydration outcome into the response's fields
//! (`outputs`, `feature_status`, `defaulted`, `features`), borrowing rather than copying the numbers.

use serde::ser::{Serialize, SerializeMap, SerializeSeq, Serializer};

use crate::encode::{WriteJson, push_json_array, push_json_f32, push_json_object};
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

impl WriteJson for Outputs<'_> {
    fn write_json(&self, buf: &mut Vec<u8>) {
        let outputs = self.model.outputs.iter().map(String::as_str);
        push_json_object(
            buf,
            outputs.zip(self.values.iter()),
            |buf, (width, data)| {
                // As `Rows`: one number per row when the width is 1, else one list per row.
                push_json_array(buf, data.chunks(width.max(1)), |buf, row| {
                    if width == 1 {
                        row.iter().for_each(|x| push_json_f32(buf, *x));
                    } else {
                        push_json_array(buf, row, |buf, x| push_json_f32(buf, *x));
                    }
                });
            },
        );
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

impl WriteJson for FeatureStatus<'_> {
    fn write_json(&self, buf: &mut Vec<u8>) {
        let views = self.model.views.iter().map(|v| v.name.as_str());
        push_json_object(
            buf,
            views.zip(self.views.iter().zip(self.per_row)),
            |buf, (resolved, per_row)| {
                if *per_row {
                    push_json_array(buf, resolved, |buf, r| r.status.write_json(buf));
                } else {
                    let status = resolved.first().map_or(Status::Defaulted, |r| r.status);
                    status.write_json(buf);
                }
            },
        );
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

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use super::*;
    use crate::schema::Registry;

    fn model(outputs: &str) -> std::sync::Arc<Model> {
        let docs = format!(
            "kind: entity\nname: user_id\n---\nkind: entity\nname: item_id\n---\n\
             kind: view\nname: user_profile\nversion: 1\nentity: user_id\nfeatures:\n  - {{name: age, dtype: int64, default: 30}}\n---\n\
             kind: view\nname: item_stats\nversion: 1\nentity: item_id\nfeatures:\n  - {{name: ctr, dtype: float32, default: 0}}\n---\n\
             kind: model\nname: m\nversion: 1\nfile: m.onnx\noutputs: {outputs}\ninputs:\n  - {{feature: user_profile:age}}\n  - {{feature: item_stats:ctr}}\n"
        );
        let reg = Registry::compile(&[(PathBuf::from("all.yaml"), docs)], Path::new("models"))
            .unwrap_or_else(|e| panic!("{e}"));
        reg.models["m"].clone()
    }

    fn both(v: &impl WriteJson) -> (String, String) {
        let mut buf = Vec::new();
        v.write_json(&mut buf);
        (
            String::from_utf8(buf).unwrap_or_default(),
            serde_json::to_string(v).unwrap_or_default(),
        )
    }

    #[test]
    fn outputs_are_written_as_serde_json_writes_them() {
        let m = model(r#"[score, "emb:0", "q\"uote"]"#);
        let mut rows = OutputRows::default();
        rows.push(1, &[0.5, -1.25e-7, f32::MAX]);
        rows.push(3, &[1.0, 2.0, 3.0, 0.1, 0.2, 0.3, 7.0, 8.0, 9.0]);
        rows.push(0, &[]);
        let (fast, serde) = both(&Outputs {
            model: &m,
            values: &rows,
        });
        assert_eq!(fast, serde);
        assert!(
            fast.starts_with(r#"{"score":[0.5,-1.25e-7,3.4028235e+38],"emb:0":[[1.0,2.0,3.0],"#),
            "{fast}"
        );
    }

    #[test]
    fn feature_statuses_are_written_as_serde_json_writes_them() {
        let m = model("[score]");
        let r = |status| Resolved {
            entry: None,
            status,
        };
        for (views, per_row) in [
            (
                vec![
                    vec![r(Status::Present)],
                    vec![r(Status::Stale), r(Status::NotFound)],
                ],
                vec![false, true],
            ),
            (
                vec![vec![], vec![r(Status::OutsideMaxAge), r(Status::Defaulted)]],
                vec![false, true],
            ),
            (vec![vec![r(Status::Defaulted)], vec![]], vec![true, true]),
        ] {
            let (fast, serde) = both(&FeatureStatus {
                model: &m,
                views: &views,
                per_row: &per_row,
            });
            assert_eq!(fast, serde);
        }
    }
}
